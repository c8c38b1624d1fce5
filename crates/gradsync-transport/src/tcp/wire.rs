//! The bytes of a TCP data connection: the hello a dialing rank opens each stream with
//! ([`Hello`]), the answer of its authentication handshake ([`HandshakeAnswer`]), and the header
//! of every frame after that ([`FrameHeader`]).
//!
//! All little-endian. Each is a typed view over bytes with a parsed form (`...Repr`) that
//! [`parse`](FrameHeaderRepr::parse)s without ever panicking and [`emit`](FrameHeaderRepr::emit)s
//! canonical bytes.
//!
//! # Frame header
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 1 | kind: 1 write, 2 write with immediate, 3 send, 4 part of a striped write |
//! | 1 | 1 | part number, from 0 (kind 4; 0 otherwise) |
//! | 2 | 1 | number of parts, at least 2 (kind 4; 0 otherwise) |
//! | 3 | 1 | reserved (0) |
//! | 4 | 4 | immediate value (write with immediate, part; ignored otherwise) |
//! | 8 | 4 | remote key (writes; ignored for a send) |
//! | 12 | 4 | payload length |
//! | 16 | 8 | offset in the remote region (writes; ignored for a send) |
//!
//! A striped write is a write with immediate cut into as many parts as the pair has streams,
//! part `i` on stream `i`: each part lands where its offset says, and the receiver completes
//! the write (one immediate, the length of all parts) once every part of it has landed (see
//! [the TCP transport's documentation](super)).
//!
//! # Hello
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 4 | magic [`HELLO_MAGIC`] (`"HTSG"` on the wire) |
//! | 4 | 2 | version ([`HELLO_VERSION`]) |
//! | 6 | 2 | reserved (0) |
//! | 8 | 8 | communicator id |
//! | 16 | 4 | the dialing rank |
//! | 20 | 2 | stream index |
//! | 22 | 2 | streams per peer |
//!
//! # Handshake answer
//!
//! The dialer's answer to the acceptor's challenge: its own nonce ([`NONCE_LEN`] bytes), then
//! its proof ([`PROOF_LEN`] bytes, an HMAC-SHA256 tag); see the [module
//! documentation](super#authentication).

use crate::wire::{WireError, array, put, wire_view};

/// Length of a [`FrameHeader`].
pub const FRAME_HEADER_LEN: usize = 24;
/// Length of a [`Hello`].
pub const HELLO_LEN: usize = 24;
/// Magic number of a hello (`"GSTH"` as a little-endian `u32`).
pub const HELLO_MAGIC: u32 = 0x4753_5448;
/// Version of the hello (and of the frames after it).
pub const HELLO_VERSION: u16 = 2;
/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a handshake proof.
pub const PROOF_LEN: usize = 32;
/// Length of a [`HandshakeAnswer`].
pub const ANSWER_LEN: usize = NONCE_LEN + PROOF_LEN;

/// Frame kind: a write without immediate.
pub const KIND_WRITE: u8 = 1;
/// Frame kind: a write with immediate.
pub const KIND_WRITE_IMM: u8 = 2;
/// Frame kind: a two-sided send.
pub const KIND_SEND: u8 = 3;
/// Frame kind: a part of a write with immediate striped over the streams of a pair.
pub const KIND_WRITE_PART: u8 = 4;

mod frame_field {
    pub(super) const KIND: usize = 0;
    pub(super) const RESERVED: usize = 1;
    pub(super) const IMM: usize = 4;
    pub(super) const RKEY: usize = 8;
    pub(super) const LEN: usize = 12;
    pub(super) const OFFSET: usize = 16;
}

mod hello_field {
    pub(super) const MAGIC: usize = 0;
    pub(super) const VERSION: usize = 4;
    pub(super) const RESERVED: usize = 6;
    pub(super) const COMM_ID: usize = 8;
    pub(super) const RANK: usize = 16;
    pub(super) const STREAM: usize = 20;
    pub(super) const NSOCKS: usize = 22;
}

