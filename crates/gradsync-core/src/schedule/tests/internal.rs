//! The post's place in the send queues, and the shape of the eager and deterministic programs.

use super::*;
use crate::{Collective, ReduceOp};

fn params(world: usize, count: usize, algorithm: Algorithm) -> Params {
    Params {
        coll: Collective::AllReduce,
        rank: 0,
        world,
        count,
        root: 0,
        op: ReduceOp::Sum,
        segment: usize::MAX,
        in_place: false,
        algorithm,
        local_size: 0,
    }
}

/// Every combination of the parameters the shape tests run: `(params, program)` for every rank.
fn cases(algorithm: Algorithm) -> Vec<(Params, Program)> {
    let mut out = Vec::new();
    for world in 1..=16 {
        for count in [0, 1, 3, world - 1, 37, 1000] {
            for segment in [1, 7, 64, usize::MAX] {
                if segment == 1 && count == 1000 && world > 4 {
                    continue;
                }
                for in_place in [false, true] {
                    for op in [ReduceOp::Sum, ReduceOp::Avg] {
                        for rank in 0..world {
                            let p = Params {
                                rank,
                                segment,
                                in_place,
                                op,
                                ..params(world, count, algorithm)
                            };
                            out.push((p, build(&p).unwrap()));
                        }
                    }
                }
            }
        }
    }
    out
}

fn count(prog: &Program, f: impl Fn(&Op) -> bool) -> usize {
    prog.ops().iter().filter(|o| f(o)).count()
}

#[test]
fn a_post_joins_the_send_queue_of_every_peer() {
    let l = |s| Loc::new(Buf::Output, s);
    let send = |peer, s| Op::Send {
        peer,
        src: l(s),
        len: 1,
    };
    let mut p = Program::new();
    let r0 = p.push(
        Op::Recv {
            peer: 1,
            dst: l(0),
            reduce_with: None,
            len: 1,
        },
        &[],
    );
    let s0 = p.push(send(1, 0), &[r0]);
    let post = p.push(Op::Post { src: l(1), len: 1 }, &[]);
    let s1 = p.push(send(2, 2), &[]);
    let s2 = p.push(send(1, 3), &[]);
    let c = p.push(
        Op::Copy {
            src: l(4),
            dst: l(5),
            len: 1,
        },
        &[],
    );
    let mut s = Schedule::new(p, 3);
    let mut order = Vec::new();
    let drain = |s: &mut Schedule, order: &mut Vec<OpId>| {
        while let Some((id, _)) = s.poll_action() {
            order.push(id);
        }
    };
    for round in 0..2 {
        order.clear();
        // The post waits behind the send to peer 1 (which waits for the receive); the sends after
        // it wait for it, whichever peer they go to; local ops wait for nothing.
        drain(&mut s, &mut order);
        assert_eq!(order, [r0, c], "round {round}");
        s.handle_complete(r0);
        drain(&mut s, &mut order);
        assert_eq!(order, [r0, c, s0, post, s1, s2], "round {round}");
        for id in [c, s2, s1, post, s0] {
            s.handle_complete(id);
        }
        assert!(s.is_done());
        s.restart();
    }
}

