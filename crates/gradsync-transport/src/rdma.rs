//! RDMA backend: InfiniBand or RoCE verbs through libibverbs (feature `rdma`).
//!
//! # Connection
//!
//! [`RdmaSetup::new`] opens the device (`GRADSYNC_IB_HCA`, else the first port that is
//! active), creates one protection domain, one completion queue with its completion channel,
//! and [`RdmaOptions::qps_per_peer`] reliable-connected queue pairs to every peer, moved to INIT
//! with their receive buffers posted. Its [`RdmaSetup::info`] is what peers need: GID, LID,
//! path MTU and, for every peer, the queue pair numbers and first packet sequence numbers meant
//! for it. Ranks exchange these through the rendezvous store, then [`RdmaSetup::connect`] moves
//! every queue pair INIT -> RTR -> RTS. On RoCE the GID index is `GRADSYNC_IB_GID_INDEX`, or
//! the first RoCE v2 GID that maps an IPv4 address.
//!
//! # Data path
//!
//! - [`Endpoint::post_write`] becomes an RDMA WRITE (with an immediate: RDMA WRITE WITH IMM) of
//!   the gather list into the peer's registered region at `addr + offset`, the peer's adapter
//!   checking key and bounds. A write with an immediate consumes one of the peer's posted
//!   receives and completes there as [`Completion::WriteImm`], the notification that every byte
//!   landed. Writes and sends go round-robin over the queue pairs of a peer.
//! - [`Endpoint::post_send`] is a SEND into one of the peer's posted receive buffers.
//! - The engine above advertises free slots of its inbox to each sender (credits, the
//!   receiver's clear-to-send), so a write always has a place to land.
//! - Receive buffers are reposted as soon as their completion is polled; a sender that finds
//!   none waits in the adapter's receiver-not-ready retries, which are unlimited.
//!
//! # Memory registration
//!
//! Registrations with [`Access::PERSISTENT`] (the engine's inbox, header staging and scratch
//! pool: memory it owns for the communicator's life) are registered with the adapter and kept
//! in a pool: a registration inside a span already registered with at least the same rights
//! shares it (reference counted), and the bytes pinned are bounded by
//! [`RdmaOptions::reg_max_bytes`]. Any other region (a caller's buffer) is only recorded: its
//! data is copied into a registered staging ring when a write from it is posted. Pinning a
//! caller's buffer across operations would be wrong without hooks on the allocator: a buffer
//! freed and allocated again at the same address is new memory, and a registration made
//! before would still point the adapter at the old pages. A registration the kernel refuses
//! for `RLIMIT_MEMLOCK` gives an error that says so and how to raise the limit.
//!
//! # Errors
//!
//! A failed work completion names the peer and what the status means: a remote access error
//! is a key or bounds mismatch, retries exceeded means the peer or the link is unreachable,
//! receiver-not-ready retries exceeded means the peer stopped posting receives. A queue pair
//! transition that fails names the transition and every attribute it set.

mod ffi;

use crate::TransportError;
use crate::check_send_len;
use crate::regions::RegionTable;
use crate::{Access, Completion, Endpoint, MAX_SEND, MemoryRegion, RemoteRegion, Result, Sge};
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::fmt;
use std::time::{Duration, Instant};

/// Default queue pairs per peer (`GRADSYNC_IB_QPS_PER_CONN`).
pub const DEFAULT_QPS_PER_PEER: usize = 2;
/// Default local ACK timeout exponent (`GRADSYNC_IB_TIMEOUT`): 4.096 µs x 2^18, about 1 s.
pub const DEFAULT_IB_TIMEOUT: u8 = 18;
/// Default transport retry count (`GRADSYNC_IB_RETRY_CNT`).
pub const DEFAULT_RETRY_CNT: u8 = 7;
/// Default size of the staging ring that caller data is copied into before a write.
pub const DEFAULT_STAGING: usize = 32 << 20;
/// Default bound on the bytes registered with the adapter.
pub const DEFAULT_REG_MAX: usize = 4 << 30;

/// Send work requests a queue pair may have outstanding.
const SEND_DEPTH: u32 = 128;
/// Receive buffers posted per queue pair.
const RECV_DEPTH: usize = 64;
/// Gather entries of one work request.
const MAX_SGE: u32 = 4;
/// Immediate value of the internal message that says a peer closes.
const CTRL_BYE: u32 = 0x4259_4521;
/// First bytes of a connection descriptor.
const INFO_MAGIC: u32 = 0x4753_4942;
/// Tag of receive work request ids.
const RECV_TAG: u64 = 1 << 63;

