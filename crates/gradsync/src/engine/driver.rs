//! The engine: its state, the start of an operation, and the loop that drives it (spin, then
//! sleep in the transport, with a deadline).

use crate::config::{BOARD_EAGER_DEFAULT, BOARD_EAGER_MAX};
use crate::error::Error;
use crate::recorder::{FlightRecorder, OpState};
use gradsync_core::proto::{self, Mode, Protocol};
use gradsync_core::schedule::{Algorithm, Loc, Op, Params, PlanError, Program, Schedule, plan};
use gradsync_core::wire::{DATA_HEADER_LEN, Signature};
use gradsync_core::{Collective, DataType};
use gradsync_transport::{Access, Completion, Endpoint, MemoryRegion, RemoteRegion};
use std::time::{Duration, Instant};

use super::memory::{AlignedBuf, RawBuf, RegCache, buf_index};

/// Bytes of an eager message before its payload: a data header.
pub(super) const EAGER_HDR: usize = DATA_HEADER_LEN;
/// Largest buffer an eager all-reduce carries in one two-sided message.
pub(crate) const EAGER_MAX: usize = gradsync_transport::MAX_SEND - EAGER_HDR;
pub(crate) use crate::cost::EAGER_WORLD_MAX;

/// Tunables of the engine.
#[derive(Clone, Debug)]
pub(crate) struct EngineOptions {
    /// Payload bytes per slot (message size).
    pub slot_bytes: usize,
    /// Slots per peer.
    pub nslots: usize,
    /// Deadline of every collective.
    pub timeout: Duration,
    /// Spin this long before sleeping.
    pub spin: Duration,
    /// Of that, poll this long without yielding the core first: worth it only when every
    /// local rank has a core of its own (shared-memory latency), zero otherwise.
    pub busy_spin: Duration,
    /// Copy-receives of at least this many bytes ask the sender to write straight into the
    /// destination (clear-to-send) instead of going through an inbox slot.
    pub direct_min: usize,
    /// Send a CRC32C of every payload in its header and verify it on arrival
    /// (`GRADSYNC_CHECKSUM`). Direct writes carry no header, so the direct path is off with it.
    pub checksum: bool,
    /// All-reduces of at most this many bytes run eagerly (`GRADSYNC_EAGER_MAX`, 0: never),
    /// at most [`BOARD_EAGER_MAX`]; `usize::MAX` when unset (each path's default).
    pub eager_max: usize,
    /// Floating-point all-reduces reduce every element in rank order, whatever the algorithm,
    /// chunking or size (`GRADSYNC_DETERMINISTIC`).
    pub deterministic: bool,
}

/// A rank's shared receive pool
/// ([`Communicator::receive_pool`](crate::Communicator::receive_pool)): where `world` inboxes of
/// `GRADSYNC_NSLOTS` slots would exceed `GRADSYNC_RECV_BUDGET`, only the peers at a
/// power-of-two distance round the ring or in the bits of the rank keep inbox slots, and the
/// messages of the others go straight into place or through slots of this pool, granted one
/// message at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReceivePool {
    /// Slots of the pool (each `GRADSYNC_CHUNK_SIZE` and a header).
    pub slots: usize,
    /// Slots free now.
    pub free: usize,
    /// Peers without inbox slots, whose messages use the pool or land in place.
    pub pooled_peers: usize,
    /// Messages staged in the pool so far.
    pub staged: u64,
}

/// A schedule ready to start, with the parameters it was planned from (for reuse).
#[derive(Debug)]
pub(crate) struct Planned {
    pub(crate) sched: Box<Schedule>,
    pub(crate) params: Option<Params>,
    /// The buffer lengths its ops were last checked against (a kept schedule, which `start`
    /// restarts before it runs it).
    pub(crate) checked: Option<[usize; 3]>,
}

/// Schedules kept for reuse: a training loop calls the same collectives with the same sizes
/// every step, and a restarted schedule costs no generation and no allocation.
const SCHEDULE_CACHE: usize = 8;

/// The engine's scratch buffer starts at this size.
const SCRATCH_POOL: usize = 256 * 1024;

/// Operations needing at most this much scratch use the engine's scratch buffer, which grows
/// to the largest such need (a deterministic all-reduce needs `2 * world` slots' worth); larger
/// scratch is allocated for the operation.
const SCRATCH_KEEP: usize = 16 << 20;

/// Operations of at least this many bytes copy what they receive into the caller's buffer
/// with non-temporal stores (see [`gradsync_reduce::copy_streaming`]): such a buffer does not
/// stay in the caches, and skipping the read of each destination line before it is written
/// saves a third of the memory traffic of the copy.
pub(super) const STREAMING_OP_MIN: usize = 8 << 20;

/// The driver's side of the operation in flight: where its buffers are.
#[derive(Debug)]
pub(super) struct Running {
    pub(super) sig: Signature,
    pub(super) params: Option<Params>,
    pub(super) bufs: [RawBuf; 3],
    pub(super) lkeys: [u32; 3],
    /// Registrations made for this operation only (fresh scratch).
    pub(super) mrs: Vec<MemoryRegion>,
    pub(super) _scratch: Option<AlignedBuf>,
    /// Handle of this operation in the flight recorder.
    pub(super) record: usize,
    /// When it started (its deadline counts from here).
    pub(super) started: Instant,
    /// Receives copy into place with non-temporal stores.
    pub(super) streaming: bool,
}

