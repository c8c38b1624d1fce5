//! The `Communicator` and `Work` classes.

use crate::buffer::{Access, Buffer, Ctx, Keep, bump_versions, dtype_name, extract};
use crate::error::GradsyncError;
use crate::worker::{Completion, Info, Task, Worker, wait_detached};
use gradsync::{Config, DataType, ReduceOp};
use pyo3::exceptions::{PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Runs `$body` with `$T` bound to the Rust element type of the data type `$dt`.
macro_rules! with_element {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DataType::F32 => {
                type $T = f32;
                $body
            }
            DataType::F64 => {
                type $T = f64;
                $body
            }
            DataType::F16 => {
                type $T = half::f16;
                $body
            }
            DataType::Bf16 => {
                type $T = half::bf16;
                $body
            }
            DataType::I32 => {
                type $T = i32;
                $body
            }
            DataType::I64 => {
                type $T = i64;
                $body
            }
            DataType::U8 => {
                type $T = u8;
                $body
            }
        }
    };
}

pub(crate) use with_element;

/// What a split runs on the parent's worker thread.
type SplitFn = Box<
    dyn FnOnce(&mut gradsync::Communicator) -> gradsync::Result<Option<gradsync::Communicator>>
        + Send,
>;

// The worker thread owns the Rust communicator: it must be allowed to move there.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<gradsync::Communicator>();
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn parse_op(op: &str, rank: usize, name: &str) -> PyResult<ReduceOp> {
    match op.to_ascii_lowercase().as_str() {
        "sum" => Ok(ReduceOp::Sum),
        "prod" | "product" => Ok(ReduceOp::Prod),
        "min" => Ok(ReduceOp::Min),
        "max" => Ok(ReduceOp::Max),
        "avg" | "mean" => Ok(ReduceOp::Avg),
        "band" => Ok(ReduceOp::Band),
        "bor" => Ok(ReduceOp::Bor),
        "bxor" => Ok(ReduceOp::Bxor),
        _ => Err(PyValueError::new_err(format!(
            "rank {rank}: {name}: unknown op {op:?} (expected one of sum, prod, min, max, avg, \
             band, bor, bxor)"
        ))),
    }
}

fn timeout_arg(t: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Duration::try_from_secs_f64(s)
            .map(Some)
            .map_err(|_| PyValueError::new_err(format!("{what}: timeout {s} is out of range"))),
        Some(s) => Err(PyValueError::new_err(format!(
            "{what}: timeout must be a non-negative number of seconds, got {s}"
        ))),
    }
}

/// A timeout argument that must be positive when given.
fn positive_timeout(t: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match timeout_arg(t, what)? {
        Some(d) if d.is_zero() => Err(PyValueError::new_err(format!(
            "{what}: timeout must be positive"
        ))),
        d => Ok(d),
    }
}

/// A group of processes (ranks) that run collectives together.
///
/// Every rank calls the same collectives in the same order with matching arguments; a rank
/// that does otherwise gets a :class:`GradsyncError` naming both sides. Buffers are numpy
/// arrays or CPU torch tensors, C-contiguous, of type float32, float64, float16, bfloat16
/// (torch tensors only), int32, int64 or uint8; buffers that are written must be writable.
/// Other objects are refused, even with an ``__array_interface__``. Writing a torch tensor
/// bumps its version counter when the operation is submitted, as in-place torch operations do.
/// Each operation releases the GIL while it runs. Operations run one at a time, in the order
/// they were called, on a thread of the communicator; the ``*_async`` variants return a
/// :class:`Work` at once and keep their buffers alive until they finish. Do not read or write
/// a buffer of an unfinished operation.
///
/// ``Communicator(store_addr, rank, world_size, *, host_store=True, timeout=None)`` joins
/// the group explicitly: all ranks meet at the rendezvous store ``store_addr`` (``host:port``),
/// which rank 0 starts when ``host_store`` is true, or which already runs there (a
/// :class:`StoreServer`, a launcher's) when it is false. ``timeout`` (seconds) bounds init and
/// every operation (default ``GRADSYNC_TIMEOUT``, 300). The ``GRADSYNC_*`` tunables of the
/// environment apply. :meth:`from_env` reads everything from the launcher's environment.
///
/// The communicator is a context manager: leaving the ``with`` block closes it.
#[pyclass(module = "gradsync", frozen)]
#[derive(Debug)]
pub struct Communicator {
    info: Info,
    worker: Mutex<Option<Worker>>,
}

