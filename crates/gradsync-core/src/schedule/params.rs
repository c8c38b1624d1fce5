//! The parameters of one collective call ([`Params`]), the algorithms ([`Algorithm`]) and the
//! errors of planning ([`PlanError`]), with the conventions every program follows for them.
//!
//! # Buffers
//!
//! Counts are per rank, in elements, as in NCCL. The buffers a program refers to:
//!
//! | collective       | `Input`         | `Output`        | result in `Output`                    |
//! |------------------|-----------------|-----------------|---------------------------------------|
//! | `all_reduce`     | `count`         | `count`         | all of it                             |
//! | `reduce_scatter` | `count * world` | `count`         | all of it: slice `rank` of the sum    |
//! | `all_gather`     | `count`         | `count * world` | all; rank r's input at `r * count`    |
//! | `broadcast`      | `count` (root)  | `count`         | all of it                             |
//! | `reduce`         | `count`         | `count`         | root: all; others: never written      |
//! | `barrier`        | 0               | 0               | nothing                               |
//!
//! (sizes out of place, in elements).
//!
//! **In place** (`in_place = true`), `Input` and `Output` are the same memory and programs refer
//! only to [`Buf::Output`]. That one buffer has [`Params::output_elems`] elements: `count`, except
//! for `reduce_scatter` and `all_gather` where it is `count * world` (NCCL's convention):
//! `reduce_scatter` reads the whole buffer and leaves its result in slice `rank`
//! (`rank * count ..`), the other slices keep their contents; `all_gather` finds this rank's input
//! already in slice `rank`. [`Params::result_range`] and [`Params::input_offset`] say where.
//!
//! Scratch space ([`Buf::Scratch`], [`Program::scratch_elems`]) is used by the ring
//! reduce-scatter (two slices of `count` for partial sums), by interior ranks of a tree reduce, by
//! recursive doubling (one buffer of `count` to alternate with `Output`), by the hierarchical
//! reduce-scatter (partial sums of the intra-host phase and the host's reduced slices, at most
//! `3 * count * world / local_size` elements), by the eager all-reduce (every rank's part,
//! `world * count`) and by the deterministic all-reduce (two halves of `world` pieces of at most
//! `segment` elements, `2 * world * min(count, segment)`).
//!
//! # Segments
//!
//! No op of a program is longer than [`Params::segment`] elements: messages are split, and every
//! dependency is per segment, so step k of segment j can run while step k - 1 of segment j + 1 is
//! still in flight. Both sides split a block the same way (`segment`-sized pieces and a shorter
//! last one), so matched sends and receives always agree on length. Some programs cut smaller
//! pieces where that pipelines better (the double tree's, and the tree all-reduce's across
//! hosts), the same way on every rank.
//!
//! The one exception is [`Algorithm::Eager`]: its messages carry a rank's whole buffer whatever
//! `segment` says (one message per pair of ranks is the point of it; the engine uses it only for
//! buffers small enough to go in one message).
//!
//! [`Buf::Scratch`]: super::program::Buf::Scratch
//! [`Buf::Output`]: super::program::Buf::Output
//! [`Program::scratch_elems`]: super::program::Program::scratch_elems

use std::fmt;
use std::ops::Range;

use crate::{Collective, ReduceOp};

