//! Groups: several operations started together and waited for together, as
//! `ncclGroupStart`/`ncclGroupEnd` (coalesced collectives, batched point-to-point).
//!
//! A [`Group`] collects checked calls; [`Group::start`] launches them and returns a
//! [`GroupPending`] that holds every buffer until all have ended. The calls run one after
//! another as the group is driven ([`GroupPending::test`], [`GroupPending::wait`]): the
//! collectives first, in the order they were added (every rank adds them in the same order),
//! then the sends and receives, ordered so that no two ranks can wait for each other:
//! by peer, ascending; with one peer, the lower rank's sends go first (then its receives), the
//! higher rank's receives first (then its sends). Every rank's point-to-point traffic thus
//! follows one global order of pairs, so a group in which two ranks both send and both
//! receive large messages completes, where the same blocking calls in program order would
//! wait for each other.

use super::call::Call;
use super::communicator::Communicator;
use crate::Element;
use crate::Result;
use gradsync_core::ReduceOp;
use std::collections::VecDeque;
use std::marker::PhantomData;

/// Operations to start together; made by [`Communicator::group`]. Each method checks its
/// arguments at once and returns `self` for chaining; the buffers stay borrowed until the group
/// has ended.
///
/// The operations run one after another as the group is driven: the collectives first, in the
/// order they were added (every rank adds them in the same order), then the sends and
/// receives, ordered so that no two ranks wait for each other: by peer, ascending, and with
/// one peer the lower rank sends first while the higher receives first. A group in which two
/// ranks both send and both receive messages larger than a peer buffers therefore completes,
/// where the same blocking calls in program order would wait for each other.
#[derive(Debug)]
#[must_use = "a group does nothing until it is started or waited for"]
pub struct Group<'a> {
    comm: &'a mut Communicator,
    calls: Vec<Call>,
    _bufs: PhantomData<&'a mut [u8]>,
}

/// A started group; it holds every buffer of the group until all its operations have ended
/// ([`wait`](Self::wait), or drop, which waits).
#[derive(Debug)]
#[must_use = "a group completes only when it is waited for (or dropped, which waits)"]
pub struct GroupPending<'a> {
    comm: &'a mut Communicator,
    calls: VecDeque<Call>,
    running: bool,
    failed: bool,
    _bufs: PhantomData<&'a mut [u8]>,
}

impl Communicator {
    /// An empty group of operations on this communicator.
    pub fn group(&mut self) -> Group<'_> {
        Group {
            comm: self,
            calls: Vec::new(),
            _bufs: PhantomData,
        }
    }
}

impl<'a> Group<'a> {
    fn push(mut self, call: Result<Call>) -> Result<Self> {
        let call = call?;
        // An operator the type does not have is refused when it is added, not when it runs.
        if let Call::Planned {
            coll, dtype, op, ..
        } = &call
        {
            self.comm.check_op(*coll, *dtype, *op)?;
        }
        self.calls.push(call);
        Ok(self)
    }

    /// Adds an in-place all-reduce.
    pub fn all_reduce<T: Element>(self, buf: &'a mut [T], op: ReduceOp) -> Result<Self> {
        let call = self.comm.c_all_reduce(buf, op);
        self.push(Ok(call))
    }

