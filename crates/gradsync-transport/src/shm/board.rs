//! The board of a shared-memory endpoint (its [`Board`](crate::Board)), kept by
//! [`BoardState`]: a small buffer at the end of every rank's segment that the other local
//! ranks read through their mapping of the segment.
//!
//! # Layout
//!
//! ```text
//! board_off(nlocal)   slot 0: header (seq, len, release mark of the poster; see
//!                     wire::SlotHeader) and the 40 bytes of data after the head,
//!                     then the head (the data's first 64 bytes) on the next line,
//!                     then the rest of the data
//! + SLOT_BYTES        slot 1: the same
//! + 2 * SLOT_BYTES    the poster's release mark (u64, own cache line)
//! ```
//!
//! A posting under `seq` goes to slot `seq % 2`. The header and up to 40 bytes of data after
//! the head share one cache line. The head, the caller's header, is the same from one call
//! to the next of a loop but for fields the caller leaves out of it (the engine leaves out the
//! sequence number, which the slot header carries): it is written only when it differs from
//! what the slot holds, so its line stays in the readers' caches. A small posting then costs
//! the poster one line to write and a reader one line to fetch.
//!
//! # Protocol
//!
//! - **Posting** is a seqlock write: `seq` is set to 0, then (release fence) length, the
//!   poster's release mark and the data are written, then `seq` is stored with release
//!   ordering. One sequentially consistent fence then orders the posting before the look at
//!   each peer's `sleeping` flag, which pairs with the fence of a waiter (as for a ring record).
//! - **Reading** is a seqlock read: `seq` (acquire), the bytes, an acquire fence and `seq`
//!   again. A different value the second time means the poster rewrote the slot while it was
//!   read, which the reuse rule excludes: a protocol error, never torn data. The header is
//!   copied word by word (atomically) and parsed as a [`SlotHeaderRepr`]: a posting longer
//!   than the board is a protocol error too. (A slot that holds
//!   another number than the one asked for simply has no such posting: the poster may have run
//!   that operation without the board.)
//! - **Reuse.** A slot is rewritten only when every peer's release mark has reached the
//!   sequence number it holds. A reader's mark travels with its own postings, so a rank that
//!   keeps reading its peers' postings knows their marks without another cache line; only when
//!   that knowledge is too old does the poster read the peer's mark line.
//! - **Waiting.** [`BoardState::ready`] tells the connection's blocking wait not to sleep
//!   while a watched posting is there unread: together with the post's fence no wake-up is
//!   lost.

use super::layout::MARK_LINE;
use super::layout::SLOT_BYTES;
use super::peer::{Me, Peer};
use super::segment::Segment;
use super::wire::{
    BOARD_CAPACITY, BOARD_HEAD, SLOT_HEAD, SLOT_HEADER_LEN, SLOT_INLINE, SLOT_LEN, SLOT_MARK,
    SLOT_REST, SLOT_SEQ, SlotHeader, SlotHeaderRepr,
};
use crate::error::{Result, TransportError, Violation};
use std::ptr;
use std::sync::atomic::{Ordering, fence};

/// This rank's bookkeeping of the board.
#[derive(Debug, Default)]
pub(super) struct BoardState {
    /// Offset of the board in every segment.
    pub(super) off: usize,
    /// Sequence number last posted in each slot (0: none).
    last: [u64; 2],
    /// Per local position: the newest sequence number read from that peer.
    seen: Vec<u64>,
    /// Per local position: the newest release mark known of that peer.
    pub(super) marks: Vec<u64>,
    /// This rank's release mark.
    mark: u64,
    /// The sequence number a blocking wait watches (0: none).
    watch: u64,
}

impl BoardState {
    pub(super) fn new(off: usize, nlocal: usize) -> Self {
        BoardState {
            off,
            seen: vec![0; nlocal],
            marks: vec![0; nlocal],
            ..BoardState::default()
        }
    }

