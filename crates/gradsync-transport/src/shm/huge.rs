//! Huge pages under the large regions peers write into by cross-memory attach.
//!
//! `process_vm_writev` pins every page of the target span for each write, and the writer's
//! copy walks it page by page: with 4 KiB pages, pinning and TLB misses cost about a third of
//! a 64 MiB all-gather over shared memory. A region registered for remote writes, outside
//! a shared allocation and at least [`HUGE_MIN`] long, that peers wrote by cross-memory attach
//! and that is registered again with the same address and length (a buffer the caller reuses,
//! as a training loop or a benchmark does) gets `madvise(MADV_COLLAPSE)` over its 2 MiB-aligned
//! interior: the kernel backs it with transparent huge pages, keeping its contents. A first
//! registration changes nothing, so a buffer used once pays nothing, and neither does one that
//! peers fill through the inbox (an all-reduce's output). Later registrations of a collapsed buffer call it again,
//! which returns at once while the pages are still huge. Should those calls keep doing real
//! work (the caller frees and allocates anew at the same address), the endpoint stops after
//! [`MAX_STRIKES`] of them. A region the kernel refused twice (pinned pages, untouched ones,
//! `MADV_NOHUGEPAGE`, a kernel before 6.1) is left alone. Off when the kernel's transparent
//! huge pages are `never`.

use std::time::{Duration, Instant};

/// Regions shorter than this keep their pages.
pub const HUGE_MIN: usize = 8 << 20;

/// The transparent huge page size of x86-64 and aarch64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

/// Recently registered large regions remembered.
const SEEN: usize = 16;

/// Repeated collapses of one remembered region that did real work before the endpoint stops.
pub(super) const MAX_STRIKES: u32 = 3;

/// Refusals of one remembered region after which it is left alone (pages pinned by someone
/// else, for example a page-locked staging buffer, are refused every time).
const MAX_REFUSALS: u8 = 2;

/// A remembered region: its aligned interior, whether peers wrote it by cross-memory attach,
/// whether a collapse of it succeeded, and how often the kernel refused it.
#[derive(Clone, Copy, Debug)]
struct Seen {
    span: (usize, usize),
    written: bool,
    collapsed: bool,
    refusals: u8,
}

/// `MADV_COLLAPSE` (Linux 6.1), absent from older libc bindings.
const MADV_COLLAPSE: libc::c_int = 25;

/// What the huge-page policy of a shared-memory endpoint did so far
/// ([`ShmEndpoint::huge_pages`](crate::shm::ShmEndpoint::huge_pages)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HugeStats {
    /// Whether the endpoint still collapses regions.
    pub on: bool,
    /// Collapse calls that succeeded (including ones that found the pages already huge).
    pub collapsed: u64,
    /// Collapse calls the kernel refused (untouched pages, `MADV_NOHUGEPAGE`, an old kernel).
    pub refused: u64,
}

/// The per-endpoint policy and its memory of recent regions.
#[derive(Debug)]
pub(super) struct HugePages {
    /// The kernel's transparent huge pages are not `never`.
    kernel: bool,
    /// The caller's setting ([`set`](Self::set)).
    wanted: bool,
    /// Oldest replaced first.
    seen: Vec<Seen>,
    next: usize,
    strikes: u32,
    collapsed: u64,
    refused: u64,
}

impl HugePages {
    /// On unless the kernel's setting is `never` (or there is no such setting).
    pub(super) fn new() -> HugePages {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        HugePages::with(thp.is_ok_and(|s| !s.contains("[never]")))
    }

    fn with(kernel: bool) -> HugePages {
        HugePages {
            kernel,
            wanted: true,
            seen: Vec::with_capacity(SEEN),
            next: 0,
            strikes: 0,
            collapsed: 0,
            refused: 0,
        }
    }

    /// The caller's setting; neither the kernel's `never` nor the strikes are undone by it.
    pub(super) fn set(&mut self, on: bool) {
        self.wanted = on;
    }

    fn on(&self) -> bool {
        self.kernel && self.wanted && self.strikes < MAX_STRIKES
    }

    pub(super) fn stats(&self) -> HugeStats {
        HugeStats {
            on: self.on(),
            collapsed: self.collapsed,
            refused: self.refused,
        }
    }

