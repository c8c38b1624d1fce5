//! TCP pairs connect on first use (`GRADSYNC_RUNTIME_CONNECT`, on by default): after init a
//! rank is connected only to the peers init's own operations talked to, an operation connects
//! the peers of its program, results are right on every path, and a peer that never connects
//! is named within the timeout.

use gradsync::{Algorithm, Communicator, Config, ReduceOp, TransportMode};
use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

mod common;

/// Runs `f(comm)` on `world` ranks over TCP (threads of this process), with `tweak` applied
/// to every rank's config.
fn run<R: Send + 'static>(
    world: usize,
    tweak: impl Fn(&mut Config) + Send + Sync + Clone + 'static,
    f: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    common::run_ranks(
        world,
        move |cfg| {
            cfg.transport = TransportMode::Tcp;
            tweak(cfg)
        },
        f,
    )
}

/// Whether `p` is at a power-of-two distance from `rank` either way round a ring of `world`.
fn power_of_two_apart(rank: usize, p: usize, world: usize) -> bool {
    let d = (p + world - rank) % world;
    d.is_power_of_two() || (world - d).is_power_of_two()
}

/// What `snap` says of each of 16 ranks over TCP (ring all-reduces, no eager path, `tweak`
/// applied) after init, after a ring all-reduce, after a send from `pair.0` to `pair.1`, and
/// after an all-to-all, every result checked. Snapshots are taken between phases that every
/// rank has finished (ranks that run ahead would otherwise already talk for the next one).
fn phases<T: Send + 'static>(
    pair: (usize, usize),
    tweak: impl Fn(&mut Config) + Send + Sync + Clone + 'static,
    snap: impl Fn(&Communicator) -> T + Send + Sync + Clone + 'static,
) -> Vec<[T; 4]> {
    let world = 16;
    let phase = Arc::new(Barrier::new(world));
    run(
        world,
        move |c| {
            c.algorithm = Some(Algorithm::Ring);
            c.eager_max = 0;
            tweak(c)
        },
        move |mut c| {
            let rank = c.rank();
            phase.wait();
            let after_init = snap(&c);
            let mut a: Vec<f32> = (0..1000).map(|i| (rank * 1000 + i) as f32).collect();
            c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            for (i, x) in a.iter().enumerate() {
                let want: usize = (0..world).map(|r| r * 1000 + i).sum();
                assert_eq!(*x, want as f32, "rank {rank} element {i}");
            }
            phase.wait();
            let after_ring = snap(&c);
            phase.wait();
            if rank == pair.0 {
                c.send(&[7i32, 8, 9], pair.1).unwrap();
            } else if rank == pair.1 {
                let mut b = [0i32; 3];
                c.recv(&mut b, pair.0).unwrap();
                assert_eq!(b, [7, 8, 9]);
            }
            phase.wait();
            let after_p2p = snap(&c);
            phase.wait();
            let input: Vec<i64> = (0..world).map(|p| (rank * 100 + p) as i64).collect();
            let mut output = vec![0i64; world];
            c.all_to_all(&input, &mut output).unwrap();
            for (p, x) in output.iter().enumerate() {
                assert_eq!(*x, (p * 100 + rank) as i64, "rank {rank} block {p}");
            }
            [after_init, after_ring, after_p2p, snap(&c)]
        },
    )
}

#[test]
fn a_ring_job_connects_its_neighbours_and_first_use_connects_the_rest() {
    let world = 16;
    // Point-to-point between ranks 0 and 5, five apart: never connected before; all-to-all
    // needs every pair.
    let res = phases((0, 5), |_| {}, Communicator::connected_peers);
    for (rank, [init, ring, p2p, all]) in res.into_iter().enumerate() {
        // Init's own operations (the first barrier, the cost model's ring) talk to ranks at
        // power-of-two distances; so does a ring.
        for p in init.iter().chain(&ring) {
            assert!(
                power_of_two_apart(rank, p.to_owned(), world),
                "rank {rank} connected to rank {p}: {ring:?}"
            );
        }
        assert!(
            ring.len() <= 2 * 4,
            "rank {rank}: {} peers after a ring",
            ring.len()
        );
        let left = (rank + world - 1) % world;
        let right = (rank + 1) % world;
        assert!(
            ring.contains(&left) && ring.contains(&right),
            "rank {rank}: {ring:?}"
        );
        let ring_set: BTreeSet<usize> = ring.iter().copied().collect();
        let p2p_set: BTreeSet<usize> = p2p.iter().copied().collect();
        let extra: Vec<usize> = p2p_set.difference(&ring_set).copied().collect();
        match rank {
            0 => assert_eq!(extra, vec![5], "rank 0"),
            5 => assert_eq!(extra, vec![0], "rank 5"),
            _ => assert!(extra.is_empty(), "rank {rank}: {extra:?}"),
        }
        assert_eq!(all.len(), world - 1, "rank {rank} after all-to-all");
    }
}

