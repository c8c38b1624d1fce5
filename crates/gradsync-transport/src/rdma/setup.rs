//! Setting up the RDMA backend: [`RdmaSetup`] opens the device, then either creates the queue
//! pairs to every peer, publishes its connection descriptor and moves the queue pairs to RTS
//! against the peers' descriptors, or leaves every pair to connect on first use (`lazy`); in
//! both it hands its resources to an [`RdmaEndpoint`].

use super::device::{
    Buffer, Device, LINK_LAYER_ETHERNET, errno_str, list_ports, memlock_msg, parse_hca, pick_gid,
    random_u64,
};
use super::endpoint::{Peer, RdmaEndpoint};
use super::ffi;
use super::lazy::{FirstUse, Lazy};
use super::options::RdmaOptions;
use super::staging::Staging;
use super::wire::ConnInfoRepr;
use crate::error::{Result, TransportError};
use crate::regions::RegionTable;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CString, c_int};
use std::fmt;

/// Send work requests a queue pair may have outstanding.
pub(super) const SEND_DEPTH: u32 = 128;
/// Receive buffers posted per queue pair.
pub(super) const RECV_DEPTH: usize = 64;
/// Gather entries of one work request.
pub(super) const MAX_SGE: u32 = 4;
/// Immediate value of the internal message that says a peer closes.
pub(super) const CTRL_BYE: u32 = 0x4259_4521;

/// Completion queue entries for the queue pairs to `peers` peers, `qps` each: every send and
/// receive they may have outstanding, and some room.
pub(super) fn cq_entries(peers: usize, qps: usize) -> usize {
    peers * qps * (SEND_DEPTH as usize + RECV_DEPTH) + 64
}

/// An rdma error of `rank` (with `peer`, or `usize::MAX`) about `what`.
pub(super) fn setup_err(
    rank: usize,
    peer: usize,
    what: &'static str,
    msg: String,
) -> TransportError {
    TransportError::Rdma {
        rank,
        peer,
        what,
        msg,
    }
}

/// An open device with the queue pairs to every peer in INIT, receives posted, waiting for
/// the peers' descriptors ([`new`](Self::new)); or with none, for queue pairs made on first
/// use ([`open`](Self::open), then [`first_use`](Self::first_use)).
pub struct RdmaSetup {
    ep: RdmaEndpoint,
    info: ConnInfoRepr,
}

impl fmt::Debug for RdmaSetup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaSetup")
            .field("rank", &self.ep.rank)
            .field("device", &self.ep.device)
            .field("gid_index", &self.ep.gid_index)
            .finish()
    }
}

impl RdmaSetup {
    /// Opens the device and creates the queue pairs of `rank` to every other rank of a world
    /// of `world`.
    pub fn new(rank: usize, world: usize, opts: &RdmaOptions) -> Result<RdmaSetup> {
        let mut s = RdmaSetup::open_for(rank, world, opts, world.saturating_sub(1))?;
        let q = s.ep.qps_per_peer();
        for p in (0..world).filter(|&p| p != rank) {
            let entries = s.ep.open_peer(p)?;
            s.info.qp[p * q..(p + 1) * q].copy_from_slice(&entries);
        }
        Ok(s)
    }

    /// Opens the device (protection domain, completion queue, staging ring) and creates no
    /// queue pair. The completion queue starts with room for one peer's queue pairs and grows
    /// as pairs make theirs.
    pub fn open(rank: usize, world: usize, opts: &RdmaOptions) -> Result<RdmaSetup> {
        RdmaSetup::open_for(rank, world, opts, world.saturating_sub(1).min(1))
    }

