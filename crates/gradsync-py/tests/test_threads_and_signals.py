"""Several Python threads on one communicator; Ctrl-C (SIGINT) during a wait."""

import os
import signal
import sys
import time

import pytest

from spawn_ranks import collect, run_ranks, start_ranks


def test_two_threads_share_a_communicator():
    results = run_ranks(2, "rank_programs:shared_by_threads", {"iters": 60}, timeout=90)
    for rank, r in enumerate(results):
        assert r["errors"] == [], f"rank {rank}: {r['errors']}"
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        # both threads had a call in flight at the same time
        assert r["most_inside"] == 2, r


def _wait_for(path, seconds):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a process is POSIX")
def test_sigint_interrupts_a_wait_for_a_peer_that_never_comes(tmp_path):
    procs = start_ranks(2, "rank_programs:interrupted_wait", {"dir": str(tmp_path)},
                        env={"GRADSYNC_TIMEOUT": "60"})
    try:
        assert _wait_for(tmp_path / "waiting", 60), "rank 0 never reached its all_reduce"
        time.sleep(0.5)  # rank 0 is inside the wait: rank 1 does not join before the signal
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGINT)
        assert _wait_for(tmp_path / "interrupted", 10), "SIGINT did not interrupt the wait"
        delay = time.monotonic() - sent
    except BaseException as e:
        for p in procs:
            p.kill()
        outs = [p.communicate(timeout=10) for p in procs]
        detail = "\n".join(f"rank {r} stdout:\n{o}\nrank {r} stderr:\n{err}" for r, (o, err) in enumerate(outs))
        raise AssertionError(f"{e}\n{detail}") from e
    results = collect(procs, timeout=60)
    assert results[0]["interrupted"], results
    assert delay < 2.0, f"KeyboardInterrupt came {delay:.2f} s after SIGINT"
    assert results[0]["waited"] >= 0.4, results  # it was raised inside the wait
    # the interrupted operation still ran to its end once rank 1 joined
    assert results[0]["buf"] == [3.0] * 8 and results[1]["buf"] == [3.0] * 8, results