#[test]
fn a_rank_reads_only_the_records_of_the_ranks_it_talks_to() {
    let world = 16;
    // Ranks 2 and 13, eleven apart: neither has read the other's records before the send.
    let res = phases(
        (2, 13),
        |c| c.token = Some("a-secret".into()),
        Communicator::peer_records,
    );
    for (rank, [init, ring, p2p, all]) in res.into_iter().enumerate() {
        // After init: its own records and those of at most 3 log2 16 + 1 ranks (addresses only
        // of lower ranks), with no request beyond init's own.
        assert!(init.addresses <= 1 + 13.min(rank), "rank {rank}: {init:?}");
        assert!(init.inboxes <= 1 + 13, "rank {rank}: {init:?}");
        assert!(init.inboxes < world, "rank {rank}: {init:?}");
        assert_eq!(init.requests, 0, "rank {rank}: {init:?}");
        // The ring talks only to ranks read at init.
        assert_eq!(ring, init, "rank {rank}");
        if rank == 2 || rank == 13 {
            // One request, through an authenticated connection: rank 2, which sends, reads
            // rank 13's inbox; rank 13, which receives and dials, rank 2's address.
            assert_eq!(p2p.requests, 1, "rank {rank}: {p2p:?}");
            let sender = usize::from(rank == 2);
            assert_eq!(p2p.inboxes, ring.inboxes + sender, "rank {rank}: {p2p:?}");
            let dialed = usize::from(rank == 13);
            assert_eq!(
                p2p.addresses,
                ring.addresses + dialed,
                "rank {rank}: {p2p:?}"
            );
            assert!(p2p.sent > 0 && p2p.received > 0, "{p2p:?}");
        } else {
            assert_eq!(p2p, ring, "rank {rank}");
        }
        // All-to-all talks to every rank: one more request for the records not read yet.
        assert_eq!(all.addresses, rank + 1, "rank {rank}: {all:?}");
        assert_eq!(all.inboxes, world, "rank {rank}: {all:?}");
        assert_eq!(all.requests, p2p.requests + 1, "rank {rank}: {all:?}");
    }
}

#[test]
fn connections_on_first_use_are_authenticated_with_the_token() {
    let world = 6;
    let res = run(
        world,
        |c| {
            c.token = Some("lazy-secret".into());
            c.algorithm = Some(Algorithm::Tree);
        },
        move |mut c| {
            let rank = c.rank();
            let mut a = vec![rank as i64 + 1; 4099];
            c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            assert!(a.iter().all(|&x| x == 21), "rank {rank}");
            let mut b = vec![if rank == 3 { 42u8 } else { 0 }; 70_001];
            c.broadcast(&mut b, 3).unwrap();
            assert!(b.iter().all(|&x| x == 42), "rank {rank}");
            c.connected_peers().len()
        },
    );
    assert!(res.iter().all(|&n| n >= 1));
}

#[test]
fn runtime_connect_off_connects_every_pair_at_init() {
    let world = 5;
    let res = run(
        world,
        |c| c.runtime_connect = false,
        |c| (c.connected_peers().len(), c.peer_records()),
    );
    for (connected, records) in res {
        assert_eq!(connected, world - 1);
        // Every record read at init: the job needs the store no more.
        assert_eq!((records.addresses, records.inboxes), (world, world));
    }
}

