//! Carrying out the protocol machine's actions with real memory and the transport, and
//! feeding the transport's completions back.

use super::driver::{EAGER_HDR, Engine, Running};
use super::memory::{RawBuf, buf_index, slice};
use crate::error::Error;
use gradsync_core::proto::{Action, ProtoError, Target};
use gradsync_core::schedule::{Buf, Loc, Op};
use gradsync_core::wire::{Control, ControlRepr, DATA_HEADER_LEN, DataHeader, Signature};
use gradsync_core::{DataType, ReduceOp};
use gradsync_transport::{Board, Completion, RemoteRegion, Sge, TransportError};

impl Engine {
    /// The engine error of a protocol error.
    pub(super) fn proto_error(&self, e: ProtoError) -> Error {
        match e {
            ProtoError::Violation { peer, violation } => Error::Protocol {
                rank: self.rank,
                peer,
                violation,
            },
            ProtoError::Mismatch {
                peer,
                ours,
                theirs,
                detail,
            } => Error::Mismatch {
                rank: self.rank,
                peer,
                ours,
                theirs,
                detail,
            },
            ProtoError::PeerAborted { peer, reason } => Error::PeerAborted {
                rank: self.rank,
                peer,
                reason,
            },
            e => Error::Internal {
                rank: self.rank,
                msg: e.to_string(),
            },
        }
    }

    /// Carries out every action the machine has now. Returns whether there was any.
    pub(super) fn run_actions(&mut self) -> Result<bool, Error> {
        let mut any = false;
        let mut batch = std::mem::take(&mut self.batch);
        let res = loop {
            if let Err(e) = self.proto.poll_actions(&mut batch) {
                break Err(self.proto_error(e));
            }
            if batch.is_empty() {
                break Ok(any);
            }
            any = true;
            // By reference: an action is read where it lies, never moved.
            let res = batch.iter().try_for_each(|a| self.act(a));
            batch.clear();
            if let Err(e) = res {
                break Err(e);
            }
        };
        batch.clear();
        self.batch = batch;
        res
    }

    /// After a failure: sends the control messages the machine has (the abort), best effort,
    /// and nothing else.
    pub(super) fn send_controls_only(&mut self) {
        while let Ok(Some(a)) = self.proto.poll_action() {
            if let Action::Control { peer, msg, .. } = a {
                let _ = self.ep.post_send(peer, &msg.to_vec(), 0);
            }
        }
    }

