//! Ring schedules: reduce-scatter, all-gather, and all-reduce as the two in sequence.
//!
//! The ranks form a ring `r -> r + 1 (mod n)`; every rank sends only to its right neighbour and
//! receives only from its left one. The buffer is cut into `n` blocks whose sizes differ by at
//! most one element ([`block_range`]).
//!
//! **Reduce-scatter** takes `n - 1` steps. At step `s` rank `r` sends block `r - 1 - s` (its own
//! contribution at step 0, afterwards the partial sum it received at step `s - 1`) and receives
//! block `r - 2 - s`, which it reduces with its own contribution on arrival
//! (`Recv { reduce_with }`). After the last step rank `r` holds block `r` reduced over all ranks.
//! Each block is reduced in one fixed order — it travels once around the ring, picking up one
//! contribution per hop — so its bits do not depend on timing.
//!
//! **All-gather** takes `n - 1` more steps: at step `t` rank `r` sends block `r - t` and
//! receives block `r - t - 1`, a plain copy. Every rank thus ends with the very bits the block's
//! owner computed, which is why all ranks agree bit for bit. For `ReduceOp::Avg` the owner
//! divides its block (`Op::Finalize`) before the all-gather starts, so the division too happens
//! once.
//!
//! # Why the ring is bandwidth-optimal
//!
//! In each of the `2 (n - 1)` steps every rank sends one block of `B / n` bytes and receives one,
//! all links busy at once. Each rank's link therefore carries `2 (n - 1) / n * B` bytes, and the
//! all-reduce takes `2 (n - 1) (alpha + B / n * beta)`. Any all-reduce must move at least
//! `2 (n - 1) / n * B` bytes over some rank's link (every rank must send its `B` bytes' worth of
//! contributions out, less its own share, and receive as much of the result), so for large `B`
//! the ring is optimal; this is the "bus bandwidth" factor of nccl-tests
//! ([`super::plan::bus_bandwidth_factor`]). Its weakness is the `2 (n - 1) alpha` latency term,
//! which is why small messages use recursive doubling instead.
//!
//! # Pipelining and buffers
//!
//! Every block is split into segments of at most `segment` elements and every dependency is per
//! segment: the step-`s` send of segment `j` waits only for the step-`s - 1` receive of segment
//! `j`. Out of place, nothing is copied up front: step-0 sends read `Input`, receives reduce
//! `Output = Input op incoming`, later sends read `Output`. For the stand-alone reduce-scatter,
//! `Output` holds only the result, so partial sums alternate between two scratch slices. In place,
//! the same programs read `Output` wherever they would read `Input`; the few write-after-read
//! hazards this creates (a block overwritten by the all-gather after the reduce-scatter sent it)
//! are explicit dependencies.

use super::plan::{Params, at, block_range, copy_segments, finalizes, segments};
use super::{Buf, Loc, Op, OpId, Program};

/// Ops of the reduce-scatter phase that later phases depend on.
struct RsPhase {
    /// Per step, per segment: the send.
    sends: Vec<Vec<OpId>>,
    /// Per segment of this rank's block: the last op writing its final value.
    last: Vec<OpId>,
}

/// Where the reduce-scatter phase finds and leaves data.
struct RsLayout<I, P, L> {
    /// Length of block `b`.
    len: L,
    /// This rank's contribution to block `b`.
    input: I,
    /// Where the partial of block `b` received at step `s` is kept (steps before the last).
    partial: P,
    /// Where this rank's fully reduced block goes.
    final_loc: Loc,
    /// Whether partials alternate between two slots that are reused every other step.
    double_buffered: bool,
}

fn rs_phase<I, P, L>(prog: &mut Program, p: &Params, lay: &RsLayout<I, P, L>) -> RsPhase
where
    I: Fn(usize) -> Loc,
    P: Fn(usize, usize) -> Loc,
    L: Fn(usize) -> usize,
{
    let (n, r, seg) = (p.world, p.rank, p.segment);
    debug_assert!(n >= 2);
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let mut sends: Vec<Vec<OpId>> = Vec::with_capacity(n - 1);
    let mut recvs: Vec<Vec<OpId>> = Vec::with_capacity(n - 1);
    for s in 0..n - 1 {
        let sb = (r + n - 1 - s) % n;
        let rb = (r + 2 * n - 2 - s) % n;
        let mut ss = Vec::new();
        for (j, (off, len)) in segments((lay.len)(sb), seg).enumerate() {
            let (src, deps) = if s == 0 {
                ((lay.input)(sb), Vec::new())
            } else {
                ((lay.partial)(sb, s - 1), vec![recvs[s - 1][j]])
            };
            ss.push(prog.push(
                Op::Send {
                    peer: right,
                    src: at(src, off),
                    len,
                },
                &deps,
            ));
        }
        let mut rs = Vec::new();
        for (j, (off, len)) in segments((lay.len)(rb), seg).enumerate() {
            let last_step = s == n - 2;
            let dst = if last_step {
                lay.final_loc
            } else {
                (lay.partial)(rb, s)
            };
            // The slot written now held the partial received two steps ago, which the previous
            // step's send read.
            let deps: Vec<OpId> = if lay.double_buffered && !last_step && s >= 2 {
                sends[s - 1].get(j).copied().into_iter().collect()
            } else {
                Vec::new()
            };
            let op = Op::Recv {
                peer: left,
                dst: at(dst, off),
                reduce_with: Some(at((lay.input)(rb), off)),
                len,
            };
            rs.push(prog.push(op, &deps));
        }
        sends.push(ss);
        recvs.push(rs);
    }
    let mut last = recvs.pop().unwrap_or_default();
    if finalizes(p) {
        for (j, (off, len)) in segments((lay.len)(r), seg).enumerate() {
            last[j] = prog.push(
                Op::Finalize {
                    loc: at(lay.final_loc, off),
                    len,
                },
                &[last[j]],
            );
        }
    }
    RsPhase { sends, last }
}

