//! The flight recorder: the last operations of one rank, kept in a bounded ring and written as
//! JSON when something goes wrong.
//!
//! Every communicator records each collective it starts (sequence number, operation, type,
//! count, root, algorithm, peers, bytes) and how it ended. The ring holds the last
//! `GRADSYNC_FLIGHT_RECORDER` operations (default [`DEFAULT_CAPACITY`]; `0` turns recording off);
//! older ones are overwritten. Recording costs one uncontended lock and a clock read per start
//! and per finish; nothing is formatted until a dump is written.
//!
//! # When a dump is written
//!
//! - on a timeout or a failure of the communicator (reason `timeout`, `failure`, ...);
//! - on `SIGUSR1`, once [`install_sigusr1_dump`] has run: `kill -USR1 <pid>` on every rank of a
//!   job that seems stuck (`pkill -USR1 -f train.py` on each node) makes every live recorder of
//!   the process dump, with reason `SIGUSR1`, and the job keeps running;
//! - whenever the program calls [`FlightRecorder::dump`].
//!
//! The file is `gradsync-flight-<comm_id>-r<rank>.json` in `GRADSYNC_FLIGHT_DIR` (default: the
//! system temporary directory, usually `/tmp`). It is written to a temporary name and renamed,
//! so a reader never sees half a file; a later dump of the same rank replaces it. Every dump
//! logs a warning line with its path.
//!
//! # Reading a dump
//!
//! An excerpt (the last two of its 41 operations) of rank 2's dump:
//!
//! ```text
//! {
//!   "rank": 2,
//!   "world": 4,
//!   "host": "node1",
//!   "pid": 48213,
//!   "comm_id": "5f3a9c2e11d04b7a",
//!   "dumped_unix_us": 1718000012500000,
//!   "reason": "SIGUSR1",
//!   "capacity": 64,
//!   "recorded": 41,
//!   "ops": [
//!     ...
//!     {"seq":40,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"algorithm":"ring","peers":[1,3],"state":"completed","started_unix_us":1718000010000000,"ended_unix_us":1718000010004210,"bytes":4194304,"error":null},
//!     {"seq":41,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"algorithm":"ring","peers":[1,3],"state":"completed","started_unix_us":1718000010010000,"ended_unix_us":1718000010014190,"bytes":4194304,"error":null}
//!   ]
//! }
//! ```
//!
//! The header says whose dump it is (`rank` of `world`, `host`, `pid`, communicator `comm_id`),
//! when it was taken (`dumped_unix_us`, microseconds since the Unix epoch) and why (`reason`).
//! `recorded` counts every operation the rank ever started; when it exceeds the length of `ops`,
//! the oldest were overwritten. `ops` lists the kept operations oldest first, one per line:
//!
//! - `seq` is the communicator's sequence number: every rank calls the same collectives in the
//!   same order, so the same `seq` means the same call on every rank;
//! - `op`, `dtype`, `count`, `root` are the call's signature, `algorithm` and `peers` how it ran
//!   (the ranks this rank exchanges data with), `bytes` the size of its buffer;
//! - `state` is `started` (still running when the dump was taken), `completed`, `failed` or
//!   `timed_out`; `error` says why a failed or timed-out operation ended;
//! - `started_unix_us` and `ended_unix_us` time it; a `started` operation's age is
//!   `dumped_unix_us - started_unix_us`.
//!
//! Small all-reduces that run on the shared-memory fast path (see the engine) are not recorded
//! one by one, which would cost more than the operation: the recorder counts them, and a dump
//! shows the latest as one `completed` record with `algorithm` `eager-fast`, no times (0 and
//! `null`), among the others by `seq`; `recorded` includes them.
//!
//! One rank's dump rarely tells the story; the dumps of all ranks together do. `gradsync flight
//! /tmp/gradsync-flight-*.json` reads them and names the rank that is behind:
//!
//! ```text
//! communicator 5f3a9c2e11d04b7a: world 4, 4 dumps
//! rank  host   pid    reason   last completed  in flight              age
//! 0     node1  48211  timeout  41 all_reduce   42 all_reduce started  2.004 s
//! 1     node1  48212  timeout  41 all_reduce   42 all_reduce started  2.004 s
//! 2     node1  48213  SIGUSR1  41 all_reduce   -                      -
//! 3     node1  48214  timeout  41 all_reduce   42 all_reduce started  2.004 s
//! verdict: rank 2 is behind: ranks 0,1,3 are in all_reduce seq 42 (started), rank 2 last started seq 41 (completed)
//! ```
//!
//! Here rank 2 finished seq 41 and never called seq 42: its peers wait for it in the all-reduce.
//! Look at rank 2's program, not at the network: it is busy elsewhere, stuck in data loading, or
//! took another branch. When every rank started the same `seq` and they all wait, look
//! at the `failed` and `timed_out` errors, and at a rank whose dump is missing: a process that
//! died writes nothing.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Operations kept per rank when `GRADSYNC_FLIGHT_RECORDER` is not set.
pub const DEFAULT_CAPACITY: usize = 64;

