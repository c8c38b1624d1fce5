//! Helpers the generators share: how a buffer is cut into blocks and segments, local copies, the
//! program of a rank alone, and read/write hazard tracking.

use std::ops::Range;

use super::params::Params;
use super::program::{Buf, Loc, Op, OpId, Program};
use crate::ReduceOp;

/// The range of block `b` when `count` elements are split into `world` blocks whose sizes differ
/// by at most one (the first `count % world` blocks are one longer).
pub fn block_range(count: usize, world: usize, b: usize) -> Range<usize> {
    let base = count / world;
    let rem = count % world;
    let start = b * base + b.min(rem);
    start..start + base + usize::from(b < rem)
}

/// Segments of a run of `len` elements: `(offset, length)` pairs of at most `segment` elements,
/// all full except possibly the last. Empty when `len == 0`.
pub(crate) fn segments(len: usize, segment: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len.div_ceil(segment)).map(move |j| {
        let off = j * segment;
        (off, segment.min(len - off))
    })
}

/// `loc` moved `off` elements further.
pub(crate) fn at(loc: Loc, off: usize) -> Loc {
    Loc::new(loc.buf, loc.start + off)
}

/// Whether the collective's `Avg` needs a `Finalize` (more than one rank contributed).
pub(crate) fn finalizes(p: &Params) -> bool {
    p.op == ReduceOp::Avg && p.world > 1
}

/// The program of a rank with no peer (a world of one): out of place its input is copied to its
/// output segment by segment; in place there is nothing to do.
pub(crate) fn alone(p: &Params) -> Program {
    let mut prog = Program::new();
    if !p.in_place {
        let (i, o) = (Loc::new(Buf::Input, 0), Loc::new(Buf::Output, 0));
        copy_segments(&mut prog, i, o, p.count, p.segment, |_| None);
    }
    prog
}

/// Appends local copies of `len` elements from `src` to `dst`, segment by segment, each after
/// `deps(j)`. Returns the copy of each segment.
pub(crate) fn copy_segments(
    prog: &mut Program,
    src: Loc,
    dst: Loc,
    len: usize,
    segment: usize,
    deps: impl Fn(usize) -> Option<OpId>,
) -> Vec<OpId> {
    segments(len, segment)
        .enumerate()
        .map(|(j, (off, l))| {
            let d: Vec<OpId> = deps(j).into_iter().collect();
            prog.push(
                Op::Copy {
                    src: at(src, off),
                    dst: at(dst, off),
                    len: l,
                },
                &d,
            )
        })
        .collect()
}

/// Read/write hazards per (buffer, segment) for generators that segment a whole buffer uniformly
/// (recursive doubling, trees): an op that writes a segment waits for its last writer and for
/// every reader since; an op that reads it waits for its last writer.
pub(crate) struct Hazards {
    segs: usize,
    writer: Vec<Option<OpId>>,
    readers: Vec<Vec<OpId>>,
}

impl Hazards {
    pub(crate) fn new(segs: usize) -> Self {
        Hazards {
            segs,
            writer: vec![None; 3 * segs],
            readers: vec![Vec::new(); 3 * segs],
        }
    }

    fn idx(&self, buf: Buf, j: usize) -> usize {
        let b = match buf {
            Buf::Input => 0,
            Buf::Output => 1,
            Buf::Scratch => 2,
        };
        b * self.segs + j
    }

    /// Appends `op` (on segment `j`) reading `reads` and writing `writes`, after `extra` and the
    /// hazards on those buffers.
    pub(crate) fn push(
        &mut self,
        prog: &mut Program,
        op: Op,
        j: usize,
        reads: &[Buf],
        writes: &[Buf],
        extra: &[OpId],
    ) -> OpId {
        let mut deps: Vec<OpId> = extra.to_vec();
        for &b in reads.iter().chain(writes) {
            deps.extend(self.writer[self.idx(b, j)]);
        }
        for &b in writes {
            deps.extend_from_slice(&self.readers[self.idx(b, j)]);
        }
        deps.sort_unstable();
        deps.dedup();
        let id = prog.push(op, &deps);
        for &b in reads {
            if !writes.contains(&b) {
                let i = self.idx(b, j);
                self.readers[i].push(id);
            }
        }
        for &b in writes {
            let i = self.idx(b, j);
            self.writer[i] = Some(id);
            self.readers[i].clear();
        }
        id
    }
}