    /// [`open`](Self::open), with a completion queue sized for the queue pairs to `peers`
    /// peers.
    fn open_for(rank: usize, world: usize, opts: &RdmaOptions, peers: usize) -> Result<RdmaSetup> {
        let err = |what, msg| setup_err(rank, usize::MAX, what, msg);
        let ports = list_ports().map_err(|e| err("device", e))?;
        let (want_dev, want_port) = match &opts.hca {
            Some(h) => {
                let (d, p) = parse_hca(h).map_err(|e| err("device", e))?;
                (Some(d), p)
            }
            None => (None, None),
        };
        let found = ports.iter().find(|p| {
            want_dev.as_ref().is_none_or(|d| *d == p.device)
                && want_port.is_none_or(|n| n == p.port)
                && (want_dev.is_some() || p.active())
        });
        let Some(chosen) = found else {
            let have: Vec<String> = ports
                .iter()
                .map(|p| format!("{}:{} {}", p.device, p.port, p.state))
                .collect();
            return Err(err(
                "device",
                match &opts.hca {
                    Some(h) => format!(
                        "GRADSYNC_IB_HCA={h:?} names no port of this machine (ports: {})",
                        if have.is_empty() {
                            "none".into()
                        } else {
                            have.join(", ")
                        }
                    ),
                    None => format!(
                        "no RDMA port is active (ports: {})",
                        if have.is_empty() {
                            "none".into()
                        } else {
                            have.join(", ")
                        }
                    ),
                },
            ));
        };
        if !chosen.active() {
            return Err(err(
                "device",
                format!(
                    "{}:{} is {}, not PORT_ACTIVE",
                    chosen.device, chosen.port, chosen.state
                ),
            ));
        }
        let qps_per_peer = opts.qps_per_peer.max(1);
        let cqe = cq_entries(peers, qps_per_peer) as c_int;
        let name =
            CString::new(chosen.device.clone()).map_err(|_| err("device", "bad name".into()))?;
        let mut e: c_int = 0;
        // SAFETY: `name` is NUL-terminated; `e` receives the error.
        let raw = unsafe { ffi::gs_open(name.as_ptr(), chosen.port, cqe.max(16), &mut e) };
        if raw.is_null() {
            return Err(err(
                "device",
                format!(
                    "opening {}:{} (protection domain, completion queue of {cqe} entries): {}",
                    chosen.device,
                    chosen.port,
                    errno_str(e)
                ),
            ));
        }
        let dev = Device { raw };
        let mut port = ffi::GsPort::default();
        // SAFETY: `dev.raw` is open; `port` is a plain struct the call fills.
        let rc = unsafe { ffi::gs_port_info(dev.raw, &mut port) };
        if rc != 0 {
            return Err(err("device", format!("ibv_query_port: {}", errno_str(rc))));
        }
        let ethernet = port.link_layer == LINK_LAYER_ETHERNET;
        let gid_index = match opts.gid_index {
            Some(i) if i >= port.gid_tbl_len => {
                return Err(err(
                    "device",
                    format!(
                        "GRADSYNC_IB_GID_INDEX={i} is past the GID table of {}:{} ({} entries)",
                        chosen.device, chosen.port, port.gid_tbl_len
                    ),
                ));
            }
            Some(i) => i,
            None if ethernet => pick_gid(&chosen.gids).ok_or_else(|| {
                err(
                    "device",
                    format!(
                        "{}:{} is RoCE but has no GID (is an IP address assigned to its network device?)",
                        chosen.device, chosen.port
                    ),
                )
            })?,
            None => 0,
        };
        let mut gid = [0u8; 16];
        let mut gtype = 0u32;
        // SAFETY: `gid` holds 16 bytes.
        let rc = unsafe { ffi::gs_gid(dev.raw, gid_index, gid.as_mut_ptr(), &mut gtype) };
        if rc != 0 || (ethernet && gid == [0u8; 16]) {
            return Err(err(
                "device",
                format!(
                    "GID index {gid_index} of {}:{} is {}",
                    chosen.device,
                    chosen.port,
                    if rc != 0 {
                        errno_str(rc)
                    } else {
                        "empty".into()
                    }
                ),
            ));
        }
        let q = qps_per_peer;
        let staging_buf = Buffer::new(opts.staging_bytes.max(1 << 20))
            .map_err(|m| setup_err(rank, usize::MAX, "register", m))?;
        let (mut lkey, mut rkey) = (0u32, 0u32);
        // SAFETY: a live mapping, deregistered before it is unmapped (the endpoint's drop).
        let smr = unsafe {
            ffi::gs_reg(
                dev.raw,
                staging_buf.ptr.cast(),
                staging_buf.len,
                1,
                &mut lkey,
                &mut rkey,
                &mut e,
            )
        };
        if smr.is_null() {
            return Err(setup_err(
                rank,
                usize::MAX,
                "register",
                memlock_msg(staging_buf.len, e),
            ));
        }
        let local = ConnInfoRepr {
            world: world as u32,
            qps: q as u32,
            gid,
            lid: port.lid,
            mtu: port.active_mtu,
            global: ethernet,
            qp: Vec::new(),
        };
        let ep = RdmaEndpoint {
            rank,
            world,
            device: format!("{}:{}", chosen.device, port.port),
            opts: opts.clone(),
            peers: (0..world).map(|_| Peer::default()).collect(),
            by_qpn: HashMap::new(),
            regions: RegionTable::new(rank),
            pinned: Vec::new(),
            pinned_bytes: 0,
            staging: Staging {
                buf: staging_buf,
                mr: smr,
                lkey,
                live: VecDeque::new(),
                first: 0,
                head: 0,
            },
            wrs: HashMap::new(),
            next_wr: 1,
            ready: VecDeque::new(),
            stash: Vec::new(),
            armed: false,
            errors: VecDeque::new(),
            port_num: port.port,
            gid_index,
            local: local.clone(),
            seed: random_u64(),
            // SAFETY: the device is open.
            cq_size: unsafe { ffi::gs_cq_size(dev.raw) }.max(0) as usize,
            max_cqe: port.max_cqe as usize,
            first_use: None,
            areas: None,
            dev,
        };
        Ok(RdmaSetup {
            ep,
            info: ConnInfoRepr {
                qp: vec![(0, 0); world * q],
                ..local
            },
        })
    }

