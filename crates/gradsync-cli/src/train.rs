//! `gradsync train`: data-parallel training of an MLP classifier on Fashion-MNIST, the gradient
//! path of [`gradsync_ddp`] end to end.
//!
//! Every rank holds the whole model ([`model::Mlp`]: `784 - 256 - ReLU - 128 - ReLU - 10` by
//! default, about 235,000 parameters) and the whole dataset ([`data`]); rank 0's initial
//! parameters are broadcast to all. A step is K micro-batches of B samples per rank (the
//! global batch N x K x B is the same set of samples whatever N is, see [`data::Sampler`]);
//! backward reports every gradient piece to a [`Reducer`] as it becomes final, so the gradient
//! buckets are all-reduced while backward goes on, and the averaged gradient drives SGD with
//! momentum. Rank 0 prints a line every `--log-every` steps (loss over the window and over all
//! ranks, compute time, time blocked on communication, overlap), a progress bar on stderr when
//! stderr is a terminal, and at the end the test accuracy on the 10,000 test images (evaluated
//! in shards, summed with an all-reduce), the bus bandwidth of the gradient all-reduces, and
//! every rank's parameter hash. The command fails if the hashes differ.
//!
//! Buckets default to 0.25 MiB (`--bucket-mb`, or `GRADSYNC_BUCKET_MB`), not the library's
//! 25 MiB: the whole model is under 1 MiB, so 25 MiB would make one bucket that can only start
//! after backward, with nothing to overlap.
//!
//! `--bench-overlap` measures instead of training to the end: after a few warm-up steps it
//! alternates rounds of steps with overlap on and off and prints both step times, their ratio,
//! and the share of the step spent blocked on communication.
//!
//! Without torchrun variables, or with `--nproc N`, the command starts itself as N local ranks
//! (4 by default) through [`crate::launch::launch`].

pub mod data;
pub mod model;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use gradsync::{Communicator, ReduceOp};
use gradsync_ddp::{Reducer, StepStats, gather_hashes, hash_f32};

use data::{FashionMnist, PIXELS, Sampler};
use model::{Mlp, Workspace};

/// Elements per reported gradient piece (64 KiB of `f32`): a quarter of the default bucket, so
/// that a bucket fills, and starts, while backward is still inside a layer.
pub const GRAD_BLOCK_ELEMS: usize = 16 * 1024;
/// Local ranks started by default.
pub const DEFAULT_NPROC: usize = 4;
/// Warm-up steps of `--bench-overlap`, not measured.
pub const BENCH_WARMUP: usize = 4;
/// Rounds of `--bench-overlap`; each runs [`BENCH_ROUND`] steps with overlap on, then off.
pub const BENCH_ROUNDS: usize = 4;
/// Steps per round and mode of `--bench-overlap`.
pub const BENCH_ROUND: usize = 10;

/// Options of `gradsync train`.
#[derive(Clone, Debug, clap::Args)]
pub struct TrainArgs {
    /// Start this many local ranks (through the launcher) instead of joining a running job
    /// [default: 4 when not in a job].
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Micro-batches accumulated per step (gradients are synchronised once per step).
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// Optimiser steps.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Samples per micro-batch per rank (the global batch is nproc x accum x batch).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    /// SGD momentum (0 = plain SGD).
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// Widths of the hidden layers, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,128")]
    pub hidden: Vec<usize>,
    /// Seed of the initial parameters (rank 0's, broadcast) and of the sample order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Start every gradient bucket only after backward (no overlap).
    #[arg(long)]
    pub no_overlap: bool,
    /// Measure the step time with overlap on and off instead of training to the end.
    #[arg(long)]
    pub bench_overlap: bool,
    /// Gradient bucket capacity in MiB (the model is under 1 MiB: a 25 MiB bucket would hold all
    /// of it and leave nothing to overlap).
    #[arg(long, env = "GRADSYNC_BUCKET_MB", default_value_t = 0.25)]
    pub bucket_mb: f64,
    /// Print a line every this many steps [default: steps / 10].
    #[arg(long)]
    pub log_every: Option<usize>,
    /// Directory of the Fashion-MNIST idx files.
    #[arg(long, default_value = data::DEFAULT_DIR)]
    pub data: PathBuf,
}