/// The handle of an operation started by one of the ``*_async`` methods.
///
/// The operation's buffers must not be read or written until :meth:`wait` returns (or
/// :meth:`is_completed` is true).
#[pyclass(module = "gradsync", frozen)]
#[derive(Debug)]
pub struct Work {
    done: Arc<Completion>,
    /// When the worker must have finished it (every operation is bounded by the timeout).
    deadline: Instant,
    rank: usize,
    op: &'static str,
}

impl Work {
    fn wait_inner(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<()> {
        let limit = timeout.map(|t| Instant::now() + t);
        let deadline = limit.map_or(self.deadline, |l| l.min(self.deadline));
        let done = Arc::clone(&self.done);
        if !wait_detached(py, deadline, move |d| done.wait_for(d))? {
            if limit.is_some_and(|l| l <= self.deadline) {
                return Err(PyTimeoutError::new_err(format!(
                    "rank {}: {}: not completed within {:.3} s (it is still running)",
                    self.rank,
                    self.op,
                    timeout.unwrap_or_default().as_secs_f64()
                )));
            }
            return Err(GradsyncError::new_err(format!(
                "rank {}: {}: not completed by its deadline; the communicator's thread is stuck",
                self.rank, self.op
            )));
        }
        match self.done.take_result(py) {
            Some(Ok(())) => Ok(()),
            Some(Err(msg)) => Err(GradsyncError::new_err(msg)),
            None => unreachable!("a finished operation has a result"),
        }
    }
}

#[pymethods]
impl Work {
    /// Waits for the operation to finish.
    ///
    /// ``timeout`` (seconds) limits the wait: when it elapses first, :class:`TimeoutError` is
    /// raised and the operation keeps running (wait again later). Without one the wait is
    /// still bounded, by the communicator's timeout of this and every earlier operation.
    /// Raises :class:`GradsyncError` when the operation failed (again on every later call).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = timeout_arg(timeout, "Work.wait")?;
        self.wait_inner(py, t)
    }

    /// Whether the operation has finished (successfully or not); never blocks.
    fn is_completed(&self) -> bool {
        self.done.is_done()
    }

    fn __repr__(&self) -> String {
        let state = if self.done.is_done() {
            "completed"
        } else {
            "running"
        };
        format!("<gradsync.Work {} rank={} {state}>", self.op, self.rank)
    }
}

impl Communicator {
    fn start(py: Python<'_>, config: Config) -> PyResult<Self> {
        let rank = config.rank;
        let timeout = config.timeout;
        let spawned = Worker::start(config).map_err(|e| {
            GradsyncError::new_err(format!("rank {rank}: cannot start a thread: {e}"))
        })?;
        Self::await_init(py, rank, timeout, spawned)
    }

