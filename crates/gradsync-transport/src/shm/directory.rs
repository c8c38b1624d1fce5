//! The region directory in a control segment: an open-addressing hash table of this rank's
//! registered regions by key, published entry by entry under a seqlock, which writers read to
//! check a write before they make it; and this rank's own table of its regions.

use super::layout::{
    D_ACCESS, D_ADDR, D_ALLOC_FD, D_ALLOC_ID, D_ALLOC_LEN, D_ALLOC_OFF, D_KEY, D_LEN, D_SEQ,
    D_STATE, DIR_CAP, dir_off,
};
use super::segment::Segment;
use crate::error::Violation;
use crate::regions::{KeyMap, RegionTable};
use crate::verbs::Access;
use std::cell::RefCell;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

const DIR_MASK: usize = DIR_CAP - 1;
const DIR_BITS: u32 = DIR_CAP.trailing_zeros();

pub(super) const DIR_EMPTY: u32 = 0;
pub(super) const DIR_LIVE: u32 = 1;
pub(super) const DIR_TOMB: u32 = 2;

const ACC_LOCAL_READ: u32 = 1;
pub(super) const ACC_REMOTE_WRITE: u32 = 2;

/// How long a reader retries a directory entry that is being rewritten before giving up (the
/// owner may be descheduled or stopped in the middle of an update).
const SEQ_PATIENCE: Duration = Duration::from_secs(2);

fn dir_hash(key: u32) -> usize {
    (key.wrapping_mul(0x9e37_79b1) >> (32 - DIR_BITS)) as usize
}

/// The rights of a region as the directory records them.
pub(super) fn access_bits(a: Access) -> u32 {
    let mut b = 0;
    if a.contains(Access::LOCAL_READ) {
        b |= ACC_LOCAL_READ;
    }
    if a.contains(Access::REMOTE_WRITE) {
        b |= ACC_REMOTE_WRITE;
    }
    b
}

/// A consistent copy of one directory entry.
#[derive(Clone, Copy, Debug)]
pub(super) struct DirEntry {
    pub(super) state: u32,
    pub(super) key: u32,
    pub(super) access: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    /// The owner's shared allocation that holds the whole region, if any.
    pub(super) alloc: Option<AllocRef>,
}

/// Where a region lies in a shared allocation of its owner, as a directory entry records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct AllocRef {
    /// The owner's descriptor of the allocation's memfd.
    pub(super) fd: i32,
    /// The allocation's id (never 0).
    pub(super) id: u64,
    /// Length of the allocation in bytes.
    pub(super) len: u64,
    /// Offset of the region's first byte in the allocation.
    pub(super) off: u64,
}

/// Rewrites directory slot `slot` of the owner's own segment under its seqlock.
pub(super) fn dir_write(seg: &Segment, slot: usize, e: DirEntry) {
    let o = dir_off(slot);
    let seq = seg.a32(o + D_SEQ);
    let s = seq.load(Ordering::Relaxed);
    seq.store(s.wrapping_add(1), Ordering::Relaxed);
    fence(Ordering::Release);
    seg.a32(o + D_STATE).store(e.state, Ordering::Relaxed);
    seg.a32(o + D_KEY).store(e.key, Ordering::Relaxed);
    seg.a32(o + D_ACCESS).store(e.access, Ordering::Relaxed);
    seg.a64(o + D_ADDR).store(e.addr, Ordering::Relaxed);
    seg.a64(o + D_LEN).store(e.len, Ordering::Relaxed);
    let a = e.alloc.unwrap_or(AllocRef {
        fd: -1,
        id: 0,
        len: 0,
        off: 0,
    });
    seg.a32(o + D_ALLOC_FD)
        .store(a.fd as u32, Ordering::Relaxed);
    seg.a64(o + D_ALLOC_ID).store(a.id, Ordering::Relaxed);
    seg.a64(o + D_ALLOC_LEN).store(a.len, Ordering::Relaxed);
    seg.a64(o + D_ALLOC_OFF).store(a.off, Ordering::Relaxed);
    seq.store(s.wrapping_add(2), Ordering::Release);
}

