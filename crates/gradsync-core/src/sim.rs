//! In-memory simulator: runs the programs of N ranks with seeded reordering and checks them.
//!
//! [`run`] plans every rank's [`Program`] from its [`Params`], gives each rank the buffers the
//! conventions of [`crate::schedule::plan`] define (filled with seeded garbage, then the input),
//! and executes all ranks together. At every step it picks, at random from a seeded xorshift
//! generator, one of:
//!
//! - a rank issuing the next op its [`Schedule::poll_action`] hands out. A `Send` copies its data
//!   into an in-flight message at once (FIFO per `(source, destination)` pair); a `Recv` is
//!   posted; local ops (`Copy`, `Finalize`) wait;
//! - delivering the oldest message of a pair whose receiver has a posted `Recv` from that source
//!   (matched FIFO; messages that arrive before their receive wait in the queue): its data is
//!   copied or reduced into the destination;
//! - completing an issued op that is able to complete (a send whose data left, a delivered
//!   receive, a local op, which takes effect only now), which may release dependent ops.
//!
//! So sends complete at random times after they issue, messages overtake nothing within a pair
//! but anything across pairs, and local work lags at random. A correct program gives the same
//! result under every interleaving; the simulator reports every way a program can be wrong
//! instead of panicking:
//!
//! - **deadlock**: nothing can make progress while some rank is unfinished (the error names the
//!   ranks and their pending ops);
//! - **length mismatch** between a matched send and receive, and messages never received;
//! - **out of bounds**: a range beyond its buffer — `Input` and `Output` sized by the
//!   conventions ([`Params::input_elems`], [`Params::output_elems`]), `Scratch` by
//!   [`Program::scratch_elems`];
//! - **races**: two ops in flight at once that touch the same element, one of them writing (every
//!   issued op claims what it reads and writes until it completes, so a dependency the program
//!   forgot shows up as soon as an interleaving runs the two ops concurrently);
//! - writes to `Input`, use of `Input` in an in-place program, overlapping operands of one op, and
//!   changes to `Output` outside the rank's [`Params::result_range`].
//!
//! It also tracks causality: [`SimResult::heard_from`] says which ranks' start happens before a
//! rank's last op through the programs' dependencies and messages. A barrier must have heard
//! from everyone on every rank.
//!
//! The reductions use [`crate::reference`]; result checking is [`crate::reference::check`]'s job.
//!
//! # Time
//!
//! Independently of the random interleaving, [`SimResult::predict`] (or [`predict`], without
//! running anything) predicts the collective's duration under an alpha-beta [`LinkModel`]; see
//! [`predict`] for the model, and [`predict_on`] for its two-level variant ([`Topology`]: one link
//! model inside a host, another across hosts). The cost of a prediction grows with the ops of all
//! ranks together; [`predict_symmetric`] replays rank 0 alone when every rank runs the same program
//! up to a relabeling of the ranks ([`Symmetry`]: rings, recursive doubling), which is what makes
//! thousands of ranks affordable.
//!
//! [`Schedule::poll_action`]: crate::schedule::Schedule::poll_action

use crate::DataType;
use crate::ReduceOp;
use crate::rng::XorShift64;
use crate::schedule::plan::{self, Params, PlanError};
use crate::schedule::{Buf, OpId, Program};

mod engine;
mod timing;

pub use engine::run_programs;
pub use timing::{
    LinkModel, Prediction, SYMMETRY_CHECK_ALL_OPS, Symmetry, Topology, predict, predict_on,
    predict_programs, predict_programs_on, predict_symmetric,
};

