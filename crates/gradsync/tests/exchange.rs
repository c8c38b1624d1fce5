//! All-to-allv, gather, scatter and groups beyond the conformance suite: exchanges larger than
//! what a peer buffers, in groups and with every transport; and the errors of bad counts.

use gradsync::{Communicator, Config, TransportMode};
use gradsync_store::StoreServer;
use std::time::{Duration, Instant};

/// Runs `f(rank, comm)` on `world` ranks (threads) over `transport`.
fn ranks<R: Send + 'static>(
    world: usize,
    transport: TransportMode,
    timeout: Duration,
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
            cfg.transport = transport;
            let f = f.clone();
            std::thread::spawn(move || {
                let mut c = Communicator::init(cfg).unwrap();
                f(rank, &mut c)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Every rank sends 6 MiB to each of the other ranks and receives as much from each, all
/// sends added to the group before any receive: more than a peer buffers (3.5 MiB on shared
/// memory, 1 MiB over TCP), so the same blocking calls in this order would wait for each other
/// until the deadline. The group orders them and completes.
fn big_group_exchange(world: usize, transport: TransportMode) {
    let n = 6 << 18; // 6 MiB of f32
    let res = ranks(world, transport, Duration::from_secs(60), move |r, c| {
        let mine: Vec<f32> = (0..n).map(|i| (r * n + i) as f32).collect();
        let mut got: Vec<Vec<f32>> = (0..world).map(|_| vec![0.0; n]).collect();
        let mut g = c.group();
        for p in (0..world).filter(|&p| p != r) {
            g = g.send(&mine, p).unwrap();
        }
        for (p, buf) in got.iter_mut().enumerate().filter(|(p, _)| *p != r) {
            g = g.recv(buf, p).unwrap();
        }
        g.wait().map_err(|e| e.to_string())?;
        for (p, buf) in got.iter().enumerate().filter(|(p, _)| *p != r) {
            for (i, x) in buf.iter().enumerate() {
                if *x != (p * n + i) as f32 {
                    return Err(format!("rank {r}: element {i} from {p} is {x}"));
                }
            }
        }
        Ok(())
    });
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn a_group_exchanges_more_than_a_peer_buffers_over_shm() {
    big_group_exchange(3, TransportMode::Shm);
}

#[test]
fn a_group_exchanges_more_than_a_peer_buffers_over_tcp() {
    big_group_exchange(2, TransportMode::Tcp);
}

/// Large uneven all-to-allv and all-to-all (several segments per block, the window of steps
/// smaller than the world), checked element by element.
#[test]
fn large_all_to_allv_on_six_ranks() {
    let world = 6;
    let res = ranks(
        world,
        TransportMode::Shm,
        Duration::from_secs(60),
        move |r, c| {
            let count = |s: usize, d: usize| ((s * 7 + d * 13) % 5) * 100_003;
            let sc: Vec<usize> = (0..world).map(|d| count(r, d)).collect();
            let rc: Vec<usize> = (0..world).map(|s| count(s, r)).collect();
            let val =
                |s: usize, d: usize, j: usize| (s * 1_000_000 + d * 100_000 + j % 99_991) as i64;
            let input: Vec<i64> = (0..world)
                .flat_map(|d| (0..sc[d]).map(move |j| val(r, d, j)))
                .collect();
            let mut out = vec![0i64; rc.iter().sum()];
            c.all_to_allv(&input, &sc, &mut out, &rc).unwrap();
            let want: Vec<i64> = (0..world)
                .flat_map(|s| (0..rc[s]).map(move |j| val(s, r, j)))
                .collect();
            assert!(out == want, "rank {r}: all_to_allv result differs");
            let b = 300_007;
            let input: Vec<i64> = (0..world * b).map(|k| val(r, k / b, k % b)).collect();
            let mut out = vec![0i64; world * b];
            c.all_to_all(&input, &mut out).unwrap();
            assert!(
                out.iter()
                    .enumerate()
                    .all(|(k, &x)| x == val(k / b, r, k % b)),
                "rank {r}: all_to_all result differs"
            );
        },
    );
    assert_eq!(res.len(), world);
}

#[test]
fn all_to_allv_with_counts_that_disagree_fails_naming_the_ranks() {
    let t0 = Instant::now();
    let res = ranks(2, TransportMode::Tcp, Duration::from_secs(10), |r, c| {
        // Rank 0 sends 5 elements to rank 1, which expects 3.
        let (sc, rc) = if r == 0 {
            ([1, 5], [1, 2])
        } else {
            ([2, 4], [5 - 2, 4])
        };
        let input = vec![1.0f32; sc.iter().sum()];
        let mut out = vec![0.0f32; rc.iter().sum()];
        c.all_to_allv(&input, &sc, &mut out, &rc)
            .map_err(|e| e.to_string())
    });
    let all = format!("{res:?}");
    assert!(res[1].is_err(), "rank 1 must fail: {all}");
    assert!(all.contains("rank 0"), "{all}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{all}");
}

#[test]
fn bad_counts_and_sizes_are_local_errors_naming_them() {
    let res = ranks(2, TransportMode::Shm, Duration::from_secs(10), |r, c| {
        let mut errs = Vec::new();
        let mut out = vec![0f32; 4];
        errs.push(
            c.all_to_allv(&[0f32; 4], &[1, 2], &mut out, &[2, 2])
                .unwrap_err()
                .to_string(),
        );
        errs.push(
            c.all_to_allv(&[0f32; 4], &[2, 2, 0], &mut out, &[2, 2])
                .unwrap_err()
                .to_string(),
        );
        errs.push(
            c.all_to_all(&[0f32; 3], &mut [0f32; 3])
                .unwrap_err()
                .to_string(),
        );
        errs.push(
            c.all_gather_in_place(&mut [0f32; 5])
                .unwrap_err()
                .to_string(),
        );
        // A wrong output on the root, and a non-empty wrong one elsewhere: both refused.
        let _ = r;
        let root_out = 3;
        errs.push(
            c.gather(&[0f32; 2], &mut vec![0f32; root_out], 0)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default(),
        );
        errs.push(
            c.scatter(&[0f32; 4], &mut [0f32; 2], 2)
                .unwrap_err()
                .to_string(),
        );
        // Local errors start nothing: the communicator still works.
        let mut out = vec![0f32; 4];
        c.all_to_allv(&[r as f32; 4], &[2, 2], &mut out, &[2, 2])
            .unwrap();
        assert_eq!(out, [0.0, 0.0, 1.0, 1.0]);
        errs
    });
    let e = &res[0];
    assert!(
        e[0].contains("all_to_allv")
            && e[0].contains("send_counts add up to 3")
            && e[0].contains("has 4"),
        "{e:?}"
    );
    assert!(
        e[1].contains("send_counts has 3 entries") && e[1].contains("2 ranks"),
        "{e:?}"
    );
    assert!(
        e[2].contains("all_to_all") && e[2].contains("not a multiple of the world size 2"),
        "{e:?}"
    );
    assert!(
        e[3].contains("all_gather") && e[3].contains("5 elements"),
        "{e:?}"
    );
    assert!(
        e[4].contains("gather") && e[4].contains("must have world 2 x input 2 = 4"),
        "{e:?}"
    );
    assert!(e[5].contains("scatter") && e[5].contains("root 2"), "{e:?}");
    assert!(e.iter().all(|m| m.contains("rank 0")), "{e:?}");
    assert!(res[1][4].contains("rank 1: gather"), "{:?}", res[1]);
}

/// Bruck's all-to-all forced (`GRADSYNC_ALGO=all_to_all:bruck` does the same) on 5 ranks in
/// memory and over shared memory, small and segmented blocks.
#[test]
fn bruck_all_to_all_when_forced() {
    use gradsync::{Algorithm, Collective};
    let run = |c: &mut Communicator| {
        let (r, w) = (c.rank(), c.world_size());
        c.set_collective_algorithm(Collective::AllToAll, Some(Algorithm::Bruck))
            .unwrap();
        assert_eq!(
            c.algorithm_for(Collective::AllToAll, 8),
            Some(Algorithm::Bruck)
        );
        for b in [0usize, 1, 3, 1000, 70_001] {
            let input: Vec<i64> = (0..w * b)
                .map(|k| (r * 1_000_000 + (k / b) * 100_000 + k % b) as i64)
                .collect();
            let mut out = vec![0i64; w * b];
            c.all_to_all(&input, &mut out).unwrap();
            for (k, x) in out.iter().enumerate() {
                let want = ((k / b) * 1_000_000 + r * 100_000 + k % b) as i64;
                assert_eq!(*x, want, "rank {r} block size {b} element {k}");
            }
        }
    };
    let mut cfg = Config::new("unused:0", 0, 1);
    cfg.timeout = Duration::from_secs(60);
    let hs: Vec<_> = Communicator::mem_group(5, &cfg)
        .unwrap()
        .into_iter()
        .map(|mut c| std::thread::spawn(move || run(&mut c)))
        .collect();
    hs.into_iter().for_each(|h| h.join().unwrap());
    ranks(
        5,
        TransportMode::Shm,
        Duration::from_secs(60),
        move |_, c| run(c),
    );
}

/// A bitwise op over a float type is refused when it is added to a group, and the group's
/// other operations still run.
#[test]
fn a_group_refuses_a_bitwise_float_reduction_when_it_is_added() {
    use gradsync::ReduceOp;
    let res = ranks(2, TransportMode::Shm, Duration::from_secs(20), |r, c| {
        let mut f = vec![1.0f32; 4];
        let e = c.group().all_reduce(&mut f, ReduceOp::Bxor).unwrap_err();
        assert!(e.to_string().contains("bxor"), "{e}");
        let mut i = vec![1i32 << r; 4];
        c.group()
            .all_reduce(&mut i, ReduceOp::Bor)
            .unwrap()
            .wait()
            .unwrap();
        i
    });
    assert!(res.iter().all(|i| i == &[3, 3, 3, 3]), "{res:?}");
}
