//! The signature of a collective call and its one encoding on the wire.
//!
//! Every message that belongs to a call carries the call's [`Signature`], so the receiver
//! checks on the first message, at no extra round trip, that both sides run the same
//! collective with the same element type, operator, count and root. The data header
//! ([`super::data`]) and the clear-to-send ([`super::control`]) embed the same 32 bytes:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 1 | collective code |
//! | 1 | 1 | data type code |
//! | 2 | 1 | reduction op code |
//! | 3 | 1 | reserved (0) |
//! | 4 | 8 | communicator id |
//! | 12 | 8 | sequence number |
//! | 20 | 8 | count (elements per rank, as passed by the caller) |
//! | 28 | 4 | root (or peer tag for send/recv) |

use super::error::WireError;
use super::field::{need, rd};
use crate::{Collective, DataType, ReduceOp};
use std::fmt;

/// Length of an encoded [`Signature`].
pub const SIGNATURE_LEN: usize = 32;

/// Offset of the sequence number in an encoded [`Signature`].
pub(crate) const SEQ_AT: usize = field::SEQ;

mod field {
    pub const COLL: usize = 0;
    pub const DTYPE: usize = 1;
    pub const OP: usize = 2;
    pub const COMM: usize = 4;
    pub const SEQ: usize = 12;
    pub const COUNT: usize = 20;
    pub const ROOT: usize = 28;
}

/// What identifies one collective call; every rank of a call must have the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    /// Communicator id (equal on all ranks of a communicator).
    pub comm_id: u64,
    /// Sequence number of the call on this communicator (starts at 1).
    pub seq: u64,
    /// Which collective.
    pub coll: Collective,
    /// Element type.
    pub dtype: DataType,
    /// Reduction operator (`Sum` for collectives that do not reduce).
    pub op: ReduceOp,
    /// Element count as passed by the caller (per rank).
    pub count: u64,
    /// Root rank (0 for collectives without a root).
    pub root: u32,
}

impl Signature {
    /// Parses the first [`SIGNATURE_LEN`] bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<Signature, WireError> {
        need("signature", b, SIGNATURE_LEN)?;
        Ok(Signature {
            coll: Collective::from_code(b[field::COLL])?,
            dtype: DataType::from_code(b[field::DTYPE])?,
            op: ReduceOp::from_code(b[field::OP])?,
            comm_id: u64::from_le_bytes(rd(b, field::COMM)),
            seq: u64::from_le_bytes(rd(b, field::SEQ)),
            count: u64::from_le_bytes(rd(b, field::COUNT)),
            root: u32::from_le_bytes(rd(b, field::ROOT)),
        })
    }

    /// Writes every one of the first [`SIGNATURE_LEN`] bytes of `b`.
    ///
    /// # Panics
    ///
    /// If `b` is shorter than [`SIGNATURE_LEN`].
    pub fn emit(&self, b: &mut [u8]) {
        let b = &mut b[..SIGNATURE_LEN];
        b[field::COLL] = self.coll as u8;
        b[field::DTYPE] = self.dtype as u8;
        b[field::OP] = self.op as u8;
        b[3] = 0;
        b[field::COMM..field::COMM + 8].copy_from_slice(&self.comm_id.to_le_bytes());
        b[field::SEQ..field::SEQ + 8].copy_from_slice(&self.seq.to_le_bytes());
        b[field::COUNT..field::COUNT + 8].copy_from_slice(&self.count.to_le_bytes());
        b[field::ROOT..field::ROOT + 4].copy_from_slice(&self.root.to_le_bytes());
    }
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} seq {} {} ", self.coll, self.seq, self.dtype)?;
        if matches!(
            self.coll,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        ) {
            write!(f, "{} ", self.op)?;
        }
        write!(f, "count {}", self.count)?;
        if matches!(self.coll, Collective::Broadcast | Collective::Reduce) {
            write!(f, " root {}", self.root)?;
        }
        if self.coll == Collective::SendRecv {
            write!(f, " tag {}", self.root)?;
        }
        Ok(())
    }
}
