//! Recursive halving-doubling (Rabenseifner) all-reduce: a reduce-scatter by recursive halving,
//! then an all-gather by recursive doubling, `log2 p` steps each.
//!
//! # Steps
//!
//! The buffer is cut into `p` blocks ([`block_range`]), `p` the largest power of two `<= n`. In
//! halving step `i` (of `log2 p`) rank `v` pairs with `v xor p / 2^(i+1)`: the blocks it still
//! holds are a run of neighbours in memory, and it sends the half of the run its partner keeps
//! while it reduces the half it keeps with what the partner sends. After `log2 p` steps it holds
//! block `v`, fully reduced. The doubling steps then run the halving in reverse: in step `i` rank
//! `v` sends the run of `2^i` reduced blocks it has to `v xor 2^i` and receives the partner's
//! run, until everyone has all of them.
//!
//! **One message per step.** A step's half is one run of elements, cut into segments of
//! [`Params::segment`] from its start, so a step is one message whenever the half fits a
//! segment, whatever the blocks' sizes (across hosts a longer half goes in pieces, see
//! [Pipelining across steps](#pipelining-across-steps)). Under the alpha-beta model (see [`super::plan`]) the
//! all-reduce of `B` bytes then costs `2 log2(p) alpha + 2 (p - 1) / p * B * beta`: the ring's
//! bandwidth term (a rank sends `B / 2 + B / 4 + ... + B / p` in each phase) with `2 log2 p`
//! latencies instead of the ring's `2 (n - 1)`.
//!
//! **Other worlds** fold as recursive doubling does ([`super::doubling`]): with `rem = n - p`,
//! each even rank `r < 2 rem` sends its whole buffer to `r + 1`, which reduces it into its own,
//! and leaves; the `p` others run the steps above; at the end each `r + 1` sends the result back.
//! That adds two messages of the whole buffer to the critical path:
//! `(2 log2(p) + 2) alpha + (2 (p - 1) / p + 2) * B * beta`.
//!
//! **Identical bits.** Every block is reduced at one rank only (the operands combined in an order
//! fixed by the steps, and each receive computes `local op incoming`), averaged there once, and
//! then copied to the others, so every rank ends with the same bits.
//!
//! **Buffers.** A halving step reads the half it sends and writes the disjoint half it keeps, so
//! the reduction lands in `Output` with no scratch (the first step reads `Input` when out of
//! place). The segments of different steps start at different offsets, so the read/write hazards
//! are tracked per element range (`RangeHazards`); every op waits only for the ops that touch
//! its own elements, and step `i + 1` of a segment runs while later segments of step `i` are
//! still in flight.
//!
//! # Pipelining across steps
//!
//! A rank can start a step only with the blocks it already has, so the order in which the step
//! before delivers them matters. In address order, half the ranks receive first what they pass
//! on next and the other half last: those wait with their upload idle while their partners
//! send, then send while their partners' links are idle. When the ranks span hosts
//! ([`Params::local_size`] below the world), each message instead carries first what its
//! receiver passes on first:
//! - in halving step `i`, the half the receiver gives away in step `i + 1` (itself ordered for
//!   that step's receiver), then the half it keeps (ordered for itself);
//! - in doubling step `i`, the run the sender sent in step `i - 1` (in that order), then the
//!   run it received then (in the order it came).
//!
//! Both ends of a message compute the same order. A run that fits one segment stays in
//! address order, and pieces that meet in memory are one run, so small messages are cut as
//! before. On 4 emulated hosts at 1 Gbit/s (`scripts/emuhosts.py`), a 64 MiB all-reduce went
//! from 1.14 s to 1.01 s, every link busy in both directions all along. On one host, 4 ranks on
//! 2 cores over shared memory measured about 0.9 of address order at 2-8 MiB (medians of 8-10
//! alternating runs), where the copies, not the links, are the bound; there the order stays by
//! address.
//!
//! **No deadlock under rendezvous sends.** No receive of the halving phase waits for a send (it
//! reads and writes only what the rank keeps); a receive of the doubling phase waits, besides
//! earlier receives, only for the halving send of the same elements to the same partner, whose
//! matching receive waits for nothing but earlier receives.

