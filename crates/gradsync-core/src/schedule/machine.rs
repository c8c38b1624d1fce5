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
    /// For every op: its state and counters.
    counts: Vec<Counts>,
    rev_start: Vec<u32>,
    rev: Vec<OpId>,
    ready: BinaryHeap<Reverse<OpId>>,
    /// For every op: its queue ([`NO_QUEUE`] for local ops, [`ALL_SENDS`] for a post).
    queue_of: Vec<u32>,
    /// Per (peer, direction) queue (`2 * peer` sends, `2 * peer + 1` receives): op ids in
    /// program order, and the next index to issue.
    queues: Vec<(Vec<OpId>, usize)>,
    completed: usize,
    issued: usize,
    /// The initial `counts`, and the ops ready at the start in program order (a valid heap): a
    /// restart copies them instead of indexing the program again.
    init_ops: Vec<Counts>,
    init_ready: Vec<Reverse<OpId>>,
}

/// The state of one op and what it waits for, together so that a restart is one copy.
#[derive(Clone, Copy, Debug)]
struct Counts {
    state: State,
    /// Dependencies not completed yet.
    pending: u32,
    /// How many of its queues still hold an unissued op before it.
    blocked: u32,
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
        let mut blocked = vec![0u32; n];
        for q in &queues {
            for &id in q.0.iter().skip(1) {
                blocked[id as usize] += 1;
            }
        }
        let init_ops: Vec<Counts> = (0..n)
            .map(|id| Counts {
                state: if pending_deps[id] == 0 {
                    State::DepsDone
                } else {
                    State::Waiting
                },
                pending: pending_deps[id],
                blocked: blocked[id],
            })
            .collect();
        let init_ready = (0..n)
            .filter(|&id| pending_deps[id] == 0 && blocked[id] == 0)
            .map(|id| Reverse(id as OpId))
            .collect();
        let mut s = Schedule {
            prog,
            counts: init_ops.clone(),
            rev_start,
            rev,
            ready: BinaryHeap::new(),
            queue_of,
            queues,
            completed: 0,
            issued: 0,
            init_ops,
            init_ready,
        };
        s.reset();
        s
    }

    /// Sets every op waiting, every queue at its start, and releases the ops without
    /// dependencies.
    fn reset(&mut self) {
        self.counts.copy_from_slice(&self.init_ops);
        for q in &mut self.queues {
            q.1 = 0;
        }
        // Ascending ids are a valid min-heap: rebuilding it only looks.
        let mut ready = std::mem::take(&mut self.ready).into_vec();
        ready.clear();
        ready.extend_from_slice(&self.init_ready);
        self.ready = BinaryHeap::from(ready);
        self.completed = 0;
        self.issued = 0;
    }

    fn deps_done(&mut self, id: OpId) {
        let o = &mut self.counts[id as usize];
        o.state = State::DepsDone;
        if o.blocked == 0 {
            self.ready.push(Reverse(id));
        }
    }

    /// Moves queue `q` past its head `id`, and releases the next op if it is now ready.
    fn advance(&mut self, q: usize, id: OpId) {
        let (ids, next) = &mut self.queues[q];
        debug_assert_eq!(ids.get(*next), Some(&id));
        *next += 1;
        if let Some(&nid) = ids.get(*next) {
            let o = &mut self.counts[nid as usize];
            o.blocked -= 1;
            if o.blocked == 0 && o.state == State::DepsDone {
                self.ready.push(Reverse(nid));
            }
        }
    }

    /// The next op that may start now, lowest program index first; `None` when nothing can
    /// start until a completion arrives (or the program is done). The op is marked issued.
    pub fn poll_action(&mut self) -> Option<(OpId, Op)> {
        let id = self.poll_id()?;
        Some((id, self.prog.ops()[id as usize]))
    }

    /// As [`poll_action`](Self::poll_action), the op's id alone (its op is
    /// [`op`](Self::op)).
    pub fn poll_id(&mut self) -> Option<OpId> {
        let Reverse(id) = self.ready.pop()?;
        debug_assert_eq!(self.counts[id as usize].state, State::DepsDone);
        self.counts[id as usize].state = State::Issued;
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
        Some(id)
    }

    /// Op `id` of the program.
    #[inline]
    pub fn op(&self, id: OpId) -> &Op {
        &self.prog.ops()[id as usize]
    }

    /// Reports that op `id` (returned earlier by `poll_action`) has completed.
    ///
    /// # Panics
    ///
    /// If `id` was not issued or is completed twice (an executor bug).
    pub fn handle_complete(&mut self, id: OpId) {
        let i = id as usize;
        assert_eq!(
            self.counts[i].state,
            State::Issued,
            "op {id} completed while not issued"
        );
        self.counts[i].state = State::Complete;
        self.completed += 1;
        for k in self.rev_start[i]..self.rev_start[i + 1] {
            let d = self.rev[k as usize];
            let o = &mut self.counts[d as usize];
            o.pending -= 1;
            if o.pending == 0 {
                self.deps_done(d);
            }
        }
    }

    /// Whether an op may start now ([`poll_action`](Self::poll_action) has one).
    #[inline]
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Whether every op has completed.
    #[inline]
    pub fn is_done(&self) -> bool {
        self.completed == self.prog.len()
    }

    /// Number of ops issued and not yet completed.
    #[inline]
    pub fn in_flight(&self) -> usize {
        self.issued - self.completed
    }

    /// The program being run.
    #[inline]
    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// Puts the schedule back in its initial state, as [`new`](Self::new) left it, so the same
    /// program runs again without being generated or indexed again (and without allocating).
    pub fn restart(&mut self) {
        self.reset();
    }
}
