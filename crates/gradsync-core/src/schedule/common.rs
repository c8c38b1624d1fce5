//! Helpers the generators share: how a buffer is cut into blocks and segments, local copies, the
//! program of a rank alone, and read/write hazard tracking (per segment, or per element range).

use std::collections::BTreeMap;
use std::ops::Range;

use super::params::Params;
use super::program::{Buf, Extent, Loc, Op, OpId, Program};
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

/// A pipeline segment for a run of `len` elements: about `pieces` of them, but none under `floor`
/// elements nor over `max` (the caller's segment), so that a short run still pipelines over the
/// hops of a tree without cutting it into messages that cost more latency than they save.
pub(crate) fn pipeline_segment(len: usize, pieces: usize, floor: usize, max: usize) -> usize {
    max.min(len.div_ceil(pieces).max(floor))
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

/// Read/write hazards over element ranges, for generators whose messages do not follow one
/// segmentation of the buffer (the halving and doubling steps of Rabenseifner cut runs of
/// blocks that start anywhere into segments): an op waits for the last writer of every element
/// it reads or writes, and an op that writes an element also waits for every reader of it since.
/// What an op reads and writes is taken from the op itself ([`Op::extents`]).
///
/// Each buffer is a map of disjoint spans, split where an op's range begins or ends and merged
/// where an op writes, so a program of `k` ops keeps at most about `2 k` spans.
pub(crate) struct RangeHazards {
    world: usize,
    spans: [BTreeMap<usize, Span>; 3],
}

/// Elements `start..end` (`start` is the key in the map) of one buffer, with their last writer
/// and the ops that read them since.
#[derive(Clone)]
struct Span {
    end: usize,
    writer: Option<OpId>,
    readers: Vec<OpId>,
}

impl RangeHazards {
    /// No hazards yet, for the programs of a world of `world` ranks (the extent of the parts of
    /// an [`Op::ReduceParts`]).
    pub(crate) fn new(world: usize) -> Self {
        let all = || {
            BTreeMap::from([(
                0,
                Span {
                    end: usize::MAX,
                    writer: None,
                    readers: Vec::new(),
                },
            )])
        };
        RangeHazards {
            world,
            spans: [all(), all(), all()],
        }
    }

    fn map(&mut self, buf: Buf) -> &mut BTreeMap<usize, Span> {
        &mut self.spans[match buf {
            Buf::Input => 0,
            Buf::Output => 1,
            Buf::Scratch => 2,
        }]
    }

    /// Makes a span start at `at` (the spans cover every element from 0 on).
    fn split(&mut self, buf: Buf, at: usize) {
        let map = self.map(buf);
        let (&start, span) = map
            .range_mut(..=at)
            .next_back()
            .expect("the spans start at 0");
        if start < at {
            let tail = Span {
                end: span.end,
                ..span.clone()
            };
            span.end = at;
            map.insert(at, tail);
        }
    }

    /// Appends `op` after the hazards on the elements it reads and writes.
    pub(crate) fn push(&mut self, prog: &mut Program, op: Op) -> OpId {
        let (read, write) = op.extents(self.world);
        let (read, write) = (extent(read), extent(write));
        for (buf, range) in read.iter().chain(&write) {
            self.split(*buf, range.start);
            self.split(*buf, range.end);
        }
        let mut deps = Vec::new();
        if let Some((buf, range)) = &read {
            let spans = self.map(*buf).range(range.clone());
            deps.extend(spans.filter_map(|s| s.1.writer));
        }
        if let Some((buf, range)) = &write {
            for (_, s) in self.map(*buf).range(range.clone()) {
                deps.extend(s.writer);
                deps.extend_from_slice(&s.readers);
            }
        }
        deps.sort_unstable();
        deps.dedup();
        let id = prog.push(op, &deps);
        if let Some((buf, range)) = read {
            for (_, s) in self.map(buf).range_mut(range) {
                s.readers.push(id);
            }
        }
        if let Some((buf, range)) = write {
            // The written elements become one span: one writer, no reader since.
            let map = self.map(buf);
            let starts: Vec<usize> = map.range(range.clone()).map(|s| *s.0).collect();
            for start in starts {
                map.remove(&start);
            }
            let span = Span {
                end: range.end,
                writer: Some(id),
                readers: Vec::new(),
            };
            map.insert(range.start, span);
        }
        id
    }
}

/// The range of `(start, length)` in its buffer, none when it is empty.
fn extent(at: Option<Extent>) -> Option<(Buf, Range<usize>)> {
    at.filter(|&(_, len)| len > 0)
        .map(|(l, len)| (l.buf, l.start..l.start + len))
}
