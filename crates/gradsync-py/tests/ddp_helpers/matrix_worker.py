"""One rank of the gradsync-against-Gloo matrix: each check runs the same program on a group of the
"gradsync" backend and on a group of Gloo over the same ranks, in this process, and compares the
two results within 1e-5 (and, where it is cheap, with the expected values too).

The default group is gradsync's (as in a job that switched to it); the Gloo group is made with
``new_group(backend="gloo")``. Each check gets a gradsync group of its own, so that a check that
fails cannot leave the next one out of step. Prints one JSON line:
``{"results": {check: "ok" | traceback}, "compared": {check: values compared}}``.

Run by test_torch_matrix.py through ``launch.run_ranks``; arguments name the checks to run (all
those of this world size by default).
"""

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync.distributed  # noqa: F401  (registers the backend)

RANK = WORLD = 0
TOL = 1e-5
COMPARED = [0]

# -- data and comparison ----------------------------------------------------------------------


def data(rank, shape, dtype=torch.float32, salt=0, integers=False):
    """Rank ``rank``'s deterministic input; ``integers``: small integers (exact in bfloat16 and
    in sums of a few of them)."""
    g = torch.Generator().manual_seed(7919 * rank + 31 * salt + 5)
    if isinstance(shape, int):
        shape = (shape,)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point and not integers:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    lo, hi = (0, 200) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def same(a, b, path="result"):
    """Asserts ``a`` (gradsync's) equals ``b`` (Gloo's): tensors of one shape and dtype within
    1e-5 (exactly for integers), containers element by element, other values by ``==``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor against {type(b)}"
        assert a.shape == b.shape and a.dtype == b.dtype, f"{path}: {a.shape} {a.dtype} against {b.shape} {b.dtype}"
        if a.dtype.is_floating_point:
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            assert torch.allclose(a.double(), b.double(), rtol=TOL, atol=TOL), f"{path}: differs by {diff}"
        else:
            assert torch.equal(a, b), f"{path}: {a.flatten()[:8].tolist()} against {b.flatten()[:8].tolist()}"
        COMPARED[0] += a.numel()
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{path}: keys {sorted(a)} against {sorted(b) if isinstance(b, dict) else b}"
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} against {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} against {b!r}"
        COMPARED[0] += 1


def both(fn, gs, gl, *args):
    """Runs ``fn(group, ..., extra)`` on gradsync's group (``extra=True``) and on Gloo's
    (``extra=False``), and compares them; returns gradsync's result. With ``extra`` a function
    adds cases Gloo cannot run (int16 tensors, uneven tensor lists), which it checks against the
    expected values itself: only the keys of Gloo's result are compared."""
    got = fn(gs, *args, extra=True)
    want = fn(gl, *args, extra=False)
    if isinstance(got, dict) and isinstance(want, dict):
        assert set(want) <= set(got), f"keys {sorted(want)} not all in {sorted(got)}"
        same({k: got[k] for k in want}, want)
    else:
        same(got, want)
    return got


def backend_of(group):
    return group._get_backend(torch.device("cpu"))


# -- models -------------------------------------------------------------------------------------


