//! The gradient reducer: buckets, accumulation, overlapped all-reduce, one division.

use std::time::{Duration, Instant};

use crate::{Error, Result};
use gradsync::{Communicator, ReduceOp, Work};

/// Default bucket capacity: 25 MiB, as PyTorch DDP's `bucket_cap_mb`.
///
/// Large enough that the per-message latency is amortised, small enough that a deep model has
/// several buckets to overlap with its backward pass. `GRADSYNC_BUCKET_MB` overrides it (see
/// [`bucket_cap_from_env`]).
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 << 20;

/// Bytes of one gradient element (`f32`).
const ELEM: usize = std::mem::size_of::<f32>();

/// A bucket capacity in bytes from a size in MiB (`2^20` bytes; fractions allowed, e.g. `0.25`).
pub fn bucket_cap_bytes(mib: f64) -> Result<usize> {
    if !mib.is_finite() || mib <= 0.0 {
        return Err(Error::Config(format!(
            "bucket size must be a positive number of MiB, not {mib}"
        )));
    }
    let bytes = (mib * (1u64 << 20) as f64).round();
    if bytes < ELEM as f64 || bytes > isize::MAX as f64 {
        return Err(Error::Config(format!(
            "bucket size {mib} MiB is out of range (at least {ELEM} bytes)"
        )));
    }
    Ok(bytes as usize)
}

/// The bucket capacity in bytes: `GRADSYNC_BUCKET_MB` (MiB, fractions allowed) when set and
/// not empty, [`DEFAULT_BUCKET_CAP_BYTES`] otherwise.
pub fn bucket_cap_from_env() -> Result<usize> {
    match std::env::var("GRADSYNC_BUCKET_MB") {
        Ok(v) if !v.trim().is_empty() => {
            let mib: f64 = v.trim().parse().map_err(|_| {
                Error::Config(format!("GRADSYNC_BUCKET_MB={v:?} is not a number of MiB"))
            })?;
            bucket_cap_bytes(mib)
                .map_err(|e| Error::Config(format!("GRADSYNC_BUCKET_MB={v:?}: {e}")))
        }
        _ => Ok(DEFAULT_BUCKET_CAP_BYTES),
    }
}

/// Assigns parameters (given by their sizes in elements, in registration order) to buckets of
/// at most `cap_bytes` bytes of `f32` each; returns every bucket's parameter indices, in the
/// order they are laid out in the bucket's buffer.
///
/// Parameters are taken in **reverse** registration order, the order in which backward
/// produces their gradients, and a bucket is closed when the next parameter would overflow it.
/// A parameter larger than the cap gets a bucket of its own; no bucket is empty.
pub fn assign_buckets(param_sizes: &[usize], cap_bytes: usize) -> Vec<Vec<usize>> {
    let cap = (cap_bytes / ELEM).max(1);
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_len = 0usize;
    for p in (0..param_sizes.len()).rev() {
        let n = param_sizes[p];
        if !cur.is_empty() && cur_len + n > cap {
            buckets.push(std::mem::take(&mut cur));
            cur_len = 0;
        }
        cur.push(p);
        cur_len += n;
    }
    if !cur.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// Timing and volume of one step's gradient synchronisation.
///
/// Progress is driven by the caller (in [`Reducer::mark_ready`] and [`Reducer::finish`]), so a
/// bucket's completion is seen at the first call after it happened; the spans below are as seen
/// by this rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Gradient bytes all-reduced (every bucket once).
    pub bytes: usize,
    /// Ranks in the communicator.
    pub world: usize,
    /// From the first bucket's start to the last bucket's completion: the communication span.
    pub comm: Duration,
    /// Time blocked in [`Reducer::finish`]: the communication that backward did not hide.
    pub wait: Duration,
    /// The part of [`comm`](Self::comm) that passed before `finish` was entered, behind
    /// backward.
    pub hidden: Duration,
}

impl StepStats {
    /// Share of the communication span hidden behind backward, `hidden / comm`, in `[0, 1]`
    /// (0 when nothing was communicated: a single rank, or an empty span; and with overlap
    /// off).
    pub fn overlap_fraction(&self) -> f64 {
        if self.world < 2 || self.comm.is_zero() {
            0.0
        } else {
            (self.hidden.as_secs_f64() / self.comm.as_secs_f64()).clamp(0.0, 1.0)
        }
    }

    /// Bus bandwidth of the step's all-reduces in bytes per second: `bytes * 2(n-1)/n / comm`,
    /// the nccl-tests definition (the traffic each rank's link carries in a ring all-reduce).
    ///
    /// With overlap the span also covers the backward computation between progress calls, so
    /// this is a lower bound of what the links did; with overlap off it is the plain figure.
    /// 0 for a single rank or an empty span.
    pub fn bus_bandwidth(&self) -> f64 {
        if self.world < 2 || self.comm.is_zero() {
            return 0.0;
        }
        let n = self.world as f64;
        self.bytes as f64 * 2.0 * (n - 1.0) / n / self.comm.as_secs_f64()
    }
}