/// The engine of one communicator.
#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) ep: Box<dyn Endpoint>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) comm_id: u64,
    pub(crate) opts: EngineOptions,
    pub(super) proto: Protocol,
    pub(super) inbox: AlignedBuf,
    pub(super) inbox_mr: MemoryRegion,
    pub(super) hdrs: AlignedBuf,
    pub(super) hdr_mr: MemoryRegion,
    pub(super) remote_inboxes: Vec<RemoteRegion>,
    /// Whether `remote_inboxes[p]` is rank p's descriptor (this rank's own counts as known).
    pub(super) inbox_known: Vec<bool>,
    /// Where the descriptors not known yet come from, when an operation first talks to their
    /// ranks.
    pub(super) inbox_source: Option<Box<dyn InboxSource>>,
    pub(super) comps: Vec<Completion>,
    pub(super) running: Option<Running>,
    pub(super) poisoned: Option<String>,
    /// The largest eager all-reduce the agreed boards hold (0: no board).
    pub(super) board_eager: usize,
    /// The last operations, for post-mortems.
    pub(crate) recorder: FlightRecorder,
    /// Registrations of caller buffers kept from one operation to the next.
    pub(super) regs: RegCache,
    /// Scratch space of small operations and its registration.
    pub(super) scratch_pool: Option<(AlignedBuf, MemoryRegion)>,
    /// The shared pool of receive slots of the pooled peers, if any (see
    /// [`enable_pool`](Self::enable_pool)).
    pub(super) recv_pool: Option<(AlignedBuf, MemoryRegion)>,
    /// The communicator pools the pairs beyond the receive budget (this rank may have none).
    pub(crate) pool_on: bool,
    /// Finished schedules by the parameters they were planned from, most recent last.
    pub(super) sched_cache: Vec<(Params, Box<Schedule>, [usize; 3])>,
    /// Where an outgoing eager message is built (kept for its allocation).
    pub(super) msg: Vec<u8>,
    /// The machine's actions being carried out (kept for its allocation).
    pub(super) batch: Vec<proto::Action>,
    /// The engine's last clock reading (operation start, idle rounds): when peers were last
    /// heard from, without a clock read per message.
    pub(super) now_coarse: Instant,
    /// Whether some peer may not be connected yet (the transport connects on first use): an
    /// operation then connects the peers of its program before it starts.
    pub(super) partly_connected: bool,
    /// Whether the inbox descriptor of some rank is not known yet (read from the store when an
    /// operation first talks to it). Apart from `partly_connected`: the board, which the fast
    /// path posts to, needs every connection but no inbox descriptor.
    pub(super) inboxes_partial: bool,
    /// The operation whose board posting the fast path put up before handing it to the
    /// machine (see [`fast`](super::fast)).
    pub(super) fast_posted: Option<u64>,
}

/// Where an engine gets the inbox descriptors of the ranks it did not learn at setup.
pub(crate) trait InboxSource: Send + std::fmt::Debug {
    /// The inbox descriptors of `peers`, in their order, within `timeout`; an error says what
    /// failed, naming the peers.
    fn fetch(&mut self, peers: &[usize], timeout: Duration) -> Result<Vec<RemoteRegion>, String>;
}

impl Engine {
    /// Allocates and registers the inbox; returns the engine and the inbox descriptor to
    /// advertise. Call [`connect_peers`](Self::connect_peers) with every rank's descriptor.
    pub(crate) fn new(
        mut ep: Box<dyn Endpoint>,
        comm_id: u64,
        opts: EngineOptions,
    ) -> Result<(Engine, RemoteRegion), Error> {
        let rank = ep.rank();
        let world = ep.world();
        let now = Instant::now();
        let proto = Protocol::new(
            proto::Config {
                rank,
                world,
                nslots: opts.nslots,
                slot_bytes: opts.slot_bytes,
                direct_min: opts.direct_min,
                checksum: opts.checksum,
            },
            now,
        );
        let inbox_len = proto.config().inbox_len();
        // Where peers map this rank's memory, they copy straight into the inbox.
        let inbox = match ep.shared_memory().and_then(|m| m.alloc_shared(inbox_len)) {
            Some(p) if (p as usize).is_multiple_of(64) => AlignedBuf::lent(p, inbox_len),
            _ => AlignedBuf::zeroed(inbox_len),
        };
        // SAFETY: the inbox is owned by the engine, outlives its registration (deregistered in
        // Drop before it is freed) and is read only after a write's completion arrived. Peer
        // `p` writes only its own area, `p` of `world` (`Protocol::slot_offset`).
        let inbox_mr = unsafe {
            ep.register(
                inbox.ptr,
                inbox.len,
                Access::REMOTE_WRITE
                    .union(Access::LOCAL_READ)
                    .union(Access::PERSISTENT)
                    .union(Access::PEER_AREAS),
            )
        }
        .map_err(|e| Error::transport(rank, "register inbox", e))?;
        let hdrs = AlignedBuf::zeroed(DATA_HEADER_LEN * opts.nslots * world);
        // SAFETY: owned by the engine and deregistered before it is freed.
        let hdr_mr = unsafe {
            ep.register(
                hdrs.ptr,
                hdrs.len,
                Access::LOCAL_READ.union(Access::PERSISTENT),
            )
        }
        .map_err(|e| Error::transport(rank, "register headers", e))?;
        let remote = inbox_mr.remote();
        let recorder = FlightRecorder::from_env(rank, world);
        recorder.set_comm_id(comm_id);
        let none = RemoteRegion {
            addr: 0,
            rkey: 0,
            len: 0,
        };
        Ok((
            Engine {
                ep,
                rank,
                world,
                comm_id,
                opts,
                proto,
                inbox,
                inbox_mr,
                hdrs,
                hdr_mr,
                remote_inboxes: vec![none; world],
                inbox_known: (0..world).map(|p| p == rank).collect(),
                inbox_source: None,
                comps: Vec::new(),
                running: None,
                poisoned: None,
                board_eager: 0,
                recorder,
                regs: RegCache::default(),
                scratch_pool: None,
                recv_pool: None,
                pool_on: false,
                sched_cache: Vec::new(),
                msg: Vec::new(),
                batch: Vec::new(),
                now_coarse: now,
                partly_connected: true,
                inboxes_partial: world > 1,
                fast_posted: None,
            },
            remote,
        ))
    }