    /// The 2 MiB-aligned interior of a span, or `None` when the span is short or holds no
    /// whole huge page.
    fn interior(addr: usize, len: usize) -> Option<(usize, usize)> {
        if len < HUGE_MIN {
            return None;
        }
        let start = addr.checked_add(HUGE_PAGE - 1)? & !(HUGE_PAGE - 1);
        let end = addr.checked_add(len)? & !(HUGE_PAGE - 1);
        (end > start).then(|| (start, end - start))
    }

    /// The span to collapse now for a registration of `len` bytes at `addr` (remote writes,
    /// outside a shared allocation), or `None`; remembers the span either way.
    pub(super) fn on_register(&mut self, addr: usize, len: usize) -> Option<(usize, usize)> {
        if !self.on() {
            return None;
        }
        let span = Self::interior(addr, len)?;
        if let Some(e) = self.seen.iter().find(|e| e.span == span) {
            return (e.written && e.refusals < MAX_REFUSALS).then_some(span);
        }
        let e = Seen {
            span,
            written: false,
            collapsed: false,
            refusals: 0,
        };
        if self.seen.len() < SEEN {
            self.seen.push(e);
        } else {
            self.seen[self.next] = e;
            self.next = (self.next + 1) % SEEN;
        }
        None
    }

    /// A peer wrote at least 64 KiB into the region of `len` bytes at `addr` by cross-memory
    /// attach: its next registration collapses it.
    pub(super) fn on_written(&mut self, addr: usize, len: usize) {
        let Some(span) = Self::interior(addr, len) else {
            return;
        };
        if let Some(e) = self.seen.iter_mut().find(|e| e.span == span) {
            e.written = true;
        }
    }

    /// Records the outcome of collapsing `span`, which took `took`. Returns `true` when this
    /// outcome turned the policy off.
    pub(super) fn record(&mut self, span: (usize, usize), ok: bool, took: Duration) -> bool {
        let Some(e) = self.seen.iter_mut().find(|e| e.span == span) else {
            return false;
        };
        if !ok {
            self.refused += 1;
            e.refusals = e.refusals.saturating_add(1);
            return false;
        }
        self.collapsed += 1;
        // Pages still huge: the call only walks the page tables. Copying them again costs
        // about a millisecond per 16 MiB or more.
        let redone = took > Duration::from_micros(100) + Duration::from_nanos(span.1 as u64 / 16);
        let strike = e.collapsed && redone;
        e.collapsed = true;
        if strike {
            self.strikes += 1;
            return self.strikes == MAX_STRIKES;
        }
        false
    }

    /// Collapses `span` now: `madvise(MADV_COLLAPSE)`, timed. Returns whether the kernel did
    /// it and how long it took.
    pub(super) fn collapse(span: (usize, usize)) -> (bool, Duration) {
        let t = Instant::now();
        // SAFETY: `span` lies inside a region the caller registered and keeps mapped while it
        // is registered; MADV_COLLAPSE keeps the contents of the pages it replaces.
        let rc = unsafe { libc::madvise(span.0 as *mut libc::c_void, span.1, MADV_COLLAPSE) };
        (rc == 0, t.elapsed())
    }
}

