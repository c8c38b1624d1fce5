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

use std::path::{Path, PathBuf};
use std::time::Duration;

use gradsync_core::schedule::plan::{Algorithm, Params};
use gradsync_core::sim::{LinkModel, Topology, predict_on};
use gradsync_core::{Collective, DataType, ReduceOp};
use serde::{Deserialize, Serialize};

/// One link's alpha-beta model.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CostModel {
    /// Transport it describes (`shm`, `tcp`, `rdma`).
    pub transport: String,
    /// One-way latency per message, microseconds.
    pub alpha_us: f64,
    /// Bandwidth, GB/s (10^9 bytes per second).
    pub gbytes_per_s: f64,
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
    pub fn uncalibrated(transport: &str) -> CostModel {
        let (alpha_us, gbytes_per_s) = match transport {
            "shm" | "self" | "mem" => (1.0, 3.0),
            _ => (8.0, 4.2),
        };
        CostModel {
            transport: transport.to_string(),
            alpha_us,
            gbytes_per_s,
        }
    }
}

/// The two links of a communicator's model, and where the model came from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LinkCosts {
    /// Links between ranks on one host.
    pub intra: CostModel,
    /// Links between ranks on different hosts (the same as `intra` on a single host).
    pub inter: CostModel,
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
        }
    }

    /// Uncalibrated figures for the transports inside and across hosts.
    pub fn uncalibrated(intra: &str, inter: &str) -> LinkCosts {
        LinkCosts {
            intra: CostModel::uncalibrated(intra),
            inter: CostModel::uncalibrated(inter),
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
        Ok(links)
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

/// One size class's predictions: every candidate with its predicted seconds (or why it has
/// none), and the candidate with the least.
#[derive(Clone, Debug)]
pub struct Choice {
    /// `(algorithm, predicted seconds)` in the order of [`all_reduce_candidates`].
    pub predicted: Vec<(Algorithm, Result<f64, String>)>,
    /// The fastest predicted candidate.
    pub best: Algorithm,
}

/// The model's all-reduce algorithm for size class `class` on `world` ranks in hosts of
/// `local_size`, with pipeline segments of `segment_f32` f32 elements.
pub fn choose_all_reduce(
    world: usize,
    local_size: usize,
    segment_f32: usize,
    class: u32,
    links: &LinkCosts,
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
            );
            (a, t)
        })
        .collect();
    let best = predicted
        .iter()
        .filter_map(|(a, t)| t.as_ref().ok().map(|t| (*a, *t)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
        .map_or(Algorithm::Ring, |(a, _)| a);
    Choice { predicted, best }
}

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
/// hosts. `None` is the eager path: `world - 1` messages of the whole buffer from every rank,
/// back to back.
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
    let topo = if local_size > 1 && local_size < world {
        Topology::two_level(local_size, *intra, *inter)
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
        let t = |a| predict_all_reduce(2, 0, 1 << 20, DataType::F32, 32768, a, &l, &l).unwrap();
        // On 2 ranks: one message for eager and recursive doubling, two halves for the ring.
        assert!((t(None) * 1e6 - 34.768).abs() < 0.01);
        assert!((t(Some(Algorithm::RecursiveDoubling)) * 1e6 - 34.768).abs() < 0.01);
        assert!((t(Some(Algorithm::Ring)) * 1e6 - 36.768).abs() < 0.01);
    }
}
