//! The progress engine: runs one schedule at a time over a transport endpoint.
//!
//! # Data path
//!
//! Every rank registers one *inbox* region at init and advertises it through the rendezvous
//! store. The inbox holds `nslots` slots per sender; a slot is a 64-byte
//! [`DataHeader`](gradsync_core::wire::DataHeader) followed by up to `slot_bytes` of payload.
//! A sender owns `window` credits per peer (`nslots`, or fewer for a pair over TCP): it writes
//! message k into slot `k % window` of the peer's inbox with one write-with-immediate (gather
//! list: header, then payload straight from the user buffer) and spends a credit; the receiver
//! reduces or copies the payload out of the slot into its destination and returns the credit
//! with a small two-sided send. This is the
//! clear-to-send scheme an RDMA backend needs, and over TCP the payload is read by the
//! transport straight into the slot.
//!
//! Messages are consumed in the order they were sent (slot counters), whatever stream they came
//! on, so the k-th send to a peer meets that peer's k-th receive, as the schedules require. The
//! header of every message carries the collective's signature, checked on arrival.
//!
//! # Small all-reduces
//!
//! An all-reduce of at most [`EAGER_MAX`] bytes (and `GRADSYNC_EAGER_MAX`), with no forced
//! algorithm and at most [`EAGER_WORLD_MAX`] ranks, runs *eagerly*: each rank sends its whole
//! buffer, with the signature, to every peer in one two-sided message, and once every
//! contribution is there reduces them in rank order, so every rank computes the same bits. It
//! takes one message latency for any world and needs no slot, credit or schedule. Messages a
//! peer sends for operations this rank has not reached are kept (a few per peer); one for an
//! operation that this rank runs through a schedule, or a slot message for an operation it runs
//! eagerly, is a mismatch naming both calls.
//!
//! When every rank's transport has a board ([`Endpoint::board_post`]: all ranks on one host's
//! shared memory) the communicator turns it on for all of them, and the eager path carries up
//! to [`BOARD_EAGER_DEFAULT`] bytes: each rank posts its message once under the operation's
//! sequence number and copies each peer's posting out, then releases the sequence number. A
//! message per peer costs the sender a ring record and a tail to publish per peer and the
//! receiver a ring to drain, a completion and an allocation per peer; with 4 ranks on 2 cores,
//! in one run alternating the two, the board took an 8-byte all-reduce from 8.8 us to 7.6 us
//! and a 2 KiB one from 12.3 us to 8.6 us (medians of 5). A rank waiting in a
//! scheduled collective looks at its peers' boards every millisecond: a posting under its own
//! sequence number is a mismatch.
//!
//! # Progress
//!
//! The engine is driven by the calling thread: blocking calls run it to completion, an async
//! handle runs it from `test()`/`wait()`. When nothing moves it spins for a short while
//! (`GRADSYNC_SPIN_US`) and then sleeps in the transport until data arrives, so an idle rank
//! leaves its core to the others. Every wait has a deadline.

use crate::error::Error;
use crate::recorder::{FlightRecorder, OpState};
use gradsync_core::schedule::plan::{self, Params, PlanError};
use gradsync_core::schedule::{Buf, Loc, Op, OpId, Program, Schedule};
use gradsync_core::wire::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr, Signature};
use gradsync_core::{Collective, DataType, ReduceOp};
use gradsync_transport::{
    Access, Completion, Endpoint, MemoryRegion, RemoteRegion, Sge, TransportError,
};
use std::alloc::Layout;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

const CTRL_CREDIT: u8 = 1;
const CTRL_ABORT: u8 = 2;
const CTRL_CTS: u8 = 3;
/// "Where are you?", sent to every peer when a collective times out.
const CTRL_PROBE: u8 = 4;
/// Answer to a probe: the sequence number of the collective the peer runs (or ran last) and
/// whether it is inside it.
const CTRL_PROBE_REPLY: u8 = 5;
/// An eager all-reduce's contribution: signature and the whole (small) buffer.
const CTRL_EAGER: u8 = 6;
/// Bytes of an eager message before its payload.
const EAGER_HDR: usize = 32;
/// Largest buffer an eager all-reduce carries: one two-sided message.
pub(crate) const EAGER_MAX: usize = gradsync_transport::MAX_SEND - EAGER_HDR;
/// Largest buffer an eager all-reduce posts on a board ([`Endpoint::board_post`]).
pub(crate) const BOARD_EAGER_MAX: usize = gradsync_transport::shm::BOARD_CAPACITY - EAGER_HDR;
/// All-reduces of at most this many bytes go eagerly through a board by default.
pub(crate) const BOARD_EAGER_DEFAULT: usize = 16 * 1024;
/// Largest world that runs small all-reduces eagerly: each rank sends `world - 1` messages.
pub(crate) const EAGER_WORLD_MAX: usize = 16;
/// Eager messages a peer may have sent for operations this rank has not reached.
const EAGER_AHEAD_MAX: usize = 4;
/// Length of a clear-to-send message.
const CTS_LEN: usize = 40;
/// Immediate-value flag of a write that went straight to the receiver's destination.
const IMM_DIRECT: u32 = 1 << 31;

/// A receiver's offer to take message `msg` of collective `seq` straight into its buffer.
#[derive(Clone, Copy, Debug)]
struct Cts {
    rkey: u32,
    offset: u64,
    bytes: u32,
    /// The receiver's signature, checked by the sender.
    sig: Signature,
}

impl Cts {
    fn encode(&self, msg: u32) -> [u8; CTS_LEN] {
        let mut b = [0u8; CTS_LEN];
        b[0] = CTRL_CTS;
        b[1] = self.sig.coll as u8;
        b[2] = self.sig.dtype as u8;
        b[3] = self.sig.op as u8;
        b[4..8].copy_from_slice(&msg.to_le_bytes());
        b[8..16].copy_from_slice(&self.sig.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.bytes.to_le_bytes());
        b[20..24].copy_from_slice(&self.rkey.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..36].copy_from_slice(&(self.sig.count as u32).to_le_bytes());
        b[36..40].copy_from_slice(&self.sig.root.to_le_bytes());
        b
    }

    fn decode(b: &[u8], comm_id: u64) -> Option<(u32, Cts)> {
        if b.len() != CTS_LEN {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
        let sig = Signature {
            comm_id,
            seq: u64_at(8),
            coll: gradsync_core::Collective::from_code(b[1]).ok()?,
            dtype: DataType::from_code(b[2]).ok()?,
            op: ReduceOp::from_code(b[3]).ok()?,
            count: u32_at(32) as u64,
            root: u32_at(36),
        };
        Some((
            u32_at(4),
            Cts {
                rkey: u32_at(20),
                offset: u64_at(24),
                bytes: u32_at(16),
                sig,
            },
        ))
    }
}

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
    /// at most [`EAGER_MAX`].
    pub eager_max: usize,
    /// Floating-point all-reduces reduce every element in rank order, whatever the algorithm,
    /// chunking or size (`GRADSYNC_DETERMINISTIC`).
    pub deterministic: bool,
}

/// A 64-byte aligned heap buffer.
#[derive(Debug)]
pub(crate) struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    /// Whether this buffer owns its allocation (false: memory a transport lent, freed by it).
    owned: bool,
}

// SAFETY: AlignedBuf exclusively owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(64), 64).expect("layout");
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf {
            ptr,
            len,
            owned: true,
        }
    }

    /// Memory the transport allocated ([`Endpoint::alloc_shared`]); it stays valid as long as
    /// the transport, which frees it.
    fn lent(ptr: *mut u8, len: usize) -> Self {
        AlignedBuf {
            ptr,
            len,
            owned: false,
        }
    }
    pub(crate) fn addr(&self) -> usize {
        self.ptr as usize
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let layout = Layout::from_size_align(self.len.max(64), 64).expect("layout");
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// Raw view of a caller buffer for the duration of one operation.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RawBuf {
    pub addr: usize,
    pub len: usize,
}

#[derive(Debug)]
struct PeerState {
    remote_inbox: RemoteRegion,
    credits: usize,
    /// Slots of the pair's part of an inbox in use, at most `nslots`: message k goes to slot
    /// `k % window`, and as many messages may be in flight. Both ranks of the pair use the
    /// same window (checked at init).
    window: usize,
    tx_ctr: u64,
    rx_ctr: u64,
    arrived: Vec<bool>,
    hdr_busy: Vec<bool>,
    unreturned: u32,
    last_heard: Option<(Instant, u64)>,
    /// Clear-to-send offers from this peer, by (sequence number, message index).
    cts: HashMap<(u64, u32), Cts, BuildHasherDefault<IdHasher>>,
    /// Copy-receives from this peer of at least this many bytes are direct writes.
    direct_min: usize,
}

impl PeerState {
    /// The slot (of the peer's part of an inbox) that message `ctr` of the pair uses.
    fn slot(&self, ctr: u64) -> usize {
        (ctr % self.window as u64) as usize
    }
}

/// A receive the schedule has issued.
#[derive(Clone, Copy, Debug)]
struct PostedRecv {
    id: OpId,
    len: usize,
    dst: Loc,
    with: Option<Loc>,
    /// Index of the message, per peer, within the operation.
    msg: u32,
    /// Whether a clear-to-send went out for it (it may then arrive directly).
    direct: bool,
}

/// A schedule ready to start, with the parameters it was planned from (for reuse).
#[derive(Debug)]
pub(crate) struct Planned {
    pub(crate) sched: Box<Schedule>,
    pub(crate) params: Option<Params>,
    /// An eager all-reduce (the schedule is empty).
    pub(crate) eager: bool,
}