#[test]
fn a_peer_that_never_connects_is_named_within_the_timeout() {
    // Ranks 0 and 5 of 8 are not connected after init (five apart); rank 0 waits for a
    // message from rank 5, which never calls: rank 0's wait for rank 5's connection ends
    // within the timeout, naming rank 5.
    let world = 8;
    let done = Arc::new(Barrier::new(world));
    let res = run(
        world,
        |c| c.timeout = Duration::from_secs(3),
        move |mut c| {
            let rank = c.rank();
            let mut out = None;
            if rank == 0 {
                assert!(!c.connected_peers().contains(&5));
                let t0 = Instant::now();
                let mut b = [0f32; 4];
                let e = c.recv(&mut b, 5).unwrap_err();
                out = Some((e.to_string(), t0.elapsed()));
            }
            done.wait();
            out
        },
    );
    let (msg, took) = res[0].clone().unwrap();
    assert!(msg.contains("rank 5"), "{msg}");
    assert!(msg.contains("no connection"), "{msg}");
    assert!(took < Duration::from_secs(10), "{took:?}: {msg}");
}

#[test]
fn init_store_traffic_grows_by_a_few_bytes_per_rank() {
    // A rank other than the first reads the hosts table (a few bytes a host), the agreed slot
    // layout, its host's CPU lists, the addresses and inbox descriptors of the few ranks it
    // talks to first (about 3 log2 n keys) and a few keys of fixed size; it never reads every
    // rank's records, addresses or inboxes. Hosts of 8 ranks (emulated), as in a job of
    // 8-GPU machines.
    let traffic = |world: usize| -> Vec<(u64, u64)> {
        run(
            world,
            |c| c.host_id = Some(format!("node{}", c.rank / 8)),
            |c| c.init_store_traffic().expect("init went through a store"),
        )
    };
    let (small, large) = (traffic(8), traffic(64));
    eprintln!("store traffic (sent, received) per rank, 8 ranks: {small:?}; 64 ranks: {large:?}");
    let received = |v: &[(u64, u64)]| v[1..].iter().map(|t| t.1).max().unwrap();
    let sent = |v: &[(u64, u64)]| v[1..].iter().map(|t| t.0).max().unwrap();
    // 7 more hosts and about 10 more keys (log2 64 against log2 8) come with the 56 more
    // ranks; a table of 10 or 20 bytes a rank would exceed these.
    let per_rank_received = (received(&large) - received(&small)) as f64 / 56.0;
    let per_rank_sent = (sent(&large) - sent(&small)) as f64 / 56.0;
    assert!(
        per_rank_received <= 16.0,
        "received {per_rank_received} bytes more per rank"
    );
    assert!(
        per_rank_sent <= 16.0,
        "sent {per_rank_sent} bytes more per rank"
    );
}

#[test]
fn a_receive_budget_gives_every_peer_fewer_slots_and_results_stay_right() {
    // 4 ranks, slots of 64 KiB, a budget of 2 slots a peer: the default 8 would need 2 MiB.
    let (world, chunk) = (4usize, 64usize << 10);
    let res = run(
        world,
        move |c| {
            c.chunk_bytes = chunk;
            c.recv_budget = world * 2 * chunk + 1000;
            c.eager_max = 0;
        },
        move |mut c| {
            let rank = c.rank();
            let stride = (chunk + 64).div_ceil(64) * 64;
            assert_eq!(c.receive_memory(), world * 2 * stride, "rank {rank}");
            // Enough data for many messages per pair through 2 slots, every algorithm.
            for algo in [Algorithm::Ring, Algorithm::Rabenseifner, Algorithm::Tree] {
                c.set_algorithm(Some(algo)).unwrap();
                let mut a: Vec<f32> = (0..300_000).map(|i| (rank * 7 + i % 1000) as f32).collect();
                c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
                for (i, x) in a.iter().enumerate() {
                    let want: usize = (0..world).map(|r| r * 7 + i % 1000).sum();
                    assert_eq!(*x, want as f32, "rank {rank} {algo:?} element {i}");
                }
            }
            let send: Vec<i32> = (0..world * 50_000)
                .map(|i| (rank * 1_000_000 + i) as i32)
                .collect();
            let mut recv = vec![0i32; send.len()];
            c.all_to_all(&send, &mut recv).unwrap();
            for (i, x) in recv.iter().enumerate() {
                let (from, k) = (i / 50_000, i % 50_000);
                assert_eq!(
                    *x,
                    (from * 1_000_000 + rank * 50_000 + k) as i32,
                    "rank {rank} element {i}"
                );
            }
        },
    );
    assert_eq!(res.len(), world);
}

