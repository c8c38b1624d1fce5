//! One worker thread per communicator: it builds the communicator (or takes one split from
//! another), then runs the submitted operations one after the other, in submission order,
//! without the GIL.
//!
//! A blocking call from Python is a submission followed by a wait; an async call returns the
//! [`Completion`] to wait on later. Each job carries the Python objects that own its buffers,
//! so their memory outlives the operation even when the caller drops every other reference:
//! they are handed back with the outcome and released by whoever looks at it (or, when nobody
//! does, through PyO3's deferred reference release).

use gradsync::{Communicator, Config};
use pyo3::prelude::*;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What an operation runs on the worker thread.
pub(crate) type Task = Box<dyn FnOnce(&mut Communicator) -> gradsync::Result<()> + Send>;

/// A submitted operation.
pub(crate) struct Job {
    task: Task,
    /// Owners of the buffers the task uses.
    keep: Vec<Py<PyAny>>,
    done: Arc<Completion>,
}

/// How an operation ended.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// `Err` holds the Rust error's message.
    pub(crate) result: Result<(), String>,
    /// The buffers' owners, released once the outcome is seen.
    keep: Vec<Py<PyAny>>,
}

/// The completion of one operation: set once by the worker, waited on by Python.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    state: Mutex<Option<Outcome>>,
    cv: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Completion {
    fn set(&self, outcome: Outcome) {
        *lock(&self.state) = Some(outcome);
        self.cv.notify_all();
    }

    /// Whether the operation has finished.
    pub(crate) fn is_done(&self) -> bool {
        lock(&self.state).is_some()
    }

    /// Waits up to `d` for the operation to finish; returns whether it has.
    pub(crate) fn wait_for(&self, d: Duration) -> bool {
        let g = lock(&self.state);
        let (g, _) = self
            .cv
            .wait_timeout_while(g, d, |s| s.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        g.is_some()
    }

    /// The result of a finished operation (`None` while it runs); the buffers' owners are
    /// released (the caller holds the GIL).
    pub(crate) fn take_result(&self, _py: Python<'_>) -> Option<Result<(), String>> {
        let mut g = lock(&self.state);
        let o = g.as_mut()?;
        let keep = std::mem::take(&mut o.keep);
        let r = o.result.clone();
        drop(g);
        drop(keep);
        Some(r)
    }
}

/// What init tells the Python side about the communicator.
#[derive(Clone, Debug)]
pub(crate) struct Info {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) transport: String,
    pub(crate) timeout: Duration,
}

/// The Python side's handle on a worker.
#[derive(Debug)]
pub(crate) struct Worker {
    tx: Sender<Job>,
    thread: JoinHandle<()>,
    /// Operations submitted and not finished.
    pending: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").finish_non_exhaustive()
    }
}

/// Extra time a wait allows beyond the operations' own deadlines before it reports the worker
/// as stuck.
const SLACK: Duration = Duration::from_secs(30);

impl Worker {
    /// Starts the thread, which builds the communicator from `config`; `init` is the receiver
    /// of init's result.
    pub(crate) fn start(
        config: Config,
    ) -> std::io::Result<(Worker, Receiver<Result<Info, String>>)> {
        let name = format!("gradsync-rank{}", config.rank);
        Self::spawn(name, move || Communicator::init(config))
    }

    /// Starts the thread of a communicator that is already built (split from another).
    pub(crate) fn adopt(
        comm: Communicator,
    ) -> std::io::Result<(Worker, Receiver<Result<Info, String>>)> {
        let name = format!("gradsync-rank{}of{}", comm.rank(), comm.world_size());
        Self::spawn(name, move || Ok(comm))
    }

