//! The simulator's vocabulary: its errors, options, the setup of a raw run and what a run
//! returns.

use crate::schedule::plan::PlanError;
use crate::schedule::{Buf, OpId, Program};
use crate::{ReduceOp, TypeError};

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
    /// A rank's operator is not defined for the element type (a bitwise operator over a
    /// floating-point type).
    #[error("rank {rank}: {source}")]
    OpType {
        /// The rank.
        rank: usize,
        /// Which operator and type.
        #[source]
        source: TypeError,
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
    /// A message was issued out of the order the matching rule prescribes: the k-th message to
    /// a peer must be the k-th send or post for it in program order, the k-th receive posted
    /// from a peer the k-th receive from it (a bug of the executor's queues).
    #[error(
        "rank {rank} op {op} is message {index} with rank {peer}, but program order makes it \
         message {expected}"
    )]
    OutOfOrder {
        /// The rank.
        rank: usize,
        /// The send, post or receive.
        op: OpId,
        /// The other rank.
        peer: usize,
        /// Its position among the messages issued with that rank.
        index: u64,
        /// Its position in program order.
        expected: u64,
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
    /// may complete before. Posts are buffered either way ([`Op::Post`](crate::schedule::Op::Post)).
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

/// One rank of a raw simulation ([`run_programs`](super::run_programs)).
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

/// Outcome of [`run_programs`](super::run_programs).
#[derive(Clone, Debug)]
pub struct RawOutcome {
    /// Final contents of every rank's `Output`.
    pub outputs: Vec<Vec<u8>>,
    /// `heard_from[r][q]`: rank q's start happens before rank r's end.
    pub heard_from: Vec<Vec<bool>>,
    /// Counters.
    pub stats: SimStats,
}
