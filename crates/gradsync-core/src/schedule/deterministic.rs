//! The deterministic all-reduce: pieces of the buffer all-gathered into scratch and reduced in
//! rank order, piece after piece, so that the result's bits depend on neither the algorithm nor
//! the chunking, only on the inputs and the world.
//!
//! # Pieces
//!
//! The buffer of `count` elements is cut into pieces of `piece = min(count, segment)` elements
//! (the last one shorter). Every piece of every rank is one message of at most
//! [`Params::segment`] elements, and the reduction of one piece works on `world * piece`
//! elements at most, so both the messages and the memory follow the one knob the engine already
//! sizes (the pipeline segment, `GRADSYNC_CHUNK_SIZE`). For each piece `k`:
//!
//! 1. a `Copy` of this rank's piece into its part of the scratch half `k mod 2`;
//! 2. the ring all-gather of the piece ([`super::ring`]'s `ag_phase`, one block of one message
//!    per rank) into the same half, part `q` at `q * len` for rank `q`; this rank's own block
//!    leaves straight from the input;
//! 3. a `ReduceParts` of the half into the piece's place in `Output`:
//!    `out = ((part 0 op part 1) op part 2) ...`, and for `ReduceOp::Avg` a `Finalize` of it.
//!
//! # Overlap and memory
//!
//! Pieces alternate between two scratch halves, so the all-gather of piece `k + 1` runs while
//! piece `k` is being reduced; piece `k + 2` reuses the half of piece `k` once its reduction and
//! the sends that forwarded its parts are done. Scratch is therefore
//! `2 * world * min(count, segment)` elements (one half when there is only one piece): for a
//! segment of 256 Ki `f32` elements (1 MiB) over 8 ranks, 16 MiB. An executor with a scratch
//! budget of `S` elements plans the call with `segment <= S / (2 * world)`: the messages get
//! smaller, not fewer bytes move. In place works: a piece of `Output` is overwritten only after
//! its copy and its first send have read it.
//!
//! # Cost
//!
//! Every rank sends `(world - 1) * count` elements, `world / 2` times the ring all-reduce's
//! `2 (world - 1) / world * count`, with `world - 1` latencies per piece: the price of bits that
//! depend only on the inputs. The result equals the rank-order reduction of the inputs
//! (`reference::expected`) bit for bit whatever the timing.

use super::common::{alone, finalizes};
use super::params::Params;
use super::program::{Buf, Loc, Op, OpId, Program};
use super::ring::{AgLayout, RingPos, ag_phase};

/// Elements per piece of a deterministic all-reduce with these parameters: `min(count,
/// segment)` (0 for an empty buffer).
pub fn piece_elems(p: &Params) -> usize {
    p.count.min(p.segment)
}

/// Scratch elements of a deterministic all-reduce with these parameters: two halves of `world`
/// pieces, or one when the buffer is a single piece (0 for a world of one).
pub fn scratch_elems(p: &Params) -> usize {
    if p.world == 1 {
        return 0;
    }
    let piece = piece_elems(p);
    let halves = p.count.div_ceil(piece.max(1)).min(2);
    halves * p.world * piece
}

/// What a piece left behind in its scratch half: the reduction that read the whole half, and the
/// sends that read each part.
struct HalfUse {
    /// Elements per part.
    len: usize,
    /// The `ReduceParts` of the piece.
    reduce: OpId,
    /// Per part: the send that read it from scratch (every part but this rank's own is
    /// forwarded once, as one message).
    readers: Vec<Option<OpId>>,
}

impl HalfUse {
    /// The ops that must complete before `len` elements of part `q` (parts of `len` elements)
    /// are written: the reduction, and the sends that read any overlapping part.
    fn before_writing(&self, q: usize, len: usize) -> Vec<OpId> {
        let mut deps = Vec::with_capacity(3);
        deps.push(self.reduce);
        if len > 0 && self.len > 0 {
            let (lo, hi) = (q * len, (q + 1) * len);
            for b in lo / self.len..=(hi - 1) / self.len {
                deps.extend(self.readers.get(b).copied().flatten());
            }
        }
        deps
    }
}

/// The deterministic all-reduce of rank `p.rank`.
pub(crate) fn all_reduce(p: &Params) -> Program {
    let (n, r, count) = (p.world, p.rank, p.count);
    if n == 1 {
        return alone(p);
    }
    let mut prog = Program::new();
    if count == 0 {
        return prog;
    }
    prog.reserve_scratch(scratch_elems(p));
    let piece = piece_elems(p);
    let ring = RingPos::flat(p);
    let src_buf = if p.in_place { Buf::Output } else { Buf::Input };
    let mut halves: [Option<HalfUse>; 2] = [None, None];
    // Every rank's block of a piece is one message; all pieces but the last have the same.
    let full = vec![vec![(0, piece)]; n];
    for (k, off) in (0..count).step_by(piece).enumerate() {
        let len = piece.min(count - off);
        let base = (k % 2) * n * piece;
        let part = move |q: usize, o: usize| Loc::new(Buf::Scratch, base + q * len + o);
        let prev = halves[k % 2].take();
        let reuse = |q: usize| {
            prev.as_ref()
                .map_or(Vec::new(), |h| h.before_writing(q, len))
        };
        let own = prog.push(
            Op::Copy {
                src: Loc::new(src_buf, off),
                dst: part(r, 0),
                len,
            },
            &reuse(r),
        );
        let last;
        let blocks = if len == piece {
            &full
        } else {
            last = vec![vec![(0, len)]; n];
            &last
        };
        let ag = ag_phase(
            &mut prog,
            ring,
            blocks,
            &AgLayout {
                loc: &part,
                first: &|_, o, _| (Loc::new(src_buf, off + o), Vec::new()),
                recv_deps: &|_, b, _| reuse(b),
            },
        );
        let mut deps: Vec<OpId> = Vec::with_capacity(n + 1);
        deps.push(own);
        deps.extend(ag.recvs.iter().flat_map(|(_, ids)| ids.iter().copied()));
        if p.in_place {
            // The first send reads this piece of `Output`, which the reduction overwrites.
            deps.extend(ag.sends.first().into_iter().flat_map(|(_, ids)| ids));
        }
        let out = Loc::new(Buf::Output, off);
        let reduce = prog.push(
            Op::ReduceParts {
                src: part(0, 0),
                dst: out,
                len,
            },
            &deps,
        );
        if finalizes(p) {
            prog.push(Op::Finalize { loc: out, len }, &[reduce]);
        }
        let mut readers = vec![None; n];
        for (b, ids) in ag.sends.iter().skip(1) {
            debug_assert_eq!(ids.len(), 1);
            readers[*b] = ids.first().copied();
        }
        halves[k % 2] = Some(HalfUse {
            len,
            reduce,
            readers,
        });
    }
    prog
}
