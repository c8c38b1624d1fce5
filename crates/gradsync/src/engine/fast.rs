//! The fast path of a small all-reduce over the board (see
//! [`gradsync_core::proto`]'s `fast` module): posting, reads of the peers' postings and the
//! rank-order reduction, straight through, with no clock read, allocation or system call.
//! Whatever it cannot finish at once it hands to the machine, with its posting up.

use super::driver::{EAGER_HDR, Engine, Planned};
use super::exec::{fold, no_board, reduce_rank_order};
use super::memory::RawBuf;
use crate::error::Error;
use gradsync_core::ReduceOp;
use gradsync_core::wire::Signature;
use gradsync_transport::Board;

/// Reads of the peers' postings before the operation goes to the machine, which then spins,
/// yields and sleeps by its own rules, with the deadline. A few microseconds of reads: peers of
/// a small all-reduce that are in step arrive well within them.
const FAST_SPINS: u32 = 2048;

/// Passes over the peers' postings, each after a yield of the core, when the local ranks do
/// not have a core each (no busy spin): the peer waited for may need this core.
const FAST_YIELDS: u32 = 16;

/// Bit `p` of a world of at most this many ranks marks peer `p`'s posting as read.
const FAST_WORLD_MAX: usize = 64;

impl Engine {
    /// Runs `sig`, an eager all-reduce of `input` into `output` over the board, on the fast
    /// path. `Ok(None)`: done. `Ok(Some(planned))`: start it the usual way (then
    /// [`Engine::fast_posted`] says whether its posting is already up).
    ///
    /// # Safety
    ///
    /// As [`Engine::start`].
    pub(super) unsafe fn fast(
        &mut self,
        sig: Signature,
        planned: Planned,
        input: RawBuf,
        output: RawBuf,
    ) -> Result<Option<Planned>, Error> {
        let bytes = sig.count as usize * sig.dtype.size();
        let (rank, world) = (self.rank, self.world);
        // Only a schedule already checked against these buffers (the first call of a shape
        // takes the usual way, which checks it and keeps it).
        let scratch = planned.sched.program().scratch_elems() * sig.dtype.size();
        let lens = [input.len, output.len, scratch];
        if world > FAST_WORLD_MAX
            || bytes == 0
            || input.len < bytes
            || output.len < bytes
            || planned.checked != Some(lens)
            || planned.params.is_none()
        {
            return Ok(Some(planned));
        }
        let Some(start) = self.proto.fast_begin(sig) else {
            return Ok(Some(planned));
        };
        let Some(board) = self.ep.board() else {
            return Err(no_board(rank, "fast path"));
        };
        let posting: Result<bool, Error> = 'post: {
            if let Some(seq) = start.release
                && let Err(e) = board.release(seq)
            {
                break 'post Err(Error::transport(rank, "eager release", e));
            }
            self.proto.fast_header(&mut self.msg);
            // SAFETY: `input` is valid for `bytes` (checked above) for the call.
            self.msg.extend_from_slice(unsafe {
                std::slice::from_raw_parts(input.addr as *const u8, bytes)
            });
            board
                .post(sig.seq, &self.msg)
                .map_err(|e| Error::transport(rank, "eager post", e))
        };
        // A failure fails the communicator as a failed action of the machine's does.
        let posted = match posting {
            Ok(posted) => posted,
            Err(e) => return Err(self.failed(e)),
        };
        if !posted {
            return Ok(Some(planned));
        }
        self.fast_posted = Some(sig.seq);
        let busy = !self.opts.busy_spin.is_zero();
        match read_all(board, &mut self.proto, &sig, rank, world, busy) {
            Ok(true) => {}
            Ok(false) => return Ok(Some(planned)),
            Err(e) => {
                let e = match e {
                    Fail::Transport(e) => Error::transport(rank, "board read", e),
                    Fail::Proto(e) => self.proto_error(e),
                };
                return Err(self.failed(e));
            }
        }
        self.fast_posted = None;
        // SAFETY: `output` is valid for `bytes` (checked above) and exclusively the call's;
        // `input` was copied into the posting, so in place or not nothing read aliases it.
        let out = unsafe { std::slice::from_raw_parts_mut(output.addr as *mut u8, bytes) };
        let (own, proto) = (&self.msg[EAGER_HDR..], &self.proto);
        reduce_rank_order(sig.dtype, fold(sig.op), out, world, |p| {
            if p == rank {
                own
            } else {
                proto.board_payload(p)
            }
        });
        if sig.op == ReduceOp::Avg {
            gradsync_reduce::finalize_avg(sig.dtype, out, world);
        }
        self.proto.fast_end(sig.seq);
        self.recorder.fast(&sig);
        if let Some(p) = planned.params {
            self.keep_schedule(p, planned.sched, lens);
        }
        Ok(None)
    }

    /// The sequence number of the operation whose posting the fast path put up before it
    /// handed the operation to the machine (whose post then needs no second posting).
    pub(super) fn take_fast_posted(&mut self, seq: u64) -> bool {
        if self.fast_posted == Some(seq) {
            self.fast_posted = None;
            return true;
        }
        false
    }
}

enum Fail {
    Transport(gradsync_transport::TransportError),
    Proto(gradsync_core::proto::ProtoError),
}

/// Reads every peer's posting of `sig` within the spin budget (`busy`: spinning, else
/// yielding between passes): `Ok(true)` when all are read and checked, `Ok(false)` when the
/// machine is to take over.
fn read_all(
    board: &mut dyn Board,
    proto: &mut gradsync_core::proto::Protocol,
    sig: &Signature,
    rank: usize,
    world: usize,
    busy: bool,
) -> Result<bool, Fail> {
    let all: u64 = if world == 64 {
        u64::MAX
    } else {
        (1u64 << world) - 1
    };
    let mut got: u64 = 1 << rank;
    for _ in 0..if busy { FAST_SPINS } else { FAST_YIELDS } {
        for p in 0..world {
            if got & (1 << p) != 0 {
                continue;
            }
            if !board
                .read(p, sig.seq, proto.board_buf(p))
                .map_err(Fail::Transport)?
            {
                continue;
            }
            if !proto.fast_check(sig, p).map_err(Fail::Proto)? {
                return Ok(false);
            }
            got |= 1 << p;
        }
        if got == all {
            return Ok(true);
        }
        if busy {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    Ok(false)
}