/// Algorithm of a collective schedule. See the [planning docs](super::plan) for which collective
/// supports which.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring: bandwidth-optimal, `2 (n - 1)` latency terms for an all-reduce. For broadcast and
    /// reduce, a pipelined chain.
    Ring,
    /// Recursive doubling: `log2 n` pairwise exchanges of the whole buffer (all-reduce only).
    RecursiveDoubling,
    /// Binomial tree, pipelined by segment. For all-reduce, a binomial reduce to rank 0 followed by
    /// a binomial broadcast.
    Tree,
    /// Two-level rings for hosts of [`Params::local_size`] ranks: all-reduce, reduce-scatter and
    /// all-gather run rings inside each host and rings across hosts among the ranks of equal local
    /// rank, so the links between hosts carry only a `1 / local_size` share of the buffer per rank.
    /// Planning fails with [`PlanError::NonUniformHosts`] when `local_size` does not divide the
    /// world.
    Hierarchical,
    /// Recursive halving-doubling (Rabenseifner, all-reduce only): a reduce-scatter by recursive
    /// halving, then an all-gather by recursive doubling, one message per step when a step fits
    /// a segment; `2 log2 n` latencies and the ring's bandwidth term on a power of two (two more
    /// of each, for the fold, on other worlds), for medium buffers.
    Rabenseifner,
    /// Double binary tree (all-reduce only): each half of the buffer is reduced up and broadcast
    /// down its own binary tree, pipelined by segment; every rank is interior in at most one of
    /// the two trees. `2 log2 n` latencies and close to the ring's bandwidth for large buffers.
    DoubleTree,
    /// Central aggregator (a parameter server at rank 0, all-reduce only): every other rank sends
    /// its buffer to rank 0, which reduces in rank order and sends the result back. Rank 0's link
    /// carries `n - 1` buffers each way; this is the baseline that the ring is compared against.
    Central,
    /// Eager all-reduce (internal: chosen by the engine for small buffers, never forced by a
    /// user): every rank makes its whole buffer available to every peer in one message (or one
    /// posting on a shared-memory board) and reduces all contributions in rank order. One
    /// latency, `(n - 1) * B` bytes out of every rank; see [`super::eager`].
    Eager,
    /// Deterministic all-reduce (internal: chosen by the engine's deterministic mode): pieces of
    /// the buffer are all-gathered and every element is reduced in rank order, so the bits
    /// depend on neither the algorithm nor the chunking. `(n - 1) * B` bytes out of every rank;
    /// see [`super::deterministic`].
    Deterministic,
    /// Pairwise exchange (all-to-all only): at step `s` rank `r` sends to `r + s` and receives
    /// from `r - s`, a bounded window of steps at once; every byte sent once. See
    /// [`super::alltoall`].
    Pairwise,
    /// Bruck's log-step all-to-all (all-to-all only): `ceil(log2 n)` messages, each block
    /// forwarded up to `log2 n` times; for small blocks. See [`super::alltoall`].
    Bruck,
}