/// Checks the options before any rank starts.
fn check(args: &TrainArgs) -> anyhow::Result<()> {
    ensure!(args.nproc != Some(0), "--nproc must be at least 1");
    ensure!(args.accum >= 1, "--accum must be at least 1");
    ensure!(args.steps >= 1, "--steps must be at least 1");
    ensure!(args.batch >= 1, "--batch must be at least 1");
    ensure!(
        args.lr.is_finite() && args.lr > 0.0,
        "--lr must be a positive number"
    );
    ensure!(
        args.momentum.is_finite() && (0.0..1.0).contains(&args.momentum),
        "--momentum must be in [0, 1)"
    );
    ensure!(
        !args.hidden.is_empty() && args.hidden.iter().all(|&h| h > 0),
        "--hidden must list positive layer widths"
    );
    ensure!(args.log_every != Some(0), "--log-every must be at least 1");
    gradsync_ddp::bucket_cap_bytes(args.bucket_mb).context("--bucket-mb")?;
    Ok(())
}

/// Runs `gradsync train`; returns the exit code.
pub fn run(args: &TrainArgs) -> anyhow::Result<i32> {
    check(args)?;
    if args.nproc.is_some() || !crate::bench::in_job() {
        // Fail once, here, rather than in every rank.
        data::check_files(&args.data)?;
        return crate::bench::launch_self(args.nproc.unwrap_or(DEFAULT_NPROC));
    }
    gradsync::logging::init_from_env();
    let mut comm = Communicator::from_env().context("cannot join the job")?;
    gradsync::logging::set_rank(comm.rank());
    let data = data::load(&args.data)?;
    let mut t = Trainer::new(args, &mut comm, data)?;
    if args.bench_overlap {
        t.bench_overlap(&mut comm)?;
        return Ok(0);
    }
    t.train(&mut comm)
}

/// What one step measured on this rank.
#[derive(Clone, Debug, Default)]
struct StepRecord {
    /// Mean loss over this rank's micro-batches.
    loss: f32,
    /// Whole step, from the first forward to the end of the update.
    step: Duration,
    /// Forward and backward of all micro-batches (including the progress calls in backward).
    compute: Duration,
    /// The reducer's figures (time blocked in finish, communication span, overlap).
    sync: StepStats,
}

/// One rank's training state.
struct Trainer {
    args: TrainArgs,
    data: FashionMnist,
    model: Mlp,
    params: Vec<f32>,
    velocity: Vec<f32>,
    grad: Vec<f32>,
    reducer: Reducer,
    ws: Workspace,
    x: Vec<f32>,
    y: Vec<u8>,
    sampler: Sampler,
    step: usize,
    rank: usize,
    world: usize,
    /// Rank 0 and stderr is a terminal.
    bar: bool,
}

impl Trainer {
    fn new(args: &TrainArgs, comm: &mut Communicator, data: FashionMnist) -> anyhow::Result<Self> {
        let mut dims = vec![PIXELS];
        dims.extend_from_slice(&args.hidden);
        dims.push(data::CLASSES);
        let model = Mlp::new(&dims, GRAD_BLOCK_ELEMS);
        // Every rank starts from rank 0's parameters, as DDP's constructor does.
        let mut params = model.init(args.seed);
        comm.broadcast(&mut params, 0)
            .context("broadcast of the initial parameters")?;
        let sizes: Vec<usize> = model.grad_ranges().iter().map(|r| r.len()).collect();
        let mut reducer = Reducer::new(&sizes, gradsync_ddp::bucket_cap_bytes(args.bucket_mb)?)?;
        reducer.set_overlap(!args.no_overlap);
        let n = model.len();
        let train_len = data.train.len();
        Ok(Trainer {
            args: args.clone(),
            model,
            params,
            velocity: vec![0.0; n],
            grad: vec![0.0; n],
            reducer,
            ws: Workspace::default(),
            x: Vec::new(),
            y: Vec::new(),
            sampler: Sampler::new(train_len, args.seed),
            step: 0,
            rank: comm.rank(),
            world: comm.world_size(),
            bar: comm.rank() == 0 && std::io::stderr().is_terminal(),
            data,
        })
    }

