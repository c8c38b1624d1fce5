//! All-to-all: every rank sends a block of its input to every rank, and gathers the blocks it
//! receives in rank order.
//!
//! - [`all_to_allv`]: pairwise exchange for any counts per pair of ranks. At step `s`
//!   (`1 <= s < n`) rank `r` sends its block for rank `r + s` and receives the block of rank
//!   `r - s` (mod `n`); its own block is a local copy, made once the first step's sends are
//!   out (the peers wait for those, not for it). Steps run `window` at a time: step `s` starts
//!   when step `s - window` has completed, so at most `window` peers are in flight towards and
//!   from each rank (bounded memory and connections, as with NCCL's and Open MPI's windowed
//!   pairwise schedules) while several links stay busy. Each pair exchanges exactly
//!   one block in each direction, so FIFO matching per pair holds trivially. `(n - 1)` latencies,
//!   `window` of them overlapped, and every byte sent once: bandwidth-optimal.
//! - `bruck`: Bruck's log-step algorithm for small uniform blocks: after a local rotation, at
//!   step `k` every block whose index has bit `k` set travels `2^k` ranks on, packed into one
//!   message; a final rotation puts the blocks in rank order. `ceil(log2 n)` latencies instead
//!   of `n - 1`, but each block travels up to `log2 n` times (about `log2(n) / 2 * B` bytes out
//!   of every rank instead of `B`), plus local copies: it wins only where latency dominates.
//!
//! Buffers (out of place only): `Input` holds `n` blocks in destination order, `Output` `n`
//! blocks in source order. The uniform case (`count` elements per block) is planned from
//! [`Params`] with [`Algorithm::Pairwise`] or [`Algorithm::Bruck`].

use super::common::{RangeHazards, at, segments};
use super::params::{Algorithm, Params, PlanError};
use super::program::{Buf, Loc, Op, OpId, Program};
use crate::Collective;

/// Steps of the pairwise exchange in flight at once, unless the caller says otherwise.
pub const DEFAULT_WINDOW: usize = 8;

/// One block of an all-to-all(v): where it starts in its buffer and how many elements it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Offset in elements.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
}

/// Contiguous blocks of `counts[p]` elements in rank order, as `all_to_allv` lays them out
/// (displacements are prefix sums). `None` when the total overflows.
pub fn contiguous(counts: &[usize]) -> Option<Vec<Block>> {
    let mut start = 0usize;
    counts
        .iter()
        .map(|&len| {
            let b = Block { start, len };
            start = start.checked_add(len)?;
            Some(b)
        })
        .collect()
}

/// The pairwise all-to-all(v) program of `rank` in a world of `send.len()` ranks: `send[p]` is
/// the block of `Input` for rank `p`, `recv[p]` the block of `Output` that rank `p`'s block
/// lands in. `send[rank]` and `recv[rank]` must have the same length (the local copy); the
/// other lengths must equal what the peers send and expect (their mismatch is the receiver's
/// error when the messages arrive). Messages are at most `segment` elements; `window` steps run
/// at once (at least 1).
///
/// # Panics
///
/// If `recv` and `send` differ in length, `rank` is out of range, `segment` is 0 or the local
/// blocks differ in length.
pub fn all_to_allv(
    rank: usize,
    send: &[Block],
    recv: &[Block],
    segment: usize,
    window: usize,
) -> Program {
    let n = send.len();
    assert_eq!(recv.len(), n, "one receive block per rank");
    assert!(
        rank < n && segment > 0,
        "rank {rank} of {n}, segment {segment}"
    );
    assert_eq!(send[rank].len, recv[rank].len, "the local block");
    let window = window.max(1);
    let mut prog = Program::new();
    // joins[s]: an empty op that completes when every op of step s has (the window's gate).
    let mut joins: Vec<Option<OpId>> = vec![None; n];
    // The sends of the first step: the local copy waits for them, so that the peers' data
    // leaves before this rank spends time on its own block.
    let mut first_sends = Vec::new();
    for s in 1..n {
        let gate: Vec<OpId> = s
            .checked_sub(window)
            .and_then(|g| joins[g])
            .into_iter()
            .collect();
        let (to, from) = ((rank + s) % n, (rank + n - s) % n);
        let mut step = Vec::new();
        for (off, len) in segments(send[to].len, segment) {
            let src = Loc::new(Buf::Input, send[to].start + off);
            step.push(prog.push(Op::Send { peer: to, src, len }, &gate));
        }
        if s == 1 {
            first_sends.clone_from(&step);
        }
        for (off, len) in segments(recv[from].len, segment) {
            let dst = Loc::new(Buf::Output, recv[from].start + off);
            let op = Op::Recv {
                peer: from,
                dst,
                reduce_with: None,
                len,
            };
            step.push(prog.push(op, &gate));
        }
        if s + window < n && !step.is_empty() {
            let join = Op::Copy {
                src: Loc::new(Buf::Output, 0),
                dst: Loc::new(Buf::Output, 0),
                len: 0,
            };
            joins[s] = Some(prog.push(join, &step));
        } else if s + window < n {
            joins[s] = s.checked_sub(window).and_then(|g| joins[g]);
        }
    }
    for (off, len) in segments(send[rank].len, segment) {
        prog.push(
            Op::Copy {
                src: Loc::new(Buf::Input, send[rank].start + off),
                dst: Loc::new(Buf::Output, recv[rank].start + off),
                len,
            },
            &first_sends,
        );
    }
    prog
}