const WC_SEND: u32 = 0;
const WC_RDMA_WRITE: u32 = 1;
const WC_RECV: u32 = 128;
const WC_RECV_RDMA_WITH_IMM: u32 = 129;

const WC_SUCCESS: u32 = 0;
const WC_LOC_PROT_ERR: u32 = 4;
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_REM_INV_REQ_ERR: u32 = 9;
const WC_REM_ACCESS_ERR: u32 = 10;
const WC_REM_OP_ERR: u32 = 11;
const WC_RETRY_EXC_ERR: u32 = 12;
const WC_RNR_RETRY_EXC_ERR: u32 = 13;

const LINK_LAYER_ETHERNET: u32 = 2;

/// Options of the RDMA backend.
#[derive(Clone, Debug)]
pub struct RdmaOptions {
    /// Device and optional port, `mlx5_0` or `mlx5_0:1` (`GRADSYNC_IB_HCA`); `None` picks the
    /// first active port.
    pub hca: Option<String>,
    /// GID index (`GRADSYNC_IB_GID_INDEX`); `None` picks one (RoCE v2 with an IPv4 address
    /// first).
    pub gid_index: Option<u32>,
    /// Queue pairs per peer (`GRADSYNC_IB_QPS_PER_CONN`, at least 1).
    pub qps_per_peer: usize,
    /// Local ACK timeout exponent (`GRADSYNC_IB_TIMEOUT`, 1..=31).
    pub ib_timeout: u8,
    /// Transport retries before a write fails (`GRADSYNC_IB_RETRY_CNT`, 0..=7).
    pub retry_cnt: u8,
    /// Bytes of the staging ring for data from unpinned memory.
    pub staging_bytes: usize,
    /// Bound on the bytes registered with the adapter.
    pub reg_max_bytes: usize,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            hca: None,
            gid_index: None,
            qps_per_peer: DEFAULT_QPS_PER_PEER,
            ib_timeout: DEFAULT_IB_TIMEOUT,
            retry_cnt: DEFAULT_RETRY_CNT,
            staging_bytes: DEFAULT_STAGING,
            reg_max_bytes: DEFAULT_REG_MAX,
        }
    }
}

/// One GID table entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's table.
    pub index: u32,
    /// The GID as an IPv6 address.
    pub gid: std::net::Ipv6Addr,
    /// `RoCE v2`, or `IB/RoCE v1`.
    pub kind: &'static str,
}

/// One port of one RDMA device, as `ibv_devinfo` shows it.
#[derive(Clone, Debug)]
pub struct PortInfo {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number (from 1).
    pub port: u32,
    /// Node GUID.
    pub node_guid: u64,
    /// Firmware version.
    pub fw_ver: String,
    /// `PORT_ACTIVE`, `PORT_DOWN`, ...
    pub state: &'static str,
    /// Active path MTU in bytes.
    pub active_mtu: u32,
    /// Largest path MTU in bytes.
    pub max_mtu: u32,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: &'static str,
    /// Local identifier (InfiniBand).
    pub lid: u32,
    /// Non-zero GIDs.
    pub gids: Vec<GidEntry>,
}

impl PortInfo {
    /// Whether the port is up.
    pub fn active(&self) -> bool {
        self.state == "PORT_ACTIVE"
    }
}

fn port_state(s: u32) -> &'static str {
    match s {
        1 => "PORT_DOWN",
        2 => "PORT_INIT",
        3 => "PORT_ARMED",
        4 => "PORT_ACTIVE",
        5 => "PORT_ACTIVE_DEFER",
        _ => "PORT_NOP",
    }
}

fn mtu_bytes(m: u32) -> u32 {
    if (1..=5).contains(&m) { 128 << m } else { 0 }
}

fn link_layer(l: u32) -> &'static str {
    match l {
        LINK_LAYER_ETHERNET => "Ethernet",
        1 => "InfiniBand",
        _ => "unspecified",
    }
}

fn cstr(b: &[c_char]) -> String {
    let bytes: Vec<u8> = b
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn errno_str(e: c_int) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

fn gid_kind(t: u32) -> &'static str {
    if t == 1 { "RoCE v2" } else { "IB/RoCE v1" }
}

