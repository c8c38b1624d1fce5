//! `gradsync scale`: every all-reduce algorithm on paper, from 8 to 4096 ranks: its time, and
//! the connections and receive memory it needs per rank ([`footprints`]).
//!
//! For every world size and buffer size of the sweep, the simulator replays the messages of every
//! all-reduce schedule that [`gradsync::cost::all_reduce_candidates`] lists, on one host of
//! identical links: `alpha` seconds per message and one bandwidth (see the timing model of
//! [`gradsync_core::sim::predict`]: every rank sends one message at a time, receives without
//! limit, and reductions cost nothing). The table gives every algorithm's predicted time and the
//! best one; the summary after it gives, per world, the sizes at which the best algorithm changes.
//! Nothing is a closed-form formula: every number is the finish time of the last rank when the
//! timing model runs the ranks' own programs.
//!
//! # Making 4096 ranks affordable
//!
//! Replaying a schedule costs time in proportion to the ops of all ranks together, which grow
//! like the world times the messages per rank (a ring over 4096 ranks is 67 million ops, and
//! building the programs alone takes seconds). Two things keep the sweep short:
//!
//! - **symmetry**: when every rank's program is rank 0's with the peers relabeled (rings whose
//!   blocks are all alike, recursive doubling on a power of two, Rabenseifner on a power of two
//!   when its blocks are alike and a halving step is one message), every rank goes through the
//!   same events at the same times, and the timing model runs rank 0 alone, its messages
//!   mirrored ([`gradsync_core::sim::predict_symmetric`]; programs are compared op by op first,
//!   on a sample of ranks in large worlds). The result equals the full run's;
//! - **a budget**: the other schedules (trees, the other Rabenseifner cells, rings whose blocks
//!   differ by an element) run every rank, which is skipped, and said so in the table and in the
//!   crossover line, when the ops of all ranks would exceed `--max-ops` (0: no limit). Their ops
//!   are estimated from a sample of ranks.
//!
//! The pipeline segment is never changed: every time is for `--segment-bytes`, the library's
//! default chunk unless given. Cells run on `--jobs` threads. On two shared vCPUs the default
//! sweep (10 worlds, 15 sizes, budget 8M ops) takes about a minute and skips 12 of its 750
//! cells, the largest sizes of the trees and Rabenseifner on 2048 and 4096 ranks; with
//! `--max-ops 0` it takes two to three minutes and about 3 GB.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, ensure};
use gradsync::cost::{
    EAGER_WORLD_MAX, all_reduce_candidates, all_reduce_params, predict_all_reduce,
};
use gradsync::{Algorithm, DataType};
use gradsync_core::rng::XorShift64;
use gradsync_core::schedule::plan::{self, Params};
use gradsync_core::sim::{LinkModel, Symmetry, predict_symmetric};
use serde::Serialize;

use crate::table;

/// Options of `gradsync scale`.
#[derive(Clone, Debug, clap::Args)]
pub struct ScaleArgs {
    /// Latency of one message (software and wire, per hop), microseconds.
    #[arg(long, default_value_t = 2.0)]
    pub alpha_us: f64,
    /// Bandwidth of every rank's link, Gbit/s (10^9 bits per second).
    #[arg(long, default_value_t = 400.0)]
    pub gbit: f64,
    /// World sizes (ranks), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,16,32,64,128,256,512,1024,2048,4096"
    )]
    pub worlds: Vec<usize>,
    /// Smallest buffer per rank, bytes (K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "8", value_parser = table::parse_size)]
    pub min_bytes: u64,
    /// Largest buffer per rank, bytes; always part of the sweep.
    #[arg(long, default_value = "1G", value_parser = table::parse_size)]
    pub max_bytes: u64,
    /// Factor between consecutive buffer sizes.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(2..))]
    pub factor: u64,
    /// Pipeline segment (largest message), bytes; default the library's default chunk size
    /// (`GRADSYNC_CHUNK_SIZE`).
    #[arg(long, value_parser = table::parse_size)]
    pub segment_bytes: Option<u64>,
    /// Most ops (of all ranks together) one prediction replays; predictions that would replay
    /// more are skipped. 0: no limit. Symmetric predictions replay one rank and always run.
    #[arg(long, default_value_t = DEFAULT_MAX_OPS)]
    pub max_ops: u64,
    /// Threads that predict at once (default: the CPUs available).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Also write the predictions and the crossovers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Default `--max-ops`.
