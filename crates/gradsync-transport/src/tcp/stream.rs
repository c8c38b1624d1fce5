//! One TCP stream: its receive state machine (a frame header, then the payload read straight
//! into the destination region) and its send queue, flushed with `sendmsg`; and the receive
//! side of the writes striped over a pair's streams ([`Stripes`]).
//!
//! # Striped writes
//!
//! A write with immediate of at least [`STRIPE_MIN`] bytes to a peer on another host reached
//! over several streams is cut into one part per stream (part `i` on stream `i`, see
//! [`super::wire`]), so that every stream carries a share of each write, one write after the
//! other. Posting whole writes to the streams in turn lets a write overtake the one posted
//! before it to the same peer: both share the link, and the first lands later than it would
//! alone (a Rabenseifner all-reduce sends the last step of one call and the first of the next
//! to the same partner, back to back). Each stream delivers its parts in order, so the `k`-th
//! part a stream delivers belongs to the pair's `k`-th striped write, and a write completes,
//! with its immediate and the length of all its parts, once every stream has delivered its
//! part of it; writes complete in the order they were posted.

use super::wire::{FRAME_HEADER_LEN, FrameHeader, FrameHeaderRepr};
use crate::error::{Result, TransportError, Violation};
use crate::regions::RegionTable;
use crate::verbs::{Completion, MAX_SEND};
use crate::wire::{WireError, array};
use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

/// Bytes of a stream's receive buffer.
pub(super) const RXBUF: usize = 64 * 1024;
/// Bytes read from one stream per poll before moving on to the others.
const RX_BUDGET: usize = 8 << 20;
/// Payload bytes left to read below which the receive buffer is used instead of reading
/// straight into the region.
const DIRECT_MIN: usize = 16 * 1024;
/// Writes with immediate of at least this many bytes are striped over a peer's streams.
pub(super) const STRIPE_MIN: usize = 64 * 1024;
/// Striped writes that may wait for parts on other streams (a bound on what a peer can make
/// this rank hold).
const MAX_PENDING_STRIPES: u64 = 4096;

/// Where a stream is in the frame it receives.
#[derive(Debug)]
pub(super) enum Rx {
    /// Waiting for a frame header.
    Header,
    /// Reading a write's payload into place.
    Write {
        dst: usize,
        remaining: usize,
        end: WriteEnd,
        total: u32,
    },
    /// Reading a send's payload.
    Send { data: Vec<u8>, need: usize },
}

/// What a write's last byte landing completes.
#[derive(Clone, Copy, Debug)]
pub(super) enum WriteEnd {
    /// Nothing: a write without immediate.
    Silent,
    /// The write, with this immediate.
    Imm(u32),
    /// A part of the striped write of this immediate (see [`Stripes`]).
    Part(u32),
}

/// A frame queued for sending: its header and the spans of its payload.
#[derive(Debug)]
pub(super) struct TxItem {
    pub(super) hdr: [u8; FRAME_HEADER_LEN],
    pub(super) sges: Vec<(usize, usize)>,
    /// Keeps the payload of a two-sided send alive while `sges` points into it.
    pub(super) _owned: Vec<u8>,
    pub(super) wr_id: u64,
    pub(super) is_send: bool,
    /// A part of a striped write: the write is done once every part is.
    pub(super) part: bool,
}

impl TxItem {
    /// Bytes of the frame, header included.
    pub(super) fn total(&self) -> usize {
        FRAME_HEADER_LEN + self.sges.iter().map(|s| s.1).sum::<usize>()
    }
}

/// One TCP stream to a peer, with its receive state and send queue.
#[derive(Debug)]
pub(super) struct Stream {
    pub(super) sock: TcpStream,
    pub(super) fd: RawFd,
    pub(super) rx: Rx,
    pub(super) rxbuf: Box<[u8]>,
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) txq: VecDeque<TxItem>,
    pub(super) tx_off: usize,
    /// End of stream read: nothing more will arrive on this stream.
    pub(super) eof: bool,
    /// Sending failed (the peer is gone); what it still sent may be read until `eof`.
    pub(super) tx_failed: bool,
    /// The last frame was large: read the next header alone, so that a large payload after it
    /// is read straight into place rather than through the receive buffer.
    pub(super) header_only: bool,
}

