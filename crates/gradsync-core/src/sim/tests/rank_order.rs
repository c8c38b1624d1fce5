//! Posts and rank-order reductions in the simulator, and the eager and deterministic all-reduces
//! built from them: matching, checks, results bit for bit, missing dependencies, time.

use super::*;
use crate::reference::{Tolerance, expected};

fn recv(peer: usize, at: usize, len: usize) -> Op {
    Op::Recv {
        peer,
        dst: loc(Buf::Output, at),
        reduce_with: None,
        len,
    }
}

fn send(peer: usize, at: usize, len: usize) -> Op {
    Op::Send {
        peer,
        src: loc(Buf::Input, at),
        len,
    }
}

fn program(ops: &[(Op, &[OpId])]) -> Program {
    let mut p = Program::new();
    for (op, deps) in ops {
        p.push(*op, deps);
    }
    p
}

/// Rank 0 sends one element to rank 1, posts two, and sends three more to rank 1: rank 1
/// receives 1, 2 and 3 elements from it in this order, rank 2 the two of the post.
fn post_between_sends(recv2_len: usize) -> Vec<RankSetup> {
    let post = Op::Post {
        src: loc(Buf::Input, 1),
        len: 2,
    };
    let r0 = program(&[(send(1, 0, 1), &[]), (post, &[]), (send(1, 3, 3), &[])]);
    let r1 = program(&[
        (recv(0, 0, 1), &[]),
        (recv(0, 1, 2), &[]),
        (recv(0, 3, 3), &[]),
    ]);
    let r2 = program(&[(recv(0, 0, recv2_len), &[])]);
    let mut s = vec![setup(r0, 6, 0), setup(r1, 6, 0), setup(r2, 6, 0)];
    s[0].input = vec![10, 11, 12, 13, 14, 15];
    s
}

#[test]
fn a_post_is_one_message_to_every_peer_in_program_order() {
    for seed in 0..20 {
        for rendezvous in [false, true] {
            let opts = SimOptions {
                rendezvous,
                ..SimOptions::new(seed)
            };
            let out = run_programs(post_between_sends(2), DataType::U8, &opts).unwrap();
            assert_eq!(out.outputs[1], [10, 11, 12, 13, 14, 15]);
            assert_eq!(out.outputs[2], [11, 12, 0, 0, 0, 0]);
            assert_eq!(out.stats.messages, 4);
            assert_eq!(out.stats.bytes, 1 + 2 * 2 + 3);
            assert!(out.heard_from[2][0] && out.heard_from[1][0]);
        }
    }
    // Both sides of every message must agree on its length, posts included.
    let err = run_raw(post_between_sends(3)).unwrap_err();
    assert!(
        matches!(
            err,
            SimError::LengthMismatch {
                src: 0,
                send_op: 1,
                send_len: 2,
                dst: 2,
                recv_len: 3,
                ..
            }
        ),
        "{err}"
    );
    // A post nobody receives is a message left over.
    let mut s = post_between_sends(2);
    s[2].program = Program::new();
    assert_eq!(
        run_raw(s).unwrap_err(),
        SimError::Unreceived {
            src: 0,
            dst: 2,
            count: 1
        }
    );
    // Alone, a post goes nowhere and completes.
    let alone = program(&[(
        Op::Post {
            src: loc(Buf::Input, 0),
            len: 3,
        },
        &[],
    )]);
    let out = run_raw(vec![setup(alone, 3, 1)]).unwrap();
    assert_eq!(out.stats.messages, 0);
}

