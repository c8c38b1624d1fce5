"""How the torch.distributed backend runs one gradsync operation of a torch call, on CPU tensors
in place or on CUDA tensors through pinned host memory.

A :class:`Call` describes one gradsync operation: the ``gradsync.Communicator`` method to run
(``fn(input, output)``, given flat contiguous host tensors) and its input and output, as 2-D
contiguous ``(blocks, n)`` tensors: an all-gather's output has one block per rank, a
reduce-scatter's input too, an all-reduce's buffer one block. ``alias`` says how input and
output share memory: ``"same"`` (one buffer, in place), ``"in_block"`` (the input is the
output's block ``block``: an in-place all-gather) or ``"out_block"`` (the output is the input's
block ``block``: an in-place reduce-scatter).

On CPU tensors :meth:`Call.direct` runs ``fn`` on the tensors themselves.

On CUDA tensors gradsync works on copies in pinned host memory, and :class:`StagedOp` runs the
call in chunks of columns (the same columns of every block), so that copies and communication
overlap: a chunk is copied device to host on a copy stream of its own, and once that copy has
landed its gradsync operation is submitted; when gradsync has finished a chunk, it is copied
back host to device on a second copy stream, while the next chunks communicate. The chunks are
cut the same way on every rank (from sizes every rank shares), so the ranks submit the same
gradsync operations. At most ``depth`` chunks of a group are staged at once, and the pinned
buffers are reused (:class:`HostPool`): a buffer goes back to the pool with the event of the
last copy that reads or writes it, and is used again only once that event has completed.

Ordering with the CUDA streams: the copies to the host wait (on the GPU) for an event recorded
on the caller's current stream when the torch call was made, so they see everything queued
before it; the copies back wait for it too, and the operation completes only once the last
copy back (and the copies into the caller's tensors, for calls staged through a temporary) has
completed. So whoever waits for the work, or for its future, sees the result, and kernels they
queue afterwards read it.

Operations on CUDA tensors are submitted to gradsync by a thread of the group (the stager,
:class:`Stager`) once their data is on the host; an operation called while earlier ones wait
there (CPU tensors too) is submitted by that thread as well, after them, so gradsync runs every
group's operations in the order they were called on every rank.
"""

import contextlib
import os
import queue
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import GradsyncError

__all__ = ["Call", "CudaStaging", "DeferredOp", "HostPool", "HostStaging", "StagedOp", "Stager", "chunk_bytes", "depth", "wait_event"]


def _positive_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"gradsync backend: {name}={raw!r} is not a positive integer")
    return value


def chunk_bytes() -> int:
    """Host bytes a chunk of a staged operation covers (``GRADSYNC_STAGING_CHUNK``, 4 MiB)."""
    return _positive_env("GRADSYNC_STAGING_CHUNK", 4 << 20)


def depth() -> int:
    """Chunks of a group staged at once (``GRADSYNC_STAGING_DEPTH``, 4)."""
    return _positive_env("GRADSYNC_STAGING_DEPTH", 4)


# --------------------------------------------------------------------------------------------
# Calls


