//! The store's wire format: a typed view over frame bytes ([`Frame`]) and the parsed
//! high-level representation ([`Repr`]).
//!
//! The byte layout is described in the [crate-level documentation](crate#wire-format). The split
//! follows smoltcp: [`Frame`] gives field access over any `AsRef<[u8]>` buffer and checks lengths,
//! [`Repr::parse`] validates a whole frame into owned-or-borrowed values, and [`Repr::emit`]
//! writes one back. Encoding is canonical (one byte sequence per `Repr`), so
//! `emit(parse(bytes)) == bytes` for every frame that parses.
//!
//! Everything here is peer input: no function in this module panics on any byte sequence given
//! to [`Frame::new_checked`] and [`Repr::parse`], and no allocation is sized from a peer-supplied
//! length before that length has been checked against the limits below.

use core::fmt;

/// The four magic bytes that open every frame: `"GSKV"`.
pub const MAGIC: [u8; 4] = *b"GSKV";

/// The protocol version this build speaks. A peer that sends another version gets an
/// [`Repr::Error`] reply and is disconnected.
pub const VERSION: u8 = 1;

/// Length of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 12;

/// Largest key, in bytes of UTF-8.
pub const MAX_KEY_LEN: usize = 4 << 10;

/// Largest value, in bytes.
pub const MAX_VALUE_LEN: usize = 64 << 20;

/// Most keys in one wait request (and so most entries in a `Values` or `Timeout` reply).
pub const MAX_WAIT_KEYS: usize = 4096;

/// Largest error message, in bytes of UTF-8.
pub const MAX_ERROR_LEN: usize = 4 << 10;

/// Largest frame body: one maximal value plus 1 MiB of room for keys and length prefixes.
pub const MAX_BODY_LEN: usize = MAX_VALUE_LEN + (1 << 20);

/// Longest wait the server honours, in milliseconds (24 hours); longer requests are clamped.
pub const MAX_WAIT_TIMEOUT_MS: u64 = 24 * 60 * 60 * 1000;

/// Length of a handshake nonce in bytes.
pub const NONCE_LEN: usize = 32;

/// Length of a handshake proof (an HMAC-SHA256 tag) in bytes.
pub const MAC_LEN: usize = 32;

/// Largest server identity in an [`Repr::AuthChallenge`], in bytes of UTF-8.
pub const MAX_SERVER_ID_LEN: usize = 256;

/// Byte ranges of the header fields.
mod field {
    use core::ops::Range;

    pub(super) const MAGIC: Range<usize> = 0..4;
    pub(super) const VERSION: usize = 4;
    pub(super) const KIND: usize = 5;
    pub(super) const FLAGS: Range<usize> = 6..8;
    pub(super) const BODY_LEN: Range<usize> = 8..12;
}

/// The kind byte of a frame: which request or response it carries.
///
/// Requests use `0x01..=0x3f`, responses `0x80..=0xbf`. The range `0x40..=0x4f` belongs to the
/// authentication handshake (see the [crate-level documentation](crate#authentication));
/// `0x43..=0x4f` are still unassigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Kind {
    /// Request: store a value under a key.
    Set = 0x01,
    /// Request: read the value of a key.
    Get = 0x02,
    /// Request: block until all keys exist, then return their values.
    Wait = 0x03,
    /// Request: add to the decimal integer stored at a key.
    Add = 0x04,
    /// Request: remove a key.
    Delete = 0x05,
    /// Handshake, server to client: the server's nonce and identity.
    AuthChallenge = 0x40,
    /// Handshake, client to server: the client's rank, nonce and proof of the token.
    AuthResponse = 0x41,
    /// Handshake, server to client: the server's proof of the token.
    AuthConfirm = 0x42,
    /// Response: the request succeeded and has no result.
    Ok = 0x80,
    /// Response: one value.
    Value = 0x81,
    /// Response: the values of a wait, in request order.
    Values = 0x82,
    /// Response: the key does not exist.
    NotFound = 0x83,
    /// Response: an integer (the result of an add).
    Int = 0x84,
    /// Response: a wait reached its deadline; carries the keys still missing.
    Timeout = 0x85,
    /// Response: the request failed; carries a message.
    Error = 0x86,
}