def mlp():
    """A small MLP with sizes that do not divide by 2, 3 or 4 (FSDP pads its shards)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 5))


def batches(steps, salt=0):
    g = torch.Generator().manual_seed(1000 + 17 * RANK + salt)
    return [(torch.randn(6, 13, generator=g), torch.randn(6, 5, generator=g)) for _ in range(steps)]


def train(model, opt, steps, salt=0):
    losses = []
    for x, y in batches(steps, salt):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


_meshes = [0]


def mesh_of(group):
    """A 1-D DeviceMesh over ``group``, with a name of its own: torch compares meshes (and
    caches DTensor plans) by ranks, layout and names, not by group, so two meshes over the same
    ranks on two backends must differ by name."""
    from torch.distributed.device_mesh import DeviceMesh

    _meshes[0] += 1
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"dp{_meshes[0]}",))


def fsdp_run(mesh, steps=4, mp=None):
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, opt, steps)
    params = [p.full_tensor().detach() for p in model.parameters()]
    return {"losses": losses, "params": params}


# -- checks --------------------------------------------------------------------------------------

CHECKS = {}


def check(*worlds):
    def register(fn):
        CHECKS[fn.__name__] = (fn, worlds)
        return fn

    return register


@check(2, 3)
def ddp(gs, gl):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run(group, extra):
        # Tiny buckets: several all-reduces in flight during backward.
        model = DDP(mlp(), process_group=group, bucket_cap_mb=0.0001)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return {"losses": train(model, opt, 5), "params": [p.detach().clone() for p in model.parameters()]}

    got = both(run, gs, gl)
    same(got["params"], fsdp_run_unsharded(5)["params"], "against one process")


@check(2, 3)
def fsdp2_per_layer_and_root(gs, gl):
    got = both(lambda g, extra: fsdp_run(mesh_of(g)), gs, gl)
    ref = fsdp_run_unsharded()
    same(got["params"], ref["params"], "against one process")


def fsdp_run_unsharded(steps=4):
    """The same training on one process with the batches of every rank: gradients averaged."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_rank = []
    global RANK
    mine = RANK
    try:
        for r in range(WORLD):
            RANK = r
            per_rank.append(batches(steps))
    finally:
        RANK = mine
    for step in range(steps):
        loss = sum(F.mse_loss(model(per_rank[r][step][0]), per_rank[r][step][1]) for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach() for p in model.parameters()]}


@check(2)
def fsdp2_bf16_params(gs, gl):
    # Parameters all-gathered in bfloat16 (in place), gradients reduced in float32.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    both(lambda g, extra: fsdp_run(mesh_of(g), mp=mp), gs, gl)


@check(4)
def hsdp_2x2(gs, gl):
    from torch.distributed.device_mesh import init_device_mesh

    # Dimension names of their own (see mesh_of).
    meshes = {
        "gradsync": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
        "gloo": init_device_mesh(
            "cpu", (2, 2), mesh_dim_names=("replicate_g", "shard_g"), backend_override={"replicate_g": "gloo", "shard_g": "gloo"}
        ),
    }
    for name, mesh in meshes.items():
        for dim in mesh.mesh_dim_names:
            got = mesh.get_group(dim)._get_backend(torch.device("cpu")).name()
            assert got == name, f"{name} mesh's {dim} group runs on {got}"
    got = fsdp_run(meshes["gradsync"])
    want = fsdp_run(meshes["gloo"])
    same(got, want)
    same(got["params"], fsdp_run_unsharded()["params"], "against one process")


@check(2, 3)
def zero_redundancy_optimizer(gs, gl):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run(group, extra):
        model = DDP(mlp(), process_group=group)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, process_group=group, lr=1e-2)
        losses = train(model, opt, 4)
        opt.consolidate_state_dict(to=0)
        out = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}
        if RANK == 0:
            state = opt.state_dict()["state"]
            out["state"] = [[state[i][k] for k in ("exp_avg", "exp_avg_sq")] for i in sorted(state)]
            assert len(out["state"]) == 6, sorted(state)
        return out

    both(run, gs, gl)


@check(2, 3)
def object_collectives(gs, gl):
    def run(group, extra):
        out = {}
        objs = [None] * WORLD
        dist.all_gather_object(objs, {"rank": RANK, "s": "x" * RANK}, group=group)
        out["all_gather_object"] = objs
        lst = [RANK, {"a": [RANK] * 3}]
        dist.broadcast_object_list(lst, src=WORLD - 1, group=group)
        out["broadcast_object_list"] = lst
        got = [None] * WORLD if RANK == WORLD - 1 else None
        dist.gather_object(("g", RANK), got, dst=WORLD - 1, group=group)
        out["gather_object"] = got
        mine = [None]
        dist.scatter_object_list(mine, [("s", r, "y" * r) for r in range(WORLD)] if RANK == 0 else None, src=0, group=group)
        out["scatter_object_list"] = mine
        return out

    got = both(run, gs, gl)
    assert got["all_gather_object"] == [{"rank": r, "s": "x" * r} for r in range(WORLD)], got
    assert got["broadcast_object_list"] == [WORLD - 1, {"a": [WORLD - 1] * 3}], got
    if RANK == WORLD - 1:
        assert got["gather_object"] == [("g", r) for r in range(WORLD)], got
    assert got["scatter_object_list"] == [("s", RANK, "y" * RANK)], got


