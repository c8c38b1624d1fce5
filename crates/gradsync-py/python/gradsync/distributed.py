"""gradsync under ``torch.distributed``: a process-group backend and a DDP communication hook.

Importing this module registers the backend ``"gradsync"`` for CPU tensors, so that::

    import gradsync.distributed  # registers the backend
    torch.distributed.init_process_group("gradsync")

works under ``torchrun`` and ``gradsync launch`` (or any ``env://``, ``tcp://`` or ``file://``
rendezvous), and the usual collectives and an unmodified ``DistributedDataParallel`` model run
on gradsync.

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

Deadlines: gradsync bounds each operation by the communicator's timeout, and every wait here has
a deadline of its own as well: the communicator's timeout for the operation and for each one
queued before it and not yet finished, plus 60 seconds. A ``wait()`` that reaches it, and a
``destroy_process_group`` whose queued operations overrun it, raise ``GradsyncError`` naming the
rank and the operation instead of blocking. ``abort`` stops taking operations and does not wait
for the completion threads, but it is not immediate: gradsync cannot cancel an operation, so the
ones already queued run to their end (each bounded by the timeout) while the communicator closes.

What the backend implements:

- ``allreduce`` (and ``allreduce_coalesced``) with ``SUM``, ``PRODUCT``, ``MIN``, ``MAX``,
  ``AVG``; bool tensors are reduced as bytes (``SUM``/``MAX`` are logical or, ``MIN``/``PRODUCT``
  logical and);
- ``broadcast``, ``reduce``, ``allgather`` (list form and ``all_gather_into_tensor``),
  ``reduce_scatter`` (list form and ``reduce_scatter_tensor``), ``barrier``;
- ``gather`` and ``scatter``, built on all-gather and broadcast (every rank moves the whole
  data; fine for objects and metadata, not meant for bulk data);
- ``send``/``recv``, ``isend``/``irecv`` and ``batch_isend_irecv``. Each direction between two
  ranks has its own two-rank gradsync communicator and its own thread; the first message either
  way between two ranks connects both directions (through the group's store, about 0.1 s on one
  host). Transfers return at once and proceed independently of the group's collectives and of
  each other: a rank's ``isend`` to a peer and ``irecv`` from it complete whichever the two ranks
  queue first (two ranks may both send, then both receive). Messages one way between two ranks
  are matched in the order they were sent; tags are not matched. A blocking ``send`` returns once
  the message has been handed over (the first one also waits for the peer's first transfer with
  this rank, which connects them): at once for a message that fits in what gradsync buffers for
  a peer, (``GRADSYNC_NSLOTS`` - 1) x ``GRADSYNC_CHUNK_SIZE`` bytes on one host and
  (``GRADSYNC_TCP_NSLOTS`` - 1) x ``GRADSYNC_CHUNK_SIZE`` over TCP (3.5 MiB and 1 MiB by
  default: on one host an exchange of 3 MiB blocking sends completes, one of 4 MiB does not),
  else once the peer receives it. So two ranks that both ``send`` large messages before they
  ``recv`` wait for each other until the timeout and then fail (the error says so); use
  ``isend``/``irecv`` or ``batch_isend_irecv`` for exchanges.

Other operations (``all_to_all``, ``recv`` from any source, sparse all-reduce, ``PREMUL_SUM`` and
the bitwise reductions) raise :class:`NotImplementedError` naming the operation.

Data movement (broadcast, gathers, scatter, send/recv) works on any dtype, moved as bytes;
reductions need one of gradsync's types (float32, float64, float16, bfloat16, int32, int64,
uint8) or bool. Non-contiguous tensors are reduced through a contiguous copy.

The DDP communication hook, for jobs that keep Gloo (or any backend) as the process group and
let gradsync all-reduce only the gradients::

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

from . import Communicator, GradsyncError, StoreServer

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


def _op_name(reduce_op: object, where: str) -> str:
    """gradsync's name of a ``ReduceOp`` (or ``RedOpType``)."""
    kind = getattr(reduce_op, "op", reduce_op)
    if kind == ReduceOp.SUM:
        return "sum"
    if kind == ReduceOp.PRODUCT:
        return "prod"
    if kind == ReduceOp.MIN:
        return "min"
    if kind == ReduceOp.MAX:
        return "max"
    if kind == ReduceOp.AVG:
        return "avg"
    name = getattr(kind, "name", str(kind))
    raise NotImplementedError(
        f"gradsync backend: {where} with ReduceOp.{name} is not supported "
        "(supported: SUM, PRODUCT, MIN, MAX, AVG)"
    )


