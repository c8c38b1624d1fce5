//! Bookkeeping of registered regions shared by the backends.

use crate::{Access, MemoryRegion, Result, Sge, TransportError};
use std::collections::HashMap;

/// The regions one rank has registered, by key.
#[derive(Debug)]
pub(crate) struct RegionTable {
    rank: usize,
    next: u32,
    by_key: HashMap<u32, MemoryRegion>,
}

impl RegionTable {
    pub(crate) fn new(rank: usize) -> Self {
        // Keys start at a per-process value so a stale key from another run rarely validates.
        let seed = std::process::id().wrapping_mul(0x9e37_79b9) ^ (rank as u32).rotate_left(16);
        RegionTable {
            rank,
            next: seed | 1,
            by_key: HashMap::new(),
        }
    }

    pub(crate) fn register(&mut self, addr: usize, len: usize, access: Access) -> MemoryRegion {
        loop {
            self.next = self.next.wrapping_add(0x2545_f491);
            if self.next != 0 && !self.by_key.contains_key(&self.next) {
                break;
            }
        }
        let mr = MemoryRegion {
            addr,
            len,
            lkey: self.next,
            rkey: self.next,
            access,
        };
        self.by_key.insert(mr.rkey, mr);
        mr
    }

    pub(crate) fn deregister(&mut self, mr: &MemoryRegion) {
        self.by_key.remove(&mr.rkey);
    }

    /// Checks a peer's write and returns the destination address.
    pub(crate) fn check_remote_write(
        &self,
        peer: usize,
        rkey: u32,
        offset: u64,
        len: u64,
    ) -> Result<usize> {
        let mr = self.by_key.get(&rkey).ok_or(TransportError::BadKey {
            rank: self.rank,
            peer,
            rkey,
            offset,
            len,
        })?;
        let oob = |why| TransportError::OutOfBounds {
            rank: self.rank,
            peer,
            rkey,
            offset,
            len,
            region_len: mr.len as u64,
            why,
        };
        if !mr.access.contains(Access::REMOTE_WRITE) {
            return Err(oob("region does not allow remote writes"));
        }
        match offset.checked_add(len) {
            Some(end) if end <= mr.len as u64 => Ok(mr.addr + offset as usize),
            _ => Err(oob("past the end of the region")),
        }
    }

    /// Checks that every span of a gather list lies in a registered region with its key.
    pub(crate) fn check_local(&self, sges: &[Sge]) -> Result<()> {
        for s in sges {
            let ok = self.by_key.get(&s.lkey).is_some_and(|mr| {
                s.addr >= mr.addr
                    && s.addr
                        .checked_add(s.len)
                        .is_some_and(|e| e <= mr.addr + mr.len)
            });
            if !ok {
                return Err(TransportError::Invalid {
                    rank: self.rank,
                    op: "post_write",
                    msg: format!(
                        "span of {} bytes at 0x{:x} is not inside region with key 0x{:08x}",
                        s.len, s.addr, s.lkey
                    ),
                });
            }
        }
        Ok(())
    }
}