pub const DEFAULT_MAX_OPS: u64 = 1 << 23;

/// The element type of the sweep: sizes are `f32` buffers.
const DTYPE: DataType = DataType::F32;

/// The link model of a sweep.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Model {
    /// Seconds per message.
    pub alpha_s: f64,
    /// Link bandwidth, bytes per second.
    pub bytes_per_s: f64,
}

impl Model {
    /// The simulator's link.
    pub fn link(&self) -> LinkModel {
        LinkModel::new(self.alpha_s, self.bytes_per_s)
    }
}

/// How a prediction was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Rank 0 alone, its messages mirrored under a rotation of the ranks.
    Rotation,
    /// Rank 0 alone, its messages mirrored under `xor` of the ranks.
    Xor,
    /// Every rank.
    Full,
    /// Not predicted: the full run would exceed `--max-ops`.
    Skipped,
}

/// One algorithm's prediction for one world and size.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    /// The algorithm.
    pub algorithm: String,
    /// Predicted seconds until the last rank finishes; `None` when skipped.
    pub time_s: Option<f64>,
    /// How it was predicted.
    pub method: Method,
    /// Ops of all ranks together (estimated from a sample when skipped or in full).
    pub ops: u64,
    /// Seconds the prediction took to compute.
    pub compute_s: f64,
}

/// One world size and buffer size: every algorithm's predicted time.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Ranks.
    pub world: usize,
    /// Bytes per rank.
    pub bytes: u64,
    /// Every candidate, in the order of [`all_reduce_candidates`].
    pub predictions: Vec<Prediction>,
    /// The fastest predicted algorithm (the first listed among equals).
    pub best: String,
}

/// A size range in which one algorithm is the best.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Span {
    /// The algorithm.
    pub algorithm: String,
    /// Smallest size of the sweep at which it is the best.
    pub from_bytes: u64,
    /// Largest size of the sweep at which it is the best (the next span starts at the next
    /// size of the sweep).
    pub to_bytes: u64,
}

/// Where the best algorithm changes, for one world size.
#[derive(Clone, Debug, Serialize)]
pub struct Crossover {
    /// Ranks.
    pub world: usize,
    /// Consecutive ranges of sizes, each with its best algorithm.
    pub spans: Vec<Span>,
    /// Runs of consecutive sizes at which an algorithm was skipped (there the best is the best
    /// of the others).
    pub skipped: Vec<Span>,
    /// The one-line summary (`n=64: recursive_doubling <= 32 KiB < ring`).
    pub text: String,
}

/// The JSON document of `--json`.
#[derive(Serialize)]
struct Report<'a> {
    model: Model,
    dtype: &'static str,
    segment_bytes: u64,
    max_ops: u64,
    points: &'a [Point],
    crossovers: &'a [Crossover],
    footprints: &'a [Footprint],
}

/// The buffer sizes of a sweep: `min`, `min * factor`, ... up to `max`, and `max` itself.
pub fn sweep_sizes(min: u64, max: u64, factor: u64) -> Vec<u64> {
    let mut v = table::sizes(min, max, factor.max(2), None);
    if v.last().is_some_and(|&l| l < max) {
        v.push(max);
    }
    v
}

/// `bytes` in binary units, exact when possible: `8 B`, `32 KiB`, `1 GiB`, `1.5 MiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut u = 0;
    while u + 1 < UNITS.len() && bytes >= 1u64 << (10 * (u + 1)) {
        u += 1;
    }
    let unit = 1u64 << (10 * u);
    if bytes.is_multiple_of(unit) {
        format!("{} {}", bytes / unit, UNITS[u])
    } else {
        format!("{:.1} {}", bytes as f64 / unit as f64, UNITS[u])
    }
}

