//! The alpha-beta cost model of the algorithm choice, and the predictions it makes.
//!
//! A [`CostModel`] is one link: a per-message latency and a bandwidth; [`LinkCosts`] holds one
//! for the links inside a host and one for the links between hosts. A communicator gets its
//! model at init (see [`crate::Config::calibrate`]): pinned in `GRADSYNC_COST_FILE`, read from
//! the per-host cache file ([`cache_path`]) that an earlier init wrote, or measured (bounded by
//! [`CALIBRATION_BUDGET`]) and then cached. On a single host every rank joins ring all-gathers
//! of 8 bytes and of growing blocks, so that the links are measured loaded as a collective loads
//! them (ranks that share cores or memory bandwidth share them while measured); across hosts
//! rank 0 ping-pongs with a rank on its host and with one on another host. Rank 0 decides and hands its model to
//! every rank, so all ranks choose alike.
//!
//! The automatic all-reduce choice ([`choose_all_reduce`]) takes, for each size class (sizes
//! within a factor `sqrt 2` of a power of two, [`size_class`]), the algorithm whose predicted time is least; the predictions come from the simulator
//! replaying the schedules' own messages ([`gradsync_core::sim::predict_on`]) under the model.
//! With `GRADSYNC_DEBUG=INFO` and the `COLL` subsystem, rank 0 logs the predicted time of every
//! candidate and the choice, once per size class.
//!
//! What a candidate is charged therefore follows from the messages its schedule sends (the
//! formulas are in [`gradsync_core::schedule::plan`]). For a buffer of `B` bytes on `n` ranks,
//! when a step fits one segment: the ring `2 (n - 1)` latencies and `2 (n - 1) / n * B` bytes
//! on the critical path; recursive doubling `log2 n` latencies and `log2(n) * B` bytes;
//! Rabenseifner `2 log2 n` latencies and the ring's `2 (n - 1) / n * B` bytes on a power of two,
//! and on other worlds, with `p` the largest power of two below `n`, `2 log2(p) + 2` latencies
//! and `(2 (p - 1) / p + 2) * B` bytes (the fold sends the whole buffer in and the result back).
//!
//! The model cannot see everything that sets an algorithm's time (ranks sharing cores, how a
//! schedule's reductions overlap its transfers), so the cost file can also hold measured
//! all-reduce times ([`Measured`], written by `gradsync bench --compare ALGOS --tune`): for a
//! size class measured on the same world and ranks per host, the choice is the algorithm with
//! the least median over the recorded runs.

use gradsync_transport::Route;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gradsync_core::schedule::plan::{Algorithm, Params};
use gradsync_core::sim::{LinkModel, Topology, predict_on};
use gradsync_core::{Collective, DataType, ReduceOp};
use serde::{Deserialize, Serialize};

mod bulk;
pub use bulk::{
    BULK_BUSY_HOST, BULK_BYTES, BULK_FROM, BULK_LARGE, BULK_NOISE, BULK_RD_MAX, BULK_RUNS,
    BULK_SIZES, BULK_WORLD_MAX, Bulk, median,
};

/// One link's alpha-beta model.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CostModel {
    /// Transport it describes (`shm`, `tcp`, `rdma`).
    pub transport: String,
    /// One-way latency per message, microseconds.
    pub alpha_us: f64,
    /// Bandwidth, GB/s (10^9 bytes per second).
    pub gbytes_per_s: f64,
    /// The part of rank 0's CPUs that other processes kept busy just before it was measured
    /// (unknown in files written before it was kept, and for figures not measured). Over
    /// [`BULK_BUSY_HOST`] a later init on a quiet host measures the links again
    /// ([`LinkCosts::links_loaded`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub others: Option<f64>,
}

impl CostModel {
    /// The simulator's link.
    pub fn link(&self) -> LinkModel {
        LinkModel::new(self.alpha_us * 1e-6, (self.gbytes_per_s * 1e9).max(1.0))
    }

    /// Reads a model written by `gradsync bench --explain` (or by hand).
    pub fn load(path: &std::path::Path) -> Result<CostModel, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read cost model {}: {e}", path.display()))?;
        let m: CostModel = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not a cost model: {e}", path.display()))?;
        if !(m.alpha_us >= 0.0 && m.gbytes_per_s > 0.0) {
            return Err(format!(
                "cost model {}: alpha_us must be >= 0 and gbytes_per_s > 0",
                path.display()
            ));
        }
        Ok(m)
    }

    /// A model for `transport` when none was measured: figures measured on the development
    /// machines (shared memory about 1 us and 3 GB/s per link, loopback TCP 8 us and 4.2 GB/s;
    /// RDMA is given TCP's until it is measured). Only a starting point for `--explain`.
    pub fn uncalibrated(route: Route) -> CostModel {
        let (alpha_us, gbytes_per_s) = match route {
            Route::Shm | Route::Own | Route::Mem => (1.0, 3.0),
            _ => (8.0, 4.2),
        };
        CostModel {
            transport: route.name().to_string(),
            alpha_us,
            gbytes_per_s,
            others: None,
        }
    }
}

/// The two links of a communicator's model, and the all-reduce choices measured on this host.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LinkCosts {
    /// Links between ranks on one host.
    pub intra: CostModel,
    /// Links between ranks on different hosts (the same as `intra` on a single host).
    pub inter: CostModel,
    /// All-reduce size classes whose algorithms were timed side by side (`gradsync bench
    /// --compare ALGOS --tune`): for these the measured fastest replaces the model's choice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub measured: Vec<Measured>,
    /// Every candidate timed at each of [`BULK_SIZES`] at init, per layout of ranks on one
    /// host: from [`BULK_FROM`] on, the model's predictions take the proportions timed at the
    /// largest of those sizes at or below theirs (see [`LinkCosts::bulk_scale`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bulk: Vec<Bulk>,
}

