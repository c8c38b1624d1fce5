//! Planning: from the parameters of one collective call to the [`Program`] of one rank.
//!
//! [`build`] turns a [`Params`] into the program of a single rank. Every rank builds its own
//! program from the same parameters (only `rank` differs), and the programs of all ranks fit
//! together: the k-th `Send` from rank a to rank b has the same length as the k-th `Recv` of rank
//! b from rank a.
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
//! `Rabenseifner` (all-reduce only): a reduce-scatter by recursive halving, then an all-gather
//! by recursive doubling. `DoubleTree` (all-reduce only): each half of the buffer reduced up and
//! broadcast down its own binary tree, every rank interior in at most one of the two.
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
//!   `(n - 1) * B * beta`, still linear in n.
//!
//! [`default_algorithm`] encodes the simplest form of this trade-off; a calibrated cost model can
//! replace it later.
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
//! recursive doubling (one buffer of `count` to alternate with `Output`) and by the hierarchical
//! reduce-scatter (partial sums of the intra-host phase and the host's reduced slices, at most
//! `3 * count * world / local_size` elements).
//!
//! # Segments
//!
//! No op of a program is longer than [`Params::segment`] elements: messages are split, and every
//! dependency is per segment, so step k of segment j can run while step k - 1 of segment j + 1 is
//! still in flight. Both sides split a block the same way (`segment`-sized pieces and a shorter
//! last one), so matched sends and receives always agree on length.

use std::fmt;
use std::ops::Range;

use super::{Buf, Loc, Op, OpId, Program};
use crate::{Collective, ReduceOp};

