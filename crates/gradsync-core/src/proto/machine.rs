//! The protocol machine of one rank: takes the running operation's schedule and the events of
//! the transport, and hands out what to do (see [`super::manual`]).

use super::action::{Action, Target};
use super::call::{Call, Mode, PostedRecv, PostedSend, Queues};
use super::eager::{Expected, Parts};
use super::error::{ProtoError, Violation, mismatch};
use super::link::{IMM_DIRECT, Link, MAX_OFFERS};
use super::probe::{Probe, Verdict};
use crate::schedule::{Buf, Loc, Op, Schedule};
use crate::wire::{
    Control, ControlRepr, Cts, DATA_HEADER_LEN, DataHeader, DataHeaderRepr, Signature, is_data,
};
use crate::{Collective, ReduceOp};
use std::time::{Duration, Instant};

/// Settings of a protocol machine; alike on every rank of a communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// This rank.
    pub rank: usize,
    /// Ranks of the communicator.
    pub world: usize,
    /// Slots per sender in every inbox.
    pub nslots: usize,
    /// Payload bytes per slot.
    pub slot_bytes: usize,
    /// Copy-receives of at least this many bytes ask for a direct write (clear-to-send), unless
    /// a peer's own value is set with [`Protocol::set_direct_min`].
    pub direct_min: usize,
    /// Every message carries the CRC32C of its payload, checked before it is used; direct
    /// writes carry no header, so there are none.
    pub checksum: bool,
}

impl Config {
    /// Bytes of a slot (header and payload) rounded to 64.
    pub fn stride(&self) -> usize {
        (DATA_HEADER_LEN + self.slot_bytes).div_ceil(64) * 64
    }

    /// Bytes of an inbox: a part of `nslots` slots per sender.
    pub fn inbox_len(&self) -> usize {
        self.stride() * self.nslots * self.world
    }
}

/// Idle time after which a waiting rank returns every credit it holds.
pub const IDLE_CREDIT_RETURN: Duration = Duration::from_micros(20);

/// How long a sender waits, with nothing moving, for the clear-to-send of a message its
/// receiver copies into place (all-to-all(v), all-gather) before it sends through a slot.
pub const OFFER_PATIENCE: Duration = Duration::from_micros(100);

/// A pass posts at most one direct write of at least this many bytes to each peer; the next
/// waits for a new round, after the driver has polled. A transport that copies during the post
/// (shared memory) has completed the write by then, so the local ops waiting for it (the
/// all-gather's and all-to-all's copy of the rank's own block, piece by piece) run between the
/// writes and read their source from the cache the write just filled.
pub const PACE_MIN: usize = 64 << 10;

/// How often a rank that waits in a scheduled collective looks at its peers' boards for a
/// posting of the same operation (a mismatch: the peer runs it eagerly).
pub const BOARD_CHECK_EVERY: Duration = Duration::from_millis(1);

/// What a finished (or failed) operation leaves behind.
#[derive(Debug)]
pub struct Finished {
    /// Its schedule, for reuse.
    pub sched: Box<Schedule>,
    /// Whether every op completed.
    pub completed: bool,
    /// Its signature.
    pub sig: Signature,
}

/// The per-rank protocol machine. See the [module docs](super) and [`super::manual`].
#[derive(Debug)]
pub struct Protocol {
    pub(super) cfg: Config,
    pub(super) stride: usize,
    pub(super) links: Vec<Link>,
    pub(super) call: Option<Call>,
    /// The running operation's queues (kept between operations for their allocations).
    pub(super) q: Queues,
    pub(super) parts: Parts,
    /// Eager postings go through the transport's board.
    pub(super) board: bool,
    pub(super) actions: Vec<Action>,
    pub(super) next_wr: u64,
    /// Sequence number of the last operation started.
    pub(super) last_seq: u64,
    /// Sequence number of the last collective (not send/recv, which count per peer) started.
    pub(super) last_coll_seq: u64,
    pub(super) probe: Probe,
    /// Rounds of the driver: retries (a refused posting, a board read that found nothing) wait
    /// for the next one.
    pub(super) round: u64,
    /// The round of the last posting tried, and whether its answer is still due.
    pub(super) post_tried: u64,
    pub(super) post_waiting: bool,
    /// The running eager operation's board release has been handed out.
    pub(super) released: bool,
    /// A finished eager operation's postings, read and not yet released (see `settle`).
    pub(super) release_due: Option<u64>,
    /// The running eager operation's postings are to be watched (for the driver's sleep).
    pub(super) watch_due: bool,
    pub(super) next_board_check: Instant,
    /// When nothing last moved, for the idle credit return.
    pub(super) idle_since: Option<Instant>,
    pub(super) credits_flushed: bool,
    /// Sends of the running operation still wait for their receivers' clear-to-send (until
    /// [`OFFER_PATIENCE`] passes with nothing moving).
    pub(super) patient: bool,
    pub(super) moved: bool,
    /// Something happened since the last pass over the operation: another may do more.
    pub(super) dirty: bool,
    /// Some pair has consumed slots not yet returned.
    pub(super) unreturned: bool,
    /// A posting was refused: try again next round.
    pub(super) retry: bool,
    /// This pass posted a large direct write (see [`PACE_MIN`]): the next pass waits for the
    /// next round.
    pub(super) paced: bool,
    /// The header every peer's (first) message of the running eager operation has, but for
    /// the sender and the checksum; kept from call to call, valid while `expect_on`.
    pub(super) expect: Option<Expected>,
    pub(super) expect_on: bool,
    /// Peers whose board posting the running eager operation waits for: read again every
    /// round, without a pass over the operation.
    pub(super) board_wanted: Vec<usize>,
    /// The driver's clock at its last event or round (when peers were last heard from).
    pub(super) now: Instant,
    /// The shared pool of receive slots that pooled peers' messages are staged in (see
    /// [`Protocol::set_pool`]): its slots, its remote key, the free slots, and the receives
    /// from pooled peers waiting for one, in the order they were issued.
    pub(super) pool_slots: usize,
    pub(super) pool_rkey: u32,
    pub(super) pool_addr: u64,
    pub(super) pool_staged: u64,
    pub(super) pool_free: Vec<u32>,
    pub(super) pool_wait: Vec<(usize, u32)>,
    /// A receive that cannot be staged in a pool slot (larger than one).
    pub(super) pool_err: Option<ProtoError>,
}