    fn act(&mut self, a: &Action) -> Result<(), Error> {
        match *a {
            Action::Write {
                peer,
                wr,
                src,
                len,
                to,
                imm,
                checksum,
            } => self.write(peer, wr, src, len, to, imm, checksum),
            Action::Control {
                peer,
                ref msg,
                required,
            } => self.control(peer, msg, required),
            Action::Deliver {
                peer,
                slot,
                dst,
                with,
                len,
                msg,
                crc,
            } => {
                let off = self.proto.slot_offset(peer, slot) + DATA_HEADER_LEN;
                let r = self.running.as_ref().expect("running");
                let bytes = len * r.sig.dtype.size();
                // SAFETY: the slot's write has completed (its notification arrived) and the
                // sender writes it again only after its credit comes back, which the machine
                // queues after this action; the payload lies inside the slot.
                let payload = unsafe { std::slice::from_raw_parts(self.inbox.ptr.add(off), bytes) };
                self.deliver(r, peer, payload, dst, with, msg, crc)
            }
            Action::DeliverPooled {
                peer,
                slot,
                dst,
                with,
                len,
                msg,
            } => {
                let r = self.running.as_ref().expect("running");
                let bytes = len * r.sig.dtype.size();
                let off = self.proto.pool_offset(slot);
                let Some((pool, _)) = self
                    .recv_pool
                    .as_ref()
                    .filter(|(p, _)| off + bytes <= p.len)
                else {
                    return Err(Error::Internal {
                        rank: self.rank,
                        msg: format!(
                            "{}: message {msg} of rank {peer} ({bytes} bytes) staged in pool slot {slot}, outside the pool",
                            r.sig
                        ),
                    });
                };
                // SAFETY: the write into the slot has completed (its notification arrived) and
                // the slot is granted again only after this action; the span lies in the pool.
                let payload = unsafe { std::slice::from_raw_parts(pool.ptr.add(off), bytes) };
                self.deliver(r, peer, payload, dst, with, msg, None)
            }
            Action::DeliverEager {
                peer,
                dst,
                with,
                len,
                msg,
                crc,
            } => {
                let r = self.running.as_ref().expect("running");
                let payload = self.proto.eager_payload(peer);
                if payload.len() != len * r.sig.dtype.size() {
                    return Err(Error::Internal {
                        rank: self.rank,
                        msg: format!(
                            "{}: eager payload of {} bytes from rank {peer} for {len} elements",
                            r.sig,
                            payload.len()
                        ),
                    });
                }
                self.deliver(r, peer, payload, dst, with, msg, crc)
            }
            Action::Local(op) => self.local(op),
            Action::EagerSend {
                peer,
                msg,
                src,
                len,
                checksum,
            } => {
                self.build_message(msg, src, len, checksum, false);
                self.ep
                    .post_send(peer, &self.msg, 0)
                    .map_err(|e| Error::transport(self.rank, "eager send", e))
            }
            Action::Post {
                msg,
                src,
                len,
                checksum,
                board,
            } => {
                let seq = self.running.as_ref().expect("running").sig.seq;
                if board && self.take_fast_posted(seq) {
                    // The fast path put this posting up before it handed the operation over.
                    self.proto.handle_posted(true);
                    return Ok(());
                }
                self.build_message(msg, src, len, checksum, board);
                if board {
                    let (rank, msg) = (self.rank, std::mem::take(&mut self.msg));
                    let res = self.transport_board("eager post").and_then(|b| {
                        b.post(seq, &msg)
                            .map_err(|e| Error::transport(rank, "eager post", e))
                    });
                    self.msg = msg;
                    let ok = res?;
                    self.proto.handle_posted(ok);
                    return Ok(());
                }
                for p in (0..self.world).filter(|&p| p != self.rank) {
                    self.ep
                        .post_send(p, &self.msg, 0)
                        .map_err(|e| Error::transport(self.rank, "eager send", e))?;
                }
                Ok(())
            }
            Action::BoardRead { peer, seq } => {
                let rank = self.rank;
                let board = self
                    .ep
                    .board()
                    .ok_or_else(|| no_board(rank, "board read"))?;
                let got = board
                    .read(peer, seq, self.proto.board_buf(peer))
                    .map_err(|e| Error::transport(rank, "board read", e))?;
                self.proto
                    .handle_board_read(peer, seq, got)
                    .map_err(|e| self.proto_error(e))
            }
            Action::BoardRelease { seq } => {
                let rank = self.rank;
                self.transport_board("eager release")?
                    .release(seq)
                    .map_err(|e| Error::transport(rank, "eager release", e))
            }
            Action::BoardWatch { seq } => {
                self.transport_board("board watch")?.watch(seq);
                Ok(())
            }
        }
    }

    /// The transport's board (the machine uses it only when every rank has one).
    fn transport_board(&mut self, op: &'static str) -> Result<&mut dyn Board, Error> {
        let rank = self.rank;
        self.ep.board().ok_or_else(|| no_board(rank, op))
    }