    /// Offset of the slot of posting `seq`.
    pub(super) fn slot(&self, seq: u64) -> usize {
        self.off + (seq % 2) as usize * SLOT_BYTES
    }
}

/// A copy of the header of the slot at `at` of a peer's segment, word by word (each word
/// atomically, as the poster writes it); the sequence number is the one already read.
fn snapshot(seg: &Segment, at: usize, seq: u64) -> [u8; SLOT_HEADER_LEN] {
    let mut raw = [0u8; SLOT_HEADER_LEN];
    let mut h = SlotHeader::new_unchecked(&mut raw[..]);
    h.set_seq(seq);
    h.set_data_len(seg.a32(at + SLOT_LEN).load(Ordering::Relaxed));
    h.set_mark(seg.a64(at + SLOT_MARK).load(Ordering::Relaxed));
    raw
}

/// Copies `n` bytes, at most [`SLOT_INLINE`], from `src` to `dst` a word at a time (no call
/// into the C library for the few bytes of a small posting).
///
/// # Safety
///
/// `src` is valid for reads and `dst` for writes of `n` bytes; they do not overlap.
unsafe fn copy_short(src: *const u8, dst: *mut u8, n: usize) {
    debug_assert!(n <= SLOT_INLINE);
    // SAFETY: every access is within the first `n` bytes of `src` and `dst`.
    unsafe {
        if n < 8 {
            for i in 0..n {
                *dst.add(i) = *src.add(i);
            }
            return;
        }
        let mut i = 0;
        while i + 8 <= n {
            ptr::write_unaligned(
                dst.add(i).cast::<u64>(),
                ptr::read_unaligned(src.add(i).cast()),
            );
            i += 8;
        }
        if i < n {
            // The last 8 bytes, overlapping the word before.
            let at = n - 8;
            ptr::write_unaligned(
                dst.add(at).cast::<u64>(),
                ptr::read_unaligned(src.add(at).cast()),
            );
        }
    }
}

/// Whether the `bytes.len()` bytes at `at` equal `bytes`, compared a word at a time (a head
/// is compared at every posting: no call into the C library for 64 bytes).
///
/// # Safety
///
/// `at` is valid for reads of `bytes.len()` bytes that no other process writes meanwhile.
unsafe fn same(at: *const u8, bytes: &[u8]) -> bool {
    let words = bytes.len() / 8;
    let mut diff = 0u64;
    for i in 0..words {
        // SAFETY: within the `bytes.len()` bytes at `at` and in `bytes`.
        diff |= unsafe {
            ptr::read_unaligned(at.add(8 * i).cast::<u64>())
                ^ ptr::read_unaligned(bytes.as_ptr().add(8 * i).cast::<u64>())
        };
    }
    // SAFETY: as above, for the last `bytes.len() % 8` bytes.
    diff == 0
        && unsafe { std::slice::from_raw_parts(at.add(8 * words), bytes.len() % 8) }
            == &bytes[8 * words..]
}

