//! Parameter hashes: the check that every rank holds the same bits.

use crate::{Error, Result};
use gradsync::Communicator;

/// A 64-bit FNV-1a hash of the bit patterns of `values` (little-endian bytes), with the length
/// mixed in first.
///
/// Two slices hash alike only if they are bitwise identical (up to hash collisions): `0.0` and
/// `-0.0`, or two NaNs with different payloads, hash differently. It is a fingerprint for
/// comparing replicas, not a cryptographic hash.
pub fn hash_f32(values: &[f32]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for b in (values.len() as u64).to_le_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(PRIME);
    }
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(PRIME);
        }
    }
    h
}

/// Every rank's `hash`, indexed by rank (an all-gather; every rank must call it).
///
/// Each hash travels as one `i64` with the same 64 bits.
pub fn gather_hashes(comm: &mut Communicator, hash: u64) -> Result<Vec<u64>> {
    let mut all = vec![0i64; comm.world_size()];
    let rank = comm.rank();
    comm.all_gather(&[hash as i64], &mut all)
        .map_err(|source| Error::Comm {
            rank,
            what: "all_gather of parameter hashes".into(),
            source: Box::new(source),
        })?;
    Ok(all.into_iter().map(|h| h as u64).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_sees_every_bit_and_the_length() {
        let a = [1.0f32, 2.0, 3.0];
        assert_eq!(hash_f32(&a), hash_f32(&[1.0, 2.0, 3.0]));
        assert_ne!(
            hash_f32(&a),
            hash_f32(&[1.0, 2.0, f32::from_bits(3.0f32.to_bits() ^ 1)])
        );
        assert_ne!(hash_f32(&[0.0]), hash_f32(&[-0.0]));
        assert_ne!(hash_f32(&[]), hash_f32(&[0.0]));
        assert_ne!(hash_f32(&[1.0, 2.0]), hash_f32(&[2.0, 1.0]));
    }
}
