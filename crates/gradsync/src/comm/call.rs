//! A call described before it starts ([`Call`]): what the blocking, async and grouped forms of
//! every collective share. Each public method checks its arguments into a `Call`; the blocking
//! form then launches it and waits, the async form launches it and returns a
//! [`Pending`](super::Pending), a group queues it.

use super::communicator::Communicator;
use super::queue::raw;
use crate::Element;
use crate::Result;
use crate::engine::RawBuf;
use gradsync_core::schedule::alltoall::{self, Block};
use gradsync_core::wire::Signature;
use gradsync_core::{Collective, DataType, ReduceOp};

/// One operation, checked and ready to start.
#[derive(Debug)]
pub(super) enum Call {
    /// A collective planned from its parameters.
    Planned {
        coll: Collective,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        count: usize,
        input: RawBuf,
        output: RawBuf,
        in_place: bool,
    },
    /// An all-to-allv: blocks per peer in `Input` and `Output`.
    AllToAllV {
        dtype: DataType,
        send: Vec<Block>,
        recv: Vec<Block>,
        input: RawBuf,
        output: RawBuf,
    },
    /// A send (`send`) or receive of `count` elements.
    P2p {
        peer: usize,
        dtype: DataType,
        count: usize,
        buf: RawBuf,
        send: bool,
    },
}

