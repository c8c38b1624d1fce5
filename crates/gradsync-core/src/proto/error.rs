//! What can go wrong between two ranks: typed causes, each naming the peer.

use crate::wire::{DataHeaderRepr, Signature, WireError};

/// Something a peer did that the protocol forbids. Every variant carries the values involved;
/// [`ProtoError::Violation`] adds the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A data header (in a slot, an eager message or a board posting) does not parse.
    #[error("bad data header: {0}")]
    BadHeader(WireError),
    /// A control message does not parse.
    #[error("malformed control message of {len} bytes: {error}")]
    BadControl {
        /// Its length.
        len: usize,
        /// Why it does not parse.
        error: WireError,
    },
    /// A write notification for a slot that is not the next free one within the window, or
    /// longer than a slot.
    #[error(
        "unexpected write notification {imm} ({len} bytes); expected one of the next {window} after {expected}"
    )]
    UnknownSlot {
        /// The immediate value.
        imm: u32,
        /// Bytes written.
        len: u32,
        /// Low bits of the next message counter expected.
        expected: u32,
        /// Messages in flight the pair allows.
        window: usize,
    },
    /// Credits returned beyond the window.
    #[error("returned {returned} credits while {free} of {window} were free")]
    TooManyCredits {
        /// Credits in the message.
        returned: u32,
        /// Credits this rank already held.
        free: usize,
        /// The pair's window.
        window: usize,
    },
    /// A write straight into this rank's buffer that no clear-to-send asked for.
    #[error("direct write of message {msg} ({len} bytes) that no clear-to-send asked for")]
    UnsolicitedDirect {
        /// Message index in the immediate.
        msg: u32,
        /// Bytes written.
        len: u32,
    },
    /// More clear-to-send offers outstanding than any schedule makes.
    #[error("more than {max} clear-to-send offers outstanding")]
    TooManyOffers {
        /// The limit.
        max: usize,
    },
    /// A ready-to-send from a peer whose pair with this rank has inbox slots (configured
    /// otherwise).
    #[error(
        "ready-to-send for message {msg} of call {seq}, but the pair is not pooled here (set GRADSYNC_RECV_BUDGET alike on every rank)"
    )]
    NotPooled {
        /// Message index.
        msg: u32,
        /// Sequence number.
        seq: u64,
    },
    /// A message from a pooled peer that must be staged in a pool slot is larger than one.
    #[error("message {msg} of {bytes} bytes must be staged in a pool slot of {slot} bytes")]
    PoolOverflow {
        /// Message index.
        msg: u32,
        /// Its bytes.
        bytes: usize,
        /// Payload bytes of a slot.
        slot: usize,
    },
    /// An eager message of another communicator.
    #[error("eager message of communicator {theirs:#x}, not this one ({ours:#x})")]
    ForeignCommunicator {
        /// The communicator it names.
        theirs: u64,
        /// This one.
        ours: u64,
    },
    /// An eager message whose header names another sender, or whose length disagrees with
    /// its header.
    #[error(
        "eager message of {len} bytes: header of rank {sender} for a payload of {payload} bytes"
    )]
    BadFraming {
        /// Bytes of the message.
        len: usize,
        /// Sender rank in the header.
        sender: u32,
        /// Payload length in the header.
        payload: u32,
    },
    /// An eager message for an operation this rank has already finished.
    #[error("eager message for {theirs} arrived after this rank finished seq {done}")]
    Late {
        /// The operation it belongs to.
        theirs: Signature,
        /// The last operation this rank finished.
        done: u64,
    },
    /// More eager messages for operations ahead of this rank than a peer may send.
    #[error("more than {max} eager messages ahead of this rank")]
    TooFarAhead {
        /// The limit.
        max: usize,
    },
    /// A message without a checksum while this rank checks them (`GRADSYNC_CHECKSUM`).
    #[error(
        "{sig}: message {msg} carries no checksum but GRADSYNC_CHECKSUM=1 here; set it alike on every rank"
    )]
    MissingChecksum {
        /// The operation.
        sig: Signature,
        /// The message index.
        msg: u32,
    },
}

/// Errors of the protocol machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// A peer broke the protocol.
    #[error("protocol error from rank {peer}: {violation}")]
    Violation {
        /// The peer.
        peer: usize,
        /// What it did.
        violation: Violation,
    },
    /// A peer runs a different call, or the same one with different arguments.
    #[error("runs {ours} but rank {peer} sent {theirs}{}", if detail.is_empty() { String::new() } else { format!(": {detail}") })]
    Mismatch {
        /// The peer.
        peer: usize,
        /// This rank's signature.
        ours: Signature,
        /// The peer's.
        theirs: Signature,
        /// Further detail when the signatures agree but the messages do not.
        detail: String,
    },
    /// A peer failed and said why.
    #[error("rank {peer} aborted the communicator: {reason}")]
    PeerAborted {
        /// The peer.
        peer: usize,
        /// Its error.
        reason: String,
    },
}

impl ProtoError {
    pub(crate) fn violation(peer: usize, violation: Violation) -> Self {
        ProtoError::Violation { peer, violation }
    }
}

/// What to add to a mismatch between an eager operation and a scheduled one: when the two
/// calls agree, the ranks' settings differ.
pub(crate) fn eager_detail(
    ours: &Signature,
    theirs: &Signature,
    scheduled: usize,
    eager: usize,
) -> String {
    if ours != theirs {
        return String::new();
    }
    format!(
        "rank {eager} ran it eagerly and rank {scheduled} through a schedule; \
         set GRADSYNC_ALGO and GRADSYNC_EAGER_MAX alike on every rank"
    )
}

/// A message whose header disagrees with the receive waiting for it.
pub(crate) fn mismatch(
    peer: usize,
    ours: &Signature,
    h: &DataHeaderRepr,
    msg: u32,
    bytes: usize,
) -> ProtoError {
    ProtoError::Mismatch {
        peer,
        ours: *ours,
        theirs: h.sig,
        detail: if h.sig == *ours {
            format!(
                "message {} of {} bytes where message {msg} of {bytes} bytes was expected",
                h.msg, h.payload_len
            )
        } else {
            String::new()
        },
    }
}
