//! Tree schedules: broadcast, reduce, the tree all-reduce (reduce to rank 0, then broadcast), and
//! the central all-reduce on a star.
//!
//! Ranks are renumbered relative to the root (`v = (rank - root) mod n`) and arranged in a
//! tree; data flows down it for a broadcast and up it for a reduce, one segment at a time.
//!
//! # Binomial tree ([`Algorithm::Tree`](super::plan::Algorithm::Tree))
//!
//! Rank `v`'s parent is `v` with its lowest set bit cleared; its children are `v + m` for every
//! power of two `m` below `v`'s lowest set bit (every `m < n` for the root). In round `k` of an
//! unsegmented broadcast every rank that has the data sends it `2^k` further, so after
//! `ceil(log2 n)` rounds all ranks have it: latency `ceil(log2 n) * alpha` against the ring's
//! `n - 1`, the reason trees win for small messages and large worlds. The price is bandwidth: the
//! root sends the whole buffer once per child, `log2 n` times.
//!
//! # Chain ([`Algorithm::Ring`](super::plan::Algorithm::Ring) for broadcast and reduce)
//!
//! Rank `v` receives from `v - 1` and sends to `v + 1`. Unsegmented that is `n - 1` latencies,
//! but pipelined in `S` segments it takes `(n - 1 + S)` segment times: for large buffers
//! (`S >> n`) every link carries the buffer exactly once, the bandwidth optimum.
//!
//! # Star ([`Algorithm::Central`](super::plan::Algorithm::Central) for all-reduce)
//!
//! Rank 0 is the parent of every other rank: the central aggregator, or parameter server. In the
//! all-reduce every rank sends its whole buffer to rank 0, which folds the contributions in rank
//! order `((x_0 op x_1) op x_2) op ...`, segment by segment as they arrive, and sends the result
//! back to every rank. Rank 0's link thus carries `n - 1` buffers in and `n - 1` out, about
//! `2 (n - 1) * B * beta` against the ring's `2 (n - 1) / n * B * beta`: its bandwidth falls like
//! `1 / (n - 1)`. It is the baseline that benchmarks compare the ring against.
//!
//! # Pipelining
//!
//! Every segment flows through the tree independently: a rank forwards segment `j` as soon as it
//! has received (broadcast) or accumulated (reduce) segment `j`, while segment `j + 1` is still
//! on its way. Children are served largest subtree first in a broadcast (they have the longest
//! path ahead); in a reduce, a rank folds its children's contributions in a fixed order, smallest
//! subtree first (it arrives first), so the result's bits never depend on timing.
//!
//! # Buffers
//!
//! A reduce accumulates at the root in `Output` (`Output = Input op child_1`, then
//! `Output = Output op child_2`, ...) and at interior ranks in scratch, since a non-root must not
//! write `Output`. The tree all-reduce accumulates in `Output` everywhere (every rank's `Output`
//! ends with the result anyway); a rank's receive of the broadcast then waits until its own
//! contribution has left `Output` for its parent. For `Avg` only the root divides, once.

use super::plan::{Params, copy_segments, finalizes, segments};
use super::{Buf, Loc, Op, OpId, Program};

/// Shape of the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Binomial tree.
    Binomial,
    /// Chain `0 -> 1 -> ... -> n - 1`.
    Chain,
    /// Star: rank 0 is the parent of every other rank.
    Star,
}

/// Parent of relative rank `v`, `None` at the root.
fn parent(shape: Shape, v: usize) -> Option<usize> {
    match (v, shape) {
        (0, _) => None,
        (_, Shape::Binomial) => Some(v & (v - 1)),
        (_, Shape::Chain) => Some(v - 1),
        (_, Shape::Star) => Some(0),
    }
}

/// Children of relative rank `v`, smallest subtree first.
fn children(shape: Shape, v: usize, n: usize) -> Vec<usize> {
    match shape {
        Shape::Binomial => {
            let limit = if v == 0 {
                n.next_power_of_two()
            } else {
                v & v.wrapping_neg()
            };
            let mut kids = Vec::new();
            let mut m = 1;
            while m < limit {
                if v + m < n {
                    kids.push(v + m);
                }
                m <<= 1;
            }
            kids
        }
        Shape::Chain => (v + 1 < n).then_some(v + 1).into_iter().collect(),
        Shape::Star if v == 0 => (1..n).collect(),
        Shape::Star => Vec::new(),
    }
}

/// The tree as seen by one rank, in real ranks.
struct Node {
    is_root: bool,
    parent: Option<usize>,
    /// Smallest subtree first.
    children: Vec<usize>,
}

fn node(shape: Shape, rank: usize, root: usize, n: usize) -> Node {
    let v = (rank + n - root) % n;
    let real = |u: usize| (u + root) % n;
    Node {
        is_root: v == 0,
        parent: parent(shape, v).map(real),
        children: children(shape, v, n).into_iter().map(real).collect(),
    }
}

