"""One rank of the subgroup test: groups made after ``init_process_group("gradsync")`` are split
from the default group's communicator, with no new rendezvous store.

On 3 ranks: ``new_group([0, 2])`` runs all-reduces, a broadcast, an all-gather and a
reduce-scatter, each compared with the same call on a Gloo group of the same ranks and with
exact values, while rank 1 stays out; then the default group. On 4 ranks: ``new_subgroups(2)``
and the sub-meshes of a 2 x 2 ``DeviceMesh``. Every rank counts the gradsync communicators
built through a store (``_connect``) and the stores it started.

Prints one JSON line: ``{"rank": r, "results": {check: "ok" | error}, "connects": n,
"servers": n}``.
"""

import json
import traceback

import torch
import torch.distributed as dist

import gradsync.distributed as gd

COUNTS = {"connects": 0, "servers": 0}


def _count(name, fn):
    def counted(*args, **kwargs):
        COUNTS[name] += 1
        return fn(*args, **kwargs)

    return counted


def data(rank, n, dtype, salt=0):
    """Small integers (exact in every dtype and under any order of summation)."""
    return ((torch.arange(n) * 7 + rank * 3 + salt) % 5 + 1).to(dtype)


def expect_same(a, b, what):
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: {a.tolist()} != {b.tolist()}")


def check_group(group, gloo, ranks):
    """Collectives on the gradsync ``group`` of global ``ranks`` against the Gloo group of the
    same ranks and against exact values."""
    rank = dist.get_rank()
    me = ranks.index(rank)
    backend = group._get_backend(torch.device("cpu"))
    comm = backend.communicator
    assert isinstance(backend, gd.GradsyncBackend), backend
    assert (comm.rank, comm.world_size) == (me, len(ranks)), (comm, me, ranks)
    assert dist.get_rank(group) == me
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8):
        for n in (1, 3, 1000, 10007):
            t = data(rank, n, dtype)
            ref = t.clone()
            dist.all_reduce(t, group=group)
            dist.all_reduce(ref, group=gloo)
            expect_same(t, ref, f"all_reduce {dtype} {n} against gloo")
            exact = sum(data(q, n, torch.int64) for q in ranks).to(dtype)
            expect_same(t, exact, f"all_reduce {dtype} {n}")
    t = data(rank, 33, torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    expect_same(t, torch.stack([data(q, 33, torch.int64) for q in ranks]).max(0).values, "all_reduce max")
    src = ranks[-1]
    t = data(rank, 100, torch.float32, salt=1)
    dist.broadcast(t, src=src, group=group)
    expect_same(t, data(src, 100, torch.float32, salt=1), "broadcast")
    out = torch.empty(7 * len(ranks), dtype=torch.int32)
    dist.all_gather_into_tensor(out, data(rank, 7, torch.int32, salt=2), group=group)
    expect_same(out, torch.cat([data(q, 7, torch.int32, salt=2) for q in ranks]), "all_gather")
    ref = torch.empty_like(out)
    dist.all_gather_into_tensor(ref, data(rank, 7, torch.int32, salt=2), group=gloo)
    expect_same(out, ref, "all_gather against gloo")
    inp = data(rank, 5 * len(ranks), torch.float32, salt=3)
    got = torch.empty(5)
    dist.reduce_scatter_tensor(got, inp, group=group)
    full = sum(data(q, 5 * len(ranks), torch.int64, salt=3) for q in ranks).to(torch.float32)
    expect_same(got, full[5 * me : 5 * me + 5], "reduce_scatter")


def check_default_group():
    world = dist.get_world_size()
    t = torch.full((9,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    expect_same(t, torch.full((9,), float(world * (world + 1) // 2)), "default group all_reduce")


def three_ranks(results):
    rank = dist.get_rank()
    group = dist.new_group([0, 2])
    gloo = dist.new_group([0, 2], backend="gloo")
    if rank in (0, 2):
        run(results, "new_group([0, 2])", lambda: check_group(group, gloo, [0, 2]))
    else:
        results["new_group([0, 2])"] = "ok" if group == dist.GroupMember.NON_GROUP_MEMBER else f"rank 1 got {group}"
    # A group given in another order (torch keeps it with sort_ranks=False): new ranks follow it.
    order = [2, 1, 0]
    group = dist.new_group(order, sort_ranks=False)
    gloo = dist.new_group(order, backend="gloo", sort_ranks=False)
    run(results, "group in the order [2, 1, 0]", lambda: check_group(group, gloo, order))
    run(results, "default group after", check_default_group)


def four_ranks(results):
    rank = dist.get_rank()
    mine, groups = dist.new_subgroups(2)
    glooed = [dist.new_group(r, backend="gloo") for r in ([0, 1], [2, 3])]
    ranks = [0, 1] if rank < 2 else [2, 3]
    assert len(groups) == 2
    run(results, "new_subgroups(2)", lambda: check_group(mine, glooed[rank // 2], ranks))

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # The mesh is [[0, 1], [2, 3]]: "tp" groups are its rows, "dp" groups its columns.
    rows = [[0, 1], [2, 3]]
    cols = [[0, 2], [1, 3]]
    gloo_rows = [dist.new_group(r, backend="gloo") for r in rows]
    gloo_cols = [dist.new_group(c, backend="gloo") for c in cols]

    def mesh_dim(name, sets, gloos):
        group = mesh.get_group(name)
        i = next(k for k, s in enumerate(sets) if rank in s)
        got = dist.get_process_group_ranks(group)
        assert got == sets[i], f"{name}: ranks {got}, want {sets[i]}"
        check_group(group, gloos[i], sets[i])

    run(results, "DeviceMesh tp", lambda: mesh_dim("tp", rows, gloo_rows))
    run(results, "DeviceMesh dp", lambda: mesh_dim("dp", cols, gloo_cols))
    run(results, "default group after", check_default_group)


def run(results, name, fn):
    try:
        fn()
        results[name] = "ok"
    except Exception:  # noqa: BLE001 - reported
        results[name] = traceback.format_exc()


def main():
    torch.set_num_threads(1)
    gd._connect = _count("connects", gd._connect)
    gd.StoreServer = _count("servers", gd.StoreServer)
    dist.init_process_group("gradsync")
    rank = dist.get_rank()
    results = {}
    if dist.get_world_size() == 3:
        three_ranks(results)
    else:
        four_ranks(results)
    dist.destroy_process_group()
    print("@@result@@ " + json.dumps({"rank": rank, "results": results, **COUNTS}), flush=True)


if __name__ == "__main__":
    main()
