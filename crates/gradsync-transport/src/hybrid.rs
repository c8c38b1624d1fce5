//! One endpoint over two backends: shared memory to the ranks on this host, the network to the
//! others.
//!
//! [`HybridEndpoint`] routes every post by peer: a peer on the same host (as decided at
//! rendezvous from host identities, never guessed from addresses) goes through the
//! [`shm`](crate::shm) backend, every other peer through the network backend (TCP). Both backends
//! see every registration under the **same key**, so a peer's [`RemoteRegion`] is valid whichever
//! path the peer uses: the network backend picks the key and the shared-memory backend registers
//! the same span under it ([`ShmEndpoint::register_with_key`]).
//!
//! Polling asks both backends. When every peer is local the network backend carries nothing but
//! could still report a closed connection, so it is polled only every few milliseconds, keeping
//! the shared-memory fast path free of system calls. Waiting blocks in the backend that carries
//! traffic; with both in use it sleeps in the shared-memory backend in short slices and checks the
//! sockets between them.

use crate::caps::{Board, PeerCaps, Route, SharedMemory};
use crate::error::{Result, TransportError};
use crate::shm::ShmEndpoint;
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion, Sge};
use crate::wire::RemoteRegion;
use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

/// Which of the two backends carries the traffic to one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// This rank itself (no traffic).
    Own,
    /// Shared memory (same host).
    Shm,
    /// The network backend.
    Net,
}

/// Slice of a mixed wait spent in the shared-memory backend before the sockets are checked.
/// A wait on shared-memory peers only, with nothing queued for the network, sleeps in the
/// shared-memory backend for its whole timeout instead (see [`HybridEndpoint::wait_on`]).
const MIXED_WAIT_SLICE: Duration = Duration::from_micros(500);
/// How often the network backend is polled when it carries no traffic (closed connections).
const IDLE_NET_POLL: Duration = Duration::from_millis(5);

/// Shared memory to local peers, a network backend to the rest.
pub struct HybridEndpoint {
    rank: usize,
    world: usize,
    net: Box<dyn Endpoint>,
    shm: ShmEndpoint,
    routes: Vec<Via>,
    net_peers: usize,
    shm_peers: usize,
    last_net_poll: Instant,
    polls: u32,
    /// Registrations by remote key: local key, how many registrations share it, and the span
    /// (address, length) the shared-memory backend has under it.
    keys: HashMap<u32, (u32, usize, usize, usize)>,
    /// Local key -> remote key, for registrations whose keys differ (an RDMA adapter's): the
    /// shared-memory backend knows a region by its remote key alone.
    local_to_remote: HashMap<u32, u32>,
}

impl fmt::Debug for HybridEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HybridEndpoint")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl HybridEndpoint {
    /// Combines a network endpoint connected to every peer with a shared-memory endpoint
    /// connected to the local ones. Peers for which `shm.is_local(peer)` holds go through shared
    /// memory. Fails if the two disagree on rank or world size.
    pub fn new(net: Box<dyn Endpoint>, shm: ShmEndpoint) -> Result<Self> {
        let (rank, world) = (net.rank(), net.world());
        if shm.rank() != rank || shm.world() != world {
            return Err(TransportError::Invalid {
                rank,
                op: "hybrid endpoint",
                msg: format!(
                    "network endpoint is rank {rank} of {world} but shared-memory endpoint is rank {} of {}",
                    shm.rank(),
                    shm.world()
                ),
            });
        }
        let routes: Vec<Via> = (0..world)
            .map(|p| {
                if p == rank {
                    Via::Own
                } else if shm.is_local(p) {
                    Via::Shm
                } else {
                    Via::Net
                }
            })
            .collect();
        let shm_peers = routes.iter().filter(|r| **r == Via::Shm).count();
        let net_peers = routes.iter().filter(|r| **r == Via::Net).count();
        Ok(HybridEndpoint {
            rank,
            world,
            net,
            shm,
            routes,
            net_peers,
            shm_peers,
            last_net_poll: Instant::now(),
            polls: 0,
            keys: HashMap::new(),
            local_to_remote: HashMap::new(),
        })
    }

    /// The route of the network backend (to its first peer).
    fn net_route(&self) -> Route {
        (0..self.world)
            .find(|&p| self.routes[p] == Via::Net)
            .map_or(Route::Tcp, |p| self.net.caps(p).route)
    }

    fn route(&self, peer: usize, op: &'static str) -> Result<Via> {
        match self.routes.get(peer) {
            Some(Via::Own) | None => Err(TransportError::Invalid {
                rank: self.rank,
                op,
                msg: format!(
                    "peer {peer} is not another rank of a world of {}",
                    self.world
                ),
            }),
            Some(r) => Ok(*r),
        }
    }
}