fn check(format: &'static str, got: usize, need: usize) -> Result<(), WireError> {
    if got < need {
        return Err(WireError::Truncated { format, got, need });
    }
    Ok(())
}

wire_view! {
    /// A typed view over the bytes of a frame header.
    FrameHeader {
        /// The kind code.
        kind, set_kind: u8 = frame_field::KIND;
        /// The immediate value.
        imm, set_imm: u32 = frame_field::IMM;
        /// The remote key.
        rkey, set_rkey: u32 = frame_field::RKEY;
        /// The payload length.
        payload_len, set_payload_len: u32 = frame_field::LEN;
        /// The offset in the remote region.
        offset, set_offset: u64 = frame_field::OFFSET;
    }
}

impl<T: AsRef<[u8]>> FrameHeader<T> {
    /// Checks that the accessors will not panic: at least [`FRAME_HEADER_LEN`] bytes.
    pub fn check_len(&self) -> Result<(), WireError> {
        check("frame header", self.buffer.as_ref().len(), FRAME_HEADER_LEN)
    }

    /// The three reserved bytes, as a little-endian number.
    pub fn reserved(&self) -> u32 {
        let b = self.buffer.as_ref();
        let r = frame_field::RESERVED;
        u32::from_le_bytes([b[r], b[r + 1], b[r + 2], 0])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> FrameHeader<T> {
    /// Sets the reserved bytes (the low three bytes of `v`).
    pub fn set_reserved(&mut self, v: u32) {
        put(
            self.buffer.as_mut(),
            frame_field::RESERVED,
            &v.to_le_bytes()[..3],
        );
    }
}

/// Parsed form of a frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameHeaderRepr {
    /// A write of `len` bytes at `offset` into the region `rkey`; the payload follows.
    Write {
        /// The target region's key.
        rkey: u32,
        /// Offset in the region.
        offset: u64,
        /// Payload length.
        len: u32,
        /// The immediate, for a write with immediate.
        imm: Option<u32>,
    },
    /// A two-sided message of `len` bytes; the payload follows.
    Send {
        /// Payload length.
        len: u32,
    },
    /// Part `part` of `parts` of a write with immediate `imm`: `len` bytes at `offset` into the
    /// region `rkey`; the payload follows.
    WritePart {
        /// The target region's key.
        rkey: u32,
        /// Offset in the region of this part.
        offset: u64,
        /// This part's payload length.
        len: u32,
        /// The immediate of the whole write.
        imm: u32,
        /// This part's number, from 0.
        part: u8,
        /// The number of parts (at least 2).
        parts: u8,
    },
}

impl FrameHeaderRepr {
    /// Parses a header: the reserved bytes must be zero (a part's number and count apart) and
    /// the kind known. Fields a kind does not use are ignored.
    pub fn parse<T: AsRef<[u8]>>(h: &FrameHeader<T>) -> Result<Self, WireError> {
        h.check_len()?;
        let reserved = h.reserved();
        let allowed = if h.kind() == KIND_WRITE_PART {
            0xffff
        } else {
            0
        };
        if reserved & !allowed != 0 {
            return Err(WireError::Reserved {
                format: "frame header",
                found: u64::from(reserved & !allowed),
            });
        }
        match h.kind() {
            KIND_WRITE_PART => {
                let (part, parts) = (reserved as u8, (reserved >> 8) as u8);
                if parts < 2 || part >= parts {
                    return Err(WireError::BadPart {
                        format: "striped write",
                        part,
                        parts,
                    });
                }
                Ok(FrameHeaderRepr::WritePart {
                    rkey: h.rkey(),
                    offset: h.offset(),
                    len: h.payload_len(),
                    imm: h.imm(),
                    part,
                    parts,
                })
            }
            KIND_WRITE | KIND_WRITE_IMM => Ok(FrameHeaderRepr::Write {
                rkey: h.rkey(),
                offset: h.offset(),
                len: h.payload_len(),
                imm: (h.kind() == KIND_WRITE_IMM).then(|| h.imm()),
            }),
            KIND_SEND => Ok(FrameHeaderRepr::Send {
                len: h.payload_len(),
            }),
            kind => Err(WireError::UnknownKind {
                format: "frame",
                kind,
            }),
        }
    }

