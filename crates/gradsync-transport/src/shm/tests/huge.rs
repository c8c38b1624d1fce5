//! Huge pages under large regions registered again: the kernel's side, for real.

use super::{RW, buf, collect, pair, pattern, remote, sge};
use crate::shm::{HUGE_MIN, huge_kib_at};
use crate::verbs::{Access, Endpoint};

fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default()
}

#[test]
fn a_region_registered_again_gets_huge_pages_and_keeps_its_bytes() {
    let mode = thp_mode();
    let (mut e0, mut e1) = pair();
    if mode.is_empty() || mode.contains("[never]") {
        assert!(!e1.huge_pages().on);
        eprintln!("skipped: transparent huge pages are off on this kernel ({mode:?})");
        return;
    }
    let len = HUGE_MIN + (8 << 20);
    let dst = buf(&mut e1, pattern(len, 3), RW);
    let addr = dst.v.as_ptr() as usize;
    assert_eq!(e1.huge_pages().collapsed, 0, "first registration");
    // A buffer that only reads is never collapsed.
    let src = buf(&mut e0, pattern(len, 4), Access::LOCAL_READ);
    // SAFETY: `src` outlives the registration, deregistered at once.
    let again = unsafe { e0.register(src.v.as_ptr() as *mut u8, len, Access::LOCAL_READ) };
    e0.deregister(&again.unwrap());
    assert_eq!(e0.huge_pages().collapsed + e0.huge_pages().refused, 0);

    // Registered again before any peer wrote it by cross-memory attach: left alone.
    // SAFETY: `dst` outlives the registration, deregistered at once.
    let mr = unsafe { e1.register(addr as *mut u8, len, RW) }.unwrap();
    e1.deregister(&mr);
    assert_eq!(e1.huge_pages().collapsed + e1.huge_pages().refused, 0);
    // A cross-memory write into it (4 KiB pages still).
    // SAFETY: the source outlives the write.
    unsafe { e0.post_write(1, &[sge(&src, 8, len - 8)], dst.mr.remote(), 0, Some(4), 1) }.unwrap();
    assert_eq!(collect(&mut e1, 1, remote).len(), 1);
    assert_eq!(&dst.v[..len - 8], &src.v[8..]);

    // SAFETY: `dst` outlives the registration, deregistered below.
    let mr = unsafe { e1.register(addr as *mut u8, len, RW) }.unwrap();
    let stats = e1.huge_pages();
    if stats.refused == 1 {
        eprintln!("skipped: this kernel refuses MADV_COLLAPSE (before Linux 6.1?)");
        return;
    }
    assert_eq!(stats.collapsed, 1, "{stats:?}");
    let kib = huge_kib_at(addr).expect("the buffer's mapping in smaps");
    assert!(
        kib >= (len as u64 >> 10) - 4096,
        "{kib} KiB of huge pages in {len} bytes"
    );
    assert_eq!(&dst.v[..len - 8], &src.v[8..], "contents kept");

    // Cross-memory writes into it land exact bytes.
    // SAFETY: the source outlives the write.
    unsafe { e0.post_write(1, &[sge(&src, 0, len - 64)], mr.remote(), 64, Some(5), 1) }.unwrap();
    assert_eq!(collect(&mut e1, 1, remote).len(), 1);
    assert_eq!(&dst.v[..64], &src.v[8..72]);
    assert_eq!(&dst.v[64..], &src.v[..len - 64]);
    e1.deregister(&mr);

    // The third registration finds the pages huge: counted, nothing copied again.
    // SAFETY: as above.
    let mr = unsafe { e1.register(addr as *mut u8, len, RW) }.unwrap();
    assert_eq!(e1.huge_pages().collapsed, 2);
    assert!(e1.huge_pages().on);
    e1.deregister(&mr);
}

#[test]
fn off_leaves_pages_alone() {
    let (mut e0, mut e1) = pair();
    e1.set_huge_pages(false);
    let len = HUGE_MIN * 2;
    let dst = buf(&mut e1, pattern(len, 1), RW);
    let src = buf(&mut e0, pattern(len, 6), Access::LOCAL_READ);
    // SAFETY: the source outlives the write.
    unsafe { e0.post_write(1, &[sge(&src, 0, len)], dst.mr.remote(), 0, Some(1), 1) }.unwrap();
    assert_eq!(collect(&mut e1, 1, remote).len(), 1);
    for _ in 0..2 {
        // SAFETY: `dst` outlives the registration, deregistered at once.
        let mr = unsafe { e1.register(dst.v.as_ptr() as *mut u8, len, RW) }.unwrap();
        e1.deregister(&mr);
    }
    assert_eq!(e1.huge_pages().collapsed + e1.huge_pages().refused, 0);
}

#[test]
fn a_region_the_kernel_refuses_is_tried_twice_then_left_alone() {
    let mode = thp_mode();
    let (mut e0, mut e1) = pair();
    if mode.is_empty() || mode.contains("[never]") {
        eprintln!("skipped: transparent huge pages are off on this kernel ({mode:?})");
        return;
    }
    let len = HUGE_MIN * 2;
    let dst = buf(&mut e1, pattern(len, 2), RW);
    let addr = dst.v.as_ptr() as usize;
    // The owner said no huge pages here: MADV_COLLAPSE fails on it.
    let start = (addr + (2 << 20) - 1) & !((2 << 20) - 1);
    // SAFETY: the span lies inside `dst`'s heap block, which stays mapped.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, 4 << 20, libc::MADV_NOHUGEPAGE) };
    assert_eq!(rc, 0);
    let src = buf(&mut e0, pattern(len, 5), Access::LOCAL_READ);
    // SAFETY: the source outlives the write.
    unsafe { e0.post_write(1, &[sge(&src, 0, len)], dst.mr.remote(), 0, Some(1), 1) }.unwrap();
    assert_eq!(collect(&mut e1, 1, remote).len(), 1);
    for _ in 0..4 {
        // SAFETY: `dst` outlives the registration, deregistered at once.
        let mr = unsafe { e1.register(addr as *mut u8, len, RW) }.unwrap();
        e1.deregister(&mr);
    }
    let s = e1.huge_pages();
    assert_eq!((s.collapsed, s.refused, s.on), (0, 2, true), "{s:?}");
    assert_eq!(dst.v, src.v);
}
