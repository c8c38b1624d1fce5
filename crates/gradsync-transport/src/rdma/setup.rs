//! Setting up the RDMA backend: [`RdmaSetup`] opens the device, creates the queue pairs to
//! every peer, publishes its connection descriptor, moves the queue pairs to RTS against the
//! peers' descriptors and hands its resources to an [`RdmaEndpoint`].

use super::device::{
    Buffer, Device, LINK_LAYER_ETHERNET, errno_str, list_ports, memlock_msg, mtu_bytes, parse_hca,
    pick_gid, post_recv, random_u64,
};
use super::endpoint::{Peer, Qp, RdmaEndpoint};
use super::ffi;
use super::options::RdmaOptions;
use super::staging::Staging;
use super::wire::ConnInfoRepr;
use crate::error::{Result, TransportError};
use crate::regions::RegionTable;
use crate::verbs::MAX_SEND;
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

/// Queue pairs to every peer, in INIT with receives posted, waiting for the peers' info.
pub struct RdmaSetup {
    rank: usize,
    world: usize,
    opts: RdmaOptions,
    dev: Device,
    port: ffi::GsPort,
    device: String,
    gid_index: u32,
    info: ConnInfoRepr,
    /// `qps[peer][i]`.
    qps: Vec<Vec<*mut ffi::IbvQp>>,
    recv_buf: Buffer,
    recv_mr: *mut ffi::IbvMr,
    recv_lkey: u32,
}

// SAFETY: the verbs objects are used from one thread at a time (the owner's); libibverbs
// objects may move between threads.
unsafe impl Send for RdmaSetup {}

impl fmt::Debug for RdmaSetup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaSetup")
            .field("rank", &self.rank)
            .field("device", &self.device)
            .field("port", &self.port.port)
            .field("gid_index", &self.gid_index)
            .finish()
    }
}

impl RdmaSetup {
    /// Opens the device and creates the queue pairs of `rank` in a world of `world`.
    pub fn new(rank: usize, world: usize, opts: &RdmaOptions) -> Result<RdmaSetup> {
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
        let nqp = (world - 1) * qps_per_peer;
        let cqe = (nqp * (SEND_DEPTH as usize + RECV_DEPTH) + 64) as c_int;
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
        let recv_len = nqp * RECV_DEPTH * MAX_SEND;
        let recv_buf = Buffer::new(recv_len).map_err(|e| err("register", e))?;
        let (mut lkey, mut rkey) = (0u32, 0u32);
        // SAFETY: `recv_buf` is a live mapping of `len` bytes, deregistered before it is freed.
        let recv_mr = unsafe {
            ffi::gs_reg(
                dev.raw,
                recv_buf.ptr.cast(),
                recv_buf.len,
                1,
                &mut lkey,
                &mut rkey,
                &mut e,
            )
        };
        if recv_mr.is_null() {
            return Err(err("register", memlock_msg(recv_buf.len, e)));
        }
        let mut setup = RdmaSetup {
            rank,
            world,
            opts: opts.clone(),
            device: chosen.device.clone(),
            gid_index,
            info: ConnInfoRepr {
                world: world as u32,
                qps: qps_per_peer as u32,
                gid,
                lid: port.lid,
                mtu: port.active_mtu,
                global: ethernet,
                qp: vec![(0, 0); world * qps_per_peer],
            },
            port,
            dev,
            qps: vec![Vec::new(); world],
            recv_buf,
            recv_mr,
            recv_lkey: lkey,
        };
        let seed = random_u64();
        let mut slot = 0usize;
        for p in (0..world).filter(|&p| p != rank) {
            for i in 0..qps_per_peer {
                let mut qpn = 0u32;
                // SAFETY: the device is open; the queue pair is destroyed in Drop.
                let qp = unsafe {
                    ffi::gs_qp_create(
                        setup.dev.raw,
                        SEND_DEPTH,
                        RECV_DEPTH as u32,
                        MAX_SGE,
                        0,
                        &mut qpn,
                        &mut e,
                    )
                };
                if qp.is_null() {
                    return Err(setup_err(
                        rank,
                        p,
                        "create queue pair",
                        format!(
                            "ibv_create_qp (RC, {SEND_DEPTH} sends, {RECV_DEPTH} receives, {MAX_SGE} gather entries): {}",
                            errno_str(e)
                        ),
                    ));
                }
                setup.qps[p].push(qp);
                // SAFETY: `qp` was just created.
                let rc = unsafe { ffi::gs_qp_init(qp, setup.port.port) };
                if rc != 0 {
                    return Err(setup_err(
                        rank,
                        p,
                        "queue pair RESET->INIT",
                        format!(
                            "queue pair {i} (qpn {qpn}): {}; attributes: pkey_index=0 port_num={} qp_access_flags=REMOTE_WRITE|LOCAL_WRITE",
                            errno_str(rc),
                            setup.port.port
                        ),
                    ));
                }
                for k in 0..RECV_DEPTH {
                    let idx = slot * RECV_DEPTH + k;
                    setup
                        .post_recv(qp, idx)
                        .map_err(|m| setup_err(rank, p, "post receive", m))?;
                }
                slot += 1;
                let psn =
                    ((seed >> ((p * qps_per_peer + i) % 40)) as u32 ^ (p as u32) << 8 ^ i as u32)
                        & 0xff_ffff;
                setup.info.qp[p * qps_per_peer + i] = (qpn, psn);
            }
        }
        Ok(setup)
    }

