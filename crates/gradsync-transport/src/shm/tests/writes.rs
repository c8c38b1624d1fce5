//! Writes and sends: exact bytes on every path, posting order, full rings, rejected writes,
//! the region directory and malformed rings.

use super::{
    LONG, RW, buf, collect, fabric, fabric_in, pair, pattern, remote, sge, tag, write_three_mib,
};
use crate::error::{TransportError, Violation};
use crate::shm::directory::{DIR_EMPTY, dir_read};
use crate::shm::endpoint::ShmEndpoint;
use crate::shm::layout::{C_TAIL, DIR_CAP, RING_BYTES};
use crate::shm::setup::ShmSetup;
use crate::shm::wire::{INLINE_MAX, RecordHeader, RecordRepr, ShmInfo};
use crate::verbs::{Access, Completion, Endpoint, MAX_SEND, Sge};
use crate::wire::{RemoteRegion, WireError};
use std::ptr;
use std::sync::Barrier;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

#[test]
fn info_roundtrip_and_setup_checks() {
    let i = ShmInfo {
        pid: 77,
        fd: -3,
        len: 1 << 40,
        nonce: 0xdead_beef_0bad_f00d,
    };
    assert_eq!(ShmInfo::from_bytes(&i.to_bytes()), Some(i));
    assert_eq!(ShmInfo::from_bytes(&i.to_bytes()[1..]), None);
    assert!(ShmSetup::new(2, 4, &[0, 1]).is_err());
    assert!(ShmSetup::new(1, 4, &[1, 0]).is_err());
    assert!(ShmSetup::new(1, 2, &[1, 2]).is_err());
}

#[test]
fn inline_and_large_writes_land_exact_bytes() {
    let (mut e0, mut e1) = pair();
    assert_eq!(e0.name(), "shm");
    let dst = buf(&mut e1, vec![0; 4 << 20], RW);
    let a = buf(&mut e0, pattern(2 << 20, 1), Access::LOCAL_READ);
    let b = buf(&mut e0, pattern(2 << 20, 2), Access::LOCAL_READ);
    let r = dst.mr.remote();
    // SAFETY: the sources outlive the writes.
    unsafe { e0.post_write(1, &[sge(&a, 3, 8)], r, 100, Some(7), 1) }.unwrap();
    let got = collect(&mut e1, 1, remote);
    assert_eq!(
        got,
        [Completion::WriteImm {
            peer: 0,
            imm: 7,
            len: 8
        }]
    );
    assert_eq!(&dst.v[100..108], &a.v[3..11]);

    // Exactly INLINE_MAX bytes, split over two spans, and no immediate: the send after it
    // is delivered after the bytes landed.
    let s = [sge(&a, 0, 1000), sge(&b, 5, INLINE_MAX - 1000)];
    // SAFETY: as above.
    unsafe { e0.post_write(1, &s, r, 9000, None, 2) }.unwrap();
    e0.post_send(1, &[1, 0, 0, 0], 3).unwrap();
    assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 1);
    assert_eq!(&dst.v[9000..10000], &a.v[..1000]);
    assert_eq!(&dst.v[10000..9000 + INLINE_MAX], &b.v[5..INLINE_MAX - 995]);

    // 3 MiB with a three-entry gather list, through process_vm_writev.
    let mib = 1 << 20;
    let want = write_three_mib(&mut e0, &mut e1, r, &a, &b);
    assert!(dst.v[17..17 + 3 * mib] == want[..]);
    assert_eq!(dst.v[16], 0);
    assert_eq!(dst.v[17 + 3 * mib], 0);

    let mut out = Vec::new();
    e0.poll(&mut out).unwrap();
    assert_eq!(
        out,
        [
            Completion::WriteDone { wr_id: 1 },
            Completion::WriteDone { wr_id: 2 },
            Completion::SendDone { wr_id: 3 },
            Completion::WriteDone { wr_id: 4 },
        ]
    );
}

#[test]
fn gather_lists_longer_than_iov_max() {
    let (mut e0, mut e1) = pair();
    let dst = buf(&mut e1, vec![0; 2 << 20], RW);
    let src = buf(&mut e0, pattern(4 << 20, 3), Access::LOCAL_READ);
    // 1500 spans of 1000 bytes, every other kilobyte of the source.
    let s: Vec<Sge> = (0..1500).map(|i| sge(&src, i * 2048 + 7, 1000)).collect();
    // SAFETY: the source outlives the write.
    unsafe { e0.post_write(1, &s, dst.mr.remote(), 5, Some(1), 1) }.unwrap();
    collect(&mut e1, 1, remote);
    for i in 0..1500 {
        let d = 5 + i * 1000;
        assert_eq!(&dst.v[d..d + 1000], &src.v[i * 2048 + 7..i * 2048 + 1007]);
    }
}