impl Kind {
    /// The kind with byte value `raw`, if there is one.
    pub const fn from_u8(raw: u8) -> Option<Kind> {
        Some(match raw {
            0x01 => Kind::Set,
            0x02 => Kind::Get,
            0x03 => Kind::Wait,
            0x04 => Kind::Add,
            0x05 => Kind::Delete,
            0x40 => Kind::AuthChallenge,
            0x41 => Kind::AuthResponse,
            0x42 => Kind::AuthConfirm,
            0x80 => Kind::Ok,
            0x81 => Kind::Value,
            0x82 => Kind::Values,
            0x83 => Kind::NotFound,
            0x84 => Kind::Int,
            0x85 => Kind::Timeout,
            0x86 => Kind::Error,
            _ => return None,
        })
    }

    /// Whether this kind is a request (client to server, after any handshake).
    pub const fn is_request(self) -> bool {
        (self as u8) < 0x40
    }

    /// Whether this kind belongs to the authentication handshake (`0x40..=0x4f`).
    pub const fn is_auth(self) -> bool {
        matches!(self as u8, 0x40..=0x4f)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Kind::Set => "set",
            Kind::Get => "get",
            Kind::Wait => "wait",
            Kind::Add => "add",
            Kind::Delete => "delete",
            Kind::AuthChallenge => "auth-challenge",
            Kind::AuthResponse => "auth-response",
            Kind::AuthConfirm => "auth-confirm",
            Kind::Ok => "ok",
            Kind::Value => "value",
            Kind::Values => "values",
            Kind::NotFound => "not-found",
            Kind::Int => "int",
            Kind::Timeout => "timeout",
            Kind::Error => "error",
        };
        f.write_str(name)
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The buffer ends before the header or a field does.
    #[error("frame truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed to go on.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The frame does not start with [`MAGIC`].
    #[error("bad magic {found:02x?}, expected {MAGIC:02x?}")]
    BadMagic {
        /// The four bytes found instead.
        found: [u8; 4],
    },
    /// The frame's version byte is not [`VERSION`].
    #[error("unsupported protocol version {found}, this build speaks version {VERSION}")]
    UnsupportedVersion {
        /// The version byte found.
        found: u8,
    },
    /// The kind byte names no known request or response.
    #[error("unknown frame kind {kind:#04x}")]
    UnknownKind {
        /// The kind byte found.
        kind: u8,
    },
    /// Header flags, reserved in version 1, are not zero.
    #[error("reserved header flags {flags:#06x} are set")]
    ReservedFlags {
        /// The flags found.
        flags: u16,
    },
    /// The header's body length exceeds [`MAX_BODY_LEN`].
    #[error("frame body of {len} bytes exceeds the limit of {limit} bytes")]
    BodyTooLong {
        /// The body length claimed or needed.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// A key, value or message is longer than its limit.
    #[error("{field} of {len} bytes exceeds the limit of {limit} bytes")]
    FieldTooLong {
        /// Which field: `"key"`, `"value"`, `"error message"` or `"server identity"`.
        field: &'static str,
        /// The length claimed.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// A list has more entries than [`MAX_WAIT_KEYS`].
    #[error("{field} has {count} entries, more than the limit of {limit}")]
    TooManyItems {
        /// Which list: `"wait keys"`, `"values"` or `"missing keys"`.
        field: &'static str,
        /// The count claimed.
        count: u64,
        /// The limit.
        limit: usize,
    },
    /// A key or message is not valid UTF-8.
    #[error("{field} is not valid utf-8")]
    InvalidUtf8 {
        /// Which field: `"key"`, `"error message"` or `"server identity"`.
        field: &'static str,
    },
    /// The body goes on after its last field.
    #[error("{extra} unexpected bytes after the fields of a {kind} frame")]
    TrailingBytes {
        /// The frame's kind.
        kind: Kind,
        /// How many bytes were left over.
        extra: usize,
    },
}

/// A read/write view of a frame in a byte buffer.
///
/// Accessors read the header fields in place. A frame made with [`Frame::new_unchecked`] may be
/// shorter than its header claims; its accessors then panic, so peer input goes through
/// [`Frame::new_checked`] (or [`Frame::check_len`]) first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Frame<T> {
        Frame { buffer }
    }