/// Environment variable with the number of operations a recorder keeps (`0`: none).
pub const CAPACITY_VAR: &str = "GRADSYNC_FLIGHT_RECORDER";

/// Environment variable with the directory dumps are written to (default: the system
/// temporary directory).
pub const DIR_VAR: &str = "GRADSYNC_FLIGHT_DIR";

/// The handle [`FlightRecorder::start`] returns when recording is off; [`FlightRecorder::finish`]
/// ignores it.
pub const NO_HANDLE: usize = usize::MAX;

/// How a recorded operation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpState {
    /// Started and not finished when the snapshot was taken.
    Started,
    /// Finished successfully.
    Completed,
    /// Ended with an error (see [`OpRecord::error`]).
    Failed,
    /// Ended because its deadline passed.
    TimedOut,
}

impl OpState {
    /// The name used in dumps: `started`, `completed`, `failed` or `timed_out`.
    pub const fn as_str(self) -> &'static str {
        match self {
            OpState::Started => "started",
            OpState::Completed => "completed",
            OpState::Failed => "failed",
            OpState::TimedOut => "timed_out",
        }
    }
}

impl fmt::Display for OpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One recorded operation.
///
/// The text fields are [`Cow`] so that the engine records `&'static str` names without
/// allocating; a record read back from JSON owns its strings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Sequence number of the call in its communicator (the same on every rank).
    pub seq: u64,
    /// The collective, e.g. `all_reduce`.
    pub op: Cow<'static, str>,
    /// Element type, e.g. `float32`.
    pub dtype: Cow<'static, str>,
    /// Element count of the call.
    pub count: u64,
    /// Root rank of rooted collectives (broadcast, reduce).
    pub root: Option<u32>,
    /// Algorithm that ran it, e.g. `ring`; empty when not known.
    pub algorithm: Cow<'static, str>,
    /// Ranks this rank exchanges data with in this operation.
    pub peers: Vec<usize>,
    /// How the operation stands.
    pub state: OpState,
    /// When it started, microseconds since the Unix epoch.
    pub started_unix_us: u64,
    /// When it ended, microseconds since the Unix epoch; `None` while started.
    pub ended_unix_us: Option<u64>,
    /// Bytes of the buffer the call works on.
    pub bytes: u64,
    /// Why a failed or timed-out operation ended.
    pub error: Option<String>,
}

impl OpRecord {
    /// A record of call `seq` of collective `op` on `count` elements of `dtype`, with no root,
    /// algorithm, peers or bytes (set the public fields to add them), state
    /// [`OpState::Started`] and no timestamps ([`FlightRecorder::start`] stamps the start).
    pub fn new(
        seq: u64,
        op: impl Into<Cow<'static, str>>,
        dtype: impl Into<Cow<'static, str>>,
        count: u64,
    ) -> Self {
        OpRecord {
            seq,
            op: op.into(),
            dtype: dtype.into(),
            count,
            root: None,
            algorithm: Cow::Borrowed(""),
            peers: Vec::new(),
            state: OpState::Started,
            started_unix_us: 0,
            ended_unix_us: None,
            bytes: 0,
            error: None,
        }
    }
}

/// A snapshot of one recorder: who, when, why, and the kept operations, oldest first.
///
/// Written by [`FlightRecorder::dump`] and read back with `serde_json` (see the
/// [module documentation](self) for the layout).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dump {
    /// Rank of the recorder's communicator.
    pub rank: usize,
    /// Number of ranks of the communicator.
    pub world: usize,
    /// Host name (up to its first dot).
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Communicator id, 16 hexadecimal digits.
    pub comm_id: String,
    /// When the snapshot was taken, microseconds since the Unix epoch.
    pub dumped_unix_us: u64,
    /// Why it was taken, e.g. `timeout` or `SIGUSR1`.
    pub reason: String,
    /// How many operations the recorder keeps.
    #[serde(default)]
    pub capacity: usize,
    /// How many operations the rank started in all; more than `ops.len()` when the oldest were
    /// overwritten.
    #[serde(default)]
    pub recorded: u64,
    /// The kept operations, oldest first.
    pub ops: Vec<OpRecord>,
}

impl Dump {
    /// The most recent operation this rank started (whatever its state).
    pub fn last_started(&self) -> Option<&OpRecord> {
        self.ops.iter().max_by_key(|r| r.seq)
    }