#[test]
fn sends_and_writes_keep_posting_order() {
    let (mut e0, mut e1) = pair();
    let dst = buf(&mut e1, vec![0; 1 << 20], RW);
    let src = buf(&mut e0, pattern(64 << 10, 4), Access::LOCAL_READ);
    let r = dst.mr.remote();
    let n = 600u32;
    let rx = thread::spawn(move || {
        let got = collect(&mut e1, n as usize, remote);
        (e1, dst, got)
    });
    for i in 0..n {
        match i % 3 {
            0 => e0.post_send(1, &i.to_le_bytes(), u64::from(i)).unwrap(),
            1 => {
                let s = [sge(&src, 0, 8)];
                // SAFETY: the source outlives the write.
                unsafe { e0.post_write(1, &s, r, u64::from(i) * 8, Some(i), 0) }.unwrap()
            }
            _ => {
                let s = [sge(&src, 0, 40_000)];
                // SAFETY: the source outlives the write.
                unsafe { e0.post_write(1, &s, r, 500_000, Some(i), 0) }.unwrap()
            }
        }
    }
    let (_e1, dst, got) = rx.join().unwrap();
    let tags: Vec<u32> = got.iter().map(tag).collect();
    assert_eq!(tags, (0..n).collect::<Vec<_>>());
    assert_eq!(&dst.v[500_000..540_000], &src.v[..40_000]);
    assert_eq!(&dst.v[8..16], &src.v[..8]);
}

#[test]
fn rejected_writes_name_the_peer() {
    let mut eps = fabric_in(4, &[0, 2]);
    let mut e2 = eps.pop().unwrap();
    let mut e0 = eps.pop().unwrap();
    let dst = buf(&mut e2, vec![0; 1000], RW);
    let ro = buf(&mut e2, vec![0; 1000], Access::LOCAL_READ);
    let src = buf(&mut e0, pattern(10_000, 5), Access::LOCAL_READ);
    let small = [sge(&src, 0, 8)];
    let large = [sge(&src, 0, 10_000)];
    let cases = [
        (
            RemoteRegion {
                addr: 0,
                rkey: 0x1234_5678,
                len: 1000,
            },
            &small[..],
            0,
            "unknown key",
        ),
        (dst.mr.remote(), &small[..], 996, "past the end"),
        (dst.mr.remote(), &large[..], 0, "past the end"),
        (
            ro.mr.remote(),
            &small[..],
            0,
            "does not allow remote writes",
        ),
    ];
    for (r, s, off, why) in cases {
        // SAFETY: the source outlives the call.
        let e = unsafe { e0.post_write(2, s, r, off, Some(1), 9) }.unwrap_err();
        assert!(
            matches!(e, TransportError::RemoteAccess { peer: 2, .. }),
            "{e}"
        );
        assert_eq!(e.peer(), Some(2));
        let msg = e.to_string();
        assert!(msg.starts_with("rank 0: write of "), "{msg}");
        assert!(msg.contains("into rank 2's region"), "{msg}");
        assert!(msg.contains(why), "{msg}");
    }
    // Nothing reached the peer and nothing completed locally.
    let mut out = Vec::new();
    e2.poll(&mut out).unwrap();
    e0.poll(&mut out).unwrap();
    assert!(out.is_empty(), "{out:?}");
    // A span outside any local region, a rank that is not local, and an oversized send.
    let bad = [Sge {
        addr: src.v.as_ptr() as usize + 9_999,
        len: 8,
        lkey: src.mr.lkey,
    }];
    // SAFETY: rejected before anything is read.
    let e = unsafe { e0.post_write(2, &bad, dst.mr.remote(), 0, None, 0) }.unwrap_err();
    assert!(matches!(e, TransportError::Invalid { .. }), "{e}");
    let e = e0.post_send(1, b"x", 0).unwrap_err();
    assert!(e.to_string().contains("rank 1 is not a local peer"), "{e}");
    assert!(e0.post_send(0, b"x", 0).is_err());
    assert!(e0.post_send(2, &[0; MAX_SEND + 1], 0).is_err());
    assert!(e0.is_local(2) && !e0.is_local(1) && !e0.is_local(0) && !e0.is_local(3));
    assert_eq!(e0.world(), 4);
}

