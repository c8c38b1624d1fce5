//! The verbs-shaped interface every backend implements: memory regions and their [`Access`]
//! rights, gather lists, completions, and the [`Endpoint`] trait.

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

    /// Whether the connection to `peer` is still up (no end of stream or error seen).
    fn peer_alive(&self, peer: usize) -> bool;

    /// Makes progress without blocking; appends completions to `out`.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()>;

    /// Blocks until [`poll`](Self::poll) may return something, or `timeout` passes.
    fn wait(&mut self, timeout: Duration) -> Result<()>;

    /// Memory of `len` bytes that peers on this host can map directly, for a region the caller is
    /// about to register (the engine's inbox); `None` where the backend has none (the caller then
    /// allocates ordinary memory). It stays valid until the endpoint is dropped.
    fn alloc_shared(&mut self, len: usize) -> Option<*mut u8> {
        let _ = len;
        None
    }

    /// Closes every connection gracefully, waiting at most `timeout` for peers to close theirs.
    fn close(&mut self, timeout: Duration) {
        let _ = timeout;
    }

    /// Bytes one [`board_post`](Self::board_post) can carry; 0 (the default) where the backend
    /// has no *board*.
    ///
    /// A board is a small buffer of this rank's, in memory every peer of the endpoint reads
    /// directly (shared memory): a posting is one copy in and one copy out per reader, with no
    /// record, completion or notification per peer. Postings carry increasing sequence numbers
    /// and alternate between two slots, so a posting stays readable until every peer has
    /// released its sequence number ([`board_release`](Self::board_release)).
    fn board_capacity(&self) -> usize {
        0
    }

    /// Posts `data` on this rank's board under `seq` (greater than every earlier posting's)
    /// and wakes peers that sleep in [`wait`](Self::wait). `Ok(false)`: the slot it would
    /// reuse still holds a posting some peer has not released; try again later.
    fn board_post(&mut self, seq: u64, data: &[u8]) -> Result<bool> {
        let _ = (seq, data);
        Err(no_board(self.rank(), "board_post"))
    }

    /// Copies `peer`'s posting under `seq` into `out` (replacing what it held); `Ok(false)`
    /// while the peer has not posted it. A peer that rewrites a posting before this rank
    /// released it, or while it is read, is a protocol error.
    fn board_read(&mut self, peer: usize, seq: u64, out: &mut Vec<u8>) -> Result<bool> {
        let _ = (peer, seq, out);
        Err(no_board(self.rank(), "board_read"))
    }

    /// Tells the peers that this rank has read every posting it needs under `seq` and
    /// before: their slots may be reused.
    fn board_release(&mut self, seq: u64) -> Result<()> {
        let _ = seq;
        Err(no_board(self.rank(), "board_release"))
    }

    /// The sequence number whose postings [`wait`](Self::wait) watches besides its
    /// completions: it returns once a peer has posted under `seq` what this rank has not read.
    fn board_watch(&mut self, seq: u64) {
        let _ = seq;
    }
}

/// The error of a board call on a backend without one.
fn no_board(rank: usize, op: &'static str) -> TransportError {
    TransportError::Invalid {
        rank,
        op,
        msg: "this transport has no board (board_capacity is 0)".into(),
    }
}
