//! The [`Communicator`] struct, its accessors, abort and drop.

use super::state::{Layout, Queued};
use crate::config::Config;
use crate::engine::{Engine, ReceivePool};
use crate::error::Error;
use crate::topology;
use gradsync_core::Collective;
use gradsync_core::schedule::plan::Algorithm;
use gradsync_store::{StoreClient, StoreServer};
use gradsync_transport::Route;
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;

/// A group of ranks that run collectives together.
///
/// Every rank calls the same collectives in the same order with matching arguments; each
/// message carries the call's signature, so a rank that does otherwise gets
/// [`Error::Mismatch`] naming both sides. Calls take `&mut self`: one operation runs at a time
/// per communicator.
#[derive(Debug)]
pub struct Communicator {
    pub(super) engine: Engine,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) seq: u64,
    pub(super) p2p_seq: Vec<u64>,
    pub(super) algorithm: Option<Algorithm>,
    /// Forced algorithms of the other collectives.
    pub(super) coll_algorithms: Vec<(Collective, Algorithm)>,
    pub(super) queue: VecDeque<Queued>,
    /// The store client, during init only: afterwards it is closed, so that the store's host
    /// (rank 0 unless the store is external) does not keep a connection per rank.
    pub(super) store: Option<StoreClient>,
    /// Built through a rendezvous store (which [`shrink`](Self::shrink) meets through again).
    pub(super) via_store: bool,
    /// What this rank's init exchanged with the store (none without one).
    pub(super) store_traffic: Option<gradsync_store::Traffic>,
    /// What this rank's address fetches after init's exchange sent and received.
    pub(super) fetch_traffic: Option<std::sync::Arc<super::addresses::FetchTraffic>>,
    pub(super) config: Option<Config>,
    pub(super) generation: u64,
    /// Communicators split from this one so far by this rank (part of their ids).
    pub(super) splits: u64,
    /// Built in process over given endpoints ([`Communicator::from_endpoints`]): its splits
    /// are in-memory groups.
    pub(super) in_process: bool,
    pub(super) closed: bool,
    pub(super) current: Option<(u64, Box<dyn Any + Send>)>,
    pub(super) finished: HashMap<u64, Box<dyn Any + Send>>,
    pub(super) next_work: u64,
    /// Where every rank is and how this rank reaches it.
    pub(super) layout: Layout,
    /// The store this rank's process hosts (rank 0 of the job), shared with the communicators
    /// shrunk from this one, so that it stays up while any of them may still meet through it.
    pub(super) _store: Option<std::sync::Arc<StoreServer>>,
    /// All-reduce size classes (log2 of the bytes) whose choice was logged at INFO.
    pub(super) explained: u64,
    /// The cost model of the automatic all-reduce choice.
    pub(super) costs: crate::cost::LinkCosts,
    /// Where the cost model came from (pinned, cached, measured, uncalibrated).
    pub(super) cost_from: String,
    /// The file the cost model was read from or saved to, if any.
    pub(super) cost_path: Option<std::path::PathBuf>,
    /// The model's all-reduce choice per size class ([`crate::cost::size_class`], the index),
    /// computed on first use; read without locking afterwards.
    pub(super) choices: Box<[std::sync::OnceLock<crate::cost::Choice>]>,
}