def tensor_ops(group, members, extra):
    """Collectives on a group whose global ranks are ``members``."""
    i = members.index(RANK)
    n = len(members)
    out = {}
    t = data(RANK, 10)
    dist.all_reduce(t, group=group)
    out["all_reduce"] = t
    o = torch.empty(n * 4)
    dist.all_gather_into_tensor(o, data(RANK, 4, salt=1), group=group)
    out["all_gather_into_tensor"] = o
    o = torch.empty(3)
    dist.reduce_scatter_tensor(o, data(RANK, 3 * n, salt=2), group=group)
    out["reduce_scatter_tensor"] = o
    b = data(RANK, 5, salt=3)
    dist.broadcast(b, src=members[-1], group=group)
    out["broadcast"] = b
    send = [(i + j) % 3 for j in range(n)]
    recv = [(j + i) % 3 for j in range(n)]
    o = torch.empty(sum(recv), 2)
    dist.all_to_all_single(o, data(RANK, (sum(send), 2), salt=4), recv, send, group=group)
    out["all_to_all_single"] = o
    objs = [None] * n
    dist.all_gather_object(objs, ("o", RANK), group=group)
    out["all_gather_object"] = objs
    return out


@check(3)
def subgroups_of_two_of_three(gs, gl):
    results = {}
    for members in ([0, 2], [1, 2]):
        g_gs = dist.new_group(members, backend="gradsync")
        g_gl = dist.new_group(members, backend="gloo")
        if RANK in members:
            got = both(tensor_ops, g_gs, g_gl, members)
            assert got["all_gather_object"] == [("o", r) for r in members], got
            results[str(members)] = got
        dist.destroy_process_group(g_gs)
        dist.destroy_process_group(g_gl)
    assert len(results) == (1 if RANK != 2 else 2), results


def a2a_even(group, extra):
    out = {}
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.int8, torch.bool) + ((torch.int16,) if extra else ()):
        inp = data(RANK, (WORLD * 3, 4), dtype, salt=5)
        o = torch.empty_like(inp)
        dist.all_to_all_single(o, inp, group=group)
        out[str(dtype)] = o
        want = torch.cat([data(r, (WORLD * 3, 4), dtype, salt=5)[3 * RANK : 3 * RANK + 3] for r in range(WORLD)])
        assert torch.equal(o, want), f"{dtype}: {o.flatten()[:6]} want {want.flatten()[:6]}"
    return out


def split_matrix(salt):
    """rows[i][j]: what rank i sends rank j (zeros included), known to every rank."""
    g = torch.Generator().manual_seed(4242 + salt)
    return torch.randint(0, 4, (WORLD, WORLD), generator=g).tolist()


def a2a_uneven(group, extra):
    out = {}
    m = split_matrix(1)
    send = m[RANK]
    recv = [m[j][RANK] for j in range(WORLD)]
    for dtype in (torch.float32, torch.int8) + ((torch.int16,) if extra else ()):
        inp = data(RANK, (sum(send), 3), dtype, salt=6)
        o = torch.full((sum(recv), 3), -1).to(dtype)
        dist.all_to_all_single(o, inp, recv, send, group=group)
        out[str(dtype)] = o
        parts = []
        for j in range(WORLD):
            start = sum(m[j][:RANK])
            parts.append(data(j, (sum(m[j]), 3), dtype, salt=6)[start : start + m[j][RANK]])
        assert torch.equal(o, torch.cat(parts)), f"{dtype}: uneven all_to_all_single"
    return out