    /// The most recent operation this rank completed.
    pub fn last_completed(&self) -> Option<&OpRecord> {
        self.ops
            .iter()
            .filter(|r| r.state == OpState::Completed)
            .max_by_key(|r| r.seq)
    }

    /// The dump as JSON: the header one field a line, then one line per operation.
    pub fn to_json(&self) -> String {
        fn js<T: Serialize + ?Sized>(v: &T) -> String {
            serde_json::to_string(v).expect("plain data serializes")
        }
        let mut s = String::with_capacity(512 + 320 * self.ops.len());
        s.push_str("{\n");
        s.push_str(&format!("  \"rank\": {},\n", self.rank));
        s.push_str(&format!("  \"world\": {},\n", self.world));
        s.push_str(&format!("  \"host\": {},\n", js(&self.host)));
        s.push_str(&format!("  \"pid\": {},\n", self.pid));
        s.push_str(&format!("  \"comm_id\": {},\n", js(&self.comm_id)));
        s.push_str(&format!("  \"dumped_unix_us\": {},\n", self.dumped_unix_us));
        s.push_str(&format!("  \"reason\": {},\n", js(&self.reason)));
        s.push_str(&format!("  \"capacity\": {},\n", self.capacity));
        s.push_str(&format!("  \"recorded\": {},\n", self.recorded));
        if self.ops.is_empty() {
            s.push_str("  \"ops\": []\n}\n");
            return s;
        }
        s.push_str("  \"ops\": [\n");
        for (i, op) in self.ops.iter().enumerate() {
            s.push_str("    ");
            s.push_str(&js(op));
            s.push_str(if i + 1 < self.ops.len() { ",\n" } else { "\n" });
        }
        s.push_str("  ]\n}\n");
        s
    }

    /// The file name of this dump: `gradsync-flight-<comm_id>-r<rank>.json`.
    pub fn file_name(&self) -> String {
        file_name(&self.comm_id, self.rank)
    }
}

fn file_name(comm_id: &str, rank: usize) -> String {
    format!("gradsync-flight-{comm_id}-r{rank}.json")
}

/// One slot of the ring: the record and the handle it was started under.
#[derive(Debug)]
struct Slot {
    id: usize,
    rec: OpRecord,
}

/// The ring: `slots[id % capacity]` holds operation `id` until `capacity` later ones overwrite it.
#[derive(Debug)]
struct Ring {
    slots: Vec<Slot>,
    /// Operations started so far; the next handle.
    next: usize,
}

#[derive(Debug)]
struct Inner {
    rank: usize,
    world: usize,
    capacity: usize,
    comm_id: AtomicU64,
    dir: Mutex<Option<PathBuf>>,
    ring: Mutex<Ring>,
    /// A monotonic instant and the wall-clock time it was, for stamping from an [`Instant`].
    epoch: (Instant, u64),
    /// Operations of the fast path (written by the communicator's thread only).
    fast: FastOps,
}

/// The fast path's operations: how many, and the latest (0: none yet).
#[derive(Debug, Default)]
struct FastOps {
    count: AtomicU64,
    seq: AtomicU64,
    elems: AtomicU64,
    dtype: AtomicU64,
}

/// The last operations of one rank of one communicator, in a bounded ring.
///
/// Cloning is cheap and every clone records into the same ring; all methods take `&self` and may
/// be called from any thread. Every recorder registers itself (weakly) in a process-wide list,
/// so [`dump_all`] and the `SIGUSR1` handler reach it while it is alive.
///
/// ```
/// use gradsync::recorder::{FlightRecorder, OpRecord, OpState};
/// let rec = FlightRecorder::new(0, 4, 64);
/// rec.set_comm_id(0x5f3a_9c2e_11d0_4b7a);
/// let h = rec.start(OpRecord {
///     algorithm: "ring".into(),
///     peers: vec![1, 3],
///     bytes: 4096,
///     ..OpRecord::new(1, "all_reduce", "float32", 1024)
/// });
/// rec.finish(h, OpState::Completed, None);
/// let dump = rec.snapshot();
/// assert_eq!(dump.ops[0].state, OpState::Completed);
/// ```
#[derive(Clone)]
pub struct FlightRecorder {
    inner: Arc<Inner>,
}

impl fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlightRecorder")
            .field("rank", &self.inner.rank)
            .field("world", &self.inner.world)
            .field("capacity", &self.inner.capacity)
            .field("comm_id", &self.comm_id())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Recorders alive in this process, for [`dump_all`] and the `SIGUSR1` handler.