impl Communicator {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Name of the transport (`tcp`, `mem`).
    pub fn transport(&self) -> &'static str {
        self.engine.ep.name()
    }

    /// The transport that carries traffic between this rank and `peer` ([`Route::Own`] for
    /// this rank; its `name()` is `shm`, `tcp`, `rdma`, `mem` or `self`).
    ///
    /// # Panics
    ///
    /// If `peer` is not a rank of the communicator.
    pub fn peer_transport(&self, peer: usize) -> Route {
        self.layout.routes[peer]
    }

    /// The peers this rank is connected to now, ascending. Over TCP with
    /// `GRADSYNC_RUNTIME_CONNECT` on (the default) a pair connects when an operation first
    /// needs it; shared memory, RDMA and in-process peers are connected from init.
    pub fn connected_peers(&self) -> Vec<usize> {
        (0..self.world)
            .filter(|&p| p != self.rank && self.engine.ep.caps(p).connected)
            .collect()
    }

    /// Bytes of this rank's inbox, registered for every peer's messages, and of its shared
    /// receive pool if it has one (resident only where peers have written into them, except
    /// under RDMA, which pins the pool and the inbox areas of the peers that connected).
    pub fn receive_memory(&self) -> usize {
        self.engine.inbox_bytes()
    }

    /// The shared receive pool, where the pairs beyond `GRADSYNC_RECV_BUDGET` share one
    /// (see [`ReceivePool`](crate::ReceivePool)).
    pub fn receive_pool(&self) -> Option<ReceivePool> {
        Some(self.engine.pool_state()).filter(|p| p.slots > 0)
    }

    /// Bytes this rank sent to and received from the rendezvous store during init (`None` for
    /// a communicator built without one, as a split): a table of a few bytes per rank and
    /// the records of the ranks of its own host, so it grows slowly with the world.
    pub fn init_store_traffic(&self) -> Option<(u64, u64)> {
        self.store_traffic.map(|t| (t.sent, t.received))
    }

    /// Whether small all-reduces go eagerly through the transports' shared-memory boards
    /// (every rank on one host, `GRADSYNC_SHM_BOARD` on) rather than as messages.
    pub fn eager_board(&self) -> bool {
        self.engine.board()
    }

    /// Host index of `rank` (hosts numbered in order of their lowest rank).
    pub fn host_of(&self, rank: usize) -> usize {
        self.layout.host_of.get(rank).copied().unwrap_or(0)
    }

    /// Short name (hostname) of `rank`'s host, as its host identity gives it.
    pub fn host_name(&self, rank: usize) -> &str {
        self.layout
            .host_ids
            .get(rank)
            .map_or("", |s| topology::host_label(s))
    }

    /// Listening address of `rank`'s data connections, where this rank knows it: its own,
    /// every rank's in a split, and through the store those of the lower ranks it has dialed
    /// or read at init to dial (`None` for the others, and in process).
    pub fn peer_addr(&self, rank: usize) -> Option<SocketAddr> {
        self.layout.addrs.as_ref().and_then(|b| b.known(rank))
    }

    /// What this rank knows of the other ranks' records that init's tables leave out (see
    /// [`PeerRecords`]).
    pub fn peer_records(&self) -> PeerRecords {
        let load = |f: fn(&super::addresses::FetchTraffic) -> u64| {
            self.fetch_traffic.as_ref().map_or(0, |t| f(t))
        };
        PeerRecords {
            addresses: self.layout.addrs.as_ref().map_or(0, |b| b.known_count()),
            inboxes: self.engine.inboxes_known(),
            requests: load(|t| t.requests.load(std::sync::atomic::Ordering::Relaxed)),
            sent: load(|t| t.sent.load(std::sync::atomic::Ordering::Relaxed)),
            received: load(|t| t.received.load(std::sync::atomic::Ordering::Relaxed)),
        }
    }

    /// Network interface of this rank's data connections (empty in process).
    pub fn interface(&self) -> &str {
        &self.layout.ifname
    }

    /// How init placed this rank on the machine's NUMA nodes (`GRADSYNC_NUMA_BIND`).
    pub fn numa_placement(&self) -> &topology::Placement {
        &self.layout.placement
    }

    /// Ranks per host when every host holds one contiguous block of equally many ranks (what
    /// the hierarchical all-reduce needs), else 0.
    pub fn local_size(&self) -> usize {
        self.layout.local_size
    }

    /// Messages this rank has in flight at most to a rank of another host (the pair's window:
    /// over TCP `GRADSYNC_TCP_NSLOTS`, by default all `GRADSYNC_NSLOTS`), as the cost model
    /// counts them; 0 on a single host.
    pub fn inter_slots(&self) -> usize {
        let (local, world) = (self.layout.local_size, self.world);
        if local == 0 || local >= world {
            return 0;
        }
        let other = (self.rank / local * local + local) % world;
        self.engine.window(other)
    }

    /// Messages this rank has in flight at most to `peer` (the pair's window, its receive
    /// slots in use): over TCP `GRADSYNC_TCP_NSLOTS`, by default 3 on one host and all
    /// `GRADSYNC_NSLOTS` to another host.
    ///
    /// # Panics
    ///
    /// If `peer` is not a rank of the communicator.
    pub fn window(&self, peer: usize) -> usize {
        assert!(
            peer < self.world,
            "rank {peer} is not in a world of {}",
            self.world
        );
        self.engine.window(peer)
    }

    /// Steps of the pairwise all-to-all this rank keeps in flight for blocks of `block_bytes`
    /// bytes: where every peer is a TCP peer on this rank's host, as many blocks as fill one
    /// pair's [`window`](Self::window) of slots each way (at least one), else 8.
    pub fn all_to_all_window(&self, block_bytes: usize) -> usize {
        self.exchange_window(block_bytes)
    }

    /// Elements of `dtype` per pipeline segment (one message, `GRADSYNC_CHUNK_SIZE`).
    pub fn segment_elems(&self, dtype: gradsync_core::DataType) -> usize {
        self.engine.segment_elems(dtype)
    }

    /// Sets the deadline of the calls that follow (overrides `GRADSYNC_TIMEOUT` for them).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.engine.opts.timeout = timeout;
    }

    /// The deadline of each call.
    pub fn timeout(&self) -> Duration {
        self.engine.opts.timeout
    }

    /// The flight recorder's record of this communicator's last operations (see
    /// [`recorder`](crate::recorder)): what ran, with which algorithm, how it ended.
    pub fn flight_snapshot(&self) -> crate::recorder::Dump {
        self.engine.recorder.snapshot()
    }

    /// Aborts the communicator: every peer is told (so its pending and next calls fail at once
    /// naming this rank) and the connections are closed. Bounded in time (about a second), also
    /// when a peer is stopped or gone; buffers of an operation in flight are never touched
    /// again.
    pub fn abort(mut self, reason: &str) {
        let e = Error::Aborted {
            rank: self.rank,
            reason: reason.to_string(),
        };
        self.engine.fail(&e);
        self.queue.clear();
        self.current = None;
        self.engine.ep.close(Duration::from_millis(500));
        self.closed = true;
    }

    pub(super) fn invalid(&self, op: &'static str, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.rank,
            op,
            msg,
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.closed {
            self.engine.ep.close(Duration::from_secs(2));
        }
    }
}

/// What a rank knows of the other ranks' listening addresses and inbox descriptors
/// ([`Communicator::peer_records`]). Through the rendezvous store init gives a rank its own,
/// those of the few ranks it talks to first, and every rank's host; the others it reads from
/// the store when an operation first talks to their ranks, one request per operation. A
/// split knows every member's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRecords {
    /// Listening addresses known, this rank's own included (a rank dials only lower ranks).
    pub addresses: usize,
    /// Inbox descriptors known, this rank's own included.
    pub inboxes: usize,
    /// Requests made of the store after init's tables.
    pub requests: u64,
    /// Bytes those requests sent.
    pub sent: u64,
    /// Bytes they received.
    pub received: u64,
}