#[test]
fn receiver_rechecks_inline_writes() {
    let (mut e0, mut e1) = pair();
    let dst = buf(&mut e1, vec![0; 64], RW);
    let src = buf(&mut e0, pattern(64, 6), Access::LOCAL_READ);
    // SAFETY: the source outlives the write.
    unsafe { e0.post_write(1, &[sge(&src, 0, 64)], dst.mr.remote(), 0, Some(3), 1) }.unwrap();
    e1.deregister(&dst.mr);
    let e = e1.poll(&mut Vec::new()).unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::BadKey {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{e}"
    );
    assert!(dst.v.iter().all(|&b| b == 0));
    // The rejected record was consumed; the pair keeps working.
    e0.post_send(1, &[5, 0, 0, 0], 2).unwrap();
    assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 5);
}

#[test]
fn full_rings_queue_without_deadlock() {
    let (mut e0, mut e1) = pair();
    let n = 400usize;
    let d0 = buf(&mut e0, vec![0; n * INLINE_MAX], RW);
    let d1 = buf(&mut e1, vec![0; n * INLINE_MAX], RW);
    let s0 = buf(&mut e0, pattern(n * INLINE_MAX, 7), Access::LOCAL_READ);
    let s1 = buf(&mut e1, pattern(n * INLINE_MAX, 8), Access::LOCAL_READ);
    let big = 64 << 10;
    let b0 = buf(&mut e0, vec![0; n / 50 * big], RW);
    let b1 = buf(&mut e1, vec![0; n / 50 * big], RW);
    // Both sides post far more than their rings hold, without polling: inline writes, a
    // send and a large write now and then.
    for i in 0..n {
        let off = i * INLINE_MAX;
        let sides = [(&mut e0, 1, &s0, &d1, &b1), (&mut e1, 0, &s1, &d0, &b0)];
        for (ep, peer, src, dst, bdst) in sides {
            let s = [sge(src, off, INLINE_MAX)];
            // SAFETY: the sources outlive the writes.
            unsafe { ep.post_write(peer, &s, dst.mr.remote(), off as u64, Some(i as u32), 0) }
                .unwrap();
            if i % 50 == 0 {
                ep.post_send(peer, &(i as u32 + 1_000_000).to_le_bytes(), 0)
                    .unwrap();
            }
            if i % 50 == 25 {
                let s = [sge(src, off, big)];
                let at = (i / 50 * big) as u64;
                let imm = Some(i as u32 + 2_000_000);
                // SAFETY: as above.
                unsafe { ep.post_write(peer, &s, bdst.mr.remote(), at, imm, 0) }.unwrap();
            }
        }
    }
    let queued = |ep: &ShmEndpoint| {
        let conn = ep.conn.as_ref().unwrap();
        conn.peers
            .iter()
            .flatten()
            .map(|p| p.pending.len())
            .sum::<usize>()
    };
    assert!(queued(&e0) > n / 2 && queued(&e1) > n / 2);
    let want: Vec<u32> = (0..n as u32)
        .flat_map(|i| {
            let send = (i % 50 == 0).then_some(i + 1_000_000);
            let large = (i % 50 == 25).then_some(i + 2_000_000);
            std::iter::once(i).chain(send).chain(large)
        })
        .collect();
    let (mut g0, mut g1) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + LONG;
    while g0.len() < want.len() || g1.len() < want.len() {
        assert!(Instant::now() < deadline, "{} / {}", g0.len(), g1.len());
        for (ep, got) in [(&mut e0, &mut g0), (&mut e1, &mut g1)] {
            let mut out = Vec::new();
            ep.poll(&mut out).unwrap();
            got.extend(out.iter().filter(|c| remote(c)).map(tag));
        }
    }
    assert_eq!(g0, want);
    assert_eq!(g1, want);
    assert!(d1.v == s0.v && d0.v == s1.v);
    for k in 0..n / 50 {
        let (at, from) = (k * big, (k * 50 + 25) * INLINE_MAX);
        assert!(b1.v[at..at + big] == s0.v[from..from + big]);
        assert!(b0.v[at..at + big] == s1.v[from..from + big]);
    }
    assert_eq!(queued(&e0) + queued(&e1), 0);
}

