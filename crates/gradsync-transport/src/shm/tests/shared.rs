//! Shared allocations: large writes that are `memcpy`s into a peer's mapped memory, their
//! offsets and access checks, forged directory entries, and mappings that go with the peer.

use super::{
    RW, buf, collect, fabric, fabric_in, pair, pattern, remote, sge, tag, write_three_mib,
};
use crate::error::TransportError;
use crate::shm::directory::{AllocRef, DirEntry, dir_lookup, dir_read, dir_write};
use crate::shm::endpoint::{PathCounts, ShmEndpoint};
use crate::shm::liveness::LIVENESS_EVERY;
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion};
use std::os::fd::AsRawFd;
use std::ptr;
use std::thread;
use std::time::{Duration, Instant};

/// Memory from `alloc_shared`, valid while the endpoint that made it lives.
#[derive(Clone, Copy)]
struct Shared {
    base: *mut u8,
    len: usize,
}

impl Shared {
    fn new(ep: &mut ShmEndpoint, len: usize) -> Shared {
        let base = ep
            .shared_memory()
            .expect("shared memory")
            .alloc_shared(len)
            .expect("shared allocation");
        Shared { base, len }
    }

    /// Registers `len` bytes at `off`.
    fn register(&self, ep: &mut ShmEndpoint, off: usize, len: usize, a: Access) -> MemoryRegion {
        // SAFETY: only the address is used; the allocation stays mapped until `ep` drops,
        // after its last use in the test.
        let p = unsafe { self.base.add(off) };
        // SAFETY: the span lies in the allocation (or, in the tests that register past its
        // end, is never written), which outlives the endpoint's use of it.
        unsafe { ep.register(p, len, a) }.unwrap()
    }

    /// A copy of `len` bytes at `off`.
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        // SAFETY: in range of the allocation, which is alive; no write is in flight while a
        // test reads.
        unsafe { std::slice::from_raw_parts(self.base.add(off), len) }.to_vec()
    }
}

fn zeros(v: &[u8]) -> bool {
    v.iter().all(|&b| b == 0)
}

fn peer_maps(ep: &ShmEndpoint, pos: usize) -> usize {
    let conn = ep.conn.as_ref().unwrap();
    conn.peers[pos].as_ref().unwrap().maps.len()
}

fn own_entry(ep: &ShmEndpoint, key: u32) -> DirEntry {
    let conn = ep.conn.as_ref().unwrap();
    dir_lookup(&conn.own, key).unwrap().unwrap()
}

#[test]
fn large_writes_into_shared_allocations_are_memcpys() {
    let (mut e0, mut e1) = pair();
    let mib = 1 << 20;
    let sh = Shared::new(&mut e1, 4 * mib + 100);
    let alloc_len = e1.shared[0].seg.len;
    assert!(alloc_len >= 4 * mib + 100 && alloc_len.is_multiple_of(4096));
    let dst = sh.register(&mut e1, 0, sh.len, RW);
    let a = own_entry(&e1, dst.rkey).alloc.unwrap();
    assert_eq!((a.id, a.len, a.off), (e1.shared[0].id, alloc_len as u64, 0));
    let r = dst.remote();
    let a = buf(&mut e0, pattern(2 * mib, 1), Access::LOCAL_READ);
    let b = buf(&mut e0, pattern(2 * mib, 2), Access::LOCAL_READ);

    // 3 MiB with a three-entry gather list.
    let want = write_three_mib(&mut e0, &mut e1, r, &a, &b);
    assert!(sh.read(17, 3 * mib) == want);
    assert!(zeros(&sh.read(0, 17)) && zeros(&sh.read(17 + 3 * mib, 100)));
    let counts = |mapped, inline, cma| PathCounts {
        inline,
        mapped,
        cma,
    };
    assert_eq!(e0.paths, counts(1, 0, 0));
    assert_eq!(peer_maps(&e0, 1), 1);

    // The mapping is reused; a small write into the same region still goes inline.
    let at = 3 * mib + 50;
    // SAFETY: as above.
    unsafe { e0.post_write(1, &[sge(&b, 7, mib)], r, at as u64, Some(10), 5) }.unwrap();
    // SAFETY: as above.
    unsafe { e0.post_write(1, &[sge(&a, 9, 8)], r, 1, Some(11), 6) }.unwrap();
    let got = collect(&mut e1, 2, remote);
    assert_eq!(got.iter().map(tag).collect::<Vec<_>>(), [10, 11]);
    assert!(sh.read(at, mib) == b.v[7..mib + 7]);
    assert_eq!(sh.read(1, 8), &a.v[9..17]);
    assert_eq!(e0.paths, counts(2, 1, 0));
    assert_eq!(peer_maps(&e0, 1), 1);

    // An ordinary region keeps using cross-memory attach.
    let plain = buf(&mut e1, vec![0; mib], RW);
    assert!(own_entry(&e1, plain.mr.rkey).alloc.is_none());
    // SAFETY: as above.
    unsafe { e0.post_write(1, &[sge(&a, 3, mib)], plain.mr.remote(), 0, Some(12), 7) }.unwrap();
    assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 12);
    assert!(plain.v == a.v[3..mib + 3]);
    assert_eq!(e0.paths, counts(2, 1, 1));

    let mut out = Vec::new();
    e0.poll(&mut out).unwrap();
    let ids: Vec<u64> = (4..8).collect();
    assert_eq!(
        out,
        ids.iter()
            .map(|&wr_id| Completion::WriteDone { wr_id })
            .collect::<Vec<_>>()
    );
}