/// Broadcast from `p.root` down a tree of `shape`.
pub(crate) fn broadcast(p: &Params, shape: Shape) -> Program {
    let mut prog = Program::new();
    let me = node(shape, p.rank, p.root, p.world);
    for (off, len) in segments(p.count, p.segment) {
        let out = Loc::new(Buf::Output, off);
        if me.is_root {
            let src = if p.in_place {
                out
            } else {
                Loc::new(Buf::Input, off)
            };
            for &c in me.children.iter().rev() {
                prog.push(Op::Send { peer: c, src, len }, &[]);
            }
            if !p.in_place {
                prog.push(Op::Copy { src, dst: out, len }, &[]);
            }
        } else {
            let parent = me.parent.expect("non-root has a parent");
            let rcv = prog.push(
                Op::Recv {
                    peer: parent,
                    dst: out,
                    reduce_with: None,
                    len,
                },
                &[],
            );
            for &c in me.children.iter().rev() {
                prog.push(
                    Op::Send {
                        peer: c,
                        src: out,
                        len,
                    },
                    &[rcv],
                );
            }
        }
    }
    prog
}

/// Receives and folds the children's contributions to one segment: the first into
/// `dst = own op incoming`, the others into `dst = dst op incoming`. Returns where the
/// accumulated value is and the last op that wrote it.
fn fold_children(
    prog: &mut Program,
    children: &[usize],
    own: Loc,
    dst: Loc,
    len: usize,
) -> (Loc, Option<OpId>) {
    let mut acc = own;
    let mut last: Option<OpId> = None;
    for &c in children {
        let deps: Vec<OpId> = last.into_iter().collect();
        let op = Op::Recv {
            peer: c,
            dst,
            reduce_with: Some(acc),
            len,
        };
        last = Some(prog.push(op, &deps));
        acc = dst;
    }
    (acc, last)
}

/// Reduce to `p.root` up a tree of `shape`.
pub(crate) fn reduce(p: &Params, shape: Shape) -> Program {
    let mut prog = Program::new();
    let me = node(shape, p.rank, p.root, p.world);
    let own_buf = if p.in_place { Buf::Output } else { Buf::Input };
    if !me.is_root && !me.children.is_empty() {
        prog.reserve_scratch(p.count);
    }
    if me.is_root && me.children.is_empty() {
        // A world of one.
        if !p.in_place {
            let (i, o) = (Loc::new(Buf::Input, 0), Loc::new(Buf::Output, 0));
            copy_segments(&mut prog, i, o, p.count, p.segment, |_| None);
        }
        return prog;
    }
    for (off, len) in segments(p.count, p.segment) {
        let own = Loc::new(own_buf, off);
        let acc_buf = if me.is_root {
            Buf::Output
        } else {
            Buf::Scratch
        };
        let (acc, last) = fold_children(&mut prog, &me.children, own, Loc::new(acc_buf, off), len);
        let deps: Vec<OpId> = last.into_iter().collect();
        if me.is_root {
            if finalizes(p) {
                prog.push(Op::Finalize { loc: acc, len }, &deps);
            }
        } else {
            let parent = me.parent.expect("non-root has a parent");
            prog.push(
                Op::Send {
                    peer: parent,
                    src: acc,
                    len,
                },
                &deps,
            );
        }
    }
    prog
}

/// Tree all-reduce: reduce to rank 0 up a tree of `shape`, then broadcast from rank 0 down the same
/// tree, both pipelined by segment and accumulating in `Output`. With [`Shape::Star`] this is the
/// central all-reduce.
pub(crate) fn all_reduce(p: &Params, shape: Shape) -> Program {
    let mut prog = Program::new();
    let me = node(shape, p.rank, 0, p.world);
    let own_buf = if p.in_place { Buf::Output } else { Buf::Input };
    if p.world == 1 {
        if !p.in_place {
            let (i, o) = (Loc::new(Buf::Input, 0), Loc::new(Buf::Output, 0));
            copy_segments(&mut prog, i, o, p.count, p.segment, |_| None);
        }
        return prog;
    }
    for (off, len) in segments(p.count, p.segment) {
        let out = Loc::new(Buf::Output, off);
        let own = Loc::new(own_buf, off);
        let (acc, mut last) = fold_children(&mut prog, &me.children, own, out, len);
        let have: OpId = if me.is_root {
            if finalizes(p) {
                let deps: Vec<OpId> = last.into_iter().collect();
                last = Some(prog.push(Op::Finalize { loc: out, len }, &deps));
            }
            last.expect("a root with a world above one has children")
        } else {
            let parent = me.parent.expect("non-root has a parent");
            let deps: Vec<OpId> = last.into_iter().collect();
            let up = prog.push(
                Op::Send {
                    peer: parent,
                    src: acc,
                    len,
                },
                &deps,
            );
            // The result overwrites `Output`, which the send up may still be reading.
            let war: Vec<OpId> = if acc.buf == Buf::Output {
                vec![up]
            } else {
                Vec::new()
            };
            let op = Op::Recv {
                peer: parent,
                dst: out,
                reduce_with: None,
                len,
            };
            prog.push(op, &war)
        };
        for &c in me.children.iter().rev() {
            prog.push(
                Op::Send {
                    peer: c,
                    src: out,
                    len,
                },
                &[have],
            );
        }
    }
    prog
}