    /// Waits for the worker thread to have its communicator (bounded by `timeout` and a
    /// margin).
    fn await_init(
        py: Python<'_>,
        rank: usize,
        timeout: Duration,
        (worker, init): (Worker, std::sync::mpsc::Receiver<Result<Info, String>>),
    ) -> PyResult<Self> {
        let deadline = Instant::now() + timeout + Duration::from_secs(30);
        let result = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&result);
        let init = Mutex::new(init);
        let ready = move |d: Duration| {
            let mut s = lock(&slot);
            if s.is_some() {
                return true;
            }
            match lock(&init).recv_timeout(d) {
                Ok(r) => {
                    *s = Some(r);
                    true
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => false,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    *s = Some(Err(format!("rank {rank}: init: the thread ended")));
                    true
                }
            }
        };
        if !wait_detached(py, deadline, ready)? {
            return Err(GradsyncError::new_err(format!(
                "rank {rank}: init did not finish within {:.0} s",
                (timeout + Duration::from_secs(30)).as_secs_f64()
            )));
        }
        let outcome = lock(&result).take().expect("set when ready");
        let info = outcome.map_err(GradsyncError::new_err)?;
        Ok(Communicator {
            info,
            worker: Mutex::new(Some(worker)),
        })
    }

    pub(crate) fn world(&self) -> usize {
        self.info.world
    }

    pub(crate) fn info_rank(&self) -> usize {
        self.info.rank
    }

    pub(crate) fn rank(&self) -> usize {
        self.info.rank
    }

    /// Runs `how` on the worker thread after the operations queued before it, and gives the
    /// communicator it makes (if any) a thread of its own.
    fn split_impl(&self, py: Python<'_>, op: &'static str, how: SplitFn) -> PyResult<Option<Self>> {
        self.check_open(op)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let task: Task = Box::new(move |c: &mut gradsync::Communicator| {
            let child = how(c)?;
            let _ = tx.send(child);
            Ok(())
        });
        Self::finish(py, self.submit(py, op, task, Keep::default()))?;
        let rank = self.info.rank;
        let child = rx.try_recv().map_err(|_| {
            GradsyncError::new_err(format!(
                "rank {rank}: {op}: the communicator's thread gave no result"
            ))
        })?;
        let Some(child) = child else {
            return Ok(None);
        };
        let timeout = child.timeout();
        let spawned = Worker::adopt(child).map_err(|e| {
            GradsyncError::new_err(format!("rank {rank}: {op}: cannot start a thread: {e}"))
        })?;
        Self::await_init(py, rank, timeout, spawned).map(Some)
    }

    /// Queues `task` with the owners of its buffers, first bumping the version counters of
    /// the torch tensors it writes (outside the worker's lock: that calls into Python).
    pub(crate) fn submit(
        &self,
        py: Python<'_>,
        op: &'static str,
        task: Task,
        keep: Keep,
    ) -> PyResult<Work> {
        bump_versions(py, &keep.written)?;
        let w = lock(&self.worker);
        let Some(worker) = w.as_ref() else {
            return Err(self.closed_error(op));
        };
        match worker.submit(task, keep.owners, self.info.timeout) {
            Ok((done, deadline)) => Ok(Work {
                done,
                deadline,
                rank: self.info.rank,
                op,
            }),
            Err(_keep) => Err(GradsyncError::new_err(format!(
                "rank {}: {op}: the communicator's thread has ended",
                self.info.rank
            ))),
        }
    }

    fn closed_error(&self, op: &str) -> PyErr {
        GradsyncError::new_err(format!(
            "rank {}: {op}: the communicator is closed",
            self.info.rank
        ))
    }

    pub(crate) fn check_open(&self, op: &str) -> PyResult<()> {
        if lock(&self.worker).is_none() {
            return Err(self.closed_error(op));
        }
        Ok(())
    }

    pub(crate) fn ctx<'a>(&self, op: &'a str, arg: &'a str) -> Ctx<'a> {
        Ctx {
            op,
            rank: self.info.rank,
            arg,
        }
    }

    pub(crate) fn invalid(&self, op: &str, msg: impl std::fmt::Display) -> PyErr {
        PyValueError::new_err(format!("rank {}: {op}: {msg}", self.info.rank))
    }

    /// Refuses an operator the buffer's type does not have (a bitwise one over a float type),
    /// as a `ValueError` at the call, before anything is submitted.
    fn check_op(&self, op: &str, rop: ReduceOp, dtype: DataType) -> PyResult<()> {
        if rop.supports(dtype) {
            return Ok(());
        }
        Err(self.invalid(
            op,
            format!(
                "op {rop} is bitwise and takes integer buffers only (int32, int64, uint8), \
                 not {}",
                dtype_name(dtype)
            ),
        ))
    }

    pub(crate) fn same_dtype(&self, op: &str, input: &Buffer, output: &Buffer) -> PyResult<()> {
        if input.dtype != output.dtype {
            return Err(PyTypeError::new_err(format!(
                "rank {}: {op}: input is {} but output is {}",
                self.info.rank,
                dtype_name(input.dtype),
                dtype_name(output.dtype)
            )));
        }
        Ok(())
    }

    /// Checks that buffer `big` holds world size x `small`'s elements.
    pub(crate) fn world_multiple(
        &self,
        op: &str,
        (big, big_len): (&str, usize),
        (small, small_len): (&str, usize),
    ) -> PyResult<()> {
        let world = self.info.world;
        if big_len == small_len * world {
            return Ok(());
        }
        Err(self.invalid(
            op,
            format!(
                "{big} has {big_len} elements but must have world size {world} x {small}'s {small_len} = {}",
                small_len * world
            ),
        ))
    }

    pub(crate) fn no_overlap(&self, op: &str, input: &Buffer, output: &Buffer) -> PyResult<()> {
        if input.overlaps(output) {
            return Err(self.invalid(op, "input and output share memory; pass separate arrays"));
        }
        Ok(())
    }

    /// The error for a `small` buffer that shares memory with `big` without being its block
    /// `rank` (the only overlap NCCL's in-place rule allows).
    fn no_overlap_unless_block(
        &self,
        op: &str,
        big: &Buffer,
        small: &Buffer,
        small_name: &str,
        big_name: &str,
    ) -> PyResult<()> {
        if big.overlaps(small) {
            let r = self.info.rank;
            return Err(self.invalid(
                op,
                format!(
                    "input and output share memory, but {small_name} is not block {r} of the {big_name} ({} elements from element {r} x {}): in place, {small_name} must be exactly this rank's block; otherwise pass separate arrays",
                    small.len, small.len
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_root(&self, op: &str, root: usize) -> PyResult<()> {
        if root >= self.info.world {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} is not a rank of world size {}",
                    self.info.world
                ),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, op: &str, peer: usize) -> PyResult<()> {
        if peer >= self.info.world || peer == self.info.rank {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} is not another rank of world size {}",
                    self.info.world
                ),
            ));
        }
        Ok(())
    }

    /// Runs `work` to its end: a blocking call.
    pub(crate) fn finish(py: Python<'_>, work: PyResult<Work>) -> PyResult<()> {
        work?.wait_inner(py, None)
    }

    fn all_reduce_impl(&self, buf: &Bound<'_, PyAny>, op: &str) -> PyResult<Work> {
        const NAME: &str = "all_reduce";
        let py = buf.py();
        self.check_open(NAME)?;
        let rop = parse_op(op, self.rank(), NAME)?;
        let b = extract(buf, Access::Write, self.ctx(NAME, "buf"))?;
        let dt = b.dtype;
        self.check_op(NAME, rop, dt)?;
        let (s, keep) = b.into_parts();
        let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
            // SAFETY: `s` describes `T`s (dispatch on its dtype) in writable memory (checked)
            // of a numpy ndarray (`extract` accepts nothing else) that owns or references that
            // memory; the ndarray travels with this job until it has finished, so the memory
            // stays allocated; the caller is told not to touch a buffer of an unfinished
            // operation, and no other slice of it exists.
            let buf = unsafe { s.slice_mut::<T>() };
            c.all_reduce(buf, rop)
        }));
        self.submit(py, NAME, task, keep)
    }

    fn reduce_scatter_impl(
        &self,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<Work> {
        const NAME: &str = "reduce_scatter";
        let py = input.py();
        self.check_open(NAME)?;
        let rop = parse_op(op, self.rank(), NAME)?;
        let i = extract(input, Access::Read, self.ctx(NAME, "input"))?;
        let o = extract(output, Access::Write, self.ctx(NAME, "output"))?;
        self.same_dtype(NAME, &i, &o)?;
        self.world_multiple(NAME, ("input", i.len), ("output", o.len))?;
        let in_place = o.is_block_of(&i, self.info.rank);
        if !in_place {
            self.no_overlap_unless_block(NAME, &i, &o, "the output", "input")?;
        }
        let dt = i.dtype;
        self.check_op(NAME, rop, dt)?;
        let (si, mut keep) = i.into_parts();
        let (so, k) = o.into_parts();
        keep.extend(k);
        if in_place {
            let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
                // SAFETY: the output is block `rank` of the input (checked), so the input is
                // the one buffer; typed, writable (the output's memory is the input's and the
                // input was checked readable; the output writable), alive with this job.
                let buf = unsafe { si.slice_mut::<T>() };
                c.reduce_scatter_in_place(buf, rop)
            }));
            return self.submit(py, NAME, task, keep);
        }
        let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
            // SAFETY: both describe `T`s whose owners travel with this job; the output is
            // writable and does not overlap the input (both checked); the caller does not
            // touch them until the operation has finished.
            let (input, output) = unsafe { (si.slice::<T>(), so.slice_mut::<T>()) };
            c.reduce_scatter(input, output, rop)
        }));
        self.submit(py, NAME, task, keep)
    }

    fn all_gather_impl(
        &self,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
    ) -> PyResult<Work> {
        const NAME: &str = "all_gather";
        let py = input.py();
        self.check_open(NAME)?;
        let i = extract(input, Access::Read, self.ctx(NAME, "input"))?;
        let o = extract(output, Access::Write, self.ctx(NAME, "output"))?;
        self.same_dtype(NAME, &i, &o)?;
        self.world_multiple(NAME, ("output", o.len), ("input", i.len))?;
        let in_place = i.is_block_of(&o, self.info.rank);
        if !in_place {
            self.no_overlap_unless_block(NAME, &o, &i, "the input", "output")?;
        }
        let dt = i.dtype;
        let (si, mut keep) = i.into_parts();
        let (so, k) = o.into_parts();
        keep.extend(k);
        if in_place {
            let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
                // SAFETY: the input is block `rank` of the output (checked), so the output is
                // the one buffer: typed, writable (checked), alive with this job.
                let buf = unsafe { so.slice_mut::<T>() };
                c.all_gather_in_place(buf)
            }));
            return self.submit(py, NAME, task, keep);
        }
        let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
            // SAFETY: as in reduce_scatter: typed, alive, output writable, no overlap.
            let (input, output) = unsafe { (si.slice::<T>(), so.slice_mut::<T>()) };
            c.all_gather(input, output)
        }));
        self.submit(py, NAME, task, keep)
    }

    fn broadcast_impl(&self, buf: &Bound<'_, PyAny>, root: usize) -> PyResult<Work> {
        const NAME: &str = "broadcast";
        let py = buf.py();
        self.check_open(NAME)?;
        self.check_root(NAME, root)?;
        let b = extract(buf, Access::Write, self.ctx(NAME, "buf"))?;
        let dt = b.dtype;
        let (s, keep) = b.into_parts();
        let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
            // SAFETY: as in all_reduce: typed, writable, alive, not otherwise referenced.
            let buf = unsafe { s.slice_mut::<T>() };
            c.broadcast(buf, root)
        }));
        self.submit(py, NAME, task, keep)
    }

    fn reduce_impl(
        &self,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        op: &str,
        root: usize,
    ) -> PyResult<Work> {
        const NAME: &str = "reduce";
        let py = input.py();
        self.check_open(NAME)?;
        let rop = parse_op(op, self.rank(), NAME)?;
        self.check_root(NAME, root)?;
        let i = extract(input, Access::Read, self.ctx(NAME, "input"))?;
        self.check_op(NAME, rop, i.dtype)?;
        let is_root = self.info.rank == root;
        let o = match output {
            Some(o) if is_root => {
                let o = extract(o, Access::Write, self.ctx(NAME, "output"))?;
                self.same_dtype(NAME, &i, &o)?;
                if o.len != i.len {
                    return Err(self.invalid(
                        NAME,
                        format!(
                            "input has {} elements but the root's output has {}",
                            i.len, o.len
                        ),
                    ));
                }
                self.no_overlap(NAME, &i, &o)?;
                o
            }
            None if is_root => {
                return Err(self.invalid(
                    NAME,
                    format!("the root (rank {root}) needs an output array"),
                ));
            }
            // Other ranks' output is never written.
            _ => Buffer::empty(i.dtype),
        };
        let dt = i.dtype;
        let (si, mut keep) = i.into_parts();
        let (so, k) = o.into_parts();
        keep.extend(k);
        let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
            // SAFETY: as in reduce_scatter: typed, alive, the root's output writable and
            // separate from the input; elsewhere the output is empty.
            let (input, output) = unsafe { (si.slice::<T>(), so.slice_mut::<T>()) };
            c.reduce(input, output, rop, root)
        }));
        self.submit(py, NAME, task, keep)
    }

    fn barrier_impl(&self, py: Python<'_>) -> PyResult<Work> {
        const NAME: &str = "barrier";
        self.check_open(NAME)?;
        self.submit(py, NAME, Box::new(|c| c.barrier()), Keep::default())
    }

    fn p2p(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: usize, send: bool) -> PyResult<()> {
        let name = if send { "send" } else { "recv" };
        self.check_open(name)?;
        self.check_peer(name, peer)?;
        let access = if send { Access::Read } else { Access::Write };
        let b = extract(buf, access, self.ctx(name, "buf"))?;
        let dt = b.dtype;
        let (s, keep) = b.into_parts();
        let task: Task = if send {
            with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
                // SAFETY: typed and alive (travels with the job); only read.
                let buf = unsafe { s.slice::<T>() };
                c.send(buf, peer)
            }))
        } else {
            with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
                // SAFETY: typed, writable (checked), alive, not otherwise referenced.
                let buf = unsafe { s.slice_mut::<T>() };
                c.recv(buf, peer)
            }))
        };
        Self::finish(py, self.submit(py, name, task, keep))
    }
}

