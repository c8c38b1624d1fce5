//! Shared-memory backend for the ranks of one host.
//!
//! Every rank creates one **control segment** (an anonymous `memfd`, sealed against shrinking and
//! growing) and publishes an [`ShmInfo`] (pid, descriptor, length, nonce) through the rendezvous
//! store. The other local ranks map it through `/proc/<pid>/fd/<fd>` with `MAP_SHARED`
//! ([`ShmSetup::connect`]). Bulk data never goes through the segments: a large write is copied
//! straight from the writer's buffers into the target's registered region, and only a small
//! notification record goes through shared memory. The copy is a plain `memcpy` when the region
//! lies in a **shared allocation** of its owner ([`alloc_shared`](Endpoint::alloc_shared): a
//! sealed `memfd` mapped `MAP_SHARED`, which the writer maps too, once, through
//! `/proc/<pid>/fd/<fd>`), and `process_vm_writev` (cross-memory attach, one copy, but pinning
//! every page) otherwise.
//!
//! # Segment layout
//!
//! ```text
//! offset 0        header (4 KiB): magic, version, pid, rank, world, number of local ranks,
//!                 directory capacity, ring size, nonce, the owner's mapping address, length;
//!                 `closed` flag (own cache line), eventcount futex word (own line),
//!                 `sleeping` flag (own line)
//! 4 KiB           region directory: DIR_CAP entries of 64 bytes
//!                 {seq, state, key, access, addr, len, alloc_fd, alloc_id, alloc_len,
//!                 alloc_off}, an open-addressing hash table by key published entry by entry
//!                 under a seqlock
//! 4 KiB + 256 KiB one ring per local sender, indexed by the sender's position in the sorted
//!                 list of local ranks: a 256-byte control block (producer `tail`, consumer
//!                 `head`, each on its own cache line; `want_space`, `attach`, `probe`) followed
//!                 by RING_BYTES of ring data
//! after the rings the board (see [`board`]): two slots of postings the other local ranks
//!                 read in place, and the rank's release mark
//! ```
//!
//! A directory entry whose span lies entirely inside one shared allocation of the owner names
//! that allocation: the owner's descriptor number, the allocation's id (also part of the
//! `memfd` name, so a writer can tell a reused descriptor number from the allocation), its
//! length and the offset of the region's start inside it. `alloc_id` 0 means none.
//!
//! The ring is a single-producer single-consumer byte ring of variable-length records, each
//! 8-byte aligned with a 32-byte header {len, kind, flags, imm, rkey, offset, data_len}. A record
//! never wraps: when it does not fit before the end of the ring the producer writes a padding
//! record up to the end and starts again at offset 0. Positions are free-running 64-bit byte
//! counters; the producer publishes `tail` with release ordering after writing the record, the
//! consumer publishes `head` with release ordering after reading it. Record kinds:
//!
//! - **send**: a two-sided message of at most [`MAX_SEND`] bytes, delivered as
//!   [`Completion::Recv`];
//! - **inline write**: a write of at most [`INLINE_MAX`] bytes whose payload travels in the
//!   record; the receiver checks key and bounds against its own table during
//!   [`poll`](Endpoint::poll), copies the payload into place and reports
//!   [`Completion::WriteImm`] when the write carries an immediate. No system call is involved,
//!   on either side;
//! - **large write notification**: the data is already in place (copied into the writer's
//!   mapping of the shared allocation, or written with `process_vm_writev`, by
//!   [`post_write`](Endpoint::post_write) itself); the record only carries the immediate, and
//!   keeps the per-pair order without one. It is published (release store of `tail`) after the
//!   copy, so the data is visible before the record.
//!
//! # Ordering and flow control
//!
//! Sends and writes from one rank to another share one ring, so they are delivered in posting
//! order. A sender never blocks on a full ring (two ranks writing to each other with full rings
//! would deadlock): the record goes to a local per-peer pending queue (an inline payload is
//! copied into it), and the queue is flushed ahead of any new record on every post, poll and
//! wait. The local [`Completion::WriteDone`] / [`Completion::SendDone`] is queued at post time:
//! by then the payload has been copied into the ring, the pending queue or (for a large write)
//! the destination.
//!
//! # Waiting
//!
//! [`wait`](Endpoint::wait) sets the `sleeping` flag of its own segment, reads the eventcount,
//! checks every ring once more and then sleeps in `FUTEX_WAIT` (a shared, not private, futex)
//! on the eventcount. A sender publishes `tail`, issues a sequentially consistent fence and
//! reads the receiver's `sleeping` flag; only when it is set does it bump the eventcount and
//! call `FUTEX_WAKE`. The two fences make it impossible for the waiter to miss the record and
//! the sender to miss the flag at the same time, so no wakeup is lost and the fast path has no
//! system call. A sender with a pending queue sets `want_space` on the ring; a consumer that
//! frees space and finds the flag set wakes the sender the same way.
//!
//! # Liveness
//!
//! A peer is gone once its segment's `closed` flag is set ([`close`](Endpoint::close) or drop)
//! or its process no longer exists (`kill(pid, 0)` fails with `ESRCH`, or `/proc/<pid>/stat`
//! shows a zombie or a different start time). Polls look at the flags and use `kill` at most
//! every [`LIVENESS_EVERY`]; `/proc` is read only by [`wait`](Endpoint::wait) and
//! [`peer_alive`](Endpoint::peer_alive), also at most that often. Records a peer published
//! before it went away are still delivered. [`close`](Endpoint::close) first hands over the
//! records still queued for live peers (waiting at most its timeout for ring space), then sets
//! the flag, wakes the peers and unmaps the segments.
//!
//! # Limitations
//!
//! - The writer checks a key against the target's directory and then writes (with `memcpy` or
//!   `process_vm_writev`); a region deregistered (and freed) by its owner in between could still
//!   receive the write. As with RDMA, a region must not be deregistered while a peer may still
//!   write into it.
//! - A writer keeps its mapping of a peer's shared allocation until that peer goes away or the
//!   writer's endpoint closes; the memory of the allocation lives that long even after its owner
//!   dropped its endpoint.
//! - The payload of an inline write is copied into place when the receiver polls, while a large
//!   write lands at post time. A large write into bytes that an earlier inline write from the
//!   same peer also covers must therefore not be posted before the receiver has seen the earlier
//!   write's notification (the engine never does: a slot is rewritten only after a credit came
//!   back for it).
//! - Cross-memory attach needs ptrace access to the peer (same user and, with Yama,
//!   `kernel.yama.ptrace_scope = 0` or `CAP_SYS_PTRACE`); [`ShmSetup::connect`] probes it and
//!   fails with an explanation otherwise, so the caller can fall back to the network.

mod board;

pub use board::BOARD_CAPACITY;
use board::{BOARD_BYTES, BoardState};

use crate::regions::RegionTable;
use crate::{
    Access, Completion, Endpoint, MAX_SEND, MemoryRegion, RemoteRegion, Result, Sge,
    TransportError, check_send_len,
};
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString};
use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

/// Largest write whose payload travels inside the ring record; larger writes are copied into
/// place by the writer (`memcpy` into a shared allocation, or `process_vm_writev`).
pub const INLINE_MAX: usize = 4096;

/// Bytes of ring data per sender in each segment.
pub const RING_BYTES: usize = 256 * 1024;

/// Capacity of a rank's region directory (registered regions at once).
pub const DIR_CAP: usize = 4096;

/// Largest number of local ranks.
pub const MAX_LOCAL: usize = 1024;

/// How often polls and waits look for peers that went away without closing.
pub const LIVENESS_EVERY: Duration = Duration::from_millis(5);

const MAGIC: u64 = u64::from_le_bytes(*b"gsyncSHM");
const VERSION: u32 = 3;

const HEADER_BYTES: usize = 4096;
const DIR_ENTRY_BYTES: usize = 64;
const DIR_OFF: usize = HEADER_BYTES;
const DIR_MASK: usize = DIR_CAP - 1;
const DIR_BITS: u32 = DIR_CAP.trailing_zeros();
const CTL_BYTES: usize = 256;
const RING_STRIDE: usize = CTL_BYTES + RING_BYTES;
const RINGS_OFF: usize = DIR_OFF + DIR_CAP * DIR_ENTRY_BYTES;

const _: () = assert!(DIR_CAP.is_power_of_two() && RING_BYTES.is_power_of_two());
const _: () = assert!(RINGS_OFF.is_multiple_of(64) && RING_STRIDE.is_multiple_of(64));
const _: () = assert!(2 * (REC_HDR + MAX_SEND + INLINE_MAX) <= RING_BYTES);

// Header fields (byte offsets).
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_PID: usize = 12;
const H_RANK: usize = 16;
const H_WORLD: usize = 20;
const H_NLOCAL: usize = 24;
const H_DIR_CAP: usize = 28;
const H_RING_BYTES: usize = 32;
const H_NONCE: usize = 40;
const H_SELF_ADDR: usize = 48;
const H_TOTAL_LEN: usize = 56;
const H_CLOSED: usize = 64;
const H_EVENTS: usize = 128;
const H_SLEEPING: usize = 192;

// Ring control block fields (byte offsets inside the block).
const C_TAIL: usize = 0;
const C_HEAD: usize = 64;
const C_WANT_SPACE: usize = 128;
const C_ATTACH: usize = 132;
const C_PROBE: usize = 136;

const ATTACH_OK: u32 = 1;
const ATTACH_FAILED: u32 = 2;

// Directory entry fields (byte offsets inside the entry).
const D_SEQ: usize = 0;
const D_STATE: usize = 4;
const D_KEY: usize = 8;
const D_ACCESS: usize = 12;
const D_ADDR: usize = 16;
const D_LEN: usize = 24;
const D_ALLOC_FD: usize = 32;
const D_ALLOC_ID: usize = 40;
const D_ALLOC_LEN: usize = 48;
const D_ALLOC_OFF: usize = 56;

const _: () = assert!(D_ALLOC_OFF + 8 == DIR_ENTRY_BYTES);

const DIR_EMPTY: u32 = 0;
const DIR_LIVE: u32 = 1;
const DIR_TOMB: u32 = 2;

const ACC_LOCAL_READ: u32 = 1;
const ACC_REMOTE_WRITE: u32 = 2;

/// How long a reader retries a directory entry that is being rewritten before giving up (the
/// owner may be descheduled or stopped in the middle of an update).
const SEQ_PATIENCE: Duration = Duration::from_secs(2);

// Ring records.
const REC_HDR: usize = 32;
const KIND_PAD: u8 = 1;
const KIND_SEND: u8 = 2;
const KIND_WRITE_INLINE: u8 = 3;
const KIND_WRITE_CMA: u8 = 4;
const FLAG_IMM: u8 = 1;

/// `process_vm_writev` accepts at most this many local entries per call.
const IOV_MAX: usize = 1024;

/// How long a sleeping [`Endpoint::wait`] goes before it looks at peer processes again.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// Bytes of a segment for `nlocal` local ranks.
fn segment_len(nlocal: usize) -> usize {
    board_off(nlocal) + BOARD_BYTES
}

/// Offset of the board in a segment for `nlocal` local ranks.
fn board_off(nlocal: usize) -> usize {
    RINGS_OFF + nlocal * RING_STRIDE
}

fn ctl_off(pos: usize) -> usize {
    RINGS_OFF + pos * RING_STRIDE
}

fn dir_off(slot: usize) -> usize {
    DIR_OFF + slot * DIR_ENTRY_BYTES
}

fn dir_hash(key: u32) -> usize {
    (key.wrapping_mul(0x9e37_79b1) >> (32 - DIR_BITS)) as usize
}

/// Ring bytes of a record with `data_len` payload bytes.
fn record_len(data_len: usize) -> usize {
    (REC_HDR + data_len).next_multiple_of(8)
}

fn access_bits(a: Access) -> u32 {
    let mut b = 0;
    if a.contains(Access::LOCAL_READ) {
        b |= ACC_LOCAL_READ;
    }
    if a.contains(Access::REMOTE_WRITE) {
        b |= ACC_REMOTE_WRITE;
    }
    b
}

/// What a rank publishes through the rendezvous store so the other ranks of its host can map
/// its segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmInfo {
    /// Process id of the rank.
    pub pid: u32,
    /// Descriptor of the segment in that process.
    pub fd: i32,
    /// Length of the segment in bytes.
    pub len: u64,
    /// Random value identifying the segment (checked against its header).
    pub nonce: u64,
}

impl ShmInfo {
    /// Length of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 24;

    /// Encodes as 24 bytes (for the rendezvous store).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..4].copy_from_slice(&self.pid.to_le_bytes());
        b[4..8].copy_from_slice(&self.fd.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..].copy_from_slice(&self.nonce.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes); `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != Self::ENCODED_LEN {
            return None;
        }
        Some(ShmInfo {
            pid: u32::from_le_bytes(b[..4].try_into().ok()?),
            fd: i32::from_le_bytes(b[4..8].try_into().ok()?),
            len: u64::from_le_bytes(b[8..16].try_into().ok()?),
            nonce: u64::from_le_bytes(b[16..].try_into().ok()?),
        })
    }
}

/// A shared mapping of a memfd: a control segment (this rank's own, or a peer's), or a shared
/// allocation (this rank's own, or a writer's mapping of a peer's).
#[derive(Debug)]
struct Segment {
    base: *mut u8,
    len: usize,
    /// The memfd, kept open for the segment's owner so peers can open it through `/proc`.
    fd: Option<OwnedFd>,
}

// SAFETY: a Segment owns its mapping and descriptor, neither tied to a thread. Shared words are
// accessed only through atomics, and ring bytes only in spans that the ring protocol hands to
// one side at a time, so moving the owner to another thread changes nothing.
unsafe impl Send for Segment {}

impl Segment {
    /// Creates, sizes, seals and maps a new memfd segment named `name`.
    fn create(name: &CStr, len: usize) -> io::Result<Segment> {
        // SAFETY: the name is a NUL-terminated string; the flags are valid.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: plain system call on a descriptor owned here.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: plain system call on a descriptor owned here.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut seg = Segment::map(fd.as_raw_fd(), len)?;
        seg.fd = Some(fd);
        Ok(seg)
    }

    /// Maps `len` bytes of `fd` shared, readable and writable.
    fn map(fd: RawFd, len: usize) -> io::Result<Segment> {
        // SAFETY: a new mapping with no address hint cannot alias existing memory; the result
        // is checked.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Segment {
            base: p.cast(),
            len,
            fd: None,
        })
    }

    fn a32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "segment offset {off}"
        );
        // SAFETY: the mapping is `len` bytes, page-aligned and alive as long as `self`; `off` is
        // 4-aligned and in range (asserted). Every process accesses this word atomically.
        unsafe { AtomicU32::from_ptr(self.base.add(off).cast()) }
    }

    fn a64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "segment offset {off}"
        );
        // SAFETY: as in `a32`, with 8-byte alignment.
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast()) }
    }

    /// Start of the ring data of sender position `pos`.
    fn ring(&self, pos: usize) -> *mut u8 {
        let off = ctl_off(pos) + CTL_BYTES;
        assert!(
            off + RING_BYTES <= self.len,
            "ring {pos} outside the segment"
        );
        // SAFETY: in range of the mapping (asserted).
        unsafe { self.base.add(off) }
    }

    fn closed(&self) -> bool {
        self.a32(H_CLOSED).load(Ordering::Acquire) != 0
    }

    /// Bumps the eventcount and wakes the owner if it sleeps on it.
    fn wake(&self) {
        let ev = self.a32(H_EVENTS);
        ev.fetch_add(1, Ordering::SeqCst);
        futex_wake(ev);
    }

    /// Wakes the owner if it has announced that it sleeps (after a fence that orders the
    /// caller's preceding publication before the read of the flag).
    fn notify(&self) {
        fence(Ordering::SeqCst);
        self.wake_if_sleeping();
    }

    /// The second half of [`notify`](Self::notify), for a caller that has issued the fence
    /// itself (after a board posting, once for every peer).
    fn wake_if_sleeping(&self) {
        if self.a32(H_SLEEPING).load(Ordering::Relaxed) != 0 {
            self.wake();
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` describe a mapping created by `map` and not unmapped before;
        // nothing borrowed from it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// A consistent copy of one directory entry.
#[derive(Clone, Copy, Debug)]
struct DirEntry {
    state: u32,
    key: u32,
    access: u32,
    addr: u64,
    len: u64,
    /// The owner's shared allocation that holds the whole region, if any.
    alloc: Option<AllocRef>,
}

/// Where a region lies in a shared allocation of its owner, as a directory entry records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AllocRef {
    /// The owner's descriptor of the allocation's memfd.
    fd: i32,
    /// The allocation's id (never 0).
    id: u64,
    /// Length of the allocation in bytes.
    len: u64,
    /// Offset of the region's first byte in the allocation.
    off: u64,
}