#[test]
fn eager_programs() {
    for (p, prog) in cases(Algorithm::Eager) {
        let (n, r) = (p.world, p.rank);
        let ctx = format!("{p:?}");
        if n == 1 || p.count == 0 {
            let copies = if n == 1 && !p.in_place && p.count > 0 {
                p.count.div_ceil(p.segment)
            } else {
                0
            };
            assert_eq!(prog.len(), copies, "{ctx}");
            continue;
        }
        if n == 2 {
            check_eager_pair(&p, &prog, &ctx);
            continue;
        }
        assert_eq!(prog.scratch_elems(), n * p.count, "{ctx}");
        assert_eq!(count(&prog, |o| matches!(o, Op::Send { .. })), 0, "{ctx}");
        assert_eq!(count(&prog, |o| matches!(o, Op::Post { .. })), 1, "{ctx}");
        assert_eq!(count(&prog, |o| matches!(o, Op::Copy { .. })), 1, "{ctx}");
        let fin = usize::from(p.op == ReduceOp::Avg);
        assert_eq!(count(&prog, |o| matches!(o, Op::Finalize { .. })), fin);
        // One whole-buffer message from every peer, into its part, whatever the segment.
        let mut peers: Vec<usize> = Vec::new();
        for op in prog.ops() {
            if let Op::Recv {
                peer,
                dst,
                reduce_with,
                len,
            } = *op
            {
                assert_eq!(
                    (dst, reduce_with, len),
                    (Loc::new(Buf::Scratch, peer * p.count), None, p.count)
                );
                peers.push(peer);
            }
        }
        let want: Vec<usize> = (1..n).map(|k| (r + k) % n).collect();
        assert_eq!(peers, want, "{ctx}");
        // The reduction waits for every part, and reads them all.
        let (id, reduce) = prog
            .ops()
            .iter()
            .enumerate()
            .find(|(_, o)| matches!(o, Op::ReduceParts { .. }))
            .expect("one reduction");
        assert_eq!(
            *reduce,
            Op::ReduceParts {
                src: Loc::new(Buf::Scratch, 0),
                dst: Loc::new(Buf::Output, 0),
                len: p.count
            }
        );
        // In place it also waits for the post, which reads what it overwrites.
        let deps = n + usize::from(p.in_place);
        assert_eq!(prog.deps(id as OpId).len(), deps, "{ctx}");
    }
}

/// Two ranks: a post and one receive that reduces into the output; in place, the receive waits
/// for the (buffered) post, whose source it overwrites.
fn check_eager_pair(p: &Params, prog: &Program, ctx: &str) {
    let out = Loc::new(Buf::Output, 0);
    let mine = if p.in_place {
        out
    } else {
        Loc::new(Buf::Input, 0)
    };
    let mut want = vec![
        Op::Post {
            src: mine,
            len: p.count,
        },
        Op::Recv {
            peer: 1 - p.rank,
            dst: out,
            reduce_with: Some(mine),
            len: p.count,
        },
    ];
    if p.op == ReduceOp::Avg {
        want.push(Op::Finalize {
            loc: out,
            len: p.count,
        });
    }
    assert_eq!(prog.ops(), &want[..], "{ctx}");
    assert_eq!(prog.scratch_elems(), 0, "{ctx}");
    let deps: &[OpId] = if p.in_place { &[0] } else { &[] };
    assert_eq!(prog.deps(1), deps, "{ctx}");
}

#[test]
fn deterministic_programs() {
    use super::super::deterministic::{piece_elems, scratch_elems};
    for (p, prog) in cases(Algorithm::Deterministic) {
        let (n, r) = (p.world, p.rank);
        let ctx = format!("{p:?}");
        if n == 1 || p.count == 0 {
            assert_eq!(prog.scratch_elems(), 0, "{ctx}");
            continue;
        }
        let piece = piece_elems(&p);
        let pieces = p.count.div_ceil(piece);
        assert_eq!(piece, p.count.min(p.segment));
        assert_eq!(prog.scratch_elems(), scratch_elems(&p), "{ctx}");
        assert_eq!(prog.scratch_elems(), pieces.min(2) * n * piece, "{ctx}");
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let mut reductions = Vec::new();
        for op in prog.ops() {
            assert!(op.len() <= p.segment, "{ctx}: {op:?}");
            match *op {
                Op::Send { peer, .. } => assert_eq!(peer, right, "{ctx}"),
                Op::Recv {
                    peer, reduce_with, ..
                } => assert_eq!((peer, reduce_with), (left, None), "{ctx}"),
                Op::ReduceParts { src, dst, len } => reductions.push((src, dst, len)),
                Op::Post { .. } => panic!("{ctx}: a post"),
                _ => {}
            }
        }
        assert_eq!(
            count(&prog, |o| matches!(o, Op::Send { .. })),
            pieces * (n - 1)
        );
        let fin = if p.op == ReduceOp::Avg { pieces } else { 0 };
        assert_eq!(count(&prog, |o| matches!(o, Op::Finalize { .. })), fin);
        // Piece after piece, alternating between the two halves of scratch.
        assert_eq!(reductions.len(), pieces, "{ctx}");
        for (k, &(src, dst, len)) in reductions.iter().enumerate() {
            let half = Loc::new(Buf::Scratch, (k % 2) * n * piece);
            let out = Loc::new(Buf::Output, k * piece);
            assert_eq!((src, dst, len), (half, out, piece.min(p.count - k * piece)));
        }
    }
}

