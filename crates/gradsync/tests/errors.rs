//! Bad input gives clear errors naming ranks, operations and sizes, never a hang.

use gradsync::{Communicator, Config, Error, ReduceOp};
use gradsync_store::StoreServer;
use std::time::{Duration, Instant};

/// Runs `f(rank, comm)` on `world` ranks in threads (the default transport: shared memory)
/// and returns their results.
fn tcp_group<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, &mut Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    group_with(world, timeout, |_| {}, f)
}

/// [`tcp_group`] with `adjust` applied to every rank's configuration.
fn group_with<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    adjust: impl Fn(&mut Config),
    f: impl Fn(usize, &mut Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let f = std::sync::Arc::new(f);
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, world);
            cfg.host_store = false;
            cfg.timeout = timeout;
            adjust(&mut cfg);
            let f = f.clone();
            std::thread::spawn(move || {
                let mut c = Communicator::init(cfg).unwrap();
                f(rank, &mut c)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Asserts that every rank's call failed; returns all their results as one string to search.
fn every_rank_failed<T: std::fmt::Debug>(res: &[Result<T, String>]) -> String {
    let all = format!("{res:?}");
    assert!(
        res.iter().all(|r| r.is_err()),
        "every rank must fail: {all}"
    );
    all
}

#[test]
fn count_mismatch_names_both_ranks_and_signatures() {
    let t0 = Instant::now();
    let res = tcp_group(2, Duration::from_secs(20), |rank, c| {
        let mut buf = vec![1.0f32; if rank == 0 { 100 } else { 200 }];
        c.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "mismatch took {:?} to surface",
        t0.elapsed()
    );
    let errs: Vec<String> = res
        .into_iter()
        .map(|r| r.expect_err("a mismatched call must fail"))
        .collect();
    let mism = errs
        .iter()
        .find(|e| e.contains(" runs ") && e.contains(" sent "))
        .unwrap_or_else(|| panic!("no mismatch error in {errs:?}"));
    assert!(
        mism.contains("all_reduce seq 2 float sum count 100")
            && mism.contains("all_reduce seq 2 float sum count 200"),
        "{mism}"
    );
    assert!(mism.contains("rank 0") && mism.contains("rank 1"), "{mism}");
}

#[test]
fn eager_against_scheduled_all_reduce_is_a_mismatch_not_a_hang() {
    // 100 floats go eagerly (posted on the shared-memory board, or one message to every peer
    // with the board off), 100000 through a schedule: each side sees the other's contribution
    // for the same sequence number and names both calls.
    for board in [true, false] {
        let t0 = Instant::now();
        let res = group_with(
            2,
            Duration::from_secs(20),
            |cfg| cfg.shm_board = board,
            move |rank, c| {
                assert_eq!(c.eager_board(), board);
                let mut buf = vec![1.0f32; if rank == 0 { 100 } else { 100_000 }];
                c.all_reduce(&mut buf, ReduceOp::Sum)
                    .map_err(|e| e.to_string())
            },
        );
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "mismatch took {:?} to surface (board {board})",
            t0.elapsed()
        );
        let all = every_rank_failed(&res);
        // Whichever rank notices first names both calls (the other may only relay its abort).
        let small = "all_reduce seq 2 float sum count 100";
        let names_small = all
            .match_indices(small)
            .any(|(i, _)| !all[i + small.len()..].starts_with(|c: char| c.is_ascii_digit()));
        assert!(
            names_small && all.contains("all_reduce seq 2 float sum count 100000"),
            "board {board}: {all}"
        );
    }
}

#[test]
fn a_forced_algorithm_on_one_rank_only_is_named_in_the_error() {
    // Same call everywhere, but rank 1 forces the ring, so it does not run small all-reduces
    // eagerly: the signatures agree and the error says what differs.
    let res = tcp_group(2, Duration::from_secs(20), |rank, c| {
        if rank == 1 {
            c.set_algorithm(Some(gradsync::Algorithm::Ring)).unwrap();
        }
        let mut buf = vec![1.0f32; 16];
        c.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    let all = every_rank_failed(&res);
    assert!(all.contains("GRADSYNC_ALGO"), "{all}");
}

/// Inits 2 ranks over their own store, rank 1 with `rank1` applied to its config; returns
/// what init gave each.
fn init_two_ranks(rank1: impl Fn(&mut Config)) -> Vec<Result<(), String>> {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, 2);
            cfg.host_store = false;
            cfg.timeout = Duration::from_secs(20);
            if rank == 1 {
                rank1(&mut cfg);
            }
            std::thread::spawn(move || {
                Communicator::init(cfg)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn slot_settings_that_differ_between_ranks_fail_init_naming_them() {
    // The inbox layout and the slots a pair uses come from these settings on each side; a
    // rank that has other values would read the wrong slots, so init refuses.
    let res = init_two_ranks(|cfg| {
        cfg.nslots = 4;
        cfg.tcp_nslots = 2;
    });
    let all = every_rank_failed(&res);
    assert!(
        all.contains("rank 0: GRADSYNC_NSLOTS is 8 on rank 0 but 4 on rank 1, GRADSYNC_TCP_NSLOTS is unset on rank 0 but 2 on rank 1; set them alike on every rank")
            && all.contains("rank 1: GRADSYNC_NSLOTS is 8 on rank 0 but 4 on rank 1"),
        "{all}"
    );
    assert!(!all.contains("GRADSYNC_CHUNK_SIZE"), "{all}");
}

#[test]
fn shared_memory_direct_thresholds_that_differ_fail_init_naming_them() {
    // All-to-all and all-gather senders wait for their receivers' offers from this size, and
    // the all-to-all's message size follows it: ranks with other values would not agree.
    let res = init_two_ranks(|cfg| cfg.shm_move_direct_min = usize::MAX);
    let all = every_rank_failed(&res);
    assert!(
        all.contains("rank 0: GRADSYNC_SHM_DIRECT_MIN is 65536 on rank 0 but off on rank 1; set them alike on every rank")
            && all.contains("rank 1: GRADSYNC_SHM_DIRECT_MIN is 65536 on rank 0 but off on rank 1"),
        "{all}"
    );
}

#[test]
fn shared_memory_direct_threshold_set_on_one_rank_only_fails_init_naming_it() {
    // Set to the default's value, the threshold holds for every block size; unset, only for
    // blocks of at least 8 MiB: the two ranks would not agree on smaller blocks.
    let res = init_two_ranks(|cfg| cfg.shm_move_block_min = 0);
    let all = every_rank_failed(&res);
    assert!(
        all.contains("rank 0: GRADSYNC_SHM_DIRECT_MIN is unset on rank 0 but set on rank 1; set them alike on every rank")
            && all.contains("rank 1: GRADSYNC_SHM_DIRECT_MIN is unset on rank 0 but set on rank 1"),
        "{all}"
    );
}

#[test]
fn receive_budgets_that_differ_between_ranks_fail_init_naming_them() {
    // The budget sets the slots per peer: ranks with other budgets would lay out their inboxes
    // differently, so init refuses and names the budget as well as the slots.
    let res = init_two_ranks(|cfg| cfg.recv_budget = 2 * 3 * cfg.chunk_bytes);
    let all = every_rank_failed(&res);
    assert!(
        all.contains("GRADSYNC_NSLOTS is 8 on rank 0 but 3 on rank 1, GRADSYNC_RECV_BUDGET is 1073741824 on rank 0 but 3145728 on rank 1; set them alike on every rank"),
        "{all}"
    );
}

#[test]
fn collective_mismatch_fails_every_rank() {
    // Rank 2 broadcasts from rank 0 while ranks 0 and 1 all-reduce a buffer too large to go
    // eagerly. With 3 ranks the all-reduce first needs rank 2's data and rank 2 waits for
    // rank 0's: no message crosses between the mismatched sides, so it is the deadline that
    // breaks the wait, and the rank that times out tells the others, which fail at once with
    // its reason.
    let t0 = Instant::now();
    let res = tcp_group(3, Duration::from_secs(2), |rank, c| {
        let mut buf = vec![1i32; 65536];
        if rank == 2 {
            c.broadcast(&mut buf, 0).map_err(|e| e.to_string())
        } else {
            c.all_reduce(&mut buf, ReduceOp::Max)
                .map_err(|e| e.to_string())
        }
    });
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "took {:?}",
        t0.elapsed()
    );
    let all = every_rank_failed(&res);
    assert!(all.contains("timed out after 2s waiting on rank"), "{all}");
    // A small all-reduce goes eagerly to every peer (here through the shared-memory board,
    // which the broadcasting rank looks at while it waits), so the broadcasting rank sees rank
    // 0's or rank 1's contribution and names the mismatch at once.
    let t0 = Instant::now();
    let res = tcp_group(3, Duration::from_secs(20), |rank, c| {
        let mut buf = vec![1i32; 64];
        if rank == 2 {
            c.broadcast(&mut buf, 0).map_err(|e| e.to_string())
        } else {
            c.all_reduce(&mut buf, ReduceOp::Max)
                .map_err(|e| e.to_string())
        }
    });
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    let all = every_rank_failed(&res);
    assert!(
        // Rank 0's or rank 1's eager message, whichever reaches rank 2 first.
        all.contains("rank 2 runs broadcast seq 2 int32 count 64 root 0 but rank ")
            && all.contains(" sent all_reduce seq 2 int32 max count 64"),
        "{all}"
    );
    // Where the sides do exchange messages, the first one carries the mismatch.
    let res = tcp_group(2, Duration::from_secs(20), |rank, c| {
        let mut buf = vec![1i32; 64];
        let mut out = vec![0i32; 128];
        if rank == 1 {
            c.all_gather(&buf, &mut out).map_err(|e| e.to_string())
        } else {
            c.all_reduce(&mut buf, ReduceOp::Max)
                .map_err(|e| e.to_string())
        }
    });
    let all = every_rank_failed(&res);
    assert!(
        all.contains("all_gather seq 2 int32 count 64")
            && all.contains("all_reduce seq 2 int32 max count 64"),
        "{all}"
    );
}

#[test]
fn bad_sizes_are_local_errors() {
    let comms = Communicator::mem_group(2, &Config::new("unused:0", 0, 2)).unwrap();
    let mut c = comms.into_iter().next().unwrap();
    let e = c
        .reduce_scatter(&[0f32; 7], &mut [0f32; 3], ReduceOp::Sum)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                rank: 0,
                op: "reduce_scatter",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("input has 7 elements") && e.to_string().contains("= 6"),
        "{e}"
    );
    let e = c.all_gather(&[0u8; 4], &mut [0u8; 7]).unwrap_err();
    assert!(e.to_string().contains("output has 7 elements"), "{e}");
    let e = c.broadcast(&mut [0i64; 4], 2).unwrap_err();
    assert!(
        e.to_string()
            .contains("root 2 is not a rank of a world of 2"),
        "{e}"
    );
    let e = c
        .all_reduce_into(&[0f64; 4], &mut [0f64; 5], ReduceOp::Sum)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("input has 4 elements but output has 5"),
        "{e}"
    );
    let e = c.send(&[0f32; 1], 0).unwrap_err();
    assert!(e.to_string().contains("peer 0 is not another rank"), "{e}");
}

#[test]
fn absent_peer_times_out_naming_it() {
    let t0 = Instant::now();
    let res = tcp_group(2, Duration::from_millis(1500), |rank, c| {
        if rank == 1 {
            // Stay alive but never join the collective.
            std::thread::sleep(Duration::from_secs(3));
            return Ok(());
        }
        let mut buf = vec![0f64; 1000];
        c.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(e.contains("timed out after 1.5s waiting on rank 1"), "{e}");
    assert!(e.contains("all_reduce seq 2"), "{e}");
    assert!(e.contains("rank 1 did not answer"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(8));
}

#[test]
fn every_rank_names_the_same_silent_rank() {
    // Rank 3 is alive but never calls in (as a stopped process would be); ranks 0-2 wait in a
    // ring where only rank 0 waits on rank 3 directly. All three must name rank 3.
    let t0 = Instant::now();
    let res = tcp_group(4, Duration::from_millis(1500), |rank, c| {
        if rank == 3 {
            std::thread::sleep(Duration::from_secs(4));
            return Ok(());
        }
        let mut buf = vec![1f32; 1 << 18];
        c.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    for (rank, r) in res.iter().enumerate().take(3) {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("rank 3 did not answer"), "rank {rank}: {e}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn dead_peer_fails_the_waiting_rank_fast() {
    let t0 = Instant::now();
    let res = tcp_group(2, Duration::from_secs(60), |rank, c| {
        if rank == 1 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut buf = vec![0f32; 1 << 20];
        c.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(e.contains("rank 1"), "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn unknown_socket_interface_is_an_error_not_a_fallback() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut cfg = Config::new(server.local_addr().to_string(), 0, 1);
    cfg.host_store = false;
    cfg.socket_ifname = Some("nosuchif9".into());
    let e = Communicator::init(cfg).unwrap_err().to_string();
    assert!(
        e.contains("GRADSYNC_SOCKET_IFNAME") && e.contains("nosuchif9") && e.contains("lo"),
        "{e}"
    );
}

#[test]
fn abort_is_bounded_and_fails_the_peers_next_call() {
    let res = tcp_group(3, Duration::from_secs(30), |rank, c| {
        if rank == 0 {
            let t = Instant::now();
            let c = std::mem::replace(
                c,
                Communicator::mem_group(1, &Config::new("unused:0", 0, 1))
                    .unwrap()
                    .pop()
                    .unwrap(),
            );
            c.abort("giving up");
            return Ok(t.elapsed().as_millis().to_string());
        }
        // Not reading while rank 0 aborts, as a stopped process would not.
        std::thread::sleep(Duration::from_millis(1500));
        let t = Instant::now();
        let mut buf = vec![1f32; 100];
        let e = c
            .all_reduce(&mut buf, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        Err((e, t.elapsed()))
    });
    let took: u128 = res[0].as_ref().unwrap().parse().unwrap();
    assert!(took < 1500, "abort took {took} ms");
    for r in &res[1..] {
        let (e, t) = r.as_ref().unwrap_err();
        assert!(
            e.contains("rank 0 aborted the communicator") && e.contains("giving up"),
            "{e}"
        );
        assert!(*t < Duration::from_secs(2), "took {t:?}: {e}");
    }
}
