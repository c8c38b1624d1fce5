//! Simulator self-tests and the conformance sweep of every schedule.

use super::*;
use crate::reference::{InputKind, check, default_tolerance, gen_input};
use crate::schedule::plan::{self, Algorithm, Params, PlanError, supports};
use crate::schedule::{Buf, Loc, Op, OpId, Program};
use crate::{Collective, DataType, ReduceOp};

mod conformance;
mod rank_order;

fn loc(buf: Buf, start: usize) -> Loc {
    Loc::new(buf, start)
}

/// A rank of a raw run with `n` elements of `Output` (u8) holding `fill`.
fn setup(program: Program, n: usize, fill: u8) -> RankSetup {
    RankSetup {
        program,
        input: vec![fill; n],
        output: vec![0; n],
        in_place: false,
        op: ReduceOp::Sum,
    }
}

fn run_raw(setups: Vec<RankSetup>) -> Result<RawOutcome, SimError> {
    run_programs(setups, DataType::U8, &SimOptions::new(1))
}

/// Rank 0 sends `len0`, rank 1 receives `len1`.
fn pair(len0: usize, len1: usize) -> Vec<RankSetup> {
    let mut a = Program::new();
    a.push(
        Op::Send {
            peer: 1,
            src: loc(Buf::Input, 0),
            len: len0,
        },
        &[],
    );
    let mut b = Program::new();
    b.push(
        Op::Recv {
            peer: 0,
            dst: loc(Buf::Output, 0),
            reduce_with: None,
            len: len1,
        },
        &[],
    );
    vec![setup(a, 4, 7), setup(b, 4, 0)]
}

#[test]
fn raw_exchange_moves_and_reduces() {
    let out = run_raw(pair(3, 3)).unwrap();
    assert_eq!(out.outputs[1], vec![7, 7, 7, 0]);
    assert_eq!(out.heard_from, vec![vec![true, false], vec![true, true]]);
    assert_eq!(out.stats.messages, 1);
    // A reducing receive: Output = Input + incoming.
    let mut s = pair(2, 2);
    s[1].program = Program::new();
    let with = Some(loc(Buf::Input, 1));
    s[1].program.push(
        Op::Recv {
            peer: 0,
            dst: loc(Buf::Output, 2),
            reduce_with: with,
            len: 2,
        },
        &[],
    );
    s[1].input = vec![1, 2, 3, 4];
    let out = run_raw(s).unwrap();
    assert_eq!(out.outputs[1], vec![0, 0, 9, 10]);
}

