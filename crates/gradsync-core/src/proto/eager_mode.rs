//! The eager side of the protocol machine: posts and eager sends, board postings and their
//! reads, and the checks of whole messages (see the eager part of [`super::manual`]).

use super::action::Action;
use super::call::Mode;
use super::eager::EAGER_AHEAD_MAX;
use super::error::{ProtoError, Violation, eager_detail, mismatch};
use super::machine::Protocol;
use crate::Collective;
use crate::wire::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr, FLAG_CRC32C};

impl Protocol {
    /// A peer's eager message for the operation this rank runs through slots: a mismatch.
    pub(super) fn check_eager_mismatch(&self) -> Result<(), ProtoError> {
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
    pub(super) fn post(&mut self) -> bool {
        let Some(c) = self.call.as_mut() else {
            return false;
        };
        let mut moved = false;
        for peer in 0..self.cfg.world {
            while let Some(s) = self.q.sendq[peer].pop_front() {
                self.q.sends -= 1;
                let m = self.q.send_msg[peer];
                self.q.send_msg[peer] += 1;
                self.actions.push(Action::EagerSend {
                    peer,
                    msg: m,
                    src: s.src,
                    len: s.len,
                    checksum: self.cfg.checksum,
                });
                c.sched.handle_complete(s.id);
                moved = true;
            }
        }
        if let Some(&s) = self.q.posts.front()
            && !self.post_waiting
            && self.post_tried != self.round
        {
            // A post is a message to every peer, counted with the sends to each; an eager
            // program posts before it sends, so the index is the same for all peers.
            let next = if self.cfg.rank + 1 == self.cfg.world {
                0
            } else {
                self.cfg.rank + 1
            };
            let m = self.q.send_msg[next];
            self.actions.push(Action::Post {
                msg: m,
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
                self.q.posts.pop_front();
                self.q.sends -= 1;
                self.q.send_msg.iter_mut().for_each(|m| *m += 1);
                c.sched.handle_complete(s.id);
                moved = true;
            }
        }
        moved
    }

    /// Whether the posting handed out last went up; a refused one (a peer has not released
    /// the slot it would reuse) is tried again next round.
    #[inline]
    pub fn handle_posted(&mut self, accepted: bool) {
        self.post_waiting = false;
        self.dirty = true;
        if !accepted {
            self.retry = true;
        }
        let Some(c) = self.call.as_mut() else {
            return;
        };
        if accepted && let Some(s) = self.q.posts.pop_front() {
            self.q.sends -= 1;
            self.q.send_msg.iter_mut().for_each(|m| *m += 1);
            c.sched.handle_complete(s.id);
            self.moved = true;
        }
    }

    /// Receives of an eager operation: a peer's message (or board posting) for it, at most
    /// one per peer per pass (the driver reads it through [`eager_payload`](Self::eager_payload)).
    pub(super) fn consume_eager(&mut self) -> Result<bool, ProtoError> {
        let Some(c) = self.call.as_ref() else {
            return Ok(false);
        };
        let mut moved = false;
        let (rank, sig) = (self.cfg.rank, c.sig);
        let seq = sig.seq;
        for peer in 0..self.cfg.world {
            if self.q.recvq[peer].is_empty() {
                continue;
            }
            if let Some(h) = self.parts.take(peer, seq) {
                self.deliver_eager(peer, &h)?;
                moved = true;
                continue;
            }
            if self.board && !self.board_wanted.contains(&peer) {
                // Read now, and every round until it is there.
                self.board_wanted.push(peer);
                self.actions.push(Action::BoardRead { peer, seq });
            }
            // The peer sent its part of this operation through slots: it runs it differently.
            let l = &self.links[peer];
            if let Some(h) = l.arrived[l.slot(l.rx_ctr)]
                && h.sig.seq == seq
                && h.sig.coll != Collective::SendRecv
            {
                return Err(ProtoError::Mismatch {
                    peer,
                    ours: sig,
                    theirs: h.sig,
                    detail: eager_detail(&sig, &h.sig, peer, rank),
                });
            }
        }
        Ok(moved)
    }

    /// `peer`'s eager message of header `h` (now the payload [`eager_payload`] shows) for the
    /// receive at the front of its queue: checked, handed to the driver, the receive done.
    ///
    /// [`eager_payload`]: Self::eager_payload
    pub(super) fn deliver_eager(
        &mut self,
        peer: usize,
        h: &DataHeaderRepr,
    ) -> Result<(), ProtoError> {
        let c = self.call.as_mut().expect("running");
        let pr = *self.q.recvq[peer].front().expect("a receive is posted");
        let bytes = pr.len * c.sig.dtype.size();
        if h.sig != c.sig || h.msg != pr.msg || h.payload_len as usize != bytes {
            return Err(mismatch(peer, &c.sig, h, pr.msg, bytes));
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
        self.actions.push(Action::DeliverEager {
            peer,
            dst: pr.dst,
            with: pr.with,
            len: pr.len,
            msg: pr.msg,
            crc: h.crc32c,
        });
        self.q.recvq[peer].pop_front();
        self.q.recvs -= 1;
        c.sched.handle_complete(pr.id);
        Ok(())
    }

    /// The buffer a [`BoardRead`](Action::BoardRead) of `peer` fills.
    #[inline]
    pub fn board_buf(&mut self, peer: usize) -> &mut Vec<u8> {
        self.parts.board_buf(peer)
    }

    /// The outcome of a [`BoardRead`](Action::BoardRead) of `peer` under `seq`: whether a
    /// posting was there (then it is in [`board_buf`](Self::board_buf)).
    pub fn handle_board_read(
        &mut self,
        peer: usize,
        seq: u64,
        got: bool,
    ) -> Result<(), ProtoError> {
        if !got {
            return Ok(());
        }
        self.parts.board_seq(peer, seq);
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
        // A second read of the same posting (queued before the first found it) adds nothing.
        let Some(i) = self.board_wanted.iter().position(|&p| p == peer) else {
            return Ok(());
        };
        self.board_wanted.swap_remove(i);
        // Wanted means its receive waits at the front of the queue: delivered at once, and
        // what that releases (the reduction, once the last part is in) issued at once.
        self.parts.accept_board(peer);
        self.deliver_eager(peer, &hdr)?;
        self.issue();
        self.moved = true;
        self.dirty = !self.settle();
        Ok(())
    }

    /// The payload of `peer`'s eager message that the last
    /// [`DeliverEager`](Action::DeliverEager) of `peer` names.
    #[inline]
    pub fn eager_payload(&self, peer: usize) -> &[u8] {
        self.parts.payload(peer)
    }

    /// The header of a whole message from `peer` (eager message or board posting), checked
    /// against this communicator and its own length.
    pub(super) fn check_message(
        &self,
        peer: usize,
        data: &[u8],
    ) -> Result<DataHeaderRepr, ProtoError> {
        // The common case, the running eager operation's message: its header is the expected
        // one but for the sender and the checksum, compared as bytes (no parse).
        if let Some((t, c)) = self.expect.as_ref().zip(self.call.as_ref())
            && self.expect_on
            && t.matches(peer, data)
        {
            let h = DataHeader::new_unchecked(data);
            let crc = match h.flags() {
                0 => None,
                FLAG_CRC32C => Some(h.crc32c()),
                _ => return self.check_message_slow(peer, data, Some(c.sig.comm_id)),
            };
            return Ok(DataHeaderRepr {
                sig: c.sig,
                msg: 0,
                payload_len: t.payload_len,
                sender: peer as u32,
                crc32c: crc,
            });
        }
        self.check_message_slow(peer, data, self.call.as_ref().map(|c| c.sig.comm_id))
    }

    /// A whole message from `peer` parsed and checked against its own length and, when given,
    /// this rank's communicator `comm`.
    pub(super) fn check_message_slow(
        &self,
        peer: usize,
        data: &[u8],
        comm: Option<u64>,
    ) -> Result<DataHeaderRepr, ProtoError> {
        let v = |violation| ProtoError::violation(peer, violation);
        let h = DataHeaderRepr::parse(&DataHeader::new_unchecked(data))
            .map_err(|e| v(Violation::BadHeader(e)))?;
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

    /// An eager message from `peer`: kept until the operation it belongs to takes it. A peer
    /// cannot have passed an operation of this rank's that needs its message: one for an
    /// operation this rank has finished is a protocol error. Send/recv numbers its operations
    /// per peer, apart from the collectives.
    pub(super) fn eager_arrived(&mut self, peer: usize, data: Vec<u8>) -> Result<(), ProtoError> {
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
}
