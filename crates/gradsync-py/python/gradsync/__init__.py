"""gradsync: collective communication for data-parallel training.

A :class:`Communicator` joins ``world_size`` processes (ranks). Every rank calls the same
collectives in the same order; each all-reduce leaves every rank with bitwise identical
results, and every wait has a deadline. Buffers are numpy arrays or CPU torch tensors (used in
place, without copies)::

    import numpy as np
    import gradsync

    comm = gradsync.Communicator.from_env()   # torchrun, gradsync launch, Slurm, Open MPI
    grads = np.ones(1 << 20, dtype=np.float32)
    comm.all_reduce(grads, op="avg")
    work = comm.all_reduce_async(grads)       # overlaps with other Python work
    work.wait()
    comm.close()

Errors of gradsync raise :class:`GradsyncError` (a :class:`RuntimeError`) whose message names
the rank, the operation and its sequence number, and the peers involved.
"""

from ._gradsync import Communicator, GradsyncError, StoreServer, Work, __version__

__all__ = ["Communicator", "GradsyncError", "StoreServer", "Work", "__version__"]
