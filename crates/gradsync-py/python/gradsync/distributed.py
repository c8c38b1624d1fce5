"""gradsync under ``torch.distributed``: a process-group backend and a DDP communication hook.

Importing this module registers the backend ``"gradsync"`` for CPU and CUDA tensors, so that::

    import gradsync.distributed  # registers the backend
    torch.distributed.init_process_group("gradsync")

works under ``torchrun`` and ``gradsync launch`` (or any ``env://``, ``tcp://`` or ``file://``
rendezvous), and the usual collectives, an unmodified ``DistributedDataParallel`` model, FSDP2
(``fully_shard``), HSDP on a 2-D ``DeviceMesh``, ``ZeroRedundancyOptimizer`` and MoE-style
all-to-all run on gradsync.

How a group is formed: torch's own store (the one ``init_process_group`` rendezvoused on) is
used only to find gradsync's. Rank 0 of the group starts a :class:`gradsync.StoreServer` on a
free port and publishes its address (``MASTER_ADDR``, else this host's name, and the port;
``GRADSYNC_STORE_HOST`` overrides the host; the server listens on loopback only when that host
is ``127.0.0.1`` or ``localhost``) under a key of the group's store; every rank then builds a
:class:`gradsync.Communicator` on it. That happens once, for the default group: when the
default group runs on gradsync, the groups made later (``new_group``, ``new_subgroups``, the
sub-meshes of a ``DeviceMesh``) are split from its communicator by their members alone
(:meth:`gradsync.Communicator.split_ranks`), with no new store: the members swap their
connection records over the default group's point-to-point messages, after the default group's
operations they queued before. A group whose default group is another backend meets through its
store as above. Set the same ``GRADSYNC_TOKEN`` on every rank to
authenticate gradsync's connections (``gradsync launch`` does; torchrun does not). The
communicator's deadline is the ``timeout`` given to ``init_process_group`` (torch's default is
30 minutes), unless ``GRADSYNC_TIMEOUT`` is set, which then wins.

Operations run asynchronously: each torch call queues a gradsync operation and returns at once
with a ``Work`` whose future completes when gradsync has finished it. One thread per group waits
for the operations in the order they were queued (the order gradsync runs them) and completes
their futures, so DDP's reducer overlaps gradient all-reduces with backward as it does on Gloo.
Tensors must stay untouched until their work is waited for, as with every backend.

Errors: ``work.wait()`` (and so every blocking call) raises the operation's
:class:`gradsync.GradsyncError`, whose message names the ranks and the calls (``rank 1 runs
broadcast seq 2 ... but rank 0 sent all_reduce seq 2 ...``); ``work.wait(timeout)`` raises
:class:`TimeoutError` when the timeout elapses first. A work's future completes with the error
too (torch reports it as a ``RuntimeError`` that quotes the ``GradsyncError``). The handle that
torch returns for ``async_op=True`` does not pass ``is_completed()`` on to a backend written in
Python (torch 2.15 answers ``False``); ``work.get_future().done()`` tells.

torch releases: 2.7 or later (older ones are refused at import, saying why; see
:data:`MIN_TORCH`). Where torch builds a c10d ``Backend`` written in Python (2.15 does), the
group is a ``ProcessGroup`` with this backend registered for CPU and CUDA tensors. Some
releases bind ``Backend`` without a constructor (2.7, 2.8 and 2.11 do: "No constructor
defined!"); there the class derives from ``ProcessGroup`` instead, and torch uses the object as
the group itself, with the same operations. ``GRADSYNC_TORCH_BASE=process_group`` takes that
path on any torch.

Deadlines: gradsync bounds each operation by the communicator's timeout, and every wait here has
a deadline of its own as well: the communicator's timeout for the operation and for each one
queued before it and not yet finished, plus 60 seconds. A ``wait()`` that reaches it, and a
``destroy_process_group`` whose queued operations overrun it, raise ``GradsyncError`` naming the
rank and the operation instead of blocking. ``abort`` stops taking operations and does not wait
for the completion threads, but it is not immediate: gradsync cannot cancel an operation, so the
ones already queued run to their end (each bounded by the timeout) while the communicator closes.

What the backend implements:

- ``allreduce`` (and ``allreduce_coalesced``) with ``SUM``, ``PRODUCT``, ``MIN``, ``MAX``,
  ``AVG``, and ``BAND``, ``BOR``, ``BXOR`` on integer and bool tensors; bool tensors are reduced
  as bytes (``SUM``/``MAX`` are logical or, ``MIN``/``PRODUCT`` logical and);
- ``broadcast``, ``reduce``, ``barrier``;
- ``allgather`` (list form, ``all_gather_into_tensor`` and its coalesced form
  ``allgather_into_tensor_coalesced``) and ``reduce_scatter`` (list form,
  ``reduce_scatter_tensor`` and ``reduce_scatter_tensor_coalesced``): what FSDP2, HSDP and
  DTensor's functional collectives call. They run in place by NCCL's rule: an all-gather whose
  input is exactly block ``rank`` of its output (what FSDP2 passes), a reduce-scatter whose
  output is exactly block ``rank`` of its input; gradsync is then handed the aliasing buffers,
  nothing is copied. Any other overlap of input and output raises :class:`ValueError` saying so;
- ``gather`` and ``scatter`` on gradsync's rooted gather and scatter (each rank sends or
  receives its own block only), and so ``gather_object`` and ``scatter_object_list``;
- ``all_to_all_single`` without split sizes (gradsync's all-to-all) and with them, uneven, zeros
  included (its all-to-allv: MoE token routing), and ``all_to_all`` of tensor lists (sizes may
  differ per peer); input and output must not overlap;
- ``send``/``recv``, ``isend``/``irecv`` and ``batch_isend_irecv``. Each direction between two
  ranks has its own two-rank gradsync communicator and its own thread; the first message either
  way between two ranks connects both directions (through the group's store, about 0.1 s on one
  host). Transfers return at once and proceed independently of the group's collectives and of
  each other: a rank's ``isend`` to a peer and ``irecv`` from it complete whichever the two ranks
  queue first (two ranks may both send, then both receive). Messages one way between two ranks
  are matched in the order they were sent; tags are not matched. A blocking ``send`` returns once
  the message has been handed over (the first one also waits for the peer's first transfer with
  this rank, which connects them): at once for a message that fits in what gradsync buffers for
  a peer, (``GRADSYNC_NSLOTS`` - 1) x ``GRADSYNC_CHUNK_SIZE`` bytes (3.5 MiB by default: on
  one host an exchange of 3 MiB blocking sends completes, one of 4 MiB does not), or
  (``GRADSYNC_TCP_NSLOTS`` - 1) x ``GRADSYNC_CHUNK_SIZE`` (1 MiB) to a peer on the same host
  reached over TCP, else once the peer receives it. So two ranks that both ``send`` large messages before they
  ``recv`` wait for each other until the timeout and then fail (the error says so); use
  ``isend``/``irecv`` or ``batch_isend_irecv`` for exchanges.

Other operations (``recv`` from any source, sparse all-reduce, ``PREMUL_SUM``) raise
:class:`NotImplementedError` naming the operation.

Data movement (broadcast, gathers, scatter, all-to-all, send/recv) works on any dtype, moved as
bytes; reductions need one of gradsync's types (float32, float64, float16, bfloat16, int32,
int64, uint8) or bool, and the bitwise ones any integer type (reduced as bytes where gradsync has
no such type). Non-contiguous tensors are used through a contiguous copy.

CUDA tensors: gradsync moves host memory, so a collective on CUDA tensors is staged through
pinned host buffers (see ``gradsync._staging``): it is cut in chunks of
``GRADSYNC_STAGING_CHUNK`` bytes (4 MiB), each copied to the host on a copy stream, reduced or
moved by gradsync as soon as it has landed, and copied back on a second copy stream, so that
the copies of one chunk overlap the communication of others; at most ``GRADSYNC_STAGING_DEPTH``
chunks (4) of a group are staged at once, and the pinned buffers are reused. The copies wait
for what was queued on the caller's current stream before the call, and the work completes (its
``wait()`` returns, its future gets its value) only once the results are in the caller's
tensors, so kernels queued afterwards on any stream read them. A call's tensors must be on one
device. CPU tensors are used in place as before; a CPU operation called while CUDA ones wait to
be staged is submitted after them, so every rank runs a group's operations in call order.
Each copy is bounded by the communicator's timeout. ``scripts/gpu-check.sh`` runs DDP and FSDP2
on CUDA tensors against Gloo on a machine with a GPU.

The DDP communication hook, for jobs that keep Gloo (or any backend) as the process group and
let gradsync all-reduce only the gradients (of a model on CPU: a bucket on a GPU is refused)::

    state = gradsync.distributed.make_hook_state()   # after init_process_group
    model = DistributedDataParallel(model)
    model.register_comm_hook(state, gradsync.distributed.allreduce_hook)
"""