    /// Payload bytes after the header.
    pub const fn payload_len(&self) -> u32 {
        match *self {
            FrameHeaderRepr::Write { len, .. }
            | FrameHeaderRepr::Send { len }
            | FrameHeaderRepr::WritePart { len, .. } => len,
        }
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        FRAME_HEADER_LEN
    }

    /// Writes the header: every byte of the first [`FRAME_HEADER_LEN`], unused fields 0.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut FrameHeader<T>) {
        h.buffer.as_mut()[..FRAME_HEADER_LEN].fill(0);
        match *self {
            FrameHeaderRepr::Write {
                rkey,
                offset,
                len,
                imm,
            } => {
                h.set_kind(if imm.is_some() {
                    KIND_WRITE_IMM
                } else {
                    KIND_WRITE
                });
                h.set_imm(imm.unwrap_or(0));
                h.set_rkey(rkey);
                h.set_payload_len(len);
                h.set_offset(offset);
            }
            FrameHeaderRepr::Send { len } => {
                h.set_kind(KIND_SEND);
                h.set_payload_len(len);
            }
            FrameHeaderRepr::WritePart {
                rkey,
                offset,
                len,
                imm,
                part,
                parts,
            } => {
                h.set_kind(KIND_WRITE_PART);
                h.set_reserved(u32::from(part) | u32::from(parts) << 8);
                h.set_imm(imm);
                h.set_rkey(rkey);
                h.set_payload_len(len);
                h.set_offset(offset);
            }
        }
    }

    /// The emitted header as an array.
    pub fn to_bytes(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        self.emit(&mut FrameHeader::new_unchecked(&mut b[..]));
        b
    }
}

wire_view! {
    /// A typed view over the bytes of a hello.
    Hello {
        /// The magic number.
        magic, set_magic: u32 = hello_field::MAGIC;
        /// The version.
        version, set_version: u16 = hello_field::VERSION;
        /// The communicator id.
        comm_id, set_comm_id: u64 = hello_field::COMM_ID;
        /// The dialing rank.
        rank, set_rank: u32 = hello_field::RANK;
        /// The stream index.
        stream, set_stream: u16 = hello_field::STREAM;
        /// Streams per peer.
        nsocks, set_nsocks: u16 = hello_field::NSOCKS;
    }
}

impl<T: AsRef<[u8]>> Hello<T> {
    /// Checks that the accessors will not panic: at least [`HELLO_LEN`] bytes.
    pub fn check_len(&self) -> Result<(), WireError> {
        check("hello", self.buffer.as_ref().len(), HELLO_LEN)
    }

    /// The reserved bytes.
    pub fn reserved(&self) -> u16 {
        u16::from_le_bytes(array(self.buffer.as_ref(), hello_field::RESERVED))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Hello<T> {
    /// Sets the reserved bytes.
    pub fn set_reserved(&mut self, v: u16) {
        put(
            self.buffer.as_mut(),
            hello_field::RESERVED,
            &v.to_le_bytes(),
        );
    }
}

/// Parsed form of a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloRepr {
    /// The communicator id.
    pub comm_id: u64,
    /// The dialing rank.
    pub rank: u32,
    /// The stream index.
    pub stream: u16,
    /// Streams per peer.
    pub nsocks: u16,
}

impl HelloRepr {
    /// Parses a hello: magic, version and reserved bytes are checked; the caller checks the
    /// fields against its own communicator.
    pub fn parse<T: AsRef<[u8]>>(h: &Hello<T>) -> Result<Self, WireError> {
        h.check_len()?;
        if h.magic() != HELLO_MAGIC {
            return Err(WireError::BadMagic {
                format: "hello",
                found: u64::from(h.magic()),
            });
        }
        if h.version() != HELLO_VERSION {
            return Err(WireError::BadVersion {
                format: "hello",
                found: u32::from(h.version()),
            });
        }
        if h.reserved() != 0 {
            return Err(WireError::Reserved {
                format: "hello",
                found: u64::from(h.reserved()),
            });
        }
        Ok(HelloRepr {
            comm_id: h.comm_id(),
            rank: h.rank(),
            stream: h.stream(),
            nsocks: h.nsocks(),
        })
    }

