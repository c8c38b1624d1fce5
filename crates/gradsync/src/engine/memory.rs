//! The engine's memory: aligned buffers, raw views of caller buffers, and the registration
//! cache of caller buffers.

use gradsync_core::DataType;
use gradsync_core::schedule::{Buf, Loc};
use gradsync_transport::{Access, MemoryRegion};
use std::alloc::Layout;

/// A 64-byte aligned, zeroed buffer. From [`MAP_MIN`] bytes on it is an anonymous mapping of
/// its own: the kernel's zero pages, made resident only where they are first written. An
/// inbox sized for every peer then costs memory only for the slots that peers write into.
/// (The allocator's aligned `alloc_zeroed` writes every byte: all of it resident at once.)
#[derive(Debug)]
pub(crate) struct AlignedBuf {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    /// Who frees the memory.
    owner: Owner,
}

/// How an [`AlignedBuf`]'s memory was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// The global allocator, with the layout of `len` (at least 64 bytes, 64-aligned).
    Heap,
    /// `mmap`, `len` rounded up to pages.
    Mapped,
    /// A transport lent it and frees it.
    Lent,
}

/// Buffers of at least this many bytes are mapped rather than allocated.
pub(crate) const MAP_MIN: usize = 256 << 10;

// SAFETY: AlignedBuf exclusively owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> Self {
        if len >= MAP_MIN {
            // SAFETY: an anonymous private mapping of `len` bytes at an address of the kernel's
            // choice; no file, no fixed address.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                return AlignedBuf {
                    ptr: p.cast(),
                    len,
                    owner: Owner::Mapped,
                };
            }
            // Out of mappings: the allocator reports its own failure below.
        }
        let layout = Layout::from_size_align(len.max(64), 64).expect("layout");
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf {
            ptr,
            len,
            owner: Owner::Heap,
        }
    }

    /// Memory the transport allocated (its shared-memory capability); it stays valid as long
    /// as the transport, which frees it.
    pub(super) fn lent(ptr: *mut u8, len: usize) -> Self {
        AlignedBuf {
            ptr,
            len,
            owner: Owner::Lent,
        }
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr as usize
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.owner {
            Owner::Lent => {}
            Owner::Mapped => {
                // SAFETY: mapped in `zeroed` with this length; nothing refers to it any more.
                unsafe { libc::munmap(self.ptr.cast(), self.len) };
            }
            Owner::Heap => {
                let layout = Layout::from_size_align(self.len.max(64), 64).expect("layout");
                // SAFETY: allocated in `zeroed` with this layout.
                unsafe { std::alloc::dealloc(self.ptr, layout) };
            }
        }
    }
}

/// Raw view of a caller buffer for the duration of one operation.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RawBuf {
    pub addr: usize,
    pub len: usize,
}

impl RawBuf {
    /// Whether two views share a byte.
    pub(super) fn overlaps(self, b: RawBuf) -> bool {
        self.addr < b.addr + b.len && b.addr < self.addr + self.len
    }
}

pub(super) fn buf_index(b: Buf) -> usize {
    match b {
        Buf::Input => 0,
        Buf::Output => 1,
        Buf::Scratch => 2,
    }
}

/// The bytes of `len` elements at `loc`.
pub(super) fn slice(bufs: &[RawBuf; 3], loc: Loc, len: usize, dt: DataType) -> RawBuf {
    let b = bufs[buf_index(loc.buf)];
    RawBuf {
        addr: b.addr + loc.start * dt.size(),
        len: len * dt.size(),
    }
}

/// Caller input buffers are registered once and reused while the same span comes back (a
/// training loop passes the same gradient buffers every step): a bounded cache of
/// `(address, length, access)` -> region, least recently used out first. It holds only
/// registrations without remote access; an output buffer is registered for its operation only.
#[derive(Debug, Default)]
pub(super) struct RegCache {
    pub(super) entries: Vec<(MemoryRegion, u64)>,
    tick: u64,
}

/// Registrations the cache keeps.
const REG_CACHE_ENTRIES: usize = 16;

impl RegCache {
    /// The cached region for exactly this span and access, marked used.
    pub(super) fn lookup(
        &mut self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Option<MemoryRegion> {
        self.tick += 1;
        let tick = self.tick;
        self.entries
            .iter_mut()
            .find(|(mr, _)| mr.addr == addr && mr.len == len && mr.access == access)
            .map(|(mr, used)| {
                *used = tick;
                *mr
            })
    }

    /// Adds a region; returns the one evicted to make room, to be deregistered.
    pub(super) fn insert(&mut self, mr: MemoryRegion) -> Option<MemoryRegion> {
        self.tick += 1;
        let evicted = if self.entries.len() >= REG_CACHE_ENTRIES {
            let (i, _) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, used))| *used)
                .expect("non-empty");
            Some(self.entries.swap_remove(i).0)
        } else {
            None
        };
        self.entries.push((mr, self.tick));
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident pages of `len` bytes at `p` (`mincore`).
    fn resident(p: *mut u8, len: usize) -> usize {
        let page = 4096;
        let mut v = vec![0u8; len.div_ceil(page)];
        // SAFETY: `p` is a page-aligned mapping of `len` bytes; `v` has one byte per page.
        let r = unsafe { libc::mincore(p.cast(), len, v.as_mut_ptr()) };
        assert_eq!(r, 0);
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn large_buffers_are_zeroed_aligned_and_resident_only_where_written() {
        let len = 8 << 20;
        let b = AlignedBuf::zeroed(len);
        assert_eq!(b.owner, Owner::Mapped);
        assert_eq!(b.addr() % 64, 0);
        assert_eq!(resident(b.ptr, len), 0, "nothing written yet");
        // SAFETY: within the buffer.
        let s = unsafe { std::slice::from_raw_parts_mut(b.ptr, len) };
        s[0] = 1;
        s[len - 1] = 2;
        let pages = resident(b.ptr, len);
        assert!(
            (2..=16).contains(&pages),
            "{pages} pages resident after two writes"
        );
        assert!(s[1..len - 1].iter().all(|&x| x == 0));
        let small = AlignedBuf::zeroed(100);
        assert_eq!(small.owner, Owner::Heap);
        assert_eq!(small.addr() % 64, 0);
    }
}
