//! The error of every transport call: [`TransportError`], and [`Violation`], what a peer did
//! that breaks a backend's protocol.

use crate::wire::WireError;
use std::net::SocketAddr;
use std::time::Duration;

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
    /// A peer broke a backend's protocol: malformed bytes, or shared state it must not be in.
    #[error("rank {rank}: protocol error from rank {peer}: {violation}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What the peer did wrong.
        violation: Violation,
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
    /// The listening address of a peer to dial could not be had.
    #[error("rank {rank}: no listening address of {peers}: {msg}")]
    Address {
        /// This rank.
        rank: usize,
        /// The peers, as `rank 3` or `ranks 3, 5`.
        peers: String,
        /// What failed.
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

/// What a peer did that breaks a backend's protocol ([`TransportError::Protocol`]).
///
/// Every variant carries the values involved. A peer that commits one is broken for good: the
/// backend stops reading from it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// tcp: a frame header that does not parse (reserved bytes set, unknown kind).
    #[error("{error} (frame header {header:02x?})")]
    FrameHeader {
        /// Why it does not parse.
        error: WireError,
        /// The header's bytes.
        header: [u8; 24],
    },
    /// tcp: a part of a striped write that does not fit the pair's streams or the parts
    /// before it.
    #[error("striped write: {why}")]
    Stripe {
        /// What does not fit.
        why: String,
    },
    /// tcp: a two-sided message longer than any sender may post.
    #[error("send of {len} bytes exceeds the {max}-byte limit")]
    OversizedSend {
        /// Its length.
        len: u32,
        /// The limit ([`MAX_SEND`](crate::MAX_SEND)).
        max: usize,
    },
    /// tcp: the mutual authentication of a stream this rank dialed failed: the peer sent no
    /// challenge, refused this rank's proof, or could not prove that it holds the token.
    #[error("authentication failed on the connection to {addr}: {why}")]
    Authentication {
        /// The peer's address.
        addr: SocketAddr,
        /// Which step failed, and how.
        why: String,
    },
    /// shm: the segment descriptor's length does not fit the number of local ranks.
    #[error("segment of {len} bytes where {nlocal} local ranks need {expected}")]
    SegmentLength {
        /// The length in the descriptor.
        len: u64,
        /// Local ranks.
        nlocal: usize,
        /// The length they need.
        expected: u64,
    },
    /// shm: the segment descriptor names no valid process id.
    #[error("invalid pid {pid}")]
    InvalidPid {
        /// The process id in the descriptor.
        pid: u32,
    },
    /// shm: the peer's segment file has another size than its descriptor says.
    #[error("{path} holds {size} bytes instead of {expected}")]
    SegmentSize {
        /// The file, under `/proc/<pid>/fd`.
        path: String,
        /// Its size.
        size: u64,
        /// The size expected.
        expected: u64,
    },
    /// shm: a file the peer shares (segment or shared allocation) can still shrink, so a
    /// mapping of it could fault.
    #[error("{path} is not sealed against shrinking")]
    NotSealed {
        /// The file, under `/proc/<pid>/fd`.
        path: String,
    },
    /// shm: the peer's segment does not start with the segment magic.
    #[error("{path}: bad magic 0x{found:016x}")]
    SegmentMagic {
        /// The file, under `/proc/<pid>/fd`.
        path: String,
        /// The magic number found.
        found: u64,
    },
    /// shm: a field of the peer's segment header differs from what this rank expects.
    #[error("{path}: segment {field} is {got}, expected {expected}")]
    SegmentField {
        /// The file, under `/proc/<pid>/fd`.
        path: String,
        /// The field (`version`, `pid`, `nonce`, `rank`, `world`, ...).
        field: &'static str,
        /// Its value.
        got: u64,
        /// The value expected.
        expected: u64,
    },
    /// shm: the peer's segment header gives an address where its probe word would overflow.
    #[error("segment address 0x{addr:x} overflows")]
    SegmentAddress {
        /// The address in the header.
        addr: u64,
    },
    /// shm: a cross-memory write into the peer's process did not show up in its segment as
    /// mapped here (the segment is not the process's own).
    #[error(
        "a cross-memory write to 0x{target:x} in pid {pid} did not show up in its mapped segment"
    )]
    ProbeLost {
        /// The address written.
        target: u64,
        /// The process written into.
        pid: u32,
    },
    /// shm: the peer attached to this rank's segment with another probe value than the nonce
    /// it published.
    #[error("attached with probe value 0x{seen:016x} instead of its nonce 0x{nonce:016x}")]
    ProbeValue {
        /// The value it wrote.
        seen: u64,
        /// Its published nonce.
        nonce: u64,
    },
    /// shm: an entry of the peer's region directory stayed in the middle of an update (its
    /// process gone or closed while writing it).
    #[error("region directory entry {slot} stayed in the middle of an update for {waited:?}")]
    DirectoryStuck {
        /// The directory slot.
        slot: usize,
        /// How long this rank waited.
        waited: Duration,
    },
    /// shm: a shared allocation of the peer changed its length between two writes.
    #[error("shared allocation {id:016x} changed its length from {was} to {now} bytes")]
    AllocationResized {
        /// The allocation's id.
        id: u64,
        /// The length mapped here.
        was: u64,
        /// The length the directory says now.
        now: u64,
    },
    /// shm: the descriptor a directory entry names is not the shared allocation it claims.
    #[error("{path} is {link:?}, not shared allocation {id:016x}")]
    NotTheAllocation {
        /// The file, under `/proc/<pid>/fd`.
        path: String,
        /// What that descriptor links to.
        link: String,
        /// The allocation's id.
        id: u64,
    },
    /// shm: a shared allocation's file has another size than its directory entry says.
    #[error("{path} holds {size} bytes where its directory entry says {expected}")]
    AllocationSize {
        /// The file, under `/proc/<pid>/fd`.
        path: String,
        /// Its size.
        size: u64,
        /// The size in the directory entry.
        expected: u64,
    },
    /// shm: a directory entry puts a region past the end of its shared allocation.
    #[error(
        "region 0x{rkey:08x} of {len} bytes at offset {offset} does not fit its shared allocation of {alloc_len} bytes"
    )]
    RegionOutsideAllocation {
        /// The region's key.
        rkey: u32,
        /// The region's length.
        len: u64,
        /// Its offset in the allocation.
        offset: u64,
        /// The allocation's length.
        alloc_len: u64,
    },
    /// shm: a directory entry puts a region where the write's target address wraps around.
    #[error("region 0x{rkey:08x} at 0x{addr:x} wraps around")]
    RegionWraps {
        /// The region's key.
        rkey: u32,
        /// Its start address.
        addr: u64,
    },
    /// shm: the consumer position of this rank's ring in the peer's segment moved backwards
    /// or past what this rank produced.
    #[error("ring head {head} outside the range [{min}, {max}] it can hold")]
    RingHead {
        /// The position found.
        head: u64,
        /// The last position read.
        min: u64,
        /// This rank's producer position.
        max: u64,
    },
    /// shm: the producer position of the peer's ring moved backwards or ahead by more than
    /// the ring holds.
    #[error("ring tail {tail} is inconsistent with head {head}")]
    RingTail {
        /// The position found.
        tail: u64,
        /// This rank's consumer position.
        head: u64,
    },
    /// shm: a ring record whose length is not a multiple of 8 of at least 8 bytes, or runs
    /// past the end of the ring or of what the peer published.
    #[error("record of {len} bytes at ring offset {at} ({avail} bytes published)")]
    RecordLength {
        /// The record length field.
        len: u32,
        /// Ring offset of the record.
        at: usize,
        /// Bytes published from there.
        avail: u64,
    },
    /// shm: a padding record that does not end the ring.
    #[error("padding of {len} bytes at ring offset {at} does not end the ring")]
    Padding {
        /// The record length field.
        len: u32,
        /// Ring offset of the record.
        at: usize,
    },
    /// shm: a ring record header that does not parse (unknown kind or flags, a payload that
    /// does not fit).
    #[error("{error} at ring offset {at}")]
    Record {
        /// Why it does not parse.
        error: WireError,
        /// Ring offset of the record.
        at: usize,
    },
    /// shm: a board slot header that does not parse (a posting longer than the board).
    #[error("bad board slot header for posting {seq}: {error}")]
    BoardSlot {
        /// The sequence number read.
        seq: u64,
        /// Why it does not parse.
        error: WireError,
    },
    /// shm: the peer rewrote a board posting while this rank read it, which it may only do
    /// once every peer released it.
    #[error("board posting {seq} was rewritten while this rank read it")]
    BoardRewritten {
        /// The sequence number read.
        seq: u64,
    },
}
