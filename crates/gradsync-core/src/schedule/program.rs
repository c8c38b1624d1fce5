//! The program model: buffers, locations, ops and the program that lists them with their
//! dependencies. What the ops mean and how messages match is in the [schedule docs](super).

/// Index of an op in its program.
pub type OpId = u32;

/// A buffer an op refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The caller's input (read only).
    Input,
    /// The caller's output. In an in-place call this is the same memory as `Input`, and
    /// programs generated for in-place calls only use `Output`.
    Output,
    /// Executor-provided scratch space of [`Program::scratch_elems`] elements.
    Scratch,
}

/// A position in a buffer, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    /// Which buffer.
    pub buf: Buf,
    /// Offset in elements.
    pub start: usize,
}

impl Loc {
    /// `Loc { buf, start }`.
    pub const fn new(buf: Buf, start: usize) -> Self {
        Loc { buf, start }
    }
}

/// Elements of one buffer: where they start and how many.
pub type Extent = (Loc, usize);

/// One operation of a program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Send `len` elements starting at `src` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Where the data is read.
        src: Loc,
        /// Number of elements.
        len: usize,
    },
    /// Receive `len` elements from `peer` into `dst`. With `reduce_with = Some(w)`, the
    /// destination becomes `w[i] op incoming[i]` (w may equal dst); with `None` it is a copy.
    Recv {
        /// Source rank.
        peer: usize,
        /// Where the result is written.
        dst: Loc,
        /// Local operand of the reduction, if this receive reduces.
        reduce_with: Option<Loc>,
        /// Number of elements.
        len: usize,
    },
    /// Make `len` elements at `src` available to every other rank: one message to each other
    /// rank, all issued at once. An executor sends one message per peer, or posts the data once
    /// where every peer reads it (a shared-memory board). For matching, a post is one message to
    /// every other rank, in program order with the sends to that rank (see the
    /// [schedule docs](super)). A post is buffered: it completes once its data has been copied
    /// out of `src` (into the messages, or onto the board), without waiting for any receive, so
    /// an op that waits for it never waits for a peer. Only eager programs post, and only data
    /// that fits one message. With a world of one it does nothing.
    Post {
        /// Where the data is read.
        src: Loc,
        /// Number of elements.
        len: usize,
    },
    /// Local copy of `len` elements.
    Copy {
        /// Source.
        src: Loc,
        /// Destination.
        dst: Loc,
        /// Number of elements.
        len: usize,
    },
    /// Local reduction of one part per rank, strictly in rank order:
    /// `dst = ((part(0) op part(1)) op part(2)) ... op part(world - 1)`, where part `i` is the
    /// `len` elements at `src + i * len` and `world` is the number of ranks. `ReduceOp::Avg`
    /// folds as a sum; its division is a separate [`Op::Finalize`]. With one rank it is a copy of
    /// part 0. `dst` must not overlap the parts. Every rank that reduces the same parts gets the
    /// same bits, whatever order they arrived in.
    ReduceParts {
        /// The first part; the others follow it, `len` elements apart.
        src: Loc,
        /// Where the result is written.
        dst: Loc,
        /// Elements per part and of the result.
        len: usize,
    },
    /// Local finalisation of an average: divide `len` elements at `loc` by the world size. Only
    /// programs for `ReduceOp::Avg` contain it.
    Finalize {
        /// Elements to divide.
        loc: Loc,
        /// Number of elements.
        len: usize,
    },
}

impl Op {
    /// Number of elements this op moves or writes: for a [`Op::Post`] the elements it makes
    /// available (to each peer), for a [`Op::ReduceParts`] the elements of the result (it reads
    /// `world` times as many).
    pub fn len(&self) -> usize {
        match *self {
            Op::Send { len, .. }
            | Op::Recv { len, .. }
            | Op::Post { len, .. }
            | Op::Copy { len, .. }
            | Op::ReduceParts { len, .. }
            | Op::Finalize { len, .. } => len,
        }
    }

    /// Whether the op touches no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements the op reads and the elements it writes, each as `(start, length)` when
    /// there are any, in a world of `world` ranks (the parts of a [`Op::ReduceParts`] span
    /// `world * len` elements). A reducing receive reads its local operand, a finalize reads and
    /// writes the same elements.
    pub fn extents(&self, world: usize) -> (Option<Extent>, Option<Extent>) {
        match *self {
            Op::Send { src, len, .. } | Op::Post { src, len } => (Some((src, len)), None),
            Op::Recv {
                dst,
                reduce_with,
                len,
                ..
            } => (reduce_with.map(|w| (w, len)), Some((dst, len))),
            Op::Copy { src, dst, len } => (Some((src, len)), Some((dst, len))),
            Op::ReduceParts { src, dst, len } => {
                (Some((src, world.saturating_mul(len))), Some((dst, len)))
            }
            Op::Finalize { loc, len } => (Some((loc, len)), Some((loc, len))),
        }
    }