#[test]
fn a_waiting_sender_is_woken_when_its_ring_drains() {
    let (mut e0, mut e1) = pair();
    let n = 300usize;
    let dst = buf(&mut e1, vec![0; n * INLINE_MAX], RW);
    let src = buf(&mut e0, pattern(n * INLINE_MAX, 11), Access::LOCAL_READ);
    let r = dst.mr.remote();
    let posted = std::sync::Arc::new(Barrier::new(2));
    let posted2 = posted.clone();
    let tx = thread::spawn(move || {
        for i in 0..n {
            let s = [sge(&src, i * INLINE_MAX, INLINE_MAX)];
            let off = (i * INLINE_MAX) as u64;
            // SAFETY: the source outlives the write.
            unsafe { e0.post_write(1, &s, r, off, Some(i as u32), 0) }.unwrap();
        }
        // Only the receiver draining its ring lets the queue move; each drain must wake
        // this thread out of its (long) wait.
        let conn_queued = |ep: &ShmEndpoint| {
            let conn = ep.conn.as_ref().unwrap();
            conn.peers
                .iter()
                .flatten()
                .map(|p| p.pending.len())
                .sum::<usize>()
        };
        assert!(conn_queued(&e0) > 0);
        posted2.wait();
        while conn_queued(&e0) > 0 {
            e0.wait(LONG).unwrap();
            e0.poll(&mut Vec::new()).unwrap();
        }
        (e0, src)
    });
    posted.wait();
    let t = Instant::now();
    let got = collect(&mut e1, n, remote);
    let (_e0, src) = tx.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(
        got.iter().map(tag).collect::<Vec<_>>(),
        (0..n as u32).collect::<Vec<_>>()
    );
    assert!(dst.v == src.v);
}

#[test]
fn register_with_key_rejects_a_key_in_use() {
    let (mut e0, mut e1) = pair();
    let mut v = vec![0u8; 10_000];
    let p = v.as_mut_ptr();
    // SAFETY: `v` outlives the endpoint's use of it.
    let mr = unsafe { e1.register_with_key(p, v.len(), RW, 42) }.unwrap();
    assert_eq!((mr.lkey, mr.rkey), (42, 42));
    // SAFETY: as above.
    let e = unsafe { e1.register_with_key(p, 8, RW, 42) }.unwrap_err();
    assert!(e.to_string().contains("already registered"), "{e}");
    // SAFETY: as above.
    let other = unsafe { e1.register(p, 8, RW) }.unwrap();
    // SAFETY: as above.
    assert!(unsafe { e1.register_with_key(p, 8, RW, other.rkey) }.is_err());
    e1.deregister(&mr);
    // SAFETY: as above.
    let mr = unsafe { e1.register_with_key(p, v.len(), RW, 42) }.unwrap();
    let src = buf(&mut e0, pattern(10_000, 9), Access::LOCAL_READ);
    for (i, len) in [(0u32, 100usize), (1, 10_000)] {
        // SAFETY: the source outlives the write.
        unsafe { e0.post_write(1, &[sge(&src, 0, len)], mr.remote(), 0, Some(i), 0) }.unwrap();
        collect(&mut e1, 1, remote);
    }
    assert_eq!(v, src.v);
}

#[test]
fn directory_survives_churn() {
    let (mut e0, mut e1) = pair();
    let mut v = vec![0u8; 64];
    let p = v.as_mut_ptr();
    let src = buf(&mut e0, pattern(64, 10), Access::LOCAL_READ);
    let mut live = Vec::new();
    for round in 0..3 * DIR_CAP {
        // SAFETY: `v` outlives the endpoint's use of it.
        live.push(unsafe { e1.register(p, 64, RW) }.unwrap());
        if live.len() > 100 || round % 3 == 0 {
            let mr = live.remove(round % live.len());
            e1.deregister(&mr);
        }
    }
    for (i, mr) in live.iter().enumerate() {
        // SAFETY: the source outlives the write.
        unsafe { e0.post_write(1, &[sge(&src, 0, 8)], mr.remote(), 0, None, i as u64) }.unwrap();
    }
    // Fill the directory to capacity: one more is refused.
    let extra: Vec<_> = (live.len()..DIR_CAP)
        // SAFETY: as above.
        .map(|_| unsafe { e1.register(p, 64, RW) }.unwrap())
        .collect();
    // SAFETY: as above.
    assert!(unsafe { e1.register(p, 64, RW) }.is_err());
    for mr in extra.iter().chain(&live) {
        e1.deregister(mr);
    }
    let conn = e1.conn.as_ref().unwrap();
    assert!((0..DIR_CAP).all(|s| dir_read(&conn.own, s).unwrap().state == DIR_EMPTY));
    drop(v);
}

