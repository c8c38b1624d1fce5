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
//! divides each piece of its block (`Op::Finalize`) before the all-gather sends it, so the
//! division too happens once.
//!
//! # Why the ring is bandwidth-optimal
//!
//! In each of the `2 (n - 1)` steps every rank sends one block of `B / n` bytes and receives one,
//! all links busy at once. Each rank's link therefore carries `2 (n - 1) / n * B` bytes, and the
//! all-reduce takes `2 (n - 1) (alpha + B / n * beta)`. Any all-reduce must move at least
//! `2 (n - 1) / n * B` bytes over some rank's link (every rank must send its `B` bytes' worth of
//! contributions out, less its own share, and receive as much of the result), so for large `B`
//! the ring is optimal; this is the "bus bandwidth" factor of nccl-tests
//! ([`super::params::bus_bandwidth_factor`]). Its weakness is the `2 (n - 1) alpha` latency term,
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
//!
//! A rank's messages to a peer leave in program order, so the order of the ops decides how far
//! apart a segment's receive and its forwarding are. The all-reduce on more than two ranks puts
//! them step by step (all of step `s`, then all of step `s + 1`): a whole block apart. On two
//! ranks, once a block has more than four pieces, it puts them as a wave, each step a few
//! segments behind the one before (`wave_order`, `wave_lag`), so that a reduced segment goes out again while it is in the
//! cache: at 64 MiB this took the ring from 1.12 to 0.94 of the double tree's time over shared
//! memory.
//!
//! The phases themselves work on any ring of ranks (`RingPos`: a position and two neighbours)
//! and any split of the blocks into pieces, so the hierarchical schedules ([`super::hier`]) run
//! them on rings inside and across hosts.

use std::ops::Range;

use super::common::{alone, at, block_range, copy_segments, finalizes, segments};
use super::params::Params;
use super::program::{Buf, Loc, Op, OpId, Program};

/// A ring of `n` ranks as one of them sees it. Position `pos` ends the reduce-scatter with block
/// `pos`; `right` and `left` are the real ranks of the neighbours at `pos + 1` and `pos - 1`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingPos {
    /// Ranks in the ring, at least 2.
    pub(crate) n: usize,
    /// This rank's position.
    pub(crate) pos: usize,
    /// Rank that this rank sends to.
    pub(crate) right: usize,
    /// Rank that this rank receives from.
    pub(crate) left: usize,
}

impl RingPos {
    /// The ring of all ranks in rank order.
    pub(crate) fn flat(p: &Params) -> Self {
        let (n, r) = (p.world, p.rank);
        RingPos {
            n,
            pos: r,
            right: (r + 1) % n,
            left: (r + n - 1) % n,
        }
    }
}

/// The pieces of every block, `(offset, len)` within the block, in the order they travel. Each
/// piece is one message: every rank of the ring must split a block the same way.
pub(crate) type Blocks = [Vec<(usize, usize)>];

/// The pieces of blocks of the given lengths: each block cut into segments.
pub(crate) fn segmented(
    lens: impl Iterator<Item = usize>,
    segment: usize,
) -> Vec<Vec<(usize, usize)>> {
    lens.map(|l| segments(l, segment).collect()).collect()
}

/// Ops of the reduce-scatter phase that later phases depend on.
pub(crate) struct RsPhase {
    /// Per step, per piece: the send.
    pub(crate) sends: Vec<Vec<OpId>>,
    /// Per piece of this rank's block: the last op writing its final value.
    pub(crate) last: Vec<OpId>,
}

/// Where the reduce-scatter phase finds and leaves data. Offsets are within a block.
pub(crate) struct RsLayout<'a> {
    /// This rank's contribution to block `b` at offset `off`.
    pub(crate) input: &'a dyn Fn(usize, usize) -> Loc,
    /// Ops that must complete before the contribution to block `b` at `(off, len)` is read.
    pub(crate) input_deps: &'a dyn Fn(usize, usize, usize) -> Vec<OpId>,
    /// Where the partial of block `b` received at step `s` is kept at offset `off` (steps before
    /// the last).
    pub(crate) partial: &'a dyn Fn(usize, usize, usize) -> Loc,
    /// Where this rank's fully reduced block goes, at offset `off`.
    pub(crate) final_loc: &'a dyn Fn(usize) -> Loc,
    /// Whether partials alternate between two slots that are reused every other step (then all
    /// blocks must have the same pieces).
    pub(crate) double_buffered: bool,
    /// Whether this rank divides its reduced block for an average (`Op::Finalize`).
    pub(crate) finalize: bool,
}

