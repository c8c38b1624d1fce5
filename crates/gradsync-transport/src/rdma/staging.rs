//! The staging ring: registered memory that data from unregistered memory is copied into
//! before a write or a send, allocated in order and freed out of order.

use super::device::Buffer;
use super::ffi;
use std::collections::VecDeque;

/// A ring of registered memory that data from unregistered memory is copied into.
pub(super) struct Staging {
    pub(super) buf: Buffer,
    pub(super) mr: *mut ffi::IbvMr,
    pub(super) lkey: u32,
    /// Allocations in order: `(offset, len, freed)`.
    pub(super) live: VecDeque<(usize, usize, bool)>,
    /// Sequence number of `live[0]`.
    pub(super) first: u64,
    pub(super) head: usize,
}

impl Staging {
    /// Room for `len` bytes: `(sequence number, offset)`.
    pub(super) fn alloc(&mut self, len: usize) -> Option<(u64, usize)> {
        let cap = self.buf.len;
        let len = len.max(1).div_ceil(64) * 64;
        if len > cap {
            return None;
        }
        let off = if self.live.is_empty() {
            self.head = 0;
            0
        } else {
            let tail = self.live[0].0;
            // Not wrapped while the newest allocation lies at or after the oldest.
            let newest = self.live.back().map_or(0, |e| e.0);
            if newest >= tail {
                if cap - self.head >= len {
                    self.head
                } else if tail >= len {
                    0
                } else {
                    return None;
                }
            } else if tail - self.head >= len {
                self.head
            } else {
                return None;
            }
        };
        self.head = off + len;
        let seq = self.first + self.live.len() as u64;
        self.live.push_back((off, len, false));
        Some((seq, off))
    }

    /// Frees allocation `seq`; the ring's tail moves past every freed allocation at its
    /// front.
    pub(super) fn free(&mut self, seq: u64) {
        if let Some(e) = seq
            .checked_sub(self.first)
            .and_then(|i| self.live.get_mut(i as usize))
        {
            e.2 = true;
        }
        while self.live.front().is_some_and(|e| e.2) {
            self.live.pop_front();
            self.first += 1;
        }
    }
}
