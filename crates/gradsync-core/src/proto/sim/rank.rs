//! One simulated rank: its protocol machine, its memory (inbox, the operation's buffers, its
//! board) and the execution of the machine's actions against them.

use super::types::{Event, Landing, SimError};
use crate::proto::action::{Action, Target};
use crate::proto::call::Mode;
use crate::proto::machine::{Config, Protocol};
use crate::reference;
use crate::schedule::{Algorithm, Buf, Loc, Op, Params, Schedule, plan};
use crate::wire::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr, Signature};
use crate::{DataType, ReduceOp};
use std::time::Instant;

/// CRC32C (Castagnoli), bit by bit: what a transport's checksum would be, for the simulator.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0x82f6_3b78 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// A rank's board: two slots of postings, and the sequence number up to which this rank has
/// read its peers' postings.
#[derive(Debug, Default)]
pub(crate) struct Board {
    pub(crate) slots: [(u64, Vec<u8>); 2],
    pub(crate) released: u64,
}

/// The operation a rank runs now.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) index: usize,
    pub(crate) params: Params,
    pub(crate) dtype: DataType,
    /// Input, Output, Scratch.
    pub(crate) bufs: [Vec<u8>; 3],
}

/// One simulated rank.
#[derive(Debug)]
pub(crate) struct SimRank {
    pub(crate) rank: usize,
    pub(crate) proto: Protocol,
    pub(crate) inbox: Vec<u8>,
    /// The shared pool, and per slot whether a message landed there and was not delivered.
    pub(crate) pool: Vec<u8>,
    pub(crate) pool_full: Vec<bool>,
    /// Per (sender, slot): a message landed there and was not consumed yet.
    pub(crate) slot_full: Vec<bool>,
    pub(crate) running: Option<Running>,
    /// The index of the next operation to start.
    pub(crate) next: usize,
    /// Each finished operation's result range of Output.
    pub(crate) results: Vec<Vec<u8>>,
    /// The last step moved something.
    pub(crate) moved: bool,
}

/// The remote key of buffer `b` of operation `index` of `rank`: a key names one operation's
/// buffer, so a write meant for an older operation is caught. Never 0, and distinct for every
/// buffer (an Input and an Output key must not coincide).
pub(crate) fn rkey(rank: usize, index: usize, b: usize) -> u32 {
    ((rank * 1_000_003 + index) * 3 + b + 1) as u32
}

/// The remote key of `rank`'s shared pool (far from every buffer key of a simulation).
pub(crate) fn pool_key(rank: usize) -> u32 {
    u32::MAX - rank as u32
}

fn buf_index(b: Buf) -> usize {
    match b {
        Buf::Input => 0,
        Buf::Output => 1,
        Buf::Scratch => 2,
    }
}

impl SimRank {
    pub(crate) fn new(cfg: Config, now: Instant) -> Self {
        SimRank {
            rank: cfg.rank,
            proto: Protocol::new(cfg, now),
            inbox: vec![0; cfg.inbox_len()],
            pool: Vec::new(),
            pool_full: Vec::new(),
            slot_full: vec![false; cfg.world * cfg.nslots],
            running: None,
            next: 0,
            results: Vec::new(),
            moved: false,
        }
    }

    /// The bytes of `len` elements at `loc` of the running operation.
    fn span(r: &Running, loc: Loc, len: usize) -> std::ops::Range<usize> {
        let ds = r.dtype.size();
        loc.start * ds..(loc.start + len) * ds
    }

    /// Starts operation `index` with `params` and this rank's input.
    pub(crate) fn start(
        &mut self,
        index: usize,
        params: Params,
        dtype: DataType,
        sig: Signature,
        input: &[u8],
        now: Instant,
    ) -> Result<(), SimError> {
        let prog = plan::build(&params).map_err(|e| SimError::Plan {
            rank: self.rank,
            call: index,
            msg: e.to_string(),
        })?;
        let ds = dtype.size();
        let mut output = vec![0xa5u8; params.output_elems() * ds];
        let input = if params.in_place {
            output[params.input_offset() * ds..][..input.len()].copy_from_slice(input);
            Vec::new()
        } else {
            input.to_vec()
        };
        let scratch = vec![0x5au8; prog.scratch_elems() * ds];
        let mode = if params.algorithm == Algorithm::Eager {
            Mode::Eager
        } else {
            Mode::Slots
        };
        let keys = [0, 1, 2].map(|b| rkey(self.rank, index, b));
        let sched = Box::new(Schedule::new(prog, params.world));
        self.proto.start(sig, sched, mode, keys, now);
        self.running = Some(Running {
            index,
            params,
            dtype,
            bufs: [input, output, scratch],
        });
        Ok(())
    }

