//! The collective calls (all-reduce, reduce-scatter, all-gather, broadcast, reduce, barrier)
//! and point-to-point send/receive, with the planning that numbers each call and fixes its
//! signature.
//!
//! The reducing calls (all-reduce, reduce-scatter, reduce) take any [`ReduceOp`] for integer
//! elements; for floating-point elements the bitwise operators (`Band`, `Bor`, `Bxor`) are
//! refused with [`Error::InvalidArgument`](crate::Error::InvalidArgument) before anything is
//! sent.

use super::communicator::Communicator;
use super::queue::{Pending, raw};
use crate::Element;
use crate::Result;
use crate::engine::{Planned, RawBuf};
use gradsync_core::schedule::{Algorithm, Params};
use gradsync_core::schedule::{Buf, Loc, Op, Program};
use gradsync_core::wire::Signature;
use gradsync_core::{Collective, ReduceOp};
use gradsync_transport::Route;

/// The smallest message of an all-to-all over shared memory (see
/// [`Communicator::exchange_segment`]).
const EXCHANGE_SEGMENT_MIN: usize = 64 << 10;

impl Communicator {
    /// All-reduce in place: every rank ends with `op` over all ranks' `buf`, bitwise identical on
    /// every rank.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let b = raw(buf);
        // SAFETY: `buf` is borrowed for the call, which runs the operation to its end.
        unsafe {
            self.run(
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
    }

    /// All-reduce out of place: `output` gets `op` over all ranks' `input`.
    pub fn all_reduce_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
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
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::AllReduce,
                T::DTYPE,
                op,
                0,
                input.len(),
                raw(input),
                raw(output),
                false,
            )
        }
    }

    /// Starts an in-place all-reduce; the returned handle holds `buf` until it is waited for.
    pub fn all_reduce_async<'a, T: Element>(
        &'a mut self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Pending<'a>> {
        let b = raw(buf);
        // SAFETY: `buf` stays mutably borrowed by the returned Pending until it completes (its
        // wait or drop); a leaked Pending poisons the communicator and its buffer is never
        // touched again (no progress happens outside calls made through the handle).
        unsafe {
            self.start(
                Collective::AllReduce,
                T::DTYPE,
                op,
                0,
                buf.len(),
                b,
                b,
                true,
            )?
        };
        Ok(Pending::new(self, false))
    }

    /// Reduce-scatter: `input` holds `world * n` elements, `output` gets slice `rank` (n
    /// elements) of `op` over all ranks' inputs.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_world_multiple(
            "reduce_scatter",
            ("input", input.len()),
            ("output", output.len()),
        )?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::ReduceScatter,
                T::DTYPE,
                op,
                0,
                output.len(),
                raw(input),
                raw(output),
                false,
            )
        }
    }

    /// All-gather: `output` (`world * input.len()` elements) gets every rank's `input`, rank r's
    /// at `r * input.len()`.
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.check_world_multiple(
            "all_gather",
            ("output", output.len()),
            ("input", input.len()),
        )?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::AllGather,
                T::DTYPE,
                ReduceOp::Sum,
                0,
                input.len(),
                raw(input),
                raw(output),
                false,
            )
        }
    }

    /// Broadcast in place: every rank's `buf` gets the root's.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        let b = raw(buf);
        // SAFETY: `buf` is borrowed for the whole call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::Broadcast,
                T::DTYPE,
                ReduceOp::Sum,
                root,
                buf.len(),
                b,
                b,
                true,
            )
        }
    }

    /// Reduce: the root's `output` gets `op` over all ranks' `input`. Other ranks' `output` is
    /// not touched and may be empty.
    pub fn reduce<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        if output.len() != input.len() && (self.rank == root || !output.is_empty()) {
            return Err(self.invalid("reduce", format!("input has {} elements but output has {} (the root's output must match; others may pass an empty one)", input.len(), output.len())));
        }
        let out = if self.rank == root {
            raw(output)
        } else {
            RawBuf::default()
        };
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::Reduce,
                T::DTYPE,
                op,
                root,
                input.len(),
                raw(input),
                out,
                false,
            )
        }
    }

    /// Barrier: returns once every rank has entered it.
    pub fn barrier(&mut self) -> Result<()> {
        // SAFETY: a barrier touches no caller memory.
        unsafe {
            self.run(
                Collective::Barrier,
                gradsync_core::DataType::U8,
                ReduceOp::Sum,
                0,
                0,
                RawBuf::default(),
                RawBuf::default(),
                false,
            )
        }
    }

    /// Sends `buf` to `peer`, which must call [`recv`](Self::recv) with as many elements of the
    /// same type.
    pub fn send<T: Element>(&mut self, buf: &[T], peer: usize) -> Result<()> {
        self.p2p(peer, T::DTYPE, buf.len(), raw(buf), true)
    }

    /// Receives into `buf` from `peer`.
    pub fn recv<T: Element>(&mut self, buf: &mut [T], peer: usize) -> Result<()> {
        self.p2p(peer, T::DTYPE, buf.len(), raw(buf), false)
    }

    fn p2p(
        &mut self,
        peer: usize,
        dtype: gradsync_core::DataType,
        count: usize,
        buf: RawBuf,
        send: bool,
    ) -> Result<()> {
        let started = tracing::enabled!(target: "gradsync::p2p", tracing::Level::TRACE)
            .then(std::time::Instant::now);
        // SAFETY: the buffer is borrowed by the caller for the whole call.
        let seq = unsafe { self.p2p_start(peer, dtype, count, buf, send)? };
        self.engine.progress(true)?;
        if let Some(t) = started {
            let (op_name, dir) = if send {
                ("send", "to")
            } else {
                ("recv", "from")
            };
            tracing::trace!(
                target: "gradsync::p2p",
                "rank {}: {op_name} #{seq} {dir} rank {peer} complete: {} B in {:.1} us",
                self.rank,
                count * dtype.size(),
                t.elapsed().as_secs_f64() * 1e6
            );
        }
        Ok(())
    }

    /// Checks, numbers and starts a send (`send`) or receive of `count` elements; returns its
    /// number in the pair's sequence.
    ///
    /// # Safety
    ///
    /// As [`start`](Self::start): `buf` stays valid and untouched until the operation ends.
    pub(super) unsafe fn p2p_start(
        &mut self,
        peer: usize,
        dtype: gradsync_core::DataType,
        count: usize,
        buf: RawBuf,
        send: bool,
    ) -> Result<u64> {
        let op_name = if send { "send" } else { "recv" };
        if peer >= self.world || peer == self.rank {
            return Err(self.invalid(
                op_name,
                format!(
                    "peer {peer} is not another rank of a world of {}",
                    self.world
                ),
            ));
        }
        self.drive(true, None)?;
        self.engine.check_usable()?;
        let seg = self.engine.segment_elems(dtype);
        let mut prog = Program::new();
        let mut start = 0;
        while start < count || (count == 0 && start == 0) {
            let len = seg.min(count - start);
            let op = if send {
                Op::Send {
                    peer,
                    src: Loc::new(Buf::Input, start),
                    len,
                }
            } else {
                Op::Recv {
                    peer,
                    dst: Loc::new(Buf::Output, start),
                    reduce_with: None,
                    len,
                }
            };
            prog.push(op, &[]);
            start += len.max(1);
        }
        // Send/recv pairs are numbered per pair of ranks, apart from the collectives.
        self.p2p_seq[peer] += 1;
        let (lo, hi) = if send {
            (self.rank, peer)
        } else {
            (peer, self.rank)
        };
        let sig = Signature {
            comm_id: self.engine.comm_id,
            seq: self.p2p_seq[peer],
            coll: Collective::SendRecv,
            dtype,
            op: ReduceOp::Sum,
            count: count as u64,
            root: ((lo as u32) << 16) | hi as u32,
        };
        let (i, o) = if send {
            (buf, RawBuf::default())
        } else {
            (RawBuf::default(), buf)
        };
        let planned = self.engine.one_off(prog);
        let (dir, other) = if send {
            ("to", "recv")
        } else {
            ("from", "send")
        };
        let bytes = count * dtype.size();
        let seq = sig.seq;
        // Sends and receives of a pair are matched by their numbers: send #n from rank a to
        // rank b is received by b's recv #n from a, whatever the collectives in between.
        tracing::trace!(
            target: "gradsync::p2p",
            "rank {}: {op_name} #{seq} {dir} rank {peer} posted: {count} x {dtype:?} ({bytes} B), matched with rank {peer}'s {other} #{seq}",
            self.rank
        );
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.start(sig, planned, "p2p", i, o)? };
        Ok(seq)
    }

    /// Elements per message of a uniform all-to-all with blocks of `block` elements. Where
    /// every peer is on this host's shared memory, a block smaller than four slots goes as four
    /// messages of at least [`EXCHANGE_SEGMENT_MIN`] bytes: the messages of consecutive calls
    /// rotate through a pair's slots, and small ones keep the inbox lines they touch in the
    /// cache (4 ranks, 1 MiB calls: 1.8x the busbw of one message per block). Over TCP every
    /// message fills a slot, since a pair's window of slots bounds the bytes in flight. Every
    /// rank of a job on one host computes the same value; a rank that did not would fail the
    /// call with a length mismatch naming both ranks. (All-to-allv keeps slot-sized messages.)
    ///
    /// Messages that every pair writes straight into place (from `GRADSYNC_SHM_DIRECT_MIN`,
    /// by default 64 KiB in blocks of at least 8 MiB) touch no slot: each costs a
    /// clear-to-send and a cross-memory write, so a block goes as one message up to a slot's
    /// size (2 ranks, 1 MiB: 1.15x the busbw of four messages per block, 4 ranks 1.11x). Init
    /// checks that every rank has the same thresholds.
    pub(super) fn exchange_segment(&self, dtype: gradsync_core::DataType, block: usize) -> usize {
        let slot = self.engine.segment_elems(dtype);
        let shm = self
            .layout
            .routes
            .iter()
            .all(|r| matches!(r, Route::Own | Route::Shm));
        if !shm {
            return slot;
        }
        let min = (EXCHANGE_SEGMENT_MIN / dtype.size()).max(1);
        let split = (block / 4).max(min).min(slot);
        let block_bytes = block.saturating_mul(dtype.size());
        let direct_from = (0..self.world)
            .filter(|&p| p != self.rank)
            .map(|p| self.engine.move_direct_min(p, block_bytes))
            .max()
            .unwrap_or(usize::MAX);
        if split.saturating_mul(dtype.size()) >= direct_from {
            block.clamp(1, slot)
        } else {
            split
        }
    }

    /// Steps of the pairwise all-to-all in flight at once for blocks of `block` bytes. Where
    /// every peer is a TCP peer on this rank's host, the blocks in flight fill at most one
    /// pair's window of slots each way (2 x 3 of `GRADSYNC_CHUNK_SIZE` by default), at least one
    /// step: the kernel copies every byte through the sockets' buffers, and the more sockets
    /// carry data at once, the more of those buffers and of the destination fall out of the
    /// cache (4 ranks, 64 MiB: one step at a time measured 1.07-1.16x the busbw of all three,
    /// 3 ranks 1.09x; at 4 MiB, 1 MiB blocks, it gained nothing, and at 1 MiB it lost).
    /// Elsewhere [`alltoall::DEFAULT_WINDOW`](gradsync_core::schedule::alltoall::DEFAULT_WINDOW):
    /// links to other hosts run in parallel, and shared memory measured faster with every step
    /// in flight. The window orders only this rank's own steps, so ranks need not agree on it.
    pub(super) fn exchange_window(&self, block: usize) -> usize {
        use gradsync_core::schedule::alltoall::DEFAULT_WINDOW;
        let me = self.layout.host_of.get(self.rank);
        let local_tcp = self.world > 1
            && (0..self.world).all(|p| {
                p == self.rank
                    || (self.layout.routes[p] == Route::Tcp && self.layout.host_of.get(p) == me)
            });
        if !local_tcp {
            return DEFAULT_WINDOW;
        }
        let peer = (self.rank + 1) % self.world;
        let in_flight =
            2 * self.engine.window(peer) * self.engine.segment_elems(gradsync_core::DataType::U8);
        (in_flight / block.max(1)).clamp(1, DEFAULT_WINDOW)
    }

    /// Plans a collective and takes its sequence number.
    pub(super) fn plan(
        &mut self,
        coll: Collective,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        root: usize,
        count: usize,
        in_place: bool,
    ) -> Result<(Signature, Planned, &'static str)> {
        let bytes = count * dtype.size();
        if coll == Collective::AllReduce
            && tracing::enabled!(target: "gradsync::coll", tracing::Level::INFO)
        {
            self.explain_choice(bytes);
        }
        // Eager all-reduces (no algorithm chosen) already reduce in rank order; deterministic
        // mode gives the others the same bits (floats: integers and min/max are exact anyway).
        let algorithm = match self.algorithm_for(coll, bytes) {
            Some(_) if coll == Collective::AllReduce && self.deterministic(dtype) => {
                Algorithm::Deterministic
            }
            Some(a) => a,
            None => Algorithm::Eager,
        };
        let params = Params {
            coll,
            rank: self.rank,
            world: self.world,
            count,
            root,
            op,
            segment: if coll == Collective::AllToAll {
                self.exchange_segment(dtype, count)
            } else {
                self.engine.segment_elems(dtype)
            },
            in_place,
            algorithm,
            local_size: self.layout.local_size,
        };
        let planned = if coll == Collective::AllToAll {
            let window = self.exchange_window(count * dtype.size());
            self.engine.schedule_with(&params, |p| {
                gradsync_core::schedule::alltoall::all_to_all_windowed(p, window)
            })
        } else {
            self.engine.schedule_for(&params)
        };
        let prog = planned.map_err(|e| self.invalid(coll.name(), e.to_string()))?;
        let algo = algorithm.name();
        self.seq += 1;
        let reduces = matches!(
            coll,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        );
        let sig = Signature {
            comm_id: self.engine.comm_id,
            seq: self.seq,
            coll,
            dtype,
            op: if reduces { op } else { ReduceOp::Sum },
            count: count as u64,
            root: if matches!(
                coll,
                Collective::Broadcast
                    | Collective::Reduce
                    | Collective::Gather
                    | Collective::Scatter
            ) {
                root as u32
            } else {
                0
            },
        };
        tracing::trace!(target: "gradsync::coll", "rank {}: plan {sig} algorithm {algo}", self.rank);
        Ok((sig, prog, algo))
    }

    /// Runs a collective to its end (see [`start`](Self::start)).
    ///
    /// # Safety
    ///
    /// As [`start`](Self::start).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run(
        &mut self,
        coll: Collective,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        root: usize,
        count: usize,
        input: RawBuf,
        output: RawBuf,
        in_place: bool,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.start(coll, dtype, op, root, count, input, output, in_place)? };
        self.engine.progress(true).map(drop)
    }

    /// Completes queued owned-buffer operations, then plans and starts a collective.
    ///
    /// # Safety
    ///
    /// As [`Engine::start`](crate::engine::Engine::start): the buffers stay valid and untouched
    /// until the operation ends.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn start(
        &mut self,
        coll: Collective,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        root: usize,
        count: usize,
        input: RawBuf,
        output: RawBuf,
        in_place: bool,
    ) -> Result<()> {
        self.check_op(coll, dtype, op)?;
        self.drive(true, None)?;
        self.engine.check_usable()?;
        let (sig, prog, algo) = self.plan(coll, dtype, op, root, count, in_place)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.start(sig, prog, algo, input, output) }
    }

    /// Checks that a reducing collective's operator is defined for its element type: a bitwise
    /// operator over a floating-point type is refused here, before anything is queued or sent,
    /// with an error naming the rank, the call, the operator and the type.
    pub(super) fn check_op(
        &self,
        coll: Collective,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let reduces = matches!(
            coll,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        );
        if reduces && let Err(e) = op.check(dtype) {
            return Err(self.invalid(coll.name(), e.to_string()));
        }
        Ok(())
    }

    /// Checks that the `big` buffer has `world` times the elements of the `small` one.
    pub(super) fn check_world_multiple(
        &self,
        op: &'static str,
        big: (&str, usize),
        small: (&str, usize),
    ) -> Result<()> {
        if Some(big.1) != small.1.checked_mul(self.world) {
            return Err(self.invalid(
                op,
                format!(
                    "{} has {} elements but must have world {} x {} {} = {}",
                    big.0,
                    big.1,
                    self.world,
                    small.0,
                    small.1,
                    small.1.saturating_mul(self.world)
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(self.invalid(
                op,
                format!("root {root} is not a rank of a world of {}", self.world),
            ));
        }
        Ok(())
    }
}
