//! The state of a connected RDMA endpoint ([`RdmaEndpoint`]): queue pairs by peer, the
//! registration pool, the staging ring, outstanding work requests, the receive buffers; its
//! accessors and teardown. Posting is in `post`, the completion queue in `completion`, the
//! [`Endpoint`](crate::Endpoint) calls in `verbs`.

use super::device::{Buffer, Device};
use super::ffi;
use super::lazy::Lazy;
use super::options::RdmaOptions;
use super::staging::Staging;
use super::wire::ConnInfoRepr;
use crate::error::{Result, TransportError};
use crate::regions::RegionTable;
use crate::verbs::{Access, Completion, Sge};
use crate::wire::RemoteRegion;
use std::collections::{HashMap, VecDeque};
use std::fmt;

/// A registration with the adapter.
#[derive(Debug)]
pub(super) struct Pinned {
    pub(super) mr: *mut ffi::IbvMr,
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
    pub(super) access: Access,
    pub(super) refs: usize,
}

/// A region peers write into that is registered area by area, each when its rank connects
/// ([`Access::PEER_AREAS`]): `world` areas of `area` bytes, area `p` written by rank `p` only.
/// `key` is the key handed out for it, which no adapter knows: local spans in it use their
/// area's key, and peers' writes the key of their area that the pair's exchange carried.
#[derive(Debug)]
pub(super) struct AreaRegion {
    pub(super) key: u32,
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) area: usize,
    /// Ranks that never write their area ([`Endpoint::unused_peer_areas`](crate::Endpoint::unused_peer_areas)): it stays
    /// unpinned.
    pub(super) unused: Vec<bool>,
}

/// A queue pair to one peer, with its outstanding send work requests.
pub(super) struct Qp {
    pub(super) raw: *mut ffi::IbvQp,
    pub(super) outstanding: u32,
}

/// The receive buffers of the queue pairs to one peer: [`RECV_DEPTH`](super::setup::RECV_DEPTH)
/// slots of [`MAX_SEND`](crate::verbs::MAX_SEND) bytes per queue pair, registered when the
/// queue pairs are made.
pub(super) struct RecvBuf {
    pub(super) buf: Buffer,
    pub(super) mr: *mut ffi::IbvMr,
    pub(super) lkey: u32,
}

/// The queue pairs to one peer and the posts waiting for room.
#[derive(Default)]
pub(super) struct Peer {
    /// Empty until the queue pairs are made (at setup, or on first use).
    pub(super) qps: Vec<Qp>,
    /// This rank's `(qpn, psn)` of each queue pair in `qps`.
    pub(super) local: Vec<(u32, u32)>,
    /// Receive buffers of `qps`.
    pub(super) recv: Option<RecvBuf>,
    /// Whether the queue pairs are in RTS and both ranks know it: only then is traffic posted.
    pub(super) joined: bool,
    /// This rank's area for the peer in a region registered by areas ([`AreaRegion`]),
    /// registered when the peer's queue pairs are made.
    pub(super) area: Option<Pinned>,
    /// The peer's region registered by areas: the key its engine publishes, and the key of
    /// the peer's area for this rank, which writes present instead.
    pub(super) remote_area: Option<(u32, u32)>,
    pub(super) next: usize,
    /// Why the connection is unusable, once it is.
    pub(super) broken: Option<String>,
    /// Queue pairs on which the peer said goodbye.
    pub(super) byes: usize,
    /// Posts waiting for room (staging or send queue), in order.
    pub(super) pending: VecDeque<Pending>,
}

/// A post waiting for room (staging or send queue).
pub(super) enum Pending {
    Write {
        sges: Vec<Sge>,
        remote: RemoteRegion,
        offset: u64,
        imm: Option<u32>,
        wr_id: u64,
    },
    Send {
        data: Vec<u8>,
        wr_id: u64,
        ctrl: Option<u32>,
    },
}

/// What an outstanding send-queue work request is.
#[derive(Clone, Copy, Debug)]
pub(super) struct Wr {
    pub(super) peer: usize,
    pub(super) qp: usize,
    /// Staging span to free on completion.
    pub(super) staged: Option<u64>,
    /// The caller's id, reported on completion (writes straight from registered memory).
    pub(super) user: Option<u64>,
    pub(super) write: bool,
    pub(super) rkey: u32,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Length of the target region as the peer advertised it.
    pub(super) region_len: u64,
}