/// How often a rank that waits in a scheduled collective looks for peers' board postings of
/// the same operation (a mismatch).
const BOARD_CHECK_EVERY: Duration = Duration::from_millis(1);

/// Idle time after which a waiting rank returns every credit it holds.
const IDLE_CREDIT_RETURN: Duration = Duration::from_micros(20);

/// Schedules kept for reuse: a training loop calls the same collectives with the same sizes
/// every step, and a restarted schedule costs no generation and no allocation.
const SCHEDULE_CACHE: usize = 8;

/// One operation in flight.
#[derive(Debug)]
struct Running {
    sig: Signature,
    sched: Box<Schedule>,
    params: Option<Params>,
    bufs: [RawBuf; 3],
    lkeys: [u32; 3],
    rkeys: [u32; 3],
    _scratch: Option<AlignedBuf>,
    /// Queues and maps of the operation; kept for the next one when it finishes.
    q: Queues,
    /// Handle of this operation in the flight recorder.
    record: usize,
    started: Instant,
    /// How an eager all-reduce stands; `None` for an operation run by its schedule.
    eager: Option<EagerRun>,
}

/// How an eager all-reduce stands.
#[derive(Clone, Copy, Debug)]
struct EagerRun {
    /// The peers whose contribution has not arrived (bit per rank).
    missing: u32,
    /// This rank's message still has to be sent (by the first progress round, where a failure
    /// is handled as any other).
    unsent: bool,
}

impl Running {
    fn is_done(&self) -> bool {
        match self.eager {
            // Every peer's part is here, and this rank's own has gone out (a board posting may
            // still wait for its slot when the peers' parts are all in).
            Some(e) => e.missing == 0 && !e.unsent,
            None => self.sched.is_done(),
        }
    }
}

/// The per-operation queues and maps. A finished operation's are emptied and reused by the
/// next one, so that it allocates nothing.
#[derive(Debug, Default)]
struct Queues {
    /// Registrations made for this operation only (fresh scratch).
    mrs: Vec<MemoryRegion>,
    sendq: Vec<VecDeque<(OpId, usize, Loc)>>,
    recvq: Vec<VecDeque<PostedRecv>>,
    send_msg: Vec<u32>,
    recv_issued: Vec<u32>,
    /// Message indices, per peer, of direct writes that have landed.
    direct_arrived: Vec<Vec<u32>>,
    inflight: HashMap<u64, (OpId, usize, usize), BuildHasherDefault<IdHasher>>,
}

impl Queues {
    /// Empties everything for a world of `w` ranks, keeping the allocations.
    fn reset(&mut self, w: usize) {
        self.mrs.clear();
        self.sendq.resize_with(w, VecDeque::new);
        self.sendq.iter_mut().for_each(VecDeque::clear);
        self.recvq.resize_with(w, VecDeque::new);
        self.recvq.iter_mut().for_each(VecDeque::clear);
        self.send_msg.clear();
        self.send_msg.resize(w, 0);
        self.recv_issued.clear();
        self.recv_issued.resize(w, 0);
        self.direct_arrived.resize_with(w, Vec::new);
        self.direct_arrived.iter_mut().for_each(Vec::clear);
        self.inflight.clear();
    }
}

/// Hashes a work-request id (already unique and well spread in its low bits) as itself.
#[derive(Debug, Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (self.0 ^ u64::from(v)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The engine of one communicator.
#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) ep: Box<dyn Endpoint>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) comm_id: u64,
    pub(crate) opts: EngineOptions,
    stride: usize,
    inbox: AlignedBuf,
    inbox_mr: MemoryRegion,
    hdrs: AlignedBuf,
    hdr_mr: MemoryRegion,
    peers: Vec<PeerState>,
    comps: Vec<Completion>,
    next_wr: u64,
    running: Option<Running>,
    poisoned: Option<String>,
    /// Sequence number of the last collective started.
    last_seq: u64,
    /// Sequence number of the last collective (not send/recv, which count per peer) started.
    last_coll_seq: u64,
    /// Answers to this rank's timeout probe, per peer: (their sequence number, inside it).
    probe_replies: Vec<Option<(u64, bool)>>,
    /// The last operations, for post-mortems.
    pub(crate) recorder: FlightRecorder,
    /// Registrations of caller buffers kept from one operation to the next.
    regs: RegCache,
    /// Scratch space of small operations and its registration.
    scratch_pool: Option<(AlignedBuf, MemoryRegion)>,
    /// Finished schedules by the parameters they were planned from, most recent last.
    sched_cache: Vec<(Params, Box<Schedule>)>,
    /// Queues of the last finished operation, for the next one.
    spare: Queues,
    /// Eager messages received and not yet used, per peer, in arrival order (whole messages, as
    /// the transport delivered them: no copy on the way to the reduction).
    eager_in: Vec<VecDeque<(Signature, Vec<u8>)>>,
    /// Each peer's message (or copied board posting) for the running eager all-reduce, valid
    /// for the peers its `missing` set no longer holds; board copies keep their allocation.
    eager_parts: Vec<Vec<u8>>,
    /// Whether eager all-reduces go through the transport's board (every rank has one).
    board: bool,
    /// When a waiting scheduled collective next looks for a mismatched board posting.
    next_board_check: Instant,
    /// The empty schedule that eager operations carry, between them.
    empty_sched: Option<Box<Schedule>>,
    /// The outgoing eager message, kept for its allocation. Its payload is also this rank's
    /// contribution to the reduction (a copy: in place, the output is written before the
    /// contributions of later ranks are read).
    eager_msg: Vec<u8>,
    /// The engine's last clock reading (operation start, idle rounds): when peers were last
    /// heard from, without a clock read per message.
    now_coarse: Instant,
}

/// Operations of at least this many bytes copy what they receive into the caller's buffer
/// with non-temporal stores (see [`gradsync_reduce::copy_streaming`]): such a buffer does not
/// stay in the caches, and skipping the read of each destination line before it is written
/// saves a third of the memory traffic of the copy. On two ranks over shared memory that is
/// about a quarter more busbw at 64 MiB.
const STREAMING_OP_MIN: usize = 8 << 20;

/// Operations needing at most this much scratch use the engine's scratch buffer.
const SCRATCH_POOL: usize = 256 * 1024;

/// Caller buffers are registered once and reused while the same span comes back (a training
/// loop passes the same gradient buffers every step), never per operation: a bounded cache of
/// `(address, length, access)` -> region, least recently used out first.
#[derive(Debug, Default)]
struct RegCache {
    entries: Vec<(MemoryRegion, u64)>,
    tick: u64,
}

/// Registrations the cache keeps.
const REG_CACHE_ENTRIES: usize = 16;

impl RegCache {
    /// The cached region for exactly this span and access, marked used.
    fn lookup(&mut self, addr: usize, len: usize, access: Access) -> Option<MemoryRegion> {
        self.tick += 1;
        let tick = self.tick;
        self.entries
            .iter_mut()
            .find(|(mr, _)| mr.addr == addr && mr.len == len && mr.access == access)
            .map(|(mr, used)| {
                *used = tick;
                *mr
            })
    }

    /// Adds a region; returns the one evicted to make room, to be deregistered.
    fn insert(&mut self, mr: MemoryRegion) -> Option<MemoryRegion> {
        self.tick += 1;
        let evicted = if self.entries.len() >= REG_CACHE_ENTRIES {
            let (i, _) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, used))| *used)
                .expect("non-empty");
            Some(self.entries.swap_remove(i).0)
        } else {
            None
        };
        self.entries.push((mr, self.tick));
        evicted
    }
}

