"""One rank of the torch.distributed collectives test: every check runs on the "gradsync" backend
and is compared with a reference computed from all ranks' inputs (every rank can generate
every rank's data). Prints one JSON line: ``{"results": {check: "ok" | error}, "digests": ...}``.

Run by test_distributed.py through ``launch.run_ranks``; also runnable by hand under torchrun.
"""

import hashlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import gradsync
import gradsync.distributed  # noqa: F401  (registers the backend)

RANK = WORLD = 0
DIGESTS = {}


def data(rank, n, dtype=torch.float32, salt=0, low=None, high=None):
    """Rank ``rank``'s deterministic input."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * salt + 1)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=torch.float64)
        if low is not None:
            x = low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64)
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    lo = -1000 if low is None else low
    hi = 1000 if high is None else high
    if dtype == torch.uint8:
        lo, hi = max(lo, 0), min(hi, 256)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def all_inputs(n, dtype, **kw):
    return [data(r, n, dtype, **kw) for r in range(WORLD)]


def reference(inputs, op):
    acc = inputs[0].double() if inputs[0].dtype.is_floating_point else inputs[0].long()
    for x in inputs[1:]:
        y = x.double() if x.dtype.is_floating_point else x.long()
        if op in ("sum", "avg"):
            acc = acc + y
        elif op == "prod":
            acc = acc * y
        elif op == "min":
            acc = torch.minimum(acc, y)
        elif op == "max":
            acc = torch.maximum(acc, y)
    if op == "avg":
        acc = acc / len(inputs) if acc.dtype.is_floating_point else torch.div(acc, len(inputs), rounding_mode="trunc")
    return acc


def assert_close(got, want, dtype, what):
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype)
    if tol is None:
        if dtype == torch.uint8:
            want = want % 256
        if not torch.equal(got.long(), want.long()):
            raise AssertionError(f"{what}: got {got[:8].tolist()} want {want[:8].tolist()}")
        return
    if not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol):
        err = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{what}: max error {err} over tolerance {tol}")


TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# -- all-reduce ---------------------------------------------------------------------------


@check
def allreduce_ops_float32():
    for op in TORCH_OPS:
        kw = dict(low=0.5, high=1.5) if op == "prod" else {}
        t = data(RANK, 1000, torch.float32, **kw)
        dist.all_reduce(t, op=TORCH_OPS[op])
        assert_close(t, reference(all_inputs(1000, torch.float32, **kw), op), torch.float32, op)
        DIGESTS[f"allreduce_{op}"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()


@check
def allreduce_dtypes():
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8):
        for op in ("sum", "max"):
            kw = dict(low=0, high=50) if dtype == torch.uint8 else {}
            t = data(RANK, 257, dtype, **kw)
            dist.all_reduce(t, op=TORCH_OPS[op])
            assert_close(t, reference(all_inputs(257, dtype, **kw), op), dtype, f"{dtype} {op}")


@check
def allreduce_avg_int64_truncates():
    t = data(RANK, 100, torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert_close(t, reference(all_inputs(100, torch.int64), "avg"), torch.int64, "avg")


@check
def allreduce_bool_is_logical():
    t = data(RANK, 64, torch.bool)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    want = torch.stack(all_inputs(64, torch.bool)).any(dim=0)
    assert torch.equal(t, want), "bool sum is logical or"
    t = data(RANK, 64, torch.bool)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    want = torch.stack(all_inputs(64, torch.bool)).all(dim=0)
    assert torch.equal(t, want), "bool min is logical and"


@check
def allreduce_non_contiguous_and_shaped():
    base = data(RANK, 60, torch.float32).reshape(6, 10)
    view = base[:, ::2]  # not contiguous
    dist.all_reduce(view)
    want = reference([data(r, 60, torch.float32).reshape(6, 10)[:, ::2].contiguous() for r in range(WORLD)], "sum")
    assert_close(view.contiguous(), want, torch.float32, "strided view")
    # the untouched columns are unchanged
    assert torch.equal(base[:, 1::2], data(RANK, 60, torch.float32).reshape(6, 10)[:, 1::2])
    s = torch.tensor(float(RANK + 1))  # 0-dim
    dist.all_reduce(s)
    assert s.item() == WORLD * (WORLD + 1) / 2


@check
def allreduce_empty():
    t = torch.empty(0)
    dist.all_reduce(t)
    assert t.numel() == 0


@check
def allreduce_async_in_flight():
    ts = [data(RANK, 5000, torch.float32, salt=i) for i in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    futs = [w.get_future() for w in works[::2]]
    for w in works:
        assert w.wait() is True
    for f in futs:
        f.wait()
    for i, t in enumerate(ts):
        want = reference([data(r, 5000, torch.float32, salt=i) for r in range(WORLD)], "sum")
        assert_close(t, want, torch.float32, f"async {i}")
    # a future's value is the list of reduced tensors
    t = data(RANK, 10, torch.float32)
    v = dist.all_reduce(t, async_op=True).get_future().wait()
    assert isinstance(v, list) and torch.equal(v[0], t), v


@check
def allreduce_coalesced():
    ts = [data(RANK, n, torch.float32, salt=n) for n in (3, 70, 1)]
    dist.all_reduce_coalesced(ts)
    for n, t in zip((3, 70, 1), ts):
        assert_close(t, reference([data(r, n, torch.float32, salt=n) for r in range(WORLD)], "sum"), torch.float32, "coalesced")


# -- broadcast and reduce -----------------------------------------------------------------


@check
def broadcast_every_root():
    for root in range(WORLD):
        t = data(RANK, 333, torch.float32, salt=root)
        dist.broadcast(t, src=root)
        assert torch.equal(t, data(root, 333, torch.float32, salt=root)), f"root {root}"


@check
def broadcast_other_dtypes_as_bytes():
    for dtype in (torch.int8, torch.int16, torch.complex64, torch.bool):
        t = torch.arange(10).to(dtype) * (RANK + 1) if dtype != torch.bool else torch.tensor([RANK % 2 == 0] * 5)
        dist.broadcast(t, src=WORLD - 1)
        want = torch.arange(10).to(dtype) * WORLD if dtype != torch.bool else torch.tensor([(WORLD - 1) % 2 == 0] * 5)
        assert torch.equal(t, want), str(dtype)


@check
def reduce_to_last_rank():
    root = WORLD - 1
    for op in ("sum", "max"):
        t = data(RANK, 100, torch.float32)
        mine = t.clone()
        dist.reduce(t, dst=root, op=TORCH_OPS[op])
        if RANK == root:
            assert_close(t, reference(all_inputs(100, torch.float32), op), torch.float32, op)
        else:
            assert torch.equal(t, mine), "a non-root input is unchanged"


# -- gathers and scatters -----------------------------------------------------------------


@check
def allgather_list():
    inp = data(RANK, 7, torch.float32).reshape(7, 1)
    outs = [torch.full((7, 1), -1.0) for _ in range(WORLD)]
    dist.all_gather(outs, inp)
    for r in range(WORLD):
        assert torch.equal(outs[r], data(r, 7, torch.float32).reshape(7, 1)), f"from {r}"


@check
def all_gather_into_tensor():
    inp = data(RANK, 11, torch.float64)
    out = torch.empty(WORLD * 11, dtype=torch.float64)
    dist.all_gather_into_tensor(out, inp)
    assert torch.equal(out, torch.cat(all_inputs(11, torch.float64)))
    out2 = torch.empty(WORLD, 11, dtype=torch.float64)  # stacked form
    dist.all_gather_into_tensor(out2, inp)
    assert torch.equal(out2, torch.stack(all_inputs(11, torch.float64)))


@check
def reduce_scatter_list():
    ins = [data(RANK, 9, torch.float32, salt=j) for j in range(WORLD)]
    out = torch.empty(9)
    dist.reduce_scatter(out, ins)
    want = reference([data(r, 9, torch.float32, salt=RANK) for r in range(WORLD)], "sum")
    assert_close(out, want, torch.float32, "reduce_scatter")


@check
def reduce_scatter_tensor_ops():
    for op in ("sum", "max", "avg"):
        inp = data(RANK, 5 * WORLD, torch.float32)
        out = torch.empty(5)
        dist.reduce_scatter_tensor(out, inp, op=TORCH_OPS[op])
        want = reference(all_inputs(5 * WORLD, torch.float32), op)[5 * RANK : 5 * RANK + 5]
        assert_close(out, want, torch.float32, op)


@check
def gather_and_scatter():
    root = 0
    inp = data(RANK, 4, torch.float32)
    outs = [torch.empty(4) for _ in range(WORLD)] if RANK == root else None
    dist.gather(inp, outs, dst=root)
    if RANK == root:
        for r in range(WORLD):
            assert torch.equal(outs[r], data(r, 4, torch.float32))
    out = torch.empty(3, dtype=torch.int64)
    parts = [torch.arange(3) + 10 * r for r in range(WORLD)] if RANK == root else None
    dist.scatter(out, parts, src=root)
    assert torch.equal(out, torch.arange(3) + 10 * RANK)


@check
def objects():
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK, "name": f"r{RANK}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(WORLD)]
    lst = [RANK, "x" * (RANK + 1)]
    dist.broadcast_object_list(lst, src=WORLD - 1)
    assert lst == [WORLD - 1, "x" * WORLD]


@check
def barrier():
    dist.barrier()
    dist.barrier(async_op=True).wait()


# -- point to point -----------------------------------------------------------------------


@check
def send_recv_chain():
    # 0 -> 1 -> ... -> W-1 -> 0, each adding its rank: no rank sends before it has received,
    # except rank 0 which starts, so blocking sends cannot deadlock.
    t = torch.zeros(100)
    if RANK == 0:
        dist.send(t + 1, dst=1)
        dist.recv(t, src=WORLD - 1)
        assert torch.equal(t, torch.full((100,), 1.0 + sum(range(1, WORLD))))
    else:
        dist.recv(t, src=RANK - 1)
        dist.send(t + RANK, dst=(RANK + 1) % WORLD)


# 16 MiB of float32: more than gradsync buffers for a peer, so a send waits for its receive.
BIG = 4 << 20


def partner():
    """This rank's partner in pairwise exchanges (0-1, 2-3, ...); None for the last rank of an
    odd world."""
    p = RANK ^ 1
    return p if p < WORLD else None


def msg(src, dst, n, salt=0):
    """What ``src`` sends ``dst``: distinct integers, exact in float32."""
    return torch.arange(n, dtype=torch.float32) + (1000 * src + 100 * dst + 10 * salt)


def exchange(send_first):
    p = partner()
    if p is None:
        return
    out, inp = msg(RANK, p, BIG), torch.empty(BIG)
    if send_first:
        works = [dist.isend(out, p), dist.irecv(inp, p)]
    else:
        works = [dist.irecv(inp, p), dist.isend(out, p)]
    for w in works:
        w.wait()
    assert torch.equal(inp, msg(p, RANK, BIG)), "received the wrong data"


@check
def isend_then_irecv_exchange_16mib():
    # Both ranks send first: each send waits for the other's receive.
    exchange(send_first=True)


@check
def irecv_then_isend_exchange_16mib():
    exchange(send_first=False)


@check
def isend_irecv_exchange_in_opposite_orders():
    p = partner()
    exchange(send_first=p is not None and RANK < p)


@check
def batch_isend_irecv_ring_both_ways():
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    n = BIG // 2
    from_prev, from_next = torch.empty(n), torch.empty(n)
    ops = [
        dist.P2POp(dist.isend, msg(RANK, nxt, n, 0), nxt),
        dist.P2POp(dist.isend, msg(RANK, prv, n, 1), prv),
        dist.P2POp(dist.irecv, from_prev, prv),
        dist.P2POp(dist.irecv, from_next, nxt),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(from_prev, msg(prv, RANK, n, 0)), "from the previous rank"
    assert torch.equal(from_next, msg(nxt, RANK, n, 1)), "from the next rank"


@check
def p2p_alongside_collectives():
    # A large send still in flight does not hold up the group's collectives, nor they it.
    p = partner()
    t = data(RANK, 1000, torch.float32, salt=9)
    if p is not None and RANK < p:
        w = dist.isend(msg(RANK, p, BIG), p)
        dist.all_reduce(t)
        w.wait()
    elif p is not None:
        dist.all_reduce(t)
        got = torch.empty(BIG)
        dist.irecv(got, p).wait()
        assert torch.equal(got, msg(p, RANK, BIG)), "received the wrong data"
    else:
        dist.all_reduce(t)
    assert_close(t, reference([data(r, 1000, torch.float32, salt=9) for r in range(WORLD)], "sum"), torch.float32, "all_reduce")


@check
def blocking_send_then_recv_small_exchange():
    # Small messages are buffered: both ranks may send before they receive.
    p = partner()
    if p is None:
        return
    got = torch.empty(256)
    dist.send(msg(RANK, p, 256), p)
    dist.recv(got, p)
    assert torch.equal(got, msg(p, RANK, 256))


@check
def send_recv_views_and_dtypes():
    p = partner()
    if p is None:
        return
    mine = torch.arange(40, dtype=torch.int16).reshape(4, 10) + RANK
    into = torch.zeros(10, 8, dtype=torch.int16)
    view = into[:, ::2]  # not contiguous
    works = [dist.isend(mine.t(), p), dist.irecv(view, p)]
    for w in works:
        w.wait()
    assert torch.equal(view, (torch.arange(40, dtype=torch.int16).reshape(4, 10) + p).t())
    assert not into[:, 1::2].any(), "the rest of the tensor is untouched"
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    for peer in (RANK, WORLD):
        try:
            backend.send([torch.ones(1)], peer)
        except ValueError as e:
            assert "not another rank" in str(e), str(e)
        else:
            raise AssertionError(f"send to {peer} did not raise")


# -- groups and errors --------------------------------------------------------------------


@check
def subgroup():
    members = [0, WORLD - 1]
    g = dist.new_group(members, backend="gradsync")
    if RANK in members:
        t = torch.tensor([float(RANK + 1)])
        dist.all_reduce(t, group=g)
        assert t.item() == 1.0 + WORLD, t
    dist.destroy_process_group(g)


@check
def multi_tensor_calls_check_every_tensor_before_queuing():
    # Rank 0 alone makes calls whose second tensor is bad: each must raise before queuing the
    # first tensor's operation, or rank 0's next collective would pair with that operation.
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    if RANK == 0:
        ar = dist.AllreduceOptions()
        bc = dist.BroadcastOptions()
        bc.rootRank = 0
        rs = dist.ReduceScatterOptions()
        ints = torch.ones(50, dtype=torch.int16)
        calls = {
            "allreduce": lambda: backend.allreduce([torch.ones(50), ints], ar),
            "broadcast": lambda: backend.broadcast([torch.ones(50), torch.empty(50, device="meta")], bc),
            "reduce_scatter": lambda: backend.reduce_scatter(
                [torch.empty(50), torch.empty(50, dtype=torch.int16)],
                [[torch.ones(50)] * WORLD, [ints] * WORLD],
                rs,
            ),
        }
        for name, call in calls.items():
            try:
                call()
            except (TypeError, ValueError):
                pass
            else:
                raise AssertionError(f"{name} with a bad second tensor did not raise")
    t = data(RANK, 100, torch.float32, salt=3)
    dist.all_reduce(t)
    assert_close(t, reference([data(r, 100, torch.float32, salt=3) for r in range(WORLD)], "sum"), torch.float32, "after")
    t = data(RANK, 100, torch.float32, salt=4)
    dist.broadcast(t, src=0)
    assert torch.equal(t, data(0, 100, torch.float32, salt=4)), "broadcast after"


@check
def unsupported_ops_name_themselves():
    try:
        dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0))
    except NotImplementedError as e:
        assert "PREMUL_SUM" in str(e), str(e)
    else:
        raise AssertionError("PREMUL_SUM did not raise")
    try:
        dist.recv(torch.empty(3))
    except NotImplementedError as e:
        assert "any source" in str(e), str(e)
    else:
        raise AssertionError("recv from any source did not raise")


@check
def backend_identity():
    assert dist.get_backend() == "gradsync", dist.get_backend()
    b = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert b.name() == "gradsync", b.name()
    assert isinstance(b, gradsync.distributed.GradsyncBackend), type(b)
    assert b.communicator.world_size == WORLD


def main():
    global RANK, WORLD
    torch.set_num_threads(1)
    dist.init_process_group("gradsync")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    only = set(sys.argv[1:])
    results = {}
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    dist.destroy_process_group()
    print("@@result@@ " + json.dumps({"rank": RANK, "results": results, "digests": DIGESTS}), flush=True)


if __name__ == "__main__":
    main()
