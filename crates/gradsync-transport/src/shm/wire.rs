//! The bytes the shared-memory backend reads from a peer: the segment descriptor published
//! through the store ([`ShmInfo`], [`ShmInfoView`]), the header of every ring record
//! ([`RecordHeader`], [`RecordRepr`]) and the header of a board slot ([`SlotHeader`],
//! [`SlotHeaderRepr`]).
//!
//! Each is a typed view over bytes with a parsed form that parses without ever panicking and
//! emits canonical bytes. Where the other fields of a segment live is
//! the `layout` module's business.
//!
//! # Segment descriptor
//!
//! Exactly 24 bytes, little-endian:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 4 | process id |
//! | 4 | 4 | descriptor of the segment in that process |
//! | 8 | 8 | length of the segment |
//! | 16 | 8 | nonce (checked against the segment's header) |
//!
//! # Ring record header
//!
//! 32 bytes, little-endian, at an 8-byte aligned ring offset; the payload of a send or an
//! inline write follows it:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 4 | record length in ring bytes: header and payload, rounded up to a multiple of 8 |
//! | 4 | 1 | kind: 1 padding, 2 send, 3 inline write, 4 write notification |
//! | 5 | 1 | flags: bit 0 [`FLAG_IMM`] = the immediate is present, others 0 |
//! | 6 | 2 | reserved (0, not checked) |
//! | 8 | 4 | immediate value |
//! | 12 | 4 | remote key (writes) |
//! | 16 | 8 | offset in the region (writes) |
//! | 24 | 4 | payload length (for a write notification: the bytes written) |
//! | 28 | 4 | reserved (0, not checked) |
//!
//! A padding record consists of its first 8 bytes only (length and kind): it fills the ring
//! up to its end, and the next record starts at ring offset 0. A send carries at most
//! [`MAX_SEND`] payload bytes, an inline write at most [`INLINE_MAX`]; a write notification
//! is the header alone (its data is already in place).
//!
//! # Board slot header
//!
//! 24 bytes in the poster's native byte order (the fields are atomics shared by the processes
//! of one host):
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 8 | sequence number of the posting (0 while it is being written) |
//! | 8 | 4 | length of the posting, at most [`BOARD_CAPACITY`] |
//! | 12 | 4 | unused |
//! | 16 | 8 | the poster's release mark |
//!
//! The posting's data follows in three parts. Its head (the first [`BOARD_HEAD`] bytes: the
//! caller's header) has a cache line of its own at offset [`SLOT_HEAD`], rewritten only when
//! it differs from what the slot holds; the next [`SLOT_INLINE`] bytes share the first line
//! with the header (offset [`SLOT_HEADER_LEN`]); the rest starts at [`SLOT_REST`]. A small
//! posting whose head repeats the slot's earlier one (a loop of equal calls) thus changes one
//! line, and a reader that kept the head line in its cache fetches one.

use crate::verbs::MAX_SEND;
use crate::wire::{WireError, array, put, wire_view};

/// Largest write whose payload travels inside the ring record; larger writes are copied into
/// place by the writer (`memcpy` into a shared allocation, or `process_vm_writev`).
pub const INLINE_MAX: usize = 4096;

/// Largest board posting, in bytes: 16 KiB and a 64-byte header of the caller's.
pub const BOARD_CAPACITY: usize = 16 * 1024 + 64;

/// Length of a record header.
pub const RECORD_HEADER_LEN: usize = 32;
/// Length of the part of a record header every record has (a padding record has no more).
pub const RECORD_PREFIX_LEN: usize = 8;

/// Record kind: padding up to the end of the ring.
pub const KIND_PAD: u8 = 1;
/// Record kind: a two-sided message.
pub const KIND_SEND: u8 = 2;
/// Record kind: a write whose payload follows the header.
pub const KIND_WRITE_INLINE: u8 = 3;
/// Record kind: the notification of a write whose data is already in place.
pub const KIND_WRITE_NOTIFY: u8 = 4;
/// Record flag: the immediate is present.
pub const FLAG_IMM: u8 = 1;

