"""Rank programs of test_split.py (run by ``spawn_ranks.run_ranks``): ``Communicator.split``
and ``split_ranks`` on separate processes."""

import time

import numpy as np

import gradsync


def _value_error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def split_and_use(rank, world, args):
    """Bad arguments, a split by parity with keys that reverse the order (the last rank without
    a color), a members-only split of the first and last ranks (in reverse order), and the
    parent after all of it."""
    comm = gradsync.Communicator.from_env()
    out = {
        "errors": {
            "negative color": _value_error(lambda: comm.split(-1)),
            "repeated rank": _value_error(lambda: comm.split_ranks([rank, rank])),
            "outside": _value_error(lambda: comm.split_ranks([rank, world])),
            "not a member": _value_error(lambda: comm.split_ranks([r for r in range(world) if r != rank])),
            "zero timeout": _value_error(lambda: comm.split(0, timeout=0)),
        }
    }
    color = None if rank == world - 1 else rank % 2
    child = comm.split(color, key=-rank, timeout=12.5)
    if child is None:
        out["child"] = None
    else:
        buf = np.full(5, rank + 1, dtype=np.float32)
        child.all_reduce(buf)
        gathered = np.zeros(child.world_size, dtype=np.int64)
        child.all_gather(np.array([rank], dtype=np.int64), gathered)
        out["child"] = {
            "rank": child.rank,
            "world": child.world_size,
            "timeout": child.timeout,
            "sum": buf.tolist(),
            "gathered": gathered.tolist(),
        }
        child.close()
    if rank in (0, world - 1):
        sub = comm.split_ranks([world - 1, 0])
        buf = np.array([rank, 10 * rank], dtype=np.int64)
        sub.all_reduce(buf, "max")
        out["members_only"] = {"rank": sub.rank, "world": sub.world_size, "max": buf.tolist()}
        sub.close()
    buf = np.ones(3, dtype=np.int32)
    comm.all_reduce(buf)
    out["parent"] = buf.tolist()
    comm.close()
    return out


def never_calls(rank, world, args):
    """Rank 1 never splits: rank 0's split fails at the timeout with an error naming it."""
    comm = gradsync.Communicator.from_env()
    if rank == 1:
        time.sleep(comm.timeout + 3)
        comm.close()
        return {}
    t = time.monotonic()
    try:
        comm.split(0)
        err = None
    except gradsync.GradsyncError as e:
        err = str(e)
    took = time.monotonic() - t
    try:
        comm.close()
    except gradsync.GradsyncError:
        pass
    return {"error": err, "took": took, "timeout": comm.timeout}
