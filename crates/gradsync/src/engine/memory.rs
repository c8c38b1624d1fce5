//! The engine's memory: aligned buffers, raw views of caller buffers, and the registration
//! cache of caller buffers.

use gradsync_core::DataType;
use gradsync_core::schedule::{Buf, Loc};
use gradsync_transport::{Access, MemoryRegion};
use std::alloc::Layout;

/// A 64-byte aligned heap buffer.
#[derive(Debug)]
pub(crate) struct AlignedBuf {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    /// Whether this buffer owns its allocation (false: memory a transport lent, freed by it).
    owned: bool,
}

// SAFETY: AlignedBuf exclusively owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(64), 64).expect("layout");
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf {
            ptr,
            len,
            owned: true,
        }
    }

    /// Memory the transport allocated (its shared-memory capability); it stays valid as long
    /// as the transport, which frees it.
    pub(super) fn lent(ptr: *mut u8, len: usize) -> Self {
        AlignedBuf {
            ptr,
            len,
            owned: false,
        }
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr as usize
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let layout = Layout::from_size_align(self.len.max(64), 64).expect("layout");
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
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
