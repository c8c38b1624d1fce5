//! The header every data message carries.
//!
//! Each chunk a rank writes into a peer's inbox slot starts with a 64-byte [`DataHeader`] and is
//! followed by its payload. The header carries the full [`Signature`] of the collective the
//! sender is running, so the receiver checks on the first message, at no extra round trip, that
//! both sides run the same collective with the same element type, operator, count and root.
//!
//! Layout (little-endian):
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 2 | magic `0x4753` ("GS") |
//! | 2 | 1 | version (1) |
//! | 3 | 1 | flags: bit 0 [`FLAG_CRC32C`] = checksum present, others 0 |
//! | 4 | 1 | collective code |
//! | 5 | 1 | data type code |
//! | 6 | 1 | reduction op code |
//! | 7 | 1 | reserved (0) |
//! | 8 | 8 | communicator id |
//! | 16 | 8 | sequence number |
//! | 24 | 8 | count (elements per rank, as passed by the caller) |
//! | 32 | 4 | root (or peer tag for send/recv) |
//! | 36 | 4 | message index within this collective, per sender and receiver |
//! | 40 | 4 | payload length in bytes |
//! | 44 | 4 | sender rank |
//! | 48 | 4 | CRC32C (Castagnoli) of the payload when [`FLAG_CRC32C`] is set, else 0 |
//! | 52 | 12 | reserved (0) |
//!
//! The checksum (`GRADSYNC_CHECKSUM=1`) covers the payload only: the header is already checked
//! field by field against the receiver's own signature, so a damaged header is refused anyway.
//! Without the flag no checksum is computed or checked, and the field stays 0.
//!
//! The view/repr split follows smoltcp: [`DataHeader`] is a typed view over bytes with
//! [`DataHeader::new_checked`], and [`DataHeaderRepr`] is the parsed form with
//! [`DataHeaderRepr::parse`] and [`DataHeaderRepr::emit`]. Parsing never panics on peer input.

use crate::{Collective, DataType, ReduceOp};
use std::fmt;

/// Length of a [`DataHeader`] in bytes.
pub const DATA_HEADER_LEN: usize = 64;
/// Magic number at the start of every data header.
pub const MAGIC: u16 = 0x4753;
/// Wire version of the data header.
pub const VERSION: u8 = 1;
/// Flag bit: the header carries the CRC32C of the payload at offset 48.
pub const FLAG_CRC32C: u8 = 0x01;

/// Errors of parsing peer bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than a header needs.
    #[error("truncated data header: {got} bytes, need {need}")]
    Truncated {
        /// Bytes available.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The magic number is wrong: not a gradsync data message.
    #[error("bad magic 0x{0:04x} in data header")]
    BadMagic(u16),
    /// Unsupported version.
    #[error("unsupported data header version {0}")]
    BadVersion(u8),
    /// A code field holds an unknown value.
    #[error("bad field in data header: {0}")]
    BadField(#[from] crate::TypeError),
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

/// A typed view over the bytes of a data header.
#[derive(Debug, Clone)]
pub struct DataHeader<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    use std::ops::Range;
    pub const MAGIC: Range<usize> = 0..2;
    pub const VERSION: usize = 2;
    pub const FLAGS: usize = 3;
    pub const COLL: usize = 4;
    pub const DTYPE: usize = 5;
    pub const OP: usize = 6;
    pub const COMM: Range<usize> = 8..16;
    pub const SEQ: Range<usize> = 16..24;
    pub const COUNT: Range<usize> = 24..32;
    pub const ROOT: Range<usize> = 32..36;
    pub const MSG: Range<usize> = 36..40;
    pub const LEN: Range<usize> = 40..44;
    pub const SENDER: Range<usize> = 44..48;
    pub const CRC32C: Range<usize> = 48..52;
}

fn rd<const N: usize>(b: &[u8], r: std::ops::Range<usize>) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[r]);
    a
}

impl<T: AsRef<[u8]>> DataHeader<T> {
    /// Wraps bytes without checking their length.
    pub const fn new_unchecked(buffer: T) -> Self {
        DataHeader { buffer }
    }

