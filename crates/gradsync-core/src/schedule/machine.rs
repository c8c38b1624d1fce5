//! [`Schedule`]: the state machine that runs a [`Program`], handing out the ops that may start
//! and taking their completions, with no I/O of its own.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::program::{Op, OpId, Program};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    DepsDone,
    Issued,
    Complete,
}

/// Runs a [`Program`]: hands out ops whose dependencies are met, in program order per peer and
/// direction, and takes their completions.
///
/// Every send and receive belongs to one (peer, direction) queue; a [`Op::Post`] belongs to the
/// send queues of every peer at once, so that the messages to each peer, sends and posts
/// together, are issued in program order. An op is handed out once its dependencies have
/// completed and it heads every queue it belongs to.
#[derive(Debug)]
pub struct Schedule {
    prog: Program,
    pending_deps: Vec<u32>,
    rev_start: Vec<u32>,
    rev: Vec<OpId>,
    state: Vec<State>,
    ready: BinaryHeap<Reverse<OpId>>,
    /// For every op: its queue ([`NO_QUEUE`] for local ops, [`ALL_SENDS`] for a post).
    queue_of: Vec<u32>,
    /// For every op: how many of its queues still hold an unissued op before it.
    blocked: Vec<u32>,
    /// Per (peer, direction) queue (`2 * peer` sends, `2 * peer + 1` receives): op ids in
    /// program order, and the next index to issue.
    queues: Vec<(Vec<OpId>, usize)>,
    completed: usize,
    issued: usize,
}

/// The op is in no queue.
const NO_QUEUE: u32 = u32::MAX;
/// The op is in the send queue of every peer.
const ALL_SENDS: u32 = u32::MAX - 1;

impl Schedule {
    /// Prepares `prog` to run. `world` bounds the peer ranks that appear in it.
    ///
    /// # Panics
    ///
    /// If an op names a peer `>= world` (a generator bug, not user input).
    pub fn new(prog: Program, world: usize) -> Self {
        let n = prog.len();
        let pending_deps: Vec<u32> = (0..n)
            .map(|id| prog.deps(id as OpId).len() as u32)
            .collect();
        let mut rev_count = vec![0u32; n + 1];
        for &p in prog.all_deps() {
            rev_count[p as usize + 1] += 1;
        }
        for i in 0..n {
            rev_count[i + 1] += rev_count[i];
        }
        let rev_start = rev_count.clone();
        let mut fill = rev_count;
        let mut rev = vec![0; prog.all_deps().len()];
        for id in 0..n {
            for &p in prog.deps(id as OpId) {
                rev[fill[p as usize] as usize] = id as OpId;
                fill[p as usize] += 1;
            }
        }
        let mut queues: Vec<(Vec<OpId>, usize)> = vec![(Vec::new(), 0); 2 * world];
        let mut queue_of = vec![NO_QUEUE; n];
        for (id, op) in prog.ops().iter().enumerate() {
            let q = match *op {
                Op::Send { peer, .. } => 2 * peer,
                Op::Recv { peer, .. } => 2 * peer + 1,
                Op::Post { .. } => {
                    queue_of[id] = ALL_SENDS;
                    for p in 0..world {
                        queues[2 * p].0.push(id as OpId);
                    }
                    continue;
                }
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
            blocked: vec![0; n],
            queues,
            completed: 0,
            issued: 0,
        };
        s.reset();
        s
    }

    /// Sets every op waiting, every queue at its start, and releases the ops without
    /// dependencies.
    fn reset(&mut self) {
        let n = self.prog.len();
        self.blocked.fill(0);
        for q in &mut self.queues {
            q.1 = 0;
            for &id in q.0.iter().skip(1) {
                self.blocked[id as usize] += 1;
            }
        }
        for id in 0..n {
            self.pending_deps[id] = self.prog.deps(id as OpId).len() as u32;
            self.state[id] = State::Waiting;
        }
        self.ready.clear();
        self.completed = 0;
        self.issued = 0;
        for id in 0..n {
            if self.pending_deps[id] == 0 {
                self.deps_done(id as OpId);
            }
        }
    }

    fn deps_done(&mut self, id: OpId) {
        self.state[id as usize] = State::DepsDone;
        if self.blocked[id as usize] == 0 {
            self.ready.push(Reverse(id));
        }
    }

    /// Moves queue `q` past its head `id`, and releases the next op if it is now ready.
    fn advance(&mut self, q: usize, id: OpId) {
        let (ids, next) = &mut self.queues[q];
        debug_assert_eq!(ids.get(*next), Some(&id));
        *next += 1;
        if let Some(&nid) = ids.get(*next) {
            let b = &mut self.blocked[nid as usize];
            *b -= 1;
            if *b == 0 && self.state[nid as usize] == State::DepsDone {
                self.ready.push(Reverse(nid));
            }
        }
    }

    /// The next op that may start now, lowest program index first; `None` when nothing can
    /// start until a completion arrives (or the program is done). The op is marked issued.
    pub fn poll_action(&mut self) -> Option<(OpId, Op)> {
        let Reverse(id) = self.ready.pop()?;
        debug_assert_eq!(self.state[id as usize], State::DepsDone);
        self.state[id as usize] = State::Issued;
        self.issued += 1;
        match self.queue_of[id as usize] {
            NO_QUEUE => {}
            ALL_SENDS => {
                for p in 0..self.queues.len() / 2 {
                    self.advance(2 * p, id);
                }
            }
            q => self.advance(q as usize, id),
        }
        Some((id, self.prog.ops()[id as usize]))
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
        self.completed == self.prog.len()
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
        self.reset();
    }
}
