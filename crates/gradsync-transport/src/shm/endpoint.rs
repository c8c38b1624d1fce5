//! A rank's shared-memory endpoint ([`ShmEndpoint`]): registration into the region
//! directory, the three write paths (inline record, `memcpy` into a peer's shared allocation,
//! cross-memory attach), polling, waiting, the board calls and close.

use super::alloc::{SharedAlloc, alloc_name};
use super::cma::cma_write;
use super::conn::Conn;
use super::directory::{
    ACC_REMOTE_WRITE, DIR_LIVE, DirEntry, LocalTable, access_bits, dir_insert, dir_lookup,
    dir_remove,
};
use super::huge::{HugePages, HugeStats, MAX_STRIKES};
use super::layout::{C_TAIL, DIR_CAP, ctl_off};
use super::liveness::{LIVENESS_EVERY, pidfd_exited, process_state};
use super::peer::{Me, Peer};
use super::ring::Payload;
use super::segment::Segment;
use super::stream::STREAM_MIN;
use super::wire::{BOARD_CAPACITY, INLINE_MAX, RecordRepr};
use crate::caps::{Board, PeerCaps, Route, SharedMemory};
use crate::error::{Result, TransportError, Violation};
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion, Sge, check_send_len};
use crate::wire::RemoteRegion;
use std::ffi::CString;
use std::fmt;
use std::io;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

/// A rank's shared-memory connections to the other ranks of its host.
pub struct ShmEndpoint {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) local: Vec<usize>,
    pub(super) pos: usize,
    /// `None` once closed.
    pub(super) conn: Option<Conn>,
    pub(super) regions: LocalTable,
    /// Local completions, returned by the next poll.
    pub(super) done: Vec<Completion>,
    /// When a poll next looks for vanished peer processes.
    pub(super) next_check: Instant,
    /// Polls so far (the clock is read on one in 64).
    pub(super) polls: u32,
    /// Id of the last shared allocation (the first one follows the segment's nonce).
    pub(super) last_alloc_id: u64,
    /// How the writes this rank posted were carried.
    pub(super) paths: PathCounts,
    /// This rank's shared allocations; they outlive everything else of the endpoint.
    pub(super) shared: Vec<SharedAlloc>,
    /// Huge pages under large regions that peers wrote and that are registered again.
    pub(super) huge: HugePages,
}