    /// Wraps a buffer and checks that it holds a whole header and the body it announces
    /// ([`Frame::check_len`]).
    pub fn new_checked(buffer: T) -> Result<Frame<T>, WireError> {
        let frame = Frame::new_unchecked(buffer);
        frame.check_len()?;
        Ok(frame)
    }

    /// Checks that the buffer holds the header and the whole body; after this succeeds no
    /// accessor panics. Extra bytes after the body are allowed and ignored.
    pub fn check_len(&self) -> Result<(), WireError> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(WireError::Truncated {
                need: HEADER_LEN,
                have,
            });
        }
        let need = HEADER_LEN.saturating_add(self.body_len() as usize);
        if have < need {
            return Err(WireError::Truncated { need, have });
        }
        Ok(())
    }

    /// Checks the header alone: magic, version, reserved flags and the body length limit.
    ///
    /// Needs only [`HEADER_LEN`] bytes, so a reader can decide whether to accept the body
    /// before reading (or allocating for) it. The kind byte is checked by [`Repr::parse`].
    pub fn check_header(&self) -> Result<(), WireError> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(WireError::Truncated {
                need: HEADER_LEN,
                have,
            });
        }
        if self.magic() != MAGIC {
            return Err(WireError::BadMagic {
                found: self.magic(),
            });
        }
        if self.version() != VERSION {
            return Err(WireError::UnsupportedVersion {
                found: self.version(),
            });
        }
        if self.flags() != 0 {
            return Err(WireError::ReservedFlags {
                flags: self.flags(),
            });
        }
        let len = self.body_len();
        if len as usize > MAX_BODY_LEN {
            return Err(WireError::BodyTooLong {
                len: u64::from(len),
                limit: MAX_BODY_LEN,
            });
        }
        Ok(())
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The magic bytes (should be [`MAGIC`]).
    pub fn magic(&self) -> [u8; 4] {
        let b = &self.buffer.as_ref()[field::MAGIC];
        [b[0], b[1], b[2], b[3]]
    }

    /// The protocol version byte.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }

    /// The raw kind byte (see [`Kind::from_u8`]).
    pub fn kind(&self) -> u8 {
        self.buffer.as_ref()[field::KIND]
    }

    /// The header flags, reserved (zero) in version 1.
    pub fn flags(&self) -> u16 {
        let b = &self.buffer.as_ref()[field::FLAGS];
        u16::from_le_bytes([b[0], b[1]])
    }

    /// The body length announced by the header.
    pub fn body_len(&self) -> u32 {
        let b = &self.buffer.as_ref()[field::BODY_LEN];
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Header plus body length: the bytes this frame occupies.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN.saturating_add(self.body_len() as usize)
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Frame<&'a T> {
    /// The body bytes, borrowed for the buffer's lifetime.
    pub fn body(&self) -> &'a [u8] {
        let end = self.frame_len();
        &self.buffer.as_ref()[HEADER_LEN..end]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    /// Sets the magic bytes.
    pub fn set_magic(&mut self, magic: [u8; 4]) {
        self.buffer.as_mut()[field::MAGIC].copy_from_slice(&magic);
    }

    /// Sets the version byte.
    pub fn set_version(&mut self, version: u8) {
        self.buffer.as_mut()[field::VERSION] = version;
    }

    /// Sets the kind byte.
    pub fn set_kind(&mut self, kind: u8) {
        self.buffer.as_mut()[field::KIND] = kind;
    }

    /// Sets the header flags.
    pub fn set_flags(&mut self, flags: u16) {
        self.buffer.as_mut()[field::FLAGS].copy_from_slice(&flags.to_le_bytes());
    }

    /// Sets the body length.
    pub fn set_body_len(&mut self, len: u32) {
        self.buffer.as_mut()[field::BODY_LEN].copy_from_slice(&len.to_le_bytes());
    }

    /// The body bytes, mutable.
    pub fn body_mut(&mut self) -> &mut [u8] {
        let end = self.frame_len();
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }
}

