//! Collective schedules as pure state machines.
//!
//! A schedule is generated once per call from `(rank, world, count, segment, ...)` into a
//! [`Program`]: a list of [`Op`]s (sends, receives, local copies) with explicit dependencies. A
//! [`Schedule`] then runs the program without doing any I/O itself:
//!
//! - [`Schedule::poll_action`] hands out the next operation that may start now;
//! - the caller (the engine, or the simulator) performs it and reports back with
//!   [`Schedule::handle_complete`].
//!
//! # Rules every program follows
//!
//! - **Matching is FIFO per peer and direction.** The k-th `Send` to peer p is received by p's
//!   k-th `Recv` from this rank; both sides agree on the length. `poll_action` therefore issues the
//!   sends to one peer in program order, and likewise the receives from one peer.
//! - **Dependencies are explicit.** An op starts only after every op it lists has completed. A
//!   `Send` completes when its bytes have left the local buffer (the buffer may be overwritten), a
//!   `Recv` when its bytes have been copied or reduced into the destination.
//! - Locations are in elements, not bytes. [`Buf::Scratch`] is a buffer of
//!   [`Program::scratch_elems`] elements that the executor provides.
//!
//! Pipelining follows from the dependencies: a ring step on segment j may run while segment j+1
//! of the previous step is still in flight.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub mod doubling;
pub mod hier;
pub mod plan;
pub mod ring;
pub mod tree;

pub use plan::{Algorithm, Params, PlanError, build, default_algorithm};

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
    /// Local copy of `len` elements.
    Copy {
        /// Source.
        src: Loc,
        /// Destination.
        dst: Loc,
        /// Number of elements.
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
    /// Number of elements this op moves or touches.
    pub fn len(&self) -> usize {
        match *self {
            Op::Send { len, .. }
            | Op::Recv { len, .. }
            | Op::Copy { len, .. }
            | Op::Finalize { len, .. } => len,
        }
    }

    /// Whether the op touches no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
    pub fn scratch_elems(&self) -> usize {
        self.scratch_elems
    }

    /// The ops in program order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The dependencies of op `id`.
    pub fn deps(&self, id: OpId) -> &[OpId] {
        let i = id as usize;
        &self.deps[self.dep_start[i] as usize..self.dep_start[i + 1] as usize]
    }

    /// Number of ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the program has no op.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    DepsDone,
    Issued,
    Complete,
}

/// Runs a [`Program`]: hands out ops whose dependencies are met, in program order per peer and
/// direction, and takes their completions.
#[derive(Debug)]
pub struct Schedule {
    prog: Program,
    pending_deps: Vec<u32>,
    rev_start: Vec<u32>,
    rev: Vec<OpId>,
    state: Vec<State>,
    ready: BinaryHeap<Reverse<OpId>>,
    /// For every op that is a send or receive: its index in its (peer, direction) queue.
    queue_of: Vec<u32>,
    /// Per (peer, direction) queue: op ids in program order, and the next index to issue.
    queues: Vec<(Vec<OpId>, usize)>,
    completed: usize,
    issued: usize,
}

const NO_QUEUE: u32 = u32::MAX;

