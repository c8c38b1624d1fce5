//! TCP backend: verbs over sockets.
//!
//! Each pair of ranks is joined by `nsocks` TCP streams (`GRADSYNC_NSOCKS`). Every frame starts
//! with a 24-byte header:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 1 | kind: 1 write, 2 write with immediate, 3 send |
//! | 1 | 3 | reserved (0) |
//! | 4 | 4 | immediate value |
//! | 8 | 4 | remote key (writes) |
//! | 12 | 4 | payload length |
//! | 16 | 8 | offset in the remote region (writes) |
//!
//! A write's payload is read straight into the destination region after the key and bounds
//! are checked: the first bytes that came with the header through the receive buffer are
//! copied, the rest is read from the socket directly into place. Sends go out with one
//! `sendmsg` over the header and the gather list. All sockets are non-blocking and driven by
//! [`Endpoint::poll`] from the caller's thread; [`Endpoint::wait`] sleeps in `poll(2)`.
//! Frames of one write travel on one stream; consecutive writes go round-robin over the streams,
//! so their completions may arrive out of order (the engine orders them by its slot counters).
//!
//! # Authentication
//!
//! The dialing rank opens each stream with a 24-byte hello (magic `"GSTH"`, version,
//! communicator id, its rank, stream index, streams per peer); a hello that is malformed,
//! names another communicator or a slot already taken drops that connection. With a job token
//! ([`TcpOptions::token`]) the hello is followed by a mutual HMAC-SHA256 challenge-response,
//! so the token never crosses the wire:
//!
//! ```text
//! acceptor                                   dialer
//!                               <- hello
//!   Na (32 random bytes)        ->
//!                               <- Nd (32 random bytes), HMAC(token, "gradsync-data/dialer" || id || Na || Nd)
//!   HMAC(token, "gradsync-data/acceptor" || id || Na || Nd) ->
//! ```
//!
//! where `id` is the communicator id, dialer rank, acceptor rank and stream index (each a
//! little-endian u64). Fresh nonces on both sides make each proof single-use (no replay), the
//! two labels keep a proof from being reflected, and binding the communicator, both ranks and
//! the stream keeps a proof for one stream from opening another. Proofs are compared in
//! constant time. On the accepting side every read and write of the hello and handshake has a
//! timeout of at most 5 s and never past the setup deadline, all message sizes are fixed, and
//! a connection that fails is dropped with a warning while setup goes on, so the real peer can
//! still connect: a stranger (a port scanner, another job, a sender of garbage) neither stalls
//! setup past its deadline nor makes the rank allocate. The dialing side fails setup at once
//! with an error naming the peer and its address, since retrying with the same token cannot
//! help. Authentication covers who may connect; the data that follows is not encrypted.

use crate::regions::RegionTable;
use crate::{
    Access, Completion, Endpoint, MAX_SEND, MemoryRegion, RemoteRegion, Result, Sge,
    TransportError, check_send_len,
};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const FRAME_HDR: usize = 24;
const KIND_WRITE: u8 = 1;
const KIND_WRITE_IMM: u8 = 2;
const KIND_SEND: u8 = 3;
const HELLO_MAGIC: u32 = 0x4753_5448; // "GSTH"
const HELLO_LEN: usize = 24;
const RXBUF: usize = 64 * 1024;
/// Bytes read from one stream per poll before moving on to the others.
const RX_BUDGET: usize = 8 << 20;
/// Payload bytes left to read below which the receive buffer is used instead of reading
/// straight into the region.
const DIRECT_MIN: usize = 16 * 1024;

/// Options of the TCP backend. The `Debug` form does not show the token.
#[derive(Clone)]
pub struct TcpOptions {
    /// Streams per peer (at least 1).
    pub nsocks: usize,
    /// Socket send and receive buffer size in bytes; 0 keeps the kernel's auto-tuning.
    pub sock_buf: usize,
    /// Deadline for connection setup.
    pub timeout: Duration,
    /// The job token: with one, every stream is authenticated by the challenge-response
    /// described in the [module documentation](self#authentication) (all ranks must use the
    /// same token); without one, streams are not authenticated.
    pub token: Option<Vec<u8>>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            nsocks: 2,
            sock_buf: 0,
            timeout: Duration::from_secs(60),
            token: None,
        }
    }
}

impl std::fmt::Debug for TcpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpOptions")
            .field("nsocks", &self.nsocks)
            .field("sock_buf", &self.sock_buf)
            .field("timeout", &self.timeout)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Returns the first IPv4 (else IPv6) address of the network interface `name`.
///
/// An interface that does not exist, or has no address, is an error listing the interfaces
/// that do exist.
pub fn interface_addr(name: &str) -> io::Result<IpAddr> {
    let all = interfaces()?;
    let mut found = all
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, a)| *a)
        .collect::<Vec<_>>();
    found.sort_by_key(|a| a.is_ipv6());
    found.first().copied().ok_or_else(|| {
        let mut names: Vec<_> = all.iter().map(|(n, _)| n.as_str()).collect();
        names.dedup();
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "network interface {name:?} not found or has no IP address (interfaces: {})",
                names.join(", ")
            ),
        )
    })
}