/// A parsed frame: one request or one response.
///
/// Strings and byte fields borrow from the frame buffer (or, when emitting, from the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repr<'a> {
    /// Request: store `value` under `key`, replacing any previous value.
    Set {
        /// The key.
        key: &'a str,
        /// The value.
        value: &'a [u8],
    },
    /// Request: read the value of `key`.
    Get {
        /// The key.
        key: &'a str,
    },
    /// Request: block until every key exists, for at most `timeout_ms` milliseconds.
    Wait {
        /// The keys, in the order their values are to be returned.
        keys: Vec<&'a str>,
        /// How long the server waits, in milliseconds (clamped to [`MAX_WAIT_TIMEOUT_MS`]).
        timeout_ms: u64,
    },
    /// Request: add `delta` to the decimal integer at `key` (missing counts as 0).
    Add {
        /// The key.
        key: &'a str,
        /// The amount to add.
        delta: i64,
    },
    /// Request: remove `key`.
    Delete {
        /// The key.
        key: &'a str,
    },
    /// Response: success without a result (set; delete of an existing key).
    Ok,
    /// Response: the value of a get.
    Value {
        /// The value.
        value: &'a [u8],
    },
    /// Response: the values of a wait, in request order.
    Values {
        /// The values.
        values: Vec<&'a [u8]>,
    },
    /// Response: the key does not exist (get; delete).
    NotFound,
    /// Response: the new value after an add.
    Int {
        /// The value.
        value: i64,
    },
    /// Response: a wait reached its deadline.
    Timeout {
        /// The requested keys that still did not exist, in request order.
        missing: Vec<&'a str>,
    },
    /// Response: the request failed.
    Error {
        /// What went wrong.
        message: &'a str,
    },
    /// Handshake, server to client, first frame on a connection to a server with a token.
    AuthChallenge {
        /// The server's fresh random nonce.
        nonce: &'a [u8; NONCE_LEN],
        /// Who the server is (its listening address), for messages.
        server_id: &'a str,
    },
    /// Handshake, client to server: the answer to [`Repr::AuthChallenge`].
    AuthResponse {
        /// The rank the client speaks for (covered by the proof).
        rank: u64,
        /// The client's fresh random nonce.
        nonce: &'a [u8; NONCE_LEN],
        /// HMAC-SHA256 of the token over both nonces and the rank.
        mac: &'a [u8; MAC_LEN],
    },
    /// Handshake, server to client: the server's proof that it holds the token too.
    AuthConfirm {
        /// HMAC-SHA256 of the token over both nonces and the rank (another label than the
        /// client's).
        mac: &'a [u8; MAC_LEN],
    },
}

/// Length of a length-prefixed field holding `len` bytes.
const fn prefixed(len: usize) -> usize {
    4usize.saturating_add(len)
}

fn list_len<I: Iterator<Item = usize>>(lens: I) -> usize {
    lens.fold(4usize, |acc, len| acc.saturating_add(prefixed(len)))
}

impl<'a> Repr<'a> {
    /// The frame kind this representation is emitted as.
    pub fn kind(&self) -> Kind {
        match self {
            Repr::Set { .. } => Kind::Set,
            Repr::Get { .. } => Kind::Get,
            Repr::Wait { .. } => Kind::Wait,
            Repr::Add { .. } => Kind::Add,
            Repr::Delete { .. } => Kind::Delete,
            Repr::Ok => Kind::Ok,
            Repr::Value { .. } => Kind::Value,
            Repr::Values { .. } => Kind::Values,
            Repr::NotFound => Kind::NotFound,
            Repr::Int { .. } => Kind::Int,
            Repr::Timeout { .. } => Kind::Timeout,
            Repr::Error { .. } => Kind::Error,
            Repr::AuthChallenge { .. } => Kind::AuthChallenge,
            Repr::AuthResponse { .. } => Kind::AuthResponse,
            Repr::AuthConfirm { .. } => Kind::AuthConfirm,
        }
    }