#[test]
fn shared_sub_regions_land_at_their_offset() {
    let (mut e0, mut e1) = pair();
    let mib = 1 << 20;
    let sh = Shared::new(&mut e1, 3 * mib);
    let alloc_len = e1.shared[0].seg.len;
    let sub = sh.register(&mut e1, 8192 + 5, mib, RW);
    let tail = sh.register(&mut e1, 2 * mib, mib, RW);
    assert_eq!(own_entry(&e1, sub.rkey).alloc.unwrap().off, 8197);
    // SAFETY: the span lies in the allocation, which outlives the endpoint's use of it.
    let keyed = unsafe { e1.register_with_key(sh.base.add(4096), 100, RW, 77) }.unwrap();
    let a = own_entry(&e1, keyed.rkey).alloc.unwrap();
    assert_eq!((a.off, a.id), (4096, e1.shared[0].id));
    assert_eq!(own_entry(&e1, tail.rkey).alloc.unwrap().off, 2 * mib as u64);
    // A span that reaches past the allocation is not inside it (registered, never written).
    let p = sh.base.wrapping_add(alloc_len - 10);
    // SAFETY: registration only records the span; nothing writes to it.
    let over = unsafe { e1.register(p, 20, RW) }.unwrap();
    assert!(own_entry(&e1, over.rkey).alloc.is_none());
    // A second allocation has its own id and its own mapping at the writer.
    let sh2 = Shared::new(&mut e1, 100_000);
    let whole2 = sh2.register(&mut e1, 0, sh2.len, RW);
    let a2 = own_entry(&e1, whole2.rkey).alloc.unwrap();
    assert_eq!((a2.id, a2.off), (e1.shared[1].id, 0));
    assert_ne!(e1.shared[0].id, e1.shared[1].id);

    let src = buf(&mut e0, pattern(mib, 3), Access::LOCAL_READ);
    let k = 600 << 10;
    let writes = [
        (sub.remote(), 1000u64, sge(&src, 0, k)),
        (tail.remote(), 0, sge(&src, 11, 300 << 10)),
        (whole2.remote(), 30_000, sge(&src, 5, 70_000)),
    ];
    for (i, (r, off, s)) in writes.iter().enumerate() {
        // SAFETY: the source outlives the writes.
        unsafe { e0.post_write(1, &[*s], *r, *off, Some(i as u32), 0) }.unwrap();
    }
    collect(&mut e1, 3, remote);
    let at = 8197 + 1000;
    assert!(sh.read(at, k) == src.v[..k]);
    assert!(zeros(&sh.read(0, at)));
    assert!(zeros(&sh.read(at + k, 2 * mib - at - k)));
    assert!(sh.read(2 * mib, 300 << 10) == src.v[11..11 + (300 << 10)]);
    assert!(zeros(&sh.read(2 * mib + (300 << 10), mib - (300 << 10))));
    assert!(sh2.read(30_000, 70_000) == src.v[5..70_005]);
    assert!(zeros(&sh2.read(0, 30_000)));
    assert_eq!(e0.paths.mapped, 3);
    assert_eq!(peer_maps(&e0, 1), 2);

    // Inside the allocation but past the end of the sub-region: refused, nothing written.
    let s = [sge(&src, 0, k)];
    // SAFETY: as above.
    let e =
        unsafe { e0.post_write(1, &s, sub.remote(), (mib - 1000) as u64, None, 0) }.unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    assert!(zeros(&sh.read(8197 + mib, 2 * mib - 8197 - mib)));
    assert_eq!(e0.paths.mapped, 3);
}