/// A count of ops: `8M` for multiples of 2^20, else the number.
fn ops_text(ops: u64) -> String {
    if ops >= 1 << 20 && ops.is_multiple_of(1 << 20) {
        format!("{}M", ops >> 20)
    } else {
        ops.to_string()
    }
}

/// Seconds with four significant digits in us, ms or s.
pub fn human_time(s: f64) -> String {
    let (v, unit) = if s < 1e-3 {
        (s * 1e6, "us")
    } else if s < 1.0 {
        (s * 1e3, "ms")
    } else {
        (s, "s")
    };
    let decimals = if v < 10.0 {
        3
    } else if v < 100.0 {
        2
    } else {
        1
    };
    format!("{v:.decimals$} {unit}")
}

/// Ops of all ranks' programs together, estimated from rank 0, rank 1, the last rank and 13
/// ranks picked at random (all ranks in worlds of at most 16).
fn estimate_ops(params: &[Params]) -> anyhow::Result<u64> {
    let world = params.len();
    let ranks: BTreeSet<usize> = if world <= 16 {
        (0..world).collect()
    } else {
        let mut rng = XorShift64::new(world as u64);
        [0, 1, world - 1]
            .into_iter()
            .chain((0..13).map(|_| rng.below(world)))
            .collect()
    };
    let mut ops = 0u64;
    for &r in &ranks {
        ops += plan::build(&params[r])
            .with_context(|| format!("planning rank {r}"))?
            .len() as u64;
    }
    Ok(ops * world as u64 / ranks.len() as u64)
}

/// Predicts `algorithm` for `world` ranks and `bytes` bytes per rank in segments of `segment`
/// elements: by symmetry when the programs have one, else in full unless that would replay more
/// than `max_ops` ops (0: no limit).
pub fn predict(
    model: &Model,
    world: usize,
    bytes: u64,
    segment: usize,
    algorithm: Algorithm,
    max_ops: u64,
) -> anyhow::Result<Prediction> {
    let started = Instant::now();
    let bytes_us = usize::try_from(bytes).context("buffer size does not fit this machine")?;
    let link = model.link();
    let params = all_reduce_params(world, 0, segment, DTYPE, bytes_us, algorithm);
    let what = || format!("{algorithm} on {world} ranks, {} per rank", human(bytes));
    let name = algorithm.name().to_string();
    if let Some((p, sym)) = predict_symmetric(&params, DTYPE, &link).with_context(what)? {
        let rank0 = plan::build(&params[0]).with_context(what)?.len() as u64;
        return Ok(Prediction {
            algorithm: name,
            time_s: Some(p.time_s),
            method: match sym {
                Symmetry::Xor => Method::Xor,
                _ => Method::Rotation,
            },
            ops: rank0 * world as u64,
            compute_s: started.elapsed().as_secs_f64(),
        });
    }
    let ops = estimate_ops(&params).with_context(what)?;
    if max_ops > 0 && ops > max_ops {
        return Ok(Prediction {
            algorithm: name,
            time_s: None,
            method: Method::Skipped,
            ops,
            compute_s: started.elapsed().as_secs_f64(),
        });
    }
    let t = predict_all_reduce(
        world,
        0,
        segment,
        DTYPE,
        bytes_us,
        Some(algorithm),
        &link,
        &link,
        0,
    )
    .map_err(anyhow::Error::msg)
    .with_context(what)?;
    Ok(Prediction {
        algorithm: name,
        time_s: Some(t),
        method: Method::Full,
        ops,
        compute_s: started.elapsed().as_secs_f64(),
    })
}

/// The fastest of `predictions` (the first listed among equals); empty when all were skipped.
pub fn best_of(predictions: &[Prediction]) -> String {
    let mut best: Option<(&str, f64)> = None;
    for p in predictions {
        if let Some(t) = p.time_s
            && best.is_none_or(|(_, b)| t < b)
        {
            best = Some((&p.algorithm, t));
        }
    }
    best.map(|b| b.0.to_string()).unwrap_or_default()
}