def _check_cpu(t: torch.Tensor, where: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"gradsync backend: {where}: tensor is on {t.device}; gradsync works on CPU tensors")
    if t.is_sparse:
        raise NotImplementedError(f"gradsync backend: {where} of a sparse tensor is not supported")


class _Staged:
    """A contiguous stand-in for a tensor that gradsync cannot use in place (non-contiguous),
    copied back after the operation."""

    def __init__(self, t: torch.Tensor, copy_in: bool) -> None:
        self.orig = t
        if t.is_contiguous():
            self.buf = t
        else:
            self.buf = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype)

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


def _reducible(t: torch.Tensor, op: str, where: str) -> Tuple[torch.Tensor, str]:
    """``t`` and ``op`` as gradsync can reduce them (bool as bytes, or/and)."""
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
        "(float32, float64, float16, bfloat16, int32, int64, uint8, bool can)"
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

    def submit(self, sending: bool, bufs: Sequence[torch.Tensor], result: object, after: Optional[Callable[[], None]]) -> _Op:
        """Queues the transfer of ``bufs`` (to the peer when ``sending``, else from it)."""

        def run() -> None:
            try:
                comm = self._communicator(sending)
                for b in bufs:
                    if sending:
                        comm.send(b, 1)
                    else:
                        comm.recv(b, 0)
            except GradsyncError as e:
                # gradsync's message numbers the ranks of the two-rank communicator.
                src, dst = self._ends(sending)
                way = f"send to rank {self.peer}" if sending else f"recv from rank {self.peer}"
                hint = ""
                if sending and "timed out" in str(e):
                    hint = (
                        "; a send larger than gradsync buffers for a peer (3.5 MiB by default, "
                        "1 MiB over TCP) "
                        "ends only when the peer receives it: if both ranks send before they "
                        "receive, use isend/irecv or batch_isend_irecv"
                    )
                raise GradsyncError(
                    f"gradsync backend: rank {self.rank}: {way}: {e} (ranks of the communicator "
                    f"of messages from rank {src} to rank {dst}: 0 is rank {src}, 1 is rank {dst}){hint}"
                ) from e

        completer = self._completers.get(sending)
        first = completer is None
        if first:
            way = f"to{self.peer}" if sending else f"from{self.peer}"
            completer = _Completer(f"gradsync-p2p-rank{self.rank}-{way}", self.rank, self._unit)
            self._completers[sending] = completer
        # A direction's first op may also wait for the connection of both: for each, the peer's
        # address and the communicator's init.
        units = len(bufs) + (4 if first else 0)
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


