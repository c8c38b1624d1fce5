//! Planning: from the parameters of one collective call to the [`Program`] of one rank.
//!
//! This module only dispatches to the generators; the parameters, algorithms and their
//! conventions are in [`super::params`], re-exported here (`plan::Params`, `plan::Algorithm`,
//! ...) for the callers that use them together with [`build`].
//!
//! [`build`] turns a [`Params`] into the program of a single rank. Every rank builds its own
//! program from the same parameters (only `rank` differs), and the programs of all ranks fit
//! together: the k-th message from rank a to rank b (its k-th `Send` to b or `Post`, in program
//! order) has the same length as the k-th `Recv` of rank b from rank a.
//!
//! # Algorithms
//!
//! | collective       | `Ring`                      | `RecursiveDoubling` | `Tree`             |
//! |------------------|-----------------------------|---------------------|--------------------|
//! | `all_reduce`     | reduce-scatter + all-gather | log2 n exchanges    | reduce + broadcast |
//! | `reduce_scatter` | ring                        | -                   | -                  |
//! | `all_gather`     | ring                        | -                   | -                  |
//! | `broadcast`      | pipelined chain             | -                   | pipelined binomial |
//! | `reduce`         | pipelined chain             | -                   | pipelined binomial |
//! | `barrier`        | dissemination               | dissemination       | dissemination      |
//!
//! | collective       | `Hierarchical`                              | `Central`              |
//! |------------------|---------------------------------------------|------------------------|
//! | `all_reduce`     | intra RS + inter-host all-reduce + intra AG | reduce at 0, send back |
//! | `reduce_scatter` | intra-host RS + inter-host RS               | -                      |
//! | `all_gather`     | inter-host AG + intra-host AG               | -                      |
//! | `broadcast`      | -                                           | -                      |
//! | `reduce`         | -                                           | -                      |
//! | `barrier`        | dissemination                               | dissemination          |
//!
//! `Pairwise` and `Bruck` (all-to-all only): see [`super::alltoall`]; `all_to_allv`, whose
//! counts differ per pair, is planned by [`super::alltoall::all_to_allv`] directly. `Central`
//! is also the gather and the scatter: the root exchanges a block with each rank (see
//! [`super::rooted`]).
//!
//! `Rabenseifner` (all-reduce only): a reduce-scatter by recursive halving, then an all-gather
//! by recursive doubling. `DoubleTree` (all-reduce only): each half of the buffer reduced up and
//! broadcast down its own binary tree, every rank interior in at most one of the two.
//!
//! The internal algorithms ([`Algorithm::is_internal`]) plan all-reduces only, for the engine's
//! own paths: `Eager` (every rank's buffer to every peer in one message or one board posting,
//! then a reduction in rank order, see [`super::eager`]) and `Deterministic` (pieces all-gathered
//! and reduced in rank order, see [`super::deterministic`]).
//!
//! (RS: ring reduce-scatter, AG: ring all-gather, each over the ranks of one host or over the
//! ranks of equal local rank on all hosts; hosts hold [`Params::local_size`] ranks each.)
//!
//! Under the alpha-beta model (a message of b bytes costs `alpha + b * beta`, see
//! [`crate::sim::LinkModel`]) an all-reduce of `B` bytes over `n` ranks costs about
//!
//! - ring: `2 (n - 1) alpha + 2 (n - 1) / n * B * beta` — bandwidth-optimal, latency linear in n
//!   (see [`super::ring`]);
//! - recursive doubling: `log2(n) alpha + log2(n) * B * beta` — latency-optimal, but it moves the
//!   whole buffer at every step (see [`super::doubling`]);
//! - Rabenseifner (recursive halving, then doubling): `2 log2(n) alpha + 2 (n - 1) / n * B * beta`
//!   on a power of two, the ring's bandwidth term in `2 log2 n` steps; other worlds fold into the
//!   largest power of two `p < n` for two more messages of the whole buffer,
//!   `(2 log2(p) + 2) alpha + (2 (p - 1) / p + 2) * B * beta` (see [`super::halving`]);
//! - tree: `2 log2(n) alpha + 2 log2(n) * B * beta` unpipelined; with segments the bandwidth term
//!   approaches `2 * (fan-out) * B * beta` (see [`super::tree`]);
//! - double binary tree: `2 log2(n)` latencies like the tree, but each tree carries half the
//!   buffer and a rank is interior in at most one: pipelined, a rank sends at most `2 B` (`3/2 B`
//!   as an interior rank of one tree, `1/2 B` as a leaf of the other), close to the ring's
//!   `2 (n - 1) / n * B` (see [`super::tree`]);
//! - hierarchical, over `H` hosts of `L` ranks (`n = H L`), with `alpha_l`, `beta_l` inside a host
//!   and `alpha_h`, `beta_h` across hosts: `2 (L - 1) alpha_l + 2 (L - 1) / L * B * beta_l` for the
//!   reduce-scatter and all-gather inside the hosts, plus
//!   `2 (H - 1) alpha_h + 2 (H - 1) / H * (B / L) * beta_h` for the rings across hosts, which carry
//!   only a `1 / L` share of the buffer each (see [`super::hier`]). The flat ring instead pushes
//!   `2 (n - 1) / n * B` bytes over the links that cross hosts, so the hierarchical schedule wins
//!   when those are slow;
//! - central (a parameter server at rank 0): about `2 (n - 1) * B * beta` at the root, whose link
//!   carries `n - 1` buffers in and `n - 1` out, so its algorithm bandwidth falls like
//!   `1 / (n - 1)`. It exists as the baseline the ring is measured against (see [`super::tree`]).
//!   The simulator's timing model limits only outgoing traffic and so predicts about
//!   `(n - 1) * B * beta`, still linear in n;
//! - eager: `(n - 1) (alpha + B * beta)` when a rank's messages leave one after the other: one
//!   latency on the critical path of each peer, but `n - 1` buffers out of every rank;
//! - deterministic: an all-gather of the whole buffer, `(n - 1) alpha` per piece and
//!   `(n - 1) * B * beta`, `n / 2` times the ring's bandwidth term: the price of bits that do not
//!   depend on the algorithm or the chunking.
//!
//! [`default_algorithm`] encodes the simplest form of this trade-off; a calibrated cost model can
//! replace it later. Buffer sizes, scratch and segments follow the conventions of
//! [`super::params`].
//!
//! [`Program`]: super::program::Program