/// Lists (interface name, address) pairs of this host.
pub fn interfaces() -> io::Result<Vec<(String, IpAddr)>> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into ifap; it is freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: p is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose family says its type.
        let fam = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        if fam == libc::AF_INET {
            // SAFETY: the family is AF_INET, so the sockaddr is a sockaddr_in.
            let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            out.push((
                name,
                IpAddr::from(u32::from_be(sa.sin_addr.s_addr).to_be_bytes()),
            ));
        } else if fam == libc::AF_INET6 {
            // SAFETY: the family is AF_INET6, so the sockaddr is a sockaddr_in6.
            let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
            out.push((name, IpAddr::from(sa.sin6_addr.s6_addr)));
        }
    }
    // SAFETY: ifap came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    Ok(out)
}

/// Binds a listener for incoming peer connections on `ip` (port chosen by the kernel).
pub fn listen(ip: IpAddr) -> io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, 0))
}

#[derive(Debug)]
enum Rx {
    Header,
    Write {
        dst: usize,
        remaining: usize,
        imm: Option<u32>,
        total: u32,
    },
    Send {
        data: Vec<u8>,
        need: usize,
    },
}

#[derive(Debug)]
struct TxItem {
    hdr: [u8; FRAME_HDR],
    sges: Vec<(usize, usize)>,
    /// Keeps the payload of a two-sided send alive while `sges` points into it.
    _owned: Vec<u8>,
    wr_id: u64,
    is_send: bool,
}

impl TxItem {
    fn total(&self) -> usize {
        FRAME_HDR + self.sges.iter().map(|s| s.1).sum::<usize>()
    }
}

#[derive(Debug)]
struct Stream {
    sock: TcpStream,
    fd: RawFd,
    rx: Rx,
    rxbuf: Box<[u8]>,
    lo: usize,
    hi: usize,
    txq: VecDeque<TxItem>,
    tx_off: usize,
    /// End of stream read: nothing more will arrive on this stream.
    eof: bool,
    /// Sending failed (the peer is gone); what it still sent may be read until `eof`.
    tx_failed: bool,
    /// The last frame was large: read the next header alone, so that a large payload after it
    /// is read straight into place rather than through the receive buffer.
    header_only: bool,
}

#[derive(Debug)]
struct Peer {
    streams: Vec<Stream>,
    next_tx: usize,
    broken: Option<String>,
}

/// A rank's TCP connections to all peers.
#[derive(Debug)]
pub struct TcpEndpoint {
    rank: usize,
    world: usize,
    peers: Vec<Option<Peer>>,
    regions: RegionTable,
    pollfds: Vec<libc::pollfd>,
    done: Vec<Completion>,
}

fn hello(comm_id: u64, rank: usize, stream: usize, nsocks: usize) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&1u16.to_le_bytes());
    b[8..16].copy_from_slice(&comm_id.to_le_bytes());
    b[16..20].copy_from_slice(&(rank as u32).to_le_bytes());
    b[20..22].copy_from_slice(&(stream as u16).to_le_bytes());
    b[22..24].copy_from_slice(&(nsocks as u16).to_le_bytes());
    b
}

/// A parsed hello, the first 24 bytes a dialing rank sends on each stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) magic: u32,
    pub(crate) version: u16,
    pub(crate) comm_id: u64,
    pub(crate) rank: usize,
    pub(crate) stream: usize,
    pub(crate) nsocks: usize,
}

/// Parses a hello (any 24 bytes parse; the caller checks the fields).
pub(crate) fn parse_hello(b: &[u8; HELLO_LEN]) -> Hello {
    Hello {
        magic: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        version: u16::from_le_bytes([b[4], b[5]]),
        comm_id: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        rank: u32::from_le_bytes([b[16], b[17], b[18], b[19]]) as usize,
        stream: u16::from_le_bytes([b[20], b[21]]) as usize,
        nsocks: u16::from_le_bytes([b[22], b[23]]) as usize,
    }
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub(crate) kind: u8,
    pub(crate) imm: u32,
    pub(crate) rkey: u32,
    pub(crate) len: u32,
    pub(crate) off: u64,
}

/// Parses a frame header; the reserved bytes must be zero (the kind is checked by the caller).
pub(crate) fn parse_frame_header(h: &[u8]) -> std::result::Result<FrameHeader, String> {
    let Some(h) = h.get(..FRAME_HDR) else {
        return Err(format!(
            "frame header of {} bytes, need {FRAME_HDR}",
            h.len()
        ));
    };
    if h[1..4] != [0, 0, 0] {
        return Err(format!("reserved bytes set in frame header {h:02x?}"));
    }
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let mut off = [0u8; 8];
    off.copy_from_slice(&h[16..24]);
    Ok(FrameHeader {
        kind: h[0],
        imm: u32_at(4),
        rkey: u32_at(8),
        len: u32_at(12),
        off: u64::from_le_bytes(off),
    })
}

/// Length of a data-connection handshake nonce and proof.
const AUTH_LEN: usize = 32;
/// Label of the dialing side's proof.
const DIALER_LABEL: &[u8] = b"gradsync-data/dialer";
/// Label of the accepting side's proof (another label, so that no proof can be reflected).
const ACCEPTOR_LABEL: &[u8] = b"gradsync-data/acceptor";

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The identity of one data stream that both proofs cover.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamId {
    pub(crate) comm_id: u64,
    pub(crate) dialer: usize,
    pub(crate) acceptor: usize,
    pub(crate) stream: usize,
}

