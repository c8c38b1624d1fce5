//! Where everything lies in a control segment: sizes, the header's fields, the region
//! directory, the rings with their control blocks, and the board (see the [module
//! documentation](super#segment-layout)).

use super::wire::{
    BOARD_CAPACITY, BOARD_HEAD, INLINE_MAX, RECORD_HEADER_LEN, SLOT_INLINE, SLOT_REST,
};
use crate::verbs::MAX_SEND;

/// Bytes of ring data per sender in each segment.
pub const RING_BYTES: usize = 256 * 1024;

/// Capacity of a rank's region directory (registered regions at once).
pub const DIR_CAP: usize = 4096;

/// Largest number of local ranks.
pub const MAX_LOCAL: usize = 1024;

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"gsyncSHM");
pub(super) const VERSION: u32 = 3;

const HEADER_BYTES: usize = 4096;
const DIR_ENTRY_BYTES: usize = 64;
const DIR_OFF: usize = HEADER_BYTES;
pub(super) const CTL_BYTES: usize = 256;
const RING_STRIDE: usize = CTL_BYTES + RING_BYTES;
const RINGS_OFF: usize = DIR_OFF + DIR_CAP * DIR_ENTRY_BYTES;

const _: () = assert!(DIR_CAP.is_power_of_two() && RING_BYTES.is_power_of_two());
const _: () = assert!(RINGS_OFF.is_multiple_of(64) && RING_STRIDE.is_multiple_of(64));
const _: () = assert!(2 * (RECORD_HEADER_LEN + MAX_SEND + INLINE_MAX) <= RING_BYTES);

// Header fields (byte offsets).
pub(super) const H_MAGIC: usize = 0;
pub(super) const H_VERSION: usize = 8;
pub(super) const H_PID: usize = 12;
pub(super) const H_RANK: usize = 16;
pub(super) const H_WORLD: usize = 20;
pub(super) const H_NLOCAL: usize = 24;
pub(super) const H_DIR_CAP: usize = 28;
pub(super) const H_RING_BYTES: usize = 32;
pub(super) const H_NONCE: usize = 40;
pub(super) const H_SELF_ADDR: usize = 48;
pub(super) const H_TOTAL_LEN: usize = 56;
pub(super) const H_CLOSED: usize = 64;
pub(super) const H_EVENTS: usize = 128;
pub(super) const H_SLEEPING: usize = 192;

// Ring control block fields (byte offsets inside the block).
pub(super) const C_TAIL: usize = 0;
pub(super) const C_HEAD: usize = 64;
pub(super) const C_WANT_SPACE: usize = 128;
pub(super) const C_ATTACH: usize = 132;
pub(super) const C_PROBE: usize = 136;

/// Value of a control block's `attach` word once the sender mapped the segment.
pub(super) const ATTACH_OK: u32 = 1;
/// Value of a control block's `attach` word once the sender gave up.
pub(super) const ATTACH_FAILED: u32 = 2;

// Directory entry fields (byte offsets inside the entry).
pub(super) const D_SEQ: usize = 0;
pub(super) const D_STATE: usize = 4;
pub(super) const D_KEY: usize = 8;
pub(super) const D_ACCESS: usize = 12;
pub(super) const D_ADDR: usize = 16;
pub(super) const D_LEN: usize = 24;
pub(super) const D_ALLOC_FD: usize = 32;
pub(super) const D_ALLOC_ID: usize = 40;
pub(super) const D_ALLOC_LEN: usize = 48;
pub(super) const D_ALLOC_OFF: usize = 56;

const _: () = assert!(D_ALLOC_OFF + 8 == DIR_ENTRY_BYTES);

/// Bytes of one board slot (a [slot header](super::wire::SlotHeader) and the posting, its
/// head on a line of its own), a whole number of cache lines.
pub(super) const SLOT_BYTES: usize =
    (SLOT_REST + BOARD_CAPACITY - BOARD_HEAD - SLOT_INLINE).next_multiple_of(64);

/// Offset of the board's release-mark line from the board's start.
pub(super) const MARK_LINE: usize = 2 * SLOT_BYTES;

/// Bytes of a board.
const BOARD_BYTES: usize = MARK_LINE + 64;

/// Bytes of a segment for `nlocal` local ranks.
pub(super) fn segment_len(nlocal: usize) -> usize {
    board_off(nlocal) + BOARD_BYTES
}

/// Offset of the board in a segment for `nlocal` local ranks.
pub(super) fn board_off(nlocal: usize) -> usize {
    RINGS_OFF + nlocal * RING_STRIDE
}

/// Offset of the control block of the ring of sender position `pos`; its data follows at
/// `CTL_BYTES`.
pub(super) fn ctl_off(pos: usize) -> usize {
    RINGS_OFF + pos * RING_STRIDE
}

/// Offset of directory entry `slot`.
pub(super) fn dir_off(slot: usize) -> usize {
    DIR_OFF + slot * DIR_ENTRY_BYTES
}