/// The reduce-scatter phase over `ring`: after it, this rank holds block `ring.pos` reduced over
/// the ring at `lay.final_loc`.
pub(crate) fn rs_phase(
    prog: &mut Program,
    ring: RingPos,
    blocks: &Blocks,
    lay: &RsLayout<'_>,
) -> RsPhase {
    let (n, r) = (ring.n, ring.pos);
    debug_assert!(n >= 2 && blocks.len() == n);
    let mut sends: Vec<Vec<OpId>> = Vec::with_capacity(n - 1);
    let mut recvs: Vec<Vec<OpId>> = Vec::with_capacity(n - 1);
    for s in 0..n - 1 {
        let sb = (r + n - 1 - s) % n;
        let rb = (r + 2 * n - 2 - s) % n;
        let mut ss = Vec::with_capacity(blocks[sb].len());
        for (j, &(off, len)) in blocks[sb].iter().enumerate() {
            let (src, deps) = if s == 0 {
                ((lay.input)(sb, off), (lay.input_deps)(sb, off, len))
            } else {
                ((lay.partial)(sb, s - 1, off), vec![recvs[s - 1][j]])
            };
            ss.push(prog.push(
                Op::Send {
                    peer: ring.right,
                    src,
                    len,
                },
                &deps,
            ));
        }
        let mut rs = Vec::with_capacity(blocks[rb].len());
        for (j, &(off, len)) in blocks[rb].iter().enumerate() {
            let last_step = s == n - 2;
            let dst = if last_step {
                (lay.final_loc)(off)
            } else {
                (lay.partial)(rb, s, off)
            };
            let mut deps = (lay.input_deps)(rb, off, len);
            // The slot written now held the partial received two steps ago, which the previous
            // step's send read.
            if lay.double_buffered && !last_step && s >= 2 {
                deps.extend(sends[s - 1].get(j).copied());
            }
            let op = Op::Recv {
                peer: ring.left,
                dst,
                reduce_with: Some((lay.input)(rb, off)),
                len,
            };
            rs.push(prog.push(op, &deps));
        }
        sends.push(ss);
        recvs.push(rs);
    }
    let mut last = recvs.pop().unwrap_or_default();
    if lay.finalize {
        for (j, &(off, len)) in blocks[r].iter().enumerate() {
            last[j] = prog.push(
                Op::Finalize {
                    loc: (lay.final_loc)(off),
                    len,
                },
                &[last[j]],
            );
        }
    }
    RsPhase { sends, last }
}

/// Where the all-gather phase finds and leaves data. Offsets are within a block.
pub(crate) struct AgLayout<'a> {
    /// Where block `b` lives at offset `off` (for this rank's own block: where the sends after the
    /// first step read it, which they never do).
    pub(crate) loc: &'a dyn Fn(usize, usize) -> Loc,
    /// Where the first step reads piece `j` (at `(off, len)`) of this rank's own block, and the
    /// ops it waits for.
    pub(crate) first: &'a dyn Fn(usize, usize, usize) -> (Loc, Vec<OpId>),
    /// Ops that the receive of piece `j` of block `b` at step `t` waits for, as `(t, b, j)`.
    pub(crate) recv_deps: &'a dyn Fn(usize, usize, usize) -> Vec<OpId>,
}

/// Ops of the all-gather phase that later ops depend on.
pub(crate) struct AgPhase {
    /// Per step: the block sent and its sends per piece.
    pub(crate) sends: Vec<(usize, Vec<OpId>)>,
    /// Per step: the block received and its receives per piece.
    pub(crate) recvs: Vec<(usize, Vec<OpId>)>,
}

/// The all-gather phase over `ring`: every rank's block `pos` reaches every other rank.
pub(crate) fn ag_phase(
    prog: &mut Program,
    ring: RingPos,
    blocks: &Blocks,
    lay: &AgLayout<'_>,
) -> AgPhase {
    let (n, r) = (ring.n, ring.pos);
    debug_assert!(n >= 2 && blocks.len() == n);
    let mut recvs: Vec<(usize, Vec<OpId>)> = Vec::with_capacity(n - 1);
    let mut sends: Vec<(usize, Vec<OpId>)> = Vec::with_capacity(n - 1);
    for t in 0..n - 1 {
        let sb = (r + n - t) % n;
        let rb = (r + 2 * n - 1 - t) % n;
        let mut ss = Vec::with_capacity(blocks[sb].len());
        for (j, &(off, len)) in blocks[sb].iter().enumerate() {
            let (src, deps) = if t == 0 {
                (lay.first)(j, off, len)
            } else {
                ((lay.loc)(sb, off), vec![recvs[t - 1].1[j]])
            };
            ss.push(prog.push(
                Op::Send {
                    peer: ring.right,
                    src,
                    len,
                },
                &deps,
            ));
        }
        sends.push((sb, ss));
        let mut cur = Vec::with_capacity(blocks[rb].len());
        for (j, &(off, len)) in blocks[rb].iter().enumerate() {
            let deps = (lay.recv_deps)(t, rb, j);
            let op = Op::Recv {
                peer: ring.left,
                dst: (lay.loc)(rb, off),
                reduce_with: None,
                len,
            };
            cur.push(prog.push(op, &deps));
        }
        recvs.push((rb, cur));
    }
    AgPhase { sends, recvs }
}

