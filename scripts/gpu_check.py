#!/usr/bin/env python3
"""Checks the torch.distributed backend "gradsync" on CUDA tensors against Gloo: DDP and FSDP2
(``fully_shard`` per layer and at the root) train the same model for several steps on each
backend, on 2 ranks (processes started here, sharing the GPUs round robin), and the losses of
every rank and step must agree within 1e-5, with Gloo's (on CUDA tensors, or on CPU ones where
Gloo cannot run on CUDA) and with the same training in one process on the same device (every
rank's gradient, averaged); a set of collectives on CUDA tensors (large enough
for the staging pipeline to cut them in chunks, in place and not, all-to-all even and uneven,
gather, scatter, point to point, and CUDA operations mixed with CPU ones) must give the expected
values. Prints a table of PASS and FAIL.

    python3 scripts/gpu_check.py [--steps N] [--device cuda|cpu] [--json FILE]

Exit status: 0 when every check passes, 1 when one fails, 3 without a CUDA GPU (nothing is
checked). ``--device cpu`` runs the same comparison on CPU tensors (to try the harness on a
machine without a GPU). gradsync must be importable (``scripts/gpu-check.sh`` installs a wheel
and runs this). Every run has a timeout.
"""

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import traceback

NO_GPU = 3
TOL = 1e-5
WORLD = 2


# --------------------------------------------------------------------------------------------
# One rank


def _model(torch, width):
    torch.manual_seed(0)
    nn = torch.nn
    # Widths that do not divide evenly (FSDP pads its shards); width x width float32 parameters
    # are large enough for the staging pipeline to cut all-gathers in several chunks.
    return nn.Sequential(
        nn.Linear(97, width), nn.Tanh(), nn.Linear(width, width + 3), nn.Tanh(), nn.Linear(width + 3, 11)
    )


def _batches(torch, rank, steps, device):
    g = torch.Generator().manual_seed(1000 + 17 * rank)
    return [(torch.randn(16, 97, generator=g).to(device), torch.randn(16, 11, generator=g).to(device)) for _ in range(steps)]


def _train(torch, model, opt, batches):
    import torch.nn.functional as F

    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(args) -> dict:
    import torch
    import torch.distributed as dist

    import gradsync.distributed  # noqa: F401  (registers the backend)

    rank = int(os.environ["RANK"])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    out = {"rank": rank}
    try:
        if args.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = _model(torch, args.width).to(device)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=1)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
            out["losses"] = _train(torch, ddp, opt, _batches(torch, rank, args.steps, device))
        elif args.kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            model = _model(torch, args.width).to(device)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            out["losses"] = _train(torch, model, opt, _batches(torch, rank, args.steps, device))
        else:
            out["checks"] = _collectives(torch, dist, device, args.mib)
    finally:
        # Every rank done before any tears down: Gloo's pairs abort the process
        # (std::terminate) when the other side closes while they still run.
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    return out


