//! Running one collective call on simulated ranks: [`run`] and [`run_with`] plan every rank's
//! program, lay out its buffers as the conventions say, run them and keep each rank's result.

use super::engine::{garbage, run_programs};
use super::timing::{LinkModel, Prediction, Topology, predict_programs_on};
use super::types::{RankSetup, SimError, SimOptions, SimStats};
use crate::rng::XorShift64;
use crate::schedule::Program;
use crate::schedule::plan::{self, Params};
use crate::{Collective, DataType};

/// Outcome of [`run`].
#[derive(Clone, Debug)]
pub struct SimResult {
    /// Each rank's result: its `Output` restricted to [`Params::result_range`].
    pub outputs: Vec<Vec<u8>>,
    /// `heard_from[r][q]`: rank q's start happens before rank r's end, through dependencies and
    /// messages.
    pub heard_from: Vec<Vec<bool>>,
    /// Counters.
    pub stats: SimStats,
    /// The programs that ran, by rank.
    pub programs: Vec<Program>,
    /// The element type.
    pub dtype: DataType,
}

impl SimResult {
    /// Predicted duration of the collective that ran, under `link` (see
    /// [`predict`](super::predict)).
    pub fn predict(&self, link: &LinkModel) -> Prediction {
        self.predict_on(&Topology::flat(*link))
    }

    /// Predicted duration of the collective that ran, on a two-level network (see
    /// [`predict_on`](super::predict_on)).
    pub fn predict_on(&self, topo: &Topology) -> Prediction {
        predict_programs_on(&self.programs, self.dtype.size(), topo)
            .expect("programs that ran to completion also complete in the timing model")
    }
}

/// Runs one collective call on `params_per_rank.len()` simulated ranks with buffered sends; see
/// [`run_with`].
pub fn run(
    params_per_rank: Vec<Params>,
    dtype: DataType,
    inputs: Vec<Vec<u8>>,
    seed: u64,
) -> Result<SimResult, SimError> {
    run_with(params_per_rank, dtype, inputs, &SimOptions::new(seed))
}

/// Runs one collective call: `params_per_rank[r]` are rank r's parameters (`rank == r`,
/// `world == params_per_rank.len()`), `inputs[r]` its logical input of
/// [`Params::input_elems`] elements (in place, it is placed at [`Params::input_offset`] of the
/// shared buffer). Buffers start out as seeded garbage.
pub fn run_with(
    params_per_rank: Vec<Params>,
    dtype: DataType,
    inputs: Vec<Vec<u8>>,
    opts: &SimOptions,
) -> Result<SimResult, SimError> {
    let world = params_per_rank.len();
    let size = dtype.size();
    if inputs.len() != world {
        let detail = format!("{} inputs for a world of {world}", inputs.len());
        return Err(SimError::Params {
            rank: inputs.len().min(world),
            detail,
        });
    }
    let mut rng = XorShift64::new(opts.seed ^ 0x5eed_6a7b_a6e0);
    let mut setups = Vec::with_capacity(world);
    let mut initial = Vec::with_capacity(world);
    for (r, (p, input)) in params_per_rank.iter().zip(inputs).enumerate() {
        if p.rank != r || p.world != world {
            let detail = format!("parameters say rank {} of {}", p.rank, p.world);
            return Err(SimError::Params { rank: r, detail });
        }
        if matches!(
            p.coll,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        ) {
            p.op.check(dtype)
                .map_err(|source| SimError::OpType { rank: r, source })?;
        }
        let program = plan::build(p).map_err(|source| SimError::Plan { rank: r, source })?;
        let want = p.input_elems() * size;
        if input.len() != want {
            let got = input.len();
            return Err(SimError::BufferSize {
                rank: r,
                what: "input",
                got,
                want,
            });
        }
        let mut output = garbage(&mut rng, p.output_elems() * size);
        let input = if p.in_place {
            output[p.input_offset() * size..][..input.len()].copy_from_slice(&input);
            Vec::new()
        } else {
            input
        };
        initial.push(output.clone());
        setups.push(RankSetup {
            program,
            input,
            output,
            in_place: p.in_place,
            op: p.op,
        });
    }
    let programs: Vec<Program> = setups.iter().map(|s| s.program.clone()).collect();
    let raw = run_programs(setups, dtype, opts)?;
    let mut outputs = Vec::with_capacity(world);
    for (r, (p, (out, init))) in params_per_rank
        .iter()
        .zip(raw.outputs.iter().zip(&initial))
        .enumerate()
    {
        let res = p.result_range();
        let (lo, hi) = (res.start * size, res.end * size);
        let changed = (0..lo).chain(hi..out.len()).find(|&i| out[i] != init[i]);
        if let Some(i) = changed {
            return Err(SimError::Clobbered {
                rank: r,
                index: i / size,
            });
        }
        outputs.push(out[lo..hi].to_vec());
    }
    Ok(SimResult {
        outputs,
        heard_from: raw.heard_from,
        stats: raw.stats,
        programs,
        dtype,
    })
}