/// Where a parameter's gradient lives.
#[derive(Clone, Copy, Debug)]
struct Slot {
    bucket: usize,
    offset: usize,
    len: usize,
}

#[derive(Debug)]
struct Bucket {
    /// Parameter indices, in buffer order.
    params: Vec<usize>,
    /// Elements.
    len: usize,
    /// The accumulation buffer; `None` while it is on the wire.
    buf: Option<Vec<f32>>,
    /// The all-reduce in flight.
    work: Option<Work<f32>>,
    /// Parameters not yet reported in the current micro-batch.
    pending: usize,
    /// When its all-reduce was queued and when its completion was seen.
    started: Option<Instant>,
    done: Option<Instant>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// No step begun, or the last one finished.
    Idle,
    /// Between `begin_step` and `finish`.
    Accumulating,
    /// A collective failed mid-step; buffers may be lost and are rebuilt by `begin_step`.
    Broken,
}

/// Bucketed, overlapped gradient all-reduce with accumulation over micro-batches (Loop 2 of a
/// data-parallel step; see the [crate documentation](crate)).
///
/// A step is [`begin_step`](Self::begin_step)`(K)`, then for each of the K micro-batches one
/// [`mark_ready`](Self::mark_ready) per parameter as backward makes its gradient final, then
/// [`finish`](Self::finish), which returns the gradients averaged over world x K micro-batches.
/// Every rank must register the same parameter sizes and run the same steps.
#[derive(Debug)]
pub struct Reducer {
    slots: Vec<Slot>,
    buckets: Vec<Bucket>,
    overlap: bool,
    phase: Phase,
    /// Micro-batches of the current step, and the index of the one being reported.
    k: usize,
    micro: usize,
    ready: Vec<bool>,
    marked: usize,
    /// Buckets `..launched` are queued; `..seen_done` are known complete.
    launched: usize,
    seen_done: usize,
    first_start: Option<Instant>,
    stats: StepStats,
}

impl Reducer {
    /// A reducer for parameters of `param_sizes` elements (registration order, the order of the
    /// forward pass), in buckets of at most `bucket_cap_bytes` (see [`assign_buckets`]; pass
    /// [`bucket_cap_from_env`]`()?` for the default). Overlap is on.
    pub fn new(param_sizes: &[usize], bucket_cap_bytes: usize) -> Result<Self> {
        if bucket_cap_bytes < ELEM {
            return Err(Error::Config(format!(
                "bucket cap of {bucket_cap_bytes} bytes cannot hold one f32"
            )));
        }
        if let Some(p) = param_sizes.iter().position(|&n| n == 0) {
            return Err(Error::Config(format!("parameter {p} has no elements")));
        }
        let mut slots = vec![
            Slot {
                bucket: 0,
                offset: 0,
                len: 0
            };
            param_sizes.len()
        ];
        let buckets = assign_buckets(param_sizes, bucket_cap_bytes)
            .into_iter()
            .enumerate()
            .map(|(b, params)| {
                let mut len = 0;
                for &p in &params {
                    slots[p] = Slot {
                        bucket: b,
                        offset: len,
                        len: param_sizes[p],
                    };
                    len += param_sizes[p];
                }
                Bucket {
                    pending: params.len(),
                    params,
                    len,
                    buf: Some(vec![0.0; len]),
                    work: None,
                    started: None,
                    done: None,
                }
            })
            .collect();
        Ok(Reducer {
            slots,
            buckets,
            overlap: true,
            phase: Phase::Idle,
            k: 1,
            micro: 0,
            ready: vec![false; param_sizes.len()],
            marked: 0,
            launched: 0,
            seen_done: 0,
            first_start: None,
            stats: StepStats::default(),
        })
    }

    /// Turns overlap on (default: a bucket starts as soon as its gradients are final) or off
    /// (every bucket starts in [`finish`](Self::finish), after backward).
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// Whether buckets start during backward.
    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// Number of registered parameters.
    pub fn num_params(&self) -> usize {
        self.slots.len()
    }

    /// Number of buckets.
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// The parameters of bucket `b`, in buffer order (panics if `b` is out of range).
    pub fn bucket_params(&self, b: usize) -> &[usize] {
        &self.buckets[b].params
    }

    /// The bucket that holds parameter `p` (panics if `p` is out of range).
    pub fn bucket_of(&self, p: usize) -> usize {
        self.slots[p].bucket
    }

    /// Total gradient elements over all parameters.
    pub fn num_elements(&self) -> usize {
        self.buckets.iter().map(|b| b.len).sum()
    }

    /// The micro-batch being reported (0-based) in the current step.
    pub fn micro_batch(&self) -> usize {
        self.micro
    }