    /// Wraps bytes after [`check_len`](Self::check_len).
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let h = Self::new_unchecked(buffer);
        h.check_len()?;
        Ok(h)
    }

    /// Checks that the accessors will not panic.
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        if got < DATA_HEADER_LEN {
            Err(WireError::Truncated {
                got,
                need: DATA_HEADER_LEN,
            })
        } else {
            Ok(())
        }
    }

    /// Magic number.
    pub fn magic(&self) -> u16 {
        u16::from_le_bytes(rd(self.buffer.as_ref(), field::MAGIC))
    }
    /// Version.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }
    /// Flags.
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    /// Collective code.
    pub fn coll(&self) -> u8 {
        self.buffer.as_ref()[field::COLL]
    }
    /// Data type code.
    pub fn dtype(&self) -> u8 {
        self.buffer.as_ref()[field::DTYPE]
    }
    /// Operator code.
    pub fn op(&self) -> u8 {
        self.buffer.as_ref()[field::OP]
    }
    /// Communicator id.
    pub fn comm_id(&self) -> u64 {
        u64::from_le_bytes(rd(self.buffer.as_ref(), field::COMM))
    }
    /// Sequence number.
    pub fn seq(&self) -> u64 {
        u64::from_le_bytes(rd(self.buffer.as_ref(), field::SEQ))
    }
    /// Count.
    pub fn count(&self) -> u64 {
        u64::from_le_bytes(rd(self.buffer.as_ref(), field::COUNT))
    }
    /// Root or tag.
    pub fn root(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::ROOT))
    }
    /// Message index.
    pub fn msg(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::MSG))
    }
    /// Payload length.
    pub fn payload_len(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::LEN))
    }
    /// Sender rank.
    pub fn sender(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::SENDER))
    }
    /// CRC32C of the payload (meaningful only when [`FLAG_CRC32C`] is set in the flags).
    pub fn crc32c(&self) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), field::CRC32C))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DataHeader<T> {
    fn put(&mut self, r: std::ops::Range<usize>, v: &[u8]) {
        self.buffer.as_mut()[r].copy_from_slice(v);
    }
}

/// Parsed form of a data header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHeaderRepr {
    /// The collective the sender runs.
    pub sig: Signature,
    /// Message index within the collective (per sender and receiver).
    pub msg: u32,
    /// Payload length in bytes.
    pub payload_len: u32,
    /// Sender rank.
    pub sender: u32,
    /// CRC32C of the payload, if the sender computed one ([`FLAG_CRC32C`]).
    pub crc32c: Option<u32>,
}

