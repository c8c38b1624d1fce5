"""Type stubs of the native module ``gradsync._gradsync`` (re-exported by ``gradsync``)."""

from types import TracebackType
from typing import Any, Literal, Optional, Type

from typing_extensions import Self, TypeAlias

#: A C-contiguous numpy array (``numpy.ndarray``; other objects with an
#: ``__array_interface__`` are refused) or CPU torch tensor of float32, float64, float16,
#: bfloat16 (torch only), int32, int64 or uint8.
Buffer: TypeAlias = Any
#: A reduction operator; the bitwise ``band``, ``bor`` and ``bxor`` take integer buffers only.
ReduceOpName: TypeAlias = Literal["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]

__version__: str

class GradsyncError(RuntimeError):
    """An operation of gradsync failed.

    The message is the Rust error's: it names this rank, the operation (with its sequence
    number) and the peers involved.
    """

class Work:
    """The handle of an operation started by one of the ``*_async`` methods.

    The operation's buffers must not be read or written until :meth:`wait` returns.
    """

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits for the operation to finish.

        Raises :class:`TimeoutError` when ``timeout`` seconds elapse first (the operation keeps
        running), :class:`GradsyncError` when it failed.
        """
    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not); never blocks."""

class Communicator:
    """A group of processes (ranks) that run collectives together.

    ``Communicator(store_addr, rank, world_size, *, host_store=True, timeout=None)`` joins
    explicitly: rank 0 starts the rendezvous store at ``store_addr`` when ``host_store`` is
    true, otherwise it already runs there. :meth:`from_env` reads the launcher's environment.
    """

    def __init__(
        self,
        store_addr: str,
        rank: int,
        world_size: int,
        *,
        host_store: bool = True,
        timeout: Optional[float] = None,
    ) -> None: ...
    @classmethod
    def from_env(cls) -> "Communicator":
        """Joins the group described by torchrun / gradsync launch / Slurm / Open MPI
        variables and the ``GRADSYNC_*`` tunables."""
    @property
    def rank(self) -> int:
        """This process's rank."""
    @property
    def world_size(self) -> int:
        """Number of ranks."""
    @property
    def transport(self) -> str:
        """Name of the transport (``tcp``, ``shm``, ``hybrid``, ...)."""
    @property
    def timeout(self) -> float:
        """Deadline of init and of each operation, in seconds."""
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
    def all_reduce(self, buf: Buffer, op: ReduceOpName = "sum") -> None:
        """All-reduce ``buf`` in place."""
    def all_reduce_async(self, buf: Buffer, op: ReduceOpName = "sum") -> Work:
        """Starts :meth:`all_reduce`."""
    def reduce_scatter(self, input: Buffer, output: Buffer, op: ReduceOpName = "sum") -> None:
        """``output`` (n elements) gets block ``rank`` of ``op`` over all ranks' ``input``
        (``world_size * n`` elements)."""
    def reduce_scatter_async(
        self, input: Buffer, output: Buffer, op: ReduceOpName = "sum"
    ) -> Work:
        """Starts :meth:`reduce_scatter`."""
    def all_gather(self, input: Buffer, output: Buffer) -> None:
        """``output`` (``world_size * n`` elements) gets every rank's ``input`` (n elements)."""
    def all_gather_async(self, input: Buffer, output: Buffer) -> Work:
        """Starts :meth:`all_gather`."""
    def broadcast(self, buf: Buffer, root: int = 0) -> None:
        """Every rank's ``buf`` gets rank ``root``'s."""
    def broadcast_async(self, buf: Buffer, root: int = 0) -> Work:
        """Starts :meth:`broadcast`."""
    def reduce(
        self,
        input: Buffer,
        output: Optional[Buffer],
        op: ReduceOpName = "sum",
        root: int = 0,
    ) -> None:
        """The root's ``output`` gets ``op`` over all ranks' ``input``; others may pass None."""
    def reduce_async(
        self,
        input: Buffer,
        output: Optional[Buffer],
        op: ReduceOpName = "sum",
        root: int = 0,
    ) -> Work:
        """Starts :meth:`reduce`."""
    def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""
    def barrier_async(self) -> Work:
        """Starts :meth:`barrier`."""
    def send(self, buf: Buffer, peer: int) -> None:
        """Sends ``buf`` to rank ``peer`` (blocking).

        The sends and receives between two ranks are matched in order: the k-th call of one
        with the other meets the other's k-th, which must be the opposite call. A send larger
        than the receive slots (3.5 MiB by default) returns only once the peer receives it.
        """
    def recv(self, buf: Buffer, peer: int) -> None:
        """Receives into ``buf`` from rank ``peer`` (blocking; matched in order, see
        :meth:`send`)."""
    def split(
        self, color: Optional[int], key: int = 0, *, timeout: Optional[float] = None
    ) -> Optional["Communicator"]:
        """Splits the group (every rank calls it): the ranks of one ``color`` form a new
        communicator, numbered by ``key`` then rank; ``color=None`` takes part and gets
        ``None``. Formed over this communicator, without a rendezvous store; ``timeout`` is
        the new communicator's (default: this one's)."""
    def split_ranks(self, ranks: list[int], *, timeout: Optional[float] = None) -> "Communicator":
        """A new communicator of ``ranks``, built by those ranks alone (the others do not
        call it); the new rank of a member is its position in ``ranks``."""
    def close(self) -> None:
        """Finishes started operations and closes the connections; later calls raise
        :class:`GradsyncError`.

        Raises :class:`GradsyncError` (naming how many operations are still pending) when the
        communicator's thread has not ended by the deadline of those operations.
        """
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> Literal[False]: ...

class StoreServer:
    """A rendezvous store for ``Communicator(..., host_store=False)``; serves while alive."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None: ...
    @property
    def port(self) -> int:
        """The bound port."""
    @property
    def address(self) -> str:
        """The bound address, ``host:port``."""
    def close(self) -> None:
        """Stops serving."""
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> Literal[False]: ...