    /// Posts a one-sided write: into a slot (staged header, then the payload straight from
    /// the caller's buffer) or straight into the peer's buffer.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        peer: usize,
        wr: u64,
        src: Loc,
        len: usize,
        to: Target,
        imm: u32,
        checksum: bool,
    ) -> Result<(), Error> {
        let r = self.running.as_ref().expect("running");
        let dt = r.sig.dtype;
        let bytes = len * dt.size();
        let data = Sge {
            addr: slice(&r.bufs, src, len, dt).addr,
            len: bytes,
            lkey: r.lkeys[buf_index(src.buf)],
        };
        let (sges, n, remote, offset) = match to {
            Target::Slot { slot, offset, msg } => {
                let mut header = self.proto.data_header(msg, bytes);
                let hdr_off = (peer * self.opts.nslots + slot) * DATA_HEADER_LEN;
                if checksum {
                    header.crc32c = Some(crc(r.bufs, src, len, dt));
                }
                // SAFETY: the header staging area is owned by the engine; the machine hands out
                // a slot only while its previous write is done (its staged header is free).
                let hb = unsafe {
                    std::slice::from_raw_parts_mut(self.hdrs.ptr.add(hdr_off), DATA_HEADER_LEN)
                };
                header.emit(&mut DataHeader::new_unchecked(hb));
                let hdr = Sge {
                    addr: self.hdrs.addr() + hdr_off,
                    len: DATA_HEADER_LEN,
                    lkey: self.hdr_mr.lkey,
                };
                let n = if bytes > 0 { 2 } else { 1 };
                ([hdr, data], n, self.remote_inboxes[peer], offset)
            }
            Target::Direct { rkey, offset } => {
                let remote = RemoteRegion {
                    addr: 0,
                    rkey,
                    len: offset + bytes as u64,
                };
                // An empty message (a pool slot's) has no span to read.
                ([data, data], usize::from(bytes > 0), remote, offset)
            }
        };
        // SAFETY: the staged header stays untouched until the write is done (the machine holds
        // the slot); the payload lies in a buffer the caller keeps valid and unmodified for the
        // operation, and the schedule does not overwrite it before this send completes.
        unsafe {
            self.ep
                .post_write(peer, &sges[..n], remote, offset, Some(imm), wr)
        }
        .map_err(|e| Error::transport(self.rank, "post_write", e))
    }

    /// Sends a control message. A peer that has gone needs none (waiting on it reports the
    /// loss); other failures count when the message is `required`.
    fn control(&mut self, peer: usize, msg: &ControlRepr<'_>, required: bool) -> Result<(), Error> {
        let mut buf = [0u8; 64];
        let n = msg.buffer_len();
        let res = if n <= buf.len() {
            msg.emit(&mut Control::new_unchecked(&mut buf[..n]));
            self.ep.post_send(peer, &buf[..n], 0)
        } else {
            self.ep.post_send(peer, &msg.to_vec(), 0)
        };
        match res {
            Ok(()) => Ok(()),
            Err(TransportError::PeerClosed { .. }) => {
                self.proto.handle_unsent(peer, msg);
                Ok(())
            }
            Err(_) if !self.ep.peer_alive(peer) => {
                self.proto.handle_unsent(peer, msg);
                Ok(())
            }
            Err(_) if !required => Ok(()),
            Err(e) => Err(Error::transport(self.rank, msg.kind().name(), e)),
        }
    }

    /// Builds a whole message (header and payload) in the engine's message buffer, as a board
    /// posting carries it when `board`.
    fn build_message(&mut self, msg: u32, src: Loc, len: usize, checksum: bool, board: bool) {
        let r = self.running.as_ref().expect("running");
        let dt = r.sig.dtype;
        let s = slice(&r.bufs, src, len, dt);
        let mut header = self.proto.data_header(msg, s.len);
        if board {
            header = header.for_board();
        }
        if checksum {
            header.crc32c = Some(crc(r.bufs, src, len, dt));
        }
        self.msg.clear();
        self.msg.resize(EAGER_HDR, 0);
        header.emit(&mut DataHeader::new_unchecked(&mut self.msg[..]));
        if s.len > 0 {
            // SAFETY: bounds-checked at start; the caller keeps the buffer valid and the
            // schedule does not modify this span while it is sent.
            self.msg.extend_from_slice(unsafe {
                std::slice::from_raw_parts(s.addr as *const u8, s.len)
            });
        }
    }

    /// Copies (or reduces) an arrived payload into place, after checking its checksum: a
    /// damaged payload never reaches the caller's buffer.
    #[allow(clippy::too_many_arguments)]
    fn deliver(
        &self,
        r: &Running,
        peer: usize,
        payload: &[u8],
        dst: Loc,
        with: Option<Loc>,
        msg: u32,
        expected: Option<u32>,
    ) -> Result<(), Error> {
        if let Some(expected) = expected {
            let got = crc32c::crc32c(payload);
            if got != expected {
                return Err(Error::Corrupt {
                    rank: self.rank,
                    peer,
                    sig: r.sig,
                    msg,
                    expected,
                    got,
                });
            }
        }
        if payload.is_empty() {
            return Ok(());
        }
        let dt = r.sig.dtype;
        let len = payload.len() / dt.size();
        let d = slice(&r.bufs, dst, len, dt);
        // SAFETY: bounds-checked at start; exclusive to the engine while the operation runs,
        // and distinct from the inbox and the machine's message buffers the payload lies in.
        let dbuf = unsafe { std::slice::from_raw_parts_mut(d.addr as *mut u8, d.len) };
        let op = fold(r.sig.op);
        match with {
            // The last copy of a large operation: its destination is not read again soon,
            // and it is larger than the caches anyway.
            None if r.streaming => gradsync_reduce::copy_streaming(dbuf, payload),
            None => dbuf.copy_from_slice(payload),
            Some(w) if w == dst => gradsync_reduce::reduce_in_place(dt, op, dbuf, payload),
            Some(w) => {
                let wv = slice(&r.bufs, w, len, dt);
                if wv.overlaps(d) {
                    return Err(self.overlap(&r.sig));
                }
                // SAFETY: bounds-checked at start, and not overlapping `d`.
                let wbuf = unsafe { std::slice::from_raw_parts(wv.addr as *const u8, wv.len) };
                gradsync_reduce::reduce_into(dt, op, dbuf, wbuf, payload);
            }
        }
        Ok(())
    }

    fn overlap(&self, sig: &Signature) -> Error {
        Error::Internal {
            rank: self.rank,
            msg: format!("{sig}: schedule reduces between overlapping spans"),
        }
    }

    /// A local op of the program.
    fn local(&mut self, op: Op) -> Result<(), Error> {
        let r = self.running.as_ref().expect("running");
        let dt = r.sig.dtype;
        match op {
            Op::Copy { src, dst, len } => {
                let (s, d) = (slice(&r.bufs, src, len, dt), slice(&r.bufs, dst, len, dt));
                if r.streaming && len > 0 && dst.buf == Buf::Output && !s.overlaps(d) {
                    // A large operation's copy into its output places a result there that this
                    // operation does not read again (as the last copy of a receive does).
                    // SAFETY: both spans were bounds-checked at start and do not overlap; the
                    // engine has exclusive access to the output while the operation runs.
                    let (sb, db) = unsafe {
                        (
                            std::slice::from_raw_parts(s.addr as *const u8, s.len),
                            std::slice::from_raw_parts_mut(d.addr as *mut u8, d.len),
                        )
                    };
                    gradsync_reduce::copy_streaming(db, sb);
                } else if s.addr != d.addr && len > 0 {
                    // SAFETY: both spans were bounds-checked at start; distinct buffers (or
                    // distinct positions) of one operation never overlap partially in generated
                    // programs, and `copy` tolerates overlap anyway.
                    unsafe { std::ptr::copy(s.addr as *const u8, d.addr as *mut u8, s.len) };
                }
            }
            Op::Finalize { loc, len } => {
                let d = slice(&r.bufs, loc, len, dt);
                if len > 0 {
                    // SAFETY: bounds-checked at start; the engine has exclusive access.
                    let b = unsafe { std::slice::from_raw_parts_mut(d.addr as *mut u8, d.len) };
                    gradsync_reduce::finalize_avg(dt, b, self.world);
                }
            }
            Op::ReduceParts { src, dst, len } => {
                if len == 0 {
                    return Ok(());
                }
                let d = slice(&r.bufs, dst, len, dt);
                let parts = slice(&r.bufs, src, len * self.world, dt);
                if parts.overlaps(d) {
                    return Err(self.overlap(&r.sig));
                }
                // SAFETY: both bounds-checked at start and not overlapping; the engine has
                // exclusive access while the operation runs.
                let (out, parts) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(d.addr as *mut u8, d.len),
                        std::slice::from_raw_parts(parts.addr as *const u8, parts.len),
                    )
                };
                let n = out.len();
                reduce_rank_order(dt, fold(r.sig.op), out, self.world, |p| {
                    &parts[p * n..(p + 1) * n]
                });
            }
            other => {
                return Err(Error::Internal {
                    rank: self.rank,
                    msg: format!("{}: {other:?} is not a local op", r.sig),
                });
            }
        }
        Ok(())
    }

    /// Feeds one completion of the transport to the machine.
    pub(super) fn feed(&mut self, c: Completion) -> Result<(), Error> {
        let now = self.now_coarse;
        let res = match c {
            Completion::WriteDone { wr_id } => {
                self.proto.handle_write_done(wr_id);
                Ok(())
            }
            Completion::SendDone { .. } => Ok(()),
            Completion::WriteImm { peer, imm, len } => {
                let (stride, nslots) = (self.proto.config().stride(), self.opts.nslots);
                let (inbox, proto) = (&self.inbox, &mut self.proto);
                proto.handle_write_imm(peer, imm, len, now, |k| {
                    let off = (peer * nslots + k) * stride;
                    // SAFETY: the slot's write has completed (its notification is what is fed
                    // here) and its sender writes it again only after its credit comes back.
                    unsafe { std::slice::from_raw_parts(inbox.ptr.add(off), DATA_HEADER_LEN) }
                })
            }
            Completion::Recv { peer, data } => self.proto.handle_message(peer, data, now),
        };
        res.map_err(|e| self.proto_error(e))
    }
}

