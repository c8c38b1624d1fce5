//! The integrity option (`GRADSYNC_CHECKSUM=1`, [`Config::checksum`]) against a transport that
//! damages data: communicators over in-memory endpoints wrapped in the fault injector.
//!
//! With checksums on, a corrupted message is reported naming the link and is never reduced in;
//! every rank fails. With checksums off the same corruption goes unnoticed and the result is
//! silently wrong, which is why the option exists.

use gradsync::{Algorithm, Communicator, Config, Error, ReduceOp};
use gradsync_core::wire::DATA_HEADER_LEN;
use gradsync_transport::Endpoint;
use gradsync_transport::fault::{FaultConfig, FaultyEndpoint};
use gradsync_transport::shm::ShmSetup;
use std::time::Duration;

fn config(checksum: bool) -> Config {
    let mut c = Config::new("unused:0", 0, 1);
    c.timeout = Duration::from_secs(20);
    c.checksum = checksum;
    // The ring makes every rank's result depend on every link, so one bad link fails all.
    c.algorithm = Some(Algorithm::Ring);
    c
}

/// Runs `f(rank, comm)` on `world` in-memory ranks whose endpoints inject `faults(rank)`.
fn run<R: Send + 'static>(
    world: usize,
    cfg: &Config,
    faults: impl Fn(usize) -> FaultConfig,
    f: impl Fn(usize, &mut Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_on(gradsync_transport::mem::fabric(world), cfg, faults, f)
}

/// Runs `f(rank, comm)` on ranks over `eps` (one per rank, in order), each wrapped in a fault
/// injector that injects `faults(rank)`.
fn run_on<E: Endpoint + 'static, R: Send + 'static>(
    eps: Vec<E>,
    cfg: &Config,
    faults: impl Fn(usize) -> FaultConfig,
    f: impl Fn(usize, &mut Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let world = eps.len();
    let eps: Vec<Box<dyn Endpoint>> = eps
        .into_iter()
        .enumerate()
        .map(|(r, ep)| Box::new(FaultyEndpoint::new(ep, faults(r))) as Box<dyn Endpoint>)
        .collect();
    let comms = Communicator::from_endpoints(eps, cfg).unwrap();
    let f = std::sync::Arc::new(f);
    // No rank drops its communicator (closing its endpoint) before all have their result: a
    // rank that hears of the failure late must learn it from the abort, not from a closed link.
    let done = std::sync::Arc::new(std::sync::Barrier::new(world));
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut c)| {
            let (f, done) = (f.clone(), done.clone());
            std::thread::spawn(move || {
                let r = f(rank, &mut c);
                done.wait();
                r
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn corrupt_all(seed: u64, only_peer: Option<usize>) -> FaultConfig {
    FaultConfig {
        seed,
        corrupt_writes: 1.0,
        only_peer,
        ..FaultConfig::default()
    }
}

/// Rank r's input: small integers, so every sum is exact.
fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 3) % 101) as f32).collect()
}

fn summed(world: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0..world).map(|r| ((i * 7 + r * 3) % 101) as f32).sum())
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn corrupted_message_is_reported_naming_the_link_and_every_rank_fails() {
    let n = 1 << 16;
    let res = run(
        2,
        &config(true),
        |r| {
            if r == 1 {
                corrupt_all(7, None)
            } else {
                FaultConfig::default()
            }
        },
        move |rank, c| {
            let mut buf = input(rank, n);
            let first = c.all_reduce(&mut buf, ReduceOp::Sum);
            // The communicator is unusable afterwards.
            let next = c.all_reduce(&mut buf, ReduceOp::Sum);
            (first, next)
        },
    );
    let (first, next): (Vec<_>, Vec<_>) = res.into_iter().unzip();
    match &first[0] {
        Err(Error::Corrupt {
            rank: 0,
            peer: 1,
            sig,
            expected,
            got,
            ..
        }) => {
            assert_eq!(sig.seq, 1);
            assert_ne!(expected, got);
        }
        other => panic!("rank 0 should detect the corruption, got {other:?}"),
    }
    for (rank, r) in first.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank fails").to_string();
        assert!(e.contains("rank 1 -> rank 0"), "rank {rank}: {e}");
        assert!(
            e.contains("all_reduce seq 1 float sum count 65536"),
            "rank {rank}: {e}"
        );
        assert!(e.contains("message 0"), "rank {rank}: {e}");
    }
    assert!(
        matches!(first[1], Err(Error::PeerAborted { peer: 0, .. })),
        "{:?}",
        first[1]
    );
    for n in next {
        assert!(matches!(n, Err(Error::Poisoned { .. })), "{n:?}");
    }
}