    /// Sets the size from which copy-receives from `peer` are direct writes (`usize::MAX`:
    /// never), overriding [`EngineOptions::direct_min`] for that peer.
    /// `move_min` and `move_block` as in
    /// [`Protocol::set_direct_min`](gradsync_core::proto::Protocol::set_direct_min).
    pub(crate) fn set_direct_min(
        &mut self,
        peer: usize,
        min: usize,
        move_min: usize,
        move_block: usize,
    ) {
        self.proto.set_direct_min(peer, min, move_min, move_block);
    }

    /// Gives this rank a shared pool of `slots` receive slots and pools its pairs with
    /// `pooled` (no inbox slots between them; see `Protocol::set_pool`): their messages go
    /// straight into place or through the pool. Before any traffic, with the same `pooled`
    /// pairs on both ranks of each. The pooled peers' inbox areas are never written, and a
    /// transport that pins areas as ranks connect leaves them unpinned. Returns the pool's
    /// bytes.
    pub(crate) fn enable_pool(&mut self, slots: usize, pooled: &[usize]) -> Result<usize, Error> {
        if slots == 0 || self.recv_pool.is_some() {
            return Ok(0);
        }
        self.pool_on = true;
        if pooled.is_empty() {
            return Ok(0);
        }
        let len = slots * self.proto.config().stride();
        let buf = match self.ep.shared_memory().and_then(|m| m.alloc_shared(len)) {
            Some(p) if (p as usize).is_multiple_of(64) => AlignedBuf::lent(p, len),
            _ => AlignedBuf::zeroed(len),
        };
        // Read only after a write's completion arrived, written by a peer only in the slot its
        // clear-to-send named, which stays taken until that message is delivered.
        let mr = self.register_writable(&buf, "register the receive pool")?;
        self.proto.set_pool(slots, mr.rkey, buf.addr() as u64);
        for &p in pooled {
            let absolute = self.ep.caps(p).route == gradsync_transport::Route::Rdma;
            self.proto.set_pooled(p, absolute);
        }
        self.ep.unused_peer_areas(pooled);
        self.recv_pool = Some((buf, mr));
        Ok(len)
    }

    /// Registers `buf`, a buffer of the engine's that peers write into where its clear-to-sends
    /// say and that it keeps until Drop deregisters the region (`what` names the step in an
    /// error).
    fn register_writable(
        &mut self,
        buf: &AlignedBuf,
        what: &'static str,
    ) -> Result<MemoryRegion, Error> {
        // SAFETY: the engine owns `buf` and deregisters the region in Drop before it frees it.
        unsafe {
            self.ep.register(
                buf.ptr,
                buf.len,
                Access::REMOTE_WRITE
                    .union(Access::LOCAL_READ)
                    .union(Access::PERSISTENT),
            )
        }
        .map_err(|e| Error::transport(self.rank, what, e))
    }

    /// The shared receive pool: its slots, how many are free, the pooled peers, and the
    /// messages staged in it so far.
    pub(crate) fn pool_state(&self) -> ReceivePool {
        let (slots, free, staged) = self.proto.pool();
        let pooled_peers = (0..self.world).filter(|&p| self.proto.pooled(p)).count();
        ReceivePool {
            slots,
            free,
            pooled_peers,
            staged,
        }
    }

    /// Limits the messages in flight to `peer` (and the slots this rank holds back from it) to
    /// `window` of the inbox's slots, at least 1. Called before any traffic, with the same
    /// value on both ranks of the pair.
    pub(crate) fn set_window(&mut self, peer: usize, window: usize) {
        self.proto.set_window(peer, window);
    }

    /// The messages in flight to `peer` at most (see [`Engine::set_window`]).
    pub(crate) fn window(&self, peer: usize) -> usize {
        self.proto.window(peer)
    }

    /// See [`Protocol::move_direct_min`](gradsync_core::proto::Protocol::move_direct_min).
    pub(crate) fn move_direct_min(&self, peer: usize, block: usize) -> usize {
        self.proto.move_direct_min(peer, block)
    }