/// A board action on a transport without a board: the ranks agreed on boards at init, so this
/// is a bug.
pub(super) fn no_board(rank: usize, op: &str) -> Error {
    Error::Internal {
        rank,
        msg: format!("{op}: the transport has no board"),
    }
}

/// `Avg` sums; the division is the program's `Finalize`.
pub(super) fn fold(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
}

/// The CRC32C of `len` elements at `src`.
fn crc(bufs: [RawBuf; 3], src: Loc, len: usize, dt: DataType) -> u32 {
    let p = slice(&bufs, src, len, dt);
    if p.len == 0 {
        return crc32c::crc32c(&[]);
    }
    // SAFETY: bounds-checked at start; the caller keeps the buffer valid and the schedule does
    // not modify this span before the send completes.
    crc32c::crc32c(unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len) })
}

/// `out = ((p(0) op p(1)) op p(2)) ...` over the `world` contributions `part(r)` (each at least
/// `out.len()` bytes, none of them `out`): every element reduced in rank order, so the same
/// inputs give the same bits however they were gathered.
pub(crate) fn reduce_rank_order<'a>(
    dt: DataType,
    op: ReduceOp,
    out: &mut [u8],
    world: usize,
    part: impl Fn(usize) -> &'a [u8],
) {
    let n = out.len();
    if world == 1 {
        out.copy_from_slice(&part(0)[..n]);
        return;
    }
    gradsync_reduce::reduce_into(dt, op, out, &part(0)[..n], &part(1)[..n]);
    for r in 2..world {
        gradsync_reduce::reduce_in_place(dt, op, out, &part(r)[..n]);
    }
}
