//! A fault injector that wraps any [`Endpoint`]: drops, corrupts, delays writes, or kills the
//! endpoint after a number of writes.
//!
//! [`FaultyEndpoint`] composes with every backend, as smoltcp's `phy` middlewares do: it
//! implements the whole [`Endpoint`] trait by delegation and intercepts only
//! [`post_write`](Endpoint::post_write) (and, once killed, every call). The faults are drawn
//! from a seeded generator, so a given [`FaultConfig`] and sequence of calls always injects the
//! same faults in the same places.
//!
//! - **Drop**: the write is acknowledged locally ([`Completion::WriteDone`] on the next poll)
//!   but never reaches the peer, as a lost packet without retransmission would.
//! - **Corrupt**: one byte of the payload is flipped on the way out. The gather list points at
//!   the caller's memory, which must not change, so the wrapper copies the last non-empty entry
//!   of the gather list (in a header-then-payload write, the payload) into a buffer of its own,
//!   registered with the inner endpoint, flips one byte there and posts that copy instead. The
//!   copy lives until the write's [`Completion::WriteDone`] has been polled.
//! - **Delay**: the write is held and posted by the first [`poll`](Endpoint::poll) after the
//!   delay has passed; held writes keep their order.
//! - **Kill**: after `kill_after_writes` writes the endpoint behaves as if its process had died:
//!   every call fails with [`TransportError::PeerClosed`], every peer is reported as not alive,
//!   and the inner endpoint is closed so that its peers can notice.
//!
//! - **Corrupt sends**: one byte of a two-sided message (at or past `corrupt_skip`, to aim at
//!   a payload behind a header) is flipped in a copy on the way out.
//! - **Corrupt postings**: the wrapper offers the inner endpoint's [`Board`] wrapped: a peer's
//!   posting this rank reads (the link from that peer) may have one byte flipped in what is
//!   copied out, at or past `corrupt_skip`. A posting is read by every peer, so the fault sits
//!   on the reading side, where it names one link.
//!
//! - **Replay**: a [`Replayer`] taken from the wrapper (it may be moved to another thread)
//!   records where the writes went and posts one of them again, with a payload of its own, at
//!   the wrapper's next poll: the write a replayed clear-to-send or a buggy peer would make
//!   after its operation has ended.
//!
//! `only_peer` restricts all of this to one peer (a single bad link): the writes and sends to
//! it and the postings read from it; the rest and registrations pass through untouched. The
//! wrapper forwards every capability of the inner endpoint ([`Endpoint::caps`], its board and
//! its shared memory), so wrapping changes nothing but the faults.

use crate::caps::{Board, PeerCaps, SharedMemory};
use crate::error::{Result, TransportError};
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion, Sge};
use crate::wire::RemoteRegion;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a [`FaultyEndpoint`] injects. [`Default`] injects nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultConfig {
    /// Seed of the generator that decides which writes are dropped or corrupted, and where.
    pub seed: u64,
    /// Probability (0.0 to 1.0) that a write is dropped: acknowledged but never delivered.
    pub drop_writes: f64,
    /// Probability (0.0 to 1.0) that a delivered write has one payload byte flipped.
    pub corrupt_writes: f64,
    /// Hold every write this long before posting it.
    pub delay: Option<Duration>,
    /// After this many writes, the endpoint dies: every call fails, every peer looks gone.
    pub kill_after_writes: Option<u64>,
    /// Probability (0.0 to 1.0) that a two-sided message has one byte flipped.
    pub corrupt_sends: f64,
    /// Probability (0.0 to 1.0) that a board posting read from a peer has one byte flipped.
    pub corrupt_postings: f64,
    /// Sends and postings are corrupted at or past this byte (a message no longer is left
    /// whole): a test aims at the payload behind a header.
    pub corrupt_skip: usize,
    /// Only the writes and sends to this peer, and the postings read from it, are subject to
    /// faults (and the writes counted for `kill_after_writes`).
    pub only_peer: Option<usize>,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            seed: 0,
            drop_writes: 0.0,
            corrupt_writes: 0.0,
            delay: None,
            kill_after_writes: None,
            corrupt_sends: 0.0,
            corrupt_postings: 0.0,
            corrupt_skip: 0,
            only_peer: None,
        }
    }
}