/// The ring all-reduce of the elements `range` of `src` into the same range of `Output`, over
/// `ring`: reduce-scatter then all-gather. `input_deps(off, len)` are the ops that must complete
/// before the input at offset `off` of the range is read. For `ReduceOp::Avg` the owner of each
/// block divides it when `finalize` is set. Returns the ops that last write the result, as
/// `(offset, len, op)` pieces that cover the range (offsets relative to its start).
///
/// On two ranks the steps of every segment index run as a wave ([`wave_order`]): step `s` of
/// segment `j` comes a few segments after step `s - 1` of it, not after all of step `s - 1`, so
/// the all-gather sends a reduced segment while it is still in the cache ([`wave_lag`]).
pub(crate) fn all_reduce_range(
    prog: &mut Program,
    ring: RingPos,
    src: Buf,
    range: Range<usize>,
    segment: usize,
    input_deps: &dyn Fn(usize, usize) -> Vec<OpId>,
    finalize: bool,
) -> Vec<(usize, usize, OpId)> {
    let (n, r, start, count) = (ring.n, ring.pos, range.start, range.len());
    let bstart = |b: usize| block_range(count, n, b).start;
    let blocks = segmented((0..n).map(|b| block_range(count, n, b).len()), segment);
    let input = |b: usize, off: usize| Loc::new(src, start + bstart(b) + off);
    let out = |b: usize, off: usize| Loc::new(Buf::Output, start + bstart(b) + off);
    let steps = 2 * (n - 1);
    // The block sent and the block received at step `s`: reduce-scatter steps first, then the
    // all-gather's (module docs).
    let sent = |s: usize| {
        if s < n - 1 {
            (r + n - 1 - s) % n
        } else {
            (r + 2 * n - 1 - s) % n
        }
    };
    let received = |s: usize| (sent(s) + n - 1) % n;
    // All-gather step t overwrites block pos - 1 - t, which reduce-scatter step t sent: from
    // `Output` (a hazard) except at step 0 when the input is elsewhere.
    let reads_output = src == Buf::Output;
    let mut sends: Vec<Vec<OpId>> = vec![Vec::new(); steps];
    let mut recvs: Vec<Vec<OpId>> = vec![Vec::new(); steps];
    // Per piece of this rank's block: the last op writing its final value.
    let mut last: Vec<OpId> = Vec::with_capacity(blocks[r].len());
    let kmax = blocks.iter().map(Vec::len).max().unwrap_or(0);
    let lag = wave_lag(n, kmax);
    let order: Vec<(usize, usize)> = wave_order(steps, kmax, lag).collect();
    // The pairs go in groups (a step, or one value of the wave's key), each group's sends before
    // its receives.
    let group = |&(s, j): &(usize, usize)| if lag >= kmax { s } else { j + s * lag };
    for pairs in order.chunk_by(|a, b| group(a) == group(b)) {
        for &(s, j) in pairs {
            let sb = sent(s);
            let Some(&(off, len)) = blocks[sb].get(j) else {
                continue;
            };
            let (src, deps) = if s == 0 {
                (input(sb, off), input_deps(bstart(sb) + off, len))
            } else if s == n - 1 {
                (out(sb, off), vec![last[j]])
            } else {
                (out(sb, off), vec![recvs[s - 1][j]])
            };
            let op = Op::Send {
                peer: ring.right,
                src,
                len,
            };
            sends[s].push(prog.push(op, &deps));
        }
        for &(s, j) in pairs {
            let rb = received(s);
            let Some(&(off, len)) = blocks[rb].get(j) else {
                continue;
            };
            if s < n - 1 {
                let op = Op::Recv {
                    peer: ring.left,
                    dst: out(rb, off),
                    reduce_with: Some(input(rb, off)),
                    len,
                };
                let id = prog.push(op, &input_deps(bstart(rb) + off, len));
                recvs[s].push(id);
                if s == n - 2 {
                    last.push(if finalize {
                        let fin = Op::Finalize {
                            loc: out(rb, off),
                            len,
                        };
                        prog.push(fin, &[id])
                    } else {
                        id
                    });
                }
            } else {
                let t = s - (n - 1);
                let deps: Vec<OpId> = if reads_output || t > 0 {
                    sends[t].get(j).copied().into_iter().collect()
                } else {
                    Vec::new()
                };
                let op = Op::Recv {
                    peer: ring.left,
                    dst: out(rb, off),
                    reduce_with: None,
                    len,
                };
                recvs[s].push(prog.push(op, &deps));
            }
        }
    }
    let mut cover: Vec<(usize, usize, OpId)> = Vec::new();
    let mut add = |b: usize, ids: &[OpId]| {
        for (&(off, len), &id) in blocks[b].iter().zip(ids) {
            cover.push((bstart(b) + off, len, id));
        }
    };
    add(r, &last);
    for (s, ids) in recvs.iter().enumerate().skip(n - 1) {
        add(received(s), ids);
    }
    cover
}

