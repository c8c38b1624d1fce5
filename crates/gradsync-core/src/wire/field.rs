//! Helpers of the views: reading fixed-size fields and checking lengths.

use super::error::WireError;

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
