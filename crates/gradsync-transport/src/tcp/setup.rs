//! Connection setup of the TCP backend: [`TcpOptions`] and [`TcpEndpoint::establish`], which
//! dials the lower ranks, accepts the higher ones, checks every hello and runs the
//! authentication handshake.

use super::auth::{StreamId, accept_auth, dial_auth};
use super::endpoint::{Peer, TcpEndpoint};
use super::stream::Stream;
use super::wire::{HELLO_LEN, Hello, HelloRepr};
use crate::error::{Result, TransportError, Violation};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

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
    /// described in the [module documentation](super#authentication) (all ranks must use the
    /// same token); without one, streams are not authenticated.
    pub token: Option<Vec<u8>>,
    /// Messages in flight per peer that suit these streams, if fewer than an inbox holds (the
    /// [`window`](crate::PeerCaps::window) the endpoint reports): fewer keep the socket
    /// queues short.
    pub window: Option<usize>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            nsocks: 2,
            sock_buf: 0,
            timeout: Duration::from_secs(60),
            token: None,
            window: None,
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
            .field("window", &self.window)
            .finish()
    }
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
                let hello = HelloRepr {
                    comm_id,
                    rank: rank as u32,
                    stream: s as u16,
                    nsocks: nsocks as u16,
                };
                (&sock)
                    .write_all(&hello.to_bytes())
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
                            violation: Violation::Authentication { addr: *addr, why },
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
                        && peer > rank
                        && peer < world
                        && s < nsocks
                        && n == nsocks
                        && slots[peer][s].is_none();
                    if !valid {
                        tracing::warn!(target: "gradsync::net", "rank {rank}: dropped a connection from {from} with an invalid hello (magic 0x{magic:08x}, version {version}, communicator {cid:x}, rank {peer}, stream {s}/{n})");
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
                streams.push(Stream::new(sock));
            }
            peers.push(Some(Peer::new(streams)));
        }
        tracing::info!(target: "gradsync::net", "rank {rank}: connected to {} peers with {nsocks} stream(s) each in {:.1} ms", world - 1, start.elapsed().as_secs_f64() * 1e3);
        Ok(TcpEndpoint::new(rank, world, peers, opts.window))
    }
}

/// Binds a listener for incoming peer connections on `ip` (port chosen by the kernel).
pub fn listen(ip: IpAddr) -> io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, 0))
}