/// Every port of every RDMA device on this machine, with its non-zero GIDs.
pub fn list_ports() -> std::result::Result<Vec<PortInfo>, String> {
    let mut raw = vec![ffi::GsPort::default(); 64];
    // SAFETY: `raw` has room for the 64 entries the call may write.
    let n = unsafe { ffi::gs_list_ports(raw.as_mut_ptr(), raw.len() as c_int) };
    if n < 0 {
        return Err(format!("ibv_get_device_list: {}", errno_str(-n)));
    }
    let mut table = vec![ffi::GsGid::default(); 1024];
    // SAFETY: `table` has room for the entries the call may write.
    let g = unsafe { ffi::gs_list_gids(table.as_mut_ptr(), table.len() as c_int) };
    table.truncate(g.max(0) as usize);
    let mut out = Vec::new();
    for p in &raw[..n as usize] {
        let device = cstr(&p.dev);
        let mut gids: Vec<GidEntry> = table
            .iter()
            .filter(|e| e.port == p.port && cstr(&e.dev) == device && e.gid != [0u8; 16])
            .map(|e| GidEntry {
                index: e.index,
                gid: std::net::Ipv6Addr::from(e.gid),
                kind: gid_kind(e.typ),
            })
            .collect();
        gids.sort_by_key(|g| g.index);
        out.push(PortInfo {
            device,
            port: p.port,
            node_guid: p.node_guid,
            fw_ver: cstr(&p.fw_ver),
            state: port_state(p.state),
            active_mtu: mtu_bytes(p.active_mtu),
            max_mtu: mtu_bytes(p.max_mtu),
            link_layer: link_layer(p.link_layer),
            lid: p.lid,
            gids,
        });
    }
    Ok(out)
}

/// Whether this machine has an RDMA port that is up (for the automatic transport choice).
pub fn active_port_present() -> bool {
    list_ports().is_ok_and(|v| v.iter().any(PortInfo::active))
}

/// The GID index RoCE traffic should use on a port: the first RoCE v2 GID holding an IPv4
/// address, else the first RoCE v2 GID, else the first GID.
pub fn pick_gid(gids: &[GidEntry]) -> Option<u32> {
    let v4 = |g: &GidEntry| g.gid.to_ipv4_mapped().is_some();
    gids.iter()
        .find(|g| g.kind == "RoCE v2" && v4(g))
        .or_else(|| gids.iter().find(|g| g.kind == "RoCE v2"))
        .or_else(|| gids.first())
        .map(|g| g.index)
}

/// Parses `GRADSYNC_IB_HCA`: `dev` or `dev:port`.
pub fn parse_hca(s: &str) -> std::result::Result<(String, Option<u32>), String> {
    let s = s.trim();
    let (dev, port) = match s.split_once(':') {
        Some((d, p)) => (
            d,
            Some(p.parse::<u32>().ok().filter(|&p| p >= 1).ok_or_else(|| {
                format!("GRADSYNC_IB_HCA={s:?}: port {p:?} is not a number from 1")
            })?),
        ),
        None => (s, None),
    };
    if dev.is_empty() {
        return Err(format!("GRADSYNC_IB_HCA={s:?}: no device name"));
    }
    Ok((dev.to_string(), port))
}

/// A 64-bit per-process random value (for packet sequence numbers).
fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: writes at most 8 bytes into `v`.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast::<c_void>(), 8, 0) };
    if n != 8 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        v = t ^ (u64::from(std::process::id()) << 32);
    }
    v
}

/// An open device: context, protection domain, completion channel and queue.
struct Device {
    raw: *mut ffi::GsDev,
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        // SAFETY: `raw` came from `gs_open` and everything created on it is gone by now
        // (queue pairs and registrations are dropped before the device).
        unsafe { ffi::gs_close(self.raw) };
    }
}

/// A registration with the adapter.
#[derive(Debug)]
struct Pinned {
    mr: *mut ffi::IbvMr,
    addr: usize,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: Access,
    refs: usize,
}

/// Memory allocated for the adapter (receive buffers, staging ring), page aligned.
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

impl Buffer {
    fn new(len: usize) -> std::result::Result<Buffer, String> {
        let len = len.max(4096).div_ceil(4096) * 4096;
        // SAFETY: an anonymous private mapping; checked for failure below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {len} bytes: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Buffer {
            ptr: p.cast::<u8>(),
            len,
        })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // SAFETY: the mapping made in `new`, unregistered before this drop.
        unsafe { libc::munmap(self.ptr.cast::<c_void>(), self.len) };
    }
}

/// What a queue pair's peer needs to know about this side.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Info {
    world: u32,
    qps: u32,
    gid: [u8; 16],
    lid: u32,
    mtu: u32,
    global: bool,
    /// `(qpn, psn)` of every queue pair to every rank (`world * qps`, zeros for itself).
    qp: Vec<(u32, u32)>,
}