/// The ranges of sizes in which each algorithm is the best, for the points of one world (in
/// increasing size).
pub fn crossover(world: usize, points: &[&Point]) -> Crossover {
    let mut spans: Vec<Span> = Vec::new();
    for p in points {
        match spans.last_mut() {
            Some(s) if s.algorithm == p.best => s.to_bytes = p.bytes,
            _ => spans.push(Span {
                algorithm: p.best.clone(),
                from_bytes: p.bytes,
                to_bytes: p.bytes,
            }),
        }
    }
    // Runs of consecutive sizes at which an algorithm was not predicted, by algorithm.
    let mut skipped: Vec<Span> = Vec::new();
    let names: Vec<&str> = points
        .first()
        .map(|p| p.predictions.iter().map(|q| q.algorithm.as_str()).collect())
        .unwrap_or_default();
    for (j, name) in names.iter().enumerate() {
        let mut run: Option<Span> = None;
        for p in points {
            if p.predictions.get(j).is_some_and(|q| q.time_s.is_none()) {
                let r = run.get_or_insert_with(|| Span {
                    algorithm: name.to_string(),
                    from_bytes: p.bytes,
                    to_bytes: p.bytes,
                });
                r.to_bytes = p.bytes;
            } else if let Some(r) = run.take() {
                skipped.push(r);
            }
        }
        skipped.extend(run);
    }
    let mut text = format!("n={world}:");
    for (i, s) in spans.iter().enumerate() {
        if i > 0 {
            text.push_str(" <");
        }
        write!(text, " {}", s.algorithm).unwrap();
        if i + 1 < spans.len() {
            write!(text, " <= {}", human(s.to_bytes)).unwrap();
        }
    }
    if !skipped.is_empty() {
        let list: Vec<String> = skipped
            .iter()
            .map(|s| {
                if s.from_bytes == s.to_bytes {
                    format!("{} {}", s.algorithm, human(s.from_bytes))
                } else {
                    format!(
                        "{} {}..{}",
                        s.algorithm,
                        human(s.from_bytes),
                        human(s.to_bytes)
                    )
                }
            })
            .collect();
        write!(
            text,
            "   (not simulated, over --max-ops: {})",
            list.join(", ")
        )
        .unwrap();
    }
    Crossover {
        world,
        spans,
        skipped,
        text,
    }
}

/// What one algorithm costs a rank in connections and receive memory at one world size.
#[derive(Clone, Debug, Serialize)]
pub struct Footprint {
    /// Ranks.
    pub world: usize,
    /// The algorithm; `any` for the union of every candidate (what a job that lets the choice
    /// change with the size may talk to; every rank in worlds that run small all-reduces
    /// eagerly); `full mesh` for every other rank.
    pub algorithm: String,
    /// Most peers one rank's program exchanges messages with (over every rank in worlds of at
    /// most 64, else rank 0, 1, the last and 13 picked at random).
    pub peers: usize,
    /// TCP sockets of such a rank: its streams to each of those peers and its listener.
    pub sockets: usize,
    /// Receive memory of such a rank when inbox slots exist only for those peers.
    pub receive_bytes: u64,
}

/// The ranks whose programs a footprint looks at.
fn footprint_ranks(world: usize) -> BTreeSet<usize> {
    if world <= 64 {
        return (0..world).collect();
    }
    let mut rng = XorShift64::new(world as u64 ^ 0x9e37);
    [0, 1, world - 1]
        .into_iter()
        .chain((0..13).map(|_| rng.below(world)))
        .collect()
}

/// How a rank's receive memory is laid out: [`gradsync::RecvLayout`] for the settings of
/// [`footprints`], and the bytes of a slot.
struct Receive {
    layout: gradsync::RecvLayout,
    slot_bytes: usize,
}

impl Receive {
    /// The receive memory of `rank` of `world` once it has talked to `peers`: inbox slots for
    /// each, or where pairs beyond the budget share a pool, slots only for the peers at
    /// power-of-two distances and the pool (registered at init where the rank has pooled
    /// peers, [`gradsync::RecvLayout::pool_for`] slots).
    fn bytes(&self, rank: usize, world: usize, peers: impl Iterator<Item = usize>) -> u64 {
        let l = &self.layout;
        if l.pool_slots == 0 {
            return (peers.count() * l.nslots * self.slot_bytes) as u64;
        }
        let near = gradsync::slot_peers(rank, world);
        let kept = peers.filter(|p| near.binary_search(p).is_ok()).count();
        let pooled = world - 1 - near.len();
        let pool = if pooled == 0 { 0 } else { l.pool_for(pooled) };
        ((kept * l.nslots + pool) * self.slot_bytes) as u64
    }
}

