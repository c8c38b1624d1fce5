//! Wire formats every backend shares: [`WireError`], the error of parsing bytes that a peer
//! sent or published, and [`RemoteRegion`], the region descriptor that ranks exchange through
//! the rendezvous store.
//!
//! Every format of this crate follows the smoltcp split: a typed view over bytes
//! (`new_unchecked`, `new_checked`, `check_len`, field accessors and setters) and a parsed
//! form with `parse`, `emit` and `buffer_len`. Parsing never panics, whatever the bytes. The
//! other formats live next to their owners: [`tcp::wire`](crate::tcp::wire) (frame header,
//! hello, handshake answer), [`shm::wire`](crate::shm::wire) (ring record header, board slot
//! header, segment descriptor) and `rdma::wire` (connection descriptor, feature `rdma`).
//!
//! # Region descriptor
//!
//! A [`RemoteRegion`] travels as exactly 20 bytes ([`RemoteRegionView`]), little-endian:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 4 | remote key |
//! | 4 | 8 | length in bytes |
//! | 12 | 8 | start address in the owner's address space |

/// Errors of parsing bytes a peer sent or published.
///
/// `format` names the format (`"frame"`, `"record"`, `"region descriptor"`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the format needs.
    #[error("truncated {format}: {got} bytes, need {need}")]
    Truncated {
        /// The format.
        format: &'static str,
        /// Bytes available.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// A format that fills a whole store value has another length.
    #[error("{format} of {got} bytes, expected exactly {expected}")]
    Length {
        /// The format.
        format: &'static str,
        /// Bytes available.
        got: usize,
        /// The format's length.
        expected: usize,
    },
    /// The magic number is wrong: not this format at all.
    #[error("bad magic 0x{found:x} in {format}")]
    BadMagic {
        /// The format.
        format: &'static str,
        /// The magic number found.
        found: u64,
    },
    /// A version this build does not speak.
    #[error("unsupported {format} version {found}")]
    BadVersion {
        /// The format.
        format: &'static str,
        /// The version found.
        found: u32,
    },
    /// Reserved bytes are not zero.
    #[error("reserved bytes set in {format}: 0x{found:x}")]
    Reserved {
        /// The format.
        format: &'static str,
        /// The reserved bytes, as a little-endian number.
        found: u64,
    },
    /// A kind code that names nothing.
    #[error("unknown {format} kind {kind}")]
    UnknownKind {
        /// The format.
        format: &'static str,
        /// The kind code found.
        kind: u8,
    },
    /// Flag bits that name nothing.
    #[error("{format} with unknown flags 0x{flags:02x}")]
    UnknownFlags {
        /// The format.
        format: &'static str,
        /// The flags found.
        flags: u8,
    },
    /// A part number that its count does not allow (a part of a striped write: at least 2
    /// parts, numbered from 0).
    #[error("{format} part {part} of {parts}")]
    BadPart {
        /// The format.
        format: &'static str,
        /// The part's number.
        part: u8,
        /// The number of parts.
        parts: u8,
    },
    /// A length field past the format's limit.
    #[error("{format} of {len} bytes (at most {max})")]
    TooLong {
        /// The format.
        format: &'static str,
        /// The length claimed.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A table whose entries cannot be held in memory.
    #[error("{format} with {count} entries")]
    TooManyEntries {
        /// The format.
        format: &'static str,
        /// The number of entries claimed.
        count: u64,
    },
    /// A shared-memory ring record whose length field cannot hold its kind's header.
    #[error("record of {len} bytes of kind {kind}")]
    RecordLength {
        /// The record length field.
        len: u32,
        /// The record kind.
        kind: u8,
    },
    /// A shared-memory ring record whose payload length does not fit its kind or its length.
    #[error("record of kind {kind} with {data_len} payload bytes in {len} bytes")]
    RecordPayload {
        /// The record kind.
        kind: u8,
        /// The payload length field.
        data_len: u32,
        /// The record length field.
        len: u32,
    },
}

/// A wire view `V<T>` over bytes `T`: the struct, `new_unchecked`, `new_checked` (through the
/// view's own `check_len`, which must cover every offset), and its little-endian fields: for
/// each `get, set: type = offset;` a getter `get` (documented by the doc comment given) and a
/// setter `set`.
macro_rules! wire_view {
    (
        $(#[doc = $vdoc:literal])*
        $view:ident { $( $(#[doc = $doc:literal])* $get:ident, $set:ident: $ty:ty = $at:expr; )* }
    ) => {
        $(#[doc = $vdoc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $view<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $view<T> {
            /// Wraps bytes without checking their length.
            pub const fn new_unchecked(buffer: T) -> Self {
                $view { buffer }
            }

            /// Wraps bytes after [`check_len`](Self::check_len).
            pub fn new_checked(buffer: T) -> Result<Self, $crate::wire::WireError> {
                let v = Self::new_unchecked(buffer);
                v.check_len()?;
                Ok(v)
            }

            $(
                $(#[doc = $doc])*
                pub fn $get(&self) -> $ty {
                    <$ty>::from_le_bytes($crate::wire::array(self.buffer.as_ref(), $at))
                }
            )*
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $view<T> {
            $(
                #[doc = concat!("Sets the field that [`", stringify!($get), "`](Self::", stringify!($get), ") reads.")]
                pub fn $set(&mut self, v: $ty) {
                    $crate::wire::put(self.buffer.as_mut(), $at, &v.to_le_bytes());
                }
            )*
        }
    };
}
pub(crate) use wire_view;

/// Writes `v` at `at` (the caller checked the length).
pub(crate) fn put(b: &mut [u8], at: usize, v: &[u8]) {
    b[at..at + v.len()].copy_from_slice(v);
}

/// Reads `N` bytes at `at` (the caller checked the length).
pub(crate) fn array<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

/// A peer's region, as advertised out of band.
///
/// It is also the parsed form of a [`RemoteRegionView`]: [`parse`](Self::parse),
/// [`emit`](Self::emit), and the store helpers [`to_bytes`](Self::to_bytes) and
/// [`from_bytes`](Self::from_bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Start address in the owner's address space (what an RDMA write targets; backends that
    /// address regions by key and offset ignore it).
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

mod region_field {
    pub(super) const RKEY: usize = 0;
    pub(super) const LEN: usize = 4;
    pub(super) const ADDR: usize = 12;
}

/// Length of an encoded [`RemoteRegion`].
pub const REMOTE_REGION_LEN: usize = 20;

const REGION: &str = "region descriptor";

wire_view! {
    /// A typed view over the bytes of a region descriptor.
    RemoteRegionView {
    }
}

impl<T: AsRef<[u8]>> RemoteRegionView<T> {
    /// Checks that the accessors will not panic: at least [`REMOTE_REGION_LEN`] bytes.
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        if got < REMOTE_REGION_LEN {
            return Err(WireError::Truncated {
                format: REGION,
                got,
                need: REMOTE_REGION_LEN,
            });
        }
        Ok(())
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        u32::from_le_bytes(array(self.buffer.as_ref(), region_field::RKEY))
    }

    /// The region's length.
    pub fn len(&self) -> u64 {
        u64::from_le_bytes(array(self.buffer.as_ref(), region_field::LEN))
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The region's start address.
    pub fn addr(&self) -> u64 {
        u64::from_le_bytes(array(self.buffer.as_ref(), region_field::ADDR))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RemoteRegionView<T> {
    /// Sets the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        let at = region_field::RKEY;
        self.buffer.as_mut()[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// Sets the length.
    pub fn set_len(&mut self, v: u64) {
        let at = region_field::LEN;
        self.buffer.as_mut()[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    /// Sets the start address.
    pub fn set_addr(&mut self, v: u64) {
        let at = region_field::ADDR;
        self.buffer.as_mut()[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

impl RemoteRegion {
    /// Parses a descriptor, which must be exactly [`REMOTE_REGION_LEN`] bytes (a whole store
    /// value).
    pub fn parse<T: AsRef<[u8]>>(v: &RemoteRegionView<T>) -> Result<Self, WireError> {
        v.check_len()?;
        let got = v.buffer.as_ref().len();
        if got != REMOTE_REGION_LEN {
            return Err(WireError::Length {
                format: REGION,
                got,
                expected: REMOTE_REGION_LEN,
            });
        }
        Ok(RemoteRegion {
            addr: v.addr(),
            rkey: v.rkey(),
            len: v.len(),
        })
    }

    /// Length of the emitted descriptor.
    pub const fn buffer_len(&self) -> usize {
        REMOTE_REGION_LEN
    }

    /// Writes the descriptor into the first [`REMOTE_REGION_LEN`] bytes.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, v: &mut RemoteRegionView<T>) {
        v.set_rkey(self.rkey);
        v.set_len(self.len);
        v.set_addr(self.addr);
    }

    /// Encodes as 20 bytes (for the rendezvous store).
    pub fn to_bytes(&self) -> [u8; REMOTE_REGION_LEN] {
        let mut b = [0u8; REMOTE_REGION_LEN];
        self.emit(&mut RemoteRegionView::new_unchecked(&mut b[..]));
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes); `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        Self::parse(&RemoteRegionView::new_unchecked(b)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    static BYTES: [u8; 20] = [
        0x78, 0x56, 0x34, 0x12, // rkey 0x12345678
        0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, // len 1 MiB
        0x00, 0x10, 0x20, 0x30, 0x40, 0x7f, 0x00, 0x00, // addr 0x7f40_3020_1000
    ];

    fn repr() -> RemoteRegion {
        RemoteRegion {
            addr: 0x7f40_3020_1000,
            rkey: 0x1234_5678,
            len: 1 << 20,
        }
    }

    #[test]
    fn remote_region_literal() {
        assert_eq!(repr().to_bytes(), BYTES);
        let v = RemoteRegionView::new_checked(&BYTES[..]).unwrap();
        assert_eq!(
            (v.rkey(), v.len(), v.addr()),
            (0x1234_5678, 1 << 20, 0x7f40_3020_1000)
        );
        assert_eq!(RemoteRegion::parse(&v), Ok(repr()));
        assert_eq!(RemoteRegion::from_bytes(&BYTES), Some(repr()));
        assert!(matches!(
            RemoteRegionView::new_checked(&BYTES[..19]),
            Err(WireError::Truncated {
                got: 19,
                need: 20,
                ..
            })
        ));
        let mut long = BYTES.to_vec();
        long.push(0);
        assert!(matches!(
            RemoteRegion::parse(&RemoteRegionView::new_unchecked(&long)),
            Err(WireError::Length { got: 21, .. })
        ));
        assert_eq!(RemoteRegion::from_bytes(&long), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn fuzz_remote_region_parse(b in proptest::collection::vec(any::<u8>(), 0..32)) {
            let r = RemoteRegion::parse(&RemoteRegionView::new_unchecked(&b[..]));
            prop_assert_eq!(r.is_ok(), b.len() == REMOTE_REGION_LEN);
            if let Ok(r) = r {
                prop_assert_eq!(&r.to_bytes()[..], &b[..]);
            }
        }

        #[test]
        fn fuzz_remote_region_round_trip(addr: u64, rkey: u32, len: u64) {
            let r = RemoteRegion { addr, rkey, len };
            let mut b = [0u8; REMOTE_REGION_LEN];
            r.emit(&mut RemoteRegionView::new_unchecked(&mut b[..]));
            prop_assert_eq!(RemoteRegion::parse(&RemoteRegionView::new_unchecked(&b[..])), Ok(r));
        }
    }
}