/// Offset of the sequence number in a board slot.
pub const SLOT_SEQ: usize = 0;
/// Offset of the posting's length in a board slot.
pub const SLOT_LEN: usize = 8;
/// Offset of the poster's release mark in a board slot.
pub const SLOT_MARK: usize = 16;
/// Length of a board slot header: the posting's data after its head starts here.
pub const SLOT_HEADER_LEN: usize = 24;
/// Bytes at the start of a posting that make its head (the caller's header), kept on a line
/// of their own.
pub const BOARD_HEAD: usize = 64;
/// Bytes of a posting after its head that share the first line with the slot header.
pub const SLOT_INLINE: usize = 64 - SLOT_HEADER_LEN;
/// Offset of a posting's head in a board slot.
pub const SLOT_HEAD: usize = 64;
/// Offset of the rest of a posting (after its head and the inline part) in a board slot.
pub const SLOT_REST: usize = SLOT_HEAD + BOARD_HEAD;

mod info_field {
    pub(super) const PID: usize = 0;
    pub(super) const FD: usize = 4;
    pub(super) const LEN: usize = 8;
    pub(super) const NONCE: usize = 16;
}

mod record_field {
    pub(super) const LEN: usize = 0;
    pub(super) const KIND: usize = 4;
    pub(super) const FLAGS: usize = 5;
    pub(super) const IMM: usize = 8;
    pub(super) const RKEY: usize = 12;
    pub(super) const OFFSET: usize = 16;
    pub(super) const DATA_LEN: usize = 24;
}

/// Ring bytes of a record with `data_len` payload bytes.
pub(crate) fn record_len(data_len: usize) -> usize {
    (RECORD_HEADER_LEN + data_len).next_multiple_of(8)
}

/// What a rank publishes through the rendezvous store so the other ranks of its host can map
/// its segment.
///
/// It is also the parsed form of a [`ShmInfoView`]: [`parse`](Self::parse),
/// [`emit`](Self::emit), and the store helpers [`to_bytes`](Self::to_bytes) and
/// [`from_bytes`](Self::from_bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmInfo {
    /// Process id of the rank.
    pub pid: u32,
    /// Descriptor of the segment in that process.
    pub fd: i32,
    /// Length of the segment in bytes.
    pub len: u64,
    /// Random value identifying the segment (checked against its header).
    pub nonce: u64,
}

wire_view! {
    /// A typed view over the bytes of a segment descriptor.
    ShmInfoView {
        /// The process id.
        pid, set_pid: u32 = info_field::PID;
        /// The descriptor number.
        fd, set_fd: i32 = info_field::FD;
        /// The segment's length.
        segment_len, set_segment_len: u64 = info_field::LEN;
        /// The nonce.
        nonce, set_nonce: u64 = info_field::NONCE;
    }
}

impl<T: AsRef<[u8]>> ShmInfoView<T> {
    /// Checks that the accessors will not panic: at least [`ShmInfo::ENCODED_LEN`] bytes.
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        if got < ShmInfo::ENCODED_LEN {
            return Err(WireError::Truncated {
                format: "segment descriptor",
                got,
                need: ShmInfo::ENCODED_LEN,
            });
        }
        Ok(())
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ShmInfoView<T> {}

impl ShmInfo {
    /// Length of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 24;

    /// Parses a descriptor, which must be exactly [`ENCODED_LEN`](Self::ENCODED_LEN) bytes
    /// (a whole store value).
    pub fn parse<T: AsRef<[u8]>>(v: &ShmInfoView<T>) -> Result<Self, WireError> {
        v.check_len()?;
        let got = v.buffer.as_ref().len();
        if got != Self::ENCODED_LEN {
            return Err(WireError::Length {
                format: "segment descriptor",
                got,
                expected: Self::ENCODED_LEN,
            });
        }
        Ok(ShmInfo {
            pid: v.pid(),
            fd: v.fd(),
            len: v.segment_len(),
            nonce: v.nonce(),
        })
    }

    /// Length of the emitted descriptor.
    pub const fn buffer_len(&self) -> usize {
        Self::ENCODED_LEN
    }

    /// Writes the descriptor into the first [`ENCODED_LEN`](Self::ENCODED_LEN) bytes.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, v: &mut ShmInfoView<T>) {
        v.set_pid(self.pid);
        v.set_fd(self.fd);
        v.set_segment_len(self.len);
        v.set_nonce(self.nonce);
    }