#[test]
fn shared_regions_keep_the_access_checks() {
    let mut eps = fabric_in(4, &[0, 2]);
    let mut e2 = eps.pop().unwrap();
    let mut e0 = eps.pop().unwrap();
    let sh = Shared::new(&mut e2, 1 << 20);
    let dst = sh.register(&mut e2, 0, 100_000, RW);
    let ro = sh.register(&mut e2, 100_000, 100_000, Access::LOCAL_READ);
    let gone = sh.register(&mut e2, 200_000, 100_000, RW);
    e2.deregister(&gone);
    let src = buf(&mut e0, pattern(100_000, 5), Access::LOCAL_READ);
    let large = [sge(&src, 0, 10_000)];
    let cases = [
        (gone.remote(), 0, "unknown key"),
        (dst.remote(), 95_000, "past the end"),
        (dst.remote(), u64::MAX - 100, "past the end"),
        (ro.remote(), 0, "does not allow remote writes"),
    ];
    for (r, off, why) in cases {
        // SAFETY: the source outlives the call.
        let e = unsafe { e0.post_write(2, &large, r, off, Some(1), 9) }.unwrap_err();
        assert!(
            matches!(e, TransportError::RemoteAccess { peer: 2, .. }),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.starts_with("rank 0: write of 10000 bytes"), "{msg}");
        assert!(msg.contains("into rank 2's region"), "{msg}");
        assert!(msg.contains(why), "{msg}");
    }
    let mut out = Vec::new();
    e2.poll(&mut out).unwrap();
    e0.poll(&mut out).unwrap();
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(e0.paths, PathCounts::default());
    assert_eq!(peer_maps(&e0, 1), 0);
    assert!(zeros(&sh.read(0, sh.len)));
    assert!(e0.peer_alive(2));
}

#[test]
fn forged_allocation_entries_are_rejected() {
    type Forge = fn(AllocRef, &ShmEndpoint) -> AllocRef;
    let cases: [(Forge, &str); 5] = [
        (
            |a, _| AllocRef {
                len: a.len + 4096,
                ..a
            },
            "where its directory entry says",
        ),
        (
            |a, _| AllocRef { id: a.id ^ 1, ..a },
            "not shared allocation",
        ),
        (
            |a, ep| AllocRef {
                fd: ep
                    .conn
                    .as_ref()
                    .unwrap()
                    .own
                    .fd
                    .as_ref()
                    .unwrap()
                    .as_raw_fd(),
                ..a
            },
            "gradsync-shm",
        ),
        (
            |a, _| AllocRef {
                off: a.len - 10,
                ..a
            },
            "does not fit its shared allocation",
        ),
        (|a, _| AllocRef { fd: 99_999, ..a }, "/proc/"),
    ];
    for (i, (forge, why)) in cases.into_iter().enumerate() {
        let (mut e0, mut e1) = pair();
        let sh = Shared::new(&mut e1, 1 << 20);
        let dst = sh.register(&mut e1, 0, 100_000, RW);
        let conn = e1.conn.as_ref().unwrap();
        let slot = e1.regions.slots[&dst.rkey];
        let mut entry = dir_read(&conn.own, slot).unwrap();
        entry.alloc = Some(forge(entry.alloc.unwrap(), &e1));
        dir_write(&conn.own, slot, entry);
        let src = buf(&mut e0, pattern(10_000, 5), Access::LOCAL_READ);
        // SAFETY: the source outlives the call.
        let e = unsafe { e0.post_write(1, &[sge(&src, 0, 10_000)], dst.remote(), 0, None, 0) }
            .unwrap_err();
        assert!(e.to_string().contains(why), "case {i}: {e}");
        assert_eq!(e.peer(), Some(1));
        if i == 4 {
            // A descriptor that does not exist: an I/O error, the peer stays up.
            assert!(matches!(e, TransportError::Io { .. }), "{e}");
            assert!(e0.peer_alive(1));
        } else {
            assert!(matches!(e, TransportError::Protocol { .. }), "{e}");
            assert!(!e0.peer_alive(1));
        }
        assert!(zeros(&sh.read(0, sh.len)));
        assert_eq!(peer_maps(&e0, 1), 0);
    }
}