/// The tree all-reduce folds a segment's contributions only once the result of the segment
/// `fold_lead(world)` before it is in `Output` (3 up to 4 ranks, `2 levels - 1` above), on every
/// rank with children, whatever the world, the segment and the place; ranks without children send
/// whenever their parent takes it.
#[test]
fn the_tree_all_reduce_folds_at_most_fold_lead_segments_ahead_of_its_results() {
    use super::tree::fold_lead;
    let seg = 8;
    for world in 2..=16 {
        let lead = fold_lead(world);
        // 3 up to 4 ranks, then two more for every further level.
        let levels = (world as f64).log2().ceil() as usize;
        assert_eq!(
            lead,
            if world <= 4 { 3 } else { 2 * levels - 1 },
            "world {world}"
        );
        let nseg = lead + 4;
        for in_place in [false, true] {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                for rank in 0..world {
                    let p = Params {
                        rank,
                        segment: seg,
                        in_place,
                        op,
                        ..params(world, nseg * seg - 3, Algorithm::Tree)
                    };
                    let prog = build(&p).unwrap();
                    let ops = prog.ops();
                    let ctx = format!("world {world} rank {rank} in_place {in_place} {op:?}");
                    // Per segment, the first fold (a receive that reduces) and the op after
                    // which its result is in `Output`: the last op writing `Output` there.
                    let mut first_fold = vec![None; nseg];
                    let mut result = vec![None; nseg];
                    for (id, o) in ops.iter().enumerate() {
                        let id = id as OpId;
                        match o {
                            Op::Recv {
                                dst, reduce_with, ..
                            } if dst.buf == Buf::Output => {
                                let j = dst.start / seg;
                                if reduce_with.is_some() && first_fold[j].is_none() {
                                    first_fold[j] = Some(id);
                                }
                                result[j] = Some(id);
                            }
                            Op::Finalize { loc, .. } => result[loc.start / seg] = Some(id),
                            _ => {}
                        }
                    }
                    let has_children = first_fold.iter().any(Option::is_some);
                    assert_eq!(has_children, rank % 2 == 0 && rank + 1 < world, "{ctx}");
                    for (j, f) in first_fold.iter().enumerate() {
                        let Some(f) = *f else { continue };
                        let want: Vec<OpId> = j
                            .checked_sub(lead)
                            .map(|k| result[k].expect("a result"))
                            .into_iter()
                            .collect();
                        assert_eq!(prog.deps(f), &want[..], "{ctx} segment {j}");
                    }
                }
            }
        }
    }
}

