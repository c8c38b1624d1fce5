//! Every all-reduce candidate timed at init on one host of 3 to 8 ranks: the timed sizes, the
//! entries the cost file keeps per layout, how quiet timings settle, and the proportions to the
//! ring that the automatic choice takes from them. [`super::LinkCosts`] holds the entries and
//! reaches them through the functions here.

use gradsync_core::schedule::plan::Algorithm;
use serde::{Deserialize, Serialize};

/// Largest size at which the calibration of a single host of 3 to [`BULK_WORLD_MAX`] ranks
/// times every all-reduce candidate whenever it times any: the size from which the engine
/// streams copies past the cache (`STREAMING_OP_MIN`).
pub const BULK_BYTES: usize = 8 << 20;

/// The size past [`BULK_BYTES`] that the calibration also times where its budget allows (the
/// warm round guesses its cost from [`BULK_BYTES`]'s). The proportions still move there: 3
/// ranks of shared memory on 2 cores, 8 calls at a time (6 runs of each, out of place and in
/// place), the tree took as long as the double tree at 8 MiB (means of 3.39 ms both) and
/// 0.90 of its time at 32 MiB (13.1 against 14.5 ms); `gradsync bench --compare` measured
/// the tree at 0.83 of the double tree's time at 32 MiB and 128 MiB.
pub const BULK_LARGE: usize = 32 << 20;

/// The sizes at which the calibration times the candidates, a factor of 4 apart: the
/// proportions change with the size (4 ranks on 2 cores: Rabenseifner 1.1-1.6 times the
/// ring's time at 512 KiB to 1 MiB, 0.84-0.92 of it from 2 MiB on); between two of them the
/// proportions are interpolated ([`super::LinkCosts::bulk_ratio`]). The smallest is the
/// board's eager limit: above it and under 32 KiB the per-pair model alone chose the ring for
/// 16 KiB on 3 ranks, 1.52 times recursive doubling's time over shared memory and 2.02 times
/// the tree's over TCP.
pub const BULK_SIZES: [usize; 7] = [
    8 << 10,
    32 << 10,
    128 << 10,
    512 << 10,
    2 << 20,
    BULK_BYTES,
    BULK_LARGE,
];

/// All-reduces from this size on take measured proportions: the smallest of [`BULK_SIZES`].
/// Below it the eager path and the latency terms decide.
pub const BULK_FROM: usize = BULK_SIZES[0];

/// The largest size at which recursive doubling is timed: it sends the whole buffer at every
/// step, so from 2 MiB on it is never the fastest on one host.
pub const BULK_RD_MAX: usize = 512 << 10;

/// A candidate timed at one of [`BULK_SIZES`] within this part of the ring's time is level
/// with it there: the timing at init repeats to about that (two inits of one layout of 4
/// ranks, shared memory or TCP, timed a candidate 2-8% apart), so
/// [`super::LinkCosts::bulk_ratio`] counts such a candidate as the ring's equal rather than trust the
/// noise either way.
pub const BULK_NOISE: f64 = 0.05;

/// Largest world whose candidates the calibration times at [`BULK_SIZES`]: every candidate
/// runs 25 times at each size, which on more ranks than cores grows with the world.
pub const BULK_WORLD_MAX: usize = 8;

/// Every all-reduce candidate's time at one size, measured at init on one layout of ranks
/// (a single host; the median of the calibration's rounds, rank 0's clock).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Bulk {
    /// Ranks of the communicator it was measured on.
    pub world: usize,
    /// Ranks per host of that communicator.
    pub local_size: usize,
    /// Bytes per rank of the all-reduces timed.
    pub bytes: usize,
    /// Microseconds per call, by algorithm name.
    pub us: std::collections::BTreeMap<String, f64>,
    /// The part of the host's CPU time (of the CPUs rank 0 may use) that other processes
    /// took while the candidates were timed; unknown in files written before it was kept.
    /// Over [`BULK_BUSY_HOST`] the times are the load's as much as the algorithms', and a
    /// later init on a quiet host times them again (see [`super::LinkCosts::bulk_loaded`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub others: Option<f64>,
    /// The times of the last [`BULK_RUNS`] timings on a quiet host, oldest first, by
    /// algorithm; `us` is their median (see [`super::LinkCosts::merge_bulk`]).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub runs: std::collections::BTreeMap<String, Vec<f64>>,
}

