"""Launch paths: the explicit constructor with a StoreServer, torchrun, the package surface."""

import os
import shutil
import subprocess
import sys

import pytest

import gradsync
from spawn_ranks import HERE, free_port, run_ranks


def test_explicit_constructor_with_store_server():
    with gradsync.StoreServer("127.0.0.1", 0) as store:
        assert store.port > 0 and store.address.endswith(f":{store.port}")
        results = run_ranks(3, "rank_programs:explicit", {"port": store.port}, timeout=60)
    for r in results:
        assert r["max"] == [2] * 9
        assert "closed" in r["repr"]


def test_store_server_port_in_use():
    with gradsync.StoreServer("127.0.0.1", 0) as store:
        with pytest.raises(gradsync.GradsyncError, match="Address already in use|in use"):
            gradsync.StoreServer("127.0.0.1", store.port)


TORCHRUN_SCRIPT = """
import sys, numpy as np, gradsync
comm = gradsync.Communicator.from_env()
buf = np.full(4, comm.rank + 1.0, dtype=np.float32)
comm.all_reduce(buf)
with open(f"{sys.argv[1]}/rank{comm.rank}", "w") as f:
    f.write(f"{comm.rank} {comm.world_size} {buf.tolist()}")
comm.close()
"""


def test_from_env_under_torchrun(tmp_path):
    # torchrun's agent already serves its store on MASTER_PORT; gradsync's goes next to it.
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, GRADSYNC_TIMEOUT="30")
    port = free_port()
    p = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-port", str(port), str(script),
         str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in range(2):
        got = (tmp_path / f"rank{rank}").read_text()
        assert got == f"{rank} 2 [3.0, 3.0, 3.0, 3.0]", p.stdout + p.stderr


def test_package_surface():
    assert issubclass(gradsync.GradsyncError, RuntimeError)
    assert gradsync.GradsyncError.__module__ == "gradsync"
    for name in ("Communicator", "Work", "StoreServer", "GradsyncError"):
        assert getattr(gradsync, name).__doc__, name
    for name in ("from_env", "all_reduce", "all_reduce_async", "reduce_scatter",
                 "reduce_scatter_async", "all_gather", "all_gather_async", "broadcast",
                 "broadcast_async", "reduce", "reduce_async", "barrier", "barrier_async",
                 "send", "recv", "close"):
        assert getattr(gradsync.Communicator, name).__doc__, name
    pkg = os.path.dirname(gradsync.__file__)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    assert os.path.exists(os.path.join(pkg, "_gradsync.pyi"))
    assert isinstance(gradsync.__version__, str)


def test_import_does_not_import_torch():
    code = ("import sys, numpy as np, gradsync; "
            "c = gradsync.Communicator('127.0.0.1:%d', 0, 1); "
            "c.all_reduce(np.ones(3, dtype=np.float32)); c.close(); "
            "print('torch' in sys.modules)" % free_port())
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=HERE)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
