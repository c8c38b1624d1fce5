//! Queue pairs on first use, the endpoint's side: an endpoint made by
//! [`RdmaSetup::first_use`](super::RdmaSetup::first_use) has no queue pair at setup; a pair
//! makes its queue pairs (and registers their receive buffers) when
//! [`Endpoint::connect`](crate::Endpoint::connect) first names it.
//!
//! The queue pair numbers travel over a TCP connection made for the purpose, with the roles
//! and checks of TCP's connections on first use (see [`crate::tcp`]): the higher rank dials the
//! lower one's listener, sends the hello (and, with a token, passes the handshake), then:
//!
//! 1. the dialer makes its queue pairs and sends its column (the descriptor's fixed part and
//!    its entries for this pair, [`ConnInfoRepr::to_column`]), then the keys of its region
//!    registered by areas, if it has one (the region's key and that of the acceptor's area,
//!    registered with the queue pairs; see [`Access::PEER_AREAS`](crate::Access::PEER_AREAS));
//! 2. the acceptor makes its queue pairs, moves them to RTR and RTS against that column and
//!    sends its own column and keys;
//! 3. the dialer moves its queue pairs to RTR and RTS and sends one byte: from then on both
//!    sides' queue pairs take traffic, and the acceptor counts the pair as connected.
//!
//! Frames are a 4-byte little-endian length and the column or the keys. A dial blocks until the
//! lower rank accepts; the lower rank accepts whenever it polls (one poll in 1024) or waits,
//! and while its own `connect` waits for higher ranks, so chains of dials, which only go down
//! in rank, end. The TCP connection is closed once the pair is connected.

use super::endpoint::RdmaEndpoint;
use super::lazy::Lazy;
use super::setup::setup_err;
use super::wire::{ConnInfoRepr, INFO_ENTRY_LEN, INFO_HEADER_LEN};
use crate::error::{Result, TransportError};
use crate::tcp::setup::{accept_ready, accept_stream, dial_stream};
use crate::verbs::Completion;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Queue pairs per peer a column may announce (a bound on what a frame may hold).
const MAX_QPS: usize = 256;

/// Writes one frame: the length, then `b`.
fn write_frame(mut s: &TcpStream, b: &[u8]) -> io::Result<()> {
    let mut f = Vec::with_capacity(4 + b.len());
    f.extend_from_slice(&(b.len() as u32).to_le_bytes());
    f.extend_from_slice(b);
    s.write_all(&f)
}

/// Reads one frame of at most a column's largest length.
fn read_frame(mut s: &TcpStream) -> io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    s.read_exact(&mut l)?;
    let len = u32::from_le_bytes(l) as usize;
    if len > INFO_HEADER_LEN + MAX_QPS * INFO_ENTRY_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes is longer than any column"),
        ));
    }
    let mut b = vec![0u8; len];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// The frame of a region's key and the key of the area a peer writes (zeros: no region is
/// registered by areas).
fn keys_frame((key, area): (u32, u32)) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&key.to_le_bytes());
    b[4..].copy_from_slice(&area.to_le_bytes());
    b
}

/// Parses [`keys_frame`]: `None` for zeros.
fn parse_keys(b: &[u8]) -> std::result::Result<Option<(u32, u32)>, String> {
    let b: [u8; 8] = b
        .try_into()
        .map_err(|_| format!("{} bytes, not 8", b.len()))?;
    let key = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
    let area = u32::from_le_bytes(b[4..].try_into().expect("4 bytes"));
    Ok((key != 0).then_some((key, area)))
}

/// Sets both timeouts of `s` to what is left until `deadline` (at least 1 ms).
fn bound(s: &TcpStream, deadline: Instant) {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(left));
    let _ = s.set_write_timeout(Some(left));
}

impl RdmaEndpoint {
    /// This rank's column for `p`: the fixed part of its descriptor and its entries for the
    /// pair.
    fn column_for(&self, p: usize) -> Vec<u8> {
        ConnInfoRepr {
            qp: self.peers[p].local.clone(),
            ..self.local.clone()
        }
        .to_column()
    }

    /// Parses and checks a peer's column received on a first-use connection.
    fn their_column(&self, p: usize, b: &[u8]) -> Result<ConnInfoRepr> {
        let c = ConnInfoRepr::from_column(b).ok_or_else(|| {
            setup_err(
                self.rank,
                p,
                "connect",
                format!("malformed queue pair column ({} bytes)", b.len()),
            )
        })?;
        self.check_remote(p, &c)?;
        if c.qp.len() != self.qps_per_peer() {
            return Err(setup_err(
                self.rank,
                p,
                "connect",
                format!(
                    "the column has {} queue pair entries, not {}",
                    c.qp.len(),
                    self.qps_per_peer()
                ),
            ));
        }
        Ok(c)
    }

    /// Marks `p` connected.
    fn joined(&mut self, p: usize) {
        self.peers[p].joined = true;
        if let Some(lz) = self.first_use.as_mut() {
            lz.missing = lz.missing.saturating_sub(1);
        }
        tracing::debug!(target: "gradsync::net", "rank {}: rdma queue pairs to rank {p} connected on first use", self.rank);
    }