impl Stream {
    /// A stream over a connected, non-blocking socket.
    pub(super) fn new(sock: TcpStream) -> Stream {
        let fd = sock.as_raw_fd();
        Stream {
            sock,
            fd,
            rx: Rx::Header,
            rxbuf: vec![0u8; RXBUF].into_boxed_slice(),
            lo: 0,
            hi: 0,
            txq: VecDeque::new(),
            tx_off: 0,
            eof: false,
            tx_failed: false,
            header_only: false,
        }
    }
}

/// A queued frame the kernel has taken whole.
#[derive(Clone, Copy, Debug)]
pub(super) struct Sent {
    pub(super) wr_id: u64,
    pub(super) is_send: bool,
    pub(super) part: bool,
}

/// The receive side of one peer's striped writes: which parts have landed (see the [module
/// documentation](self#striped-writes)).
#[derive(Debug, Default)]
pub(super) struct Stripes {
    /// Per stream, the number (among the pair's striped writes) of the next part it delivers.
    next: Vec<u64>,
    /// The number of the first write not completed.
    base: u64,
    /// The writes from `base` on: immediate, bytes landed, parts landed.
    pending: VecDeque<(u32, u64, usize)>,
}

impl Stripes {
    /// Part `part` of `parts` of a striped write begins on stream `index` of `streams`:
    /// whether it fits them (before its payload is read).
    fn check(
        &self,
        index: usize,
        streams: usize,
        part: u8,
        parts: u8,
    ) -> std::result::Result<(), String> {
        if usize::from(parts) != streams || usize::from(part) != index {
            return Err(format!(
                "part {part} of {parts} on stream {index} of {streams} (part i of a write goes on stream i, one part per stream)"
            ));
        }
        let m = self.next.get(index).copied().unwrap_or(self.base);
        if m - self.base >= MAX_PENDING_STRIPES {
            return Err(format!(
                "{MAX_PENDING_STRIPES} writes wait for parts on other streams"
            ));
        }
        Ok(())
    }

    /// The part on stream `index` of `streams`, of `len` bytes, has landed: completes, in order,
    /// the writes whose every part has.
    fn landed(
        &mut self,
        peer: usize,
        index: usize,
        streams: usize,
        imm: u32,
        len: u32,
        out: &mut Vec<Completion>,
    ) -> std::result::Result<(), String> {
        if self.next.len() < streams {
            self.next.resize(streams, self.base);
        }
        let m = self.next[index];
        self.next[index] += 1;
        let at = (m - self.base) as usize;
        while self.pending.len() <= at {
            self.pending.push_back((imm, 0, 0));
        }
        let w = &mut self.pending[at];
        if w.2 > 0 && w.0 != imm {
            return Err(format!(
                "write {m} has immediate {:#x} on one stream and {imm:#x} on stream {index}",
                w.0
            ));
        }
        w.0 = imm;
        w.1 += u64::from(len);
        w.2 += 1;
        while self.pending.front().is_some_and(|w| w.2 == streams) {
            let (imm, bytes, _) = self.pending.pop_front().expect("front");
            self.base += 1;
            let len = u32::try_from(bytes)
                .map_err(|_| format!("write {} of {bytes} bytes", self.base - 1))?;
            out.push(Completion::WriteImm { peer, imm, len });
        }
        Ok(())
    }
}