/// `HMAC(token, label || comm_id || dialer || acceptor || stream || nonce_a || nonce_d)`,
/// integers as little-endian u64.
fn stream_mac(
    token: &[u8],
    label: &[u8],
    id: StreamId,
    nonce_a: &[u8; AUTH_LEN],
    nonce_d: &[u8; AUTH_LEN],
) -> HmacSha256 {
    use hmac::Mac;
    let mut mac = HmacSha256::new_from_slice(token).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(&id.comm_id.to_le_bytes());
    mac.update(&(id.dialer as u64).to_le_bytes());
    mac.update(&(id.acceptor as u64).to_le_bytes());
    mac.update(&(id.stream as u64).to_le_bytes());
    mac.update(nonce_a);
    mac.update(nonce_d);
    mac
}

/// A proof of one side (`dialer` true: the dialing side's).
pub(crate) fn stream_proof(
    token: &[u8],
    dialer: bool,
    id: StreamId,
    nonce_a: &[u8; AUTH_LEN],
    nonce_d: &[u8; AUTH_LEN],
) -> [u8; AUTH_LEN] {
    use hmac::Mac;
    let label = if dialer { DIALER_LABEL } else { ACCEPTOR_LABEL };
    stream_mac(token, label, id, nonce_a, nonce_d)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a proof of one side in constant time; `proof` is peer bytes of any length.
pub(crate) fn verify_stream_proof(
    token: &[u8],
    dialer: bool,
    id: StreamId,
    nonce_a: &[u8; AUTH_LEN],
    nonce_d: &[u8; AUTH_LEN],
    proof: &[u8],
) -> bool {
    use hmac::Mac;
    let label = if dialer { DIALER_LABEL } else { ACCEPTOR_LABEL };
    stream_mac(token, label, id, nonce_a, nonce_d)
        .verify_slice(proof)
        .is_ok()
}

fn random_nonce() -> io::Result<[u8; AUTH_LEN]> {
    let mut nonce = [0u8; AUTH_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut nonce)?;
    Ok(nonce)
}

/// The accepting side of the handshake, after a valid hello; the socket's read timeout is
/// already set. Returns why it failed.
fn accept_auth(sock: &TcpStream, token: &[u8], id: StreamId) -> std::result::Result<(), String> {
    let nonce_a = random_nonce().map_err(|e| format!("no random nonce: {e}"))?;
    let mut s = sock;
    s.write_all(&nonce_a)
        .map_err(|e| format!("sending the challenge: {e}"))?;
    let mut answer = [0u8; 2 * AUTH_LEN];
    s.read_exact(&mut answer)
        .map_err(|e| format!("no answer to the challenge: {e}"))?;
    let (nonce_d, proof) = answer.split_at(AUTH_LEN);
    let nonce_d: [u8; AUTH_LEN] = nonce_d.try_into().expect("AUTH_LEN bytes");
    if !verify_stream_proof(token, true, id, &nonce_a, &nonce_d, proof) {
        return Err("wrong proof (another token, or none)".into());
    }
    s.write_all(&stream_proof(token, false, id, &nonce_a, &nonce_d))
        .map_err(|e| format!("sending the proof: {e}"))
}

/// The dialing side of the handshake, after its hello, with reads bounded by `deadline`.
fn dial_auth(
    sock: &TcpStream,
    token: &[u8],
    id: StreamId,
    deadline: Instant,
) -> std::result::Result<(), String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    sock.set_read_timeout(Some(left))
        .map_err(|e| format!("setsockopt: {e}"))?;
    let mut s = sock;
    let mut nonce_a = [0u8; AUTH_LEN];
    s.read_exact(&mut nonce_a)
        .map_err(|e| format!("no challenge ({e}); does the peer run without GRADSYNC_TOKEN?"))?;
    let nonce_d = random_nonce().map_err(|e| format!("no random nonce: {e}"))?;
    let mut answer = [0u8; 2 * AUTH_LEN];
    answer[..AUTH_LEN].copy_from_slice(&nonce_d);
    answer[AUTH_LEN..].copy_from_slice(&stream_proof(token, true, id, &nonce_a, &nonce_d));
    s.write_all(&answer)
        .map_err(|e| format!("sending the answer: {e}"))?;
    let mut proof = [0u8; AUTH_LEN];
    s.read_exact(&mut proof)
        .map_err(|e| format!("the peer refused this token ({e}); check GRADSYNC_TOKEN"))?;
    if !verify_stream_proof(token, false, id, &nonce_a, &nonce_d, &proof) {
        return Err("the peer could not prove that it holds the token".into());
    }
    sock.set_read_timeout(None)
        .map_err(|e| format!("setsockopt: {e}"))
}

fn tune(sock: &TcpStream, opts: &TcpOptions) -> io::Result<()> {
    sock.set_nodelay(true)?;
    if opts.sock_buf > 0 {
        let s = socket2::SockRef::from(sock);
        s.set_send_buffer_size(opts.sock_buf)?;
        s.set_recv_buffer_size(opts.sock_buf)?;
    }
    Ok(())
}

