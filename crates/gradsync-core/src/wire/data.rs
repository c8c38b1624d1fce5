//! The header in front of every payload.
//!
//! A slot write into a peer's inbox, an eager all-reduce's two-sided message and a board
//! posting all start with a 64-byte [`DataHeader`] followed by the payload. The header carries
//! the full [`Signature`] of the collective the sender runs (bytes 4 to 36, in its one
//! encoding), so the receiver checks on the first message that both sides run the same call.
//!
//! Layout (little-endian):
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 2 | magic `0x4753` ("GS") |
//! | 2 | 1 | version (1) |
//! | 3 | 1 | flags: bit 0 [`FLAG_CRC32C`] = checksum present, others 0 |
//! | 4 | 32 | signature ([`super::signature`]) |
//! | 36 | 4 | message index within this collective, per sender and receiver |
//! | 40 | 4 | payload length in bytes |
//! | 44 | 4 | sender rank |
//! | 48 | 4 | CRC32C (Castagnoli) of the payload when [`FLAG_CRC32C`] is set, else 0 |
//! | 52 | 12 | reserved (0) |
//!
//! A board posting's header carries sequence number 0 in its signature
//! ([`DataHeader::set_seq`]): the board carries the number beside it.
//!
//! The checksum (`GRADSYNC_CHECKSUM=1`) covers the payload only: the header is already checked
//! field by field against the receiver's own signature, so a damaged header is refused anyway.
//! Without the flag no checksum is computed or checked, and the field stays 0.

use super::error::WireError;
use super::field::{need, rd};
use super::signature::{SIGNATURE_LEN, Signature};

/// Length of a [`DataHeader`] in bytes.
pub const DATA_HEADER_LEN: usize = 64;
/// Magic number at the start of every data header.
pub const MAGIC: u16 = 0x4753;
/// Wire version of the data header.
pub const VERSION: u8 = 1;
/// Flag bit: the header carries the CRC32C of the payload at offset 48.
pub const FLAG_CRC32C: u8 = 0x01;

mod field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 2;
    pub const FLAGS: usize = 3;
    pub const SIG: usize = 4;
    pub const MSG: usize = 36;
    pub const LEN: usize = 40;
    pub const SENDER: usize = 44;
    pub const CRC32C: usize = 48;
}

/// A typed view over the bytes of a data header.
#[derive(Debug, Clone)]
pub struct DataHeader<T: AsRef<[u8]>> {
    buffer: T,
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
        need("data header", self.buffer.as_ref(), DATA_HEADER_LEN)
    }

    fn u32_at(&self, at: usize) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), at))
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
    /// The encoded signature.
    pub fn signature(&self) -> &[u8] {
        &self.buffer.as_ref()[field::SIG..field::SIG + SIGNATURE_LEN]
    }
    /// Message index.
    pub fn msg(&self) -> u32 {
        self.u32_at(field::MSG)
    }
    /// Payload length.
    pub fn payload_len(&self) -> u32 {
        self.u32_at(field::LEN)
    }
    /// Sender rank.
    pub fn sender(&self) -> u32 {
        self.u32_at(field::SENDER)
    }
    /// CRC32C of the payload (meaningful only when [`FLAG_CRC32C`] is set in the flags).
    pub fn crc32c(&self) -> u32 {
        self.u32_at(field::CRC32C)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DataHeader<T> {
    /// Writes the signature field (every byte of it).
    pub fn set_signature(&mut self, sig: &Signature) {
        sig.emit(&mut self.buffer.as_mut()[field::SIG..field::SIG + SIGNATURE_LEN]);
    }
    /// Writes the payload length.
    pub fn set_payload_len(&mut self, len: u32) {
        self.buffer.as_mut()[field::LEN..field::LEN + 4].copy_from_slice(&len.to_le_bytes());
    }
    /// Writes the sender rank.
    pub fn set_sender(&mut self, rank: u32) {
        self.buffer.as_mut()[field::SENDER..field::SENDER + 4].copy_from_slice(&rank.to_le_bytes());
    }
    /// Writes the signature's sequence number alone. A board posting's header carries 0 there:
    /// the board carries the number beside the posting, so the header of a loop of equal
    /// calls repeats from one posting to the next. A reader writes back the number it read
    /// the posting under before it checks the header.
    pub fn set_seq(&mut self, seq: u64) {
        let at = field::SIG + super::signature::SEQ_AT;
        self.buffer.as_mut()[at..at + 8].copy_from_slice(&seq.to_le_bytes());
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
    /// The header as a board posting carries it: sequence number 0 ([`DataHeader::set_seq`]).
    pub fn for_board(mut self) -> Self {
        self.sig.seq = 0;
        self
    }

    /// Parses a header.
    pub fn parse<T: AsRef<[u8]>>(h: &DataHeader<T>) -> Result<Self, WireError> {
        h.check_len()?;
        if h.magic() != MAGIC {
            return Err(WireError::BadMagic(h.magic()));
        }
        if h.version() != VERSION {
            return Err(WireError::BadVersion(h.version()));
        }
        Ok(DataHeaderRepr {
            sig: Signature::parse(h.signature())?,
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
        let b = &mut h.buffer.as_mut()[..DATA_HEADER_LEN];
        b.fill(0);
        b[field::MAGIC..field::MAGIC + 2].copy_from_slice(&MAGIC.to_le_bytes());
        b[field::VERSION] = VERSION;
        b[field::FLAGS] = if self.crc32c.is_some() {
            FLAG_CRC32C
        } else {
            0
        };
        self.sig.emit(&mut b[field::SIG..]);
        let put = |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        put(b, field::MSG, self.msg);
        put(b, field::LEN, self.payload_len);
        put(b, field::SENDER, self.sender);
        put(b, field::CRC32C, self.crc32c.unwrap_or(0));
    }
}

/// Whether a two-sided message is a data message (an eager contribution) rather than a
/// control message: it starts with the data header's magic.
pub fn is_data(msg: &[u8]) -> bool {
    msg.len() >= 2 && u16::from_le_bytes([msg[0], msg[1]]) == MAGIC
}