    /// Records every rank's inbox descriptor (index = rank).
    pub(crate) fn connect_peers(&mut self, inboxes: &[RemoteRegion]) {
        self.remote_inboxes.copy_from_slice(inboxes);
        self.inbox_known.fill(true);
        self.inboxes_partial = false;
    }

    /// Records the inbox descriptors of `known` ranks; those of the others come from `source`
    /// when an operation first talks to them.
    pub(crate) fn connect_peers_on_demand(
        &mut self,
        known: &[(usize, RemoteRegion)],
        source: Box<dyn InboxSource>,
    ) {
        for &(p, r) in known {
            if p < self.world {
                self.remote_inboxes[p] = r;
                self.inbox_known[p] = true;
            }
        }
        self.inbox_source = Some(source);
        self.inboxes_partial = self.inboxes_known() < self.world;
    }

    /// How many ranks' inbox descriptors this rank knows, its own included.
    pub(crate) fn inboxes_known(&self) -> usize {
        self.inbox_known.iter().filter(|&&k| k).count()
    }

    pub(crate) fn segment_elems(&self, dtype: DataType) -> usize {
        (self.opts.slot_bytes / dtype.size()).max(1)
    }

    pub(crate) fn check_usable(&self) -> Result<(), Error> {
        self.check_usable_or_running()?;
        if let Some(r) = &self.running {
            return Err(Error::Poisoned {
                rank: self.rank,
                reason: format!(
                    "{} was still in flight when a new call was made (its handle was leaked)",
                    r.sig
                ),
            });
        }
        Ok(())
    }