/// Algorithm of a collective schedule. See the [module docs](self) for which collective supports
/// which.
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
    /// halving, then an all-gather by recursive doubling; `2 log2 n` latencies and the ring's
    /// bandwidth term, for medium buffers.
    Rabenseifner,
    /// Double binary tree (all-reduce only): each half of the buffer is reduced up and broadcast
    /// down its own binary tree, pipelined by segment; every rank is interior in at most one of
    /// the two trees. `2 log2 n` latencies and close to the ring's bandwidth for large buffers.
    DoubleTree,
    /// Central aggregator (a parameter server at rank 0, all-reduce only): every other rank sends
    /// its buffer to rank 0, which reduces in rank order and sends the result back. Rank 0's link
    /// carries `n - 1` buffers each way; this is the baseline that the ring is compared against.
    Central,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 7] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Tree,
        Algorithm::DoubleTree,
        Algorithm::Hierarchical,
        Algorithm::Central,
    ];

    /// Name in snake case (`ring`, `recursive_doubling`, `rabenseifner`, `tree`, `double_tree`,
    /// `hierarchical`, `central`).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::Rabenseifner => "rabenseifner",
            Algorithm::Tree => "tree",
            Algorithm::DoubleTree => "double_tree",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Central => "central",
        }
    }

    /// Parses a name (`ring`, `recursive_doubling` or `rd`, `rabenseifner`, `halving_doubling` or
    /// `rhd`, `tree`, `double_tree` or `dbtree`, `hierarchical` or `hier`, `central`),
    /// case-insensitively, as
    /// `GRADSYNC_ALGO` spells it.
    pub fn parse(s: &str) -> Result<Self, PlanError> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "ring" => Algorithm::Ring,
            "recursive_doubling" | "recursivedoubling" | "rd" => Algorithm::RecursiveDoubling,
            "rabenseifner" | "halving_doubling" | "rhd" => Algorithm::Rabenseifner,
            "tree" => Algorithm::Tree,
            "double_tree" | "doubletree" | "dbtree" => Algorithm::DoubleTree,
            "hierarchical" | "hier" => Algorithm::Hierarchical,
            "central" => Algorithm::Central,
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
    /// `root >= world` for a rooted collective (broadcast, reduce).
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
         double_tree, hierarchical, central)"
    )]
    UnknownAlgorithm(String),
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
    /// host of `world` ranks. Only [`Algorithm::Hierarchical`] uses it; it needs `local_size` to
    /// divide `world` (see [`host_shape`]).
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
        if matches!(self.coll, Collective::Broadcast | Collective::Reduce)
            && self.root >= self.world
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
            // central root) have ops in proportion to `count * world`.
            self.count
                .checked_mul(self.world)
                .ok_or(too_large.clone())?;
            let log = self.world.next_power_of_two().trailing_zeros() as usize;
            let per_peer = matches!(self.coll, Collective::ReduceScatter | Collective::AllGather)
                || self.algorithm == Algorithm::Central;
            let mut segs = self.count.div_ceil(self.segment);
            if per_peer {
                segs = segs.checked_mul(self.world).ok_or(too_large.clone())?;
            }
            let segs = segs.checked_add(self.world).ok_or(too_large.clone())?;
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
            Collective::ReduceScatter => self.count * self.world,
            Collective::Barrier | Collective::SendRecv => 0,
            _ => self.count,
        }
    }

    /// Elements of `Output`. In place, the size of the one buffer that is both `Input` and
    /// `Output`.
    pub fn output_elems(&self) -> usize {
        match self.coll {
            Collective::AllGather => self.count * self.world,
            Collective::ReduceScatter if self.in_place => self.count * self.world,
            Collective::Barrier | Collective::SendRecv => 0,
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

/// Builds the program of rank `p.rank` for the collective call described by `p`.
pub fn build(p: &Params) -> Result<Program, PlanError> {
    use Algorithm::*;
    use Collective::*;
    p.validate()?;
    Ok(match (p.coll, p.algorithm) {
        (AllReduce, Ring) => super::ring::all_reduce(p),
        (AllReduce, RecursiveDoubling) => super::doubling::all_reduce(p),
        (AllReduce, Rabenseifner) => super::doubling::rabenseifner(p),
        (AllReduce, Tree) => super::tree::all_reduce(p, super::tree::Shape::Binomial),
        (AllReduce, DoubleTree) => super::tree::double_tree_all_reduce(p),
        (ReduceScatter, Ring) => super::ring::reduce_scatter(p),
        (AllGather, Ring) => super::ring::all_gather(p),
        (AllReduce, Hierarchical) => super::hier::all_reduce(p),
        (ReduceScatter, Hierarchical) => super::hier::reduce_scatter(p),
        (AllGather, Hierarchical) => super::hier::all_gather(p),
        (AllReduce, Central) => super::tree::all_reduce(p, super::tree::Shape::Star),
        (Broadcast, Tree) => super::tree::broadcast(p, super::tree::Shape::Binomial),
        (Broadcast, Ring) => super::tree::broadcast(p, super::tree::Shape::Chain),
        (Reduce, Tree) => super::tree::reduce(p, super::tree::Shape::Binomial),
        (Reduce, Ring) => super::tree::reduce(p, super::tree::Shape::Chain),
        (Barrier, _) => super::doubling::barrier(p),
        (coll, algorithm) => return Err(PlanError::Unsupported { coll, algorithm }),
    })
}

/// Whether [`build`] has a schedule for `coll` with `algorithm`.
pub fn supports(coll: Collective, algorithm: Algorithm) -> bool {
    use Algorithm::*;
    use Collective::*;
    matches!(
        (coll, algorithm),
        (AllReduce, _)
            | (ReduceScatter | AllGather, Ring | Hierarchical)
            | (Broadcast | Reduce, Ring | Tree)
            | (Barrier, _)
    )
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
        Collective::ReduceScatter | Collective::AllGather => (n - 1.0) / n,
        Collective::Broadcast | Collective::Reduce | Collective::SendRecv => 1.0,
        Collective::Barrier => 0.0,
    }
}

// ---- helpers shared by the generators ----------------------------------------------------------

/// The range of block `b` when `count` elements are split into `world` blocks whose sizes differ
/// by at most one (the first `count % world` blocks are one longer).
pub fn block_range(count: usize, world: usize, b: usize) -> Range<usize> {
    let base = count / world;
    let rem = count % world;
    let start = b * base + b.min(rem);
    start..start + base + usize::from(b < rem)
}

/// Segments of a run of `len` elements: `(offset, length)` pairs of at most `segment` elements,
/// all full except possibly the last. Empty when `len == 0`.
pub(crate) fn segments(len: usize, segment: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len.div_ceil(segment)).map(move |j| {
        let off = j * segment;
        (off, segment.min(len - off))
    })
}