impl Info {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(40 + self.qp.len() * 8);
        b.extend_from_slice(&INFO_MAGIC.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.qps.to_le_bytes());
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.extend_from_slice(&self.mtu.to_le_bytes());
        b.extend_from_slice(&u32::from(self.global).to_le_bytes());
        for (n, p) in &self.qp {
            b.extend_from_slice(&n.to_le_bytes());
            b.extend_from_slice(&p.to_le_bytes());
        }
        b
    }

    fn decode(b: &[u8]) -> Option<Info> {
        let u32_at = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        if u32_at(0)? != INFO_MAGIC {
            return None;
        }
        let world = u32_at(4)?;
        let qps = u32_at(8)?;
        let gid: [u8; 16] = b.get(12..28)?.try_into().ok()?;
        let n = (world as usize).checked_mul(qps as usize)?;
        if b.len() != n.checked_mul(8)?.checked_add(40)? {
            return None;
        }
        let mut qp = Vec::with_capacity(n);
        for i in 0..n {
            qp.push((u32_at(40 + 8 * i)?, u32_at(44 + 8 * i)?));
        }
        Some(Info {
            world,
            qps,
            gid,
            lid: u32_at(28)?,
            mtu: u32_at(32)?,
            global: u32_at(36)? != 0,
            qp,
        })
    }
}

fn setup_err(rank: usize, peer: usize, what: &'static str, msg: String) -> TransportError {
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
    info: Info,
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
            info: Info {
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

    fn post_recv(&self, qp: *mut ffi::IbvQp, idx: usize) -> std::result::Result<(), String> {
        post_recv(qp, idx, self.recv_buf.ptr, self.recv_lkey)
    }

    /// This rank's connection descriptor, to publish through the rendezvous store.
    pub fn info(&self) -> Vec<u8> {
        self.info.encode()
    }

    /// Device name and port in use.
    pub fn device(&self) -> String {
        format!("{}:{}", self.device, self.port.port)
    }

    /// Moves every queue pair to RTS against the peers' descriptors (`infos[rank]` is ignored).
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
            let i = Info::decode(b).ok_or_else(|| {
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
                let (dqpn, rpsn) = pi.qp[rank * q + i];
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
        RdmaEndpoint::new(self)
    }
}

fn post_recv(
    qp: *mut ffi::IbvQp,
    idx: usize,
    base: *mut u8,
    lkey: u32,
) -> std::result::Result<(), String> {
    let addr = base as u64 + (idx * MAX_SEND) as u64;
    // SAFETY: the buffer slot `idx` lies inside the registered receive buffer.
    let rc = unsafe { ffi::gs_post_recv(qp, RECV_TAG | idx as u64, addr, MAX_SEND as u32, lkey) };
    if rc != 0 {
        return Err(format!("ibv_post_recv: {}", errno_str(rc)));
    }
    Ok(())
}

fn memlock_msg(len: usize, e: c_int) -> String {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a plain struct the call fills.
    unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    let show = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            "unlimited".to_string()
        } else {
            format!("{} KiB", v / 1024)
        }
    };
    if e == libc::ENOMEM || e == libc::EPERM {
        format!(
            "ibv_reg_mr of {len} bytes refused ({}): the locked-memory limit RLIMIT_MEMLOCK is {} (hard {}); raise it with `ulimit -l unlimited` in the launching shell, `LimitMEMLOCK=infinity` for a systemd service, a `memlock` line in /etc/security/limits.conf, or `--ulimit memlock=-1` for a container",
            errno_str(e),
            show(lim.rlim_cur),
            show(lim.rlim_max)
        )
    } else {
        format!("ibv_reg_mr of {len} bytes: {}", errno_str(e))
    }
}

/// A queue pair to one peer, with its outstanding send work requests.
struct Qp {
    raw: *mut ffi::IbvQp,
    outstanding: u32,
}

struct Peer {
    qps: Vec<Qp>,
    next: usize,
    /// Why the connection is unusable, once it is.
    broken: Option<String>,
    /// Queue pairs on which the peer said goodbye.
    byes: usize,
    /// Posts waiting for room (staging or send queue), in order.
    pending: VecDeque<Pending>,
}