impl BoardState {
    /// Posts `data` under `seq` in this rank's segment `own` and wakes the sleeping `peers`;
    /// `Ok(false)` while the slot still holds a posting some peer has not released.
    pub(super) fn post(
        &mut self,
        me: Me,
        own: &Segment,
        peers: &[Option<Peer>],
        seq: u64,
        data: &[u8],
    ) -> Result<bool> {
        let invalid = |msg: String| TransportError::Invalid {
            rank: me.rank,
            op: "board_post",
            msg,
        };
        if data.len() > BOARD_CAPACITY {
            return Err(invalid(format!(
                "{} bytes exceed the board's {BOARD_CAPACITY}",
                data.len()
            )));
        }
        let b = self;
        let newest = b.last[0].max(b.last[1]);
        if seq <= newest {
            return Err(invalid(format!(
                "sequence number {seq} after {newest}: postings must increase"
            )));
        }
        let prev = b.last[(seq % 2) as usize];
        if prev > 0 {
            for p in peers.iter().flatten() {
                if p.down.is_some() || b.marks[p.pos] >= prev {
                    continue;
                }
                let line = p.seg.a64(b.off + MARK_LINE).load(Ordering::Acquire);
                b.marks[p.pos] = b.marks[p.pos].max(line);
                if line < prev {
                    return Ok(false);
                }
            }
        }
        let at = b.slot(seq);
        let seq_word = own.a64(at + SLOT_SEQ);
        seq_word.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        own.a32(at + SLOT_LEN)
            .store(data.len() as u32, Ordering::Relaxed);
        own.a64(at + SLOT_MARK).store(b.mark, Ordering::Relaxed);
        let (head, body) = data.split_at(data.len().min(BOARD_HEAD));
        let (inline, rest) = body.split_at(body.len().min(SLOT_INLINE));
        let head_at = own.span(at + SLOT_HEAD, head.len());
        // SAFETY: the spans lie in this rank's own segment (checked by `span`), which only this
        // rank writes (peers only read it); `data` is a separate buffer of this process.
        unsafe {
            // An unchanged head is left alone: a rewrite, even with the same bytes, would take
            // its line out of every reader's cache.
            if !same(head_at, head) {
                ptr::copy_nonoverlapping(head.as_ptr(), head_at, head.len());
            }
            let inline_at = own.span(at + SLOT_HEADER_LEN, inline.len());
            copy_short(inline.as_ptr(), inline_at, inline.len());
            if !rest.is_empty() {
                let rest_at = own.span(at + SLOT_REST, rest.len());
                ptr::copy_nonoverlapping(rest.as_ptr(), rest_at, rest.len());
            }
        }
        seq_word.store(seq, Ordering::Release);
        b.last[(seq % 2) as usize] = seq;
        fence(Ordering::SeqCst);
        for p in peers.iter().flatten() {
            if p.down.is_none() {
                p.seg.wake_if_sleeping();
            }
        }
        Ok(true)
    }

    /// Copies the posting of the peer at `pos` under `seq` into `out`; `Ok(false)` while
    /// there is none.
    pub(super) fn read(
        &mut self,
        me: Me,
        peers: &mut [Option<Peer>],
        pos: usize,
        seq: u64,
        out: &mut Vec<u8>,
    ) -> Result<bool> {
        let b = self;
        let Some(p) = peers.get_mut(pos).and_then(Option::as_mut) else {
            return Err(TransportError::Invalid {
                rank: me.rank,
                op: "board_read",
                msg: format!("local position {pos} is not a peer"),
            });
        };
        if p.broken {
            return Err(TransportError::PeerClosed {
                rank: me.rank,
                peer: p.rank,
                during: format!(
                    "board_read: {}",
                    p.down.as_deref().unwrap_or("protocol error")
                ),
            });
        }
        let at = b.slot(seq);
        let seq_word = p.seg.a64(at + SLOT_SEQ);
        // Another number is an older posting, one being written, or a newer one in a slot
        // whose posting under `seq` was never made (the peer ran that operation otherwise).
        if seq_word.load(Ordering::Acquire) != seq {
            return Ok(false);
        }
        let header =
            match SlotHeaderRepr::parse(&SlotHeader::new_unchecked(&snapshot(&p.seg, at, seq)[..]))
            {
                Ok(h) => h,
                Err(error) => return Err(p.protocol(me, Violation::BoardSlot { seq, error })),
            };
        let (len, mark) = (header.data_len as usize, header.mark);
        let head = len.min(BOARD_HEAD);
        let inline = (len - head).min(SLOT_INLINE);
        let rest = len - head - inline;
        out.clear();
        // Room for the whole inline part, which is copied whole (below).
        out.reserve(len.max(head + SLOT_INLINE));
        // SAFETY: the spans lie in the peer's segment (checked by `span`); `out` has room for
        // `len` bytes and for `head + SLOT_INLINE`, and its first `len` bytes are initialised
        // by the copies before the length is set. The peer may write the spans concurrently
        // only by breaking the protocol, which the second look at `seq` below detects (the
        // bytes are then discarded).
        unsafe {
            let o = out.as_mut_ptr();
            let head_at = p.seg.span(at + SLOT_HEAD, head);
            if head == BOARD_HEAD {
                // A whole head, the usual case: a copy of known length, inlined.
                ptr::copy_nonoverlapping(head_at, o, BOARD_HEAD);
            } else {
                ptr::copy_nonoverlapping(head_at, o, head);
            }
            if inline > 0 {
                // The whole inline part, of known length (inlined, no call), though only
                // `inline` bytes of it are the posting's: its line is fetched whole anyway.
                let inline_at = p.seg.span(at + SLOT_HEADER_LEN, SLOT_INLINE);
                ptr::copy_nonoverlapping(inline_at, o.add(head), SLOT_INLINE);
            }
            if rest > 0 {
                let rest_at = p.seg.span(at + SLOT_REST, rest);
                ptr::copy_nonoverlapping(rest_at, o.add(head + inline), rest);
            }
            out.set_len(len);
        }
        fence(Ordering::Acquire);
        if seq_word.load(Ordering::Relaxed) != seq {
            out.clear();
            return Err(p.protocol(me, Violation::BoardRewritten { seq }));
        }
        b.seen[pos] = b.seen[pos].max(seq);
        b.marks[pos] = b.marks[pos].max(mark);
        Ok(true)
    }