/// What a [`FaultyEndpoint`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Writes subject to faults (to `only_peer`, or all of them).
    pub writes: u64,
    /// Writes dropped.
    pub dropped: u64,
    /// Writes posted with a flipped byte.
    pub corrupted: u64,
    /// Writes held for the delay.
    pub delayed: u64,
    /// Two-sided messages sent with a flipped byte.
    pub corrupted_sends: u64,
    /// Board postings read with a flipped byte.
    pub corrupted_postings: u64,
    /// Writes replayed through the [`Replayer`].
    pub replayed: u64,
    /// Whether the endpoint has been killed.
    pub killed: bool,
}

/// Where one write went: its peer, the remote region and the span in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRecord {
    /// The target rank.
    pub peer: usize,
    /// The region the write named.
    pub remote: RemoteRegion,
    /// Offset of the write in the region.
    pub offset: u64,
    /// Bytes written.
    pub len: u64,
}

#[derive(Debug, Default)]
struct ReplayState {
    log: VecDeque<WriteRecord>,
    queue: Vec<(WriteRecord, u8)>,
}

/// The replayer's shared part: two flags the wrapper reads on every write and poll without
/// taking the lock, and the log and queue behind it.
#[derive(Debug, Default)]
struct ReplayShared {
    record: AtomicBool,
    queued: AtomicBool,
    state: Mutex<ReplayState>,
}

/// Most writes a [`Replayer`] remembers (the oldest are forgotten first).
const REPLAY_LOG: usize = 4096;

/// Work request ids of replayed writes: their completions are the wrapper's, not the caller's.
const REPLAY_WR_ID: u64 = 0xfa17_0000_0000_0000;

/// Replays writes through a [`FaultyEndpoint`] from any thread (see the module documentation).
#[derive(Clone, Debug, Default)]
pub struct Replayer(Arc<ReplayShared>);

impl Replayer {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReplayState> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts (or stops) recording where the writes go.
    pub fn record(&self, on: bool) {
        self.0.record.store(on, Ordering::Relaxed);
    }

    /// The writes recorded so far, oldest first.
    pub fn writes(&self) -> Vec<WriteRecord> {
        self.lock().log.iter().copied().collect()
    }

    /// Posts a write to `w`'s peer, region and span again at the wrapper's next poll, its
    /// payload `w.len` bytes of `fill`.
    pub fn replay(&self, w: WriteRecord, fill: u8) {
        self.lock().queue.push((w, fill));
        self.0.queued.store(true, Ordering::Release);
    }
}

/// A write held for the delay.
#[derive(Debug)]
struct Held {
    due: Instant,
    peer: usize,
    sges: Vec<Sge>,
    remote: RemoteRegion,
    offset: u64,
    imm: Option<u32>,
    wr_id: u64,
}

/// A corrupted copy of a gather entry, registered with the inner endpoint.
#[derive(Debug)]
struct OwnedCopy {
    wr_id: u64,
    mr: MemoryRegion,
    /// Keeps the memory `mr` describes alive; never read by the wrapper once posted.
    _buf: Box<[u8]>,
}

/// An [`Endpoint`] that injects faults into the writes of the endpoint it wraps.
///
/// See the [module documentation](self) for what each fault does.
#[derive(Debug)]
pub struct FaultyEndpoint<E: Endpoint> {
    // Declared first so that it is dropped first: the inner endpoint may read the corrupted
    // copies below until it is gone.
    inner: E,
    copies: Vec<OwnedCopy>,
    cfg: FaultConfig,
    rng: u64,
    held: VecDeque<Held>,
    /// Local completions of dropped writes, handed out by the next poll.
    acked: Vec<u64>,
    stats: FaultStats,
    /// The inner endpoint's board capacity, if it has a board.
    board_capacity: Option<usize>,
    replayer: Replayer,
}

impl<E: Endpoint> FaultyEndpoint<E> {
    /// Wraps `inner`.
    pub fn new(mut inner: E, cfg: FaultConfig) -> Self {
        let board_capacity = inner.board().map(|b| b.capacity());
        FaultyEndpoint {
            board_capacity,
            inner,
            copies: Vec::new(),
            rng: cfg.seed ^ 0x6a09_e667_f3bc_c908,
            cfg,
            held: VecDeque::new(),
            acked: Vec::new(),
            stats: FaultStats::default(),
            replayer: Replayer::default(),
        }
    }