enum Pending {
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
struct Wr {
    peer: usize,
    qp: usize,
    /// Staging span to free on completion.
    staged: Option<u64>,
    /// The caller's id, reported on completion (writes straight from registered memory).
    user: Option<u64>,
    write: bool,
    rkey: u32,
    offset: u64,
    len: u64,
    /// Length of the target region as the peer advertised it.
    region_len: u64,
}

/// A ring of registered memory that data from unregistered memory is copied into.
struct Staging {
    buf: Buffer,
    mr: *mut ffi::IbvMr,
    lkey: u32,
    /// Allocations in order: `(offset, len, freed)`.
    live: VecDeque<(usize, usize, bool)>,
    /// Sequence number of `live[0]`.
    first: u64,
    head: usize,
}

impl Staging {
    /// Room for `len` bytes: `(sequence number, offset)`.
    fn alloc(&mut self, len: usize) -> Option<(u64, usize)> {
        let cap = self.buf.len;
        let len = len.max(1).div_ceil(64) * 64;
        if len > cap {
            return None;
        }
        let off = if self.live.is_empty() {
            self.head = 0;
            0
        } else {
            let tail = self.live[0].0;
            // Not wrapped while the newest allocation lies at or after the oldest.
            let newest = self.live.back().map_or(0, |e| e.0);
            if newest >= tail {
                if cap - self.head >= len {
                    self.head
                } else if tail >= len {
                    0
                } else {
                    return None;
                }
            } else if tail - self.head >= len {
                self.head
            } else {
                return None;
            }
        };
        self.head = off + len;
        let seq = self.first + self.live.len() as u64;
        self.live.push_back((off, len, false));
        Some((seq, off))
    }

    fn free(&mut self, seq: u64) {
        if let Some(e) = seq
            .checked_sub(self.first)
            .and_then(|i| self.live.get_mut(i as usize))
        {
            e.2 = true;
        }
        while self.live.front().is_some_and(|e| e.2) {
            self.live.pop_front();
            self.first += 1;
        }
    }
}

/// A rank's queue pairs to all peers, its completion queue and its registrations.
pub struct RdmaEndpoint {
    rank: usize,
    world: usize,
    device: String,
    opts: RdmaOptions,
    peers: Vec<Peer>,
    by_qpn: HashMap<u32, (usize, usize)>,
    regions: RegionTable,
    pinned: Vec<Pinned>,
    pinned_bytes: usize,
    staging: Staging,
    wrs: HashMap<u64, Wr>,
    next_wr: u64,
    ready: VecDeque<Completion>,
    stash: Vec<ffi::GsWc>,
    recv_buf: Buffer,
    recv_mr: *mut ffi::IbvMr,
    recv_lkey: u32,
    armed: bool,
    /// Errors found while polling, reported by the next poll.
    errors: VecDeque<TransportError>,
    dev: Device,
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
    fn new(mut s: RdmaSetup) -> Result<RdmaEndpoint> {
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

    fn peer_check(&self, peer: usize, op: &'static str) -> Result<()> {
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
        Ok(())
    }

    /// The registered span holding `s`, if its key is an adapter key.
    fn pinned_for(&self, s: &Sge) -> bool {
        self.pinned.iter().any(|p| {
            p.lkey == s.lkey
                && s.addr >= p.addr
                && s.addr
                    .checked_add(s.len)
                    .is_some_and(|e| e <= p.addr + p.len)
        })
    }

    /// Posts as much of every peer's pending queue as there is room for.
    fn flush_pending(&mut self) {
        for peer in 0..self.peers.len() {
            while let Some(item) = self.peers[peer].pending.pop_front() {
                if self.peers[peer].broken.is_some() {
                    // The operation that queued it has failed; its buffers may be gone.
                    self.peers[peer].pending.clear();
                    break;
                }
                match self.try_post(peer, &item) {
                    Ok(true) => {}
                    Ok(false) => {
                        self.peers[peer].pending.push_front(item);
                        break;
                    }
                    Err(e) => {
                        self.peers[peer].broken = Some(e.to_string());
                        self.peers[peer].pending.clear();
                        self.errors.push_back(e);
                        break;
                    }
                }
            }
        }
    }

    /// A queue pair of `peer` with room, round-robin.
    fn pick_qp(&mut self, peer: usize) -> Option<usize> {
        let p = &mut self.peers[peer];
        let n = p.qps.len();
        let i = (0..n)
            .map(|k| (p.next + k) % n)
            .find(|&i| p.qps[i].outstanding < SEND_DEPTH)?;
        p.next = (i + 1) % n;
        Some(i)
    }

    /// Posts a queued `item` now; `false` when there is no room.
    fn try_post(&mut self, peer: usize, item: &Pending) -> Result<bool> {
        match item {
            Pending::Write {
                sges,
                remote,
                offset,
                imm,
                wr_id,
            } => self.try_write(peer, sges, *remote, *offset, *imm, *wr_id),
            Pending::Send { data, wr_id, ctrl } => self.try_send(peer, data, *wr_id, *ctrl),
        }
    }

    /// Posts a write now, straight from registered memory or through the staging ring;
    /// `false` when there is no room (queue pair or staging).
    fn try_write(
        &mut self,
        peer: usize,
        sges: &[Sge],
        remote: RemoteRegion,
        offset: u64,
        imm: Option<u32>,
        wr_id: u64,
    ) -> Result<bool> {
        let Some(qi) = self.pick_qp(peer) else {
            return Ok(false);
        };
        let total: usize = sges.iter().map(|s| s.len).sum();
        let direct = sges.len() <= MAX_SGE as usize && sges.iter().all(|s| self.pinned_for(s));
        let mut addrs = [0u64; MAX_SGE as usize];
        let mut lens = [0u32; MAX_SGE as usize];
        let mut keys = [0u32; MAX_SGE as usize];
        let (n, staged) = if direct {
            for (i, s) in sges.iter().enumerate() {
                (addrs[i], lens[i], keys[i]) = (s.addr as u64, s.len as u32, s.lkey);
            }
            (sges.len(), None)
        } else {
            let Some((seq, off)) = self.staging.alloc(total) else {
                return Ok(false);
            };
            let mut at = off;
            for s in sges {
                // SAFETY: the caller keeps every span valid until WriteDone, which is reported
                // only after this copy; the staging span is ours until the adapter completes
                // the write.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.addr as *const u8,
                        self.staging.buf.ptr.add(at),
                        s.len,
                    );
                }
                at += s.len;
            }
            addrs[0] = self.staging.buf.ptr as u64 + off as u64;
            lens[0] = total as u32;
            keys[0] = self.staging.lkey;
            (1, Some(seq))
        };
        let id = self.next_wr;
        // SAFETY: every span is registered (an adapter registration or the staging ring) and
        // stays valid until the completion of work request `id`.
        let rc = unsafe {
            ffi::gs_post_write(
                self.peers[peer].qps[qi].raw,
                id,
                addrs.as_ptr(),
                lens.as_ptr(),
                keys.as_ptr(),
                if total == 0 { 0 } else { n as u32 },
                remote.addr.wrapping_add(offset),
                remote.rkey,
                u32::from(imm.is_some()),
                imm.unwrap_or(0),
            )
        };
        if rc != 0 {
            if let Some(seq) = staged {
                self.staging.free(seq);
            }
            return Err(setup_err(
                self.rank,
                peer,
                "post_write",
                format!(
                    "ibv_post_send (RDMA WRITE of {total} bytes): {}",
                    errno_str(rc)
                ),
            ));
        }
        self.posted(
            id,
            Wr {
                peer,
                qp: qi,
                staged,
                user: direct.then_some(wr_id),
                write: true,
                rkey: remote.rkey,
                offset,
                len: total as u64,
                region_len: remote.len,
            },
        );
        if !direct {
            self.ready.push_back(Completion::WriteDone { wr_id });
        }
        Ok(true)
    }