#[test]
fn corruption_on_one_link_of_four_names_that_link() {
    let n = 10_007;
    let res = run(
        4,
        &config(true),
        |r| {
            if r == 1 {
                corrupt_all(3, Some(2))
            } else {
                FaultConfig::default()
            }
        },
        move |rank, c| {
            let mut buf = input(rank, n);
            c.all_reduce(&mut buf, ReduceOp::Sum)
                .map_err(|e| (matches!(e, Error::Corrupt { .. }), e.to_string()))
        },
    );
    let errs: Vec<_> = res
        .into_iter()
        .map(|r| r.expect_err("every rank fails"))
        .collect();
    assert!(errs[2].0, "rank 2 detects it: {}", errs[2].1);
    for (rank, (_, e)) in errs.iter().enumerate() {
        assert!(e.contains("rank 1 -> rank 2"), "rank {rank}: {e}");
    }
}

#[test]
fn checksums_on_without_faults_give_correct_results() {
    for (world, chunk) in [(2, 512 * 1024), (3, 4096), (4, 64 * 1024)] {
        let mut cfg = config(true);
        cfg.chunk_bytes = chunk;
        cfg.algorithm = None;
        let n = 50_000;
        let res = run(
            world,
            &cfg,
            |_| FaultConfig::default(),
            move |rank, c| -> gradsync::Result<_> {
                let mut ar = input(rank, n);
                c.all_reduce(&mut ar, ReduceOp::Sum)?;
                let rs_in = input(rank, n * world);
                let mut rs = vec![0f32; n];
                c.reduce_scatter(&rs_in, &mut rs, ReduceOp::Sum)?;
                let ag_in = input(rank, n);
                let mut ag = vec![0f32; n * world];
                c.all_gather(&ag_in, &mut ag)?;
                let mut bc = input(rank, n);
                c.broadcast(&mut bc, world - 1)?;
                let mut small = vec![rank as f32 + 1.0; 3];
                c.all_reduce(&mut small, ReduceOp::Max)?;
                Ok((ar, rs, ag, bc, small))
            },
        );
        let total = summed(world, n * world);
        for (rank, r) in res.into_iter().enumerate() {
            let (ar, rs, ag, bc, small) = r.unwrap_or_else(|e| panic!("world {world}: {e}"));
            assert_eq!(
                bits(&ar),
                bits(&summed(world, n)),
                "all_reduce world {world}"
            );
            assert_eq!(
                bits(&rs),
                bits(&total[rank * n..(rank + 1) * n]),
                "reduce_scatter world {world} rank {rank}"
            );
            let expect_ag: Vec<f32> = (0..world).flat_map(|r| input(r, n)).collect();
            assert_eq!(bits(&ag), bits(&expect_ag), "all_gather world {world}");
            assert_eq!(bits(&bc), bits(&input(world - 1, n)), "broadcast");
            assert_eq!(small, vec![world as f32; 3]);
        }
    }
}

#[test]
fn delayed_writes_are_slow_not_wrong() {
    let n = 20_000;
    let res = run(
        3,
        &config(true),
        |r| FaultConfig {
            delay: (r == 0).then_some(Duration::from_millis(2)),
            ..FaultConfig::default()
        },
        move |rank, c| {
            let mut buf = input(rank, n);
            c.all_reduce(&mut buf, ReduceOp::Sum).map(|()| buf)
        },
    );
    for r in res {
        assert_eq!(bits(&r.unwrap()), bits(&summed(3, n)));
    }
}

/// Without checksums the same corruption passes unnoticed: every call "succeeds" and the
/// ranks hold wrong (and mutually different) results. This is what `GRADSYNC_CHECKSUM=1`
/// exists to catch, at the price of a CRC32C per message and of the direct-write path.
#[test]
fn without_checksums_corruption_is_silently_wrong() {
    let n = 1 << 16;
    let res = run(
        2,
        &config(false),
        |r| {
            if r == 1 {
                corrupt_all(7, None)
            } else {
                FaultConfig::default()
            }
        },
        move |rank, c| {
            let mut buf = input(rank, n);
            c.all_reduce(&mut buf, ReduceOp::Sum).map(|()| buf)
        },
    );
    let expect = bits(&summed(2, n));
    let got: Vec<Vec<u32>> = res
        .into_iter()
        .map(|r| bits(&r.expect("no error is reported without checksums")))
        .collect();
    assert_ne!(
        got[0], expect,
        "rank 0 received corrupted data from rank 1 and used it"
    );
    assert_ne!(got[0], got[1], "the ranks do not even agree");
}

/// Over TCP with checksums on (direct writes then off on both sides), results stay exact.
#[test]
fn checksums_over_tcp_give_correct_results() {
    let server = gradsync_store::StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let (world, n) = (3, 100_003);
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, world);
            cfg.host_store = false;
            cfg.timeout = Duration::from_secs(30);
            cfg.checksum = true;
            cfg.chunk_bytes = 64 * 1024;
            std::thread::spawn(move || -> gradsync::Result<_> {
                let mut c = Communicator::init(cfg)?;
                let mut ar = input(rank, n);
                c.all_reduce(&mut ar, ReduceOp::Sum)?;
                let mut ag = vec![0f32; n * world];
                c.all_gather(&input(rank, n), &mut ag)?;
                Ok((ar, ag))
            })
        })
        .collect();
    let expect_ag: Vec<f32> = (0..world).flat_map(|r| input(r, n)).collect();
    for h in hs {
        let (ar, ag) = h.join().unwrap().unwrap();
        assert_eq!(bits(&ar), bits(&summed(world, n)));
        assert_eq!(bits(&ag), bits(&expect_ag));
    }
}