use std::ops::Range;

use super::common::{Hazards, RangeHazards, alone, block_range, finalizes, segments};
use super::doubling::fold_out;
use super::params::Params;
use super::program::{Buf, Loc, Op, Program};

/// Recursive halving-doubling all-reduce.
pub(crate) fn all_reduce(p: &Params) -> Program {
    let (n, r, count, seg) = (p.world, p.rank, p.count, p.segment);
    if n == 1 {
        return alone(p);
    }
    let base = if p.in_place { Buf::Output } else { Buf::Input };
    let pow = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - pow;
    let steps = pow.trailing_zeros() as usize;
    let mut prog = Program::new();
    if r < 2 * rem && r % 2 == 0 {
        let segs: Vec<_> = segments(count, seg)
            .enumerate()
            .map(|(j, (off, len))| (off, len, j))
            .collect();
        fold_out(&mut prog, &mut Hazards::new(segs.len()), base, r + 1, &segs);
        return prog;
    }
    let fold = r < 2 * rem;
    let vrank = if fold { r / 2 } else { r - rem };
    let spans_hosts = p.local_size != 0 && p.local_size < n;
    let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
    // The elements of the run of blocks `blocks`.
    let elems = |blocks: Range<usize>| {
        block_range(count, pow, blocks.start).start..block_range(count, pow, blocks.end).start
    };
    let mut run = Run {
        prog: &mut prog,
        hz: RangeHazards::new(n),
        segment: seg,
    };
    let order = Order {
        on: spans_hosts,
        pow,
        steps,
        segment: seg,
        elems: &elems,
    };
    let out = |off: usize| Loc::new(Buf::Output, off);
    let mut cur = base;
    if fold {
        run.each(0..count, |off, len| Op::Recv {
            peer: r - 1,
            dst: out(off),
            reduce_with: Some(Loc::new(cur, off)),
            len,
        });
        cur = Buf::Output;
    }
    // Reduce-scatter by recursive halving over the run of blocks [lo, hi) still held.
    let (mut lo, mut hi) = (0, pow);
    for i in 0..steps {
        let d = pow >> (i + 1);
        let peer = real(vrank ^ d);
        let (keep, give) = halves(lo..hi, vrank, d);
        run.each_of(order.halving(give, vrank ^ d, i + 1), |off, len| Op::Send {
            peer,
            src: Loc::new(cur, off),
            len,
        });
        run.each_of(order.halving(keep.clone(), vrank, i + 1), |off, len| {
            Op::Recv {
                peer,
                dst: out(off),
                reduce_with: Some(Loc::new(cur, off)),
                len,
            }
        });
        (lo, hi) = (keep.start, keep.end);
        cur = Buf::Output;
    }
    debug_assert_eq!((lo, hi), (vrank, vrank + 1));
    // An average is divided once, where its block was reduced.
    if finalizes(p) {
        run.each(elems(vrank..vrank + 1), |off, len| Op::Finalize {
            loc: out(off),
            len,
        });
    }
    // All-gather by recursive doubling: the reduced blocks [own, own + d) grow to everything.
    for i in 0..steps {
        let d = 1usize << i;
        let peer = real(vrank ^ d);
        run.each_of(order.doubling(vrank, i), |off, len| Op::Send {
            peer,
            src: out(off),
            len,
        });
        run.each_of(order.doubling(vrank ^ d, i), |off, len| Op::Recv {
            peer,
            dst: out(off),
            reduce_with: None,
            len,
        });
    }
    if fold {
        run.each(0..count, |off, len| Op::Send {
            peer: r - 1,
            src: out(off),
            len,
        });
    }
    prog
}

