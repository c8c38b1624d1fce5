"""Runs a function on N ranks, each a separate Python process, as a launcher would.

``run_ranks(world, "module:function", args)`` starts ``world`` processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``; each imports ``module`` from this directory and calls ``function(rank, world,
args)``, and prints what it returns as JSON. The results come back as a list indexed by rank.
A rank that fails or overruns the timeout fails the whole run with every rank's output.
``start_ranks`` and ``collect`` are its two halves, for tests that act on the processes while
they run.

Run as a script, this file is the per-rank entry point.
"""

import importlib
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "@@result@@ "


def free_port() -> int:
    """A TCP port that is free now (and, very likely, the next one too)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def start_ranks(world, target, args=None, env=None):
    """Starts ``target`` (``"module:function"``) on ``world`` processes; returns them."""
    port = free_port()
    procs = []
    base = dict(os.environ)
    base.setdefault("GRADSYNC_TIMEOUT", "30")
    base.update(env or {})
    base["SPAWN_RANKS_ARGS"] = json.dumps(args if args is not None else {})
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
                [sys.executable, os.path.join(HERE, "spawn_ranks.py"), target],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=e,
                text=True,
            )
        )
    return procs


def collect(procs, timeout=120):
    """Waits for the processes of :func:`start_ranks`; returns their results by rank."""
    world = len(procs)
    outs = [None] * world
    deadline = time.monotonic() + timeout
    try:
        for r, p in enumerate(procs):
            left = max(0.1, deadline - time.monotonic())
            outs[r] = p.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        report = []
        for r, p in enumerate(procs):
            o, e = p.communicate()
            report.append(f"--- rank {r} (killed after {timeout} s)\n{o}\n{e}")
        raise AssertionError("ranks timed out:\n" + "\n".join(report))
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        report = "\n".join(
            f"--- rank {r} exit {procs[r].returncode}\n{outs[r][0]}\n{outs[r][1]}"
            for r in range(world)
        )
        raise AssertionError(f"ranks {failed} failed:\n{report}")
    results = []
    for r, (o, _) in enumerate(outs):
        lines = [l for l in o.splitlines() if l.startswith(MARK)]
        assert lines, f"rank {r} printed no result:\n{o}"
        results.append(json.loads(lines[-1][len(MARK):]))
    return results


def run_ranks(world, target, args=None, timeout=120, env=None):
    """Runs ``target`` (``"module:function"``) on ``world`` processes; returns their results."""
    return collect(start_ranks(world, target, args, env), timeout)


def _main():
    module, func = sys.argv[1].split(":")
    sys.path.insert(0, HERE)
    args = json.loads(os.environ.get("SPAWN_RANKS_ARGS") or "{}")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    fn = getattr(importlib.import_module(module), func)
    result = fn(rank, world, args)
    print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()