/// Faults that flip one payload byte of what `rank` sends to `to` (past the data header, so the
/// message still parses and only its checksum can tell).
fn damaged_sends(seed: u64, to: usize) -> FaultConfig {
    FaultConfig {
        seed,
        corrupt_sends: 1.0,
        corrupt_skip: DATA_HEADER_LEN,
        only_peer: Some(to),
        ..FaultConfig::default()
    }
}

/// Eager all-reduces: a small buffer, no forced algorithm.
fn eager_config(checksum: bool) -> Config {
    let mut c = config(checksum);
    c.algorithm = None;
    c
}

#[test]
fn a_corrupted_eager_contribution_is_caught_naming_the_link() {
    // Rank 1's eager message to rank 0 (a data header and its whole buffer, one two-sided
    // message) has a payload byte flipped on the way.
    let faults = |r| {
        if r == 1 {
            damaged_sends(11, 0)
        } else {
            FaultConfig::default()
        }
    };
    let res = run(3, &eager_config(true), faults, |rank, c| {
        let mut buf = input(rank, 100);
        let first = c.all_reduce(&mut buf, ReduceOp::Sum).map(|()| bits(&buf));
        let algo = c
            .flight_snapshot()
            .ops
            .last()
            .map(|o| o.algorithm.to_string());
        let next = c.all_reduce(&mut buf, ReduceOp::Sum);
        (first, algo, next)
    });
    assert_eq!(
        res[1].1.as_deref(),
        Some("eager"),
        "small all-reduces run eagerly"
    );
    assert!(
        matches!(
            res[0].0,
            Err(Error::Corrupt {
                rank: 0,
                peer: 1,
                ..
            })
        ),
        "{:?}",
        res[0].0
    );
    let want = bits(&summed(3, 100));
    for (rank, (first, _, next)) in res.iter().enumerate() {
        // The damaged part never reaches a result: rank 0 fails; a rank that had every part
        // before the abort arrived has the right sum. Every rank learns of it by its next call.
        match first {
            Ok(got) => assert_eq!(got, &want, "rank {rank}"),
            Err(e) => assert!(
                e.to_string().contains("rank 1 -> rank 0"),
                "rank {rank}: {e}"
            ),
        }
        let e = next
            .as_ref()
            .expect_err("the communicator is failed")
            .to_string();
        assert!(e.contains("rank 1 -> rank 0"), "rank {rank}: {e}");
    }
    // Without checksums the damage goes into rank 0's result unnoticed.
    let res = run(3, &eager_config(false), faults, |rank, c| {
        let mut buf = input(rank, 100);
        c.all_reduce(&mut buf, ReduceOp::Sum).map(|()| buf)
    });
    let want = bits(&summed(3, 100));
    assert_ne!(
        bits(res[0].as_ref().unwrap()),
        want,
        "rank 0 silently wrong"
    );
    assert_eq!(bits(res[2].as_ref().unwrap()), want, "rank 2 clean");
}

#[test]
fn a_corrupted_board_posting_is_caught_naming_the_link() {
    // Three ranks on this host's shared memory, each endpoint inside the fault injector: the
    // board survives the wrapper, and rank 0 reads rank 2's posting with a payload byte flipped.
    let local = [0, 1, 2];
    let eps = ShmSetup::in_process(3, &local, Duration::from_secs(20)).unwrap();
    let faults = |r| {
        if r == 0 {
            FaultConfig {
                seed: 5,
                corrupt_postings: 1.0,
                corrupt_skip: DATA_HEADER_LEN,
                only_peer: Some(2),
                ..FaultConfig::default()
            }
        } else {
            FaultConfig::default()
        }
    };
    let res = run_on(eps, &eager_config(true), faults, |rank, c| {
        assert!(
            c.eager_board(),
            "rank {rank}: the board is kept inside the wrapper"
        );
        let mut buf = input(rank, 1000);
        let first = c.all_reduce(&mut buf, ReduceOp::Sum).map(|()| bits(&buf));
        (first, c.all_reduce(&mut buf, ReduceOp::Sum))
    });
    assert!(
        matches!(
            res[0].0,
            Err(Error::Corrupt {
                rank: 0,
                peer: 2,
                ..
            })
        ),
        "{:?}",
        res[0].0
    );
    let want = bits(&summed(3, 1000));
    for (rank, (first, next)) in res.iter().enumerate() {
        match first {
            Ok(got) => assert_eq!(got, &want, "rank {rank}"),
            Err(e) => assert!(
                e.to_string().contains("rank 2 -> rank 0"),
                "rank {rank}: {e}"
            ),
        }
        let e = next
            .as_ref()
            .expect_err("the communicator is failed")
            .to_string();
        assert!(e.contains("rank 2 -> rank 0"), "rank {rank}: {e}");
    }
}