    /// Adds an out-of-place all-reduce.
    pub fn all_reduce_into<T: Element>(
        self,
        input: &'a [T],
        output: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Self> {
        let call = self.comm.c_all_reduce_into(input, output, op);
        self.push(call)
    }

    /// Adds a reduce-scatter.
    pub fn reduce_scatter<T: Element>(
        self,
        input: &'a [T],
        output: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Self> {
        let call = self.comm.c_reduce_scatter(input, output, op);
        self.push(call)
    }

    /// Adds an in-place reduce-scatter.
    pub fn reduce_scatter_in_place<T: Element>(
        self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Self> {
        let call = self.comm.c_reduce_scatter_in_place(buf, op);
        self.push(call)
    }

    /// Adds an all-gather.
    pub fn all_gather<T: Element>(self, input: &'a [T], output: &'a mut [T]) -> Result<Self> {
        let call = self.comm.c_all_gather(input, output);
        self.push(call)
    }

    /// Adds an in-place all-gather.
    pub fn all_gather_in_place<T: Element>(self, buf: &'a mut [T]) -> Result<Self> {
        let call = self.comm.c_all_gather_in_place(buf);
        self.push(call)
    }

    /// Adds a broadcast.
    pub fn broadcast<T: Element>(self, buf: &'a mut [T], root: usize) -> Result<Self> {
        let call = self.comm.c_broadcast(buf, root);
        self.push(call)
    }

    /// Adds a reduce.
    pub fn reduce<T: Element>(
        self,
        input: &'a [T],
        output: &'a mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Self> {
        let call = self.comm.c_reduce(input, output, op, root);
        self.push(call)
    }

    /// Adds an all-to-all.
    pub fn all_to_all<T: Element>(self, input: &'a [T], output: &'a mut [T]) -> Result<Self> {
        let call = self.comm.c_all_to_all(input, output);
        self.push(call)
    }

    /// Adds an all-to-allv.
    pub fn all_to_allv<T: Element>(
        self,
        input: &'a [T],
        send_counts: &[usize],
        output: &'a mut [T],
        recv_counts: &[usize],
    ) -> Result<Self> {
        let call = self
            .comm
            .c_all_to_allv(input, send_counts, output, recv_counts);
        self.push(call)
    }

    /// Adds a gather.
    pub fn gather<T: Element>(
        self,
        input: &'a [T],
        output: &'a mut [T],
        root: usize,
    ) -> Result<Self> {
        let call = self.comm.c_gather(input, output, root);
        self.push(call)
    }

    /// Adds a scatter.
    pub fn scatter<T: Element>(
        self,
        input: &'a [T],
        output: &'a mut [T],
        root: usize,
    ) -> Result<Self> {
        let call = self.comm.c_scatter(input, output, root);
        self.push(call)
    }

    /// Adds a send to `peer`.
    pub fn send<T: Element>(self, buf: &'a [T], peer: usize) -> Result<Self> {
        let call = self.comm.c_p2p(buf, peer, true);
        self.push(call)
    }

    /// Adds a receive from `peer`.
    pub fn recv<T: Element>(self, buf: &'a mut [T], peer: usize) -> Result<Self> {
        let call = self.comm.c_p2p(buf, peer, false);
        self.push(call)
    }

    /// Number of operations in the group.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether the group has no operation.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Starts the group: its first operation is launched at once, the others as it is driven.
    pub fn start(self) -> Result<GroupPending<'a>> {
        let rank = self.comm.rank;
        type Numbered = Vec<(usize, Call)>;
        let (mut p2p, colls): (Numbered, Numbered) = self
            .calls
            .into_iter()
            .enumerate()
            .partition(|(_, c)| c.peer().is_some());
        // One global order of pairs: by peer; with one peer, the lower rank sends first.
        p2p.sort_by_key(|(i, c)| {
            let peer = c.peer().unwrap_or(0);
            let sends_first = rank < peer;
            let is_send = matches!(c, Call::P2p { send: true, .. });
            (peer, is_send != sends_first, *i)
        });
        let calls = colls.into_iter().chain(p2p).map(|(_, c)| c).collect();
        let mut g = GroupPending {
            comm: self.comm,
            calls,
            running: false,
            failed: false,
            _bufs: PhantomData,
        };
        g.step(false)?;
        Ok(g)
    }

    /// Starts the group and waits for all of it.
    pub fn wait(self) -> Result<()> {
        self.start()?.wait()
    }
}

impl GroupPending<'_> {
    /// Drives the group: launches operations in turn; with `block`, until all have ended.
    fn step(&mut self, block: bool) -> Result<bool> {
        if self.failed {
            return Ok(true);
        }
        let r = self.step_inner(block);
        if r.is_err() {
            // The communicator is failed or the call was refused: nothing more runs.
            self.failed = true;
            self.calls.clear();
            self.running = false;
        }
        r
    }

    fn step_inner(&mut self, block: bool) -> Result<bool> {
        loop {
            if self.running {
                if !self.comm.engine.progress(block)? {
                    return Ok(false);
                }
                self.running = false;
            }
            let Some(call) = self.calls.pop_front() else {
                return Ok(true);
            };
            // SAFETY: the group's buffers stay borrowed for 'a by this GroupPending until every
            // call has ended (its wait or drop); a leaked one poisons the communicator and the
            // buffers are never touched again (no progress happens outside calls made through
            // the handle).
            unsafe { self.comm.launch(call)? };
            self.running = true;
        }
    }

    /// Drives the group without blocking; `true` once every operation has ended.
    pub fn test(&mut self) -> Result<bool> {
        self.step(false)
    }

    /// Waits for every operation of the group (each bounded by the communicator's timeout).
    pub fn wait(mut self) -> Result<()> {
        self.step(true).map(drop)
    }
}

impl Drop for GroupPending<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.step(true) {
            tracing::warn!(target: "gradsync::coll", "group dropped without wait failed: {e}");
        }
    }
}