    /// A handle that records this endpoint's writes and replays them.
    pub fn replayer(&self) -> Replayer {
        self.replayer.clone()
    }

    /// Notes where a write goes, when the replayer records.
    fn note(&self, peer: usize, remote: RemoteRegion, offset: u64, sges: &[Sge]) {
        if !self.replayer.0.record.load(Ordering::Relaxed) {
            return;
        }
        let len = sges.iter().map(|s| s.len as u64).sum();
        let mut st = self.replayer.lock();
        if st.log.len() >= REPLAY_LOG {
            st.log.pop_front();
        }
        st.log.push_back(WriteRecord {
            peer,
            remote,
            offset,
            len,
        });
    }

    /// Posts the writes queued on the replayer, each from a registered buffer of its own.
    fn post_replays(&mut self) -> Result<()> {
        if !self.replayer.0.queued.swap(false, Ordering::Acquire) {
            return Ok(());
        }
        let queued = std::mem::take(&mut self.replayer.lock().queue);
        for (w, fill) in queued {
            let mut buf: Box<[u8]> = vec![fill; w.len as usize].into();
            // SAFETY: the buffer is owned by `self.copies` until the write's WriteDone has
            // been polled, as for corrupted copies.
            let mr = unsafe {
                self.inner
                    .register(buf.as_mut_ptr(), buf.len(), Access::LOCAL_READ)
            }?;
            let wr_id = REPLAY_WR_ID + self.stats.replayed;
            self.stats.replayed += 1;
            self.copies.push(OwnedCopy {
                wr_id,
                mr,
                _buf: buf,
            });
            let sge = Sge {
                addr: mr.addr,
                len: mr.len,
                lkey: mr.lkey,
            };
            // SAFETY: the span is the registered buffer kept above.
            unsafe {
                self.inner
                    .post_write(w.peer, &[sge], w.remote, w.offset, None, wr_id)
            }?;
        }
        Ok(())
    }

    /// The wrapped endpoint.
    pub fn inner(&self) -> &E {
        &self.inner
    }

    /// The configuration.
    pub fn config(&self) -> &FaultConfig {
        &self.cfg
    }

    /// Counts of the faults injected so far.
    pub fn stats(&self) -> FaultStats {
        self.stats
    }