    /// Reads `len` elements at `loc` (in place, Input is Output).
    fn read(r: &Running, loc: Loc, len: usize) -> Vec<u8> {
        let b = if r.params.in_place && loc.buf == Buf::Input {
            1
        } else {
            buf_index(loc.buf)
        };
        r.bufs[b][Self::span(r, loc, len)].to_vec()
    }

    /// Copies `data` to `dst`, or reduces it with `with` into `dst`.
    fn land(r: &mut Running, op: ReduceOp, dst: Loc, with: Option<Loc>, data: &[u8]) {
        let len = data.len() / r.dtype.size();
        let d = Self::span(r, dst, len);
        match with {
            None => r.bufs[buf_index(dst.buf)][d].copy_from_slice(data),
            Some(w) => {
                let a = Self::read(r, w, len);
                reference::reduce_slices(r.dtype, op, &mut r.bufs[buf_index(dst.buf)][d], &a, data);
            }
        }
    }

    fn local(r: &mut Running, op: ReduceOp, world: usize, o: Op) {
        let ds = r.dtype.size();
        match o {
            Op::Copy { src, dst, len } => {
                let data = Self::read(r, src, len);
                Self::land(r, op, dst, None, &data);
            }
            Op::Finalize { loc, len } => {
                let s = Self::span(r, loc, len);
                reference::finalize_avg(r.dtype, &mut r.bufs[buf_index(loc.buf)][s], world);
            }
            Op::ReduceParts { src, dst, len } => {
                let part = |i: usize| Self::read(r, Loc::new(src.buf, src.start + i * len), len);
                let mut acc = part(0);
                for i in 1..world {
                    reference::reduce_assign(r.dtype, op, &mut acc, &part(i));
                }
                let d = Self::span(r, dst, len);
                debug_assert_eq!(d.len(), len * ds);
                r.bufs[buf_index(dst.buf)][d].copy_from_slice(&acc);
            }
            other => unreachable!("not a local op: {other:?}"),
        }
    }

    /// The header and payload of a whole message.
    fn message(
        r: &Running,
        mut header: DataHeaderRepr,
        src: Loc,
        len: usize,
        crc: bool,
    ) -> Vec<u8> {
        let payload = Self::read(r, src, len);
        if crc {
            header.crc32c = Some(crc32c(&payload));
        }
        let mut m = vec![0u8; DATA_HEADER_LEN];
        header.emit(&mut DataHeader::new_unchecked(&mut m[..]));
        m.extend_from_slice(&payload);
        m
    }

