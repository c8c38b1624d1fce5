//! A rank's TCP endpoint: its streams to every peer, the round-robin send path, graceful close
//! and the [`Endpoint`] implementation.

use super::lazy::Lazy;
use super::stream::{RXBUF, Rx, STRIPE_MIN, Sent, Stream, Stripes, TxItem, flush, rx_stream};
use super::wire::FrameHeaderRepr;
use crate::caps::{Board, PeerCaps, Route, SharedMemory};
use crate::error::{Result, TransportError};
use crate::regions::RegionTable;
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion, Sge, check_send_len};
use crate::wire::RemoteRegion;
use std::collections::HashMap;
use std::io::{self, Read};
use std::time::{Duration, Instant};

/// The streams to one peer.
#[derive(Debug)]
pub(super) struct Peer {
    pub(super) streams: Vec<Stream>,
    next_tx: usize,
    broken: Option<String>,
    /// The striped writes received (see [`super::stream`]).
    stripes: Stripes,
    /// Parts still queued of the striped writes posted, by work request.
    parts_left: HashMap<u64, usize>,
    /// Writes to this peer are striped over its streams (it is on another host).
    stripe: bool,
}

impl Peer {
    /// A peer reached through `streams`; `stripe`: large writes to it are striped over them.
    pub(super) fn new(streams: Vec<Stream>, stripe: bool) -> Peer {
        Peer {
            streams,
            next_tx: 0,
            broken: None,
            stripes: Stripes::default(),
            parts_left: HashMap::new(),
            stripe,
        }
    }

    /// Appends to `out` the completions of the frames the kernel has taken whole (`sent`): a
    /// striped write completes with the last of its parts.
    pub(super) fn complete_sent(&mut self, sent: Vec<Sent>, out: &mut Vec<Completion>) {
        for s in sent {
            if s.part {
                let Some(left) = self.parts_left.get_mut(&s.wr_id) else {
                    continue;
                };
                *left -= 1;
                if *left > 0 {
                    continue;
                }
                self.parts_left.remove(&s.wr_id);
            }
            out.push(if s.is_send {
                Completion::SendDone { wr_id: s.wr_id }
            } else {
                Completion::WriteDone { wr_id: s.wr_id }
            });
        }
    }
}

/// A rank's TCP connections to all peers.
#[derive(Debug)]
pub struct TcpEndpoint {
    rank: usize,
    world: usize,
    pub(super) peers: Vec<Option<Peer>>,
    regions: RegionTable,
    pollfds: Vec<libc::pollfd>,
    pub(super) done: Vec<Completion>,
    /// The window every peer's capabilities report.
    window: Option<usize>,
    /// Connections on first use (see [`super::lazy`]); `None`: every peer was connected at
    /// setup.
    pub(super) lazy: Option<Lazy>,
}

impl TcpEndpoint {
    /// An endpoint of `rank` over connected peers (`None` at `rank`).
    pub(super) fn new(
        rank: usize,
        world: usize,
        peers: Vec<Option<Peer>>,
        window: Option<usize>,
    ) -> TcpEndpoint {
        TcpEndpoint {
            window,
            rank,
            world,
            peers,
            regions: RegionTable::new(rank),
            pollfds: Vec::new(),
            done: Vec::new(),
            lazy: None,
        }
    }