/// Rewrites directory slot `slot` of the owner's own segment under its seqlock.
fn dir_write(seg: &Segment, slot: usize, e: DirEntry) {
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
fn dir_read(seg: &Segment, slot: usize) -> std::result::Result<DirEntry, String> {
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
    Err(format!(
        "region directory entry {slot} stayed in the middle of an update for {SEQ_PATIENCE:?}"
    ))
}

/// Finds `key` in a segment's directory.
fn dir_lookup(seg: &Segment, key: u32) -> std::result::Result<Option<DirEntry>, String> {
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
fn dir_insert(seg: &Segment, e: DirEntry) -> Option<usize> {
    let h = dir_hash(e.key);
    (0..DIR_CAP)
        .map(|i| (h + i) & DIR_MASK)
        .find(|&s| seg.a32(dir_off(s) + D_STATE).load(Ordering::Relaxed) != DIR_LIVE)
        .inspect(|&s| dir_write(seg, s, e))
}

/// Removes the entry in `slot` of the owner's directory; `last` when no entry stays live.
fn dir_remove(seg: &Segment, slot: usize, last: bool) {
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
struct LocalTable {
    regions: RegionTable,
    /// Directory slot of every registered key.
    slots: crate::regions::KeyMap<usize>,
}

impl LocalTable {
    fn new(rank: usize) -> Self {
        LocalTable {
            regions: RegionTable::new(rank),
            slots: crate::regions::KeyMap::default(),
        }
    }
}

/// Header of a ring record.
#[derive(Clone, Copy, Debug)]
struct RecHdr {
    kind: u8,
    imm: Option<u32>,
    rkey: u32,
    offset: u64,
    data_len: u32,
}

impl RecHdr {
    fn encode(&self, rec_len: usize) -> [u8; REC_HDR] {
        let mut b = [0u8; REC_HDR];
        b[..4].copy_from_slice(&(rec_len as u32).to_le_bytes());
        b[4] = self.kind;
        b[5] = if self.imm.is_some() { FLAG_IMM } else { 0 };
        b[8..12].copy_from_slice(&self.imm.unwrap_or(0).to_le_bytes());
        b[12..16].copy_from_slice(&self.rkey.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..28].copy_from_slice(&self.data_len.to_le_bytes());
        b
    }
}

/// The payload of a record being posted.
enum Payload<'a> {
    Empty,
    Bytes(&'a [u8]),
    Gather(&'a [Sge]),
}

impl Payload<'_> {
    fn len(&self) -> usize {
        match self {
            Payload::Empty => 0,
            Payload::Bytes(b) => b.len(),
            Payload::Gather(s) => s.iter().map(|s| s.len).sum(),
        }
    }

    /// Copies the payload to `dst`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for `self.len()` bytes of writes and not overlap the payload; the
    /// spans of a gather list must be readable.
    unsafe fn copy_to(&self, dst: *mut u8) {
        match self {
            Payload::Empty => {}
            // SAFETY: the caller guarantees `dst` holds `b.len()` bytes.
            Payload::Bytes(b) => unsafe { ptr::copy_nonoverlapping(b.as_ptr(), dst, b.len()) },
            Payload::Gather(sges) => {
                let mut at = 0;
                for s in sges.iter() {
                    // SAFETY: the caller guarantees the span is readable and `dst` holds the
                    // sum of the span lengths.
                    unsafe { ptr::copy_nonoverlapping(s.addr as *const u8, dst.add(at), s.len) };
                    at += s.len;
                }
            }
        }
    }
}

/// This rank's view of one local peer.
#[derive(Debug)]
struct Peer {
    rank: usize,
    /// Position in the sorted list of local ranks.
    pos: usize,
    pid: u32,
    /// Start time of the peer's process (from `/proc/<pid>/stat`), to detect pid reuse.
    starttime: Option<u64>,
    /// A pidfd of the peer's process (`None` where the kernel has no `pidfd_open`): it keeps
    /// naming that process after its pid is reused, so a cross-memory-attach write never goes
    /// to another process that got the pid.
    pidfd: Option<OwnedFd>,
    /// The peer's segment.
    seg: Segment,
    /// Offset, in the peer's segment, of the control block of this rank's ring.
    ctl: usize,
    /// Producer position in the peer's ring for this rank (published or about to be).
    tail: u64,
    /// Last consumer position read from the peer's ring.
    head_cache: u64,
    /// Consumer position in this rank's ring for the peer.
    rx_head: u64,
    /// Records waiting for space in the peer's ring, in order.
    pending: VecDeque<Vec<u8>>,
    /// This rank's mappings of the peer's shared allocations, by allocation id.
    maps: HashMap<u64, Segment>,
    /// Why the peer counts as gone.
    down: Option<String>,
    /// The peer broke the ring protocol: its ring is no longer read.
    broken: bool,
    /// Last `/proc` check, for `peer_alive` (which only has `&self`).
    checked: Cell<Option<Instant>>,
    /// What that check found.
    gone: Cell<Option<&'static str>>,
}

/// The rank and ring position of this endpoint.
#[derive(Clone, Copy, Debug)]
struct Me {
    rank: usize,
    pos: usize,
}

impl Peer {
    fn set_down(&mut self, why: String) {
        if self.down.is_none() {
            tracing::debug!(peer = self.rank, "shm peer gone: {why}");
            self.down = Some(why);
            self.pending.clear();
            self.maps.clear();
        }
    }

    /// The start of this rank's mapping of the peer's shared allocation `a`, mapped through
    /// `/proc/<pid>/fd/<fd>` on first use and cached until the peer goes away.
    fn map_alloc(&mut self, me: Me, a: AllocRef) -> Result<*mut u8> {
        if let Some(m) = self.maps.get(&a.id) {
            if m.len as u64 == a.len {
                return Ok(m.base);
            }
            let msg = format!(
                "shared allocation {:016x} changed its length from {} to {} bytes",
                a.id, m.len, a.len
            );
            return Err(self.protocol(me, msg));
        }
        let path = format!("/proc/{}/fd/{}", self.pid, a.fd);
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => {
                if !self.is_down()
                    && let Some(g) = process_state(self.pid, self.starttime, true)
                {
                    self.set_down(format!("rank {}: {g}", self.rank));
                }
                if self.down.is_some() {
                    return Err(TransportError::PeerClosed {
                        rank: me.rank,
                        peer: self.rank,
                        during: format!("post_write: opening its shared allocation {path}: {e}"),
                    });
                }
                return Err(TransportError::Io {
                    rank: me.rank,
                    peer: self.rank,
                    op: "post_write (open the peer's shared allocation)",
                    source: io::Error::new(e.kind(), format!("{path}: {e}")),
                });
            }
        };
        // The descriptor number could have been reused by the owner for another file: the link
        // of the opened file must name this allocation's memfd.
        let want = format!("/memfd:{}", alloc_name(a.id));
        let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default();
        if link.strip_suffix(" (deleted)").unwrap_or(&link) != want {
            let msg = format!("{path} is {link:?}, not shared allocation {:016x}", a.id);
            return Err(self.protocol(me, msg));
        }
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let len = usize::try_from(a.len).ok().filter(|&l| l > 0);
        let Some(len) = len.filter(|_| size == a.len) else {
            let msg = format!(
                "{path} holds {size} bytes where its directory entry says {}",
                a.len
            );
            return Err(self.protocol(me, msg));
        };
        // SAFETY: plain system call on a descriptor owned by `file`.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(self.protocol(me, format!("{path} is not sealed against shrinking")));
        }
        let m = Segment::map(file.as_raw_fd(), len).map_err(|e| TransportError::Io {
            rank: me.rank,
            peer: self.rank,
            op: "post_write (map the peer's shared allocation)",
            source: io::Error::new(e.kind(), format!("{path}: {e}")),
        })?;
        tracing::debug!(
            peer = self.rank,
            id = a.id,
            len,
            "shm: mapped a shared allocation of the peer"
        );
        let base = m.base;
        self.maps.insert(a.id, m);
        Ok(base)
    }

    fn protocol(&mut self, me: Me, msg: String) -> TransportError {
        self.broken = true;
        self.set_down(format!("protocol error: {msg}"));
        TransportError::Protocol {
            rank: me.rank,
            peer: self.rank,
            msg,
        }
    }

    /// Whether the peer counts as gone (updating `down` from its `closed` flag).
    fn is_down(&mut self) -> bool {
        if self.down.is_none() && self.seg.closed() {
            self.set_down(format!(
                "rank {} closed its shared-memory endpoint",
                self.rank
            ));
        }
        self.down.is_some()
    }

    /// Full process check (`kill` and `/proc`), at most every [`LIVENESS_EVERY`].
    fn process_gone(&self) -> Option<&'static str> {
        if let Some(g) = self.gone.get() {
            return Some(g);
        }
        let now = Instant::now();
        if self
            .checked
            .get()
            .is_some_and(|t| now.duration_since(t) < LIVENESS_EVERY)
        {
            return None;
        }
        self.checked.set(Some(now));
        let g = process_state(self.pid, self.starttime, true);
        self.gone.set(g);
        g
    }

    /// Reserves `rec_len` bytes in the peer's ring (writing a padding record first when the
    /// record would cross the end); returns the ring offset, or `None` when the ring is full.
    fn reserve(&mut self, me: Me, rec_len: usize) -> Result<Option<usize>> {
        let size = RING_BYTES as u64;
        let at = (self.tail % size) as usize;
        let contig = RING_BYTES - at;
        let need = if rec_len <= contig {
            rec_len
        } else {
            contig + rec_len
        } as u64;
        if self.tail - self.head_cache + need > size {
            let head = self.seg.a64(self.ctl + C_HEAD).load(Ordering::Acquire);
            if head < self.head_cache || head > self.tail {
                let msg = format!(
                    "ring head {head} outside the range [{}, {}] it can hold",
                    self.head_cache, self.tail
                );
                return Err(self.protocol(me, msg));
            }
            self.head_cache = head;
            if self.tail - head + need > size {
                return Ok(None);
            }
        }
        if rec_len <= contig {
            self.tail += rec_len as u64;
            return Ok(Some(at));
        }
        let mut pad = [0u8; 8];
        pad[..4].copy_from_slice(&(contig as u32).to_le_bytes());
        pad[4] = KIND_PAD;
        // SAFETY: `at` is 8-aligned and below RING_BYTES, so the 8 bytes lie in the ring; they
        // are in the free span just checked, which the consumer does not read before `tail`
        // is published.
        unsafe { ptr::copy_nonoverlapping(pad.as_ptr(), self.seg.ring(me.pos).add(at), 8) };
        self.tail += (contig + rec_len) as u64;
        Ok(Some(0))
    }

    /// Makes the records written so far visible to the peer and wakes it if it sleeps.
    fn publish(&self) {
        self.seg
            .a64(self.ctl + C_TAIL)
            .store(self.tail, Ordering::Release);
        self.seg.notify();
    }

    /// Moves pending records into the ring, as many as fit.
    fn flush(&mut self, me: Me) -> Result<()> {
        if self.pending.is_empty() || self.down.is_some() {
            return Ok(());
        }
        let mut wrote = false;
        while let Some(len) = self.pending.front().map(Vec::len) {
            let Some(at) = self.reserve(me, len)? else {
                break;
            };
            if let Some(rec) = self.pending.pop_front() {
                // SAFETY: `reserve` handed out `len` bytes at `at`, inside the ring and not yet
                // visible to the consumer.
                unsafe {
                    ptr::copy_nonoverlapping(rec.as_ptr(), self.seg.ring(me.pos).add(at), len)
                };
            }
            wrote = true;
        }
        if wrote {
            self.publish();
        }
        if !self.pending.is_empty() {
            self.seg
                .a32(self.ctl + C_WANT_SPACE)
                .store(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Appends a record to the peer's ring, or to the pending queue when the ring is full or
    /// records are already waiting.
    ///
    /// # Safety
    ///
    /// The spans of a gather payload must be readable.
    unsafe fn push(&mut self, me: Me, hdr: &RecHdr, payload: Payload<'_>) -> Result<()> {
        self.flush(me)?;
        let data_len = payload.len();
        let rec_len = record_len(data_len);
        let head = hdr.encode(rec_len);
        if self.pending.is_empty()
            && let Some(at) = self.reserve(me, rec_len)?
        {
            let dst = self.seg.ring(me.pos);
            // SAFETY: `reserve` handed out `rec_len` bytes at `at`, inside the ring and not yet
            // visible to the consumer; the gather spans are readable (caller).
            unsafe {
                ptr::copy_nonoverlapping(head.as_ptr(), dst.add(at), REC_HDR);
                payload.copy_to(dst.add(at + REC_HDR));
            }
            self.publish();
            return Ok(());
        }
        let mut rec = vec![0u8; rec_len];
        rec[..REC_HDR].copy_from_slice(&head);
        // SAFETY: `rec` holds REC_HDR + data_len bytes; the gather spans are readable (caller).
        unsafe { payload.copy_to(rec.as_mut_ptr().add(REC_HDR)) };
        self.pending.push_back(rec);
        self.seg
            .a32(self.ctl + C_WANT_SPACE)
            .store(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Whether the process `pid` is gone: `kill(pid, 0)` fails with `ESRCH`, or (with `full`)
/// `/proc/<pid>/stat` shows a zombie or a start time other than `starttime`.
/// A pidfd for `pid`, `None` where the kernel refuses (no `pidfd_open`, or the process is gone).
fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = RawFd::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process a pidfd names has exited (signal 0 through the pidfd: `ESRCH` once it
/// is gone, whatever process holds its pid now).
fn pidfd_exited(fd: &OwnedFd) -> bool {
    // SAFETY: signal 0 checks existence only; the null info pointer and zero flags are valid.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

fn process_state(pid: u32, starttime: Option<u64>, full: bool) -> Option<&'static str> {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return Some("its pid is invalid");
    };
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    if unsafe { libc::kill(p, 0) } != 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return Some("its process exited");
    }
    if !full {
        return None;
    }
    match read_stat(pid) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Some("its process exited"),
        Err(_) => None,
        Ok((state, _)) if state == 'Z' || state == 'X' => Some("its process exited (zombie)"),
        Ok((_, start)) if starttime.is_some() && start != starttime => {
            Some("its process exited (pid reused)")
        }
        Ok(_) => None,
    }
}

/// State letter and start time of process `pid`, from `/proc/<pid>/stat`.
fn read_stat(pid: u32) -> io::Result<(char, Option<u64>)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (in parentheses) may contain spaces; the fields after it do not.
    let rest = s.rfind(')').map_or("", |i| &s[i + 1..]);
    let mut f = rest.split_whitespace();
    let state = f.next().and_then(|s| s.chars().next()).unwrap_or('?');
    // Field 22 of the file is the start time; the state is field 3.
    let start = f.nth(18).and_then(|v| v.parse().ok());
    Ok((state, start))
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address to find waiters; the word is a valid, aligned
    // u32 in a shared mapping that outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            ptr::null::<libc::timespec>(),
            ptr::null::<u32>(),
            0,
        )
    };
}

/// How a futex wait ended.
#[derive(Debug, PartialEq, Eq)]
enum Woke {
    /// Woken, the word had already changed, or a signal arrived.
    Event,
    /// The timeout passed.
    Timeout,
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> Woke {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the word is a valid, aligned u32 in a shared mapping that outlives the call, and
    // `ts` a valid relative timeout. A shared (not private) futex, since other processes wake it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            ptr::null::<u32>(),
            0,
        )
    };
    if r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT) {
        Woke::Timeout
    } else {
        Woke::Event
    }
}