import datetime
import itertools
import os
import queue
import socket
import threading
import time
from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import ReduceOp

from . import Communicator, GradsyncError, StoreServer, _staging
from ._staging import Call as _Call
from ._staging import wait_event

#: The oldest torch the backend runs on. On 2.6, c10d's C++ side waits on a work written in
#: Python through c10d's own ``Work.wait`` once the work's Python object is gone, so it never
#: returns: DDP's construction hangs in its first collective.
MIN_TORCH = (2, 7)


def _require_torch(version) -> None:
    """Raises ``ImportError`` for a torch older than :data:`MIN_TORCH` (``version`` is a
    ``torch.__version__``)."""
    if version < MIN_TORCH:
        raise ImportError(
            f"gradsync.distributed needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or later, and this is "
            f"torch {version}: on older releases c10d waits on gradsync's operations without "
            "ever seeing them finish (DDP hangs at its first collective). Upgrade torch, or use "
            "gradsync.Communicator on tensors directly"
        )


_require_torch(torch.__version__)

__all__ = [
    "BACKEND_NAME",
    "GradsyncBackend",
    "HookState",
    "allreduce_hook",
    "make_hook_state",
    "register",
]

#: The name the backend is registered under (``init_process_group(BACKEND_NAME)``).
BACKEND_NAME = "gradsync"

# Key, under the group's store, of the address of gradsync's store.
_STORE_KEY = "gradsync/store_addr"

# dtypes gradsync reduces natively.
_REDUCIBLE = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
}


# --------------------------------------------------------------------------------------------
# Bootstrap


def _advertised_host() -> str:
    """The host name other ranks reach rank 0's store at."""
    host = os.environ.get("GRADSYNC_STORE_HOST") or os.environ.get("MASTER_ADDR")
    if not host:
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return host


def _timeout_seconds(timeout: Optional[datetime.timedelta]) -> Optional[float]:
    """The communicator timeout: ``None`` (gradsync's ``GRADSYNC_TIMEOUT``) when that variable
    is set, else torch's."""
    if os.environ.get("GRADSYNC_TIMEOUT"):
        return None
    if timeout is None:
        return None
    secs = timeout.total_seconds()
    return secs if secs > 0 else None


def _connect(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: Optional[datetime.timedelta],
    key: str = _STORE_KEY,
) -> Tuple[Communicator, Optional[StoreServer]]:
    """Builds a communicator for ``rank`` of ``size``, finding gradsync's store through
    torch's ``store``: rank 0 serves it and publishes its address under ``key``."""
    server = None
    if rank == 0:
        host = _advertised_host()
        # A job that meets on loopback keeps the store off the network.
        bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else "0.0.0.0"
        server = StoreServer(host=bind, port=0)
        addr = f"{host}:{server.port}"
        store.set(key, addr)
    else:
        addr = store.get(key).decode()
    try:
        comm = Communicator(addr, rank, size, host_store=False, timeout=_timeout_seconds(timeout))
    except BaseException:
        if server is not None:
            server.close()
        raise
    return comm, server


# --------------------------------------------------------------------------------------------
# Completion of torch futures