/// The order in which a step's message carries its blocks: what the receiver passes on first
/// comes first (see [Pipelining across steps](self#pipelining-across-steps)).
struct Order<'a> {
    /// Whether to order at all: only when the ranks span hosts.
    on: bool,
    pow: usize,
    steps: usize,
    segment: usize,
    /// The elements of a run of blocks.
    elems: &'a dyn Fn(Range<usize>) -> Range<usize>,
}

impl Order<'_> {
    /// The runs of elements, in order, of a halving message that gives virtual rank `x` the run `blocks`,
    /// which `x` halves next in step `k`: the half `x` gives away in step `k` first (ordered
    /// for its partner there), then the half it keeps (ordered for itself).
    fn halving(&self, blocks: Range<usize>, x: usize, k: usize) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        self.halving_into(blocks, x, k, &mut out);
        self.runs(out)
    }

    fn halving_into(&self, blocks: Range<usize>, x: usize, k: usize, out: &mut Vec<Range<usize>>) {
        if !self.on
            || k == self.steps
            || blocks.len() < 2
            || (self.elems)(blocks.clone()).len() <= self.segment
        {
            out.push(blocks);
            return;
        }
        let d = self.pow >> (k + 1);
        let (keep, give) = halves(blocks, x, d);
        self.halving_into(give, x ^ d, k + 1, out);
        self.halving_into(keep, x, k + 1, out);
    }

    /// The runs of elements, in order, of what virtual rank `x` sends in doubling step `i`: the run it
    /// sent in step `i - 1` (in that order), then the run it received then (in the order it
    /// came).
    fn doubling(&self, x: usize, i: usize) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        self.doubling_into(x, i, &mut out);
        self.runs(out)
    }

    fn doubling_into(&self, x: usize, i: usize, out: &mut Vec<Range<usize>>) {
        let d = 1usize << i;
        let own = x & !(d - 1);
        if !self.on || i == 0 || (self.elems)(own..own + d).len() <= self.segment {
            out.push(own..own + d);
            return;
        }
        self.doubling_into(x, i - 1, out);
        self.doubling_into(x ^ (d >> 1), i - 1, out);
    }

    /// The runs of elements of `pieces` (runs of blocks), every piece that starts where the
    /// one before it ends merged into it.
    fn runs(&self, pieces: Vec<Range<usize>>) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::with_capacity(pieces.len());
        for p in pieces {
            match out.last_mut() {
                Some(last) if last.end == p.start => last.end = p.end,
                _ => out.push(p),
            }
        }
        out.into_iter().map(|b| (self.elems)(b)).collect()
    }
}

/// The halves of the run of blocks `blocks` that virtual rank `x` keeps and gives away in the
/// halving step at distance `d` (half the run): the lower one if bit `d` of `x` is clear.
fn halves(blocks: Range<usize>, x: usize, d: usize) -> (Range<usize>, Range<usize>) {
    let mid = blocks.start + d;
    if x & d == 0 {
        (blocks.start..mid, mid..blocks.end)
    } else {
        (mid..blocks.end, blocks.start..mid)
    }
}

/// Appends ops to a program, one per segment of a run of elements, after their hazards.
struct Run<'a> {
    prog: &'a mut Program,
    hz: RangeHazards,
    segment: usize,
}

impl Run<'_> {
    /// Appends `op(offset, length)` for every segment of `elems`, cut from its start.
    fn each(&mut self, elems: Range<usize>, op: impl Fn(usize, usize) -> Op) {
        for (off, len) in segments(elems.len(), self.segment) {
            self.hz.push(self.prog, op(elems.start + off, len));
        }
    }

    /// [`Run::each`] over several runs of elements, in order.
    fn each_of(&mut self, runs: Vec<Range<usize>>, op: impl Fn(usize, usize) -> Op) {
        for elems in runs {
            self.each(elems, &op);
        }
    }
}