/// Across emulated hosts with several streams a pair, every write of 64 KiB or more is
/// striped over them (the 512 KiB slots and the direct writes of these all-reduces): the
/// results are the same as on one stream, the default, for every algorithm.
#[test]
fn striped_writes_across_hosts_give_the_same_results_as_one_stream() {
    for nsocks in [0, 3] {
        for algo in [
            Algorithm::Ring,
            Algorithm::Rabenseifner,
            Algorithm::DoubleTree,
        ] {
            let res = run(
                4,
                move |cfg| {
                    cfg.host_id = Some(format!("host-{}", cfg.rank / 2));
                    cfg.nsocks = nsocks;
                    cfg.algorithm = Some(algo);
                },
                move |mut c| {
                    let rank = c.rank();
                    // 3 MiB and 12 bytes: parts that do not divide evenly.
                    let n = (3 << 18) + 3;
                    let mut buf: Vec<f32> = (0..n).map(|i| (i % 89) as f32 + rank as f32).collect();
                    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    buf.iter()
                        .enumerate()
                        .filter(|(i, v)| **v != 4.0 * (*i % 89) as f32 + 6.0)
                        .count()
                },
            );
            assert!(
                res.iter().all(|&wrong| wrong == 0),
                "{algo:?}, GRADSYNC_NSOCKS={nsocks}: wrong elements per rank {res:?}"
            );
        }
    }
}

#[test]
fn tcp_pairs_keep_every_slot_in_flight_across_hosts_and_three_inside_one() {
    // 4 ranks as 2 emulated hosts of 2, every pair over TCP.
    let two_hosts = |cfg: &mut Config| cfg.host_id = Some(format!("host-{}", cfg.rank / 2));
    let windows = |tweak: fn(&mut Config)| {
        run(
            4,
            move |cfg| {
                two_hosts(cfg);
                tweak(cfg)
            },
            |mut c| {
                let rank = c.rank();
                let mut buf: Vec<f32> = (0..(2 << 20))
                    .map(|i| (i % 97) as f32 + rank as f32)
                    .collect();
                c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                for (i, v) in buf.iter().enumerate() {
                    assert_eq!(*v, 4.0 * (i % 97) as f32 + 6.0, "rank {rank} element {i}");
                }
                let w: Vec<usize> = (0..4)
                    .map(|p| if p == rank { 0 } else { c.window(p) })
                    .collect();
                (w, c.inter_slots())
            },
        )
    };
    // Unset: 3 to the peer on this host, all 8 slots to the other host's.
    let got = windows(|_| {});
    assert_eq!(got[0], (vec![0, 3, 8, 8], 8), "{got:?}");
    assert_eq!(got[3], (vec![8, 8, 3, 0], 8), "{got:?}");
    // At most the slots there are.
    let got = windows(|cfg| cfg.nslots = 4);
    assert_eq!(got[1], (vec![3, 0, 4, 4], 4), "{got:?}");
    // Set: the same for every TCP pair.
    let got = windows(|cfg| cfg.tcp_nslots = 5);
    assert_eq!(got[2], (vec![5, 5, 0, 5], 5), "{got:?}");
}

