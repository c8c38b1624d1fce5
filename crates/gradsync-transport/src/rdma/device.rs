//! RDMA devices and ports: listing them with their GIDs, choosing a port and a GID, and the
//! small owners of verbs resources (an open [`Device`], a page-aligned [`Buffer`]); receive
//! posting and the registration error that names `RLIMIT_MEMLOCK`.

use super::ffi;
use crate::verbs::MAX_SEND;
use std::ffi::{c_char, c_int, c_void};

/// Link layer code of Ethernet (RoCE).
pub(super) const LINK_LAYER_ETHERNET: u32 = 2;
/// Tag of receive work request ids.
pub(super) const RECV_TAG: u64 = 1 << 63;

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

/// Bytes of a path MTU code (0 for an invalid one).
pub(super) fn mtu_bytes(m: u32) -> u32 {
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

/// The text of an errno value.
pub(super) fn errno_str(e: c_int) -> String {
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
pub(super) fn random_u64() -> u64 {
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
pub(super) struct Device {
    pub(super) raw: *mut ffi::GsDev,
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

/// Memory allocated for the adapter (receive buffers, staging ring), page aligned.
pub(super) struct Buffer {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

impl Buffer {
    pub(super) fn new(len: usize) -> std::result::Result<Buffer, String> {
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

/// Posts receive buffer slot `idx` (of the registered buffer at `base`) on `qp`.
pub(super) fn post_recv(
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

/// The message of a refused registration of `len` bytes: for `ENOMEM`/`EPERM`, the
/// `RLIMIT_MEMLOCK` limits and how to raise them.
pub(super) fn memlock_msg(len: usize, e: c_int) -> String {
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