def moe_round_trip(group, extra):
    """Tokens routed to the rank of their expert and back, as an MoE layer does: the counts go
    first (an even all-to-all), then the tokens (uneven), then the results come back."""
    g = torch.Generator().manual_seed(77 + RANK)
    tokens = torch.randn(11, 6, generator=g)
    dest = torch.randint(0, WORLD, (11,), generator=g)
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=WORLD)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    routed = torch.empty(sum(recv), 6)
    dist.all_to_all_single(routed, tokens[order], recv, send, group=group)
    processed = routed * (RANK + 1) + 0.5
    back = torch.empty(11, 6)
    dist.all_to_all_single(back, processed, send, recv, group=group)
    result = torch.empty_like(back)
    result[order] = back
    want = tokens * (dest.unsqueeze(1) + 1).float() + 0.5
    assert torch.allclose(result, want), "MoE round trip"
    return {"recv_counts": recv_counts, "routed": routed, "result": result}


def a2a_lists(group, extra):
    out = {}
    if extra:  # Gloo's all_to_all takes tensors of one size only
        m = split_matrix(2)
        ins = [data(RANK, m[RANK][j] * 2 + 1, salt=7 + j) for j in range(WORLD)]
        outs = [torch.empty(m[j][RANK] * 2 + 1) for j in range(WORLD)]
        dist.all_to_all(outs, ins, group=group)
        for j in range(WORLD):
            assert torch.equal(outs[j], data(j, m[j][RANK] * 2 + 1, salt=7 + RANK)), f"all_to_all from {j}"
        out["uneven"] = outs
        COMPARED[0] += 1
    ins = [data(RANK, (2, 3), torch.int64, salt=20 + j) for j in range(WORLD)]
    outs = [torch.empty(2, 3, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_to_all(outs, ins, group=group)
    out["even"] = outs
    return out


@check(2, 3)
def all_to_all_single_even(gs, gl):
    both(a2a_even, gs, gl)


@check(2, 3)
def all_to_all_single_uneven_and_moe(gs, gl):
    both(a2a_uneven, gs, gl)
    both(moe_round_trip, gs, gl)


@check(2, 3)
def all_to_all_tensor_lists(gs, gl):
    both(a2a_lists, gs, gl)


def p2p_ring(group, extra):
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    a, b = torch.empty(3000), torch.empty(3000)
    c = torch.empty(7, dtype=torch.int16)
    ops = [
        dist.P2POp(dist.isend, data(RANK, 3000, salt=30), nxt, group),
        dist.P2POp(dist.isend, data(RANK, 3000, salt=31), prv, group),
        dist.P2POp(dist.irecv, a, prv, group),
        dist.P2POp(dist.irecv, b, nxt, group),
        dist.P2POp(dist.isend, data(RANK, 7, torch.int16, salt=32), nxt, group),
        dist.P2POp(dist.irecv, c, prv, group),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(a, data(prv, 3000, salt=30)) and torch.equal(b, data(nxt, 3000, salt=31))
    assert torch.equal(c, data(prv, 7, torch.int16, salt=32))
    return [a, b, c]


@check(2, 3)
def batch_isend_irecv(gs, gl):
    both(p2p_ring, gs, gl)


def rs_ag(group, extra):
    out = {}
    n = 6
    for dtype in (torch.bfloat16, torch.float32):
        ops = {"sum": dist.ReduceOp.SUM}
        if WORLD == 2 or dtype == torch.float32:
            ops["avg"] = dist.ReduceOp.AVG  # an average of 3 rounds differently in bfloat16
        for name, op in ops.items():
            o = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(o, data(RANK, WORLD * n, dtype, salt=40, integers=True), op=op, group=group)
            out[f"rs {dtype} {name}"] = o
            buf = data(RANK, WORLD * n, dtype, salt=40, integers=True)
            mine = buf[RANK * n : (RANK + 1) * n]
            dist.reduce_scatter_tensor(mine, buf, op=op, group=group)  # in place
            out[f"rs in place {dtype} {name}"] = mine.clone()
            assert torch.equal(mine, o), f"in-place reduce_scatter_tensor {dtype} {name}"
        o = torch.empty(WORLD * n, dtype=dtype)
        dist.all_gather_into_tensor(o, data(RANK, n, dtype, salt=41), group=group)
        out[f"ag {dtype}"] = o
        if extra:  # Gloo takes flat outputs only
            o2 = torch.empty(WORLD, n, dtype=dtype)  # stacked
            dist.all_gather_into_tensor(o2, data(RANK, n, dtype, salt=41), group=group)
            assert torch.equal(o2.flatten(), o), "stacked all_gather_into_tensor"
        buf = torch.zeros(WORLD * n, dtype=dtype)
        buf[RANK * n : (RANK + 1) * n] = data(RANK, n, dtype, salt=41)
        dist.all_gather_into_tensor(buf, buf[RANK * n : (RANK + 1) * n], group=group)  # in place
        out[f"ag in place {dtype}"] = buf
        assert torch.equal(buf, o), f"in-place all_gather_into_tensor {dtype}"
        want = torch.cat([data(r, n, dtype, salt=41) for r in range(WORLD)])
        assert torch.equal(o, want), f"all_gather_into_tensor {dtype}"
    # coalesced, as FSDP and functional collectives issue them
    outs = [torch.empty(WORLD * 3), torch.empty(WORLD * 2, dtype=torch.bfloat16)]
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], data(RANK, 3, salt=42), group=group)
        dist.all_gather_into_tensor(outs[1], data(RANK, 2, torch.bfloat16, salt=43), group=group)
    cm.wait()
    out["ag coalesced"] = outs
    outs = [torch.empty(3), torch.empty(2)]
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], data(RANK, WORLD * 3, salt=44, integers=True), group=group)
        dist.reduce_scatter_tensor(outs[1], data(RANK, WORLD * 2, salt=45, integers=True), group=group)
    cm.wait()
    out["rs coalesced"] = outs
    return out


