//! Collective schedules as pure state machines.
//!
//! A schedule is generated once per call from `(rank, world, count, segment, ...)` into a
//! [`Program`]: a list of [`Op`]s (sends, posts, receives, local copies and reductions) with
//! explicit dependencies. A [`Schedule`] then runs the program without doing any I/O itself:
//!
//! - [`Schedule::poll_action`] hands out the next operation that may start now;
//! - the caller (the engine, or the simulator) performs it and reports back with
//!   [`Schedule::handle_complete`].
//!
//! # Rules every program follows
//!
//! - **Matching is FIFO per ordered pair of ranks.** The messages from rank a to rank b are a's
//!   `Send { peer: b }` ops and a's `Post` ops (a post is one message to every other rank),
//!   counted together in a's program order; b's k-th `Recv { peer: a }` receives the k-th of
//!   them, and both sides agree on the length. `poll_action` therefore issues a rank's messages
//!   to each peer in program order: the sends to one peer in order, a post only after every
//!   earlier send and post and before any later one (it joins the send queue of every peer), and
//!   the receives from one peer in order.
//! - **Dependencies are explicit.** An op starts only after every op it lists has completed. A
//!   `Send` or `Post` completes when its bytes have left the local buffer (the buffer may be
//!   overwritten; for a post, towards every peer), a `Recv` when its bytes have been copied or
//!   reduced into the destination, a local op (`Copy`, `ReduceParts`, `Finalize`) when its result
//!   is written.
//! - **Reductions have a fixed order.** A reducing `Recv` computes `local op incoming`; a
//!   `ReduceParts` folds one part per rank strictly in rank order. No reduction depends on
//!   timing, so every rank that combines the same operands gets the same bits.
//! - Locations are in elements, not bytes. [`Buf::Scratch`] is a buffer of
//!   [`Program::scratch_elems`] elements that the executor provides. The operands of one op
//!   (source and destination, the parts and the result of a `ReduceParts`) never overlap
//!   partially; only a reducing receive may use its destination as its local operand.
//!
//! Pipelining follows from the dependencies: a ring step on segment j may run while segment j+1
//! of the previous step is still in flight.
//!
//! # Modules
//!
//! - [`program`]: the program model ([`Op`], [`Loc`], [`Buf`], [`Program`]);
//! - [`machine`]: [`Schedule`], which runs a program;
//! - [`params`]: the parameters of a call ([`Params`]), the algorithms and the buffer
//!   conventions;
//! - [`plan`]: [`build`], the dispatch from parameters to the generators;
//! - the generators: [`ring`], [`doubling`], [`halving`], [`tree`], [`hier`], [`eager`],
//!   [`deterministic`], [`alltoall`], [`rooted`], which share the helpers of `common`.

pub mod alltoall;
mod common;
pub mod deterministic;
pub mod doubling;
pub mod eager;
pub mod halving;
pub mod hier;
pub mod machine;
pub mod params;
pub mod plan;
pub mod program;
pub mod ring;
pub mod rooted;
pub mod tree;

pub use machine::Schedule;
pub use params::{Algorithm, Params, PlanError, default_algorithm};
pub use plan::build;
pub use program::{Buf, Loc, Op, OpId, Program};

#[cfg(test)]
mod tests;