    /// Like [`check_usable`](Self::check_usable) but accepts an operation in flight.
    pub(crate) fn check_usable_or_running(&self) -> Result<(), Error> {
        match &self.poisoned {
            Some(why) => Err(Error::Poisoned {
                rank: self.rank,
                reason: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Numbers operations again from `last_coll_seq` (see [`Protocol::renumber`]); every
    /// rank has finished the operations numbered past it.
    pub(crate) fn renumber(&mut self, last_coll_seq: u64) {
        self.proto.renumber(last_coll_seq);
    }

    /// Whether an all-reduce of `bytes` runs eagerly here. The answer must be the same on
    /// every rank, so it depends only on the call and on settings that are alike everywhere.
    pub(crate) fn eager_fits(&self, bytes: usize) -> bool {
        bytes > 0 && bytes <= self.eager_limit() && self.world > 1 && self.world <= EAGER_WORLD_MAX
    }

    /// Lets eager all-reduces go through the transport's board when the smallest board of
    /// all ranks, `smallest` bytes (0: some rank has none), holds a message of
    /// [`BOARD_EAGER_MAX`] bytes. Every rank must pass the same value, since
    /// [`eager_fits`](Self::eager_fits) depends on the outcome.
    pub(crate) fn enable_board(&mut self, smallest: usize) {
        let on = smallest >= BOARD_EAGER_MAX + EAGER_HDR;
        self.board_eager = if on { BOARD_EAGER_MAX } else { 0 };
        self.proto.enable_board(on);
    }

    /// Whether eager all-reduces go through the transport's board.
    pub(crate) fn board(&self) -> bool {
        self.proto.board()
    }

    /// The largest all-reduce that runs eagerly (with no forced algorithm and at most
    /// [`EAGER_WORLD_MAX`] ranks): the path's own limit, lowered by `GRADSYNC_EAGER_MAX`; on
    /// the board [`BOARD_EAGER_DEFAULT`] unless `GRADSYNC_EAGER_MAX` is set, up to the board's
    /// capacity.
    pub(crate) fn eager_limit(&self) -> usize {
        let path = if !self.board() {
            EAGER_MAX
        } else if self.opts.eager_max == usize::MAX {
            self.board_eager.min(BOARD_EAGER_DEFAULT)
        } else {
            self.board_eager
        };
        path.min(self.opts.eager_max)
    }

    /// Connects the peers `prog` talks to that the transport has not connected yet, and reads
    /// the inbox descriptors of the peers it sends to that are not known yet (within the
    /// operation timeout); then notes whether every peer is connected and every inbox known.
    fn connect_for(&mut self, sig: &Signature, prog: &Program) -> Result<(), Error> {
        // The common case, every peer of the program already connected, allocates nothing:
        // a job whose ring never reaches most ranks stays partly connected for good.
        let all_there = prog.ops().iter().all(|op| match *op {
            Op::Send { peer, .. } => self.ep.caps(peer).connected && self.inbox_known[peer],
            Op::Recv { peer, .. } => self.ep.caps(peer).connected,
            Op::Post { .. } => !self.partly_connected,
            _ => true,
        });
        if all_there {
            return Ok(());
        }
        let peers = prog.peers(self.rank, self.world);
        // Only a send writes into the peer's inbox; a board posting needs none.
        let mut unknown: Vec<usize> = prog
            .ops()
            .iter()
            .filter_map(|op| match *op {
                Op::Send { peer, .. } if !self.inbox_known[peer] => Some(peer),
                _ => None,
            })
            .collect();
        unknown.sort_unstable();
        unknown.dedup();
        if !unknown.is_empty() {
            let rank = self.rank;
            let Some(source) = self.inbox_source.as_mut() else {
                return Err(Error::Internal {
                    rank,
                    msg: format!(
                        "{sig}: no inbox descriptor of {}",
                        gradsync_transport::rank_list(&unknown)
                    ),
                });
            };
            tracing::debug!(target: "gradsync::net", "rank {rank}: {sig}: fetching the inbox descriptors of {}", gradsync_transport::rank_list(&unknown));
            let got = source
                .fetch(&unknown, self.opts.timeout)
                .map_err(|msg| Error::Config(format!("rank {rank}: {sig}: {msg}")))?;
            for (p, r) in unknown.into_iter().zip(got) {
                self.remote_inboxes[p] = r;
                self.inbox_known[p] = true;
            }
        }
        let missing: Vec<usize> = peers
            .into_iter()
            .filter(|&p| !self.ep.caps(p).connected)
            .collect();
        if !missing.is_empty() {
            tracing::debug!(target: "gradsync::net", "rank {}: {sig}: connecting to rank(s) {missing:?}", self.rank);
            self.ep
                .connect(&missing, self.opts.timeout)
                .map_err(|e| Error::transport(self.rank, "connect", e))?;
        }
        self.partly_connected = self.connections() + 1 < self.world;
        self.inboxes_partial = self.inboxes_known() < self.world;
        Ok(())
    }

    /// Peers connected now.
    pub(crate) fn connections(&self) -> usize {
        (0..self.world)
            .filter(|&p| p != self.rank && self.ep.caps(p).connected)
            .count()
    }

    /// Bytes of the inbox registered for peers' messages (resident only where written,
    /// except where a transport pins it).
    pub(crate) fn inbox_bytes(&self) -> usize {
        self.inbox.len + self.recv_pool.as_ref().map_or(0, |(b, _)| b.len)
    }

    /// Starts an operation: `planned` runs over `input` and `output` (the scratch size comes
    /// from its program).
    ///
    /// # Safety
    ///
    /// `input` must be readable and `output` writable for their lengths, and neither may be
    /// accessed otherwise until the operation has completed (`progress` returned `true`) or
    /// the engine is poisoned.
    pub(crate) unsafe fn start(
        &mut self,
        sig: Signature,
        mut planned: Planned,
        algo: &'static str,
        input: RawBuf,
        output: RawBuf,
    ) -> Result<(), Error> {
        self.check_usable()?;
        let mode = match planned.params {
            Some(p) if p.algorithm == Algorithm::Eager => Mode::Eager,
            _ => Mode::Slots,
        };
        if mode == Mode::Eager {
            let bytes = sig.count as usize * sig.dtype.size();
            if sig.coll != Collective::AllReduce || !self.eager_fits(bytes) {
                return Err(Error::Internal {
                    rank: self.rank,
                    msg: format!(
                        "{sig}: cannot run eagerly ({bytes} bytes, world {})",
                        self.world
                    ),
                });
            }
        }
        if mode == Mode::Eager && self.proto.board() && !self.partly_connected {
            // SAFETY: forwarded from the caller.
            match unsafe { self.fast(sig, planned, input, output)? } {
                None => return Ok(()),
                Some(p) => planned = p,
            }
        }
        let Planned {
            mut sched,
            params,
            checked,
        } = planned;
        if checked.is_some() {
            // A kept schedule, finished by its last run.
            sched.restart();
        }
        let prog = sched.program();
        if self.partly_connected || self.inboxes_partial {
            self.connect_for(&sig, prog)?;
        }
        let dsize = sig.dtype.size();
        let scratch_len = prog.scratch_elems() * dsize;
        // Scratch comes from a buffer the engine keeps (registered once, grown when needed);
        // very large scratch is allocated for the operation.
        let pooled = scratch_len > 0 && scratch_len <= SCRATCH_KEEP;
        if pooled
            && self
                .scratch_pool
                .as_ref()
                .is_none_or(|(b, _)| b.len < scratch_len)
        {
            if let Some((_, mr)) = self.scratch_pool.take() {
                self.ep.deregister(&mr);
            }
            let buf = AlignedBuf::zeroed(scratch_len.max(SCRATCH_POOL));
            // Peers write into it only after a clear-to-send of the running operation.
            let mr = self.register_writable(&buf, "register scratch")?;
            self.scratch_pool = Some((buf, mr));
        }
        let scratch = (scratch_len > 0 && !pooled).then(|| AlignedBuf::zeroed(scratch_len));
        let sbuf = match (&scratch, &self.scratch_pool) {
            (Some(s), _) => RawBuf {
                addr: s.addr(),
                len: scratch_len,
            },
            (None, Some((pool, _))) if pooled => RawBuf {
                addr: pool.addr(),
                len: scratch_len,
            },
            _ => RawBuf::default(),
        };
        let bufs = [input, output, sbuf];
        let lens = bufs.map(|b| b.len);
        // A restarted schedule over buffers of the lengths it was checked against needs no
        // second look (a training loop's every step).
        if checked != Some(lens) {
            check_bounds(self.rank, &sig, prog, &bufs, self.world)?;
        }
        let mut lkeys = [0u32; 3];
        let mut rkeys = [0u32; 3];
        let mut mrs = Vec::new();
        let streaming = sig.count.saturating_mul(dsize as u64) >= STREAMING_OP_MIN as u64;
        // A large operation that only moves data reads its buffers once and its peers do not
        // read what it sends from a cache: transports may copy from them with non-temporal
        // stores (a reduction's inputs, read right after they land, stay in the cache).
        let streamed = streaming && sig.coll.moves_only();
        // An eager operation writes into no buffer of another rank's: nothing to register.
        if mode == Mode::Slots {
            for (i, b) in bufs.iter().enumerate() {
                if b.len == 0 {
                    continue;
                }
                match self.register(i, *b, pooled, streamed) {
                    Ok((mr, fresh)) => {
                        lkeys[i] = mr.lkey;
                        rkeys[i] = mr.rkey;
                        mrs.extend(fresh);
                    }
                    Err(e) => {
                        mrs.iter().for_each(|mr| self.ep.deregister(mr));
                        return Err(e);
                    }
                }
            }
        }
        self.proto.start(sig, sched, mode, rkeys, self.now_coarse);
        self.running = Some(Running {
            sig,
            params,
            bufs,
            lkeys,
            mrs,
            _scratch: scratch,
            record: crate::recorder::NO_HANDLE,
            started: self.now_coarse,
            streaming,
        });
        // What can go at once goes before the bookkeeping: the first messages (an eager post)
        // leave sooner, and the clock read and the flight record overlap their flight.
        let early = self.run_actions();
        let started = Instant::now();
        self.now_coarse = started;
        // The ranks it exchanges data with: every other for an eager operation (its post goes
        // to all), the peers of its sends and receives otherwise.
        let (rank, world) = (self.rank, self.world);
        let prog = self.proto.schedule().expect("started").program();
        let record = record_start(&self.recorder, started, &sig, algo, |peers| {
            if mode == Mode::Eager {
                peers.extend((0..world).filter(|&p| p != rank));
                return;
            }
            peers.extend(prog.ops().iter().filter_map(|op| match *op {
                Op::Send { peer, .. } | Op::Recv { peer, .. } => Some(peer),
                _ => None,
            }));
            peers.sort_unstable();
            peers.dedup();
        });
        let r = self.running.as_mut().expect("running");
        (r.record, r.started) = (record, started);
        early.map(drop).map_err(|e| self.failed(e))
    }

    /// The registration of buffer `i` (Input, Output, Scratch) of an operation: cached for
    /// caller buffers, the pool's for pooled scratch, fresh otherwise (returned for
    /// deregistration at the end). `streamed` marks caller buffers [`Access::STREAMED`].
    fn register(
        &mut self,
        i: usize,
        b: RawBuf,
        pooled: bool,
        streamed: bool,
    ) -> Result<(MemoryRegion, Option<MemoryRegion>), Error> {
        // Output and scratch may be written by peers that got a clear-to-send for them.
        let access = if i == 0 {
            Access::LOCAL_READ
        } else {
            Access::LOCAL_READ.union(Access::REMOTE_WRITE)
        };
        let access = if streamed && i < 2 {
            access.union(Access::STREAMED)
        } else {
            access
        };
        // Only the input's registration is kept between operations: it allows no remote
        // access. The output accepts peers' writes only while its operation runs (registered
        // here, deregistered when it ends), so a late or replayed write for a finished
        // operation finds no key and never lands in memory the caller may have freed.
        let cacheable = i == 0;
        let cached = if cacheable {
            self.regs.lookup(b.addr, b.len, access)
        } else if i == 2 && pooled {
            self.scratch_pool.as_ref().map(|(_, mr)| *mr)
        } else {
            None
        };
        if let Some(mr) = cached {
            return Ok((mr, None));
        }
        // SAFETY: the caller keeps these buffers valid for the operation and leaves them alone
        // until it ends; peers write into them only during our progress calls (tcp, shm) or
        // before the completion we wait for (mem), and only after a clear-to-send of the running
        // operation. A cached registration (the input's) outlives the operation, but allows
        // no remote access.
        let mr = unsafe { self.ep.register(b.addr as *mut u8, b.len, access) }
            .map_err(|e| Error::transport(self.rank, "register buffer", e))?;
        if !cacheable {
            return Ok((mr, Some(mr)));
        }
        if let Some(old) = self.regs.insert(mr) {
            self.ep.deregister(&old);
        }
        Ok((mr, None))
    }

    /// Drives the running operation. With `block`, returns only when it is done (or failed);
    /// otherwise makes one round of progress. Returns whether it is done. On error the
    /// communicator is poisoned and peers are told.
    pub(crate) fn progress(&mut self, block: bool) -> Result<bool, Error> {
        if self.running.is_none() {
            return Ok(true);
        }
        match self.progress_inner(block) {
            Ok(done) => {
                if done {
                    self.finish();
                }
                Ok(done)
            }
            Err(e) => Err(self.failed(e)),
        }
    }

    fn finish(&mut self) {
        // What is kept is read where it lies: the record is large, and moving it out costs a
        // copy on the path between two operations.
        let Some(r) = self.running.as_ref() else {
            return;
        };
        for mr in &r.mrs {
            self.ep.deregister(mr);
        }
        let (record, params, lens) = (r.record, r.params, r.bufs.map(|b| b.len));
        self.running = None;
        let Some(f) = self.proto.finish() else {
            return;
        };
        if !f.completed {
            return;
        }
        self.recorder.finish(record, OpState::Completed, None);
        if let Some(p) = params {
            self.keep_schedule(p, f.sched, lens);
        }
    }

    /// Keeps a finished schedule for the next call with the same parameters.
    pub(super) fn keep_schedule(&mut self, p: Params, sched: Box<Schedule>, lens: [usize; 3]) {
        if self.sched_cache.len() >= SCHEDULE_CACHE {
            self.sched_cache.remove(0);
        }
        self.sched_cache.push((p, sched, lens));
    }

    /// A program planned outside the cache (send/recv), run once.
    pub(crate) fn one_off(&self, prog: Program) -> Planned {
        Planned {
            sched: Box::new(Schedule::new(prog, self.world)),
            params: None,
            checked: None,
        }
    }

    /// The schedule of `params`: a finished one restarted when the same parameters ran
    /// recently, else newly generated.
    pub(crate) fn schedule_for(&mut self, params: &Params) -> Result<Planned, PlanError> {
        self.schedule_with(params, plan::build)
    }

    /// [`Engine::schedule_for`], with `build` making the program where the cache has none.
    /// `build` must give the same program for the same `params` on this engine (the cache is
    /// keyed by `params` alone).
    pub(crate) fn schedule_with(
        &mut self,
        params: &Params,
        build: impl FnOnce(&Params) -> Result<Program, PlanError>,
    ) -> Result<Planned, PlanError> {
        // A loop of equal calls finds its schedule last in the cache.
        let i = match self.sched_cache.last() {
            Some((p, ..)) if p == params => Some(self.sched_cache.len() - 1),
            _ => self.sched_cache.iter().rposition(|(p, ..)| p == params),
        };
        if let Some(i) = i {
            let (p, sched, lens) = if i + 1 == self.sched_cache.len() {
                self.sched_cache.pop().expect("non-empty")
            } else {
                self.sched_cache.remove(i)
            };
            // Restarted when it starts on the machine: the fast path does not run it.
            return Ok(Planned {
                sched,
                params: Some(p),
                checked: Some(lens),
            });
        }
        let mut planned = self.one_off(build(params)?);
        planned.params = Some(*params);
        Ok(planned)
    }

    /// Poisons the communicator and tells every peer why (best effort).
    /// The error an operation that failed with `e` returns: the abort behind a lost
    /// connection if one is here (see `abort_behind`), after the communicator is failed with it.
    pub(super) fn failed(&mut self, e: Error) -> Error {
        let e = self.abort_behind(e);
        self.fail(&e);
        e
    }

    pub(crate) fn fail(&mut self, e: &Error) {
        // A posting the fast path put up belongs to the operation that failed.
        self.fast_posted = None;
        if self.poisoned.is_some() {
            return;
        }
        let msg = e.to_string();
        self.poisoned = Some(msg.clone());
        if let Some(r) = &self.running {
            let state = if matches!(e, Error::Timeout { .. }) {
                OpState::TimedOut
            } else {
                OpState::Failed
            };
            self.recorder.finish(r.record, state, Some(msg.clone()));
        }
        let reason = if matches!(e, Error::Timeout { .. }) {
            "timeout"
        } else {
            "failure"
        };
        match self.recorder.dump(reason) {
            Ok(path) => {
                tracing::warn!(target: "gradsync::coll", "rank {}: flight recorder written to {}", self.rank, path.display())
            }
            Err(err) => {
                tracing::warn!(target: "gradsync::coll", "rank {}: could not write the flight recorder: {err}", self.rank)
            }
        }
        // Buffers of a failed operation are never touched again.
        self.finish();
        // Peers are told; an abort received is passed on, once, with its reason: where ranks
        // connect on first use, many are not connected to the one that failed.
        let reason = match e {
            Error::PeerAborted { reason, .. } => reason.as_str(),
            _ => msg.as_str(),
        };
        self.proto
            .abort(reason, gradsync_transport::MAX_SEND - proto_abort_header());
        self.send_controls_only();
        let mut sink = Vec::new();
        let _ = self.ep.poll(&mut sink);
    }

    fn progress_inner(&mut self, block: bool) -> Result<bool, Error> {
        let deadline = self.running.as_ref().expect("running").started + self.opts.timeout;
        let mut idle_since: Option<Instant> = None;
        let mut idle_polls: u32 = 0;
        let mut busy = self.opts.busy_spin > Duration::ZERO;
        let mut idle = false;
        loop {
            self.proto.handle_round(self.now_coarse, idle);
            let moved = self.step()?;
            if self.proto.is_done() {
                // Credits below the batch threshold are returned the next time this rank
                // waits, off the critical path of small messages.
                return Ok(true);
            }
            if !block {
                if !moved {
                    self.proto.flush_credits();
                    self.run_actions()?;
                }
                return Ok(false);
            }
            idle = !moved;
            if moved {
                idle_since = None;
                idle_polls = 0;
                continue;
            }
            // While busy-spinning, the clock is read on one idle round in 16: the rounds in
            // between only poll, which keeps the time to notice an arrival short.
            idle_polls = idle_polls.wrapping_add(1);
            if busy && idle_polls % 16 != 1 {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            self.now_coarse = now;
            let since = *idle_since.get_or_insert(now);
            busy = now - since < self.opts.busy_spin;
            if now >= deadline {
                return Err(self.diagnose_timeout());
            }
            if now - since >= self.opts.spin {
                self.check_peers_alive()?;
                let left = deadline - now;
                let peers = self.proto.wake_peers();
                self.ep
                    .wait_on(&peers, left.min(Duration::from_millis(200)))
                    .map_err(|e| Error::transport(self.rank, "wait", e))?;
            } else if busy {
                std::hint::spin_loop();
            } else {
                // Yield rather than spin: with more ranks than cores the peer we wait on may
                // need this core; with a free core the yield returns at once.
                std::thread::yield_now();
            }
        }
    }

    /// One round: carry out what the machine has, poll the transport, feed what completed,
    /// carry out what that made possible. Returns whether anything moved.
    fn step(&mut self) -> Result<bool, Error> {
        // Progress is what the machine says moved and what completed; actions that only look
        // (a board read that finds nothing, a refused posting) are not.
        let mut moved = false;
        self.run_actions()?;
        if self.proto.is_done() {
            // What was done (a board posting read at once) ends the operation: no poll first.
            return Ok(true);
        }
        self.comps.clear();
        self.ep
            .poll(&mut self.comps)
            .map_err(|e| Error::transport(self.rank, "poll", e))?;
        if !self.comps.is_empty() {
            moved = true;
            let mut comps = std::mem::take(&mut self.comps);
            let res = comps.drain(..).try_for_each(|c| self.feed(c));
            self.comps = comps;
            res?;
        }
        self.run_actions()?;
        moved |= self.proto.take_moved();
        Ok(moved)
    }
}

/// Bytes of an abort message before its reason.
fn proto_abort_header() -> usize {
    gradsync_core::wire::control::Kind::Abort.wire_len()
}

/// Bounds of every op of `prog` against the buffers, so no peer or generator bug can reach
/// outside them.
fn check_bounds(
    rank: usize,
    sig: &Signature,
    prog: &Program,
    bufs: &[RawBuf; 3],
    world: usize,
) -> Result<(), Error> {
    let dsize = sig.dtype.size();
    for op in prog.ops() {
        let (locs, span): (&[Loc], usize) = match op {
            Op::Send { src, .. } | Op::Post { src, .. } => (&[*src], op.len()),
            Op::Recv {
                dst,
                reduce_with: Some(w),
                ..
            } => (&[*dst, *w], op.len()),
            Op::Recv { dst, .. } => (&[*dst], op.len()),
            Op::Copy { src, dst, .. } => (&[*src, *dst], op.len()),
            Op::Finalize { loc, .. } => (&[*loc], op.len()),
            Op::ReduceParts { src, dst, len } => {
                for (l, n) in [(*src, len * world), (*dst, *len)] {
                    check_span(rank, sig, op, bufs, l, n, dsize)?;
                }
                continue;
            }
        };
        for l in locs {
            check_span(rank, sig, op, bufs, *l, span, dsize)?;
        }
    }
    Ok(())
}

fn check_span(
    rank: usize,
    sig: &Signature,
    op: &Op,
    bufs: &[RawBuf; 3],
    l: Loc,
    elems: usize,
    dsize: usize,
) -> Result<(), Error> {
    let b = bufs[buf_index(l.buf)];
    if (l.start + elems) * dsize > b.len {
        return Err(Error::Internal {
            rank,
            msg: format!(
                "{sig}: schedule op {op:?} reaches past the {:?} buffer of {} bytes",
                l.buf, b.len
            ),
        });
    }
    Ok(())
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.running.is_some() {
            // Never leave a peer's write landing in memory we no longer own: the inbox is ours,
            // caller buffers are never written by the transport.
            self.finish();
        }
        for (mr, _) in std::mem::take(&mut self.regs.entries) {
            self.ep.deregister(&mr);
        }
        if let Some((_, mr)) = &self.scratch_pool {
            let mr = *mr;
            self.ep.deregister(&mr);
        }
        if let Some((_, mr)) = &self.recv_pool {
            let mr = *mr;
            self.ep.deregister(&mr);
        }
        let (a, b) = (self.inbox_mr, self.hdr_mr);
        self.ep.deregister(&a);
        self.ep.deregister(&b);
    }
}

/// The flight record of an operation that started at `started` (with the ranks it exchanges
/// data with, as `peers` fills them in); its handle.
fn record_start(
    recorder: &FlightRecorder,
    started: Instant,
    sig: &Signature,
    algo: &'static str,
    peers: impl FnOnce(&mut Vec<usize>),
) -> usize {
    recorder.start_with(started, |rec| {
        rec.seq = sig.seq;
        rec.op = sig.coll.name().into();
        rec.dtype = sig.dtype.name().into();
        rec.count = sig.count;
        rec.algorithm = algo.into();
        rec.bytes = sig.count * sig.dtype.size() as u64;
        if matches!(
            sig.coll,
            Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
        ) {
            rec.root = Some(sig.root);
        }
        peers(&mut rec.peers);
    })
}