impl Bulk {
    /// Whether it was timed while other processes took at most [`BULK_BUSY_HOST`] of the
    /// host's CPUs.
    pub fn quiet(&self) -> bool {
        self.others.is_some_and(|o| o <= BULK_BUSY_HOST)
    }

    /// How many quiet timings its times are the median of.
    pub fn quiet_runs(&self) -> usize {
        if !self.quiet() {
            return 0;
        }
        self.runs
            .get(Algorithm::Ring.name())
            .map_or(1, |v| v.len().max(1))
    }
}

/// The times that stand for `runs` (by algorithm, one time per timing, in the same order):
/// the ring's median, and for each other algorithm the median over the timings of its
/// proportion to the ring in the same timing, times that. A timing that ran slow as a whole
/// then moves no proportion; where an algorithm's runs do not line up with the ring's, its
/// own median.
fn bulk_medians(
    runs: &std::collections::BTreeMap<String, Vec<f64>>,
) -> std::collections::BTreeMap<String, f64> {
    let ring = runs.get(Algorithm::Ring.name());
    let ring_median = ring.map(|v| median(&mut v.clone()));
    runs.iter()
        .map(|(name, v)| {
            let t = match (ring, ring_median) {
                (Some(r), Some(m)) if r.len() == v.len() => {
                    let mut p: Vec<f64> = v.iter().zip(r).map(|(a, r)| a / r).collect();
                    median(&mut p) * m
                }
                _ => median(&mut v.clone()),
            };
            (name.clone(), t)
        })
        .collect()
}

/// Quiet timings of a layout whose median proportions the choice takes (within each timing):
/// init times a layout again, on a quiet host, until it has this many. One timing of 4 ranks
/// on a quiet host of 2 cores measured Rabenseifner at 1.18 and 1.51 times the ring at 128 and
/// 512 KiB where three others measured 0.85-0.94 and 0.76-0.92 (and the benchmark 0.84 and
/// 1.00); a median of three outvotes such a timing.
pub const BULK_RUNS: usize = 3;

/// Part of the host's CPU time that other processes may take while the candidates are timed
/// for the times to be kept as the host's own. A cache written while the test suite ran
/// beside the timing held, for 4 ranks, ring times 1.7-1.9 times those of a quiet host and
/// proportions that chose an algorithm 1.2-1.5 times slower than the best from 32 KiB to
/// 2 MiB; timed on the quiet host, the choice was within the benchmark's noise there.
pub const BULK_BUSY_HOST: f64 = 0.2;

/// The median of `v`, which it sorts; 0 when `v` is empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The entries of `bulk` timed on `world` ranks in hosts of `local_size`, smallest size first.
pub(super) fn of(bulk: &[Bulk], world: usize, local_size: usize) -> impl Iterator<Item = &Bulk> {
    bulk.iter()
        .filter(move |b| b.world == world && b.local_size == local_size)
}

/// Takes a new timing of the layout (`entries`, one per size timed). A quiet timing joins
/// the layout's earlier quiet ones: each entry keeps the last [`BULK_RUNS`] times of every
/// algorithm and their median. A busy one replaces the layout's entries only where they
/// are busy or unknown too, as does any timing of a layout that had none. Sizes not in
/// `entries` (the budget left them out) lose their older entries. Returns whether it took
/// the timing.
pub(super) fn merge(
    bulk: &mut Vec<Bulk>,
    world: usize,
    local_size: usize,
    entries: Vec<Bulk>,
) -> bool {
    let old: Vec<Bulk> = of(bulk, world, local_size).cloned().collect();
    let old_quiet = !old.is_empty() && old.iter().all(Bulk::quiet);
    if old_quiet && !entries.iter().all(Bulk::quiet) {
        return false;
    }
    bulk.retain(|b| (b.world, b.local_size) != (world, local_size));
    for mut e in entries {
        // Past the return above, quiet old times meet a quiet timing: it joins them.
        let before = old
            .iter()
            .find(|o| o.bytes == e.bytes)
            .filter(|_| old_quiet);
        let mut runs = std::collections::BTreeMap::new();
        for (name, &t) in &e.us {
            let mut v: Vec<f64> = before
                .map(|o| {
                    o.runs
                        .get(name)
                        .cloned()
                        .unwrap_or_else(|| o.us.get(name).map(|&x| vec![x]).unwrap_or_default())
                })
                .unwrap_or_default();
            v.push(t);
            let drop = v.len().saturating_sub(BULK_RUNS);
            v.drain(..drop);
            runs.insert(name.clone(), v);
        }
        e.us = bulk_medians(&runs);
        if let Some(o) = before.and_then(|o| o.others) {
            e.others = e.others.map(|n| n.max(o));
        }
        e.runs = runs;
        set(bulk, e);
    }
    true
}

