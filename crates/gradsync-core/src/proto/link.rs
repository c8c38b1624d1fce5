//! One direction pair with one peer: credits and window, slot choice, message counters,
//! arrivals, clear-to-send offers, and when the peer was last heard from.

use crate::wire::{Cts, DataHeaderRepr};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

/// Immediate-value flag of a write that went straight to the receiver's destination; the other
/// 31 bits carry the message index. A slot write's immediate is its message counter's low 31
/// bits.
pub const IMM_DIRECT: u32 = 1 << 31;

/// Clear-to-send offers a peer may have outstanding.
pub(crate) const MAX_OFFERS: usize = 1 << 16;

/// Hashes an id that is already well spread in its low bits as itself.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (self.0 ^ u64::from(v)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by ids, hashed as themselves.
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// The protocol state of this rank with one peer.
#[derive(Debug)]
pub(crate) struct Link {
    /// Slots of the pair's part of an inbox in use, at most the inbox's slots per peer:
    /// message k goes to slot `k % window`, and as many may be in flight. Both ranks of the
    /// pair use the same window.
    pub(crate) window: usize,
    /// Slots of the peer's inbox this rank may write now.
    pub(crate) credits: usize,
    /// Messages sent through slots (all operations).
    pub(crate) tx_ctr: u64,
    /// Messages received through slots and consumed.
    pub(crate) rx_ctr: u64,
    /// The header of the message that landed in each slot and was not consumed yet.
    pub(crate) arrived: Vec<Option<DataHeaderRepr>>,
    /// Whether the header staged for each slot is still in flight (until its write is done).
    pub(crate) hdr_busy: Vec<bool>,
    /// Slots consumed and not yet returned to the peer.
    pub(crate) unreturned: u32,
    /// When the peer was last heard from, and the sequence number then.
    pub(crate) last_heard: Option<(Instant, u64)>,
    /// Clear-to-send offers from the peer, by (sequence number, message index).
    pub(crate) offers: IdMap<(u64, u32), Cts>,
    /// Copy-receives from the peer of at least this many bytes are direct writes.
    pub(crate) direct_min: usize,
    /// The same in the collectives whose every receive copies (see `receives_only_copy`),
    /// where the sender waits for the offer, for messages of blocks of at least
    /// `move_block_min` bytes (smaller blocks follow `direct_min`).
    pub(crate) move_direct_min: usize,
    /// The block size (the whole of what the pair moves one way in a call, before it is cut
    /// into messages) from which `move_direct_min` applies.
    pub(crate) move_block_min: usize,
    /// The peer has no part of this rank's inbox (nor this rank of its): every message
    /// between them goes where the receiver's clear-to-send says, into the destination or a
    /// slot of the receiver's shared pool. The window and the credits are 0.
    pub(crate) pooled: bool,
    /// Pooled: clear-to-sends name pool slots by address, not offset.
    pub(crate) pool_absolute: bool,
    /// Pooled: the messages (sequence number, index, whether of a send/recv) the peer said
    /// are ready to send, which this rank may stage in its pool.
    pub(crate) ready: Vec<(u64, u32, bool)>,
    /// Pooled: the last message this rank said is ready to send to the peer.
    pub(crate) announced: Option<(u64, u32)>,
}

impl Link {
    pub(crate) fn new(nslots: usize, direct_min: usize) -> Self {
        Link {
            window: nslots,
            credits: nslots,
            tx_ctr: 0,
            rx_ctr: 0,
            arrived: vec![None; nslots],
            hdr_busy: vec![false; nslots],
            unreturned: 0,
            last_heard: None,
            offers: IdMap::default(),
            direct_min,
            move_direct_min: direct_min,
            move_block_min: 0,
            pooled: false,
            pool_absolute: false,
            ready: Vec::new(),
            announced: None,
        }
    }

    /// The direct-write threshold of a call: `move_direct_min` where every receive copies and
    /// the pair's block is `block` bytes, at least `move_block_min` (`usize::MAX`: a block of
    /// unknown size, the messages alone decide).
    pub(crate) fn direct_min_for(&self, copies_only: bool, block: usize) -> usize {
        if copies_only && block >= self.move_block_min {
            self.direct_min.min(self.move_direct_min)
        } else {
            self.direct_min
        }
    }

    /// Whether a copy-receive of `bytes` from the peer asks for a direct write, in a call
    /// whose receives all copy or not, of blocks of `block` bytes, with checksums on or off:
    /// the receiver's rule, which a sender that waits for the offer applies too.
    pub(crate) fn offers_direct(
        &self,
        copies_only: bool,
        block: usize,
        bytes: usize,
        checksum: bool,
    ) -> bool {
        !checksum
            && bytes > 0
            && bytes >= self.direct_min_for(copies_only, block)
            && bytes <= u32::MAX as usize
    }

    /// Pooled: whether a message of `bytes` that the receiver copies into place goes straight
    /// there (else it is staged in the receiver's pool like one it reduces). Both ranks of a
    /// pair agree: they set the same thresholds, and `usize::MAX` (a transport that takes
    /// writes only into long-lived regions) means never.
    pub(crate) fn pooled_direct(&self, copies_only: bool, bytes: usize) -> bool {
        bytes > 0
            && bytes <= u32::MAX as usize
            && self.direct_min_for(copies_only, usize::MAX) != usize::MAX
    }

    /// The slot message `ctr` of the pair uses.
    pub(crate) fn slot(&self, ctr: u64) -> usize {
        (ctr % self.window.max(1) as u64) as usize
    }

    /// The slot the next send would use, if a credit and its header staging are free.
    pub(crate) fn send_slot(&self) -> Option<usize> {
        if self.credits == 0 {
            return None;
        }
        let k = self.slot(self.tx_ctr);
        (self.credits > 0 && !self.hdr_busy[k]).then_some(k)
    }

    /// Where a slot write with immediate `imm` lands, if it is one of the next `window`
    /// messages and its slot is free. The immediate carries the counter's low 31 bits; its
    /// distance from the next expected counter gives the full counter (and so the slot,
    /// whatever the window) once it is known to lie within the window.
    pub(crate) fn arrival_slot(&self, imm: u32) -> Option<usize> {
        if self.window == 0 {
            return None;
        }
        let expect_lo = self.rx_ctr as u32 & !IMM_DIRECT;
        let ahead = (imm.wrapping_sub(expect_lo) & !IMM_DIRECT) as usize;
        let k = self.slot(self.rx_ctr + ahead as u64);
        (ahead < self.window && self.arrived[k].is_none()).then_some(k)
    }

    /// Low bits of the next counter expected (for error reports).
    pub(crate) fn expected_imm(&self) -> u32 {
        self.rx_ctr as u32 & !IMM_DIRECT
    }

    /// Whether it is time to return the consumed slots: all of them with `all`, else once
    /// half the window waits (so a sender always keeps at least one).
    pub(crate) fn credits_due(&self, all: bool) -> Option<u32> {
        let n = self.unreturned;
        (n > 0 && (all || n as usize >= self.window.div_ceil(2))).then_some(n)
    }

    pub(crate) fn heard(&mut self, now: Instant, seq: u64) {
        self.last_heard = Some((now, seq));
    }
}