/// Writes the gather list into process `pid` at `dst` with `process_vm_writev`, looping over
/// partial transfers and [`IOV_MAX`]-sized batches.
///
/// # Safety
///
/// Every span of `sges` must be readable.
unsafe fn cma_write(pid: u32, sges: &[Sge], dst: u64, total: usize) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::ErrorKind::InvalidInput)?;
    let mut iov: Vec<libc::iovec> = sges
        .iter()
        .filter(|s| s.len > 0)
        .map(|s| libc::iovec {
            iov_base: s.addr as *mut libc::c_void,
            iov_len: s.len,
        })
        .collect();
    let mut first = 0;
    let mut remote = dst;
    let mut left = total;
    while left > 0 {
        let end = (first + IOV_MAX).min(iov.len());
        let batch: usize = iov[first..end].iter().map(|v| v.iov_len).sum();
        let riov = libc::iovec {
            iov_base: remote as usize as *mut libc::c_void,
            iov_len: batch,
        };
        // SAFETY: the local entries describe readable spans (caller) and the array holds
        // `end - first` of them; the remote entry is only dereferenced by the kernel, in the
        // other process, where a bad address yields an error.
        let n = unsafe {
            libc::process_vm_writev(pid, iov[first..].as_ptr(), (end - first) as _, &riov, 1, 0)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "process_vm_writev transferred nothing",
            ));
        }
        let mut n = n as usize;
        left -= n;
        remote += n as u64;
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// The error of a refused cross-memory attach, with the likely reason.
fn cma_refused(rank: usize, peer: usize, pid: u32, e: io::Error) -> TransportError {
    let why = match e.raw_os_error() {
        Some(libc::EPERM) => {
            "the kernel denies ptrace access to that process (a different user, a non-dumpable \
             process, or Yama ptrace_scope above 0; kernel.yama.ptrace_scope=0 or \
             CAP_SYS_PTRACE allows it)"
        }
        Some(libc::ENOSYS) => "the kernel or a seccomp filter does not provide process_vm_writev",
        Some(libc::EFAULT) => "the address the peer advertised is not writable in its process",
        Some(libc::ESRCH) => "the process does not exist",
        _ => "unexpected error",
    };
    TransportError::Io {
        rank,
        peer,
        op: "probe cross-memory attach",
        source: io::Error::new(
            e.kind(),
            format!(
                "cross-memory attach (process_vm_writev) into pid {pid} is not permitted: {e}; {why}"
            ),
        ),
    }
}

/// The memfd name of shared allocation `id`.
fn alloc_name(id: u64) -> String {
    format!("gradsync-shared-{id:016x}")
}