    /// Whether the micro-batch being reported is the step's last, the one whose gradients are
    /// synchronised (the earlier ones only accumulate, as under PyTorch's `no_sync()`).
    pub fn is_sync_micro_batch(&self) -> bool {
        self.micro + 1 == self.k
    }

    /// Timing of the last finished step.
    pub fn last_stats(&self) -> &StepStats {
        &self.stats
    }

    /// Begins a step of `k_micro` micro-batches (gradient accumulation; 1 = none).
    pub fn begin_step(&mut self, k_micro: usize) -> Result<()> {
        if k_micro == 0 {
            return Err(Error::Config(
                "a step needs at least one micro-batch".into(),
            ));
        }
        if self.phase == Phase::Accumulating {
            return Err(Error::State {
                op: "begin_step",
                msg: format!(
                    "the step in progress (micro-batch {} of {}) was not finished",
                    self.micro, self.k
                ),
            });
        }
        for b in &mut self.buckets {
            if b.buf.is_none() {
                // Lost to a failed collective.
                b.work = None;
                b.buf = Some(vec![0.0; b.len]);
            }
            b.pending = b.params.len();
            b.started = None;
            b.done = None;
        }
        self.k = k_micro;
        self.micro = 0;
        self.ready.fill(false);
        self.marked = 0;
        self.launched = 0;
        self.seen_done = 0;
        self.first_start = None;
        self.phase = Phase::Accumulating;
        Ok(())
    }

    /// Reports that backward has made parameter `param`'s gradient for the current micro-batch
    /// final: `grad` is added into the parameter's slot of its bucket (the accumulation buffer,
    /// separate from `grad`, which the caller may reuse at once).
    ///
    /// On the step's last micro-batch, a bucket whose parameters have all been reported starts
    /// its all-reduce at once (buckets start in bucket order; with overlap off they wait for
    /// `finish`), and the communicator is driven so that the buckets in flight advance while
    /// backward goes on.
    pub fn mark_ready(
        &mut self,
        comm: &mut Communicator,
        param: usize,
        grad: &[f32],
    ) -> Result<()> {
        if self.phase != Phase::Accumulating {
            return Err(self.not_in_step("mark_ready"));
        }
        if self.micro >= self.k {
            return Err(Error::State {
                op: "mark_ready",
                msg: format!(
                    "all {} micro-batches of the step were reported; call finish",
                    self.k
                ),
            });
        }
        let slot = *self.slots.get(param).ok_or(Error::UnknownParam {
            param,
            count: self.slots.len(),
        })?;
        if grad.len() != slot.len {
            return Err(Error::GradientLength {
                param,
                expected: slot.len,
                got: grad.len(),
            });
        }
        if self.ready[param] {
            return Err(Error::AlreadyReady {
                param,
                micro: self.micro,
            });
        }
        let bucket = &mut self.buckets[slot.bucket];
        let acc = &mut bucket
            .buf
            .as_mut()
            .expect("buckets are not in flight before the last report")
            [slot.offset..slot.offset + slot.len];
        if self.micro == 0 {
            acc.copy_from_slice(grad);
        } else {
            for (a, g) in acc.iter_mut().zip(grad) {
                *a += g;
            }
        }
        bucket.pending -= 1;
        self.ready[param] = true;
        self.marked += 1;

        if self.is_sync_micro_batch() {
            if self.overlap {
                self.launch_ready(comm)?;
            }
            if self.launched > self.seen_done {
                self.drive(comm)?;
            }
        }
        if self.marked == self.slots.len() {
            self.micro += 1;
            self.marked = 0;
            if self.micro < self.k {
                self.ready.fill(false);
                for b in &mut self.buckets {
                    b.pending = b.params.len();
                }
            }
        }
        Ok(())
    }