#[test]
fn all_to_all_four_ranks() {
    let n = 4;
    let eps = fabric(n);
    let barrier = Barrier::new(n);
    let slot = 64 << 10;
    // Every rank registers its destination first; the keys travel "out of band".
    let mut eps: Vec<_> = eps
        .into_iter()
        .map(|mut ep| {
            let d = buf(&mut ep, vec![0; n * slot], RW);
            let me = ep.rank() as u32;
            let s = buf(&mut ep, pattern(slot, me), Access::LOCAL_READ);
            (ep, d, s)
        })
        .collect();
    let keys: Vec<RemoteRegion> = eps.iter().map(|(_, d, _)| d.mr.remote()).collect();
    thread::scope(|sc| {
        for (ep, d, s) in eps.iter_mut() {
            let (keys, barrier) = (&keys, &barrier);
            sc.spawn(move || {
                let me = ep.rank();
                for p in (0..n).filter(|&p| p != me) {
                    let off = (me * slot) as u64;
                    let imm = (me * 10) as u32;
                    // SAFETY: the source outlives the write.
                    unsafe { ep.post_write(p, &[sge(s, 0, 100)], keys[p], off, Some(imm), 0) }
                        .unwrap();
                    let big = [sge(s, 100, slot - 100)];
                    // SAFETY: as above.
                    unsafe { ep.post_write(p, &big, keys[p], off + 100, Some(imm + 1), 0) }
                        .unwrap();
                    ep.post_send(p, &(imm + 2).to_le_bytes(), 0).unwrap();
                }
                let got = collect(ep, 3 * (n - 1), remote);
                for p in (0..n).filter(|&p| p != me) {
                    let from: Vec<u32> = got
                        .iter()
                        .filter(|c| matches!(c, Completion::WriteImm { peer, .. } | Completion::Recv { peer, .. } if *peer == p))
                        .map(tag)
                        .collect();
                    let base = (p * 10) as u32;
                    assert_eq!(from, [base, base + 1, base + 2]);
                    let want = pattern(slot, p as u32);
                    assert!(d.v[p * slot..(p + 1) * slot] == want[..]);
                }
                barrier.wait();
            });
        }
    });
}

/// Writes a raw record into `to`'s ring from `from` (sender position `pos`).
fn inject(from: &ShmEndpoint, to_pos: usize, rec: &[u8], tail: u64) {
    let conn = from.conn.as_ref().unwrap();
    let p = conn.peers[to_pos].as_ref().unwrap();
    // SAFETY: `rec` is far shorter than the ring, and nobody else writes this ring.
    unsafe { ptr::copy_nonoverlapping(rec.as_ptr(), p.seg.ring(from.pos), rec.len()) };
    p.seg.a64(p.ctl + C_TAIL).store(tail, Ordering::Release);
}

