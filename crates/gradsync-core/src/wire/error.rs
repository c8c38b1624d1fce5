//! The error of parsing peer bytes.

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
