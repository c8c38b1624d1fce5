//! The protocol machine of one rank: takes the running operation's schedule and the events of
//! the transport, and hands out what to do (see [`super::manual`]).

use super::action::{Action, Target};
use super::call::{Call, Mode, PostedRecv, PostedSend, Queues};
use super::eager::{EAGER_AHEAD_MAX, Parts};
use super::error::{ProtoError, Violation, eager_detail};
use super::link::{IMM_DIRECT, Link, MAX_OFFERS};
use super::probe::{Probe, Verdict};
use crate::schedule::{Buf, Loc, Op, Schedule};
use crate::wire::{
    Control, ControlRepr, Cts, DATA_HEADER_LEN, DataHeader, DataHeaderRepr, Signature, is_data,
};
use crate::{Collective, ReduceOp};
use std::collections::VecDeque;
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
    cfg: Config,
    stride: usize,
    links: Vec<Link>,
    call: Option<Call>,
    spare: Queues,
    parts: Parts,
    /// Eager postings go through the transport's board.
    board: bool,
    actions: VecDeque<Action>,
    next_wr: u64,
    /// Sequence number of the last operation started.
    last_seq: u64,
    /// Sequence number of the last collective (not send/recv, which count per peer) started.
    last_coll_seq: u64,
    probe: Probe,
    /// Rounds of the driver: retries (a refused posting, a board read that found nothing) wait
    /// for the next one.
    round: u64,
    board_tried: Vec<u64>,
    /// The round of the last posting tried, and whether its answer is still due.
    post_tried: u64,
    post_waiting: bool,
    /// The running eager operation's board release has been handed out.
    released: bool,
    next_board_check: Instant,
    /// When nothing last moved, for the idle credit return.
    idle_since: Option<Instant>,
    credits_flushed: bool,
    moved: bool,
    /// The driver's clock at its last event or round (when peers were last heard from).
    now: Instant,
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
            spare: Queues::default(),
            parts: Parts::new(cfg.world),
            board: false,
            actions: VecDeque::new(),
            next_wr: 1,
            last_seq: 0,
            last_coll_seq: 0,
            probe: Probe::new(cfg.world),
            round: 1,
            board_tried: vec![0; cfg.world],
            post_tried: 0,
            post_waiting: false,
            released: false,
            next_board_check: now,
            idle_since: None,
            credits_flushed: false,
            moved: false,
            now,
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
        if let Some(l) = self.links.get_mut(peer) {
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

    /// Sets the size from which copy-receives from `peer` ask for direct writes
    /// (`usize::MAX`: never).
    pub fn set_direct_min(&mut self, peer: usize, min: usize) {
        if let Some(l) = self.links.get_mut(peer) {
            l.direct_min = min;
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
        let mut q = std::mem::take(&mut self.spare);
        q.reset(self.cfg.world);
        self.post_waiting = false;
        self.released = false;
        self.idle_since = None;
        self.credits_flushed = false;
        if mode == Mode::Eager && self.board {
            self.actions.push_back(Action::BoardWatch { seq: sig.seq });
        }
        self.call = Some(Call {
            sig,
            sched,
            mode,
            rkeys,
            q,
            started: now,
        });
    }

    /// The running operation's signature.
    pub fn running(&self) -> Option<&Signature> {
        self.call.as_ref().map(|c| &c.sig)
    }

    /// The running operation's mode.
    pub fn mode(&self) -> Option<Mode> {
        self.call.as_ref().map(|c| c.mode)
    }

    /// When the running operation started.
    pub fn started(&self) -> Option<Instant> {
        self.call.as_ref().map(|c| c.started)
    }

    /// The running operation's schedule.
    pub fn schedule(&self) -> Option<&Schedule> {
        self.call.as_ref().map(|c| &*c.sched)
    }

    /// Whether the running operation is complete: every op done, every action handed out.
    pub fn is_done(&self) -> bool {
        self.call.as_ref().is_some_and(|c| {
            c.is_done() && self.actions.is_empty() && (!self.needs_release(c) || self.released)
        })
    }

    fn needs_release(&self, c: &Call) -> bool {
        c.mode == Mode::Eager && self.board
    }

    /// Ends the running operation, done or not, and gives its schedule back. After a failure
    /// nothing of it is handed out again.
    pub fn finish(&mut self) -> Option<Finished> {
        let completed = self.is_done();
        let c = self.call.take()?;
        self.actions
            .retain(|a| matches!(a, Action::Control { .. } | Action::BoardRelease { .. }));
        self.spare = c.q;
        Some(Finished {
            completed,
            sched: c.sched,
            sig: c.sig,
        })
    }

    /// Whether anything moved since the last call (an op issued or completed, a message
    /// consumed, an arrival); clears the mark.
    pub fn take_moved(&mut self) -> bool {
        std::mem::take(&mut self.moved)
    }

    /// The peers the running operation waits on.
    pub fn waiting_on(&self) -> Vec<usize> {
        self.call
            .as_ref()
            .map_or_else(Vec::new, |c| c.waiting_on(|p| self.links[p].credits))
    }

    /// When `peer` was last heard from, and the sequence number then.
    pub fn last_heard(&self, peer: usize) -> Option<(Instant, u64)> {
        self.links.get(peer).and_then(|l| l.last_heard)
    }

    /// The sequence number of the running operation, else of the last one.
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
        if !idle {
            self.idle_since = None;
            self.credits_flushed = false;
            return;
        }
        let since = *self.idle_since.get_or_insert(now);
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
                    self.actions.push_back(Action::BoardRead { peer: p, seq });
                }
            }
        }
    }

    /// Returns every consumed slot at once (a driver that stops driving for now).
    pub fn flush_credits(&mut self) {
        self.return_credits(true);
    }

    /// The next thing to do, or `None` until an event (or a new round) makes more possible.
    pub fn poll_action(&mut self) -> Result<Option<Action>, ProtoError> {
        loop {
            if let Some(a) = self.actions.pop_front() {
                return Ok(Some(a));
            }
            if !self.advance()? {
                return Ok(None);
            }
        }
    }

    /// One pass over the running operation: issue what the schedule allows, send what the
    /// protocol allows, consume what arrived, return credits. Whether anything changed.
    fn advance(&mut self) -> Result<bool, ProtoError> {
        let Some(c) = self.call.as_ref() else {
            return Ok(false);
        };
        let eager = c.mode == Mode::Eager;
        let mut moved = self.issue();
        if eager {
            moved |= self.post();
            moved |= self.consume_eager()?;
        } else {
            moved |= self.post_sends()?;
            moved |= self.consume()?;
            self.check_eager_mismatch()?;
        }
        self.return_credits(false);
        if let Some(c) = self.call.as_ref()
            && c.is_done()
            && self.needs_release(c)
            && !self.released
        {
            self.released = true;
            self.actions
                .push_back(Action::BoardRelease { seq: c.sig.seq });
        }
        self.moved |= moved;
        Ok(moved || !self.actions.is_empty())
    }

    /// Takes the ops the schedule allows now: local ones become actions, sends and receives
    /// wait in their queues (a direct receive sends its clear-to-send at once).
    fn issue(&mut self) -> bool {
        let Some(c) = self.call.as_mut() else {
            return false;
        };
        let mut moved = false;
        let dsize = c.sig.dtype.size();
        while let Some((id, op)) = c.sched.poll_action() {
            moved = true;
            match op {
                Op::Send { peer, src, len } => {
                    c.q.sendq[peer].push_back(PostedSend { id, src, len });
                }
                Op::Post { src, len } => c.q.posts.push_back(PostedSend { id, src, len }),
                Op::Recv {
                    peer,
                    dst,
                    reduce_with,
                    len,
                } => {
                    let msg = c.q.recv_issued[peer];
                    c.q.recv_issued[peer] += 1;
                    let bytes = len * dsize;
                    let direct = c.mode == Mode::Slots
                        && reduce_with.is_none()
                        && !self.cfg.checksum
                        && bytes > 0
                        && bytes >= self.links[peer].direct_min
                        && bytes <= u32::MAX as usize;
                    if direct {
                        let cts = Cts {
                            msg,
                            sig: c.sig,
                            rkey: c.rkeys[buf_index(dst.buf)],
                            bytes: bytes as u32,
                            offset: (dst.start * dsize) as u64,
                        };
                        self.actions.push_back(Action::Control {
                            peer,
                            msg: ControlRepr::ClearToSend(cts),
                            required: true,
                        });
                    }
                    c.q.recvq[peer].push_back(PostedRecv {
                        id,
                        len,
                        dst,
                        with: reduce_with,
                        msg,
                        direct,
                    });
                }
                local => {
                    self.actions.push_back(Action::Local(local));
                    c.sched.handle_complete(id);
                }
            }
        }
        moved
    }

    /// Sends of a slot-mode operation: straight into the receiver's buffer where it offered,
    /// else into the next slot while credits last.
    fn post_sends(&mut self) -> Result<bool, ProtoError> {
        let Some(c) = self.call.as_mut() else {
            return Ok(false);
        };
        let mut moved = false;
        let (rank, nslots, stride) = (self.cfg.rank, self.cfg.nslots, self.stride);
        let dsize = c.sig.dtype.size();
        for peer in 0..self.cfg.world {
            while let Some(&PostedSend { id, src, len }) = c.q.sendq[peer].front() {
                let l = &mut self.links[peer];
                let bytes = len * dsize;
                let m = c.q.send_msg[peer];
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
                    c.q.sendq[peer].pop_front();
                    c.q.send_msg[peer] += 1;
                    let wr = self.next_wr;
                    self.next_wr += 1;
                    self.actions.push_back(Action::Write {
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
                    c.q.inflight.insert(wr, (id, peer, usize::MAX));
                    moved = true;
                    continue;
                }
                let Some(k) = l.send_slot() else {
                    break;
                };
                c.q.sendq[peer].pop_front();
                let header = DataHeaderRepr {
                    sig: c.sig,
                    msg: m,
                    payload_len: bytes as u32,
                    sender: rank as u32,
                    crc32c: None,
                };
                c.q.send_msg[peer] += 1;
                let wr = self.next_wr;
                self.next_wr += 1;
                self.actions.push_back(Action::Write {
                    peer,
                    wr,
                    src,
                    len,
                    to: Target::Slot {
                        slot: k,
                        offset: ((rank * nslots + k) * stride) as u64,
                        header,
                    },
                    imm: l.tx_ctr as u32 & !IMM_DIRECT,
                    checksum: self.cfg.checksum,
                });
                l.credits -= 1;
                l.hdr_busy[k] = true;
                l.tx_ctr += 1;
                c.q.inflight.insert(wr, (id, peer, k));
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
        let dsize = c.sig.dtype.size();
        for peer in 0..self.cfg.world {
            while let Some(&PostedRecv {
                id,
                len,
                dst,
                with,
                msg,
                direct,
            }) = c.q.recvq[peer].front()
            {
                if direct && let Some(i) = c.q.direct_arrived[peer].iter().position(|&m| m == msg) {
                    // Landed in place: nothing to copy.
                    c.q.direct_arrived[peer].swap_remove(i);
                    c.q.recvq[peer].pop_front();
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
                self.actions.push_back(Action::Deliver {
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
                c.q.recvq[peer].pop_front();
                c.sched.handle_complete(id);
                moved = true;
            }
        }
        Ok(moved)
    }

    /// A peer's eager message for the operation this rank runs through slots: a mismatch.
    fn check_eager_mismatch(&self) -> Result<(), ProtoError> {
        let Some(c) = self.call.as_ref() else {
            return Ok(());
        };
        if c.sig.coll == Collective::SendRecv {
            return Ok(());
        }
        for p in 0..self.cfg.world {
            if let Some(part) = self.parts.find(p, c.sig.seq) {
                return Err(ProtoError::Mismatch {
                    peer: p,
                    ours: c.sig,
                    theirs: part.hdr.sig,
                    detail: eager_detail(&c.sig, &part.hdr.sig, self.cfg.rank, p),
                });
            }
        }
        Ok(())
    }

    /// Posts and sends of an eager operation: whole messages, no slots.
    fn post(&mut self) -> bool {
        let Some(c) = self.call.as_mut() else {
            return false;
        };
        let mut moved = false;
        let dsize = c.sig.dtype.size();
        let header = |msg: u32, len: usize| DataHeaderRepr {
            sig: c.sig,
            msg,
            payload_len: (len * dsize) as u32,
            sender: self.cfg.rank as u32,
            crc32c: None,
        };
        for peer in 0..self.cfg.world {
            while let Some(s) = c.q.sendq[peer].pop_front() {
                let m = c.q.send_msg[peer];
                c.q.send_msg[peer] += 1;
                self.actions.push_back(Action::EagerSend {
                    peer,
                    header: header(m, s.len),
                    src: s.src,
                    len: s.len,
                    checksum: self.cfg.checksum,
                });
                c.sched.handle_complete(s.id);
                moved = true;
            }
        }
        if let Some(&s) = c.q.posts.front()
            && !self.post_waiting
            && self.post_tried != self.round
        {
            // A post is a message to every peer, counted with the sends to each; an eager
            // program posts before it sends, so the index is the same for all peers.
            let m = c.q.send_msg[(self.cfg.rank + 1) % self.cfg.world];
            self.actions.push_back(Action::Post {
                header: header(m, s.len),
                src: s.src,
                len: s.len,
                checksum: self.cfg.checksum,
                board: self.board,
            });
            if self.board {
                // Its completion, and the progress, wait for the answer.
                self.post_waiting = true;
                self.post_tried = self.round;
            } else {
                c.q.posts.pop_front();
                c.q.send_msg.iter_mut().for_each(|m| *m += 1);
                c.sched.handle_complete(s.id);
                moved = true;
            }
        }
        moved
    }

    /// Whether the posting handed out last went up; a refused one (a peer has not released
    /// the slot it would reuse) is tried again next round.
    pub fn handle_posted(&mut self, accepted: bool) {
        self.post_waiting = false;
        let Some(c) = self.call.as_mut() else {
            return;
        };
        if accepted && let Some(s) = c.q.posts.pop_front() {
            c.q.send_msg.iter_mut().for_each(|m| *m += 1);
            c.sched.handle_complete(s.id);
            self.moved = true;
        }
    }

    /// Receives of an eager operation: a peer's message (or board posting) for it, at most
    /// one per peer per pass (the driver reads it through [`eager_payload`](Self::eager_payload)).
    fn consume_eager(&mut self) -> Result<bool, ProtoError> {
        let Some(c) = self.call.as_mut() else {
            return Ok(false);
        };
        let mut moved = false;
        let (rank, seq) = (self.cfg.rank, c.sig.seq);
        for peer in 0..self.cfg.world {
            let Some(&pr) = c.q.recvq[peer].front() else {
                continue;
            };
            let bytes = pr.len * c.sig.dtype.size();
            if let Some(part) = self.parts.find(peer, seq) {
                let h = part.hdr;
                if h.sig != c.sig || h.msg != pr.msg || h.payload_len as usize != bytes {
                    return Err(mismatch(peer, &c.sig, &h, pr.msg, bytes));
                }
                if h.crc32c.is_none() && self.cfg.checksum {
                    return Err(ProtoError::violation(
                        peer,
                        Violation::MissingChecksum {
                            sig: c.sig,
                            msg: pr.msg,
                        },
                    ));
                }
                self.parts.take(peer, seq);
                self.actions.push_back(Action::DeliverEager {
                    peer,
                    dst: pr.dst,
                    with: pr.with,
                    len: pr.len,
                    msg: pr.msg,
                    crc: h.crc32c,
                });
                c.q.recvq[peer].pop_front();
                c.sched.handle_complete(pr.id);
                moved = true;
                continue;
            }
            if self.board && self.board_tried[peer] != self.round {
                self.board_tried[peer] = self.round;
                self.actions.push_back(Action::BoardRead { peer, seq });
            }
            // The peer sent its part of this operation through slots: it runs it differently.
            let l = &self.links[peer];
            if let Some(h) = l.arrived[l.slot(l.rx_ctr)]
                && h.sig.seq == seq
                && h.sig.coll != Collective::SendRecv
            {
                return Err(ProtoError::Mismatch {
                    peer,
                    ours: c.sig,
                    theirs: h.sig,
                    detail: eager_detail(&c.sig, &h.sig, peer, rank),
                });
            }
        }
        Ok(moved)
    }

    /// The buffer a [`BoardRead`](Action::BoardRead) of `peer` fills.
    pub fn board_buf(&mut self, peer: usize) -> &mut Vec<u8> {
        self.parts.board_buf(peer)
    }

    /// The outcome of a [`BoardRead`](Action::BoardRead) of `peer`: whether a posting was
    /// there (then it is in [`board_buf`](Self::board_buf)).
    pub fn handle_board_read(&mut self, peer: usize, got: bool) -> Result<(), ProtoError> {
        if !got {
            return Ok(());
        }
        let hdr = self.check_message(peer, self.parts.board_data(peer))?;
        let Some(c) = self.call.as_ref() else {
            return Ok(());
        };
        if c.mode == Mode::Slots {
            // A posting under the sequence number of an operation this rank runs through slots.
            return Err(ProtoError::Mismatch {
                peer,
                ours: c.sig,
                theirs: hdr.sig,
                detail: eager_detail(&c.sig, &hdr.sig, self.cfg.rank, peer),
            });
        }
        self.parts.push_board(peer, hdr);
        self.moved = true;
        Ok(())
    }

    /// The payload of `peer`'s eager message that the last
    /// [`DeliverEager`](Action::DeliverEager) of `peer` names.
    pub fn eager_payload(&self, peer: usize) -> &[u8] {
        self.parts.payload(peer)
    }

    /// The header of a whole message from `peer` (eager message or board posting), checked
    /// against this communicator and its own length.
    fn check_message(&self, peer: usize, data: &[u8]) -> Result<DataHeaderRepr, ProtoError> {
        let v = |violation| ProtoError::violation(peer, violation);
        let h = DataHeaderRepr::parse(&DataHeader::new_unchecked(data))
            .map_err(|e| v(Violation::BadHeader(e)))?;
        let comm = self.call.as_ref().map(|c| c.sig.comm_id);
        if let Some(ours) = comm
            && h.sig.comm_id != ours
        {
            return Err(v(Violation::ForeignCommunicator {
                theirs: h.sig.comm_id,
                ours,
            }));
        }
        if h.sender as usize != peer || data.len() != DATA_HEADER_LEN + h.payload_len as usize {
            return Err(v(Violation::BadFraming {
                len: data.len(),
                sender: h.sender,
                payload: h.payload_len,
            }));
        }
        Ok(h)
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
        self.now = now;
        if imm & IMM_DIRECT != 0 {
            let msg = imm & !IMM_DIRECT;
            let ok = self.call.as_ref().is_some_and(|c| {
                c.q.recvq[peer].iter().any(|pr| {
                    pr.direct && pr.msg == msg && pr.len * c.sig.dtype.size() == len as usize
                })
            });
            let Some(c) = self.call.as_mut().filter(|_| ok) else {
                return Err(ProtoError::violation(
                    peer,
                    Violation::UnsolicitedDirect { msg, len },
                ));
            };
            c.q.direct_arrived[peer].push(msg);
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
            && let Some((id, peer, k)) = c.q.inflight.remove(&wr)
        {
            if k != usize::MAX {
                self.links[peer].hdr_busy[k] = false;
            }
            c.sched.handle_complete(id);
            self.moved = true;
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
                self.actions.push_back(Action::Control {
                    peer,
                    msg: ControlRepr::ProbeReply { seq, inside },
                    required: false,
                });
            }
            ControlRepr::ProbeReply { seq, inside } => {
                self.probe.replies[peer] = Some((seq, inside));
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

    /// An eager message from `peer`: kept until the operation it belongs to takes it. A peer
    /// cannot have passed an operation of this rank's that needs its message: one for an
    /// operation this rank has finished is a protocol error. Send/recv numbers its operations
    /// per peer, apart from the collectives.
    fn eager_arrived(&mut self, peer: usize, data: Vec<u8>) -> Result<(), ProtoError> {
        let h = self.check_message(peer, &data)?;
        let current = self
            .call
            .as_ref()
            .filter(|c| c.sig.coll != Collective::SendRecv)
            .map(|c| c.sig);
        let done = current.map_or(self.last_coll_seq, |s| s.seq - 1);
        let v = |violation| ProtoError::violation(peer, violation);
        if h.sig.seq <= done {
            return Err(v(Violation::Late {
                theirs: h.sig,
                done,
            }));
        }
        if self.parts.pending[peer].len() >= EAGER_AHEAD_MAX {
            return Err(v(Violation::TooFarAhead {
                max: EAGER_AHEAD_MAX,
            }));
        }
        self.parts.push(peer, h, data);
        Ok(())
    }

    /// A control message could not go to `peer`, which is gone. A clear-to-send that did not
    /// go out means the message comes through a slot (the peer, if it finished, already sent it
    /// so).
    pub fn handle_unsent(&mut self, peer: usize, msg: &ControlRepr<'_>) {
        if let ControlRepr::ClearToSend(cts) = msg
            && let Some(c) = self.call.as_mut()
            && let Some(pr) = c.q.recvq[peer].iter_mut().find(|pr| pr.msg == cts.msg)
        {
            pr.direct = false;
        }
    }

    /// Queues the return of consumed slots: all with `all`, else per peer once half its window
    /// waits.
    fn return_credits(&mut self, all: bool) {
        for (peer, l) in self.links.iter_mut().enumerate() {
            if let Some(count) = l.credits_due(all) {
                l.unreturned = 0;
                self.actions.push_back(Action::Control {
                    peer,
                    msg: ControlRepr::Credit { count },
                    required: true,
                });
            }
        }
    }

    /// Asks every peer for which `alive` holds where it is (a timeout).
    pub fn begin_probe(&mut self, alive: impl Fn(usize) -> bool) {
        self.probe.clear();
        for p in (0..self.cfg.world).filter(|&p| p != self.cfg.rank && alive(p)) {
            self.actions.push_back(Action::Control {
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
            self.actions.push_back(Action::Control {
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
    pub fn slot_offset(&self, peer: usize, slot: usize) -> usize {
        (peer * self.cfg.nslots + slot) * self.stride
    }
}

/// A message whose header disagrees with the receive waiting for it.
fn mismatch(
    peer: usize,
    ours: &Signature,
    h: &DataHeaderRepr,
    msg: u32,
    bytes: usize,
) -> ProtoError {
    ProtoError::Mismatch {
        peer,
        ours: *ours,
        theirs: h.sig,
        detail: if h.sig == *ours {
            format!(
                "message {} of {} bytes where message {msg} of {bytes} bytes was expected",
                h.msg, h.payload_len
            )
        } else {
            String::new()
        },
    }
}

/// Where the op of a program reads or writes, as a location: the helper of drivers.
pub fn loc_bytes(loc: Loc, dsize: usize) -> (usize, usize) {
    (buf_index(loc.buf), loc.start * dsize)
}
