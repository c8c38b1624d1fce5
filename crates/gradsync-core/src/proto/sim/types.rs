//! What a protocol simulation is given and what it reports.

use crate::proto::action::Target;
use crate::proto::error::ProtoError;
use crate::schedule::{Algorithm, Loc};
use crate::wire::DataHeaderRepr;
use crate::{Collective, DataType, ReduceOp, TypeError};

/// How to run a protocol simulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Seed of the interleaving and of the inputs.
    pub seed: u64,
    /// Slots per sender in every inbox.
    pub nslots: usize,
    /// Payload bytes per slot.
    pub slot_bytes: usize,
    /// Slots in flight per pair, if fewer than `nslots`.
    pub window: Option<usize>,
    /// Copy-receives of at least this many bytes ask for direct writes (`usize::MAX`: never).
    pub direct_min: usize,
    /// Eager operations post on boards.
    pub board: bool,
    /// Payloads carry a CRC32C.
    pub checksum: bool,
    /// A rank that is picked to run once for every this many picks of another.
    pub slow: Option<(usize, usize)>,
    /// Events of a pair arrive in the order they were sent (one stream per pair).
    pub fifo: bool,
    /// Steps before giving up (a livelock).
    pub max_steps: u64,
    /// Every pair's message counters start near this value instead of 0 (each direction a
    /// little apart), to cross the wrap of the 31 bits a write's immediate carries.
    pub counters_from: u64,
    /// This rank never asks for direct writes (a rank configured otherwise): its peers' sends
    /// that wait for its offers go through slots once their patience is over.
    pub no_offers_from: Option<usize>,
    /// Slots of every rank's shared pool; with more than 0, pairs of ranks not next to each
    /// other (or every pair, with `pool_all`) are pooled: they have no inbox slots.
    pub pool_slots: usize,
    /// Every pair is pooled (with `pool_slots` above 0).
    pub pool_all: bool,
}

impl SimConfig {
    /// Defaults for `seed`: 4 slots of 256 bytes, direct writes from 512 bytes, no board.
    pub fn new(seed: u64) -> Self {
        SimConfig {
            seed,
            nslots: 4,
            slot_bytes: 256,
            window: None,
            direct_min: 512,
            board: false,
            checksum: false,
            slow: None,
            fifo: false,
            max_steps: 50_000_000,
            counters_from: 0,
            no_offers_from: None,
            pool_slots: 0,
            pool_all: false,
        }
    }
}

/// One collective call of a simulation, alike on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallSpec {
    /// Which collective.
    pub coll: Collective,
    /// Which algorithm.
    pub algorithm: Algorithm,
    /// Element type.
    pub dtype: DataType,
    /// Operator.
    pub op: ReduceOp,
    /// Elements per rank.
    pub count: usize,
    /// Root of broadcast and reduce.
    pub root: usize,
    /// In place.
    pub in_place: bool,
}

/// What went wrong in a protocol simulation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A rank's machine reported an error.
    #[error("rank {rank}: {error}")]
    Proto {
        /// The rank.
        rank: usize,
        /// The error.
        error: ProtoError,
    },
    /// A call asks for an operator that its element type does not have (a bitwise operator over
    /// a floating-point type).
    #[error("call {call}: {source}")]
    OpType {
        /// The call.
        call: usize,
        /// Which operator and type.
        #[source]
        source: TypeError,
    },
    /// Planning a call failed.
    #[error("rank {rank} call {call}: {msg}")]
    Plan {
        /// The rank.
        rank: usize,
        /// The call.
        call: usize,
        /// Why.
        msg: String,
    },
    /// A write landed in a slot whose previous message was not consumed: the sender had no
    /// credit for it.
    #[error(
        "rank {from} wrote slot {slot} of its part of rank {to}'s inbox before rank {to} consumed the message there"
    )]
    SlotOverrun {
        /// Writer.
        from: usize,
        /// Receiver.
        to: usize,
        /// The slot.
        slot: usize,
    },
    /// A direct write with a key that names no buffer of the receiver's running operation.
    #[error(
        "rank {from} wrote to rank {to} with key {rkey:#x}, which names no buffer of its running operation"
    )]
    BadKey {
        /// Writer.
        from: usize,
        /// Receiver.
        to: usize,
        /// The key.
        rkey: u32,
    },
    /// A payload failed its checksum.
    #[error("rank {rank}: message {msg} from rank {peer} failed its checksum")]
    Corrupt {
        /// Receiver.
        rank: usize,
        /// Sender.
        peer: usize,
        /// Message index.
        msg: u32,
    },
    /// Nothing can move while some ranks have calls left.
    #[error("deadlock after {steps} steps: {detail}")]
    Deadlock {
        /// Steps taken.
        steps: u64,
        /// The ranks' states.
        detail: String,
    },
    /// The step budget ran out.
    #[error("no end after {0} steps")]
    Livelock(u64),
    /// A call's results differ from the reference.
    #[error("call {call} ({spec:?}): {detail}")]
    Result {
        /// The call.
        call: usize,
        /// What it was.
        spec: CallSpec,
        /// The difference.
        detail: String,
    },
    /// A bug of the simulator's driver.
    #[error("{0}")]
    Internal(String),
}

/// A one-sided write on its way.
#[derive(Debug, Clone)]
pub(crate) struct Landing {
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) wr: u64,
    pub(crate) header: Option<DataHeaderRepr>,
    pub(crate) src: Loc,
    pub(crate) len: usize,
    pub(crate) target: Target,
    pub(crate) imm: u32,
}

/// Something on its way to a rank.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A write lands (and notifies the receiver).
    Land(Landing),
    /// The writer learns that its write is done.
    Done { rank: usize, wr: u64 },
    /// A two-sided message arrives.
    Msg {
        from: usize,
        to: usize,
        data: Vec<u8>,
    },
}

impl Event {
    pub(crate) fn pair(&self) -> (usize, usize) {
        match self {
            Event::Land(l) => (l.from, l.to),
            Event::Done { rank, .. } => (*rank, *rank),
            Event::Msg { from, to, .. } => (*from, *to),
        }
    }
}

/// Counters of a protocol simulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Steps taken.
    pub steps: u64,
    /// Writes that landed.
    pub writes: u64,
    /// Of those, direct writes (straight into the receiver's buffer after its offer).
    pub direct_writes: u64,
    /// Of those, writes into a slot of the receiver's shared pool.
    pub pool_writes: u64,
    /// Two-sided messages delivered.
    pub messages: u64,
}