    /// Raises this rank's release mark in its segment `own` to `seq`.
    pub(super) fn release(&mut self, own: &Segment, seq: u64) {
        self.mark = self.mark.max(seq);
        own.a64(self.off + MARK_LINE)
            .store(self.mark, Ordering::Release);
    }

    /// Sets the sequence number a blocking wait watches.
    pub(super) fn watch(&mut self, seq: u64) {
        self.watch = seq;
    }

    /// Whether a peer has posted under the watched sequence number what this rank has not
    /// read.
    pub(super) fn ready(&self, peers: &[Option<Peer>]) -> bool {
        peers.iter().flatten().any(|p| !p.broken && self.unread(p))
    }

    /// Whether peer `p` has posted under the watched sequence number what this rank has not
    /// read. Such a posting was made before anything the peer did after it, its close
    /// included: a peer that closed (or exited) with it unread still counts as alive until it
    /// is read, as with the records in its ring.
    pub(super) fn unread(&self, p: &Peer) -> bool {
        self.watch > 0
            && self.seen[p.pos] < self.watch
            && p.seg
                .a64(self.slot(self.watch) + SLOT_SEQ)
                .load(Ordering::Acquire)
                == self.watch
    }
}

#[cfg(test)]
mod tests {
    use super::super::endpoint::ShmEndpoint;
    use super::super::tests::fabric;
    use super::*;
    use crate::caps::Board;
    use crate::verbs::Endpoint;
    use std::time::{Duration, Instant};

    fn read(ep: &mut ShmEndpoint, peer: usize, seq: u64) -> Option<Vec<u8>> {
        let mut out = vec![9; 3];
        ep.read(peer, seq, &mut out).unwrap().then_some(out)
    }