/// Reads directory slot `slot` of a (possibly foreign) segment; never a torn entry.
pub(super) fn dir_read(seg: &Segment, slot: usize) -> Result<DirEntry, Violation> {
    let o = dir_off(slot);
    let seq = seg.a32(o + D_SEQ);
    let mut since: Option<Instant> = None;
    for i in 0u64.. {
        let s1 = seq.load(Ordering::Acquire);
        if s1 & 1 == 0 {
            let id = seg.a64(o + D_ALLOC_ID).load(Ordering::Relaxed);
            let e = DirEntry {
                state: seg.a32(o + D_STATE).load(Ordering::Relaxed),
                key: seg.a32(o + D_KEY).load(Ordering::Relaxed),
                access: seg.a32(o + D_ACCESS).load(Ordering::Relaxed),
                addr: seg.a64(o + D_ADDR).load(Ordering::Relaxed),
                len: seg.a64(o + D_LEN).load(Ordering::Relaxed),
                alloc: (id != 0).then(|| AllocRef {
                    fd: seg.a32(o + D_ALLOC_FD).load(Ordering::Relaxed) as i32,
                    id,
                    len: seg.a64(o + D_ALLOC_LEN).load(Ordering::Relaxed),
                    off: seg.a64(o + D_ALLOC_OFF).load(Ordering::Relaxed),
                }),
            };
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return Ok(e);
            }
        }
        if i < 64 {
            std::hint::spin_loop();
        } else {
            let now = Instant::now();
            if now.duration_since(*since.get_or_insert(now)) >= SEQ_PATIENCE {
                break;
            }
            std::thread::yield_now();
        }
    }
    Err(Violation::DirectoryStuck {
        slot,
        waited: SEQ_PATIENCE,
    })
}

/// Finds `key` in a segment's directory.
pub(super) fn dir_lookup(seg: &Segment, key: u32) -> Result<Option<DirEntry>, Violation> {
    let h = dir_hash(key);
    for i in 0..DIR_CAP {
        let e = dir_read(seg, (h + i) & DIR_MASK)?;
        match e.state {
            DIR_EMPTY => return Ok(None),
            DIR_LIVE if e.key == key => return Ok(Some(e)),
            _ => {}
        }
    }
    Ok(None)
}

/// Publishes a new entry in the owner's directory (the key is known to be absent); returns its
/// slot, or `None` when the directory is full.
pub(super) fn dir_insert(seg: &Segment, e: DirEntry) -> Option<usize> {
    let h = dir_hash(e.key);
    (0..DIR_CAP)
        .map(|i| (h + i) & DIR_MASK)
        .find(|&s| seg.a32(dir_off(s) + D_STATE).load(Ordering::Relaxed) != DIR_LIVE)
        .inspect(|&s| dir_write(seg, s, e))
}

/// Removes the entry in `slot` of the owner's directory; `last` when no entry stays live.
pub(super) fn dir_remove(seg: &Segment, slot: usize, last: bool) {
    let state = |s: usize| seg.a32(dir_off(s) + D_STATE).load(Ordering::Relaxed);
    let blank = |state| DirEntry {
        state,
        key: 0,
        access: 0,
        addr: 0,
        len: 0,
        alloc: None,
    };
    dir_write(seg, slot, blank(DIR_TOMB));
    // A tombstone followed by an empty slot ends no probe chain that reaches a live entry, so
    // it can become empty (and so can the tombstones before it).
    let mut s = slot;
    for _ in 0..DIR_CAP {
        if state(s) != DIR_TOMB || state((s + 1) & DIR_MASK) != DIR_EMPTY {
            break;
        }
        dir_write(seg, s, blank(DIR_EMPTY));
        s = s.wrapping_sub(1) & DIR_MASK;
    }
    // Without live entries no lookup can succeed, so every tombstone can go (this also
    // recovers a directory that was full, where no tombstone is followed by an empty slot).
    if last {
        for s in (0..DIR_CAP).filter(|&s| state(s) != DIR_EMPTY) {
            dir_write(seg, s, blank(DIR_EMPTY));
        }
    }
}

/// This rank's registered regions.
#[derive(Debug)]
pub(super) struct LocalTable {
    pub(super) regions: RegionTable,
    /// Directory slot of every registered key.
    pub(super) slots: KeyMap<usize>,
    /// Keys of regions that peers wrote by cross-memory attach since the endpoint last looked
    /// (noted while draining, where the table is shared).
    pub(super) written: RefCell<Vec<u32>>,
}

impl LocalTable {
    pub(super) fn new(rank: usize) -> Self {
        LocalTable {
            regions: RegionTable::new(rank),
            slots: KeyMap::default(),
            written: RefCell::new(Vec::new()),
        }
    }

    /// Notes that a peer wrote at least [`WRITTEN_MIN`] bytes into the region of `key` outside
    /// the ring (a large-write notification).
    pub(super) fn note_written(&self, key: u32) {
        let mut w = self.written.borrow_mut();
        if w.last() != Some(&key) {
            w.push(key);
        }
    }
}

/// Large-write notifications of at least this many bytes are noted (see
/// [`LocalTable::note_written`]).
pub(super) const WRITTEN_MIN: u32 = 64 << 10;
