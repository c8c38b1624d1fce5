//! In-memory simulator: runs the programs of N ranks with seeded reordering and checks them.
//!
//! [`run`] plans every rank's [`Program`] from its [`Params`], gives each rank the buffers the
//! conventions of [`crate::schedule::plan`] define (filled with seeded garbage, then the input),
//! and executes all ranks together. At every step it picks, at random from a seeded xorshift
//! generator, one of:
//!
//! - a rank issuing the next op its [`Schedule::poll_action`] hands out. A `Send` copies its data
//!   into an in-flight message at once (FIFO per `(source, destination)` pair), a `Post` into one
//!   message to every other rank; a `Recv` is posted; local ops (`Copy`, `ReduceParts`,
//!   `Finalize`) wait;
//! - delivering the oldest message of a pair whose receiver has a posted `Recv` from that source
//!   (matched FIFO; messages that arrive before their receive wait in the queue): its data is
//!   copied or reduced into the destination;
//! - completing an issued op that is able to complete (a send or post whose data left, a
//!   delivered receive, a local op, which takes effect only now), which may release dependent
//!   ops. With rendezvous sends ([`SimOptions::rendezvous`]) a send completes only once its
//!   receive is posted, a post once the receives of every peer are.
//!
//! So sends complete at random times after they issue, messages overtake nothing within a pair
//! but anything across pairs, and local work lags at random. A correct program gives the same
//! result under every interleaving; the simulator reports every way a program can be wrong
//! instead of panicking:
//!
//! - **deadlock**: nothing can make progress while some rank is unfinished (the error names the
//!   ranks and their pending ops);
//! - **length mismatch** between a matched send (or post) and receive, and messages never
//!   received;
//! - **out of order**: a message issued out of the program order that matching relies on (the
//!   k-th message to a peer must be the k-th send or post for it, see [`crate::schedule`]);
//! - **out of bounds**: a range beyond its buffer — `Input` and `Output` sized by the
//!   conventions ([`Params::input_elems`], [`Params::output_elems`]), `Scratch` by
//!   [`Program::scratch_elems`];
//! - **races**: two ops in flight at once that touch the same element, one of them writing (every
//!   issued op claims what it reads and writes until it completes, so a dependency the program
//!   forgot shows up as soon as an interleaving runs the two ops concurrently);
//! - writes to `Input`, use of `Input` in an in-place program, overlapping operands of one op (a
//!   copy's source and destination, the parts and the result of a `ReduceParts`), and changes to
//!   `Output` outside the rank's [`Params::result_range`];
//! - an operator its element type does not have: a bitwise operator (`Band`, `Bor`, `Bxor`) in a
//!   reducing collective over a floating-point type ([`SimError::OpType`]).
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
//! [`Program`]: crate::schedule::Program
//! [`Program::scratch_elems`]: crate::schedule::Program::scratch_elems
//! [`Params`]: crate::schedule::Params
//! [`Params::input_elems`]: crate::schedule::Params::input_elems
//! [`Params::output_elems`]: crate::schedule::Params::output_elems
//! [`Params::result_range`]: crate::schedule::Params::result_range

//!
//! # Modules
//!
//! [`run`] and [`run_with`] live in `run`, the execution engine ([`run_programs`]) in `engine`,
//! the timing model ([`predict`] and its variants) in `timing`, the errors and options in
//! `types`; this module only re-exports them.

mod engine;
mod run;
mod timing;
mod types;

pub use engine::run_programs;
pub use run::{SimResult, run, run_with};
pub use timing::{
    LinkModel, Prediction, SYMMETRY_CHECK_ALL_OPS, Symmetry, Topology, predict, predict_on,
    predict_programs, predict_programs_on, predict_symmetric,
};
pub use types::{RankSetup, RawOutcome, SimError, SimOptions, SimStats};

#[cfg(test)]
mod tests;