    fn peer_mut(&mut self, peer: usize, op: &'static str) -> Result<&mut Peer> {
        let rank = self.rank;
        let world = self.world;
        let lazy = self.lazy.is_some();
        let p = self
            .peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| TransportError::Invalid {
                rank,
                op,
                msg: if lazy && peer < world && peer != rank {
                    format!("rank {peer} is not connected yet (connect to it first)")
                } else {
                    format!("peer {peer} is not another rank of a world of {world}")
                },
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

    /// Queues `item` on the peer's next stream in turn.
    fn enqueue(&mut self, peer: usize, item: TxItem, op: &'static str) -> Result<()> {
        let rank = self.rank;
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
        self.push(peer, i, item, op)
    }

    /// Queues `item` on stream `i` of `peer`, and sends at once if nothing was queued there: a
    /// small message then leaves without waiting for the next poll.
    fn push(&mut self, peer: usize, i: usize, item: TxItem, op: &'static str) -> Result<()> {
        let rank = self.rank;
        let mut done = Vec::new();
        self.peer_mut(peer, op)?;
        let p = self.peers[peer].as_mut().expect("peer_mut found the peer");
        let st = &mut p.streams[i];
        st.txq.push_back(item);
        if st.txq.len() == 1
            && let Err(e) = flush(st, &mut done)
        {
            st.tx_failed = true;
            st.txq.clear();
            return Err(TransportError::Io {
                rank,
                peer,
                op,
                source: e,
            });
        }
        p.complete_sent(done, &mut self.done);
        Ok(())
    }

    /// The streams a write of `total` bytes with immediate to `peer` is striped over, if it
    /// is: the peer's streams, when the peer is on another host, there are several, none has
    /// failed, and the write is at least [`STRIPE_MIN`].
    fn stripes_for(&self, peer: usize, total: usize) -> Option<usize> {
        let p = self.peers.get(peer)?.as_ref()?;
        let k = p.streams.len();
        (p.stripe
            && k >= 2
            && k <= usize::from(u8::MAX)
            && total >= STRIPE_MIN
            && p.broken.is_none()
            && p.streams.iter().all(|st| !st.tx_failed))
        .then_some(k)
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

    fn caps(&self, peer: usize) -> PeerCaps {
        if peer == self.rank {
            return PeerCaps::plain(Route::Own);
        }
        PeerCaps {
            window: self.window,
            connected: self.peers.get(peer).is_some_and(Option::is_some),
            ..PeerCaps::plain(Route::Tcp)
        }
    }

    fn board(&mut self) -> Option<&mut dyn Board> {
        None
    }

    fn shared_memory(&mut self) -> Option<&mut dyn SharedMemory> {
        None
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
        if let (Some(imm), Some(k)) = (imm, self.stripes_for(peer, total)) {
            // Part i of k on stream i: shares of a multiple of 64 bytes, the last the rest.
            let share = total.div_ceil(k).next_multiple_of(64);
            let spans: Vec<(usize, usize)> = sges.iter().map(|s| (s.addr, s.len)).collect();
            self.peers[peer]
                .as_mut()
                .expect("stripes_for found the peer")
                .parts_left
                .insert(wr_id, k);
            for i in 0..k {
                let (a, b) = ((i * share).min(total), ((i + 1) * share).min(total));
                let hdr = FrameHeaderRepr::WritePart {
                    rkey: remote.rkey,
                    offset: offset + a as u64,
                    len: (b - a) as u32,
                    imm,
                    part: i as u8,
                    parts: k as u8,
                }
                .to_bytes();
                let item = TxItem {
                    hdr,
                    sges: sub_spans(&spans, a, b),
                    _owned: Vec::new(),
                    wr_id,
                    is_send: false,
                    part: true,
                };
                self.push(peer, i, item, "post_write")?;
            }
            return Ok(());
        }
        let hdr = FrameHeaderRepr::Write {
            rkey: remote.rkey,
            offset,
            len: total as u32,
            imm,
        }
        .to_bytes();
        let item = TxItem {
            hdr,
            sges: sges.iter().map(|s| (s.addr, s.len)).collect(),
            _owned: Vec::new(),
            wr_id,
            is_send: false,
            part: false,
        };
        self.enqueue(peer, item, "post_write")
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        check_send_len(self.rank, data.len())?;
        let hdr = FrameHeaderRepr::Send {
            len: data.len() as u32,
        }
        .to_bytes();
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
                part: false,
            },
            "post_send",
        )
    }

    fn close(&mut self, timeout: Duration) {
        self.close_gracefully(timeout);
    }

    fn connect(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        if self.lazy.is_none() {
            // Every peer was connected at setup.
            return Ok(());
        }
        self.connect_lazy(peers, timeout)
    }

    fn peer_alive(&self, peer: usize) -> bool {
        match self.peers.get(peer) {
            Some(Some(p)) => p.broken.is_none(),
            // Not connected yet: nothing is known against it.
            Some(None) => self.lazy.is_some() && peer != self.rank,
            None => false,
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let rank = self.rank;
        if self.lazy.as_mut().is_some_and(Lazy::accept_due) {
            self.accept_pending()?;
        }
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
            let nstreams = p.streams.len();
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
                rx_stream(
                    rank,
                    peer,
                    i,
                    nstreams,
                    st,
                    &mut p.stripes,
                    &self.regions,
                    out,
                )?;
            }
            // Only once every stream is drained: data a peer sent on one stream before it
            // closed must not be lost because another stream ended first.
            if p.streams.iter().all(|st| st.eof) {
                p.broken = Some("the peer closed the connection".into());
            }
            p.complete_sent(done, out);
        }
        Ok(())
    }

    fn tx_pending(&self) -> bool {
        !self.done.is_empty()
            || self.peers.iter().flatten().any(|p| {
                p.broken.is_none()
                    && p.streams
                        .iter()
                        .any(|st| !st.tx_failed && !st.txq.is_empty())
            })
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
        // A peer's dial wakes a rank that waits for its first connection.
        if let Some(lz) = self.lazy.as_ref().filter(|lz| lz.missing > 0) {
            self.pollfds.push(libc::pollfd {
                fd: lz.listener_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
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

/// The spans covering bytes `a..b` of the payload that `spans` (address, length) make up.
fn sub_spans(spans: &[(usize, usize)], a: usize, b: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    for &(addr, len) in spans {
        let (lo, hi) = (a.max(at), b.min(at + len));
        if lo < hi {
            out.push((addr + (lo - at), hi - lo));
        }
        at += len;
        if at >= b {
            break;
        }
    }
    out
}