#[test]
fn detects_length_mismatch() {
    let err = run_raw(pair(2, 3)).unwrap_err();
    assert!(
        matches!(
            err,
            SimError::LengthMismatch {
                src: 0,
                send_len: 2,
                recv_len: 3,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn detects_unreceived_messages() {
    let mut s = pair(1, 1);
    s[1].program = Program::new();
    let err = run_raw(s).unwrap_err();
    assert_eq!(
        err,
        SimError::Unreceived {
            src: 0,
            dst: 1,
            count: 1
        }
    );
}

#[test]
fn detects_deadlock_and_names_ranks() {
    // Each rank receives before it sends.
    let mk = |peer| {
        let mut p = Program::new();
        let r = p.push(
            Op::Recv {
                peer,
                dst: loc(Buf::Output, 0),
                reduce_with: None,
                len: 1,
            },
            &[],
        );
        p.push(
            Op::Send {
                peer,
                src: loc(Buf::Input, 0),
                len: 1,
            },
            &[r],
        );
        p
    };
    let err = run_raw(vec![setup(mk(1), 1, 0), setup(mk(0), 1, 0)]).unwrap_err();
    let SimError::Deadlock { ranks, detail } = &err else {
        panic!("{err}")
    };
    assert_eq!(ranks, &[0, 1]);
    assert!(
        detail.contains("op 0 recv of 1 from rank 1 (issued)"),
        "{detail}"
    );
    assert!(
        detail.contains("op 1 send of 1 to rank 1 (after [0])"),
        "{detail}"
    );
}

#[test]
fn rendezvous_sends_wait_for_the_receive() {
    // Send, then receive into the buffer just sent, after the send completed: fine with buffered
    // sends, a deadlock when a send needs the peer's receive to be posted.
    let mk = |peer| {
        let mut p = Program::new();
        let s = p.push(
            Op::Send {
                peer,
                src: loc(Buf::Output, 0),
                len: 1,
            },
            &[],
        );
        let with = Some(loc(Buf::Output, 0));
        p.push(
            Op::Recv {
                peer,
                dst: loc(Buf::Output, 0),
                reduce_with: with,
                len: 1,
            },
            &[s],
        );
        p
    };
    let setups = || vec![setup(mk(1), 1, 0), setup(mk(0), 1, 0)];
    for seed in 0..10 {
        run_programs(setups(), DataType::U8, &SimOptions::new(seed)).unwrap();
        let opts = SimOptions {
            rendezvous: true,
            ..SimOptions::new(seed)
        };
        let err = run_programs(setups(), DataType::U8, &opts).unwrap_err();
        assert!(matches!(err, SimError::Deadlock { .. }), "{err}");
    }
}

#[test]
fn detects_bounds_input_writes_and_overlap() {
    let one = |op: Op, scratch: usize| {
        let mut p = Program::new();
        p.reserve_scratch(scratch);
        p.push(op, &[]);
        vec![setup(p, 4, 0)]
    };
    let err = run_raw(one(
        Op::Copy {
            src: loc(Buf::Input, 3),
            dst: loc(Buf::Output, 0),
            len: 2,
        },
        0,
    ));
    assert!(matches!(
        err,
        Err(SimError::OutOfBounds {
            buf: Buf::Input,
            start: 3,
            len: 2,
            size: 4,
            ..
        })
    ));
    let err = run_raw(one(
        Op::Copy {
            src: loc(Buf::Scratch, 0),
            dst: loc(Buf::Output, 0),
            len: 3,
        },
        2,
    ));
    assert!(
        matches!(
            err,
            Err(SimError::OutOfBounds {
                buf: Buf::Scratch,
                size: 2,
                ..
            })
        ),
        "{err:?}"
    );
    run_raw(one(
        Op::Copy {
            src: loc(Buf::Scratch, 0),
            dst: loc(Buf::Output, 0),
            len: 2,
        },
        2,
    ))
    .unwrap();
    let err = run_raw(one(
        Op::Finalize {
            loc: loc(Buf::Input, 0),
            len: 1,
        },
        0,
    ));
    assert_eq!(err.unwrap_err(), SimError::WritesInput { rank: 0, op: 0 });
    let err = run_raw(one(
        Op::Copy {
            src: loc(Buf::Output, 0),
            dst: loc(Buf::Output, 1),
            len: 2,
        },
        0,
    ));
    assert_eq!(err.unwrap_err(), SimError::Overlap { rank: 0, op: 0 });
    let err = run_raw(one(
        Op::Send {
            peer: 3,
            src: loc(Buf::Output, 0),
            len: 1,
        },
        0,
    ));
    assert!(matches!(
        err,
        Err(SimError::BadPeer {
            peer: 3,
            world: 1,
            ..
        })
    ));
    let mut s = one(
        Op::Copy {
            src: loc(Buf::Input, 0),
            dst: loc(Buf::Output, 0),
            len: 1,
        },
        0,
    );
    s[0].in_place = true;
    s[0].input.clear();
    assert_eq!(
        run_raw(s).unwrap_err(),
        SimError::InputInPlace { rank: 0, op: 0 }
    );
}

#[test]
fn detects_races() {
    // A receive and a copy write the same element with no dependency between them.
    let mut p = Program::new();
    p.push(
        Op::Recv {
            peer: 1,
            dst: loc(Buf::Output, 0),
            reduce_with: None,
            len: 2,
        },
        &[],
    );
    p.push(
        Op::Copy {
            src: loc(Buf::Input, 0),
            dst: loc(Buf::Output, 1),
            len: 1,
        },
        &[],
    );
    let mut q = Program::new();
    q.push(
        Op::Send {
            peer: 0,
            src: loc(Buf::Input, 0),
            len: 2,
        },
        &[],
    );
    let err = run_raw(vec![setup(p.clone(), 2, 0), setup(q.clone(), 2, 0)]).unwrap_err();
    assert!(
        matches!(
            err,
            SimError::Race {
                rank: 0,
                buf: Buf::Output,
                index: 1,
                ..
            }
        ),
        "{err}"
    );
    // With the dependency it is fine.
    let mut p = Program::new();
    let r = p.push(
        Op::Recv {
            peer: 1,
            dst: loc(Buf::Output, 0),
            reduce_with: None,
            len: 2,
        },
        &[],
    );
    p.push(
        Op::Copy {
            src: loc(Buf::Input, 0),
            dst: loc(Buf::Output, 1),
            len: 1,
        },
        &[r],
    );
    run_raw(vec![setup(p, 2, 0), setup(q, 2, 0)]).unwrap();
    // Two concurrent readers are fine.
    let mut p = Program::new();
    p.push(
        Op::Send {
            peer: 0,
            src: loc(Buf::Output, 0),
            len: 2,
        },
        &[],
    );
    p.push(
        Op::Copy {
            src: loc(Buf::Output, 0),
            dst: loc(Buf::Scratch, 0),
            len: 2,
        },
        &[],
    );
    p.push(
        Op::Recv {
            peer: 0,
            dst: loc(Buf::Scratch, 2),
            reduce_with: None,
            len: 2,
        },
        &[],
    );
    p.reserve_scratch(4);
    run_raw(vec![setup(p, 2, 0)]).unwrap();
    // A writer under a reader is not: rank 0's receive reads Output 0..2 and cannot complete
    // before rank 1 has heard from rank 0, which happens only after the finalize wrote Output[1].
    let mut p = Program::new();
    let with = Some(loc(Buf::Output, 0));
    p.push(
        Op::Recv {
            peer: 1,
            dst: loc(Buf::Scratch, 0),
            reduce_with: with,
            len: 2,
        },
        &[],
    );
    let f = p.push(
        Op::Finalize {
            loc: loc(Buf::Output, 1),
            len: 1,
        },
        &[],
    );
    p.push(
        Op::Send {
            peer: 1,
            src: loc(Buf::Input, 0),
            len: 1,
        },
        &[f],
    );
    p.reserve_scratch(2);
    let mut q = Program::new();
    let r = q.push(
        Op::Recv {
            peer: 0,
            dst: loc(Buf::Output, 0),
            reduce_with: None,
            len: 1,
        },
        &[],
    );
    q.push(
        Op::Send {
            peer: 0,
            src: loc(Buf::Input, 0),
            len: 2,
        },
        &[r],
    );
    for seed in 0..10 {
        let setups = vec![setup(p.clone(), 2, 0), setup(q.clone(), 2, 0)];
        let err = run_programs(setups, DataType::U8, &SimOptions::new(seed)).unwrap_err();
        assert_eq!(
            err,
            SimError::Race {
                rank: 0,
                op: 1,
                other: 0,
                buf: Buf::Output,
                index: 1
            }
        );
    }
}

fn params(coll: Collective, algorithm: Algorithm, world: usize, count: usize) -> Vec<Params> {
    (0..world)
        .map(|rank| Params {
            coll,
            rank,
            world,
            count,
            root: 0,
            op: ReduceOp::Sum,
            segment: usize::MAX,
            in_place: false,
            algorithm,
            local_size: 0,
        })
        .collect()
}

fn zeros(ps: &[Params], dtype: DataType) -> Vec<Vec<u8>> {
    ps.iter()
        .map(|p| vec![0; p.input_elems() * dtype.size()])
        .collect()
}

#[test]
fn run_rejects_bad_parameters_and_inputs() {
    let mut ps = params(Collective::AllReduce, Algorithm::Ring, 3, 4);
    let inputs = zeros(&ps, DataType::F32);
    assert!(matches!(
        run(ps.clone(), DataType::F32, inputs[..2].to_vec(), 0),
        Err(SimError::Params { .. })
    ));
    let mut short = inputs.clone();
    short[2].pop();
    assert!(matches!(
        run(ps.clone(), DataType::F32, short, 0),
        Err(SimError::BufferSize {
            rank: 2,
            got: 15,
            want: 16,
            ..
        })
    ));
    ps[1].rank = 2;
    assert!(matches!(
        run(ps.clone(), DataType::F32, inputs.clone(), 0),
        Err(SimError::Params { rank: 1, .. })
    ));
    let mut ps = params(Collective::Broadcast, Algorithm::Tree, 3, 4);
    ps.iter_mut().for_each(|p| p.root = 3);
    let err = run(ps, DataType::F32, inputs, 0).unwrap_err();
    assert!(
        matches!(
            err,
            SimError::Plan {
                rank: 0,
                source: PlanError::RootOutOfRange { .. }
            }
        ),
        "{err}"
    );
}

#[test]
fn same_seed_same_interleaving() {
    let ps = params(Collective::AllReduce, Algorithm::Ring, 5, 40);
    let ps: Vec<Params> = ps.into_iter().map(|p| Params { segment: 3, ..p }).collect();
    let inputs: Vec<Vec<u8>> = (0..5)
        .map(|r| gen_input(DataType::F32, ReduceOp::Sum, InputKind::Random, 40, r))
        .collect();
    let a = run(ps.clone(), DataType::F32, inputs.clone(), 9).unwrap();
    let b = run(ps.clone(), DataType::F32, inputs.clone(), 9).unwrap();
    assert_eq!(a.outputs, b.outputs);
    assert_eq!(a.stats, b.stats);
    let steps: Vec<u64> = (0..6)
        .map(|s| {
            run(ps.clone(), DataType::F32, inputs.clone(), s)
                .unwrap()
                .stats
                .max_in_flight as u64
        })
        .collect();
    assert!(
        steps.iter().any(|&s| s != steps[0]),
        "seeds should change the interleaving: {steps:?}"
    );
}

#[test]
fn barrier_hears_from_everyone() {
    for world in 1..=17 {
        let ps = params(Collective::Barrier, Algorithm::Ring, world, 0);
        let res = run(
            ps.clone(),
            DataType::U8,
            zeros(&ps, DataType::U8),
            world as u64,
        )
        .unwrap();
        for (r, h) in res.heard_from.iter().enumerate() {
            assert!(
                h.iter().all(|&x| x),
                "world {world}: rank {r} heard only from {h:?}"
            );
        }
        let rounds = world.next_power_of_two().trailing_zeros() as u64;
        assert_eq!(res.stats.messages, world as u64 * rounds);
        assert!(res.outputs.iter().all(Vec::is_empty));
    }
}

#[test]
fn broadcast_hears_from_root() {
    let mut ps = params(Collective::Broadcast, Algorithm::Tree, 6, 5);
    ps.iter_mut().for_each(|p| p.root = 4);
    let res = run(ps.clone(), DataType::U8, zeros(&ps, DataType::U8), 0).unwrap();
    assert!(res.heard_from.iter().all(|h| h[4]));
    assert!(!res.heard_from[4][0], "the root hears from no one");
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

#[test]
fn predicted_times_match_textbook_formulas() {
    let link = LinkModel {
        alpha_s: 1e-5,
        beta_s_per_byte: 1e-9,
    };
    let f32s = DataType::F32;
    // Ring all-reduce, unsegmented: 2 (n - 1) (alpha + B / n beta).
    let n = 4;
    let ps = params(Collective::AllReduce, Algorithm::Ring, n, 1024);
    let t = predict(&ps, f32s, &link).unwrap();
    let want = 2.0 * (n - 1) as f64 * link.message_s(4 * 1024 / n);
    assert!(close(t.time_s, want), "{} vs {want}", t.time_s);
    assert_eq!(t.messages, (n * 2 * (n - 1)) as u64);
    assert_eq!(t.bytes, (2 * (n - 1) * 4 * 1024) as u64);
    // Recursive doubling over 8 ranks: 3 exchanges of the whole buffer.
    let ps = params(Collective::AllReduce, Algorithm::RecursiveDoubling, 8, 256);
    let t = predict(&ps, f32s, &link).unwrap();
    assert!(close(t.time_s, 3.0 * link.message_s(1024)), "{}", t.time_s);
    // Binomial broadcast over 8 ranks, one segment: 3 rounds.
    let ps = params(Collective::Broadcast, Algorithm::Tree, 8, 256);
    let t = predict(&ps, f32s, &link).unwrap();
    assert!(close(t.time_s, 3.0 * link.message_s(1024)), "{}", t.time_s);
    // Pipelined chain broadcast: (n + S - 2) segment times.
    let (n, s, seg) = (4, 10, 64);
    let ps: Vec<Params> = params(Collective::Broadcast, Algorithm::Ring, n, s * seg)
        .into_iter()
        .map(|p| Params { segment: seg, ..p })
        .collect();
    let t = predict(&ps, f32s, &link).unwrap();
    assert!(
        close(t.time_s, (n + s - 2) as f64 * link.message_s(4 * seg)),
        "{}",
        t.time_s
    );
    // The simulator reports the same prediction.
    let res = run(ps.clone(), f32s, zeros(&ps, f32s), 0).unwrap();
    assert_eq!(res.predict(&link), t);
}

#[test]
fn prediction_prefers_doubling_for_small_and_ring_for_large() {
    let link = LinkModel::default();
    let time = |alg, count| {
        predict(
            &params(Collective::AllReduce, alg, 8, count),
            DataType::F32,
            &link,
        )
        .unwrap()
        .time_s
    };
    assert!(time(Algorithm::RecursiveDoubling, 16) < time(Algorithm::Ring, 16));
    assert!(time(Algorithm::Ring, 1 << 22) < time(Algorithm::RecursiveDoubling, 1 << 22));
}

#[test]
fn predicts_large_worlds_on_paper() {
    let ps = params(Collective::AllReduce, Algorithm::Ring, 256, 1 << 16);
    let t = predict(&ps, DataType::F32, &LinkModel::default()).unwrap();
    assert_eq!(t.rank_time_s.len(), 256);
    assert!(t.time_s > 0.0);
}

/// Parameters of a two-level world of `hosts` x `local` ranks.
fn two_level(
    coll: Collective,
    algorithm: Algorithm,
    hosts: usize,
    local: usize,
    count: usize,
) -> Vec<Params> {
    params(coll, algorithm, hosts * local, count)
        .into_iter()
        .map(|p| Params {
            local_size: local,
            ..p
        })
        .collect()
}

#[test]
fn hierarchical_results_do_not_depend_on_timing() {
    // Random floats make the bits depend on the order of reduction; that order is fixed, so every
    // interleaving (buffered or rendezvous sends) gives the same bits on every rank.
    for coll in [Collective::AllReduce, Collective::ReduceScatter] {
        for (hosts, local) in [(2, 2), (3, 2), (2, 3)] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod] {
                let ps: Vec<Params> = two_level(coll, Algorithm::Hierarchical, hosts, local, 301)
                    .into_iter()
                    .map(|p| Params {
                        segment: 16,
                        op,
                        ..p
                    })
                    .collect();
                let inputs: Vec<Vec<u8>> = ps
                    .iter()
                    .map(|p| {
                        gen_input(
                            DataType::F32,
                            op,
                            InputKind::Random,
                            p.input_elems(),
                            p.rank as u64,
                        )
                    })
                    .collect();
                let mut first: Option<Vec<Vec<u8>>> = None;
                for seed in 0..8 {
                    let opts = SimOptions {
                        rendezvous: seed % 2 == 1,
                        ..SimOptions::new(seed)
                    };
                    let res = run_with(ps.clone(), DataType::F32, inputs.clone(), &opts).unwrap();
                    match &first {
                        None => first = Some(res.outputs),
                        Some(f) => assert_eq!(f, &res.outputs, "{coll} {hosts}x{local} {op}"),
                    }
                }
            }
        }
    }
}

/// `prog` with op `i`'s dependencies restricted to those `keep` accepts.
fn drop_deps(prog: &Program, i: usize, keep: impl Fn(OpId) -> bool) -> Program {
    let mut out = Program::new();
    out.reserve_scratch(prog.scratch_elems());
    for (id, op) in prog.ops().iter().enumerate() {
        let deps: Vec<OpId> = prog
            .deps(id as OpId)
            .iter()
            .copied()
            .filter(|&d| id != i || keep(d))
            .collect();
        out.push(*op, &deps);
    }
    out
}

/// For every op of `prog`: which ops have surely completed when it is issued, through its
/// dependencies and the FIFO order of its (peer, direction) queue.
fn completed_before(prog: &Program) -> Vec<Vec<bool>> {
    let n = prog.len();
    let mut before: Vec<Vec<bool>> = Vec::with_capacity(n);
    let mut queue_tail: std::collections::HashMap<(usize, bool), usize> = Default::default();
    for (i, op) in prog.ops().iter().enumerate() {
        let mut b = vec![false; n];
        for &d in prog.deps(i as OpId) {
            b[d as usize] = true;
            for (x, &y) in b.iter_mut().zip(&before[d as usize]) {
                *x |= y;
            }
        }
        let queue = match *op {
            Op::Send { peer, .. } => Some((peer, true)),
            Op::Recv { peer, .. } => Some((peer, false)),
            _ => None,
        };
        if let Some(q) = queue {
            if let Some(&prev) = queue_tail.get(&q) {
                for (x, &y) in b.iter_mut().zip(&before[prev]) {
                    *x |= y;
                }
            }
            queue_tail.insert(q, i);
        }
        before.push(b);
    }
    before
}

#[test]
fn race_detector_catches_missing_hierarchical_dependencies() {
    // The dependencies between the intra-host and inter-host phases are what make the
    // hierarchical schedules correct. Dropping those of any one op of rank 0 must show up as a
    // race on rank 0 under some interleaving.
    let (hosts, local) = (2, 2);
    let same_host = |a: usize, b: usize| a / local == b / local;
    let mut mutations = 0;
    for coll in [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
    ] {
        for in_place in [false, true] {
            let ps: Vec<Params> = two_level(coll, Algorithm::Hierarchical, hosts, local, 10)
                .into_iter()
                .map(|p| Params {
                    segment: 2,
                    in_place,
                    ..p
                })
                .collect();
            let programs: Vec<Program> = ps.iter().map(|p| plan::build(p).unwrap()).collect();
            let prog = &programs[0];
            // Whether an op talks inside the host (`Some(true)`), across (`Some(false)`), or is
            // local (`None`).
            let class = |id: OpId| match prog.ops()[id as usize] {
                Op::Send { peer, .. } | Op::Recv { peer, .. } => Some(same_host(0, peer)),
                _ => None,
            };
            for i in 0..prog.len() {
                let me = class(i as OpId);
                let crosses = |d: OpId| me.is_some() && class(d).is_some() && class(d) != me;
                if !prog.deps(i as OpId).iter().any(|&d| crosses(d)) {
                    continue;
                }
                let mutated = drop_deps(prog, i, |d| !crosses(d));
                // Skip dependencies that the FIFO order of the queues still implies.
                let implied = &completed_before(&mutated)[i];
                if prog
                    .deps(i as OpId)
                    .iter()
                    .all(|&d| !crosses(d) || implied[d as usize])
                {
                    continue;
                }
                mutations += 1;
                let caught = (0..200).any(|seed| {
                    let setups: Vec<RankSetup> = ps
                        .iter()
                        .zip(&programs)
                        .map(|(p, prog)| {
                            let program = if p.rank == 0 {
                                mutated.clone()
                            } else {
                                prog.clone()
                            };
                            let elems = p.input_elems();
                            let input = gen_input(
                                DataType::F32,
                                ReduceOp::Sum,
                                InputKind::Exact,
                                elems,
                                p.rank as u64,
                            );
                            let mut output = vec![0; p.output_elems() * 4];
                            let input = if in_place {
                                output[p.input_offset() * 4..][..input.len()]
                                    .copy_from_slice(&input);
                                Vec::new()
                            } else {
                                input
                            };
                            RankSetup {
                                program,
                                input,
                                output,
                                in_place,
                                op: ReduceOp::Sum,
                            }
                        })
                        .collect();
                    let res = run_programs(setups, DataType::F32, &SimOptions::new(seed));
                    matches!(res, Err(SimError::Race { rank: 0, .. }))
                });
                assert!(
                    caught,
                    "{coll} in place {in_place}: dropping op {i}'s cross-phase deps went unseen"
                );
            }
        }
    }
    assert!(mutations >= 30, "only {mutations} mutations");
}

fn time(ps: &[Params], topo: &Topology) -> f64 {
    predict_on(ps, DataType::F32, topo).unwrap().time_s
}

#[test]
fn two_level_prediction_matches_formulas() {
    let intra = LinkModel {
        alpha_s: 1e-6,
        beta_s_per_byte: 1e-11,
    };
    let inter = LinkModel {
        alpha_s: 2e-5,
        beta_s_per_byte: 1e-9,
    };
    let topo = Topology::two_level(2, intra, inter);
    let count = 1024;
    let bytes = 4 * count;
    // Unsegmented hierarchical all-reduce over 2 x 2: one intra-host step of B / 2, two steps of
    // the inter-host ring on B / 4, one more intra-host step of B / 2.
    let ps = two_level(Collective::AllReduce, Algorithm::Hierarchical, 2, 2, count);
    let want = 2.0 * intra.message_s(bytes / 2) + 2.0 * inter.message_s(bytes / 4);
    let t = time(&ps, &topo);
    assert!(close(t, want), "{t} vs {want}");
    // The flat ring crosses hosts at 1 -> 2 and 3 -> 0: 6 steps paced by the slow link.
    let ps = two_level(Collective::AllReduce, Algorithm::Ring, 2, 2, count);
    let want = 6.0 * inter.message_s(bytes / 4);
    let t = time(&ps, &topo);
    assert!(close(t, want), "{t} vs {want}");
    // Equal links on both levels: a ring, which sends on one link per rank, is timed as flat.
    let ps = two_level(Collective::AllReduce, Algorithm::Ring, 2, 4, 4096);
    let same = Topology::two_level(4, inter, inter);
    assert_eq!(
        predict_on(&ps, DataType::F32, &same).unwrap(),
        predict(&ps, DataType::F32, &inter).unwrap()
    );
    // The simulator's prediction agrees.
    let ps = two_level(Collective::AllReduce, Algorithm::Hierarchical, 2, 2, 64);
    let res = run(ps.clone(), DataType::F32, zeros(&ps, DataType::F32), 0).unwrap();
    assert_eq!(res.predict_on(&topo).time_s, time(&ps, &topo));
    // Central over n ranks, unsegmented: all send to the root at once (incoming links are not
    // limited), then the root sends n - 1 buffers one after the other.
    for n in [2, 4, 8] {
        let ps = params(Collective::AllReduce, Algorithm::Central, n, count);
        let t = predict(&ps, DataType::F32, &inter).unwrap().time_s;
        let want = n as f64 * inter.message_s(bytes);
        assert!(close(t, want), "n = {n}: {t} vs {want}");
    }
}

#[test]
fn hierarchical_beats_the_ring_over_slow_links_between_hosts() {
    // 2 hosts x 2 ranks, 64 MiB of f32 in 1 MiB segments; fast links inside a host (100 GB/s),
    // 12.5 GB/s (100 Gb/s) between hosts.
    let topo = Topology::two_level(
        2,
        LinkModel::new(2e-6, 100e9),
        LinkModel::new(10e-6, 12.5e9),
    );
    let count = 16 << 20;
    let segmented = |alg| -> Vec<Params> {
        two_level(Collective::AllReduce, alg, 2, 2, count)
            .into_iter()
            .map(|p| Params {
                segment: 1 << 18,
                ..p
            })
            .collect()
    };
    let ring = time(&segmented(Algorithm::Ring), &topo);
    let hier = time(&segmented(Algorithm::Hierarchical), &topo);
    // The ring pushes 1.5 B over the links between hosts, the hierarchical schedule 0.5 B (plus
    // B over the fast links, largely overlapped by the pipeline).
    let b = (4 * count) as f64 / 12.5e9;
    assert!(ring > 1.5 * b, "ring {ring}");
    assert!(hier < 0.5 * ring, "hierarchical {hier} vs ring {ring}");
    assert!(hier > 0.5 * b, "hierarchical {hier}");
}

#[test]
fn central_time_grows_linearly_while_the_ring_stays_flat() {
    let link = LinkModel::default();
    let count = 1 << 20;
    let at = |alg, n| -> f64 {
        let ps: Vec<Params> = params(Collective::AllReduce, alg, n, count)
            .into_iter()
            .map(|p| Params {
                segment: 1 << 16,
                ..p
            })
            .collect();
        predict(&ps, DataType::F32, &link).unwrap().time_s
    };
    let b = link.message_s(4 * count);
    for n in [2, 3, 4, 6, 8] {
        let (central, ring) = (at(Algorithm::Central, n), at(Algorithm::Ring, n));
        // The root sends n - 1 buffers; the ring at most 2 per rank.
        let per_peer = central / (n - 1) as f64;
        assert!(
            per_peer > 0.9 * b && per_peer < 1.3 * b,
            "central, n = {n}: {central} s, {per_peer} s per peer against {b} s per buffer"
        );
        assert!(ring < 2.0 * b, "ring, n = {n}: {ring}");
    }
    let ratio = |alg| at(alg, 8) / at(alg, 2);
    assert!(
        ratio(Algorithm::Central) > 5.0,
        "{}",
        ratio(Algorithm::Central)
    );
    assert!(ratio(Algorithm::Ring) < 2.0, "{}", ratio(Algorithm::Ring));
}

#[test]
#[ignore]
fn stress_simulator_speed() {
    for (coll, alg, count, seg) in [
        (Collective::AllReduce, Algorithm::Ring, 10007, 1),
        (Collective::AllReduce, Algorithm::Ring, 10007, 7),
        (Collective::ReduceScatter, Algorithm::Ring, 10007, 7),
        (
            Collective::ReduceScatter,
            Algorithm::Ring,
            10007,
            usize::MAX,
        ),
        (Collective::AllGather, Algorithm::Ring, 10007, usize::MAX),
        (Collective::ReduceScatter, Algorithm::Ring, 1000, 7),
        (Collective::AllReduce, Algorithm::RecursiveDoubling, 1000, 1),
        (Collective::AllReduce, Algorithm::Ring, 3, 1),
    ] {
        let ps: Vec<Params> = params(coll, alg, 16, count)
            .into_iter()
            .map(|p| Params { segment: seg, ..p })
            .collect();
        let inputs: Vec<Vec<u8>> = ps
            .iter()
            .map(|p| {
                gen_input(
                    DataType::F32,
                    ReduceOp::Sum,
                    InputKind::Exact,
                    p.input_elems(),
                    1,
                )
            })
            .collect();
        let ops: usize = ps.iter().map(|p| plan::build(p).unwrap().len()).sum();
        let t = std::time::Instant::now();
        let n = if count < 10 { 1000 } else { 1 };
        for _ in 0..n {
            let r = run(ps.clone(), DataType::F32, inputs.clone(), 1).unwrap();
            std::hint::black_box(r);
        }
        let dt = t.elapsed().as_secs_f64() / n as f64;
        let steps = run(ps.clone(), DataType::F32, inputs.clone(), 1)
            .unwrap()
            .stats
            .steps;
        let t = std::time::Instant::now();
        for _ in 0..n {
            std::hint::black_box(predict(&ps, DataType::F32, &LinkModel::default()).unwrap());
        }
        let tp = t.elapsed().as_secs_f64() / n as f64;
        eprintln!(
            "steps/op {:.2}, predict {:.3} s",
            steps as f64 / ops as f64,
            tp
        );
        eprintln!(
            "{coll} {alg} count {count} seg {seg}: {ops} ops, {:.3} s, {:.0} ns/op",
            dt,
            dt * 1e9 / ops as f64
        );
    }
}