class _Failed:
    """The outcome of a failed operation, re-raised by :func:`_unwrap`."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(fut: torch.futures.Future):
    value = fut.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class _Op:
    """One queued operation: what runs on the completion thread (``run``, a blocking
    point-to-point transfer), the gradsync works it waits for, what runs after them (copies out
    of staging buffers), and how it ended.

    ``raw`` is completed with the result (or a :class:`_Failed`); ``future`` is ``raw`` seen
    through :func:`_unwrap`, so that a failure completes it with an error (``set_exception``
    would only store the exception as a value, which torch's C++ side takes for a result).

    ``units`` is how many communicator timeouts the op may take; the completer that queues it
    sets ``deadline`` (a ``time.monotonic()`` instant) and ``bound`` (seconds from queuing).
    """

    __slots__ = (
        "name",
        "run",
        "works",
        "result",
        "after",
        "units",
        "deadline",
        "bound",
        "outcome",
        "done",
        "raw",
        "future",
    )

    def __init__(
        self,
        name: str,
        works: Sequence,
        result: object,
        after: Optional[Callable[[], None]],
        run: Optional[Callable[[], None]] = None,
        units: int = 0,
    ) -> None:
        self.name = name
        self.run = run
        self.works = works
        self.result = result
        self.after = after
        self.units = max(1, units or len(works))
        self.deadline = float("inf")
        self.bound = float("inf")
        self.outcome: object = None
        self.done = threading.Event()
        self.raw: torch.futures.Future = torch.futures.Future()
        self.future = self.raw.then(_unwrap)

    def complete(self) -> None:
        """Runs the op, waits for its works, runs ``after``, and completes the op (completion
        thread). Never raises: whatever happens, the op ends with a result or an error."""
        try:
            try:
                if self.run is not None:
                    self.run()
                # Every work ends before the op does (its buffers are in use until then); the
                # first error is the op's.
                error = None
                for w in self.works:
                    try:
                        w.wait()
                    except BaseException as e:  # noqa: BLE001
                        error = error or e
                if error is not None:
                    raise error
                if self.after is not None:
                    self.after()
            except BaseException as e:  # noqa: BLE001 - handed to the waiters
                self.outcome = _Failed(e)
            else:
                self.outcome = self.result
        finally:
            self.run = self.works = self.after = None
            # The futures first (``future``'s callback runs inside ``set_result``), then
            # ``done``: whoever `wait()`ed finds them completed.
            try:
                try:
                    self.raw.set_result(self.outcome)
                except BaseException as e:  # noqa: BLE001 - the future must end all the same
                    try:
                        self.raw.set_result(_Failed(e))
                    except BaseException:  # noqa: BLE001 - already completed
                        pass
            finally:
                self.done.set()


# Seconds that waits allow beyond the communicator's own deadlines before they report the
# completion thread as stuck.
_SLACK = 60.0


def _secs(t: float) -> float:
    """``t`` seconds as ``Event.wait`` and ``Thread.join`` take them."""
    return min(max(t, 0.0), threading.TIMEOUT_MAX)


class _Completer:
    """A thread that completes operations in the order they were queued.

    gradsync runs a communicator's operations one at a time in submission order, so waiting for
    them in that order never waits behind an operation that could finish later.

    Every op gets a deadline when it is queued: ``timeout`` (the communicator's, in seconds)
    for each unit of it and of every op queued before it and not yet finished, plus
    ``_SLACK``. gradsync bounds each of its operations by that timeout, so an op still
    unfinished at its deadline means the thread is stuck; waits report that instead of
    blocking for ever.
    """

    def __init__(self, name: str, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._units = 0  # of the ops queued and not finished
        self._current: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, op: "_Op") -> "_Op":
        with self._lock:
            if self._closed:
                raise RuntimeError(f"gradsync backend: rank {self.rank}: {op.name}: the group was shut down")
            self._units += op.units
            op.bound = self._bound()
            op.deadline = time.monotonic() + op.bound
            self._queue.put(op)
        return op

    def _bound(self) -> float:
        """Seconds the queued operations may take in all (hold ``_lock``)."""
        return self.timeout * self._units + _SLACK

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            self._current = op.name
            try:
                op.complete()
            except BaseException:  # noqa: BLE001 - complete() does not raise; keep going if it did
                pass
            finally:
                with self._lock:
                    self._units -= op.units
                self._current = None
            del op  # drop the tensors before blocking on the next one

    def close(self, wait: bool = True) -> None:
        """Stops taking operations; the queued ones still complete. With ``wait``, waits for
        them until the last one's deadline, then raises :class:`GradsyncError` naming the rank
        and the operation the thread is stuck in."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bound = self._bound()
            self._queue.put(None)
        if not wait or self._thread is threading.current_thread():
            return
        self._thread.join(_secs(bound))
        if self._thread.is_alive():
            raise GradsyncError(
                f"gradsync backend: rank {self.rank}: shutdown: the queued operations did not "
                f"finish within {bound:.0f} s (the communicator's timeout of {self.timeout:g} s "
                f"for each, plus {_SLACK:.0f} s); stuck in {self._current or 'an operation'}"
            )


class _GradsyncWork(dist._Work):
    """torch's handle on a queued operation.

    ``wait()`` blocks until the operation (and its copies out) are done and raises its error
    (:class:`gradsync.GradsyncError`, whose message names the ranks and the operation);
    ``wait(timeout)`` raises :class:`TimeoutError` when it elapses first (the operation goes
    on). Every wait ends by the operation's deadline (see :class:`_Completer`): past it,
    ``wait`` raises :class:`gradsync.GradsyncError` naming the rank and the operation.
    ``get_future()`` is a future completed with the op's tensors, or with its error.
    """

    def __init__(self, op: _Op, rank: int) -> None:
        super().__init__()
        self._op = op
        self._rank = rank

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        op = self._op
        limit = time.monotonic() + secs if secs else None
        end = op.deadline if limit is None else min(limit, op.deadline)
        if not op.done.wait(_secs(end - time.monotonic())):
            if limit is not None and limit <= op.deadline:
                raise TimeoutError(
                    f"gradsync backend: rank {self._rank}: {op.name} not completed within {secs} s "
                    "(it is still running)"
                )
            raise GradsyncError(
                f"gradsync backend: rank {self._rank}: {op.name} not completed by its deadline, "
                f"{op.bound:.0f} s after it was queued (the communicator's timeout for it and for "
                f"each operation queued before it, plus {_SLACK:.0f} s): the group's completion "
                "thread is stuck"
            )
        if isinstance(op.outcome, _Failed):
            raise op.outcome.error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._op.future

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and not isinstance(self._op.outcome, _Failed)

    def result(self):
        self.wait()
        return self._op.outcome


# --------------------------------------------------------------------------------------------
# Tensors


# torch's reduction operators and gradsync's names for them.
_OPS = (
    (ReduceOp.SUM, "sum"),
    (ReduceOp.PRODUCT, "prod"),
    (ReduceOp.MIN, "min"),
    (ReduceOp.MAX, "max"),
    (ReduceOp.AVG, "avg"),
    (ReduceOp.BAND, "band"),
    (ReduceOp.BOR, "bor"),
    (ReduceOp.BXOR, "bxor"),
)
_BITWISE = ("band", "bor", "bxor")


def _op_name(reduce_op: object, where: str) -> str:
    """gradsync's name of a ``ReduceOp`` (or ``RedOpType``)."""
    kind = getattr(reduce_op, "op", reduce_op)
    for torch_op, name in _OPS:
        if kind == torch_op:
            return name
    name = getattr(kind, "name", str(kind))
    raise NotImplementedError(
        f"gradsync backend: {where} with ReduceOp.{name} is not supported "
        "(supported: SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR)"
    )


def _check_tensor(t: torch.Tensor, where: str) -> None:
    if t.is_sparse:
        raise NotImplementedError(f"gradsync backend: {where} of a sparse tensor is not supported")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"gradsync backend: {where}: tensor is on {t.device}; gradsync works on CPU and CUDA tensors")


def _device_of(tensors: Iterable[torch.Tensor], where: str) -> torch.device:
    """The one device of a call's tensors (CPU when it has none); checks each tensor."""
    devices = []
    for t in tensors:
        _check_tensor(t, where)
        if t.device not in devices:
            devices.append(t.device)
    if len(devices) > 1:
        raise ValueError(
            f"gradsync backend: {where}: the tensors of one call are on several devices "
            f"({', '.join(str(d) for d in devices)})"
        )
    return devices[0] if devices else torch.device("cpu")


def _span(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """The byte range ``[start, end)`` a tensor's elements lie in; ``None`` when empty."""
    if t.numel() == 0:
        return None
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        extent = (size - 1) * stride * t.element_size()
        if extent >= 0:
            hi += extent
        else:
            lo += extent
    return lo, hi + t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    sa, sb = _span(a), _span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def _is_block(part: torch.Tensor, whole: torch.Tensor, index: int, count: int) -> bool:
    """Whether ``part`` is exactly block ``index`` of ``count`` equal blocks of ``whole``."""
    return (
        part.is_contiguous()
        and whole.is_contiguous()
        and part.dtype == whole.dtype
        and part.device == whole.device
        and part.numel() * count == whole.numel()
        and part.data_ptr() == whole.data_ptr() + index * part.numel() * part.element_size()
    )


def _in_place_error(where: str, what: str, rank: int, world: int, n: int) -> ValueError:
    return ValueError(
        f"gradsync backend: rank {rank}: {where}: {what}; in place, it must be exactly block "
        f"{rank} of {world} of the other (elements [{rank * n}, {(rank + 1) * n}), both "
        "contiguous); no other overlap of input and output is supported"
    )


class _Staged:
    """A contiguous stand-in for a tensor that gradsync cannot use in place (non-contiguous),
    copied back after the operation."""

    def __init__(self, t: torch.Tensor, copy_in: bool) -> None:
        self.orig = t
        if t.is_contiguous():
            self.buf = t
        else:
            self.buf = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype, device=t.device)

    @property
    def staged(self) -> bool:
        return self.buf is not self.orig

    def copy_back(self) -> None:
        if self.staged:
            self.orig.copy_(self.buf)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _movable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as gradsync can move it: itself for its types, else its bytes."""
    return t if t.dtype in _REDUCIBLE else _as_bytes(t)


def _2d(t: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """A contiguous tensor as ``rows`` blocks (a view)."""
    return t.view(rows, t.numel() // rows)


def _reducible(t: torch.Tensor, op: str, where: str) -> Tuple[torch.Tensor, str]:
    """``t`` and ``op`` as gradsync can reduce them: bool as bytes (or/and), and the bitwise
    operators on any integer type as bytes (each byte of the result depends on that byte of the
    inputs only)."""
    if op in _BITWISE:
        if t.dtype in (torch.int32, torch.int64, torch.uint8):
            return t, op
        if not t.dtype.is_floating_point and not t.dtype.is_complex:
            return _as_bytes(t), op
        raise TypeError(f"gradsync backend: {where}: ReduceOp.{op.upper()} needs an integer or bool tensor, got {t.dtype}")
    if t.dtype in _REDUCIBLE:
        return t, op
    if t.dtype == torch.bool:
        if op in ("sum", "max"):
            return _as_bytes(t), "max"
        if op in ("prod", "min"):
            return _as_bytes(t), "min"
        raise NotImplementedError(f"gradsync backend: {where} of bool tensors with {op} is not supported")
    raise TypeError(
        f"gradsync backend: {where}: dtype {t.dtype} cannot be reduced "
        "(float32, float64, float16, bfloat16, int32, int64, uint8, bool can; "
        "with BAND, BOR, BXOR every integer type)"
    )


def _chain(*fns: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    todo = [f for f in fns if f is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for f in todo:
            f()

    return run


def _copy_backs(staged: Iterable[_Staged]) -> Optional[Callable[[], None]]:
    todo = [s for s in staged if s.staged]
    if not todo:
        return None

    def run() -> None:
        for s in todo:
            s.copy_back()

    return run


def _p2p_staged(comm: Communicator, buf: torch.Tensor, sending: bool, staging, ready, timeout: float, where: str) -> None:
    """Sends (or receives) a device tensor through a host buffer of ``staging``."""
    flat = buf.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    host, fence = staging.pool.take(nbytes)
    last = fence
    try:
        wait_event(fence, timeout, where)
        h = host[:nbytes].view(flat.dtype)
        if sending:
            with staging.on_host_stream(ready):
                h.copy_(flat, non_blocking=True)
                last = staging.record()
            wait_event(last, timeout, where)
            comm.send(h, 1)
        else:
            comm.recv(h, 0)
            with staging.on_device_stream(ready):
                flat.copy_(h, non_blocking=True)
                last = staging.record()
            wait_event(last, timeout, where)
    finally:
        staging.pool.give(host, last)


# --------------------------------------------------------------------------------------------
# Point to point


class _Pair:
    """Point-to-point messages between this rank and one peer.

    Each direction has a two-rank gradsync communicator of its own (rank 0 the sender, rank 1
    the receiver) and a thread that drives it: gradsync's ``send`` and ``recv`` block, and a
    communicator runs its operations one at a time, so transfers that shared one could wait on
    each other. On their own communicators and threads, a rank's sends to the peer and its
    receives from it (and transfers with other peers) proceed independently, in whatever order
    the two ranks queue them; the messages of one direction are matched in order.

    The first message either way connects both directions, on the thread that carries it,
    meeting through the group's store (each direction's sender serves its store, as rank 0 does
    for the group); both ranks connect them in the same order, so two ranks whose first
    messages go opposite ways connect together.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        peer: int,
        timeout: Optional[datetime.timedelta],
        unit: float,
    ) -> None:
        self.rank, self.peer = rank, peer
        self.order = (min(rank, peer), max(rank, peer))
        self._store = store
        self._timeout = timeout
        self._unit = unit
        self._connect_lock = threading.Lock()  # held while connecting
        self._lock = threading.Lock()  # guards _comms and _closed
        self._comms: Optional[dict] = None  # (sender, receiver) -> (Communicator, StoreServer)
        self._error: Optional[BaseException] = None
        self._closed = False
        self._completers: dict = {}

    def _shut_error(self, sending: bool) -> RuntimeError:
        way = f"send to rank {self.peer}" if sending else f"recv from rank {self.peer}"
        return RuntimeError(f"gradsync backend: rank {self.rank}: {way}: the group was shut down")

    def _communicator(self, sending: bool) -> Communicator:
        """The communicator of one direction; connects both on first use (a channel thread)."""
        with self._connect_lock:
            if self._comms is None:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise self._shut_error(sending)
                comms = {}
                try:
                    for src, dst in sorted([(self.rank, self.peer), (self.peer, self.rank)]):
                        key = f"gradsync/p2p/{src}->{dst}"
                        if src != self.rank:
                            # The sender publishes the address; wait for it no longer than a
                            # transfer may take.
                            self._store.wait([key], datetime.timedelta(seconds=self._unit))
                        comms[(src, dst)] = _connect(self._store, 0 if src == self.rank else 1, 2, self._timeout, key=key)
                except BaseException as e:
                    self._error = e
                    for comm, server in comms.values():
                        try:
                            _close_all(comm, server)
                        except BaseException:  # noqa: BLE001 - the connection error is the one to see
                            pass
                    raise
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._comms = comms
                if closed:  # shut down while connecting
                    for comm, server in comms.values():
                        _close_all(comm, server)
                    raise self._shut_error(sending)
            return self._comms[self._ends(sending)][0]

    def _ends(self, sending: bool) -> tuple:
        """(sender, receiver) of the direction ``sending`` names."""
        return (self.rank, self.peer) if sending else (self.peer, self.rank)

    def submit(
        self,
        sending: bool,
        bufs: Sequence[torch.Tensor],
        result: object,
        after: Optional[Callable[[], None]],
        staging=None,
    ) -> _Op:
        """Queues the transfer of ``bufs`` (to the peer when ``sending``, else from it); with
        ``staging``, device tensors go through its host buffers (and ``after`` runs on its
        copy-back stream)."""
        way = f"send to rank {self.peer}" if sending else f"recv from rank {self.peer}"
        where = f"gradsync backend: rank {self.rank}: {way}"
        ready = staging.ready() if staging is not None else None

        def run() -> None:
            try:
                comm = self._communicator(sending)
                for b in bufs:
                    if staging is not None:
                        _p2p_staged(comm, b, sending, staging, ready, self._unit, where)
                    elif sending:
                        comm.send(b, 1)
                    else:
                        comm.recv(b, 0)
                if staging is not None and after is not None:
                    with staging.on_device_stream(ready):
                        after()
                        done = staging.record()
                    wait_event(done, self._unit, where)
            except GradsyncError as e:
                if str(e).startswith(where):
                    raise
                # gradsync's message numbers the ranks of the two-rank communicator.
                src, dst = self._ends(sending)
                hint = ""
                if sending and "timed out" in str(e):
                    hint = (
                        "; a send larger than gradsync buffers for a peer (3.5 MiB by default, "
                        "1 MiB over TCP) "
                        "ends only when the peer receives it: if both ranks send before they "
                        "receive, use isend/irecv or batch_isend_irecv"
                    )
                raise GradsyncError(
                    f"{where}: {e} (ranks of the communicator "
                    f"of messages from rank {src} to rank {dst}: 0 is rank {src}, 1 is rank {dst}){hint}"
                ) from e

        if staging is not None:
            after = None
        completer = self._completers.get(sending)
        first = completer is None
        if first:
            way = f"to{self.peer}" if sending else f"from{self.peer}"
            completer = _Completer(f"gradsync-p2p-rank{self.rank}-{way}", self.rank, self._unit)
            self._completers[sending] = completer
        # A direction's first op may also wait for the connection of both: for each, the peer's
        # address and the communicator's init. A staged transfer also waits for its copies.
        units = len(bufs) * (3 if staging is not None else 1) + (4 if first else 0)
        name = "send" if sending else "recv"
        return completer.submit(_Op(name, (), result, after, run=run, units=units))

    def close(self, wait: bool) -> None:
        """Stops taking transfers (with ``wait``, lets the queued ones end), then closes both
        communicators, in the same order on both ranks (a close waits a little for the peer's)."""
        errors = []
        for completer in self._completers.values():
            try:
                completer.close(wait)
            except BaseException as e:  # noqa: BLE001 - raised once closed
                errors.append(e)
        with self._lock:
            self._closed = True
            comms = self._comms or {}
        for key in sorted(comms):
            try:
                _close_all(*comms[key])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]


