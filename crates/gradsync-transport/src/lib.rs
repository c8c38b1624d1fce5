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
//!
//! Every byte a peer sends or publishes is parsed through a checked view: the formats every
//! backend shares are in [`wire`], each backend's own in its `wire` module. A peer that breaks
//! a backend's protocol is a [`TransportError::Protocol`] naming what it did, a [`Violation`].

mod addrs;
mod caps;
mod error;
pub mod fault;
pub mod hybrid;
pub mod mem;
#[cfg(feature = "rdma")]
pub mod rdma;
mod regions;
pub mod shm;
pub mod tcp;
mod verbs;
pub mod wire;

pub use addrs::{AddressBook, AddressSource, rank_list};
pub use caps::{Board, PeerCaps, Route, SharedMemory};
pub use error::{Result, TransportError, Violation};
pub use verbs::{Access, Completion, Endpoint, MAX_SEND, MemoryRegion, Sge};
pub use wire::{REMOTE_REGION_LEN, RemoteRegion};
