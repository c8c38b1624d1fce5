//! The alpha-beta cost model of the algorithm choice, and the predictions it makes.
//!
//! A [`CostModel`] is one link: a per-message latency and a bandwidth. `gradsync bench
//! --explain` measures it between ranks 0 and 1, or reads it from `GRADSYNC_COST_FILE`. With
//! `GRADSYNC_DEBUG=INFO` and the `COLL` subsystem, a communicator logs, the first time it plans
//! an all-reduce of each power-of-two size class, the time the model predicts for every
//! algorithm, the model's best, and the algorithm it runs. The predictions come from the
//! simulator replaying the schedules' own messages ([`gradsync_core::sim::predict_on`]).

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

/// The all-reduce algorithms the model compares on `world` ranks in hosts of `local_size`
/// (0: one host).
pub fn all_reduce_candidates(world: usize, local_size: usize) -> Vec<Algorithm> {
    let mut v = vec![
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Tree,
    ];
    if local_size > 1 && local_size < world {
        v.push(Algorithm::Hierarchical);
    }
    v
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
    let params: Vec<Params> = (0..world)
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
        .collect();
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