def _close_all(comm: Optional[Communicator], server: Optional[StoreServer]) -> None:
    try:
        if comm is not None:
            comm.close()
    finally:
        if server is not None:
            server.close()


# --------------------------------------------------------------------------------------------
# The backend


def _backends_in_python() -> bool:
    """Whether this torch builds a c10d ``Backend`` written in Python and calls its methods from
    C++ (where DDP and the group's own dispatch call them). Some releases (2.7, 2.8, 2.11) bind
    ``Backend`` without a constructor ("No constructor defined!"); a binding with a constructor
    but no way back into Python would build the object and then run c10d's own methods. Either
    way the group is a ``ProcessGroup`` written in Python instead, which torch builds and uses
    as it is."""

    class _Probe(_C10dBackend):
        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "gradsync-probe"

    try:
        # ``name()`` is c10d's, and calls the virtual getBackendName.
        return _Probe(0, 1).name() == "gradsync-probe"
    except Exception:  # noqa: BLE001 - any failure means: not this way
        return False


#: The class the backend derives from: c10d's ``Backend`` where torch builds one written in
#: Python, else its ``ProcessGroup`` (see :func:`_backends_in_python`). The environment
#: variable ``GRADSYNC_TORCH_BASE=process_group`` takes the ``ProcessGroup`` on any torch (so
#: that the tests run that path where torch has both).
_BASE = (
    dist.ProcessGroup
    if os.environ.get("GRADSYNC_TORCH_BASE") == "process_group" or not _backends_in_python()
    else _C10dBackend
)


