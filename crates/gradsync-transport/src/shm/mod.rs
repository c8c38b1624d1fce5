//! Shared-memory backend for the ranks of one host.
//!
//! Every rank creates one **control segment** (an anonymous `memfd`, sealed against shrinking and
//! growing) and publishes an [`ShmInfo`] (pid, descriptor, length, nonce) through the rendezvous
//! store. The other local ranks map it through `/proc/<pid>/fd/<fd>` with `MAP_SHARED`
//! ([`ShmSetup::connect`]). Bulk data never goes through the segments: a large write is copied
//! straight from the writer's buffers into the target's registered region, and only a small
//! notification record goes through shared memory. The copy is a plain `memcpy` when the region
//! lies in a **shared allocation** of its owner ([`alloc_shared`](crate::SharedMemory::alloc_shared): a
//! sealed `memfd` mapped `MAP_SHARED`, which the writer maps too, once, through
//! `/proc/<pid>/fd/<fd>`), and `process_vm_writev` (cross-memory attach, one copy, but pinning
//! every page) otherwise.
//!
//! # Segment layout
//!
//! ```text
//! offset 0        header (4 KiB): magic, version, pid, rank, world, number of local ranks,
//!                 directory capacity, ring size, nonce, the owner's mapping address, length;
//!                 `closed` flag (own cache line), eventcount futex word (own line),
//!                 `sleeping` flag (own line)
//! 4 KiB           region directory: DIR_CAP entries of 64 bytes
//!                 {seq, state, key, access, addr, len, alloc_fd, alloc_id, alloc_len,
//!                 alloc_off}, an open-addressing hash table by key published entry by entry
//!                 under a seqlock
//! 4 KiB + 256 KiB one ring per local sender, indexed by the sender's position in the sorted
//!                 list of local ranks: a 256-byte control block (producer `tail`, consumer
//!                 `head`, each on its own cache line; `want_space`, `attach`, `probe`) followed
//!                 by RING_BYTES of ring data
//! after the rings the board (see `board`): two slots of postings the other local ranks
//!                 read in place, and the rank's release mark
//! ```
//!
//! A directory entry whose span lies entirely inside one shared allocation of the owner names
//! that allocation: the owner's descriptor number, the allocation's id (also part of the
//! `memfd` name, so a writer can tell a reused descriptor number from the allocation), its
//! length and the offset of the region's start inside it. `alloc_id` 0 means none.
//!
//! The ring is a single-producer single-consumer byte ring of variable-length records, each
//! 8-byte aligned with a 32-byte header {len, kind, flags, imm, rkey, offset, data_len}
//! ([`wire::RecordHeader`]). A record
//! never wraps: when it does not fit before the end of the ring the producer writes a padding
//! record up to the end and starts again at offset 0. Positions are free-running 64-bit byte
//! counters; the producer publishes `tail` with release ordering after writing the record, the
//! consumer publishes `head` with release ordering after reading it. Record kinds:
//!
//! - **send**: a two-sided message of at most [`MAX_SEND`](crate::MAX_SEND) bytes, delivered as
//!   [`Completion::Recv`](crate::Completion::Recv);
//! - **inline write**: a write of at most [`INLINE_MAX`] bytes whose payload travels in the
//!   record; the receiver checks key and bounds against its own table during
//!   [`poll`](crate::Endpoint::poll), copies the payload into place and reports
//!   [`Completion::WriteImm`](crate::Completion::WriteImm) when the write carries an immediate. No system call is involved,
//!   on either side;
//! - **large write notification**: the data is already in place (copied into the writer's
//!   mapping of the shared allocation, or written with `process_vm_writev`, by
//!   [`post_write`](crate::Endpoint::post_write) itself); the record only carries the immediate, and
//!   keeps the per-pair order without one. It is published (release store of `tail`) after the
//!   copy, so the data is visible before the record.
//!
//! # Ordering and flow control
//!
//! Sends and writes from one rank to another share one ring, so they are delivered in posting
//! order. A sender never blocks on a full ring (two ranks writing to each other with full rings
//! would deadlock): the record goes to a local per-peer pending queue (an inline payload is
//! copied into it), and the queue is flushed ahead of any new record on every post, poll and
//! wait. The local [`Completion::WriteDone`](crate::Completion::WriteDone) / [`Completion::SendDone`](crate::Completion::SendDone) is queued at post time:
//! by then the payload has been copied into the ring, the pending queue or (for a large write)
//! the destination.
//!
//! # Waiting
//!
//! [`wait`](crate::Endpoint::wait) sets the `sleeping` flag of its own segment, reads the eventcount,
//! checks every ring once more and then sleeps in `FUTEX_WAIT` (a shared, not private, futex)
//! on the eventcount. A sender publishes `tail`, issues a sequentially consistent fence and
//! reads the receiver's `sleeping` flag; only when it is set does it bump the eventcount and
//! call `FUTEX_WAKE`. The two fences make it impossible for the waiter to miss the record and
//! the sender to miss the flag at the same time, so no wakeup is lost and the fast path has no
//! system call. A sender with a pending queue sets `want_space` on the ring; a consumer that
//! frees space and finds the flag set wakes the sender the same way.
//!
//! # Liveness
//!
//! A peer is gone once its segment's `closed` flag is set ([`close`](crate::Endpoint::close) or drop)
//! or its process no longer exists (`kill(pid, 0)` fails with `ESRCH`, or `/proc/<pid>/stat`
//! shows a zombie or a different start time). Polls look at the flags and use `kill` at most
//! every [`LIVENESS_EVERY`]; `/proc` is read only by [`wait`](crate::Endpoint::wait) and
//! [`peer_alive`](crate::Endpoint::peer_alive), also at most that often. Records a peer published
//! before it went away are still delivered. [`close`](crate::Endpoint::close) first hands over the
//! records still queued for live peers (waiting at most its timeout for ring space), then sets
//! the flag, wakes the peers and unmaps the segments.
//!
//! # Limitations
//!
//! - The writer checks a key against the target's directory and then writes (with `memcpy` or
//!   `process_vm_writev`); a region deregistered (and freed) by its owner in between could still
//!   receive the write. As with RDMA, a region must not be deregistered while a peer may still
//!   write into it.
//! - A writer keeps its mapping of a peer's shared allocation until that peer goes away or the
//!   writer's endpoint closes; the memory of the allocation lives that long even after its owner
//!   dropped its endpoint.
//! - The payload of an inline write is copied into place when the receiver polls, while a large
//!   write lands at post time. A large write into bytes that an earlier inline write from the
//!   same peer also covers must therefore not be posted before the receiver has seen the earlier
//!   write's notification (the engine never does: a slot is rewritten only after a credit came
//!   back for it).
//! - Cross-memory attach needs ptrace access to the peer (same user and, with Yama,
//!   `kernel.yama.ptrace_scope = 0` or `CAP_SYS_PTRACE`); [`ShmSetup::connect`] probes it and
//!   fails with an explanation otherwise, so the caller can fall back to the network.
//!
//! # Modules
//!
//! [`wire`] holds the formats a peer's bytes are parsed with; `layout` where everything lies
//! in a segment; `segment` the mapping itself; `directory` the region directory; `ring` the
//! record ring; `futex` the wait and wake; `liveness` the process checks; `cma` cross-memory
//! attach; `alloc` shared allocations; `peer` this rank's view of a peer; `conn` the mapped
//! segments of a connected endpoint and its blocking wait; `board` the board; `setup`
//! [`ShmSetup`]; `endpoint` [`ShmEndpoint`].

mod alloc;
mod board;
mod cma;
mod conn;
mod directory;
mod endpoint;
mod futex;
mod huge;
mod layout;
mod liveness;
mod peer;
mod ring;
mod segment;
mod setup;
mod stream;
#[cfg(test)]
mod tests;
pub mod wire;

pub use endpoint::ShmEndpoint;
pub use huge::{HUGE_MIN, HugeStats, huge_kib_at};
pub use layout::{DIR_CAP, MAX_LOCAL, RING_BYTES};
pub use liveness::LIVENESS_EVERY;
pub use setup::ShmSetup;
pub use wire::{BOARD_CAPACITY, INLINE_MAX, ShmInfo};
