"""torch.distributed on the "gradsync" backend: every collective against a reference on 2 and 3
processes, results bitwise identical on every rank, errors of mismatched collectives as Python
exceptions naming the ranks, point-to-point exchanges (isend/irecv in either order,
batch_isend_irecv), a one-rank group in this process, and the completion thread: every operation
ends, every wait has a deadline."""

import datetime
import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
gd = pytest.importorskip("gradsync.distributed")
gradsync = pytest.importorskip("gradsync")

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
    assert dist.Backend.backend_capability["gradsync"] == ["cpu", "cuda"]
    gd.register()  # idempotent


def test_torch_older_than_the_backend_supports_is_refused_at_import_saying_why():
    from torch.torch_version import TorchVersion

    with pytest.raises(ImportError, match=r"needs torch 2\.7 or later, and this is torch 2\.6\.0.*DDP hangs"):
        gd._require_torch(TorchVersion("2.6.0"))
    for ok in ("2.7.0", "2.7.1+cu126", "2.8.0", "2.11.0+cu130", "2.15.0"):
        gd._require_torch(TorchVersion(ok))


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
        a = torch.arange(4.0)
        b = torch.empty(4)
        dist.all_to_all_single(b, a)
        assert torch.equal(b, a)
        dist.all_to_all_single(b[:3], a[1:], [3], [3])
        assert torch.equal(b[:3], a[1:])
        g = [torch.empty(4)]
        dist.gather(a, g, dst=0)
        assert torch.equal(g[0], a)
        dist.scatter(b, [a + 1], src=0)
        assert torch.equal(b, a + 1)
        x = torch.tensor([0b1100, 0b1010], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.BXOR)
        assert x.tolist() == [0b1100, 0b1010]
        in_place = torch.arange(3.0)
        dist.all_gather_into_tensor(in_place, in_place)  # the input is the output's block 0
        dist.reduce_scatter_tensor(in_place, in_place)
        assert torch.equal(in_place, torch.arange(3.0))
        base = torch.arange(4.0)
        with pytest.raises(ValueError, match="block 0 of 1"):  # overlapping, but shifted
            dist.all_gather_into_tensor(base[:3], base[1:])
        with pytest.raises(NotImplementedError, match="PREMUL_SUM"):
            dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
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


# -- completion: every operation ends, every wait has a deadline ------------------------------


class _Odd(BaseException):
    """Something other than an Exception, raised by a work's wait."""


class _OddWork:
    def wait(self):
        raise _Odd("odd")


def test_an_operation_always_ends_and_the_completion_thread_goes_on():
    c = gd._Completer("test-completer", 0, 10.0)
    try:

        def failing_copy():
            raise ValueError("copy out failed")

        a = c.submit(gd._Op("a", (), None, failing_copy))
        b = gd._Op("b", (), ["b"], None)
        b.raw.set_result(["early"])  # so that completing its future raises
        c.submit(b)
        d = c.submit(gd._Op("d", [_OddWork()], None, None))
        e = c.submit(gd._Op("e", (), ["e"], None))
        with pytest.raises(ValueError, match="copy out failed"):
            gd._GradsyncWork(a, 0).wait()
        with pytest.raises(RuntimeError, match="ValueError: copy out failed"):  # torch's wrapping
            a.future.wait()
        assert gd._GradsyncWork(b, 0).wait() is True
        with pytest.raises(_Odd):
            gd._GradsyncWork(d, 0).wait()
        assert gd._GradsyncWork(e, 0).result() == ["e"]
        assert e.future.wait() == ["e"]
    finally:
        c.close()


def test_a_stuck_operation_raises_at_its_deadline_naming_the_rank_and_the_operation(monkeypatch):
    monkeypatch.setattr(gd, "_SLACK", 0.5)
    c = gd._Completer("test-completer", 3, 0.25)  # deadline: 0.25 s per queued op + 0.5 s
    release = threading.Event()
    op = c.submit(gd._Op("stuck_all_reduce", (), ["done"], None, run=lambda: release.wait(60)))
    work = gd._GradsyncWork(op, 3)
    try:
        with pytest.raises(TimeoutError, match="within 0.1 s"):
            work.wait(datetime.timedelta(seconds=0.1))
        t0 = time.monotonic()
        with pytest.raises(gradsync.GradsyncError, match="rank 3: stuck_all_reduce not completed by its deadline"):
            work.wait()
        assert time.monotonic() - t0 < 5
        # a wait with a longer timeout of its own still ends at the deadline
        with pytest.raises(gradsync.GradsyncError, match="deadline"):
            work.wait(datetime.timedelta(seconds=600))
        t0 = time.monotonic()
        with pytest.raises(gradsync.GradsyncError, match="rank 3: shutdown: .*stuck in stuck_all_reduce"):
            c.close()
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    assert op.done.wait(10), "the operation ends once released"
    assert work.wait() is True and work.result() == ["done"]


def test_blocking_exchange_of_large_messages_fails_at_the_timeout_saying_why(mismatch):
    # Both ranks send 16 MiB, then receive: each send waits for the other's receive.
    for rank, res in enumerate(mismatch):
        err = res["blocking_large_exchange"]
        assert err is not None, f"rank {rank}: the exchange did not fail"
        assert (err["module"], err["type"]) == ("gradsync", "GradsyncError"), err
        assert f"rank {rank}: send to rank {1 - rank}" in err["message"], err["message"]
        assert "timed out" in err["message"] and "isend/irecv" in err["message"], err["message"]