/// One all-reduce size class timed with every algorithm on one layout of ranks, as `gradsync
/// bench --compare ALGOS --tune` records it in the cost file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Measured {
    /// Ranks of the communicator it was measured on.
    pub world: usize,
    /// Ranks per host of that communicator (as [`crate::Communicator::local_size`] reports it).
    pub local_size: usize,
    /// The size measured (bytes of f32 per rank); the entry stands for its size class
    /// ([`size_class`]).
    pub bytes: usize,
    /// The fastest algorithm measured (least median over the runs in `us`), which the
    /// automatic choice runs for the class.
    pub algorithm: String,
    /// Microseconds per call of every algorithm measured, by name: the median of each tuning
    /// run, oldest first, the last [`MEASURED_RUNS`] runs.
    pub us: std::collections::BTreeMap<String, Vec<f64>>,
}

/// Tuning runs a [`Measured`] entry keeps per algorithm: a run on a shared machine can be off
/// by more than the algorithms differ, so the choice is made on the median over several.
pub const MEASURED_RUNS: usize = 5;

impl Measured {
    /// Whether this entry stands for size class `class` of an all-reduce on `world` ranks in
    /// hosts of `local_size`.
    pub fn covers(&self, world: usize, local_size: usize, class: u32) -> bool {
        self.world == world && self.local_size == local_size && size_class(self.bytes) == class
    }

    /// Every algorithm's median over its recorded runs, in microseconds, by name.
    pub fn medians(&self) -> Vec<(&str, f64)> {
        self.us
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(name, v)| (name.as_str(), median(&mut v.clone())))
            .collect()
    }

    /// The most runs recorded for any algorithm.
    pub fn runs(&self) -> usize {
        self.us.values().map(Vec::len).max().unwrap_or(0)
    }
}

/// What a cost file may hold: both links, or one model for every link (the form `gradsync
/// bench --explain` wrote first).
#[derive(Deserialize)]
#[serde(untagged)]
enum CostFile {
    Links(LinkCosts),
    One(CostModel),
}

impl LinkCosts {
    /// The same model on every link.
    pub fn uniform(m: CostModel) -> LinkCosts {
        LinkCosts {
            intra: m.clone(),
            inter: m,
            measured: Vec::new(),
            bulk: Vec::new(),
        }
    }

    /// Uncalibrated figures for the transports inside and across hosts.
    pub fn uncalibrated(intra: Route, inter: Route) -> LinkCosts {
        LinkCosts {
            intra: CostModel::uncalibrated(intra),
            inter: CostModel::uncalibrated(inter),
            measured: Vec::new(),
            bulk: Vec::new(),
        }
    }