@check(2, 3)
def reduce_scatter_and_all_gather_bf16_in_place(gs, gl):
    both(rs_ag, gs, gl)


def rooted(group, extra):
    out = {}
    for dtype in (torch.float32, torch.int8, torch.bfloat16) + ((torch.int16,) if extra else ()):
        root = WORLD - 1
        inp = data(RANK, 5, dtype, salt=50)
        outs = [torch.empty(5, dtype=dtype) for _ in range(WORLD)] if RANK == root else None
        dist.gather(inp, outs, dst=root, group=group)
        if RANK == root:
            out[f"gather {dtype}"] = outs
            for r in range(WORLD):
                assert torch.equal(outs[r], data(r, 5, dtype, salt=50)), f"gather {dtype} from {r}"
        o = torch.empty(4, dtype=dtype)
        parts = [data(0, 4, dtype, salt=51 + r) for r in range(WORLD)] if RANK == 0 else None
        dist.scatter(o, parts, src=0, group=group)
        assert torch.equal(o, data(0, 4, dtype, salt=51 + RANK)), f"scatter {dtype}"
        out[f"scatter {dtype}"] = o
    t = data(RANK, 9, salt=52)
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX, group=group)
    if RANK == 0:
        out["reduce"] = t
    return out


@check(2, 3)
def gather_scatter_reduce(gs, gl):
    both(rooted, gs, gl)


def bitwise_ops(group, extra):
    import functools

    out = {}
    ops = {"band": (dist.ReduceOp.BAND, torch.bitwise_and), "bor": (dist.ReduceOp.BOR, torch.bitwise_or), "bxor": (dist.ReduceOp.BXOR, torch.bitwise_xor)}
    for dtype in (torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool) + ((torch.int16,) if extra else ()):
        for name, (op, fn) in ops.items():
            t = data(RANK, 33, dtype, salt=60)
            dist.all_reduce(t, op=op, group=group)
            want = functools.reduce(fn, [data(r, 33, dtype, salt=60) for r in range(WORLD)])
            assert torch.equal(t, want), f"all_reduce {name} {dtype}"
            out[f"{name} {dtype}"] = t
    return out


