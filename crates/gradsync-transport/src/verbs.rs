//! The verbs-shaped interface every backend implements: memory regions and their [`Access`]
//! rights, gather lists, completions, and the [`Endpoint`] trait.

use crate::caps::{Board, PeerCaps, SharedMemory};
use crate::error::{Result, TransportError};
use crate::wire::RemoteRegion;
use std::fmt;
use std::time::Duration;

/// Largest payload of a two-sided [`Endpoint::post_send`].
pub const MAX_SEND: usize = 4096;

/// Access rights of a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Access(u8);

impl Access {
    /// The local side may read the region (source of writes and sends).
    pub const LOCAL_READ: Access = Access(1);
    /// Peers may write into the region.
    pub const REMOTE_WRITE: Access = Access(2);
    /// The registrant owns the memory until it deregisters it, and no allocator reuses it in
    /// between (the engine's inbox, staging and scratch pool). Backends that pin memory for an
    /// adapter (rdma) pin only such regions and stage data from any other.
    pub const PERSISTENT: Access = Access(4);
    /// A hint: the registrant streams the region through, reading each byte once per
    /// operation, and the copies a peer makes of what it sends are not read back at once
    /// from a cache. A transport that copies from the region into a peer's memory may then
    /// bypass the caches (shared memory does for large spans, see its module docs); the
    /// others ignore it.
    pub const STREAMED: Access = Access(8);
    /// A hint about a region peers write into: it is `world` equal areas in rank order, and
    /// only rank `p` writes area `p` (the engine's inbox). A backend that pins memory for an
    /// adapter and connects pairs on first use (rdma) may then pin each area when its rank
    /// connects rather than the whole region at once; the others ignore it.
    pub const PEER_AREAS: Access = Access(16);

    /// Union of two sets of rights.
    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }

    /// Whether every right in `other` is in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

/// A registered span of local memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Key for local use (gather lists).
    pub lkey: u32,
    /// Key a peer presents to write into the region.
    pub rkey: u32,
    /// Rights.
    pub access: Access,
}

impl MemoryRegion {
    /// What a peer needs to write into this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr as u64,
            rkey: self.rkey,
            len: self.len as u64,
        }
    }
}

/// One entry of a gather list: `len` bytes at `addr`, inside a region registered with `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Local key of the region holding the span.
    pub lkey: u32,
}

/// What a poll of the completion queue returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A posted write has left the local buffers; they may be reused.
    WriteDone {
        /// The id given at post time.
        wr_id: u64,
    },
    /// A posted send has left; its id.
    SendDone {
        /// The id given at post time.
        wr_id: u64,
    },
    /// A peer's write with immediate has landed in one of our regions.
    WriteImm {
        /// Writer rank.
        peer: usize,
        /// The immediate value.
        imm: u32,
        /// Bytes written.
        len: u32,
    },
    /// A two-sided message from a peer.
    Recv {
        /// Sender rank.
        peer: usize,
        /// The message.
        data: Vec<u8>,
    },
}

/// Refuses a two-sided message longer than [`MAX_SEND`] (every backend's `post_send`).
pub(crate) fn check_send_len(rank: usize, len: usize) -> Result<()> {
    if len > MAX_SEND {
        return Err(TransportError::Invalid {
            rank,
            op: "post_send",
            msg: format!("{len} bytes exceed the {MAX_SEND}-byte limit"),
        });
    }
    Ok(())
}

/// A rank's connections to all its peers and its completion queue.
pub trait Endpoint: Send + fmt::Debug {
    /// This rank.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world(&self) -> usize;

    /// Short backend name for logs (`tcp`, `mem`).
    fn name(&self) -> &'static str;

    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    ///
    /// The memory must stay valid (and, with [`Access::REMOTE_WRITE`], writable and not
    /// otherwise accessed while a peer's write into it may land) until the region is
    /// deregistered.
    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion>;

    /// Deregisters a region; later writes with its key fail.
    fn deregister(&mut self, mr: &MemoryRegion);

    /// Writes the gather list into `peer`'s region at `offset`; with `imm`, the peer is notified.
    ///
    /// # Safety
    ///
    /// Every span of `sges` must stay valid and unmodified until this write's
    /// [`Completion::WriteDone`] has been returned by [`poll`](Self::poll).
    unsafe fn post_write(
        &mut self,
        peer: usize,
        sges: &[Sge],
        remote: RemoteRegion,
        offset: u64,
        imm: Option<u32>,
        wr_id: u64,
    ) -> Result<()>;

    /// Sends a small two-sided message (copied at post time).
    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()>;

    /// Whether the connection to `peer` is still up (no end of stream or error seen); true for
    /// a peer not connected yet (nothing is known against it).
    fn peer_alive(&self, peer: usize) -> bool;

    /// Connects to every rank of `peers` that this endpoint is not connected to yet (see
    /// [`PeerCaps::connected`](crate::PeerCaps::connected)), within `timeout`. Both ranks of a
    /// pair call it for each other before their first message (the engine does, for the peers
    /// of each operation's program); backends whose peers are connected from the start return
    /// at once.
    fn connect(&mut self, peers: &[usize], timeout: Duration) -> Result<()>;

    /// Makes progress without blocking; appends completions to `out`.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()>;

    /// Blocks until [`poll`](Self::poll) may return something, or `timeout` passes.
    fn wait(&mut self, timeout: Duration) -> Result<()>;

    /// As [`wait`](Self::wait), for a caller whose progress now depends on `peers` only
    /// (receives from them, credits or clear-to-sends they owe): an endpoint of several
    /// backends may then sleep in the one that serves them. What arrives from other peers
    /// meanwhile is kept for the next [`poll`](Self::poll), as always.
    fn wait_on(&mut self, peers: &[usize], timeout: Duration) -> Result<()> {
        let _ = peers;
        self.wait(timeout)
    }

    /// Whether writes or sends posted to this endpoint still wait to be handed on (queued
    /// bytes that only [`poll`](Self::poll) moves, so a caller must not sleep elsewhere for
    /// long). `true` unless the endpoint knows better.
    fn tx_pending(&self) -> bool {
        true
    }

    /// Closes every connection gracefully, waiting at most `timeout` for peers to close theirs.
    fn close(&mut self, timeout: Duration) {
        let _ = timeout;
    }

    /// What this endpoint can do for the traffic to `peer` (for this rank itself: the route
    /// [`Route::Own`](crate::Route::Own)).
    fn caps(&self, peer: usize) -> PeerCaps;

    /// This rank's board, where the endpoint has one for every peer (all on one host's shared
    /// memory). Every backend and wrapper answers for itself (there is no default, so a
    /// wrapper cannot hide its inner endpoint's board by forgetting it): a wrapper offers its
    /// inner endpoint's board, or its own around it.
    fn board(&mut self) -> Option<&mut dyn Board>;

    /// Allocation of memory the peers map, where the endpoint has it (no default, as for
    /// [`board`](Self::board)).
    fn shared_memory(&mut self) -> Option<&mut dyn SharedMemory>;

    /// A hint about the region registered with [`Access::PEER_AREAS`]: `peers` never write
    /// their areas (their messages go elsewhere), so a backend that pins each area when its
    /// rank connects leaves theirs unpinned. Called before those pairs connect; a wrapper
    /// passes it on.
    fn unused_peer_areas(&mut self, peers: &[usize]) {
        let _ = peers;
    }
}
