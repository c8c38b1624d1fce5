//! The machine's side of the driver's *fast path*: an eager all-reduce over the board run
//! straight through by the driver, without the machine's rounds (see the eager part of
//! [`super::manual`]).
//!
//! The bytes are the machine's: the same posting under the same sequence number, the same
//! header checks, the same release rule. What the fast path leaves out is the bookkeeping of a
//! running operation (queues, actions, schedule), which a small all-reduce on one host pays for
//! with most of its time. The driver asks [`Protocol::fast_begin`]; with a yes it releases what
//! is due, posts, reads the peers' postings (each checked with [`Protocol::fast_check`]) and
//! reduces them in rank order, then calls [`Protocol::fast_end`]. Whenever it cannot finish
//! straight away — its posting refused, a peer not there within its spin budget, a posting that
//! carries a checksum — it starts the operation on the machine as usual, telling it that the
//! posting is already up; the machine then does everything else (reads, deadline, probes,
//! mismatches).

use super::eager::Expected;
use super::error::{ProtoError, mismatch};
use super::machine::Protocol;
use crate::Collective;
use crate::wire::{DATA_HEADER_LEN, DataHeader, Signature};

/// What the driver does first on the fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastStart {
    /// Postings of an earlier operation to release before this operation's posting (which
    /// then carries the release to the peers).
    pub release: Option<u64>,
}

impl Protocol {
    /// Starts `sig` on the fast path if it may take it: an all-reduce of the board with
    /// nothing running, no action and no peer's eager message pending, and checksums off.
    /// `None`: start it with [`start`](Self::start) as any other operation.
    ///
    /// With a yes the operation counts as started (probes report it), and the release due
    /// from the previous eager operation is handed to the driver here, not by `start`.
    pub fn fast_begin(&mut self, sig: Signature) -> Option<FastStart> {
        if !self.board
            || self.cfg.checksum
            || self.call.is_some()
            || sig.coll != Collective::AllReduce
            || !self.actions.is_empty()
            || self.parts.any()
        {
            return None;
        }
        self.last_seq = sig.seq;
        self.last_coll_seq = sig.seq;
        Expected::refresh(&mut self.expect, sig);
        Some(FastStart {
            release: self.release_due.take(),
        })
    }

    /// The header of this rank's posting for the operation [`fast_begin`](Self::fast_begin)
    /// started, written into `out` (which it replaces): message 0, no checksum, sequence
    /// number 0 (the board carries it; [`DataHeader::set_seq`]).
    pub fn fast_header(&self, out: &mut Vec<u8>) {
        let t = self.expect.as_ref().expect("fast_begin refreshed it");
        out.clear();
        out.extend_from_slice(&t.bytes);
        let mut h = DataHeader::new_unchecked(&mut out[..]);
        h.set_sender(self.cfg.rank as u32);
        h.set_seq(0);
    }

    /// Checks `peer`'s posting for `sig`, as the last board read of `peer` brought it (header
    /// and payload), as the machine checks an eager message: `Ok(true)` when it is the one
    /// expected, `Ok(false)` when it is valid but carries a checksum (the machine's way
    /// verifies it), an error when it is not `sig`'s.
    pub fn fast_check(&mut self, sig: &Signature, peer: usize) -> Result<bool, ProtoError> {
        self.parts.board_seq(peer, sig.seq);
        let data = self.parts.board_data(peer);
        if let Some(t) = self.expect.as_ref()
            && t.matches(peer, data)
            && DataHeader::new_unchecked(data).flags() == 0
        {
            return Ok(true);
        }
        let h = self.check_message_slow(peer, data, Some(sig.comm_id))?;
        let bytes = sig.count as usize * sig.dtype.size();
        if h.sig != *sig || h.msg != 0 || h.payload_len as usize != bytes {
            return Err(mismatch(peer, sig, &h, 0, bytes));
        }
        Ok(h.crc32c.is_none())
    }

    /// The payload of `peer`'s posting that the last board read of `peer` brought.
    #[inline]
    pub fn board_payload(&self, peer: usize) -> &[u8] {
        let d = self.parts.board_data(peer);
        &d[DATA_HEADER_LEN.min(d.len())..]
    }

    /// The operation `seq` that [`fast_begin`](Self::fast_begin) started is done: its
    /// postings are released when the next operation starts.
    pub fn fast_end(&mut self, seq: u64) {
        self.release_due = Some(seq);
    }
}