#[test]
fn malformed_rings_are_protocol_errors() {
    let send = RecordRepr::Send { data_len: 0 }.to_bytes();
    let edit = |f: &dyn Fn(&mut RecordHeader<&mut [u8]>)| {
        let mut b = send.to_vec();
        f(&mut RecordHeader::new_unchecked(&mut b[..]));
        b
    };
    let bad_kind = edit(&|h| h.set_kind(99));
    let bad_len = edit(&|h| {
        h.set_kind(99);
        h.set_record_len(12)
    });
    let big_send = edit(&|h| h.set_data_len(100_000));
    let bad_flags = edit(&|h| h.set_flags(2));
    let short_pad = RecordRepr::Padding { len: 16 }.to_bytes();
    let mut bad_kind_64 = bad_kind.clone();
    bad_kind_64.resize(64, 0);
    let record = |error| Violation::Record { error, at: 0 };
    let tail = RING_BYTES as u64 + 8;
    let cases: [(&[u8], u64, Violation, &str); 6] = [
        (
            &bad_kind,
            32,
            record(WireError::UnknownKind {
                format: "record",
                kind: 99,
            }),
            "unknown record kind",
        ),
        (
            &bad_len,
            32,
            Violation::RecordLength {
                len: 12,
                at: 0,
                avail: 32,
            },
            "record of 12 bytes",
        ),
        (
            &big_send,
            32,
            record(WireError::RecordPayload {
                kind: 2,
                data_len: 100_000,
                len: 32,
            }),
            "payload bytes",
        ),
        (
            &bad_flags,
            32,
            record(WireError::UnknownFlags {
                format: "record",
                flags: 2,
            }),
            "unknown flags 0x02",
        ),
        (
            &short_pad[..16],
            16,
            Violation::Padding { len: 16, at: 0 },
            "does not end the ring",
        ),
        (
            &bad_kind_64,
            tail,
            Violation::RingTail { tail, head: 0 },
            "inconsistent",
        ),
    ];
    for (rec, tail, want, why) in cases {
        let (e0, mut e1) = pair();
        inject(&e0, 1, rec, tail);
        let e = e1.poll(&mut Vec::new()).unwrap_err();
        assert!(
            matches!(&e, TransportError::Protocol { peer: 0, violation, .. } if *violation == want),
            "{e}"
        );
        assert!(e.to_string().contains(why), "{e}");
        assert!(!e1.peer_alive(0));
        // The broken ring is no longer read.
        e1.poll(&mut Vec::new()).unwrap();
        e1.wait(Duration::from_millis(1)).unwrap();
    }
}

/// By hand: `cargo test -p gradsync-transport --release shm::tests::writes::measure -- --ignored
/// --nocapture`. One-way latency of an 8-byte inline write with immediate (ping-pong between
/// two threads) and throughput of 512 KiB cross-memory writes.
#[test]
#[ignore]
fn measure() {
    let (mut e0, mut e1) = pair();
    let d0 = buf(&mut e0, vec![0; 8 << 20], RW);
    let d1 = buf(&mut e1, vec![0; 8 << 20], RW);
    let s0 = buf(&mut e0, pattern(512 << 10, 1), Access::LOCAL_READ);
    let s1 = buf(&mut e1, pattern(512 << 10, 2), Access::LOCAL_READ);
    let (r0, r1) = (d0.mr.remote(), d1.mr.remote());
    let iters = 200_000u32;
    let spin = |ep: &mut ShmEndpoint, out: &mut Vec<Completion>| loop {
        out.clear();
        ep.poll(out).unwrap();
        if out.iter().any(remote) {
            return;
        }
    };
    let s1_sge = [sge(&s1, 0, 8)];
    let pong = thread::spawn(move || {
        let mut out = Vec::new();
        for i in 0..iters {
            spin(&mut e1, &mut out);
            // SAFETY: the source outlives the write.
            unsafe { e1.post_write(0, &s1_sge, r0, 0, Some(i), 0) }.unwrap();
        }
        (e1, s1, d1)
    });
    let mut out = Vec::new();
    let t = Instant::now();
    for i in 0..iters {
        // SAFETY: the source outlives the write.
        unsafe { e0.post_write(1, &[sge(&s0, 0, 8)], r1, 0, Some(i), 0) }.unwrap();
        spin(&mut e0, &mut out);
    }
    let el = t.elapsed();
    let (mut e1, _s1, _d1) = pong.join().unwrap();
    println!(
        "8-byte inline write with imm, one-way: {:.0} ns",
        el.as_nanos() as f64 / (2.0 * f64::from(iters))
    );

    let writes = 4096u32;
    let rx = thread::spawn(move || {
        let mut n = 0;
        let mut out = Vec::new();
        while n < writes {
            out.clear();
            e1.poll(&mut out).unwrap();
            n += out.iter().filter(|c| remote(c)).count() as u32;
        }
        e1
    });
    let t = Instant::now();
    for i in 0..writes {
        let off = u64::from(i % 16) * (512 << 10);
        // SAFETY: the source outlives the write.
        unsafe { e0.post_write(1, &[sge(&s0, 0, 512 << 10)], r1, off, Some(i), 0) }.unwrap();
        if i % 64 == 0 {
            e0.poll(&mut Vec::new()).unwrap();
        }
    }
    let _e1 = rx.join().unwrap();
    let el = t.elapsed();
    let bytes = f64::from(writes) * (512.0 * 1024.0);
    println!(
        "512 KiB cross-memory writes: {:.2} GB/s ({:.1} us per write)",
        bytes / el.as_secs_f64() / 1e9,
        el.as_micros() as f64 / f64::from(writes)
    );
}