/// Whether every receive of `coll` copies what arrives into place (none reduces it), so that a
/// receiver asks for every large enough message to be written straight into place. Of the
/// collectives that [`Collective::moves_only`], broadcast, gather and scatter are left out
/// (broadcast measured slower written in place at 2-4 MiB over shared memory), and
/// point-to-point, whose receiver may post late.
fn receives_only_copy(coll: Collective) -> bool {
    matches!(
        coll,
        Collective::AllToAll | Collective::AllToAllV | Collective::AllGather
    )
}

/// What each pair moves one way in a call of `sig`, in bytes, as both ranks of the pair know
/// it from the signature: an all-to-all's or all-gather's block; `usize::MAX` for the others
/// (an all-to-allv's blocks differ per pair and its signature carries no count).
fn pair_block(sig: &Signature) -> usize {
    match sig.coll {
        Collective::AllToAll | Collective::AllGather => {
            usize::try_from(sig.count).map_or(usize::MAX, |c| c.saturating_mul(sig.dtype.size()))
        }
        _ => usize::MAX,
    }
}

fn buf_index(b: Buf) -> usize {
    match b {
        Buf::Input => 0,
        Buf::Output => 1,
        Buf::Scratch => 2,
    }
}

impl Protocol {
    /// A machine with every pair idle.
    pub fn new(cfg: Config, now: Instant) -> Self {
        Protocol {
            cfg,
            stride: cfg.stride(),
            links: (0..cfg.world)
                .map(|_| Link::new(cfg.nslots, cfg.direct_min))
                .collect(),
            call: None,
            q: Queues::default(),
            parts: Parts::new(cfg.world),
            board: false,
            actions: Vec::new(),
            next_wr: 1,
            last_seq: 0,
            last_coll_seq: 0,
            probe: Probe::new(cfg.world),
            round: 1,
            post_tried: 0,
            post_waiting: false,
            released: false,
            release_due: None,
            watch_due: false,
            next_board_check: now,
            idle_since: None,
            credits_flushed: false,
            patient: false,
            moved: false,
            dirty: false,
            retry: false,
            paced: false,
            unreturned: false,
            board_wanted: Vec::new(),
            expect: None,
            expect_on: false,
            now,
            pool_slots: 0,
            pool_rkey: 0,
            pool_addr: 0,
            pool_staged: 0,
            pool_free: Vec::new(),
            pool_wait: Vec::new(),
            pool_err: None,
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Limits the messages in flight to `peer` to `window` slots (at least 1, at most the
    /// inbox's slots per peer). Before any traffic, with the same value on both ranks.
    pub fn set_window(&mut self, peer: usize, window: usize) {
        let w = window.clamp(1, self.cfg.nslots);
        if let Some(l) = self.links.get_mut(peer).filter(|l| !l.pooled) {
            l.window = w;
            l.credits = w;
        }
    }

    /// Starts the pair with `peer` at message counters `tx` (this rank's sends) and `rx` (its
    /// receives) instead of 0: the peer's counters must mirror them. For tests of the 31-bit
    /// immediate's wrap.
    pub(crate) fn set_counters(&mut self, peer: usize, tx: u64, rx: u64) {
        if let Some(l) = self.links.get_mut(peer) {
            l.tx_ctr = tx;
            l.rx_ctr = rx;
        }
    }

    /// The window of the pair with `peer`.
    pub fn window(&self, peer: usize) -> usize {
        self.links.get(peer).map_or(0, |l| l.window)
    }

    /// The size from which the messages of a collective that only moves data (all-to-all(v),
    /// all-gather) between this rank and `peer` are direct writes (`usize::MAX`: never), in a
    /// call whose blocks (what the pair moves one way) are `block` bytes.
    pub fn move_direct_min(&self, peer: usize, block: usize) -> usize {
        self.links
            .get(peer)
            .map_or(usize::MAX, |l| l.direct_min_for(true, block))
    }

    /// Sets the size from which copy-receives from `peer` ask for direct writes
    /// (`usize::MAX`: never): `min` in every collective, `move_min` in the collectives that
    /// only move data (all-to-all(v), all-gather), whose senders wait for the offer, where
    /// the pair's block in the call is at least `move_block` bytes (smaller blocks follow
    /// `min`; an all-to-allv's blocks count as large, its messages alone decide). Both ranks
    /// of a pair must set the same values, or the sends wait [`OFFER_PATIENCE`] for offers
    /// that do not come.
    pub fn set_direct_min(&mut self, peer: usize, min: usize, move_min: usize, move_block: usize) {
        if let Some(l) = self.links.get_mut(peer) {
            l.direct_min = min;
            l.move_direct_min = move_min;
            l.move_block_min = move_block;
        }
    }

    /// Lets eager operations post on the transport's board (every rank must agree).
    pub fn enable_board(&mut self, on: bool) {
        self.board = on;
    }

    /// Whether eager operations post on the board.
    pub fn board(&self) -> bool {
        self.board
    }

    /// Starts an operation: `sched` runs in `mode`; `rkeys` are the remote keys of the
    /// driver's Input, Output and Scratch regions (what a clear-to-send names).
    ///
    /// # Panics
    ///
    /// If an operation is running (the driver finishes one before it starts the next).
    pub fn start(
        &mut self,
        sig: Signature,
        sched: Box<Schedule>,
        mode: Mode,
        rkeys: [u32; 3],
        now: Instant,
    ) {
        assert!(self.call.is_none(), "an operation is running");
        self.now = now;
        self.last_seq = sig.seq;
        if sig.coll != Collective::SendRecv {
            self.last_coll_seq = sig.seq;
        }
        self.q.reset(self.cfg.world);
        if self.pool_free.len() != self.pool_slots || !self.pool_wait.is_empty() {
            // A failed operation may have left slots taken.
            self.pool_free = (0..self.pool_slots as u32).rev().collect();
            self.pool_wait.clear();
        }
        self.post_waiting = false;
        self.post_tried = 0;
        self.released = false;
        self.idle_since = None;
        self.credits_flushed = false;
        self.patient = true;
        self.dirty = true;
        self.board_wanted.clear();
        if let Some(seq) = self.release_due.take() {
            // First, before this operation's posting, which then carries the release to the
            // peers: a peer about to reuse that slot finds it there, without a look at this
            // rank's release line.
            self.actions.push(Action::BoardRelease { seq });
        }
        self.expect_on = mode == Mode::Eager;
        if self.expect_on {
            Expected::refresh(&mut self.expect, sig);
        }
        // Watched once the first messages are out (see `advance`).
        self.watch_due = mode == Mode::Eager && self.board;
        self.call = Some(Call {
            sig,
            sched,
            mode,
            rkeys,
            started: now,
        });
    }

    /// The running operation's signature.
    #[inline]
    pub fn running(&self) -> Option<&Signature> {
        self.call.as_ref().map(|c| &c.sig)
    }

    /// The running operation's mode.
    #[inline]
    pub fn mode(&self) -> Option<Mode> {
        self.call.as_ref().map(|c| c.mode)
    }

    /// When the running operation started.
    #[inline]
    pub fn started(&self) -> Option<Instant> {
        self.call.as_ref().map(|c| c.started)
    }

    /// The running operation's schedule.
    #[inline]
    pub fn schedule(&self) -> Option<&Schedule> {
        self.call.as_ref().map(|c| &*c.sched)
    }

    /// Whether the running operation is complete: every op done, every action handed out.
    #[inline]
    pub fn is_done(&self) -> bool {
        self.call
            .as_ref()
            .is_some_and(|c| c.is_done() && self.actions.is_empty())
    }

    fn needs_release(&self, c: &Call) -> bool {
        c.mode == Mode::Eager && self.board
    }

    /// Ends the running operation, done or not, and gives its schedule back. After a failure
    /// nothing of it is handed out again.
    pub fn finish(&mut self) -> Option<Finished> {
        let completed = self.is_done();
        let c = self.call.take()?;
        if !completed {
            self.q.abandon();
        }
        self.board_wanted.clear();
        self.actions
            .retain(|a| matches!(a, Action::Control { .. } | Action::BoardRelease { .. }));
        Some(Finished {
            completed,
            sched: c.sched,
            sig: c.sig,
        })
    }

    /// Whether anything moved since the last call (an op issued or completed, a message
    /// consumed, an arrival); clears the mark.
    #[inline]
    pub fn take_moved(&mut self) -> bool {
        std::mem::take(&mut self.moved)
    }

    /// The peers the running operation waits on.
    pub fn waiting_on(&self) -> Vec<usize> {
        if self.call.is_none() {
            return Vec::new();
        }
        self.q.waiting_on(|p| self.links[p].credits)
    }

    /// The peers whose messages the running operation needs before it can move: a receive
    /// outstanding or a send queued (for credits, an offer or a pool grant); else those whose
    /// writes are in flight. A driver may sleep where only these can wake it.
    pub fn wake_peers(&self) -> Vec<usize> {
        if self.call.is_none() {
            return Vec::new();
        }
        self.q.waiting_on(|_| 0)
    }

    /// When `peer` was last heard from, and the sequence number then.
    pub fn last_heard(&self, peer: usize) -> Option<(Instant, u64)> {
        self.links.get(peer).and_then(|l| l.last_heard)
    }

    /// Numbers operations again from `last_coll_seq`, the last collective (and operation)
    /// finished before operations that every rank has finished since, and numbered past it
    /// (the calibration at init). Without it an eager message for the next collective, from
    /// a peer already past it, reads as late while this rank is between operations.
    pub fn renumber(&mut self, last_coll_seq: u64) {
        assert!(self.call.is_none(), "an operation is running");
        self.last_coll_seq = last_coll_seq;
        self.last_seq = last_coll_seq;
    }

    /// The sequence number of the running operation, else of the last one.
    #[inline]
    pub fn current_seq(&self) -> u64 {
        self.call.as_ref().map_or(self.last_seq, |c| c.sig.seq)
    }

    /// A new round of the driver (it has polled the transport): retries wait for it. `now`
    /// is the driver's clock, read when it was idle; idle credits go back after
    /// [`IDLE_CREDIT_RETURN`], and a waiting scheduled operation looks for mismatched board
    /// postings every [`BOARD_CHECK_EVERY`].
    pub fn handle_round(&mut self, now: Instant, idle: bool) {
        self.round += 1;
        self.now = now;
        if std::mem::take(&mut self.retry) {
            self.dirty = true;
        }
        if let Some(c) = &self.call {
            let seq = c.sig.seq;
            for &peer in &self.board_wanted {
                self.actions.push(Action::BoardRead { peer, seq });
            }
        }
        if !idle {
            self.idle_since = None;
            self.credits_flushed = false;
            return;
        }
        let since = *self.idle_since.get_or_insert(now);
        if self.patient && now - since >= OFFER_PATIENCE {
            // No clear-to-send came: the receiver may not offer one (configured otherwise);
            // the sends waiting for one go through slots.
            self.patient = false;
            self.dirty = true;
        }
        if now - since < IDLE_CREDIT_RETURN {
            return;
        }
        if !self.credits_flushed {
            // Nothing moved for a while: hand back every slot, in case the peer waits for them.
            self.return_credits(true);
            self.credits_flushed = true;
        }
        if self.board && now >= self.next_board_check {
            self.next_board_check = now + BOARD_CHECK_EVERY;
            if let Some(c) = &self.call
                && c.mode == Mode::Slots
                && c.sig.coll != Collective::SendRecv
            {
                let seq = c.sig.seq;
                for p in (0..self.cfg.world).filter(|&p| p != self.cfg.rank) {
                    self.actions.push(Action::BoardRead { peer: p, seq });
                }
            }
        }
    }

    /// Returns every consumed slot at once (a driver that stops driving for now).
    pub fn flush_credits(&mut self) {
        self.return_credits(true);
    }

    /// The data header of message `msg` of the running operation, `bytes` of payload from this
    /// rank (without a checksum: the driver computes it where an action asks for one).
    #[inline]
    pub fn data_header(&self, msg: u32, bytes: usize) -> DataHeaderRepr {
        DataHeaderRepr {
            sig: self
                .call
                .as_ref()
                .map(|c| c.sig)
                .expect("an operation is running"),
            msg,
            payload_len: bytes as u32,
            sender: self.cfg.rank as u32,
            crc32c: None,
        }
    }

    /// Every action there is now, moved into `out` (which must be empty), in order: what
    /// [`poll_action`](Self::poll_action) would hand out one at a time. The driver carries them
    /// out and calls again; answers to them (`handle_*`) may make more.
    #[inline]
    pub fn poll_actions(&mut self, out: &mut Vec<Action>) -> Result<(), ProtoError> {
        debug_assert!(out.is_empty());
        loop {
            if !self.actions.is_empty() {
                std::mem::swap(&mut self.actions, out);
                return Ok(());
            }
            if !std::mem::take(&mut self.dirty) {
                return Ok(());
            }
            self.dirty = self.advance()?;
        }
    }

    /// The next thing to do, or `None` until an event (or a new round) makes more possible.
    pub fn poll_action(&mut self) -> Result<Option<Action>, ProtoError> {
        loop {
            if !self.actions.is_empty() {
                return Ok(Some(self.actions.remove(0)));
            }
            // A pass only when something happened since the last: waiting costs nothing.
            if !std::mem::take(&mut self.dirty) {
                return Ok(None);
            }
            // Progress (ops issued or completed) may make more possible at once.
            self.dirty = self.advance()?;
        }
    }

    /// One pass over the running operation: issue what the schedule allows, send what the
    /// protocol allows, consume what arrived, return credits. Whether anything changed.
    fn advance(&mut self) -> Result<bool, ProtoError> {
        let Some(c) = self.call.as_ref() else {
            return Ok(false);
        };
        let eager = c.mode == Mode::Eager;
        // Each phase only when it has something to look at.
        let mut moved = c.sched.has_ready() && self.issue();
        if let Some(e) = self.pool_err.take() {
            return Err(e);
        }
        let (sends, recvs) = (self.q.sends, self.q.recvs);
        if eager {
            if sends > 0 {
                moved |= self.post();
            }
            if recvs > 0 {
                moved |= self.consume_eager()?;
            }
        } else {
            if sends > 0 {
                moved |= self.post_sends()?;
            }
            if recvs > 0 {
                moved |= self.consume()?;
            }
            if self.parts.any() {
                self.check_eager_mismatch()?;
            }
        }
        if self.unreturned {
            self.return_credits(false);
        }
        let done = self.settle();
        self.moved |= moved;
        if std::mem::take(&mut self.paced) {
            self.retry = true;
            return Ok(false);
        }
        // Once every op is done a further pass has nothing to find.
        Ok(moved && !done)
    }

    /// The end of a pass: the watch of the running eager operation's postings once its first
    /// messages are out, and once it is done the release of its postings, due at the start of
    /// the next operation (off the path between this operation's end and the next one's
    /// posting; see `start`). Whether the operation is done.
    pub(super) fn settle(&mut self) -> bool {
        let Some(c) = self.call.as_ref() else {
            return false;
        };
        if std::mem::take(&mut self.watch_due) {
            self.actions.push(Action::BoardWatch { seq: c.sig.seq });
        }
        let done = c.is_done();
        if done && self.needs_release(c) && !self.released {
            self.released = true;
            self.release_due = Some(c.sig.seq);
        }
        done
    }

    /// Takes the ops the schedule allows now: local ones become actions, sends and receives
    /// wait in their queues (a direct receive sends its clear-to-send at once).
    pub(super) fn issue(&mut self) -> bool {
        let Some(c) = self.call.as_mut() else {
            return false;
        };
        let mut moved = false;
        let mut wait_pool = false;
        let dsize = c.sig.dtype.size();
        let copies_only = receives_only_copy(c.sig.coll);
        let block = pair_block(&c.sig);
        while let Some(id) = c.sched.poll_id() {
            moved = true;
            match *c.sched.op(id) {
                Op::Send { peer, src, len } => {
                    self.q.sendq[peer].push_back(PostedSend { id, src, len });
                    self.q.sends += 1;
                }
                Op::Post { src, len } => {
                    self.q.posts.push_back(PostedSend { id, src, len });
                    self.q.sends += 1;
                }
                Op::Recv {
                    peer,
                    dst,
                    reduce_with,
                    len,
                } => {
                    let msg = self.q.recv_issued[peer];
                    self.q.recv_issued[peer] += 1;
                    let bytes = len * dsize;
                    // Senders of these collectives wait for offers on that promise.
                    debug_assert!(
                        !copies_only || reduce_with.is_none(),
                        "a {} program reduces on receipt",
                        c.sig.coll
                    );
                    let l = &self.links[peer];
                    let pooled = c.mode == Mode::Slots && l.pooled;
                    // A pooled peer's message that is copied into place comes straight there
                    // whatever its size; one that is reduced (or empty) waits for a pool slot.
                    let direct = c.mode == Mode::Slots
                        && reduce_with.is_none()
                        && if pooled {
                            l.pooled_direct(copies_only, bytes)
                        } else {
                            l.offers_direct(copies_only, block, bytes, self.cfg.checksum)
                        };
                    let awaiting = pooled && !direct;
                    if awaiting && bytes > self.cfg.slot_bytes && self.pool_err.is_none() {
                        self.pool_err = Some(ProtoError::violation(
                            peer,
                            Violation::PoolOverflow {
                                msg,
                                bytes,
                                slot: self.cfg.slot_bytes,
                            },
                        ));
                    }
                    if awaiting {
                        self.pool_wait.push((peer, msg));
                        wait_pool = true;
                    }
                    if direct {
                        let cts = Cts {
                            msg,
                            sig: c.sig,
                            rkey: c.rkeys[buf_index(dst.buf)],
                            bytes: bytes as u32,
                            offset: (dst.start * dsize) as u64,
                        };
                        self.actions.push(Action::Control {
                            peer,
                            msg: ControlRepr::ClearToSend(cts),
                            required: true,
                        });
                    }
                    self.q.recvs += 1;
                    self.q.recvq[peer].push_back(PostedRecv {
                        id,
                        len,
                        dst,
                        with: reduce_with,
                        msg,
                        direct: direct || awaiting,
                        pool: None,
                        awaiting,
                    });
                }
                local => {
                    self.actions.push(Action::Local(local));
                    c.sched.handle_complete(id);
                }
            }
        }
        if wait_pool {
            self.grant_pool();
        }
        moved
    }

    /// Sends of a slot-mode operation: straight into the receiver's buffer where it offered,
    /// else into the next slot while credits last; in a collective whose receives all copy, a
    /// message the receiver will offer to take in place waits for the offer while the
    /// operation is patient (see [`OFFER_PATIENCE`]).
    fn post_sends(&mut self) -> Result<bool, ProtoError> {
        let Some(c) = self.call.as_mut() else {
            return Ok(false);
        };
        let mut moved = false;
        let (rank, nslots, stride) = (self.cfg.rank, self.cfg.nslots, self.stride);
        let dsize = c.sig.dtype.size();
        let copies_only = receives_only_copy(c.sig.coll);
        let block = pair_block(&c.sig);
        for peer in 0..self.cfg.world {
            while let Some(&PostedSend { id, src, len }) = self.q.sendq[peer].front() {
                let l = &mut self.links[peer];
                let bytes = len * dsize;
                let m = self.q.send_msg[peer];
                if !l.offers.is_empty() {
                    let seq = c.sig.seq;
                    l.offers
                        .retain(|&(s, k), _| s > seq || (s == seq && k >= m));
                }
                // A direct write has no header to carry a checksum: with checksums on, an offer
                // (from a peer configured otherwise) is dropped and the message goes through a
                // slot, which the receiver accepts for a direct receive too.
                let offer = l.offers.remove(&(c.sig.seq, m));
                if let Some(cts) = offer.filter(|_| !self.cfg.checksum) {
                    if cts.sig != c.sig || cts.bytes as usize != bytes {
                        return Err(ProtoError::Mismatch {
                            peer,
                            ours: c.sig,
                            theirs: cts.sig,
                            detail: format!(
                                "rank {peer} asked for message {m} of {} bytes where rank {rank} sends {bytes} bytes",
                                cts.bytes
                            ),
                        });
                    }
                    self.q.sendq[peer].pop_front();
                    self.q.sends -= 1;
                    self.q.send_msg[peer] += 1;
                    let wr = self.next_wr;
                    self.next_wr += 1;
                    self.actions.push(Action::Write {
                        peer,
                        wr,
                        src,
                        len,
                        to: Target::Direct {
                            rkey: cts.rkey,
                            offset: cts.offset,
                        },
                        imm: IMM_DIRECT | m,
                        checksum: false,
                    });
                    self.q.inflight.insert(wr, (id, peer, usize::MAX));
                    moved = true;
                    if bytes >= PACE_MIN {
                        self.paced = true;
                        break;
                    }
                    continue;
                }
                if l.pooled {
                    // No slots: the receiver's clear-to-send says where it goes. Copies into
                    // place are offered unasked; a message it may reduce on receipt is
                    // announced, and it stages it in its pool.
                    let at = (c.sig.seq, m);
                    let p2p = c.sig.coll == Collective::SendRecv;
                    let offered = (copies_only || p2p) && l.pooled_direct(copies_only, bytes);
                    if !offered && l.announced != Some(at) {
                        l.announced = Some(at);
                        self.actions.push(Action::Control {
                            peer,
                            msg: ControlRepr::ReadyToSend {
                                msg: m,
                                seq: c.sig.seq,
                                p2p,
                            },
                            required: true,
                        });
                        moved = true;
                    }
                    break;
                }
                if self.patient
                    && copies_only
                    && l.offers_direct(true, block, bytes, self.cfg.checksum)
                {
                    // The receiver offers to take this message in place (it decides from the
                    // same rule): wait for the offer rather than copy it twice through a slot.
                    break;
                }
                let Some(k) = l.send_slot() else {
                    break;
                };
                self.q.sendq[peer].pop_front();
                self.q.sends -= 1;
                self.q.send_msg[peer] += 1;
                let wr = self.next_wr;
                self.next_wr += 1;
                self.actions.push(Action::Write {
                    peer,
                    wr,
                    src,
                    len,
                    to: Target::Slot {
                        slot: k,
                        offset: ((rank * nslots + k) * stride) as u64,
                        msg: m,
                    },
                    imm: l.tx_ctr as u32 & !IMM_DIRECT,
                    checksum: self.cfg.checksum,
                });
                l.credits -= 1;
                l.hdr_busy[k] = true;
                l.tx_ctr += 1;
                self.q.inflight.insert(wr, (id, peer, k));
                moved = true;
            }
        }
        Ok(moved)
    }

    /// Receives of a slot-mode operation, in order per peer: a direct write that landed, or the
    /// message in the next slot once its header matches.
    fn consume(&mut self) -> Result<bool, ProtoError> {
        let Some(c) = self.call.as_mut() else {
            return Ok(false);
        };
        let mut moved = false;
        let mut freed = false;
        let dsize = c.sig.dtype.size();
        for peer in 0..self.cfg.world {
            while let Some(&PostedRecv {
                id,
                len,
                dst,
                with,
                msg,
                direct,
                pool,
                ..
            }) = self.q.recvq[peer].front()
            {
                if direct
                    && let Some(i) = self.q.direct_arrived[peer].iter().position(|&m| m == msg)
                {
                    self.q.direct_arrived[peer].swap_remove(i);
                    self.q.recvq[peer].pop_front();
                    self.q.recvs -= 1;
                    if let Some(slot) = pool {
                        // Staged in a pool slot: deliver it from there, then the slot is free
                        // (its next grant goes out after this action).
                        self.actions.push(Action::DeliverPooled {
                            peer,
                            slot: slot as usize,
                            dst,
                            with,
                            len,
                            msg,
                        });
                        self.pool_free.push(slot);
                        freed = true;
                    }
                    // Else landed in place: nothing to copy.
                    c.sched.handle_complete(id);
                    moved = true;
                    continue;
                }
                let l = &mut self.links[peer];
                let k = l.slot(l.rx_ctr);
                let Some(h) = l.arrived[k] else {
                    break;
                };
                let bytes = len * dsize;
                let same_call = h.sig.seq == c.sig.seq && h.sig.coll == c.sig.coll;
                if direct && (h.sig.seq != c.sig.seq || (same_call && h.msg > msg)) {
                    // The message waited for comes straight into place; the slot holds a later
                    // one.
                    break;
                }
                if h.sig != c.sig
                    || h.msg != msg
                    || h.payload_len as usize != bytes
                    || h.sender as usize != peer
                {
                    return Err(mismatch(peer, &c.sig, &h, msg, bytes));
                }
                if h.crc32c.is_none() && self.cfg.checksum {
                    return Err(ProtoError::violation(
                        peer,
                        Violation::MissingChecksum { sig: c.sig, msg },
                    ));
                }
                l.heard(self.now, h.sig.seq);
                self.actions.push(Action::Deliver {
                    peer,
                    slot: k,
                    dst,
                    with,
                    len,
                    msg,
                    crc: h.crc32c,
                });
                l.arrived[k] = None;
                l.rx_ctr += 1;
                l.unreturned += 1;
                self.unreturned = true;
                self.q.recvq[peer].pop_front();
                self.q.recvs -= 1;
                c.sched.handle_complete(id);
                moved = true;
            }
        }
        if freed && !self.pool_wait.is_empty() {
            self.grant_pool();
        }
        Ok(moved)
    }

    /// A write with immediate from `peer` landed (`len` bytes). A slot write's header is read
    /// through `header(slot)`, the first [`DATA_HEADER_LEN`] bytes of the slot.
    pub fn handle_write_imm<'h>(
        &mut self,
        peer: usize,
        imm: u32,
        len: u32,
        now: Instant,
        header: impl FnOnce(usize) -> &'h [u8],
    ) -> Result<(), ProtoError> {
        self.moved = true;
        self.dirty = true;
        self.now = now;
        if imm & IMM_DIRECT != 0 {
            let msg = imm & !IMM_DIRECT;
            let ok = self.call.as_ref().is_some_and(|c| {
                self.q.recvq[peer].iter().any(|pr| {
                    pr.direct
                        && !pr.awaiting
                        && pr.msg == msg
                        && pr.len * c.sig.dtype.size() == len as usize
                })
            });
            let Some(c) = self.call.as_mut().filter(|_| ok) else {
                return Err(ProtoError::violation(
                    peer,
                    Violation::UnsolicitedDirect { msg, len },
                ));
            };
            self.q.direct_arrived[peer].push(msg);
            self.links[peer].heard(now, c.sig.seq);
            return Ok(());
        }
        let l = &mut self.links[peer];
        let k = l
            .arrival_slot(imm)
            .filter(|_| len as usize <= self.stride)
            .ok_or_else(|| {
                ProtoError::violation(
                    peer,
                    Violation::UnknownSlot {
                        imm,
                        len,
                        expected: l.expected_imm(),
                        window: l.window,
                    },
                )
            })?;
        let h = DataHeaderRepr::parse(&DataHeader::new_unchecked(header(k)))
            .map_err(|e| ProtoError::violation(peer, Violation::BadHeader(e)))?;
        l.arrived[k] = Some(h);
        let seq = l.last_heard.map_or(0, |x| x.1);
        l.heard(now, seq);
        Ok(())
    }

    /// A one-sided write of this rank's is done: its buffers may be reused.
    pub fn handle_write_done(&mut self, wr: u64) {
        if let Some(c) = self.call.as_mut()
            && let Some((id, peer, k)) = self.q.inflight.remove(&wr)
        {
            if k != usize::MAX {
                self.links[peer].hdr_busy[k] = false;
            }
            c.sched.handle_complete(id);
            self.moved = true;
            self.dirty = true;
        }
    }

    /// A two-sided message from `peer`: an eager message (kept until its operation takes it)
    /// or a control message.
    pub fn handle_message(
        &mut self,
        peer: usize,
        data: Vec<u8>,
        now: Instant,
    ) -> Result<(), ProtoError> {
        self.moved = true;
        self.dirty = true;
        self.now = now;
        let seq = self.current_seq();
        self.links[peer].heard(now, seq);
        if is_data(&data) {
            return self.eager_arrived(peer, data);
        }
        let msg = ControlRepr::parse(&Control::new_unchecked(&data[..])).map_err(|error| {
            ProtoError::violation(
                peer,
                Violation::BadControl {
                    len: data.len(),
                    error,
                },
            )
        })?;
        match msg {
            ControlRepr::Credit { count } => {
                let l = &mut self.links[peer];
                if l.credits + count as usize > l.window {
                    return Err(ProtoError::violation(
                        peer,
                        Violation::TooManyCredits {
                            returned: count,
                            free: l.credits,
                            window: l.window,
                        },
                    ));
                }
                l.credits += count as usize;
            }
            ControlRepr::ClearToSend(cts) => {
                let l = &mut self.links[peer];
                if l.offers.len() >= MAX_OFFERS {
                    return Err(ProtoError::violation(
                        peer,
                        Violation::TooManyOffers { max: MAX_OFFERS },
                    ));
                }
                l.offers.insert((cts.sig.seq, cts.msg), cts);
            }
            ControlRepr::Probe => {
                let (seq, inside) = match &self.call {
                    Some(c) => (c.sig.seq, true),
                    None => (self.last_seq, false),
                };
                self.actions.push(Action::Control {
                    peer,
                    msg: ControlRepr::ProbeReply { seq, inside },
                    required: false,
                });
            }
            ControlRepr::ProbeReply { seq, inside } => {
                self.probe.replies[peer] = Some((seq, inside));
            }
            ControlRepr::ReadyToSend { msg, seq, p2p } => {
                self.ready_to_send(peer, msg, seq, p2p)?
            }
            ControlRepr::Abort { reason } => {
                return Err(ProtoError::PeerAborted {
                    peer,
                    reason: reason.into_owned(),
                });
            }
        }
        Ok(())
    }

    /// A control message could not go to `peer`, which is gone. A clear-to-send that did not
    /// go out means the message comes through a slot (the peer, if it finished, already sent it
    /// so).
    pub fn handle_unsent(&mut self, peer: usize, msg: &ControlRepr<'_>) {
        if let ControlRepr::ClearToSend(cts) = msg
            && self.call.is_some()
            && let Some(pr) = self.q.recvq[peer].iter_mut().find(|pr| pr.msg == cts.msg)
        {
            pr.direct = false;
            if let Some(slot) = pr.pool.take() {
                self.pool_free.push(slot);
                self.grant_pool();
            }
            self.dirty = true;
        }
    }

    /// Queues the return of consumed slots: all with `all`, else per peer once half its window
    /// waits.
    fn return_credits(&mut self, all: bool) {
        let mut left = false;
        for (peer, l) in self.links.iter_mut().enumerate() {
            if let Some(count) = l.credits_due(all) {
                l.unreturned = 0;
                self.actions.push(Action::Control {
                    peer,
                    msg: ControlRepr::Credit { count },
                    required: true,
                });
            }
            left |= l.unreturned > 0;
        }
        self.unreturned = left;
    }

    /// Asks every peer for which `alive` holds where it is (a timeout).
    pub fn begin_probe(&mut self, alive: impl Fn(usize) -> bool) {
        self.probe.clear();
        for p in (0..self.cfg.world).filter(|&p| p != self.cfg.rank && alive(p)) {
            self.actions.push(Action::Control {
                peer: p,
                msg: ControlRepr::Probe,
                required: false,
            });
        }
    }

    /// Whether every live peer has answered the probe.
    pub fn probe_settled(&self, alive: impl Fn(usize) -> bool) -> bool {
        self.probe.settled(self.cfg.rank, alive)
    }

    /// What the probe found about the running (or last) operation.
    pub fn verdict(&self, alive: impl Fn(usize) -> bool) -> Verdict {
        self.probe.verdict(self.cfg.rank, self.current_seq(), alive)
    }

    /// Queues an abort to every peer, the reason cut to `max` bytes (best effort).
    pub fn abort(&mut self, reason: &str, max: usize) {
        let mut end = reason.len().min(max);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        for p in (0..self.cfg.world).filter(|&p| p != self.cfg.rank) {
            self.actions.push(Action::Control {
                peer: p,
                msg: ControlRepr::Abort {
                    reason: reason[..end].to_string().into(),
                },
                required: false,
            });
        }
    }

    /// The operator a receive's reduction applies (`Avg` sums; `Finalize` divides).
    pub fn fold_op(&self) -> Option<ReduceOp> {
        self.call.as_ref().map(|c| match c.sig.op {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        })
    }

    /// The slot `slot` of `peer`'s part of this rank's inbox: its offset in the inbox region.
    #[inline]
    pub fn slot_offset(&self, peer: usize, slot: usize) -> usize {
        (peer * self.cfg.nslots + slot) * self.stride
    }
}

/// Where the op of a program reads or writes, as a location: the helper of drivers.
pub fn loc_bytes(loc: Loc, dsize: usize) -> (usize, usize) {
    (buf_index(loc.buf), loc.start * dsize)
}
