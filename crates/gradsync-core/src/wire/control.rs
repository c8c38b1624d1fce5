//! The control messages of the protocol: small two-sided messages beside the data.
//!
//! The first byte is the [`Kind`]; the rest depends on it (little-endian):
//!
//! | kind | length | layout |
//! |------|-------:|--------|
//! | 1 credit | 8 | 3 reserved, slots returned (u32) at 4 |
//! | 2 abort | 4 + n | 3 reserved, the reason (UTF-8) from 4 |
//! | 3 clear-to-send | 56 | 3 reserved, message index (u32) at 4, signature (32) at 8, remote key (u32) at 40, bytes (u32) at 44, offset (u64) at 48 |
//! | 4 probe | 8 | 7 reserved |
//! | 5 probe reply | 16 | inside (u8) at 1, 6 reserved, sequence number (u64) at 8 |
//! | 6 ready-to-send | 16 | point-to-point (u8) at 1, 2 reserved, message index (u32) at 4, sequence number (u64) at 8 |
//!
//! Reserved bytes are written as 0 and ignored on reading. See [`crate::proto::manual`] for
//! what each message does.

use super::error::WireError;
use super::field::{need, rd};
use super::signature::{SIGNATURE_LEN, Signature};
use std::borrow::Cow;

/// The kind of a control message (its first byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Slots returned to their sender.
    Credit = 1,
    /// The sender failed and takes the communicator down.
    Abort = 2,
    /// A receiver's offer to take one message straight into its buffer.
    ClearToSend = 3,
    /// "Where are you?", sent when a collective times out.
    Probe = 4,
    /// The answer to a probe.
    ProbeReply = 5,
    /// A sender of a pooled pair has a message ready: its receiver may stage it in a slot of
    /// its shared pool.
    ReadyToSend = 6,
}

impl Kind {
    /// The kind of code `c`.
    pub fn from_code(c: u8) -> Result<Kind, WireError> {
        Ok(match c {
            1 => Kind::Credit,
            2 => Kind::Abort,
            3 => Kind::ClearToSend,
            4 => Kind::Probe,
            5 => Kind::ProbeReply,
            6 => Kind::ReadyToSend,
            _ => return Err(WireError::UnknownKind(c)),
        })
    }

    /// The length of a message of this kind (the shortest, for an abort).
    pub const fn wire_len(self) -> usize {
        match self {
            Kind::Credit | Kind::Probe => 8,
            Kind::Abort => 4,
            Kind::ClearToSend => 56,
            Kind::ProbeReply | Kind::ReadyToSend => 16,
        }
    }

    /// Whether messages of this kind have no fixed length.
    pub const fn is_variable(self) -> bool {
        matches!(self, Kind::Abort)
    }

    /// Name for error messages.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Credit => "credit",
            Kind::Abort => "abort",
            Kind::ClearToSend => "clear-to-send",
            Kind::Probe => "probe",
            Kind::ProbeReply => "probe reply",
            Kind::ReadyToSend => "ready-to-send",
        }
    }
}

mod field {
    pub const KIND: usize = 0;
    pub const INSIDE: usize = 1;
    pub const WORD: usize = 4;
    pub const SIG: usize = 8;
    pub const SEQ: usize = 8;
    pub const RKEY: usize = 40;
    pub const BYTES: usize = 44;
    pub const OFFSET: usize = 48;
}

/// A typed view over the bytes of a control message.
#[derive(Debug, Clone)]
pub struct Control<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Control<T> {
    /// Wraps bytes without checking them.
    pub const fn new_unchecked(buffer: T) -> Self {
        Control { buffer }
    }