/// The entry of the layout that stands for `bytes`: the one timed at the largest size at
/// or below it.
pub(super) fn at(bulk: &[Bulk], world: usize, local_size: usize, bytes: usize) -> Option<&Bulk> {
    of(bulk, world, local_size)
        .filter(|b| b.bytes <= bytes)
        .max_by_key(|b| b.bytes)
}

/// Puts `entry` in place of any earlier one of its layout and size.
pub(super) fn set(bulk: &mut Vec<Bulk>, entry: Bulk) {
    let key = |b: &Bulk| (b.world, b.local_size, b.bytes);
    bulk.retain(|b| key(b) != key(&entry));
    bulk.push(entry);
    bulk.sort_by_key(key);
}

/// The proportion of `algo`'s time to the ring's that the host measured for `bytes` bytes
/// (from [`BULK_FROM`] on; `None` below, or where nothing was timed for this layout or
/// algorithm). Between two timed sizes it is interpolated in the logarithm of the size,
/// from the entry at or below `bytes` ([`at`]) to the next one up;
/// beyond the largest timed size, or where the next entry did not time `algo` (recursive
/// doubling from 2 MiB on), the lower entry's proportion holds. A time within
/// [`BULK_NOISE`] of the ring's says nothing either way: it counts as level (1).
pub(super) fn ratio(
    bulk: &[Bulk],
    world: usize,
    local_size: usize,
    algo: Algorithm,
    bytes: usize,
) -> Option<f64> {
    let proportion = |b: &Bulk| {
        let (t_a, t_ring) = (b.us.get(algo.name())?, b.us.get(Algorithm::Ring.name())?);
        let r = t_a / t_ring;
        if !(r.is_finite() && r > 0.0) {
            return None;
        }
        Some(if (r - 1.0).abs() < BULK_NOISE { 1.0 } else { r })
    };
    // `lo.bytes <= bytes < hi.bytes`.
    let lo = at(bulk, world, local_size, bytes)?;
    let r_lo = proportion(lo)?;
    let hi = of(bulk, world, local_size)
        .filter(|b| b.bytes > bytes)
        .min_by_key(|b| b.bytes);
    let Some((hi, r_hi)) = hi.and_then(|h| Some((h, proportion(h)?))) else {
        return Some(r_lo);
    };
    let part = (bytes as f64 / lo.bytes as f64).ln() / (hi.bytes as f64 / lo.bytes as f64).ln();
    Some(r_lo + (r_hi - r_lo) * part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proportions_are_taken_within_each_timing() {
        let runs = |ring: [f64; 3], tree: [f64; 3]| {
            [
                ("ring".to_string(), ring.to_vec()),
                ("tree".to_string(), tree.to_vec()),
            ]
            .into_iter()
            .collect()
        };
        // A timing that ran slow as a whole (the ring at 200) moves no proportion: the tree's
        // proportions are 0.5, 0.5 and 0.9, their median 0.5 of the ring's median 100.
        let m = bulk_medians(&runs([100.0, 200.0, 100.0], [50.0, 100.0, 90.0]));
        assert_eq!((m["ring"], m["tree"]), (100.0, 50.0));
        // Runs that do not line up with the ring's: the algorithm's own median.
        let mut uneven = runs([100.0, 200.0, 100.0], [50.0, 100.0, 90.0]);
        uneven.get_mut("tree").unwrap().pop();
        assert_eq!(bulk_medians(&uneven)["tree"], 75.0);
        assert_eq!(median(&mut []), 0.0);
    }
}