#[test]
fn a_post_is_buffered_even_with_rendezvous_sends() {
    // Every rank waits for its own post before its receive, which overwrites what the post
    // reads: a deadlock if a post waited for the receives, fine when it completes once issued.
    // A send in the same place does wait for its receive under rendezvous, and deadlocks.
    let post = Op::Post {
        src: loc(Buf::Output, 0),
        len: 1,
    };
    let posts = |peer| program(&[(post, &[]), (recv(peer, 0, 1), &[0])]);
    let sends = |peer| program(&[(send(peer, 0, 1), &[]), (recv(peer, 0, 1), &[0])]);
    for seed in 0..10 {
        let opts = SimOptions {
            rendezvous: true,
            ..SimOptions::new(seed)
        };
        let setups = vec![setup(posts(1), 2, 5), setup(posts(0), 2, 7)];
        run_programs(setups, DataType::U8, &opts).unwrap();
        let setups = vec![setup(sends(1), 2, 5), setup(sends(0), 2, 7)];
        let err = run_programs(setups, DataType::U8, &opts).unwrap_err();
        assert!(matches!(err, SimError::Deadlock { .. }), "{err}");
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Every rank of a world of `parts.len()` reduces the parts in `Input` into `Output`, then
/// optionally divides.
fn reduce_parts_world(parts: &[f32], len: usize, op: ReduceOp, finalize: bool) -> Vec<Vec<u8>> {
    let world = parts.len() / len;
    let mut p = Program::new();
    let r = p.push(
        Op::ReduceParts {
            src: loc(Buf::Input, 0),
            dst: loc(Buf::Output, 0),
            len,
        },
        &[],
    );
    if finalize {
        p.push(
            Op::Finalize {
                loc: loc(Buf::Output, 0),
                len,
            },
            &[r],
        );
    }
    let setups = (0..world)
        .map(|_| RankSetup {
            program: p.clone(),
            input: f32s(parts),
            output: vec![0; 4 * len],
            in_place: false,
            op,
        })
        .collect();
    run_programs(setups, DataType::F32, &SimOptions::new(3))
        .unwrap()
        .outputs
}

#[test]
fn reduce_parts_folds_strictly_in_rank_order() {
    // ((1e8 + 1) - 1e8) is 0 in f32, any other order gives 1.
    let out = reduce_parts_world(&[1e8, 1.0, 1.0, 1e8, -1e8, -1e8], 2, ReduceOp::Sum, false);
    assert!(out.iter().all(|o| *o == f32s(&[0.0, 0.0])), "{out:?}");
    // An average folds as a sum; the division is the finalize's.
    let out = reduce_parts_world(&[1.0, 2.0, 4.0], 1, ReduceOp::Avg, false);
    assert_eq!(out[0], f32s(&[7.0]));
    let out = reduce_parts_world(&[1.0, 2.0, 4.0], 1, ReduceOp::Avg, true);
    assert_eq!(out[0], f32s(&[7.0 / 3.0]));
    let out = reduce_parts_world(&[3.0, -2.0], 1, ReduceOp::Max, false);
    assert_eq!(out[1], f32s(&[3.0]));
    // Over one rank, a copy.
    let out = reduce_parts_world(&[5.0, 6.0], 2, ReduceOp::Prod, false);
    assert_eq!(out[0], f32s(&[5.0, 6.0]));
}

#[test]
fn detects_bad_posts_and_reductions() {
    // Two ranks, each running `op` alone over 4 elements of Input, Output and scratch.
    let run = |op: Op, other: Option<Op>| {
        let mut p = Program::new();
        p.reserve_scratch(4);
        p.push(op, &[]);
        if let Some(o) = other {
            p.push(o, &[]);
        }
        let progs = [p.clone(), p];
        (0..40).find_map(|seed| {
            let setups = progs.iter().map(|p| setup(p.clone(), 4, 1)).collect();
            run_programs(setups, DataType::U8, &SimOptions::new(seed)).err()
        })
    };
    let reduce = |src: Loc, dst: Loc, len| Op::ReduceParts { src, dst, len };
    // The parts span world * len elements.
    let err = run(reduce(loc(Buf::Input, 1), loc(Buf::Output, 0), 2), None);
    assert!(
        matches!(
            err,
            Some(SimError::OutOfBounds {
                buf: Buf::Input,
                start: 1,
                len: 4,
                ..
            })
        ),
        "{err:?}"
    );
    let err = run(reduce(loc(Buf::Scratch, 0), loc(Buf::Scratch, 2), 1), None);
    assert!(err.is_none(), "{err:?}");
    let err = run(reduce(loc(Buf::Scratch, 0), loc(Buf::Scratch, 1), 1), None);
    assert!(matches!(err, Some(SimError::Overlap { .. })), "{err:?}");
    let err = run(reduce(loc(Buf::Output, 0), loc(Buf::Input, 2), 1), None);
    assert!(matches!(err, Some(SimError::WritesInput { .. })), "{err:?}");
    let post = Op::Post {
        src: loc(Buf::Scratch, 2),
        len: 3,
    };
    let err = run(post, None);
    assert!(matches!(err, Some(SimError::OutOfBounds { .. })), "{err:?}");
    // A reduction in flight claims every part: a copy into the second one races with it.
    let copy = Op::Copy {
        src: loc(Buf::Input, 0),
        dst: loc(Buf::Scratch, 3),
        len: 1,
    };
    let err = run(
        reduce(loc(Buf::Scratch, 2), loc(Buf::Output, 0), 1),
        Some(copy),
    );
    assert!(
        matches!(
            err,
            Some(SimError::Race {
                buf: Buf::Scratch,
                index: 3,
                ..
            })
        ),
        "{err:?}"
    );
}

fn all_reduce(
    algorithm: Algorithm,
    world: usize,
    count: usize,
    segment: usize,
    op: ReduceOp,
    in_place: bool,
) -> Vec<Params> {
    params(Collective::AllReduce, algorithm, world, count)
        .into_iter()
        .map(|p| Params {
            segment,
            op,
            in_place,
            ..p
        })
        .collect()
}

#[test]
fn internal_all_reduces_give_the_rank_order_reduction_bit_for_bit() {
    // Random floats: the bits depend on the order of reduction. The eager and deterministic
    // all-reduces fold every element in rank order, as `reference::expected` does, whatever the
    // interleaving and the segment; the ring does not.
    let floats = [DataType::F32, DataType::Bf16, DataType::F64, DataType::F16];
    let ops = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Avg];
    let (mut runs, mut ring_differs) = (0, 0);
    let mut i = 0usize;
    for world in [2, 3, 5, 8, 13] {
        for (count, segment) in [(1, 1), (300, 16), (300, usize::MAX), (1000, 128)] {
            for in_place in [false, true] {
                i += 1;
                let (dtype, op) = (floats[i % 4], ops[i % 3]);
                let make = |alg| all_reduce(alg, world, count, segment, op, in_place);
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|r| gen_input(dtype, op, InputKind::Random, count, (i * 64 + r) as u64))
                    .collect();
                let want = expected(Collective::AllReduce, dtype, op, world, 0, &inputs);
                for algorithm in [Algorithm::Eager, Algorithm::Deterministic] {
                    for seed in 0..4 {
                        let opts = SimOptions {
                            rendezvous: seed % 2 == 1,
                            ..SimOptions::new(seed * 7919 + i as u64)
                        };
                        let res = run_with(make(algorithm), dtype, inputs.clone(), &opts).unwrap();
                        assert!(
                            res.outputs == want,
                            "{algorithm} {dtype} {op} n={world} count={count} seg={segment} \
                             in_place={in_place} seed={seed}"
                        );
                        runs += 1;
                    }
                }
                let ring = run_with(make(Algorithm::Ring), dtype, inputs.clone(), &opts(i));
                let ring = ring.unwrap();
                let exact = check(
                    Collective::AllReduce,
                    dtype,
                    op,
                    world,
                    0,
                    &inputs,
                    &ring.outputs,
                    Tolerance::Exact,
                );
                ring_differs += usize::from(exact.is_err());
            }
        }
    }
    assert_eq!(runs, 5 * 4 * 2 * 2 * 4);
    assert!(
        ring_differs > 10,
        "the ring matched the rank order {ring_differs} times"
    );
}

