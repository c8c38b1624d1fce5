//! The record ring of one sender in a receiver's segment: the producer side (reserve,
//! publish, flush of the pending queue, push of a record) and the consumer side (drain), both
//! as methods of [`Peer`].

use super::directory::{LocalTable, WRITTEN_MIN};
use super::layout::{C_HEAD, C_TAIL, C_WANT_SPACE, RING_BYTES, ctl_off};
use super::peer::{Me, Peer};
use super::segment::Segment;
use super::stream::copy_streaming;
use super::wire::{
    KIND_PAD, RECORD_HEADER_LEN, RECORD_PREFIX_LEN, RecordHeader, RecordRepr, record_len,
};
use crate::error::{Result, Violation};
use crate::verbs::{Completion, Sge};
use std::ptr;
use std::sync::atomic::{Ordering, fence};

/// The payload of a record being posted.
pub(super) enum Payload<'a> {
    /// No payload (a write notification).
    Empty,
    /// A message's bytes.
    Bytes(&'a [u8]),
    /// A gather list's spans.
    Gather(&'a [Sge]),
}

impl Payload<'_> {
    /// Payload bytes.
    fn len(&self) -> usize {
        match self {
            Payload::Empty => 0,
            Payload::Bytes(b) => b.len(),
            Payload::Gather(s) => s.iter().map(|s| s.len).sum(),
        }
    }

    /// Copies the payload to `dst`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for `self.len()` bytes of writes and not overlap the payload; the
    /// spans of a gather list must be readable.
    pub(super) unsafe fn copy_to(&self, dst: *mut u8) {
        match self {
            Payload::Empty => {}
            // SAFETY: the caller guarantees `dst` holds `b.len()` bytes.
            Payload::Bytes(b) => unsafe { ptr::copy_nonoverlapping(b.as_ptr(), dst, b.len()) },
            Payload::Gather(sges) => {
                let mut at = 0;
                for s in sges.iter() {
                    // SAFETY: the caller guarantees the span is readable and `dst` holds the
                    // sum of the span lengths.
                    unsafe { ptr::copy_nonoverlapping(s.addr as *const u8, dst.add(at), s.len) };
                    at += s.len;
                }
            }
        }
    }

    /// Copies the payload to `dst` as [`copy_to`](Self::copy_to) does, with non-temporal
    /// stores for the spans `stream` picks (see [`super::stream`]).
    ///
    /// # Safety
    ///
    /// As for [`copy_to`](Self::copy_to).
    pub(super) unsafe fn copy_to_streaming(&self, dst: *mut u8, stream: impl Fn(&Sge) -> bool) {
        let Payload::Gather(sges) = self else {
            // SAFETY: forwarded from the caller.
            return unsafe { self.copy_to(dst) };
        };
        let mut at = 0;
        for s in sges.iter() {
            let (src, d) = (s.addr as *const u8, dst.wrapping_add(at));
            if stream(s) {
                // SAFETY: the caller guarantees the span is readable and `dst` holds the sum
                // of the span lengths, without overlap.
                unsafe { copy_streaming(d, src, s.len) };
            } else {
                // SAFETY: as above.
                unsafe { ptr::copy_nonoverlapping(src, d, s.len) };
            }
            at += s.len;
        }
    }
}

impl Peer {
    /// Reserves `rec_len` bytes in the peer's ring (writing a padding record first when the
    /// record would cross the end); returns the ring offset, or `None` when the ring is full.
    fn reserve(&mut self, me: Me, rec_len: usize) -> Result<Option<usize>> {
        let size = RING_BYTES as u64;
        let at = (self.tail % size) as usize;
        let contig = RING_BYTES - at;
        let need = if rec_len <= contig {
            rec_len
        } else {
            contig + rec_len
        } as u64;
        if self.tail - self.head_cache + need > size {
            let head = self.seg.a64(self.ctl + C_HEAD).load(Ordering::Acquire);
            if head < self.head_cache || head > self.tail {
                let violation = Violation::RingHead {
                    head,
                    min: self.head_cache,
                    max: self.tail,
                };
                return Err(self.protocol(me, violation));
            }
            self.head_cache = head;
            if self.tail - head + need > size {
                return Ok(None);
            }
        }
        if rec_len <= contig {
            self.tail += rec_len as u64;
            return Ok(Some(at));
        }
        let pad = RecordRepr::Padding { len: contig as u32 }.to_bytes();
        // SAFETY: `at` is 8-aligned and below RING_BYTES, so the 8 bytes lie in the ring; they
        // are in the free span just checked, which the consumer does not read before `tail`
        // is published.
        unsafe {
            ptr::copy_nonoverlapping(
                pad.as_ptr(),
                self.seg.ring(me.pos).add(at),
                RECORD_PREFIX_LEN,
            )
        };
        self.tail += (contig + rec_len) as u64;
        Ok(Some(0))
    }