impl TcpEndpoint {
    /// Connects to every peer: rank r dials every lower rank `nsocks` times and accepts every
    /// higher rank's streams on `listener`. `addrs[p]` is the listening address of rank p.
    /// Connections whose hello is malformed or names another communicator are dropped with a
    /// warning and do not disturb setup.
    pub fn establish(
        rank: usize,
        addrs: &[SocketAddr],
        listener: TcpListener,
        comm_id: u64,
        opts: &TcpOptions,
    ) -> Result<TcpEndpoint> {
        let world = addrs.len();
        let nsocks = opts.nsocks.max(1);
        let start = Instant::now();
        let deadline = start + opts.timeout;
        let io_err = |peer: usize, op: &'static str| {
            move |source| TransportError::Io {
                rank,
                peer,
                op,
                source,
            }
        };
        let mut slots: Vec<Vec<Option<TcpStream>>> = (0..world)
            .map(|_| (0..nsocks).map(|_| None).collect())
            .collect();
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            #[allow(clippy::needless_range_loop)] // `s` is also the stream index sent in the hello
            for s in 0..nsocks {
                let sock = loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match TcpStream::connect_timeout(addr, left.max(Duration::from_millis(1))) {
                        Ok(sock) => break sock,
                        Err(e) if Instant::now() < deadline => {
                            tracing::debug!(target: "gradsync::net", "rank {rank}: connect to rank {peer} at {addr}: {e}; retrying");
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => {
                            return Err(TransportError::Timeout {
                                rank,
                                timeout: opts.timeout,
                                msg: format!("could not connect to rank {peer} at {addr}: {e}"),
                            });
                        }
                    }
                };
                tune(&sock, opts).map_err(io_err(peer, "setsockopt"))?;
                (&sock)
                    .write_all(&hello(comm_id, rank, s, nsocks))
                    .map_err(io_err(peer, "hello"))?;
                if let Some(token) = &opts.token {
                    let id = StreamId {
                        comm_id,
                        dialer: rank,
                        acceptor: peer,
                        stream: s,
                    };
                    dial_auth(&sock, token, id, deadline).map_err(|why| {
                        tracing::warn!(target: "gradsync::net", "rank {rank}: authentication failed on the connection to rank {peer} at {addr}: {why}");
                        TransportError::Protocol {
                            rank,
                            peer,
                            msg: format!(
                                "authentication failed on the connection to rank {peer} at {addr}: {why}"
                            ),
                        }
                    })?;
                }
                slots[peer][s] = Some(sock);
            }
        }
        let expected = (world - rank - 1) * nsocks;
        let mut got = 0;
        listener
            .set_nonblocking(true)
            .map_err(io_err(usize::MAX, "listen"))?;
        while got < expected {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = (rank + 1..world)
                    .filter(|&p| slots[p].iter().any(Option::is_none))
                    .map(|p| p.to_string())
                    .collect();
                return Err(TransportError::Timeout {
                    rank,
                    timeout: opts.timeout,
                    msg: format!(
                        "no connection from rank(s) {} (listening on {:?})",
                        missing.join(", "),
                        listener.local_addr().ok()
                    ),
                });
            }
            match listener.accept() {
                Ok((sock, from)) => {
                    sock.set_nonblocking(false)
                        .map_err(io_err(usize::MAX, "accept"))?;
                    let _ = sock.set_read_timeout(Some(Duration::from_secs(5).min(deadline - now)));
                    let _ =
                        sock.set_write_timeout(Some(Duration::from_secs(5).min(deadline - now)));
                    let mut h = [0u8; HELLO_LEN];
                    let ok = (&sock).read_exact(&mut h).is_ok();
                    let Hello {
                        magic,
                        comm_id: cid,
                        rank: peer,
                        stream: s,
                        nsocks: n,
                        ..
                    } = parse_hello(&h);
                    let valid = ok
                        && magic == HELLO_MAGIC
                        && cid == comm_id
                        && peer > rank
                        && peer < world
                        && s < nsocks
                        && n == nsocks
                        && slots[peer][s].is_none();
                    if !valid {
                        tracing::warn!(target: "gradsync::net", "rank {rank}: dropped a connection from {from} with an invalid hello (magic 0x{magic:08x}, communicator {cid:x}, rank {peer}, stream {s}/{n})");
                        continue;
                    }
                    if let Some(token) = &opts.token {
                        let id = StreamId {
                            comm_id,
                            dialer: peer,
                            acceptor: rank,
                            stream: s,
                        };
                        if let Err(why) = accept_auth(&sock, token, id) {
                            tracing::warn!(target: "gradsync::net", "rank {rank}: dropped a connection from {from} claiming rank {peer} stream {s}: authentication failed ({why})");
                            continue;
                        }
                    }
                    let _ = sock.set_read_timeout(None);
                    let _ = sock.set_write_timeout(None);
                    tune(&sock, opts).map_err(io_err(peer, "setsockopt"))?;
                    slots[peer][s] = Some(sock);
                    got += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let mut pfd = libc::pollfd {
                        fd: listener.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: pfd is a valid pollfd array of length 1.
                    unsafe { libc::poll(&mut pfd, 1, 50) };
                }
                Err(e) => return Err(io_err(usize::MAX, "accept")(e)),
            }
        }
        let mut peers = Vec::with_capacity(world);
        for (p, socks) in slots.into_iter().enumerate() {
            if p == rank {
                peers.push(None);
                continue;
            }
            let mut streams = Vec::with_capacity(nsocks);
            for sock in socks.into_iter().flatten() {
                sock.set_nonblocking(true)
                    .map_err(io_err(p, "set_nonblocking"))?;
                let fd = sock.as_raw_fd();
                streams.push(Stream {
                    sock,
                    fd,
                    rx: Rx::Header,
                    rxbuf: vec![0u8; RXBUF].into_boxed_slice(),
                    lo: 0,
                    hi: 0,
                    txq: VecDeque::new(),
                    tx_off: 0,
                    eof: false,
                    tx_failed: false,
                    header_only: false,
                });
            }
            peers.push(Some(Peer {
                streams,
                next_tx: 0,
                broken: None,
            }));
        }
        tracing::info!(target: "gradsync::net", "rank {rank}: connected to {} peers with {nsocks} stream(s) each in {:.1} ms", world - 1, start.elapsed().as_secs_f64() * 1e3);
        Ok(TcpEndpoint {
            rank,
            world,
            peers,
            regions: RegionTable::new(rank),
            pollfds: Vec::new(),
            done: Vec::new(),
        })
    }

    fn peer_mut(&mut self, peer: usize, op: &'static str) -> Result<&mut Peer> {
        let rank = self.rank;
        let world = self.world;
        let p = self
            .peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| TransportError::Invalid {
                rank,
                op,
                msg: format!("peer {peer} is not another rank of a world of {world}"),
            })?;
        if let Some(why) = &p.broken {
            return Err(TransportError::PeerClosed {
                rank,
                peer,
                during: why.clone(),
            });
        }
        Ok(p)
    }

    fn enqueue(&mut self, peer: usize, item: TxItem, op: &'static str) -> Result<()> {
        let rank = self.rank;
        let mut done = Vec::new();
        let p = self.peer_mut(peer, op)?;
        let n = p.streams.len();
        let Some(i) = (0..n)
            .map(|k| (p.next_tx + k) % n)
            .find(|&k| !p.streams[k].tx_failed)
        else {
            return Err(TransportError::PeerClosed {
                rank,
                peer,
                during: format!("{op}: every stream to the peer failed"),
            });
        };
        p.next_tx = (i + 1) % n;
        let st = &mut p.streams[i];
        st.txq.push_back(item);
        if st.txq.len() == 1 {
            // Send at once: a small message then leaves without waiting for the next poll.
            if let Err(e) = flush(st, &mut done) {
                st.tx_failed = true;
                st.txq.clear();
                return Err(TransportError::Io {
                    rank,
                    peer,
                    op,
                    source: e,
                });
            }
        }
        self.done.extend(done.into_iter().map(done_completion));
        Ok(())
    }

    /// Closes gracefully: stops sending, then reads and discards until every peer has closed
    /// too or `timeout` passes, so no unread byte makes the kernel reset a connection that a
    /// slower peer is still reading from.
    fn close_gracefully(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        // Flush what is queued (bounded by the deadline).
        while Instant::now() < deadline
            && self
                .peers
                .iter()
                .flatten()
                .any(|p| p.broken.is_none() && p.streams.iter().any(|s| !s.txq.is_empty()))
        {
            let _ = self.poll(&mut out);
            out.clear();
            let _ = self.wait(Duration::from_millis(10));
        }
        for p in self.peers.iter().flatten() {
            for s in &p.streams {
                let _ = s.sock.shutdown(std::net::Shutdown::Write);
            }
        }
        let mut buf = vec![0u8; RXBUF];
        loop {
            let mut open = 0;
            for p in self.peers.iter_mut().flatten() {
                for s in p.streams.iter_mut().filter(|s| !s.eof) {
                    loop {
                        match s.sock.read(&mut buf) {
                            Ok(0) => {
                                s.eof = true;
                                break;
                            }
                            Ok(_) => continue,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                            Err(_) => {
                                s.eof = true;
                                break;
                            }
                        }
                    }
                    if !s.eof {
                        open += 1;
                    }
                }
            }
            if open == 0 || Instant::now() >= deadline {
                break;
            }
            let _ = self.wait(Duration::from_millis(20));
        }
    }
}

