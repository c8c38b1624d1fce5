//! A shared mapping of a memfd ([`Segment`]): creation, sealing and mapping, atomic access to
//! its words, and the eventcount wake-up of its owner.

use super::futex::futex_wake;
use super::layout::{CTL_BYTES, H_CLOSED, H_EVENTS, H_SLEEPING, RING_BYTES, ctl_off};
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// A shared mapping of a memfd: a control segment (this rank's own, or a peer's), or a shared
/// allocation (this rank's own, or a writer's mapping of a peer's).
#[derive(Debug)]
pub(super) struct Segment {
    pub(super) base: *mut u8,
    pub(super) len: usize,
    /// The memfd, kept open for the segment's owner so peers can open it through `/proc`.
    pub(super) fd: Option<OwnedFd>,
}

// SAFETY: a Segment owns its mapping and descriptor, neither tied to a thread. Shared words are
// accessed only through atomics, and ring bytes only in spans that the ring protocol hands to
// one side at a time, so moving the owner to another thread changes nothing.
unsafe impl Send for Segment {}

impl Segment {
    /// Creates, sizes, seals and maps a new memfd segment named `name`.
    pub(super) fn create(name: &CStr, len: usize) -> io::Result<Segment> {
        // SAFETY: the name is a NUL-terminated string; the flags are valid.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: plain system call on a descriptor owned here.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: plain system call on a descriptor owned here.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut seg = Segment::map(fd.as_raw_fd(), len)?;
        seg.fd = Some(fd);
        Ok(seg)
    }

    /// Maps `len` bytes of `fd` shared, readable and writable.
    pub(super) fn map(fd: RawFd, len: usize) -> io::Result<Segment> {
        // SAFETY: a new mapping with no address hint cannot alias existing memory; the result
        // is checked.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Segment {
            base: p.cast(),
            len,
            fd: None,
        })
    }

    /// `len` bytes at `off`, inside the mapping (asserted).
    pub(super) fn span(&self, off: usize, len: usize) -> *mut u8 {
        assert!(off + len <= self.len, "segment span {off}+{len}");
        // SAFETY: in range of the mapping (asserted).
        unsafe { self.base.add(off) }
    }

    pub(super) fn a32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "segment offset {off}"
        );
        // SAFETY: the mapping is `len` bytes, page-aligned and alive as long as `self`; `off` is
        // 4-aligned and in range (asserted). Every process accesses this word atomically.
        unsafe { AtomicU32::from_ptr(self.base.add(off).cast()) }
    }

    pub(super) fn a64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "segment offset {off}"
        );
        // SAFETY: as in `a32`, with 8-byte alignment.
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast()) }
    }

    /// Start of the ring data of sender position `pos`.
    pub(super) fn ring(&self, pos: usize) -> *mut u8 {
        let off = ctl_off(pos) + CTL_BYTES;
        assert!(
            off + RING_BYTES <= self.len,
            "ring {pos} outside the segment"
        );
        // SAFETY: in range of the mapping (asserted).
        unsafe { self.base.add(off) }
    }

    pub(super) fn closed(&self) -> bool {
        self.a32(H_CLOSED).load(Ordering::Acquire) != 0
    }

    /// Bumps the eventcount and wakes the owner if it sleeps on it.
    pub(super) fn wake(&self) {
        let ev = self.a32(H_EVENTS);
        ev.fetch_add(1, Ordering::SeqCst);
        futex_wake(ev);
    }

    /// Wakes the owner if it has announced that it sleeps (after a fence that orders the
    /// caller's preceding publication before the read of the flag).
    pub(super) fn notify(&self) {
        fence(Ordering::SeqCst);
        self.wake_if_sleeping();
    }

    /// The second half of [`notify`](Self::notify), for a caller that has issued the fence
    /// itself (after a board posting, once for every peer).
    pub(super) fn wake_if_sleeping(&self) {
        if self.a32(H_SLEEPING).load(Ordering::Relaxed) != 0 {
            self.wake();
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` describe a mapping created by `map` and not unmapped before;
        // nothing borrowed from it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