/// Connections and receive memory per rank of every candidate algorithm on `world` ranks, and
/// of their union (`any`), for a buffer of `bytes` per rank; `nsocks` streams per peer and
/// inboxes of `nslots` slots of `slot_bytes` per connected peer within a receive budget of
/// `budget` bytes (past it, the peers beyond it share a pool: see `GRADSYNC_RECV_BUDGET`).
pub fn footprints(
    world: usize,
    bytes: usize,
    segment: usize,
    nsocks: usize,
    (nslots, slot_bytes, budget): (usize, usize, usize),
) -> anyhow::Result<Vec<Footprint>> {
    let ranks = footprint_ranks(world);
    let algos = all_reduce_candidates(world, 0);
    let mut cfg = gradsync::Config::new("", 0, world);
    (cfg.nslots, cfg.chunk_bytes, cfg.recv_budget) = (nslots, slot_bytes, budget);
    let recv = Receive {
        layout: cfg.recv_layout(world),
        slot_bytes,
    };
    let mut union: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); world];
    let mut out = Vec::new();
    let row = |algorithm: String, peers: usize, receive_bytes: u64| Footprint {
        world,
        algorithm,
        peers,
        sockets: peers * nsocks + 1,
        receive_bytes,
    };
    for &a in &algos {
        let params = all_reduce_params(world, 0, segment, DTYPE, bytes, a);
        let (mut most, mut most_bytes) = (0, 0);
        for &r in &ranks {
            let prog = plan::build(&params[r])
                .with_context(|| format!("planning {a} for rank {r} of {world}"))?;
            let peers = prog.peers(r, world);
            most = most.max(peers.len());
            most_bytes = most_bytes.max(recv.bytes(r, world, peers.iter().copied()));
            union[r].extend(peers);
        }
        out.push(row(a.name().to_string(), most, most_bytes));
    }
    let everyone = |r: usize| (0..world).filter(move |&p| p != r);
    let mesh_bytes = ranks
        .iter()
        .map(|&r| recv.bytes(r, world, everyone(r)))
        .max()
        .unwrap_or(0);
    // Small all-reduces of small worlds run eagerly: every rank posts to every other.
    let (any, any_bytes) = if world <= EAGER_WORLD_MAX {
        (world - 1, mesh_bytes)
    } else {
        (
            ranks.iter().map(|&r| union[r].len()).max().unwrap_or(0),
            ranks
                .iter()
                .map(|&r| recv.bytes(r, world, union[r].iter().copied()))
                .max()
                .unwrap_or(0),
        )
    };
    out.push(row("any".to_string(), any, any_bytes));
    out.push(row("full mesh".to_string(), world - 1, mesh_bytes));
    Ok(out)
}

/// The header of the table of one world.
fn table_header(names: &[String]) -> String {
    let mut line = format!("#{:>5} {:>9}", "world", "size");
    for n in names {
        write!(line, "  {:>w$}", n, w = n.len().max(11)).unwrap();
    }
    line.push_str("  best");
    line
}

/// One row of the table.
fn table_row(p: &Point) -> String {
    let mut line = format!("{:>6} {:>9}", p.world, human(p.bytes));
    for q in &p.predictions {
        let cell = match q.time_s {
            Some(t) => human_time(t),
            None => "skipped".to_string(),
        };
        write!(line, "  {:>w$}", cell, w = q.algorithm.len().max(11)).unwrap();
    }
    write!(line, "  {}", p.best).unwrap();
    line
}