@check(2, 3)
def bitwise_reductions(gs, gl):
    import functools

    both(bitwise_ops, gs, gl)
    # Against the expected values: bool as logical operators, reduce and reduce_scatter_tensor.
    inputs = [data(r, 40, torch.bool, salt=61) for r in range(WORLD)]
    for op, fn in ((dist.ReduceOp.BAND, torch.logical_and), (dist.ReduceOp.BOR, torch.logical_or), (dist.ReduceOp.BXOR, torch.logical_xor)):
        t = inputs[RANK].clone()
        dist.all_reduce(t, op=op, group=gs)
        assert torch.equal(t, functools.reduce(fn, inputs)), f"bool {op}"
        COMPARED[0] += t.numel()
    t = data(RANK, 12, torch.int64, salt=62)
    dist.reduce(t, dst=WORLD - 1, op=dist.ReduceOp.BXOR, group=gs)
    if RANK == WORLD - 1:
        assert torch.equal(t, functools.reduce(torch.bitwise_xor, [data(r, 12, torch.int64, salt=62) for r in range(WORLD)]))
    o = torch.empty(4, dtype=torch.int32)
    dist.reduce_scatter_tensor(o, data(RANK, WORLD * 4, torch.int32, salt=63), op=dist.ReduceOp.BOR, group=gs)
    full = functools.reduce(torch.bitwise_or, [data(r, WORLD * 4, torch.int32, salt=63) for r in range(WORLD)])
    assert torch.equal(o, full[4 * RANK : 4 * RANK + 4]), "reduce_scatter_tensor BOR"
    COMPARED[0] += o.numel()


def misc(group, extra):
    """All-reduce of strided and empty tensors, broadcast, list all-gather and reduce-scatter."""
    out = {}
    if extra:  # Gloo reduces strided tensors differently
        base = data(RANK, (6, 10), salt=70)
        view = base[:, ::2]
        dist.all_reduce(view, group=group)
        want = data(RANK, (6, 10), salt=70)
        want[:, ::2] = sum(data(r, (6, 10), salt=70)[:, ::2] for r in range(WORLD))
        assert torch.allclose(base, want, rtol=TOL, atol=TOL), "strided all_reduce"
        out["strided all_reduce"] = base
    e = torch.empty(0)
    dist.all_reduce(e, group=group)
    out["empty"] = e
    t = data(RANK, 1000, salt=71)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out["max"] = t
    for dtype in (torch.int8,) + ((torch.int16,) if extra else ()):
        b = data(RANK, 300, dtype, salt=72)
        dist.broadcast(b, src=WORLD - 1, group=group)
        assert torch.equal(b, data(WORLD - 1, 300, dtype, salt=72)), f"broadcast {dtype}"
        out[f"broadcast {dtype}"] = b
    outs = [torch.empty(3, 2) for _ in range(WORLD)]
    dist.all_gather(outs, data(RANK, (3, 2), salt=73), group=group)
    out["all_gather list"] = outs
    o = torch.empty(4)
    dist.reduce_scatter(o, [data(RANK, 4, salt=74 + j, integers=True) for j in range(WORLD)], group=group)
    out["reduce_scatter list"] = o
    return out


