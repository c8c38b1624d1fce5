//! Tree schedules: broadcast, reduce, the tree all-reduce (reduce to rank 0, then broadcast), the
//! double binary tree all-reduce, and the central all-reduce on a star.
//!
//! Ranks are renumbered relative to the root (`v = (rank - root) mod n`) and arranged in a
//! tree; data flows down it for a broadcast and up it for a reduce, one segment at a time.
//!
//! # Binomial tree ([`Algorithm::Tree`](super::params::Algorithm::Tree))
//!
//! Rank `v`'s parent is `v` with its lowest set bit cleared; its children are `v + m` for every
//! power of two `m` below `v`'s lowest set bit (every `m < n` for the root). In round `k` of an
//! unsegmented broadcast every rank that has the data sends it `2^k` further, so after
//! `ceil(log2 n)` rounds all ranks have it: latency `ceil(log2 n) * alpha` against the ring's
//! `n - 1`, the reason trees win for small messages and large worlds. The price is bandwidth: the
//! root sends the whole buffer once per child, `log2 n` times.
//!
//! # Chain ([`Algorithm::Ring`](super::params::Algorithm::Ring) for broadcast and reduce)
//!
//! Rank `v` receives from `v - 1` and sends to `v + 1`. Unsegmented that is `n - 1` latencies,
//! but pipelined in `S` segments it takes `(n - 1 + S)` segment times: for large buffers
//! (`S >> n`) every link carries the buffer exactly once, the bandwidth optimum.
//!
//! # Star ([`Algorithm::Central`](super::params::Algorithm::Central) for all-reduce)
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
//! In the tree all-reduce a rank folds segment `j` of its children only once it has the result
//! of segment `j - L` (received from its parent, or, at the root, folded), so no child runs
//! more than `L` segments ahead of the broadcast. Without that bound a leaf child, whose sends
//! wait for nothing, takes most of its parent's download while a sibling, which forwards a
//! subtree and shares its own upload with the broadcast down, falls behind: the parent's
//! download is then full while results trickle out, and half idle while the late child catches
//! up. On emulated hosts at 1 Gbit/s (`scripts/emuhosts.py`) the two phases alternated about
//! once a second, and a 64 MiB all-reduce took 1.55 times as long on 4 hosts and 1.3 times on
//! 8 as with the bound.
//!
//! The lead `L` (`fold_lead`) must cover the time from folding a segment to having its
//! result, and every level below a rank adds a round trip to it: the root's fold of segment
//! `j` waits for its child's, which waits for the grandchild's, each gated by a result that
//! came down the same way. So `L` is 3 up to 4 ranks and `2 levels - 1` above (5 on 8 ranks,
//! 7 on 16). 64 MiB on emulated hosts, the leads taking turns, 2 or 3 runs of 3 calls: on 4
//! hosts at 1 Gbit/s leads of 3 to 6 all took 1.19-1.21 s a call (3 the fastest by 1%); on 8
//! hosts a lead of 3 took 2.09-2.14 s, 5 took 1.80-1.82 s (the model's 1.77 s), 8 and 12
//! 1.84-1.90 s; on 8 hosts at 300 Mbit/s 7.56-7.57 s with 3, 6.50-6.55 with 5, 6.64-6.82 with
//! 7. On 16 hosts at 300 Mbit/s, 16 MiB: 2.90 s with 3, 2.51 with 5, 2.57 with 7, 2.61 with 9.
//! Where TCP loses packets a child's loss recovery stalls its siblings through the bound, where
//! they would otherwise use the link; the longer lead leaves them more room.
//!
//! # Segments across hosts
//!
//! A segment crosses every level of the tree twice, up and down, and a rank forwards it only
//! once it has all of it, so a buffer of one or two segments crosses the levels one after the
//! other with most links idle. Across hosts ([`Params::local_size`] below the world) the tree
//! all-reduce therefore cuts four segments per level (`count / (4 levels)`), but none under an
//! eighth of the caller's segment (64 KiB of the default 512 KiB: a buffer of 128 KiB on 4 hosts
//! stays two segments) and none over it (from `4 levels` caller's segments on nothing changes:
//! 4 MiB on 4 hosts, 6 MiB on 8). On emulated hosts (`scripts/emuhosts.py`, the binaries taking
//! turns, medians of 5 runs of 3 calls) segments of 512 KiB against these took at 1 MiB 29.8
//! against 20.9 ms on 4 hosts and 51.6 against 34.0 on 8 at 1 Gbit/s, 96.2 against 70.2 and
//! 168.2 against 121.0 at 300 Mbit/s. Two segments per level took 24.2 and 39.8 ms at
//! 1 Gbit/s in runs of their own; two against four, taking turns (3 runs, 1 Gbit/s): 10.2 and
//! 9.8 ms at 512 KiB on 4 hosts, 51.6 and 45.7 at 2 MiB, and on 8 hosts 82.2 and 72.0 at 2 MiB,
//! 158.1 and 148.4 at 4 MiB. On one host the caller's segment stays.
//!
//! # Buffers
//!
//! A reduce accumulates at the root in `Output` (`Output = Input op child_1`, then
//! `Output = Output op child_2`, ...) and at interior ranks in scratch, since a non-root must not
//! write `Output`. The tree all-reduce accumulates in `Output` everywhere (every rank's `Output`
//! ends with the result anyway); a rank's receive of the broadcast then waits until its own
//! contribution has left `Output` for its parent. For `Avg` only the root divides, once.