impl Call {
    /// A point-to-point call's peer.
    pub(super) fn peer(&self) -> Option<usize> {
        match self {
            Call::P2p { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

impl Communicator {
    /// Starts `call`; it then runs as the engine is driven (`engine.progress`).
    ///
    /// # Safety
    ///
    /// The call's buffers stay valid, and are not accessed otherwise, until it has ended.
    pub(super) unsafe fn launch(&mut self, call: Call) -> Result<()> {
        match call {
            Call::Planned {
                coll,
                dtype,
                op,
                root,
                count,
                input,
                output,
                in_place,
            } => {
                // SAFETY: forwarded from the caller.
                unsafe { self.start(coll, dtype, op, root, count, input, output, in_place) }
            }
            Call::AllToAllV {
                dtype,
                send,
                recv,
                input,
                output,
            } => {
                self.drive(true, None)?;
                self.engine.check_usable()?;
                let seg = self.engine.segment_elems(dtype);
                // The window for the mean block this rank sends.
                let sent: usize = send.iter().map(|b| b.len).sum();
                let window = self.exchange_window(sent * dtype.size() / self.world.max(1));
                let prog = alltoall::all_to_allv(self.rank, &send, &recv, seg, window);
                self.seq += 1;
                // The counts differ per pair: the signature carries none, and every message's
                // length is checked against what its receiver expects.
                let sig = Signature {
                    comm_id: self.engine.comm_id,
                    seq: self.seq,
                    coll: Collective::AllToAllV,
                    dtype,
                    op: ReduceOp::Sum,
                    count: 0,
                    root: 0,
                };
                let planned = self.engine.one_off(prog);
                // SAFETY: forwarded from the caller.
                unsafe { self.engine.start(sig, planned, "pairwise", input, output) }
            }
            Call::P2p {
                peer,
                dtype,
                count,
                buf,
                send,
            } => {
                // SAFETY: forwarded from the caller.
                unsafe { self.p2p_start(peer, dtype, count, buf, send) }.map(drop)
            }
        }
    }

    /// Launches `call` and waits for it.
    ///
    /// # Safety
    ///
    /// As [`launch`](Self::launch).
    pub(super) unsafe fn finish(&mut self, call: Call) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.launch(call)? };
        self.engine.progress(true).map(drop)
    }

    /// The all-to-allv blocks of `counts` (contiguous, in rank order) for a buffer of `len`
    /// elements, named `what` in errors.
    pub(super) fn blocks(
        &self,
        op: &'static str,
        what: &str,
        counts: &[usize],
        len: usize,
    ) -> Result<Vec<Block>> {
        if counts.len() != self.world {
            return Err(self.invalid(
                op,
                format!(
                    "{what} has {} entries but the world has {} ranks",
                    counts.len(),
                    self.world
                ),
            ));
        }
        let blocks = alltoall::contiguous(counts).filter(|b| {
            b.last()
                .is_none_or(|l| l.start.checked_add(l.len) == Some(len))
        });
        blocks.ok_or_else(|| {
            let total = counts
                .iter()
                .try_fold(0usize, |a, &c| a.checked_add(c))
                .map_or_else(|| "more than fit in memory".to_string(), |t| t.to_string());
            self.invalid(
                op,
                format!("{what} add up to {total} elements but the buffer has {len}"),
            )
        })
    }
}

/// The checked calls of every collective, from the caller's slices (the blocking, async and
/// grouped forms share them). The caller keeps the slices borrowed while the call runs.
impl Communicator {
    pub(super) fn c_all_reduce<T: Element>(&self, buf: &[T], op: ReduceOp) -> Call {
        let b = raw(buf);
        planned(
            Collective::AllReduce,
            T::DTYPE,
            op,
            0,
            buf.len(),
            b,
            b,
            true,
        )
    }

    pub(super) fn c_all_reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &[T],
        op: ReduceOp,
    ) -> Result<Call> {
        if input.len() != output.len() {
            return Err(self.invalid(
                "all_reduce",
                format!(
                    "input has {} elements but output has {}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let (i, o) = (raw(input), raw(output));
        Ok(planned(
            Collective::AllReduce,
            T::DTYPE,
            op,
            0,
            input.len(),
            i,
            o,
            false,
        ))
    }

    pub(super) fn c_reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &[T],
        op: ReduceOp,
    ) -> Result<Call> {
        self.check_world_multiple(
            "reduce_scatter",
            ("input", input.len()),
            ("output", output.len()),
        )?;
        let (i, o) = (raw(input), raw(output));
        let coll = Collective::ReduceScatter;
        Ok(planned(coll, T::DTYPE, op, 0, output.len(), i, o, false))
    }

    pub(super) fn c_reduce_scatter_in_place<T: Element>(
        &self,
        buf: &[T],
        op: ReduceOp,
    ) -> Result<Call> {
        let count = self.blocks_of("reduce_scatter", buf.len())?;
        let b = raw(buf);
        let coll = Collective::ReduceScatter;
        Ok(planned(coll, T::DTYPE, op, 0, count, b, b, true))
    }

    pub(super) fn c_all_gather<T: Element>(&self, input: &[T], output: &[T]) -> Result<Call> {
        self.check_world_multiple(
            "all_gather",
            ("output", output.len()),
            ("input", input.len()),
        )?;
        let (i, o) = (raw(input), raw(output));
        let coll = Collective::AllGather;
        Ok(planned(
            coll,
            T::DTYPE,
            ReduceOp::Sum,
            0,
            input.len(),
            i,
            o,
            false,
        ))
    }

    pub(super) fn c_all_gather_in_place<T: Element>(&self, buf: &[T]) -> Result<Call> {
        let count = self.blocks_of("all_gather", buf.len())?;
        let b = raw(buf);
        let coll = Collective::AllGather;
        Ok(planned(coll, T::DTYPE, ReduceOp::Sum, 0, count, b, b, true))
    }

    pub(super) fn c_broadcast<T: Element>(&self, buf: &[T], root: usize) -> Result<Call> {
        self.check_root("broadcast", root)?;
        let b = raw(buf);
        let coll = Collective::Broadcast;
        Ok(planned(
            coll,
            T::DTYPE,
            ReduceOp::Sum,
            root,
            buf.len(),
            b,
            b,
            true,
        ))
    }

    pub(super) fn c_reduce<T: Element>(
        &self,
        input: &[T],
        output: &[T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Call> {
        self.check_root("reduce", root)?;
        if output.len() != input.len() && (self.rank == root || !output.is_empty()) {
            return Err(self.invalid("reduce", format!("input has {} elements but output has {} (the root's output must match; others may pass an empty one)", input.len(), output.len())));
        }
        let out = if self.rank == root {
            raw(output)
        } else {
            RawBuf::default()
        };
        let coll = Collective::Reduce;
        Ok(planned(
            coll,
            T::DTYPE,
            op,
            root,
            input.len(),
            raw(input),
            out,
            false,
        ))
    }

    pub(super) fn c_barrier(&self) -> Call {
        let none = RawBuf::default();
        planned(
            Collective::Barrier,
            DataType::U8,
            ReduceOp::Sum,
            0,
            0,
            none,
            none,
            false,
        )
    }

    pub(super) fn c_all_to_all<T: Element>(&self, input: &[T], output: &[T]) -> Result<Call> {
        if input.len() != output.len() {
            return Err(self.invalid(
                "all_to_all",
                format!(
                    "input has {} elements but output has {}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let count = self.blocks_of("all_to_all", input.len())?;
        let (i, o) = (raw(input), raw(output));
        let coll = Collective::AllToAll;
        Ok(planned(
            coll,
            T::DTYPE,
            ReduceOp::Sum,
            0,
            count,
            i,
            o,
            false,
        ))
    }

    pub(super) fn c_all_to_allv<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &[T],
        recv_counts: &[usize],
    ) -> Result<Call> {
        let op = "all_to_allv";
        let send = self.blocks(op, "send_counts", send_counts, input.len())?;
        let recv = self.blocks(op, "recv_counts", recv_counts, output.len())?;
        let r = self.rank;
        if send[r].len != recv[r].len {
            return Err(self.invalid(
                op,
                format!(
                    "send_counts[{r}] is {} but recv_counts[{r}] is {}: this rank's block to itself must have one size",
                    send[r].len, recv[r].len
                ),
            ));
        }
        Ok(Call::AllToAllV {
            dtype: T::DTYPE,
            send,
            recv,
            input: raw(input),
            output: raw(output),
        })
    }

    pub(super) fn c_gather<T: Element>(
        &self,
        input: &[T],
        output: &[T],
        root: usize,
    ) -> Result<Call> {
        self.check_root("gather", root)?;
        let full = input.len().saturating_mul(self.world);
        if output.len() != full && (self.rank == root || !output.is_empty()) {
            return Err(self.invalid(
                "gather",
                format!(
                    "output has {} elements but must have world {} x input {} = {full} (on the root; others may pass an empty one)",
                    output.len(),
                    self.world,
                    input.len()
                ),
            ));
        }
        let out = if self.rank == root {
            raw(output)
        } else {
            RawBuf::default()
        };
        let coll = Collective::Gather;
        Ok(planned(
            coll,
            T::DTYPE,
            ReduceOp::Sum,
            root,
            input.len(),
            raw(input),
            out,
            false,
        ))
    }

    pub(super) fn c_scatter<T: Element>(
        &self,
        input: &[T],
        output: &[T],
        root: usize,
    ) -> Result<Call> {
        self.check_root("scatter", root)?;
        let full = output.len().saturating_mul(self.world);
        if input.len() != full && (self.rank == root || !input.is_empty()) {
            return Err(self.invalid(
                "scatter",
                format!(
                    "input has {} elements but must have world {} x output {} = {full} (on the root; others may pass an empty one)",
                    input.len(),
                    self.world,
                    output.len()
                ),
            ));
        }
        let inp = if self.rank == root {
            raw(input)
        } else {
            RawBuf::default()
        };
        let coll = Collective::Scatter;
        Ok(planned(
            coll,
            T::DTYPE,
            ReduceOp::Sum,
            root,
            output.len(),
            inp,
            raw(output),
            false,
        ))
    }

    pub(super) fn c_p2p<T: Element>(&self, buf: &[T], peer: usize, send: bool) -> Result<Call> {
        if peer >= self.world || peer == self.rank {
            let op_name = if send { "send" } else { "recv" };
            return Err(self.invalid(
                op_name,
                format!(
                    "peer {peer} is not another rank of a world of {}",
                    self.world
                ),
            ));
        }
        Ok(Call::P2p {
            peer,
            dtype: T::DTYPE,
            count: buf.len(),
            buf: raw(buf),
            send,
        })
    }

    /// The block size of an in-place buffer of `len` elements split over the ranks.
    fn blocks_of(&self, op: &'static str, len: usize) -> Result<usize> {
        if !len.is_multiple_of(self.world) {
            return Err(self.invalid(
                op,
                format!(
                    "the buffer has {len} elements, not a multiple of the world size {}",
                    self.world
                ),
            ));
        }
        Ok(len / self.world)
    }
}

#[allow(clippy::too_many_arguments)]
fn planned(
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    count: usize,
    input: RawBuf,
    output: RawBuf,
    in_place: bool,
) -> Call {
    Call::Planned {
        coll,
        dtype,
        op,
        root,
        count,
        input,
        output,
        in_place,
    }
}
