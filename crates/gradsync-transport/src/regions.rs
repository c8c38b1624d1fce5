//! Bookkeeping of registered regions shared by the backends.

use crate::error::{Result, TransportError};
use crate::verbs::{Access, MemoryRegion, Sge};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map by region key. Keys are handed out by this rank and only looked up for peers, so a
/// multiplicative hash is enough (no peer can choose what gets inserted).
pub(crate) type KeyMap<V> = HashMap<u32, V, BuildHasherDefault<KeyHasher>>;

/// Fibonacci hashing of a 32-bit key.
#[derive(Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (u64::from(v) ^ self.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The regions one rank has registered, by key.
#[derive(Debug)]
pub(crate) struct RegionTable {
    rank: usize,
    next: u32,
    by_key: KeyMap<MemoryRegion>,
}

impl RegionTable {
    pub(crate) fn new(rank: usize) -> Self {
        // Keys start at a per-process value so a stale key from another run rarely validates.
        let seed = std::process::id().wrapping_mul(0x9e37_79b9) ^ (rank as u32).rotate_left(16);
        RegionTable {
            rank,
            next: seed | 1,
            by_key: KeyMap::default(),
        }
    }

    /// A key not in use (never 0).
    pub(crate) fn fresh_key(&mut self) -> u32 {
        loop {
            self.next = self.next.wrapping_add(0x2545_f491);
            if self.next != 0 && !self.by_key.contains_key(&self.next) {
                return self.next;
            }
        }
    }

    /// Whether `key` is registered.
    pub(crate) fn contains(&self, key: u32) -> bool {
        self.by_key.contains_key(&key)
    }

    /// Whether no region is registered.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Number of registered regions.
    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Registers the span under `key` (the caller made sure it is free).
    pub(crate) fn insert(
        &mut self,
        key: u32,
        addr: usize,
        len: usize,
        access: Access,
    ) -> MemoryRegion {
        let mr = MemoryRegion {
            addr,
            len,
            lkey: key,
            rkey: key,
            access,
        };
        self.by_key.insert(key, mr);
        mr
    }

    pub(crate) fn register(&mut self, addr: usize, len: usize, access: Access) -> MemoryRegion {
        let key = self.fresh_key();
        self.insert(key, addr, len, access)
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
        check_write(self.rank, peer, rkey, offset, len, self.by_key.get(&rkey))
    }

    /// The address and length of the region registered under `key`.
    pub(crate) fn span_of(&self, key: u32) -> Option<(usize, usize)> {
        self.by_key.get(&key).map(|mr| (mr.addr, mr.len))
    }

    /// The access rights of the region registered under `key`.
    pub(crate) fn access_of(&self, key: u32) -> Option<Access> {
        self.by_key.get(&key).map(|mr| mr.access)
    }

    /// Checks that every span of a gather list lies in a registered region with its key.
    pub(crate) fn check_local(&self, sges: &[Sge]) -> Result<()> {
        check_spans(self.rank, sges, |k| {
            self.by_key.get(&k).map(|mr| (mr.addr, mr.len))
        })
    }
}

/// Checks a write of `len` bytes at `offset` from `peer` into `mr`, the region `rkey` names
/// (`None`: no such key), and returns the destination address.
pub(crate) fn check_write(
    rank: usize,
    peer: usize,
    rkey: u32,
    offset: u64,
    len: u64,
    mr: Option<&MemoryRegion>,
) -> Result<usize> {
    let mr = mr.ok_or(TransportError::BadKey {
        rank,
        peer,
        rkey,
        offset,
        len,
    })?;
    let oob = |why| TransportError::OutOfBounds {
        rank,
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

/// Checks that every span of a gather list lies inside the region its key names; `region`
/// gives a key's `(address, length)`, `None` for an unknown key.
pub(crate) fn check_spans(
    rank: usize,
    sges: &[Sge],
    region: impl Fn(u32) -> Option<(usize, usize)>,
) -> Result<()> {
    for s in sges {
        let ok = region(s.lkey).is_some_and(|(addr, len)| {
            s.addr >= addr && s.addr.checked_add(s.len).is_some_and(|e| e <= addr + len)
        });
        if !ok {
            return Err(TransportError::Invalid {
                rank,
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