/// The uniform all-to-all of `p` (`p.count` elements per block) with its algorithm: Bruck's
/// for [`Algorithm::Bruck`], the pairwise exchange of [`DEFAULT_WINDOW`] steps otherwise.
pub(crate) fn all_to_all(p: &Params) -> Program {
    all_to_all_window(p, DEFAULT_WINDOW)
}

/// The uniform all-to-all of `p` (`p.count` elements per block): Bruck's for
/// [`Algorithm::Bruck`], else the pairwise exchange with `window` steps in flight (see
/// [`all_to_allv`]; the planner's default is [`DEFAULT_WINDOW`]).
///
/// # Errors
///
/// Whatever [`Params::validate`] finds in `p`, or [`PlanError::Unsupported`] when `p` is not an
/// all-to-all by [`Algorithm::Pairwise`] or [`Algorithm::Bruck`].
pub fn all_to_all_windowed(p: &Params, window: usize) -> Result<Program, PlanError> {
    p.validate()?;
    if p.coll != Collective::AllToAll
        || !matches!(p.algorithm, Algorithm::Pairwise | Algorithm::Bruck)
    {
        return Err(PlanError::Unsupported {
            coll: p.coll,
            algorithm: p.algorithm,
        });
    }
    Ok(all_to_all_window(p, window))
}

fn all_to_all_window(p: &Params, window: usize) -> Program {
    if p.algorithm == Algorithm::Bruck && p.world > 2 {
        return bruck(p);
    }
    let blocks: Vec<Block> = (0..p.world)
        .map(|b| Block {
            start: b * p.count,
            len: p.count,
        })
        .collect();
    all_to_allv(p.rank, &blocks, &blocks, p.segment, window)
}

/// Bruck's all-to-all for `p.count` elements per block (see the [module docs](self)).
///
/// Scratch: the rotated blocks `T` (`n` blocks), then for each step a packed send buffer and a
/// packed receive buffer of as many blocks as the step moves.
pub(crate) fn bruck(p: &Params) -> Program {
    let (n, r, c, seg) = (p.world, p.rank, p.count, p.segment);
    let mut prog = Program::new();
    let mut hz = RangeHazards::new(n);
    let t = |i: usize| Loc::new(Buf::Scratch, i * c);
    let copy = |hz: &mut RangeHazards, prog: &mut Program, src: Loc, dst: Loc| {
        for (off, len) in segments(c, seg) {
            let op = Op::Copy {
                src: at(src, off),
                dst: at(dst, off),
                len,
            };
            hz.push(prog, op);
        }
    };
    // T[i] = the block for rank r + i.
    for i in 0..n {
        copy(
            &mut hz,
            &mut prog,
            Loc::new(Buf::Input, (r + i) % n * c),
            t(i),
        );
    }
    let mut next = n * c;
    let mut k = 0;
    while (1usize << k) < n {
        let dist = 1usize << k;
        let moved: Vec<usize> = (0..n).filter(|i| i & dist != 0).collect();
        let len = moved.len() * c;
        let (pack, unpack) = (
            Loc::new(Buf::Scratch, next),
            Loc::new(Buf::Scratch, next + len),
        );
        next += 2 * len;
        for (j, &i) in moved.iter().enumerate() {
            copy(&mut hz, &mut prog, t(i), at(pack, j * c));
        }
        for (off, l) in segments(len, seg) {
            let op = Op::Send {
                peer: (r + dist) % n,
                src: at(pack, off),
                len: l,
            };
            hz.push(&mut prog, op);
        }
        for (off, l) in segments(len, seg) {
            let op = Op::Recv {
                peer: (r + n - dist) % n,
                dst: at(unpack, off),
                reduce_with: None,
                len: l,
            };
            hz.push(&mut prog, op);
        }
        for (j, &i) in moved.iter().enumerate() {
            copy(&mut hz, &mut prog, at(unpack, j * c), t(i));
        }
        k += 1;
    }
    // T[i] now holds the block of rank r - i.
    for i in 0..n {
        copy(
            &mut hz,
            &mut prog,
            t(i),
            Loc::new(Buf::Output, (r + n - i) % n * c),
        );
    }
    prog.reserve_scratch(next);
    prog
}

/// Elements one rank sends in Bruck's all-to-all of `count` elements per block over `n` ranks
/// (the cost model's bandwidth term): every step moves the blocks whose index has that step's
/// bit set.
pub fn bruck_elems_sent(n: usize, count: usize) -> usize {
    let mut total = 0;
    let mut dist = 1;
    while dist < n {
        total += (0..n).filter(|i| i & dist != 0).count() * count;
        dist <<= 1;
    }
    total
}