use super::common::{alone, finalizes, pipeline_segment, segments};
use super::params::Params;
use super::program::{Buf, Loc, Op, OpId, Program};

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
/// `dst = own op incoming`, the others into `dst = dst op incoming`; the first waits for
/// `after`, if any. Returns where the accumulated value is and the last op that wrote it.
fn fold_children(
    prog: &mut Program,
    children: &[usize],
    own: Loc,
    dst: Loc,
    len: usize,
    after: Option<OpId>,
) -> (Loc, Option<OpId>) {
    let mut acc = own;
    let mut last: Option<OpId> = after;
    if children.is_empty() {
        return (acc, None);
    }
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
        return alone(p);
    }
    for (off, len) in segments(p.count, p.segment) {
        let own = Loc::new(own_buf, off);
        let acc_buf = if me.is_root {
            Buf::Output
        } else {
            Buf::Scratch
        };
        let (acc, last) = fold_children(
            &mut prog,
            &me.children,
            own,
            Loc::new(acc_buf, off),
            len,
            None,
        );
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

/// Segments by which a rank of the tree all-reduce over `world` ranks may fold its children's
/// contributions ahead of the results it has (see the module docs, "Pipelining"): 3 up to 4
/// ranks, then two more for every further level of the binomial tree (`2 levels - 1`), since
/// each level below a rank adds a round trip to the time between folding a segment and having
/// its result.
pub(crate) fn fold_lead(world: usize) -> usize {
    (2 * levels(world)).saturating_sub(1).max(3)
}

/// Levels of the binomial tree over `world` ranks (at least 1).
fn levels(world: usize) -> usize {
    world.max(2).next_power_of_two().trailing_zeros() as usize
}

/// The segment of the binomial tree all-reduce: the caller's on one host; across hosts
/// ([`Params::local_size`] below the world) small enough for four segments per level of the tree
/// (`count / (4 levels)`), but not under an eighth of the caller's (64 KiB of the default
/// 512 KiB) nor over it, so that a buffer of a few segments still pipelines over the levels
/// (see the module docs, "Segments across hosts").
pub(crate) fn tree_segment(p: &Params) -> usize {
    if p.local_size == 0 || p.local_size >= p.world {
        return p.segment;
    }
    let floor = (p.segment / 8).max(1);
    pipeline_segment(p.count, 4 * levels(p.world), floor, p.segment)
}

/// Tree all-reduce: reduce to rank 0 up a tree of `shape`, then broadcast from rank 0 down the same
/// tree, both pipelined by segment and accumulating in `Output`. With [`Shape::Star`] this is the
/// central all-reduce.
pub(crate) fn all_reduce(p: &Params, shape: Shape) -> Program {
    let mut prog = Program::new();
    let me = node(shape, p.rank, 0, p.world);
    let own_buf = if p.in_place { Buf::Output } else { Buf::Input };
    if p.world == 1 {
        return alone(p);
    }
    // The op after which each segment's result is in `Output`.
    let mut results: Vec<OpId> = Vec::new();
    let lead = fold_lead(p.world);
    let seg = if shape == Shape::Binomial {
        tree_segment(p)
    } else {
        p.segment
    };
    for (j, (off, len)) in segments(p.count, seg).enumerate() {
        let out = Loc::new(Buf::Output, off);
        let own = Loc::new(own_buf, off);
        let after = j.checked_sub(lead).map(|k| results[k]);
        let (acc, mut last) = fold_children(&mut prog, &me.children, own, out, len, after);
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
        results.push(have);
    }
    prog
}

// ---- double binary tree ------------------------------------------------------------------------

/// The in-order binary tree over positions `1..=n`: position `p` with lowest set bit `b` has
/// children `p - b/2` and `p + b/2`, and its parent is whichever of `p - b`, `p + b` has lowest
/// set bit `2b`. Positions above `n` do not exist: a child out of range is replaced by its own
/// left descendant in range, and a parent out of range by its own parent. The root is the
/// largest power of two `<= n`; odd positions are leaves, even ones interior.
fn bt_parent(p: usize, n: usize) -> Option<usize> {
    if p == 1usize << (usize::BITS - 1 - n.leading_zeros()) {
        return None;
    }
    let mut q = p;
    loop {
        let b = q & q.wrapping_neg();
        q = (q | (b << 1)) & !b;
        if q <= n {
            return Some(q);
        }
    }
}

/// Children of position `p` (left first) in the tree of [`bt_parent`].
fn bt_children(p: usize, n: usize) -> Vec<usize> {
    let b = p & p.wrapping_neg();
    if b == 1 {
        return Vec::new();
    }
    let mut kids = vec![p - b / 2];
    let mut c = p + b / 2;
    while c > n && c & 1 == 0 {
        c -= (c & c.wrapping_neg()) / 2;
    }
    if c <= n {
        kids.push(c);
    }
    kids
}

/// Position of `rank` in tree `t` (0 or 1) of the double binary tree over `n` ranks, and back.
///
/// Tree 0 puts rank `r` at position `r + 1`: its interior ranks are the odd ones. Tree 1 puts
/// them elsewhere so that its interior ranks are even: mirrored (`r = n - p`) when `n` is even,
/// shifted by one (`r = p mod n`) when `n` is odd. So every rank is interior in at most one of
/// the two trees and forwards at most one tree's traffic (NCCL's construction).
fn dt_position(t: usize, rank: usize, n: usize) -> usize {
    match t {
        0 => rank + 1,
        _ if n.is_multiple_of(2) => n - rank,
        _ if rank == 0 => n,
        _ => rank,
    }
}

fn dt_rank(t: usize, p: usize, n: usize) -> usize {
    match t {
        0 => p - 1,
        _ if n.is_multiple_of(2) => n - p,
        _ => p % n,
    }
}

/// One rank's place in tree `t` of the double binary tree: parent, children (in fold order) as
/// ranks, its depth and the depth of the tree.
struct DtNode {
    parent: Option<usize>,
    children: Vec<usize>,
    depth: usize,
    height: usize,
}

fn dt_depth(p: usize, n: usize) -> usize {
    let mut d = 0;
    let mut q = p;
    while let Some(up) = bt_parent(q, n) {
        q = up;
        d += 1;
    }
    d
}

fn dt_node(t: usize, rank: usize, n: usize) -> DtNode {
    let p = dt_position(t, rank, n);
    DtNode {
        parent: bt_parent(p, n).map(|q| dt_rank(t, q, n)),
        children: bt_children(p, n)
            .into_iter()
            .map(|c| dt_rank(t, c, n))
            .collect(),
        depth: dt_depth(p, n),
        height: (1..=n).map(|q| dt_depth(q, n)).max().unwrap_or(0),
    }
}

/// The ranks that are interior (have children) in tree `t` of the double binary tree over `n`
/// ranks; for tests and documentation.
pub fn double_tree_interior(t: usize, n: usize) -> Vec<usize> {
    (0..n)
        .filter(|&r| !bt_children(dt_position(t, r, n), n).is_empty())
        .collect()
}

/// The smallest pipeline segment of the double binary tree, in elements.
const DT_MIN_SEGMENT: usize = 1024;

/// Double binary tree all-reduce: the buffer is split in two halves, and each half is reduced up
/// one of two binary trees and broadcast back down the same tree, pipelined by segment. A rank
/// is interior in at most one tree (see [`dt_position`]), so no rank sends more than twice the
/// buffer (as in a ring) while the depth stays `log2 n`: the latency of a tree with close to
/// the bandwidth of the ring for large buffers.
///
/// # Message order
///
/// The two trees share links (rank a may send tree 0's partial sums to rank b while it forwards
/// tree 1's result to it), and messages between two ranks match in FIFO order. Both ends must
/// therefore order them alike, and the order decides how well the two trees pipeline. Every
/// message gets a step: going up, segment `j` leaves a rank at depth `d` at step `j + H - d` (H:
/// the tree's height), as in an ideal lock-step execution; going down, at step `j + H + d + S`,
/// where the slack `S = 2 H + 4` lets the partial sums of later segments overtake results that
/// are late. A rank's program lists its ops by step (then tree), which keeps every dependency
/// before its dependent (a dependency always has a smaller step, so no order of this kind can
/// deadlock), and both ends of a link see its messages in the same order.
///
/// Segments are the caller's, but smaller when a half is short: at least two per hop of the
/// tree's height, of at least 1024 elements, so that small buffers still pipeline.
///
/// Each tree folds a rank's own contribution, then its children's in a fixed order, and the
/// root's result is what every rank receives: the bits do not depend on timing. For `Avg` each
/// tree's root divides its half, once.
pub(crate) fn double_tree_all_reduce(p: &Params) -> Program {
    let n = p.world;
    let mut prog = Program::new();
    if n == 1 {
        return alone(p);
    }
    let own_buf = if p.in_place { Buf::Output } else { Buf::Input };
    let half = p.count.div_ceil(2);
    // (step, tree, op, deps as indices into `ops`), generated in dependency order per tree.
    let mut ops: Vec<((usize, usize), Op, Vec<usize>)> = Vec::new();
    for (t, (base, len)) in [(0, half), (half, p.count - half)].into_iter().enumerate() {
        let me = dt_node(t, p.rank, n);
        let (d, h) = (me.depth, me.height);
        // At least two segments per hop of the way up and down, so that the pipeline fills,
        // but no segment under DT_MIN_SEGMENT elements (nor above the caller's).
        let seg = pipeline_segment(len, 2 * h, DT_MIN_SEGMENT, p.segment);
        // Results going down trail the partial sums going up by a round trip and some, so that
        // one tree's traffic waits for the other's only when it is that far behind.
        let slack = 2 * h + 4;
        for (j, (off, l)) in segments(len, seg).enumerate() {
            let out = Loc::new(Buf::Output, base + off);
            let mut acc = Loc::new(own_buf, base + off);
            let mut last: Option<usize> = None;
            for &c in &me.children {
                let op = Op::Recv {
                    peer: c,
                    dst: out,
                    reduce_with: Some(acc),
                    len: l,
                };
                ops.push(((j + h - d - 1, t), op, last.into_iter().collect()));
                last = Some(ops.len() - 1);
                acc = out;
            }
            let have = match me.parent {
                None => {
                    if finalizes(p) {
                        let op = Op::Finalize { loc: out, len: l };
                        ops.push(((j + h - 1, t), op, last.into_iter().collect()));
                        last = Some(ops.len() - 1);
                    }
                    last.expect("a root in a world above one has children")
                }
                Some(parent) => {
                    let up = Op::Send {
                        peer: parent,
                        src: acc,
                        len: l,
                    };
                    ops.push(((j + h - d, t), up, last.into_iter().collect()));
                    let up = ops.len() - 1;
                    // The result overwrites `Output`, which the send up may still be reading.
                    let war = if acc.buf == Buf::Output {
                        vec![up]
                    } else {
                        Vec::new()
                    };
                    let down = Op::Recv {
                        peer: parent,
                        dst: out,
                        reduce_with: None,
                        len: l,
                    };
                    ops.push(((j + h + d - 1 + slack, t), down, war));
                    ops.len() - 1
                }
            };
            for &c in me.children.iter().rev() {
                let op = Op::Send {
                    peer: c,
                    src: out,
                    len: l,
                };
                ops.push(((j + h + d + slack, t), op, vec![have]));
            }
        }
    }
    let mut order: Vec<usize> = (0..ops.len()).collect();
    order.sort_by_key(|&i| ops[i].0);
    let mut id_of: Vec<Option<OpId>> = vec![None; ops.len()];
    for &i in &order {
        let deps: Vec<OpId> = ops[i]
            .2
            .iter()
            .map(|&k| id_of[k].expect("dependency placed first"))
            .collect();
        id_of[i] = Some(prog.push(ops[i].1, &deps));
    }
    prog
}
