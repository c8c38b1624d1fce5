//! Receive memory beyond the budget: where `world` inboxes of `GRADSYNC_NSLOTS` slots exceed
//! `GRADSYNC_RECV_BUDGET`, only the peers at a power-of-two distance keep inbox slots and the
//! others share each receiver's pool. Every collective and algorithm stays right over TCP
//! with 16 ranks in 16 MiB each, the messages of pooled pairs go through the pool (or
//! straight into place where direct writes are on), and every pool slot is free again after.

use gradsync::{Algorithm, Communicator, Config, ReduceOp, TransportMode};

mod common;

/// Every collective, over every all-reduce algorithm, with sizes from one element to several
/// slots, each result checked; point-to-point between pooled ranks, empty included.
fn exercise(c: &mut Communicator) {
    let (rank, world) = (c.rank(), c.world_size());
    let sum = |i: usize| -> f32 { (0..world).map(|r| ((r * 7 + i) % 64) as f32).sum() };
    for algo in [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::DoubleTree,
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Central,
    ] {
        c.set_algorithm(Some(algo)).unwrap();
        for n in [1, 1000, 300_000] {
            let mut a: Vec<f32> = (0..n).map(|i| ((rank * 7 + i) % 64) as f32).collect();
            c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            for (i, x) in a.iter().enumerate() {
                assert_eq!(*x, sum(i), "{algo:?} n {n} rank {rank} element {i}");
            }
        }
    }
    c.set_algorithm(None).unwrap();
    let n = 16 * 5000;
    let input: Vec<f32> = (0..n).map(|i| ((rank * 7 + i) % 64) as f32).collect();
    let mut out = vec![0f32; n / world];
    c.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
    for (i, x) in out.iter().enumerate() {
        assert_eq!(
            *x,
            sum(rank * n / world + i),
            "reduce_scatter rank {rank} {i}"
        );
    }
    let mine: Vec<i32> = (0..3000).map(|i| (rank * 10_000 + i) as i32).collect();
    let mut all = vec![0i32; 3000 * world];
    c.all_gather(&mine, &mut all).unwrap();
    for (j, x) in all.iter().enumerate() {
        assert_eq!(
            *x,
            ((j / 3000) * 10_000 + j % 3000) as i32,
            "all_gather {j}"
        );
    }
    let input: Vec<i64> = (0..world * 40_000)
        .map(|j| (rank * 1_000_000 + j) as i64)
        .collect();
    let mut output = vec![0i64; world * 40_000];
    c.all_to_all(&input, &mut output).unwrap();
    for (j, x) in output.iter().enumerate() {
        let (p, k) = (j / 40_000, j % 40_000);
        assert_eq!(
            *x,
            (p * 1_000_000 + rank * 40_000 + k) as i64,
            "all_to_all {j}"
        );
    }
    let mut b: Vec<u8> = (0..200_000)
        .map(|i| if rank == 5 { i as u8 } else { 0 })
        .collect();
    c.broadcast(&mut b, 5).unwrap();
    assert!(
        b.iter().enumerate().all(|(i, &x)| x == i as u8),
        "broadcast"
    );
    let input: Vec<f32> = (0..70_000).map(|i| ((rank * 7 + i) % 64) as f32).collect();
    let mut out = vec![0f32; 70_000];
    c.reduce(&input, &mut out, ReduceOp::Sum, 11).unwrap();
    if rank == 11 {
        assert!(out.iter().enumerate().all(|(i, &x)| x == sum(i)), "reduce");
    }
    // Ranks 0 and 5, 6 and 13: no power of two apart, so pooled.
    for (from, to, n) in [(0, 5, 100_000), (13, 6, 0), (6, 13, 3)] {
        if rank == from {
            let v: Vec<i32> = (0..n as i32).collect();
            c.send(&v, to).unwrap();
        } else if rank == to {
            let mut v = vec![7i32; n];
            c.recv(&mut v, from).unwrap();
            assert!(v.iter().enumerate().all(|(i, &x)| x == i as i32), "recv");
        }
    }
    c.barrier().unwrap();
}

fn run(tweak: impl Fn(&mut Config) + Send + Sync + Clone + 'static) -> Vec<gradsync::ReceivePool> {
    common::run_ranks(
        16,
        move |cfg| {
            cfg.transport = TransportMode::Tcp;
            cfg.recv_budget = 16 << 20;
            tweak(cfg)
        },
        |mut c| {
            let before = c.receive_pool().expect("a pool");
            assert_eq!(before.staged, 0, "rank {}", c.rank());
            exercise(&mut c);
            c.receive_pool().expect("a pool")
        },
    )
}

#[test]
fn pooled_pairs_stage_through_the_pool_and_every_result_is_right() {
    for (rank, p) in run(|_| {}).into_iter().enumerate() {
        // 16 ranks x 8 slots of 512 KiB exceed 16 MiB: 7 peers keep 2 slots each (the ranks
        // 1, 2, 4 and 8 away either way, or in the bits), the other 8 share 8 pool slots.
        assert_eq!((p.slots, p.pooled_peers), (8, 8), "rank {rank}: {p:?}");
        assert_eq!(p.free, p.slots, "rank {rank}: every slot free after: {p:?}");
        assert!(
            p.staged > 0,
            "rank {rank}: nothing went through the pool: {p:?}"
        );
    }
}

#[test]
fn with_direct_writes_copies_from_pooled_peers_land_in_place() {
    let res = run(|c| c.direct_min = 64 << 10);
    for (rank, p) in res.iter().enumerate() {
        assert_eq!(p.free, p.slots, "rank {rank}: {p:?}");
    }
    // Copies from pooled peers land in place; what is reduced (the central all-reduce's
    // root, 16 ranks' sums) and the empty message from rank 13 to rank 6 are staged.
    assert!(res[0].staged > 0 && res[6].staged > 0, "{res:?}");
}

#[test]
fn within_the_budget_there_is_no_pool() {
    let res = common::run_ranks(
        4,
        |cfg| {
            cfg.transport = TransportMode::Tcp;
            cfg.recv_budget = 16 << 20;
        },
        |c| c.receive_pool(),
    );
    assert!(res.iter().all(Option::is_none), "{res:?}");
}