/// Number of posted writes by the way their bytes travelled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PathCounts {
    /// Inside a ring record.
    pub(super) inline: u64,
    /// With `memcpy` into a mapping of the target's shared allocation.
    pub(super) mapped: u64,
    /// With `process_vm_writev`.
    pub(super) cma: u64,
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
            .field("huge_pages", &self.huge.stats())
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
    /// The endpoint `setup` makes once connected: `rank` of `world`, at position `pos` among
    /// the sorted `local` ranks; the first shared allocation id follows `nonce`.
    pub(super) fn new(
        rank: usize,
        world: usize,
        local: Vec<usize>,
        pos: usize,
        conn: Conn,
        nonce: u64,
    ) -> ShmEndpoint {
        ShmEndpoint {
            rank,
            world,
            local,
            pos,
            conn: Some(conn),
            regions: LocalTable::new(rank),
            done: Vec::new(),
            next_check: Instant::now(),
            polls: 0,
            last_alloc_id: nonce,
            paths: PathCounts::default(),
            shared: Vec::new(),
            huge: HugePages::new(),
        }
    }

    /// Whether large regions that peers wrote by cross-memory attach get huge pages. A region
    /// registered for remote writes outside a shared allocation, at least
    /// [`HUGE_MIN`](crate::shm::HUGE_MIN) long, into which a peer wrote at least 64 KiB that
    /// way, and registered again at the same address and length (one of the last 16 such
    /// regions), has its 2 MiB-aligned interior collapsed (`madvise(MADV_COLLAPSE)`, contents
    /// kept). A region the kernel refused twice is left alone; after three re-collapses that
    /// did real work (buffers replaced at one address) the endpoint stops. On by default;
    /// never where the kernel's transparent huge pages are `never`.
    pub fn set_huge_pages(&mut self, on: bool) {
        self.huge.set(on);
    }

    /// What the huge-page policy did so far.
    pub fn huge_pages(&self) -> HugeStats {
        self.huge.stats()
    }

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
        if access.contains(Access::REMOTE_WRITE)
            && entry.alloc.is_none()
            && let Some(span) = self.huge.on_register(addr, len)
        {
            // Peers wrote this region with process_vm_writev, which pins it page by page.
            let (ok, took) = HugePages::collapse(span);
            if self.huge.record(span, ok, took) {
                tracing::info!(
                    rank = self.rank,
                    "shm: buffers registered again at the same address kept losing their huge \
                     pages ({MAX_STRIKES} times); no more collapsing"
                );
            }
        }
        Ok(self.regions.regions.insert(key, addr, len, access))
    }

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

    /// The connection to `peer` for a post, with the region table.
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
            Err(violation) if p.process_gone().is_none() && !p.seg.closed() => {
                return Err(TransportError::Io {
                    rank: me.rank,
                    peer,
                    op: "post_write",
                    source: io::Error::new(io::ErrorKind::TimedOut, violation),
                });
            }
            Err(violation) => return Err(p.protocol(me, violation)),
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
        let inline = RecordRepr::WriteInline {
            rkey,
            offset,
            imm,
            data_len: total as u32,
        };
        // The notification of a write whose bytes are already in place.
        let notify = RecordRepr::WriteNotify {
            rkey,
            offset,
            imm,
            data_len: total as u32,
        };
        if total <= INLINE_MAX {
            // SAFETY: the spans lie in registered regions (checked) that the caller keeps
            // readable until the write completes.
            unsafe { p.push(me, &inline, Payload::Gather(sges)) }?;
            self.paths.inline += 1;
        } else if let Some(a) = entry.alloc {
            // The region lies in a shared allocation of the peer: copy straight into this
            // rank's mapping of it. `offset + len <= entry.len` holds (checked above).
            if a.off.checked_add(entry.len).is_none_or(|end| end > a.len) {
                let violation = Violation::RegionOutsideAllocation {
                    rkey,
                    len: entry.len,
                    offset: a.off,
                    alloc_len: a.len,
                };
                return Err(p.protocol(me, violation));
            }
            let base = p.map_alloc(me, a)?;
            // SAFETY: the mapping is `a.len` bytes (checked against the memfd's size and
            // sealed against shrinking) and `a.off + offset + total <= a.off + entry.len <=
            // a.len`, so the destination is in range; it is a separate mapping, so it does not
            // overlap the sources, which lie in registered regions (checked) that the caller
            // keeps readable until the write completes.
            unsafe {
                Payload::Gather(sges).copy_to_streaming(base.add((a.off + offset) as usize), |s| {
                    s.len >= STREAM_MIN
                        && regions
                            .regions
                            .access_of(s.lkey)
                            .is_some_and(|a| a.contains(Access::STREAMED))
                })
            };
            // The bytes are in place; the notification is published after them.
            // SAFETY: an empty payload reads nothing.
            unsafe { p.push(me, &notify, Payload::Empty) }?;
            self.paths.mapped += 1;
        } else {
            let Some(dst) = entry.addr.checked_add(offset) else {
                let violation = Violation::RegionWraps {
                    rkey,
                    addr: entry.addr,
                };
                return Err(p.protocol(me, violation));
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
            // SAFETY: an empty payload reads nothing.
            unsafe { p.push(me, &notify, Payload::Empty) }?;
            self.paths.cma += 1;
        }
        self.done.push(Completion::WriteDone { wr_id });
        Ok(())
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        check_send_len(self.rank, data.len())?;
        let me = self.me();
        let (p, _) = self.target(peer, "post_send")?;
        let hdr = RecordRepr::Send {
            data_len: data.len() as u32,
        };
        // SAFETY: a byte-slice payload has no gather spans.
        unsafe { p.push(me, &hdr, Payload::Bytes(data)) }?;
        self.done.push(Completion::SendDone { wr_id });
        Ok(())
    }

    fn connect(&mut self, _peers: &[usize], _timeout: Duration) -> Result<()> {
        // Every peer is connected at setup.
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
        // Records the peer published before it closed or exited, and its board posting of the
        // watched operation, are still to be read: until they are, the peer counts as alive (a caller that checks liveness between two polls
        // must not lose them). The closed flag is read first, then the ring: a record
        // published before the close is then always seen.
        let gone = p.down.is_some() || p.seg.closed() || p.process_gone().is_some();
        if !gone {
            return true;
        }
        fence(Ordering::SeqCst);
        let c = self.conn.as_ref().expect("checked above");
        let tail = c.own.a64(ctl_off(pos) + C_TAIL).load(Ordering::Acquire);
        tail != p.rx_head || c.board.unread(p)
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
        let LocalTable {
            regions, written, ..
        } = &mut self.regions;
        for key in written.get_mut().drain(..) {
            if let Some((addr, len)) = regions.span_of(key) {
                self.huge.on_written(addr, len);
            }
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

    fn caps(&self, peer: usize) -> PeerCaps {
        if peer == self.rank {
            return PeerCaps::plain(Route::Own);
        }
        PeerCaps {
            mapped: true,
            ..PeerCaps::plain(Route::Shm)
        }
    }

    fn board(&mut self) -> Option<&mut dyn Board> {
        let on = self.conn.is_some() && self.local.len() > 1;
        on.then_some(self as &mut dyn Board)
    }

    fn shared_memory(&mut self) -> Option<&mut dyn SharedMemory> {
        Some(self)
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

/// The board of a shared-memory endpoint: a small buffer at the end of this rank's segment,
/// which the other local ranks read through their mapping of it.
impl Board for ShmEndpoint {
    fn capacity(&self) -> usize {
        BOARD_CAPACITY
    }

    fn post(&mut self, seq: u64, data: &[u8]) -> Result<bool> {
        let me = self.me();
        self.live_conn("board_post")?.board_post(me, seq, data)
    }

    fn read(&mut self, peer: usize, seq: u64, out: &mut Vec<u8>) -> Result<bool> {
        let me = self.me();
        let pos = self.peer_pos(peer, "board_read")?;
        self.live_conn("board_read")?.board_read(me, pos, seq, out)
    }

    fn release(&mut self, seq: u64) -> Result<()> {
        self.live_conn("board_release")?.board_release(seq);
        Ok(())
    }

    fn watch(&mut self, seq: u64) {
        if let Some(c) = self.conn.as_mut() {
            c.board.watch(seq);
        }
    }
}

impl SharedMemory for ShmEndpoint {
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
}