#[test]
fn mixed_writes_keep_posting_order() {
    let (mut e0, mut e1) = pair();
    let n = 1000u32;
    let big = 40_000usize;
    let per_kind = n as usize / 5;
    let sh = Shared::new(&mut e1, per_kind * big + (64 << 10));
    let sh_small = sh.register(&mut e1, 0, 64 << 10, RW).remote();
    let sh_big = sh.register(&mut e1, 64 << 10, per_kind * big, RW).remote();
    let plain = buf(&mut e1, vec![0; per_kind * big + (64 << 10)], RW);
    let pr = plain.mr.remote();
    let src = buf(&mut e0, pattern(big + 1000, 4), Access::LOCAL_READ);
    let rx = thread::spawn(move || {
        let got = collect(&mut e1, n as usize, remote);
        (e1, plain, got)
    });
    let span = |i: u32| (i as usize * 7) % 1000;
    for i in 0..n {
        let slot = (i / 5) as u64;
        let small = [sge(&src, span(i), 8)];
        let large = [sge(&src, span(i), big)];
        // SAFETY: the source outlives the writes.
        unsafe {
            match i % 5 {
                0 => e0.post_send(1, &i.to_le_bytes(), 0),
                1 => e0.post_write(1, &small, sh_small, slot * 8, Some(i), 0),
                2 => e0.post_write(1, &large, sh_big, slot * big as u64, Some(i), 0),
                3 => e0.post_write(1, &small, pr, slot * 8, Some(i), 0),
                _ => e0.post_write(1, &large, pr, (64 << 10) + slot * big as u64, Some(i), 0),
            }
        }
        .unwrap();
        if i % 64 == 0 {
            e0.poll(&mut Vec::new()).unwrap();
        }
    }
    let (_e1, plain, got) = rx.join().unwrap();
    let tags: Vec<u32> = got.iter().map(tag).collect();
    assert_eq!(tags, (0..n).collect::<Vec<_>>());
    for slot in 0..per_kind {
        let i = |k: usize| (slot * 5 + k) as u32;
        let (s1, s2, s3, s4) = (span(i(1)), span(i(2)), span(i(3)), span(i(4)));
        assert_eq!(sh.read(slot * 8, 8), &src.v[s1..s1 + 8]);
        assert!(sh.read((64 << 10) + slot * big, big) == src.v[s2..s2 + big]);
        assert_eq!(&plain.v[slot * 8..slot * 8 + 8], &src.v[s3..s3 + 8]);
        let at = (64 << 10) + slot * big;
        assert!(plain.v[at..at + big] == src.v[s4..s4 + big]);
    }
    let k = u64::from(n) / 5;
    assert_eq!(
        e0.paths,
        PathCounts {
            inline: 2 * k,
            mapped: k,
            cma: k
        }
    );
}

