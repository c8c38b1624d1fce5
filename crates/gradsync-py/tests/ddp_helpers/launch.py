"""Starting the ranks of a job: as separate processes with the torchrun environment, or under
torchrun itself. Every run has a timeout; a failed or overrunning run raises with every rank's
output."""

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
EXAMPLES = REPO / "examples"


def free_port() -> int:
    """A TCP port that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(extra=None) -> dict:
    """The environment every rank of a test job shares: one intra-op thread (the ranks share
    two cores), a job token, and gradsync deadlines that fail a test well before its timeout."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        GRADSYNC_TOKEN=secrets.token_hex(32),
        GRADSYNC_TIMEOUT="60",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def _collect(procs, timeout, what):
    outs = [None] * len(procs)
    deadline = time.monotonic() + timeout
    try:
        for i, p in enumerate(procs):
            outs[i] = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        report = []
        for i, p in enumerate(procs):
            o, e = p.communicate()
            report.append(f"--- {what} {i} (killed after {timeout} s)\n{o}\n{e}")
        raise AssertionError("timed out:\n" + "\n".join(report))
    return outs


def run_ranks(script, world, args=(), timeout=120, env=None):
    """Runs ``script`` as ``world`` processes with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set (what ``init_process_group("...")`` reads); returns each rank's stdout.
    Raises when a rank fails or the run overruns ``timeout`` seconds."""
    port = free_port()
    base = job_env(env)
    procs = []
    for rank in range(world):
        e = dict(base)
        e.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *map(str, args)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=e,
                text=True,
            )
        )
    outs = _collect(procs, timeout, "rank")
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        report = "\n".join(
            f"--- rank {r} exit {procs[r].returncode}\n{outs[r][0]}\n{outs[r][1]}" for r in range(world)
        )
        raise AssertionError(f"ranks {failed} of {script} failed:\n{report}")
    return [o for o, _ in outs]


def torchrun_command():
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def run_torchrun(script, nproc, args=(), timeout=150, env=None):
    """``torchrun --nproc-per-node nproc script args`` on a free port; returns its stdout."""
    cmd = torchrun_command() + [
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *map(str, args),
    ]
    p = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=job_env(env),
        text=True,
    )
    [(out, err)] = _collect([p], timeout, "torchrun")
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with exit {p.returncode}:\n{out}\n{err}")
    return out