/// Runs `gradsync scale`.
pub fn run(args: &ScaleArgs) -> anyhow::Result<i32> {
    ensure!(
        args.alpha_us.is_finite() && args.alpha_us >= 0.0,
        "--alpha-us must be a non-negative number"
    );
    ensure!(
        args.gbit.is_finite() && args.gbit > 0.0,
        "--gbit must be a positive number"
    );
    let elem = DTYPE.size() as u64;
    ensure!(
        args.min_bytes >= elem && args.min_bytes <= args.max_bytes,
        "--min-bytes must be at least one element ({elem} bytes) and at most --max-bytes"
    );
    ensure!(
        !args.worlds.is_empty() && args.worlds.iter().all(|&w| w >= 2),
        "--worlds must list world sizes of at least 2 ranks"
    );
    let model = Model {
        alpha_s: args.alpha_us * 1e-6,
        bytes_per_s: args.gbit * 1e9 / 8.0,
    };
    let default_chunk = gradsync::Config::new("", 0, 1).chunk_bytes as u64;
    let segment_bytes = args.segment_bytes.unwrap_or(default_chunk);
    ensure!(
        segment_bytes >= elem,
        "--segment-bytes must be at least one element ({elem} bytes)"
    );
    let segment = usize::try_from(segment_bytes / elem).context("--segment-bytes is too large")?;
    let sizes = sweep_sizes(args.min_bytes, args.max_bytes, args.factor);
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);

    println!(
        "# gradsync {} scale: all-reduce of {DTYPE} predicted by the simulator, which replays \
         every rank's schedule",
        gradsync::VERSION
    );
    println!(
        "# link model: alpha {} us per message, {} Gbit/s ({:.2} GB/s) per rank; each rank \
         sends one message at a time and receives without limit; reductions and copies are free",
        args.alpha_us,
        args.gbit,
        model.bytes_per_s / 1e9
    );
    println!(
        "# pipeline segment {}{}; symmetric schedules replay rank 0 alone, the others every \
         rank {}",
        human(segment_bytes),
        if segment_bytes == default_chunk {
            " (GRADSYNC_CHUNK_SIZE default)"
        } else {
            ""
        },
        if args.max_ops == 0 {
            "without limit".to_string()
        } else {
            format!("up to {} ops (--max-ops)", ops_text(args.max_ops))
        }
    );

    // Every (world, size, algorithm) is a job; rows print in order as they complete.
    let rows: Vec<(usize, u64, Vec<Algorithm>)> = args
        .worlds
        .iter()
        .flat_map(|&w| {
            let algos = all_reduce_candidates(w, 0);
            sizes.iter().map(move |&b| (w, b, algos.clone()))
        })
        .collect();
    let cells: Vec<(usize, usize)> = rows
        .iter()
        .enumerate()
        .flat_map(|(i, r)| (0..r.2.len()).map(move |j| (i, j)))
        .collect();
    let started = Instant::now();
    let results: Mutex<Vec<Vec<Option<Prediction>>>> = Mutex::new(
        rows.iter()
            .map(|r| vec![None; r.2.len()])
            .collect::<Vec<_>>(),
    );
    let printed = Mutex::new(0usize);
    let next = AtomicUsize::new(0);
    let failure: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let print_ready = |results: &Vec<Vec<Option<Prediction>>>| {
        let mut printed = printed.lock().unwrap();
        while *printed < rows.len() && results[*printed].iter().all(Option::is_some) {
            let (w, b, algos) = &rows[*printed];
            if *printed == 0 || rows[*printed - 1].0 != *w {
                let names: Vec<String> = algos.iter().map(|a| a.name().to_string()).collect();
                println!("\n{}", table_header(&names));
            }
            let predictions: Vec<Prediction> =
                results[*printed].iter().flatten().cloned().collect();
            let best = best_of(&predictions);
            println!(
                "{}",
                table_row(&Point {
                    world: *w,
                    bytes: *b,
                    predictions,
                    best
                })
            );
            *printed += 1;
        }
    };
    std::thread::scope(|s| {
        for _ in 0..jobs.min(cells.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= cells.len() || failure.lock().unwrap().is_some() {
                        break;
                    }
                    let (row, j) = cells[i];
                    let (w, b, algos) = &rows[row];
                    match predict(&model, *w, *b, segment, algos[j], args.max_ops) {
                        Ok(p) => {
                            let mut res = results.lock().unwrap();
                            res[row][j] = Some(p);
                            print_ready(&res);
                        }
                        Err(e) => {
                            *failure.lock().unwrap() = Some(e);
                            break;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().unwrap() {
        return Err(e);
    }
    let results = results.into_inner().unwrap();
    let points: Vec<Point> = rows
        .iter()
        .zip(results)
        .map(|((w, b, _), preds)| {
            let predictions: Vec<Prediction> = preds.into_iter().flatten().collect();
            let best = best_of(&predictions);
            Point {
                world: *w,
                bytes: *b,
                predictions,
                best,
            }
        })
        .collect();
    let crossovers: Vec<Crossover> = args
        .worlds
        .iter()
        .map(|&w| {
            let pts: Vec<&Point> = points.iter().filter(|p| p.world == w).collect();
            crossover(w, &pts)
        })
        .collect();
    println!(
        "\n# crossovers: the best algorithm by size per rank (a <= S < b: a up to S, b above)"
    );
    for c in &crossovers {
        println!("{}", c.text);
    }
    let cfg = gradsync::Config::new("", 0, 1);
    let (nsocks, nslots) = (cfg.tcp_streams(false), cfg.nslots);
    let streams = if nsocks == 1 { "stream" } else { "streams" };
    println!(
        "\n# per-rank connections and receive memory: the peers one rank's program talks to \
         (most over the ranks), TCP sockets ({nsocks} {streams} a peer on another host and a \
         listener), and the \
         inbox for those peers ({nslots} slots of {} each; past the receive budget of {}, \
         slots only for the peers at power-of-two distances, and a shared pool for the \
         others); `any`: every candidate together, `full mesh`: every other rank",
        human(segment_bytes),
        human(cfg.recv_budget as u64)
    );
    let mut feet = Vec::new();
    for &w in &args.worlds {
        let f = footprints(
            w,
            (1usize << 20).max(segment * elem as usize),
            segment,
            nsocks,
            (nslots, segment_bytes as usize, cfg.recv_budget),
        )?;
        let cells: Vec<String> = f
            .iter()
            .map(|x| {
                format!(
                    "{} {}/{}/{}",
                    x.algorithm,
                    x.peers,
                    x.sockets,
                    human(x.receive_bytes)
                )
            })
            .collect();
        println!("n={w}: {}", cells.join(", "));
        feet.extend(f);
    }
    let count = |m: Method| {
        points
            .iter()
            .flat_map(|p| &p.predictions)
            .filter(|q| q.method == m)
            .count()
    };
    println!(
        "# {} predictions in {:.1} s on {jobs} threads: {} by symmetry, {} in full, {} skipped \
         (over --max-ops)",
        cells.len(),
        started.elapsed().as_secs_f64(),
        count(Method::Rotation) + count(Method::Xor),
        count(Method::Full),
        count(Method::Skipped)
    );
    if let Some(path) = &args.json {
        let report = Report {
            model,
            dtype: "float",
            segment_bytes,
            max_ops: args.max_ops,
            points: &points,
            crossovers: &crossovers,
            footprints: &feet,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_units() {
        assert_eq!(sweep_sizes(8, 1 << 30, 4).len(), 15);
        assert_eq!(sweep_sizes(8, 1 << 30, 4).last(), Some(&(1 << 30)));
        assert_eq!(sweep_sizes(8, 32, 4), vec![8, 32]);
        assert_eq!(sweep_sizes(8, 8, 4), vec![8]);
        assert_eq!(human(8), "8 B");
        assert_eq!(human(32 << 10), "32 KiB");
        assert_eq!(human(3 << 19), "1.5 MiB");
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human_time(6e-6), "6.000 us");
        assert_eq!(human_time(0.0504), "50.40 ms");
        assert_eq!(human_time(2.5), "2.500 s");
    }

    fn pred(algorithm: &str, time_s: Option<f64>) -> Prediction {
        Prediction {
            algorithm: algorithm.into(),
            time_s,
            method: if time_s.is_some() {
                Method::Full
            } else {
                Method::Skipped
            },
            ops: 0,
            compute_s: 0.0,
        }
    }

    #[test]
    fn crossover_names_the_last_size_of_each_best() {
        let mk = |bytes, times: [Option<f64>; 3]| {
            let predictions: Vec<Prediction> = ["ring", "recursive_doubling", "rabenseifner"]
                .iter()
                .zip(times)
                .map(|(a, t)| pred(a, t))
                .collect();
            let best = best_of(&predictions);
            Point {
                world: 64,
                bytes,
                predictions,
                best,
            }
        };
        let pts = [
            mk(8, [Some(3.0), Some(1.0), Some(2.0)]),
            mk(32 << 10, [Some(3.0), Some(1.0), None]),
            mk(128 << 10, [Some(3.0), Some(2.0), Some(1.0)]),
            mk(2 << 20, [Some(2.0), Some(3.0), Some(2.0)]),
            mk(8 << 20, [Some(1.0), Some(3.0), Some(2.0)]),
        ];
        assert_eq!(pts[3].best, "ring", "ties go to the first listed");
        let refs: Vec<&Point> = pts.iter().collect();
        let c = crossover(64, &refs);
        assert_eq!(
            c.text,
            "n=64: recursive_doubling <= 32 KiB < rabenseifner <= 128 KiB < ring   \
             (not simulated, over --max-ops: rabenseifner 32 KiB)"
        );
        assert_eq!(c.spans.len(), 3);
        assert_eq!(
            (c.spans[2].from_bytes, c.spans[2].to_bytes),
            (2 << 20, 8 << 20)
        );
    }

    #[test]
    fn footprints_follow_the_peers_of_each_algorithm() {
        let f = footprints(1024, 1 << 20, 1 << 17, 2, (8, 512 << 10, 1 << 30)).unwrap();
        let get = |name: &str| f.iter().find(|x| x.algorithm == name).unwrap();
        assert_eq!(get("ring").peers, 2);
        assert_eq!(get("ring").sockets, 5);
        // 1024 x 8 slots of 512 KiB exceed 1 GiB: the ring's two neighbours keep their 8
        // slots, and the rank has a pool of 256 slots for the ranks not a power of two away.
        assert_eq!(get("ring").receive_bytes, (2 * 8 + 256) * (512 << 10));
        assert_eq!(get("recursive_doubling").peers, 10);
        assert_eq!(get("full mesh").peers, 1023);
        // Every other rank: at most 3 log2 1024 keep slots, within the budget.
        let mesh = get("full mesh").receive_bytes;
        assert!(mesh <= 1 << 30, "{mesh}");
        assert!(mesh >= (19 * 8 + 256) * (512 << 10), "{mesh}");
        // Within the budget every peer has slots.
        let within = footprints(64, 1 << 20, 1 << 17, 2, (8, 512 << 10, 1 << 30)).unwrap();
        let mesh = within.iter().find(|x| x.algorithm == "full mesh").unwrap();
        assert_eq!(mesh.receive_bytes, 63 * 8 * (512 << 10));
        let any = get("any").peers;
        assert!(
            (10..=8 * 10).contains(&any),
            "{any} peers for every candidate together"
        );
        // Small worlds can run eagerly: a post reaches every rank.
        let small = footprints(8, 64, 1 << 17, 2, (8, 512 << 10, 1 << 30)).unwrap();
        assert_eq!(
            small.iter().find(|x| x.algorithm == "any").unwrap().peers,
            7
        );
    }

    #[test]
    fn predictions_equal_the_cost_model_of_the_library() {
        let model = Model {
            alpha_s: 2e-6,
            bytes_per_s: 50e9,
        };
        let link = model.link();
        for world in [8, 12, 16] {
            for bytes in [8u64, 96 << 10, 3 << 20] {
                for algo in all_reduce_candidates(world, 0) {
                    let got = predict(&model, world, bytes, 4096, algo, 0).unwrap();
                    let want = predict_all_reduce(
                        world,
                        0,
                        4096,
                        DTYPE,
                        bytes as usize,
                        Some(algo),
                        &link,
                        &link,
                        0,
                    )
                    .unwrap();
                    assert_eq!(got.time_s, Some(want), "{algo} n={world} {bytes} B");
                }
            }
        }
    }
}