/// Across hosts the tree all-reduce cuts four segments per level of the binomial tree, none under
/// an eighth of the caller's segment nor over it; on one host (and for the star) it keeps the
/// caller's, and its messages are then no longer than that.
#[test]
fn the_tree_all_reduce_cuts_finer_segments_across_hosts() {
    use super::tree::tree_segment;
    let at = |world: usize, local_size: usize, count: usize, segment: usize| {
        tree_segment(&Params {
            segment,
            local_size,
            ..params(world, count, Algorithm::Tree)
        })
    };
    // One host: the caller's.
    assert_eq!(at(8, 0, 1 << 18, 1 << 17), 1 << 17);
    assert_eq!(at(8, 8, 1 << 18, 1 << 17), 1 << 17);
    // 8 hosts (3 levels) at 1 MiB of f32: 12 segments of 21846 elements instead of 2.
    assert_eq!(at(8, 1, 1 << 18, 1 << 17), (1usize << 18).div_ceil(12));
    assert_eq!(at(8, 2, 1 << 18, 1 << 17), (1usize << 18).div_ceil(12));
    // 4 hosts (2 levels) at 512 KiB: 8 segments of the floor.
    assert_eq!(at(4, 1, 1 << 17, 1 << 17), 1 << 14);
    // 4 hosts (2 levels) at 128 KiB: the floor, an eighth of the caller's segment.
    assert_eq!(at(4, 1, 1 << 15, 1 << 17), 1 << 14);
    // From 4 levels x the caller's segment on, the caller's.
    assert_eq!(at(4, 1, 1 << 20, 1 << 17), 1 << 17);
    assert_eq!(at(4, 1, (1 << 20) - 8, 1 << 17), (1 << 17) - 1);
    assert_eq!(at(3, 1, 100, 1), 1);
    // The programs' messages follow it, on every rank; the star keeps the caller's segment.
    for (world, local_size, shape) in [
        (8, 1, Algorithm::Tree),
        (8, 2, Algorithm::Tree),
        (8, 0, Algorithm::Tree),
        (2, 1, Algorithm::Tree),
        (5, 1, Algorithm::Tree),
        (8, 1, Algorithm::Central),
    ] {
        let count = 1 << 18;
        let want = if shape == Algorithm::Tree {
            at(world, local_size, count, 1 << 17)
        } else {
            1 << 17
        };
        for rank in 0..world {
            let p = Params {
                rank,
                segment: 1 << 17,
                local_size,
                ..params(world, count, shape)
            };
            let lens: Vec<usize> = build(&p)
                .unwrap()
                .ops()
                .iter()
                .filter_map(|o| match o {
                    Op::Send { len, .. } | Op::Recv { len, .. } => Some(*len),
                    _ => None,
                })
                .collect();
            let ctx = format!("{shape} world {world} local_size {local_size} rank {rank}");
            assert_eq!(lens.iter().max(), Some(&want), "{ctx}");
            // Every message but a buffer's last piece is a whole segment.
            assert!(
                lens.iter().all(|&l| l == want || l == count % want),
                "{ctx}: {lens:?}"
            );
        }
    }
}

#[test]
fn the_wave_order_keeps_every_step_after_the_one_before() {
    use super::super::ring::wave_order;
    for steps in 1..=6 {
        for segs in 0..=12 {
            for lag in 1..=14 {
                let order: Vec<(usize, usize)> = wave_order(steps, segs, lag).collect();
                let ctx = format!("{steps} steps, {segs} segments, lag {lag}");
                assert_eq!(order.len(), steps * segs, "{ctx}");
                let mut at = vec![usize::MAX; steps * segs];
                for (i, &(s, j)) in order.iter().enumerate() {
                    assert!(s < steps && j < segs, "{ctx}: ({s}, {j})");
                    assert_eq!(at[s * segs + j], usize::MAX, "{ctx}: ({s}, {j}) twice");
                    at[s * segs + j] = i;
                }
                for s in 0..steps {
                    for j in 0..segs {
                        let i = at[s * segs + j];
                        if s > 0 {
                            assert!(at[(s - 1) * segs + j] < i, "{ctx}: ({s}, {j}) early");
                        }
                        if j > 0 {
                            assert!(at[s * segs + j - 1] < i, "{ctx}: ({s}, {j}) out of turn");
                        }
                    }
                }
                if lag >= segs {
                    let by_step: Vec<(usize, usize)> = (0..steps)
                        .flat_map(|s| (0..segs).map(move |j| (s, j)))
                        .collect();
                    assert_eq!(order, by_step, "{ctx}: step by step");
                }
            }
        }
    }
}