fn random_nonce() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is valid for 8 bytes of writes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 8 {
        return u64::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let a = b.as_ptr() as usize as u64;
    (t ^ a.rotate_left(32) ^ u64::from(std::process::id())).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// First half of the shared-memory setup: this rank's segment, before peers are known.
#[derive(Debug)]
pub struct ShmSetup {
    rank: usize,
    world: usize,
    local: Vec<usize>,
    pos: usize,
    nonce: u64,
    /// Taken by a successful [`connect`](Self::connect); otherwise marked closed on drop so
    /// peers waiting in theirs give up at once.
    seg: Option<Segment>,
}

impl Drop for ShmSetup {
    fn drop(&mut self) {
        if let Some(seg) = &self.seg {
            seg.a32(H_CLOSED).store(1, Ordering::SeqCst);
        }
    }
}

impl ShmSetup {
    /// Creates this rank's segment. `local` is the sorted list of all ranks on this host,
    /// including `rank`. Returns the setup and the [`ShmInfo`] to publish to the local peers.
    pub fn new(rank: usize, world: usize, local: &[usize]) -> Result<(ShmSetup, ShmInfo)> {
        let invalid = |msg: String| TransportError::Invalid {
            rank,
            op: "shm setup",
            msg,
        };
        if local.len() > MAX_LOCAL {
            return Err(invalid(format!(
                "{} local ranks exceed the limit of {MAX_LOCAL}",
                local.len()
            )));
        }
        if !local.windows(2).all(|w| w[0] < w[1]) {
            return Err(invalid(format!(
                "local ranks {local:?} are not sorted and distinct"
            )));
        }
        if world > u32::MAX as usize || local.last().is_some_and(|&r| r >= world) {
            return Err(invalid(format!(
                "local ranks {local:?} do not fit a world of {world}"
            )));
        }
        let pos = local.binary_search(&rank).map_err(|_| {
            invalid(format!(
                "rank {rank} is not among the local ranks {local:?}"
            ))
        })?;
        let len = segment_len(local.len());
        let seg = Segment::create(c"gradsync-shm", len).map_err(|source| TransportError::Io {
            rank,
            peer: usize::MAX,
            op: "create shared-memory segment",
            source,
        })?;
        let Some(fd) = seg.fd.as_ref().map(AsRawFd::as_raw_fd) else {
            return Err(invalid("segment without descriptor".into()));
        };
        let nonce = random_nonce();
        let pid = std::process::id();
        seg.a32(H_VERSION).store(VERSION, Ordering::Relaxed);
        seg.a32(H_PID).store(pid, Ordering::Relaxed);
        seg.a32(H_RANK).store(rank as u32, Ordering::Relaxed);
        seg.a32(H_WORLD).store(world as u32, Ordering::Relaxed);
        seg.a32(H_NLOCAL)
            .store(local.len() as u32, Ordering::Relaxed);
        seg.a32(H_DIR_CAP).store(DIR_CAP as u32, Ordering::Relaxed);
        seg.a32(H_RING_BYTES)
            .store(RING_BYTES as u32, Ordering::Relaxed);
        seg.a64(H_NONCE).store(nonce, Ordering::Relaxed);
        seg.a64(H_SELF_ADDR)
            .store(seg.base as usize as u64, Ordering::Relaxed);
        seg.a64(H_TOTAL_LEN).store(len as u64, Ordering::Relaxed);
        seg.a64(H_MAGIC).store(MAGIC, Ordering::Release);
        let info = ShmInfo {
            pid,
            fd,
            len: len as u64,
            nonce,
        };
        let setup = ShmSetup {
            rank,
            world,
            local: local.to_vec(),
            pos,
            nonce,
            seg: Some(seg),
        };
        Ok((setup, info))
    }

    /// Maps every local peer's segment (`infos[i]` is the info of `local[i]`; this rank's own
    /// entry is ignored), checks it (magic, version, nonce, the peer's rank and layout), probes
    /// cross-memory attach into each peer, and waits at most `timeout` for every peer to have
    /// done the same with this rank.
    ///
    /// Every local rank must call it at about the same time. If the kernel refuses
    /// `process_vm_writev` into a peer (`EPERM`, `ENOSYS`, ...), the error says that
    /// cross-memory attach is not permitted and why; the peers then fail too, so the caller can
    /// fall back to the network for all local pairs.
    pub fn connect(mut self, infos: &[ShmInfo], timeout: Duration) -> Result<ShmEndpoint> {
        let rank = self.rank;
        if infos.len() != self.local.len() {
            return Err(TransportError::Invalid {
                rank,
                op: "shm connect",
                msg: format!("{} infos for {} local ranks", infos.len(), self.local.len()),
            });
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut peers: Vec<Option<Peer>> = (0..self.local.len()).map(|_| None).collect();
        let res = self
            .attach(infos, &mut peers)
            .and_then(|()| self.await_peers(infos, &peers, deadline, timeout));
        if let Err(e) = res {
            for p in peers.iter().flatten() {
                p.seg
                    .a32(p.ctl + C_ATTACH)
                    .store(ATTACH_FAILED, Ordering::SeqCst);
                p.seg.wake();
            }
            return Err(e);
        }
        let Some(own) = self.seg.take() else {
            return Err(TransportError::Invalid {
                rank,
                op: "shm connect",
                msg: "setup without segment".into(),
            });
        };
        let nlocal = self.local.len();
        Ok(ShmEndpoint {
            rank,
            world: self.world,
            local: std::mem::take(&mut self.local),
            pos: self.pos,
            conn: Some(Conn {
                own,
                peers,
                board: BoardState::new(board_off(nlocal), nlocal),
            }),
            regions: LocalTable::new(rank),
            done: Vec::new(),
            next_check: Instant::now(),
            polls: 0,
            last_alloc_id: self.nonce,
            paths: PathCounts::default(),
            shared: Vec::new(),
        })
    }

    /// Maps and checks every peer's segment and probes cross-memory attach into it; marks
    /// this rank attached in each peer's segment.
    fn attach(&self, infos: &[ShmInfo], peers: &mut [Option<Peer>]) -> Result<()> {
        for (i, info) in infos.iter().enumerate() {
            if i == self.pos {
                continue;
            }
            let seg = self.open_peer(i, info)?;
            let p = peers[i].insert(Peer {
                rank: self.local[i],
                pos: i,
                pid: info.pid,
                starttime: read_stat(info.pid).ok().and_then(|(_, s)| s),
                pidfd: pidfd_open(info.pid),
                seg,
                ctl: ctl_off(self.pos),
                tail: 0,
                head_cache: 0,
                rx_head: 0,
                pending: VecDeque::new(),
                maps: HashMap::new(),
                down: None,
                broken: false,
                checked: Cell::new(None),
                gone: Cell::new(None),
            });
            self.probe(p)?;
        }
        for p in peers.iter().flatten() {
            p.seg
                .a32(p.ctl + C_ATTACH)
                .store(ATTACH_OK, Ordering::SeqCst);
            p.seg.wake();
        }
        Ok(())
    }

    /// Opens, checks and maps the segment of `local[i]`.
    fn open_peer(&self, i: usize, info: &ShmInfo) -> Result<Segment> {
        let (rank, peer) = (self.rank, self.local[i]);
        let proto = |msg: String| TransportError::Protocol { rank, peer, msg };
        let expect = segment_len(self.local.len());
        if info.len != expect as u64 {
            return Err(proto(format!(
                "segment of {} bytes where {} local ranks need {expect}",
                info.len,
                self.local.len()
            )));
        }
        if info.pid == 0 || libc::pid_t::try_from(info.pid).is_err() {
            return Err(proto(format!("invalid pid {}", info.pid)));
        }
        let path = format!("/proc/{}/fd/{}", info.pid, info.fd);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| TransportError::Io {
                rank,
                peer,
                op: "open shared-memory segment",
                source: io::Error::new(e.kind(), format!("{path}: {e}")),
            })?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if size != expect as u64 {
            return Err(proto(format!(
                "{path} holds {size} bytes instead of {expect}"
            )));
        }
        // SAFETY: plain system call on a descriptor owned by `file`.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(proto(format!("{path} is not sealed against shrinking")));
        }
        let seg = Segment::map(file.as_raw_fd(), expect).map_err(|source| TransportError::Io {
            rank,
            peer,
            op: "map shared-memory segment",
            source,
        })?;
        let magic = seg.a64(H_MAGIC).load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(proto(format!("{path}: bad magic 0x{magic:016x}")));
        }
        let u32_field = |off| seg.a32(off).load(Ordering::Relaxed) as u64;
        let checks: [(&str, u64, u64); 9] = [
            ("version", u32_field(H_VERSION), u64::from(VERSION)),
            ("pid", u32_field(H_PID), u64::from(info.pid)),
            (
                "nonce",
                seg.a64(H_NONCE).load(Ordering::Relaxed),
                info.nonce,
            ),
            ("rank", u32_field(H_RANK), peer as u64),
            ("world", u32_field(H_WORLD), self.world as u64),
            ("local ranks", u32_field(H_NLOCAL), self.local.len() as u64),
            ("directory capacity", u32_field(H_DIR_CAP), DIR_CAP as u64),
            ("ring size", u32_field(H_RING_BYTES), RING_BYTES as u64),
            (
                "length",
                seg.a64(H_TOTAL_LEN).load(Ordering::Relaxed),
                expect as u64,
            ),
        ];
        for (what, got, want) in checks {
            if got != want {
                return Err(proto(format!(
                    "{path}: segment {what} is {got}, expected {want}"
                )));
            }
        }
        Ok(seg)
    }

    /// Writes this rank's nonce into the peer's probe word with `process_vm_writev` and checks
    /// that it shows up in the mapped segment.
    fn probe(&self, p: &Peer) -> Result<()> {
        let (rank, peer) = (self.rank, p.rank);
        let base = p.seg.a64(H_SELF_ADDR).load(Ordering::Relaxed);
        let Some(target) = base.checked_add((p.ctl + C_PROBE) as u64) else {
            return Err(TransportError::Protocol {
                rank,
                peer,
                msg: format!("segment address 0x{base:x} overflows"),
            });
        };
        let value = self.nonce.to_ne_bytes();
        let sge = [Sge {
            addr: value.as_ptr() as usize,
            len: value.len(),
            lkey: 0,
        }];
        // SAFETY: the only span is `value`, readable for its length.
        unsafe { cma_write(p.pid, &sge, target, value.len()) }
            .map_err(|e| cma_refused(rank, peer, p.pid, e))?;
        let seen = p.seg.a64(p.ctl + C_PROBE).load(Ordering::Acquire);
        if seen != self.nonce {
            return Err(TransportError::Protocol {
                rank,
                peer,
                msg: format!(
                    "a cross-memory write to 0x{target:x} in pid {} did not show up in its mapped \
                     segment",
                    p.pid
                ),
            });
        }
        Ok(())
    }

    /// Waits until every peer has marked itself attached in this rank's segment.
    fn await_peers(
        &self,
        infos: &[ShmInfo],
        peers: &[Option<Peer>],
        deadline: Option<Instant>,
        timeout: Duration,
    ) -> Result<()> {
        let rank = self.rank;
        let Some(own) = self.seg.as_ref() else {
            return Ok(());
        };
        loop {
            let mut missing = Vec::new();
            for p in peers.iter().flatten() {
                let ctl = ctl_off(p.pos);
                match own.a32(ctl + C_ATTACH).load(Ordering::Acquire) {
                    ATTACH_OK => {
                        let seen = own.a64(ctl + C_PROBE).load(Ordering::Relaxed);
                        if seen != infos[p.pos].nonce {
                            return Err(TransportError::Protocol {
                                rank,
                                peer: p.rank,
                                msg: format!(
                                    "attached with probe value 0x{seen:016x} instead of its nonce"
                                ),
                            });
                        }
                    }
                    ATTACH_FAILED => {
                        return Err(TransportError::Io {
                            rank,
                            peer: p.rank,
                            op: "shm connect",
                            source: io::Error::new(
                                io::ErrorKind::PermissionDenied,
                                format!(
                                    "rank {} could not attach to this rank's shared-memory \
                                     segment (cross-memory attach not permitted or mapping failed)",
                                    p.rank
                                ),
                            ),
                        });
                    }
                    _ if p.seg.closed() => {
                        return Err(TransportError::PeerClosed {
                            rank,
                            peer: p.rank,
                            during: "shm connect: the peer gave up on shared memory".into(),
                        });
                    }
                    _ if p.process_gone().is_some() => {
                        return Err(TransportError::PeerClosed {
                            rank,
                            peer: p.rank,
                            during: "shm connect: the peer's process exited before attaching"
                                .into(),
                        });
                    }
                    _ => missing.push(p.rank),
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(TransportError::Timeout {
                    rank,
                    timeout,
                    msg: format!("local ranks {missing:?} did not attach to this rank's segment"),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// The mapped segments of a connected endpoint.
#[derive(Debug)]
struct Conn {
    own: Segment,
    /// By position in the local ranks; `None` at this rank's own position.
    peers: Vec<Option<Peer>>,
    /// This rank's bookkeeping of the board.
    board: BoardState,
}

impl Conn {
    fn flush_all(&mut self, me: Me) -> Result<()> {
        for p in self.peers.iter_mut().flatten() {
            p.flush(me)?;
        }
        Ok(())
    }

    /// Whether any ring holds a record not yet polled.
    fn rings_ready(&self) -> bool {
        self.peers.iter().flatten().any(|p| {
            !p.broken
                && self
                    .own
                    .a64(ctl_off(p.pos) + C_TAIL)
                    .load(Ordering::Acquire)
                    != p.rx_head
        })
    }

    /// Marks peers that closed or whose process is gone; returns whether any newly went down.
    fn check_liveness(&mut self, full: bool) -> bool {
        let mut newly = false;
        for p in self.peers.iter_mut().flatten() {
            if p.down.is_some() {
                continue;
            }
            let gone = if full {
                p.process_gone()
            } else {
                process_state(p.pid, None, false)
            };
            if p.is_down() {
                newly = true;
            } else if let Some(g) = gone {
                p.set_down(format!("rank {}: {g}", p.rank));
                newly = true;
            }
        }
        newly
    }

    /// Sleeps on the eventcount until a peer signals, `deadline` passes or (with `rings`) a
    /// ring has data or a peer goes away.
    fn block(&mut self, me: Me, deadline: Option<Instant>, rings: bool) -> Result<()> {
        let sleeping = self.own.a32(H_SLEEPING);
        sleeping.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let ec = self.own.a32(H_EVENTS).load(Ordering::Acquire);
        for p in self.peers.iter().flatten() {
            if p.down.is_none() && !p.pending.is_empty() {
                p.seg.a32(p.ctl + C_WANT_SPACE).store(1, Ordering::Relaxed);
            }
        }
        fence(Ordering::SeqCst);
        let res = self.flush_all(me);
        let ready = res.is_err()
            || (rings && (self.rings_ready() || self.board_ready() || self.check_liveness(true)));
        if !ready {
            loop {
                let left =
                    deadline.map_or(WAIT_SLICE, |d| d.saturating_duration_since(Instant::now()));
                if left.is_zero() {
                    break;
                }
                if futex_wait(self.own.a32(H_EVENTS), ec, left.min(WAIT_SLICE)) == Woke::Event
                    || self.check_liveness(true)
                {
                    break;
                }
            }
        }
        self.own.a32(H_SLEEPING).store(0, Ordering::Relaxed);
        res
    }

    /// Delivers every record of the ring of the peer at `pos`.
    fn drain(
        &mut self,
        me: Me,
        regions: &LocalTable,
        pos: usize,
        out: &mut Vec<Completion>,
    ) -> Result<()> {
        let own = &self.own;
        let Some(p) = self.peers[pos].as_mut() else {
            return Ok(());
        };
        if p.broken {
            return Ok(());
        }
        let ctl = ctl_off(pos);
        let tail = own.a64(ctl + C_TAIL).load(Ordering::Acquire);
        let mut head = p.rx_head;
        if tail == head {
            return Ok(());
        }
        if tail < head || tail - head > RING_BYTES as u64 {
            return Err(p.protocol(
                me,
                format!("ring tail {tail} is inconsistent with head {head}"),
            ));
        }
        let ring = own.ring(pos);
        let peer = p.rank;
        let mut res = Ok(());
        while head < tail {
            let at = (head % RING_BYTES as u64) as usize;
            let contig = RING_BYTES - at;
            let avail = tail - head;
            let mut h = [0u8; REC_HDR];
            // SAFETY: `head` advances in multiples of 8, so `at` is 8-aligned and below
            // RING_BYTES and the 8 bytes lie in the ring, in the span the producer published.
            unsafe { ptr::copy_nonoverlapping(ring.add(at), h.as_mut_ptr(), 8) };
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let kind = h[4];
            if len < 8 || !len.is_multiple_of(8) || len > contig || len as u64 > avail {
                res = Err(p.protocol(
                    me,
                    format!("record of {len} bytes at ring offset {at} ({avail} bytes published)"),
                ));
                break;
            }
            if kind == KIND_PAD {
                if len != contig {
                    res = Err(p.protocol(
                        me,
                        format!("padding of {len} bytes at ring offset {at} does not end the ring"),
                    ));
                    break;
                }
                head += len as u64;
                continue;
            }
            if len < REC_HDR {
                res = Err(p.protocol(me, format!("record of {len} bytes of kind {kind}")));
                break;
            }
            // SAFETY: `len >= REC_HDR` bytes at `at` lie in the ring and were published.
            unsafe { ptr::copy_nonoverlapping(ring.add(at + 8), h.as_mut_ptr().add(8), 24) };
            let flags = h[5];
            let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
            let imm = word(8);
            let rkey = word(12);
            let offset =
                u64::from_le_bytes([h[16], h[17], h[18], h[19], h[20], h[21], h[22], h[23]]);
            let data_len = word(24) as usize;
            let imm = (flags & FLAG_IMM != 0).then_some(imm);
            let data = at + REC_HDR;
            let bad_len = |max: usize| data_len > max || len != record_len(data_len);
            if flags & !FLAG_IMM != 0 {
                res = Err(p.protocol(me, format!("record with unknown flags 0x{flags:02x}")));
                break;
            }
            match kind {
                KIND_SEND if !bad_len(MAX_SEND) => {
                    // SAFETY: the payload lies inside the checked record.
                    let v = unsafe { std::slice::from_raw_parts(ring.add(data), data_len) };
                    out.push(Completion::Recv {
                        peer,
                        data: v.to_vec(),
                    });
                }
                KIND_WRITE_INLINE if !bad_len(INLINE_MAX) => {
                    match regions
                        .regions
                        .check_remote_write(peer, rkey, offset, data_len as u64)
                    {
                        Ok(dst) => {
                            // SAFETY: the payload lies inside the checked record; the
                            // destination was bounds-checked against a region this rank
                            // registered with REMOTE_WRITE, which its owner keeps valid and
                            // does not touch while peers may write.
                            unsafe {
                                ptr::copy_nonoverlapping(ring.add(data), dst as *mut u8, data_len)
                            };
                            if let Some(imm) = imm {
                                out.push(Completion::WriteImm {
                                    peer,
                                    imm,
                                    len: data_len as u32,
                                });
                            }
                        }
                        Err(e) => {
                            head += len as u64;
                            res = Err(e);
                            break;
                        }
                    }
                }
                KIND_WRITE_CMA if len == REC_HDR => {
                    if let Some(imm) = imm {
                        out.push(Completion::WriteImm {
                            peer,
                            imm,
                            len: data_len as u32,
                        });
                    }
                }
                KIND_SEND | KIND_WRITE_INLINE | KIND_WRITE_CMA => {
                    res = Err(p.protocol(
                        me,
                        format!(
                            "record of kind {kind} with {data_len} payload bytes in {len} bytes"
                        ),
                    ));
                    break;
                }
                _ => {
                    res = Err(p.protocol(me, format!("unknown record kind {kind}")));
                    break;
                }
            }
            head += len as u64;
        }
        p.rx_head = head;
        own.a64(ctl + C_HEAD).store(head, Ordering::Release);
        fence(Ordering::SeqCst);
        let want = own.a32(ctl + C_WANT_SPACE);
        if want.load(Ordering::Relaxed) != 0 && want.swap(0, Ordering::AcqRel) != 0 {
            p.seg.wake();
        }
        res
    }

    /// Marks this rank closed and wakes every peer.
    fn shutdown(&self) {
        self.own.a32(H_CLOSED).store(1, Ordering::SeqCst);
        for p in self.peers.iter().flatten() {
            p.seg.wake();
        }
    }
}

/// A rank's shared-memory connections to the other ranks of its host.
pub struct ShmEndpoint {
    rank: usize,
    world: usize,
    local: Vec<usize>,
    pos: usize,
    /// `None` once closed.
    conn: Option<Conn>,
    regions: LocalTable,
    /// Local completions, returned by the next poll.
    done: Vec<Completion>,
    /// When a poll next looks for vanished peer processes.
    next_check: Instant,
    /// Polls so far (the clock is read on one in 64).
    polls: u32,
    /// Id of the last shared allocation (the first one follows the segment's nonce).
    last_alloc_id: u64,
    /// How the writes this rank posted were carried.
    paths: PathCounts,
    /// This rank's shared allocations; they outlive everything else of the endpoint.
    shared: Vec<SharedAlloc>,
}

/// A memfd allocation of this rank that its peers map directly ([`Endpoint::alloc_shared`]).
#[derive(Debug)]
struct SharedAlloc {
    id: u64,
    seg: Segment,
}

impl SharedAlloc {
    /// Where `[addr, addr + len)` lies in this allocation, if it lies there entirely.
    fn locate(&self, addr: usize, len: usize) -> Option<AllocRef> {
        let base = self.seg.base as usize;
        let off = addr.checked_sub(base)?;
        if off.checked_add(len)? > self.seg.len {
            return None;
        }
        Some(AllocRef {
            fd: self.seg.fd.as_ref()?.as_raw_fd(),
            id: self.id,
            len: self.seg.len as u64,
            off: off as u64,
        })
    }
}

/// Number of posted writes by the way their bytes travelled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PathCounts {
    /// Inside a ring record.
    inline: u64,
    /// With `memcpy` into a mapping of the target's shared allocation.
    mapped: u64,
    /// With `process_vm_writev`.
    cma: u64,
}

impl fmt::Debug for ShmEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmEndpoint")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("local", &self.local)
            .field("closed", &self.conn.is_none())
            .field("regions", &self.regions.regions.len())
            .field("shared_allocations", &self.shared.len())
            .field("writes", &self.paths)
            .finish_non_exhaustive()
    }
}

impl Drop for ShmEndpoint {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.shutdown();
            drop(conn);
        }
        // Last: the regions registered in them are gone with the endpoint.
        self.shared.clear();
    }
}

impl ShmEndpoint {
    fn me(&self) -> Me {
        Me {
            rank: self.rank,
            pos: self.pos,
        }
    }

    /// The connection, or the error of a call `op` on a closed endpoint.
    fn live_conn(&mut self, op: &'static str) -> Result<&mut Conn> {
        let rank = self.rank;
        self.conn.as_mut().ok_or_else(|| TransportError::Invalid {
            rank,
            op,
            msg: "the endpoint is closed".into(),
        })
    }

    /// Whether `peer` is another rank of this host, reachable through this endpoint.
    pub fn is_local(&self, peer: usize) -> bool {
        peer != self.rank && self.local.binary_search(&peer).is_ok()
    }

    /// Registers `len` bytes at `addr` under `key`, chosen by the caller (a composite endpoint
    /// keeps one key space over several backends). Fails if the key is in use.
    ///
    /// # Safety
    ///
    /// As for [`Endpoint::register`].
    pub unsafe fn register_with_key(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
        key: u32,
    ) -> Result<MemoryRegion> {
        if self.regions.regions.contains(key) {
            return Err(TransportError::Invalid {
                rank: self.rank,
                op: "register",
                msg: format!("key 0x{key:08x} is already registered"),
            });
        }
        self.insert_region(addr as usize, len, access, key)
    }

    fn insert_region(
        &mut self,
        addr: usize,
        len: usize,
        access: Access,
        key: u32,
    ) -> Result<MemoryRegion> {
        let invalid = |msg: String| TransportError::Invalid {
            rank: self.rank,
            op: "register",
            msg,
        };
        if addr.checked_add(len).is_none() {
            return Err(invalid(format!(
                "{len} bytes at 0x{addr:x} wrap the address space"
            )));
        }
        let Some(conn) = &self.conn else {
            return Err(invalid("the endpoint is closed".into()));
        };
        let entry = DirEntry {
            state: DIR_LIVE,
            key,
            access: access_bits(access),
            addr: addr as u64,
            len: len as u64,
            alloc: self.shared.iter().find_map(|a| a.locate(addr, len)),
        };
        let Some(slot) = dir_insert(&conn.own, entry) else {
            return Err(invalid(format!(
                "the region directory is full ({DIR_CAP} regions)"
            )));
        };
        self.regions.slots.insert(key, slot);
        Ok(self.regions.regions.insert(key, addr, len, access))
    }

    /// The connection to `peer` for a post, with the region table.
    /// The position of `peer` among the local ranks, or the error of a call `op` naming it when
    /// it is not another rank of this host.
    fn peer_pos(&self, peer: usize, op: &'static str) -> Result<usize> {
        match self.local.binary_search(&peer) {
            Ok(pos) if pos != self.pos => Ok(pos),
            _ => Err(TransportError::Invalid {
                rank: self.rank,
                op,
                msg: format!(
                    "rank {peer} is not a local peer of this shm endpoint (local ranks {:?})",
                    self.local
                ),
            }),
        }
    }

    fn target(&mut self, peer: usize, op: &'static str) -> Result<(&mut Peer, &LocalTable)> {
        let rank = self.rank;
        let pos = self.peer_pos(peer, op)?;
        let Some(p) = self.conn.as_mut().and_then(|c| c.peers[pos].as_mut()) else {
            return Err(TransportError::PeerClosed {
                rank,
                peer,
                during: format!("{op}: this endpoint is closed"),
            });
        };
        if p.is_down() {
            return Err(TransportError::PeerClosed {
                rank,
                peer,
                during: format!("{op}: {}", p.down.as_deref().unwrap_or("gone")),
            });
        }
        Ok((p, &self.regions))
    }
}

impl Endpoint for ShmEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        "shm"
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        let key = self.regions.regions.fresh_key();
        self.insert_region(addr as usize, len, access, key)
    }

    fn deregister(&mut self, mr: &MemoryRegion) {
        self.regions.regions.deregister(mr);
        if let Some(slot) = self.regions.slots.remove(&mr.rkey)
            && let Some(conn) = &self.conn
        {
            dir_remove(&conn.own, slot, self.regions.regions.is_empty());
        }
    }

    unsafe fn post_write(
        &mut self,
        peer: usize,
        sges: &[Sge],
        remote: RemoteRegion,
        offset: u64,
        imm: Option<u32>,
        wr_id: u64,
    ) -> Result<()> {
        let me = self.me();
        let (p, regions) = self.target(peer, "post_write")?;
        regions.regions.check_local(sges)?;
        let total = sges
            .iter()
            .try_fold(0usize, |a, s| a.checked_add(s.len))
            .filter(|&t| t <= u32::MAX as usize)
            .ok_or_else(|| TransportError::Invalid {
                rank: me.rank,
                op: "post_write",
                msg: "the gather list exceeds one write (4 GiB - 1 bytes)".into(),
            })?;
        let len = total as u64;
        let rkey = remote.rkey;
        let entry = match dir_lookup(&p.seg, rkey) {
            Ok(e) => e,
            // A live owner stopped in the middle of an update is not a broken peer: the write
            // fails, the connection stays.
            Err(msg) if p.process_gone().is_none() && !p.seg.closed() => {
                return Err(TransportError::Io {
                    rank: me.rank,
                    peer,
                    op: "post_write",
                    source: io::Error::new(io::ErrorKind::TimedOut, msg),
                });
            }
            Err(msg) => return Err(p.protocol(me, msg)),
        };
        let reject = |region_len, why| TransportError::RemoteAccess {
            rank: me.rank,
            peer,
            rkey,
            offset,
            len,
            region_len,
            why,
        };
        let Some(entry) = entry else {
            return Err(reject(0, "unknown key"));
        };
        if entry.access & ACC_REMOTE_WRITE == 0 {
            return Err(reject(entry.len, "region does not allow remote writes"));
        }
        if offset.checked_add(len).is_none_or(|end| end > entry.len) {
            return Err(reject(entry.len, "past the end of the region"));
        }
        let mut hdr = RecHdr {
            kind: KIND_WRITE_INLINE,
            imm,
            rkey,
            offset,
            data_len: total as u32,
        };
        if total <= INLINE_MAX {
            // SAFETY: the spans lie in registered regions (checked) that the caller keeps
            // readable until the write completes.
            unsafe { p.push(me, &hdr, Payload::Gather(sges)) }?;
            self.paths.inline += 1;
        } else if let Some(a) = entry.alloc {
            // The region lies in a shared allocation of the peer: copy straight into this
            // rank's mapping of it. `offset + len <= entry.len` holds (checked above).
            if a.off.checked_add(entry.len).is_none_or(|end| end > a.len) {
                let msg = format!(
                    "region 0x{rkey:08x} of {} bytes at offset {} does not fit its shared \
                     allocation of {} bytes",
                    entry.len, a.off, a.len
                );
                return Err(p.protocol(me, msg));
            }
            let base = p.map_alloc(me, a)?;
            // SAFETY: the mapping is `a.len` bytes (checked against the memfd's size and
            // sealed against shrinking) and `a.off + offset + total <= a.off + entry.len <=
            // a.len`, so the destination is in range; it is a separate mapping, so it does not
            // overlap the sources, which lie in registered regions (checked) that the caller
            // keeps readable until the write completes.
            unsafe { Payload::Gather(sges).copy_to(base.add((a.off + offset) as usize)) };
            // The bytes are in place; the notification is published after them.
            hdr.kind = KIND_WRITE_CMA;
            // SAFETY: an empty payload reads nothing.
            unsafe { p.push(me, &hdr, Payload::Empty) }?;
            self.paths.mapped += 1;
        } else {
            let Some(dst) = entry.addr.checked_add(offset) else {
                let msg = format!("region 0x{rkey:08x} at 0x{:x} wraps around", entry.addr);
                return Err(p.protocol(me, msg));
            };
            // A pid can be reused once its process has exited and been reaped: make sure it
            // still names the peer before writing into it.
            let exited = match &p.pidfd {
                Some(fd) => pidfd_exited(fd),
                None => process_state(p.pid, p.starttime, true).is_some(),
            };
            if exited {
                p.set_down(format!("rank {}: its process exited", p.rank));
                return Err(TransportError::PeerClosed {
                    rank: me.rank,
                    peer,
                    during: "post_write: the peer's process exited".into(),
                });
            }
            // The bytes land now; the notification queues behind any pending record, so the
            // order of completions at the peer is the posting order.
            // SAFETY: as above.
            if let Err(e) = unsafe { cma_write(p.pid, sges, dst, total) } {
                if e.raw_os_error() == Some(libc::ESRCH) {
                    p.set_down(format!("rank {}: its process exited", p.rank));
                    return Err(TransportError::PeerClosed {
                        rank: me.rank,
                        peer,
                        during: "post_write: the peer's process exited".into(),
                    });
                }
                return Err(TransportError::Io {
                    rank: me.rank,
                    peer,
                    op: "post_write (process_vm_writev)",
                    source: e,
                });
            }
            hdr.kind = KIND_WRITE_CMA;
            // SAFETY: an empty payload reads nothing.
            unsafe { p.push(me, &hdr, Payload::Empty) }?;
            self.paths.cma += 1;
        }
        self.done.push(Completion::WriteDone { wr_id });
        Ok(())
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        check_send_len(self.rank, data.len())?;
        let me = self.me();
        let (p, _) = self.target(peer, "post_send")?;
        let hdr = RecHdr {
            kind: KIND_SEND,
            imm: None,
            rkey: 0,
            offset: 0,
            data_len: data.len() as u32,
        };
        // SAFETY: a byte-slice payload has no gather spans.
        unsafe { p.push(me, &hdr, Payload::Bytes(data)) }?;
        self.done.push(Completion::SendDone { wr_id });
        Ok(())
    }

    fn peer_alive(&self, peer: usize) -> bool {
        let Ok(pos) = self.local.binary_search(&peer) else {
            return false;
        };
        let Some(p) = self
            .conn
            .as_ref()
            .and_then(|c| c.peers.get(pos))
            .and_then(Option::as_ref)
        else {
            return false;
        };
        if p.broken {
            return false;
        }
        // Records the peer published before it closed or exited are still to be read: until
        // they are, the peer counts as alive (a caller that checks liveness between two polls
        // must not lose them). The closed flag is read first, then the ring: a record
        // published before the close is then always seen.
        let gone = p.down.is_some() || p.seg.closed() || p.process_gone().is_some();
        if !gone {
            return true;
        }
        fence(Ordering::SeqCst);
        let c = self.conn.as_ref().expect("checked above");
        let tail = c.own.a64(ctl_off(pos) + C_TAIL).load(Ordering::Acquire);
        tail != p.rx_head
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let me = self.me();
        let Some(conn) = self.conn.as_mut() else {
            out.append(&mut self.done);
            return Ok(());
        };
        conn.flush_all(me)?;
        out.append(&mut self.done);
        for pos in 0..conn.peers.len() {
            conn.drain(me, &self.regions, pos, out)?;
        }
        // The clock is read on one poll in 64: a poll loop spins millions of times a second,
        // and the liveness check only needs to run every few milliseconds.
        self.polls = self.polls.wrapping_add(1);
        if self.polls.is_multiple_of(64) {
            let now = Instant::now();
            if now >= self.next_check {
                self.next_check = now + LIVENESS_EVERY;
                conn.check_liveness(false);
            }
        }
        Ok(())
    }

    fn board_capacity(&self) -> usize {
        if self.conn.is_some() && self.local.len() > 1 {
            BOARD_CAPACITY
        } else {
            0
        }
    }

    fn board_post(&mut self, seq: u64, data: &[u8]) -> Result<bool> {
        let me = self.me();
        self.live_conn("board_post")?.board_post(me, seq, data)
    }

    fn board_read(&mut self, peer: usize, seq: u64, out: &mut Vec<u8>) -> Result<bool> {
        let me = self.me();
        let pos = self.peer_pos(peer, "board_read")?;
        self.live_conn("board_read")?.board_read(me, pos, seq, out)
    }

    fn board_release(&mut self, seq: u64) -> Result<()> {
        self.live_conn("board_release")?.board_release(seq);
        Ok(())
    }

    fn board_watch(&mut self, seq: u64) {
        if let Some(c) = self.conn.as_mut() {
            c.board_watch(seq);
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let me = self.me();
        let deadline = Instant::now().checked_add(timeout);
        if !self.done.is_empty() {
            return Ok(());
        }
        let Some(conn) = self.conn.as_mut() else {
            // Closed: nothing can arrive any more.
            std::thread::sleep(timeout);
            return Ok(());
        };
        conn.block(me, deadline, true)
    }

    /// A sealed memfd of `len` bytes rounded up to the page size, mapped shared; a region
    /// registered inside it receives large writes by `memcpy` from the writer's own mapping.
    /// `None` when the endpoint is closed or the memfd cannot be created or mapped.
    fn alloc_shared(&mut self, len: usize) -> Option<*mut u8> {
        self.conn.as_ref()?;
        // SAFETY: sysconf only reads a configuration value.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = usize::try_from(page).ok().filter(|&p| p > 0)?;
        let size = len.max(1).checked_next_multiple_of(page)?;
        let mut id = self.last_alloc_id.wrapping_add(1);
        if id == 0 {
            id = 1;
        }
        let name = CString::new(alloc_name(id)).ok()?;
        match Segment::create(&name, size) {
            Ok(seg) => {
                self.last_alloc_id = id;
                let base = seg.base;
                tracing::debug!(rank = self.rank, id, size, "shm: shared allocation");
                self.shared.push(SharedAlloc { id, seg });
                Some(base)
            }
            Err(e) => {
                tracing::debug!(rank = self.rank, size, "shm: shared allocation failed: {e}");
                None
            }
        }
    }

    fn close(&mut self, timeout: Duration) {
        let me = self.me();
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let deadline = Instant::now().checked_add(timeout);
        // Hand over what is still queued, as long as the peers take it.
        let mut sink = Vec::new();
        loop {
            let _ = conn.flush_all(me);
            // Keep reading (and dropping) what peers send: a peer closing at the same moment
            // with a full ring to this rank is itself waiting for room.
            for pos in 0..conn.peers.len() {
                let _ = conn.drain(me, &self.regions, pos, &mut sink);
            }
            sink.clear();
            // The full check (zombies, reused pids): a crashed peer must not hold the close
            // for its whole timeout.
            let _ = conn.check_liveness(true);
            let queued = conn
                .peers
                .iter()
                .flatten()
                .any(|p| p.down.is_none() && !p.pending.is_empty());
            if !queued || deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let slice = Instant::now() + Duration::from_millis(5);
            let until = deadline.map_or(slice, |d| d.min(slice));
            let _ = conn.block(me, Some(until), false);
        }
        conn.shutdown();
    }
}