    fn spawn(
        name: String,
        build: impl FnOnce() -> gradsync::Result<Communicator> + Send + 'static,
    ) -> std::io::Result<(Worker, Receiver<Result<Info, String>>)> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (init_tx, init_rx) = mpsc::sync_channel(1);
        let pending = Arc::new(AtomicUsize::new(0));
        let p = Arc::clone(&pending);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || run(build, &rx, &init_tx, &p))?;
        Ok((
            Worker {
                tx,
                thread,
                pending,
            },
            init_rx,
        ))
    }

    /// Queues `task`; `keep` owns the memory it uses. Returns the completion, and a deadline
    /// by which it must have finished: every operation ahead of it and its own are bounded by
    /// `timeout` each.
    pub(crate) fn submit(
        &self,
        task: Task,
        keep: Vec<Py<PyAny>>,
        timeout: Duration,
    ) -> Result<(Arc<Completion>, Instant), Vec<Py<PyAny>>> {
        let done = Arc::new(Completion::default());
        let ahead = self.pending.fetch_add(1, Ordering::SeqCst);
        let bound = timeout
            .saturating_mul(u32::try_from(ahead + 1).unwrap_or(u32::MAX))
            .saturating_add(SLACK);
        let deadline = Instant::now()
            .checked_add(bound)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86400 * 365));
        let job = Job {
            task,
            keep,
            done: Arc::clone(&done),
        };
        match self.tx.send(job) {
            Ok(()) => Ok((done, deadline)),
            Err(mpsc::SendError(job)) => {
                self.pending.fetch_sub(1, Ordering::SeqCst);
                Err(job.keep)
            }
        }
    }

    /// How long the operations still queued may take, at most.
    pub(crate) fn drain_bound(&self, timeout: Duration) -> Duration {
        let n = self.pending.load(Ordering::SeqCst);
        timeout
            .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
            .saturating_add(SLACK)
    }

    /// Stops taking operations; the thread finishes the queued ones, closes the communicator
    /// and ends. Returns its handle, and the count of operations submitted and not finished.
    pub(crate) fn finish(self) -> (JoinHandle<()>, Arc<AtomicUsize>) {
        drop(self.tx);
        (self.thread, self.pending)
    }
}

fn run(
    build: impl FnOnce() -> gradsync::Result<Communicator>,
    rx: &Receiver<Job>,
    init: &mpsc::SyncSender<Result<Info, String>>,
    pending: &AtomicUsize,
) {
    let comm = catch_unwind(AssertUnwindSafe(build));
    let mut comm = match comm {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            let _ = init.send(Err(e.to_string()));
            return;
        }
        Err(p) => {
            let _ = init.send(Err(format!("init panicked: {}", panic_message(&*p))));
            return;
        }
    };
    let info = Info {
        rank: comm.rank(),
        world: comm.world_size(),
        transport: comm.transport().to_string(),
        timeout: comm.timeout(),
    };
    if init.send(Ok(info)).is_err() {
        // The caller gave up (interrupted) before init finished.
        return;
    }
    let rank = comm.rank();
    let mut broken: Option<String> = None;
    for job in rx.iter() {
        let result = match &broken {
            Some(why) => Err(why.clone()),
            None => match catch_unwind(AssertUnwindSafe(|| (job.task)(&mut comm))) {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(p) => {
                    let why = format!(
                        "rank {rank}: internal error: an operation panicked ({}); the communicator is unusable",
                        panic_message(&*p)
                    );
                    broken = Some(why.clone());
                    Err(why)
                }
            },
        };
        pending.fetch_sub(1, Ordering::SeqCst);
        job.done.set(Outcome {
            result,
            keep: job.keep,
        });
    }
    drop(comm);
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Waits, without the GIL, until `ready()` or `deadline`, checking for signals (Ctrl-C) every
/// 100 ms. Returns whether `ready()` became true.
pub(crate) fn wait_detached(
    py: Python<'_>,
    deadline: Instant,
    ready: impl Fn(Duration) -> bool + Send + Sync,
) -> PyResult<bool> {
    loop {
        let now = Instant::now();
        let left = deadline.saturating_duration_since(now);
        let slice = left.min(Duration::from_millis(100));
        if py.detach(|| ready(slice)) {
            return Ok(true);
        }
        py.check_signals()?;
        if Instant::now() >= deadline {
            return Ok(false);
        }
    }
}