    /// Wraps bytes after [`check_len`](Self::check_len).
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let c = Self::new_unchecked(buffer);
        c.check_len()?;
        Ok(c)
    }

    /// Checks that the kind is known and the length is the kind's, so that the accessors of
    /// that kind will not panic.
    pub fn check_len(&self) -> Result<(), WireError> {
        let b = self.buffer.as_ref();
        need("control message", b, 1)?;
        let kind = Kind::from_code(b[field::KIND])?;
        if kind.is_variable() {
            return need(kind.name(), b, kind.wire_len());
        }
        if b.len() != kind.wire_len() {
            return Err(WireError::BadLength {
                what: kind.name(),
                got: b.len(),
                want: kind.wire_len(),
            });
        }
        Ok(())
    }

    /// The kind code.
    pub fn kind(&self) -> u8 {
        self.buffer.as_ref()[field::KIND]
    }
    /// The word at offset 4: slots returned (credit) or message index (clear-to-send).
    pub fn word(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::WORD))
    }
    /// The encoded signature (clear-to-send).
    pub fn signature(&self) -> &[u8] {
        &self.buffer.as_ref()[field::SIG..field::SIG + SIGNATURE_LEN]
    }
    /// Remote key of the region offered (clear-to-send).
    pub fn rkey(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::RKEY))
    }
    /// Bytes offered (clear-to-send).
    pub fn bytes(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::BYTES))
    }
    /// Offset in the region offered (clear-to-send).
    pub fn offset(&self) -> u64 {
        u64::from_le_bytes(rd(self.buffer.as_ref(), field::OFFSET))
    }
    /// Whether the prober is inside the collective it names (probe reply), or whether the
    /// call is a send/recv (ready-to-send).
    pub fn inside(&self) -> u8 {
        self.buffer.as_ref()[field::INSIDE]
    }
    /// Sequence number (probe reply).
    pub fn seq(&self) -> u64 {
        u64::from_le_bytes(rd(self.buffer.as_ref(), field::SEQ))
    }
    /// The reason bytes (abort).
    pub fn reason(&self) -> &[u8] {
        &self.buffer.as_ref()[Kind::Abort.wire_len()..]
    }
}

/// A receiver's offer to take message `msg` of a call straight into its buffer: the region's
/// key, the offset in it and the length, with the receiver's signature, checked by the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cts {
    /// Index of the message, per sender and receiver, within the call.
    pub msg: u32,
    /// The receiver's signature.
    pub sig: Signature,
    /// Remote key of the receiver's region.
    pub rkey: u32,
    /// Bytes the receiver expects.
    pub bytes: u32,
    /// Offset of the destination in the region.
    pub offset: u64,
}

/// Parsed form of a control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlRepr<'a> {
    /// `count` slots of the receiver's inbox are free again.
    Credit {
        /// Slots returned.
        count: u32,
    },
    /// The sender failed; the reason is its error message.
    Abort {
        /// Why (UTF-8; invalid bytes are replaced).
        reason: Cow<'a, str>,
    },
    /// An offer to receive one message directly.
    ClearToSend(Cts),
    /// "Where are you?"
    Probe,
    /// The answer to a probe: the collective the sender runs, or ran last.
    ProbeReply {
        /// Its sequence number.
        seq: u64,
        /// Whether the sender is inside it.
        inside: bool,
    },
    /// Message `msg` of the sender's call `seq` is ready to go (a pooled pair).
    ReadyToSend {
        /// Index of the message within the call.
        msg: u32,
        /// The call's sequence number.
        seq: u64,
        /// The call is a send/recv, numbered per pair rather than with the collectives.
        p2p: bool,
    },
}

impl<'a> ControlRepr<'a> {
    /// Parses a control message.
    pub fn parse(c: &Control<&'a [u8]>) -> Result<Self, WireError> {
        c.check_len()?;
        let b: &'a [u8] = c.buffer;
        Ok(match Kind::from_code(c.kind())? {
            Kind::Credit => ControlRepr::Credit { count: c.word() },
            Kind::Abort => ControlRepr::Abort {
                reason: String::from_utf8_lossy(&b[Kind::Abort.wire_len()..]),
            },
            Kind::ClearToSend => ControlRepr::ClearToSend(Cts {
                msg: c.word(),
                sig: Signature::parse(c.signature())?,
                rkey: c.rkey(),
                bytes: c.bytes(),
                offset: c.offset(),
            }),
            Kind::Probe => ControlRepr::Probe,
            Kind::ProbeReply => ControlRepr::ProbeReply {
                seq: c.seq(),
                inside: c.inside() != 0,
            },
            Kind::ReadyToSend => ControlRepr::ReadyToSend {
                msg: c.word(),
                seq: c.seq(),
                p2p: c.inside() != 0,
            },
        })
    }

