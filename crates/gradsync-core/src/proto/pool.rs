//! The shared pool of receive slots: pairs without inbox slots between them (receive memory
//! beyond the budget) stage the messages a receiver reduces on receipt in slots its pool
//! grants, one clear-to-send per message, to senders that said the message is ready.

use super::action::Action;
use super::error::{ProtoError, Violation};
use super::link::MAX_OFFERS;
use super::machine::Protocol;
use crate::Collective;
use crate::wire::{ControlRepr, Cts};

impl Protocol {
    /// Gives this rank a shared pool of `slots` receive slots (each
    /// [`Config::stride`](super::Config::stride) bytes, slot `i` at `i * stride` of the
    /// driver's pool region, whose remote key is `rkey` and whose address is `addr`).
    ///
    /// Messages from pooled peers ([`set_pooled`](Self::set_pooled)) that are reduced on
    /// receipt, are empty, or cannot be written straight into place are staged there: once
    /// the schedule has issued the receive and the sender has said the message is ready, the
    /// receiver takes a free slot (receives in the order they were issued) and names it in a
    /// clear-to-send; the sender writes there, and the receiver delivers from there and frees
    /// the slot. Before any traffic.
    pub fn set_pool(&mut self, slots: usize, rkey: u32, addr: u64) {
        self.pool_slots = slots.min(u32::MAX as usize);
        self.pool_rkey = rkey;
        self.pool_addr = addr;
        self.pool_free = (0..self.pool_slots as u32).rev().collect();
        self.pool_wait.clear();
    }

    /// Makes the pair with `peer` pooled: neither rank has a part of the other's inbox, and
    /// every message between them goes where its receiver's clear-to-send says (the
    /// destination, or a slot of the receiver's pool). Both ranks of the pair must do so,
    /// before any traffic. Refused (false) with checksums on, whose messages need a slot's
    /// header; a pool of at least one slot is needed to receive from a pooled peer.
    ///
    /// With `absolute`, the clear-to-sends to the peer name a pool slot by its address (the
    /// pool's address plus the slot's offset), as a transport that writes to remote
    /// addresses (RDMA) needs; else by its offset in the pool region.
    pub fn set_pooled(&mut self, peer: usize, absolute: bool) -> bool {
        if self.cfg.checksum || peer == self.cfg.rank {
            return false;
        }
        let Some(l) = self.links.get_mut(peer) else {
            return false;
        };
        l.pooled = true;
        l.pool_absolute = absolute;
        l.window = 0;
        l.credits = 0;
        true
    }

    /// Whether the pair with `peer` is pooled.
    pub fn pooled(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| l.pooled)
    }

    /// Slots of the shared pool, how many are free now, and how many messages were staged
    /// there so far.
    pub fn pool(&self) -> (usize, usize, u64) {
        (self.pool_slots, self.pool_free.len(), self.pool_staged)
    }

    /// Hands the free slots of the pool to the receives waiting for one whose senders said
    /// their message is ready (so that a slot is never held by a message that waits for
    /// anything but the clear-to-send), in the order they were issued: a clear-to-send naming
    /// the slot goes to each one's sender.
    pub(super) fn grant_pool(&mut self) {
        let Some(c) = self.call.as_ref() else {
            return;
        };
        let dsize = c.sig.dtype.size();
        let key = (c.sig.seq, c.sig.coll == Collective::SendRecv);
        let mut i = 0;
        while !self.pool_free.is_empty() && i < self.pool_wait.len() {
            let (peer, msg) = self.pool_wait[i];
            let Some(pr) = self.q.recvq[peer]
                .iter_mut()
                .find(|pr| pr.msg == msg && pr.awaiting)
            else {
                self.pool_wait.remove(i);
                continue;
            };
            let ready = &mut self.links[peer].ready;
            let Some(j) = ready.iter().position(|&r| r == (key.0, msg, key.1)) else {
                i += 1;
                continue;
            };
            ready.swap_remove(j);
            let base = if self.links[peer].pool_absolute {
                self.pool_addr
            } else {
                0
            };
            self.pool_wait.remove(i);
            let slot = self.pool_free.pop().expect("a free slot");
            pr.awaiting = false;
            pr.pool = Some(slot);
            self.pool_staged += 1;
            self.actions.push(Action::Control {
                peer,
                msg: ControlRepr::ClearToSend(Cts {
                    msg,
                    sig: c.sig,
                    rkey: self.pool_rkey,
                    bytes: (pr.len * dsize) as u32,
                    offset: base + slot as u64 * self.stride as u64,
                }),
                required: true,
            });
        }
    }

    /// Slot `slot` of the shared pool: its offset in the pool region.
    #[inline]
    pub fn pool_offset(&self, slot: usize) -> usize {
        slot * self.stride
    }

    /// `peer` says message `msg` of its call `seq` is ready to send.
    pub(super) fn ready_to_send(
        &mut self,
        peer: usize,
        msg: u32,
        seq: u64,
        p2p: bool,
    ) -> Result<(), ProtoError> {
        let coll = self.last_coll_seq;
        let l = &mut self.links[peer];
        if !l.pooled {
            return Err(ProtoError::violation(
                peer,
                Violation::NotPooled { msg, seq },
            ));
        }
        // A collective's message that this rank took in place was announced all the
        // same (the sender cannot tell whether it is reduced): once a later
        // collective has started, that announcement is spent. (A send/recv's is
        // always used: only empty ones are announced.)
        l.ready.retain(|&(s, _, p)| p || s >= coll);
        if l.ready.len() >= MAX_OFFERS {
            return Err(ProtoError::violation(
                peer,
                Violation::TooManyOffers { max: MAX_OFFERS },
            ));
        }
        l.ready.push((seq, msg, p2p));
        self.grant_pool();
        Ok(())
    }
}