impl Endpoint for HybridEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        let net = self.net_route();
        match (self.shm_peers > 0, self.net_peers > 0) {
            (true, true) if net == Route::Rdma => "shm+rdma",
            (true, true) => "shm+tcp",
            (true, false) => "shm",
            _ => self.net.name(),
        }
    }

    fn caps(&self, peer: usize) -> PeerCaps {
        match self.routes.get(peer) {
            Some(Via::Shm) => self.shm.caps(peer),
            Some(Via::Net) => self.net.caps(peer),
            _ => PeerCaps::plain(Route::Own),
        }
    }

    fn board(&mut self) -> Option<&mut dyn Board> {
        // A board serves collectives among all ranks: only when every peer is on this host.
        if self.net_peers == 0 {
            self.shm.board()
        } else {
            None
        }
    }

    fn unused_peer_areas(&mut self, peers: &[usize]) {
        self.net.unused_peer_areas(peers);
    }

    fn shared_memory(&mut self) -> Option<&mut dyn SharedMemory> {
        if self.shm_peers > 0 {
            self.shm.shared_memory()
        } else {
            None
        }
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        // SAFETY: the caller's promise about the span is passed on unchanged.
        let mr = unsafe { self.net.register(addr, len, access) }?;
        if let Some(k) = self.keys.get_mut(&mr.rkey) {
            // The network backend handed out a key it already gave: the same span again can
            // share the shared-memory registration; any other span (a span inside a pooled
            // registration, or a key that collides with a recorded one) would make local
            // peers' offsets land elsewhere, so it is refused.
            if (k.2, k.3) == (addr as usize, len) {
                k.1 += 1;
                return Ok(mr);
            }
            self.net.deregister(&mr);
            return Err(TransportError::Invalid {
                rank: self.rank,
                op: "register",
                msg: format!(
                    "the network backend gave key 0x{:08x} to {len} bytes at {addr:p}, a key already naming {} bytes at 0x{:x}",
                    mr.rkey, k.3, k.2
                ),
            });
        }
        // SAFETY: as above; the same span under the key the network backend chose.
        match unsafe { self.shm.register_with_key(addr, len, access, mr.rkey) } {
            Ok(_) => {
                self.keys.insert(mr.rkey, (mr.lkey, 1, addr as usize, len));
                if mr.lkey != mr.rkey {
                    self.local_to_remote.insert(mr.lkey, mr.rkey);
                }
                Ok(mr)
            }
            Err(e) => {
                self.net.deregister(&mr);
                Err(e)
            }
        }
    }

    fn deregister(&mut self, mr: &MemoryRegion) {
        if let Some(k) = self.keys.get_mut(&mr.rkey) {
            k.1 -= 1;
            if k.1 == 0 {
                self.keys.remove(&mr.rkey);
                self.local_to_remote.remove(&mr.lkey);
                self.shm.deregister(mr);
            }
        }
        self.net.deregister(mr);
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
        match self.route(peer, "post_write")? {
            Via::Shm if !self.local_to_remote.is_empty() => {
                // The shared-memory backend knows regions by their remote keys; a gather list
                // of the usual length is translated on the stack.
                let map = |s: &Sge| Sge {
                    lkey: self.local_to_remote.get(&s.lkey).copied().unwrap_or(s.lkey),
                    ..*s
                };
                let mut small = [Sge {
                    addr: 0,
                    len: 0,
                    lkey: 0,
                }; 4];
                let big: Vec<Sge>;
                let t: &[Sge] = if sges.len() <= small.len() {
                    for (d, s) in small.iter_mut().zip(sges) {
                        *d = map(s);
                    }
                    &small[..sges.len()]
                } else {
                    big = sges.iter().map(map).collect();
                    &big
                };
                // SAFETY: the same spans as the caller's, with their keys translated.
                unsafe { self.shm.post_write(peer, t, remote, offset, imm, wr_id) }
            }
            // SAFETY: the caller's promise about `sges` is passed on unchanged.
            Via::Shm => unsafe { self.shm.post_write(peer, sges, remote, offset, imm, wr_id) },
            // SAFETY: as above.
            _ => unsafe { self.net.post_write(peer, sges, remote, offset, imm, wr_id) },
        }
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        match self.route(peer, "post_send")? {
            Via::Shm => self.shm.post_send(peer, data, wr_id),
            _ => self.net.post_send(peer, data, wr_id),
        }
    }

    fn connect(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        // Shared-memory peers are connected at setup; the network connects its own.
        let net: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| matches!(self.routes.get(p), Some(Via::Net)))
            .collect();
        if net.is_empty() {
            return Ok(());
        }
        self.net.connect(&net, timeout)
    }

    fn peer_alive(&self, peer: usize) -> bool {
        match self.routes.get(peer) {
            // The shared-memory backend knows best: it keeps a closed peer alive until its last
            // records are read, while the idle socket may already have seen the end.
            Some(Via::Shm) => self.shm.peer_alive(peer),
            Some(Via::Net) => self.net.peer_alive(peer),
            _ => true,
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        if self.shm_peers > 0 {
            self.shm.poll(out)?;
        }
        if self.net_peers > 0 {
            self.net.poll(out)?;
        } else {
            // Read the clock on one poll in 64 only (see `ShmEndpoint::poll`).
            self.polls = self.polls.wrapping_add(1);
            if self.polls.is_multiple_of(64) {
                let now = Instant::now();
                if now.duration_since(self.last_net_poll) >= IDLE_NET_POLL {
                    self.last_net_poll = now;
                    self.net.poll(out)?;
                }
            }
        }
        Ok(())
    }

    /// Where every peer waited on is on shared memory and the network backend has nothing
    /// queued to send, sleeps on shared memory alone: its peers' signals wake it, and nothing
    /// the network could bring is needed before they come. With 32 ranks on 2 cores (8
    /// emulated hosts of 4, a 64 MiB ring all-reduce at 1 Gbit/s) the 500 us slices of the
    /// mixed wait cost every rank inside a host two wake-ups a millisecond. Otherwise as
    /// [`wait`](Endpoint::wait).
    fn wait_on(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        let shm_only = !peers.is_empty()
            && peers
                .iter()
                .all(|&p| matches!(self.routes.get(p), Some(Via::Shm)));
        if self.shm_peers > 0 && self.net_peers > 0 && shm_only && !self.net.tx_pending() {
            return self.shm.wait(timeout);
        }
        self.wait(timeout)
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        match (self.shm_peers > 0, self.net_peers > 0) {
            (true, true) => {
                self.shm.wait(timeout.min(MIXED_WAIT_SLICE))?;
                self.net.wait(Duration::ZERO)
            }
            (true, false) => self.shm.wait(timeout),
            _ => self.net.wait(timeout),
        }
    }

    fn close(&mut self, timeout: Duration) {
        // One deadline for both backends.
        let start = Instant::now();
        self.shm.close(timeout);
        self.net.close(timeout.saturating_sub(start.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ShmSetup;

    /// Rank 0 of 3: rank 1 on shared memory, rank 2 behind the network backend (in memory,
    /// where nothing is ever queued to send).
    fn rank0() -> (HybridEndpoint, ShmEndpoint) {
        let mut shm = ShmSetup::in_process(3, &[0, 1], Duration::from_secs(10)).unwrap();
        let peer = shm.pop().unwrap();
        let mut net = crate::mem::fabric(3);
        let ep = HybridEndpoint::new(Box::new(net.swap_remove(0)), shm.pop().unwrap()).unwrap();
        (ep, peer)
    }

    /// How long a wait on `peers` with nothing arriving takes.
    fn waited(ep: &mut HybridEndpoint, peers: &[usize], timeout: Duration) -> Duration {
        let t = Instant::now();
        ep.wait_on(peers, timeout).unwrap();
        t.elapsed()
    }

    /// Waiting on the shared-memory peer alone sleeps the whole timeout in one backend; a
    /// wait that involves the network peer (or names no peer) wakes every slice to check it.
    #[test]
    fn a_wait_on_shared_memory_peers_alone_sleeps_there() {
        let (mut ep, _peer) = rank0();
        assert!(!ep.net.tx_pending());
        let long = Duration::from_millis(300);
        let d = waited(&mut ep, &[1], long);
        assert!(d >= Duration::from_millis(250), "{d:?}");
        for peers in [&[2][..], &[1, 2], &[]] {
            let d = waited(&mut ep, peers, long);
            assert!(d < Duration::from_millis(150), "{peers:?}: {d:?}");
        }
    }
}
