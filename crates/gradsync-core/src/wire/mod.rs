//! The bytes ranks exchange: every header and control message, as checked views.
//!
//! Each format follows smoltcp's view/repr split: a typed view over bytes (`new_unchecked`,
//! `new_checked`, `check_len`, field accessors) and a parsed `...Repr` with `parse` and `emit`.
//! Parsing never panics on peer input: a short buffer, an unknown code or a length that does
//! not add up is a [`WireError`]. Every parser has literal byte-vector tests and a `fuzz_*`
//! property test.
//!
//! - [`signature`]: the 32-byte encoding of a call's [`Signature`] (communicator, sequence
//!   number, collective, type, operator, count, root), the one every message that names a call
//!   embeds;
//! - [`data`]: the 64-byte [`DataHeader`] in front of every payload: slot writes, eager
//!   messages and board postings;
//! - [`control`]: the small two-sided messages of the protocol ([`ControlRepr`]: credits,
//!   clear-to-send, probes and their answers, aborts);
//! - [`settings`]: the slot settings every rank publishes with its inbox at init.
//!
//! A two-sided message is either a control message (its first byte is a [`control::Kind`]) or
//! an eager contribution (a data header and its payload; the header's first byte is the low
//! byte of [`data::MAGIC`], which no control kind uses): [`is_data`] tells them apart.
//!
//! All integers are little-endian.

pub mod control;
pub mod data;
pub mod settings;
pub mod signature;

pub use control::{Control, ControlRepr, Cts};
pub use data::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr, FLAG_CRC32C, MAGIC, VERSION};
pub use settings::{SlotSettings, SlotSettingsRepr};
pub use signature::{SIGNATURE_LEN, Signature};

/// Errors of parsing peer bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the format needs.
    #[error("truncated {what}: {got} bytes, need {need}")]
    Truncated {
        /// The format.
        what: &'static str,
        /// Bytes available.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// A fixed-size message of the wrong length.
    #[error("{what} of {got} bytes, expected {want}")]
    BadLength {
        /// The format.
        what: &'static str,
        /// Bytes given.
        got: usize,
        /// Bytes the format has.
        want: usize,
    },
    /// The magic number is wrong: not a gradsync data message.
    #[error("bad magic 0x{0:04x} in data header")]
    BadMagic(u16),
    /// Unsupported version.
    #[error("unsupported data header version {0}")]
    BadVersion(u8),
    /// A control message of an unknown kind.
    #[error("unknown control message kind {0}")]
    UnknownKind(u8),
    /// A code field holds an unknown value.
    #[error("bad field: {0}")]
    BadField(#[from] crate::TypeError),
}

/// Whether a two-sided message is a data message (an eager contribution) rather than a
/// control message: it starts with the data header's magic.
pub fn is_data(msg: &[u8]) -> bool {
    msg.len() >= 2 && u16::from_le_bytes([msg[0], msg[1]]) == MAGIC
}

/// `N` bytes of `b` at `at` as an array; the caller has checked the length.
pub(crate) fn rd<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

/// Fails with [`WireError::Truncated`] when `b` is shorter than `need`.
pub(crate) fn need(what: &'static str, b: &[u8], need: usize) -> Result<(), WireError> {
    if b.len() < need {
        return Err(WireError::Truncated {
            what,
            got: b.len(),
            need,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