    /// Next value of the generator (splitmix64).
    fn next_u64(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform draw in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn dead(&self, peer: usize, during: &str) -> TransportError {
        TransportError::PeerClosed {
            rank: self.inner.rank(),
            peer,
            during: format!(
                "{during}: endpoint killed by the fault injector after {} writes",
                self.stats.writes
            ),
        }
    }

    /// The peer named in errors of calls that concern no peer.
    fn some_peer(&self) -> usize {
        self.cfg
            .only_peer
            .unwrap_or_else(|| (self.inner.rank() + 1) % self.inner.world().max(1))
    }

    fn kill(&mut self) {
        self.stats.killed = true;
        self.held.clear();
        self.acked.clear();
        self.inner.close(Duration::ZERO);
    }

    /// Replaces the last non-empty entry of `sges` by a registered copy with one byte flipped.
    ///
    /// # Safety
    ///
    /// The spans of `sges` must be readable.
    unsafe fn corrupt(&mut self, sges: &mut [Sge], wr_id: u64) -> Result<bool> {
        let Some(i) = sges.iter().rposition(|s| s.len > 0) else {
            return Ok(false);
        };
        let s = sges[i];
        // SAFETY: the caller guarantees the span is readable for its length.
        let src = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.len) };
        let mut buf: Box<[u8]> = src.into();
        let at = (self.next_u64() % s.len as u64) as usize;
        let bit = 1u8 << (self.next_u64() % 8);
        buf[at] ^= bit;
        // SAFETY: the buffer is owned by `self.copies` until the write's WriteDone has been
        // polled (then deregistered before it is freed) or until the inner endpoint is dropped
        // (declared before `copies`, so dropped first).
        let mr = unsafe {
            self.inner
                .register(buf.as_mut_ptr(), buf.len(), Access::LOCAL_READ)
        }?;
        sges[i] = Sge {
            addr: mr.addr,
            len: mr.len,
            lkey: mr.lkey,
        };
        self.copies.push(OwnedCopy {
            wr_id,
            mr,
            _buf: buf,
        });
        Ok(true)
    }

    /// Whether traffic with `peer` is subject to faults.
    fn subject(&self, peer: usize) -> bool {
        self.cfg.only_peer.is_none_or(|p| p == peer)
    }

    /// Flips one bit of `data` at or past `corrupt_skip` when the draw falls under `p`;
    /// whether it did.
    fn maybe_flip(&mut self, data: &mut [u8], p: f64) -> bool {
        let roll = self.next_f64();
        let skip = self.cfg.corrupt_skip;
        if roll >= p || data.len() <= skip {
            return false;
        }
        let at = skip + (self.next_u64() % (data.len() - skip) as u64) as usize;
        data[at] ^= 1u8 << (self.next_u64() % 8);
        true
    }

    /// The inner endpoint's board; an error once killed or when there is none.
    fn inner_board(&mut self, op: &'static str) -> Result<&mut dyn Board> {
        if self.stats.killed {
            return Err(self.dead(self.some_peer(), op));
        }
        let rank = self.inner.rank();
        self.inner.board().ok_or(TransportError::Invalid {
            rank,
            op,
            msg: "the wrapped endpoint has no board".into(),
        })
    }

    /// Posts the held writes whose delay has passed.
    fn release_due(&mut self) -> Result<()> {
        let now = Instant::now();
        while self.held.front().is_some_and(|h| h.due <= now) {
            let h = self.held.pop_front().expect("front");
            // SAFETY: the caller of `post_write` keeps the spans valid until WriteDone, which
            // the inner endpoint produces only after this post; corrupted copies are ours.
            unsafe {
                self.inner
                    .post_write(h.peer, &h.sges, h.remote, h.offset, h.imm, h.wr_id)
            }?;
        }
        Ok(())
    }
}