impl Algorithm {
    /// Every algorithm a user may force (`GRADSYNC_ALGO`) and that the tools sweep: all but the
    /// internal ones ([`Algorithm::is_internal`]).
    pub const ALL: [Algorithm; 9] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Tree,
        Algorithm::DoubleTree,
        Algorithm::Hierarchical,
        Algorithm::Central,
        Algorithm::Pairwise,
        Algorithm::Bruck,
    ];

    /// Every variant, the internal ones included: what a sweep over every program covers.
    pub const EVERY: [Algorithm; 11] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Tree,
        Algorithm::DoubleTree,
        Algorithm::Hierarchical,
        Algorithm::Central,
        Algorithm::Pairwise,
        Algorithm::Bruck,
        Algorithm::Eager,
        Algorithm::Deterministic,
    ];

    /// Whether the engine chooses this algorithm itself and a user cannot ask for it
    /// ([`Algorithm::Eager`], [`Algorithm::Deterministic`]): it is not in [`Algorithm::ALL`] and
    /// [`Algorithm::parse`] does not accept its name.
    pub const fn is_internal(self) -> bool {
        matches!(self, Algorithm::Eager | Algorithm::Deterministic)
    }

    /// Name in snake case (`ring`, `recursive_doubling`, `rabenseifner`, `tree`, `double_tree`,
    /// `hierarchical`, `central`, `pairwise`, `bruck`, and the internal `eager` and
    /// `deterministic`).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::Rabenseifner => "rabenseifner",
            Algorithm::Tree => "tree",
            Algorithm::DoubleTree => "double_tree",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Central => "central",
            Algorithm::Eager => "eager",
            Algorithm::Deterministic => "deterministic",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Bruck => "bruck",
        }
    }

    /// Parses a name (`ring`, `recursive_doubling` or `rd`, `rabenseifner`, `halving_doubling` or
    /// `rhd`, `tree`, `double_tree` or `dbtree`, `hierarchical` or `hier`, `central`,
    /// `pairwise`, `bruck`),
    /// case-insensitively, as `GRADSYNC_ALGO` spells it. The internal algorithms
    /// ([`Algorithm::is_internal`]) are not accepted: nobody can force them.
    pub fn parse(s: &str) -> Result<Self, PlanError> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "ring" => Algorithm::Ring,
            "recursive_doubling" | "recursivedoubling" | "rd" => Algorithm::RecursiveDoubling,
            "rabenseifner" | "halving_doubling" | "rhd" => Algorithm::Rabenseifner,
            "tree" => Algorithm::Tree,
            "double_tree" | "doubletree" | "dbtree" => Algorithm::DoubleTree,
            "hierarchical" | "hier" => Algorithm::Hierarchical,
            "central" => Algorithm::Central,
            "pairwise" => Algorithm::Pairwise,
            "bruck" => Algorithm::Bruck,
            _ => return Err(PlanError::UnknownAlgorithm(s.to_string())),
        })
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of planning a collective.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The world has no rank.
    #[error("world size is 0")]
    EmptyWorld,
    /// `rank >= world`.
    #[error("rank {rank} is out of range for world size {world}")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// `root >= world` for a rooted collective (broadcast, reduce, gather, scatter).
    #[error("root {root} of {coll} is out of range for world size {world}")]
    RootOutOfRange {
        /// The collective.
        coll: Collective,
        /// The root given.
        root: usize,
        /// The world size.
        world: usize,
    },
    /// `segment == 0`.
    #[error("segment size is 0 (it must be at least 1 element)")]
    ZeroSegment,
    /// The collective has no schedule for this algorithm (or is not planned at all, as send/recv).
    #[error("{coll} has no {algorithm} schedule")]
    Unsupported {
        /// The collective.
        coll: Collective,
        /// The algorithm asked for.
        algorithm: Algorithm,
    },
    /// The buffers or the program would not fit the index types.
    #[error(
        "{coll} of {count} elements over {world} ranks with segment {segment} is too large to plan"
    )]
    TooLarge {
        /// The collective.
        coll: Collective,
        /// Elements per rank.
        count: usize,
        /// The world size.
        world: usize,
        /// The segment size.
        segment: usize,
    },
    /// An algorithm name was not recognised.
    #[error(
        "unknown algorithm {0:?} (expected one of ring, recursive_doubling, rabenseifner, tree, \
         double_tree, hierarchical, central, pairwise, bruck)"
    )]
    UnknownAlgorithm(String),
    /// The collective has no in-place form (all-to-all, gather, scatter: their input and output
    /// differ in size or layout).
    #[error("{coll} has no in-place form: pass separate input and output buffers")]
    InPlace {
        /// The collective.
        coll: Collective,
    },
    /// A hierarchical schedule was asked for, but the ranks do not split into hosts of
    /// `local_size` ranks each (`local_size` does not divide `world`). Callers fall back to
    /// [`Algorithm::Ring`].
    #[error(
        "world size {world} is not a multiple of local_size {local_size}: hierarchical schedules \
         need hosts of equally many ranks"
    )]
    NonUniformHosts {
        /// The world size.
        world: usize,
        /// Ranks per host given.
        local_size: usize,
    },
}

/// Parameters of one rank's part in one collective call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Params {
    /// Which collective.
    pub coll: Collective,
    /// This rank, `< world`.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Elements per rank (see the buffer table in the [module docs](self)); ignored by barrier.
    pub count: usize,
    /// Root of broadcast and reduce; ignored by the other collectives.
    pub root: usize,
    /// Reduction operator; ignored by collectives that do not reduce.
    pub op: ReduceOp,
    /// Maximum elements per op (message, copy), at least 1.
    pub segment: usize,
    /// Whether `Input` and `Output` are the same memory.
    pub in_place: bool,
    /// Which algorithm to plan.
    pub algorithm: Algorithm,
    /// Ranks per host. Hosts hold contiguous blocks of ranks, as `torchrun` numbers them: host `h`
    /// holds ranks `h * local_size .. (h + 1) * local_size`. 0 means unknown, taken as a single
    /// host of `world` ranks. [`Algorithm::Hierarchical`] needs it to divide `world` (see
    /// [`host_shape`]); with it below `world` Rabenseifner orders its messages for the next step
    /// and the tree all-reduce cuts smaller segments (see the `halving` and `tree` schedules).
    pub local_size: usize,
}