/// Size of a slot (header + payload) rounded to 64 bytes.
fn slot_stride(slot_bytes: usize) -> usize {
    (DATA_HEADER_LEN + slot_bytes).div_ceil(64) * 64
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
        let stride = slot_stride(opts.slot_bytes);
        let inbox_len = stride * opts.nslots * world;
        // On a shared-memory transport peers copy straight into a mapping of the inbox.
        let inbox = match ep.alloc_shared(inbox_len) {
            Some(p) if (p as usize).is_multiple_of(64) => AlignedBuf::lent(p, inbox_len),
            _ => AlignedBuf::zeroed(inbox_len),
        };
        // SAFETY: the inbox is owned by the engine, outlives its registration (deregistered in
        // Drop before it is freed) and is read only after a write's completion arrived.
        let inbox_mr = unsafe {
            ep.register(
                inbox.ptr,
                inbox.len,
                Access::REMOTE_WRITE
                    .union(Access::LOCAL_READ)
                    .union(Access::PERSISTENT),
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
        let peers = (0..world)
            .map(|_| PeerState {
                remote_inbox: RemoteRegion {
                    addr: 0,
                    rkey: 0,
                    len: 0,
                },
                credits: opts.nslots,
                window: opts.nslots,
                tx_ctr: 0,
                rx_ctr: 0,
                arrived: vec![false; opts.nslots],
                hdr_busy: vec![false; opts.nslots],
                unreturned: 0,
                last_heard: None,
                cts: HashMap::default(),
                direct_min: opts.direct_min,
            })
            .collect();
        Ok((
            Engine {
                ep,
                rank,
                world,
                comm_id,
                opts,
                stride,
                inbox,
                inbox_mr,
                hdrs,
                hdr_mr,
                peers,
                comps: Vec::new(),
                next_wr: 1,
                running: None,
                poisoned: None,
                last_seq: 0,
                last_coll_seq: 0,
                probe_replies: vec![None; world],
                recorder: {
                    let rec = FlightRecorder::from_env(rank, world);
                    rec.set_comm_id(comm_id);
                    rec
                },
                regs: RegCache::default(),
                scratch_pool: None,
                sched_cache: Vec::new(),
                spare: Queues::default(),
                eager_in: (0..world).map(|_| VecDeque::new()).collect(),
                eager_parts: (0..world).map(|_| Vec::new()).collect(),
                board: false,
                next_board_check: Instant::now(),
                empty_sched: None,
                eager_msg: Vec::new(),
                now_coarse: Instant::now(),
            },
            remote,
        ))
    }

    /// Sets the size from which copy-receives from `peer` are direct writes (`usize::MAX`:
    /// never), overriding [`EngineOptions::direct_min`] for that peer.
    pub(crate) fn set_direct_min(&mut self, peer: usize, min: usize) {
        if let Some(p) = self.peers.get_mut(peer) {
            p.direct_min = min;
        }
    }

    /// Limits the messages in flight to `peer` (and the slots this rank holds back from it) to
    /// `window` of the inbox's slots, at least 1. Called before any traffic, with the same
    /// value on both ranks of the pair.
    pub(crate) fn set_window(&mut self, peer: usize, window: usize) {
        let w = window.clamp(1, self.opts.nslots);
        if let Some(p) = self.peers.get_mut(peer) {
            p.window = w;
            p.credits = w;
        }
    }

    /// Records every rank's inbox descriptor (index = rank).
    pub(crate) fn connect_peers(&mut self, inboxes: &[RemoteRegion]) {
        for (p, r) in inboxes.iter().enumerate() {
            self.peers[p].remote_inbox = *r;
        }
    }

    pub(crate) fn segment_elems(&self, dtype: DataType) -> usize {
        (self.opts.slot_bytes / dtype.size()).max(1)
    }

    pub(crate) fn check_usable(&self) -> Result<(), Error> {
        if let Some(why) = &self.poisoned {
            return Err(Error::Poisoned {
                rank: self.rank,
                reason: why.clone(),
            });
        }
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

    /// Starts an operation. `bufs` are Input, Output, and the scratch size comes from `prog`.
    ///
    /// # Safety
    ///
    /// `input` must be readable and `output` writable for their lengths, and neither may be
    /// accessed otherwise until the operation has completed (`progress` returned `true`) or
    /// the engine is poisoned.
    pub(crate) unsafe fn start(
        &mut self,
        sig: Signature,
        planned: Planned,
        algo: &'static str,
        input: RawBuf,
        output: RawBuf,
    ) -> Result<(), Error> {
        self.check_usable()?;
        if planned.eager {
            return self.start_eager(sig, planned.sched, algo, input, output);
        }
        let Planned { sched, params, .. } = planned;
        let prog = sched.program();
        let dsize = sig.dtype.size();
        let scratch_len = prog.scratch_elems() * dsize;
        // Small scratch comes from a buffer the engine keeps (registered once); large scratch
        // is allocated for the operation.
        let pooled = scratch_len > 0 && scratch_len <= SCRATCH_POOL;
        if pooled && self.scratch_pool.is_none() {
            let buf = AlignedBuf::zeroed(SCRATCH_POOL);
            // SAFETY: owned by the engine, deregistered in Drop before it is freed; peers write
            // into it only after a clear-to-send of the running operation.
            let mr = unsafe {
                self.ep.register(
                    buf.ptr,
                    buf.len,
                    Access::LOCAL_READ
                        .union(Access::REMOTE_WRITE)
                        .union(Access::PERSISTENT),
                )
            }
            .map_err(|e| Error::transport(self.rank, "register scratch", e))?;
            self.scratch_pool = Some((buf, mr));
        }
        let scratch = (scratch_len > 0 && !pooled).then(|| AlignedBuf::zeroed(scratch_len));
        let sbuf = match (&scratch, &self.scratch_pool) {
            (Some(s), _) => RawBuf {
                addr: s.addr(),
                len: scratch_len,
            },
            (None, Some((pool, _))) if pooled => {
                // Programs see zeroed scratch, as a fresh allocation would give.
                // SAFETY: the pool holds SCRATCH_POOL >= scratch_len bytes and no operation is
                // running (check_usable above), so nothing else touches it.
                unsafe { std::ptr::write_bytes(pool.ptr, 0, scratch_len) };
                RawBuf {
                    addr: pool.addr(),
                    len: scratch_len,
                }
            }
            _ => RawBuf::default(),
        };
        let bufs = [input, output, sbuf];
        let mut q = std::mem::take(&mut self.spare);
        q.reset(self.world);
        let mut lkeys = [0u32; 3];
        let mut rkeys = [0u32; 3];
        for (i, b) in bufs.iter().enumerate() {
            if b.len == 0 {
                continue;
            }
            // Output and scratch may be written by peers that got a clear-to-send for them.
            let access = if i == 0 {
                Access::LOCAL_READ
            } else {
                Access::LOCAL_READ.union(Access::REMOTE_WRITE)
            };
            // Pooled scratch has its registration; fresh scratch is registered for this
            // operation only; caller buffers go through the cache.
            let cacheable = i < 2;
            let cached = if cacheable {
                self.regs.lookup(b.addr, b.len, access)
            } else if pooled {
                self.scratch_pool.as_ref().map(|(_, mr)| *mr)
            } else {
                None
            };
            let mr = match cached {
                Some(mr) => mr,
                None => {
                    // SAFETY: the caller keeps these buffers valid for the operation and leaves
                    // them alone until it ends; peers write into them only during our progress
                    // calls (tcp, shm) or before the completion we wait for (mem), and only
                    // after a clear-to-send of the running operation. A cached registration
                    // outlives the operation, but no clear-to-send names it afterwards.
                    let mr = unsafe { self.ep.register(b.addr as *mut u8, b.len, access) }
                        .map_err(|e| Error::transport(self.rank, "register buffer", e))?;
                    if cacheable {
                        if let Some(old) = self.regs.insert(mr) {
                            self.ep.deregister(&old);
                        }
                    } else {
                        q.mrs.push(mr);
                    }
                    mr
                }
            };
            lkeys[i] = mr.lkey;
            rkeys[i] = mr.rkey;
        }
        // Bounds of every op against the buffers, so no peer or generator bug can reach
        // outside them.
        for op in prog.ops() {
            let locs: &[Loc] = match op {
                Op::Send { src, .. } => &[*src],
                Op::Recv {
                    dst,
                    reduce_with: Some(w),
                    ..
                } => &[*dst, *w],
                Op::Recv { dst, .. } => &[*dst],
                Op::Copy { src, dst, .. } => &[*src, *dst],
                Op::Finalize { loc, .. } => &[*loc],
            };
            for l in locs {
                let b = bufs[buf_index(l.buf)];
                if (l.start + op.len()) * dsize > b.len {
                    for mr in &q.mrs {
                        self.ep.deregister(mr);
                    }
                    return Err(Error::Internal {
                        rank: self.rank,
                        msg: format!(
                            "{sig}: schedule op {op:?} reaches past the {:?} buffer of {} bytes",
                            l.buf, b.len
                        ),
                    });
                }
            }
        }
        let peers = prog.ops().iter().filter_map(|op| match *op {
            Op::Send { peer, .. } | Op::Recv { peer, .. } => Some(peer),
            _ => None,
        });
        let (record, started) = self.begin(&sig, algo, peers);
        self.running = Some(Running {
            sig,
            sched,
            params,
            bufs,
            lkeys,
            rkeys,
            _scratch: scratch,
            q,
            record,
            started,
            eager: None,
        });
        Ok(())
    }

    /// The bookkeeping of an operation that starts now: sequence numbers, the engine's clock,
    /// and its flight record (with the ranks it exchanges data with). Returns the record's
    /// handle and the start time.
    fn begin(
        &mut self,
        sig: &Signature,
        algo: &'static str,
        peers: impl Iterator<Item = usize>,
    ) -> (usize, Instant) {
        self.last_seq = sig.seq;
        if sig.coll != Collective::SendRecv {
            self.last_coll_seq = sig.seq;
        }
        let started = Instant::now();
        self.now_coarse = started;
        let record = self.recorder.start_with(started, |rec| {
            rec.seq = sig.seq;
            rec.op = sig.coll.name().into();
            rec.dtype = sig.dtype.name().into();
            rec.count = sig.count;
            rec.algorithm = algo.into();
            rec.bytes = sig.count * sig.dtype.size() as u64;
            if matches!(sig.coll, Collective::Broadcast | Collective::Reduce) {
                rec.root = Some(sig.root);
            }
            rec.peers.extend(peers);
            rec.peers.sort_unstable();
            rec.peers.dedup();
        });
        (record, started)
    }

    /// Whether an all-reduce of `bytes` runs eagerly here. The answer must be the same on
    /// every rank, so it depends only on the call and on settings that are alike everywhere.
    pub(crate) fn eager_fits(&self, bytes: usize) -> bool {
        bytes > 0 && bytes <= self.eager_limit() && self.world > 1 && self.world <= EAGER_WORLD_MAX
    }

    /// A peer's board posting for the collective this rank runs through a schedule: a
    /// mismatch naming both calls.
    fn board_mismatch(&mut self) -> Result<(), Error> {
        let Some(r) = self.running.as_ref() else {
            return Ok(());
        };
        if r.eager.is_some() || r.sig.coll == Collective::SendRecv {
            return Ok(());
        }
        let (ours, rank) = (r.sig, self.rank);
        for p in (0..self.world).filter(|&p| p != rank) {
            // No eager operation runs: its buffers are free.
            let buf = &mut self.eager_parts[p];
            if let Some(theirs) =
                board_posting(self.ep.as_mut(), rank, self.comm_id, p, ours.seq, buf)?
            {
                return Err(Error::Mismatch {
                    rank: self.rank,
                    peer: p,
                    ours,
                    theirs,
                    detail: eager_detail(&ours, &theirs, self.rank, p),
                });
            }
        }
        Ok(())
    }

    /// Lets eager all-reduces go through the transport's board when the smallest board of
    /// all ranks, `smallest` bytes (0: some rank has none), holds the largest eager message.
    /// Every rank must pass the same value, since [`eager_fits`](Self::eager_fits) depends on
    /// the outcome.
    pub(crate) fn enable_board(&mut self, smallest: usize) {
        self.board = smallest >= BOARD_EAGER_MAX + EAGER_HDR;
    }

    /// Whether eager all-reduces go through the transport's board.
    pub(crate) fn board(&self) -> bool {
        self.board
    }

    /// The largest all-reduce that runs eagerly (with no forced algorithm and at most
    /// [`EAGER_WORLD_MAX`] ranks): the path's own limit, lowered by `GRADSYNC_EAGER_MAX`.
    pub(crate) fn eager_limit(&self) -> usize {
        let path = if self.board {
            BOARD_EAGER_DEFAULT
        } else {
            EAGER_MAX
        };
        path.min(self.opts.eager_max)
    }

    /// The plan of an eager all-reduce.
    pub(crate) fn eager_planned(&mut self) -> Planned {
        let sched = self
            .empty_sched
            .take()
            .unwrap_or_else(|| Box::new(Schedule::new(Program::new(), self.world)));
        Planned {
            sched,
            params: None,
            eager: true,
        }
    }

    /// Starts an eager all-reduce: this rank's whole buffer goes to every peer in one
    /// two-sided message, and the result is every contribution reduced in rank order once all
    /// have arrived (so it is the same bits on every rank). One message latency whatever the
    /// world, no slots and no schedule: the path of small all-reduces.
    fn start_eager(
        &mut self,
        sig: Signature,
        sched: Box<Schedule>,
        algo: &'static str,
        input: RawBuf,
        output: RawBuf,
    ) -> Result<(), Error> {
        let bytes = sig.count as usize * sig.dtype.size();
        if sig.coll != gradsync_core::Collective::AllReduce
            || !self.eager_fits(bytes)
            || input.len < bytes
            || output.len < bytes
        {
            self.empty_sched = Some(sched);
            return Err(Error::Internal {
                rank: self.rank,
                msg: format!(
                    "{sig}: cannot run eagerly ({bytes} bytes, buffers of {} and {} bytes, world {})",
                    input.len, output.len, self.world
                ),
            });
        }
        let w = self.world;
        let mut m = std::mem::take(&mut self.eager_msg);
        m.clear();
        m.extend_from_slice(&[CTRL_EAGER, sig.coll as u8, sig.dtype as u8, sig.op as u8]);
        m.extend_from_slice(&sig.root.to_le_bytes());
        m.extend_from_slice(&sig.comm_id.to_le_bytes());
        m.extend_from_slice(&sig.seq.to_le_bytes());
        m.extend_from_slice(&sig.count.to_le_bytes());
        debug_assert_eq!(m.len(), EAGER_HDR);
        // SAFETY: the caller guarantees `input` readable for its length, checked >= bytes.
        let own = unsafe { std::slice::from_raw_parts(input.addr as *const u8, bytes) };
        m.extend_from_slice(own);
        self.eager_msg = m;
        if self.board {
            self.ep.board_watch(sig.seq);
        }
        let missing = (0..w)
            .filter(|&p| p != self.rank)
            .fold(0u32, |m, p| m | 1 << p);
        let rank = self.rank;
        let (record, started) = self.begin(&sig, algo, (0..w).filter(|&p| p != rank));
        // An eager operation leaves the queues alone: sized, they are all it needs.
        let mut q = std::mem::take(&mut self.spare);
        if q.recvq.len() != w {
            q.reset(w);
        }
        self.running = Some(Running {
            sig,
            sched,
            params: None,
            bufs: [input, output, RawBuf::default()],
            lkeys: [0; 3],
            rkeys: [0; 3],
            _scratch: None,
            q,
            record,
            started,
            eager: Some(EagerRun {
                missing,
                unsent: true,
            }),
        });
        Ok(())
    }

    /// Takes the running eager all-reduce's contributions that have arrived, and reduces once
    /// all are there. Returns whether anything moved.
    fn eager_absorb(&mut self) -> Result<bool, Error> {
        let Some(r) = self.running.as_mut() else {
            return Ok(false);
        };
        let Some(mut e) = r.eager else {
            // A peer's eager message for an operation this rank runs through a schedule.
            if r.sig.coll == Collective::SendRecv || self.eager_in.iter().all(VecDeque::is_empty) {
                return Ok(false);
            }
            for (p, q) in self.eager_in.iter().enumerate() {
                if let Some((theirs, _)) = q.iter().find(|(s, _)| s.seq <= r.sig.seq) {
                    return Err(Error::Mismatch {
                        rank: self.rank,
                        peer: p,
                        ours: r.sig,
                        theirs: *theirs,
                        detail: eager_detail(&r.sig, theirs, self.rank, p),
                    });
                }
            }
            return Ok(false);
        };
        let sig = r.sig;
        let bytes = sig.count as usize * sig.dtype.size();
        let mut moved = false;
        if e.unsent && self.board {
            // Refused while a peer has not released the posting two operations back.
            if self
                .ep
                .board_post(sig.seq, &self.eager_msg)
                .map_err(|e| Error::transport(self.rank, "eager post", e))?
            {
                e.unsent = false;
                r.eager = Some(e);
                moved = true;
            }
        } else if e.unsent {
            e.unsent = false;
            r.eager = Some(e);
            for p in (0..self.world).filter(|&p| p != self.rank) {
                self.ep
                    .post_send(p, &self.eager_msg, 0)
                    .map_err(|e| Error::transport(self.rank, "eager send", e))?;
            }
            moved = true;
        }
        let mut missing = e.missing;
        for p in 0..self.world {
            if missing & (1 << p) == 0 {
                continue;
            }
            // Its message, or its posting on the board.
            let q = &mut self.eager_in[p];
            let found = match q.iter().position(|(s, _)| s.seq <= sig.seq) {
                Some(i) => q.remove(i),
                None if self.board => {
                    let buf = &mut self.eager_parts[p];
                    board_posting(self.ep.as_mut(), self.rank, self.comm_id, p, sig.seq, buf)?
                        .map(|theirs| (theirs, std::mem::take(buf)))
                }
                None => None,
            };
            if let Some((theirs, data)) = found {
                if theirs != sig || data.len() != EAGER_HDR + bytes {
                    return Err(Error::Mismatch {
                        rank: self.rank,
                        peer: p,
                        ours: sig,
                        theirs,
                        detail: String::new(),
                    });
                }
                self.eager_parts[p] = data;
                missing &= !(1 << p);
                moved = true;
                continue;
            }
            // The peer sent its part of this operation through slots: it runs it differently.
            let ps = &self.peers[p];
            let k = ps.slot(ps.rx_ctr);
            if ps.arrived[k] {
                let base = (p * self.opts.nslots + k) * self.stride;
                // SAFETY: the slot's write has completed (its notification arrived) and the
                // sender writes it again only after its credit comes back.
                let hdr = unsafe {
                    std::slice::from_raw_parts(self.inbox.ptr.add(base), DATA_HEADER_LEN)
                };
                if let Ok(h) = DataHeaderRepr::parse(&DataHeader::new_unchecked(hdr))
                    && h.sig.seq == sig.seq
                    && h.sig.coll != Collective::SendRecv
                {
                    return Err(Error::Mismatch {
                        rank: self.rank,
                        peer: p,
                        ours: sig,
                        theirs: h.sig,
                        detail: eager_detail(&sig, &h.sig, p, self.rank),
                    });
                }
            }
        }
        let unsent = r.eager.is_some_and(|e| e.unsent);
        if moved {
            r.eager = Some(EagerRun { missing, unsent });
        }
        if moved && missing == 0 && unsent {
            // Every peer posted, but this rank's posting still waits for its slot (a peer had
            // not released the one two operations back when this round tried): the operation
            // is not done until it is out, or that peer would wait for it in vain.
            return Ok(moved);
        }
        if moved && missing == 0 && self.board {
            // Every posting of this operation has been copied out: peers may reuse its slots.
            self.ep
                .board_release(sig.seq)
                .map_err(|e| Error::transport(self.rank, "eager release", e))?;
        }
        if moved && missing == 0 {
            let out = r.bufs[1];
            // SAFETY: the caller of `start` keeps `output` writable for its length, checked
            // >= bytes, and leaves it alone until the operation ends; the stage is separate.
            let out = unsafe { std::slice::from_raw_parts_mut(out.addr as *mut u8, bytes) };
            let (rank, own, parts) = (self.rank, &self.eager_msg, &self.eager_parts);
            reduce_rank_order(sig.dtype, sig.op, out, self.world, |p| {
                let m = if p == rank { own } else { &parts[p] };
                &m[EAGER_HDR..]
            });
        }
        Ok(moved)
    }

    /// An eager message from `peer`: kept until the operation it belongs to takes it.
    fn eager_arrived(&mut self, peer: usize, data: Vec<u8>) -> Result<(), Error> {
        let theirs = parse_eager(self.rank, peer, self.comm_id, &data)?;
        let bad = |what: String| Error::Protocol {
            rank: self.rank,
            peer,
            msg: format!("eager all-reduce message of {} bytes: {what}", data.len()),
        };
        // A peer cannot have passed an operation of this rank's that needs its message: one for
        // an operation this rank has finished is a protocol error. (One for the operation it
        // runs through a schedule is a mismatch, which `eager_absorb` reports.) Send/recv
        // numbers its operations per peer, apart from the collectives.
        let current = match &self.running {
            Some(r) if r.sig.coll != Collective::SendRecv => Some(r.sig),
            _ => None,
        };
        let done = current.map_or(self.last_coll_seq, |s| s.seq - 1);
        if theirs.seq <= done {
            return Err(bad(format!(
                "{theirs} arrived after this rank finished seq {done}"
            )));
        }
        if self.eager_in[peer].len() >= EAGER_AHEAD_MAX {
            return Err(bad(format!(
                "more than {EAGER_AHEAD_MAX} eager messages ahead of this rank"
            )));
        }
        self.eager_in[peer].push_back((theirs, data));
        Ok(())
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
            Err(e) => {
                let e = self.abort_behind(e);
                self.fail(&e);
                Err(e)
            }
        }
    }

    /// A lost connection may be the consequence of an abort whose message is already here (the
    /// aborting rank's message arrived, then a third rank that read it closed): report the
    /// abort, the cause, rather than the connection.
    fn abort_behind(&mut self, e: Error) -> Error {
        if !matches!(e, Error::Transport { .. } | Error::PeerLost { .. }) {
            return e;
        }
        let mut comps = Vec::new();
        if self.ep.poll(&mut comps).is_err() {
            return e;
        }
        for c in comps {
            if let Err(a @ Error::PeerAborted { .. }) = self.handle_completion(c) {
                return a;
            }
        }
        e
    }

    fn finish(&mut self) {
        if let Some(mut r) = self.running.take() {
            for mr in &r.q.mrs {
                self.ep.deregister(mr);
            }
            self.spare = std::mem::take(&mut r.q);
            if r.is_done() {
                self.recorder.finish(r.record, OpState::Completed, None);
                if r.eager.is_some() {
                    self.empty_sched = Some(r.sched);
                } else if let Some(p) = r.params {
                    if self.sched_cache.len() >= SCHEDULE_CACHE {
                        self.sched_cache.remove(0);
                    }
                    self.sched_cache.push((p, r.sched));
                }
            }
        }
    }

    /// A program planned outside the cache (send/recv), run once.
    pub(crate) fn one_off(&self, prog: Program) -> Planned {
        Planned {
            sched: Box::new(Schedule::new(prog, self.world)),
            params: None,
            eager: false,
        }
    }

    /// The schedule of `params`: a finished one restarted when the same parameters ran
    /// recently, else newly generated.
    pub(crate) fn schedule_for(&mut self, params: &Params) -> Result<Planned, PlanError> {
        if let Some(i) = self.sched_cache.iter().rposition(|(p, _)| p == params) {
            let (p, mut sched) = self.sched_cache.remove(i);
            sched.restart();
            return Ok(Planned {
                sched,
                params: Some(p),
                eager: false,
            });
        }
        let mut planned = self.one_off(plan::build(params)?);
        planned.params = Some(*params);
        Ok(planned)
    }

    /// Poisons the communicator and tells every peer why (best effort).
    pub(crate) fn fail(&mut self, e: &Error) {
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
        match self.recorder.dump(if matches!(e, Error::Timeout { .. }) {
            "timeout"
        } else {
            "failure"
        }) {
            Ok(path) => {
                tracing::warn!(target: "gradsync::coll", "rank {}: flight recorder written to {}", self.rank, path.display())
            }
            Err(err) => {
                tracing::warn!(target: "gradsync::coll", "rank {}: could not write the flight recorder: {err}", self.rank)
            }
        }
        if !matches!(e, Error::PeerAborted { .. }) {
            let mut data = vec![CTRL_ABORT];
            data.extend_from_slice(
                &msg.as_bytes()[..msg.len().min(gradsync_transport::MAX_SEND - 1)],
            );
            for p in (0..self.world).filter(|&p| p != self.rank) {
                let _ = self.ep.post_send(p, &data, 0);
            }
            let mut sink = Vec::new();
            let _ = self.ep.poll(&mut sink);
        }
        // Buffers of a failed operation are never touched again.
        self.finish();
    }

    fn progress_inner(&mut self, block: bool) -> Result<bool, Error> {
        let deadline = self
            .running
            .as_ref()
            .map(|r| r.started + self.opts.timeout)
            .expect("running");
        let mut idle_since: Option<Instant> = None;
        let mut credits_flushed = false;
        let mut idle_polls: u32 = 0;
        let mut busy = self.opts.busy_spin > Duration::ZERO;
        loop {
            let moved = self.step()?;
            if self.running.as_ref().is_some_and(Running::is_done) {
                // Credits below the batch threshold are returned the next time this rank waits,
                // off the critical path of small messages.
                return Ok(true);
            }
            if !block {
                if !moved {
                    self.return_credits(true)?;
                }
                return Ok(false);
            }
            if moved {
                idle_since = None;
                credits_flushed = false;
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
            if self.board && now - since >= IDLE_CREDIT_RETURN && now >= self.next_board_check {
                // A peer that runs this operation eagerly posts on its board and sends
                // nothing this rank's schedule waits for: look for such a posting now and then.
                self.next_board_check = now + BOARD_CHECK_EVERY;
                self.board_mismatch()?;
            }
            if !credits_flushed && now - since >= IDLE_CREDIT_RETURN {
                // Nothing moved for a while: a good moment to hand back every slot, in case the
                // peer is the one waiting for them. (Steps return them in batches of half the
                // slots, so a peer always keeps at least one; this only shortens its wait.)
                self.return_credits(true)?;
                credits_flushed = true;
            }
            if now >= deadline {
                return Err(self.diagnose_timeout());
            }
            if now - since >= self.opts.spin {
                self.check_peers_alive()?;
                let left = deadline - now;
                self.ep
                    .wait(left.min(Duration::from_millis(200)))
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

    /// One round: issue ready ops, post sends, poll, consume arrivals. Returns whether anything
    /// moved.
    fn step(&mut self) -> Result<bool, Error> {
        let mut moved = self.issue()?;
        moved |= self.post_sends()?;
        self.comps.clear();
        let rank = self.rank;
        self.ep
            .poll(&mut self.comps)
            .map_err(|e| Error::transport(rank, "poll", e))?;
        if !self.comps.is_empty() {
            moved = true;
            let mut comps = std::mem::take(&mut self.comps);
            for c in comps.drain(..) {
                self.handle_completion(c)?;
            }
            self.comps = comps;
        }
        moved |= self.consume()?;
        moved |= self.eager_absorb()?;
        self.return_credits(false)?;
        Ok(moved)
    }

    fn issue(&mut self) -> Result<bool, Error> {
        let mut moved = false;
        let Some(r) = self.running.as_mut() else {
            return Ok(false);
        };
        let dt = r.sig.dtype;
        while let Some((id, op)) = r.sched.poll_action() {
            moved = true;
            match op {
                Op::Send { peer, src, len } => r.q.sendq[peer].push_back((id, len, src)),
                Op::Recv {
                    peer,
                    dst,
                    reduce_with,
                    len,
                } => {
                    let msg = r.q.recv_issued[peer];
                    r.q.recv_issued[peer] += 1;
                    let bytes = len * dt.size();
                    let mut direct = reduce_with.is_none()
                        && !self.opts.checksum
                        && bytes > 0
                        && bytes >= self.peers[peer].direct_min
                        && bytes <= u32::MAX as usize;
                    if direct {
                        let cts = Cts {
                            rkey: r.rkeys[buf_index(dst.buf)],
                            offset: (dst.start * dt.size()) as u64,
                            bytes: bytes as u32,
                            sig: r.sig,
                        };
                        match self.ep.post_send(peer, &cts.encode(msg), 0) {
                            Ok(()) => {}
                            // A peer that has finished and closed already sent this message
                            // through a slot; a peer that died is reported while we wait for it.
                            Err(TransportError::PeerClosed { .. }) => direct = false,
                            Err(_) if !self.ep.peer_alive(peer) => direct = false,
                            Err(e) => return Err(Error::transport(self.rank, "clear to send", e)),
                        }
                    }
                    r.q.recvq[peer].push_back(PostedRecv {
                        id,
                        len,
                        dst,
                        with: reduce_with,
                        msg,
                        direct,
                    });
                }
                Op::Copy { src, dst, len } => {
                    let (s, d) = (slice(&r.bufs, src, len, dt), slice(&r.bufs, dst, len, dt));
                    if s.addr != d.addr && len > 0 {
                        // SAFETY: both spans were bounds-checked in `start`; distinct buffers
                        // (or distinct positions) of one operation never overlap partially in
                        // generated programs, and `copy` tolerates overlap anyway.
                        unsafe { std::ptr::copy(s.addr as *const u8, d.addr as *mut u8, s.len) };
                    }
                    r.sched.handle_complete(id);
                }
                Op::Finalize { loc, len } => {
                    let d = slice(&r.bufs, loc, len, dt);
                    if len > 0 {
                        // SAFETY: bounds-checked in `start`; the engine has exclusive access.
                        let b = unsafe { std::slice::from_raw_parts_mut(d.addr as *mut u8, d.len) };
                        gradsync_reduce::finalize_avg(dt, b, self.world);
                    }
                    r.sched.handle_complete(id);
                }
            }
        }
        Ok(moved)
    }

    fn post_sends(&mut self) -> Result<bool, Error> {
        let mut moved = false;
        let Some(r) = self.running.as_mut() else {
            return Ok(false);
        };
        let dsize = r.sig.dtype.size();
        let checksum = self.opts.checksum;
        for peer in 0..self.world {
            while let Some(&(id, len, src)) = r.q.sendq[peer].front() {
                let ps = &mut self.peers[peer];
                let bytes = len * dsize;
                let m = r.q.send_msg[peer];
                if !ps.cts.is_empty() {
                    let seq = r.sig.seq;
                    ps.cts.retain(|&(s, k), _| s > seq || (s == seq && k >= m));
                }
                // A direct write has no header to carry a checksum: with checksums on, an offer
                // (from a peer configured otherwise) is dropped and the message goes through a
                // slot, which the receiver accepts for a direct receive too.
                if let Some(cts) = ps.cts.remove(&(r.sig.seq, m)).filter(|_| !checksum) {
                    if cts.sig.coll != r.sig.coll
                        || cts.sig.dtype != r.sig.dtype
                        || cts.sig.op != r.sig.op
                        || cts.sig.count != r.sig.count as u32 as u64
                        || cts.sig.root != r.sig.root
                        || cts.bytes as usize != bytes
                    {
                        return Err(Error::Mismatch {
                            rank: self.rank,
                            peer,
                            ours: r.sig,
                            theirs: cts.sig,
                            detail: format!(
                                "rank {peer} asked for message {m} of {} bytes where rank {} sends {bytes} bytes",
                                cts.bytes, self.rank
                            ),
                        });
                    }
                    r.q.sendq[peer].pop_front();
                    r.q.send_msg[peer] += 1;
                    let sge = [Sge {
                        addr: slice(&r.bufs, src, len, r.sig.dtype).addr,
                        len: bytes,
                        lkey: r.lkeys[buf_index(src.buf)],
                    }];
                    let wr = self.next_wr;
                    self.next_wr += 1;
                    let remote = RemoteRegion {
                        addr: 0,
                        rkey: cts.rkey,
                        len: cts.offset + bytes as u64,
                    };
                    // SAFETY: the payload lies in a buffer the caller keeps valid and unmodified
                    // for the operation, and the schedule does not overwrite it before this send
                    // completes.
                    unsafe {
                        self.ep
                            .post_write(peer, &sge, remote, cts.offset, Some(IMM_DIRECT | m), wr)
                    }
                    .map_err(|e| Error::transport(self.rank, "post_write", e))?;
                    r.q.inflight.insert(wr, (id, peer, usize::MAX));
                    moved = true;
                    continue;
                }
                let k = ps.slot(ps.tx_ctr);
                if ps.credits == 0 || ps.hdr_busy[k] {
                    break;
                }
                r.q.sendq[peer].pop_front();
                let hdr_off = (peer * self.opts.nslots + k) * DATA_HEADER_LEN;
                // SAFETY: the header staging area is owned by the engine; slot (peer, k) is not
                // in flight (hdr_busy is false).
                let hb = unsafe {
                    std::slice::from_raw_parts_mut(self.hdrs.ptr.add(hdr_off), DATA_HEADER_LEN)
                };
                let crc32c = checksum.then(|| {
                    let p = slice(&r.bufs, src, len, r.sig.dtype);
                    if p.len == 0 {
                        return crc32c::crc32c(&[]);
                    }
                    // SAFETY: bounds-checked in `start`; the caller keeps the buffer valid and
                    // the schedule does not modify this span before the send completes.
                    crc32c::crc32c(unsafe {
                        std::slice::from_raw_parts(p.addr as *const u8, p.len)
                    })
                });
                DataHeaderRepr {
                    sig: r.sig,
                    msg: r.q.send_msg[peer],
                    payload_len: bytes as u32,
                    sender: self.rank as u32,
                    crc32c,
                }
                .emit(&mut DataHeader::new_unchecked(hb));
                r.q.send_msg[peer] += 1;
                let mut sges = [
                    Sge {
                        addr: self.hdrs.addr() + hdr_off,
                        len: DATA_HEADER_LEN,
                        lkey: self.hdr_mr.lkey,
                    },
                    Sge {
                        addr: 0,
                        len: 0,
                        lkey: 0,
                    },
                ];
                let n = if bytes > 0 {
                    sges[1] = Sge {
                        addr: slice(&r.bufs, src, len, r.sig.dtype).addr,
                        len: bytes,
                        lkey: r.lkeys[buf_index(src.buf)],
                    };
                    2
                } else {
                    1
                };
                let offset = ((self.rank * self.opts.nslots + k) * self.stride) as u64;
                let wr = self.next_wr;
                self.next_wr += 1;
                // SAFETY: the header slot stays untouched until WriteDone (hdr_busy); the
                // payload lies in a buffer the caller keeps valid and unmodified for the
                // operation, and the schedule does not overwrite it before this send completes.
                unsafe {
                    self.ep.post_write(
                        peer,
                        &sges[..n],
                        ps.remote_inbox,
                        offset,
                        Some(ps.tx_ctr as u32 & !IMM_DIRECT),
                        wr,
                    )
                }
                .map_err(|e| Error::transport(self.rank, "post_write", e))?;
                ps.credits -= 1;
                ps.hdr_busy[k] = true;
                ps.tx_ctr += 1;
                r.q.inflight.insert(wr, (id, peer, k));
                moved = true;
            }
        }
        Ok(moved)
    }

    fn handle_completion(&mut self, c: Completion) -> Result<(), Error> {
        match c {
            Completion::WriteDone { wr_id } => {
                if let Some(r) = self.running.as_mut()
                    && let Some((id, peer, k)) = r.q.inflight.remove(&wr_id)
                {
                    if k != usize::MAX {
                        self.peers[peer].hdr_busy[k] = false;
                    }
                    r.sched.handle_complete(id);
                }
            }
            Completion::SendDone { .. } => {}
            Completion::WriteImm { peer, imm, len } if imm & IMM_DIRECT != 0 => {
                let msg = imm & !IMM_DIRECT;
                let ok = self.running.as_ref().is_some_and(|r| {
                    r.q.recvq[peer].iter().any(|pr| {
                        pr.direct && pr.msg == msg && pr.len * r.sig.dtype.size() == len as usize
                    })
                });
                if !ok {
                    return Err(Error::Protocol {
                        rank: self.rank,
                        peer,
                        msg: format!(
                            "direct write of message {msg} ({len} bytes) that no clear-to-send asked for"
                        ),
                    });
                }
                let r = self.running.as_mut().expect("running");
                r.q.direct_arrived[peer].push(msg);
                self.peers[peer].last_heard = Some((self.now_coarse, r.sig.seq));
            }
            Completion::WriteImm { peer, imm, len } => {
                let ps = &mut self.peers[peer];
                // The immediate is the message counter's low 31 bits (the top one marks direct
                // writes); its distance from the next expected message gives the full counter
                // (and so the slot, whatever the window) once it is known to lie within the
                // window.
                let expect_lo = ps.rx_ctr as u32 & !IMM_DIRECT;
                let ahead = (imm.wrapping_sub(expect_lo) & !IMM_DIRECT) as usize;
                let k = ps.slot(ps.rx_ctr + ahead as u64);
                if ahead >= ps.window || ps.arrived[k] || len as usize > self.stride {
                    return Err(Error::Protocol {
                        rank: self.rank,
                        peer,
                        msg: format!(
                            "unexpected write notification {imm} ({len} bytes); expected one of the next {} after {expect_lo}",
                            ps.window
                        ),
                    });
                }
                ps.arrived[k] = true;
                ps.last_heard = Some((self.now_coarse, ps.last_heard.map_or(0, |l| l.1)));
            }
            Completion::Recv { peer, data } => {
                let seq = self.running.as_ref().map_or(self.last_seq, |r| r.sig.seq);
                self.peers[peer].last_heard = Some((self.now_coarse, seq));
                if data.first() == Some(&CTRL_EAGER) {
                    // Kept whole until its operation reduces it.
                    self.eager_arrived(peer, data)?;
                } else {
                    self.handle_control(peer, &data)?;
                }
            }
        }
        Ok(())
    }

    /// A two-sided control message from `peer`: credits, clear-to-send, probes, aborts.
    fn handle_control(&mut self, peer: usize, data: &[u8]) -> Result<(), Error> {
        let peer = &peer;
        match data.first() {
            Some(&CTRL_CREDIT) if data.len() == 8 => {
                let n = u32::from_le_bytes(data[4..8].try_into().expect("4")) as usize;
                let ps = &mut self.peers[*peer];
                if ps.credits + n > ps.window {
                    return Err(Error::Protocol {
                        rank: self.rank,
                        peer: *peer,
                        msg: format!(
                            "returned {n} credits while {} of {} were free",
                            ps.credits, ps.window
                        ),
                    });
                }
                ps.credits += n;
            }
            Some(&CTRL_CTS) => {
                let (msg, cts) =
                    Cts::decode(data, self.comm_id).ok_or_else(|| Error::Protocol {
                        rank: self.rank,
                        peer: *peer,
                        msg: format!("malformed clear-to-send of {} bytes", data.len()),
                    })?;
                let ps = &mut self.peers[*peer];
                if ps.cts.len() >= 1 << 16 {
                    return Err(Error::Protocol {
                        rank: self.rank,
                        peer: *peer,
                        msg: "more than 65536 clear-to-send offers outstanding".into(),
                    });
                }
                ps.cts.insert((cts.sig.seq, msg), cts);
            }
            Some(&CTRL_PROBE) => {
                let (seq, inside) = match &self.running {
                    Some(r) => (r.sig.seq, true),
                    None => (self.last_seq, false),
                };
                let mut m = [0u8; 16];
                m[0] = CTRL_PROBE_REPLY;
                m[1] = inside as u8;
                m[8..16].copy_from_slice(&seq.to_le_bytes());
                // Best effort: a peer that cannot be answered is already failing.
                let _ = self.ep.post_send(*peer, &m, 0);
            }
            Some(&CTRL_PROBE_REPLY) if data.len() == 16 => {
                let seq = u64::from_le_bytes(data[8..16].try_into().expect("8"));
                self.probe_replies[*peer] = Some((seq, data[1] != 0));
            }
            Some(&CTRL_ABORT) => {
                let why = String::from_utf8_lossy(&data[1..]).into_owned();
                return Err(Error::PeerAborted {
                    rank: self.rank,
                    peer: *peer,
                    reason: why,
                });
            }
            _ => {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: *peer,
                    msg: format!("unknown control message of {} bytes", data.len()),
                });
            }
        }
        Ok(())
    }

    /// Consumes arrived messages that match posted receives, in order per peer.
    fn consume(&mut self) -> Result<bool, Error> {
        let mut moved = false;
        let Some(r) = self.running.as_mut() else {
            return Ok(false);
        };
        let dt = r.sig.dtype;
        let streaming = r.sig.count.saturating_mul(dt.size() as u64) >= STREAMING_OP_MIN as u64;
        let op = if r.sig.op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            r.sig.op
        };
        for peer in 0..self.world {
            while let Some(&PostedRecv {
                id,
                len,
                dst,
                with,
                msg,
                direct,
            }) = r.q.recvq[peer].front()
            {
                if direct && let Some(i) = r.q.direct_arrived[peer].iter().position(|&m| m == msg) {
                    // Landed in place: nothing to copy.
                    r.q.direct_arrived[peer].swap_remove(i);
                    r.q.recvq[peer].pop_front();
                    r.sched.handle_complete(id);
                    moved = true;
                    continue;
                }
                let ps = &mut self.peers[peer];
                let k = ps.slot(ps.rx_ctr);
                if !ps.arrived[k] {
                    break;
                }
                let base = (peer * self.opts.nslots + k) * self.stride;
                // SAFETY: the slot's write has completed (its notification arrived) and the
                // sender writes it again only after we return its credit below.
                let slot =
                    unsafe { std::slice::from_raw_parts(self.inbox.ptr.add(base), self.stride) };
                let h = DataHeaderRepr::parse(&DataHeader::new_unchecked(&slot[..DATA_HEADER_LEN]))
                    .map_err(|e| Error::Protocol {
                        rank: self.rank,
                        peer,
                        msg: format!("bad data header: {e}"),
                    })?;
                let bytes = len * dt.size();
                let same_call = h.sig.seq == r.sig.seq && h.sig.coll == r.sig.coll;
                if direct && (h.sig.seq != r.sig.seq || (same_call && h.msg > msg)) {
                    // The message we wait for is coming straight into place; the slot holds a
                    // later one.
                    break;
                }
                if h.sig != r.sig
                    || h.msg != msg
                    || h.payload_len as usize != bytes
                    || h.sender as usize != peer
                {
                    return Err(Error::Mismatch {
                        rank: self.rank,
                        peer,
                        ours: r.sig,
                        theirs: h.sig,
                        detail: if h.sig == r.sig {
                            format!(
                                "message {} of {} bytes where message {msg} of {bytes} bytes was expected",
                                h.msg, h.payload_len
                            )
                        } else {
                            String::new()
                        },
                    });
                }
                ps.last_heard = Some((self.now_coarse, h.sig.seq));
                // Verified before anything is reduced or copied: a damaged payload never
                // reaches the caller's buffer.
                match h.crc32c {
                    Some(expected) => {
                        let got = crc32c::crc32c(&slot[DATA_HEADER_LEN..DATA_HEADER_LEN + bytes]);
                        if got != expected {
                            return Err(Error::Corrupt {
                                rank: self.rank,
                                peer,
                                sig: r.sig,
                                msg,
                                expected,
                                got,
                            });
                        }
                    }
                    None if self.opts.checksum => {
                        return Err(Error::Protocol {
                            rank: self.rank,
                            peer,
                            msg: format!(
                                "{}: message {msg} carries no checksum but GRADSYNC_CHECKSUM=1 on rank {}; set it alike on every rank",
                                r.sig, self.rank
                            ),
                        });
                    }
                    None => {}
                }
                if bytes > 0 {
                    let payload = &slot[DATA_HEADER_LEN..DATA_HEADER_LEN + bytes];
                    let d = slice(&r.bufs, dst, len, dt);
                    // SAFETY: bounds-checked in `start`; exclusive to the engine.
                    let dbuf = unsafe { std::slice::from_raw_parts_mut(d.addr as *mut u8, d.len) };
                    match with {
                        // The last copy of a large operation: its destination is not read
                        // again soon, and it is larger than the caches anyway.
                        None if streaming => gradsync_reduce::copy_streaming(dbuf, payload),
                        None => dbuf.copy_from_slice(payload),
                        Some(w) if w == dst => {
                            gradsync_reduce::reduce_in_place(dt, op, dbuf, payload)
                        }
                        Some(w) => {
                            let wv = slice(&r.bufs, w, len, dt);
                            if ranges_overlap(wv, d) {
                                return Err(Error::Internal {
                                    rank: self.rank,
                                    msg: format!(
                                        "{}: schedule reduces between overlapping spans",
                                        r.sig
                                    ),
                                });
                            }
                            // SAFETY: bounds-checked in `start`, and not overlapping `d`.
                            let wbuf =
                                unsafe { std::slice::from_raw_parts(wv.addr as *const u8, wv.len) };
                            gradsync_reduce::reduce_into(dt, op, dbuf, wbuf, payload);
                        }
                    }
                }
                ps.arrived[k] = false;
                ps.rx_ctr += 1;
                ps.unreturned += 1;
                r.q.recvq[peer].pop_front();
                r.sched.handle_complete(id);
                moved = true;
            }
        }
        Ok(moved)
    }

    /// Returns consumed slots to their senders: at once when `all`, else once half the slots
    /// of a peer are waiting.
    fn return_credits(&mut self, all: bool) -> Result<(), Error> {
        for peer in 0..self.world {
            let n = self.peers[peer].unreturned;
            if n == 0 || (!all && (n as usize) < self.peers[peer].window.div_ceil(2)) {
                continue;
            }
            let mut msg = [0u8; 8];
            msg[0] = CTRL_CREDIT;
            msg[4..8].copy_from_slice(&n.to_le_bytes());
            match self.ep.post_send(peer, &msg, 0) {
                Ok(()) => self.peers[peer].unreturned = 0,
                // A peer that has gone needs no credits; waiting on it reports the loss.
                Err(TransportError::PeerClosed { .. }) => self.peers[peer].unreturned = 0,
                Err(_) if !self.ep.peer_alive(peer) => self.peers[peer].unreturned = 0,
                Err(e) => return Err(Error::transport(self.rank, "return credits", e)),
            }
        }
        Ok(())
    }

    /// The peers the running operation waits on.
    fn waiting_on(&self) -> Vec<usize> {
        let Some(r) = self.running.as_ref() else {
            return Vec::new();
        };
        if let Some(e) = r.eager {
            return (0..self.world)
                .filter(|p| e.missing & (1 << p) != 0)
                .collect();
        }
        let mut v: Vec<usize> = (0..self.world)
            .filter(|&p| {
                !r.q.recvq[p].is_empty() || (!r.q.sendq[p].is_empty() && self.peers[p].credits == 0)
            })
            .collect();
        if v.is_empty() {
            v = r.q.inflight.values().map(|x| x.1).collect();
            v.sort_unstable();
            v.dedup();
        }
        v
    }

    fn check_peers_alive(&self) -> Result<(), Error> {
        for p in self.waiting_on() {
            if !self.ep.peer_alive(p) {
                let r = self.running.as_ref().expect("running");
                return Err(Error::PeerLost {
                    rank: self.rank,
                    peer: p,
                    sig: r.sig,
                });
            }
        }
        Ok(())
    }

    /// Peers whose connection is down, after polling the transport for up to `wait`.
    pub(crate) fn dead_peers(&mut self, wait: Duration) -> Vec<usize> {
        let end = Instant::now() + wait;
        let mut sink = Vec::new();
        loop {
            sink.clear();
            // Errors here are about peers that are going away; what matters is who is gone.
            let _ = self.ep.poll(&mut sink);
            let dead: Vec<usize> = (0..self.world)
                .filter(|&p| p != self.rank && !self.ep.peer_alive(p))
                .collect();
            if !dead.is_empty() || Instant::now() >= end {
                return dead;
            }
            let _ = self.ep.wait(Duration::from_millis(10));
        }
    }

    /// On a timeout, asks every peer where it is and names the ranks that do not answer (stopped,
    /// hung, or not inside any collective) or that are behind. Every rank that times out asks
    /// everyone, so all of them name the same culprit.
    fn diagnose_timeout(&mut self) -> Error {
        let window =
            (self.opts.timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
        self.probe_replies.iter_mut().for_each(|r| *r = None);
        let peers: Vec<usize> = (0..self.world).filter(|&p| p != self.rank).collect();
        for &p in &peers {
            if self.ep.peer_alive(p) {
                let _ = self.ep.post_send(p, &[CTRL_PROBE], 0);
            }
        }
        let end = Instant::now() + window;
        let mut comps = Vec::new();
        while Instant::now() < end
            && peers
                .iter()
                .any(|&p| self.probe_replies[p].is_none() && self.ep.peer_alive(p))
        {
            comps.clear();
            if self.ep.poll(&mut comps).is_err() {
                break;
            }
            for c in comps.drain(..) {
                if let Err(e @ Error::PeerAborted { .. }) = self.handle_completion(c) {
                    // Another rank finished its diagnosis first: its verdict is the job's.
                    return e;
                }
            }
            let _ = self.ep.wait(Duration::from_millis(10));
        }
        let seq = self.running.as_ref().map_or(self.last_seq, |r| r.sig.seq);
        let lost: Vec<String> = peers
            .iter()
            .filter(|&&p| !self.ep.peer_alive(p))
            .map(|p| p.to_string())
            .collect();
        let silent: Vec<String> = peers
            .iter()
            .filter(|&&p| self.ep.peer_alive(p) && self.probe_replies[p].is_none())
            .map(|p| p.to_string())
            .collect();
        let behind: Vec<String> = peers
            .iter()
            .filter_map(|&p| match self.probe_replies[p] {
                Some((s, inside)) if s < seq || (s == seq && !inside) => Some(format!(
                    "rank {p} (at seq {s}{})",
                    if inside { "" } else { ", not inside it" }
                )),
                _ => None,
            })
            .collect();
        let mut verdict = Vec::new();
        if !silent.is_empty() {
            verdict.push(format!("rank {} did not answer within {window:?} (stopped, hung, or not calling into gradsync)", silent.join(", rank ")));
        }
        if !lost.is_empty() {
            verdict.push(format!("lost connection to rank {}", lost.join(", rank ")));
        }
        if !behind.is_empty() {
            verdict.push(format!("behind: {}", behind.join(", ")));
        }
        if verdict.is_empty() {
            verdict.push("every peer answered and is inside this collective".into());
        }
        let mut e = self.timeout_error();
        if let Error::Timeout { verdict: v, .. } = &mut e {
            *v = verdict.join("; ");
        }
        e
    }

    fn timeout_error(&self) -> Error {
        let r = self.running.as_ref().expect("running");
        let now = Instant::now();
        let waits = self
            .waiting_on()
            .into_iter()
            .map(|p| {
                let heard = match self.peers[p].last_heard {
                    Some((t, seq)) => format!(
                        "last heard {:.1} s ago (seq {seq})",
                        (now - t).as_secs_f64()
                    ),
                    None => "never heard from".to_string(),
                };
                format!("rank {p} ({heard})")
            })
            .collect::<Vec<_>>();
        Error::Timeout {
            rank: self.rank,
            sig: r.sig,
            timeout: self.opts.timeout,
            waiting: waits.join(", "),
            verdict: String::new(),
        }
    }
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
        let (a, b) = (self.inbox_mr, self.hdr_mr);
        self.ep.deregister(&a);
        self.ep.deregister(&b);
    }
}

/// `out = ((p(0) op p(1)) op p(2)) ...` over the `world` contributions `part(r)` (each at least
/// `out.len()` bytes, none of them `out`), then the division of an average: every element
/// reduced in rank order, so the same inputs give the same bits however they were gathered
/// (eager and deterministic all-reduces).
pub(crate) fn reduce_rank_order<'a>(
    dt: DataType,
    op: ReduceOp,
    out: &mut [u8],
    world: usize,
    part: impl Fn(usize) -> &'a [u8],
) {
    let n = out.len();
    let fold = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    if world == 1 {
        out.copy_from_slice(&part(0)[..n]);
    } else {
        gradsync_reduce::reduce_into(dt, fold, out, &part(0)[..n], &part(1)[..n]);
        for r in 2..world {
            gradsync_reduce::reduce_in_place(dt, fold, out, &part(r)[..n]);
        }
    }
    if op == ReduceOp::Avg {
        gradsync_reduce::finalize_avg(dt, out, world);
    }
}

/// Peer `p`'s board posting under `seq`, copied into `buf`: its signature, or `None` while it
/// has not posted.
fn board_posting(
    ep: &mut dyn Endpoint,
    rank: usize,
    comm_id: u64,
    p: usize,
    seq: u64,
    buf: &mut Vec<u8>,
) -> Result<Option<Signature>, Error> {
    if !ep
        .board_read(p, seq, buf)
        .map_err(|e| Error::transport(rank, "board read", e))?
    {
        return Ok(None);
    }
    parse_eager(rank, p, comm_id, buf).map(Some)
}

/// The signature of an eager all-reduce message (or board posting) from `peer`, checked
/// against this communicator and its own length.
fn parse_eager(rank: usize, peer: usize, comm_id: u64, data: &[u8]) -> Result<Signature, Error> {
    let u32_at = |i: usize| u32::from_le_bytes(data[i..i + 4].try_into().expect("4"));
    let u64_at = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().expect("8"));
    let bad = |what: String| Error::Protocol {
        rank,
        peer,
        msg: format!("eager all-reduce message of {} bytes: {what}", data.len()),
    };
    if data.len() < EAGER_HDR {
        return Err(bad("too short".into()));
    }
    let theirs = Signature {
        comm_id: u64_at(8),
        seq: u64_at(16),
        coll: gradsync_core::Collective::from_code(data[1])
            .map_err(|_| bad(format!("unknown collective {}", data[1])))?,
        dtype: DataType::from_code(data[2])
            .map_err(|_| bad(format!("unknown data type {}", data[2])))?,
        op: ReduceOp::from_code(data[3])
            .map_err(|_| bad(format!("unknown operator {}", data[3])))?,
        count: u64_at(24),
        root: u32_at(4),
    };
    if theirs.comm_id != comm_id {
        return Err(bad(format!(
            "communicator {:#x}, not this one ({:#x})",
            theirs.comm_id, comm_id
        )));
    }
    if theirs.count.checked_mul(theirs.dtype.size() as u64) != Some((data.len() - EAGER_HDR) as u64)
    {
        return Err(bad(format!("{theirs} does not match its length")));
    }
    Ok(theirs)
}