    /// Encodes as 24 bytes (for the rendezvous store).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        self.emit(&mut ShmInfoView::new_unchecked(&mut b[..]));
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes); `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        Self::parse(&ShmInfoView::new_unchecked(b)).ok()
    }
}

wire_view! {
    /// A typed view over the bytes of a ring record header.
    RecordHeader {
        /// The record length in ring bytes.
        record_len, set_record_len: u32 = record_field::LEN;
        /// The kind code.
        kind, set_kind: u8 = record_field::KIND;
        /// The flags.
        flags, set_flags: u8 = record_field::FLAGS;
        /// The immediate value (meaningful with [`FLAG_IMM`]).
        imm, set_imm: u32 = record_field::IMM;
        /// The remote key.
        rkey, set_rkey: u32 = record_field::RKEY;
        /// The offset in the region.
        offset, set_offset: u64 = record_field::OFFSET;
    }
}

impl<T: AsRef<[u8]>> RecordHeader<T> {
    /// Checks that the accessors will not panic: [`RECORD_PREFIX_LEN`] bytes for a padding
    /// record, [`RECORD_HEADER_LEN`] for any other.
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        let need = if got >= RECORD_PREFIX_LEN && self.kind() == KIND_PAD {
            RECORD_PREFIX_LEN
        } else {
            RECORD_HEADER_LEN
        };
        if got < need {
            return Err(WireError::Truncated {
                format: "record header",
                got,
                need,
            });
        }
        Ok(())
    }

    /// The payload length.
    pub fn data_len(&self) -> u32 {
        u32::from_le_bytes(array(self.buffer.as_ref(), record_field::DATA_LEN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RecordHeader<T> {
    /// Sets the payload length.
    pub fn set_data_len(&mut self, v: u32) {
        put(
            self.buffer.as_mut(),
            record_field::DATA_LEN,
            &v.to_le_bytes(),
        );
    }
}

/// Parsed form of a ring record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordRepr {
    /// Fills the ring from here to its end.
    Padding {
        /// Ring bytes it fills.
        len: u32,
    },
    /// A two-sided message of `data_len` bytes, which follow the header.
    Send {
        /// Payload length.
        data_len: u32,
    },
    /// A write of `data_len` bytes, which follow the header, at `offset` into region `rkey`.
    WriteInline {
        /// The target region's key.
        rkey: u32,
        /// Offset in the region.
        offset: u64,
        /// The immediate, if the write carries one.
        imm: Option<u32>,
        /// Payload length.
        data_len: u32,
    },
    /// The notification of a write of `data_len` bytes at `offset` into region `rkey` that the
    /// writer already put in place.
    WriteNotify {
        /// The target region's key.
        rkey: u32,
        /// Offset in the region.
        offset: u64,
        /// The immediate, if the write carries one.
        imm: Option<u32>,
        /// Bytes written.
        data_len: u32,
    },
}

impl RecordRepr {
    /// Parses a record header. The checks, in order: a length of at least 8 bytes and a
    /// multiple of 8; padding needs nothing more; any other record at least a whole header,
    /// known flags, a known kind, and a length that fits the kind (the payload of a send at
    /// most [`MAX_SEND`], of an inline write at most [`INLINE_MAX`] bytes and the record
    /// exactly header and payload; a notification exactly a header). Reserved bytes are not
    /// checked. Whether the record fits the ring is the reader's business.
    pub fn parse<T: AsRef<[u8]>>(h: &RecordHeader<T>) -> Result<Self, WireError> {
        let got = h.buffer.as_ref().len();
        if got < RECORD_PREFIX_LEN {
            return Err(WireError::Truncated {
                format: "record header",
                got,
                need: RECORD_PREFIX_LEN,
            });
        }
        let (len, kind) = (h.record_len(), h.kind());
        if (len as usize) < RECORD_PREFIX_LEN || !len.is_multiple_of(8) {
            return Err(WireError::RecordLength { len, kind });
        }
        if kind == KIND_PAD {
            return Ok(RecordRepr::Padding { len });
        }
        if (len as usize) < RECORD_HEADER_LEN {
            return Err(WireError::RecordLength { len, kind });
        }
        h.check_len()?;
        let flags = h.flags();
        if flags & !FLAG_IMM != 0 {
            return Err(WireError::UnknownFlags {
                format: "record",
                flags,
            });
        }
        let imm = (flags & FLAG_IMM != 0).then(|| h.imm());
        let data_len = h.data_len();
        let fits =
            |max: usize| data_len as usize <= max && len as usize == record_len(data_len as usize);
        match kind {
            KIND_SEND if fits(MAX_SEND) => Ok(RecordRepr::Send { data_len }),
            KIND_WRITE_INLINE if fits(INLINE_MAX) => Ok(RecordRepr::WriteInline {
                rkey: h.rkey(),
                offset: h.offset(),
                imm,
                data_len,
            }),
            KIND_WRITE_NOTIFY if len as usize == RECORD_HEADER_LEN => Ok(RecordRepr::WriteNotify {
                rkey: h.rkey(),
                offset: h.offset(),
                imm,
                data_len,
            }),
            KIND_SEND | KIND_WRITE_INLINE | KIND_WRITE_NOTIFY => Err(WireError::RecordPayload {
                kind,
                data_len,
                len,
            }),
            _ => Err(WireError::UnknownKind {
                format: "record",
                kind,
            }),
        }
    }

    /// Ring bytes of the record: its header and the payload that follows it.
    pub fn record_len(&self) -> usize {
        match *self {
            RecordRepr::Padding { len } => len as usize,
            RecordRepr::Send { data_len } | RecordRepr::WriteInline { data_len, .. } => {
                record_len(data_len as usize)
            }
            RecordRepr::WriteNotify { .. } => RECORD_HEADER_LEN,
        }
    }

    /// Length of the emitted header: [`RECORD_PREFIX_LEN`] for padding, else
    /// [`RECORD_HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        match self {
            RecordRepr::Padding { .. } => RECORD_PREFIX_LEN,
            _ => RECORD_HEADER_LEN,
        }
    }

    /// Writes the header: every byte of the first [`buffer_len`](Self::buffer_len), the
    /// fields a kind does not use 0.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut RecordHeader<T>) {
        h.buffer.as_mut()[..self.buffer_len()].fill(0);
        h.set_record_len(self.record_len() as u32);
        let (kind, rkey, offset, imm, data_len) = match *self {
            RecordRepr::Padding { .. } => {
                h.set_kind(KIND_PAD);
                return;
            }
            RecordRepr::Send { data_len } => (KIND_SEND, 0, 0, None, data_len),
            RecordRepr::WriteInline {
                rkey,
                offset,
                imm,
                data_len,
            } => (KIND_WRITE_INLINE, rkey, offset, imm, data_len),
            RecordRepr::WriteNotify {
                rkey,
                offset,
                imm,
                data_len,
            } => (KIND_WRITE_NOTIFY, rkey, offset, imm, data_len),
        };
        h.set_kind(kind);
        h.set_flags(if imm.is_some() { FLAG_IMM } else { 0 });
        h.set_imm(imm.unwrap_or(0));
        h.set_rkey(rkey);
        h.set_offset(offset);
        h.set_data_len(data_len);
    }

    /// The emitted header in a [`RECORD_HEADER_LEN`]-byte array (zeros after a padding
    /// record's prefix).
    pub fn to_bytes(&self) -> [u8; RECORD_HEADER_LEN] {
        let mut b = [0u8; RECORD_HEADER_LEN];
        self.emit(&mut RecordHeader::new_unchecked(&mut b[..]));
        b
    }
}