/// `loc` moved `off` elements further.
pub(crate) fn at(loc: Loc, off: usize) -> Loc {
    Loc::new(loc.buf, loc.start + off)
}

/// Whether the collective's `Avg` needs a `Finalize` (more than one rank contributed).
pub(crate) fn finalizes(p: &Params) -> bool {
    p.op == ReduceOp::Avg && p.world > 1
}

/// The program of a rank with no peer (a world of one): out of place its input is copied to its
/// output segment by segment; in place there is nothing to do.
pub(crate) fn alone(p: &Params) -> Program {
    let mut prog = Program::new();
    if !p.in_place {
        let (i, o) = (Loc::new(Buf::Input, 0), Loc::new(Buf::Output, 0));
        copy_segments(&mut prog, i, o, p.count, p.segment, |_| None);
    }
    prog
}

/// Appends local copies of `len` elements from `src` to `dst`, segment by segment, each after
/// `deps(j)`. Returns the copy of each segment.
pub(crate) fn copy_segments(
    prog: &mut Program,
    src: Loc,
    dst: Loc,
    len: usize,
    segment: usize,
    deps: impl Fn(usize) -> Option<OpId>,
) -> Vec<OpId> {
    segments(len, segment)
        .enumerate()
        .map(|(j, (off, l))| {
            let d: Vec<OpId> = deps(j).into_iter().collect();
            prog.push(
                Op::Copy {
                    src: at(src, off),
                    dst: at(dst, off),
                    len: l,
                },
                &d,
            )
        })
        .collect()
}

/// Read/write hazards per (buffer, segment) for generators that segment a whole buffer uniformly
/// (recursive doubling, trees): an op that writes a segment waits for its last writer and for
/// every reader since; an op that reads it waits for its last writer.
pub(crate) struct Hazards {
    segs: usize,
    writer: Vec<Option<OpId>>,
    readers: Vec<Vec<OpId>>,
}

impl Hazards {
    pub(crate) fn new(segs: usize) -> Self {
        Hazards {
            segs,
            writer: vec![None; 3 * segs],
            readers: vec![Vec::new(); 3 * segs],
        }
    }

    fn idx(&self, buf: Buf, j: usize) -> usize {
        let b = match buf {
            Buf::Input => 0,
            Buf::Output => 1,
            Buf::Scratch => 2,
        };
        b * self.segs + j
    }

    /// Appends `op` (on segment `j`) reading `reads` and writing `writes`, after `extra` and the
    /// hazards on those buffers.
    pub(crate) fn push(
        &mut self,
        prog: &mut Program,
        op: Op,
        j: usize,
        reads: &[Buf],
        writes: &[Buf],
        extra: &[OpId],
    ) -> OpId {
        let mut deps: Vec<OpId> = extra.to_vec();
        for &b in reads.iter().chain(writes) {
            deps.extend(self.writer[self.idx(b, j)]);
        }
        for &b in writes {
            deps.extend_from_slice(&self.readers[self.idx(b, j)]);
        }
        deps.sort_unstable();
        deps.dedup();
        let id = prog.push(op, &deps);
        for &b in reads {
            if !writes.contains(&b) {
                let i = self.idx(b, j);
                self.readers[i].push(id);
            }
        }
        for &b in writes {
            let i = self.idx(b, j);
            self.writer[i] = Some(id);
            self.readers[i].clear();
        }
        id
    }
}