/// The all-gather phase: block `b` of every rank lives at `loc(b)`; this rank's own block is read
/// from `first_src` at step 0 after `first_deps[j]`; the receive of segment `j` at step `t` waits
/// for `recv_dep(t, j)`.
fn ag_phase(
    prog: &mut Program,
    p: &Params,
    len: impl Fn(usize) -> usize,
    loc: impl Fn(usize) -> Loc,
    first_src: Loc,
    first_deps: &[OpId],
    recv_dep: impl Fn(usize, usize) -> Option<OpId>,
) {
    let (n, r, seg) = (p.world, p.rank, p.segment);
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let mut prev: Vec<OpId> = Vec::new();
    for t in 0..n - 1 {
        let sb = (r + n - t) % n;
        let rb = (r + 2 * n - 1 - t) % n;
        for (j, (off, l)) in segments(len(sb), seg).enumerate() {
            let (src, deps): (Loc, Vec<OpId>) = if t == 0 {
                (first_src, first_deps.get(j).copied().into_iter().collect())
            } else {
                (loc(sb), vec![prev[j]])
            };
            prog.push(
                Op::Send {
                    peer: right,
                    src: at(src, off),
                    len: l,
                },
                &deps,
            );
        }
        let mut cur = Vec::new();
        for (j, (off, l)) in segments(len(rb), seg).enumerate() {
            let deps: Vec<OpId> = recv_dep(t, j).into_iter().collect();
            let op = Op::Recv {
                peer: left,
                dst: at(loc(rb), off),
                reduce_with: None,
                len: l,
            };
            cur.push(prog.push(op, &deps));
        }
        prev = cur;
    }
}

/// Ring all-reduce: reduce-scatter then all-gather over `Output`.
pub(crate) fn all_reduce(p: &Params) -> Program {
    let mut prog = Program::new();
    let (n, count) = (p.world, p.count);
    let src_buf = if p.in_place { Buf::Output } else { Buf::Input };
    if n == 1 {
        if !p.in_place {
            let (i, o) = (Loc::new(Buf::Input, 0), Loc::new(Buf::Output, 0));
            copy_segments(&mut prog, i, o, count, p.segment, |_| None);
        }
        return prog;
    }
    let start = |b: usize| block_range(count, n, b).start;
    let len = |b: usize| block_range(count, n, b).len();
    let lay = RsLayout {
        len,
        input: |b| Loc::new(src_buf, start(b)),
        partial: |b, _s| Loc::new(Buf::Output, start(b)),
        final_loc: Loc::new(Buf::Output, start(p.rank)),
        double_buffered: false,
    };
    let rs = rs_phase(&mut prog, p, &lay);
    let out = |b: usize| Loc::new(Buf::Output, start(b));
    // All-gather step t overwrites block r - 1 - t, which reduce-scatter step t sent: from
    // `Output` (a hazard) except at step 0 out of place, where it came from `Input`.
    let in_place = p.in_place;
    let rs_sends = &rs.sends;
    let recv_dep = |t: usize, j: usize| {
        (in_place || t > 0)
            .then(|| rs_sends[t].get(j).copied())
            .flatten()
    };
    ag_phase(&mut prog, p, len, out, out(p.rank), &rs.last, recv_dep);
    prog
}

/// Ring reduce-scatter. Partial sums alternate between two scratch slices of `count` elements.
pub(crate) fn reduce_scatter(p: &Params) -> Program {
    let mut prog = Program::new();
    let (n, count, r) = (p.world, p.count, p.rank);
    let src_buf = if p.in_place { Buf::Output } else { Buf::Input };
    let final_loc = Loc::new(Buf::Output, if p.in_place { r * count } else { 0 });
    if n == 1 {
        if !p.in_place {
            let i = Loc::new(Buf::Input, 0);
            copy_segments(&mut prog, i, final_loc, count, p.segment, |_| None);
        }
        return prog;
    }
    if n > 2 {
        prog.reserve_scratch(2 * count);
    }
    let lay = RsLayout {
        len: |_b| count,
        input: |b| Loc::new(src_buf, b * count),
        partial: |_b, s| Loc::new(Buf::Scratch, (s % 2) * count),
        final_loc,
        double_buffered: true,
    };
    rs_phase(&mut prog, p, &lay);
    prog
}

/// Ring all-gather.
pub(crate) fn all_gather(p: &Params) -> Program {
    let mut prog = Program::new();
    let (n, count, r) = (p.world, p.count, p.rank);
    let own = Loc::new(Buf::Output, r * count);
    let first_src = if p.in_place {
        own
    } else {
        copy_segments(
            &mut prog,
            Loc::new(Buf::Input, 0),
            own,
            count,
            p.segment,
            |_| None,
        );
        Loc::new(Buf::Input, 0)
    };
    if n == 1 {
        return prog;
    }
    let out = |b: usize| Loc::new(Buf::Output, b * count);
    ag_phase(&mut prog, p, |_| count, out, first_src, &[], |_, _| None);
    prog
}