#[test]
fn peer_mappings_go_with_the_peer() {
    let mut eps = fabric(3);
    let mut e2 = eps.pop().unwrap();
    let mut e1 = eps.pop().unwrap();
    let mut e0 = eps.pop().unwrap();
    let sh1 = Shared::new(&mut e1, 1 << 20);
    let sh2 = Shared::new(&mut e2, 1 << 20);
    let r1 = sh1.register(&mut e1, 0, 1 << 20, RW).remote();
    let r2 = sh2.register(&mut e2, 0, 1 << 20, RW).remote();
    let src = buf(&mut e0, pattern(100_000, 6), Access::LOCAL_READ);
    let s = [sge(&src, 0, 100_000)];
    // SAFETY: the source outlives the writes.
    unsafe { e0.post_write(1, &s, r1, 0, Some(1), 0) }.unwrap();
    // SAFETY: as above.
    unsafe { e0.post_write(2, &s, r2, 0, Some(2), 0) }.unwrap();
    collect(&mut e1, 1, remote);
    collect(&mut e2, 1, remote);
    assert!(sh1.read(0, 100_000) == src.v && sh2.read(0, 100_000) == src.v);
    assert_eq!((peer_maps(&e0, 1), peer_maps(&e0, 2)), (1, 1));
    // A closed endpoint allocates nothing more; its allocations live until it drops.
    e1.close(Duration::from_secs(1));
    assert!(
        e1.shared_memory()
            .expect("shared memory")
            .alloc_shared(4096)
            .is_none()
    );
    assert!(sh1.read(0, 100_000) == src.v);
    // SAFETY: as above.
    let e = unsafe { e0.post_write(1, &s, r1, 0, Some(3), 0) }.unwrap_err();
    assert!(
        matches!(e, TransportError::PeerClosed { peer: 1, .. }),
        "{e}"
    );
    assert_eq!((peer_maps(&e0, 1), peer_maps(&e0, 2)), (0, 1));
    drop(e1);
    drop(e2);
    e0.poll(&mut Vec::new()).unwrap();
    thread::sleep(LIVENESS_EVERY);
    // Polls read the clock (and so run the liveness check) one time in 64.
    for _ in 0..64 {
        e0.poll(&mut Vec::new()).unwrap();
    }
    assert!(!e0.peer_alive(2));
    assert_eq!(peer_maps(&e0, 2), 0);
}

/// By hand: `cargo test -p gradsync-transport --release shm::tests::shared::measure_shared --
/// --ignored --nocapture`. Throughput of 512 KiB writes into a region of a shared allocation
/// (memcpy) and into an ordinary region (cross-memory attach): a writer and a polling
/// receiver thread, 64 MiB per run, 3 runs each.
#[test]
#[ignore]
fn measure_shared() {
    let (mut e0, mut e1) = pair();
    let chunk = 512 << 10;
    let slots = 16;
    let writes = (64 << 20) / chunk;
    let sh = Shared::new(&mut e1, slots * chunk);
    // SAFETY: the allocation holds `slots * chunk` bytes; nothing else touches it yet.
    unsafe { ptr::write_bytes(sh.base, 1, slots * chunk) };
    let shared = sh.register(&mut e1, 0, slots * chunk, RW).remote();
    let plain = buf(&mut e1, vec![1; slots * chunk], RW);
    let src = buf(&mut e0, pattern(chunk, 1), Access::LOCAL_READ);
    let cases = [
        ("a shared allocation (memcpy)", shared),
        ("an ordinary region (CMA)", plain.mr.remote()),
    ];
    for run in 1..=3 {
        for (name, r) in cases {
            let el = thread::scope(|sc| {
                let rx = sc.spawn(|| {
                    let mut n = 0;
                    let mut out = Vec::new();
                    while n < writes {
                        out.clear();
                        e1.poll(&mut out).unwrap();
                        n += out.iter().filter(|c| remote(c)).count();
                    }
                });
                let t = Instant::now();
                for i in 0..writes {
                    let off = ((i % slots) * chunk) as u64;
                    let s = [sge(&src, 0, chunk)];
                    // SAFETY: the source outlives the write.
                    unsafe { e0.post_write(1, &s, r, off, Some(i as u32), 0) }.unwrap();
                    if i % 16 == 0 {
                        e0.poll(&mut Vec::new()).unwrap();
                    }
                }
                rx.join().unwrap();
                t.elapsed()
            });
            println!(
                "run {run}: 512 KiB writes into {name}: {:.2} GB/s ({:.1} us per write)",
                (writes * chunk) as f64 / el.as_secs_f64() / 1e9,
                el.as_micros() as f64 / writes as f64
            );
        }
    }
    assert!(sh.read(0, chunk) == src.v && plain.v[..chunk] == src.v[..]);
    assert_eq!(e0.paths.mapped, 3 * writes as u64);
    assert_eq!(e0.paths.cma, 3 * writes as u64);
}