    /// Parses a whole frame: header checks, then every body field with its limit, then that
    /// no bytes are left over.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(frame: &Frame<&'a T>) -> Result<Repr<'a>, WireError> {
        frame.check_header()?;
        frame.check_len()?;
        let kind =
            Kind::from_u8(frame.kind()).ok_or(WireError::UnknownKind { kind: frame.kind() })?;
        let mut r = Reader {
            buf: frame.body(),
            pos: 0,
        };
        let repr = match kind {
            Kind::Set => {
                let key = r.key()?;
                let value = r.bytes("value", MAX_VALUE_LEN)?;
                Repr::Set { key, value }
            }
            Kind::Get => Repr::Get { key: r.key()? },
            Kind::Wait => {
                let timeout_ms = r.u64()?;
                let count = r.count("wait keys")?;
                let mut keys = Vec::with_capacity(count);
                for _ in 0..count {
                    keys.push(r.key()?);
                }
                Repr::Wait { keys, timeout_ms }
            }
            Kind::Add => {
                let key = r.key()?;
                let delta = r.u64()? as i64;
                Repr::Add { key, delta }
            }
            Kind::Delete => Repr::Delete { key: r.key()? },
            Kind::Ok => Repr::Ok,
            Kind::Value => Repr::Value {
                value: r.bytes("value", MAX_VALUE_LEN)?,
            },
            Kind::Values => {
                let count = r.count("values")?;
                let mut values = Vec::with_capacity(count);
                for _ in 0..count {
                    values.push(r.bytes("value", MAX_VALUE_LEN)?);
                }
                Repr::Values { values }
            }
            Kind::NotFound => Repr::NotFound,
            Kind::Int => Repr::Int {
                value: r.u64()? as i64,
            },
            Kind::Timeout => {
                let count = r.count("missing keys")?;
                let mut missing = Vec::with_capacity(count);
                for _ in 0..count {
                    missing.push(r.key()?);
                }
                Repr::Timeout { missing }
            }
            Kind::Error => Repr::Error {
                message: r.str("error message", MAX_ERROR_LEN)?,
            },
            Kind::AuthChallenge => Repr::AuthChallenge {
                nonce: r.array()?,
                server_id: r.str("server identity", MAX_SERVER_ID_LEN)?,
            },
            Kind::AuthResponse => Repr::AuthResponse {
                rank: r.u64()?,
                nonce: r.array()?,
                mac: r.array()?,
            },
            Kind::AuthConfirm => Repr::AuthConfirm { mac: r.array()? },
        };
        let extra = r.buf.len() - r.pos;
        if extra != 0 {
            return Err(WireError::TrailingBytes { kind, extra });
        }
        Ok(repr)
    }

    /// Checks this representation against the protocol limits (key, value, message and list
    /// sizes, total body length), the same limits [`Repr::parse`] enforces on the other side.
    ///
    /// A representation that passes can be emitted; one that fails would be rejected by the peer.
    pub fn validate(&self) -> Result<(), WireError> {
        fn key(k: &str) -> Result<(), WireError> {
            limit("key", k.len(), MAX_KEY_LEN)
        }
        fn limit(field: &'static str, len: usize, limit: usize) -> Result<(), WireError> {
            if len > limit {
                return Err(WireError::FieldTooLong {
                    field,
                    len: len as u64,
                    limit,
                });
            }
            Ok(())
        }
        fn count(field: &'static str, count: usize) -> Result<(), WireError> {
            if count > MAX_WAIT_KEYS {
                return Err(WireError::TooManyItems {
                    field,
                    count: count as u64,
                    limit: MAX_WAIT_KEYS,
                });
            }
            Ok(())
        }
        match self {
            Repr::Set { key: k, value } => {
                key(k)?;
                limit("value", value.len(), MAX_VALUE_LEN)?;
            }
            Repr::Get { key: k } | Repr::Add { key: k, .. } | Repr::Delete { key: k } => key(k)?,
            Repr::Wait { keys, .. } => {
                count("wait keys", keys.len())?;
                keys.iter().try_for_each(|k| key(k))?;
            }
            Repr::Timeout { missing } => {
                count("missing keys", missing.len())?;
                missing.iter().try_for_each(|k| key(k))?;
            }
            Repr::Value { value } => limit("value", value.len(), MAX_VALUE_LEN)?,
            Repr::Values { values } => {
                count("values", values.len())?;
                values
                    .iter()
                    .try_for_each(|v| limit("value", v.len(), MAX_VALUE_LEN))?;
            }
            Repr::Error { message } => limit("error message", message.len(), MAX_ERROR_LEN)?,
            Repr::AuthChallenge { server_id, .. } => {
                limit("server identity", server_id.len(), MAX_SERVER_ID_LEN)?;
            }
            Repr::Ok
            | Repr::NotFound
            | Repr::Int { .. }
            | Repr::AuthResponse { .. }
            | Repr::AuthConfirm { .. } => {}
        }
        let len = self.body_len();
        if len > MAX_BODY_LEN {
            return Err(WireError::BodyTooLong {
                len: len as u64,
                limit: MAX_BODY_LEN,
            });
        }
        Ok(())
    }

    /// Length of the body this representation emits (saturating on absurd sizes).
    fn body_len(&self) -> usize {
        match self {
            Repr::Set { key, value } => prefixed(key.len()).saturating_add(prefixed(value.len())),
            Repr::Get { key } | Repr::Delete { key } => prefixed(key.len()),
            Repr::Wait { keys, .. } => {
                8usize.saturating_add(list_len(keys.iter().map(|k| k.len())))
            }
            Repr::Add { key, .. } => prefixed(key.len()).saturating_add(8),
            Repr::Ok | Repr::NotFound => 0,
            Repr::Value { value } => prefixed(value.len()),
            Repr::Values { values } => list_len(values.iter().map(|v| v.len())),
            Repr::Int { .. } => 8,
            Repr::Timeout { missing } => list_len(missing.iter().map(|k| k.len())),
            Repr::Error { message } => prefixed(message.len()),
            Repr::AuthChallenge { server_id, .. } => {
                NONCE_LEN.saturating_add(prefixed(server_id.len()))
            }
            Repr::AuthResponse { .. } => 8 + NONCE_LEN + MAC_LEN,
            Repr::AuthConfirm { .. } => MAC_LEN,
        }
    }

    /// Length of the whole frame (header and body) this representation emits.
    pub fn buffer_len(&self) -> usize {
        HEADER_LEN.saturating_add(self.body_len())
    }

    /// Writes the header and body into `frame`.
    ///
    /// # Panics
    ///
    /// If the frame's buffer is shorter than [`Repr::buffer_len`], or the body does not fit the
    /// 32-bit length field. Call [`Repr::validate`] first for anything sized by a caller.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, frame: &mut Frame<T>) {
        let body_len = u32::try_from(self.body_len()).expect("frame body longer than u32::MAX");
        assert!(
            frame.buffer.as_ref().len() >= self.buffer_len(),
            "frame buffer of {} bytes is shorter than the {} bytes to emit",
            frame.buffer.as_ref().len(),
            self.buffer_len()
        );
        frame.set_magic(MAGIC);
        frame.set_version(VERSION);
        frame.set_kind(self.kind() as u8);
        frame.set_flags(0);
        frame.set_body_len(body_len);
        let mut w = Writer {
            buf: frame.body_mut(),
            pos: 0,
        };
        match self {
            Repr::Set { key, value } => {
                w.bytes(key.as_bytes());
                w.bytes(value);
            }
            Repr::Get { key } | Repr::Delete { key } => w.bytes(key.as_bytes()),
            Repr::Wait { keys, timeout_ms } => {
                w.u64(*timeout_ms);
                w.u32(keys.len() as u32);
                keys.iter().for_each(|k| w.bytes(k.as_bytes()));
            }
            Repr::Add { key, delta } => {
                w.bytes(key.as_bytes());
                w.u64(*delta as u64);
            }
            Repr::Ok | Repr::NotFound => {}
            Repr::Value { value } => w.bytes(value),
            Repr::Values { values } => {
                w.u32(values.len() as u32);
                values.iter().for_each(|v| w.bytes(v));
            }
            Repr::Int { value } => w.u64(*value as u64),
            Repr::Timeout { missing } => {
                w.u32(missing.len() as u32);
                missing.iter().for_each(|k| w.bytes(k.as_bytes()));
            }
            Repr::Error { message } => w.bytes(message.as_bytes()),
            Repr::AuthChallenge { nonce, server_id } => {
                w.put(&nonce[..]);
                w.bytes(server_id.as_bytes());
            }
            Repr::AuthResponse { rank, nonce, mac } => {
                w.u64(*rank);
                w.put(&nonce[..]);
                w.put(&mac[..]);
            }
            Repr::AuthConfirm { mac } => w.put(&mac[..]),
        }
        debug_assert_eq!(w.pos, w.buf.len());
    }

    /// Emits into a new vector of exactly [`Repr::buffer_len`] bytes.
    ///
    /// # Panics
    ///
    /// As [`Repr::emit`].
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut buf = vec![0u8; self.buffer_len()];
        self.emit(&mut Frame::new_unchecked(&mut buf[..]));
        buf
    }
}