    /// Makes the records written so far visible to the peer and wakes it if it sleeps.
    fn publish(&self) {
        self.seg
            .a64(self.ctl + C_TAIL)
            .store(self.tail, Ordering::Release);
        self.seg.notify();
    }

    /// Moves pending records into the ring, as many as fit.
    pub(super) fn flush(&mut self, me: Me) -> Result<()> {
        if self.pending.is_empty() || self.down.is_some() {
            return Ok(());
        }
        let mut wrote = false;
        while let Some(len) = self.pending.front().map(Vec::len) {
            let Some(at) = self.reserve(me, len)? else {
                break;
            };
            if let Some(rec) = self.pending.pop_front() {
                // SAFETY: `reserve` handed out `len` bytes at `at`, inside the ring and not yet
                // visible to the consumer.
                unsafe {
                    ptr::copy_nonoverlapping(rec.as_ptr(), self.seg.ring(me.pos).add(at), len)
                };
            }
            wrote = true;
        }
        if wrote {
            self.publish();
        }
        if !self.pending.is_empty() {
            self.seg
                .a32(self.ctl + C_WANT_SPACE)
                .store(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Appends a record to the peer's ring, or to the pending queue when the ring is full or
    /// records are already waiting.
    ///
    /// # Safety
    ///
    /// The spans of a gather payload must be readable.
    pub(super) unsafe fn push(
        &mut self,
        me: Me,
        hdr: &RecordRepr,
        payload: Payload<'_>,
    ) -> Result<()> {
        self.flush(me)?;
        let data_len = payload.len();
        let rec_len = record_len(data_len);
        debug_assert_eq!(rec_len, hdr.record_len(), "{hdr:?}");
        let head = hdr.to_bytes();
        if self.pending.is_empty()
            && let Some(at) = self.reserve(me, rec_len)?
        {
            let dst = self.seg.ring(me.pos);
            // SAFETY: `reserve` handed out `rec_len` bytes at `at`, inside the ring and not yet
            // visible to the consumer; the gather spans are readable (caller).
            unsafe {
                ptr::copy_nonoverlapping(head.as_ptr(), dst.add(at), RECORD_HEADER_LEN);
                payload.copy_to(dst.add(at + RECORD_HEADER_LEN));
            }
            self.publish();
            return Ok(());
        }
        let mut rec = vec![0u8; rec_len];
        rec[..RECORD_HEADER_LEN].copy_from_slice(&head);
        // SAFETY: `rec` holds RECORD_HEADER_LEN + data_len bytes; the gather spans are readable (caller).
        unsafe { payload.copy_to(rec.as_mut_ptr().add(RECORD_HEADER_LEN)) };
        self.pending.push_back(rec);
        self.seg
            .a32(self.ctl + C_WANT_SPACE)
            .store(1, Ordering::Relaxed);
        Ok(())
    }

    /// Delivers every record of the peer's ring in this rank's own segment `own`; `regions`
    /// are this rank's, which inline writes land in.
    pub(super) fn drain(
        &mut self,
        me: Me,
        own: &Segment,
        regions: &LocalTable,
        out: &mut Vec<Completion>,
    ) -> Result<()> {
        let p = self;
        if p.broken {
            return Ok(());
        }
        let ctl = ctl_off(p.pos);
        let tail = own.a64(ctl + C_TAIL).load(Ordering::Acquire);
        let mut head = p.rx_head;
        if tail == head {
            return Ok(());
        }
        if tail < head || tail - head > RING_BYTES as u64 {
            return Err(p.protocol(me, Violation::RingTail { tail, head }));
        }
        let ring = own.ring(p.pos);
        let peer = p.rank;
        let mut res = Ok(());
        while head < tail {
            let at = (head % RING_BYTES as u64) as usize;
            let contig = RING_BYTES - at;
            let avail = tail - head;
            let mut h = [0u8; RECORD_HEADER_LEN];
            // SAFETY: `head` advances in multiples of 8, so `at` is 8-aligned and below
            // RING_BYTES and the 8 bytes lie in the ring, in the span the producer published.
            unsafe { ptr::copy_nonoverlapping(ring.add(at), h.as_mut_ptr(), RECORD_PREFIX_LEN) };
            let view = RecordHeader::new_unchecked(&h[..RECORD_PREFIX_LEN]);
            let (len32, kind) = (view.record_len(), view.kind());
            let len = len32 as usize;
            if len < 8 || !len.is_multiple_of(8) || len > contig || len as u64 > avail {
                res = Err(p.protocol(
                    me,
                    Violation::RecordLength {
                        len: len32,
                        at,
                        avail,
                    },
                ));
                break;
            }
            if kind == KIND_PAD {
                if len != contig {
                    res = Err(p.protocol(me, Violation::Padding { len: len32, at }));
                    break;
                }
                head += len as u64;
                continue;
            }
            if len >= RECORD_HEADER_LEN {
                // SAFETY: `len >= RECORD_HEADER_LEN` bytes at `at` lie in the ring and were
                // published.
                unsafe {
                    ptr::copy_nonoverlapping(
                        ring.add(at + RECORD_PREFIX_LEN),
                        h.as_mut_ptr().add(RECORD_PREFIX_LEN),
                        RECORD_HEADER_LEN - RECORD_PREFIX_LEN,
                    )
                };
            }
            let rec = match RecordRepr::parse(&RecordHeader::new_unchecked(&h[..])) {
                Ok(rec) => rec,
                Err(error) => {
                    res = Err(p.protocol(me, Violation::Record { error, at }));
                    break;
                }
            };
            let data = at + RECORD_HEADER_LEN;
            match rec {
                RecordRepr::Send { data_len } => {
                    // SAFETY: the payload lies inside the checked record.
                    let v =
                        unsafe { std::slice::from_raw_parts(ring.add(data), data_len as usize) };
                    out.push(Completion::Recv {
                        peer,
                        data: v.to_vec(),
                    });
                }
                RecordRepr::WriteInline {
                    rkey,
                    offset,
                    imm,
                    data_len,
                } => {
                    match regions.regions.check_remote_write(
                        peer,
                        rkey,
                        offset,
                        u64::from(data_len),
                    ) {
                        Ok(dst) => {
                            // SAFETY: the payload lies inside the checked record; the
                            // destination was bounds-checked against a region this rank
                            // registered with REMOTE_WRITE, which its owner keeps valid and
                            // does not touch while peers may write.
                            unsafe {
                                ptr::copy_nonoverlapping(
                                    ring.add(data),
                                    dst as *mut u8,
                                    data_len as usize,
                                )
                            };
                            if let Some(imm) = imm {
                                out.push(Completion::WriteImm {
                                    peer,
                                    imm,
                                    len: data_len,
                                });
                            }
                        }
                        Err(e) => {
                            head += len as u64;
                            res = Err(e);
                            break;
                        }
                    }
                }
                RecordRepr::WriteNotify {
                    rkey,
                    imm,
                    data_len,
                    ..
                } => {
                    if data_len >= WRITTEN_MIN {
                        regions.note_written(rkey);
                    }
                    if let Some(imm) = imm {
                        out.push(Completion::WriteImm {
                            peer,
                            imm,
                            len: data_len,
                        });
                    }
                }
                // Padding was handled above.
                RecordRepr::Padding { .. } => {}
            }
            head += len as u64;
        }
        p.rx_head = head;
        own.a64(ctl + C_HEAD).store(head, Ordering::Release);
        fence(Ordering::SeqCst);
        let want = own.a32(ctl + C_WANT_SPACE);
        if want.load(Ordering::Relaxed) != 0 && want.swap(0, Ordering::AcqRel) != 0 {
            p.seg.wake();
        }
        res
    }
}