/// A rank's queue pairs to all peers, its completion queue and its registrations.
pub struct RdmaEndpoint {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) device: String,
    pub(super) opts: RdmaOptions,
    pub(super) peers: Vec<Peer>,
    pub(super) by_qpn: HashMap<u32, (usize, usize)>,
    pub(super) regions: RegionTable,
    pub(super) pinned: Vec<Pinned>,
    pub(super) pinned_bytes: usize,
    pub(super) staging: Staging,
    pub(super) wrs: HashMap<u64, Wr>,
    pub(super) next_wr: u64,
    pub(super) ready: VecDeque<Completion>,
    pub(super) stash: Vec<ffi::GsWc>,
    pub(super) armed: bool,
    /// Errors found while polling, reported by the next poll.
    pub(super) errors: VecDeque<TransportError>,
    /// Port number in use.
    pub(super) port_num: u32,
    pub(super) gid_index: u32,
    /// This rank's descriptor without queue pair entries (world, queue pairs per peer, GID,
    /// LID, MTU, link layer): what every column it sends starts with.
    pub(super) local: ConnInfoRepr,
    /// Seed of the initial packet sequence numbers.
    pub(super) seed: u64,
    /// Entries the completion queue holds now, and the most the device allows: it grows as
    /// pairs make their queue pairs.
    pub(super) cq_size: usize,
    pub(super) max_cqe: usize,
    /// Connections on first use: the listener and the peers' addresses.
    pub(super) first_use: Option<Lazy>,
    /// The region registered area by area, if one is.
    pub(super) areas: Option<AreaRegion>,
    pub(super) dev: Device,
}

// SAFETY: see `RdmaSetup`; the endpoint is used by one thread at a time.
unsafe impl Send for RdmaEndpoint {}

impl fmt::Debug for RdmaEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaEndpoint")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .field("qps_per_peer", &self.opts.qps_per_peer)
            .finish()
    }
}

impl RdmaEndpoint {
    /// Device and port in use (`rxe0:1`).
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Bytes registered with the adapter through [`Access::PERSISTENT`] registrations.
    pub fn pinned_bytes(&self) -> usize {
        self.pinned_bytes
    }

    /// Number of distinct adapter registrations in the pool.
    pub fn pinned_regions(&self) -> usize {
        self.pinned.len()
    }

    pub(super) fn peer_check(&self, peer: usize, op: &'static str) -> Result<()> {
        if peer >= self.world || peer == self.rank {
            return Err(TransportError::Invalid {
                rank: self.rank,
                op,
                msg: format!(
                    "peer {peer} is not another rank of a world of {}",
                    self.world
                ),
            });
        }
        if let Some(why) = &self.peers[peer].broken {
            return Err(TransportError::PeerClosed {
                rank: self.rank,
                peer,
                during: format!("{op}: {why}"),
            });
        }
        if !self.peers[peer].joined {
            return Err(TransportError::Invalid {
                rank: self.rank,
                op,
                msg: format!("rank {peer} is not connected yet (connect first)"),
            });
        }
        Ok(())
    }

    /// The adapter key of the registered span holding `s`: its own key if that is an adapter
    /// key, the key of its area in a region registered by areas; `None` when no registration
    /// holds it (its data is then staged).
    pub(super) fn local_key(&self, s: &Sge) -> Option<u32> {
        let within = |addr: usize, len: usize| {
            s.addr >= addr && s.addr.checked_add(s.len).is_some_and(|e| e <= addr + len)
        };
        if self
            .pinned
            .iter()
            .any(|p| p.lkey == s.lkey && within(p.addr, p.len))
        {
            return Some(s.lkey);
        }
        let ar = self
            .areas
            .as_ref()
            .filter(|ar| ar.key == s.lkey && within(ar.addr, ar.len))?;
        let a = self
            .peers
            .get((s.addr - ar.addr) / ar.area)?
            .area
            .as_ref()?;
        within(a.addr, a.len).then_some(a.lkey)
    }

    /// A key of the region table that no adapter registration in the pool has: for memory
    /// only recorded (caller buffers) or registered by areas.
    pub(super) fn fresh_key(&mut self) -> u32 {
        loop {
            let k = self.regions.fresh_key();
            if !self.pinned.iter().any(|p| p.lkey == k || p.rkey == k) {
                return k;
            }
        }
    }

    /// Whether `s` lies in memory registered with the adapter.
    pub(super) fn pinned_for(&self, s: &Sge) -> bool {
        self.local_key(s).is_some()
    }
}

impl Drop for RdmaEndpoint {
    fn drop(&mut self) {
        for p in 0..self.peers.len() {
            self.drop_peer_qps(p);
        }
        for p in self.pinned.drain(..) {
            // SAFETY: registered by `gs_reg`, deregistered once.
            unsafe { ffi::gs_dereg(p.mr) };
        }
        // SAFETY: as above.
        unsafe { ffi::gs_dereg(self.staging.mr) };
        // The buffers unmap and the device closes (in field order) after this.
    }
}