class GradsyncBackend(_BASE):
    """A ``torch.distributed`` backend (a c10d ``Backend`` implemented in Python; a
    ``ProcessGroup`` where torch cannot build such a ``Backend``) that runs collectives on a
    :class:`gradsync.Communicator`.

    Built by ``init_process_group("gradsync")`` / ``new_group(backend="gradsync")`` after
    ``import gradsync.distributed``; see the module's documentation.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: Optional[datetime.timedelta] = None,
        comm: Optional[Communicator] = None,
    ) -> None:
        super().__init__(rank, size)
        self._timeout = timeout if timeout is not None else datetime.timedelta(minutes=30)
        self._options = _C10dBackend.Options(BACKEND_NAME, timeout=self._timeout)
        self._store = store
        # A communicator split from the default group's, else one of its own through a store.
        self._comm, self._server = (comm, None) if comm is not None else _connect(store, rank, size, timeout)
        self._completer = _Completer(f"gradsync-pg-rank{rank}", rank, self._comm.timeout)
        self._pairs: dict = {}
        self._pairs_lock = threading.Lock()
        self._shut = False
        self._init_staging()

    # -- identity ------------------------------------------------------------------------

    @property
    def options(self) -> _C10dBackend.Options:
        return self._options

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    @property
    def supports_coalescing(self) -> bool:
        # What batch_isend_irecv asks (torch's own answer recurses for a backend written in
        # Python): no, so it queues each transfer on its own.
        return False

    @property
    def communicator(self) -> Communicator:
        """The gradsync communicator the group runs on."""
        return self._comm

    def __repr__(self) -> str:
        return f"<gradsync.distributed.GradsyncBackend rank={self.rank()} size={self.size()}>"

    # -- a ProcessGroup's own names --------------------------------------------------------
    #
    # Where the class is a ``ProcessGroup`` (see ``_BASE``), torch's functions call the group's
    # methods by a group's names (``_allgather_base`` and the other aliases below).

    if _BASE is not _C10dBackend:
        # A ProcessGroup keeps its name and description in its backends, which this one has
        # none of; torch's own calls (``group_name``, DeviceMesh) reach these.

        def getGroupName(self) -> str:  # noqa: N802 - torch's name
            return getattr(self, "_group_name", "")

        def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
            self._group_name = name

        def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
            return getattr(self, "_group_desc", "")

        def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
            self._group_desc = desc

        def _get_backend(self, device: torch.device):
            # The group is its own backend, for every device.
            return self

    # -- helpers -------------------------------------------------------------------------

    def _init_staging(self) -> None:
        """State of the CUDA path (see ``_staging``): made when the group is built, the stager
        thread and the pinned buffers on first use."""
        self._staging_lock = threading.Lock()
        self._order_lock = threading.Lock()
        self._stager: Optional[_staging.Stager] = None
        self._slots: Optional[threading.Semaphore] = None
        self._cuda: dict = {}  # torch.device -> CudaStaging
        self._pinned: Optional[_staging.HostPool] = None
        self._host: Optional[_staging.HostStaging] = None
        # Tests set this to run CPU tensors through the staging pipeline (synchronous copies).
        self._stage_host_tensors = False

    def _staging_for(self, device: torch.device):
        """How tensors on ``device`` are staged: ``None`` for CPU tensors used in place."""
        if device.type == "cpu" and not self._stage_host_tensors:
            return None
        with self._staging_lock:
            if self._slots is None:
                depth = _staging.depth()
                self._slots = threading.Semaphore(depth)
                self._pinned = _staging.HostPool(pinned=True, keep=2 * depth)
            if device.type == "cpu":
                if self._host is None:
                    self._host = _staging.HostStaging(_staging.HostPool(pinned=False, keep=2 * _staging.depth()))
                return self._host
            staging = self._cuda.get(device)
            if staging is None:
                staging = self._cuda[device] = _staging.CudaStaging(device, self._pinned)
            return staging

    def _work(self, name: str, works: Sequence, result: object, after: Optional[Callable[[], None]] = None):
        op = self._completer.submit(_Op(name, works, result, after))
        return _GradsyncWork(op, self.rank())

    def _run(
        self,
        name: str,
        device: torch.device,
        calls: Sequence[_Call],
        result: object,
        after: Optional[Callable[[], None]] = None,
    ) -> _GradsyncWork:
        """Queues the gradsync operations of one torch call and returns its work.

        CPU tensors go to gradsync at once, unless operations wait in the stager (then they
        follow them there); staged tensors (CUDA) go through the stager.
        """
        staging = self._staging_for(device)
        with self._order_lock:
            if self._shut:
                raise RuntimeError(f"gradsync backend: rank {self.rank()}: {name}: the group was shut down")
            if staging is None and (self._stager is None or not self._stager.busy):
                return self._work(name, [c.direct() for c in calls], result, after)
            if self._stager is None:
                self._stager = _staging.Stager(f"gradsync-stager-rank{self.rank()}")
            if staging is None:
                sop = _staging.DeferredOp(calls)
            else:
                where = f"gradsync backend: rank {self.rank()}: {name}"
                sop = _staging.StagedOp(staging, calls, self._slots, self._comm.timeout, where, after)
                after = None
            op = _Op(name, (), result, after, units=sop.units)
            if staging is None:
                op.run = lambda: sop.complete(op.deadline, name)
            else:
                op.run = lambda: sop.complete(op.deadline)
            self._completer.submit(op)
            self._stager.defer(lambda: sop.submit(op.deadline), name)
        return _GradsyncWork(op, self.rank())

    def _unsupported(self, what: str):
        raise NotImplementedError(f"gradsync backend: {what} is not supported")

    # -- collectives ---------------------------------------------------------------------
    #
    # Every tensor of a call is checked (and staged) before anything is queued, so that a bad
    # tensor raises on its rank without leaving the call's earlier operations queued there.
    # Each collective becomes gradsync calls (``_Call``): run on CPU tensors in place, or
    # staged through host memory (CUDA).

    def allreduce(self, tensors, opts):
        op = _op_name(opts.reduceOp, "allreduce")
        device = _device_of(tensors, "allreduce")
        comm = self._comm
        staged, calls = [], []
        for t in tensors:
            s = _Staged(t, copy_in=True)
            buf, gop = _reducible(s.buf, op, "allreduce")
            b = _2d(buf)
            calls.append(_Call(lambda i, o, gop=gop: comm.all_reduce_async(o, gop), b, b, alias="same"))
            staged.append(s)
        return self._run("allreduce", device, calls, list(tensors), _copy_backs(staged))

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def allreduce_sparse(self, tensors, opts):
        self._unsupported("allreduce_sparse")

    def broadcast(self, tensors, opts):
        root = opts.rootRank
        device = _device_of(tensors, "broadcast")
        comm = self._comm
        staged, calls = [], []
        for t in tensors:
            s = _Staged(t, copy_in=self.rank() == root)
            b = _2d(_movable(s.buf))
            calls.append(
                _Call(lambda i, o: comm.broadcast_async(o, root), b if self.rank() == root else None, b, alias="same")
            )
            staged.append(s)
        return self._run("broadcast", device, calls, list(tensors), _copy_backs(staged))

    def reduce(self, tensors, opts):
        op = _op_name(opts.reduceOp, "reduce")
        root = opts.rootRank
        device = _device_of(tensors, "reduce")
        comm = self._comm
        calls, afters = [], []
        for t in tensors:
            s = _Staged(t, copy_in=True)
            buf, gop = _reducible(s.buf, op, "reduce")

            def fn(i, o, gop=gop):
                return comm.reduce_async(i, o, gop, root)

            if self.rank() == root:
                # gradsync's reduce is out of place: reduce a copy of the input into the tensor.
                calls.append(_Call(fn, _2d(buf.clone()), _2d(buf)))
                if s.staged:
                    afters.append(s.copy_back)
            else:
                calls.append(_Call(fn, _2d(buf), None))
        return self._run("reduce", device, calls, list(tensors), _chain(*afters))

    def allgather(self, output_tensors, input_tensors, opts=None):
        # torch 2.7 calls it without options (all_gather, all_gather_object).
        world = self.size()
        device = _device_of([*input_tensors, *(o for outs in output_tensors for o in outs)], "allgather")
        comm = self._comm
        calls, afters = [], []
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != world:
                raise ValueError(
                    f"gradsync backend: allgather: {len(outs)} output tensors for a group of {world}"
                )
            for o in outs:
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ValueError(
                        "gradsync backend: allgather: every output tensor must have the input's "
                        f"size and dtype ({inp.numel()} x {inp.dtype}), got {o.numel()} x {o.dtype}"
                    )
            src = _movable(inp.contiguous())
            flat = torch.empty(world * src.numel(), dtype=src.dtype, device=device)
            calls.append(_Call(lambda i, o: comm.all_gather_async(i, o), _2d(src), _2d(flat, world), rows=world))
            afters.append(_scatter_copy(flat, outs))
        return self._run("allgather", device, calls, [list(o) for o in output_tensors], _chain(*afters))

    def _all_gather_single(self, output, input, where):
        """A ``_Call`` for an ``all_gather_into_tensor``, and the staged output (or ``None``).

        In place (NCCL's rule) when the input is exactly the output's block ``rank``."""
        world, rank = self.size(), self.rank()
        if output.numel() != world * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"gradsync backend: {where}: the output must hold world_size x the "
                f"input ({world} x {input.numel()} x {input.dtype}), got "
                f"{output.numel()} x {output.dtype}"
            )
        comm = self._comm

        def fn(i, o):
            return comm.all_gather_async(i, o)

        if _overlaps(input, output):
            if not _is_block(input, output, rank, world):
                raise _in_place_error(where, "the input overlaps the output but is not its block", rank, world, input.numel())
            return _Call(fn, _2d(_movable(input)), _2d(_movable(output), world), alias="in_block", block=rank, rows=world), None
        s = _Staged(output, copy_in=False)
        return _Call(fn, _2d(_movable(input.contiguous())), _2d(_movable(s.buf), world), rows=world), s

    def all_gather_single(self, output, input, opts):
        return self.all_gather_single_coalesced([output], [input], opts, name="all_gather_into_tensor")

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        return self.allgather(output_lists, input_tensors, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None, name="all_gather_into_tensor_coalesced"):
        device = _device_of([*outputs, *inputs], name)
        parts = [self._all_gather_single(o, i, name) for o, i in zip(outputs, inputs)]
        staged = [s for _, s in parts if s is not None]
        return self._run(name, device, [c for c, _ in parts], list(outputs), _copy_backs(staged))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op_name(opts.reduceOp, "reduce_scatter")
        world = self.size()
        device = _device_of([*output_tensors, *(i for ins in input_tensors for i in ins)], "reduce_scatter")
        comm = self._comm
        calls, staged = [], []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != world:
                raise ValueError(
                    f"gradsync backend: reduce_scatter: {len(ins)} input tensors for a group of {world}"
                )
            for i in ins:
                if i.numel() != out.numel() or i.dtype != out.dtype:
                    raise ValueError(
                        "gradsync backend: reduce_scatter: every input tensor must have the output's "
                        f"size and dtype ({out.numel()} x {out.dtype}), got {i.numel()} x {i.dtype}"
                    )
            flat = torch.cat([i.reshape(-1) for i in ins]) if out.numel() else torch.empty(0, dtype=out.dtype, device=device)
            s = _Staged(out, copy_in=False)
            fin, gop = _reducible(flat, op, "reduce_scatter")
            fout, _ = _reducible(s.buf, op, "reduce_scatter")
            calls.append(
                _Call(lambda i, o, gop=gop: comm.reduce_scatter_async(i, o, gop), _2d(fin, world), _2d(fout), rows=world)
            )
            staged.append(s)
        return self._run("reduce_scatter", device, calls, list(output_tensors), _copy_backs(staged))

    def _reduce_scatter_single(self, output, input, op, where):
        """A ``_Call`` for a ``reduce_scatter_tensor``, and the staged output (or ``None``).

        In place (NCCL's rule) when the output is exactly the input's block ``rank``."""
        world, rank = self.size(), self.rank()
        if input.numel() != world * output.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"gradsync backend: {where}: the input must hold world_size x the "
                f"output ({world} x {output.numel()} x {output.dtype}), got "
                f"{input.numel()} x {input.dtype}"
            )
        comm = self._comm
        if _overlaps(input, output):
            if not _is_block(output, input, rank, world):
                raise _in_place_error(where, "the output overlaps the input but is not its block", rank, world, output.numel())
            fin, gop = _reducible(input, op, where)
            fout, _ = _reducible(output, op, where)
            call = _Call(
                lambda i, o: comm.reduce_scatter_async(i, o, gop),
                _2d(fin, world),
                _2d(fout),
                alias="out_block",
                block=rank,
                rows=world,
            )
            return call, None
        s = _Staged(output, copy_in=False)
        fin, gop = _reducible(input.contiguous(), op, where)
        fout, _ = _reducible(s.buf, op, where)
        return _Call(lambda i, o: comm.reduce_scatter_async(i, o, gop), _2d(fin, world), _2d(fout), rows=world), s

    def reduce_scatter_single(self, output, input, opts):
        return self.reduce_scatter_single_coalesced([output], [input], opts, name="reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts, name="reduce_scatter_tensor_coalesced"):
        op = _op_name(opts.reduceOp, name)
        device = _device_of([*outputs, *inputs], name)
        parts = [self._reduce_scatter_single(o, i, op, name) for o, i in zip(outputs, inputs)]
        staged = [s for _, s in parts if s is not None]
        return self._run(name, device, [c for c, _ in parts], list(outputs), _copy_backs(staged))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def gather(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        world, rank = self.size(), self.rank()
        outputs = [o for outs in output_tensors for o in outs] if rank == root else []
        device = _device_of([*input_tensors, *outputs], "gather")
        comm = self._comm
        calls, afters = [], []
        for idx, inp in enumerate(input_tensors):
            src = _movable(inp.contiguous())
            out = None
            if rank == root:
                outs = output_tensors[idx]
                if len(outs) != world:
                    raise ValueError(f"gradsync backend: gather: {len(outs)} output tensors for a group of {world}")
                for o in outs:
                    if o.numel() != inp.numel() or o.dtype != inp.dtype:
                        raise ValueError(
                            "gradsync backend: gather: every output tensor must have the input's "
                            f"size and dtype ({inp.numel()} x {inp.dtype}), got {o.numel()} x {o.dtype}"
                        )
                flat = torch.empty(world * src.numel(), dtype=src.dtype, device=device)
                out = _2d(flat, world)
                afters.append(_scatter_copy(flat, outs))

            calls.append(_Call(lambda i, o: comm.gather_async(i, o, root), _2d(src), out, rows=world))
        result = [list(o) for o in output_tensors] if rank == root else []
        return self._run("gather", device, calls, result, _chain(*afters))

    def scatter(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        world, rank = self.size(), self.rank()
        inputs = [i for ins in input_tensors for i in ins] if rank == root else []
        device = _device_of([*output_tensors, *inputs], "scatter")
        comm = self._comm
        calls, staged = [], []
        for idx, out in enumerate(output_tensors):
            s = _Staged(out, copy_in=False)
            dst = _movable(s.buf)
            src = None
            if rank == root:
                ins = input_tensors[idx]
                if len(ins) != world:
                    raise ValueError(f"gradsync backend: scatter: {len(ins)} input tensors for a group of {world}")
                for i in ins:
                    if i.numel() != out.numel() or i.dtype != out.dtype:
                        raise ValueError(
                            "gradsync backend: scatter: every input tensor must have the output's "
                            f"size and dtype ({out.numel()} x {out.dtype}), got {i.numel()} x {i.dtype}"
                        )
                src = _2d(torch.cat([_movable(i.contiguous()).reshape(-1) for i in ins]), world)

            calls.append(_Call(lambda i, o: comm.scatter_async(i, o, root), src, _2d(dst), rows=world))
            staged.append(s)
        return self._run("scatter", device, calls, list(output_tensors), _copy_backs(staged))

    def alltoall(self, output_tensors, input_tensors, opts):
        where = "all_to_all"
        world = self.size()
        device = _device_of([*output_tensors, *input_tensors], where)
        if len(output_tensors) != world or len(input_tensors) != world:
            raise ValueError(
                f"gradsync backend: {where}: {len(input_tensors)} input and {len(output_tensors)} "
                f"output tensors for a group of {world}"
            )
        dtypes = {t.dtype for t in [*output_tensors, *input_tensors]}
        if len(dtypes) != 1:
            raise ValueError(f"gradsync backend: {where}: the tensors have several dtypes ({sorted(map(str, dtypes))})")
        for o in output_tensors:
            for i in input_tensors:
                if _overlaps(o, i):
                    raise ValueError(f"gradsync backend: {where}: an output tensor overlaps an input tensor")
        src = torch.cat([_movable(t.contiguous()).reshape(-1) for t in input_tensors])
        send = [_movable(t.contiguous()).numel() for t in input_tensors]
        recv = [t.numel() * t.element_size() // src.element_size() for t in output_tensors]
        flat = torch.empty(sum(recv), dtype=src.dtype, device=device)
        call = self._all_to_all_call(src, send, flat, recv, even=False)
        return self._run(where, device, [call], list(output_tensors), _split_copy(flat, recv, output_tensors))

    def _all_to_all_call(self, src: torch.Tensor, send: Sequence[int], dst: torch.Tensor, recv: Sequence[int], even: bool) -> _Call:
        """The gradsync call of an all-to-all of flat ``src`` (blocks of ``send`` elements, in
        rank order) into flat ``dst`` (``recv``): ``all_to_all`` (chunked when staged) when the
        call is ``even`` on every rank (``all_to_all_single`` without split sizes), else
        ``all_to_allv``. The choice must not depend on this rank's sizes alone: every rank makes
        the same gradsync call."""
        world = self.size()
        comm = self._comm
        if even:
            return _Call(lambda i, o: comm.all_to_all_async(i, o), _2d(src, world), _2d(dst, world), rows=world)
        send, recv = [int(c) for c in send], [int(c) for c in recv]
        return _Call(lambda i, o: comm.all_to_allv_async(i, send, o, recv), _2d(src), _2d(dst), chunked=False)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        where = "all_to_all_single"
        world = self.size()
        device = _device_of([output, input], where)
        if output.dtype != input.dtype:
            raise ValueError(f"gradsync backend: {where}: input of {input.dtype} but output of {output.dtype}")
        if _overlaps(output, input):
            raise ValueError(f"gradsync backend: rank {self.rank()}: {where}: the output overlaps the input (all-to-all is out of place)")

        def splits(t: torch.Tensor, sizes, what: str) -> list:
            rows = t.shape[0] if t.dim() else 1
            if not sizes:
                if rows % world:
                    raise ValueError(
                        f"gradsync backend: rank {self.rank()}: {where}: without split sizes the {what}'s "
                        f"first dimension ({rows}) must divide by the group's size ({world})"
                    )
                return [rows // world] * world
            sizes = [int(s) for s in sizes]
            if len(sizes) != world or any(s < 0 for s in sizes) or sum(sizes) != rows:
                raise ValueError(
                    f"gradsync backend: rank {self.rank()}: {where}: {what} split sizes {sizes} must be "
                    f"{world} non-negative sizes adding up to the {what}'s first dimension ({rows})"
                )
            return sizes

        send_rows = splits(input, input_split_sizes, "input")
        recv_rows = splits(output, output_split_sizes, "output")
        row_in = input[0].numel() if input.dim() and input.shape[0] else None
        row_out = output[0].numel() if output.dim() and output.shape[0] else None
        if row_in is not None and row_out is not None and row_in != row_out:
            raise ValueError(
                f"gradsync backend: {where}: a row of the input has {row_in} elements but a row of "
                f"the output {row_out}"
            )
        row = row_in if row_in is not None else (row_out if row_out is not None else 1)
        s = _Staged(output, copy_in=False)
        src = _movable(input.contiguous()).reshape(-1)
        dst = _movable(s.buf).reshape(-1)
        scale = 1 if input.dtype in _REDUCIBLE else input.element_size()  # bytes when moved as bytes
        send = [r * row * scale for r in send_rows]
        recv = [r * row * scale for r in recv_rows]
        even = not output_split_sizes and not input_split_sizes
        if even and src.numel() != dst.numel():
            raise ValueError(
                f"gradsync backend: rank {self.rank()}: {where}: without split sizes the input and "
                f"output must have one size, got {input.numel()} and {output.numel()} elements"
            )
        call = self._all_to_all_call(src, send, dst, recv, even)
        return self._run(where, device, [call], [output], _copy_backs([s]))

    alltoall_base = all_to_all_single

    def barrier(self, opts):
        comm = self._comm
        return self._run("barrier", torch.device("cpu"), [_Call(lambda i, o: comm.barrier_async(), None, None)], [])

    # -- point to point ------------------------------------------------------------------

    def _p2p(self, where: str, peer: int, sending: bool, bufs, result, after, device) -> _GradsyncWork:
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(
                f"gradsync backend: {where}: peer {peer} is not another rank of this group "
                f"(rank {self.rank()} of {self.size()})"
            )
        staging = self._staging_for(device)
        with self._pairs_lock:
            if self._shut:
                raise RuntimeError(f"gradsync backend: rank {self.rank()}: {where}: the group was shut down")
            pair = self._pairs.get(peer)
            if pair is None:
                pair = _Pair(self._store, self.rank(), peer, self._timeout, self._comm.timeout)
                self._pairs[peer] = pair
            op = pair.submit(sending, bufs, result, after, staging)
        return _GradsyncWork(op, self.rank())

    def send(self, tensors, dst, tag=0):
        device = _device_of(tensors, "send")
        bufs = [_movable(t.contiguous()) for t in tensors]
        return self._p2p("send", dst, True, bufs, list(tensors), None, device)

    def recv(self, tensors, src, tag=0):
        device = _device_of(tensors, "recv")
        staged = [_Staged(t, copy_in=False) for t in tensors]
        bufs = [_movable(s.buf) for s in staged]
        return self._p2p("recv", src, False, bufs, list(tensors), _copy_backs(staged), device)

    def recv_anysource(self, tensors, tag=0):
        self._unsupported("recv from any source")

    # -- lifecycle -----------------------------------------------------------------------

    def _close(self, wait: bool) -> None:
        with self._pairs_lock:
            if self._shut:
                return
            self._shut = True
            # Closing a communicator waits a little for its peer to close it too: every rank
            # closes its pairs' communicators in the same order.
            pairs = sorted(self._pairs.values(), key=lambda p: p.order)
        errors = []
        for close in [p.close for p in pairs] + [self._close_stager, self._completer.close]:
            try:
                close(wait)
            except BaseException as e:  # noqa: BLE001 - raised once everything is closed
                errors.append(e)
        try:
            _close_all(self._comm, self._server)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        if errors:
            raise errors[0]

    def _close_stager(self, wait: bool) -> None:
        # The operations queued in the stager are still submitted; the completion thread's
        # close waits for them (each bounded by its deadline).
        with self._order_lock:
            stager = self._stager
        if stager is not None:
            stager.close(None)

    def shutdown(self) -> None:
        """Waits for the queued operations to complete (each bounded by the communicator's
        timeout; see :class:`_Completer`), then closes the communicators and the stores."""
        self._close(wait=True)

    def abort(self) -> None:
        """Stops taking operations and closes, without waiting for the completion threads.

        This is not immediate: gradsync cannot cancel an operation, so closing a communicator
        still lets the operations already queued on it run to their end, each bounded by the
        communicator's timeout (an operation whose peers are gone fails at that deadline). The
        futures of those operations still complete, with their results or errors.
        """
        self._close(wait=False)


def _fill(out: torch.Tensor, part: torch.Tensor) -> None:
    """Copies the flat ``part`` (of ``out``'s dtype, or its bytes) into ``out``."""
    if part.dtype != out.dtype:  # moved as bytes
        part = part.view(out.dtype)
    out.copy_(part.view(out.shape))


def _scatter_copy(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Copies the ``len(outs)`` equal parts of ``flat`` into ``outs``."""

    def run() -> None:
        n = flat.numel() // max(len(outs), 1)
        for i, o in enumerate(outs):
            _fill(o, flat[i * n : (i + 1) * n])

    return run


def _split_copy(flat: torch.Tensor, counts: Sequence[int], outs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Copies consecutive parts of ``flat``, of ``counts`` elements, into ``outs``."""

    def run() -> None:
        start = 0
        for n, o in zip(counts, outs):
            _fill(o, flat[start : start + n])
            start += n

    return run


def _split_from_default(ranks: Sequence[int], timeout: Optional[datetime.timedelta]) -> Optional[Communicator]:
    """The communicator of a new group of the default group's ``ranks`` (global ranks, in the
    group's order), split from the default group's communicator by the members alone; ``None``
    for the default group itself, or when the default group does not run on gradsync."""
    if not ranks or not dist.is_initialized():
        return None
    try:
        parent = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    if not isinstance(parent, GradsyncBackend) or parent._shut:
        return None
    return parent.communicator.split_ranks(list(ranks), timeout=_timeout_seconds(timeout))


def _create_backend(opts, backend_options=None):
    """Builds a group's backend; ``opts`` is torch's ``_DistributedBackendOptions`` (the
    extended creator API), whose ``global_ranks_in_group`` is empty for the default group."""
    comm = _split_from_default(opts.global_ranks_in_group, opts.timeout)
    return GradsyncBackend(opts.store, opts.group_rank, opts.group_size, opts.timeout, comm=comm)


def register() -> None:
    """Registers the backend ``"gradsync"`` with ``torch.distributed`` (done on import)."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


register()


# --------------------------------------------------------------------------------------------
# DDP communication hook

_hook_counter = itertools.count()


class HookState:
    """State of :func:`allreduce_hook`: the gradsync communicator the gradients travel on.

    ``HookState(comm)`` uses an existing :class:`gradsync.Communicator`;
    ``HookState(process_group=pg)`` (or :func:`make_hook_state`) builds one over the ranks of a
    ``torch.distributed`` group (default: the world), meeting through that group's store; every
    rank of the group must build its state in the same order. :meth:`close` ends it (the
    communicator too when the state built it).
    """

    def __init__(
        self,
        comm: Optional[Communicator] = None,
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        timeout: Optional[datetime.timedelta] = None,
    ) -> None:
        self._server = None
        self._owns = comm is None
        if comm is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "gradsync.distributed.HookState: call torch.distributed.init_process_group "
                    "first, or pass a gradsync.Communicator"
                )
            pg = process_group if process_group is not None else dist.group.WORLD
            # torch 2.8 has no ProcessGroup.get_group_store; its module keeps the store.
            get_store = getattr(pg, "get_group_store", None)
            group_store = get_store() if get_store is not None else dist.distributed_c10d._get_process_group_store(pg)
            store = dist.PrefixStore("gradsync-hook/", group_store)
            key = f"comm{next(_hook_counter)}"
            comm, self._server = _connect(store, pg.rank(), pg.size(), timeout, key=key)
        self.comm = comm
        self.world_size = comm.world_size
        self._completer = _Completer(f"gradsync-hook-rank{comm.rank}", comm.rank, comm.timeout)

    def close(self) -> None:
        """Finishes the queued all-reduces (raising :class:`gradsync.GradsyncError` when they
        overrun their deadline); closes the communicator if this state built it."""
        try:
            self._completer.close(wait=True)
        finally:
            if self._owns:
                _close_all(self.comm, self._server)

    def __getstate__(self):
        raise TypeError("gradsync.distributed.HookState cannot be pickled")


def make_hook_state(
    process_group: Optional[dist.ProcessGroup] = None,
    comm: Optional[Communicator] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> HookState:
    """A :class:`HookState` on ``comm``, or on a new communicator over ``process_group``'s ranks
    (default: the world)."""
    return HookState(comm, process_group=process_group, timeout=timeout)


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each gradient bucket over the ranks on gradsync.

    Like DDP's default, the bucket is divided by the world size and then summed; the returned
    future completes, with the averaged bucket, when gradsync has finished. Register it with
    ``model.register_comm_hook(state, allreduce_hook)``.
    """
    buf = bucket.buffer()
    if buf.device.type != "cpu":
        raise ValueError(
            f"gradsync.distributed.allreduce_hook: rank {state.comm.rank}: the gradient bucket is on "
            f"{buf.device}; the hook all-reduces CPU buckets (for CUDA models use the process "
            'group backend, init_process_group("gradsync"), which stages CUDA tensors)'
        )
    buf.div_(state.world_size)
    work = state.comm.all_reduce_async(buf, "sum")
    return state._completer.submit(_Op("allreduce_hook", [work], buf, None)).future
