//! The [`Endpoint`] calls of the RDMA endpoint: registration into the pool (or only into the
//! region table, for caller buffers), the checks of a post, poll, wait and close.

use super::device::memlock_msg;
use super::endpoint::{AreaRegion, Pending, Pinned, RdmaEndpoint};
use super::ffi;
use super::lazy::Lazy;
use super::setup::{CTRL_BYE, setup_err};
use crate::caps::{Board, PeerCaps, Route, SharedMemory};
use crate::error::{Result, TransportError};
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion, Sge, check_send_len};
use crate::wire::RemoteRegion;
use std::ffi::c_int;
use std::time::{Duration, Instant};

impl Endpoint for RdmaEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        "rdma"
    }

    /// An adapter writes only into regions pinned for it: the long-lived ones (inbox, scratch);
    /// a caller's buffer is never pinned, so no receiver asks for a write straight into it.
    fn caps(&self, peer: usize) -> PeerCaps {
        if peer == self.rank {
            return PeerCaps::plain(Route::Own);
        }
        PeerCaps {
            direct_writes: false,
            connected: self.peers.get(peer).is_some_and(|p| p.joined),
            ..PeerCaps::plain(Route::Rdma)
        }
    }

    fn board(&mut self) -> Option<&mut dyn Board> {
        None
    }

    fn shared_memory(&mut self) -> Option<&mut dyn SharedMemory> {
        None
    }

    fn unused_peer_areas(&mut self, peers: &[usize]) {
        if let Some(ar) = self.areas.as_mut() {
            ar.unused.resize(self.world, false);
            for &p in peers.iter().filter(|&&p| p < self.world) {
                ar.unused[p] = true;
            }
        }
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        if !access.contains(Access::PERSISTENT) {
            // Only recorded: data from here is staged (see the module documentation). Keys
            // never collide with an adapter key in the pool.
            let k = self.fresh_key();
            return Ok(self.regions.insert(k, addr as usize, len, access));
        }
        let a = addr as usize;
        // Under first use, a region written by areas is pinned area by area as ranks connect
        // (`pair::open_peer`), if no pair has connected yet.
        if access.contains(Access::PEER_AREAS.union(Access::REMOTE_WRITE))
            && self.first_use.is_some()
            && self.areas.is_none()
            && len > 0
            && len.is_multiple_of(self.world)
            && self.peers.iter().all(|p| p.qps.is_empty())
        {
            let k = self.fresh_key();
            self.areas = Some(AreaRegion {
                key: k,
                addr: a,
                len,
                area: len / self.world,
                unused: Vec::new(),
            });
            return Ok(self.regions.insert(k, a, len, access));
        }
        if let Some(p) = self.pinned.iter_mut().find(|p| {
            a >= p.addr
                && a.checked_add(len).is_some_and(|e| e <= p.addr + p.len)
                && p.access.contains(access)
        }) {
            p.refs += 1;
            return Ok(MemoryRegion {
                addr: a,
                len,
                lkey: p.lkey,
                rkey: p.rkey,
                access,
            });
        }
        if self.pinned_bytes.saturating_add(len) > self.opts.reg_max_bytes {
            return Err(setup_err(
                self.rank,
                usize::MAX,
                "register",
                format!(
                    "registering {len} bytes would pin {} bytes, past the pool's bound of {}",
                    self.pinned_bytes + len,
                    self.opts.reg_max_bytes
                ),
            ));
        }
        let mut bits = 1;
        if access.contains(Access::REMOTE_WRITE) {
            bits |= 2;
        }
        let (mut lkey, mut rkey, mut e) = (0u32, 0u32, 0 as c_int);
        // SAFETY: the caller keeps the memory valid until deregistration.
        let mr = unsafe {
            ffi::gs_reg(
                self.dev.raw,
                addr.cast(),
                len.max(1),
                bits,
                &mut lkey,
                &mut rkey,
                &mut e,
            )
        };
        if mr.is_null() {
            return Err(setup_err(
                self.rank,
                usize::MAX,
                "register",
                memlock_msg(len, e),
            ));
        }
        self.pinned_bytes += len;
        self.pinned.push(Pinned {
            mr,
            addr: a,
            len,
            lkey,
            rkey,
            access,
            refs: 1,
        });
        Ok(MemoryRegion {
            addr: a,
            len,
            lkey,
            rkey,
            access,
        })
    }

    fn deregister(&mut self, mr: &MemoryRegion) {
        if !mr.access.contains(Access::PERSISTENT) {
            self.regions.deregister(mr);
            return;
        }
        if self.areas.as_ref().is_some_and(|ar| ar.key == mr.lkey) {
            for p in 0..self.peers.len() {
                self.drop_area(p);
            }
            self.areas = None;
            self.regions.deregister(mr);
            return;
        }
        if let Some(i) = self.pinned.iter().position(|p| {
            p.lkey == mr.lkey && mr.addr >= p.addr && mr.addr + mr.len <= p.addr + p.len
        }) {
            self.pinned[i].refs -= 1;
            if self.pinned[i].refs == 0 {
                let p = self.pinned.swap_remove(i);
                self.pinned_bytes -= p.len;
                // SAFETY: the registration came from `gs_reg` and has no users left.
                unsafe { ffi::gs_dereg(p.mr) };
            }
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
        self.peer_check(peer, "post_write")?;
        for s in sges {
            if !self.pinned_for(s) {
                self.regions.check_local(std::slice::from_ref(s))?;
            }
        }
        let total: u64 = sges.iter().map(|s| s.len as u64).sum();
        if total > self.staging.buf.len as u64 || total > u32::MAX as u64 {
            return Err(TransportError::Invalid {
                rank: self.rank,
                op: "post_write",
                msg: format!(
                    "a write of {total} bytes to rank {peer} is larger than the staging ring ({} bytes)",
                    self.staging.buf.len
                ),
            });
        }
        if offset.checked_add(total).is_none_or(|e| e > remote.len) {
            return Err(TransportError::RemoteAccess {
                rank: self.rank,
                peer,
                rkey: remote.rkey,
                offset,
                len: total,
                region_len: remote.len,
                why: "past the end of the region the peer advertised",
            });
        }
        if self.peers[peer].pending.is_empty()
            && self.try_write(peer, sges, remote, offset, imm, wr_id)?
        {
            return Ok(());
        }
        self.peers[peer].pending.push_back(Pending::Write {
            sges: sges.to_vec(),
            remote,
            offset,
            imm,
            wr_id,
        });
        Ok(())
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        self.peer_check(peer, "post_send")?;
        check_send_len(self.rank, data.len())?;
        self.send_or_queue(peer, data, wr_id, None)
    }

    fn connect(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        // Without connections on first use, every peer is connected at setup.
        if self.first_use.is_none() {
            return Ok(());
        }
        self.connect_peers(peers, timeout)
    }

    fn peer_alive(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|p| p.broken.is_none() && (!p.joined || p.byes < p.qps.len()))
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        if self.first_use.as_mut().is_some_and(Lazy::accept_due) {
            self.accept_pending()?;
        }
        let before = out.len();
        self.drain_cq(out);
        self.flush_pending();
        out.extend(self.ready.drain(..));
        // What arrived goes up first (a caller drops `out` on an error): the error waits for
        // the next poll.
        if out.len() == before
            && let Some(e) = self.errors.pop_front()
        {
            return Err(e);
        }
        Ok(())
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        if !self.ready.is_empty() || !self.errors.is_empty() || !self.stash.is_empty() {
            return Ok(());
        }
        // Arm, then look once more: a completion that came before arming raises no event.
        if !self.armed {
            // SAFETY: the device is open.
            unsafe { ffi::gs_req_notify(self.dev.raw) };
            self.armed = true;
        }
        let mut wcs = [ffi::GsWc::default(); 32];
        // SAFETY: room for 32 completions.
        let n = unsafe { ffi::gs_poll(self.dev.raw, wcs.as_mut_ptr(), 32) };
        if n > 0 {
            self.stash.extend_from_slice(&wcs[..n as usize]);
            return Ok(());
        }
        // Pending posts wait for send completions, which raise events too.
        // Round up: a sub-millisecond wait must not become a busy poll(2) of 0 ms.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as c_int;
        let mut pfds = [
            libc::pollfd {
                // SAFETY: the device is open.
                fd: unsafe { ffi::gs_channel_fd(self.dev.raw) },
                events: libc::POLLIN,
                revents: 0,
            },
            // A peer's dial wakes a rank that waits for its first connection.
            libc::pollfd {
                fd: self
                    .first_use
                    .as_ref()
                    .and_then(Lazy::listener_fd)
                    .unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds (a negative descriptor is ignored).
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), 2, ms) };
        if r > 0 && pfds[0].revents != 0 {
            // SAFETY: the device is open; the channel is non-blocking.
            while unsafe { ffi::gs_take_event(self.dev.raw) } == 1 {}
            self.armed = false;
        }
        Ok(())
    }

    fn close(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        // Let what is queued leave, then say goodbye on every queue pair.
        while self.has_outstanding() && Instant::now() < deadline {
            if self.poll(&mut out).is_err() {
                break;
            }
            out.clear();
            let _ = self.wait(Duration::from_millis(5));
        }
        for peer in 0..self.peers.len() {
            if self.peers[peer].broken.is_some() || !self.peers[peer].joined {
                continue;
            }
            for _ in 0..self.peers[peer].qps.len() {
                let _ = self.send_or_queue(peer, &[], 0, Some(CTRL_BYE));
            }
        }
        // Wait for our goodbyes to be acknowledged and for the peers' goodbyes.
        while Instant::now() < deadline {
            if self.poll(&mut out).is_err() {
                // A peer that failed is not waited for; the others still are.
            }
            out.clear();
            let done = !self.has_outstanding()
                && self
                    .peers
                    .iter()
                    .all(|p| p.broken.is_some() || !p.joined || p.byes >= p.qps.len());
            if done {
                break;
            }
            let _ = self.wait(Duration::from_millis(5));
        }
    }
}
