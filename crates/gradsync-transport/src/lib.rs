//! The verbs-shaped transport layer of gradsync.
//!
//! Every backend speaks the same small subset of RDMA verbs, so the engine above it is written
//! once:
//!
//! - **Memory regions.** [`Endpoint::register`] turns a span of memory into a
//!   [`MemoryRegion`] with a local key, a remote key and [`Access`] rights. Peers learn a
//!   region's [`RemoteRegion`] (remote key and length) out of band, through the rendezvous store.
//! - **One-sided writes with an immediate.** [`Endpoint::post_write`] copies a gather list of
//!   local spans into a peer's registered region at an offset. With an immediate value the peer
//!   gets a [`Completion::WriteImm`] once every byte has landed: the notification that the data
//!   is there. The receiver never posts anything for a write; it only checks the key and the
//!   bounds, and a bad key or an out-of-range write is an error naming the peer.
//! - **Two-sided sends.** [`Endpoint::post_send`] delivers a small message (at most
//!   [`MAX_SEND`] bytes) that arrives as [`Completion::Recv`]; the engine uses it for credits and
//!   aborts.
//! - **One completion queue.** [`Endpoint::poll`] makes progress on every connection without
//!   blocking and returns what completed: local writes and sends whose buffers may be reused,
//!   and remote writes and messages that arrived. [`Endpoint::wait`] blocks until there may be
//!   something to poll, with a deadline.
//!
//! An endpoint holds one connection (a queue-pair group, possibly several TCP streams) to every
//! peer. Backends: [`mem`] (in-process, for tests), [`tcp`] (sockets; a write is a framed
//! header followed by its payload, which the receiver reads straight into the destination region),
//! [`shm`] (ranks of one host: inline ring records, copies into mapped shared allocations, or
//! cross-memory attach), `rdma` (InfiniBand/RoCE verbs, feature `rdma`) and [`hybrid`] (shared memory to local peers, the network to the rest).

use std::fmt;
use std::time::Duration;

pub mod fault;
pub mod hybrid;
pub mod mem;
#[cfg(feature = "rdma")]
pub mod rdma;
mod regions;
pub mod shm;
pub mod tcp;

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

/// A peer's region, as advertised out of band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Start address in the owner's address space (what an RDMA write targets; backends that
    /// address regions by key and offset ignore it).
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteRegion {
    /// Encodes as 20 bytes (for the rendezvous store).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..4].copy_from_slice(&self.rkey.to_le_bytes());
        b[4..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..].copy_from_slice(&self.addr.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes); `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != 20 {
            return None;
        }
        Some(RemoteRegion {
            rkey: u32::from_le_bytes(b[..4].try_into().ok()?),
            len: u64::from_le_bytes(b[4..12].try_into().ok()?),
            addr: u64::from_le_bytes(b[12..].try_into().ok()?),
        })
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

/// Errors of the transport layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A peer wrote with a key we never handed out (or already deregistered).
    #[error(
        "rank {rank}: peer {peer} wrote with unknown remote key 0x{rkey:08x} ({len} bytes at offset {offset})"
    )]
    BadKey {
        /// This rank.
        rank: usize,
        /// The writer.
        peer: usize,
        /// The key it presented.
        rkey: u32,
        /// Offset it asked for.
        offset: u64,
        /// Bytes it wanted to write.
        len: u64,
    },
    /// A peer's write falls outside the region, or the region forbids remote writes.
    #[error(
        "rank {rank}: peer {peer} wrote {len} bytes at offset {offset} into region 0x{rkey:08x} of {region_len} bytes ({why})"
    )]
    OutOfBounds {
        /// This rank.
        rank: usize,
        /// The writer.
        peer: usize,
        /// The key it presented.
        rkey: u32,
        /// Offset it asked for.
        offset: u64,
        /// Bytes it wanted to write.
        len: u64,
        /// Length of the region.
        region_len: u64,
        /// Which check failed.
        why: &'static str,
    },
    /// A write this rank posted was refused on the writer's side by the target's region
    /// directory: unknown key, no remote-write right, or past the end of the region.
    #[error(
        "rank {rank}: write of {len} bytes at offset {offset} into rank {peer}'s region 0x{rkey:08x} ({region_len} bytes) rejected: {why}"
    )]
    RemoteAccess {
        /// This rank (the writer).
        rank: usize,
        /// The target of the write.
        peer: usize,
        /// The key presented.
        rkey: u32,
        /// Offset asked for.
        offset: u64,
        /// Bytes to write.
        len: u64,
        /// Length of the region (0 when the key is unknown).
        region_len: u64,
        /// Which check failed.
        why: &'static str,
    },
    /// A local call was invalid (bad peer, unregistered span, oversized send).
    #[error("rank {rank}: invalid {op}: {msg}")]
    Invalid {
        /// This rank.
        rank: usize,
        /// The call.
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
    /// The connection to a peer closed.
    #[error("rank {rank}: connection to rank {peer} closed ({during})")]
    PeerClosed {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What was going on.
        during: String,
    },
    /// A socket error.
    #[error("rank {rank}: {op} with rank {peer}: {source}")]
    Io {
        /// This rank.
        rank: usize,
        /// The peer (or `usize::MAX` for none).
        peer: usize,
        /// The operation.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A peer broke the framing protocol.
    #[error("rank {rank}: protocol error from rank {peer}: {msg}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What was wrong.
        msg: String,
    },
    /// An RDMA verb failed: device or queue pair setup, registration, a post, or a work
    /// completion with an error status (`peer` is `usize::MAX` when no peer is involved).
    #[error("rank {rank}: rdma {what}{}: {msg}", if *peer == usize::MAX { String::new() } else { format!(" with rank {peer}") })]
    Rdma {
        /// This rank.
        rank: usize,
        /// The peer, or `usize::MAX`.
        peer: usize,
        /// What failed (`device`, `register`, `queue pair INIT->RTR`, `completion`, ...).
        what: &'static str,
        /// The cause, with the values involved.
        msg: String,
    },
    /// Connection setup did not finish in time.
    #[error("rank {rank}: connecting timed out after {timeout:?}: {msg}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The deadline.
        timeout: Duration,
        /// Which peers were missing.
        msg: String,
    },
}

impl TransportError {
    /// The peer this error is about, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            TransportError::BadKey { peer, .. }
            | TransportError::OutOfBounds { peer, .. }
            | TransportError::PeerClosed { peer, .. }
            | TransportError::Protocol { peer, .. }
            | TransportError::RemoteAccess { peer, .. } => Some(*peer),
            TransportError::Io { peer, .. } | TransportError::Rdma { peer, .. }
                if *peer != usize::MAX =>
            {
                Some(*peer)
            }
            _ => None,
        }
    }
}

/// Result of transport calls.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;

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
