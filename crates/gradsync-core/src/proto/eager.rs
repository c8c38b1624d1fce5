//! Eager contributions: whole messages (two-sided, or read off a peer's board) that carry a
//! data header and their payload, kept until the operation they belong to takes them.

use crate::wire::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr, Signature};
use std::collections::VecDeque;

/// Eager messages a peer may have sent for operations this rank has not reached.
pub const EAGER_AHEAD_MAX: usize = 4;

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
    /// Where the driver reads a peer's board posting, per peer (swapped with `delivered` when
    /// one is taken, so that neither allocates again).
    board: Vec<Vec<u8>>,
}

impl Parts {
    pub(crate) fn new(world: usize) -> Self {
        Parts {
            pending: (0..world).map(|_| VecDeque::new()).collect(),
            delivered: vec![Vec::new(); world],
            board: vec![Vec::new(); world],
        }
    }

    /// Whether any message is pending.
    pub(crate) fn any(&self) -> bool {
        self.pending.iter().any(|q| !q.is_empty())
    }

    /// The first pending message of `peer` for an operation up to `seq`, if any.
    pub(crate) fn find(&self, peer: usize, seq: u64) -> Option<&Part> {
        self.pending[peer].iter().find(|p| p.hdr.sig.seq <= seq)
    }

    /// Takes the first pending message of `peer` for an operation up to `seq` and makes its
    /// payload the one [`payload`](Self::payload) shows; its header.
    #[inline]
    pub(crate) fn take(&mut self, peer: usize, seq: u64) -> Option<DataHeaderRepr> {
        let q = &mut self.pending[peer];
        let part = match q.front() {
            None => return None,
            Some(p) if p.hdr.sig.seq <= seq => q.pop_front()?,
            _ => {
                let i = q.iter().position(|p| p.hdr.sig.seq <= seq)?;
                q.remove(i)?
            }
        };
        self.delivered[peer] = part.data;
        Some(part.hdr)
    }

    /// The payload of `peer`'s message handed out last.
    #[inline]
    pub(crate) fn payload(&self, peer: usize) -> &[u8] {
        let d = &self.delivered[peer];
        &d[DATA_HEADER_LEN.min(d.len())..]
    }

    /// The buffer a board read of `peer` fills.
    #[inline]
    pub(crate) fn board_buf(&mut self, peer: usize) -> &mut Vec<u8> {
        &mut self.board[peer]
    }

    /// Writes `seq`, the number the last board read of `peer` was made under, back into the
    /// posting's header, which carries 0 there ([`DataHeader::set_seq`]).
    #[inline]
    pub(crate) fn board_seq(&mut self, peer: usize, seq: u64) {
        let b = &mut self.board[peer];
        if b.len() >= DATA_HEADER_LEN {
            DataHeader::new_unchecked(&mut b[..]).set_seq(seq);
        }
    }

    /// What the last board read of `peer` brought.
    #[inline]
    pub(crate) fn board_data(&self, peer: usize) -> &[u8] {
        &self.board[peer]
    }

    /// Makes what the last board read of `peer` brought the payload [`payload`](Self::payload)
    /// shows.
    pub(crate) fn accept_board(&mut self, peer: usize) {
        std::mem::swap(&mut self.board[peer], &mut self.delivered[peer]);
    }

    /// Queues a two-sided message of `peer`.
    pub(crate) fn push(&mut self, peer: usize, hdr: DataHeaderRepr, data: Vec<u8>) {
        self.pending[peer].push_back(Part { hdr, data });
    }
}

/// The header of the running eager operation's messages (sender 0, no checksum).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expected {
    pub(crate) bytes: [u8; DATA_HEADER_LEN],
    pub(crate) payload_len: u32,
}

impl Expected {
    /// Whether `data` is a whole message of `peer` with this header: the same bytes but for
    /// the flags, the sender (`peer`) and the checksum, and the payload length it announces.
    #[inline]
    pub(crate) fn matches(&self, peer: usize, data: &[u8]) -> bool {
        if data.len() != DATA_HEADER_LEN + self.payload_len as usize {
            return false;
        }
        // Word by word, inlined: this runs for every eager message and board posting. No load
        // straddles the sequence number (bytes 16-23), which a board reader has just written
        // back: a load that overlaps a recent store only in part waits for it.
        let w64 = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8"));
        let w32 = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4"));
        let (d, t) = (&data[..DATA_HEADER_LEN], &self.bytes);
        // Bytes 0-2 (magic, version; not the flags), the signature and the fields to byte 43,
        // and 44-47 (the sender).
        (w32(d, 0) ^ w32(t, 0)) & 0x00ff_ffff == 0
            && w64(d, 4) == w64(t, 4)
            && w32(d, 12) == w32(t, 12)
            && [16, 24, 32].iter().all(|&at| w64(d, at) == w64(t, at))
            && w32(d, 40) == w32(t, 40)
            && w32(d, 44) == peer as u32
    }

    /// Makes `slot` the template of `sig`'s messages: written whole the first time, after
    /// that only the two fields that differ between calls (signature and length).
    pub(crate) fn refresh(slot: &mut Option<Expected>, sig: Signature) {
        let payload_len = (sig.count * sig.dtype.size() as u64) as u32;
        if let Some(t) = slot {
            let mut h = DataHeader::new_unchecked(&mut t.bytes[..]);
            h.set_signature(&sig);
            h.set_payload_len(payload_len);
            t.payload_len = payload_len;
            return;
        }
        let mut bytes = [0u8; DATA_HEADER_LEN];
        DataHeaderRepr {
            sig,
            msg: 0,
            payload_len,
            sender: 0,
            crc32c: None,
        }
        .emit(&mut DataHeader::new_unchecked(&mut bytes[..]));
        *slot = Some(Expected { bytes, payload_len });
    }
}