#[test]
fn a_tcp_all_to_all_inside_one_host_keeps_one_window_of_blocks_in_flight() {
    // 4 TCP ranks: on one host, blocks of two slot windows or more go one step at a time.
    let exchange = |tweak: fn(&mut Config)| {
        run(4, tweak, |mut c| {
            let (rank, n) = (c.rank(), 4usize);
            // 2 MiB blocks: one step at a time on one host.
            let block = 512 << 10;
            let input: Vec<i32> = (0..n * block)
                .map(|i| (rank * n * block + i) as i32)
                .collect();
            let mut output = vec![0i32; n * block];
            c.all_to_all(&input, &mut output).unwrap();
            for (i, v) in output.iter().enumerate() {
                let (src, off) = (i / block, i % block);
                let want = (src * n * block + rank * block + off) as i32;
                assert_eq!(*v, want, "rank {rank} element {i}");
            }
            // Uneven counts: rank r sends (r + p + 1) * 300 Ki elements to rank p.
            let send: Vec<usize> = (0..n).map(|p| (rank + p + 1) * (300 << 10)).collect();
            let recv: Vec<usize> = (0..n).map(|p| (p + rank + 1) * (300 << 10)).collect();
            let input: Vec<i32> = (0..send.iter().sum::<usize>())
                .map(|i| (i as i32).wrapping_mul(7) ^ rank as i32)
                .collect();
            let mut output = vec![0i32; recv.iter().sum()];
            c.all_to_allv(&input, &send, &mut output, &recv).unwrap();
            let mut at = 0;
            for (p, &len) in recv.iter().enumerate() {
                // Rank p's block for `rank` starts after its blocks for ranks below `rank`.
                let start: usize = (0..rank).map(|q| (p + q + 1) * (300 << 10)).sum();
                for j in 0..len {
                    let want = ((start + j) as i32).wrapping_mul(7) ^ p as i32;
                    assert_eq!(output[at + j], want, "rank {rank} from {p} element {j}");
                }
                at += len;
            }
            [2 << 20, 1 << 20, 512 << 10, 256 << 10, 64 << 10].map(|b| c.all_to_all_window(b))
        })
    };
    // One host: 3 slots of 512 KiB each way, so 1, 3, 6 and 8 (the most) steps.
    let got = exchange(|_| {});
    assert!(got.iter().all(|w| *w == [1, 3, 6, 8, 8]), "{got:?}");
    // With 6 slots a pair: twice as many.
    let got = exchange(|cfg| cfg.tcp_nslots = 6);
    assert!(got.iter().all(|w| *w == [3, 6, 8, 8, 8]), "{got:?}");
    // Two hosts: the links to the other host run in parallel, every step in flight.
    let got = exchange(|cfg| cfg.host_id = Some(format!("host-{}", cfg.rank / 2)));
    assert!(got.iter().all(|w| *w == [8; 5]), "{got:?}");
}

/// Records are read from the store when an operation first talks to a rank, so the store must
/// serve while communicators live: once it is gone, a send and a receive between two ranks
/// that have not read each other's records both fail, naming the peer and the store, after
/// trying to reach it for 10 s, not for the whole operation timeout.
#[test]
fn a_store_gone_after_init_is_named_by_the_first_operation_that_needs_it() {
    use gradsync_store::StoreServer;
    let world = 16;
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let inited = Arc::new(Barrier::new(world + 1));
    let closed = Arc::new(Barrier::new(world + 1));
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = Config::new(server.local_addr().to_string(), rank, world);
            cfg.host_store = false;
            cfg.transport = TransportMode::Tcp;
            // Longer than the 10 s a read after init tries to reach the store.
            cfg.timeout = Duration::from_secs(40);
            let (inited, closed) = (inited.clone(), closed.clone());
            std::thread::spawn(move || {
                let mut c = Communicator::init(cfg).unwrap();
                inited.wait();
                closed.wait();
                let t0 = Instant::now();
                // Ranks 2 and 13, eleven apart, have not read each other's records.
                let failed = match rank {
                    2 => c.send(&[1u8, 2, 3], 13).err(),
                    13 => c.recv(&mut [0u8; 3], 2).err(),
                    _ => None,
                };
                let took = t0.elapsed();
                (failed.map(|e| e.to_string()), took)
            })
        })
        .collect();
    inited.wait();
    let store = server.local_addr().to_string();
    drop(server);
    closed.wait();
    for (rank, h) in hs.into_iter().enumerate() {
        let (failed, took) = h.join().expect("rank thread panicked");
        let peer = match rank {
            2 => 13,
            13 => 2,
            _ => {
                assert!(failed.is_none(), "rank {rank}: {failed:?}");
                continue;
            }
        };
        let msg = failed.unwrap_or_else(|| panic!("rank {rank}: the operation did not fail"));
        assert!(msg.contains(&format!("rank {peer}")), "rank {rank}: {msg}");
        assert!(msg.contains(&store), "rank {rank}: {msg}");
        assert!(
            took < Duration::from_secs(20),
            "rank {rank}: {took:?}: {msg}"
        );
    }
}