    /// This rank's connection descriptor, to publish through the rendezvous store.
    pub fn info(&self) -> Vec<u8> {
        self.info.to_bytes()
    }

    /// Device name and port in use.
    pub fn device(&self) -> String {
        self.ep.device.clone()
    }

    /// The column of descriptor `info` (as [`info`](Self::info) makes it) for rank `dst`:
    /// what `dst` needs of it to connect (see [`ConnInfoRepr::column`]). `None` when `info`
    /// is not a descriptor or has no entries for `dst`.
    pub fn column(info: &[u8], dst: usize) -> Option<Vec<u8>> {
        ConnInfoRepr::from_bytes(info)?.column(dst)
    }

    /// Moves every queue pair to RTS against the peers' descriptors, whole or the columns of
    /// them for this rank (`infos[rank]` is ignored).
    pub fn connect(self, infos: &[Vec<u8>]) -> Result<RdmaEndpoint> {
        let RdmaSetup { mut ep, .. } = self;
        let (rank, world) = (ep.rank, ep.world);
        let q = ep.qps_per_peer();
        if infos.len() != world {
            return Err(setup_err(
                rank,
                usize::MAX,
                "connect",
                format!("{} descriptors for a world of {world}", infos.len()),
            ));
        }
        let mut columns = Vec::with_capacity(world);
        for (p, b) in infos.iter().enumerate() {
            if p == rank {
                columns.push(None);
                continue;
            }
            let mut i = ConnInfoRepr::from_bytes(b)
                .or_else(|| ConnInfoRepr::from_column(b))
                .ok_or_else(|| {
                    setup_err(
                        rank,
                        p,
                        "connect",
                        format!("malformed connection descriptor ({} bytes)", b.len()),
                    )
                })?;
            ep.check_remote(p, &i)?;
            // A whole descriptor holds the entries to every rank; a column only those to
            // this one.
            if i.qp.len() != q {
                i.qp = i.qp[rank * q..(rank + 1) * q].to_vec();
            }
            columns.push(Some(i));
        }
        for (p, c) in columns.iter().enumerate() {
            if let Some(c) = c {
                ep.join_peer(p, c)?;
                ep.peers[p].joined = true;
            }
        }
        Ok(ep)
    }

    /// The endpoint, connecting each pair on first use: the higher rank of a pair dials the
    /// lower one's listener at `first.addrs`, and the two exchange their queue pair numbers
    /// over that connection (see [`FirstUse`]).
    pub fn first_use(self, first: FirstUse) -> Result<RdmaEndpoint> {
        let mut ep = self.ep;
        ep.first_use = Some(Lazy::new(ep.rank, ep.world, first)?);
        Ok(ep)
    }
}
