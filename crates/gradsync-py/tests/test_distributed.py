"""torch.distributed on the "gradsync" backend: every collective against a reference on 2 and 3
processes, results bitwise identical on every rank, errors of mismatched collectives as Python
exceptions naming the ranks, and a one-rank group in this process."""

import datetime
import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
gd = pytest.importorskip("gradsync.distributed")

from ddp_helpers import launch  # noqa: E402
from ddp_helpers.collectives_worker import CHECKS  # noqa: E402

MARK = "@@result@@ "


def results_of(outs):
    res = []
    for r, out in enumerate(outs):
        lines = [line for line in out.splitlines() if line.startswith(MARK)]
        assert lines, f"rank {r} printed no result:\n{out}"
        res.append(json.loads(lines[-1][len(MARK) :]))
    return res


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def collectives(request):
    """Every check of collectives_worker.py, run once per world size."""
    outs = launch.run_ranks(launch.HERE / "collectives_worker.py", request.param, timeout=150)
    return results_of(outs)


@pytest.mark.parametrize("check", list(CHECKS))
def test_collective_matches_reference(collectives, check):
    for rank, res in enumerate(collectives):
        assert check in res["results"], f"rank {rank} did not run {check}"
        assert res["results"][check] == "ok", f"rank {rank}:\n{res['results'][check]}"


def test_all_reduce_results_are_bitwise_identical_on_every_rank(collectives):
    digests = [res["digests"] for res in collectives]
    assert digests[0], "no digests"
    assert all(d == digests[0] for d in digests), digests


@pytest.fixture(scope="module")
def mismatch():
    return results_of(launch.run_ranks(launch.HERE / "mismatch_worker.py", 2, timeout=120))


@pytest.mark.parametrize("case", ["different_collectives", "different_counts"])
def test_mismatched_collective_raises_gradsync_error_naming_the_ranks(mismatch, case):
    for rank, res in enumerate(mismatch):
        err = res[case]
        assert err is not None, f"rank {rank}: {case} raised nothing"
        assert (err["module"], err["type"]) == ("gradsync", "GradsyncError"), err
        assert "rank 0" in err["message"] and "rank 1" in err["message"], err["message"]
    if case == "different_collectives":
        # the rank that detected it names both calls
        assert "runs broadcast" in mismatch[1][case]["message"], mismatch[1][case]
        assert "all_reduce" in mismatch[1][case]["message"], mismatch[1][case]
    else:
        assert "count 16" in mismatch[0][case]["message"] and "count 17" in mismatch[0][case]["message"]


def test_mismatch_error_also_completes_the_future_with_an_error(mismatch):
    for rank, res in enumerate(mismatch):
        err = res["through_future"]
        assert err is not None, f"rank {rank}: the future completed without an error"
        assert "GradsyncError" in err["message"], err
        assert "rank 0" in err["message"] and "rank 1" in err["message"], err


# -- in this process ------------------------------------------------------------------------


def test_import_registers_the_backend():
    assert gd.BACKEND_NAME == "gradsync"
    assert "gradsync" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["gradsync"] == ["cpu"]
    gd.register()  # idempotent


def test_one_rank_group_in_process():
    port = launch.free_port()
    dist.init_process_group(
        "gradsync",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        t = torch.arange(6, dtype=torch.float32)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(6, dtype=torch.float32))
        w = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        assert w.wait() is True
        assert w.get_future().done()
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, t)
        assert torch.equal(out, t)
        with pytest.raises(NotImplementedError, match="all_to_all"):
            dist.all_to_all_single(torch.empty(1), torch.empty(1))
        with pytest.raises(NotImplementedError, match="BXOR"):
            dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BXOR)
        with pytest.raises(TypeError, match="int16"):
            dist.all_reduce(torch.ones(2, dtype=torch.int16))
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.communicator.world_size == 1
    finally:
        dist.destroy_process_group()
    assert backend.communicator.closed, "destroy_process_group closes the communicator"


def test_hook_state_needs_a_group_or_a_communicator():
    if dist.is_initialized():
        pytest.skip("a process group is initialized")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gd.make_hook_state()