    /// Waits for every bucket (starting those not started yet), divides the sums by
    /// world x K once, and returns the averaged gradients. They stay readable until the next
    /// [`begin_step`](Self::begin_step).
    pub fn finish(&mut self, comm: &mut Communicator) -> Result<Grads<'_>> {
        if self.phase != Phase::Accumulating {
            return Err(self.not_in_step("finish"));
        }
        if self.micro < self.k {
            let missing: Vec<usize> = (0..self.slots.len())
                .filter(|&p| !self.ready[p])
                .take(8)
                .collect();
            return Err(Error::State {
                op: "finish",
                msg: format!(
                    "micro-batch {} of {} is incomplete: parameters {missing:?}{} were not marked ready",
                    self.micro + 1,
                    self.k,
                    if self.slots.len() - self.marked > missing.len() {
                        "..."
                    } else {
                        ""
                    }
                ),
            });
        }
        let entered = Instant::now();
        while self.launched < self.buckets.len() {
            self.launch(comm)?;
        }
        let rank = comm.rank();
        for b in 0..self.buckets.len() {
            let Some(work) = self.buckets[b].work.take() else {
                continue;
            };
            match comm.wait(work) {
                Ok(buf) => {
                    let bucket = &mut self.buckets[b];
                    bucket.done.get_or_insert_with(Instant::now);
                    bucket.buf = Some(buf);
                }
                Err(source) => {
                    self.phase = Phase::Broken;
                    return Err(Error::Comm {
                        rank,
                        what: format!("all-reduce of gradient bucket {b}"),
                        source: Box::new(source),
                    });
                }
            }
        }
        let left = Instant::now();
        let divisor = (comm.world_size() * self.k) as f32;
        if divisor != 1.0 {
            for b in &mut self.buckets {
                for x in b.buf.as_mut().expect("every bucket was waited for") {
                    *x /= divisor;
                }
            }
        }
        let first = self.first_start.unwrap_or(entered);
        let last = self
            .buckets
            .iter()
            .filter_map(|b| b.done)
            .max()
            .unwrap_or(first);
        let comm_span = last.saturating_duration_since(first);
        let exposed = last.saturating_duration_since(entered.max(first));
        self.stats = StepStats {
            buckets: self.buckets.len(),
            bytes: self.num_elements() * ELEM,
            world: comm.world_size(),
            comm: comm_span,
            wait: left - entered,
            hidden: comm_span.saturating_sub(exposed),
        };
        self.phase = Phase::Idle;
        Ok(Grads { reducer: self })
    }

    fn not_in_step(&self, op: &'static str) -> Error {
        Error::State {
            op,
            msg: match self.phase {
                Phase::Broken => "the step failed; begin a new one".into(),
                _ => "no step in progress; call begin_step first".into(),
            },
        }
    }

    /// Starts, in bucket order, every bucket whose parameters have all been reported.
    fn launch_ready(&mut self, comm: &mut Communicator) -> Result<()> {
        while self.launched < self.buckets.len() && self.buckets[self.launched].pending == 0 {
            self.launch(comm)?;
        }
        Ok(())
    }

    /// Queues bucket `self.launched`'s all-reduce.
    fn launch(&mut self, comm: &mut Communicator) -> Result<()> {
        let b = self.launched;
        let bucket = &mut self.buckets[b];
        let buf = bucket
            .buf
            .take()
            .expect("a bucket is launched once per step");
        let now = Instant::now();
        match comm.all_reduce_owned(buf, ReduceOp::Sum) {
            Ok(work) => {
                bucket.work = Some(work);
                bucket.started = Some(now);
                self.first_start.get_or_insert(now);
                self.launched += 1;
                Ok(())
            }
            Err(source) => {
                self.phase = Phase::Broken;
                Err(Error::Comm {
                    rank: comm.rank(),
                    what: format!("starting the all-reduce of gradient bucket {b}"),
                    source: Box::new(source),
                })
            }
        }
    }

    /// Drives the communicator once and notes the buckets seen complete (they complete in
    /// order).
    fn drive(&mut self, comm: &mut Communicator) -> Result<()> {
        let rank = comm.rank();
        let fail = |source| Error::Comm {
            rank,
            what: "progress of the gradient buckets".into(),
            source: Box::new(source),
        };
        let r = comm.progress().map_err(fail);
        if r.is_err() {
            self.phase = Phase::Broken;
            return r;
        }
        while self.seen_done < self.launched {
            let bucket = &mut self.buckets[self.seen_done];
            let work = bucket
                .work
                .as_ref()
                .expect("launched buckets hold their work");
            match comm.test(work) {
                Ok(true) => {
                    bucket.done = Some(Instant::now());
                    self.seen_done += 1;
                }
                Ok(false) => break,
                Err(e) => {
                    self.phase = Phase::Broken;
                    return Err(fail(e));
                }
            }
        }
        Ok(())
    }
}

/// The averaged gradients of a finished step, by parameter index.
#[derive(Debug)]
pub struct Grads<'a> {
    reducer: &'a Reducer,
}

impl<'a> Grads<'a> {
    /// Parameter `p`'s averaged gradient (panics if `p` is out of range).
    pub fn get(&self, p: usize) -> &'a [f32] {
        let s = self.reducer.slots[p];
        &self.reducer.buckets[s.bucket]
            .buf
            .as_ref()
            .expect("a finished step holds every bucket")[s.offset..s.offset + s.len]
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.reducer.slots.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.reducer.slots.is_empty()
    }

    /// The gradients in registration order.
    pub fn iter(&self) -> impl Iterator<Item = &'a [f32]> + '_ {
        (0..self.len()).map(|p| self.get(p))
    }

    /// Timing of this step.
    pub fn stats(&self) -> &'a StepStats {
        &self.reducer.stats
    }
}

#[cfg(test)]
mod tests;
