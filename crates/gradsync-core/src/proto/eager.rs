//! Eager contributions: whole messages (two-sided, or read off a peer's board) that carry a
//! data header and their payload, kept until the operation they belong to takes them.

use crate::wire::{DATA_HEADER_LEN, DataHeaderRepr};
use std::collections::VecDeque;

/// Eager messages a peer may have sent for operations this rank has not reached.
pub const EAGER_AHEAD_MAX: usize = 4;

/// Spare buffers kept for reuse, per peer.
const SPARE_PER_PEER: usize = 2;

/// One eager message: its parsed header and the whole message as it arrived.
#[derive(Debug)]
pub(crate) struct Part {
    pub(crate) hdr: DataHeaderRepr,
    pub(crate) data: Vec<u8>,
}

/// The eager messages of every peer.
#[derive(Debug, Default)]
pub(crate) struct Parts {
    /// Arrived and not yet taken, per peer, in arrival order.
    pub(crate) pending: Vec<VecDeque<Part>>,
    /// The message most recently handed to the driver, per peer (its payload is what a
    /// [`DeliverEager`](super::Action::DeliverEager) copies).
    delivered: Vec<Vec<u8>>,
    /// Where the driver reads a peer's board posting, per peer.
    board: Vec<Vec<u8>>,
    /// Buffers for reuse.
    spare: Vec<Vec<u8>>,
}

impl Parts {
    pub(crate) fn new(world: usize) -> Self {
        Parts {
            pending: (0..world).map(|_| VecDeque::new()).collect(),
            delivered: vec![Vec::new(); world],
            board: vec![Vec::new(); world],
            spare: Vec::new(),
        }
    }

    /// The first pending message of `peer` for an operation up to `seq`, if any.
    pub(crate) fn find(&self, peer: usize, seq: u64) -> Option<&Part> {
        self.pending[peer].iter().find(|p| p.hdr.sig.seq <= seq)
    }

    /// Takes the first pending message of `peer` for an operation up to `seq` and makes its
    /// payload the one [`payload`](Self::payload) shows.
    pub(crate) fn take(&mut self, peer: usize, seq: u64) -> Option<DataHeaderRepr> {
        let q = &mut self.pending[peer];
        let i = q.iter().position(|p| p.hdr.sig.seq <= seq)?;
        let part = q.remove(i)?;
        let old = std::mem::replace(&mut self.delivered[peer], part.data);
        self.recycle(old);
        Some(part.hdr)
    }

    /// The payload of `peer`'s message handed out last.
    pub(crate) fn payload(&self, peer: usize) -> &[u8] {
        let d = &self.delivered[peer];
        &d[DATA_HEADER_LEN.min(d.len())..]
    }

    /// The buffer a board read of `peer` fills.
    pub(crate) fn board_buf(&mut self, peer: usize) -> &mut Vec<u8> {
        &mut self.board[peer]
    }

    /// What the last board read of `peer` brought.
    pub(crate) fn board_data(&self, peer: usize) -> &[u8] {
        &self.board[peer]
    }

    /// Queues what the last board read of `peer` brought, as a message of `hdr`.
    pub(crate) fn push_board(&mut self, peer: usize, hdr: DataHeaderRepr) {
        let fresh = self.spare.pop().unwrap_or_default();
        let data = std::mem::replace(&mut self.board[peer], fresh);
        self.pending[peer].push_back(Part { hdr, data });
    }

    /// Queues a two-sided message of `peer`.
    pub(crate) fn push(&mut self, peer: usize, hdr: DataHeaderRepr, data: Vec<u8>) {
        self.pending[peer].push_back(Part { hdr, data });
    }

    fn recycle(&mut self, mut v: Vec<u8>) {
        if v.capacity() > 0 && self.spare.len() < SPARE_PER_PEER * self.board.len() {
            v.clear();
            self.spare.push(v);
        }
    }
}