    /// Connects every rank of `peers` not connected yet: dials the lower ones, then waits for
    /// the higher ones to dial, accepting, until `timeout`.
    pub(super) fn connect_peers(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let (rank, world) = (self.rank, self.world);
        let wanted = |ep: &RdmaEndpoint, p: usize| {
            p < world && p != rank && !ep.peers[p].joined && ep.peers[p].broken.is_none()
        };
        let lower: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| p < rank && wanted(self, p))
            .collect();
        if let Some(lz) = self.first_use.as_ref() {
            // The addresses of the lower ranks to dial, fetched together where the book lacks
            // them.
            lz.addrs.resolve(&lower, deadline)?;
        }
        for p in lower {
            if wanted(self, p) {
                self.dial(p, deadline)?;
            }
        }
        loop {
            let waiting: Vec<usize> = peers
                .iter()
                .copied()
                .filter(|&p| p > rank && wanted(self, p))
                .collect();
            if waiting.is_empty() {
                return Ok(());
            }
            self.accept_pending()?;
            if peers.iter().all(|&p| p <= rank || !wanted(self, p)) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout {
                    rank,
                    timeout,
                    msg: format!(
                        "rank {rank} waited for ranks {waiting:?} to connect their rdma queue pairs (they dial the lower rank of a pair on first use)"
                    ),
                });
            }
            // Completions of the pairs already connected keep coming while this rank waits.
            let mut got: Vec<Completion> = Vec::new();
            self.drain_cq(&mut got);
            self.ready.extend(got);
            self.flush_pending();
            if let Some(fd) = self.first_use.as_ref().and_then(Lazy::listener_fd) {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ms = (deadline - now).as_millis().clamp(1, 5) as i32;
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pfd, 1, ms) };
            }
        }
    }

    /// Dials `p` (a lower rank) and connects the pair's queue pairs.
    fn dial(&mut self, p: usize, deadline: Instant) -> Result<()> {
        let rank = self.rank;
        let lz = self.first_use.as_ref().expect("connect on first use");
        let addr = lz.addrs.resolve(&[p], deadline)?[0];
        let sock = dial_stream(rank, p, addr, 0, lz.comm_id, &lz.topts, deadline)?;
        bound(&sock, deadline);
        let io_err = |op: &'static str| {
            move |source| TransportError::Io {
                rank,
                peer: p,
                op,
                source,
            }
        };
        self.open_peer(p)?;
        let done = (|| {
            write_frame(&sock, &self.column_for(p)).map_err(io_err("rdma connect: send column"))?;
            write_frame(&sock, &keys_frame(self.area_keys(p)))
                .map_err(io_err("rdma connect: send area keys"))?;
            let b = read_frame(&sock).map_err(io_err("rdma connect: receive column"))?;
            let k = read_frame(&sock).map_err(io_err("rdma connect: receive area keys"))?;
            let theirs = self.their_column(p, &b)?;
            self.peers[p].remote_area = parse_keys(&k)
                .map_err(|why| setup_err(rank, p, "connect", format!("the area keys: {why}")))?;
            self.join_peer(p, &theirs)?;
            (&sock)
                .write_all(&[1])
                .map_err(io_err("rdma connect: send ready"))
        })();
        match done {
            Ok(()) => {
                self.joined(p);
                Ok(())
            }
            Err(e) => {
                self.drop_peer_qps(p);
                Err(e)
            }
        }
    }

    /// Takes every dial waiting on the listener (without blocking when none is) and connects
    /// its pair. A connection whose hello, handshake or exchange fails is dropped with a
    /// warning: the dialing rank reports the failure.
    pub(super) fn accept_pending(&mut self) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        loop {
            let Some(lz) = self.first_use.as_ref() else {
                return Ok(());
            };
            let Some((sock, from)) = accept_ready(rank, &lz.listener)? else {
                return Ok(());
            };
            let step = Instant::now() + lz.topts.timeout.min(Duration::from_secs(5));
            let joined: Vec<bool> = self.peers.iter().map(|p| p.joined).collect();
            let fits = |peer: usize, _s: usize| peer > rank && peer < world && !joined[peer];
            let Some((p, _, sock)) =
                accept_stream(rank, world, sock, from, lz.comm_id, &lz.topts, step, fits)?
            else {
                continue;
            };
            bound(&sock, step);
            let done = (|| -> std::result::Result<(), String> {
                let b = read_frame(&sock).map_err(|e| format!("receiving its column: {e}"))?;
                let k = read_frame(&sock).map_err(|e| format!("receiving its area keys: {e}"))?;
                let theirs = self.their_column(p, &b).map_err(|e| e.to_string())?;
                let remote_area = parse_keys(&k).map_err(|why| format!("its area keys: {why}"))?;
                self.open_peer(p).map_err(|e| e.to_string())?;
                self.peers[p].remote_area = remote_area;
                self.join_peer(p, &theirs).map_err(|e| e.to_string())?;
                write_frame(&sock, &self.column_for(p))
                    .map_err(|e| format!("sending this rank's column: {e}"))?;
                write_frame(&sock, &keys_frame(self.area_keys(p)))
                    .map_err(|e| format!("sending this rank's area keys: {e}"))?;
                let mut ready = [0u8; 1];
                (&sock)
                    .read_exact(&mut ready)
                    .map_err(|e| format!("waiting for its ready byte: {e}"))?;
                Ok(())
            })();
            match done {
                Ok(()) => self.joined(p),
                Err(why) => {
                    tracing::warn!(target: "gradsync::net", "rank {rank}: dropped the rdma connection of rank {p} from {from}: {why}");
                    self.drop_peer_qps(p);
                }
            }
        }
    }
}
