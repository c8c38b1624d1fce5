//! The slot settings a rank publishes beside its inbox at init.
//!
//! Every rank lays out its inbox and picks slots from the same settings, so they travel with
//! the inbox descriptor through the rendezvous store and must agree; the board size may differ
//! (eager all-reduces use boards only when the smallest holds the largest eager message).
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 8 | payload bytes per slot (`GRADSYNC_CHUNK_SIZE`) |
//! | 8 | 4 | slots per peer (`GRADSYNC_NSLOTS`) |
//! | 12 | 4 | slots in flight per TCP peer (`GRADSYNC_TCP_NSLOTS`) |
//! | 16 | 4 | bytes of the rank's board, 0 without one |

use super::error::WireError;
use super::field::rd;

mod field {
    pub const CHUNK: usize = 0;
    pub const NSLOTS: usize = 8;
    pub const TCP_NSLOTS: usize = 12;
    pub const BOARD: usize = 16;
    pub const LEN: usize = 20;
}

/// A typed view over encoded slot settings.
#[derive(Debug, Clone)]
pub struct SlotSettings<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> SlotSettings<T> {
    /// Wraps bytes without checking their length.
    pub const fn new_unchecked(buffer: T) -> Self {
        SlotSettings { buffer }
    }

    /// Wraps bytes after [`check_len`](Self::check_len).
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let s = Self::new_unchecked(buffer);
        s.check_len()?;
        Ok(s)
    }

    /// Checks that the settings have exactly their length.
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        if got != field::LEN {
            return Err(WireError::BadLength {
                what: "slot settings",
                got,
                want: field::LEN,
            });
        }
        Ok(())
    }

    fn u32_at(&self, at: usize) -> u32 {
        u32::from_le_bytes(rd(self.buffer.as_ref(), at))
    }

    /// Payload bytes per slot.
    pub fn chunk(&self) -> u64 {
        u64::from_le_bytes(rd(self.buffer.as_ref(), field::CHUNK))
    }
    /// Slots per peer.
    pub fn nslots(&self) -> u32 {
        self.u32_at(field::NSLOTS)
    }
    /// Slots in flight per TCP peer.
    pub fn tcp_nslots(&self) -> u32 {
        self.u32_at(field::TCP_NSLOTS)
    }
    /// Bytes of the board.
    pub fn board(&self) -> u32 {
        self.u32_at(field::BOARD)
    }
}

/// Parsed slot settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSettingsRepr {
    /// Payload bytes per slot.
    pub chunk: u64,
    /// Slots per peer.
    pub nslots: u32,
    /// Slots in flight per TCP peer.
    pub tcp_nslots: u32,
    /// Bytes of the rank's board, 0 without one.
    pub board: u32,
}

impl SlotSettingsRepr {
    /// Length of the encoding.
    pub const LEN: usize = field::LEN;

    /// Parses checked settings.
    pub fn parse<T: AsRef<[u8]>>(s: &SlotSettings<T>) -> Result<Self, WireError> {
        s.check_len()?;
        Ok(SlotSettingsRepr {
            chunk: s.chunk(),
            nslots: s.nslots(),
            tcp_nslots: s.tcp_nslots(),
            board: s.board(),
        })
    }

    /// Length of the emitted settings.
    pub const fn buffer_len(&self) -> usize {
        field::LEN
    }

    /// Writes the settings.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter than [`Self::LEN`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, s: &mut SlotSettings<T>) {
        let b = &mut s.buffer.as_mut()[..field::LEN];
        b[field::CHUNK..field::CHUNK + 8].copy_from_slice(&self.chunk.to_le_bytes());
        for (at, v) in [
            (field::NSLOTS, self.nslots),
            (field::TCP_NSLOTS, self.tcp_nslots),
            (field::BOARD, self.board),
        ] {
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
    }

    /// The encoding as an array.
    pub fn to_bytes(&self) -> [u8; field::LEN] {
        let mut b = [0u8; field::LEN];
        self.emit(&mut SlotSettings::new_unchecked(&mut b[..]));
        b
    }
}