    /// Reads a cost file: `{"intra": MODEL, "inter": MODEL}` or a single `MODEL` for both, where
    /// `MODEL` is `{"transport": .., "alpha_us": .., "gbytes_per_s": ..}`.
    pub fn load(path: &Path) -> Result<LinkCosts, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read cost model {}: {e}", path.display()))?;
        let links = match serde_json::from_str::<CostFile>(&text) {
            Ok(CostFile::Links(l)) => l,
            Ok(CostFile::One(m)) => LinkCosts::uniform(m),
            Err(e) => return Err(format!("{} is not a cost model: {e}", path.display())),
        };
        for m in [&links.intra, &links.inter] {
            if !(m.alpha_us >= 0.0 && m.gbytes_per_s > 0.0 && m.alpha_us.is_finite()) {
                return Err(format!(
                    "cost model {}: alpha_us must be >= 0 and gbytes_per_s > 0",
                    path.display()
                ));
            }
        }
        for b in &links.bulk {
            for (name, us) in &b.us {
                if let Err(e) = Algorithm::parse(name) {
                    return Err(format!(
                        "cost model {}: bulk entry of {} ranks: {e}",
                        path.display(),
                        b.world
                    ));
                }
                if !(us.is_finite() && *us > 0.0) {
                    return Err(format!(
                        "cost model {}: bulk entry of {} ranks: {name} took {us} us",
                        path.display(),
                        b.world
                    ));
                }
            }
            for (name, v) in &b.runs {
                if let Some(us) = v.iter().find(|us| !(us.is_finite() && **us > 0.0)) {
                    return Err(format!(
                        "cost model {}: bulk entry of {} ranks: a run of {name} took {us} us",
                        path.display(),
                        b.world
                    ));
                }
            }
        }
        for m in &links.measured {
            if let Err(e) = Algorithm::parse(&m.algorithm) {
                return Err(format!(
                    "cost model {}: measured entry of {} bytes on {} ranks: {e}",
                    path.display(),
                    m.bytes,
                    m.world
                ));
            }
        }
        Ok(links)
    }

    /// Records one tuning run's medians (microseconds per call, by algorithm name) of an
    /// all-reduce of `bytes` bytes on `world` ranks in hosts of `local_size`: they join the
    /// class's earlier runs (the last [`MEASURED_RUNS`] kept), and the class's algorithm
    /// becomes the one with the least median over them. Returns that algorithm's name.
    pub fn record(
        &mut self,
        world: usize,
        local_size: usize,
        bytes: usize,
        run: &[(String, f64)],
    ) -> String {
        let class = size_class(bytes);
        let mut us = std::collections::BTreeMap::<String, Vec<f64>>::new();
        if let Some(i) = self
            .measured
            .iter()
            .position(|m| m.covers(world, local_size, class))
        {
            us = self.measured.remove(i).us;
        }
        for (name, t) in run {
            let v = us.entry(name.clone()).or_default();
            v.push(*t);
            let extra = v.len().saturating_sub(MEASURED_RUNS);
            v.drain(..extra);
        }
        let mut entry = Measured {
            world,
            local_size,
            bytes,
            algorithm: String::new(),
            us,
        };
        entry.algorithm = entry
            .medians()
            .into_iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or_else(String::new, |(name, _)| name.to_string());
        let algorithm = entry.algorithm.clone();
        self.measured.push(entry);
        self.measured
            .sort_by_key(|m| (m.world, m.local_size, m.bytes));
        algorithm
    }

    /// The entries of [`bulk`](Self::bulk) timed on `world` ranks in hosts of `local_size`,
    /// smallest size first.
    pub fn bulk_of(&self, world: usize, local_size: usize) -> impl Iterator<Item = &Bulk> {
        bulk::of(&self.bulk, world, local_size)
    }

    /// Whether the layout's candidates were timed: it has an entry at the smallest of
    /// [`BULK_SIZES`] (the timing keeps the sizes from the smallest on that fit its budget).
    pub fn has_bulk(&self, world: usize, local_size: usize) -> bool {
        self.bulk_of(world, local_size)
            .any(|b| b.bytes == BULK_SIZES[0])
    }

    /// Whether the links were measured while other processes kept more than
    /// [`BULK_BUSY_HOST`] of rank 0's CPUs busy (a cache written beside a busy test suite held
    /// a shared-memory latency of 1331 us, against 5-8 us on a quiet host). Figures that do
    /// not say are taken as they are.
    pub fn links_loaded(&self) -> bool {
        [&self.intra, &self.inter]
            .iter()
            .any(|m| m.others.is_some_and(|o| o > BULK_BUSY_HOST))
    }

    /// Whether the layout's timed candidates may be the load's rather than the host's: some
    /// entry was timed while other processes took more than [`BULK_BUSY_HOST`] of the CPUs,
    /// or in a file that did not say. Init times such a layout again when the host is quiet.
    pub fn bulk_loaded(&self, world: usize, local_size: usize) -> bool {
        self.bulk_of(world, local_size).any(|b| !b.quiet())
    }

    /// Whether the layout's times are settled: every entry is the median of [`BULK_RUNS`]
    /// quiet timings. Until then init times the layout again whenever the host is quiet.
    pub fn bulk_settled(&self, world: usize, local_size: usize) -> bool {
        self.has_bulk(world, local_size)
            && self
                .bulk_of(world, local_size)
                .all(|b| b.quiet_runs() >= BULK_RUNS)
    }

    /// Takes a new timing of the layout (`entries`, one per size timed). A quiet timing joins
    /// the layout's earlier quiet ones: each entry keeps the last [`BULK_RUNS`] times of every
    /// algorithm and their median. A busy one replaces the layout's entries only where they
    /// are busy or unknown too, as does any timing of a layout that had none. Sizes not in
    /// `entries` (the budget left them out) lose their older entries. Returns whether it took
    /// the timing (not: a busy one beside quiet times).
    pub fn merge_bulk(&mut self, world: usize, local_size: usize, entries: Vec<Bulk>) -> bool {
        bulk::merge(&mut self.bulk, world, local_size, entries)
    }

    /// The entry of the layout that stands for `bytes`: the one timed at the largest size at
    /// or below it.
    pub fn bulk_at(&self, world: usize, local_size: usize, bytes: usize) -> Option<&Bulk> {
        bulk::at(&self.bulk, world, local_size, bytes)
    }

    /// Puts `entry` in place of any earlier one of its layout and size.
    pub fn set_bulk(&mut self, entry: Bulk) {
        bulk::set(&mut self.bulk, entry)
    }

    /// The proportion of `algo`'s time to the ring's that the host measured for `bytes` bytes
    /// (from [`BULK_FROM`] on; `None` below, or where nothing was timed for this layout or
    /// algorithm). Between two timed sizes it is interpolated in the logarithm of the size,
    /// from the entry at or below `bytes` ([`bulk_at`](Self::bulk_at)) to the next one up;
    /// beyond the largest timed size, or where the next entry did not time `algo` (recursive
    /// doubling from 2 MiB on), the lower entry's proportion holds. A time within
    /// [`BULK_NOISE`] of the ring's says nothing either way: it counts as level (1).
    pub fn bulk_ratio(
        &self,
        world: usize,
        local_size: usize,
        algo: Algorithm,
        bytes: usize,
    ) -> Option<f64> {
        bulk::ratio(&self.bulk, world, local_size, algo, bytes)
    }

    /// The factor that scales the model's prediction for `algo` at `bytes` bytes so that it
    /// stands to the ring's prediction in the proportion the host measured
    /// ([`bulk_ratio`](Self::bulk_ratio)); 1 where nothing was measured. The ring's factor is
    /// 1, so the ring keeps the model's figure and the others take the proportions that the
    /// host measured: where the ranks share cores and memory rather than a link per pair (3
    /// ranks on 2 cores: the tree at 0.61-0.65 of the ring where the model has it 1.54 times),
    /// the model's shape alone misses by far more than its margin, and between two timed
    /// sizes it misses too (4 ranks: scaled from 512 KiB, the model had the tree fastest at
    /// 1 MiB, which measured 1.48 times Rabenseifner's time).
    #[allow(clippy::too_many_arguments)]
    pub fn bulk_scale(
        &self,
        world: usize,
        local_size: usize,
        segment: usize,
        inter_slots: usize,
        algo: Algorithm,
        bytes: usize,
    ) -> f64 {
        if algo == Algorithm::Ring {
            return 1.0;
        }
        let Some(ratio) = self.bulk_ratio(world, local_size, algo, bytes) else {
            return 1.0;
        };
        let (intra, inter) = (self.intra.link(), self.inter.link());
        let predict = |a| {
            predict_all_reduce(
                world,
                local_size,
                segment,
                DataType::F32,
                bytes,
                Some(a),
                &intra,
                &inter,
                inter_slots,
            )
        };
        match (predict(algo), predict(Algorithm::Ring)) {
            (Ok(p_a), Ok(p_ring)) if p_a > 0.0 && p_ring > 0.0 => {
                let f = ratio / (p_a / p_ring);
                if f.is_finite() && f > 0.0 { f } else { 1.0 }
            }
            _ => 1.0,
        }
    }

    /// Writes the model to `path` (pretty JSON), through a temporary file renamed into place so
    /// that a concurrent reader never sees half a file. Creates the directory.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n";
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    }
}

/// About the longest a calibration at init measures, all links together: the bulk messages
/// stop growing, and the measurement ends, once it is spent.
pub const CALIBRATION_BUDGET: Duration = Duration::from_millis(120);

/// The per-host cache file of the model measured at init: `$XDG_CACHE_HOME/gradsync/` (or
/// `~/.cache/gradsync/`) `cost-HOST-INTRA-INTER.json`, where HOST is rank 0's host name
/// and INTRA, INTER the transports inside and across hosts. `None` without a home directory.
pub fn cache_path(host: &str, intra: &str, inter: &str) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    let clean: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    Some(
        base.join("gradsync")
            .join(format!("cost-{clean}-{intra}-{inter}.json")),
    )
}