    /// Posts a send (with `ctrl`, an internal message carrying it as immediate) through the
    /// staging ring; `false` when there is no room.
    fn try_send(
        &mut self,
        peer: usize,
        data: &[u8],
        wr_id: u64,
        ctrl: Option<u32>,
    ) -> Result<bool> {
        let Some(qi) = self.pick_qp(peer) else {
            return Ok(false);
        };
        let Some((seq, off)) = self.staging.alloc(data.len()) else {
            return Ok(false);
        };
        // SAFETY: the staging span is ours until the send completes.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.staging.buf.ptr.add(off), data.len());
        }
        let id = self.next_wr;
        // SAFETY: the span lies in the registered staging ring.
        let rc = unsafe {
            ffi::gs_post_send(
                self.peers[peer].qps[qi].raw,
                id,
                self.staging.buf.ptr as u64 + off as u64,
                data.len() as u32,
                self.staging.lkey,
                u32::from(ctrl.is_some()),
                ctrl.unwrap_or(0),
            )
        };
        if rc != 0 {
            self.staging.free(seq);
            return Err(setup_err(
                self.rank,
                peer,
                "post_send",
                format!(
                    "ibv_post_send (SEND of {} bytes): {}",
                    data.len(),
                    errno_str(rc)
                ),
            ));
        }
        self.posted(
            id,
            Wr {
                peer,
                qp: qi,
                staged: Some(seq),
                user: None,
                write: false,
                rkey: 0,
                offset: 0,
                len: data.len() as u64,
                region_len: 0,
            },
        );
        if ctrl.is_none() {
            self.ready.push_back(Completion::SendDone { wr_id });
        }
        Ok(true)
    }

    /// Books work request `id`, just posted.
    fn posted(&mut self, id: u64, w: Wr) {
        self.next_wr += 1;
        self.peers[w.peer].qps[w.qp].outstanding += 1;
        self.wrs.insert(id, w);
    }

    /// A send now, or queued (copied) behind what waits for room.
    fn send_or_queue(
        &mut self,
        peer: usize,
        data: &[u8],
        wr_id: u64,
        ctrl: Option<u32>,
    ) -> Result<()> {
        if self.peers[peer].pending.is_empty() && self.try_send(peer, data, wr_id, ctrl)? {
            return Ok(());
        }
        self.peers[peer].pending.push_back(Pending::Send {
            data: data.to_vec(),
            wr_id,
            ctrl,
        });
        Ok(())
    }

    /// The error a failed work completion means.
    fn wc_error(&self, wc: &ffi::GsWc, w: Option<Wr>, peer: usize) -> TransportError {
        // SAFETY: returns a static string for any status value.
        let status = unsafe { CStr::from_ptr(ffi::gs_wc_status_str(wc.status)) }
            .to_string_lossy()
            .into_owned();
        let what = match w {
            Some(w) if w.write => format!(
                "RDMA WRITE of {} bytes at offset {} into region 0x{:08x}",
                w.len, w.offset, w.rkey
            ),
            Some(w) => format!("SEND of {} bytes", w.len),
            None => "receive".to_string(),
        };
        let hint = match wc.status {
            WC_REM_ACCESS_ERR => {
                if let Some(w) = w.filter(|w| w.write) {
                    return TransportError::RemoteAccess {
                        rank: self.rank,
                        peer,
                        rkey: w.rkey,
                        offset: w.offset,
                        len: w.len,
                        region_len: w.region_len,
                        why: "the peer's adapter refused the remote key or the bounds (remote access error: the key is unknown, deregistered, lacks remote write, or the span is past the region's end)",
                    };
                }
                "remote access error: a key or bounds mismatch"
            }
            WC_RETRY_EXC_ERR => {
                "transport retries exceeded: the peer or the link is unreachable (peer process gone, port down, or wrong GID/LID/MTU)"
            }
            WC_RNR_RETRY_EXC_ERR => {
                "receiver-not-ready retries exceeded: the peer stopped posting receives"
            }
            WC_REM_INV_REQ_ERR => {
                "the peer's adapter found the request invalid (length past its receive buffer, or an operation its queue pair does not allow)"
            }
            WC_REM_OP_ERR => "the peer's adapter could not complete the operation",
            WC_LOC_PROT_ERR => {
                "local protection error: a gather entry is outside the registration its key names"
            }
            WC_WR_FLUSH_ERR => {
                "work request flushed: the queue pair is in the error state after an earlier failure"
            }
            _ => "work request failed",
        };
        TransportError::Rdma {
            rank: self.rank,
            peer,
            what: "completion",
            msg: format!(
                "{what} on queue pair {}: {status} (status {}, vendor error 0x{:x}): {hint}",
                wc.qp_num, wc.status, wc.vendor_err
            ),
        }
    }

    fn handle(&mut self, wc: ffi::GsWc, out: &mut Vec<Completion>) {
        let Some(&(peer, qi)) = self.by_qpn.get(&wc.qp_num) else {
            return;
        };
        if wc.wr_id & RECV_TAG != 0 {
            let idx = (wc.wr_id & !RECV_TAG) as usize;
            if wc.status != WC_SUCCESS {
                if self.peers[peer].broken.is_none() {
                    let e = self.wc_error(&wc, None, peer);
                    let why = match &e {
                        TransportError::Rdma { msg, .. } => msg.clone(),
                        other => other.to_string(),
                    };
                    self.peers[peer].broken = Some(why);
                    self.peers[peer].pending.clear();
                    if wc.status != WC_WR_FLUSH_ERR || self.peers[peer].byes == 0 {
                        self.errors.push_back(TransportError::PeerClosed {
                            rank: self.rank,
                            peer,
                            during: format!("receiving: {e}"),
                        });
                    }
                }
                return;
            }
            let len = (wc.byte_len as usize).min(MAX_SEND);
            match wc.opcode {
                WC_RECV_RDMA_WITH_IMM => out.push(Completion::WriteImm {
                    peer,
                    imm: wc.imm,
                    len: wc.byte_len,
                }),
                WC_RECV if wc.with_imm != 0 && wc.imm == CTRL_BYE => {
                    self.peers[peer].byes += 1;
                }
                WC_RECV => {
                    // SAFETY: buffer slot `idx` holds the `len` bytes the adapter wrote.
                    let data = unsafe {
                        std::slice::from_raw_parts(self.recv_buf.ptr.add(idx * MAX_SEND), len)
                    }
                    .to_vec();
                    out.push(Completion::Recv { peer, data });
                }
                _ => {}
            }
            if self.peers[peer].broken.is_none() {
                let qp = self.peers[peer].qps[qi].raw;
                if let Err(m) = post_recv(qp, idx, self.recv_buf.ptr, self.recv_lkey) {
                    self.errors
                        .push_back(setup_err(self.rank, peer, "post receive", m));
                }
            }
            return;
        }
        let w = self.wrs.remove(&wc.wr_id);
        if let Some(w) = w {
            let q = &mut self.peers[w.peer].qps[w.qp];
            q.outstanding = q.outstanding.saturating_sub(1);
            if let Some(seq) = w.staged {
                self.staging.free(seq);
            }
        }
        if wc.status != WC_SUCCESS {
            let e = self.wc_error(&wc, w, peer);
            let first = self.peers[peer].broken.is_none();
            if first {
                self.peers[peer].broken = Some(e.to_string());
            }
            if first || wc.status != WC_WR_FLUSH_ERR {
                self.errors.push_back(e);
            }
            return;
        }
        if let Some(w) = w
            && let Some(user) = w.user
        {
            debug_assert!(matches!(wc.opcode, WC_RDMA_WRITE | WC_SEND));
            out.push(Completion::WriteDone { wr_id: user });
        }
    }

    fn drain_cq(&mut self, out: &mut Vec<Completion>) {
        let stash = std::mem::take(&mut self.stash);
        for wc in stash {
            self.handle(wc, out);
        }
        let mut wcs = [ffi::GsWc::default(); 32];
        loop {
            // SAFETY: `wcs` has room for 32 completions.
            let n = unsafe { ffi::gs_poll(self.dev.raw, wcs.as_mut_ptr(), 32) };
            if n < 0 {
                self.errors.push_back(setup_err(
                    self.rank,
                    usize::MAX,
                    "completion queue",
                    format!("ibv_poll_cq failed ({n})"),
                ));
                break;
            }
            if n == 0 {
                break;
            }
            for wc in &wcs[..n as usize] {
                self.handle(*wc, out);
            }
            if n < 32 {
                break;
            }
        }
    }

    fn has_outstanding(&self) -> bool {
        self.peers.iter().any(|p| {
            p.broken.is_none() && (!p.pending.is_empty() || p.qps.iter().any(|q| q.outstanding > 0))
        })
    }
}

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

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        if !access.contains(Access::PERSISTENT) {
            // Only recorded: data from here is staged (see the module documentation). Keys
            // never collide with an adapter key in the pool.
            loop {
                let k = self.regions.fresh_key();
                if !self.pinned.iter().any(|p| p.lkey == k || p.rkey == k) {
                    return Ok(self.regions.insert(k, addr as usize, len, access));
                }
            }
        }
        let a = addr as usize;
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

    fn peer_alive(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|p| p.broken.is_none() && (p.qps.is_empty() || p.byes < p.qps.len()))
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
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
        let mut pfd = libc::pollfd {
            // SAFETY: the device is open.
            fd: unsafe { ffi::gs_channel_fd(self.dev.raw) },
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r > 0 {
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
            if self.peers[peer].broken.is_some() {
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
                    .all(|p| p.broken.is_some() || p.qps.is_empty() || p.byes >= p.qps.len());
            if done {
                break;
            }
            let _ = self.wait(Duration::from_millis(5));
        }
    }
}

impl Drop for RdmaEndpoint {
    fn drop(&mut self) {
        for p in &self.peers {
            for q in &p.qps {
                // SAFETY: created by `gs_qp_create`, destroyed once.
                unsafe { ffi::gs_qp_destroy(q.raw) };
            }
        }
        for p in self.pinned.drain(..) {
            // SAFETY: registered by `gs_reg`, deregistered once.
            unsafe { ffi::gs_dereg(p.mr) };
        }
        // SAFETY: as above.
        unsafe {
            ffi::gs_dereg(self.staging.mr);
            ffi::gs_dereg(self.recv_mr);
        }
        // The buffers unmap and the device closes (in field order) after this.
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

#[cfg(test)]
mod tests;