/// Errors the simulator reports.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The parameters of a rank are inconsistent with its position or the world.
    #[error("rank {rank}: {detail}")]
    Params {
        /// Index of the parameters.
        rank: usize,
        /// What is wrong.
        detail: String,
    },
    /// Planning a rank's program failed.
    #[error("rank {rank}: {source}")]
    Plan {
        /// The rank.
        rank: usize,
        /// Why.
        #[source]
        source: PlanError,
    },
    /// An input does not have the size the conventions require.
    #[error("rank {rank}: {what} has {got} bytes, expected {want}")]
    BufferSize {
        /// The rank.
        rank: usize,
        /// Which buffer.
        what: &'static str,
        /// Bytes given.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// An op names a peer outside the world.
    #[error("rank {rank} op {op} names peer {peer} outside the world of {world}")]
    BadPeer {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
        /// The peer named.
        peer: usize,
        /// The world size.
        world: usize,
    },
    /// No progress is possible while some ranks are unfinished.
    #[error("deadlock: ranks {ranks:?} cannot finish; {detail}")]
    Deadlock {
        /// The unfinished ranks.
        ranks: Vec<usize>,
        /// Their pending ops and stranded messages.
        detail: String,
    },
    /// A send and the receive it matched disagree on the length.
    #[error(
        "length mismatch: rank {src} op {send_op} sends {send_len} elements, \
         rank {dst} op {recv_op} receives {recv_len}"
    )]
    LengthMismatch {
        /// Sending rank.
        src: usize,
        /// The send.
        send_op: OpId,
        /// Elements sent.
        send_len: usize,
        /// Receiving rank.
        dst: usize,
        /// The receive.
        recv_op: OpId,
        /// Elements expected.
        recv_len: usize,
    },
    /// An op reaches past the end of a buffer.
    #[error("rank {rank} op {op} uses {buf:?} {start}..{start}+{len}, beyond its {size} elements")]
    OutOfBounds {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
        /// The buffer.
        buf: Buf,
        /// First element.
        start: usize,
        /// Elements.
        len: usize,
        /// Size of the buffer in elements.
        size: usize,
    },
    /// An op writes `Input`, which is read-only.
    #[error("rank {rank} op {op} writes Input")]
    WritesInput {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
    },
    /// An in-place program names `Input` (in place, only `Output` exists).
    #[error("rank {rank} op {op} uses Input in an in-place program")]
    InputInPlace {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
    },
    /// One op's source and destination overlap without being the same range.
    #[error("rank {rank} op {op} has overlapping operands")]
    Overlap {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
    },
    /// Two ops in flight at once touch the same element and at least one writes it.
    #[error("rank {rank}: race on {buf:?} element {index} between op {op} and op {other}")]
    Race {
        /// The rank.
        rank: usize,
        /// The op being issued.
        op: OpId,
        /// An op in flight that conflicts with it.
        other: OpId,
        /// The buffer.
        buf: Buf,
        /// The element.
        index: usize,
    },
    /// Messages were sent that no receive consumed.
    #[error("{count} message(s) from rank {src} to rank {dst} were never received")]
    Unreceived {
        /// Sending rank.
        src: usize,
        /// Destination rank.
        dst: usize,
        /// Messages left.
        count: usize,
    },
    /// A rank changed `Output` outside its result range.
    #[error("rank {rank} changed Output element {index}, outside its result")]
    Clobbered {
        /// The rank.
        rank: usize,
        /// The element.
        index: usize,
    },
}

/// How to run a simulation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimOptions {
    /// Seed of the interleaving and of the garbage that fills buffers.
    pub seed: u64,
    /// If set, a send completes only after the peer has posted the matching receive (as when the
    /// transport writes straight into the receiver's buffer); otherwise sends are buffered and
    /// may complete before.
    pub rendezvous: bool,
}

impl SimOptions {
    /// Buffered sends and `seed`.
    pub fn new(seed: u64) -> Self {
        SimOptions {
            seed,
            rendezvous: false,
        }
    }
}

/// One rank of a raw simulation ([`run_programs`]).
#[derive(Clone, Debug)]
pub struct RankSetup {
    /// The rank's program.
    pub program: Program,
    /// Initial contents of `Input` (ignored and must be empty in place).
    pub input: Vec<u8>,
    /// Initial contents of `Output`.
    pub output: Vec<u8>,
    /// Whether the program runs in place (`Input` then is `Output`).
    pub in_place: bool,
    /// Reduction operator of reducing receives.
    pub op: ReduceOp,
}

/// Counters of one simulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Scheduler steps taken.
    pub steps: u64,
    /// Messages sent.
    pub messages: u64,
    /// Payload bytes sent.
    pub bytes: u64,
    /// Most ops in flight at once on any rank.
    pub max_in_flight: usize,
}

/// Outcome of [`run_programs`].
#[derive(Clone, Debug)]
pub struct RawOutcome {
    /// Final contents of every rank's `Output`.
    pub outputs: Vec<Vec<u8>>,
    /// `heard_from[r][q]`: rank q's start happens before rank r's end.
    pub heard_from: Vec<Vec<bool>>,
    /// Counters.
    pub stats: SimStats,
}

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
    /// Predicted duration of the collective that ran, under `link` (see [`predict`]).
    pub fn predict(&self, link: &LinkModel) -> Prediction {
        self.predict_on(&Topology::flat(*link))
    }

    /// Predicted duration of the collective that ran, on a two-level network (see
    /// [`predict_on`]).
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
    let mut garbage = XorShift64::new(opts.seed ^ 0x5eed_6a7b_a6e0);
    let mut setups = Vec::with_capacity(world);
    let mut initial = Vec::with_capacity(world);
    for (r, (p, input)) in params_per_rank.iter().zip(inputs).enumerate() {
        if p.rank != r || p.world != world {
            let detail = format!("parameters say rank {} of {}", p.rank, p.world);
            return Err(SimError::Params { rank: r, detail });
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
        let mut output: Vec<u8> = (0..p.output_elems() * size)
            .map(|_| garbage.next_u64() as u8)
            .collect();
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
        let changed = (0..out.len()).find(|&i| (i < lo || i >= hi) && out[i] != init[i]);
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

#[cfg(test)]
mod tests;