    /// Length of the emitted hello.
    pub const fn buffer_len(&self) -> usize {
        HELLO_LEN
    }

    /// Writes the hello into the first [`HELLO_LEN`] bytes.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Hello<T>) {
        h.set_magic(HELLO_MAGIC);
        h.set_version(HELLO_VERSION);
        h.set_reserved(0);
        h.set_comm_id(self.comm_id);
        h.set_rank(self.rank);
        h.set_stream(self.stream);
        h.set_nsocks(self.nsocks);
    }

    /// The emitted hello as an array.
    pub fn to_bytes(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        self.emit(&mut Hello::new_unchecked(&mut b[..]));
        b
    }
}

wire_view! {
    /// A typed view over the bytes of a handshake answer.
    HandshakeAnswer {
    }
}

impl<T: AsRef<[u8]>> HandshakeAnswer<T> {
    /// Checks that the accessors will not panic: at least [`ANSWER_LEN`] bytes.
    pub fn check_len(&self) -> Result<(), WireError> {
        check("handshake answer", self.buffer.as_ref().len(), ANSWER_LEN)
    }

    /// The dialer's nonce.
    pub fn nonce(&self) -> [u8; NONCE_LEN] {
        array(self.buffer.as_ref(), 0)
    }

    /// The dialer's proof.
    pub fn proof(&self) -> [u8; PROOF_LEN] {
        array(self.buffer.as_ref(), NONCE_LEN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> HandshakeAnswer<T> {
    /// Sets the nonce.
    pub fn set_nonce(&mut self, v: &[u8; NONCE_LEN]) {
        put(self.buffer.as_mut(), 0, v);
    }

    /// Sets the proof.
    pub fn set_proof(&mut self, v: &[u8; PROOF_LEN]) {
        put(self.buffer.as_mut(), NONCE_LEN, v);
    }
}

/// Parsed form of a handshake answer (any [`ANSWER_LEN`] bytes parse; the proof is checked
/// by the handshake).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandshakeAnswerRepr {
    /// The dialer's nonce.
    pub nonce: [u8; NONCE_LEN],
    /// The dialer's proof.
    pub proof: [u8; PROOF_LEN],
}

impl HandshakeAnswerRepr {
    /// Parses an answer.
    pub fn parse<T: AsRef<[u8]>>(a: &HandshakeAnswer<T>) -> Result<Self, WireError> {
        a.check_len()?;
        Ok(HandshakeAnswerRepr {
            nonce: a.nonce(),
            proof: a.proof(),
        })
    }

    /// Length of the emitted answer.
    pub const fn buffer_len(&self) -> usize {
        ANSWER_LEN
    }

    /// Writes the answer into the first [`ANSWER_LEN`] bytes.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, a: &mut HandshakeAnswer<T>) {
        a.set_nonce(&self.nonce);
        a.set_proof(&self.proof);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A write with immediate 7 of `u32::MAX` bytes into key 9 at the last offset.
    static FRAME_WRITE_IMM: [u8; 24] = [
        0x02, 0x00, 0x00, 0x00, // kind 2, reserved
        0x07, 0x00, 0x00, 0x00, // imm 7
        0x09, 0x00, 0x00, 0x00, // rkey 9
        0xff, 0xff, 0xff, 0xff, // len u32::MAX
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // offset u64::MAX
    ];

    /// Part 1 of 2 of a write with immediate 7: 32 bytes into key 9 at offset 0x100.
    static FRAME_WRITE_PART: [u8; 24] = [
        0x04, 0x01, 0x02, 0x00, // kind 4, part 1, of 2, reserved
        0x07, 0x00, 0x00, 0x00, // imm 7
        0x09, 0x00, 0x00, 0x00, // rkey 9
        0x20, 0x00, 0x00, 0x00, // len 32
        0x00, 0x01, 0, 0, 0, 0, 0, 0, // offset 0x100
    ];

    /// A send of 300 bytes.
    static FRAME_SEND: [u8; 24] = [
        0x03, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // kind 3
        0x2c, 0x01, 0x00, 0x00, // len 300
        0, 0, 0, 0, 0, 0, 0, 0,
    ];

    /// A write without immediate of 16 bytes into key 0x0a0b0c0d at offset 0x1234.
    static FRAME_WRITE: [u8; 24] = [
        0x01, 0, 0, 0, 0, 0, 0, 0, // kind 1, reserved, imm 0
        0x0d, 0x0c, 0x0b, 0x0a, // rkey
        0x10, 0x00, 0x00, 0x00, // len 16
        0x34, 0x12, 0, 0, 0, 0, 0, 0, // offset
    ];

    #[test]
    fn frame_header_literals() {
        let cases = [
            (
                &FRAME_WRITE_IMM,
                FrameHeaderRepr::Write {
                    rkey: 9,
                    offset: u64::MAX,
                    len: u32::MAX,
                    imm: Some(7),
                },
            ),
            (&FRAME_SEND, FrameHeaderRepr::Send { len: 300 }),
            (
                &FRAME_WRITE_PART,
                FrameHeaderRepr::WritePart {
                    rkey: 9,
                    offset: 0x100,
                    len: 32,
                    imm: 7,
                    part: 1,
                    parts: 2,
                },
            ),
            (
                &FRAME_WRITE,
                FrameHeaderRepr::Write {
                    rkey: 0x0a0b_0c0d,
                    offset: 0x1234,
                    len: 16,
                    imm: None,
                },
            ),
        ];
        for (bytes, repr) in cases {
            let v = FrameHeader::new_checked(&bytes[..]).unwrap();
            assert_eq!(FrameHeaderRepr::parse(&v), Ok(repr));
            let mut out = [0xa5u8; 24];
            repr.emit(&mut FrameHeader::new_unchecked(&mut out[..]));
            assert_eq!(&out, bytes);
            assert_eq!(repr.to_bytes(), *bytes);
        }
        let v = FrameHeader::new_unchecked(&FRAME_WRITE_IMM[..]);
        assert_eq!(
            (v.kind(), v.imm(), v.rkey(), v.payload_len(), v.offset()),
            (2, 7, 9, u32::MAX, u64::MAX)
        );
    }

    #[test]
    fn frame_header_rejects() {
        assert_eq!(
            FrameHeader::new_checked(&FRAME_SEND[..23]).unwrap_err(),
            WireError::Truncated {
                format: "frame header",
                got: 23,
                need: 24
            }
        );
        let mut b = FRAME_WRITE_IMM;
        b[2] = 1;
        let e = FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])).unwrap_err();
        assert_eq!(
            e,
            WireError::Reserved {
                format: "frame header",
                found: 0x100
            }
        );
        assert_eq!(e.to_string(), "reserved bytes set in frame header: 0x100");
        let mut b = FRAME_SEND;
        b[0] = 5;
        let e = FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])).unwrap_err();
        assert_eq!(e.to_string(), "unknown frame kind 5");
        // Only a part has a number and a count, and only where they make sense.
        let mut b = FRAME_WRITE_IMM;
        b[1] = 1;
        assert!(matches!(
            FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])),
            Err(WireError::Reserved { found: 1, .. })
        ));
        let mut b = FRAME_WRITE_PART;
        b[3] = 1;
        assert!(matches!(
            FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])),
            Err(WireError::Reserved {
                found: 0x1_0000,
                ..
            })
        ));
        for (part, parts) in [(0, 0), (0, 1), (1, 1), (2, 2), (7, 3)] {
            let mut b = FRAME_WRITE_PART;
            (b[1], b[2]) = (part, parts);
            let e = FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])).unwrap_err();
            assert_eq!(
                e,
                WireError::BadPart {
                    format: "striped write",
                    part,
                    parts
                }
            );
        }
        let mut b = FRAME_WRITE_PART;
        (b[1], b[2]) = (3, 3);
        let e = FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])).unwrap_err();
        assert_eq!(e.to_string(), "striped write part 3 of 3");
        // A send ignores the fields it does not use; a write without immediate its immediate.
        let mut b = FRAME_SEND;
        b[4..12].fill(0xee);
        b[16..].fill(0xee);
        assert_eq!(
            FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])),
            Ok(FrameHeaderRepr::Send { len: 300 })
        );
        let mut b = FRAME_WRITE;
        b[4] = 1;
        assert!(matches!(
            FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])),
            Ok(FrameHeaderRepr::Write { imm: None, .. })
        ));
    }

    /// Communicator 0x0807060504030201, rank 3, stream 1 of 2.
    static HELLO: [u8; 24] = [
        0x48, 0x54, 0x53, 0x47, // magic "GSTH"
        0x02, 0x00, 0x00, 0x00, // version 2, reserved
        0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // communicator id
        0x03, 0x00, 0x00, 0x00, // rank 3
        0x01, 0x00, 0x02, 0x00, // stream 1, 2 streams
    ];

    fn hello() -> HelloRepr {
        HelloRepr {
            comm_id: 0x0807_0605_0403_0201,
            rank: 3,
            stream: 1,
            nsocks: 2,
        }
    }

    #[test]
    fn hello_literal() {
        assert_eq!(hello().to_bytes(), HELLO);
        let v = Hello::new_checked(&HELLO[..]).unwrap();
        assert_eq!(
            (
                v.magic(),
                v.version(),
                v.comm_id(),
                v.rank(),
                v.stream(),
                v.nsocks()
            ),
            (HELLO_MAGIC, 2, 0x0807_0605_0403_0201, 3, 1, 2)
        );
        assert_eq!(HelloRepr::parse(&v), Ok(hello()));
    }

    #[test]
    fn hello_rejects() {
        assert!(matches!(
            Hello::new_checked(&HELLO[..10]),
            Err(WireError::Truncated { got: 10, .. })
        ));
        let parse = |b: &[u8]| HelloRepr::parse(&Hello::new_unchecked(b));
        let mut b = HELLO;
        b[3] = b'X';
        assert_eq!(
            parse(&b).unwrap_err().to_string(),
            "bad magic 0x58535448 in hello"
        );
        // Version 1 had no striped writes.
        let mut b = HELLO;
        b[4] = 1;
        assert_eq!(
            parse(&b).unwrap_err().to_string(),
            "unsupported hello version 1"
        );
        let mut b = HELLO;
        b[7] = 1;
        assert!(matches!(parse(&b), Err(WireError::Reserved { .. })));
    }

    #[test]
    fn handshake_answer_literal() {
        let mut bytes = [0u8; ANSWER_LEN];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = i as u8;
        }
        let a =
            HandshakeAnswerRepr::parse(&HandshakeAnswer::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(a.nonce[0], 0);
        assert_eq!(a.nonce[31], 31);
        assert_eq!(a.proof[0], 32);
        assert_eq!(a.proof[31], 63);
        let mut out = [0u8; ANSWER_LEN];
        a.emit(&mut HandshakeAnswer::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert!(HandshakeAnswer::new_checked(&bytes[..63]).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn fuzz_frame_header_parse(b in proptest::collection::vec(any::<u8>(), 0..40)) {
            // Kinds 1-3 have bytes 1-3 zero; a part (kind 4) its number below its count
            // (at least 2) in bytes 1 and 2, byte 3 zero.
            let valid = b.len() >= FRAME_HEADER_LEN
                && match b[0] {
                    1..=3 => b[1..4] == [0, 0, 0],
                    KIND_WRITE_PART => b[3] == 0 && b[2] >= 2 && b[1] < b[2],
                    _ => false,
                };
            match FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])) {
                Ok(f) => {
                    prop_assert!(valid);
                    prop_assert_eq!(f.payload_len().to_le_bytes(), [b[12], b[13], b[14], b[15]]);
                    // Re-emitting keeps every field the kind uses.
                    let out = f.to_bytes();
                    prop_assert_eq!(&out[..4], &b[..4]);
                    prop_assert_eq!(&out[12..16], &b[12..16]);
                    if b[0] != KIND_SEND {
                        prop_assert_eq!(&out[8..], &b[8..FRAME_HEADER_LEN]);
                    }
                    if b[0] == KIND_WRITE_IMM || b[0] == KIND_WRITE_PART {
                        prop_assert_eq!(&out[4..8], &b[4..8]);
                    }
                }
                Err(_) => prop_assert!(!valid),
            }
        }

        #[test]
        fn fuzz_frame_header_round_trip(
            kind in 0..3u8, rkey: u32, offset: u64, len: u32, imm in any::<Option<u32>>(),
            parts in 2..=u8::MAX, part: u8
        ) {
            let r = match kind {
                0 => FrameHeaderRepr::Send { len },
                1 => FrameHeaderRepr::Write { rkey, offset, len, imm },
                _ => FrameHeaderRepr::WritePart {
                    rkey,
                    offset,
                    len,
                    imm: imm.unwrap_or(0),
                    part: part % parts,
                    parts,
                },
            };
            let b = r.to_bytes();
            prop_assert_eq!(FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&b[..])), Ok(r));
        }

        #[test]
        fn fuzz_hello_parse(b in proptest::collection::vec(any::<u8>(), 0..32)) {
            let parsed = HelloRepr::parse(&Hello::new_unchecked(&b[..]));
            if let Ok(h) = parsed {
                // Whatever parses re-emits the same bytes.
                prop_assert_eq!(&h.to_bytes()[..], &b[..HELLO_LEN]);
            }
        }

        #[test]
        fn fuzz_hello_round_trip(comm_id: u64, rank: u32, stream: u16, nsocks: u16) {
            let h = HelloRepr { comm_id, rank, stream, nsocks };
            let b = h.to_bytes();
            prop_assert_eq!(HelloRepr::parse(&Hello::new_unchecked(&b[..])), Ok(h));
        }

        #[test]
        fn fuzz_handshake_answer_parse(b in proptest::collection::vec(any::<u8>(), 0..80)) {
            let parsed = HandshakeAnswerRepr::parse(&HandshakeAnswer::new_unchecked(&b[..]));
            prop_assert_eq!(parsed.is_ok(), b.len() >= ANSWER_LEN);
            if let Ok(a) = parsed {
                let mut out = [0u8; ANSWER_LEN];
                a.emit(&mut HandshakeAnswer::new_unchecked(&mut out[..]));
                prop_assert_eq!(&out[..], &b[..ANSWER_LEN]);
            }
        }

        #[test]
        fn fuzz_handshake_answer_round_trip(
            nonce in any::<[u8; NONCE_LEN]>(), proof in any::<[u8; PROOF_LEN]>()
        ) {
            let a = HandshakeAnswerRepr { nonce, proof };
            let mut b = [0u8; ANSWER_LEN];
            a.emit(&mut HandshakeAnswer::new_unchecked(&mut b[..]));
            prop_assert_eq!(HandshakeAnswerRepr::parse(&HandshakeAnswer::new_unchecked(&b[..])), Ok(a));
        }
    }
}