/// The size class of `bytes`: 0 for 0 bytes, else `1 + round(log2(bytes))`, so that the class
/// of `2^k` bytes holds the sizes from `2^k / sqrt 2` to below `2^k * sqrt 2`.
pub fn size_class(bytes: usize) -> u32 {
    if bytes == 0 {
        return 0;
    }
    let k = usize::BITS - 1 - bytes.leading_zeros();
    let b = bytes as u128;
    let up = b * b >= 1u128 << (2 * k + 1);
    k + 1 + u32::from(up)
}

/// The size at which the model is evaluated for every size of `class`: the power of two at its
/// centre (at least 8 bytes). A function of the class alone, so that every rank makes the same
/// choice.
pub fn class_bytes(class: u32) -> usize {
    if class <= 4 {
        return 8;
    }
    1usize << (class - 1).min(usize::BITS - 2)
}

/// Worlds above this size skip the model and use [`gradsync_core::schedule::plan::default_algorithm`]:
/// replaying every candidate's messages for every rank would take longer than the collective.
pub const MODEL_MAX_WORLD: usize = 256;

/// The ring is the model's choice unless another candidate is predicted faster by more than
/// this fraction: the model leaves out reductions, copies and caches, which favour the ring's
/// small pipelined blocks (at 512 KiB to 1 MiB on 4 ranks of this host, Rabenseifner's halving
/// steps measure 1.1 to 1.6 times the ring while the model has them 1 to 3% faster).
pub const RING_MARGIN: f64 = 0.05;

/// One size class's predictions: every candidate with its predicted seconds (or why it has
/// none), the candidate with the least, and the algorithm the automatic choice runs.
#[derive(Clone, Debug)]
pub struct Choice {
    /// `(algorithm, predicted seconds)` in the order of [`all_reduce_candidates`], from
    /// [`BULK_FROM`] on scaled by the host's measured proportions ([`LinkCosts::bulk_scale`]).
    pub predicted: Vec<(Algorithm, Result<f64, String>)>,
    /// The fastest predicted candidate, or the ring when it is within [`RING_MARGIN`] of it.
    pub model: Algorithm,
    /// The cost file's measurement of this class, when it has one for this layout.
    pub measured: Option<Measured>,
    /// What the automatic choice runs: the measured fastest where the class was measured (and
    /// that algorithm is a candidate here), else the model's.
    pub best: Algorithm,
}

/// The model's all-reduce algorithm for size class `class` on `world` ranks in hosts of
/// `local_size`, with pipeline segments of `segment_f32` f32 elements and at most
/// `inter_slots` of them in flight to a peer on another host (0: no limit).
pub fn choose_all_reduce(
    world: usize,
    local_size: usize,
    segment_f32: usize,
    class: u32,
    links: &LinkCosts,
    inter_slots: usize,
) -> Choice {
    let bytes = class_bytes(class);
    let (intra, inter) = (links.intra.link(), links.inter.link());
    let predicted: Vec<(Algorithm, Result<f64, String>)> = all_reduce_candidates(world, local_size)
        .into_iter()
        .map(|a| {
            let t = predict_all_reduce(
                world,
                local_size,
                segment_f32,
                DataType::F32,
                bytes,
                Some(a),
                &intra,
                &inter,
                inter_slots,
            )
            .map(|t| t * links.bulk_scale(world, local_size, segment_f32, inter_slots, a, bytes));
            (a, t)
        })
        .collect();
    let fastest = predicted
        .iter()
        .filter_map(|(a, t)| t.as_ref().ok().map(|t| (*a, *t)))
        .min_by(|x, y| x.1.total_cmp(&y.1));
    let ring = predicted.iter().find_map(|(a, t)| match (a, t) {
        (Algorithm::Ring, Ok(t)) => Some(*t),
        _ => None,
    });
    let model = match (fastest, ring) {
        (Some((_, t)), Some(r)) if r <= t * (1.0 + RING_MARGIN) => Algorithm::Ring,
        (Some((a, _)), _) => a,
        (None, _) => Algorithm::Ring,
    };
    let measured = links
        .measured
        .iter()
        .rev()
        .find(|m| m.covers(world, local_size, class))
        .cloned();
    let best = measured
        .as_ref()
        .and_then(|m| Algorithm::parse(&m.algorithm).ok())
        .filter(|a| predicted.iter().any(|(c, _)| c == a))
        .unwrap_or(model);
    Choice {
        predicted,
        model,
        measured,
        best,
    }
}

/// The all-to-all algorithm for blocks of `block_bytes` bytes on `world` ranks, with `link` the
/// model of the links the exchange crosses: the pairwise exchange unless Bruck's log-step
/// algorithm is predicted faster by more than [`RING_MARGIN`].
///
/// Under the alpha-beta model, where a rank's messages leave one after the other on its link,
/// the pairwise exchange with `w` steps in flight costs `ceil((n - 1) / w) alpha + (n - 1) b
/// beta`; Bruck's costs `ceil(log2 n) alpha + s b beta` plus its local copies (`2 +
/// ceil(log2 n)` passes over `n b` bytes at [`COPY_BYTES_PER_S`]), where `s b` is what each
/// rank sends over all steps (the blocks whose index has the step's bit set, about
/// `n log2(n) / 2` blocks). Returns the choice, then the pairwise and Bruck predictions in
/// seconds.
pub fn choose_all_to_all(
    world: usize,
    block_bytes: usize,
    window: usize,
    link: &LinkModel,
) -> (Algorithm, f64, f64) {
    let n = world.max(1);
    let b = block_bytes as f64;
    let steps = n.saturating_sub(1);
    let rounds = steps.div_ceil(window.max(1)) as f64;
    let pairwise = rounds * link.alpha_s + steps as f64 * b * link.beta_s_per_byte;
    let logn = n.next_power_of_two().trailing_zeros() as f64;
    let sent = gradsync_core::schedule::alltoall::bruck_elems_sent(n, 1) as f64 * b;
    let copies = (2.0 + logn) * n as f64 * b / COPY_BYTES_PER_S;
    let bruck = logn * link.alpha_s + sent * link.beta_s_per_byte + copies;
    let algo = if n > 2 && bruck * (1.0 + RING_MARGIN) < pairwise {
        Algorithm::Bruck
    } else {
        Algorithm::Pairwise
    };
    (algo, pairwise, bruck)
}