impl<E: Endpoint> Endpoint for FaultyEndpoint<E> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    /// The inner endpoint's name: the wrapper is transparent in logs.
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        if self.stats.killed {
            return Err(self.dead(self.some_peer(), "register"));
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.register(addr, len, access) }
    }

    fn deregister(&mut self, mr: &MemoryRegion) {
        self.inner.deregister(mr);
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
        if self.stats.killed {
            return Err(self.dead(peer, "post_write"));
        }
        self.note(peer, remote, offset, sges);
        if self.cfg.only_peer.is_some_and(|p| p != peer) {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe {
                self.inner
                    .post_write(peer, sges, remote, offset, imm, wr_id)
            };
        }
        self.stats.writes += 1;
        // Two draws per write whatever the probabilities, so that changing one probability
        // does not move the other faults.
        let drop_roll = self.next_f64();
        let corrupt_roll = self.next_f64();
        let result = if drop_roll < self.cfg.drop_writes {
            self.stats.dropped += 1;
            self.acked.push(wr_id);
            Ok(())
        } else {
            let mut sges = sges.to_vec();
            if corrupt_roll < self.cfg.corrupt_writes {
                // SAFETY: the caller guarantees the spans are valid.
                if unsafe { self.corrupt(&mut sges, wr_id) }? {
                    self.stats.corrupted += 1;
                }
            }
            match self.cfg.delay {
                Some(d) => {
                    self.stats.delayed += 1;
                    self.held.push_back(Held {
                        due: Instant::now() + d,
                        peer,
                        sges,
                        remote,
                        offset,
                        imm,
                        wr_id,
                    });
                    Ok(())
                }
                // SAFETY: the caller's spans are valid until WriteDone, and corrupted copies
                // are kept until then.
                None => unsafe {
                    self.inner
                        .post_write(peer, &sges, remote, offset, imm, wr_id)
                },
            }
        };
        if self
            .cfg
            .kill_after_writes
            .is_some_and(|n| self.stats.writes >= n)
        {
            self.kill();
        }
        result
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        if self.stats.killed {
            return Err(self.dead(peer, "post_send"));
        }
        if self.subject(peer) && self.cfg.corrupt_sends > 0.0 {
            let mut copy = data.to_vec();
            if self.maybe_flip(&mut copy, self.cfg.corrupt_sends) {
                self.stats.corrupted_sends += 1;
                return self.inner.post_send(peer, &copy, wr_id);
            }
        }
        self.inner.post_send(peer, data, wr_id)
    }

    fn connect(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        if self.stats.killed {
            return Err(self.dead(self.some_peer(), "connect"));
        }
        self.inner.connect(peers, timeout)
    }

    fn peer_alive(&self, peer: usize) -> bool {
        !self.stats.killed && self.inner.peer_alive(peer)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        if self.stats.killed {
            return Err(self.dead(self.some_peer(), "poll"));
        }
        self.release_due()?;
        self.post_replays()?;
        out.extend(
            self.acked
                .drain(..)
                .map(|wr_id| Completion::WriteDone { wr_id }),
        );
        let from = out.len();
        self.inner.poll(out)?;
        if !self.copies.is_empty() {
            for c in &out[from..] {
                if let Completion::WriteDone { wr_id } = c
                    && let Some(i) = self.copies.iter().position(|x| x.wr_id == *wr_id)
                {
                    let copy = self.copies.swap_remove(i);
                    self.inner.deregister(&copy.mr);
                }
            }
            // The caller never posted the replayed writes: their completions stay here.
            if self.stats.replayed > 0 {
                let replay = |c: &Completion| {
                    matches!(c, Completion::WriteDone { wr_id }
                        if (REPLAY_WR_ID..REPLAY_WR_ID + (1 << 32)).contains(wr_id))
                };
                let tail: Vec<Completion> = out.drain(from..).filter(|c| !replay(c)).collect();
                out.extend(tail);
            }
        }
        Ok(())
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        if self.stats.killed {
            return Err(self.dead(self.some_peer(), "wait"));
        }
        if !self.acked.is_empty() {
            return Ok(());
        }
        let timeout = match self.held.front() {
            Some(h) => timeout.min(h.due.saturating_duration_since(Instant::now())),
            None => timeout,
        };
        self.inner.wait(timeout)
    }

    fn wait_on(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        if self.stats.killed || !self.acked.is_empty() || !self.held.is_empty() {
            return self.wait(timeout);
        }
        self.inner.wait_on(peers, timeout)
    }

    fn tx_pending(&self) -> bool {
        !self.held.is_empty() || self.inner.tx_pending()
    }

    fn close(&mut self, timeout: Duration) {
        if !self.stats.killed {
            self.inner.close(timeout);
        }
    }

    fn caps(&self, peer: usize) -> PeerCaps {
        self.inner.caps(peer)
    }

    /// The inner endpoint's board, wrapped: postings read through it are subject to faults.
    fn board(&mut self) -> Option<&mut dyn Board> {
        self.board_capacity.map(|_| self as &mut dyn Board)
    }

    fn shared_memory(&mut self) -> Option<&mut dyn SharedMemory> {
        self.inner.shared_memory()
    }

    fn unused_peer_areas(&mut self, peers: &[usize]) {
        self.inner.unused_peer_areas(peers);
    }
}

impl<E: Endpoint> Board for FaultyEndpoint<E> {
    fn capacity(&self) -> usize {
        self.board_capacity.unwrap_or(0)
    }

    fn post(&mut self, seq: u64, data: &[u8]) -> Result<bool> {
        self.inner_board("board post")?.post(seq, data)
    }

    fn read(&mut self, peer: usize, seq: u64, out: &mut Vec<u8>) -> Result<bool> {
        let got = self.inner_board("board read")?.read(peer, seq, out)?;
        if got && self.subject(peer) && self.maybe_flip(out, self.cfg.corrupt_postings) {
            self.stats.corrupted_postings += 1;
        }
        Ok(got)
    }

    fn release(&mut self, seq: u64) -> Result<()> {
        self.inner_board("board release")?.release(seq)
    }

    fn watch(&mut self, seq: u64) {
        if let Ok(b) = self.inner_board("board watch") {
            b.watch(seq);
        }
    }
}