fn done_completion(d: u64) -> Completion {
    if d & (1 << 63) != 0 {
        Completion::SendDone {
            wr_id: d & !(1 << 63),
        }
    } else {
        Completion::WriteDone { wr_id: d }
    }
}

/// Sends as much of the stream's queue as the socket takes. Appends wr_ids of items that
/// finished (tagged: high bit set for sends) to `done`.
fn flush(st: &mut Stream, done: &mut Vec<u64>) -> io::Result<()> {
    const MAXIOV: usize = 64;
    loop {
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(MAXIOV);
        let mut skip = st.tx_off;
        for item in st.txq.iter() {
            let mut push = |addr: usize, len: usize| {
                if skip >= len {
                    skip -= len;
                    return;
                }
                iov.push(libc::iovec {
                    iov_base: (addr + skip) as *mut libc::c_void,
                    iov_len: len - skip,
                });
                skip = 0;
            };
            push(item.hdr.as_ptr() as usize, FRAME_HDR);
            for &(a, l) in &item.sges {
                push(a, l);
            }
            if iov.len() >= MAXIOV - 8 {
                break;
            }
        }
        if iov.is_empty() {
            return Ok(());
        }
        let mut msg: libc::msghdr = unsafe_zeroed_msghdr();
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        // SAFETY: msg points to iovecs describing the frame headers (owned by the queue items)
        // and the registered spans the caller promised to keep valid until completion; the
        // socket is a valid fd owned by `st`.
        let n = unsafe { libc::sendmsg(st.fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(()),
                io::ErrorKind::Interrupted => continue,
                _ => Err(e),
            };
        }
        let mut n = n as usize;
        while n > 0 {
            let total = st.txq[0].total();
            let left = total - st.tx_off;
            if n >= left {
                n -= left;
                st.tx_off = 0;
                let item = st.txq.pop_front().expect("item");
                done.push(item.wr_id | if item.is_send { 1 << 63 } else { 0 });
            } else {
                st.tx_off += n;
                n = 0;
            }
        }
    }
}

