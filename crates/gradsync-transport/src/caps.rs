//! What a transport can do, by peer: the route to it, whether writes may land in any region it
//! registered, whether it maps this rank's memory, and the optional capability objects of
//! shared memory (a [`Board`] and [`SharedMemory`] allocations).

use crate::error::Result;
use std::fmt;

/// The backend that carries the traffic to one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Route {
    /// This rank itself (no traffic).
    Own,
    /// The in-process reference transport.
    Mem,
    /// TCP sockets.
    Tcp,
    /// Shared memory of one host.
    Shm,
    /// RDMA verbs (InfiniBand, RoCE).
    Rdma,
}

impl Route {
    /// Every route, in code order.
    pub const ALL: [Route; 5] = [Route::Own, Route::Mem, Route::Tcp, Route::Shm, Route::Rdma];

    /// The name logs and tables use (`self`, `mem`, `tcp`, `shm`, `rdma`).
    pub const fn name(self) -> &'static str {
        match self {
            Route::Own => "self",
            Route::Mem => "mem",
            Route::Tcp => "tcp",
            Route::Shm => "shm",
            Route::Rdma => "rdma",
        }
    }

    /// A one-byte code, for exchanging routes between ranks.
    pub const fn code(self) -> u8 {
        match self {
            Route::Own => 0,
            Route::Mem => 1,
            Route::Tcp => 2,
            Route::Shm => 3,
            Route::Rdma => 4,
        }
    }

    /// The route of [`code`](Self::code) `c`.
    pub fn from_code(c: u8) -> Option<Route> {
        Route::ALL.get(c as usize).copied()
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an endpoint can do for the traffic to one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCaps {
    /// The backend that carries it.
    pub route: Route,
    /// One-sided writes may land in any region the peer registered, its callers' buffers
    /// included, so a receiver may ask for a message straight into place (a clear-to-send).
    /// False where only long-lived regions can take writes (RDMA pins only those).
    pub direct_writes: bool,
    /// The peer writes into this rank's memory through a mapping of it (shared memory): a
    /// write is the sender's copy, and memory from [`SharedMemory`] avoids a second one.
    pub mapped: bool,
    /// Messages in flight that suit the link, if fewer than an inbox holds (TCP: a short
    /// socket queue).
    pub window: Option<usize>,
    /// Whether the pair is connected now. Backends that connect lazily (TCP) connect a pair
    /// at its first [`Endpoint::connect`](crate::Endpoint::connect); messages to a peer not
    /// connected fail.
    pub connected: bool,
}

impl PeerCaps {
    /// The capabilities of a link that takes writes anywhere, not mapped, no window hint.
    pub const fn plain(route: Route) -> Self {
        PeerCaps {
            route,
            direct_writes: true,
            mapped: false,
            window: None,
            connected: true,
        }
    }
}

/// A *board*: a small buffer of this rank's, in memory every peer of the endpoint reads
/// directly (shared memory). A posting is one copy in and one copy out per reader, with no
/// record, completion or notification per peer. Postings carry increasing sequence numbers and
/// alternate between two slots, so a posting stays readable until every peer has released its
/// sequence number ([`release`](Self::release)).
pub trait Board: fmt::Debug {
    /// Bytes one [`post`](Self::post) can carry.
    fn capacity(&self) -> usize;

    /// Posts `data` under `seq` (greater than every earlier posting's) and wakes peers that
    /// sleep in the endpoint's wait. `Ok(false)`: the slot it would reuse still holds a posting
    /// some peer has not released; try again later.
    ///
    /// The first 64 bytes of `data` are its head: a caller that keeps them the same from one
    /// posting to the next (a header without the sequence number) lets the board leave them
    /// where they are, in the readers' caches (the shared-memory board keeps them on a cache
    /// line of their own).
    fn post(&mut self, seq: u64, data: &[u8]) -> Result<bool>;

    /// Copies `peer`'s posting under `seq` into `out` (replacing what it held); `Ok(false)`
    /// while the peer has not posted it. A peer that rewrites a posting before this rank
    /// released it, or while it is read, is a protocol error.
    fn read(&mut self, peer: usize, seq: u64, out: &mut Vec<u8>) -> Result<bool>;

    /// Tells the peers that this rank has read every posting it needs under `seq` and before:
    /// their slots may be reused.
    fn release(&mut self, seq: u64) -> Result<()>;

    /// The sequence number whose postings the endpoint's wait watches besides its completions:
    /// it returns once a peer has posted under `seq` what this rank has not read.
    fn watch(&mut self, seq: u64);
}

/// Memory that the peers on this host map directly.
pub trait SharedMemory: fmt::Debug {
    /// `len` bytes for a region the caller is about to register (the engine's inbox), valid
    /// until the endpoint is dropped; `None` when none can be made (the caller then allocates
    /// ordinary memory).
    fn alloc_shared(&mut self, len: usize) -> Option<*mut u8>;
}