fn opts(seed: usize) -> SimOptions {
    SimOptions::new(seed as u64)
}
/// The ranges `op` touches in a world of `world` ranks: `(where, elements, whether it writes)`.
fn touches(op: &Op, world: usize) -> Vec<(Loc, usize, bool)> {
    match *op {
        Op::Send { src, len, .. } | Op::Post { src, len } => vec![(src, len, false)],
        Op::Recv {
            dst,
            reduce_with,
            len,
            ..
        } => {
            let mut v = vec![(dst, len, true)];
            v.extend(reduce_with.map(|w| (w, len, false)));
            v
        }
        Op::Copy { src, dst, len } => vec![(src, len, false), (dst, len, true)],
        Op::ReduceParts { src, dst, len } => vec![(src, world * len, false), (dst, len, true)],
        Op::Finalize { loc, len } => vec![(loc, len, true)],
    }
}

/// The pairs of ops of `prog` that touch a common element, one of them writing it, while
/// neither surely completes before the other is issued (through dependencies and the order of
/// the queues): the races some interleaving can produce, found without running anything.
fn unordered_conflicts(prog: &Program, world: usize) -> Vec<(usize, usize)> {
    let before = completed_before(prog);
    let t: Vec<_> = prog.ops().iter().map(|op| touches(op, world)).collect();
    let mut out = Vec::new();
    for b in 0..prog.len() {
        for a in 0..b {
            if before[b][a] || before[a][b] {
                continue;
            }
            let clash = t[a].iter().any(|&(x, xl, xw)| {
                t[b].iter().any(|&(y, yl, yw)| {
                    (xw || yw)
                        && x.buf == y.buf
                        && xl > 0
                        && yl > 0
                        && x.start < y.start + yl
                        && y.start < x.start + xl
                })
            });
            if clash {
                out.push((a, b));
            }
        }
    }
    out
}