#[cfg(test)]
mod tests {
    //! Several endpoints in one process (cross-memory attach into one's own pid is always
    //! allowed), each used from its own thread where the test needs concurrency.
    use super::*;
    use std::sync::Barrier;
    use std::thread;

    const RW: Access = Access::LOCAL_READ.union(Access::REMOTE_WRITE);
    const LONG: Duration = Duration::from_secs(10);

    fn fabric_in(world: usize, local: &[usize]) -> Vec<ShmEndpoint> {
        let (setups, infos): (Vec<_>, Vec<_>) = local
            .iter()
            .map(|&r| ShmSetup::new(r, world, local).unwrap())
            .unzip();
        let infos = &infos;
        thread::scope(|s| {
            let hs: Vec<_> = setups
                .into_iter()
                .map(|st| s.spawn(move || st.connect(infos, LONG).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    pub(super) fn fabric(n: usize) -> Vec<ShmEndpoint> {
        fabric_in(n, &(0..n).collect::<Vec<_>>())
    }

    fn pair() -> (ShmEndpoint, ShmEndpoint) {
        let mut v = fabric(2);
        let e1 = v.pop().unwrap();
        (v.pop().unwrap(), e1)
    }

    /// A registered buffer (the vector's heap block never moves).
    struct Buf {
        v: Vec<u8>,
        mr: MemoryRegion,
    }

    fn buf(ep: &mut ShmEndpoint, v: Vec<u8>, access: Access) -> Buf {
        let mut v = v;
        // SAFETY: the heap block stays valid and in place until the test ends, after the
        // endpoints' last use of it.
        let mr = unsafe { ep.register(v.as_mut_ptr(), v.len(), access) }.unwrap();
        Buf { v, mr }
    }

    fn sge(b: &Buf, off: usize, len: usize) -> Sge {
        assert!(off + len <= b.v.len());
        Sge {
            addr: b.v.as_ptr() as usize + off,
            len,
            lkey: b.mr.lkey,
        }
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(31).wrapping_add(seed * 17) % 251) as u8)
            .collect()
    }

    fn remote(c: &Completion) -> bool {
        matches!(c, Completion::WriteImm { .. } | Completion::Recv { .. })
    }

    /// Polls until `n` completions accepted by `keep` arrived.
    fn collect(
        ep: &mut ShmEndpoint,
        n: usize,
        keep: impl Fn(&Completion) -> bool,
    ) -> Vec<Completion> {
        let deadline = Instant::now() + LONG;
        let mut got = Vec::new();
        let mut out = Vec::new();
        loop {
            ep.poll(&mut out).unwrap();
            got.extend(out.drain(..).filter(|c| keep(c)));
            if got.len() >= n {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {n} completions",
                got.len()
            );
            ep.wait(Duration::from_millis(20)).unwrap();
        }
    }

    /// The tag of a completion: the immediate, or the first 4 bytes of a message.
    fn tag(c: &Completion) -> u32 {
        match c {
            Completion::WriteImm { imm, .. } => *imm,
            Completion::Recv { data, .. } => u32::from_le_bytes(data[..4].try_into().unwrap()),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn info_roundtrip_and_setup_checks() {
        let i = ShmInfo {
            pid: 77,
            fd: -3,
            len: 1 << 40,
            nonce: 0xdead_beef_0bad_f00d,
        };
        assert_eq!(ShmInfo::from_bytes(&i.to_bytes()), Some(i));
        assert_eq!(ShmInfo::from_bytes(&i.to_bytes()[1..]), None);
        assert!(ShmSetup::new(2, 4, &[0, 1]).is_err());
        assert!(ShmSetup::new(1, 4, &[1, 0]).is_err());
        assert!(ShmSetup::new(1, 2, &[1, 2]).is_err());
    }

    #[test]
    fn inline_and_large_writes_land_exact_bytes() {
        let (mut e0, mut e1) = pair();
        assert_eq!(e0.name(), "shm");
        let dst = buf(&mut e1, vec![0; 4 << 20], RW);
        let a = buf(&mut e0, pattern(2 << 20, 1), Access::LOCAL_READ);
        let b = buf(&mut e0, pattern(2 << 20, 2), Access::LOCAL_READ);
        let r = dst.mr.remote();
        // SAFETY: the sources outlive the writes.
        unsafe { e0.post_write(1, &[sge(&a, 3, 8)], r, 100, Some(7), 1) }.unwrap();
        let got = collect(&mut e1, 1, remote);
        assert_eq!(
            got,
            [Completion::WriteImm {
                peer: 0,
                imm: 7,
                len: 8
            }]
        );
        assert_eq!(&dst.v[100..108], &a.v[3..11]);

        // Exactly INLINE_MAX bytes, split over two spans, and no immediate: the send after it
        // is delivered after the bytes landed.
        let s = [sge(&a, 0, 1000), sge(&b, 5, INLINE_MAX - 1000)];
        // SAFETY: as above.
        unsafe { e0.post_write(1, &s, r, 9000, None, 2) }.unwrap();
        e0.post_send(1, &[1, 0, 0, 0], 3).unwrap();
        assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 1);
        assert_eq!(&dst.v[9000..10000], &a.v[..1000]);
        assert_eq!(&dst.v[10000..9000 + INLINE_MAX], &b.v[5..INLINE_MAX - 995]);

        // 3 MiB with a three-entry gather list, through process_vm_writev.
        let mib = 1 << 20;
        let s = [sge(&a, 5, mib + 3), sge(&b, 0, mib - 3), sge(&a, 1000, mib)];
        // SAFETY: as above.
        unsafe { e0.post_write(1, &s, r, 17, Some(9), 4) }.unwrap();
        let got = collect(&mut e1, 1, remote);
        assert_eq!(
            got,
            [Completion::WriteImm {
                peer: 0,
                imm: 9,
                len: 3 * mib as u32
            }]
        );
        let mut want = a.v[5..mib + 8].to_vec();
        want.extend_from_slice(&b.v[..mib - 3]);
        want.extend_from_slice(&a.v[1000..mib + 1000]);
        assert!(dst.v[17..17 + 3 * mib] == want[..]);
        assert_eq!(dst.v[16], 0);
        assert_eq!(dst.v[17 + 3 * mib], 0);

        let mut out = Vec::new();
        e0.poll(&mut out).unwrap();
        assert_eq!(
            out,
            [
                Completion::WriteDone { wr_id: 1 },
                Completion::WriteDone { wr_id: 2 },
                Completion::SendDone { wr_id: 3 },
                Completion::WriteDone { wr_id: 4 },
            ]
        );
    }

    #[test]
    fn gather_lists_longer_than_iov_max() {
        let (mut e0, mut e1) = pair();
        let dst = buf(&mut e1, vec![0; 2 << 20], RW);
        let src = buf(&mut e0, pattern(4 << 20, 3), Access::LOCAL_READ);
        // 1500 spans of 1000 bytes, every other kilobyte of the source.
        let s: Vec<Sge> = (0..1500).map(|i| sge(&src, i * 2048 + 7, 1000)).collect();
        // SAFETY: the source outlives the write.
        unsafe { e0.post_write(1, &s, dst.mr.remote(), 5, Some(1), 1) }.unwrap();
        collect(&mut e1, 1, remote);
        for i in 0..1500 {
            let d = 5 + i * 1000;
            assert_eq!(&dst.v[d..d + 1000], &src.v[i * 2048 + 7..i * 2048 + 1007]);
        }
    }

    #[test]
    fn sends_and_writes_keep_posting_order() {
        let (mut e0, mut e1) = pair();
        let dst = buf(&mut e1, vec![0; 1 << 20], RW);
        let src = buf(&mut e0, pattern(64 << 10, 4), Access::LOCAL_READ);
        let r = dst.mr.remote();
        let n = 600u32;
        let rx = thread::spawn(move || {
            let got = collect(&mut e1, n as usize, remote);
            (e1, dst, got)
        });
        for i in 0..n {
            match i % 3 {
                0 => e0.post_send(1, &i.to_le_bytes(), u64::from(i)).unwrap(),
                1 => {
                    let s = [sge(&src, 0, 8)];
                    // SAFETY: the source outlives the write.
                    unsafe { e0.post_write(1, &s, r, u64::from(i) * 8, Some(i), 0) }.unwrap()
                }
                _ => {
                    let s = [sge(&src, 0, 40_000)];
                    // SAFETY: the source outlives the write.
                    unsafe { e0.post_write(1, &s, r, 500_000, Some(i), 0) }.unwrap()
                }
            }
        }
        let (_e1, dst, got) = rx.join().unwrap();
        let tags: Vec<u32> = got.iter().map(tag).collect();
        assert_eq!(tags, (0..n).collect::<Vec<_>>());
        assert_eq!(&dst.v[500_000..540_000], &src.v[..40_000]);
        assert_eq!(&dst.v[8..16], &src.v[..8]);
    }

    #[test]
    fn rejected_writes_name_the_peer() {
        let mut eps = fabric_in(4, &[0, 2]);
        let mut e2 = eps.pop().unwrap();
        let mut e0 = eps.pop().unwrap();
        let dst = buf(&mut e2, vec![0; 1000], RW);
        let ro = buf(&mut e2, vec![0; 1000], Access::LOCAL_READ);
        let src = buf(&mut e0, pattern(10_000, 5), Access::LOCAL_READ);
        let small = [sge(&src, 0, 8)];
        let large = [sge(&src, 0, 10_000)];
        let cases = [
            (
                RemoteRegion {
                    addr: 0,
                    rkey: 0x1234_5678,
                    len: 1000,
                },
                &small[..],
                0,
                "unknown key",
            ),
            (dst.mr.remote(), &small[..], 996, "past the end"),
            (dst.mr.remote(), &large[..], 0, "past the end"),
            (
                ro.mr.remote(),
                &small[..],
                0,
                "does not allow remote writes",
            ),
        ];
        for (r, s, off, why) in cases {
            // SAFETY: the source outlives the call.
            let e = unsafe { e0.post_write(2, s, r, off, Some(1), 9) }.unwrap_err();
            assert!(
                matches!(e, TransportError::RemoteAccess { peer: 2, .. }),
                "{e}"
            );
            assert_eq!(e.peer(), Some(2));
            let msg = e.to_string();
            assert!(msg.starts_with("rank 0: write of "), "{msg}");
            assert!(msg.contains("into rank 2's region"), "{msg}");
            assert!(msg.contains(why), "{msg}");
        }
        // Nothing reached the peer and nothing completed locally.
        let mut out = Vec::new();
        e2.poll(&mut out).unwrap();
        e0.poll(&mut out).unwrap();
        assert!(out.is_empty(), "{out:?}");
        // A span outside any local region, a rank that is not local, and an oversized send.
        let bad = [Sge {
            addr: src.v.as_ptr() as usize + 9_999,
            len: 8,
            lkey: src.mr.lkey,
        }];
        // SAFETY: rejected before anything is read.
        let e = unsafe { e0.post_write(2, &bad, dst.mr.remote(), 0, None, 0) }.unwrap_err();
        assert!(matches!(e, TransportError::Invalid { .. }), "{e}");
        let e = e0.post_send(1, b"x", 0).unwrap_err();
        assert!(e.to_string().contains("rank 1 is not a local peer"), "{e}");
        assert!(e0.post_send(0, b"x", 0).is_err());
        assert!(e0.post_send(2, &[0; MAX_SEND + 1], 0).is_err());
        assert!(e0.is_local(2) && !e0.is_local(1) && !e0.is_local(0) && !e0.is_local(3));
        assert_eq!(e0.world(), 4);
    }

    #[test]
    fn receiver_rechecks_inline_writes() {
        let (mut e0, mut e1) = pair();
        let dst = buf(&mut e1, vec![0; 64], RW);
        let src = buf(&mut e0, pattern(64, 6), Access::LOCAL_READ);
        // SAFETY: the source outlives the write.
        unsafe { e0.post_write(1, &[sge(&src, 0, 64)], dst.mr.remote(), 0, Some(3), 1) }.unwrap();
        e1.deregister(&dst.mr);
        let e = e1.poll(&mut Vec::new()).unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::BadKey {
                    rank: 1,
                    peer: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(dst.v.iter().all(|&b| b == 0));
        // The rejected record was consumed; the pair keeps working.
        e0.post_send(1, &[5, 0, 0, 0], 2).unwrap();
        assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 5);
    }

    #[test]
    fn full_rings_queue_without_deadlock() {
        let (mut e0, mut e1) = pair();
        let n = 400usize;
        let d0 = buf(&mut e0, vec![0; n * INLINE_MAX], RW);
        let d1 = buf(&mut e1, vec![0; n * INLINE_MAX], RW);
        let s0 = buf(&mut e0, pattern(n * INLINE_MAX, 7), Access::LOCAL_READ);
        let s1 = buf(&mut e1, pattern(n * INLINE_MAX, 8), Access::LOCAL_READ);
        let big = 64 << 10;
        let b0 = buf(&mut e0, vec![0; n / 50 * big], RW);
        let b1 = buf(&mut e1, vec![0; n / 50 * big], RW);
        // Both sides post far more than their rings hold, without polling: inline writes, a
        // send and a large write now and then.
        for i in 0..n {
            let off = i * INLINE_MAX;
            let sides = [(&mut e0, 1, &s0, &d1, &b1), (&mut e1, 0, &s1, &d0, &b0)];
            for (ep, peer, src, dst, bdst) in sides {
                let s = [sge(src, off, INLINE_MAX)];
                // SAFETY: the sources outlive the writes.
                unsafe { ep.post_write(peer, &s, dst.mr.remote(), off as u64, Some(i as u32), 0) }
                    .unwrap();
                if i % 50 == 0 {
                    ep.post_send(peer, &(i as u32 + 1_000_000).to_le_bytes(), 0)
                        .unwrap();
                }
                if i % 50 == 25 {
                    let s = [sge(src, off, big)];
                    let at = (i / 50 * big) as u64;
                    let imm = Some(i as u32 + 2_000_000);
                    // SAFETY: as above.
                    unsafe { ep.post_write(peer, &s, bdst.mr.remote(), at, imm, 0) }.unwrap();
                }
            }
        }
        let queued = |ep: &ShmEndpoint| {
            let conn = ep.conn.as_ref().unwrap();
            conn.peers
                .iter()
                .flatten()
                .map(|p| p.pending.len())
                .sum::<usize>()
        };
        assert!(queued(&e0) > n / 2 && queued(&e1) > n / 2);
        let want: Vec<u32> = (0..n as u32)
            .flat_map(|i| {
                let send = (i % 50 == 0).then_some(i + 1_000_000);
                let large = (i % 50 == 25).then_some(i + 2_000_000);
                std::iter::once(i).chain(send).chain(large)
            })
            .collect();
        let (mut g0, mut g1) = (Vec::new(), Vec::new());
        let deadline = Instant::now() + LONG;
        while g0.len() < want.len() || g1.len() < want.len() {
            assert!(Instant::now() < deadline, "{} / {}", g0.len(), g1.len());
            for (ep, got) in [(&mut e0, &mut g0), (&mut e1, &mut g1)] {
                let mut out = Vec::new();
                ep.poll(&mut out).unwrap();
                got.extend(out.iter().filter(|c| remote(c)).map(tag));
            }
        }
        assert_eq!(g0, want);
        assert_eq!(g1, want);
        assert!(d1.v == s0.v && d0.v == s1.v);
        for k in 0..n / 50 {
            let (at, from) = (k * big, (k * 50 + 25) * INLINE_MAX);
            assert!(b1.v[at..at + big] == s0.v[from..from + big]);
            assert!(b0.v[at..at + big] == s1.v[from..from + big]);
        }
        assert_eq!(queued(&e0) + queued(&e1), 0);
    }

    #[test]
    fn a_waiting_sender_is_woken_when_its_ring_drains() {
        let (mut e0, mut e1) = pair();
        let n = 300usize;
        let dst = buf(&mut e1, vec![0; n * INLINE_MAX], RW);
        let src = buf(&mut e0, pattern(n * INLINE_MAX, 11), Access::LOCAL_READ);
        let r = dst.mr.remote();
        let posted = std::sync::Arc::new(Barrier::new(2));
        let posted2 = posted.clone();
        let tx = thread::spawn(move || {
            for i in 0..n {
                let s = [sge(&src, i * INLINE_MAX, INLINE_MAX)];
                let off = (i * INLINE_MAX) as u64;
                // SAFETY: the source outlives the write.
                unsafe { e0.post_write(1, &s, r, off, Some(i as u32), 0) }.unwrap();
            }
            // Only the receiver draining its ring lets the queue move; each drain must wake
            // this thread out of its (long) wait.
            let conn_queued = |ep: &ShmEndpoint| {
                let conn = ep.conn.as_ref().unwrap();
                conn.peers
                    .iter()
                    .flatten()
                    .map(|p| p.pending.len())
                    .sum::<usize>()
            };
            assert!(conn_queued(&e0) > 0);
            posted2.wait();
            while conn_queued(&e0) > 0 {
                e0.wait(LONG).unwrap();
                e0.poll(&mut Vec::new()).unwrap();
            }
            (e0, src)
        });
        posted.wait();
        let t = Instant::now();
        let got = collect(&mut e1, n, remote);
        let (_e0, src) = tx.join().unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert_eq!(
            got.iter().map(tag).collect::<Vec<_>>(),
            (0..n as u32).collect::<Vec<_>>()
        );
        assert!(dst.v == src.v);
    }

    #[test]
    fn wait_times_out_and_wakes_on_post() {
        let (mut e0, mut e1) = pair();
        let t = Instant::now();
        e1.wait(Duration::from_millis(40)).unwrap();
        let idle = t.elapsed();
        assert!(idle >= Duration::from_millis(30), "{idle:?}");
        assert!(idle < Duration::from_secs(1), "{idle:?}");

        let tx = thread::spawn(move || {
            thread::sleep(Duration::from_millis(30));
            e0.post_send(1, &[9, 0, 0, 0], 1).unwrap();
            e0
        });
        let t = Instant::now();
        let mut out = Vec::new();
        while out.is_empty() {
            e1.wait(LONG).unwrap();
            e1.poll(&mut out).unwrap();
            assert!(t.elapsed() < Duration::from_secs(2), "no wakeup");
        }
        let woke = t.elapsed();
        assert!(woke >= Duration::from_millis(20), "{woke:?}");
        assert_eq!(tag(&out[0]), 9);
        let _e0 = tx.join().unwrap();
    }

    #[test]
    fn close_and_drop_are_noticed() {
        let mut eps = fabric(3);
        let e2 = eps.pop().unwrap();
        let mut e1 = eps.pop().unwrap();
        let mut e0 = eps.pop().unwrap();
        assert!(e1.peer_alive(0) && e1.peer_alive(2) && !e1.peer_alive(1));
        // Sent before the close, delivered after it.
        e0.post_send(1, &[4, 0, 0, 0], 1).unwrap();
        e0.close(Duration::from_secs(1));
        assert!(!e0.peer_alive(1));
        // A closed peer stays alive until what it sent before closing has been read.
        assert!(e1.peer_alive(0));
        assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 4);
        assert!(!e1.peer_alive(0));
        let e = e1.post_send(0, b"x", 2).unwrap_err();
        assert!(
            matches!(e, TransportError::PeerClosed { peer: 0, .. }),
            "{e}"
        );
        let e = e0.post_send(1, b"x", 3).unwrap_err();
        assert!(matches!(e, TransportError::PeerClosed { .. }), "{e}");
        let mut out = Vec::new();
        e0.poll(&mut out).unwrap();
        assert_eq!(out, [Completion::SendDone { wr_id: 1 }]);
        drop(e2);
        assert!(!e1.peer_alive(2));
        assert!(e1.post_send(2, b"x", 4).is_err());
        e1.wait(Duration::from_millis(1)).unwrap();
    }

    /// Two ranks that close at the same moment, each with more queued for the other than its
    /// ring holds, both finish: a closing rank keeps reading (and dropping) what it is sent.
    #[test]
    fn simultaneous_close_with_full_rings_finishes() {
        let (mut e0, mut e1) = pair();
        let msg = [7u8; MAX_SEND];
        for i in 0..(2 * RING_BYTES / MAX_SEND) as u64 {
            e0.post_send(1, &msg, i).unwrap();
            e1.post_send(0, &msg, i).unwrap();
        }
        let timeout = Duration::from_secs(20);
        let t = Instant::now();
        let h = thread::spawn(move || e1.close(timeout));
        e0.close(timeout);
        h.join().unwrap();
        assert!(t.elapsed() < timeout / 2, "close took {:?}", t.elapsed());
    }

    /// A pidfd keeps naming its process: once that process has exited (and been reaped, so
    /// its pid may be reused), the check says so.
    #[test]
    fn pidfd_notices_an_exited_process() {
        let me = pidfd_open(std::process::id()).expect("pidfd_open of this process");
        assert!(!pidfd_exited(&me));
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let fd = pidfd_open(child.id());
        child.wait().unwrap();
        if let Some(fd) = fd {
            assert!(pidfd_exited(&fd));
        }
    }

    #[test]
    fn register_with_key_rejects_a_key_in_use() {
        let (mut e0, mut e1) = pair();
        let mut v = vec![0u8; 10_000];
        let p = v.as_mut_ptr();
        // SAFETY: `v` outlives the endpoint's use of it.
        let mr = unsafe { e1.register_with_key(p, v.len(), RW, 42) }.unwrap();
        assert_eq!((mr.lkey, mr.rkey), (42, 42));
        // SAFETY: as above.
        let e = unsafe { e1.register_with_key(p, 8, RW, 42) }.unwrap_err();
        assert!(e.to_string().contains("already registered"), "{e}");
        // SAFETY: as above.
        let other = unsafe { e1.register(p, 8, RW) }.unwrap();
        // SAFETY: as above.
        assert!(unsafe { e1.register_with_key(p, 8, RW, other.rkey) }.is_err());
        e1.deregister(&mr);
        // SAFETY: as above.
        let mr = unsafe { e1.register_with_key(p, v.len(), RW, 42) }.unwrap();
        let src = buf(&mut e0, pattern(10_000, 9), Access::LOCAL_READ);
        for (i, len) in [(0u32, 100usize), (1, 10_000)] {
            // SAFETY: the source outlives the write.
            unsafe { e0.post_write(1, &[sge(&src, 0, len)], mr.remote(), 0, Some(i), 0) }.unwrap();
            collect(&mut e1, 1, remote);
        }
        assert_eq!(v, src.v);
    }

    #[test]
    fn directory_survives_churn() {
        let (mut e0, mut e1) = pair();
        let mut v = vec![0u8; 64];
        let p = v.as_mut_ptr();
        let src = buf(&mut e0, pattern(64, 10), Access::LOCAL_READ);
        let mut live = Vec::new();
        for round in 0..3 * DIR_CAP {
            // SAFETY: `v` outlives the endpoint's use of it.
            live.push(unsafe { e1.register(p, 64, RW) }.unwrap());
            if live.len() > 100 || round % 3 == 0 {
                let mr = live.remove(round % live.len());
                e1.deregister(&mr);
            }
        }
        for (i, mr) in live.iter().enumerate() {
            // SAFETY: the source outlives the write.
            unsafe { e0.post_write(1, &[sge(&src, 0, 8)], mr.remote(), 0, None, i as u64) }
                .unwrap();
        }
        // Fill the directory to capacity: one more is refused.
        let extra: Vec<_> = (live.len()..DIR_CAP)
            // SAFETY: as above.
            .map(|_| unsafe { e1.register(p, 64, RW) }.unwrap())
            .collect();
        // SAFETY: as above.
        assert!(unsafe { e1.register(p, 64, RW) }.is_err());
        for mr in extra.iter().chain(&live) {
            e1.deregister(mr);
        }
        let conn = e1.conn.as_ref().unwrap();
        assert!((0..DIR_CAP).all(|s| dir_read(&conn.own, s).unwrap().state == DIR_EMPTY));
        drop(v);
    }

    #[test]
    fn all_to_all_four_ranks() {
        let n = 4;
        let eps = fabric(n);
        let barrier = Barrier::new(n);
        let slot = 64 << 10;
        // Every rank registers its destination first; the keys travel "out of band".
        let mut eps: Vec<_> = eps
            .into_iter()
            .map(|mut ep| {
                let d = buf(&mut ep, vec![0; n * slot], RW);
                let me = ep.rank() as u32;
                let s = buf(&mut ep, pattern(slot, me), Access::LOCAL_READ);
                (ep, d, s)
            })
            .collect();
        let keys: Vec<RemoteRegion> = eps.iter().map(|(_, d, _)| d.mr.remote()).collect();
        thread::scope(|sc| {
            for (ep, d, s) in eps.iter_mut() {
                let (keys, barrier) = (&keys, &barrier);
                sc.spawn(move || {
                    let me = ep.rank();
                    for p in (0..n).filter(|&p| p != me) {
                        let off = (me * slot) as u64;
                        let imm = (me * 10) as u32;
                        // SAFETY: the source outlives the write.
                        unsafe { ep.post_write(p, &[sge(s, 0, 100)], keys[p], off, Some(imm), 0) }
                            .unwrap();
                        let big = [sge(s, 100, slot - 100)];
                        // SAFETY: as above.
                        unsafe { ep.post_write(p, &big, keys[p], off + 100, Some(imm + 1), 0) }
                            .unwrap();
                        ep.post_send(p, &(imm + 2).to_le_bytes(), 0).unwrap();
                    }
                    let got = collect(ep, 3 * (n - 1), remote);
                    for p in (0..n).filter(|&p| p != me) {
                        let from: Vec<u32> = got
                            .iter()
                            .filter(|c| matches!(c, Completion::WriteImm { peer, .. } | Completion::Recv { peer, .. } if *peer == p))
                            .map(tag)
                            .collect();
                        let base = (p * 10) as u32;
                        assert_eq!(from, [base, base + 1, base + 2]);
                        let want = pattern(slot, p as u32);
                        assert!(d.v[p * slot..(p + 1) * slot] == want[..]);
                    }
                    barrier.wait();
                });
            }
        });
    }

    /// Writes a raw record into `to`'s ring from `from` (sender position `pos`).
    fn inject(from: &ShmEndpoint, to_pos: usize, rec: &[u8], tail: u64) {
        let conn = from.conn.as_ref().unwrap();
        let p = conn.peers[to_pos].as_ref().unwrap();
        // SAFETY: `rec` is far shorter than the ring, and nobody else writes this ring.
        unsafe { ptr::copy_nonoverlapping(rec.as_ptr(), p.seg.ring(from.pos), rec.len()) };
        p.seg.a64(p.ctl + C_TAIL).store(tail, Ordering::Release);
    }

    #[test]
    fn malformed_rings_are_protocol_errors() {
        let mut bad_kind = RecHdr {
            kind: 99,
            imm: None,
            rkey: 0,
            offset: 0,
            data_len: 0,
        }
        .encode(REC_HDR)
        .to_vec();
        let mut bad_len = bad_kind.clone();
        bad_len[..4].copy_from_slice(&12u32.to_le_bytes());
        let mut big_send = bad_kind.clone();
        big_send[4] = KIND_SEND;
        big_send[24..28].copy_from_slice(&100_000u32.to_le_bytes());
        bad_kind.resize(64, 0);
        let cases: [(&[u8], u64, &str); 4] = [
            (&bad_kind, 32, "unknown record kind"),
            (&bad_len, 32, "record of 12 bytes"),
            (&big_send, 32, "payload bytes"),
            (&bad_kind, RING_BYTES as u64 + 8, "inconsistent"),
        ];
        for (rec, tail, why) in cases {
            let (e0, mut e1) = pair();
            inject(&e0, 1, rec, tail);
            let e = e1.poll(&mut Vec::new()).unwrap_err();
            assert!(matches!(e, TransportError::Protocol { peer: 0, .. }), "{e}");
            assert!(e.to_string().contains(why), "{e}");
            assert!(!e1.peer_alive(0));
            // The broken ring is no longer read.
            e1.poll(&mut Vec::new()).unwrap();
            e1.wait(Duration::from_millis(1)).unwrap();
        }
    }

    #[test]
    fn connect_fails_fast_or_times_out() {
        // A peer that gave up (its setup dropped) makes connect fail without waiting.
        let local = [0, 1];
        let (s0, i0) = ShmSetup::new(0, 2, &local).unwrap();
        let (s1, i1) = ShmSetup::new(1, 2, &local).unwrap();
        drop(s1);
        let t = Instant::now();
        assert!(s0.connect(&[i0, i1], LONG).is_err());
        assert!(t.elapsed() < Duration::from_secs(2));
        // A peer that never connects: a timeout naming it.
        let (s0, i0) = ShmSetup::new(0, 2, &local).unwrap();
        let (_s1, i1) = ShmSetup::new(1, 2, &local).unwrap();
        let e = s0
            .connect(&[i0, i1], Duration::from_millis(50))
            .unwrap_err();
        assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("[1]"), "{e}");
        // Infos that do not match the segments.
        let (s0, i0) = ShmSetup::new(0, 2, &local).unwrap();
        let (_s1, i1) = ShmSetup::new(1, 2, &local).unwrap();
        let forged = ShmInfo {
            nonce: i1.nonce ^ 1,
            ..i1
        };
        let e = s0.connect(&[i0, forged], LONG).unwrap_err();
        assert!(matches!(e, TransportError::Protocol { peer: 1, .. }), "{e}");
    }

    /// Memory from `alloc_shared`, valid while the endpoint that made it lives.
    #[derive(Clone, Copy)]
    struct Shared {
        base: *mut u8,
        len: usize,
    }

    impl Shared {
        fn new(ep: &mut ShmEndpoint, len: usize) -> Shared {
            let base = ep.alloc_shared(len).expect("shared allocation");
            Shared { base, len }
        }

        /// Registers `len` bytes at `off`.
        fn register(
            &self,
            ep: &mut ShmEndpoint,
            off: usize,
            len: usize,
            a: Access,
        ) -> MemoryRegion {
            // SAFETY: only the address is used; the allocation stays mapped until `ep` drops,
            // after its last use in the test.
            let p = unsafe { self.base.add(off) };
            // SAFETY: the span lies in the allocation (or, in the tests that register past its
            // end, is never written), which outlives the endpoint's use of it.
            unsafe { ep.register(p, len, a) }.unwrap()
        }

        /// A copy of `len` bytes at `off`.
        fn read(&self, off: usize, len: usize) -> Vec<u8> {
            assert!(off + len <= self.len);
            // SAFETY: in range of the allocation, which is alive; no write is in flight while a
            // test reads.
            unsafe { std::slice::from_raw_parts(self.base.add(off), len) }.to_vec()
        }
    }

    fn zeros(v: &[u8]) -> bool {
        v.iter().all(|&b| b == 0)
    }

    fn peer_maps(ep: &ShmEndpoint, pos: usize) -> usize {
        let conn = ep.conn.as_ref().unwrap();
        conn.peers[pos].as_ref().unwrap().maps.len()
    }

    fn own_entry(ep: &ShmEndpoint, key: u32) -> DirEntry {
        let conn = ep.conn.as_ref().unwrap();
        dir_lookup(&conn.own, key).unwrap().unwrap()
    }

    #[test]
    fn large_writes_into_shared_allocations_are_memcpys() {
        let (mut e0, mut e1) = pair();
        let mib = 1 << 20;
        let sh = Shared::new(&mut e1, 4 * mib + 100);
        let alloc_len = e1.shared[0].seg.len;
        assert!(alloc_len >= 4 * mib + 100 && alloc_len.is_multiple_of(4096));
        let dst = sh.register(&mut e1, 0, sh.len, RW);
        let a = own_entry(&e1, dst.rkey).alloc.unwrap();
        assert_eq!((a.id, a.len, a.off), (e1.shared[0].id, alloc_len as u64, 0));
        let r = dst.remote();
        let a = buf(&mut e0, pattern(2 * mib, 1), Access::LOCAL_READ);
        let b = buf(&mut e0, pattern(2 * mib, 2), Access::LOCAL_READ);

        // 3 MiB with a three-entry gather list.
        let s = [sge(&a, 5, mib + 3), sge(&b, 0, mib - 3), sge(&a, 1000, mib)];
        // SAFETY: the sources outlive the writes.
        unsafe { e0.post_write(1, &s, r, 17, Some(9), 4) }.unwrap();
        let got = collect(&mut e1, 1, remote);
        assert_eq!(
            got,
            [Completion::WriteImm {
                peer: 0,
                imm: 9,
                len: 3 * mib as u32
            }]
        );
        let mut want = a.v[5..mib + 8].to_vec();
        want.extend_from_slice(&b.v[..mib - 3]);
        want.extend_from_slice(&a.v[1000..mib + 1000]);
        assert!(sh.read(17, 3 * mib) == want);
        assert!(zeros(&sh.read(0, 17)) && zeros(&sh.read(17 + 3 * mib, 100)));
        let counts = |mapped, inline, cma| PathCounts {
            inline,
            mapped,
            cma,
        };
        assert_eq!(e0.paths, counts(1, 0, 0));
        assert_eq!(peer_maps(&e0, 1), 1);

        // The mapping is reused; a small write into the same region still goes inline.
        let at = 3 * mib + 50;
        // SAFETY: as above.
        unsafe { e0.post_write(1, &[sge(&b, 7, mib)], r, at as u64, Some(10), 5) }.unwrap();
        // SAFETY: as above.
        unsafe { e0.post_write(1, &[sge(&a, 9, 8)], r, 1, Some(11), 6) }.unwrap();
        let got = collect(&mut e1, 2, remote);
        assert_eq!(got.iter().map(tag).collect::<Vec<_>>(), [10, 11]);
        assert!(sh.read(at, mib) == b.v[7..mib + 7]);
        assert_eq!(sh.read(1, 8), &a.v[9..17]);
        assert_eq!(e0.paths, counts(2, 1, 0));
        assert_eq!(peer_maps(&e0, 1), 1);

        // An ordinary region keeps using cross-memory attach.
        let plain = buf(&mut e1, vec![0; mib], RW);
        assert!(own_entry(&e1, plain.mr.rkey).alloc.is_none());
        // SAFETY: as above.
        unsafe { e0.post_write(1, &[sge(&a, 3, mib)], plain.mr.remote(), 0, Some(12), 7) }.unwrap();
        assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 12);
        assert!(plain.v == a.v[3..mib + 3]);
        assert_eq!(e0.paths, counts(2, 1, 1));

        let mut out = Vec::new();
        e0.poll(&mut out).unwrap();
        let ids: Vec<u64> = (4..8).collect();
        assert_eq!(
            out,
            ids.iter()
                .map(|&wr_id| Completion::WriteDone { wr_id })
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn shared_sub_regions_land_at_their_offset() {
        let (mut e0, mut e1) = pair();
        let mib = 1 << 20;
        let sh = Shared::new(&mut e1, 3 * mib);
        let alloc_len = e1.shared[0].seg.len;
        let sub = sh.register(&mut e1, 8192 + 5, mib, RW);
        let tail = sh.register(&mut e1, 2 * mib, mib, RW);
        assert_eq!(own_entry(&e1, sub.rkey).alloc.unwrap().off, 8197);
        // SAFETY: the span lies in the allocation, which outlives the endpoint's use of it.
        let keyed = unsafe { e1.register_with_key(sh.base.add(4096), 100, RW, 77) }.unwrap();
        let a = own_entry(&e1, keyed.rkey).alloc.unwrap();
        assert_eq!((a.off, a.id), (4096, e1.shared[0].id));
        assert_eq!(own_entry(&e1, tail.rkey).alloc.unwrap().off, 2 * mib as u64);
        // A span that reaches past the allocation is not inside it (registered, never written).
        let p = sh.base.wrapping_add(alloc_len - 10);
        // SAFETY: registration only records the span; nothing writes to it.
        let over = unsafe { e1.register(p, 20, RW) }.unwrap();
        assert!(own_entry(&e1, over.rkey).alloc.is_none());
        // A second allocation has its own id and its own mapping at the writer.
        let sh2 = Shared::new(&mut e1, 100_000);
        let whole2 = sh2.register(&mut e1, 0, sh2.len, RW);
        let a2 = own_entry(&e1, whole2.rkey).alloc.unwrap();
        assert_eq!((a2.id, a2.off), (e1.shared[1].id, 0));
        assert_ne!(e1.shared[0].id, e1.shared[1].id);

        let src = buf(&mut e0, pattern(mib, 3), Access::LOCAL_READ);
        let k = 600 << 10;
        let writes = [
            (sub.remote(), 1000u64, sge(&src, 0, k)),
            (tail.remote(), 0, sge(&src, 11, 300 << 10)),
            (whole2.remote(), 30_000, sge(&src, 5, 70_000)),
        ];
        for (i, (r, off, s)) in writes.iter().enumerate() {
            // SAFETY: the source outlives the writes.
            unsafe { e0.post_write(1, &[*s], *r, *off, Some(i as u32), 0) }.unwrap();
        }
        collect(&mut e1, 3, remote);
        let at = 8197 + 1000;
        assert!(sh.read(at, k) == src.v[..k]);
        assert!(zeros(&sh.read(0, at)));
        assert!(zeros(&sh.read(at + k, 2 * mib - at - k)));
        assert!(sh.read(2 * mib, 300 << 10) == src.v[11..11 + (300 << 10)]);
        assert!(zeros(&sh.read(2 * mib + (300 << 10), mib - (300 << 10))));
        assert!(sh2.read(30_000, 70_000) == src.v[5..70_005]);
        assert!(zeros(&sh2.read(0, 30_000)));
        assert_eq!(e0.paths.mapped, 3);
        assert_eq!(peer_maps(&e0, 1), 2);

        // Inside the allocation but past the end of the sub-region: refused, nothing written.
        let s = [sge(&src, 0, k)];
        // SAFETY: as above.
        let e = unsafe { e0.post_write(1, &s, sub.remote(), (mib - 1000) as u64, None, 0) }
            .unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
        assert!(zeros(&sh.read(8197 + mib, 2 * mib - 8197 - mib)));
        assert_eq!(e0.paths.mapped, 3);
    }

    #[test]
    fn shared_regions_keep_the_access_checks() {
        let mut eps = fabric_in(4, &[0, 2]);
        let mut e2 = eps.pop().unwrap();
        let mut e0 = eps.pop().unwrap();
        let sh = Shared::new(&mut e2, 1 << 20);
        let dst = sh.register(&mut e2, 0, 100_000, RW);
        let ro = sh.register(&mut e2, 100_000, 100_000, Access::LOCAL_READ);
        let gone = sh.register(&mut e2, 200_000, 100_000, RW);
        e2.deregister(&gone);
        let src = buf(&mut e0, pattern(100_000, 5), Access::LOCAL_READ);
        let large = [sge(&src, 0, 10_000)];
        let cases = [
            (gone.remote(), 0, "unknown key"),
            (dst.remote(), 95_000, "past the end"),
            (dst.remote(), u64::MAX - 100, "past the end"),
            (ro.remote(), 0, "does not allow remote writes"),
        ];
        for (r, off, why) in cases {
            // SAFETY: the source outlives the call.
            let e = unsafe { e0.post_write(2, &large, r, off, Some(1), 9) }.unwrap_err();
            assert!(
                matches!(e, TransportError::RemoteAccess { peer: 2, .. }),
                "{e}"
            );
            let msg = e.to_string();
            assert!(msg.starts_with("rank 0: write of 10000 bytes"), "{msg}");
            assert!(msg.contains("into rank 2's region"), "{msg}");
            assert!(msg.contains(why), "{msg}");
        }
        let mut out = Vec::new();
        e2.poll(&mut out).unwrap();
        e0.poll(&mut out).unwrap();
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(e0.paths, PathCounts::default());
        assert_eq!(peer_maps(&e0, 1), 0);
        assert!(zeros(&sh.read(0, sh.len)));
        assert!(e0.peer_alive(2));
    }

    #[test]
    fn forged_allocation_entries_are_rejected() {
        type Forge = fn(AllocRef, &ShmEndpoint) -> AllocRef;
        let cases: [(Forge, &str); 5] = [
            (
                |a, _| AllocRef {
                    len: a.len + 4096,
                    ..a
                },
                "where its directory entry says",
            ),
            (
                |a, _| AllocRef { id: a.id ^ 1, ..a },
                "not shared allocation",
            ),
            (
                |a, ep| AllocRef {
                    fd: ep
                        .conn
                        .as_ref()
                        .unwrap()
                        .own
                        .fd
                        .as_ref()
                        .unwrap()
                        .as_raw_fd(),
                    ..a
                },
                "gradsync-shm",
            ),
            (
                |a, _| AllocRef {
                    off: a.len - 10,
                    ..a
                },
                "does not fit its shared allocation",
            ),
            (|a, _| AllocRef { fd: 99_999, ..a }, "/proc/"),
        ];
        for (i, (forge, why)) in cases.into_iter().enumerate() {
            let (mut e0, mut e1) = pair();
            let sh = Shared::new(&mut e1, 1 << 20);
            let dst = sh.register(&mut e1, 0, 100_000, RW);
            let conn = e1.conn.as_ref().unwrap();
            let slot = e1.regions.slots[&dst.rkey];
            let mut entry = dir_read(&conn.own, slot).unwrap();
            entry.alloc = Some(forge(entry.alloc.unwrap(), &e1));
            dir_write(&conn.own, slot, entry);
            let src = buf(&mut e0, pattern(10_000, 5), Access::LOCAL_READ);
            // SAFETY: the source outlives the call.
            let e = unsafe { e0.post_write(1, &[sge(&src, 0, 10_000)], dst.remote(), 0, None, 0) }
                .unwrap_err();
            assert!(e.to_string().contains(why), "case {i}: {e}");
            assert_eq!(e.peer(), Some(1));
            if i == 4 {
                // A descriptor that does not exist: an I/O error, the peer stays up.
                assert!(matches!(e, TransportError::Io { .. }), "{e}");
                assert!(e0.peer_alive(1));
            } else {
                assert!(matches!(e, TransportError::Protocol { .. }), "{e}");
                assert!(!e0.peer_alive(1));
            }
            assert!(zeros(&sh.read(0, sh.len)));
            assert_eq!(peer_maps(&e0, 1), 0);
        }
    }

    #[test]
    fn mixed_writes_keep_posting_order() {
        let (mut e0, mut e1) = pair();
        let n = 1000u32;
        let big = 40_000usize;
        let per_kind = n as usize / 5;
        let sh = Shared::new(&mut e1, per_kind * big + (64 << 10));
        let sh_small = sh.register(&mut e1, 0, 64 << 10, RW).remote();
        let sh_big = sh.register(&mut e1, 64 << 10, per_kind * big, RW).remote();
        let plain = buf(&mut e1, vec![0; per_kind * big + (64 << 10)], RW);
        let pr = plain.mr.remote();
        let src = buf(&mut e0, pattern(big + 1000, 4), Access::LOCAL_READ);
        let rx = thread::spawn(move || {
            let got = collect(&mut e1, n as usize, remote);
            (e1, plain, got)
        });
        let span = |i: u32| (i as usize * 7) % 1000;
        for i in 0..n {
            let slot = (i / 5) as u64;
            let small = [sge(&src, span(i), 8)];
            let large = [sge(&src, span(i), big)];
            // SAFETY: the source outlives the writes.
            unsafe {
                match i % 5 {
                    0 => e0.post_send(1, &i.to_le_bytes(), 0),
                    1 => e0.post_write(1, &small, sh_small, slot * 8, Some(i), 0),
                    2 => e0.post_write(1, &large, sh_big, slot * big as u64, Some(i), 0),
                    3 => e0.post_write(1, &small, pr, slot * 8, Some(i), 0),
                    _ => e0.post_write(1, &large, pr, (64 << 10) + slot * big as u64, Some(i), 0),
                }
            }
            .unwrap();
            if i % 64 == 0 {
                e0.poll(&mut Vec::new()).unwrap();
            }
        }
        let (_e1, plain, got) = rx.join().unwrap();
        let tags: Vec<u32> = got.iter().map(tag).collect();
        assert_eq!(tags, (0..n).collect::<Vec<_>>());
        for slot in 0..per_kind {
            let i = |k: usize| (slot * 5 + k) as u32;
            let (s1, s2, s3, s4) = (span(i(1)), span(i(2)), span(i(3)), span(i(4)));
            assert_eq!(sh.read(slot * 8, 8), &src.v[s1..s1 + 8]);
            assert!(sh.read((64 << 10) + slot * big, big) == src.v[s2..s2 + big]);
            assert_eq!(&plain.v[slot * 8..slot * 8 + 8], &src.v[s3..s3 + 8]);
            let at = (64 << 10) + slot * big;
            assert!(plain.v[at..at + big] == src.v[s4..s4 + big]);
        }
        let k = u64::from(n) / 5;
        assert_eq!(
            e0.paths,
            PathCounts {
                inline: 2 * k,
                mapped: k,
                cma: k
            }
        );
    }

    #[test]
    fn peer_mappings_go_with_the_peer() {
        let mut eps = fabric(3);
        let mut e2 = eps.pop().unwrap();
        let mut e1 = eps.pop().unwrap();
        let mut e0 = eps.pop().unwrap();
        let sh1 = Shared::new(&mut e1, 1 << 20);
        let sh2 = Shared::new(&mut e2, 1 << 20);
        let r1 = sh1.register(&mut e1, 0, 1 << 20, RW).remote();
        let r2 = sh2.register(&mut e2, 0, 1 << 20, RW).remote();
        let src = buf(&mut e0, pattern(100_000, 6), Access::LOCAL_READ);
        let s = [sge(&src, 0, 100_000)];
        // SAFETY: the source outlives the writes.
        unsafe { e0.post_write(1, &s, r1, 0, Some(1), 0) }.unwrap();
        // SAFETY: as above.
        unsafe { e0.post_write(2, &s, r2, 0, Some(2), 0) }.unwrap();
        collect(&mut e1, 1, remote);
        collect(&mut e2, 1, remote);
        assert!(sh1.read(0, 100_000) == src.v && sh2.read(0, 100_000) == src.v);
        assert_eq!((peer_maps(&e0, 1), peer_maps(&e0, 2)), (1, 1));
        // A closed endpoint allocates nothing more; its allocations live until it drops.
        e1.close(Duration::from_secs(1));
        assert!(e1.alloc_shared(4096).is_none());
        assert!(sh1.read(0, 100_000) == src.v);
        // SAFETY: as above.
        let e = unsafe { e0.post_write(1, &s, r1, 0, Some(3), 0) }.unwrap_err();
        assert!(
            matches!(e, TransportError::PeerClosed { peer: 1, .. }),
            "{e}"
        );
        assert_eq!((peer_maps(&e0, 1), peer_maps(&e0, 2)), (0, 1));
        drop(e1);
        drop(e2);
        e0.poll(&mut Vec::new()).unwrap();
        thread::sleep(LIVENESS_EVERY);
        // Polls read the clock (and so run the liveness check) one time in 64.
        for _ in 0..64 {
            e0.poll(&mut Vec::new()).unwrap();
        }
        assert!(!e0.peer_alive(2));
        assert_eq!(peer_maps(&e0, 2), 0);
    }

    /// By hand: `cargo test -p gradsync-transport --release shm::tests::measure_shared --
    /// --ignored --nocapture`. Throughput of 512 KiB writes into a region of a shared allocation
    /// (memcpy) and into an ordinary region (cross-memory attach): a writer and a polling
    /// receiver thread, 64 MiB per run, 3 runs each.
    #[test]
    #[ignore]
    fn measure_shared() {
        let (mut e0, mut e1) = pair();
        let chunk = 512 << 10;
        let slots = 16;
        let writes = (64 << 20) / chunk;
        let sh = Shared::new(&mut e1, slots * chunk);
        // SAFETY: the allocation holds `slots * chunk` bytes; nothing else touches it yet.
        unsafe { ptr::write_bytes(sh.base, 1, slots * chunk) };
        let shared = sh.register(&mut e1, 0, slots * chunk, RW).remote();
        let plain = buf(&mut e1, vec![1; slots * chunk], RW);
        let src = buf(&mut e0, pattern(chunk, 1), Access::LOCAL_READ);
        let cases = [
            ("a shared allocation (memcpy)", shared),
            ("an ordinary region (CMA)", plain.mr.remote()),
        ];
        for run in 1..=3 {
            for (name, r) in cases {
                let el = thread::scope(|sc| {
                    let rx = sc.spawn(|| {
                        let mut n = 0;
                        let mut out = Vec::new();
                        while n < writes {
                            out.clear();
                            e1.poll(&mut out).unwrap();
                            n += out.iter().filter(|c| remote(c)).count();
                        }
                    });
                    let t = Instant::now();
                    for i in 0..writes {
                        let off = ((i % slots) * chunk) as u64;
                        let s = [sge(&src, 0, chunk)];
                        // SAFETY: the source outlives the write.
                        unsafe { e0.post_write(1, &s, r, off, Some(i as u32), 0) }.unwrap();
                        if i % 16 == 0 {
                            e0.poll(&mut Vec::new()).unwrap();
                        }
                    }
                    rx.join().unwrap();
                    t.elapsed()
                });
                println!(
                    "run {run}: 512 KiB writes into {name}: {:.2} GB/s ({:.1} us per write)",
                    (writes * chunk) as f64 / el.as_secs_f64() / 1e9,
                    el.as_micros() as f64 / writes as f64
                );
            }
        }
        assert!(sh.read(0, chunk) == src.v && plain.v[..chunk] == src.v[..]);
        assert_eq!(e0.paths.mapped, 3 * writes as u64);
        assert_eq!(e0.paths.cma, 3 * writes as u64);
    }

    /// By hand: `cargo test -p gradsync-transport --release shm::tests::measure -- --ignored
    /// --nocapture`. One-way latency of an 8-byte inline write with immediate (ping-pong between
    /// two threads) and throughput of 512 KiB cross-memory writes.
    #[test]
    #[ignore]
    fn measure() {
        let (mut e0, mut e1) = pair();
        let d0 = buf(&mut e0, vec![0; 8 << 20], RW);
        let d1 = buf(&mut e1, vec![0; 8 << 20], RW);
        let s0 = buf(&mut e0, pattern(512 << 10, 1), Access::LOCAL_READ);
        let s1 = buf(&mut e1, pattern(512 << 10, 2), Access::LOCAL_READ);
        let (r0, r1) = (d0.mr.remote(), d1.mr.remote());
        let iters = 200_000u32;
        let spin = |ep: &mut ShmEndpoint, out: &mut Vec<Completion>| loop {
            out.clear();
            ep.poll(out).unwrap();
            if out.iter().any(remote) {
                return;
            }
        };
        let s1_sge = [sge(&s1, 0, 8)];
        let pong = thread::spawn(move || {
            let mut out = Vec::new();
            for i in 0..iters {
                spin(&mut e1, &mut out);
                // SAFETY: the source outlives the write.
                unsafe { e1.post_write(0, &s1_sge, r0, 0, Some(i), 0) }.unwrap();
            }
            (e1, s1, d1)
        });
        let mut out = Vec::new();
        let t = Instant::now();
        for i in 0..iters {
            // SAFETY: the source outlives the write.
            unsafe { e0.post_write(1, &[sge(&s0, 0, 8)], r1, 0, Some(i), 0) }.unwrap();
            spin(&mut e0, &mut out);
        }
        let el = t.elapsed();
        let (mut e1, _s1, _d1) = pong.join().unwrap();
        println!(
            "8-byte inline write with imm, one-way: {:.0} ns",
            el.as_nanos() as f64 / (2.0 * f64::from(iters))
        );

        let writes = 4096u32;
        let rx = thread::spawn(move || {
            let mut n = 0;
            let mut out = Vec::new();
            while n < writes {
                out.clear();
                e1.poll(&mut out).unwrap();
                n += out.iter().filter(|c| remote(c)).count() as u32;
            }
            e1
        });
        let t = Instant::now();
        for i in 0..writes {
            let off = u64::from(i % 16) * (512 << 10);
            // SAFETY: the source outlives the write.
            unsafe { e0.post_write(1, &[sge(&s0, 0, 512 << 10)], r1, off, Some(i), 0) }.unwrap();
            if i % 64 == 0 {
                e0.poll(&mut Vec::new()).unwrap();
            }
        }
        let _e1 = rx.join().unwrap();
        let el = t.elapsed();
        let bytes = f64::from(writes) * (512.0 * 1024.0);
        println!(
            "512 KiB cross-memory writes: {:.2} GB/s ({:.1} us per write)",
            bytes / el.as_secs_f64() / 1e9,
            el.as_micros() as f64 / f64::from(writes)
        );
    }
}