    #[test]
    fn postings_are_read_in_place_by_every_peer() {
        let mut eps = fabric(3);
        assert!(
            eps.iter_mut()
                .all(|e| e.board().is_some_and(|b| b.capacity() == BOARD_CAPACITY))
        );
        assert_eq!(read(&mut eps[1], 0, 1), None, "nothing posted yet");
        let big: Vec<u8> = (0..BOARD_CAPACITY).map(|i| (i % 251) as u8).collect();
        assert!(eps[0].post(1, b"first").unwrap());
        assert!(eps[0].post(2, &big).unwrap());
        for r in [1, 2] {
            assert_eq!(read(&mut eps[r], 0, 1).as_deref(), Some(&b"first"[..]));
            assert_eq!(read(&mut eps[r], 0, 2), Some(big.clone()));
            assert_eq!(read(&mut eps[r], 0, 4), None, "not posted");
        }
        // Too long, or not after the last posting: the caller's error.
        let e = eps[0].post(3, &vec![0; BOARD_CAPACITY + 1]).unwrap_err();
        assert!(e.to_string().contains("exceed the board's"), "{e}");
        let e = eps[0].post(2, b"again").unwrap_err();
        assert!(e.to_string().contains("postings must increase"), "{e}");
        let e = eps[1].read(1, 1, &mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("not a local peer"), "{e}");
    }

    #[test]
    fn postings_of_every_length_read_back_whole_whether_or_not_their_head_changed() {
        // Lengths around the head, the inline part and the rest; per length, postings whose
        // head repeats the one in their slot (left alone) and then changes (rewritten).
        let mut eps = fabric(2);
        let lens = [0, 1, 8, 63, 64, 65, 100, 104, 105, 200, BOARD_CAPACITY];
        let mut seq = 0;
        for (i, &len) in lens.iter().enumerate() {
            for round in 0..6u8 {
                let data: Vec<u8> = (0..len)
                    .map(|j| match j < BOARD_HEAD {
                        true => (i as u8) ^ (round / 4) ^ (j as u8),
                        false => (j % 251) as u8 ^ round,
                    })
                    .collect();
                seq += 1;
                assert!(
                    eps[0].post(seq, &data).unwrap(),
                    "length {len} round {round}"
                );
                assert_eq!(
                    read(&mut eps[1], 0, seq),
                    Some(data),
                    "length {len} round {round}"
                );
                eps[1].release(seq).unwrap();
            }
        }
    }

    #[test]
    fn a_slot_is_reused_only_after_every_peer_released_it() {
        let mut eps = fabric(3);
        assert!(eps[0].post(1, b"one").unwrap());
        assert!(eps[0].post(2, b"two").unwrap());
        // Posting 3 goes where posting 1 is, which nobody has released.
        assert!(!eps[0].post(3, b"three").unwrap());
        eps[1].release(1).unwrap();
        assert!(!eps[0].post(3, b"three").unwrap(), "rank 2 still reads 1");
        eps[2].release(2).unwrap();
        assert!(eps[0].post(3, b"three").unwrap());
        assert_eq!(read(&mut eps[1], 0, 3).as_deref(), Some(&b"three"[..]));
        // A reader's mark also travels with its own postings: after reading rank 1's posting
        // 5 (made once rank 1 released 3), rank 0 reuses slot 1 without reading rank 1's
        // mark line, which still says 1 here.
        eps[1].release(3).unwrap();
        assert!(eps[1].post(5, b"from one").unwrap());
        let c1 = eps[1].conn.as_ref().unwrap();
        c1.own
            .a64(c1.board.off + MARK_LINE)
            .store(1, Ordering::Release);
        eps[2].release(3).unwrap();
        assert_eq!(read(&mut eps[0], 1, 5).as_deref(), Some(&b"from one"[..]));
        assert!(eps[0].post(5, b"five").unwrap());
    }

