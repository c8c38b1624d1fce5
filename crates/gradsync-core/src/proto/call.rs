//! The operation in flight: its schedule, and the sends and receives the schedule has issued
//! that wait for the protocol (a credit, an arrival, a clear-to-send).

use super::link::IdMap;
use crate::schedule::{Loc, OpId, Schedule};
use crate::wire::Signature;
use std::collections::VecDeque;
use std::time::Instant;

/// How an operation's messages travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Through inbox slots, with credits, or straight into the receiver's buffer after its
    /// clear-to-send.
    Slots,
    /// As whole two-sided messages (or board postings), no slot, credit or clear-to-send: the
    /// path of small all-reduces.
    Eager,
}

/// A send the schedule issued.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PostedSend {
    pub(crate) id: OpId,
    pub(crate) src: Loc,
    pub(crate) len: usize,
}

/// A receive the schedule issued.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PostedRecv {
    pub(crate) id: OpId,
    pub(crate) len: usize,
    pub(crate) dst: Loc,
    pub(crate) with: Option<Loc>,
    /// Index of the message, per peer, within the operation.
    pub(crate) msg: u32,
    /// Whether a clear-to-send went out for it (it may then arrive directly).
    pub(crate) direct: bool,
    /// From a pooled peer: the slot of the shared pool its clear-to-send named, once one was
    /// granted (it lands there, then is delivered from there).
    pub(crate) pool: Option<u32>,
    /// From a pooled peer: waits for a slot of the shared pool (no clear-to-send yet).
    pub(crate) awaiting: bool,
}

/// The per-operation queues. A finished operation's are emptied and reused by the next one,
/// so that starting an operation allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct Queues {
    pub(crate) sendq: Vec<VecDeque<PostedSend>>,
    pub(crate) recvq: Vec<VecDeque<PostedRecv>>,
    pub(crate) send_msg: Vec<u32>,
    pub(crate) recv_issued: Vec<u32>,
    /// Message indices, per peer, of direct writes that have landed.
    pub(crate) direct_arrived: Vec<Vec<u32>>,
    /// Writes in flight: work-request id -> (op, peer, slot or `usize::MAX` for a direct write).
    pub(crate) inflight: IdMap<u64, (OpId, usize, usize)>,
    /// Posts waiting to go out (a refused board posting is tried again next round).
    pub(crate) posts: VecDeque<PostedSend>,
    /// Sends and posts queued, receives posted and not yet done: a pass skips what has none.
    pub(crate) sends: usize,
    pub(crate) recvs: usize,
    /// An operation ended without completing: the next reset empties everything.
    used: bool,
}

impl Queues {
    /// The peers this operation waits on: those with a receive outstanding or a send held
    /// for want of credits; else those whose writes are in flight.
    pub(crate) fn waiting_on(&self, credits: impl Fn(usize) -> usize) -> Vec<usize> {
        let w = self.recvq.len();
        let mut v: Vec<usize> = (0..w)
            .filter(|&p| {
                !self.recvq[p].is_empty() || (!self.sendq[p].is_empty() && credits(p) == 0)
            })
            .collect();
        if v.is_empty() {
            v = self.inflight.values().map(|x| x.1).collect();
            v.sort_unstable();
            v.dedup();
        }
        v
    }
    /// Empties everything for a world of `w` ranks, keeping the allocations. After a
    /// completed operation the queues are empty already and only the counters go back to 0.
    pub(crate) fn reset(&mut self, w: usize) {
        if self.send_msg.len() != w {
            self.sendq.resize_with(w, VecDeque::new);
            self.recvq.resize_with(w, VecDeque::new);
            self.send_msg.resize(w, 0);
            self.recv_issued.resize(w, 0);
            self.direct_arrived.resize_with(w, Vec::new);
        }
        if std::mem::take(&mut self.used) {
            // A failed operation may have left anything behind.
            self.sendq.iter_mut().for_each(VecDeque::clear);
            self.recvq.iter_mut().for_each(VecDeque::clear);
            self.direct_arrived.iter_mut().for_each(Vec::clear);
            self.inflight.clear();
            self.posts.clear();
            self.sends = 0;
            self.recvs = 0;
        }
        self.send_msg.fill(0);
        self.recv_issued.fill(0);
    }

    /// Marks the queues as possibly not empty (an operation that did not complete).
    pub(crate) fn abandon(&mut self) {
        self.used = true;
    }
}

/// One operation in flight.
#[derive(Debug)]
pub(crate) struct Call {
    pub(crate) sig: Signature,
    pub(crate) sched: Box<Schedule>,
    pub(crate) mode: Mode,
    /// Remote keys of the driver's Input, Output and Scratch regions (0: none).
    pub(crate) rkeys: [u32; 3],
    pub(crate) started: Instant,
}

impl Call {
    #[inline]
    pub(crate) fn is_done(&self) -> bool {
        self.sched.is_done()
    }
}