wire_view! {
    /// A typed view over the bytes of a board slot header (native byte order).
    SlotHeader {
    }
}

impl<T: AsRef<[u8]>> SlotHeader<T> {
    /// Checks that the accessors will not panic: at least [`SLOT_HEADER_LEN`] bytes.
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        if got < SLOT_HEADER_LEN {
            return Err(WireError::Truncated {
                format: "board slot header",
                got,
                need: SLOT_HEADER_LEN,
            });
        }
        Ok(())
    }

    /// The posting's sequence number.
    pub fn seq(&self) -> u64 {
        u64::from_ne_bytes(array(self.buffer.as_ref(), SLOT_SEQ))
    }

    /// The posting's length.
    pub fn data_len(&self) -> u32 {
        u32::from_ne_bytes(array(self.buffer.as_ref(), SLOT_LEN))
    }

    /// The poster's release mark.
    pub fn mark(&self) -> u64 {
        u64::from_ne_bytes(array(self.buffer.as_ref(), SLOT_MARK))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> SlotHeader<T> {
    /// Sets the sequence number.
    pub fn set_seq(&mut self, v: u64) {
        put(self.buffer.as_mut(), SLOT_SEQ, &v.to_ne_bytes());
    }

    /// Sets the posting's length.
    pub fn set_data_len(&mut self, v: u32) {
        put(self.buffer.as_mut(), SLOT_LEN, &v.to_ne_bytes());
    }

    /// Sets the release mark.
    pub fn set_mark(&mut self, v: u64) {
        put(self.buffer.as_mut(), SLOT_MARK, &v.to_ne_bytes());
    }
}

/// Parsed form of a board slot header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHeaderRepr {
    /// The posting's sequence number.
    pub seq: u64,
    /// The posting's length, at most [`BOARD_CAPACITY`].
    pub data_len: u32,
    /// The poster's release mark.
    pub mark: u64,
}