    /// Carries out every action the machine has now; the events they cause go to `out`.
    pub(crate) fn drain(
        &mut self,
        world: usize,
        boards: &mut [Board],
        out: &mut Vec<Event>,
    ) -> Result<(), SimError> {
        let err = |rank, e| SimError::Proto { rank, error: e };
        loop {
            let a = match self.proto.poll_action() {
                Ok(Some(a)) => a,
                Ok(None) => return Ok(()),
                Err(e) => return Err(err(self.rank, e)),
            };
            let op = self.proto.fold_op().unwrap_or(ReduceOp::Sum);
            let me = self.rank;
            match a {
                Action::Write {
                    peer,
                    wr,
                    src,
                    len,
                    to,
                    imm,
                    checksum,
                } => {
                    let r = self.running.as_ref().expect("running");
                    let header = match to {
                        Target::Slot { msg, .. } => {
                            let mut h = self.proto.data_header(msg, len * r.dtype.size());
                            if checksum {
                                h.crc32c = Some(crc32c(&Self::read(r, src, len)));
                            }
                            Some(h)
                        }
                        Target::Direct { .. } => None,
                    };
                    out.push(Event::Land(Landing {
                        from: me,
                        to: peer,
                        wr,
                        header,
                        src,
                        len,
                        target: to,
                        imm,
                    }));
                }
                Action::Control { peer, msg, .. } => out.push(Event::Msg {
                    from: me,
                    to: peer,
                    data: msg.to_vec(),
                }),
                Action::Deliver {
                    peer,
                    slot,
                    dst,
                    with,
                    len,
                    msg,
                    crc,
                } => {
                    let off = self.proto.slot_offset(peer, slot);
                    let r = self.running.as_mut().expect("running");
                    let bytes = len * r.dtype.size();
                    let data = self.inbox[off + DATA_HEADER_LEN..][..bytes].to_vec();
                    check_crc(crc, &data, me, peer, msg)?;
                    Self::land(r, op, dst, with, &data);
                    self.slot_full[peer * self.proto.config().nslots + slot] = false;
                }
                Action::DeliverPooled {
                    peer,
                    slot,
                    dst,
                    with,
                    len,
                    msg,
                } => {
                    let off = self.proto.pool_offset(slot);
                    let r = self.running.as_mut().expect("running");
                    let bytes = len * r.dtype.size();
                    if !std::mem::take(&mut self.pool_full[slot]) {
                        return Err(SimError::Internal(format!(
                            "rank {me}: message {msg} of rank {peer} delivered from pool slot {slot}, where nothing landed"
                        )));
                    }
                    let data = self.pool[off..][..bytes].to_vec();
                    Self::land(r, op, dst, with, &data);
                }
                Action::DeliverEager {
                    peer,
                    dst,
                    with,
                    len,
                    msg,
                    crc,
                } => {
                    let r = self.running.as_mut().expect("running");
                    let data = self.proto.eager_payload(peer).to_vec();
                    if data.len() != len * r.dtype.size() {
                        return Err(SimError::Internal(format!(
                            "rank {me}: eager payload of {} bytes for {len} elements",
                            data.len()
                        )));
                    }
                    check_crc(crc, &data, me, peer, msg)?;
                    Self::land(r, op, dst, with, &data);
                }
                Action::Local(o) => {
                    let r = self.running.as_mut().expect("running");
                    Self::local(r, op, world, o);
                }
                Action::EagerSend {
                    peer,
                    msg,
                    src,
                    len,
                    checksum,
                } => {
                    let r = self.running.as_ref().expect("running");
                    let header = self.proto.data_header(msg, len * r.dtype.size());
                    let data = Self::message(r, header, src, len, checksum);
                    out.push(Event::Msg {
                        from: me,
                        to: peer,
                        data,
                    });
                }
                Action::Post {
                    msg,
                    src,
                    len,
                    checksum,
                    board,
                } => {
                    let r = self.running.as_ref().expect("running");
                    let header = self.proto.data_header(msg, len * r.dtype.size());
                    let posted = if board { header.for_board() } else { header };
                    let data = Self::message(r, posted, src, len, checksum);
                    if board {
                        // The slot it reuses must have been released by every peer.
                        let seq = header.sig.seq;
                        let old = boards[me].slots[(seq % 2) as usize].0;
                        let free = old == 0
                            || (0..world)
                                .filter(|&p| p != me)
                                .all(|p| boards[p].released >= old);
                        if free {
                            boards[me].slots[(seq % 2) as usize] = (seq, data);
                        }
                        self.proto.handle_posted(free);
                    } else {
                        for p in (0..world).filter(|&p| p != me) {
                            out.push(Event::Msg {
                                from: me,
                                to: p,
                                data: data.clone(),
                            });
                        }
                    }
                }
                Action::BoardRead { peer, seq } => {
                    let (s, data) = &boards[peer].slots[(seq % 2) as usize];
                    let got = *s == seq;
                    if got {
                        let buf = self.proto.board_buf(peer);
                        buf.clear();
                        buf.extend_from_slice(data);
                    }
                    self.proto
                        .handle_board_read(peer, seq, got)
                        .map_err(|e| err(me, e))?;
                }
                Action::BoardRelease { seq } => boards[me].released = seq,
                Action::BoardWatch { .. } => {}
            }
        }
    }
}

/// A payload's checksum, when its header carried one, against the bytes that arrived.
fn check_crc(
    crc: Option<u32>,
    data: &[u8],
    rank: usize,
    peer: usize,
    msg: u32,
) -> Result<(), SimError> {
    match crc {
        Some(want) if crc32c(data) != want => Err(SimError::Corrupt { rank, peer, msg }),
        _ => Ok(()),
    }
}