/// The sources of the sends of `prog`, in program order.
fn send_srcs(prog: &Program) -> Vec<Loc> {
    prog.ops()
        .iter()
        .filter_map(|o| match o {
            Op::Send { src, .. } => Some(*src),
            _ => None,
        })
        .collect()
}

/// The lengths of the messages `prog` sends to `peer` (`send`) or receives from it, in program
/// order.
fn message_lens(prog: &Program, peer: usize, send: bool) -> Vec<usize> {
    prog.ops()
        .iter()
        .filter_map(|o| match *o {
            Op::Send { peer: p, len, .. } if send && p == peer => Some(len),
            Op::Recv { peer: p, len, .. } if !send && p == peer => Some(len),
            _ => None,
        })
        .collect()
}

#[test]
fn the_ring_all_reduce_forwards_a_reduced_segment_within_eight_sends_on_two_ranks() {
    // 2 ranks, 100 elements, segments of 5: blocks of 50 in 10 pieces. Rank 0 reduces block 0
    // (offsets 0..50) and sends it in the all-gather from `Output`; its reduce-scatter sends
    // block 1 (50..100) from `Input`.
    let p = Params {
        segment: 5,
        ..params(2, 100, Algorithm::Ring)
    };
    let prog = build(&p).unwrap();
    let sends: Vec<(bool, usize)> = send_srcs(&prog)
        .iter()
        .map(|src| (src.buf == Buf::Output, src.start))
        .collect();
    assert_eq!(sends.len(), 20);
    for j in 0..10 {
        let rs = sends
            .iter()
            .position(|&s| s == (false, 50 + 5 * j))
            .unwrap();
        let ag = sends.iter().position(|&s| s == (true, 5 * j)).unwrap();
        assert!(
            ag > rs && ag <= rs + 8,
            "segment {j}: sent at {rs} and {ag}: {sends:?}"
        );
    }
    // On 3 ranks the steps go one after the other: all of a step's sends before the next's.
    for rank in 0..3 {
        let p3 = Params {
            rank,
            segment: 5,
            ..params(3, 150, Algorithm::Ring)
        };
        let offs: Vec<usize> = send_srcs(&build(&p3).unwrap())
            .iter()
            .map(|src| src.start)
            .collect();
        assert_eq!(offs.len(), 40);
        for step in offs.chunks(10) {
            let block = step[0] / 50;
            assert!(
                step.iter().all(|o| o / 50 == block),
                "rank {rank}: {offs:?}"
            );
        }
    }
}

#[test]
fn ring_all_reduce_neighbours_send_and_receive_the_same_messages_in_the_same_order() {
    use super::super::common::block_range;
    // Blocks of unequal piece counts (count not a multiple of world x segment), on two ranks
    // with more pieces than the wave's lag and on more ranks step by step.
    for world in [2, 3, 4] {
        for count in [11, 23, 37, 61] {
            for segment in [1, 2, 3] {
                for in_place in [false, true] {
                    let progs: Vec<Program> = (0..world)
                        .map(|rank| {
                            let p = Params {
                                rank,
                                segment,
                                in_place,
                                op: ReduceOp::Avg,
                                ..params(world, count, Algorithm::Ring)
                            };
                            build(&p).unwrap()
                        })
                        .collect();
                    for r in 0..world {
                        let right = (r + 1) % world;
                        let sent = message_lens(&progs[r], right, true);
                        let got = message_lens(&progs[right], r, false);
                        let ctx = format!("{world} ranks, {count} elements, segment {segment}");
                        assert_eq!(sent, got, "{ctx}: {r} to {right}");
                        // Every block but this rank's in the reduce-scatter, every block but
                        // the right neighbour's in the all-gather.
                        let block = |b: usize| block_range(count, world, b).len();
                        assert_eq!(
                            sent.iter().sum::<usize>(),
                            2 * count - block(r) - block(right),
                            "{ctx}"
                        );
                    }
                }
            }
        }
    }
}