impl SlotHeaderRepr {
    /// Parses a slot header: the posting must fit the board.
    pub fn parse<T: AsRef<[u8]>>(h: &SlotHeader<T>) -> Result<Self, WireError> {
        h.check_len()?;
        let data_len = h.data_len();
        if data_len as usize > BOARD_CAPACITY {
            return Err(WireError::TooLong {
                format: "board posting",
                len: u64::from(data_len),
                max: BOARD_CAPACITY as u64,
            });
        }
        Ok(SlotHeaderRepr {
            seq: h.seq(),
            data_len,
            mark: h.mark(),
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        SLOT_HEADER_LEN
    }

    /// Writes the header: every byte of the first [`SLOT_HEADER_LEN`], the unused ones 0.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut SlotHeader<T>) {
        h.buffer.as_mut()[..SLOT_HEADER_LEN].fill(0);
        h.set_seq(self.seq);
        h.set_data_len(self.data_len);
        h.set_mark(self.mark);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn shm_info_literal() {
        let bytes = [
            0x4d, 0x00, 0x00, 0x00, // pid 77
            0xfd, 0xff, 0xff, 0xff, // fd -3
            0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, // len 1 << 40
            0x0d, 0xf0, 0xad, 0x0b, 0xef, 0xbe, 0xad, 0xde, // nonce
        ];
        let i = ShmInfo {
            pid: 77,
            fd: -3,
            len: 1 << 40,
            nonce: 0xdead_beef_0bad_f00d,
        };
        assert_eq!(i.to_bytes(), bytes);
        let v = ShmInfoView::new_checked(&bytes[..]).unwrap();
        assert_eq!(
            (v.pid(), v.fd(), v.segment_len(), v.nonce()),
            (77, -3, 1 << 40, 0xdead_beef_0bad_f00d)
        );
        assert_eq!(ShmInfo::parse(&v), Ok(i));
        assert_eq!(ShmInfo::from_bytes(&bytes), Some(i));
        assert_eq!(ShmInfo::from_bytes(&bytes[1..]), None);
        let mut long = bytes.to_vec();
        long.push(0);
        assert!(matches!(
            ShmInfo::parse(&ShmInfoView::new_unchecked(&long[..])),
            Err(WireError::Length { got: 25, .. })
        ));
    }

    /// An inline write of 5 bytes with immediate 0x11223344 at offset 0x1000 into key 0xabcd.
    static INLINE: [u8; 32] = [
        0x28, 0x00, 0x00, 0x00, // record length 40
        0x03, 0x01, 0x00, 0x00, // kind 3, immediate present
        0x44, 0x33, 0x22, 0x11, // immediate
        0xcd, 0xab, 0x00, 0x00, // rkey
        0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // offset
        0x05, 0x00, 0x00, 0x00, // payload length 5
        0x00, 0x00, 0x00, 0x00,
    ];

    /// A notification of a 1 MiB write without immediate at offset 8 into key 7.
    static NOTIFY: [u8; 32] = [
        0x20, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, // length 32, kind 4
        0x00, 0x00, 0x00, 0x00, 0x07, 0x00, 0x00, 0x00, // no immediate, rkey 7
        0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // offset 8
        0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, // 1 MiB written
    ];

    /// A send of 4096 bytes (a record of 4128 ring bytes).
    static SEND: [u8; 32] = [
        0x20, 0x10, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, // length 4128, kind 2
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // unused
        0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // payload 4096
    ];

    /// Padding of 0x3f8 bytes: only the 8-byte prefix.
    static PAD: [u8; 8] = [0xf8, 0x03, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00];

    #[test]
    fn record_header_literals() {
        let cases: [(&[u8], RecordRepr); 4] = [
            (
                &INLINE,
                RecordRepr::WriteInline {
                    rkey: 0xabcd,
                    offset: 0x1000,
                    imm: Some(0x1122_3344),
                    data_len: 5,
                },
            ),
            (
                &NOTIFY,
                RecordRepr::WriteNotify {
                    rkey: 7,
                    offset: 8,
                    imm: None,
                    data_len: 1 << 20,
                },
            ),
            (&SEND, RecordRepr::Send { data_len: 4096 }),
            (&PAD, RecordRepr::Padding { len: 0x3f8 }),
        ];
        for (bytes, repr) in cases {
            let v = RecordHeader::new_checked(bytes).unwrap();
            assert_eq!(RecordRepr::parse(&v), Ok(repr), "{bytes:02x?}");
            assert_eq!(repr.buffer_len(), bytes.len());
            let mut out = [0xa5u8; RECORD_HEADER_LEN];
            repr.emit(&mut RecordHeader::new_unchecked(&mut out[..]));
            assert_eq!(&out[..bytes.len()], bytes);
        }
        assert_eq!(RecordRepr::Send { data_len: 4096 }.record_len(), 4128);
        assert_eq!(
            RecordRepr::WriteInline {
                rkey: 0,
                offset: 0,
                imm: None,
                data_len: 5
            }
            .record_len(),
            40
        );
        let v = RecordHeader::new_unchecked(&INLINE[..]);
        assert_eq!(
            (
                v.record_len(),
                v.kind(),
                v.flags(),
                v.imm(),
                v.rkey(),
                v.offset(),
                v.data_len()
            ),
            (40, 3, 1, 0x1122_3344, 0xabcd, 0x1000, 5)
        );
    }

    #[test]
    fn record_header_rejects() {
        let parse = |b: &[u8]| RecordRepr::parse(&RecordHeader::new_unchecked(b));
        assert!(RecordHeader::new_checked(&INLINE[..31]).is_err());
        assert!(RecordHeader::new_checked(&PAD[..7]).is_err());
        let mut b = INLINE;
        b[0] = 12;
        assert_eq!(
            parse(&b).unwrap_err().to_string(),
            "record of 12 bytes of kind 3"
        );
        b[0] = 24;
        assert_eq!(
            parse(&b).unwrap_err().to_string(),
            "record of 24 bytes of kind 3"
        );
        let mut b = INLINE;
        b[5] = 3;
        assert_eq!(
            parse(&b).unwrap_err().to_string(),
            "record with unknown flags 0x03"
        );
        let mut b = INLINE;
        b[4] = 99;
        assert_eq!(parse(&b).unwrap_err().to_string(), "unknown record kind 99");
        let mut b = INLINE;
        b[24] = 9;
        assert_eq!(
            parse(&b).unwrap_err().to_string(),
            "record of kind 3 with 9 payload bytes in 40 bytes"
        );
        let mut b = SEND;
        b[24..28].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(matches!(
            parse(&b),
            Err(WireError::RecordPayload {
                data_len: 100_000,
                ..
            })
        ));
        let mut b = NOTIFY;
        b[0] = 40;
        assert!(matches!(
            parse(&b),
            Err(WireError::RecordPayload { kind: 4, .. })
        ));
    }

    #[test]
    fn board_slot_header_literal() {
        let repr = SlotHeaderRepr {
            seq: 0x0102_0304_0506_0708,
            data_len: 300,
            mark: 41,
        };
        let mut bytes = [0u8; 24];
        bytes[..8].copy_from_slice(&0x0102_0304_0506_0708u64.to_ne_bytes());
        bytes[8..12].copy_from_slice(&300u32.to_ne_bytes());
        bytes[16..].copy_from_slice(&41u64.to_ne_bytes());
        if cfg!(target_endian = "little") {
            assert_eq!(
                bytes,
                [
                    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, 0x2c, 0x01, 0, 0, 0, 0, 0, 0,
                    41, 0, 0, 0, 0, 0, 0, 0
                ]
            );
        }
        let mut out = [0xa5u8; 24];
        repr.emit(&mut SlotHeader::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        let v = SlotHeader::new_checked(&bytes[..]).unwrap();
        assert_eq!((v.seq(), v.data_len(), v.mark()), (repr.seq, 300, 41));
        assert_eq!(SlotHeaderRepr::parse(&v), Ok(repr));
        bytes[8..12].copy_from_slice(&(BOARD_CAPACITY as u32 + 1).to_ne_bytes());
        let e = SlotHeaderRepr::parse(&SlotHeader::new_unchecked(&bytes[..])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "board posting of 16449 bytes (at most 16448)"
        );
        assert!(SlotHeader::new_checked(&bytes[..23]).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn fuzz_shm_info_parse(b in proptest::collection::vec(any::<u8>(), 0..32)) {
            let r = ShmInfo::parse(&ShmInfoView::new_unchecked(&b[..]));
            prop_assert_eq!(r.is_ok(), b.len() == ShmInfo::ENCODED_LEN);
            if let Ok(i) = r {
                prop_assert_eq!(&i.to_bytes()[..], &b[..]);
            }
        }

        #[test]
        fn fuzz_shm_info_round_trip(pid: u32, fd: i32, len: u64, nonce: u64) {
            let i = ShmInfo { pid, fd, len, nonce };
            prop_assert_eq!(ShmInfo::from_bytes(&i.to_bytes()), Some(i));
        }

        #[test]
        fn fuzz_record_header_parse(
            mut b in proptest::collection::vec(any::<u8>(), 0..40),
            kind in 0u8..6,
            len in 0u32..5000,
        ) {
            // Half the inputs get a plausible kind and length, so that parsing goes deep.
            if b.len() >= RECORD_PREFIX_LEN && len % 2 == 0 {
                b[4] = kind;
                b[..4].copy_from_slice(&(len & !7).to_le_bytes());
            }
            if let Ok(r) = RecordRepr::parse(&RecordHeader::new_unchecked(&b[..])) {
                // What parses re-emits the fields it read.
                let out = r.to_bytes();
                prop_assert_eq!(&out[..5], &b[..5]);
                prop_assert_eq!(r.record_len(), u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
                if r.buffer_len() == RECORD_HEADER_LEN {
                    prop_assert_eq!(&out[24..28], &b[24..28]);
                }
            }
        }

        #[test]
        fn fuzz_record_header_round_trip(
            which in 0u8..4, rkey: u32, offset: u64, imm in any::<Option<u32>>(),
            data_len in 0u32..=4096, pad in 1u32..32768,
        ) {
            let r = match which {
                0 => RecordRepr::Padding { len: pad * 8 },
                1 => RecordRepr::Send { data_len },
                2 => RecordRepr::WriteInline { rkey, offset, imm, data_len },
                _ => RecordRepr::WriteNotify { rkey, offset, imm, data_len: data_len.wrapping_mul(977) },
            };
            let b = r.to_bytes();
            prop_assert_eq!(RecordRepr::parse(&RecordHeader::new_unchecked(&b[..r.buffer_len()])), Ok(r));
        }

        #[test]
        fn fuzz_board_slot_header_parse(b in proptest::collection::vec(any::<u8>(), 0..32)) {
            if let Ok(h) = SlotHeaderRepr::parse(&SlotHeader::new_unchecked(&b[..])) {
                prop_assert!(h.data_len as usize <= BOARD_CAPACITY);
                let mut out = [0u8; SLOT_HEADER_LEN];
                h.emit(&mut SlotHeader::new_unchecked(&mut out[..]));
                prop_assert_eq!(&out[..12], &b[..12]);
                prop_assert_eq!(&out[16..], &b[16..SLOT_HEADER_LEN]);
            }
        }

        #[test]
        fn fuzz_board_slot_header_round_trip(
            seq: u64, data_len in 0u32..=BOARD_CAPACITY as u32, mark: u64
        ) {
            let h = SlotHeaderRepr { seq, data_len, mark };
            let mut b = [0u8; SLOT_HEADER_LEN];
            h.emit(&mut SlotHeader::new_unchecked(&mut b[..]));
            prop_assert_eq!(SlotHeaderRepr::parse(&SlotHeader::new_unchecked(&b[..])), Ok(h));
        }
    }
}