/// How many segment indices step `s + 1` of the ring all-reduce's wave trails step `s`
/// ([`wave_order`]), for a ring of `n` ranks whose blocks have at most `segs` pieces.
///
/// On two ranks 4: a segment's all-gather send then comes seven sends after its reduce-scatter
/// send (two sends to each value of the key), late enough that the peer's half of it has
/// arrived, so the send queue seldom waits at its head, and early enough that the reduced
/// segment is still in the cache (64 MiB on two ranks of this 2-core machine: 0.94 of the
/// double tree's time against 1.12 step by step over shared memory, 0.97 against 1.10 over TCP;
/// a lag of 1, one send apart, left the queue waiting, up to 1.5x slower over TCP). A block of
/// at most 4 pieces goes step by step either way. On more ranks `segs`, step by step: there the
/// wave measured no faster (3 ranks 1.03-1.08 of the double tree against 1.00, 4 ranks 0.99-1.06
/// against 0.88), with ranks sharing cores, where a rank that gets the CPU does best with every
/// segment of a step ready to send.
pub(crate) fn wave_lag(n: usize, segs: usize) -> usize {
    if n == 2 { 4 } else { segs.max(1) }
}

/// The order of `(step, segment index)` pairs of a wave of `steps` steps over `segs` segment
/// indices: by `j + s * lag`, and within one value the later step first. Every pair comes after
/// `(s - 1, j)`, and all ranks order the same pairs alike, so each pair of neighbours matches
/// messages in the order they were sent. A lag of `segs` or more is the order step by step.
pub(crate) fn wave_order(
    steps: usize,
    segs: usize,
    lag: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let keys = if segs == 0 || steps == 0 {
        0
    } else {
        segs + (steps - 1) * lag
    };
    (0..keys).flat_map(move |key| {
        // Steps whose segment index j = key - s * lag lies in 0..segs.
        let hi = (key / lag).min(steps - 1);
        let lo = (key + 1).saturating_sub(segs).div_ceil(lag);
        (lo..=hi).rev().map(move |s| (s, key - s * lag))
    })
}

/// Ring all-reduce: reduce-scatter then all-gather over `Output`.
pub(crate) fn all_reduce(p: &Params) -> Program {
    let mut prog = Program::new();
    let src_buf = if p.in_place { Buf::Output } else { Buf::Input };
    if p.world == 1 {
        return alone(p);
    }
    all_reduce_range(
        &mut prog,
        RingPos::flat(p),
        src_buf,
        0..p.count,
        p.segment,
        &|_, _| Vec::new(),
        finalizes(p),
    );
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
    let blocks = segmented((0..n).map(|_| count), p.segment);
    rs_phase(
        &mut prog,
        RingPos::flat(p),
        &blocks,
        &RsLayout {
            input: &|b, off| Loc::new(src_buf, b * count + off),
            input_deps: &|_, _, _| Vec::new(),
            partial: &|_b, s, off| Loc::new(Buf::Scratch, (s % 2) * count + off),
            final_loc: &|off| at(final_loc, off),
            double_buffered: true,
            finalize: finalizes(p),
        },
    );
    prog
}

/// Ring all-gather. Out of place, this rank's own block is copied from `Input` into `Output`
/// piece by piece, each piece right after its first-step send has read it: the copy then reads
/// the piece from the cache, and `Input` crosses the memory bus once instead of twice.
pub(crate) fn all_gather(p: &Params) -> Program {
    let mut prog = Program::new();
    let (n, count, r) = (p.world, p.count, p.rank);
    let own = Loc::new(Buf::Output, r * count);
    let input = Loc::new(Buf::Input, 0);
    if n == 1 {
        if !p.in_place {
            copy_segments(&mut prog, input, own, count, p.segment, |_| None);
        }
        return prog;
    }
    let first_src = if p.in_place { own } else { input };
    let blocks = segmented((0..n).map(|_| count), p.segment);
    let ag = ag_phase(
        &mut prog,
        RingPos::flat(p),
        &blocks,
        &AgLayout {
            loc: &|b, off| Loc::new(Buf::Output, b * count + off),
            first: &|_, off, _| (at(first_src, off), Vec::new()),
            recv_deps: &|_, _, _| Vec::new(),
        },
    );
    if !p.in_place {
        let first_sends = &ag.sends[0].1;
        copy_segments(&mut prog, input, own, count, p.segment, |j| {
            first_sends.get(j).copied()
        });
    }
    prog
}
