//! Connection setup of the TCP backend: [`TcpOptions`] and [`TcpEndpoint::establish`], which
//! dials the lower ranks, accepts the higher ones, checks every hello and runs the
//! authentication handshake.

use super::auth::{StreamId, accept_auth, dial_auth};
use super::endpoint::{Peer, TcpEndpoint};
use super::options::TcpOptions;
use super::stream::Stream;
use super::wire::{HELLO_LEN, Hello, HelloRepr};
use crate::error::{Result, TransportError, Violation};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

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
            .map(|p| (0..opts.streams_to(p)).map(|_| None).collect())
            .collect();
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            for (s, slot) in slots[peer].iter_mut().enumerate() {
                *slot = Some(dial_stream(rank, peer, *addr, s, comm_id, opts, deadline)?);
            }
        }
        let expected: usize = (rank + 1..world).map(|p| opts.streams_to(p)).sum();
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
                    let fits = |peer: usize, s: usize| peer > rank && slots[peer][s].is_none();
                    if let Some((peer, s, sock)) =
                        accept_stream(rank, world, sock, from, comm_id, opts, deadline, fits)?
                    {
                        slots[peer][s] = Some(sock);
                        got += 1;
                    }
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
            let mut streams = Vec::with_capacity(socks.len());
            for sock in socks.into_iter().flatten() {
                sock.set_nonblocking(true)
                    .map_err(io_err(p, "set_nonblocking"))?;
                streams.push(Stream::new(sock));
            }
            peers.push(Some(Peer::new(streams, !opts.is_local(p))));
        }
        tracing::info!(target: "gradsync::net", "rank {rank}: connected to {} peers in {:.1} ms ({} stream(s) to a peer on another host, {} on this one)", world - 1, start.elapsed().as_secs_f64() * 1e3, opts.nsocks.max(1), opts.nsocks_local.max(1));
        Ok(TcpEndpoint::new(rank, world, peers, opts.window))
    }
}

/// Dials stream `s` of the pair with `peer` at `addr` (this rank dials: it is the higher one):
/// connect, retrying until `deadline`, then the hello and, with a token, the handshake.
pub(crate) fn dial_stream(
    rank: usize,
    peer: usize,
    addr: SocketAddr,
    s: usize,
    comm_id: u64,
    opts: &TcpOptions,
    deadline: Instant,
) -> Result<TcpStream> {
    let nsocks = opts.streams_to(peer);
    let io_err = |op: &'static str| {
        move |source| TransportError::Io {
            rank,
            peer,
            op,
            source,
        }
    };
    let sock = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
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
    tune(&sock, opts).map_err(io_err("setsockopt"))?;
    let hello = HelloRepr {
        comm_id,
        rank: rank as u32,
        stream: s as u16,
        nsocks: nsocks as u16,
    };
    (&sock)
        .write_all(&hello.to_bytes())
        .map_err(io_err("hello"))?;
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
                violation: Violation::Authentication { addr, why },
            }
        })?;
    }
    Ok(sock)
}

/// Takes a connection accepted from `from`: reads and checks its hello and, with a token,
/// runs the handshake, each step within 5 s and `deadline`. `fits(peer, stream)` says whether
/// the stream it claims is one this rank waits for. `Ok(None)`: the connection was dropped
/// with a warning (bad hello, unwanted stream, failed handshake); setup goes on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn accept_stream(
    rank: usize,
    world: usize,
    sock: TcpStream,
    from: SocketAddr,
    comm_id: u64,
    opts: &TcpOptions,
    deadline: Instant,
    fits: impl Fn(usize, usize) -> bool,
) -> Result<Option<(usize, usize, TcpStream)>> {
    let io_err = |op: &'static str| {
        move |source| TransportError::Io {
            rank,
            peer: usize::MAX,
            op,
            source,
        }
    };
    sock.set_nonblocking(false).map_err(io_err("accept"))?;
    let step = Duration::from_secs(5)
        .min(deadline.saturating_duration_since(Instant::now()))
        .max(Duration::from_millis(1));
    let _ = sock.set_read_timeout(Some(step));
    let _ = sock.set_write_timeout(Some(step));
    let mut h = [0u8; HELLO_LEN];
    let ok = (&sock).read_exact(&mut h).is_ok();
    let view = Hello::new_unchecked(&h[..]);
    let parsed = HelloRepr::parse(&view);
    let (magic, version, cid) = (view.magic(), view.version(), view.comm_id());
    let (peer, s, n) = (
        view.rank() as usize,
        view.stream() as usize,
        view.nsocks() as usize,
    );
    let valid = ok
        && parsed.is_ok()
        && cid == comm_id
        && peer < world
        && peer != rank
        && s < opts.streams_to(peer)
        && n == opts.streams_to(peer)
        && fits(peer, s);
    if !valid {
        tracing::warn!(target: "gradsync::net", "rank {rank}: dropped a connection from {from} with an invalid hello (magic 0x{magic:08x}, version {version}, communicator {cid:x}, rank {peer}, stream {s}/{n})");
        return Ok(None);
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
            return Ok(None);
        }
    }
    let _ = sock.set_read_timeout(None);
    let _ = sock.set_write_timeout(None);
    tune(&sock, opts).map_err(|source| TransportError::Io {
        rank,
        peer,
        op: "setsockopt",
        source,
    })?;
    Ok(Some((peer, s, sock)))
}

/// Makes `listener` non-blocking, for connections on first use taken from a poll loop.
pub(crate) fn set_nonblocking(rank: usize, listener: &TcpListener) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|source| TransportError::Io {
            rank,
            peer: usize::MAX,
            op: "listen",
            source,
        })
}

/// The next connection waiting on a non-blocking `listener`, or `None` when none is.
pub(crate) fn accept_ready(
    rank: usize,
    listener: &TcpListener,
) -> Result<Option<(TcpStream, SocketAddr)>> {
    loop {
        match listener.accept() {
            Ok(x) => return Ok(Some(x)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(TransportError::Io {
                    rank,
                    peer: usize::MAX,
                    op: "accept",
                    source,
                });
            }
        }
    }
}

/// Binds a listener for incoming peer connections on `ip` (port chosen by the kernel), with a
/// backlog of [`LISTEN_BACKLOG`]: peers that dial at once (lazy connections of many ranks to a
/// tree's root, a full mesh at setup) wait in the kernel's queue, not in SYN retries.
pub fn listen(ip: IpAddr) -> io::Result<TcpListener> {
    let addr = SocketAddr::new(ip, 0);
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.bind(&addr.into())?;
    sock.listen(LISTEN_BACKLOG)?;
    Ok(sock.into())
}

/// Connections a listener queues before it accepts them (the kernel caps it at
/// `net.core.somaxconn`).
pub const LISTEN_BACKLOG: i32 = 4096;