    /// Posts receive buffer slot `idx` on `qp`.
    fn post_recv(&self, qp: *mut ffi::IbvQp, idx: usize) -> std::result::Result<(), String> {
        post_recv(qp, idx, self.recv_buf.ptr, self.recv_lkey)
    }

    /// This rank's connection descriptor, to publish through the rendezvous store.
    pub fn info(&self) -> Vec<u8> {
        self.info.to_bytes()
    }

    /// Device name and port in use.
    pub fn device(&self) -> String {
        format!("{}:{}", self.device, self.port.port)
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
        let (rank, world) = (self.rank, self.world);
        let q = self.opts.qps_per_peer.max(1);
        if infos.len() != world {
            return Err(setup_err(
                rank,
                usize::MAX,
                "connect",
                format!("{} descriptors for a world of {world}", infos.len()),
            ));
        }
        let mut peers_info = Vec::with_capacity(world);
        for (p, b) in infos.iter().enumerate() {
            if p == rank {
                peers_info.push(None);
                continue;
            }
            let i = ConnInfoRepr::from_bytes(b)
                .or_else(|| ConnInfoRepr::from_column(b))
                .ok_or_else(|| {
                    setup_err(
                        rank,
                        p,
                        "connect",
                        format!("malformed connection descriptor ({} bytes)", b.len()),
                    )
                })?;
            if i.world as usize != world || i.qps as usize != q {
                return Err(setup_err(
                    rank,
                    p,
                    "connect",
                    format!(
                        "the peer has {} queue pairs per peer in a world of {}, this rank {q} in a world of {world} (GRADSYNC_IB_QPS_PER_CONN must match)",
                        i.qps, i.world
                    ),
                ));
            }
            if i.global != self.info.global {
                return Err(setup_err(
                    rank,
                    p,
                    "connect",
                    "one side is RoCE (Ethernet), the other InfiniBand".into(),
                ));
            }
            peers_info.push(Some(i));
        }
        let port = self.port.port;
        for (p, pi) in peers_info.iter().enumerate() {
            let Some(pi) = pi else { continue };
            let mtu = self.info.mtu.min(pi.mtu);
            if !(1..=5).contains(&mtu) {
                return Err(setup_err(
                    rank,
                    p,
                    "queue pair INIT->RTR",
                    format!(
                        "path_mtu: rank {p} advertises MTU code {}, this port {}; valid codes are 1-5 (256-4096 bytes)",
                        pi.mtu, self.info.mtu
                    ),
                ));
            }
            for (i, &qp) in self.qps[p].iter().enumerate() {
                // A column holds only the entries to this rank.
                let (dqpn, rpsn) = if pi.qp.len() == q {
                    pi.qp[i]
                } else {
                    pi.qp[rank * q + i]
                };
                let (_, spsn) = self.info.qp[p * q + i];
                let gid = std::net::Ipv6Addr::from(pi.gid);
                let attrs = format!(
                    "path_mtu={} dest_qp_num={dqpn} rq_psn={rpsn} ah_attr.is_global={} ah_attr.grh.dgid={gid} ah_attr.grh.sgid_index={} ah_attr.dlid={} port_num={port}",
                    mtu_bytes(mtu),
                    u8::from(self.info.global),
                    self.gid_index,
                    pi.lid
                );
                if dqpn == 0 {
                    return Err(setup_err(
                        rank,
                        p,
                        "queue pair INIT->RTR",
                        format!("dest_qp_num is 0 ({attrs})"),
                    ));
                }
                // SAFETY: `qp` is in INIT; `pi.gid` holds 16 bytes.
                let rc = unsafe {
                    ffi::gs_qp_rtr(
                        qp,
                        port,
                        mtu,
                        dqpn,
                        rpsn,
                        u32::from(self.info.global),
                        pi.gid.as_ptr(),
                        self.gid_index,
                        pi.lid,
                    )
                };
                if rc != 0 {
                    return Err(setup_err(
                        rank,
                        p,
                        "queue pair INIT->RTR",
                        format!("queue pair {i}: {}; attributes: {attrs}", errno_str(rc)),
                    ));
                }
                // SAFETY: `qp` is in RTR.
                let rc = unsafe {
                    ffi::gs_qp_rts(
                        qp,
                        spsn,
                        u32::from(self.opts.ib_timeout),
                        u32::from(self.opts.retry_cnt.min(7)),
                        7,
                    )
                };
                if rc != 0 {
                    return Err(setup_err(
                        rank,
                        p,
                        "queue pair RTR->RTS",
                        format!(
                            "queue pair {i}: {}; attributes: sq_psn={spsn} timeout={} retry_cnt={} rnr_retry=7 max_rd_atomic=1",
                            errno_str(rc),
                            self.opts.ib_timeout,
                            self.opts.retry_cnt
                        ),
                    ));
                }
            }
        }
        self.into_endpoint()
    }

