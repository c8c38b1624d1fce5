#!/usr/bin/env python3
"""Times collectives on CUDA tensors through the torch.distributed backend "gradsync" (staged
through pinned host memory) against Gloo on the same tensors, and against gradsync on CPU
tensors of the same size (what the staging adds), 2 ranks on this machine. Each run starts 2
fresh processes; the backends alternate run by run, and a cell is the median over the runs of
the mean time of ``--iters`` calls (after 2 warm-up calls).

    python3 scripts/gpu_bench.py [--device cuda|cpu] [--reps N] [--sizes MIB,...]
                                 [--iters N] [--colls all_reduce,all_gather,reduce_scatter]
                                 [--json FILE]

Columns: milliseconds a call; ``gloo/gradsync`` (above 1: gradsync is faster) and, on CUDA,
``staged/cpu`` (gradsync on CUDA tensors over gradsync on CPU tensors: 1 when the copies hide
entirely behind the communication). A size is the tensor all-reduced, the output of the
all-gather and the input of the reduce-scatter (float32). ``--device cpu`` runs the same
comparison on CPU tensors (to try the script without a GPU). Exit status: 0 when every cell was
timed, 1 when a run failed, 3 without a CUDA GPU (nothing was timed). gradsync must be
importable (install a wheel, as ``scripts/gpu-check.sh`` does).
"""

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

from gpu_check import NO_GPU, WORLD, _free_port, device_name


def _worker(args) -> dict:
    import torch
    import torch.distributed as dist

    import gradsync.distributed  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    dist.init_process_group(args.backend)
    out = {}
    try:
        for coll in args.colls.split(","):
            for mib in (int(s) for s in args.sizes.split(",")):
                n = (mib << 18) // WORLD * WORLD  # float32 elements, a multiple of the world
                if coll == "all_reduce":
                    t = torch.ones(n, device=device)

                    def call(t=t):
                        dist.all_reduce(t)

                elif coll == "all_gather":
                    o, i = torch.empty(n, device=device), torch.ones(n // WORLD, device=device)

                    def call(o=o, i=i):
                        dist.all_gather_into_tensor(o, i)

                elif coll == "reduce_scatter":
                    i, o = torch.ones(n, device=device), torch.empty(n // WORLD, device=device)

                    def call(o=o, i=i):
                        dist.reduce_scatter_tensor(o, i)

                else:
                    raise ValueError(f"unknown collective {coll!r}")
                for _ in range(2):
                    call()
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    call()
                sync()
                out[f"{coll} {mib}"] = (time.perf_counter() - t0) / args.iters
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return out


def _run(backend: str, device: str, args) -> dict:
    """One run of WORLD ranks; rank 0's times, or ``{"error": ...}``."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD))
    env.update(GRADSYNC_TOKEN=secrets.token_hex(16), OMP_NUM_THREADS="1")
    env.setdefault("GRADSYNC_TIMEOUT", "60")
    procs = []
    for rank in range(WORLD):
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--backend", backend, "--device", device]
        cmd += ["--sizes", args.sizes, "--iters", str(args.iters), "--colls", args.colls]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + args.timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(p.communicate()[0] + f"\n(killed after {args.timeout} s)")
    for line in logs[0].splitlines():
        if line.startswith("RESULT ") and all(p.returncode == 0 for p in procs):
            return json.loads(line[len("RESULT ") :])
    return {"error": "\n".join(f"--- rank {r}\n{log[-2000:]}" for r, log in enumerate(logs))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="1,64", help="MiB, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--colls", default="all_reduce,all_gather,reduce_scatter")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for each run of 2 ranks")
    ap.add_argument("--json", help="also write the times to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = _worker(args)
        if int(os.environ["RANK"]) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return 0

    import torch

    where = device_name(torch, args.device, "gpu-bench", "timed")
    if where is None:
        return NO_GPU
    print(f"gpu-bench: torch {torch.__version__}, {where}, {WORLD} ranks, {args.reps} runs of {args.iters} calls")
    columns = [("gradsync", args.device), ("gloo", args.device)]
    if args.device == "cuda":
        columns.append(("gradsync", "cpu"))
    times: dict = {}
    failed = False
    for _ in range(args.reps):
        for backend, device in columns:
            got = _run(backend, device, args)
            if "error" in got:
                failed = True
                print(f"--- {backend} on {device} tensors failed:\n{got['error']}")
                continue
            for key, t in got.items():
                times.setdefault(f"{backend} {device}", {}).setdefault(key, []).append(t)
    keys = [f"{c} {m}" for c in args.colls.split(",") for m in args.sizes.split(",")]
    head = ["collective MiB"] + [f"{b} {d}" for b, d in columns] + ["gloo/gradsync"]
    if args.device == "cuda":
        head.append("staged/cpu")
    rows, report = [], {}
    for key in keys:
        cells = {}
        for b, d in columns:
            runs = times.get(f"{b} {d}", {}).get(key, [])
            cells[f"{b} {d}"] = statistics.median(runs) * 1e3 if runs else None
        report[key] = cells
        mine, gloo = cells[f"gradsync {args.device}"], cells[f"gloo {args.device}"]
        row = [key] + [f"{v:.3f}" if v is not None else "-" for v in cells.values()]
        row.append(f"{gloo / mine:.2f}" if mine and gloo else "-")
        if args.device == "cuda":
            cpu = cells["gradsync cpu"]
            row.append(f"{mine / cpu:.2f}" if mine and cpu else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print()
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print("\nms a call, median of the runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"columns": head, "rows": rows, "ms": report}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