    fn global_batch(&self) -> u64 {
        (self.world * self.args.accum * self.args.batch) as u64
    }

    /// Loads micro-batch `k` of this rank for the current step into `x`, `y`.
    fn load_micro_batch(&mut self, k: usize) {
        let b = self.args.batch;
        let start =
            self.step as u64 * self.global_batch() + ((k * self.world + self.rank) * b) as u64;
        self.x.resize(b * PIXELS, 0.0);
        self.y.clear();
        for s in 0..b {
            let i = self.sampler.at(start + s as u64);
            self.data
                .train
                .pixels_into(i, &mut self.x[s * PIXELS..(s + 1) * PIXELS]);
            self.y.push(self.data.train.labels[i]);
        }
    }

    /// One optimiser step: K micro-batches of forward and backward (buckets start during the
    /// last backward), the averaged gradient, and the SGD-with-momentum update.
    fn train_step(&mut self, comm: &mut Communicator) -> anyhow::Result<StepRecord> {
        let t0 = Instant::now();
        let k_micro = self.args.accum;
        self.reducer.begin_step(k_micro)?;
        let mut loss = 0.0;
        for k in 0..k_micro {
            self.load_micro_batch(k);
            let reducer = &mut self.reducer;
            let mut failed = None;
            loss += self.model.forward_backward(
                &self.params,
                &self.x,
                &self.y,
                &mut self.ws,
                &mut self.grad,
                |p, g| {
                    if failed.is_none()
                        && let Err(e) = reducer.mark_ready(comm, p, g)
                    {
                        failed = Some(e);
                    }
                },
            );
            if let Some(e) = failed {
                return Err(e).context(format!("step {}", self.step));
            }
        }
        let t1 = Instant::now();
        let grads = self
            .reducer
            .finish(comm)
            .with_context(|| format!("step {}", self.step))?;
        let (lr, mu) = (self.args.lr, self.args.momentum);
        for (p, r) in self.model.grad_ranges().iter().enumerate() {
            let (w, v) = (&mut self.params[r.clone()], &mut self.velocity[r.clone()]);
            for ((w, v), g) in w.iter_mut().zip(v.iter_mut()).zip(grads.get(p)) {
                *v = mu * *v + g;
                *w -= lr * *v;
            }
        }
        let sync = grads.stats().clone();
        self.step += 1;
        Ok(StepRecord {
            loss: loss / k_micro as f32,
            step: t0.elapsed(),
            compute: t1 - t0,
            sync,
        })
    }

    fn header(&self) -> String {
        let dims: Vec<String> = self.model.dims().iter().map(usize::to_string).collect();
        format!(
            "# gradsync {} train: Fashion-MNIST, MLP {} ({} parameters, {:.1} KiB)\n\
             # {} ranks x {} micro-batches x {} samples = global batch {}; SGD lr {} momentum {}; seed {}\n\
             # gradients: {} pieces in {} buckets of <= {} MiB, overlap {}",
            gradsync::VERSION,
            dims.join("-"),
            self.model.len(),
            (self.model.len() * 4) as f64 / 1024.0,
            self.world,
            self.args.accum,
            self.args.batch,
            self.global_batch(),
            self.args.lr,
            self.args.momentum,
            self.args.seed,
            self.reducer.num_params(),
            self.reducer.num_buckets(),
            self.args.bucket_mb,
            if self.reducer.overlap() {
                "on"
            } else {
                "off (buckets start after backward)"
            },
        )
    }

    fn draw_bar(&self, loss: Option<f64>, started: Instant) {
        if !self.bar {
            return;
        }
        const WIDTH: usize = 30;
        let total = self.args.steps;
        let filled = self.step * WIDTH / total;
        let rate = self.step as f64 / started.elapsed().as_secs_f64().max(1e-9);
        let loss = loss.map(|l| format!("  loss {l:.4}")).unwrap_or_default();
        let mut e = std::io::stderr().lock();
        let _ = write!(
            e,
            "\r\x1b[K[{}{}] {}/{total}{loss}  {rate:.1} steps/s",
            "#".repeat(filled),
            ".".repeat(WIDTH - filled),
            self.step
        );
        let _ = e.flush();
    }

