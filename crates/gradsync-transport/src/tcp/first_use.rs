//! Connections on first use, the endpoint's side: [`TcpEndpoint::lazy`], accepting dials,
//! and [`Endpoint::connect`](crate::Endpoint::connect) (see [Connections on first use](super#connections-on-first-use)).

use super::endpoint::{Peer, TcpEndpoint};
use super::lazy::Lazy;
use super::options::TcpOptions;
use super::setup::{accept_ready, accept_stream, dial_stream, set_nonblocking};
use super::stream::{Stream, flush};
use crate::AddressBook;
use crate::error::{Result, TransportError};
use crate::verbs::Endpoint;
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

impl TcpEndpoint {
    /// An endpoint that connects to a peer only when [`Endpoint::connect`](crate::Endpoint::connect)
    /// first names it (see [Connections on first use](super#connections-on-first-use)). `addrs` has the listening address of
    /// every rank, or fetches those of the lower ranks this rank dials when it first dials them;
    /// `listener` is this rank's, already published to the peers.
    pub fn lazy(
        rank: usize,
        addrs: AddressBook,
        listener: TcpListener,
        comm_id: u64,
        opts: &TcpOptions,
    ) -> Result<TcpEndpoint> {
        let world = addrs.world();
        set_nonblocking(rank, &listener)?;
        let mut ep = TcpEndpoint::new(rank, world, (0..world).map(|_| None).collect(), opts.window);
        ep.lazy = Some(Lazy {
            listener,
            addrs,
            comm_id,
            opts: opts.clone(),
            partial: HashMap::new(),
            missing: world.saturating_sub(1),
            polls: 0,
        });
        Ok(ep)
    }

    /// Takes every connection waiting on the listener (without blocking when none is); a peer
    /// whose streams are then all there is connected.
    pub(super) fn accept_pending(&mut self) -> Result<()> {
        let (rank, world) = (self.rank(), self.world());
        loop {
            let Some(lz) = self.lazy.as_mut() else {
                return Ok(());
            };
            let Some((sock, from)) = accept_ready(rank, &lz.listener)? else {
                return Ok(());
            };
            let deadline = Instant::now() + lz.opts.timeout;
            let peers = &self.peers;
            let partial = &lz.partial;
            // A higher rank's stream this rank does not have yet.
            let fits = |peer: usize, s: usize| {
                peer > rank
                    && peers[peer].is_none()
                    && partial
                        .get(&peer)
                        .is_none_or(|v| v.get(s).is_some_and(Option::is_none))
            };
            let Some((peer, s, sock)) = accept_stream(
                rank, world, sock, from, lz.comm_id, &lz.opts, deadline, fits,
            )?
            else {
                continue;
            };
            let nsocks = lz.opts.streams_to(peer);
            let slots = lz
                .partial
                .entry(peer)
                .or_insert_with(|| (0..nsocks).map(|_| None).collect());
            slots[s] = Some(sock);
            if slots.iter().all(Option::is_some) {
                let socks = lz.partial.remove(&peer).expect("present");
                self.install(peer, socks.into_iter().flatten().collect())?;
            }
        }
    }

    /// Makes `socks` the streams to `peer`.
    fn install(&mut self, peer: usize, socks: Vec<TcpStream>) -> Result<()> {
        let rank = self.rank();
        let mut streams = Vec::with_capacity(socks.len());
        for sock in socks {
            sock.set_nonblocking(true)
                .map_err(|source| TransportError::Io {
                    rank,
                    peer,
                    op: "set_nonblocking",
                    source,
                })?;
            streams.push(Stream::new(sock));
        }
        let stripe = self.lazy.as_ref().is_none_or(|lz| !lz.opts.is_local(peer));
        self.peers[peer] = Some(Peer::new(streams, stripe));
        if let Some(lz) = self.lazy.as_mut() {
            lz.missing = lz.missing.saturating_sub(1);
        }
        tracing::debug!(target: "gradsync::net", "rank {rank}: connected to rank {peer}");
        Ok(())
    }

    /// [`Endpoint::connect`](crate::Endpoint::connect) of a lazy endpoint: dials the lower
    /// peers of `peers` not connected yet, then waits, accepting, until the higher ones have
    /// dialed this rank.
    pub(super) fn connect_lazy(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        let (rank, world) = (self.rank(), self.world());
        let Some(lz) = self.lazy.as_ref() else {
            return Ok(());
        };
        if let Some(&p) = peers.iter().find(|&&p| p >= world || p == rank) {
            return Err(TransportError::Invalid {
                rank,
                op: "connect",
                msg: format!("rank {p} is not a peer in a world of {world}"),
            });
        }
        let start = Instant::now();
        let deadline = start + timeout;
        let (comm_id, opts) = (lz.comm_id, lz.opts.clone());
        let mut lower: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| p < rank && self.peers[p].is_none())
            .collect();
        lower.sort_unstable();
        lower.dedup();
        let addrs = self
            .lazy
            .as_ref()
            .expect("lazy")
            .addrs
            .resolve(&lower, deadline)?;
        for (p, addr) in lower.into_iter().zip(addrs) {
            let socks = (0..opts.streams_to(p))
                .map(|s| dial_stream(rank, p, addr, s, comm_id, &opts, deadline))
                .collect::<Result<Vec<_>>>()?;
            self.install(p, socks)?;
        }
        loop {
            self.accept_pending()?;
            let missing: Vec<usize> = peers
                .iter()
                .copied()
                .filter(|&p| p > rank && self.peers[p].is_none())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                let mut list: Vec<String> = missing.iter().map(usize::to_string).collect();
                list.dedup();
                return Err(TransportError::Timeout {
                    rank,
                    timeout,
                    msg: format!(
                        "no connection from rank{} {} (listening on {:?})",
                        if list.len() > 1 { "s" } else { "" },
                        list.join(", "),
                        self.lazy
                            .as_ref()
                            .and_then(|l| l.listener.local_addr().ok())
                    ),
                });
            }
            self.flush_queued();
            let fd = self.lazy.as_ref().expect("lazy").listener_fd();
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = (deadline - now).as_millis().clamp(1, 20) as i32;
            // SAFETY: pfd is a valid pollfd array of length 1.
            unsafe { libc::poll(&mut pfd, 1, ms) };
        }
    }

    /// Flushes what is queued to the connected peers (best effort; a failing stream is marked
    /// as [`poll`](crate::Endpoint::poll) would).
    fn flush_queued(&mut self) {
        for p in self.peers.iter_mut().flatten() {
            let mut done = Vec::new();
            for st in p.streams.iter_mut() {
                if !st.tx_failed && !st.txq.is_empty() && flush(st, &mut done).is_err() {
                    st.tx_failed = true;
                    st.txq.clear();
                }
            }
            p.complete_sent(done, &mut self.done);
        }
    }
}
