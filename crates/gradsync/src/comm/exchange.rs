//! The data-moving collectives beyond the classic five (all-to-all and all-to-allv, rooted
//! gather and scatter, in-place all-gather and reduce-scatter), and the async form of every
//! collective and of send/receive.
//!
//! In place follows NCCL's rule: an all-gather is in place when its input is block `rank` of
//! its output, a reduce-scatter when its output is block `rank` of its input. Rust's borrows
//! cannot alias an input with an output, so the in-place forms take the one buffer.

use super::call::Call;
use super::communicator::Communicator;
use super::queue::Pending;
use crate::Element;
use crate::Result;
use gradsync_core::ReduceOp;

impl Communicator {
    /// All-to-all: `input` and `output` hold `world` blocks of `n` elements each; block `p` of
    /// `input` goes to rank `p`, which stores it as block `rank` of its `output`. Pairwise
    /// exchange, or Bruck's log-step algorithm for small blocks on many ranks (the cost model
    /// chooses; `GRADSYNC_ALGO=all_to_all:pairwise|bruck` forces one).
    pub fn all_to_all<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        let call = self.c_all_to_all(input, output)?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe { self.finish(call) }
    }

    /// All-to-all with a count per pair of ranks: `send_counts[p]` elements of `input` go to
    /// rank `p` and `recv_counts[p]` elements of `output` come from rank `p`, each buffer's
    /// blocks contiguous in rank order (`torch.distributed.all_to_all_single` with split
    /// sizes). Each count must equal its peer's counterpart; a message whose length differs
    /// from what its receiver expects fails the call on the receiver, naming both ranks.
    pub fn all_to_allv<T: Element>(
        &mut self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let call = self.c_all_to_allv(input, send_counts, output, recv_counts)?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe { self.finish(call) }
    }

    /// Gather: the root's `output` (`world * input.len()` elements) gets every rank's `input`,
    /// rank r's at block r; each rank sends only its own block. Other ranks' `output` is not
    /// touched and may be empty.
    pub fn gather<T: Element>(&mut self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        let call = self.c_gather(input, output, root)?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe { self.finish(call) }
    }

    /// Scatter: rank r's `output` gets block r of the root's `input` (`world * output.len()`
    /// elements); each rank receives only its own block. Other ranks' `input` is not read and
    /// may be empty.
    pub fn scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let call = self.c_scatter(input, output, root)?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe { self.finish(call) }
    }

    /// All-gather in place: `buf` holds `world` blocks, this rank's input already in block
    /// `rank`; every block ends with its rank's input.
    pub fn all_gather_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        let call = self.c_all_gather_in_place(buf)?;
        // SAFETY: `buf` is borrowed for the call, which runs the operation to its end.
        unsafe { self.finish(call) }
    }

    /// Reduce-scatter in place: `buf` holds `world` blocks; block `rank` ends with `op` over
    /// every rank's block `rank`, and the other blocks keep their contents.
    pub fn reduce_scatter_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let call = self.c_reduce_scatter_in_place(buf, op)?;
        // SAFETY: `buf` is borrowed for the call, which runs the operation to its end.
        unsafe { self.finish(call) }
    }

    /// Starts `call` and returns its handle, which holds the borrows of lifetime `'a`.
    fn begin<'a>(&'a mut self, call: Call) -> Result<Pending<'a>> {
        // SAFETY: the caller's buffers stay borrowed for 'a by the returned Pending until it
        // completes (its wait or drop); a leaked Pending poisons the communicator and its
        // buffers are never touched again (no progress happens outside calls made through the
        // handle).
        unsafe { self.launch(call)? };
        Ok(Pending::new(self, false))
    }

    /// Starts an out-of-place all-reduce (see [`all_reduce_into`](Self::all_reduce_into)).
    pub fn all_reduce_into_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        output: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Pending<'a>> {
        let call = self.c_all_reduce_into(input, output, op)?;
        self.begin(call)
    }

    /// Starts a reduce-scatter (see [`reduce_scatter`](Self::reduce_scatter)).
    pub fn reduce_scatter_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        output: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Pending<'a>> {
        let call = self.c_reduce_scatter(input, output, op)?;
        self.begin(call)
    }

    /// Starts an in-place reduce-scatter (see
    /// [`reduce_scatter_in_place`](Self::reduce_scatter_in_place)).
    pub fn reduce_scatter_in_place_async<'a, T: Element>(
        &'a mut self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Pending<'a>> {
        let call = self.c_reduce_scatter_in_place(buf, op)?;
        self.begin(call)
    }

    /// Starts an all-gather (see [`all_gather`](Self::all_gather)).
    pub fn all_gather_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        output: &'a mut [T],
    ) -> Result<Pending<'a>> {
        let call = self.c_all_gather(input, output)?;
        self.begin(call)
    }

    /// Starts an in-place all-gather (see [`all_gather_in_place`](Self::all_gather_in_place)).
    pub fn all_gather_in_place_async<'a, T: Element>(
        &'a mut self,
        buf: &'a mut [T],
    ) -> Result<Pending<'a>> {
        let call = self.c_all_gather_in_place(buf)?;
        self.begin(call)
    }

    /// Starts a broadcast (see [`broadcast`](Self::broadcast)).
    pub fn broadcast_async<'a, T: Element>(
        &'a mut self,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<Pending<'a>> {
        let call = self.c_broadcast(buf, root)?;
        self.begin(call)
    }

    /// Starts a reduce (see [`reduce`](Self::reduce)).
    pub fn reduce_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        output: &'a mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Pending<'a>> {
        let call = self.c_reduce(input, output, op, root)?;
        self.begin(call)
    }

    /// Starts a barrier (see [`barrier`](Self::barrier)).
    pub fn barrier_async(&mut self) -> Result<Pending<'_>> {
        let call = self.c_barrier();
        self.begin(call)
    }

    /// Starts an all-to-all (see [`all_to_all`](Self::all_to_all)).
    pub fn all_to_all_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        output: &'a mut [T],
    ) -> Result<Pending<'a>> {
        let call = self.c_all_to_all(input, output)?;
        self.begin(call)
    }

    /// Starts an all-to-allv (see [`all_to_allv`](Self::all_to_allv)).
    pub fn all_to_allv_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        send_counts: &[usize],
        output: &'a mut [T],
        recv_counts: &[usize],
    ) -> Result<Pending<'a>> {
        let call = self.c_all_to_allv(input, send_counts, output, recv_counts)?;
        self.begin(call)
    }

    /// Starts a gather (see [`gather`](Self::gather)).
    pub fn gather_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        output: &'a mut [T],
        root: usize,
    ) -> Result<Pending<'a>> {
        let call = self.c_gather(input, output, root)?;
        self.begin(call)
    }

    /// Starts a scatter (see [`scatter`](Self::scatter)).
    pub fn scatter_async<'a, T: Element>(
        &'a mut self,
        input: &'a [T],
        output: &'a mut [T],
        root: usize,
    ) -> Result<Pending<'a>> {
        let call = self.c_scatter(input, output, root)?;
        self.begin(call)
    }

    /// Starts a send (see [`send`](Self::send)).
    pub fn send_async<'a, T: Element>(
        &'a mut self,
        buf: &'a [T],
        peer: usize,
    ) -> Result<Pending<'a>> {
        let call = self.c_p2p(buf, peer, true)?;
        self.begin(call)
    }

    /// Starts a receive (see [`recv`](Self::recv)).
    pub fn recv_async<'a, T: Element>(
        &'a mut self,
        buf: &'a mut [T],
        peer: usize,
    ) -> Result<Pending<'a>> {
        let call = self.c_p2p(buf, peer, false)?;
        self.begin(call)
    }
}