use super::program::Program;
use super::{alltoall, deterministic, doubling, eager, halving, hier, ring, rooted, tree};
use crate::Collective;

pub use super::common::block_range;
pub use super::params::{
    Algorithm, Params, PlanError, SMALL_ALL_REDUCE_BYTES, bus_bandwidth_factor, default_algorithm,
    host_shape,
};

/// Builds the program of rank `p.rank` for the collective call described by `p`.
pub fn build(p: &Params) -> Result<Program, PlanError> {
    use Algorithm::*;
    use Collective::*;
    p.validate()?;
    Ok(match (p.coll, p.algorithm) {
        (AllReduce, Ring) => ring::all_reduce(p),
        (AllReduce, RecursiveDoubling) => doubling::all_reduce(p),
        (AllReduce, Rabenseifner) => halving::all_reduce(p),
        (AllReduce, Tree) => tree::all_reduce(p, tree::Shape::Binomial),
        (AllReduce, DoubleTree) => tree::double_tree_all_reduce(p),
        (ReduceScatter, Ring) => ring::reduce_scatter(p),
        (AllGather, Ring) => ring::all_gather(p),
        (AllReduce, Hierarchical) => hier::all_reduce(p),
        (ReduceScatter, Hierarchical) => hier::reduce_scatter(p),
        (AllGather, Hierarchical) => hier::all_gather(p),
        (AllReduce, Central) => tree::all_reduce(p, tree::Shape::Star),
        (AllReduce, Eager) => eager::all_reduce(p),
        (AllReduce, Deterministic) => deterministic::all_reduce(p),
        (Broadcast, Tree) => tree::broadcast(p, tree::Shape::Binomial),
        (Broadcast, Ring) => tree::broadcast(p, tree::Shape::Chain),
        (Reduce, Tree) => tree::reduce(p, tree::Shape::Binomial),
        (Reduce, Ring) => tree::reduce(p, tree::Shape::Chain),
        (AllToAll, Pairwise | Bruck) => alltoall::all_to_all(p),
        (Gather, Central) => rooted::gather(p),
        (Scatter, Central) => rooted::scatter(p),
        (Barrier, a) if !a.is_internal() => doubling::barrier(p),
        (coll, algorithm) => return Err(PlanError::Unsupported { coll, algorithm }),
    })
}

/// Whether [`build`] has a schedule for `coll` with `algorithm`. The internal algorithms
/// ([`Algorithm::is_internal`]) plan all-reduces only.
pub fn supports(coll: Collective, algorithm: Algorithm) -> bool {
    use Algorithm::*;
    use Collective::*;
    match coll {
        AllReduce => !matches!(algorithm, Pairwise | Bruck),
        Barrier => !algorithm.is_internal(),
        ReduceScatter | AllGather => matches!(algorithm, Ring | Hierarchical),
        Broadcast | Reduce => matches!(algorithm, Ring | Tree),
        AllToAll => matches!(algorithm, Pairwise | Bruck),
        Gather | Scatter => algorithm == Central,
        AllToAllV | SendRecv => false,
    }
}