    /// Moves the resources of a connected setup into an endpoint.
    fn into_endpoint(mut self) -> Result<RdmaEndpoint> {
        let s = &mut self;
        let rank = s.rank;
        let mut e: c_int = 0;
        let staging_buf = Buffer::new(s.opts.staging_bytes.max(1 << 20))
            .map_err(|m| setup_err(rank, usize::MAX, "register", m))?;
        let (mut lkey, mut rkey) = (0u32, 0u32);
        // SAFETY: a live mapping, deregistered before it is unmapped.
        let smr = unsafe {
            ffi::gs_reg(
                s.dev.raw,
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
        let q = s.opts.qps_per_peer.max(1);
        let mut by_qpn = HashMap::new();
        let mut peers = Vec::with_capacity(s.world);
        for (p, qps) in s.qps.iter().enumerate() {
            let mut v = Vec::new();
            for (i, &raw) in qps.iter().enumerate() {
                let (qpn, _) = s.info.qp[p * q + i];
                by_qpn.insert(qpn, (p, i));
                v.push(Qp {
                    raw,
                    outstanding: 0,
                });
            }
            peers.push(Peer {
                qps: v,
                next: 0,
                broken: None,
                byes: 0,
                pending: VecDeque::new(),
            });
        }
        // Move the resources out of the setup; what is left drops as nothing.
        let dev = Device {
            raw: std::mem::replace(&mut s.dev.raw, std::ptr::null_mut()),
        };
        let recv_buf = std::mem::replace(
            &mut s.recv_buf,
            Buffer {
                ptr: std::ptr::null_mut(),
                len: 0,
            },
        );
        let recv_mr = std::mem::replace(&mut s.recv_mr, std::ptr::null_mut());
        s.qps.clear();
        let (opts, device) = (s.opts.clone(), s.device.clone());
        let device = format!("{device}:{}", s.port.port);
        Ok(RdmaEndpoint {
            rank,
            world: s.world,
            device,
            opts,
            peers,
            by_qpn,
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
            recv_buf,
            recv_mr,
            recv_lkey: s.recv_lkey,
            armed: false,
            errors: VecDeque::new(),
            dev,
        })
    }
}

impl Drop for RdmaSetup {
    fn drop(&mut self) {
        for qps in &self.qps {
            for &qp in qps {
                // SAFETY: created by `gs_qp_create`, destroyed once.
                unsafe { ffi::gs_qp_destroy(qp) };
            }
        }
        if !self.recv_mr.is_null() {
            // SAFETY: registered in `new`, deregistered once.
            unsafe { ffi::gs_dereg(self.recv_mr) };
        }
    }
}
