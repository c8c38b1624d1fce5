//! Small all-reduces over the shared-memory board run on the engine's fast path: the same
//! postings and checks as the protocol machine's eager path, without its rounds. These tests
//! check that the fast path is taken, that its results are exact and bitwise equal on every
//! rank (every type and operator, in place and not), that a peer that is late hands the
//! operation to the machine without harm, and that a mismatch is still named.

use gradsync::recorder::OpState;
use gradsync::{Communicator, Config, Element, ReduceOp, TransportMode};
use std::time::Duration;

mod common;

/// Runs `f` on `world` ranks over shared memory (threads of this process, one store).
fn shm<R: Send + 'static>(
    world: usize,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let tweak = |cfg: &mut Config| {
        cfg.transport = TransportMode::Shm;
        cfg.timeout = Duration::from_secs(30);
    };
    common::run_ranks(world, tweak, move |mut c| {
        assert!(c.eager_board(), "rank {}: no board", c.rank());
        f(&mut c)
    })
}

/// Operations of the fast path in a rank's flight record: (count, latest sequence number).
fn fast_ops(c: &Communicator) -> (u64, u64) {
    let d = c.flight_snapshot();
    let kept = d.ops.iter().filter(|o| o.algorithm != "eager-fast").count() as u64;
    let fast = d.ops.iter().find(|o| o.algorithm == "eager-fast");
    match fast {
        Some(o) => {
            assert_eq!(o.state, OpState::Completed);
            assert_eq!(o.op, "all_reduce");
            // Every other record is kept in this short run: the rest are the fast ones.
            (d.recorded - kept, o.seq)
        }
        None => (0, 0),
    }
}

/// Every rank's input of element `i` of call `k`: small integers, exact in every type.
fn input<T: Element>(rank: usize, i: usize, k: usize, from: impl Fn(i64) -> T) -> T {
    from(((rank * 7 + i * 3 + k) % 11) as i64 - 3)
}

/// All-reduces of `n` elements of `T` with `op`, in place and out of place, each checked
/// against `want(inputs of element i)`; returns every result's bits for the cross-rank check.
fn check<T: Element + PartialEq + std::fmt::Debug>(
    c: &mut Communicator,
    k: usize,
    n: usize,
    op: ReduceOp,
    from: impl Fn(i64) -> T + Copy,
    want: impl Fn(&[T]) -> T,
    bits: impl Fn(T) -> u64,
) -> Vec<u64> {
    let (rank, world) = (c.rank(), c.world_size());
    let inp: Vec<T> = (0..n).map(|i| input(rank, i, k, from)).collect();
    let mut out = vec![from(0); n];
    c.all_reduce_into(&inp, &mut out, op).unwrap();
    let mut inplace = inp.clone();
    c.all_reduce(&mut inplace, op).unwrap();
    for i in 0..n {
        let all: Vec<T> = (0..world).map(|r| input(r, i, k, from)).collect();
        assert_eq!(out[i], want(&all), "rank {rank} {op:?} n {n} element {i}");
        assert_eq!(inplace[i], out[i], "rank {rank} {op:?} n {n} in place {i}");
    }
    out.into_iter().map(bits).collect()
}

#[test]
fn small_all_reduces_take_the_fast_path_with_exact_results_on_every_rank() {
    for world in [2, 3, 4] {
        let res = shm(world, |c| {
            let mut seen = Vec::new();
            for (k, n) in [1usize, 7, 1000, 2].into_iter().enumerate() {
                for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                    let fold = |xs: &[f64]| match op {
                        ReduceOp::Sum => xs.iter().sum::<f64>(),
                        ReduceOp::Prod => xs.iter().product::<f64>(),
                        ReduceOp::Min => xs.iter().copied().fold(f64::INFINITY, f64::min),
                        _ => xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    };
                    seen.push(check(
                        c,
                        k,
                        n,
                        op,
                        |v| v as f32,
                        |xs| fold(&xs.iter().map(|&x| x as f64).collect::<Vec<_>>()) as f32,
                        |x| x.to_bits() as u64,
                    ));
                    seen.push(check(
                        c,
                        k,
                        n,
                        op,
                        |v| v as f64,
                        |xs| fold(xs),
                        f64::to_bits,
                    ));
                    seen.push(check(
                        c,
                        k,
                        n,
                        op,
                        |v| v,
                        |xs| fold(&xs.iter().map(|&x| x as f64).collect::<Vec<_>>()) as i64,
                        |x| x as u64,
                    ));
                    seen.push(check(
                        c,
                        k,
                        n,
                        op,
                        |v| v as i32,
                        |xs| fold(&xs.iter().map(|&x| x as f64).collect::<Vec<_>>()) as i32,
                        |x| x as u32 as u64,
                    ));
                }
                for op in [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor] {
                    seen.push(check(
                        c,
                        k,
                        n,
                        op,
                        |v| v as u8,
                        |xs| {
                            xs.iter()
                                .copied()
                                .reduce(|a, b| match op {
                                    ReduceOp::Band => a & b,
                                    ReduceOp::Bor => a | b,
                                    _ => a ^ b,
                                })
                                .unwrap()
                        },
                        |x| x as u64,
                    ));
                }
                let w = c.world_size() as f64;
                seen.push(check(
                    c,
                    k,
                    n,
                    ReduceOp::Avg,
                    |v| v as f64,
                    |xs| xs.iter().sum::<f64>() / w,
                    f64::to_bits,
                ));
            }
            (seen, fast_ops(c))
        });
        let (first, _) = &res[0];
        for (rank, (seen, (count, seq))) in res.iter().enumerate() {
            assert_eq!(
                seen, first,
                "world {world}: rank {rank}'s bits differ from rank 0's"
            );
            // 160 calls of 80 shapes, more than the engine keeps schedules for: many take
            // the machine's way (a shape's first call does), and on a busy machine a peer
            // may miss the spin budget; at least some must be fast.
            assert!(
                *count > 0 && *seq > 0,
                "world {world} rank {rank}: no fast operation"
            );
        }
    }
}