impl Schedule {
    /// Prepares `prog` to run. `world` bounds the peer ranks that appear in it.
    ///
    /// # Panics
    ///
    /// If an op names a peer `>= world` (a generator bug, not user input).
    pub fn new(prog: Program, world: usize) -> Self {
        let n = prog.ops.len();
        let pending_deps: Vec<u32> = (0..n)
            .map(|id| prog.deps(id as OpId).len() as u32)
            .collect();
        let mut rev_count = vec![0u32; n + 1];
        for &p in &prog.deps {
            rev_count[p as usize + 1] += 1;
        }
        for i in 0..n {
            rev_count[i + 1] += rev_count[i];
        }
        let rev_start = rev_count.clone();
        let mut fill = rev_count;
        let mut rev = vec![0; prog.deps.len()];
        for id in 0..n {
            for &p in prog.deps(id as OpId) {
                rev[fill[p as usize] as usize] = id as OpId;
                fill[p as usize] += 1;
            }
        }
        let mut queues: Vec<(Vec<OpId>, usize)> = vec![(Vec::new(), 0); 2 * world];
        let mut queue_of = vec![NO_QUEUE; n];
        for (id, op) in prog.ops.iter().enumerate() {
            let q = match *op {
                Op::Send { peer, .. } => 2 * peer,
                Op::Recv { peer, .. } => 2 * peer + 1,
                _ => continue,
            };
            assert!(q < 2 * world, "op {id} names peer outside world {world}");
            queue_of[id] = q as u32;
            queues[q].0.push(id as OpId);
        }
        let mut s = Schedule {
            prog,
            pending_deps,
            rev_start,
            rev,
            state: vec![State::Waiting; n],
            ready: BinaryHeap::new(),
            queue_of,
            queues,
            completed: 0,
            issued: 0,
        };
        for id in 0..n {
            if s.pending_deps[id] == 0 {
                s.deps_done(id as OpId);
            }
        }
        s
    }

    fn is_queue_head(&self, id: OpId) -> bool {
        let q = self.queue_of[id as usize];
        if q == NO_QUEUE {
            return true;
        }
        let (ids, next) = &self.queues[q as usize];
        ids.get(*next) == Some(&id)
    }

    fn deps_done(&mut self, id: OpId) {
        self.state[id as usize] = State::DepsDone;
        if self.is_queue_head(id) {
            self.ready.push(Reverse(id));
        }
    }

    /// The next op that may start now, lowest program index first; `None` when nothing can
    /// start until a completion arrives (or the program is done). The op is marked issued.
    pub fn poll_action(&mut self) -> Option<(OpId, Op)> {
        let Reverse(id) = self.ready.pop()?;
        debug_assert_eq!(self.state[id as usize], State::DepsDone);
        self.state[id as usize] = State::Issued;
        self.issued += 1;
        let q = self.queue_of[id as usize];
        if q != NO_QUEUE {
            let (ids, next) = &mut self.queues[q as usize];
            *next += 1;
            if let Some(&nid) = ids.get(*next)
                && self.state[nid as usize] == State::DepsDone
            {
                self.ready.push(Reverse(nid));
            }
        }
        Some((id, self.prog.ops[id as usize]))
    }

    /// Reports that op `id` (returned earlier by `poll_action`) has completed.
    ///
    /// # Panics
    ///
    /// If `id` was not issued or is completed twice (an executor bug).
    pub fn handle_complete(&mut self, id: OpId) {
        let i = id as usize;
        assert_eq!(
            self.state[i],
            State::Issued,
            "op {id} completed while not issued"
        );
        self.state[i] = State::Complete;
        self.completed += 1;
        for k in self.rev_start[i]..self.rev_start[i + 1] {
            let d = self.rev[k as usize];
            self.pending_deps[d as usize] -= 1;
            if self.pending_deps[d as usize] == 0 {
                self.deps_done(d);
            }
        }
    }

    /// Whether every op has completed.
    pub fn is_done(&self) -> bool {
        self.completed == self.prog.ops.len()
    }

    /// Number of ops issued and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.issued - self.completed
    }

    /// The program being run.
    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// Puts the schedule back in its initial state, as [`new`](Self::new) left it, so the same
    /// program runs again without being generated or indexed again (and without allocating).
    pub fn restart(&mut self) {
        let n = self.prog.ops.len();
        for id in 0..n {
            self.pending_deps[id] = self.prog.deps(id as OpId).len() as u32;
            self.state[id] = State::Waiting;
        }
        self.ready.clear();
        for q in &mut self.queues {
            q.1 = 0;
        }
        self.completed = 0;
        self.issued = 0;
        for id in 0..n {
            if self.pending_deps[id] == 0 {
                self.deps_done(id as OpId);
            }
        }
    }
}

#[cfg(test)]
mod tests;