/// Bytes per second of a local copy in the cost model (the lower end of what this kind of
/// machine measures for `memcpy`).
pub const COPY_BYTES_PER_S: f64 = 10e9;

/// Largest world that runs small all-reduces eagerly: each rank sends `world - 1` messages
/// (or posts once on a shared-memory board).
pub const EAGER_WORLD_MAX: usize = 16;

/// The all-reduce algorithms the model compares on `world` ranks in hosts of `local_size`
/// (0: one host).
pub fn all_reduce_candidates(world: usize, local_size: usize) -> Vec<Algorithm> {
    let mut v = vec![
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Tree,
        Algorithm::DoubleTree,
    ];
    if local_size > 1 && local_size < world {
        v.push(Algorithm::Hierarchical);
    }
    v
}

/// The parameters of every rank of an out-of-place sum all-reduce of `bytes` bytes of `dtype`
/// with `algorithm`, as the model predicts it.
pub fn all_reduce_params(
    world: usize,
    local_size: usize,
    segment: usize,
    dtype: DataType,
    bytes: usize,
    algorithm: Algorithm,
) -> Vec<Params> {
    (0..world)
        .map(|rank| Params {
            coll: Collective::AllReduce,
            rank,
            world,
            count: bytes / dtype.size(),
            root: 0,
            op: ReduceOp::Sum,
            segment,
            in_place: false,
            algorithm,
            local_size,
        })
        .collect()
}

