//! The error type of the public API.

use gradsync_core::wire::Signature;
use std::time::Duration;

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of gradsync's public API. Every message names the rank it happened on and, where
/// there is one, the peer and the operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad configuration or environment.
    #[error("config: {0}")]
    Config(String),
    /// A call's arguments are inconsistent (sizes, root, peer).
    #[error("rank {rank}: {op}: {msg}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The call.
        op: &'static str,
        /// What is wrong, with the sizes involved.
        msg: String,
    },
    /// Rendezvous through the store failed.
    #[error("rank {rank}: rendezvous: {source}")]
    Store {
        /// This rank.
        rank: usize,
        /// The store error.
        #[source]
        source: gradsync_store::StoreError,
    },
    /// The transport failed.
    #[error("rank {rank}: {op}: {source}")]
    Transport {
        /// This rank.
        rank: usize,
        /// What the engine was doing.
        op: &'static str,
        /// The transport error (names the peer where there is one).
        #[source]
        source: gradsync_transport::TransportError,
    },
    /// A peer runs a different collective, or the same one with different arguments.
    #[error("rank {rank} runs {ours} but rank {peer} sent {theirs}{}", if detail.is_empty() { String::new() } else { format!(": {detail}") })]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The peer whose message disagreed.
        peer: usize,
        /// Our signature.
        ours: Signature,
        /// The peer's.
        theirs: Signature,
        /// Further detail when the signatures agree but the messages do not.
        detail: String,
    },
    /// A peer broke the protocol.
    #[error("rank {rank}: protocol error from rank {peer}: {violation}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What it did.
        violation: gradsync_core::proto::Violation,
    },
    /// A message failed its checksum (`GRADSYNC_CHECKSUM=1`): its payload was damaged between
    /// the sender's buffer and this rank's inbox. The payload was not reduced or copied.
    #[error(
        "rank {rank}: {sig}: message {msg} on the link rank {peer} -> rank {rank} is corrupt (crc32c 0x{got:08x}, sender computed 0x{expected:08x}); it was not used"
    )]
    Corrupt {
        /// This rank (the receiver).
        rank: usize,
        /// The sender.
        peer: usize,
        /// The operation.
        sig: Signature,
        /// Index of the message within the operation, per sender and receiver.
        msg: u32,
        /// The checksum the sender put in the header.
        expected: u32,
        /// The checksum of the payload as it arrived.
        got: u32,
    },
    /// A peer failed and told us.
    #[error("rank {rank}: rank {peer} aborted the communicator: {reason}")]
    PeerAborted {
        /// This rank.
        rank: usize,
        /// The peer that failed.
        peer: usize,
        /// Its error.
        reason: String,
    },
    /// The connection to a peer was lost while this rank waited on it.
    #[error("rank {rank}: {sig}: connection to rank {peer} lost (process exited or was killed?)")]
    PeerLost {
        /// This rank.
        rank: usize,
        /// The lost peer.
        peer: usize,
        /// The operation.
        sig: Signature,
    },
    /// An operation did not finish before its deadline.
    #[error("rank {rank}: {sig} timed out after {timeout:?} waiting on {waiting}; {verdict}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The operation.
        sig: Signature,
        /// The deadline.
        timeout: Duration,
        /// The peers waited on and what was last heard from each.
        waiting: String,
        /// Which ranks did not answer the timeout probe, or are behind.
        verdict: String,
    },
    /// This rank aborted the communicator.
    #[error("rank {rank}: aborted: {reason}")]
    Aborted {
        /// This rank.
        rank: usize,
        /// The reason given to `abort`.
        reason: String,
    },
    /// An earlier failure left the communicator unusable.
    #[error("rank {rank}: communicator unusable after an earlier failure: {reason}")]
    Poisoned {
        /// This rank.
        rank: usize,
        /// The earlier failure.
        reason: String,
    },
    /// Building a communicator out of this one ([`Communicator::split`](crate::Communicator::split),
    /// [`Communicator::split_ranks`](crate::Communicator::split_ranks)) failed: the members
    /// disagree, a peer sent a malformed record, or a step failed (the source, such as the
    /// timeout of a message to a member).
    #[error("rank {rank}: {op}: {msg}{}", source.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    Split {
        /// This rank, in the communicator split.
        rank: usize,
        /// The call (`split`, `split_ranks`).
        op: &'static str,
        /// The step that failed, naming the members involved.
        msg: String,
        /// The failure of that step, if another error caused it.
        #[source]
        source: Option<Box<Error>>,
    },
    /// A bug in gradsync itself.
    #[error("rank {rank}: internal error: {msg}")]
    Internal {
        /// This rank.
        rank: usize,
        /// What went wrong.
        msg: String,
    },
}

impl Error {
    pub(crate) fn transport(
        rank: usize,
        op: &'static str,
        source: gradsync_transport::TransportError,
    ) -> Self {
        Error::Transport { rank, op, source }
    }
}