#[pymethods]
impl Communicator {
    #[new]
    #[pyo3(signature = (store_addr, rank, world_size, *, host_store=true, timeout=None))]
    fn new(
        py: Python<'_>,
        store_addr: String,
        rank: usize,
        world_size: usize,
        host_store: bool,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        gradsync::logging::init_from_env();
        if world_size == 0 || rank >= world_size {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is not within world size {world_size}"
            )));
        }
        let mut config = Config::new(store_addr, rank, world_size);
        config.host_store = host_store;
        config
            .apply_env()
            .map_err(|e| GradsyncError::new_err(e.to_string()))?;
        if let Some(t) = timeout_arg(timeout, "Communicator")? {
            if t.is_zero() {
                return Err(PyValueError::new_err(
                    "Communicator: timeout must be positive",
                ));
            }
            config.timeout = t;
        }
        Self::start(py, config)
    }

    /// Joins the group described by the launcher's environment.
    ///
    /// Reads torchrun / ``gradsync launch`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    /// ``MASTER_ADDR``, ``MASTER_PORT``), Open MPI (``OMPI_COMM_WORLD_*``) or Slurm
    /// (``SLURM_PROCID``, ``SLURM_NTASKS``, ...) variables, and every ``GRADSYNC_*`` tunable.
    /// Under torchrun, whose agent already serves a store on ``MASTER_PORT``, rank 0 starts
    /// gradsync's store on ``MASTER_PORT + 1`` (``GRADSYNC_STORE_PORT`` overrides the port).
    /// Raises :class:`GradsyncError` when the environment is incomplete or init fails.
    #[classmethod]
    fn from_env(_cls: &Bound<'_, PyType>, py: Python<'_>) -> PyResult<Self> {
        gradsync::logging::init_from_env();
        let config = Config::from_env().map_err(|e| GradsyncError::new_err(e.to_string()))?;
        Self::start(py, config)
    }

    /// This process's rank, ``0 <= rank < world_size``.
    #[getter]
    fn get_rank(&self) -> usize {
        self.info.rank
    }

    /// Number of ranks in the group.
    #[getter]
    fn world_size(&self) -> usize {
        self.info.world
    }

    /// Name of the transport between this rank and its peers (``tcp``, ``shm``, ``hybrid``, ...).
    #[getter]
    fn transport(&self) -> String {
        self.info.transport.clone()
    }

    /// The deadline of init and of each operation, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.info.timeout.as_secs_f64()
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.worker).is_none()
    }

    /// All-reduce in place: every rank's ``buf`` becomes ``op`` over all ranks' ``buf``
    /// (bitwise identical on every rank).
    ///
    /// ``op`` is ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"avg"`` (the sum divided by
    /// the world size; integers truncate toward zero), or for integer buffers one of the
    /// bitwise ``"band"``, ``"bor"`` and ``"bxor"``. Integer sums and products wrap. A bitwise
    /// ``op`` over a float buffer raises ``ValueError`` at the call, as does an unknown ``op``.
    #[pyo3(signature = (buf, op="sum"))]
    fn all_reduce(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, op: &str) -> PyResult<()> {
        Self::finish(py, self.all_reduce_impl(buf, op))
    }

    /// Starts :meth:`all_reduce` and returns its :class:`Work`.
    #[pyo3(signature = (buf, op="sum"))]
    fn all_reduce_async(&self, buf: &Bound<'_, PyAny>, op: &str) -> PyResult<Work> {
        self.all_reduce_impl(buf, op)
    }

    /// Reduce-scatter: ``input`` holds ``world_size * n`` elements; ``output`` (``n``
    /// elements) gets block ``rank`` of ``op`` over all ranks' ``input``.
    #[pyo3(signature = (input, output, op="sum"))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<()> {
        Self::finish(py, self.reduce_scatter_impl(input, output, op))
    }

    /// Starts :meth:`reduce_scatter` and returns its :class:`Work`.
    #[pyo3(signature = (input, output, op="sum"))]
    fn reduce_scatter_async(
        &self,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<Work> {
        self.reduce_scatter_impl(input, output, op)
    }

    /// All-gather: ``output`` (``world_size * n`` elements) gets every rank's ``input`` (``n``
    /// elements), rank ``r``'s at offset ``r * n``.
    fn all_gather(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        Self::finish(py, self.all_gather_impl(input, output))
    }

    /// Starts :meth:`all_gather` and returns its :class:`Work`.
    fn all_gather_async(
        &self,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
    ) -> PyResult<Work> {
        self.all_gather_impl(input, output)
    }

    /// Broadcast in place: every rank's ``buf`` gets rank ``root``'s.
    #[pyo3(signature = (buf, root=0))]
    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, root: usize) -> PyResult<()> {
        Self::finish(py, self.broadcast_impl(buf, root))
    }

    /// Starts :meth:`broadcast` and returns its :class:`Work`.
    #[pyo3(signature = (buf, root=0))]
    fn broadcast_async(&self, buf: &Bound<'_, PyAny>, root: usize) -> PyResult<Work> {
        self.broadcast_impl(buf, root)
    }

    /// Reduce: the root's ``output`` gets ``op`` over all ranks' ``input``.
    ///
    /// The other ranks' ``output`` may be ``None``; it is never written.
    #[pyo3(signature = (input, output, op="sum", root=0))]
    fn reduce(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        op: &str,
        root: usize,
    ) -> PyResult<()> {
        Self::finish(py, self.reduce_impl(input, output, op, root))
    }

    /// Starts :meth:`reduce` and returns its :class:`Work`.
    #[pyo3(signature = (input, output, op="sum", root=0))]
    fn reduce_async(
        &self,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        op: &str,
        root: usize,
    ) -> PyResult<Work> {
        self.reduce_impl(input, output, op, root)
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        Self::finish(py, self.barrier_impl(py))
    }

    /// Starts :meth:`barrier` and returns its :class:`Work`.
    fn barrier_async(&self, py: Python<'_>) -> PyResult<Work> {
        self.barrier_impl(py)
    }

    /// Sends ``buf`` to rank ``peer``, which calls :meth:`recv` with as many elements of the
    /// same type.
    ///
    /// Blocking. The sends and receives between two ranks are matched in order: the k-th
    /// ``send``/``recv`` of one with the other meets the other's k-th, which must be the
    /// opposite call. A send larger than the transport's receive slots ((``GRADSYNC_NSLOTS``
    /// - 1) x ``GRADSYNC_CHUNK_SIZE``, 3.5 MiB by default; with ``GRADSYNC_TCP_NSLOTS``, 1 MiB,
    /// over TCP inside a host) returns only once the peer receives
    /// it, so two ranks that both send first fail (at once, or at the timeout for large sends).
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        self.p2p(py, buf, peer, true)
    }

    /// Receives into ``buf`` what rank ``peer`` sends with :meth:`send`.
    ///
    /// Blocking, and matched in order with the peer's calls (see :meth:`send`).
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        self.p2p(py, buf, peer, false)
    }

    /// Splits the group into disjoint new ones, as ``ncclCommSplit`` and ``MPI_Comm_split``
    /// do, and returns this rank's new :class:`Communicator` (``None`` when ``color`` is
    /// ``None``).
    ///
    /// Every rank calls it; the ranks that pass the same ``color`` (an integer, 0 or more)
    /// form a new communicator, in which they are numbered in the order of their ``key``,
    /// ties broken by their rank here. A rank that passes ``color=None`` takes part and gets
    /// no communicator. No rendezvous store is involved: the colors are all-gathered over
    /// this communicator, and the members of each new one swap their connection records over
    /// its point-to-point messages. The new communicator has this one's settings (transport,
    /// tunables, timeout); this one stays usable. Runs after the operations queued before it,
    /// bounded by this communicator's timeout; raises :class:`GradsyncError` when a rank does
    /// not take part. ``timeout`` (seconds) sets the new communicator's deadline of each
    /// operation (default: this one's).
    #[pyo3(signature = (color, key=0, *, timeout=None))]
    fn split(
        &self,
        py: Python<'_>,
        color: Option<i64>,
        key: i64,
        timeout: Option<f64>,
    ) -> PyResult<Option<Self>> {
        const NAME: &str = "split";
        let timeout = positive_timeout(timeout, "Communicator.split")?;
        let color = match color {
            None => None,
            Some(c) => Some(u32::try_from(c).map_err(|_| {
                self.invalid(
                    NAME,
                    format!("color {c} is out of range (0 to {}, or None)", u32::MAX),
                )
            })?),
        };
        self.split_impl(
            py,
            NAME,
            Box::new(move |c| {
                let mut child = c.split(color, key)?;
                if let (Some(child), Some(t)) = (child.as_mut(), timeout) {
                    child.set_timeout(t);
                }
                Ok(child)
            }),
        )
    }

    /// A new communicator of the ranks ``ranks`` of this one, built by them alone (as
    /// ``MPI_Comm_create_group``): every rank in ``ranks`` calls it with the same list, the
    /// others do not call it. The new rank of a member is its position in ``ranks``.
    ///
    /// As :meth:`split` otherwise: no rendezvous store, the records go over this
    /// communicator's point-to-point messages between the members only. Between two
    /// members, their splits and their other calls on this communicator must come in the same
    /// order. ``timeout`` as in :meth:`split`. Raises :class:`ValueError` for a list that
    /// repeats a rank, names one outside the group or leaves this rank out, and
    /// :class:`GradsyncError` when members pass different lists or one does not call.
    #[pyo3(signature = (ranks, *, timeout=None))]
    fn split_ranks(&self, py: Python<'_>, ranks: Vec<i64>, timeout: Option<f64>) -> PyResult<Self> {
        const NAME: &str = "split_ranks";
        let timeout = positive_timeout(timeout, "Communicator.split_ranks")?;
        let world = self.info.world;
        let ranks = ranks
            .iter()
            .map(|&r| {
                usize::try_from(r)
                    .ok()
                    .filter(|&r| r < world)
                    .ok_or_else(|| {
                        self.invalid(
                            NAME,
                            format!("rank {r} of {ranks:?} is not a rank of world size {world}"),
                        )
                    })
            })
            .collect::<PyResult<Vec<usize>>>()?;
        for (i, r) in ranks.iter().enumerate() {
            if ranks[..i].contains(r) {
                return Err(self.invalid(NAME, format!("rank {r} appears twice in {ranks:?}")));
            }
        }
        if !ranks.contains(&self.info.rank) {
            return Err(self.invalid(
                NAME,
                format!(
                    "rank {} is not among {ranks:?}: only the members call it",
                    self.info.rank
                ),
            ));
        }
        let child = self.split_impl(
            py,
            NAME,
            Box::new(move |c| {
                let mut child = c.split_ranks(&ranks)?;
                if let Some(t) = timeout {
                    child.set_timeout(t);
                }
                Ok(Some(child))
            }),
        )?;
        child.ok_or_else(|| {
            GradsyncError::new_err(format!(
                "rank {}: {NAME}: no communicator came back",
                self.info.rank
            ))
        })
    }

    /// Finishes the operations already started, then closes the connections. Later calls
    /// raise :class:`GradsyncError`; closing again does nothing.
    ///
    /// Raises :class:`GradsyncError` when the communicator's thread has not ended by the
    /// deadline of the operations it still had to run (plus a margin); those operations are
    /// then left to it.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(worker) = lock(&self.worker).take() else {
            return Ok(());
        };
        // The queued operations are bounded by their deadlines, closing by a few seconds.
        let bound = worker.drain_bound(self.info.timeout);
        let deadline = Instant::now() + bound;
        let (thread, pending) = worker.finish();
        let handle = Mutex::new(Some(thread));
        let ended = wait_detached(py, deadline, |d| {
            let mut h = lock(&handle);
            match h.as_ref() {
                None => true,
                Some(j) if j.is_finished() => {
                    let _ = h.take().map(std::thread::JoinHandle::join);
                    true
                }
                Some(_) => {
                    drop(h);
                    std::thread::sleep(d.min(Duration::from_millis(5)));
                    false
                }
            }
        })?;
        if !ended {
            let what = match pending.load(Ordering::SeqCst) {
                0 => "no operation is pending; it is closing the connections".to_string(),
                1 => "1 operation is still pending".to_string(),
                n => format!("{n} operations are still pending"),
            };
            return Err(GradsyncError::new_err(format!(
                "rank {}: close: the communicator's thread did not end within {:.0} s; {what}",
                self.info.rank,
                bound.as_secs_f64(),
            )));
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<gradsync.Communicator rank={} world_size={} transport={}{}>",
            self.info.rank,
            self.info.world,
            self.info.transport,
            if self.closed() { " closed" } else { "" }
        )
    }
}