/// Bounds-checked little-endian reader over a frame body.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let rest = &self.buf[self.pos..];
        if rest.len() < n {
            return Err(WireError::Truncated {
                need: HEADER_LEN + self.pos + n,
                have: HEADER_LEN + self.buf.len(),
            });
        }
        self.pos += n;
        Ok(&rest[..n])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A fixed-size field of `N` bytes (nonce, proof).
    fn array<const N: usize>(&mut self) -> Result<&'a [u8; N], WireError> {
        let b = self.take(N)?;
        Ok(b.try_into().expect("take returned N bytes"))
    }

    /// A list count, checked against [`MAX_WAIT_KEYS`] before anything is sized from it.
    fn count(&mut self, field: &'static str) -> Result<usize, WireError> {
        let count = self.u32()?;
        if count as usize > MAX_WAIT_KEYS {
            return Err(WireError::TooManyItems {
                field,
                count: u64::from(count),
                limit: MAX_WAIT_KEYS,
            });
        }
        Ok(count as usize)
    }

    /// A length-prefixed byte field; the length is checked against `limit` first.
    fn bytes(&mut self, field: &'static str, limit: usize) -> Result<&'a [u8], WireError> {
        let len = self.u32()?;
        if len as usize > limit {
            return Err(WireError::FieldTooLong {
                field,
                len: u64::from(len),
                limit,
            });
        }
        self.take(len as usize)
    }

    fn str(&mut self, field: &'static str, limit: usize) -> Result<&'a str, WireError> {
        let bytes = self.bytes(field, limit)?;
        core::str::from_utf8(bytes).map_err(|_| WireError::InvalidUtf8 { field })
    }

    fn key(&mut self) -> Result<&'a str, WireError> {
        self.str("key", MAX_KEY_LEN)
    }
}

/// Little-endian writer into a body sized by [`Repr::body_len`].
struct Writer<'b> {
    buf: &'b mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        self.buf[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
    }

    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }

    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.put(b);
    }
}

/// Cuts `message` to at most [`MAX_ERROR_LEN`] bytes at a character boundary.
pub(crate) fn truncate_message(message: &str) -> &str {
    if message.len() <= MAX_ERROR_LEN {
        return message;
    }
    let mut end = MAX_ERROR_LEN;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

#[cfg(test)]
mod tests;