impl DataHeaderRepr {
    /// Parses a checked header.
    pub fn parse<T: AsRef<[u8]>>(h: &DataHeader<T>) -> Result<Self, WireError> {
        h.check_len()?;
        if h.magic() != MAGIC {
            return Err(WireError::BadMagic(h.magic()));
        }
        if h.version() != VERSION {
            return Err(WireError::BadVersion(h.version()));
        }
        Ok(DataHeaderRepr {
            sig: Signature {
                comm_id: h.comm_id(),
                seq: h.seq(),
                coll: Collective::from_code(h.coll())?,
                dtype: DataType::from_code(h.dtype())?,
                op: ReduceOp::from_code(h.op())?,
                count: h.count(),
                root: h.root(),
            },
            msg: h.msg(),
            payload_len: h.payload_len(),
            sender: h.sender(),
            crc32c: (h.flags() & FLAG_CRC32C != 0).then(|| h.crc32c()),
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        DATA_HEADER_LEN
    }

    /// Writes the header; every byte of the first [`DATA_HEADER_LEN`] is written.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter than [`DATA_HEADER_LEN`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut DataHeader<T>) {
        h.buffer.as_mut()[..DATA_HEADER_LEN].fill(0);
        h.put(field::MAGIC, &MAGIC.to_le_bytes());
        h.buffer.as_mut()[field::VERSION] = VERSION;
        h.buffer.as_mut()[field::FLAGS] = if self.crc32c.is_some() {
            FLAG_CRC32C
        } else {
            0
        };
        h.buffer.as_mut()[field::COLL] = self.sig.coll as u8;
        h.buffer.as_mut()[field::DTYPE] = self.sig.dtype as u8;
        h.buffer.as_mut()[field::OP] = self.sig.op as u8;
        h.put(field::COMM, &self.sig.comm_id.to_le_bytes());
        h.put(field::SEQ, &self.sig.seq.to_le_bytes());
        h.put(field::COUNT, &self.sig.count.to_le_bytes());
        h.put(field::ROOT, &self.sig.root.to_le_bytes());
        h.put(field::MSG, &self.msg.to_le_bytes());
        h.put(field::LEN, &self.payload_len.to_le_bytes());
        h.put(field::SENDER, &self.sender.to_le_bytes());
        if let Some(crc) = self.crc32c {
            h.put(field::CRC32C, &crc.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static BYTES: [u8; 64] = [
        0x53, 0x47, 0x01, 0x00, 0x00, 0x02, 0x04,
        0x00, // magic, version, flags, coll, dtype, op
        0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // comm id
        0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // seq 42
        0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // count 1000
        0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, // root 0, msg 5
        0x00, 0x01, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, // len 256, sender 3
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];

    fn repr() -> DataHeaderRepr {
        DataHeaderRepr {
            sig: Signature {
                comm_id: 0x0102030405060708,
                seq: 42,
                coll: Collective::AllReduce,
                dtype: DataType::F16,
                op: ReduceOp::Avg,
                count: 1000,
                root: 0,
            },
            msg: 5,
            payload_len: 256,
            sender: 3,
            crc32c: None,
        }
    }

    /// [`BYTES`] with a checksum: flag bit 0 set, CRC32C 0xe3069283 at offset 48.
    static BYTES_CRC: [u8; 64] = [
        0x53, 0x47, 0x01, 0x01, 0x00, 0x02, 0x04,
        0x00, // magic, version, flags (crc32c), coll, dtype, op
        0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // comm id
        0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // seq 42
        0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // count 1000
        0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, // root 0, msg 5
        0x00, 0x01, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, // len 256, sender 3
        0x83, 0x92, 0x06, 0xe3, 0, 0, 0, 0, // crc32c, reserved
        0, 0, 0, 0, 0, 0, 0, 0,
    ];

    fn repr_crc() -> DataHeaderRepr {
        DataHeaderRepr {
            crc32c: Some(0xe306_9283),
            ..repr()
        }
    }

    #[test]
    fn emit_literal_with_checksum() {
        let mut buf = [0xffu8; 64];
        repr_crc().emit(&mut DataHeader::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES_CRC);
    }

    #[test]
    fn parse_literal_with_checksum() {
        let h = DataHeader::new_checked(&BYTES_CRC[..]).unwrap();
        assert_eq!(h.flags(), FLAG_CRC32C);
        assert_eq!(h.crc32c(), 0xe306_9283);
        assert_eq!(DataHeaderRepr::parse(&h).unwrap(), repr_crc());
    }

    #[test]
    fn checksum_field_ignored_without_flag() {
        // A value at offset 48 without the flag bit is reserved space, not a checksum.
        let mut b = BYTES_CRC;
        b[3] = 0;
        let h = DataHeader::new_checked(&b[..]).unwrap();
        assert_eq!(DataHeaderRepr::parse(&h).unwrap().crc32c, None);
    }

    #[test]
    fn emit_literal() {
        let mut buf = [0xffu8; 64];
        repr().emit(&mut DataHeader::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn parse_literal() {
        let h = DataHeader::new_checked(&BYTES[..]).unwrap();
        assert_eq!(DataHeaderRepr::parse(&h).unwrap(), repr());
    }

    #[test]
    fn parse_rejects_bad_input() {
        assert!(matches!(
            DataHeader::new_checked(&BYTES[..63]),
            Err(WireError::Truncated { got: 63, need: 64 })
        ));
        let mut b = BYTES;
        b[0] = 0;
        let h = DataHeader::new_unchecked(&b[..]);
        assert!(matches!(
            DataHeaderRepr::parse(&h),
            Err(WireError::BadMagic(_))
        ));
        let mut b = BYTES;
        b[5] = 99;
        let h = DataHeader::new_unchecked(&b[..]);
        assert!(matches!(
            DataHeaderRepr::parse(&h),
            Err(WireError::BadField(_))
        ));
    }

    #[test]
    fn parse_never_panics_on_garbage() {
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for len in 0..200 {
            let mut b = vec![0u8; len % 80];
            for v in b.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *v = x as u8;
            }
            if len % 3 == 0 && b.len() >= 3 {
                b[0] = 0x53;
                b[1] = 0x47;
                b[2] = 1;
            }
            let h = DataHeader::new_unchecked(&b[..]);
            let _ = DataHeaderRepr::parse(&h);
        }
    }

    #[test]
    fn signature_display() {
        let s = repr().sig;
        assert_eq!(s.to_string(), "all_reduce seq 42 half avg count 1000");
    }
}