@check(2, 3)
def staged_path_on_host_tensors(gs, gl):
    """The staging pipeline of CUDA tensors, run on CPU tensors (synchronous copies) with chunks
    of 64 bytes and 2 in flight: chunking, aliasing and ordering against Gloo."""
    b = backend_of(gs)
    b._stage_host_tensors = True
    for fn in (misc, rs_ag, a2a_even, a2a_uneven, moe_round_trip, a2a_lists, rooted, p2p_ring, object_collectives_plain):
        both(fn, gs, gl)
    staging = b._staging_for(torch.device("cpu"))
    assert isinstance(staging, gradsync._staging.HostStaging), staging
    # A staged operation of many chunks, then CPU operations on the same group, unstaged: they
    # wait in the stager behind it, so every rank submits them in the same order.
    big = data(RANK, 4000, salt=80)
    w1 = dist.all_reduce(big, group=gs, async_op=True)
    b._stage_host_tensors = False
    small = data(RANK, 10, salt=81)
    w2 = dist.all_reduce(small, group=gs, async_op=True)
    bc = data(RANK, 10, salt=82)
    w3 = dist.broadcast(bc, src=0, group=gs, async_op=True)
    deferred = b._stager is not None
    for w in (w3, w1, w2):
        w.wait()
    assert deferred, "the stager was never started"
    ref_big, ref_small, ref_bc = data(RANK, 4000, salt=80), data(RANK, 10, salt=81), data(RANK, 10, salt=82)
    dist.all_reduce(ref_big, group=gl)
    dist.all_reduce(ref_small, group=gl)
    dist.broadcast(ref_bc, src=0, group=gl)
    same([big, small, bc], [ref_big, ref_small, ref_bc], "ordered")


def object_collectives_plain(group, extra):
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK}, group=group)
    got = [None] * WORLD if RANK == 0 else None
    dist.gather_object(RANK * 10, got, dst=0, group=group)
    return {"all_gather_object": objs, "gather_object": got}


@check(2)
def misuse_raises_clear_errors(gs, gl):
    n = 4
    buf = torch.zeros(WORLD * n)
    wrong = buf[(1 - RANK) * n : (2 - RANK) * n]  # another rank's block
    expect(ValueError, "block", lambda: dist.all_gather_into_tensor(buf, wrong, group=gs))
    expect(ValueError, "block", lambda: dist.reduce_scatter_tensor(wrong, buf, group=gs))
    expect(ValueError, "block", lambda: dist.all_gather_into_tensor(buf, buf[1 : 1 + n], group=gs))
    x = torch.zeros(WORLD * 2)
    expect(ValueError, "overlaps", lambda: dist.all_to_all_single(x, x, group=gs))
    expect(ValueError, "split sizes", lambda: dist.all_to_all_single(torch.empty(3), torch.empty(3), [1, 1], [3, 3], group=gs))
    expect(TypeError, "BAND", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND, group=gs))
    expect(NotImplementedError, "PREMUL_SUM", lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0), group=gs))
    # nothing was queued: the group still works
    t = torch.full((3,), float(RANK + 1))
    dist.all_reduce(t, group=gs)
    assert torch.equal(t, torch.full((3,), float(sum(range(1, WORLD + 1))))), t
    COMPARED[0] += 1


def expect(kind, words, fn):
    try:
        fn()
    except kind as e:
        assert words in str(e), f"{kind.__name__} without {words!r}: {e}"
        COMPARED[0] += 1
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"expected {kind.__name__} ({words}), got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {kind.__name__} ({words}), nothing was raised")


def main():
    global RANK, WORLD
    torch.set_num_threads(1)
    dist.init_process_group("gradsync")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    gl = dist.new_group(backend="gloo")
    only = set(sys.argv[1:])
    results, compared = {}, {}
    for name, (fn, worlds) in CHECKS.items():
        if WORLD not in worlds or (only and name not in only):
            continue
        gs = dist.new_group(backend="gradsync")
        COMPARED[0] = 0
        try:
            fn(gs, gl)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        compared[name] = COMPARED[0]
        try:
            dist.destroy_process_group(gs)
        except Exception:
            results[name] += "\n(destroying its group failed: " + traceback.format_exc() + ")"
        dist.barrier(group=gl)
    dist.destroy_process_group()
    print("@@result@@ " + json.dumps({"rank": RANK, "results": results, "compared": compared}), flush=True)


if __name__ == "__main__":
    main()