#[test]
fn a_late_peer_hands_the_operation_to_the_machine() {
    let res = shm(2, |c| {
        let rank = c.rank();
        let mut v = vec![0f32; 4];
        // Warm-up: the shape's schedule is kept, so the calls below may take the fast path.
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let mut handed = 0;
        for k in 0..6usize {
            if rank == 1 {
                // Far beyond rank 0's spin budget: it hands the operation to the machine,
                // which waits (and sleeps) as usual.
                std::thread::sleep(Duration::from_millis(30));
            }
            let mut v: Vec<f32> = (0..4).map(|i| (rank * 10 + i + k) as f32).collect();
            let before = fast_ops(c).0;
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            if fast_ops(c).0 == before {
                handed += 1;
            }
            for (i, x) in v.iter().enumerate() {
                assert_eq!(
                    *x,
                    (10 + 2 * (i + k)) as f32,
                    "rank {rank} call {k} element {i}"
                );
            }
        }
        // Back in step: the fast path again.
        for _ in 0..20 {
            c.all_reduce(&mut v, ReduceOp::Max).unwrap();
        }
        (handed, fast_ops(c).0)
    });
    let (handed, fast) = res[0];
    assert!(
        handed >= 5,
        "rank 0 handed {handed} of 6 late calls to the machine"
    );
    assert!(fast > 0, "rank 0: no fast operation once back in step");
}

#[test]
fn a_mismatch_on_the_fast_path_names_the_peer_and_both_calls() {
    let res = shm(2, |c| {
        let rank = c.rank();
        // Both shapes are known to both ranks (their schedules kept), so the call below
        // takes the fast path on both sides, where the postings are compared.
        for n in [8, 9, 8, 9] {
            let mut v = vec![1f32; n];
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        }
        assert!(
            fast_ops(c).0 > 0,
            "rank {rank}: the warm-up took no fast path"
        );
        // Rank 1 reduces 9 elements where rank 0 reduces 8.
        let mut w = vec![1f32; 8 + rank];
        let r = c
            .all_reduce(&mut w, ReduceOp::Sum)
            .map_err(|e| e.to_string());
        if let Err(e) = &r {
            println!("rank {rank}: {e}");
        }
        r
    });
    for (rank, r) in res.iter().enumerate() {
        let e = r.as_ref().expect_err("a mismatch must fail");
        let peer = 1 - rank;
        assert!(
            e.contains(&format!("rank {peer}")) && e.contains("all_reduce"),
            "rank {rank}: {e}"
        );
    }
}

/// On the board, all-reduces of up to 8 KiB go eagerly by default and larger ones through a
/// schedule (above 8 KiB recursive doubling measured faster than the eager path);
/// `GRADSYNC_EAGER_MAX` raises the limit up to the board's 16 KiB.
#[test]
fn the_board_runs_eagerly_up_to_8_kib_unless_told_otherwise() {
    use gradsync::Collective::AllReduce;
    for eager_max in [None, Some(16 << 10)] {
        let limits = common::run_ranks(
            3,
            move |cfg: &mut Config| {
                cfg.transport = TransportMode::Shm;
                cfg.timeout = Duration::from_secs(30);
                if let Some(m) = eager_max {
                    cfg.eager_max = m;
                }
            },
            |c| {
                assert!(c.eager_board(), "rank {}: no board", c.rank());
                let eager = |b: usize| c.algorithm_for(AllReduce, b).is_none();
                let limit = (1..=32usize)
                    .map(|k| k << 10)
                    .take_while(|&b| eager(b))
                    .last();
                // Every size up to the limit runs eagerly, the next byte does not.
                let l = limit.unwrap();
                assert!(eager(1) && eager(l) && !eager(l + 1), "rank {}", c.rank());
                l
            },
        );
        let want = eager_max.unwrap_or(8 << 10);
        assert_eq!(limits, vec![want; 3], "GRADSYNC_EAGER_MAX {eager_max:?}");
    }
}

/// The board needs every rank connected but no inbox descriptor: a rank of 16 that has read
/// only the inboxes of the ranks it talks to first (the others are read when an operation first
/// writes to them) still takes the fast path.
#[test]
fn the_fast_path_does_not_wait_for_inboxes_read_on_first_use() {
    let world = 16;
    let res = shm(world, move |c| {
        let rank = c.rank();
        let known = c.peer_records().inboxes;
        for k in 0..200 {
            let mut a = [(rank + k) as f32; 4];
            c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            let want = (0..world).map(|r| (r + k) as f32).sum::<f32>();
            assert_eq!(a, [want; 4], "rank {rank} call {k}");
        }
        // The sequence number of the latest operation of the fast path (0: none).
        (known, c.peer_records().inboxes, fast_ops(c).1)
    });
    for (rank, (known, after, fast)) in res.into_iter().enumerate() {
        assert!(
            known < world,
            "rank {rank}: read every inbox at init ({known})"
        );
        // The eager path writes to no inbox: nothing more was read.
        assert_eq!(after, known, "rank {rank}");
        // On a busy machine a peer may miss the spin budget; some calls must be fast.
        assert!(
            fast > 0,
            "rank {rank}: no fast operation in 200 (known inboxes {known})"
        );
    }
}