fn unsafe_zeroed_msghdr() -> libc::msghdr {
    // SAFETY: msghdr is a plain C struct for which all-zero bytes are a valid value.
    unsafe { std::mem::zeroed() }
}

impl TcpEndpoint {
    /// Reads what is available on one stream; returns true if anything was read.
    fn rx_stream(
        rank: usize,
        peer: usize,
        st: &mut Stream,
        regions: &RegionTable,
        out: &mut Vec<Completion>,
    ) -> Result<bool> {
        let mut progressed = false;
        let mut budget = RX_BUDGET;
        let proto = |msg: String| TransportError::Protocol { rank, peer, msg };
        loop {
            match &mut st.rx {
                Rx::Header => {
                    if st.hi - st.lo >= FRAME_HDR {
                        let FrameHeader {
                            kind,
                            imm,
                            rkey,
                            len,
                            off,
                        } = parse_frame_header(&st.rxbuf[st.lo..st.lo + FRAME_HDR])
                            .map_err(proto)?;
                        st.lo += FRAME_HDR;
                        st.header_only = len as usize >= DIRECT_MIN;
                        st.rx = match kind {
                            KIND_WRITE | KIND_WRITE_IMM => {
                                let dst =
                                    regions.check_remote_write(peer, rkey, off, len as u64)?;
                                Rx::Write {
                                    dst,
                                    remaining: len as usize,
                                    imm: (kind == KIND_WRITE_IMM).then_some(imm),
                                    total: len,
                                }
                            }
                            KIND_SEND => {
                                if len as usize > MAX_SEND {
                                    return Err(proto(format!(
                                        "send of {len} bytes exceeds the {MAX_SEND}-byte limit"
                                    )));
                                }
                                Rx::Send {
                                    data: Vec::with_capacity(len as usize),
                                    need: len as usize,
                                }
                            }
                            k => return Err(proto(format!("unknown frame kind {k}"))),
                        };
                        progressed = true;
                        continue;
                    }
                }
                Rx::Write {
                    dst,
                    remaining,
                    imm,
                    total,
                } => {
                    if *remaining == 0 {
                        if let Some(imm) = *imm {
                            out.push(Completion::WriteImm {
                                peer,
                                imm,
                                len: *total,
                            });
                        }
                        st.rx = Rx::Header;
                        continue;
                    }
                    if st.hi > st.lo {
                        let n = (*remaining).min(st.hi - st.lo);
                        // SAFETY: dst..dst+remaining was checked to lie in a region registered
                        // for remote writes, which its owner keeps valid and leaves alone until
                        // the completion pushed above.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                st.rxbuf[st.lo..].as_ptr(),
                                *dst as *mut u8,
                                n,
                            )
                        };
                        st.lo += n;
                        *dst += n;
                        *remaining -= n;
                        progressed = true;
                        continue;
                    }
                    if *remaining >= DIRECT_MIN {
                        // SAFETY: as above; the slice covers exactly the checked span.
                        let target =
                            unsafe { std::slice::from_raw_parts_mut(*dst as *mut u8, *remaining) };
                        match st.sock.read(target) {
                            Ok(0) => {
                                st.eof = true;
                                return Ok(progressed);
                            }
                            Ok(n) => {
                                *dst += n;
                                *remaining -= n;
                                progressed = true;
                                budget = budget.saturating_sub(n);
                                if budget == 0 {
                                    return Ok(true);
                                }
                                continue;
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                                return Ok(progressed);
                            }
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                            Err(e) => {
                                return Err(TransportError::Io {
                                    rank,
                                    peer,
                                    op: "read",
                                    source: e,
                                });
                            }
                        }
                    }
                }
                Rx::Send { data, need } => {
                    if data.len() == *need {
                        out.push(Completion::Recv {
                            peer,
                            data: std::mem::take(data),
                        });
                        st.rx = Rx::Header;
                        continue;
                    }
                    if st.hi > st.lo {
                        let n = (*need - data.len()).min(st.hi - st.lo);
                        data.extend_from_slice(&st.rxbuf[st.lo..st.lo + n]);
                        st.lo += n;
                        progressed = true;
                        continue;
                    }
                }
            }
            // Need more bytes in the receive buffer.
            if st.lo == st.hi {
                st.lo = 0;
                st.hi = 0;
            } else if st.lo > 0 && st.rxbuf.len() - st.hi < FRAME_HDR {
                st.rxbuf.copy_within(st.lo..st.hi, 0);
                st.hi -= st.lo;
                st.lo = 0;
            }
            let want = if st.header_only && matches!(st.rx, Rx::Header) {
                FRAME_HDR - (st.hi - st.lo)
            } else {
                st.rxbuf.len() - st.hi
            };
            match st.sock.read(&mut st.rxbuf[st.hi..st.hi + want]) {
                Ok(0) => {
                    st.eof = true;
                    return Ok(progressed);
                }
                Ok(n) => {
                    st.hi += n;
                    progressed = true;
                    budget = budget.saturating_sub(n);
                    if budget == 0 {
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progressed),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(TransportError::Io {
                        rank,
                        peer,
                        op: "read",
                        source: e,
                    });
                }
            }
        }
    }
}

