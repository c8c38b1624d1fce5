//! What the protocol machine asks its driver to do.
//!
//! The driver takes actions from [`Protocol::poll_action`](super::Protocol::poll_action) one
//! at a time and carries each out completely before it asks for the next: the machine counts
//! an action as done (a slot's payload copied out, a local copy made, a message sent) from
//! then on. Actions whose outcome the machine must learn have a `handle_*` answer, named in
//! their documentation.

use crate::schedule::{Loc, Op};
use crate::wire::ControlRepr;

/// Where a one-sided write lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Slot `slot` of this rank's part of the peer's inbox, at `offset` of the inbox region:
    /// the data header ([`Protocol::data_header`](super::Protocol::data_header) of message
    /// `msg`, staged at the driver's staging area of `(peer, slot)`), then the payload.
    Slot {
        /// The slot (of this rank's part of the peer's inbox).
        slot: usize,
        /// Offset of the slot in the peer's inbox region.
        offset: u64,
        /// The message index within the operation, for the header.
        msg: u32,
    },
    /// Straight into the peer's buffer, as its clear-to-send offered: region `rkey` at
    /// `offset`. No header.
    Direct {
        /// Remote key of the peer's region.
        rkey: u32,
        /// Offset in it.
        offset: u64,
    },
}

/// One thing for the driver to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Post a one-sided write with immediate `imm` of `len` elements at `src` to `peer`, with
    /// work-request id `wr`. Answer: [`handle_write_done`](super::Protocol::handle_write_done)
    /// once the transport reports it done.
    Write {
        /// The receiver.
        peer: usize,
        /// Work-request id.
        wr: u64,
        /// Where the payload is read.
        src: Loc,
        /// Elements of payload.
        len: usize,
        /// Where it lands.
        to: Target,
        /// The immediate value.
        imm: u32,
        /// Whether to put the payload's CRC32C in the slot header.
        checksum: bool,
    },
    /// Send a two-sided control message. When the peer is gone, tell the machine with
    /// [`handle_unsent`](super::Protocol::handle_unsent); other failures are errors only when
    /// `required`.
    Control {
        /// The receiver.
        peer: usize,
        /// The message.
        msg: ControlRepr<'static>,
        /// Whether a failure other than the peer being gone fails the operation.
        required: bool,
    },
    /// Copy (or with `with`, reduce) the payload that landed in slot `slot` of `peer`'s part
    /// of this rank's inbox into `dst`, after checking its CRC32C when `crc` is set.
    Deliver {
        /// The sender.
        peer: usize,
        /// The slot.
        slot: usize,
        /// Destination.
        dst: Loc,
        /// Local operand of a reduction (may equal `dst`).
        with: Option<Loc>,
        /// Elements.
        len: usize,
        /// The message index (for error reports).
        msg: u32,
        /// The checksum the sender computed.
        crc: Option<u32>,
    },
    /// Copy (or with `with`, reduce) the payload that landed in slot `slot` of this rank's
    /// shared pool (at [`pool_offset`](super::Protocol::pool_offset) of the pool region; no
    /// header) into `dst`. The slot is free again after this action.
    DeliverPooled {
        /// The sender.
        peer: usize,
        /// The pool slot.
        slot: usize,
        /// Destination.
        dst: Loc,
        /// Local operand of a reduction (may equal `dst`).
        with: Option<Loc>,
        /// Elements.
        len: usize,
        /// The message index (for error reports).
        msg: u32,
    },
    /// Copy (or reduce) the payload of `peer`'s eager message, held by the machine
    /// ([`eager_payload`](super::Protocol::eager_payload)), into `dst`, checking `crc` first.
    DeliverEager {
        /// The sender.
        peer: usize,
        /// Destination.
        dst: Loc,
        /// Local operand of a reduction.
        with: Option<Loc>,
        /// Elements.
        len: usize,
        /// The message index.
        msg: u32,
        /// The checksum the sender computed.
        crc: Option<u32>,
    },
    /// Carry out a local op of the program (`Copy`, `Finalize`, `ReduceParts`).
    Local(Op),
    /// Send the data header of message `msg` and `len` elements at `src` as one two-sided
    /// message to `peer`.
    EagerSend {
        /// The receiver.
        peer: usize,
        /// The message index within the operation, for the header.
        msg: u32,
        /// Where the payload is read.
        src: Loc,
        /// Elements.
        len: usize,
        /// Whether to put the payload's CRC32C in the header.
        checksum: bool,
    },
    /// Make the data header of message `msg` and `len` elements at `src` available to every
    /// peer: a posting on the
    /// transport's board when `board` (answer:
    /// [`handle_posted`](super::Protocol::handle_posted)), else one two-sided message to each
    /// peer.
    Post {
        /// The message index within the operation, for the header.
        msg: u32,
        /// Where the payload is read.
        src: Loc,
        /// Elements.
        len: usize,
        /// Whether to put the payload's CRC32C in the header.
        checksum: bool,
        /// Whether to post on the board.
        board: bool,
    },
    /// Read `peer`'s board posting under `seq` into
    /// [`board_buf`](super::Protocol::board_buf). Answer:
    /// [`handle_board_read`](super::Protocol::handle_board_read).
    BoardRead {
        /// The poster.
        peer: usize,
        /// The sequence number.
        seq: u64,
    },
    /// Tell the peers that every posting under `seq` and before has been read.
    BoardRelease {
        /// The sequence number.
        seq: u64,
    },
    /// Have the transport's wait return when a peer posts under `seq`.
    BoardWatch {
        /// The sequence number.
        seq: u64,
    },
}