impl Params {
    /// Checks the parameters without building a program.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.world == 0 {
            return Err(PlanError::EmptyWorld);
        }
        if self.rank >= self.world {
            return Err(PlanError::RankOutOfRange {
                rank: self.rank,
                world: self.world,
            });
        }
        if matches!(
            self.coll,
            Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
        ) && self.root >= self.world
        {
            return Err(PlanError::RootOutOfRange {
                coll: self.coll,
                root: self.root,
                world: self.world,
            });
        }
        if self.segment == 0 {
            return Err(PlanError::ZeroSegment);
        }
        if self.in_place
            && matches!(
                self.coll,
                Collective::AllToAll
                    | Collective::AllToAllV
                    | Collective::Gather
                    | Collective::Scatter
            )
        {
            return Err(PlanError::InPlace { coll: self.coll });
        }
        if self.algorithm == Algorithm::Hierarchical
            && matches!(
                self.coll,
                Collective::AllReduce | Collective::ReduceScatter | Collective::AllGather
            )
        {
            host_shape(self.world, self.local_size)?;
        }
        let too_large = PlanError::TooLarge {
            coll: self.coll,
            count: self.count,
            world: self.world,
            segment: self.segment,
        };
        if self.coll != Collective::Barrier {
            // Buffers of count * world elements must be addressable, and the number of ops must
            // fit an `OpId` with room to spare (a loose upper bound over every algorithm). The
            // schedules that move `count` elements per peer (reduce-scatter, all-gather, the
            // central root, the deterministic all-gather) have ops in proportion to
            // `count * world`.
            let all = self
                .count
                .checked_mul(self.world)
                .ok_or(too_large.clone())?;
            if self.algorithm == Algorithm::Deterministic {
                // Its scratch holds two halves of `world` pieces.
                all.checked_mul(2).ok_or(too_large.clone())?;
            }
            let log = self.world.next_power_of_two().trailing_zeros() as usize;
            let per_peer = matches!(
                self.coll,
                Collective::ReduceScatter
                    | Collective::AllGather
                    | Collective::AllToAll
                    | Collective::Gather
                    | Collective::Scatter
            ) || matches!(
                self.algorithm,
                Algorithm::Central | Algorithm::Deterministic
            );
            let mut segs = self.count.div_ceil(self.segment);
            if per_peer {
                segs = segs.checked_mul(self.world).ok_or(too_large.clone())?;
            }
            let mut segs = segs.checked_add(self.world).ok_or(too_large.clone())?;
            if self.algorithm == Algorithm::Bruck {
                // Every block is copied into, out of and between packs, once per step.
                segs = segs.checked_mul(4 * (log + 1)).ok_or(too_large.clone())?;
            }
            let bound = segs.checked_mul(8 * (log + 2)).ok_or(too_large.clone())?;
            if bound > (u32::MAX / 2) as usize {
                return Err(too_large);
            }
        }
        Ok(())
    }

    /// Elements of this rank's logical input: the size of `Input` in an out-of-place call.
    pub fn input_elems(&self) -> usize {
        match self.coll {
            Collective::ReduceScatter | Collective::AllToAll | Collective::AllToAllV => {
                self.count * self.world
            }
            Collective::Scatter if self.rank == self.root => self.count * self.world,
            Collective::Scatter | Collective::Barrier | Collective::SendRecv => 0,
            _ => self.count,
        }
    }

    /// Elements of `Output`. In place, the size of the one buffer that is both `Input` and
    /// `Output`.
    pub fn output_elems(&self) -> usize {
        match self.coll {
            Collective::AllGather | Collective::AllToAll | Collective::AllToAllV => {
                self.count * self.world
            }
            Collective::ReduceScatter if self.in_place => self.count * self.world,
            Collective::Gather if self.rank == self.root => self.count * self.world,
            Collective::Gather | Collective::Barrier | Collective::SendRecv => 0,
            _ => self.count,
        }
    }

    /// Where this rank's logical input lies in `Output` in an in-place call (`rank * count` for
    /// all-gather, 0 otherwise). Meaningless out of place, where the input is all of `Input`.
    pub fn input_offset(&self) -> usize {
        match self.coll {
            Collective::AllGather if self.in_place => self.rank * self.count,
            _ => 0,
        }
    }

    /// The part of `Output` that holds this rank's result after the call. Elements of `Output`
    /// outside it keep their contents. Empty for a non-root reduce and for barrier.
    pub fn result_range(&self) -> Range<usize> {
        match self.coll {
            Collective::ReduceScatter if self.in_place => {
                self.rank * self.count..(self.rank + 1) * self.count
            }
            Collective::Reduce if self.rank != self.root => 0..0,
            _ => 0..self.output_elems(),
        }
    }
}