/// Sends as much of the stream's queue as the socket takes. Appends wr_ids of items that
/// finished (tagged: high bit set for sends) to `done`.
pub(super) fn flush(st: &mut Stream, done: &mut Vec<Sent>) -> io::Result<()> {
    const MAXIOV: usize = 64;
    loop {
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(MAXIOV);
        let mut skip = st.tx_off;
        for item in st.txq.iter() {
            let mut push = |addr: usize, len: usize| {
                if skip >= len {
                    skip -= len;
                    return;
                }
                iov.push(libc::iovec {
                    iov_base: (addr + skip) as *mut libc::c_void,
                    iov_len: len - skip,
                });
                skip = 0;
            };
            push(item.hdr.as_ptr() as usize, FRAME_HEADER_LEN);
            for &(a, l) in &item.sges {
                push(a, l);
            }
            if iov.len() >= MAXIOV - 8 {
                break;
            }
        }
        if iov.is_empty() {
            return Ok(());
        }
        let mut msg: libc::msghdr = unsafe_zeroed_msghdr();
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        // SAFETY: msg points to iovecs describing the frame headers (owned by the queue items)
        // and the registered spans the caller promised to keep valid until completion; the
        // socket is a valid fd owned by `st`.
        let n = unsafe { libc::sendmsg(st.fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(()),
                io::ErrorKind::Interrupted => continue,
                _ => Err(e),
            };
        }
        let mut n = n as usize;
        while n > 0 {
            let total = st.txq[0].total();
            let left = total - st.tx_off;
            if n >= left {
                n -= left;
                st.tx_off = 0;
                let item = st.txq.pop_front().expect("item");
                done.push(Sent {
                    wr_id: item.wr_id,
                    is_send: item.is_send,
                    part: item.part,
                });
            } else {
                st.tx_off += n;
                n = 0;
            }
        }
    }
}

fn unsafe_zeroed_msghdr() -> libc::msghdr {
    // SAFETY: msghdr is a plain C struct for which all-zero bytes are a valid value.
    unsafe { std::mem::zeroed() }
}

