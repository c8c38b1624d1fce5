"""What each rank runs in the multi-process tests (see ``spawn_ranks.py``).

Every function takes ``(rank, world, args)``, builds its communicator, checks the results of
its collectives against numpy references itself (every rank can compute every rank's input),
and returns a JSON-able report, usually the list of mismatches found (empty when all is well).
"""

import gc
import os
import signal
import threading
import time
import weakref

import numpy as np

import gradsync

NUMPY_DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"]
TORCH_DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"]
OPS = ["sum", "prod", "min", "max", "avg"]
RTOL = {"float32": 1e-6, "float64": 1e-12, "float16": 1e-3, "bfloat16": 1e-2}


def values(rank, n, op, dtype, salt=0):
    """Rank ``rank``'s input: small integers, so sums and products are exact in every type."""
    i = np.arange(n, dtype=np.int64) + salt
    if op == "prod":
        v = 1 + (i + rank) % 2
    elif op in ("min", "max"):
        v = (i * 7 + rank * 3) % 11
        if dtype not in ("uint8",):
            v = v - 5
    else:
        v = (rank + 1) * (i % 5 + 1)
    return v.astype(np.float64)


def reference(world, n, op, dtype, salt=0):
    """``op`` over every rank's input, in float64, finished as gradsync finishes it."""
    xs = np.stack([values(r, n, op, dtype, salt) for r in range(world)])
    if op == "sum":
        return xs.sum(0)
    if op == "prod":
        return xs.prod(0)
    if op == "min":
        return xs.min(0)
    if op == "max":
        return xs.max(0)
    s = xs.sum(0) / world
    return s if dtype in RTOL else np.trunc(s)


def close(got, want, dtype):
    """Whether ``got`` (float64) matches the float64 reference ``want`` for ``dtype``."""
    if dtype in RTOL:
        return bool(np.allclose(got, want, rtol=RTOL[dtype], atol=0))
    return bool(np.array_equal(got, want))


class Backend:
    """Makes buffers and reads them back, as numpy arrays or torch tensors."""

    def __init__(self, kind):
        self.kind = kind
        if kind == "torch":
            import torch

            self.torch = torch

    def make(self, v, dtype):
        if self.kind == "numpy":
            return np.ascontiguousarray(v.astype(dtype))
        t = self.torch
        return t.from_numpy(np.ascontiguousarray(v)).to(getattr(t, dtype))

    def empty(self, n, dtype):
        if self.kind == "numpy":
            return np.full(n, 99, dtype=dtype)
        t = self.torch
        return t.full((n,), 99, dtype=getattr(t, dtype))

    def read(self, buf):
        if self.kind == "numpy":
            return buf.astype(np.float64)
        return buf.to(self.torch.float64).numpy()


