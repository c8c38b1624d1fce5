"""torch.distributed groups made after ``init_process_group("gradsync")`` (``new_group``,
``new_subgroups``, the sub-meshes of a ``DeviceMesh``): their communicators are split from the
default group's, with no new rendezvous store, and their collectives agree with Gloo's and with
exact values."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from ddp_helpers import launch  # noqa: E402

MARK = "@@result@@ "


def subgroup_results(world):
    outs = launch.run_ranks(launch.HERE / "subgroups_worker.py", world, timeout=240)
    res = []
    for r, out in enumerate(outs):
        lines = [line for line in out.splitlines() if line.startswith(MARK)]
        assert lines, f"rank {r} printed no result:\n{out}"
        res.append(json.loads(lines[-1][len(MARK) :]))
    return res


def check_subgroups(world, checks):
    for rank, r in enumerate(subgroup_results(world)):
        for check in checks:
            assert r["results"].get(check) == "ok", f"rank {rank}: {check}:\n{r['results'].get(check)}"
        # One communicator through a store (the default group's) and one store (rank 0's):
        # every later group was split from it.
        assert r["connects"] == 1, f"rank {rank}: {r['connects']} communicators built through a store"
        assert r["servers"] == (1 if rank == 0 else 0), f"rank {rank}: {r['servers']} stores started"


def test_new_group_of_two_of_three_ranks_is_split_from_the_default_group():
    check_subgroups(3, ["new_group([0, 2])", "group in the order [2, 1, 0]", "default group after"])


def test_new_subgroups_and_device_mesh_sub_meshes_are_split_from_the_default_group():
    check_subgroups(4, ["new_subgroups(2)", "DeviceMesh tp", "DeviceMesh dp", "default group after"])