    #[test]
    fn a_slot_header_past_the_board_is_a_protocol_error() {
        let mut eps = fabric(2);
        assert!(eps[0].post(1, b"one").unwrap());
        // Rank 0's slot header claims more bytes than the board holds.
        let c0 = eps[0].conn.as_ref().unwrap();
        let at = c0.board.slot(1);
        c0.own
            .a32(at + SLOT_LEN)
            .store(BOARD_CAPACITY as u32 + 1, Ordering::Relaxed);
        let e = eps[1].read(0, 1, &mut Vec::new()).unwrap_err();
        let want = Violation::BoardSlot {
            seq: 1,
            error: crate::wire::WireError::TooLong {
                format: "board posting",
                len: BOARD_CAPACITY as u64 + 1,
                max: BOARD_CAPACITY as u64,
            },
        };
        assert!(
            matches!(&e, TransportError::Protocol { peer: 0, violation, .. } if *violation == want),
            "{e}"
        );
        // The peer is broken for good.
        let e = eps[1].read(0, 1, &mut Vec::new()).unwrap_err();
        assert!(
            matches!(e, TransportError::PeerClosed { peer: 0, .. }),
            "{e}"
        );
    }

    #[test]
    fn a_posting_rewritten_while_read_is_never_torn_data() {
        // Rank 0 breaks the reuse rule on purpose, rewriting slot 1 as fast as it can; rank 1
        // reads whatever posting is there. Every read must give one posting's bytes whole, or
        // fail naming the rewrite: never a mix of two postings.
        let mut eps = fabric(2);
        let mut e1 = eps.pop().unwrap();
        let mut e0 = eps.pop().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let writer = std::thread::spawn(move || {
            let mut seq = 1;
            while !stop2.load(Ordering::Relaxed) {
                e0.conn.as_mut().unwrap().board.marks[1] = u64::MAX;
                let data = vec![(seq % 251) as u8; BOARD_CAPACITY];
                assert!(e0.post(seq, &data).unwrap());
                seq += 2;
            }
            e0
        });
        let (mut whole, mut rewritten) = (0, false);
        let mut out = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            let c = e1.conn.as_ref().unwrap();
            let seq = c.peers[0]
                .as_ref()
                .unwrap()
                .seg
                .a64(c.board.slot(1) + SLOT_SEQ)
                .load(Ordering::Acquire);
            match e1.read(0, seq, &mut out) {
                Ok(true) => {
                    let want = (seq % 251) as u8;
                    assert!(out.iter().all(|&b| b == want), "torn posting {seq}");
                    whole += 1;
                }
                Ok(false) => {}
                Err(e) => {
                    assert!(
                        e.to_string()
                            .contains("was rewritten while this rank read it")
                    );
                    rewritten = true;
                    break;
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        // Within 300 ms the writer has posted: some read saw a posting whole or caught it.
        assert!(whole > 0 || rewritten);
    }

    #[test]
    fn a_posting_made_before_close_is_still_read_and_keeps_the_poster_alive() {
        // Rank 0 posts and closes at once; rank 1 gets to the posting only afterwards. Until
        // it has read it, rank 0 is not lost; then it is.
        let mut eps = fabric(2);
        let mut e1 = eps.pop().unwrap();
        let mut e0 = eps.pop().unwrap();
        assert!(e0.post(1, b"last").unwrap());
        e0.close(Duration::from_secs(5));
        e1.watch(1);
        assert!(e1.peer_alive(0), "the unread posting keeps rank 0 alive");
        assert_eq!(read(&mut e1, 0, 1).as_deref(), Some(&b"last"[..]));
        assert!(!e1.peer_alive(0), "read: rank 0 is closed");
        // A closed peer with no posting under the watched number is gone at once.
        e1.watch(3);
        assert!(!e1.peer_alive(0));
    }

    #[test]
    fn a_posting_wakes_a_rank_that_waits_for_it() {
        let mut eps = fabric(2);
        let mut e1 = eps.pop().unwrap();
        let mut e0 = eps.pop().unwrap();
        e1.watch(1);
        let t0 = Instant::now();
        let waiter = std::thread::spawn(move || {
            // Sleeps (the futex) unless the posting is there: it must come back long before
            // the timeout.
            while read(&mut e1, 0, 1).is_none() {
                e1.wait(Duration::from_secs(20)).unwrap();
            }
            e1
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(e0.post(1, b"wake").unwrap());
        let _e1 = waiter.join().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}