/// Predicted seconds of an all-reduce of `bytes` bytes of `dtype` on `world` ranks with
/// `algo`, in segments of `segment` elements, with `intra` inside a host and `inter` across
/// hosts, where a rank has at most `inter_slots` messages in flight to a peer on another host
/// (the pair's window; 0: no limit). `None` is the eager path: `world - 1` messages of the
/// whole buffer from every rank, back to back.
#[allow(clippy::too_many_arguments)]
pub fn predict_all_reduce(
    world: usize,
    local_size: usize,
    segment: usize,
    dtype: DataType,
    bytes: usize,
    algo: Option<Algorithm>,
    intra: &LinkModel,
    inter: &LinkModel,
    inter_slots: usize,
) -> Result<f64, String> {
    let Some(algorithm) = algo else {
        let link = if local_size == 0 || local_size >= world {
            intra
        } else {
            inter
        };
        return Ok(world.saturating_sub(1) as f64 * link.message_s(bytes));
    };
    let params = all_reduce_params(world, local_size, segment, dtype, bytes, algorithm);
    // One rank per host is two levels too: every link crosses hosts, and every rank's
    // download is limited (see `predict_on`).
    let topo = if local_size >= 1 && local_size < world {
        Topology::two_level(local_size, *intra, *inter).with_inter_slots(inter_slots)
    } else {
        Topology::flat(if local_size == 0 || local_size >= world {
            *intra
        } else {
            *inter
        })
    };
    predict_on(&params, dtype, &topo)
        .map(|p| p.time_s)
        .map_err(|e| format!("predicting {algorithm}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_timings_accumulate_to_a_median_and_busy_ones_do_not_replace_them() {
        let mut links = LinkCosts::uniform(CostModel::uncalibrated(Route::Shm));
        let entry = |world: usize, tree: f64, others: Option<f64>| Bulk {
            world,
            local_size: world,
            bytes: BULK_FROM,
            us: [("ring".to_string(), 100.0), ("tree".to_string(), tree)]
                .into_iter()
                .collect(),
            others,
            runs: Default::default(),
        };
        let tree = |l: &LinkCosts| l.bulk_of(4, 4).next().unwrap().us["tree"];
        let runs = |l: &LinkCosts| l.bulk_of(4, 4).next().unwrap().runs["tree"].clone();
        links.merge_bulk(3, 3, vec![entry(3, 70.0, Some(0.0))]);
        // A file that does not say how busy the host was: not settled; any timing replaces it.
        links.merge_bulk(4, 4, vec![entry(4, 50.0, None)]);
        assert!(links.has_bulk(4, 4) && links.bulk_loaded(4, 4));
        assert!(!links.bulk_settled(4, 4));
        links.merge_bulk(4, 4, vec![entry(4, 300.0, Some(0.5))]);
        assert_eq!(tree(&links), 300.0);
        assert!(links.bulk_loaded(4, 4));
        // A quiet timing replaces a busy one: one quiet run, not settled.
        links.merge_bulk(4, 4, vec![entry(4, 90.0, Some(0.0))]);
        assert_eq!(tree(&links), 90.0);
        assert!(!links.bulk_loaded(4, 4) && !links.bulk_settled(4, 4));
        assert_eq!(links.bulk_of(4, 4).next().unwrap().quiet_runs(), 1);
        // A busy timing does not replace quiet times.
        links.merge_bulk(4, 4, vec![entry(4, 10.0, Some(0.9))]);
        assert_eq!(tree(&links), 90.0);
        // Two more quiet timings: the median of three outvotes the odd one.
        links.merge_bulk(4, 4, vec![entry(4, 150.0, Some(0.1))]);
        assert!(!links.bulk_settled(4, 4));
        links.merge_bulk(4, 4, vec![entry(4, 80.0, Some(0.05))]);
        assert!(links.bulk_settled(4, 4));
        assert_eq!(runs(&links), [90.0, 150.0, 80.0]);
        assert_eq!(tree(&links), 90.0);
        assert_eq!(links.bulk_of(4, 4).next().unwrap().others, Some(0.1));
        // A fourth drops the oldest.
        links.merge_bulk(4, 4, vec![entry(4, 70.0, Some(0.0))]);
        assert_eq!(runs(&links), [150.0, 80.0, 70.0]);
        assert_eq!(tree(&links), 80.0);
        // The other layout kept its own, and the file keeps the runs.
        assert_eq!(links.bulk_of(3, 3).next().unwrap().us["tree"], 70.0);
        assert_eq!(links.bulk.len(), 2);
        let dir = std::env::temp_dir().join(format!("gradsync-runs-{}", std::process::id()));
        let f = dir.join("c.json");
        links.save(&f).unwrap();
        assert_eq!(LinkCosts::load(&f).unwrap(), links);
        let text = std::fs::read_to_string(&f).unwrap();
        std::fs::write(&f, text.replace("150.0", "-150.0")).unwrap();
        let e = LinkCosts::load(&f).unwrap_err();
        assert!(e.contains("a run of tree took -150"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn all_to_all_choice_follows_the_model() {
        let link = LinkModel::new(10e-6, 5e9);
        // Few ranks: every step in flight at once, the pairwise exchange.
        assert_eq!(choose_all_to_all(4, 8, 8, &link).0, Algorithm::Pairwise);
        // Many ranks, tiny blocks: latency dominates, Bruck's log2 n steps.
        let (a, pw, br) = choose_all_to_all(64, 8, 8, &link);
        assert_eq!(a, Algorithm::Bruck, "{pw} {br}");
        // Many ranks, large blocks: every byte once.
        assert_eq!(
            choose_all_to_all(64, 1 << 20, 8, &link).0,
            Algorithm::Pairwise
        );
        // One or two ranks: nothing to gain.
        assert_eq!(choose_all_to_all(2, 8, 1, &link).0, Algorithm::Pairwise);
        assert_eq!(choose_all_to_all(1, 8, 1, &link).0, Algorithm::Pairwise);
    }

    #[test]
    fn size_classes_centre_on_powers_of_two() {
        assert_eq!(size_class(0), 0);
        for k in 3..40u32 {
            let p = 1usize << k;
            let c = size_class(p);
            assert_eq!(class_bytes(c), p, "2^{k}");
            // sqrt 2 = 1.41421...: 1.414 * p is still in the class, 1.415 * p is the next one.
            assert_eq!(size_class(p * 1414 / 1000), c, "2^{k} * 1.414");
            assert_eq!(size_class(p * 1415 / 1000 + 1), c + 1, "2^{k} * 1.415");
            if k >= 10 {
                assert_eq!(size_class((p * 708).div_ceil(1000)), c, "2^{k} * 0.708");
            }
        }
        assert_eq!(class_bytes(size_class(1)), 8);
    }

    #[test]
    fn model_file_round_trip_and_predictions() {
        let m = CostModel {
            transport: "shm".into(),
            alpha_us: 2.0,
            gbytes_per_s: 1.0,
            others: None,
        };
        let dir = std::env::temp_dir().join(format!("gradsync-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("m.json");
        std::fs::write(&f, serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(CostModel::load(&f).unwrap(), m);
        std::fs::write(&f, r#"{"transport":"x","alpha_us":-1,"gbytes_per_s":1}"#).unwrap();
        assert!(CostModel::load(&f).unwrap_err().contains("alpha_us"));
        let _ = std::fs::remove_dir_all(&dir);
        let l = m.link();
        let t = |a| predict_all_reduce(2, 0, 1 << 20, DataType::F32, 32768, a, &l, &l, 0).unwrap();
        // On 2 ranks: one message for eager and recursive doubling, two halves for the ring.
        assert!((t(None) * 1e6 - 34.768).abs() < 0.01);
        assert!((t(Some(Algorithm::RecursiveDoubling)) * 1e6 - 34.768).abs() < 0.01);
        assert!((t(Some(Algorithm::Ring)) * 1e6 - 36.768).abs() < 0.01);
    }

    /// The model charges Rabenseifner `2 log2 p` latencies (two more for the fold when `n` is not
    /// a power of two) and the ring's bandwidth term `2 (p - 1) / p * B` (plus `2 B` for the
    /// fold), against the ring's `2 (n - 1)` latencies.
    #[test]
    fn rabenseifner_is_charged_log2_latencies_and_the_rings_bandwidth() {
        let predict = |world: usize, bytes: usize, algo, link: &LinkModel| {
            predict_all_reduce(
                world,
                0,
                1 << 20,
                DataType::F32,
                bytes,
                Some(algo),
                link,
                link,
                0,
            )
            .unwrap()
        };
        // Latency only (1 us per message, a link too fast to matter), and bandwidth only (1 GB/s).
        let alpha = LinkModel::new(1e-6, 1e18);
        let beta = LinkModel::new(0.0, 1e9);
        let bytes = 4 << 10;
        for n in (2..=17usize).chain([31, 32, 33, 64]) {
            let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
            let fold = usize::from(n != p);
            let steps = 2 * p.trailing_zeros() as usize + 2 * fold;
            let us = predict(n, bytes, Algorithm::Rabenseifner, &alpha) * 1e6;
            assert!((us - steps as f64).abs() < 1e-6, "n = {n}: {us} us");
            let ring = predict(n, bytes, Algorithm::Ring, &alpha) * 1e6;
            assert!(
                (ring - 2.0 * (n - 1) as f64).abs() < 1e-6,
                "n = {n}: ring {ring} us"
            );
            assert!(us <= ring + 1e-6, "n = {n}: {us} us, ring {ring} us");
            // 4 KiB is 1024 f32, a whole number of elements per block for every p here.
            let pf = p as f64;
            let want = (2.0 * (pf - 1.0) / pf + 2.0 * fold as f64) * bytes as f64 / 1e9;
            let got = predict(n, bytes, Algorithm::Rabenseifner, &beta);
            assert!(
                (got - want).abs() < 1e-9 * want,
                "n = {n}: {got} s, want {want}"
            );
        }
    }

    /// One tuning run in which `fastest` took 1 us and every other candidate 2 us.
    fn run(fastest: &str) -> Vec<(String, f64)> {
        [
            "ring",
            "recursive_doubling",
            "rabenseifner",
            "tree",
            "double_tree",
        ]
        .iter()
        .map(|a| (a.to_string(), if *a == fastest { 1.0 } else { 2.0 }))
        .chain((fastest == "hierarchical").then(|| (fastest.to_string(), 0.5)))
        .collect()
    }

    #[test]
    fn the_ring_stays_unless_another_is_predicted_faster_by_the_margin() {
        let links = LinkCosts::uniform(CostModel {
            transport: "shm".into(),
            alpha_us: 2.0,
            gbytes_per_s: 2.0,
            others: None,
        });
        for bytes in [1usize << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22] {
            let c = choose_all_reduce(4, 4, 1 << 17, size_class(bytes), &links, 3);
            let t = |a: Algorithm| {
                c.predicted
                    .iter()
                    .find(|(x, _)| *x == a)
                    .and_then(|(_, t)| t.as_ref().ok().copied())
                    .unwrap()
            };
            let fastest = c
                .predicted
                .iter()
                .filter_map(|(_, t)| t.as_ref().ok().copied())
                .fold(f64::INFINITY, f64::min);
            let ring_close = t(Algorithm::Ring) <= fastest * (1.0 + RING_MARGIN);
            assert_eq!(
                c.model == Algorithm::Ring,
                ring_close,
                "{bytes} bytes: {c:?}"
            );
            if !ring_close {
                assert_eq!(t(c.model), fastest, "{bytes} bytes: {c:?}");
            }
        }
        // Small messages leave the ring (latency-bound), the largest keep it.
        let small = choose_all_reduce(4, 4, 1 << 17, size_class(1 << 12), &links, 3);
        let large = choose_all_reduce(4, 4, 1 << 17, size_class(1 << 22), &links, 3);
        assert_ne!(small.model, Algorithm::Ring, "{small:?}");
        assert_eq!(large.model, Algorithm::Ring, "{large:?}");
    }

    #[test]
    fn a_measured_class_overrides_the_model_on_its_layout_only() {
        let mut links = LinkCosts::uniform(CostModel {
            transport: "shm".into(),
            alpha_us: 1.0,
            gbytes_per_s: 1.0,
            others: None,
        });
        let class = size_class(1 << 20);
        let model = choose_all_reduce(4, 4, 1 << 17, class, &links, 3);
        assert_eq!(model.best, model.model);
        assert!(model.measured.is_none());
        let other = if model.model == Algorithm::Tree {
            "double_tree"
        } else {
            "tree"
        };
        // 1.2 MiB is in the class of 1 MiB; the entry stands for the whole class.
        assert_eq!(links.record(4, 4, 1200 << 10, &run(other)), other);
        let c = choose_all_reduce(4, 4, 1 << 17, class, &links, 3);
        assert_eq!((c.model, c.best.name()), (model.model, other));
        assert_eq!(c.measured.as_ref().unwrap().bytes, 1200 << 10);
        // Other worlds, layouts and classes keep the model's choice.
        for (world, local, cl) in [(8, 8, class), (4, 2, class), (4, 4, class + 1)] {
            let c = choose_all_reduce(world, local, 1 << 17, cl, &links, 3);
            assert!(
                c.measured.is_none() && c.best == c.model,
                "{world} {local} {cl}"
            );
        }
        // Later runs of the class join it: the choice is the least median over the runs.
        links.record(4, 4, 1 << 20, &run("ring"));
        assert_eq!(links.record(4, 4, 1 << 20, &run("ring")), "ring");
        assert_eq!(links.measured.len(), 1);
        assert_eq!(links.measured[0].us["ring"], [2.0, 1.0, 1.0]);
        assert_eq!(
            choose_all_reduce(4, 4, 1 << 17, class, &links, 3).best,
            Algorithm::Ring
        );
        // Only the last MEASURED_RUNS runs count.
        for _ in 0..MEASURED_RUNS {
            links.record(4, 4, 1 << 20, &run("tree"));
        }
        assert_eq!(links.measured[0].us["ring"], [2.0; MEASURED_RUNS]);
        assert_eq!(links.measured[0].algorithm, "tree");
        // An algorithm that is no candidate here (hierarchical on one host) is not run.
        for _ in 0..MEASURED_RUNS {
            links.record(4, 4, 1 << 20, &run("hierarchical"));
        }
        assert_eq!(links.measured[0].algorithm, "hierarchical");
        let c = choose_all_reduce(4, 4, 1 << 17, class, &links, 3);
        assert_eq!(c.best, c.model);

        // The file keeps the entries; files without any, and a bad name, are handled.
        let dir = std::env::temp_dir().join(format!("gradsync-measured-{}", std::process::id()));
        let f = dir.join("c.json");
        links.save(&f).unwrap();
        assert_eq!(LinkCosts::load(&f).unwrap(), links);
        let text = std::fs::read_to_string(&f).unwrap();
        std::fs::write(&f, text.replace("hierarchical", "bogus")).unwrap();
        let e = LinkCosts::load(&f).unwrap_err();
        assert!(
            e.contains("1048576 bytes on 4 ranks") && e.contains("bogus"),
            "{e}"
        );
        links.measured.clear();
        links.save(&f).unwrap();
        assert!(!std::fs::read_to_string(&f).unwrap().contains("measured"));
        assert_eq!(LinkCosts::load(&f).unwrap(), links);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bulk_times_take_over_the_proportions_from_their_size_on_their_layout_only() {
        let mut links = LinkCosts::uniform(CostModel {
            transport: "shm".into(),
            alpha_us: 5.0,
            gbytes_per_s: 3.0,
            others: None,
        });
        let class = size_class(BULK_BYTES);
        let before = choose_all_reduce(3, 3, 1 << 17, class, &links, 3);
        let t = |c: &Choice, a: Algorithm| {
            c.predicted
                .iter()
                .find(|(x, _)| *x == a)
                .and_then(|(_, t)| t.as_ref().ok().copied())
                .unwrap()
        };
        // The model alone keeps the ring at this size (the tree moves twice the bytes).
        assert_eq!(before.model, Algorithm::Ring, "{before:?}");
        assert!(t(&before, Algorithm::Tree) > t(&before, Algorithm::Ring));
        let us = [
            ("ring", 4800.0),
            ("tree", 3000.0),
            ("double_tree", 3400.0),
            ("rabenseifner", 3700.0),
        ];
        links.set_bulk(Bulk {
            world: 3,
            local_size: 3,
            bytes: BULK_BYTES,
            us: us.iter().map(|(a, t)| (a.to_string(), *t)).collect(),
            others: Some(0.05),
            runs: Default::default(),
        });
        // Timed while other processes took 5% of the CPUs: the host's own times.
        assert!(!links.bulk_loaded(3, 3));
        // At the timed size the predictions keep the measured proportions, so the tree wins.
        let after = choose_all_reduce(3, 3, 1 << 17, class, &links, 3);
        assert_eq!(after.model, Algorithm::Tree, "{after:?}");
        let ring = t(&after, Algorithm::Ring);
        assert_eq!(ring, t(&before, Algorithm::Ring));
        for (a, m) in us {
            let a = Algorithm::parse(a).unwrap();
            let want = m / 4800.0;
            let got = t(&after, a) / ring;
            assert!((got - want).abs() < 1e-9, "{a}: {got} against {want}");
        }
        // Larger sizes take them too; smaller ones, other layouts and algorithms not timed
        // (recursive doubling) keep the model's figures.
        let big = choose_all_reduce(3, 3, 1 << 17, size_class(BULK_BYTES << 3), &links, 3);
        assert_eq!(big.model, Algorithm::Tree, "{big:?}");
        for (world, local, cl) in [(3, 3, class - 1), (4, 4, class), (6, 3, class)] {
            assert_eq!(
                links.bulk_scale(world, local, 1 << 17, 3, Algorithm::Tree, class_bytes(cl)),
                1.0,
                "{world} {local} {cl}"
            );
        }
        assert_eq!(
            links.bulk_scale(3, 3, 1 << 17, 3, Algorithm::RecursiveDoubling, BULK_BYTES),
            1.0
        );
        // A time within BULK_NOISE of the ring's counts as level with it.
        let mut level = links.clone();
        let mut entry = level.bulk[0].clone();
        entry
            .us
            .insert("tree".into(), 4800.0 * (1.0 - BULK_NOISE / 2.0));
        entry
            .us
            .insert("double_tree".into(), 4800.0 * (1.0 + BULK_NOISE / 2.0));
        level.set_bulk(entry);
        for a in [Algorithm::Tree, Algorithm::DoubleTree] {
            assert_eq!(level.bulk_ratio(3, 3, a, BULK_BYTES), Some(1.0), "{a}");
        }
        let level_choice = choose_all_reduce(3, 3, 1 << 17, class, &level, 3);
        assert_eq!(
            level_choice.model,
            Algorithm::Rabenseifner,
            "{level_choice:?}"
        );
        // A new entry of the layout and size replaces the old one.
        let mut again = links.bulk[0].clone();
        again.us.insert("tree".into(), 6000.0);
        links.set_bulk(again);
        assert_eq!(links.bulk.len(), 1);
        assert_eq!(
            choose_all_reduce(3, 3, 1 << 17, class, &links, 3).model,
            Algorithm::DoubleTree
        );
        assert!(!links.has_bulk(3, 3));
        // Between two timed sizes the proportions are interpolated (in the logarithm of the
        // size); an algorithm the next entry did not time keeps the lower entry's: at 512 KiB
        // recursive doubling measured fastest, so it runs from 512 KiB to 4 MiB and not
        // below; 8 MiB keeps its own entry.
        let half = 512 << 10;
        links.set_bulk(Bulk {
            world: 3,
            local_size: 3,
            bytes: half,
            us: [
                ("ring", 400.0),
                ("recursive_doubling", 250.0),
                ("tree", 390.0),
                ("double_tree", 420.0),
                ("rabenseifner", 380.0),
            ]
            .iter()
            .map(|(a, t)| (a.to_string(), *t))
            .collect(),
            others: None,
            runs: Default::default(),
        });
        assert_eq!(links.bulk.len(), 2);
        // An entry that does not say how busy the host was may be the load's; so may one
        // timed while others took more than BULK_BUSY_HOST, and only its own layout.
        assert!(links.bulk_loaded(3, 3));
        let mut busy = links.clone();
        busy.bulk.iter_mut().for_each(|b| b.others = Some(0.0));
        assert!(!busy.bulk_loaded(3, 3));
        busy.bulk[0].others = Some(BULK_BUSY_HOST + 0.01);
        assert!(busy.bulk_loaded(3, 3) && !busy.bulk_loaded(4, 4));
        assert_eq!(links.bulk_at(3, 3, half).map(|b| b.bytes), Some(half));
        assert_eq!(links.bulk_at(3, 3, half - 1).map(|b| b.bytes), None);
        assert_eq!(
            links.bulk_at(3, 3, BULK_BYTES - 1).map(|b| b.bytes),
            Some(half)
        );
        let model = |bytes| choose_all_reduce(3, 3, 1 << 17, size_class(bytes), &links, 3).model;
        assert_eq!(model(half), Algorithm::RecursiveDoubling);
        assert_eq!(model(4 << 20), Algorithm::RecursiveDoubling);
        assert_eq!(model(BULK_BYTES), Algorithm::DoubleTree);
        assert_ne!(model(half / 2), Algorithm::RecursiveDoubling);
        // The tree: level with the ring at 512 KiB (390 against 400), 1.25 times it at 8 MiB;
        // at 2 MiB, halfway in the logarithm, 1.125; recursive doubling 250 / 400 throughout.
        let tree = links.bulk_ratio(3, 3, Algorithm::Tree, 2 << 20).unwrap();
        assert!((tree - 1.125).abs() < 1e-9, "{tree}");
        let rd = links.bulk_ratio(3, 3, Algorithm::RecursiveDoubling, 2 << 20);
        assert_eq!(rd, Some(0.625));
        assert_eq!(
            links.bulk_ratio(3, 3, Algorithm::Tree, BULK_BYTES << 2),
            Some(1.25)
        );
        assert_eq!(links.bulk_ratio(3, 3, Algorithm::Tree, half - 1), None);

        // The file keeps the entries; a bad name or time is refused with the layout named.
        let dir = std::env::temp_dir().join(format!("gradsync-bulk-{}", std::process::id()));
        let f = dir.join("c.json");
        links.save(&f).unwrap();
        assert_eq!(LinkCosts::load(&f).unwrap(), links);
        let text = std::fs::read_to_string(&f).unwrap();
        std::fs::write(&f, text.replace("double_tree", "bogus")).unwrap();
        let e = LinkCosts::load(&f).unwrap_err();
        assert!(
            e.contains("bulk entry of 3 ranks") && e.contains("bogus"),
            "{e}"
        );
        std::fs::write(&f, text.replace("6000.0", "-1.0")).unwrap();
        let e = LinkCosts::load(&f).unwrap_err();
        assert!(
            e.contains("bulk entry of 3 ranks") && e.contains("tree took -1"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