def _collectives(torch, dist, device, mib) -> dict:
    """Collectives on ``device`` tensors against the expected values; ``{name: "ok" | error}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}

    def data(r, n, dtype=torch.float32, salt=0):
        g = torch.Generator().manual_seed(31 * r + salt + 1)
        return torch.randint(-50, 50, (n,), generator=g).to(dtype).to(device)

    def check(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported in the table
            results[name] = traceback.format_exc()

    big = mib << 18  # float32 elements: 20 MiB by default, several chunks of 4 MiB

    def all_reduce_large():
        t = data(rank, big)
        dist.all_reduce(t)
        want = sum(data(r, big) for r in range(world))
        assert torch.equal(t, want), "all_reduce of 20 MiB"

    def all_reduce_async_then_use_on_stream():
        # The result is there for kernels queued after wait() on the current stream.
        t = data(rank, big, salt=1)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        s = t * 2
        want = sum(data(r, big, salt=1) for r in range(world)) * 2
        assert torch.equal(s, want), "use after wait"
        f = dist.all_reduce(data(rank, 1000, salt=2), async_op=True).get_future()
        got = f.wait()[0]
        assert torch.equal(got, sum(data(r, 1000, salt=2) for r in range(world))), "future value"

    def in_place_all_gather_bf16():
        n = big // 2
        buf = torch.zeros(world * n, dtype=torch.bfloat16, device=device)
        buf[rank * n : (rank + 1) * n] = data(rank, n, torch.bfloat16, salt=3)
        dist.all_gather_into_tensor(buf, buf[rank * n : (rank + 1) * n])
        want = torch.cat([data(r, n, torch.bfloat16, salt=3) for r in range(world)])
        assert torch.equal(buf, want), "in-place all_gather_into_tensor"

    def in_place_reduce_scatter():
        n = big // 2
        buf = data(rank, world * n, salt=4)
        mine = buf[rank * n : (rank + 1) * n]
        dist.reduce_scatter_tensor(mine, buf)
        want = sum(data(r, world * n, salt=4) for r in range(world))[rank * n : (rank + 1) * n]
        assert torch.equal(mine, want), "in-place reduce_scatter_tensor"

    def all_to_all_uneven():
        unit = max(1, big // 5000)
        send = [(rank + j) % 3 * unit + 1 for j in range(world)]
        recv = [(j + rank) % 3 * unit + 1 for j in range(world)]
        inp = data(rank, sum(send) * 4, salt=5).view(-1, 4)
        out = torch.empty(sum(recv), 4, device=device)
        dist.all_to_all_single(out, inp, recv, send)
        parts = []
        for j in range(world):
            sj = [(j + k) % 3 * unit + 1 for k in range(world)]
            src = data(j, sum(sj) * 4, salt=5).view(-1, 4)
            parts.append(src[sum(sj[:rank]) : sum(sj[:rank]) + sj[rank]])
        assert torch.equal(out, torch.cat(parts)), "uneven all_to_all_single"

    def gather_scatter_p2p():
        outs = [torch.empty(5000, device=device) for _ in range(world)] if rank == 0 else None
        dist.gather(data(rank, 5000, salt=6), outs, dst=0)
        if rank == 0:
            assert all(torch.equal(outs[r], data(r, 5000, salt=6)) for r in range(world)), "gather"
        o = torch.empty(5000, device=device)
        dist.scatter(o, [data(0, 5000, salt=7 + r) for r in range(world)] if rank == 0 else None, src=0)
        assert torch.equal(o, data(0, 5000, salt=7 + rank)), "scatter"
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(big, device=device)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, big, salt=8), nxt), dist.P2POp(dist.irecv, got, prv)]):
            w.wait()
        assert torch.equal(got, data(prv, big, salt=8)), "batch_isend_irecv"

    def cuda_and_cpu_in_order():
        a = data(rank, big, salt=9)
        wa = dist.all_reduce(a, async_op=True)
        c = torch.full((10,), float(rank + 1))
        wc = dist.all_reduce(c, async_op=True)
        wc.wait()
        wa.wait()
        assert torch.equal(a, sum(data(r, big, salt=9) for r in range(world))), "CUDA all_reduce"
        assert torch.equal(c, torch.full((10,), float(sum(range(1, world + 1))))), "CPU all_reduce"

    for name, fn in (
        (f"all_reduce {mib} MiB", all_reduce_large),
        ("results on the stream after wait / future", all_reduce_async_then_use_on_stream),
        ("all_gather_into_tensor bf16 in place", in_place_all_gather_bf16),
        ("reduce_scatter_tensor in place", in_place_reduce_scatter),
        ("all_to_all_single uneven", all_to_all_uneven),
        ("gather, scatter, batch_isend_irecv", gather_scatter_p2p),
        ("CUDA and CPU operations in order", cuda_and_cpu_in_order),
    ):
        check(name, fn)
    return results


# --------------------------------------------------------------------------------------------
# The driver


def device_name(torch, device: str, tool: str, done: str):
    """The name of the device the runs use; ``None``, after saying that nothing was ``done``,
    when ``device`` is "cuda" and there is no CUDA GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{tool}: no CUDA GPU here (torch.cuda.is_available() is False): nothing was {done}")
        return None
    return torch.cuda.get_device_name(0) if device == "cuda" else "CPU"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(kind, backend, device, args) -> dict:
    """Runs one configuration on WORLD ranks; ``{"ok": bool, "ranks": [...], "error": str}``."""
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="gpu-check-")
    procs = []
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), GRADSYNC_TOKEN=secrets.token_hex(16))
    env.setdefault("GRADSYNC_TIMEOUT", "120")
    for rank in range(WORLD):
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
        out = os.path.join(tmp, f"rank{rank}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--kind", kind, "--backend", backend]
        cmd += ["--device", device, "--steps", str(args.steps), "--width", str(args.width), "--mib", str(args.mib)]
        cmd += ["--out", out]
        procs.append((subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    deadline = time.monotonic() + args.timeout
    logs, failed = [], False
    for p, _ in procs:
        try:
            log, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            log, _ = p.communicate()
            log += f"\n(killed after {args.timeout} s)"
            failed = True
        failed = failed or p.returncode != 0
        logs.append(log)
    if failed:
        return {"ok": False, "error": "\n".join(f"--- rank {r}\n{log[-3000:]}" for r, log in enumerate(logs))}
    ranks = []
    for _, out in procs:
        with open(out) as f:
            ranks.append(json.load(f))
    return {"ok": True, "ranks": ranks}


def _one_process(args) -> dict:
    """The training of every rank in this process, on one device: each step, each rank's loss
    and gradient on its batch, the gradients averaged, one AdamW step (what DDP and FSDP2 compute,
    the average of 2 being exact in floating point); its ``ranks`` hold the losses as the runs'
    do."""
    import torch

    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        model = _model(torch, args.width).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = [_batches(torch, r, args.steps, device) for r in range(WORLD)]
        losses = [[] for _ in range(WORLD)]
        params = list(model.parameters())
        for step in range(args.steps):
            total = [torch.zeros_like(p) for p in params]
            for r in range(WORLD):
                x, y = data[r][step]
                loss = torch.nn.functional.mse_loss(model(x), y)
                for t, g in zip(total, torch.autograd.grad(loss, params)):
                    t.add_(g)
                losses[r].append(loss.item())
            for p, t in zip(params, total):
                p.grad = t / WORLD
            opt.step()
            opt.zero_grad()
        return {"ok": True, "ranks": [{"rank": r, "losses": losses[r]} for r in range(WORLD)]}
    except Exception:  # noqa: BLE001 - reported in the table
        return {"ok": False, "error": traceback.format_exc()}


def _loss_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for ra, rb in zip(a["ranks"], b["ranks"]):
        assert len(ra["losses"]) == len(rb["losses"])
        for x, y in zip(ra["losses"], rb["losses"]):
            worst = max(worst, abs(x - y) / max(1.0, abs(y)))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--width", type=int, default=1031)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--mib", type=int, default=20, help="size of the large collectives' tensors")
    ap.add_argument("--timeout", type=int, default=600, help="seconds for each run of 2 ranks")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = _worker(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0

    import torch

    where = device_name(torch, args.device, "gpu-check", "checked")
    if where is None:
        return NO_GPU
    import gradsync.distributed as gd

    print(f"gpu-check: torch {torch.__version__}, {where}, {WORLD} ranks, {args.steps} steps, tolerance {TOL:g}")
    print(f"gpu-check: the gradsync backend is a c10d {gd._BASE.__name__} written in Python")
    rows, report = [], {}
    ref_one = _one_process(args)
    for kind in ("ddp", "fsdp2"):
        mine = _run(kind, "gradsync", args.device, args)
        ref = _run(kind, "gloo", args.device, args)
        ref_name = f"gloo {args.device}"
        if not ref["ok"]:
            # The reference is not what is checked: a Gloo run that crashed gets one more try,
            # and the table says so.
            print(f"--- {kind} on {ref_name} failed, tried once more:\n{ref['error']}")
            ref, ref_name = _run(kind, "gloo", args.device, args), f"gloo {args.device} (2nd try)"
        if not ref["ok"] and args.device == "cuda":
            # Gloo lacks some collectives on CUDA tensors; then the Gloo run is on CPU tensors.
            why = ref["error"].strip().splitlines()[-1][:80]
            ref, ref_name = _run(kind, "gloo", "cpu", args), f"gloo cpu (gloo cuda failed: {why})"
        for against, run in ((ref_name, ref), (f"one process ({args.device})", ref_one)):
            if mine["ok"] and run["ok"]:
                diff = _loss_diff(mine, run)
                rows.append((kind, f"gradsync {args.device}", against, f"{diff:.2e}", "PASS" if diff <= TOL else "FAIL"))
            else:
                rows.append((kind, f"gradsync {args.device}", against, "-", "FAIL"))
        for what, run in (("gradsync", mine), (ref_name, ref)):
            if not run["ok"]:
                print(f"--- {kind} on {what} failed:\n{run['error']}")
        report[kind] = {"gradsync": mine, "gloo": ref, "gloo_name": ref_name}
    report["one_process"] = ref_one
    coll = _run("collectives", "gradsync", args.device, args)
    if coll["ok"]:
        for name in coll["ranks"][0]["checks"]:
            errors = [r["checks"][name] for r in coll["ranks"] if r["checks"][name] != "ok"]
            rows.append((name, f"gradsync {args.device}", "expected values", "-", "FAIL" if errors else "PASS"))
            for e in errors:
                print(f"--- {name}:\n{e}")
    else:
        rows.append(("collectives", f"gradsync {args.device}", "expected values", "-", "FAIL"))
        print(f"--- collectives failed:\n{coll['error']}")
    report["collectives"] = coll
    head = ("check", "run", "against", "max loss diff", "result")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    print()
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    failed = [r for r in rows if r[-1] != "PASS"]
    print(f"\ngpu-check: {'FAIL' if failed else 'PASS'} ({len(rows) - len(failed)} of {len(rows)} passed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "report": report}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