    fn clear_bar(&self) {
        if self.bar {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r\x1b[K");
            let _ = e.flush();
        }
    }

    /// Trains `--steps` steps, evaluates, checks that every rank holds the same parameters.
    fn train(&mut self, comm: &mut Communicator) -> anyhow::Result<i32> {
        if self.rank == 0 {
            println!("{}", self.header());
        }
        let steps = self.args.steps;
        let every = self.args.log_every.unwrap_or((steps / 10).max(1));
        let started = Instant::now();
        // Window sums: loss, compute s, comm s, overlap, steps; totals for the summary.
        let mut window = [0.0f64; 5];
        let mut total = [0.0f64; 6];
        let mut last_loss = None;
        while self.step < steps {
            let r = self.train_step(comm)?;
            let bus = r.sync.bytes as f64 * 2.0 * (self.world as f64 - 1.0) / self.world as f64;
            for (t, v) in total.iter_mut().zip([
                r.step.as_secs_f64(),
                r.compute.as_secs_f64(),
                r.sync.wait.as_secs_f64(),
                r.sync.overlap_fraction(),
                bus,
                r.sync.comm.as_secs_f64(),
            ]) {
                *t += v;
            }
            for (w, v) in window.iter_mut().zip([
                f64::from(r.loss),
                r.compute.as_secs_f64(),
                r.sync.wait.as_secs_f64(),
                r.sync.overlap_fraction(),
                1.0,
            ]) {
                *w += v;
            }
            if self.step.is_multiple_of(every) || self.step == steps {
                // Means over the window's steps and over all ranks.
                comm.all_reduce(&mut window, ReduceOp::Sum)
                    .context("all-reduce of the step statistics")?;
                let n = window[4];
                last_loss = Some(window[0] / n);
                if self.rank == 0 {
                    self.clear_bar();
                    println!(
                        "step {:>w$}/{steps}  loss {:.4}  compute {:7.1} ms  comm {:6.2} ms  overlap {:3.0}%",
                        self.step,
                        window[0] / n,
                        window[1] / n * 1e3,
                        window[2] / n * 1e3,
                        window[3] / n * 100.0,
                        w = steps.to_string().len()
                    );
                }
                window = [0.0; 5];
            }
            self.draw_bar(last_loss, started);
        }
        let train_time = started.elapsed();
        self.clear_bar();

        // Test accuracy: rank r evaluates images r, r + N, ..., and the counts are summed.
        let mut counts = [0.0f64; 3];
        let test_len = self.data.test.len();
        let mine: Vec<usize> = (self.rank..test_len).step_by(self.world).collect();
        for chunk in mine.chunks(500) {
            self.x.resize(chunk.len() * PIXELS, 0.0);
            self.y.clear();
            for (s, &i) in chunk.iter().enumerate() {
                self.data
                    .test
                    .pixels_into(i, &mut self.x[s * PIXELS..(s + 1) * PIXELS]);
                self.y.push(self.data.test.labels[i]);
            }
            let (correct, loss) = self
                .model
                .evaluate(&self.params, &self.x, &self.y, &mut self.ws);
            counts[0] += correct as f64;
            counts[1] += chunk.len() as f64;
            counts[2] += loss;
        }
        comm.all_reduce(&mut counts, ReduceOp::Sum)
            .context("all-reduce of the test counts")?;
        comm.all_reduce(&mut total, ReduceOp::Sum)
            .context("all-reduce of the timing totals")?;
        let hashes = gather_hashes(comm, hash_f32(&self.params))?;
        let identical = hashes.iter().all(|&h| h == hashes[0]);
        if self.rank == 0 {
            let per = (steps * self.world) as f64;
            println!(
                "test accuracy {:.2}% ({}/{}), test loss {:.4}",
                100.0 * counts[0] / counts[1],
                counts[0] as u64,
                counts[1] as u64,
                counts[2] / counts[1]
            );
            println!(
                "time: {steps} steps in {:.2} s, {:.1} ms/step: compute {:.1} ms, comm {:.2} ms blocked in finish ({:.1}% of the step), overlap {:.0}%",
                train_time.as_secs_f64(),
                total[0] / per * 1e3,
                total[1] / per * 1e3,
                total[2] / per * 1e3,
                100.0 * total[2] / total[0],
                total[3] / per * 100.0
            );
            println!(
                "gradient all-reduce: {} buckets, {} bytes per step, bus bandwidth {:.3} GB/s \
                 (bytes x 2(n-1)/n / communication span)",
                self.reducer.num_buckets(),
                self.model.len() * 4,
                if total[5] > 0.0 {
                    total[4] / total[5] / 1e9
                } else {
                    0.0
                }
            );
            for (r, h) in hashes.iter().enumerate() {
                println!("parameter hash rank {r}: {h:016x}");
            }
            println!(
                "parameters identical on all {} ranks: {}",
                self.world,
                if identical { "yes" } else { "NO" }
            );
        }
        Ok(if identical { 0 } else { 1 })
    }

    /// `--bench-overlap`: alternating rounds of steps with overlap on and off.
    ///
    /// Each rank takes the median of its step, compute and blocked times per mode (robust to
    /// the scheduling noise of ranks sharing cores), then the medians are averaged over ranks.
    fn bench_overlap(&mut self, comm: &mut Communicator) -> anyhow::Result<()> {
        if self.rank == 0 {
            println!("{}", self.header());
            println!(
                "# overlap benchmark: {BENCH_WARMUP} warm-up steps, then {BENCH_ROUNDS} rounds of {BENCH_ROUND} steps with overlap on and {BENCH_ROUND} with it off; medians over steps, means over ranks"
            );
        }
        self.reducer.set_overlap(true);
        for _ in 0..BENCH_WARMUP {
            self.train_step(comm)?;
        }
        let mut records: [Vec<StepRecord>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..BENCH_ROUNDS {
            for (mode, on) in [(0, true), (1, false)] {
                self.reducer.set_overlap(on);
                comm.barrier().context("barrier")?;
                for _ in 0..BENCH_ROUND {
                    records[mode].push(self.train_step(comm)?);
                }
            }
        }
        // Per mode: median step, compute and blocked time; mean span and overlap.
        let mut flat = Vec::new();
        for recs in &records {
            let median = |f: &dyn Fn(&StepRecord) -> Duration| {
                let mut v: Vec<f64> = recs.iter().map(|r| f(r).as_secs_f64()).collect();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let n = recs.len() as f64;
            flat.extend([
                median(&|r| r.step),
                median(&|r| r.compute),
                median(&|r| r.sync.wait),
                recs.iter().map(|r| r.sync.comm.as_secs_f64()).sum::<f64>() / n,
                recs.iter().map(|r| r.sync.overlap_fraction()).sum::<f64>() / n,
            ]);
        }
        comm.all_reduce(&mut flat, ReduceOp::Sum)
            .context("all-reduce of the benchmark figures")?;
        if self.rank == 0 {
            let get = |mode: usize, i: usize| flat[mode * 5 + i] / self.world as f64;
            for (mode, name) in [(0, "on "), (1, "off")] {
                println!(
                    "overlap {name}: step {:7.2} ms  compute {:7.2} ms  comm blocked {:6.2} ms ({:4.1}% of the step)  comm span {:6.2} ms  overlap {:3.0}%",
                    get(mode, 0) * 1e3,
                    get(mode, 1) * 1e3,
                    get(mode, 2) * 1e3,
                    100.0 * get(mode, 2) / get(mode, 0),
                    get(mode, 3) * 1e3,
                    100.0 * get(mode, 4),
                );
            }
            let ratio = get(1, 0) / get(0, 0);
            println!(
                "step-time ratio off/on: {ratio:.3} (overlap {} the step by {:.1}%); communication share of the step with overlap off: {:.1}%",
                if ratio >= 1.0 {
                    "shortens"
                } else {
                    "lengthens"
                },
                100.0 * (1.0 - 1.0 / ratio).abs(),
                100.0 * get(1, 2) / get(1, 0)
            );
        }
        Ok(())
    }
}