impl Endpoint for TcpEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        "tcp"
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        Ok(self.regions.register(addr as usize, len, access))
    }

    fn deregister(&mut self, mr: &MemoryRegion) {
        self.regions.deregister(mr);
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
        self.regions.check_local(sges)?;
        let total: usize = sges.iter().map(|s| s.len).sum();
        if total > u32::MAX as usize {
            return Err(TransportError::Invalid {
                rank: self.rank,
                op: "post_write",
                msg: format!("{total} bytes exceed one write"),
            });
        }
        let mut hdr = [0u8; FRAME_HDR];
        hdr[0] = if imm.is_some() {
            KIND_WRITE_IMM
        } else {
            KIND_WRITE
        };
        hdr[4..8].copy_from_slice(&imm.unwrap_or(0).to_le_bytes());
        hdr[8..12].copy_from_slice(&remote.rkey.to_le_bytes());
        hdr[12..16].copy_from_slice(&(total as u32).to_le_bytes());
        hdr[16..24].copy_from_slice(&offset.to_le_bytes());
        let item = TxItem {
            hdr,
            sges: sges.iter().map(|s| (s.addr, s.len)).collect(),
            _owned: Vec::new(),
            wr_id,
            is_send: false,
        };
        self.enqueue(peer, item, "post_write")
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        check_send_len(self.rank, data.len())?;
        let mut hdr = [0u8; FRAME_HDR];
        hdr[0] = KIND_SEND;
        hdr[12..16].copy_from_slice(&(data.len() as u32).to_le_bytes());
        let owned = data.to_vec();
        let sges = vec![(owned.as_ptr() as usize, owned.len())];
        self.enqueue(
            peer,
            TxItem {
                hdr,
                sges,
                _owned: owned,
                wr_id,
                is_send: true,
            },
            "post_send",
        )
    }

    fn close(&mut self, timeout: Duration) {
        self.close_gracefully(timeout);
    }

    fn peer_alive(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.broken.is_none())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let rank = self.rank;
        out.append(&mut self.done);
        // With many streams, one poll(2) finds the readable ones instead of a failing read on
        // every stream.
        let nstreams: usize = self.peers.iter().flatten().map(|p| p.streams.len()).sum();
        let select = nstreams > 4;
        if select {
            self.pollfds.clear();
            for p in self.peers.iter().flatten() {
                for st in &p.streams {
                    self.pollfds.push(libc::pollfd {
                        fd: st.fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
            }
            // SAFETY: pollfds is a valid array of pollfd structs of the given length.
            unsafe {
                libc::poll(
                    self.pollfds.as_mut_ptr(),
                    self.pollfds.len() as libc::nfds_t,
                    0,
                )
            };
        }
        let mut idx = 0;
        for (peer, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if p.broken.is_some() {
                idx += p.streams.len();
                continue;
            }
            let base = idx;
            idx += p.streams.len();
            let mut done = Vec::new();
            for (i, st) in p.streams.iter_mut().enumerate() {
                // A stream in the middle of a frame is always visited: its last read may have
                // ended exactly at the end of a payload (the per-poll budget ran out), and the
                // frame's completion is pushed only on the next visit, even if no more bytes come.
                let readable = !select
                    || self.pollfds[base + i].revents != 0
                    || st.hi > st.lo
                    || !matches!(st.rx, Rx::Header);
                if !st.tx_failed && !st.txq.is_empty() && flush(st, &mut done).is_err() {
                    // The peer is going away; keep reading what it sent before it went.
                    st.tx_failed = true;
                    st.txq.clear();
                }
                if !readable || st.eof {
                    continue;
                }
                Self::rx_stream(rank, peer, st, &self.regions, out)?;
            }
            // Only once every stream is drained: data a peer sent on one stream before it
            // closed must not be lost because another stream ended first.
            if p.streams.iter().all(|st| st.eof) {
                p.broken = Some("the peer closed the connection".into());
            }
            out.extend(done.into_iter().map(done_completion));
        }
        Ok(())
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        self.pollfds.clear();
        if !self.done.is_empty() {
            return Ok(());
        }
        for p in self.peers.iter().flatten() {
            if p.broken.is_some() {
                continue;
            }
            for st in p.streams.iter().filter(|st| !st.eof) {
                if st.hi > st.lo {
                    return Ok(());
                }
                let mut events = libc::POLLIN;
                if !st.txq.is_empty() {
                    events |= libc::POLLOUT;
                }
                self.pollfds.push(libc::pollfd {
                    fd: st.fd,
                    events,
                    revents: 0,
                });
            }
        }
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: pollfds is a valid array of pollfd structs of the given length.
        let r = unsafe {
            libc::poll(
                self.pollfds.as_mut_ptr(),
                self.pollfds.len() as libc::nfds_t,
                ms,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(TransportError::Io {
                    rank: self.rank,
                    peer: usize::MAX,
                    op: "poll",
                    source: e,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod setup_tests {
    //! Parsers of peer bytes on data connections (fuzz-style: `PROPTEST_CASES` cases) and the
    //! handshake proofs.
    use super::*;
    use proptest::prelude::*;

    const ID: StreamId = StreamId {
        comm_id: 0x1122_3344_5566_7788,
        dialer: 2,
        acceptor: 0,
        stream: 1,
    };

    #[test]
    fn hello_literal_bytes() {
        let b = hello(0x0807_0605_0403_0201, 3, 1, 2);
        assert_eq!(
            b,
            [
                0x48, 0x54, 0x53, 0x47, 1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 0, 0, 0, 1, 0, 2, 0
            ]
        );
        let h = parse_hello(&b);
        assert_eq!(
            (h.magic, h.version, h.comm_id, h.rank, h.stream, h.nsocks),
            (HELLO_MAGIC, 1, 0x0807_0605_0403_0201, 3, 1, 2)
        );
    }

    #[test]
    fn frame_header_literal_bytes() {
        let mut h = [0u8; FRAME_HDR];
        h[0] = KIND_WRITE_IMM;
        h[4..8].copy_from_slice(&7u32.to_le_bytes());
        h[8..12].copy_from_slice(&9u32.to_le_bytes());
        h[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        h[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let f = parse_frame_header(&h).unwrap();
        assert_eq!(
            (f.kind, f.imm, f.rkey, f.len, f.off),
            (2, 7, 9, u32::MAX, u64::MAX)
        );
        h[2] = 1;
        assert!(parse_frame_header(&h).is_err());
        assert!(parse_frame_header(&h[..FRAME_HDR - 1]).is_err());
    }

    #[test]
    fn proofs_bind_direction_and_stream() {
        let (a, d) = ([1u8; AUTH_LEN], [2u8; AUTH_LEN]);
        let p = stream_proof(b"tok", true, ID, &a, &d);
        assert!(verify_stream_proof(b"tok", true, ID, &a, &d, &p));
        assert!(!verify_stream_proof(b"tok", false, ID, &a, &d, &p));
        assert!(!verify_stream_proof(b"other", true, ID, &a, &d, &p));
        assert!(!verify_stream_proof(b"tok", true, ID, &d, &a, &p));
        let other = StreamId { stream: 0, ..ID };
        assert!(!verify_stream_proof(b"tok", true, other, &a, &d, &p));
        assert!(!verify_stream_proof(b"tok", true, ID, &a, &d, &p[..31]));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn fuzz_hello_parse(b in any::<[u8; HELLO_LEN]>()) {
            let h = parse_hello(&b);
            // Parsing is total and re-emits the fields it read.
            if h.version == 1 && b[6..8] == [0, 0] && h.magic == HELLO_MAGIC
                && h.rank <= u32::MAX as usize
            {
                prop_assert_eq!(hello(h.comm_id, h.rank, h.stream, h.nsocks), b);
            }
        }

        #[test]
        fn fuzz_frame_header_parse(b in proptest::collection::vec(any::<u8>(), 0..40)) {
            match parse_frame_header(&b) {
                Ok(f) => {
                    prop_assert!(b.len() >= FRAME_HDR && b[1..4] == [0, 0, 0]);
                    prop_assert_eq!(f.kind, b[0]);
                    prop_assert_eq!(f.len.to_le_bytes(), [b[12], b[13], b[14], b[15]]);
                }
                Err(_) => prop_assert!(b.len() < FRAME_HDR || b[1..4] != [0, 0, 0]),
            }
        }

        #[test]
        fn fuzz_handshake_answer_never_verifies(
            answer in proptest::collection::vec(any::<u8>(), 0..80),
            a in any::<[u8; AUTH_LEN]>(),
        ) {
            // A stranger's answer (any bytes, any length) is refused, and checking it never
            // panics.
            let d: [u8; AUTH_LEN] = answer.get(..AUTH_LEN).and_then(|s| s.try_into().ok()).unwrap_or([0; AUTH_LEN]);
            let proof = answer.get(AUTH_LEN..).unwrap_or(&[]);
            prop_assert!(!verify_stream_proof(b"job-token", true, ID, &a, &d, proof));
            prop_assert!(!verify_stream_proof(b"job-token", false, ID, &a, &d, proof));
        }
    }
}
