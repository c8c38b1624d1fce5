"""Data-parallel training of a small MLP with torch's DistributedDataParallel, on gradsync or Gloo.

    torchrun --nproc-per-node 4 examples/ddp_train.py --backend gradsync
    torchrun --nproc-per-node 4 examples/ddp_train.py --backend gloo
    torchrun --nproc-per-node 4 examples/ddp_train.py --hook      # Gloo group, gradsync gradients
    gradsync launch --nproc 4 -- python examples/ddp_train.py --backend gradsync

Everything is deterministic: the synthetic data set (a fixed random teacher network labels
Gaussian inputs) and the initial weights come from ``--seed``; step ``s`` trains on global batch
``s`` (``--batch`` samples), of which rank ``r`` of ``W`` takes the ``r``-th of ``W`` equal
shards. DDP averages the gradients, so every world size follows the same trajectory as one
process on the full batch (:func:`train_reference`), up to the order of floating-point sums.

Rank 0 prints one line per step, ``step <n> loss <global mean loss>``, and finally
``params <sum of all parameters>``. ``--out FILE`` writes the run as JSON (``losses``, ``params``
flattened, the settings, and DDP's gradient buckets ``buckets``): rank 0 to ``FILE``, every other
rank ``r`` to ``FILE`` with ``.rank<r>`` before its suffix (:func:`rank_out`), so that every rank's
final parameters can be compared. ``--bucket-cap-mb`` sets DDP's bucket size (default 25 MiB, one
bucket for this model); a tiny one (0.0001) splits the gradients into several buckets, several
all-reduces in flight at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 16
HIDDEN = 32
CLASSES = 4
SAMPLES = 1024


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``SAMPLES`` Gaussian inputs labelled by a fixed random teacher network."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(SAMPLES, IN_FEATURES, generator=g)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(SAMPLES, CLASSES, generator=g)).argmax(dim=1)
    return x, y


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES),
    )


def global_batch(x: torch.Tensor, y: torch.Tensor, step: int, batch: int):
    """The samples of global batch ``step`` (wrapping around the data set)."""
    idx = (torch.arange(batch) + step * batch) % SAMPLES
    return x[idx], y[idx]


def flat_params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def rank_out(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its run for ``--out path``: ``path`` itself for rank 0, else
    ``path`` with ``.rank<rank>`` before its suffix (``run.json`` -> ``run.rank1.json``)."""
    if rank == 0:
        return str(path)
    root, ext = os.path.splitext(str(path))
    return f"{root}.rank{rank}{ext}"


def ddp_buckets(model) -> list[int]:
    """The sizes in bytes of DDP's gradient buckets (as rebuilt after the first step), or
    ``[]`` when this torch does not report them."""
    try:
        data = model._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - a private API
        return []
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).replace(" ", "").split(",") if s]


def train_reference(steps: int, seed: int, batch: int, lr: float) -> dict:
    """One process, full batches: the trajectory every data-parallel run must follow."""
    x, y = make_data(seed)
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        xb, yb = global_batch(x, y, step, batch)
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": flat_params(model)}


def train_ddp(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    backend = "gloo" if args.hook else args.backend
    if backend == "gradsync":
        import gradsync.distributed  # noqa: F401  (registers the backend)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not a multiple of the world size {world}")
    shard = args.batch // world

    x, y = make_data(args.seed)
    buckets_kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = DDP(make_model(args.seed), **buckets_kw)
    state = None
    if args.hook:
        import gradsync.distributed as gd

        state = gd.make_hook_state()
        model.register_comm_hook(state, gd.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        xb, yb = global_batch(x, y, step, args.batch)
        xb, yb = xb[rank * shard : (rank + 1) * shard], yb[rank * shard : (rank + 1) * shard]
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        # The global batch's mean loss: the mean of the equal shards' means.
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        mean = total.item() / world
        losses.append(mean)
        if rank == 0:
            print(f"step {step} loss {mean:.9f}", flush=True)
    elapsed = time.perf_counter() - t0

    params = flat_params(model.module)
    buckets = ddp_buckets(model)
    if rank == 0:
        print(f"params {sum(params):.9f}", flush=True)
        print(f"time {args.steps} steps in {elapsed:.3f} s on {world} ranks ({backend}{' + gradsync hook' if args.hook else ''}, {len(buckets) or '?'} gradient buckets)", flush=True)
    if state is not None:
        state.close()
    # Every rank done before any tears down: Gloo aborts a process (std::terminate) whose
    # connections the other side closes while they still run.
    dist.barrier()
    dist.destroy_process_group()
    return {"losses": losses, "params": params, "world_size": world, "rank": rank, "buckets": buckets}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["gradsync", "gloo"], default="gradsync")
    p.add_argument("--hook", action="store_true", help="Gloo process group, gradients all-reduced by gradsync's DDP hook")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="global batch size (a multiple of the world size)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's gradient bucket size in MiB (default: DDP's, 25; 0.0001 gives five buckets)",
    )
    p.add_argument("--reference", action="store_true", help="train in this one process on full batches, without torch.distributed")
    p.add_argument(
        "--out",
        help="write the run (losses, parameters) as JSON to this file (rank 0) and to rank_out(FILE, r) (rank r)",
    )
    args = p.parse_args(argv)

    # Several ranks share the cores: one intra-op thread each.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.reference:
        run = train_reference(args.steps, args.seed, args.batch, args.lr)
        for step, loss in enumerate(run["losses"]):
            print(f"step {step} loss {loss:.9f}")
        print(f"params {sum(run['params']):.9f}")
        run.update(world_size=1, rank=0)
        backend = "reference"
    else:
        run = train_ddp(args)
        backend = args.backend if not args.hook else "gloo+hook"
    if args.out:
        run.update(
            backend=backend,
            steps=args.steps,
            seed=args.seed,
            batch=args.batch,
            lr=args.lr,
            bucket_cap_mb=args.bucket_cap_mb,
        )
        with open(rank_out(args.out, run["rank"]), "w") as f:
            json.dump(run, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