def collectives(rank, world, args):
    """Every collective x dtype x op, on numpy arrays and torch tensors."""
    comm = gradsync.Communicator.from_env()
    assert (comm.rank, comm.world_size) == (rank, world)
    bad = []
    count = 0
    n = args.get("n", 37)
    for kind, dtypes in (("numpy", NUMPY_DTYPES), ("torch", TORCH_DTYPES)):
        be = Backend(kind)
        for dt in dtypes:
            tag = f"{kind}/{dt}"
            for op in OPS:
                # all_reduce, in place
                buf = be.make(values(rank, n, op, dt), dt)
                comm.all_reduce(buf, op=op)
                count += 1
                if not close(be.read(buf), reference(world, n, op, dt), dt):
                    bad.append(f"{tag} all_reduce {op}: {be.read(buf)[:8]}")
                # reduce_scatter: world blocks of m
                m = 5
                inp = be.make(values(rank, world * m, op, dt, salt=3), dt)
                out = be.empty(m, dt)
                comm.reduce_scatter(inp, out, op)
                count += 1
                want = reference(world, world * m, op, dt, salt=3)[rank * m:(rank + 1) * m]
                if not close(be.read(out), want, dt):
                    bad.append(f"{tag} reduce_scatter {op}: {be.read(out)}")
                # reduce to the last rank; other ranks pass None or an untouched array
                root = world - 1
                inp = be.make(values(rank, n, op, dt, salt=1), dt)
                out = be.empty(n, dt) if rank == root or rank % 2 else None
                comm.reduce(inp, out, op=op, root=root)
                count += 1
                if rank == root:
                    if not close(be.read(out), reference(world, n, op, dt, salt=1), dt):
                        bad.append(f"{tag} reduce {op}: {be.read(out)[:8]}")
                elif out is not None and not np.all(be.read(out) == 99):
                    bad.append(f"{tag} reduce {op}: rank {rank}'s output was written")
                if not close(be.read(inp), values(rank, n, op, dt, salt=1), dt):
                    bad.append(f"{tag} reduce {op}: input changed")
            # all_gather
            inp = be.make(values(rank, n, "sum", dt), dt)
            out = be.empty(world * n, dt)
            comm.all_gather(inp, out)
            count += 1
            want = np.concatenate([values(r, n, "sum", dt) for r in range(world)])
            if not close(be.read(out), want, dt):
                bad.append(f"{tag} all_gather: {be.read(out)[:8]}")
            # broadcast from every root
            for root in range(world):
                buf = be.make(values(rank, n, "sum", dt, salt=root), dt)
                comm.broadcast(buf, root=root)
                count += 1
                if not close(be.read(buf), values(root, n, "sum", dt, salt=root), dt):
                    bad.append(f"{tag} broadcast root {root}: {be.read(buf)[:8]}")
    # a buffer larger than one message (several pipeline segments), 2-D
    big = np.full((256, 1031), rank + 1, dtype=np.float32)
    comm.all_reduce(big)
    count += 1
    if not np.all(big == world * (world + 1) / 2):
        bad.append("large all_reduce")
    # empty buffers
    e = np.zeros(0, dtype=np.float32)
    comm.all_reduce(e)
    comm.all_gather(e, np.zeros(0, dtype=np.float32))
    count += 2
    # send/recv around a ring
    if world > 1:
        out = np.arange(6, dtype=np.int64) + 10 * rank
        got = np.zeros(6, dtype=np.int64)
        right, left = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            comm.send(out, right)
            comm.recv(got, left)
        else:
            comm.recv(got, left)
            comm.send(out, right)
        count += 2
        if not np.array_equal(got, np.arange(6) + 10 * left):
            bad.append(f"send/recv: {got}")
    comm.barrier()
    comm.close()
    return {"bad": bad, "count": count, "transport": comm.transport}


BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def bitwise_values(rank, n, op, dtype, salt=0):
    """Rank ``rank``'s input for a bitwise ``op``: every bit of the type in use, ``band`` inputs
    mostly ones and ``bor`` inputs mostly zeros, so that the results are neither."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng([rank, n, salt, sorted(BITWISE).index(op), info.bits])

    def draw():
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)

    if op == "band":
        return draw() | draw() | draw()
    if op == "bor":
        return draw() & draw() & draw()
    return draw()


def bitwise_reference(world, n, op, dtype, salt=0):
    """``op`` over every rank's input, by numpy."""
    xs = np.stack([bitwise_values(r, n, op, dtype, salt) for r in range(world)])
    return BITWISE[op].reduce(xs, axis=0)


