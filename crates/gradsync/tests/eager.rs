//! Small all-reduces go eagerly (one message from every rank to every other): results are
//! exact and bitwise equal on every rank, peers may run ahead, send/recv in between does not
//! confuse them, and the async form interoperates with the blocking one.

use gradsync::{Communicator, Config, ReduceOp};

fn run<R: Send + 'static>(
    world: usize,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    run_with(world, Config::new("unused:0", 0, world).eager_max, f)
}

fn run_with<R: Send + 'static>(
    world: usize,
    eager_max: usize,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let mut cfg = Config::new("unused:0", 0, world);
    cfg.chunk_bytes = 256;
    cfg.eager_max = eager_max;
    Communicator::mem_group(world, &cfg)
        .unwrap()
        .into_iter()
        .map(|mut c| {
            let f = f.clone();
            std::thread::spawn(move || f(&mut c))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect()
}

#[test]
fn eager_results_are_exact_and_identical_on_every_rank() {
    for world in [2, 3, 5, 8] {
        let res = run(world, |c| {
            let r = c.rank();
            let mut out = Vec::new();
            // Sizes on both sides of the eager limit, so eager and scheduled calls alternate.
            for (k, n) in [1usize, 7, 1016, 1017, 3, 5000, 2].into_iter().enumerate() {
                let mut v: Vec<f32> = (0..n).map(|i| 0.1 * (r + i + k) as f32).collect();
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                out.push(v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                let mut m: Vec<i64> = (0..n).map(|i| (r * 1000 + i) as i64).collect();
                c.all_reduce(&mut m, ReduceOp::Max).unwrap();
                let w = c.world_size();
                assert!(
                    m.iter()
                        .enumerate()
                        .all(|(i, &x)| x == ((w - 1) * 1000 + i) as i64),
                    "max of {n} on world {w}"
                );
                let mut a = vec![(r + 1) as f64; n];
                c.all_reduce(&mut a, ReduceOp::Avg).unwrap();
                assert!(
                    a.iter().all(|&x| x == (w + 1) as f64 / 2.0),
                    "avg on world {w}"
                );
            }
            // The small calls ran eagerly, the large ones through a schedule.
            let algos: Vec<(u64, String)> = c
                .flight_snapshot()
                .ops
                .iter()
                .filter(|o| o.op == "all_reduce")
                .map(|o| (o.bytes, o.algorithm.to_string()))
                .collect();
            assert!(algos.iter().any(|(_, a)| a == "eager"), "{algos:?}");
            for (bytes, a) in &algos {
                assert_eq!(a == "eager", *bytes <= 4032, "{bytes} bytes ran {a}");
            }
            out
        });
        assert!(
            res.windows(2).all(|p| p[0] == p[1]),
            "ranks differ on world {world}"
        );
    }
}

#[test]
fn peers_ahead_and_send_recv_between_eager_calls() {
    // Ranks 0 and 1 exchange many point-to-point messages (their per-peer sequence numbers
    // overtake the collective ones) while rank 2 is already in the next all-reduce; rank 2
    // then runs several all-reduces ahead as far as it can.
    let res = run(3, |c| {
        let r = c.rank();
        let mut sum = 0.0f64;
        for round in 0..20 {
            if r < 2 {
                for k in 0..15 {
                    let mut b = vec![0u8; 8];
                    if (r + k) % 2 == 0 {
                        b.fill(k as u8);
                        c.send(&b, 1 - r).unwrap();
                    } else {
                        c.recv(&mut b, 1 - r).unwrap();
                        assert!(b.iter().all(|&x| x == k as u8));
                    }
                }
            }
            for j in 0..3 {
                let mut v = vec![(r + round + j) as f64; 4];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v[0], (3 * (round + j) + 3) as f64);
                sum += v[0];
            }
        }
        sum
    });
    assert!(res.windows(2).all(|p| p[0] == p[1]));
}

#[test]
fn async_and_blocking_small_all_reduces_interoperate() {
    let res = run(4, |c| {
        let r = c.rank();
        let mut total = 0i32;
        for k in 0..50 {
            let mut v = vec![r as i32 + k; 16];
            if (r + k as usize).is_multiple_of(2) {
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            } else {
                c.all_reduce_async(&mut v, ReduceOp::Sum)
                    .unwrap()
                    .wait()
                    .unwrap();
            }
            assert!(v.iter().all(|&x| x == 6 + 4 * k), "call {k}");
            total += v[0];
        }
        total
    });
    assert!(res.windows(2).all(|p| p[0] == p[1]));
}

#[test]
fn eager_can_be_turned_off_and_forced_algorithms_skip_it() {
    // Same results through the schedules: eager off on every rank, or a forced algorithm.
    for setting in ["off", "ring"] {
        let eager_max = if setting == "off" { 0 } else { 4032 };
        let res = run_with(3, eager_max, move |c| {
            if setting == "ring" {
                c.set_algorithm(Some(gradsync::Algorithm::Ring)).unwrap();
            }
            let mut v = vec![c.rank() as f32 + 0.5; 10];
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            let ops = c.flight_snapshot().ops;
            assert!(ops.iter().all(|o| o.algorithm != "eager"), "{setting}");
            v[0]
        });
        assert!(res.iter().all(|&x| x == 4.5), "{setting}: {res:?}");
    }
}

#[test]
fn algorithms_can_be_forced_per_collective() {
    let world = 3;
    let mut cfg = Config::new("unused:0", 0, world);
    cfg.collective_algorithms = vec![(gradsync::Collective::Broadcast, gradsync::Algorithm::Ring)];
    let comms = Communicator::mem_group(world, &cfg).unwrap();
    let hs: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let mut b = vec![c.rank() as i32; 1000];
                c.broadcast(&mut b, 1).unwrap();
                assert!(b.iter().all(|&x| x == 1));
                c.set_collective_algorithm(
                    gradsync::Collective::Reduce,
                    Some(gradsync::Algorithm::Tree),
                )
                .unwrap();
                let mut r = vec![0i32; 1000];
                c.reduce(&[1i32; 1000], &mut r, ReduceOp::Sum, 0).unwrap();
                if c.rank() == 0 {
                    assert!(r.iter().all(|&x| x == 3));
                }
                assert!(
                    c.set_collective_algorithm(
                        gradsync::Collective::AllGather,
                        Some(gradsync::Algorithm::Tree)
                    )
                    .is_err()
                );
                // The algorithms the engine chooses itself cannot be forced.
                for a in [
                    gradsync::Algorithm::Eager,
                    gradsync::Algorithm::Deterministic,
                ] {
                    let e = c.set_algorithm(Some(a)).unwrap_err().to_string();
                    assert!(
                        e.contains(&format!("rank {}", c.rank()))
                            && e.contains("all_reduce")
                            && e.contains(a.name())
                            && e.contains("cannot be forced"),
                        "{e}"
                    );
                }
                c.flight_snapshot()
                    .ops
                    .iter()
                    .map(|o| (o.op.to_string(), o.algorithm.to_string()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in hs {
        let ops = h.join().unwrap();
        assert!(
            ops.contains(&("broadcast".into(), "ring".into())),
            "{ops:?}"
        );
        assert!(ops.contains(&("reduce".into(), "tree".into())), "{ops:?}");
    }
}

#[test]
fn a_config_cannot_force_an_internal_algorithm() {
    for (all_reduce, per_coll) in [
        (Some(gradsync::Algorithm::Eager), vec![]),
        (
            None,
            vec![(
                gradsync::Collective::AllReduce,
                gradsync::Algorithm::Deterministic,
            )],
        ),
    ] {
        let mut cfg = Config::new("unused:0", 0, 2);
        cfg.algorithm = all_reduce;
        cfg.collective_algorithms = per_coll;
        let e = Communicator::mem_group(2, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("all_reduce") && e.contains("cannot be forced"),
            "{e}"
        );
    }
}