/// The host layout `(hosts, local)` of a world of `world` ranks in hosts of `local_size` ranks:
/// `local_size` 0 means a single host (`(1, world)`). Fails with [`PlanError::NonUniformHosts`]
/// when `local_size` does not divide `world`, and with [`PlanError::EmptyWorld`] for `world == 0`.
pub fn host_shape(world: usize, local_size: usize) -> Result<(usize, usize), PlanError> {
    if world == 0 {
        return Err(PlanError::EmptyWorld);
    }
    let local = if local_size == 0 { world } else { local_size };
    if !world.is_multiple_of(local) {
        return Err(PlanError::NonUniformHosts { world, local_size });
    }
    Ok((world / local, local))
}

/// Bytes up to which [`default_algorithm`] picks recursive doubling for an all-reduce.
pub const SMALL_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// The algorithm used when the caller does not choose one, for `bytes` bytes per rank.
///
/// A first rule of thumb, not yet a calibrated cost model: all-reduce uses recursive doubling up
/// to [`SMALL_ALL_REDUCE_BYTES`] (latency dominates: `log2 n` message latencies instead of
/// `2 (n - 1)`) and the ring above (bandwidth dominates); broadcast and reduce use the binomial
/// tree; everything else the ring. `world` is part of the signature for the cost model to come.
pub fn default_algorithm(coll: Collective, world: usize, bytes: usize) -> Algorithm {
    let _ = world;
    match coll {
        Collective::AllReduce if bytes <= SMALL_ALL_REDUCE_BYTES => Algorithm::RecursiveDoubling,
        Collective::Broadcast | Collective::Reduce => Algorithm::Tree,
        Collective::AllToAll | Collective::AllToAllV => Algorithm::Pairwise,
        Collective::Gather | Collective::Scatter => Algorithm::Central,
        _ => Algorithm::Ring,
    }
}

/// The nccl-tests "bus bandwidth" factor: `busbw = algbw * factor`, where `algbw` is bytes per
/// rank over time. `2 (n - 1) / n` for all-reduce, `(n - 1) / n` for reduce-scatter and
/// all-gather (with bytes counted as the full `count * world` buffer), 1 for broadcast, reduce
/// and send/recv, 0 for barrier.
///
/// The factor makes numbers comparable with the link speed: a bandwidth-optimal all-reduce moves
/// `2 (n - 1) / n` times the buffer over each rank's link, so a busbw equal to the link speed
/// means the algorithm saturates the hardware.
pub fn bus_bandwidth_factor(coll: Collective, world: usize) -> f64 {
    let n = world.max(1) as f64;
    match coll {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::ReduceScatter
        | Collective::AllGather
        | Collective::AllToAll
        | Collective::AllToAllV
        | Collective::Gather
        | Collective::Scatter => (n - 1.0) / n,
        Collective::Broadcast | Collective::Reduce | Collective::SendRecv => 1.0,
        Collective::Barrier => 0.0,
    }
}