def bitwise(rank, world, args):
    """all_reduce (in place and async), reduce_scatter and reduce with band, bor and bxor on
    int32, int64 and uint8 numpy arrays; the same ops on float arrays are refused at the call
    with a ValueError naming the rank, the call, the op and the dtype, and the ranks stay in
    step."""
    comm = gradsync.Communicator.from_env()
    bad = []
    count = 0
    n = args.get("n", 1001)
    for dt in ("int32", "int64", "uint8"):
        for op in BITWISE:
            tag = f"{dt} {op}"
            want = bitwise_reference(world, n, op, dt)
            if np.all(want == 0) or np.all(want == np.array(-1).astype(dt)):
                bad.append(f"{tag}: a trivial reference")
            buf = bitwise_values(rank, n, op, dt)
            comm.all_reduce(buf, op=op)
            count += 1
            if buf.dtype != np.dtype(dt) or not np.array_equal(buf, want):
                bad.append(f"{tag} all_reduce: {buf[:4]} vs {want[:4]}")
            buf = bitwise_values(rank, n, op, dt)
            comm.all_reduce_async(buf, op).wait()
            count += 1
            if not np.array_equal(buf, want):
                bad.append(f"{tag} all_reduce_async: {buf[:4]} vs {want[:4]}")
            m = 7
            inp = bitwise_values(rank, world * m, op, dt, salt=1)
            out = np.zeros(m, dtype=dt)
            comm.reduce_scatter(inp, out, op)
            count += 1
            rs = bitwise_reference(world, world * m, op, dt, salt=1)[rank * m:(rank + 1) * m]
            if not np.array_equal(out, rs):
                bad.append(f"{tag} reduce_scatter: {out} vs {rs}")
            root = (count // 4) % world
            inp = bitwise_values(rank, n, op, dt, salt=2)
            out = np.zeros(n, dtype=dt) if rank == root else None
            comm.reduce(inp, out, op=op, root=root)
            count += 1
            if rank == root and not np.array_equal(out, bitwise_reference(world, n, op, dt, salt=2)):
                bad.append(f"{tag} reduce to {root}: {out[:4]}")
    refused = []
    for dt, op in (("float32", "bxor"), ("float64", "band"), ("float16", "bor")):
        x = np.arange(5, dtype=dt)
        calls = {
            "all_reduce": lambda: comm.all_reduce(x, op),
            "reduce_scatter": lambda: comm.reduce_scatter(
                np.zeros(5 * world, dtype=dt), x, op
            ),
            "reduce": lambda: comm.reduce(x, np.zeros(5, dtype=dt), op=op, root=rank),
        }
        for name, call in calls.items():
            try:
                call()
            except ValueError as e:
                refused.append(str(e))
            else:
                bad.append(f"{name} {op} over {dt} was not refused")
        if not np.array_equal(x, np.arange(5, dtype=dt)):
            bad.append(f"{dt}: the refused calls wrote the buffer")
    # Nothing of the refused calls went out: the ranks are still in step.
    ok = np.array([rank + 1], dtype=np.int64)
    comm.all_reduce(ok)
    if ok[0] != world * (world + 1) // 2:
        bad.append(f"after the refused calls: {ok}")
    comm.close()
    return {"bad": bad, "count": count, "refused": refused}


def in_place_and_async(rank, world, args):
    """In-place semantics on views and tensors; async operations in submission order."""
    import torch

    bad = []
    with gradsync.Communicator.from_env() as comm:
        # a contiguous slice of a larger array: only the slice changes
        base = np.arange(20, dtype=np.float64)
        view = base[5:15]
        comm.all_reduce(view, "max")
        want = np.arange(20, dtype=np.float64)
        if not (np.array_equal(base[:5], want[:5]) and np.array_equal(base[15:], want[15:])):
            bad.append("all_reduce of a slice wrote outside it")
        if not np.array_equal(view, want[5:15]):
            bad.append(f"all_reduce of a slice: {view}")
        # a 2-D array keeps its shape; the same object is updated
        a = np.ones((3, 4), dtype=np.int32) * (rank + 1)
        before = a.__array_interface__["data"][0]
        comm.all_reduce(a)
        if a.shape != (3, 4) or a.__array_interface__["data"][0] != before:
            bad.append("2-D all_reduce changed the array object")
        if not np.all(a == world * (world + 1) // 2):
            bad.append(f"2-D all_reduce: {a}")
        # torch: same storage, requires_grad tensors and bfloat16
        t = torch.full((4, 3), float(rank + 1), dtype=torch.bfloat16)
        ptr = t.data_ptr()
        comm.all_reduce(t)
        if t.data_ptr() != ptr or not bool((t == world * (world + 1) / 2).all()):
            bad.append(f"bfloat16 tensor all_reduce: {t}")
        p = torch.nn.Parameter(torch.ones(5) * (rank + 1))
        comm.all_reduce(p, "avg")
        if not torch.allclose(p.detach(), torch.full((5,), (world + 1) / 2)):
            bad.append(f"parameter all_reduce: {p}")
        # async: several in flight, waited for in any order, results as if run in order
        bufs = [np.full(1000 * (k + 1), float(rank + k), dtype=np.float32) for k in range(4)]
        works = [comm.all_reduce_async(b) for b in bufs]
        gathered = np.zeros(world * 3, dtype=np.int64)
        works.append(comm.all_gather_async(np.full(3, rank, dtype=np.int64), gathered))
        rs_out = np.zeros(2, dtype=np.float64)
        works.append(comm.reduce_scatter_async(np.ones(2 * world), rs_out, "sum"))
        bc = np.full(7, rank, dtype=np.uint8)
        works.append(comm.broadcast_async(bc, root=world - 1))
        red_out = np.zeros(4, dtype=np.float16) if rank == 0 else None
        works.append(comm.reduce_async(np.ones(4, dtype=np.float16), red_out, "sum", 0))
        works.append(comm.barrier_async())
        # in-order execution: a blocking call after them sees them all done
        tail = np.ones(3, dtype=np.float32)
        comm.all_reduce(tail)
        if not all(w.is_completed() for w in works):
            bad.append("a blocking call returned before the async calls submitted earlier")
        for w in reversed(works):
            w.wait()
            w.wait(timeout=0)  # waiting again is fine
        for k, b in enumerate(bufs):
            want = sum(r + k for r in range(world))
            if not np.all(b == want):
                bad.append(f"async all_reduce {k}: {b[:4]}")
        if not np.array_equal(gathered, np.repeat(np.arange(world), 3)):
            bad.append(f"async all_gather: {gathered}")
        if not np.all(rs_out == world):
            bad.append(f"async reduce_scatter: {rs_out}")
        if not np.all(bc == world - 1):
            bad.append(f"async broadcast: {bc}")
        if rank == 0 and not np.all(red_out == world):
            bad.append(f"async reduce: {red_out}")
        # the buffers of an async call stay alive without the caller's references, until the
        # operation has been waited for
        for kind in ("numpy", "torch"):
            if kind == "numpy":
                arr = np.ones(100000, dtype=np.float32)
            else:
                arr = torch.ones(100000, dtype=torch.float32)
            ref = weakref.ref(arr)
            w = comm.all_reduce_async(arr)
            del arr
            gc.collect()
            if ref() is None:
                bad.append(f"{kind}: the buffer of an unfinished async all_reduce was released")
            w.wait()
            del w
            gc.collect()
            if ref() is not None:
                bad.append(f"{kind}: the buffer is still alive after wait() and del")
        # Work.wait(timeout) while a peer is late: TimeoutError, and the work goes on
        late = np.ones(10, dtype=np.float32)
        if rank == 1:
            time.sleep(1.0)
        w = comm.all_reduce_async(late)
        if rank == 0:
            try:
                w.wait(timeout=0.2)
                bad.append("wait(timeout=0.2) returned while rank 1 was late")
            except TimeoutError as e:
                if "all_reduce" not in str(e):
                    bad.append(f"TimeoutError message: {e}")
            if w.is_completed():
                bad.append("is_completed while rank 1 was late")
        w.wait()
        if not w.is_completed() or not np.all(late == world):
            bad.append(f"late all_reduce: {late}")
    try:
        comm.all_reduce(np.ones(2, dtype=np.float32))
        bad.append("a closed communicator accepted an operation")
    except gradsync.GradsyncError as e:
        if "closed" not in str(e):
            bad.append(f"closed: {e}")
    return {"bad": bad}


def gil_released(rank, world, args):
    """A Python thread keeps running while this rank waits for a late peer."""
    comm = gradsync.Communicator.from_env()
    comm.barrier()
    result = {}
    if rank == 0:
        stop = threading.Event()
        ticks = [0]

        def spin():
            while not stop.is_set():
                ticks[0] += 1

        th = threading.Thread(target=spin)
        th.start()
        time.sleep(0.05)
        start_ticks, t0 = ticks[0], time.monotonic()
        buf = np.ones(1000, dtype=np.float32)
        comm.all_reduce(buf)  # rank 1 arrives about a second late
        waited = time.monotonic() - t0
        during = ticks[0] - start_ticks
        stop.set()
        th.join()
        result = {"waited": waited, "ticks": during, "ok": bool(np.all(buf == world))}
    else:
        time.sleep(1.0)
        buf = np.ones(1000, dtype=np.float32)
        comm.all_reduce(buf)
    comm.close()
    return result


def mismatch(rank, world, args):
    """Ranks that call different collectives: every rank gets GradsyncError."""
    kind = args["kind"]
    comm = gradsync.Communicator.from_env()
    buf = np.ones(10 + (rank if kind == "count" else 0), dtype=np.float32)
    try:
        if kind == "count" or rank == 0:
            comm.all_reduce(buf)
        else:
            comm.broadcast(buf, root=0)
        return {"error": None}
    except gradsync.GradsyncError as e:
        return {"error": str(e), "type": type(e).__name__, "runtime": isinstance(e, RuntimeError)}
    finally:
        comm.close()


def explicit(rank, world, args):
    """The explicit constructor against a StoreServer run by the parent process."""
    addr = f"127.0.0.1:{args['port']}"
    comm = gradsync.Communicator(addr, rank, world, host_store=False, timeout=20.0)
    assert comm.timeout == 20.0
    buf = np.full(9, rank, dtype=np.int64)
    comm.all_reduce(buf, "max")
    comm.close()
    comm.close()
    return {"max": buf.tolist(), "repr": repr(comm)}


def shared_by_threads(rank, world, args):
    """Two Python threads issue all-reduces on one communicator at the same time.

    Every call has the same count, type and op, so however the ranks' threads interleave, the
    k-th submission of every rank matches; each result is checked.
    """
    iters = args.get("iters", 60)
    n = 4096
    idx = np.arange(n, dtype=np.float64)
    want = sum((r + 1) * (idx % 13 + 1) for r in range(world))
    bad, errors = [], []
    inside = [0, 0]  # threads inside a call now, most at once
    guard = threading.Lock()
    start = threading.Barrier(2)
    comm = gradsync.Communicator.from_env()

    def run(t):
        try:
            start.wait()
            for i in range(iters):
                buf = (rank + 1) * (idx % 13 + 1)
                with guard:
                    inside[0] += 1
                    inside[1] = max(inside[1], inside[0])
                if (i + t) % 2:
                    comm.all_reduce(buf)
                else:
                    comm.all_reduce_async(buf).wait()
                with guard:
                    inside[0] -= 1
                if not np.array_equal(buf, want):
                    bad.append(f"thread {t} call {i}: {buf[:6]}")
        except Exception as e:  # reported, not raised: the other thread must finish too
            errors.append(f"thread {t}: {e!r}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    comm.close()
    return {"bad": bad[:5], "errors": errors, "most_inside": inside[1]}


def interrupted_wait(rank, world, args):
    """Rank 0 waits on an all-reduce that rank 1 joins only after rank 0 was interrupted."""
    d = args["dir"]
    comm = gradsync.Communicator.from_env()
    buf = np.full(8, rank + 1.0, dtype=np.float32)
    if rank == 0:
        # Python raises KeyboardInterrupt only where SIGINT was not ignored at its start, and a
        # job started in the background of a non-interactive shell inherits it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        t0 = time.monotonic()
        try:
            # Inside the try: a signal that comes early is still caught, and `waited` says so.
            open(os.path.join(d, "waiting"), "w").close()
            comm.all_reduce(buf)
            return {"interrupted": False}
        except KeyboardInterrupt:
            waited = time.monotonic() - t0
        open(os.path.join(d, "interrupted"), "w").close()
        # The operation itself goes on: it completes when rank 1 joins; close() waits for it.
        comm.close()
        return {"interrupted": True, "waited": waited, "buf": buf.tolist()}
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, "interrupted")) and time.monotonic() < deadline:
        time.sleep(0.02)
    comm.all_reduce(buf)
    comm.close()
    return {"buf": buf.tolist()}


def p2p_semantics(rank, world, args):
    """How long a send waits for a late receiver; both ranks sending first."""
    comm = gradsync.Communicator.from_env()
    out = {}
    peer = 1 - rank
    for name, nbytes in (("small", 4096), ("large", 8 << 20)):
        comm.barrier()
        if rank == 0:
            t0 = time.monotonic()
            comm.send(np.ones(nbytes // 4, dtype=np.float32), peer)
            out[name] = time.monotonic() - t0
        else:
            time.sleep(1.0)  # rank 1 receives a second late
            got = np.zeros(nbytes // 4, dtype=np.float32)
            comm.recv(got, peer)
            out[name] = bool(np.all(got == 1))
    # both ranks send first: a small message arrives where the peer's recv expected its second
    try:
        comm.send(np.ones(1024, dtype=np.float32), peer)
        comm.recv(np.zeros(1024, dtype=np.float32), peer)
        out["both_send_first"] = None
    except gradsync.GradsyncError as e:
        out["both_send_first"] = str(e)
    comm.close()
    return out
