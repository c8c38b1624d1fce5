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
//! segment, whatever the blocks' sizes. Under the alpha-beta model (see [`super::plan`]) the
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
        let (keep, give) = if vrank & d == 0 {
            (lo..lo + d, lo + d..hi)
        } else {
            (lo + d..hi, lo..lo + d)
        };
        run.each(elems(give), |off, len| Op::Send {
            peer,
            src: Loc::new(cur, off),
            len,
        });
        run.each(elems(keep.clone()), |off, len| Op::Recv {
            peer,
            dst: out(off),
            reduce_with: Some(Loc::new(cur, off)),
            len,
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
        let own = vrank & !(d - 1);
        let theirs = own ^ d;
        run.each(elems(own..own + d), |off, len| Op::Send {
            peer,
            src: out(off),
            len,
        });
        run.each(elems(theirs..theirs + d), |off, len| Op::Recv {
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
}