static REGISTRY: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The capacity `GRADSYNC_FLIGHT_RECORDER` asks for: a number of operations, `0` for none;
/// [`DEFAULT_CAPACITY`] when unset, and (with a warning) when malformed.
pub fn capacity_from_env() -> usize {
    match std::env::var(CAPACITY_VAR) {
        Err(_) => DEFAULT_CAPACITY,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(
                target: "gradsync::env",
                "{CAPACITY_VAR}={v:?} is not a number of operations; keeping {DEFAULT_CAPACITY}"
            );
            DEFAULT_CAPACITY
        }),
    }
}

/// The directory dumps go to when the recorder has none of its own: `GRADSYNC_FLIGHT_DIR`, or
/// the system temporary directory.
pub fn dir_from_env() -> PathBuf {
    std::env::var_os(DIR_VAR)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

impl FlightRecorder {
    /// A recorder for `rank` of `world` keeping the last `capacity` operations (`0`: records
    /// nothing; see [`capacity_from_env`] for `GRADSYNC_FLIGHT_RECORDER`). The communicator id
    /// is 0 until [`set_comm_id`](Self::set_comm_id).
    pub fn new(rank: usize, world: usize, capacity: usize) -> Self {
        let inner = Arc::new(Inner {
            rank,
            world,
            capacity,
            comm_id: AtomicU64::new(0),
            dir: Mutex::new(None),
            ring: Mutex::new(Ring {
                slots: Vec::with_capacity(capacity.min(4096)),
                next: 0,
            }),
            epoch: (Instant::now(), now_unix_us()),
            fast: FastOps::default(),
        });
        let mut reg = lock(&REGISTRY);
        reg.retain(|w| w.strong_count() > 0);
        reg.push(Arc::downgrade(&inner));
        drop(reg);
        FlightRecorder { inner }
    }

    /// A recorder for `rank` of `world` with the capacity `GRADSYNC_FLIGHT_RECORDER` asks for.
    pub fn from_env(rank: usize, world: usize) -> Self {
        Self::new(rank, world, capacity_from_env())
    }

    /// Rank of the recorder.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks of the communicator.
    pub fn world(&self) -> usize {
        self.inner.world
    }

    /// How many operations are kept.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Sets the communicator id shown in dumps and file names.
    pub fn set_comm_id(&self, comm_id: u64) {
        self.inner.comm_id.store(comm_id, Ordering::Relaxed);
    }

    /// The communicator id as dumps show it: 16 hexadecimal digits.
    pub fn comm_id(&self) -> String {
        format!("{:016x}", self.inner.comm_id.load(Ordering::Relaxed))
    }

    /// Makes [`dump`](Self::dump) write into `dir` instead of `GRADSYNC_FLIGHT_DIR`.
    pub fn set_dump_dir(&self, dir: impl Into<PathBuf>) {
        *lock(&self.inner.dir) = Some(dir.into());
    }

    /// Like [`start`](Self::start), but fills the record in place: `fill` gets a record with
    /// sequence number 0, empty names, no root, algorithm, peers, bytes, end or error, state
    /// [`OpState::Started`] and the start time `at` (a monotonic instant the caller read,
    /// stamped as wall-clock time), and sets what it knows. The slot's previous record gives its
    /// allocations (the peer list) for reuse, so a steady stream of operations allocates
    /// nothing here.
    pub fn start_with(&self, at: Instant, fill: impl FnOnce(&mut OpRecord)) -> usize {
        let cap = self.inner.capacity;
        if cap == 0 {
            return NO_HANDLE;
        }
        let (e_mono, e_unix) = self.inner.epoch;
        let now = e_unix.saturating_add(
            u64::try_from(at.saturating_duration_since(e_mono).as_micros()).unwrap_or(u64::MAX),
        );
        let mut ring = lock(&self.inner.ring);
        let id = ring.next;
        ring.next += 1;
        if ring.slots.len() < cap {
            ring.slots.push(Slot {
                id,
                rec: OpRecord::new(0, "", "", 0),
            });
        }
        let slot = &mut ring.slots[id % cap];
        slot.id = id;
        let old_error = {
            let r = &mut slot.rec;
            r.seq = 0;
            r.op = Cow::Borrowed("");
            r.dtype = Cow::Borrowed("");
            r.count = 0;
            r.root = None;
            r.algorithm = Cow::Borrowed("");
            r.peers.clear();
            r.state = OpState::Started;
            r.started_unix_us = now;
            r.ended_unix_us = None;
            r.bytes = 0;
            fill(r);
            r.error.take()
        };
        drop(ring);
        drop(old_error); // freed outside the lock
        id
    }

    /// Records the start of an operation and returns the handle to [`finish`](Self::finish) it
    /// with. The record's state becomes [`OpState::Started`], its end and error are cleared,
    /// and `started_unix_us` is stamped with the current time unless the caller set it. When the
    /// ring is full the oldest operation is overwritten. With capacity 0 this does nothing and
    /// returns [`NO_HANDLE`].
    pub fn start(&self, rec: OpRecord) -> usize {
        self.start_with(Instant::now(), move |r| {
            let now = r.started_unix_us;
            *r = rec;
            r.state = OpState::Started;
            r.ended_unix_us = None;
            r.error = None;
            if r.started_unix_us == 0 {
                r.started_unix_us = now;
            }
        })
    }

    /// Records how the operation of `handle` ended, stamping its end time. Does nothing when the
    /// operation was already overwritten by newer ones, or when `handle` is [`NO_HANDLE`].
    pub fn finish(&self, handle: usize, state: OpState, error: Option<String>) {
        let cap = self.inner.capacity;
        if cap == 0 || handle == NO_HANDLE {
            return;
        }
        let now = now_unix_us();
        let mut ring = lock(&self.inner.ring);
        if let Some(slot) = ring.slots.get_mut(handle % cap)
            && slot.id == handle
        {
            slot.rec.state = state;
            slot.rec.ended_unix_us = Some(now);
            slot.rec.error = error;
        }
    }

    /// Counts an all-reduce of the fast path (see the [module documentation](self)): no lock,
    /// no clock read.
    pub(crate) fn fast(&self, sig: &gradsync_core::wire::Signature) {
        if self.inner.capacity == 0 {
            return;
        }
        let f = &self.inner.fast;
        f.elems.store(sig.count, Ordering::Relaxed);
        f.dtype.store(sig.dtype as u64, Ordering::Relaxed);
        f.count
            .store(f.count.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        f.seq.store(sig.seq, Ordering::Release);
    }

    /// Forgets every recorded operation, as if none had run (after the communicator's own
    /// operations at init, whose sequence numbers the caller's operations then reuse).
    pub fn clear(&self) {
        let mut ring = lock(&self.inner.ring);
        ring.slots.clear();
        ring.next = 0;
    }

    /// A snapshot of the recorder with reason `snapshot`: the header and the kept operations,
    /// oldest first.
    pub fn snapshot(&self) -> Dump {
        self.snapshot_with("snapshot")
    }

    fn snapshot_with(&self, reason: &str) -> Dump {
        let cap = self.inner.capacity;
        let (ops, recorded) = {
            let ring = lock(&self.inner.ring);
            let first = if cap == 0 || ring.slots.len() < cap {
                0
            } else {
                ring.next % cap
            };
            let (newer, older) = ring.slots.split_at(first);
            let ops: Vec<OpRecord> = older.iter().chain(newer).map(|s| s.rec.clone()).collect();
            (ops, ring.next as u64)
        };
        let (ops, recorded) = self.with_fast(ops, recorded);
        Dump {
            rank: self.inner.rank,
            world: self.inner.world,
            host: crate::logging::hostname().to_string(),
            pid: std::process::id(),
            comm_id: self.comm_id(),
            dumped_unix_us: now_unix_us(),
            reason: reason.to_string(),
            capacity: cap,
            recorded,
            ops,
        }
    }

    /// `ops` (oldest first) with the latest operation of the fast path among them, by its
    /// sequence number, and `recorded` with the fast path's count.
    fn with_fast(&self, mut ops: Vec<OpRecord>, recorded: u64) -> (Vec<OpRecord>, u64) {
        let f = &self.inner.fast;
        let seq = f.seq.load(Ordering::Acquire);
        if seq == 0 {
            return (ops, recorded);
        }
        let count = f.count.load(Ordering::Relaxed);
        let dtype = u8::try_from(f.dtype.load(Ordering::Relaxed))
            .ok()
            .and_then(|c| gradsync_core::DataType::from_code(c).ok());
        let elems = f.elems.load(Ordering::Relaxed);
        let mut rec = OpRecord::new(seq, "all_reduce", dtype.map_or("", |d| d.name()), elems);
        rec.algorithm = Cow::Borrowed("eager-fast");
        rec.peers = (0..self.inner.world)
            .filter(|&p| p != self.inner.rank)
            .collect();
        rec.state = OpState::Completed;
        rec.bytes = elems * dtype.map_or(0, |d| d.size() as u64);
        let at = ops.partition_point(|o| o.seq < seq);
        ops.insert(at, rec);
        (ops, recorded + count)
    }

    /// Writes a snapshot with `reason` as JSON into the recorder's directory (see
    /// [`set_dump_dir`](Self::set_dump_dir)), else `GRADSYNC_FLIGHT_DIR`, else the system
    /// temporary directory, and returns the file's path. See [`dump_to`](Self::dump_to).
    pub fn dump(&self, reason: &str) -> io::Result<PathBuf> {
        let dir = lock(&self.inner.dir).clone().unwrap_or_else(dir_from_env);
        self.dump_to(&dir, reason)
    }

    /// Writes a snapshot with `reason` as `dir/gradsync-flight-<comm_id>-r<rank>.json` and
    /// returns its path. The file is written under a temporary name in `dir`, synced and renamed,
    /// so readers see the old dump or the new one, never a part; the directory is created if
    /// missing. Logs a warning with the path.
    pub fn dump_to(&self, dir: &Path, reason: &str) -> io::Result<PathBuf> {
        static TMP_SEQ: AtomicU64 = AtomicU64::new(0);
        let dump = self.snapshot_with(reason);
        std::fs::create_dir_all(dir)?;
        let path = dir.join(dump.file_name());
        let tmp = dir.join(format!(
            ".{}.{}.{}.tmp",
            dump.file_name(),
            dump.pid,
            TMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(dump.to_json().as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        tracing::warn!(
            target: "gradsync::coll",
            "flight recorder: rank {} wrote {} operations to {} (reason {reason})",
            dump.rank,
            dump.ops.len(),
            path.display()
        );
        Ok(path)
    }
}

/// Makes every recorder alive in this process [`dump`](FlightRecorder::dump) with `reason`, and
/// returns each result (a recorder that fails to write also logs a warning).
pub fn dump_all(reason: &str) -> Vec<io::Result<PathBuf>> {
    let live: Vec<FlightRecorder> = lock(&REGISTRY)
        .iter()
        .filter_map(Weak::upgrade)
        .map(|inner| FlightRecorder { inner })
        .collect();
    live.iter()
        .map(|r| {
            let res = r.dump(reason);
            if let Err(e) = &res {
                tracing::warn!(
                    target: "gradsync::coll",
                    "flight recorder: rank {} could not write its dump: {e}",
                    r.rank()
                );
            }
            res
        })
        .collect()
}

/// Installs, once per process, a `SIGUSR1` handler that makes every live recorder dump with
/// reason `SIGUSR1` (see [`dump_all`]); later calls do nothing.
///
/// The handler only writes one byte to a pipe (`write(2)` is async-signal-safe); a thread named
/// `gradsync-flight` reads the pipe and writes the dumps, so the process keeps running and no
/// lock or allocation happens in signal context. Signals that arrive while a dump is being
/// written are coalesced into the next one. A handler the application installed earlier is
/// chained: it runs after this one, with the same arguments (the default disposition,
/// terminating the process, is replaced). On platforms other than Linux this does nothing.
pub fn install_sigusr1_dump() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(target_os = "linux")]
        if let Err(e) = signal::install(|| {
            dump_all("SIGUSR1");
        }) {
            tracing::warn!(
                target: "gradsync::init",
                "flight recorder: cannot install the SIGUSR1 dump handler: {e}"
            );
        }
    });
}

#[cfg(target_os = "linux")]
mod signal;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A fresh empty directory under the system temporary directory.
    fn temp_dir(name: &str) -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "gradsync-recorder-test-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A recorder whose dumps (also those a concurrent SIGUSR1 test triggers) go to a scratch
    /// directory rather than the system temporary directory.
    fn recorder(rank: usize, world: usize, capacity: usize) -> FlightRecorder {
        static SCRATCH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
        let rec = FlightRecorder::new(rank, world, capacity);
        // Created by the first dump into it, if any.
        rec.set_dump_dir(SCRATCH.get_or_init(|| {
            std::env::temp_dir().join(format!(
                "gradsync-recorder-test-{}-scratch",
                std::process::id()
            ))
        }));
        rec
    }

    /// Held by the tests that list a dump directory and by the test that raises `SIGUSR1`
    /// (which makes every live recorder write into its directory).
    static SIGNAL_LOCK: Mutex<()> = Mutex::new(());

    fn op(seq: u64) -> OpRecord {
        OpRecord {
            root: seq.is_multiple_of(3).then_some(1),
            algorithm: "ring".into(),
            peers: vec![1, 3],
            bytes: 4 * 1024,
            ..OpRecord::new(seq, "all_reduce", "float32", 1024)
        }
    }

    #[test]
    fn keeps_the_last_capacity_operations_oldest_first() {
        let rec = recorder(0, 4, 4);
        let handles: Vec<usize> = (1..=10).map(|s| rec.start(op(s))).collect();
        let dump = rec.snapshot();
        assert_eq!(dump.capacity, 4);
        assert_eq!(dump.recorded, 10);
        let seqs: Vec<u64> = dump.ops.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [7, 8, 9, 10]);
        // Finishing an overwritten operation changes nothing; a kept one is updated.
        rec.finish(handles[0], OpState::Failed, Some("late".into()));
        rec.finish(handles[8], OpState::Completed, None);
        let dump = rec.snapshot();
        assert!(dump.ops.iter().all(|r| r.error.is_none()));
        assert_eq!(dump.ops[2].seq, 9);
        assert_eq!(dump.ops[2].state, OpState::Completed);
        assert_eq!(dump.ops[3].state, OpState::Started);
    }

    #[test]
    fn partial_ring_and_wrap_boundaries() {
        let rec = recorder(1, 2, 3);
        assert!(rec.snapshot().ops.is_empty());
        for s in 1..=2 {
            rec.start(op(s));
        }
        let seqs = |r: &FlightRecorder| r.snapshot().ops.iter().map(|o| o.seq).collect::<Vec<_>>();
        assert_eq!(seqs(&rec), [1, 2]);
        rec.start(op(3));
        assert_eq!(seqs(&rec), [1, 2, 3]);
        rec.start(op(4));
        assert_eq!(seqs(&rec), [2, 3, 4]);
        for s in 5..=6 {
            rec.start(op(s));
        }
        assert_eq!(seqs(&rec), [4, 5, 6]);
    }

    #[test]
    fn states_errors_and_timestamps() {
        let rec = recorder(2, 4, 8);
        let mut pre = op(1);
        pre.state = OpState::Failed;
        pre.error = Some("stale".into());
        pre.ended_unix_us = Some(1);
        let a = rec.start(pre);
        let b = rec.start(op(2));
        let c = rec.start(op(3));
        let d = rec.start(op(4));
        rec.finish(a, OpState::Completed, None);
        rec.finish(
            b,
            OpState::Failed,
            Some("connection reset by rank 3".into()),
        );
        rec.finish(c, OpState::TimedOut, Some("waited 2 s for rank 3".into()));
        let dump = rec.snapshot();
        let states: Vec<OpState> = dump.ops.iter().map(|r| r.state).collect();
        assert_eq!(
            states,
            [
                OpState::Completed,
                OpState::Failed,
                OpState::TimedOut,
                OpState::Started
            ]
        );
        assert_eq!(dump.ops[0].error, None);
        assert_eq!(
            dump.ops[1].error.as_deref(),
            Some("connection reset by rank 3")
        );
        for r in &dump.ops[..3] {
            assert!(r.started_unix_us > 0);
            assert!(r.ended_unix_us.unwrap() >= r.started_unix_us);
        }
        assert_eq!(dump.ops[3].ended_unix_us, None);
        assert!(dump.dumped_unix_us >= dump.ops[3].started_unix_us);
        assert_eq!(dump.last_started().unwrap().seq, 4);
        assert_eq!(dump.last_completed().unwrap().seq, 1);
        rec.finish(d, OpState::Completed, None);
        assert_eq!(rec.snapshot().last_completed().unwrap().seq, 4);
        assert_eq!(OpState::TimedOut.to_string(), "timed_out");
    }

    #[test]
    fn capacity_zero_records_nothing() {
        let rec = recorder(0, 1, 0);
        let h = rec.start(op(1));
        assert_eq!(h, NO_HANDLE);
        rec.finish(h, OpState::Completed, None);
        let dump = rec.snapshot();
        assert!(dump.ops.is_empty());
        assert_eq!(dump.recorded, 0);
    }

    #[test]
    fn json_round_trip() {
        let rec = recorder(3, 4, 16);
        rec.set_comm_id(0x5f3a_9c2e_11d0_4b7a);
        for s in 1..=5 {
            let h = rec.start(op(s));
            if s < 5 {
                let (state, err) = if s == 4 {
                    (OpState::Failed, Some("peer \"3\" reset\nthe link".into()))
                } else {
                    (OpState::Completed, None)
                };
                rec.finish(h, state, err);
            }
        }
        let dump = rec.snapshot();
        assert_eq!(dump.comm_id, "5f3a9c2e11d04b7a");
        let text = dump.to_json();
        // One line per operation, after a header of one field per line.
        assert_eq!(text.lines().filter(|l| l.contains("\"seq\":")).count(), 5);
        let back: Dump = serde_json::from_str(&text).unwrap();
        assert_eq!(back, dump);
        // serde's own layout reads back the same.
        let back: Dump = serde_json::from_str(&serde_json::to_string(&dump).unwrap()).unwrap();
        assert_eq!(back, dump);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["ops"][3]["state"], "failed");
        assert_eq!(v["ops"][4]["state"], "started");
        assert_eq!(v["ops"][0]["root"], serde_json::Value::Null);
        assert_eq!(v["ops"][2]["root"], 1);
        // An empty recorder is valid JSON too.
        let empty = recorder(0, 1, 4).snapshot();
        assert_eq!(
            serde_json::from_str::<Dump>(&empty.to_json()).unwrap(),
            empty
        );
        // Dumps written before `capacity`/`recorded` existed, or by hand, still parse.
        let minimal = r#"{"rank":1,"world":2,"host":"h","pid":7,"comm_id":"00","dumped_unix_us":9,"reason":"x","ops":[]}"#;
        let d: Dump = serde_json::from_str(minimal).unwrap();
        assert_eq!((d.rank, d.capacity, d.recorded), (1, 0, 0));
    }

    #[test]
    fn dump_writes_one_complete_file_atomically() {
        let _serial = lock(&SIGNAL_LOCK);
        let dir = temp_dir("dump");
        let rec = recorder(2, 4, 8);
        rec.set_comm_id(0xabc);
        let h = rec.start(op(1));
        rec.finish(h, OpState::Completed, None);
        rec.start(op(2));
        let path = rec.dump_to(&dir, "timeout").unwrap();
        assert_eq!(path, dir.join("gradsync-flight-0000000000000abc-r2.json"));
        let d: Dump = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(d.reason, "timeout");
        assert_eq!((d.rank, d.world, d.pid), (2, 4, std::process::id()));
        assert_eq!(d.ops.len(), 2);
        // A second dump replaces the first, and no temporary file is left behind.
        rec.start(op(3));
        rec.set_dump_dir(&dir);
        assert_eq!(rec.dump("failure").unwrap(), path);
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["gradsync-flight-0000000000000abc-r2.json"]);
        let d: Dump = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!((d.reason.as_str(), d.ops.len()), ("failure", 3));
        // A directory that cannot be created is an error, not a panic.
        let file = dir.join("gradsync-flight-0000000000000abc-r2.json");
        assert!(rec.dump_to(&file.join("sub"), "x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn concurrent_start_and_finish() {
        let rec = recorder(0, 2, 32);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let rec = rec.clone();
                s.spawn(move || {
                    for i in 0..1000 {
                        let h = rec.start(op(t * 1000 + i));
                        rec.finish(h, OpState::Completed, None);
                    }
                });
            }
        });
        let dump = rec.snapshot();
        assert_eq!(dump.recorded, 4000);
        assert_eq!(dump.ops.len(), 32);
        assert!(dump.ops.iter().all(|r| r.state == OpState::Completed));
    }

    #[test]
    fn start_is_cheap() {
        let rec = recorder(0, 8, DEFAULT_CAPACITY);
        let n = 200_000u32;
        let t = Instant::now();
        for i in 0..n {
            let h = rec.start(OpRecord {
                algorithm: Cow::Borrowed("ring"),
                ..OpRecord::new(u64::from(i), "all_reduce", "float32", 1 << 20)
            });
            rec.finish(h, OpState::Completed, None);
        }
        let per_op = t.elapsed() / n;
        // Typically well under 100 ns; the bound leaves room for a loaded machine.
        assert!(
            per_op < Duration::from_micros(5),
            "{per_op:?} per start+finish"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn sigusr1_dumps_every_live_recorder() {
        let _serial = lock(&SIGNAL_LOCK);
        let dir = temp_dir("sigusr1");
        let rec = recorder(1, 4, 8);
        rec.set_comm_id(0x51);
        rec.set_dump_dir(&dir);
        let h = rec.start(op(41));
        rec.finish(h, OpState::Completed, None);
        rec.start(op(42));
        install_sigusr1_dump();
        install_sigusr1_dump(); // idempotent
        // SAFETY: raising a signal whose handler is installed; the handler only writes a byte.
        assert_eq!(unsafe { libc::raise(libc::SIGUSR1) }, 0);
        let path = dir.join("gradsync-flight-0000000000000051-r1.json");
        let deadline = Instant::now() + Duration::from_secs(20);
        let dump = loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                break serde_json::from_str::<Dump>(&text).unwrap();
            }
            assert!(Instant::now() < deadline, "no dump at {}", path.display());
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(dump.reason, "SIGUSR1");
        assert_eq!(dump.ops.len(), 2);
        assert_eq!(dump.ops[1].state, OpState::Started);
        std::fs::remove_dir_all(&dir).unwrap();
        // The signal also made the other tests' live recorders dump into the scratch directory.
        std::thread::sleep(Duration::from_millis(200));
        let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!(
            "gradsync-recorder-test-{}-scratch",
            std::process::id()
        )));
    }
}