    /// Whether the op is local: no message leaves or arrives for it (`Copy`, `ReduceParts`,
    /// `Finalize`).
    pub fn is_local(&self) -> bool {
        matches!(
            self,
            Op::Copy { .. } | Op::ReduceParts { .. } | Op::Finalize { .. }
        )
    }
}

/// A generated program: ops in program order with their dependencies.
#[derive(Clone, Debug, Default)]
pub struct Program {
    ops: Vec<Op>,
    dep_start: Vec<u32>,
    deps: Vec<OpId>,
    scratch_elems: usize,
}

impl Program {
    /// An empty program.
    pub fn new() -> Self {
        Program {
            ops: Vec::new(),
            dep_start: vec![0],
            deps: Vec::new(),
            scratch_elems: 0,
        }
    }

    /// Appends `op`, which may start only after every op in `deps` has completed. Every id in
    /// `deps` must be an earlier op. Ops of length 0 are kept (they complete at once).
    pub fn push(&mut self, op: Op, deps: &[OpId]) -> OpId {
        let id = self.ops.len() as OpId;
        debug_assert!(deps.iter().all(|&d| d < id), "dependency on a later op");
        self.ops.push(op);
        self.deps.extend_from_slice(deps);
        self.dep_start.push(self.deps.len() as u32);
        id
    }

    /// Requests at least `elems` elements of scratch space.
    pub fn reserve_scratch(&mut self, elems: usize) {
        self.scratch_elems = self.scratch_elems.max(elems);
    }

    /// Scratch space the executor must provide, in elements.
    #[inline]
    pub fn scratch_elems(&self) -> usize {
        self.scratch_elems
    }

    /// The ops in program order.
    #[inline]
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The dependencies of op `id`.
    pub fn deps(&self, id: OpId) -> &[OpId] {
        let i = id as usize;
        &self.deps[self.dep_start[i] as usize..self.dep_start[i + 1] as usize]
    }

    /// The dependencies of every op, flattened in program order (the reverse index of
    /// [`Schedule`](super::Schedule) is built from it).
    pub(crate) fn all_deps(&self) -> &[OpId] {
        &self.deps
    }

    /// Number of ops.
    #[inline]
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the program has no op.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The ranks this program exchanges messages with, ascending: the peers of its sends and
    /// receives, and every other rank of `world` when it posts (a post goes to everyone).
    pub fn peers(&self, rank: usize, world: usize) -> Vec<usize> {
        let mut seen = vec![false; world];
        for op in &self.ops {
            match *op {
                Op::Send { peer, .. } | Op::Recv { peer, .. } if peer < world => seen[peer] = true,
                Op::Post { .. } => seen.iter_mut().for_each(|s| *s = true),
                _ => {}
            }
        }
        (0..world).filter(|&p| p != rank && seen[p]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::{self, Params};
    use crate::schedule::Algorithm;
    use crate::types::{Collective, ReduceOp};

    fn peers(algorithm: Algorithm, rank: usize, world: usize) -> Vec<usize> {
        let p = Params {
            coll: Collective::AllReduce,
            rank,
            world,
            count: 4 * world,
            root: 0,
            op: ReduceOp::Sum,
            segment: 1 << 20,
            in_place: false,
            algorithm,
            local_size: 0,
        };
        plan::build(&p).unwrap().peers(rank, world)
    }

    #[test]
    fn peers_are_the_ranks_a_program_talks_to() {
        assert_eq!(peers(Algorithm::Ring, 5, 16), vec![4, 6]);
        assert_eq!(peers(Algorithm::Ring, 0, 16), vec![1, 15]);
        assert_eq!(
            peers(Algorithm::RecursiveDoubling, 5, 16),
            vec![1, 4, 7, 13]
        );
        // An eager program posts to everyone.
        assert_eq!(peers(Algorithm::Eager, 2, 5), vec![0, 1, 3, 4]);
        assert!(peers(Algorithm::Ring, 0, 1).is_empty());
    }
}