/// Reads what is available on stream `index` of a peer's `streams`; returns true if anything
/// was read. `stripes` is the peer's striped writes.
#[allow(clippy::too_many_arguments)]
pub(super) fn rx_stream(
    rank: usize,
    peer: usize,
    index: usize,
    streams: usize,
    st: &mut Stream,
    stripes: &mut Stripes,
    regions: &RegionTable,
    out: &mut Vec<Completion>,
) -> Result<bool> {
    let mut progressed = false;
    let mut budget = RX_BUDGET;
    let proto = |violation| TransportError::Protocol {
        rank,
        peer,
        violation,
    };
    loop {
        match &mut st.rx {
            Rx::Header => {
                if st.hi - st.lo >= FRAME_HEADER_LEN {
                    let header: [u8; FRAME_HEADER_LEN] = array(&st.rxbuf, st.lo);
                    let view = FrameHeader::new_unchecked(&header[..]);
                    let parsed = FrameHeaderRepr::parse(&view);
                    let bad = |error| proto(Violation::FrameHeader { error, header });
                    // Bad reserved bytes are refused before the header is consumed, an
                    // unknown kind after.
                    if let Err(e @ WireError::Reserved { .. }) = parsed {
                        return Err(bad(e));
                    }
                    st.lo += FRAME_HEADER_LEN;
                    st.header_only = view.payload_len() as usize >= DIRECT_MIN;
                    let (rkey, offset, len, end) = match parsed.map_err(bad)? {
                        FrameHeaderRepr::Write {
                            rkey,
                            offset,
                            len,
                            imm,
                        } => (
                            rkey,
                            offset,
                            len,
                            imm.map_or(WriteEnd::Silent, WriteEnd::Imm),
                        ),
                        FrameHeaderRepr::WritePart {
                            rkey,
                            offset,
                            len,
                            imm,
                            part,
                            parts,
                        } => {
                            stripes
                                .check(index, streams, part, parts)
                                .map_err(|why| proto(Violation::Stripe { why }))?;
                            (rkey, offset, len, WriteEnd::Part(imm))
                        }
                        FrameHeaderRepr::Send { len } => {
                            if len as usize > MAX_SEND {
                                return Err(proto(Violation::OversizedSend { len, max: MAX_SEND }));
                            }
                            st.rx = Rx::Send {
                                data: Vec::with_capacity(len as usize),
                                need: len as usize,
                            };
                            progressed = true;
                            continue;
                        }
                    };
                    let dst = regions.check_remote_write(peer, rkey, offset, len as u64)?;
                    st.rx = Rx::Write {
                        dst,
                        remaining: len as usize,
                        end,
                        total: len,
                    };
                    progressed = true;
                    continue;
                }
            }
            Rx::Write {
                dst,
                remaining,
                end,
                total,
            } => {
                if *remaining == 0 {
                    match *end {
                        WriteEnd::Silent => {}
                        WriteEnd::Imm(imm) => out.push(Completion::WriteImm {
                            peer,
                            imm,
                            len: *total,
                        }),
                        WriteEnd::Part(imm) => stripes
                            .landed(peer, index, streams, imm, *total, out)
                            .map_err(|why| proto(Violation::Stripe { why }))?,
                    }
                    st.rx = Rx::Header;
                    continue;
                }
                if st.hi > st.lo {
                    let n = (*remaining).min(st.hi - st.lo);
                    // SAFETY: dst..dst+remaining was checked to lie in a region registered
                    // for remote writes, which its owner keeps valid and leaves alone until
                    // the completion pushed above.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            st.rxbuf[st.lo..].as_ptr(),
                            *dst as *mut u8,
                            n,
                        )
                    };
                    st.lo += n;
                    *dst += n;
                    *remaining -= n;
                    progressed = true;
                    continue;
                }
                if *remaining >= DIRECT_MIN {
                    // SAFETY: as above; the slice covers exactly the checked span.
                    let target =
                        unsafe { std::slice::from_raw_parts_mut(*dst as *mut u8, *remaining) };
                    match st.sock.read(target) {
                        Ok(0) => {
                            st.eof = true;
                            return Ok(progressed);
                        }
                        Ok(n) => {
                            *dst += n;
                            *remaining -= n;
                            progressed = true;
                            budget = budget.saturating_sub(n);
                            if budget == 0 {
                                return Ok(true);
                            }
                            continue;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            return Ok(progressed);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            return Err(TransportError::Io {
                                rank,
                                peer,
                                op: "read",
                                source: e,
                            });
                        }
                    }
                }
            }
            Rx::Send { data, need } => {
                if data.len() == *need {
                    out.push(Completion::Recv {
                        peer,
                        data: std::mem::take(data),
                    });
                    st.rx = Rx::Header;
                    continue;
                }
                if st.hi > st.lo {
                    let n = (*need - data.len()).min(st.hi - st.lo);
                    data.extend_from_slice(&st.rxbuf[st.lo..st.lo + n]);
                    st.lo += n;
                    progressed = true;
                    continue;
                }
            }
        }
        // Need more bytes in the receive buffer.
        if st.lo == st.hi {
            st.lo = 0;
            st.hi = 0;
        } else if st.lo > 0 && st.rxbuf.len() - st.hi < FRAME_HEADER_LEN {
            st.rxbuf.copy_within(st.lo..st.hi, 0);
            st.hi -= st.lo;
            st.lo = 0;
        }
        let want = if st.header_only && matches!(st.rx, Rx::Header) {
            FRAME_HEADER_LEN - (st.hi - st.lo)
        } else {
            st.rxbuf.len() - st.hi
        };
        match st.sock.read(&mut st.rxbuf[st.hi..st.hi + want]) {
            Ok(0) => {
                st.eof = true;
                return Ok(progressed);
            }
            Ok(n) => {
                st.hi += n;
                progressed = true;
                budget = budget.saturating_sub(n);
                if budget == 0 {
                    return Ok(true);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progressed),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(TransportError::Io {
                    rank,
                    peer,
                    op: "read",
                    source: e,
                });
            }
        }
    }
}