class GradsyncBackend(_C10dBackend):
    """A ``torch.distributed`` backend (a c10d ``Backend`` implemented in Python) that runs
    collectives on a :class:`gradsync.Communicator`.

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

    # -- helpers -------------------------------------------------------------------------

    def _work(self, name: str, works: Sequence, result: object, after: Optional[Callable[[], None]] = None):
        op = self._completer.submit(_Op(name, works, result, after))
        return _GradsyncWork(op, self.rank())

    def _unsupported(self, what: str):
        raise NotImplementedError(f"gradsync backend: {what} is not supported")

    # -- collectives ---------------------------------------------------------------------
    #
    # Every tensor of a call is checked (and staged) before anything is queued, so that a bad
    # tensor raises on its rank without leaving the call's earlier operations queued there.

    def allreduce(self, tensors, opts):
        op = _op_name(opts.reduceOp, "allreduce")
        staged, bufs = [], []
        for t in tensors:
            _check_cpu(t, "allreduce")
            s = _Staged(t, copy_in=True)
            bufs.append(_reducible(s.buf, op, "allreduce"))
            staged.append(s)
        works = [self._comm.all_reduce_async(buf, gop) for buf, gop in bufs]
        return self._work("allreduce", works, list(tensors), _copy_backs(staged))

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def allreduce_sparse(self, tensors, opts):
        self._unsupported("allreduce_sparse")

    def broadcast(self, tensors, opts):
        root = opts.rootRank
        staged = []
        for t in tensors:
            _check_cpu(t, "broadcast")
            staged.append(_Staged(t, copy_in=self.rank() == root))
        works = [self._comm.broadcast_async(_movable(s.buf), root) for s in staged]
        return self._work("broadcast", works, list(tensors), _copy_backs(staged))

    def reduce(self, tensors, opts):
        op = _op_name(opts.reduceOp, "reduce")
        root = opts.rootRank
        calls, afters = [], []
        for t in tensors:
            _check_cpu(t, "reduce")
            s = _Staged(t, copy_in=True)
            buf, gop = _reducible(s.buf, op, "reduce")
            if self.rank() == root:
                # gradsync's reduce is out of place: reduce a copy of the input into the tensor.
                calls.append((buf.clone(), buf, gop))
                if s.staged:
                    afters.append(s.copy_back)
            else:
                calls.append((buf, None, gop))
        works = [self._comm.reduce_async(i, o, gop, root) for i, o, gop in calls]
        return self._work("reduce", works, list(tensors), _chain(*afters))

    def allgather(self, output_tensors, input_tensors, opts):
        world = self.size()
        calls, afters = [], []
        for outs, inp in zip(output_tensors, input_tensors):
            _check_cpu(inp, "allgather")
            if len(outs) != world:
                raise ValueError(
                    f"gradsync backend: allgather: {len(outs)} output tensors for a group of {world}"
                )
            for o in outs:
                _check_cpu(o, "allgather")
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ValueError(
                        "gradsync backend: allgather: every output tensor must have the input's "
                        f"size and dtype ({inp.numel()} x {inp.dtype}), got {o.numel()} x {o.dtype}"
                    )
            src = _movable(inp.contiguous())
            flat = torch.empty(world * src.numel(), dtype=src.dtype)
            calls.append((src, flat))
            afters.append(_scatter_copy(flat, outs))
        works = [self._comm.all_gather_async(src, flat) for src, flat in calls]
        return self._work("allgather", works, [list(o) for o in output_tensors], _chain(*afters))

    def _all_gather_single(self, output, input):
        """Checks an ``all_gather_into_tensor`` and stages it: ``(input, output, staged)``."""
        _check_cpu(output, "all_gather_into_tensor")
        _check_cpu(input, "all_gather_into_tensor")
        if output.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                "gradsync backend: all_gather_into_tensor: the output must hold world_size x the "
                f"input ({self.size()} x {input.numel()} x {input.dtype}), got "
                f"{output.numel()} x {output.dtype}"
            )
        s = _Staged(output, copy_in=False)
        return _movable(input.contiguous()), _movable(s.buf), s

    def all_gather_single(self, output, input, opts):
        return self.all_gather_single_coalesced([output], [input], opts, name="all_gather_into_tensor")

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        return self.allgather(output_lists, input_tensors, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts, name="all_gather_into_tensor_coalesced"):
        parts = [self._all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        works = [self._comm.all_gather_async(i, o) for i, o, _ in parts]
        return self._work(name, works, list(outputs), _copy_backs([s for _, _, s in parts]))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        op = _op_name(opts.reduceOp, "reduce_scatter")
        world = self.size()
        calls, staged = [], []
        for out, ins in zip(output_tensors, input_tensors):
            _check_cpu(out, "reduce_scatter")
            if len(ins) != world:
                raise ValueError(
                    f"gradsync backend: reduce_scatter: {len(ins)} input tensors for a group of {world}"
                )
            for i in ins:
                _check_cpu(i, "reduce_scatter")
                if i.numel() != out.numel() or i.dtype != out.dtype:
                    raise ValueError(
                        "gradsync backend: reduce_scatter: every input tensor must have the output's "
                        f"size and dtype ({out.numel()} x {out.dtype}), got {i.numel()} x {i.dtype}"
                    )
            flat = torch.cat([i.reshape(-1) for i in ins]) if out.numel() else torch.empty(0, dtype=out.dtype)
            s = _Staged(out, copy_in=False)
            fin, gop = _reducible(flat, op, "reduce_scatter")
            fout, _ = _reducible(s.buf, op, "reduce_scatter")
            calls.append((fin, fout, gop))
            staged.append(s)
        works = [self._comm.reduce_scatter_async(fin, fout, gop) for fin, fout, gop in calls]
        return self._work("reduce_scatter", works, list(output_tensors), _copy_backs(staged))

    def _reduce_scatter_single(self, output, input, op):
        """Checks a ``reduce_scatter_tensor`` and stages it: ``(input, output, op, staged)``."""
        _check_cpu(output, "reduce_scatter_tensor")
        _check_cpu(input, "reduce_scatter_tensor")
        if input.numel() != self.size() * output.numel() or output.dtype != input.dtype:
            raise ValueError(
                "gradsync backend: reduce_scatter_tensor: the input must hold world_size x the "
                f"output ({self.size()} x {output.numel()} x {output.dtype}), got "
                f"{input.numel()} x {input.dtype}"
            )
        s = _Staged(output, copy_in=False)
        fin, gop = _reducible(input.contiguous(), op, "reduce_scatter_tensor")
        fout, _ = _reducible(s.buf, op, "reduce_scatter_tensor")
        return fin, fout, gop, s

    def reduce_scatter_single(self, output, input, opts):
        return self.reduce_scatter_single_coalesced([output], [input], opts, name="reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts, name="reduce_scatter_tensor_coalesced"):
        op = _op_name(opts.reduceOp, name)
        parts = [self._reduce_scatter_single(o, i, op) for o, i in zip(outputs, inputs)]
        works = [self._comm.reduce_scatter_async(fin, fout, gop) for fin, fout, gop, _ in parts]
        return self._work(name, works, list(outputs), _copy_backs([s for *_, s in parts]))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def gather(self, output_tensors, input_tensors, opts):
        # Built on all-gather: every rank receives everything, the root keeps it.
        root = opts.rootRank
        world = self.size()
        calls, afters = [], []
        for idx, inp in enumerate(input_tensors):
            _check_cpu(inp, "gather")
            src = _movable(inp.contiguous())
            flat = torch.empty(world * src.numel(), dtype=src.dtype)
            if self.rank() == root:
                outs = output_tensors[idx]
                if len(outs) != world:
                    raise ValueError(f"gradsync backend: gather: {len(outs)} output tensors for a group of {world}")
                for o in outs:
                    _check_cpu(o, "gather")
                afters.append(_scatter_copy(flat, outs))
            calls.append((src, flat))
        works = [self._comm.all_gather_async(src, flat) for src, flat in calls]
        result = [list(o) for o in output_tensors] if self.rank() == root else []
        return self._work("gather", works, result, _chain(*afters))

    def scatter(self, output_tensors, input_tensors, opts):
        # Built on broadcast: the root sends everything, every rank keeps its part.
        root = opts.rootRank
        world = self.size()
        flats, afters = [], []
        for idx, out in enumerate(output_tensors):
            _check_cpu(out, "scatter")
            n = _movable(out.contiguous()).numel()
            if self.rank() == root:
                ins = input_tensors[idx]
                if len(ins) != world:
                    raise ValueError(f"gradsync backend: scatter: {len(ins)} input tensors for a group of {world}")
                for i in ins:
                    _check_cpu(i, "scatter")
                flat = torch.cat([_movable(i.contiguous()) for i in ins])
            else:
                flat = torch.empty(world * n, dtype=_movable(out.contiguous()).dtype)
            flats.append(flat)
            afters.append(_take_part(flat, out, self.rank() * n, n))
        works = [self._comm.broadcast_async(flat, root) for flat in flats]
        return self._work("scatter", works, list(output_tensors), _chain(*afters))

    def alltoall(self, output_tensors, input_tensors, opts):
        self._unsupported("all_to_all")

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        self._unsupported("all_to_all_single")

    def barrier(self, opts):
        return self._work("barrier", [self._comm.barrier_async()], [])

    # -- point to point ------------------------------------------------------------------

    def _p2p(self, where: str, peer: int, sending: bool, bufs, result, after) -> _GradsyncWork:
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(
                f"gradsync backend: {where}: peer {peer} is not another rank of this group "
                f"(rank {self.rank()} of {self.size()})"
            )
        with self._pairs_lock:
            if self._shut:
                raise RuntimeError(f"gradsync backend: rank {self.rank()}: {where}: the group was shut down")
            pair = self._pairs.get(peer)
            if pair is None:
                pair = _Pair(self._store, self.rank(), peer, self._timeout, self._comm.timeout)
                self._pairs[peer] = pair
            op = pair.submit(sending, bufs, result, after)
        return _GradsyncWork(op, self.rank())

    def send(self, tensors, dst, tag=0):
        for t in tensors:
            _check_cpu(t, "send")
        bufs = [_movable(t.contiguous()) for t in tensors]
        return self._p2p("send", dst, True, bufs, list(tensors), None)

    def recv(self, tensors, src, tag=0):
        for t in tensors:
            _check_cpu(t, "recv")
        staged = [_Staged(t, copy_in=False) for t in tensors]
        bufs = [_movable(s.buf) for s in staged]
        return self._p2p("recv", src, False, bufs, list(tensors), _copy_backs(staged))

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
        for close in [p.close for p in pairs] + [self._completer.close]:
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


def _take_part(flat: torch.Tensor, out: torch.Tensor, start: int, n: int) -> Callable[[], None]:
    def run() -> None:
        _fill(out, flat[start : start + n])

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
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])


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
            store = dist.PrefixStore("gradsync-hook/", pg.get_group_store())
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
    buf.div_(state.world_size)
    work = state.comm.all_reduce_async(buf, "sum")
    return state._completer.submit(_Op("allreduce_hook", [work], buf, None)).future
