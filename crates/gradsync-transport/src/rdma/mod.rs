//! RDMA backend: InfiniBand or RoCE verbs through libibverbs (feature `rdma`).
//!
//! # Connection
//!
//! [`RdmaSetup::open`] opens the device (`GRADSYNC_IB_HCA`, else the first port that is
//! active), creates one protection domain, one completion queue with its completion channel and
//! the staging ring. On RoCE the GID index is `GRADSYNC_IB_GID_INDEX`, or the first RoCE v2
//! GID that maps an IPv4 address. A pair's [`RdmaOptions::qps_per_peer`] reliable-connected
//! queue pairs, with their receive buffers (registered, posted), are then made in one of two
//! ways, and the completion queue grows to hold the completions of every pair's queue pairs
//! (`pair`):
//!
//! - **On first use** ([`RdmaSetup::first_use`]): none at setup. When
//!   [`Endpoint::connect`](crate::Endpoint::connect) first names a peer, the higher rank of the
//!   pair dials the lower one's listener (hello and token handshake as TCP's), the two make
//!   their queue pairs and swap their numbers and first packet sequence numbers over that
//!   connection, and each moves its queue pairs INIT -> RTR -> RTS (see `lazy`). A rank thus
//!   has queue pairs, and pins receive buffers, only for the peers its operations talk to.
//! - **At setup** ([`RdmaSetup::new`]): to every peer. Its [`RdmaSetup::info`] is what peers
//!   need: GID, LID, path MTU and, for every peer, the queue pair numbers and first packet
//!   sequence numbers meant for it. Ranks exchange these through the rendezvous store, then
//!   [`RdmaSetup::connect`] moves every queue pair INIT -> RTR -> RTS.
//!
//! # Data path
//!
//! - [`Endpoint::post_write`](crate::Endpoint::post_write) becomes an RDMA WRITE (with an immediate: RDMA WRITE WITH IMM) of
//!   the gather list into the peer's registered region at `addr + offset`, the peer's adapter
//!   checking key and bounds. A write with an immediate consumes one of the peer's posted
//!   receives and completes there as [`Completion::WriteImm`](crate::Completion::WriteImm), the notification that every byte
//!   landed. Writes and sends go round-robin over the queue pairs of a peer.
//! - [`Endpoint::post_send`](crate::Endpoint::post_send) is a SEND into one of the peer's posted receive buffers.
//! - The engine above advertises free slots of its inbox to each sender (credits, the
//!   receiver's clear-to-send), so a write always has a place to land.
//! - Receive buffers are reposted as soon as their completion is polled; a sender that finds
//!   none waits in the adapter's receiver-not-ready retries, which are unlimited.
//!
//! # Memory registration
//!
//! Registrations with [`Access::PERSISTENT`](crate::Access::PERSISTENT) (the engine's inbox, header staging and scratch
//! pool: memory it owns for the communicator's life) are registered with the adapter and kept
//! in a pool: a registration inside a span already registered with at least the same rights
//! shares it (reference counted), and the bytes pinned are bounded by
//! [`RdmaOptions::reg_max_bytes`]. Any other region (a caller's buffer) is only recorded: its
//! data is copied into a registered staging ring when a write from it is posted. Pinning a
//! caller's buffer across operations would be wrong without hooks on the allocator: a buffer
//! freed and allocated again at the same address is new memory, and a registration made
//! before would still point the adapter at the old pages. A registration the kernel refuses
//! for `RLIMIT_MEMLOCK` gives an error that says so and how to raise the limit.
//!
//! # Errors
//!
//! A failed work completion names the peer and what the status means: a remote access error
//! is a key or bounds mismatch, retries exceeded means the peer or the link is unreachable,
//! receiver-not-ready retries exceeded means the peer stopped posting receives. A queue pair
//! transition that fails names the transition and every attribute it set.
//!
//! # Modules
//!
//! [`wire`] holds the connection descriptor; `device` ports, devices and buffers; `options`
//! [`RdmaOptions`]; `setup` [`RdmaSetup`]; `pair` the queue pairs of one pair of ranks; `lazy`
//! (the state) and `first_use` (the connect, dial and accept) connections on first use;
//! `endpoint` the state of an [`RdmaEndpoint`]; `staging` the staging ring; `post` the posting
//! path; `completion` the completion queue; `verbs` the [`Endpoint`](crate::Endpoint) calls.

mod completion;
mod device;
mod endpoint;
mod ffi;
mod first_use;
mod lazy;
mod options;
mod pair;
mod post;
mod setup;
mod staging;
#[cfg(test)]
mod tests;
mod verbs;
pub mod wire;

pub use device::{GidEntry, PortInfo, active_port_present, list_ports, parse_hca, pick_gid};
pub use endpoint::RdmaEndpoint;
pub use lazy::FirstUse;
pub use options::{
    DEFAULT_IB_TIMEOUT, DEFAULT_QPS_PER_PEER, DEFAULT_REG_MAX, DEFAULT_RETRY_CNT, DEFAULT_STAGING,
    RdmaOptions,
};
pub use setup::RdmaSetup;