/// What to add to a mismatch between an eager operation and a scheduled one: when the two
/// calls agree, the ranks' settings differ.
fn eager_detail(ours: &Signature, theirs: &Signature, scheduled: usize, eager: usize) -> String {
    if ours != theirs {
        return String::new();
    }
    format!(
        "rank {eager} ran it eagerly and rank {scheduled} through a schedule; \
         set GRADSYNC_ALGO and GRADSYNC_EAGER_MAX alike on every rank"
    )
}

fn buf_index(b: Buf) -> usize {
    match b {
        Buf::Input => 0,
        Buf::Output => 1,
        Buf::Scratch => 2,
    }
}

fn slice(bufs: &[RawBuf; 3], loc: Loc, len: usize, dt: DataType) -> RawBuf {
    let b = bufs[buf_index(loc.buf)];
    RawBuf {
        addr: b.addr + loc.start * dt.size(),
        len: len * dt.size(),
    }
}

fn ranges_overlap(a: RawBuf, b: RawBuf) -> bool {
    a.addr < b.addr + b.len && b.addr < a.addr + a.len
}

#[cfg(test)]
mod tests {
    use crate::{Communicator, Config, ReduceOp};
    use std::time::Duration;

    /// Sender and receiver stay on the same slot, with a window that divides no power of two,
    /// when the message counters pass 2^31 and 2^32 (the immediate carries only their low 31
    /// bits; the top bit marks direct writes).
    #[test]
    fn slots_stay_in_step_across_the_counters_32_bit_wrap() {
        let mut cfg = Config::new("unused:0", 0, 1);
        cfg.timeout = Duration::from_secs(20);
        cfg.chunk_bytes = 256;
        cfg.nslots = 8;
        cfg.eager_max = 0;
        let comms = Communicator::mem_group(2, &cfg).unwrap();
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let me = c.rank();
                    let e = c.engine_mut();
                    let peer = 1 - me;
                    e.set_window(peer, 3);
                    // Each direction has its own counter: rank 0 -> 1 passes 2^31, 1 -> 0 2^32.
                    let starts: [u64; 2] = [(1 << 31) - 5, (1 << 32) - 5];
                    let start = starts[me];
                    e.peers[peer].tx_ctr = start;
                    e.peers[peer].rx_ctr = starts[peer];
                    let mut sums = Vec::new();
                    for round in 0..4u32 {
                        // 4 KiB: 8 messages of 256 bytes each way per call.
                        let mut v: Vec<f32> = (0..1024)
                            .map(|i| (i as u32 * 3 + round + me as u32) as f32)
                            .collect();
                        c.all_reduce(&mut v, ReduceOp::Sum)
                            .map_err(|e| format!("rank {me} round {round}: {e}"))?;
                        let want: Vec<f32> = (0..1024)
                            .map(|i| (2 * (i as u32 * 3 + round) + 1) as f32)
                            .collect();
                        assert_eq!(v, want, "rank {me} round {round}");
                        sums.push(v[7]);
                    }
                    let ctr = c.engine_mut().peers[peer].tx_ctr - start;
                    Ok::<_, String>((sums, ctr))
                })
            })
            .collect();
        for h in hs {
            let (_, ctr) = h.join().unwrap().unwrap();
            assert!(
                ctr > 5,
                "the counters did not pass their mark ({ctr} messages)"
            );
        }
    }
}