#[test]
fn every_dependency_of_the_internal_programs_guards_a_hazard() {
    // The programs have no race: every pair of ops that touch an element in common is ordered
    // by dependencies or queues. And dropping any one dependency that the others do not imply
    // creates one (the reuse of the deterministic program's scratch halves, its in-place
    // hazards, the waits of every reduction): none of them is superfluous, none is missing.
    let mut mutations = 0;
    for (algorithm, world, count, segment) in [
        (Algorithm::Deterministic, 2, 5, 2),
        (Algorithm::Deterministic, 3, 10, 2),
        (Algorithm::Deterministic, 4, 7, 2),
        (Algorithm::Deterministic, 5, 3, 1),
        (Algorithm::Eager, 3, 4, usize::MAX),
        (Algorithm::Eager, 5, 1, 1),
    ] {
        for in_place in [false, true] {
            for p in all_reduce(algorithm, world, count, segment, ReduceOp::Avg, in_place) {
                let prog = plan::build(&p).unwrap();
                let ctx = format!("{algorithm} n={world} rank {} in place {in_place}", p.rank);
                assert_eq!(unordered_conflicts(&prog, world), [], "{ctx}");
                for i in 0..prog.len() {
                    for &d in prog.deps(i as OpId) {
                        let mutated = drop_deps(&prog, i, |x| x != d);
                        if completed_before(&mutated)[i][d as usize] {
                            continue;
                        }
                        mutations += 1;
                        assert!(
                            !unordered_conflicts(&mutated, world).is_empty(),
                            "{ctx}: op {i} needs no dependency on op {d}"
                        );
                    }
                }
            }
        }
    }
    assert!(mutations >= 200, "only {mutations} mutations");
}

#[test]
fn every_program_is_free_of_races_by_construction() {
    // The same static check over every generator: no two ops that touch an element in common
    // can be in flight together.
    for algorithm in Algorithm::EVERY {
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::Broadcast,
            Collective::Reduce,
            Collective::AllToAll,
            Collective::Gather,
            Collective::Scatter,
        ] {
            if !supports(coll, algorithm) {
                continue;
            }
            let moves = matches!(
                coll,
                Collective::AllToAll | Collective::Gather | Collective::Scatter
            );
            for (world, local_size) in [(2, 0), (3, 0), (4, 2), (5, 0), (6, 3)] {
                for in_place in [false, true] {
                    if in_place && moves {
                        continue;
                    }
                    for (rank, p) in params(coll, algorithm, world, 11).into_iter().enumerate() {
                        let p = Params {
                            segment: 3,
                            in_place,
                            local_size,
                            root: 1,
                            op: ReduceOp::Avg,
                            ..p
                        };
                        let prog = plan::build(&p).unwrap();
                        let c = unordered_conflicts(&prog, world);
                        assert_eq!(c, [], "{coll} {algorithm} n={world} rank {rank} {in_place}");
                    }
                }
            }
        }
    }
}

#[test]
fn internal_all_reduces_are_predicted() {
    let link = LinkModel::new(5e-6, 1e9);
    for world in [2, 3, 5, 8] {
        for count in [1usize, 1000] {
            // Eager: one post, a message to each peer in a row on every rank's link.
            let ps = all_reduce(Algorithm::Eager, world, count, 7, ReduceOp::Sum, false);
            let t = predict(&ps, DataType::F32, &link).unwrap();
            let want = (world - 1) as f64 * link.message_s(4 * count);
            assert!(
                close(t.time_s, want),
                "eager n={world}: {} vs {want}",
                t.time_s
            );
            assert_eq!(t.messages, (world * (world - 1)) as u64);
            let (sym, s) = predict_symmetric(&ps, DataType::F32, &link)
                .unwrap()
                .expect("every rank posts and receives alike");
            assert_eq!((sym.time_s, s), (t.time_s, Symmetry::Rotation));
            // Deterministic: an all-gather of each piece, the pieces back to back.
            for segment in [count, 300] {
                let ps = all_reduce(
                    Algorithm::Deterministic,
                    world,
                    count,
                    segment,
                    ReduceOp::Avg,
                    true,
                );
                let t = predict(&ps, DataType::F32, &link).unwrap();
                let pieces: f64 = (0..count)
                    .step_by(segment)
                    .map(|off| link.message_s(4 * segment.min(count - off)))
                    .sum();
                let want = (world - 1) as f64 * pieces;
                assert!(
                    close(t.time_s, want),
                    "det n={world}: {} vs {want}",
                    t.time_s
                );
            }
        }
    }
}