    /// Parses the bytes of a control message.
    pub fn parse_bytes(b: &'a [u8]) -> Result<Self, WireError> {
        Self::parse(&Control::new_unchecked(b))
    }

    /// The kind of this message.
    pub fn kind(&self) -> Kind {
        match self {
            ControlRepr::Credit { .. } => Kind::Credit,
            ControlRepr::Abort { .. } => Kind::Abort,
            ControlRepr::ClearToSend(_) => Kind::ClearToSend,
            ControlRepr::Probe => Kind::Probe,
            ControlRepr::ProbeReply { .. } => Kind::ProbeReply,
            ControlRepr::ReadyToSend { .. } => Kind::ReadyToSend,
        }
    }

    /// This message with no borrow of the bytes it was parsed from.
    pub fn into_owned(self) -> ControlRepr<'static> {
        match self {
            ControlRepr::Abort { reason } => ControlRepr::Abort {
                reason: Cow::Owned(reason.into_owned()),
            },
            ControlRepr::Credit { count } => ControlRepr::Credit { count },
            ControlRepr::ClearToSend(c) => ControlRepr::ClearToSend(c),
            ControlRepr::Probe => ControlRepr::Probe,
            ControlRepr::ProbeReply { seq, inside } => ControlRepr::ProbeReply { seq, inside },
            ControlRepr::ReadyToSend { msg, seq, p2p } => {
                ControlRepr::ReadyToSend { msg, seq, p2p }
            }
        }
    }

    /// Length of the emitted message.
    pub fn buffer_len(&self) -> usize {
        match self {
            ControlRepr::Abort { reason } => Kind::Abort.wire_len() + reason.len(),
            _ => self.kind().wire_len(),
        }
    }

    /// Writes the message into the first [`buffer_len`](Self::buffer_len) bytes.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter than [`buffer_len`](Self::buffer_len).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, c: &mut Control<T>) {
        let b = &mut c.buffer.as_mut()[..self.buffer_len()];
        let head = self.kind().wire_len().min(b.len());
        b[..head].fill(0);
        b[field::KIND] = self.kind() as u8;
        let word = |b: &mut [u8], v: u32| {
            b[field::WORD..field::WORD + 4].copy_from_slice(&v.to_le_bytes())
        };
        match self {
            ControlRepr::Credit { count } => word(b, *count),
            ControlRepr::Abort { reason } => {
                b[Kind::Abort.wire_len()..].copy_from_slice(reason.as_bytes())
            }
            ControlRepr::ClearToSend(cts) => {
                word(b, cts.msg);
                cts.sig.emit(&mut b[field::SIG..]);
                b[field::RKEY..field::RKEY + 4].copy_from_slice(&cts.rkey.to_le_bytes());
                b[field::BYTES..field::BYTES + 4].copy_from_slice(&cts.bytes.to_le_bytes());
                b[field::OFFSET..field::OFFSET + 8].copy_from_slice(&cts.offset.to_le_bytes());
            }
            ControlRepr::Probe => {}
            ControlRepr::ProbeReply { seq, inside } => {
                b[field::INSIDE] = u8::from(*inside);
                b[field::SEQ..field::SEQ + 8].copy_from_slice(&seq.to_le_bytes());
            }
            ControlRepr::ReadyToSend { msg, seq, p2p } => {
                word(b, *msg);
                b[field::INSIDE] = u8::from(*p2p);
                b[field::SEQ..field::SEQ + 8].copy_from_slice(&seq.to_le_bytes());
            }
        }
    }

    /// The emitted message in a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut Control::new_unchecked(&mut v[..]));
        v
    }
}
