"""The CUDA staging path (gradsync._staging.CudaStaging) driven through a stand-in of torch.cuda's
stream and event API on CPU tensors: every copy to the host waits for the caller's stream, every
copy back too, the operation ends only after an event recorded behind the last copy back, and the
chunks give the right results (in place included). What the GPU itself does is checked by
scripts/gpu_check.py where there is one (test_cuda.py)."""

import contextlib
import threading

import pytest

torch = pytest.importorskip("torch")
gradsync = pytest.importorskip("gradsync")
from gradsync import _staging  # noqa: E402

from spawn_ranks import free_port  # noqa: E402


class FakeEvent:
    def __init__(self, log):
        self.log = log
        self.stream = None

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream.name, self))

    def query(self):
        return True


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, ev):
        self.log.append(("wait", self.name, ev))


@pytest.fixture
def fake_cuda(monkeypatch):
    log = []
    local = threading.local()
    caller = FakeStream("caller", log)
    made = iter(["to_host", "to_device"])

    @contextlib.contextmanager
    def stream(s):
        prev = getattr(local, "s", caller)
        local.s = s
        log.append(("enter", s.name))
        try:
            yield
        finally:
            local.s = prev
            log.append(("exit", s.name))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(next(made), log))
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(local, "s", caller))
    monkeypatch.setenv("GRADSYNC_STAGING_CHUNK", "64")
    return log


def run(staging, calls, after=None):
    op = _staging.StagedOp(staging, calls, threading.Semaphore(2), 10.0, "test", after)
    t = threading.Thread(target=op.submit, args=(float("inf"),))
    t.start()
    op.complete(float("inf"))
    t.join()
    return op


def check_order(log, chunks):
    ready = next(e for kind, name, e in (x for x in log if len(x) == 3) if kind == "record" and name == "caller")
    # each stream waits for the caller's event inside its context before anything is recorded there
    for stream in ("to_host", "to_device"):
        waits = [x for x in log if x[:2] == ("wait", stream)]
        assert waits and all(x[2] is ready for x in waits), log
    records = [x for x in log if x[0] == "record" and x[1] in ("to_host", "to_device")]
    assert len([r for r in records if r[1] == "to_host"]) == chunks, records
    # one event per chunk copied back, then the final one
    assert len([r for r in records if r[1] == "to_device"]) == chunks + 1, records
    assert log.index(records[-1]) > max(i for i, x in enumerate(log) if x[:2] == ("wait", "to_device")), log


def test_chunks_wait_for_the_callers_stream_and_the_op_for_its_copies_back(fake_cuda):
    comm = gradsync.Communicator(f"127.0.0.1:{free_port()}", 0, 1, timeout=20)
    try:
        pool = _staging.HostPool(pinned=False, keep=4)
        staging = _staging.CudaStaging(torch.device("cpu"), pool)
        t = torch.arange(40, dtype=torch.float32)
        b = t.view(1, -1)
        call = _staging.Call(lambda i, o: comm.all_reduce_async(o, "sum"), b, b, alias="same")
        op = run(staging, [call])
        assert op.units == 3  # 160 bytes in chunks of 64
        assert torch.equal(t, torch.arange(40, dtype=torch.float32))
        check_order(fake_cuda, 3)
        # in place: the input is block 0 of the output (one rank)
        fake_cuda.clear()
        out = torch.arange(30, dtype=torch.float32) * 2
        call = _staging.Call(lambda i, o: comm.all_gather_async(i, o), out.view(1, -1), out.view(1, -1), alias="in_block", block=0)
        seen = []
        run(staging, [call], after=lambda: seen.append(torch.cuda.current_stream().name))
        assert torch.equal(out, torch.arange(30, dtype=torch.float32) * 2)
        assert seen == ["to_device"], "after() runs on the copy-back stream"
        check_order(fake_cuda, 2)
    finally:
        comm.close()