class Call:
    """One gradsync operation and its buffers (see the module's documentation)."""

    __slots__ = ("fn", "inp", "out", "alias", "block", "rows", "chunked")

    def __init__(
        self,
        fn: Callable[[Optional[torch.Tensor], Optional[torch.Tensor]], object],
        inp: Optional[torch.Tensor],
        out: Optional[torch.Tensor],
        *,
        alias: Optional[str] = None,
        block: int = 0,
        rows: int = 1,
        chunked: bool = True,
    ) -> None:
        for t in (inp, out):
            assert t is None or (t.dim() == 2 and t.is_contiguous()), "a call's buffers are 2-D and contiguous"
        self.fn = fn
        self.inp = inp
        self.out = out
        self.alias = alias
        self.block = block
        # Blocks of the larger buffer on every rank: what chunks are cut from (a rank's absent
        # buffer, such as a gather's output off the root, must not change them).
        self.rows = max(1, rows)
        self.chunked = chunked

    @property
    def dtype(self) -> torch.dtype:
        return (self.inp if self.inp is not None else self.out).dtype

    @property
    def width(self) -> int:
        return (self.inp if self.inp is not None else self.out).shape[1]

    def direct(self):
        """Runs ``fn`` on the tensors themselves (CPU tensors); returns gradsync's work."""
        i = None if self.inp is None else self.inp.reshape(-1)
        o = None if self.out is None else self.out.reshape(-1)
        if self.alias == "same":
            i = o if i is None else i
            o = i if o is None else o
        return self.fn(i, o)

    def chunks(self, nbytes: int) -> List[Optional[Tuple[int, int]]]:
        """The column ranges of the chunks; ``[None]`` for the whole call."""
        if not self.chunked:
            return [None]
        width = self.width
        cols = max(1, nbytes // (self.dtype.itemsize * self.rows))
        if width <= cols:
            return [None]
        return [(a, min(a + cols, width)) for a in range(0, width, cols)]


# --------------------------------------------------------------------------------------------
# Host buffers and devices


class _Done:
    """An event that has completed (host staging)."""

    def query(self) -> bool:
        return True


def wait_event(event, timeout: float, what: str) -> None:
    """Waits for a CUDA event, by polling, at most ``timeout`` seconds; raises
    :class:`GradsyncError` saying ``what`` waited."""
    if event is None or event.query():
        return
    end = time.monotonic() + timeout
    pause = 20e-6
    while not event.query():
        if time.monotonic() > end:
            raise GradsyncError(f"{what}: a copy between the GPU and host memory did not complete within {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class HostPool:
    """Host buffers for staging, reused: pinned memory for CUDA tensors.

    A buffer is handed out with the event that must complete before it is used again (the last
    copy that used it), or ``None``. Sizes are rounded up to powers of two; at most ``keep``
    buffers of each size are kept, and none above ``largest`` bytes.
    """

    def __init__(self, pinned: bool, keep: int, largest: int = 256 << 20) -> None:
        self.pinned = pinned
        self.keep = keep
        self.largest = largest
        self._lock = threading.Lock()
        self._free: dict = {}

    @staticmethod
    def _size(nbytes: int) -> int:
        size = 4096
        while size < nbytes:
            size *= 2
        return size

    def take(self, nbytes: int) -> Tuple[torch.Tensor, object]:
        size = self._size(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned), None

    def give(self, buf: torch.Tensor, fence) -> None:
        size = buf.numel()
        if size > self.largest:
            return
        with self._lock:
            free = self._free.setdefault(size, [])
            if len(free) < self.keep:
                free.append((buf, fence))


def _typed(buf: torch.Tensor, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    n = rows * cols
    return buf[: n * dtype.itemsize].view(dtype).view(rows, cols)


class CudaStaging:
    """Staging of one CUDA device's tensors: two copy streams (to the host, back to the device)
    and the group's pool of pinned buffers."""

    def __init__(self, device: torch.device, pool: HostPool) -> None:
        self.device = device
        self.pool = pool
        self.to_host = torch.cuda.Stream(device=device)
        self.to_device = torch.cuda.Stream(device=device)

    def ready(self):
        """An event on the caller's current stream: what the copies wait for."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @contextlib.contextmanager
    def _on(self, stream, ready):
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            yield

    def on_host_stream(self, ready):
        """Queues the copies of the block to the host, after ``ready``."""
        return self._on(self.to_host, ready)

    def on_device_stream(self, ready):
        """Queues the copies of the block back to the device, after ``ready``."""
        return self._on(self.to_device, ready)

    def record(self):
        """An event recorded on the device's current stream (inside ``on_*_stream``: the copy
        stream)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev


class HostStaging:
    """The staging pipeline on CPU tensors (copies are synchronous): what a test runs to check
    the chunking, aliasing and ordering of the CUDA path on a machine without a GPU."""

    def __init__(self, pool: HostPool) -> None:
        self.device = torch.device("cpu")
        self.pool = pool

    def ready(self):
        return _Done()

    def on_host_stream(self, ready):
        return contextlib.nullcontext()

    on_device_stream = on_host_stream

    def record(self):
        return _Done()


# --------------------------------------------------------------------------------------------
# Staged operations


class _Fail:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Chunk:
    """A chunk in flight: its call, columns, gradsync work, host output and buffers."""

    __slots__ = ("call", "cols", "work", "host_out", "bufs")

    def __init__(self, call, cols, work, host_out, bufs) -> None:
        self.call, self.cols, self.work, self.host_out, self.bufs = call, cols, work, host_out, bufs


def _cols(t: torch.Tensor, cols: Optional[Tuple[int, int]]) -> torch.Tensor:
    return t if cols is None else t[:, cols[0] : cols[1]]


class StagedOp:
    """The calls of one torch call on staged tensors: :meth:`submit` runs on the stager thread
    (copies to the host, gradsync submissions), :meth:`complete` on the group's completion
    thread (waits, copies back, then ``after`` on the copy-back stream, then the final sync)."""

    def __init__(
        self,
        staging,
        calls: Sequence[Call],
        slots: threading.Semaphore,
        timeout: float,
        where: str,
        after: Optional[Callable[[], None]] = None,
    ) -> None:
        self.staging = staging
        self.calls = list(calls)
        self.slots = slots
        self.timeout = timeout
        self.where = where
        self.after = after
        self.ready = staging.ready()
        nbytes = chunk_bytes()
        self.plan = [(c, cols) for c in self.calls for cols in c.chunks(nbytes)]
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._abandoned = False

    @property
    def units(self) -> int:
        """gradsync operations the op submits (each bounded by the communicator's timeout)."""
        return len(self.plan)

    # -- stager thread ---------------------------------------------------------------------

    def _host_buffers(self, call: Call, cols) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], list]:
        """Host buffers for a chunk: ``(input, output, buffers taken from the pool)``, aliased
        as the call's buffers are."""
        dtype = call.dtype
        pool = self.staging.pool
        taken: list = []

        def like(t: torch.Tensor) -> torch.Tensor:
            rows, n = t.shape[0], t.shape[1] if cols is None else cols[1] - cols[0]
            buf, fence = pool.take(rows * n * dtype.itemsize)
            taken.append(buf)
            wait_event(fence, self.timeout, self.where)
            return _typed(buf, dtype, rows, n)

        inp, out = call.inp, call.out
        try:
            if call.alias == "same":
                h = like(out if out is not None else inp)
                return h, h, taken
            if call.alias == "in_block":
                h = like(out)
                return h[call.block : call.block + 1], h, taken
            if call.alias == "out_block":
                h = like(inp)
                return h, h[call.block : call.block + 1], taken
            hin = None if inp is None else like(inp)
            hout = None if out is None else like(out)
            return hin, hout, taken
        except BaseException:
            for b in taken:
                pool.give(b, None)
            raise

    def submit(self, deadline: float) -> None:
        """Stages and submits every chunk, in order; the completion thread takes them from the
        queue. Never raises: an error ends the queue."""
        staging = self.staging
        try:
            for call, cols in self.plan:
                if self._abandoned:
                    raise GradsyncError(f"{self.where}: abandoned after an earlier chunk failed")
                if not self.slots.acquire(timeout=max(0.0, min(deadline - time.monotonic(), threading.TIMEOUT_MAX))):
                    raise GradsyncError(
                        f"{self.where}: no staging buffer was freed by the operation's deadline "
                        "(the chunks before it did not complete)"
                    )
                bufs: list = []
                landed = None
                try:
                    hin, hout, bufs = self._host_buffers(call, cols)
                    if call.inp is not None:
                        with staging.on_host_stream(self.ready):
                            hin.copy_(_cols(call.inp, cols), non_blocking=True)
                            landed = staging.record()
                        wait_event(landed, self.timeout, self.where)
                    i = None if hin is None else hin.reshape(-1)
                    o = None if hout is None else hout.reshape(-1)
                    work = call.fn(i, o)
                except BaseException:
                    for b in bufs:
                        staging.pool.give(b, landed)
                    self.slots.release()
                    raise
                self._queue.put(_Chunk(call, cols, work, hout, bufs))
        except BaseException as e:  # noqa: BLE001 - handed to the completion thread
            self._queue.put(_Fail(e))
        finally:
            self._queue.put(None)

    # -- completion thread -------------------------------------------------------------------

    def complete(self, deadline: float) -> None:
        """Waits for every chunk and copies it back; then ``after``; then waits for the copies.
        Raises the first error, once every submitted chunk has ended."""
        staging = self.staging
        error: Optional[BaseException] = None
        while True:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=max(0.001, min(left, threading.TIMEOUT_MAX)))
            except queue.Empty:
                self._abandoned = True
                raise GradsyncError(f"{self.where}: the stager did not submit the operation by its deadline") from None
            if item is None:
                break
            if isinstance(item, _Fail):
                error = error or item.error
                continue
            fence = None
            try:
                item.work.wait()
                if error is None and item.call.out is not None:
                    with staging.on_device_stream(self.ready):
                        _cols(item.call.out, item.cols).copy_(item.host_out, non_blocking=True)
                        fence = staging.record()
            except BaseException as e:  # noqa: BLE001 - the first error is the op's
                error = error or e
                self._abandoned = True
            finally:
                for b in item.bufs:
                    staging.pool.give(b, fence)
                self.slots.release()
        try:
            if error is None and self.after is not None:
                with staging.on_device_stream(self.ready):
                    self.after()
        except BaseException as e:  # noqa: BLE001
            error = e
        finally:
            # The copies write the caller's tensors (and read temporaries the op holds): they
            # end before the op does, failed or not. An event after everything queued on the
            # copy-back stream marks that.
            with staging.on_device_stream(None):
                last = staging.record()
            wait_event(last, self.timeout, self.where)
        if error is not None:
            raise error


