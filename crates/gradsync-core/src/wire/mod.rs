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
mod error;
mod field;
pub mod settings;
pub mod signature;

pub use control::{Control, ControlRepr, Cts};
pub use data::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr, FLAG_CRC32C, MAGIC, VERSION, is_data};
pub use error::WireError;
pub use settings::{SlotSettings, SlotSettingsRepr};
pub use signature::{SIGNATURE_LEN, Signature};

#[cfg(test)]
mod tests;