/// The transparent huge pages of the mapping that holds `addr` in this process, in KiB
/// (`AnonHugePages` in `/proc/self/smaps`), or `None` when that cannot be read: what a
/// collapse did, for tests and diagnostics (the kernel may merge adjacent allocations into one
/// mapping, so the figure can include its neighbours).
pub fn huge_kib_at(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = (a..b).contains(&addr);
            continue;
        }
        if inside && let Some(v) = line.strip_prefix("AnonHugePages:") {
            return v.trim().trim_end_matches("kB").trim().parse().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: usize = 1 << 20;

    #[test]
    fn short_spans_and_spans_without_a_whole_huge_page_are_left_alone() {
        let mut h = HugePages::with(true);
        for _ in 0..3 {
            assert_eq!(h.on_register(0x4000_0000, HUGE_MIN - 1), None);
        }
        assert_eq!(
            HugePages::interior(0x4000_0010, 8 * M),
            Some((0x4020_0000, 6 * M))
        );
        assert_eq!(
            HugePages::interior(0x4000_0000, 8 * M),
            Some((0x4000_0000, 8 * M))
        );
        assert_eq!(
            HugePages::interior(usize::MAX - 4 * M, 9 * M),
            None,
            "wraps"
        );
    }

    #[test]
    fn a_region_peers_wrote_is_collapsed_when_registered_again() {
        let mut h = HugePages::with(true);
        let (addr, len) = (0x7f00_0000_0010, 64 * M);
        assert_eq!(h.on_register(addr, len), None, "first sight");
        assert_eq!(
            h.on_register(addr, len),
            None,
            "nobody wrote it by cross-memory attach"
        );
        h.on_written(addr, len);
        let span = h.on_register(addr, len).expect("written, seen again");
        assert_eq!(span, (0x7f00_0020_0000, 62 * M));
        assert!(!h.record(span, true, Duration::from_millis(40)));
        for _ in 0..10 {
            assert_eq!(h.on_register(addr, len), Some(span));
            assert!(!h.record(span, true, Duration::from_micros(20)));
        }
        assert_eq!(h.stats().collapsed, 11);
        assert!(h.stats().on);
        // Another buffer: remembered, not collapsed on first sight.
        assert_eq!(h.on_register(addr + 128 * M, 16 * M), None);
    }

    #[test]
    fn buffers_replaced_at_the_same_address_turn_it_off_after_three_strikes() {
        let mut h = HugePages::with(true);
        let (addr, len) = (0x7f00_0000_0000, 32 * M);
        h.on_register(addr, len);
        h.on_written(addr, len);
        let span = h.on_register(addr, len).unwrap();
        // The first collapse does real work: no strike.
        assert!(!h.record(span, true, Duration::from_millis(30)));
        for strike in 1..MAX_STRIKES {
            assert_eq!(h.on_register(addr, len), Some(span));
            assert!(
                !h.record(span, true, Duration::from_millis(30)),
                "strike {strike}"
            );
        }
        assert_eq!(h.on_register(addr, len), Some(span));
        assert!(
            h.record(span, true, Duration::from_millis(30)),
            "the last strike"
        );
        assert_eq!(h.on_register(addr, len), None);
        assert!(!h.stats().on);
        h.set(true);
        assert!(!h.stats().on, "set(true) does not undo the strikes");
    }

    #[test]
    fn a_region_refused_twice_is_left_alone() {
        let mut h = HugePages::with(true);
        let (addr, len) = (0x7f00_0000_0000, 16 * M);
        h.on_register(addr, len);
        h.on_written(addr, len);
        let span = h.on_register(addr, len).unwrap();
        assert!(!h.record(span, false, Duration::from_micros(3)));
        assert_eq!(h.on_register(addr, len), Some(span), "tried again once");
        assert!(!h.record(span, false, Duration::from_micros(3)));
        assert_eq!(h.on_register(addr, len), None);
        assert_eq!(h.stats().refused, 2);
        assert!(h.stats().on, "other regions still get huge pages");
        h.on_register(addr + 64 * M, len);
        h.on_written(addr + 64 * M, len);
        assert!(h.on_register(addr + 64 * M, len).is_some());
    }

    #[test]
    fn the_memory_holds_the_last_sixteen_regions() {
        let mut h = HugePages::with(true);
        let base = 0x7f00_0000_0000usize;
        for i in 0..=SEEN {
            assert_eq!(h.on_register(base + i * 64 * M, 16 * M), None);
        }
        for i in 0..=SEEN {
            h.on_written(base + i * 64 * M, 16 * M);
        }
        // The first was replaced by the seventeenth; the second is still there.
        assert_eq!(h.on_register(base, 16 * M), None);
        assert!(h.on_register(base + 2 * 64 * M, 16 * M).is_some());
    }

    #[test]
    fn off_means_nothing_is_collapsed() {
        let mut h = HugePages::with(true);
        h.set(false);
        for _ in 0..3 {
            assert_eq!(h.on_register(0x7f00_0000_0000, 64 * M), None);
            h.on_written(0x7f00_0000_0000, 64 * M);
        }
        assert_eq!(h.stats(), HugeStats::default());
    }

    #[test]
    fn the_kernels_never_stays_off_whatever_the_setting() {
        let mut h = HugePages::with(false);
        h.set(true);
        assert!(!h.stats().on);
        for _ in 0..3 {
            assert_eq!(h.on_register(0x7f00_0000_0000, 64 * M), None);
            h.on_written(0x7f00_0000_0000, 64 * M);
        }
    }
}