class DeferredOp:
    """The calls of a torch call on CPU tensors made while staged operations wait to be
    submitted: the stager submits them after those."""

    def __init__(self, calls: Sequence[Call]) -> None:
        self.calls = list(calls)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()

    @property
    def units(self) -> int:
        return len(self.calls)

    def submit(self, deadline: float) -> None:
        try:
            for call in self.calls:
                self._queue.put(call.direct())
        except BaseException as e:  # noqa: BLE001 - handed to the completion thread
            self._queue.put(_Fail(e))
        finally:
            self._queue.put(None)

    def complete(self, deadline: float, where: str = "operation") -> None:
        error = None
        while True:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=max(0.001, min(left, threading.TIMEOUT_MAX)))
            except queue.Empty:
                raise GradsyncError(f"{where}: the stager did not submit the operation by its deadline") from None
            if item is None:
                break
            if isinstance(item, _Fail):
                error = error or item.error
                continue
            try:
                item.wait()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error


class Stager:
    """The thread that submits a group's deferred operations to gradsync, in call order.

    :attr:`busy` is true while operations wait in it: a call made then is deferred too (see
    the module's documentation). Started on the first deferred operation."""

    def __init__(self, name: str) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def defer(self, task: Callable[[], None], where: str) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"gradsync backend: {where}: the group was shut down")
            self._pending += 1
            self._queue.put(task)

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                task()
            except BaseException:  # noqa: BLE001 - tasks hand their errors on themselves
                pass
            finally:
                with self._lock:
                    self._pending -= 1
            del task

    def close(self, timeout: Optional[float]) -> None:
        """Stops taking operations; the queued ones are still submitted. With a ``timeout``,
        waits that long for them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if timeout is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, min(timeout, threading.TIMEOUT_MAX)))
