"""torch.distributed.all_reduce on gradsync vs Gloo, in the same run.

    python examples/bench_torch_allreduce.py                  # starts 2 local processes itself
    torchrun --nproc-per-node 2 examples/bench_torch_allreduce.py

Both groups live in one job: the default group is Gloo and a second group over the same ranks
runs on gradsync. Each round times ``--iters`` all-reduces of one float32 tensor (``--size-mb``,
default 64 MiB) on each backend in turn (the order alternates from round to round), after a
warm-up all-reduce and a barrier; a round's time is the slowest rank's mean. Printed per backend:
the median over ``--rounds`` of the time per all-reduce, the algorithm bandwidth
(bytes / time) and the bus bandwidth, busbw = 2(n-1)/n x bytes / time (the nccl-tests
convention), then the ratio of the median busbws gradsync / gloo.

What is checked (``#wrong`` counts wrong elements, summed over rounds and ranks): in every round
and on every backend, the warm-up all-reduce's result (rank ``r`` contributes ``r + 1`` in every
element, so each must be ``n(n+1)/2``), and the result of the last timed all-reduce. The timed
all-reduces run in place on a tensor that starts as ones, so each multiplies it by the world size
``n`` and the last must leave ``n ** iters`` in every element; a wrong element in an earlier timed
all-reduce carries into it. The value is exact in float32 in any summation order when
``n ** iters`` and its partial sums are (for instance 2 ranks and up to 127 iterations, 3 ranks
and up to 15); otherwise the timed results are not checked, and the output says so.
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(nproc: int, argv: list) -> int:
    """Runs this script as ``nproc`` ranks with the torchrun environment; returns the worst exit
    status."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv, env=env))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=600))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return 124
    return max(codes, key=abs)


def exact_in_float32(v: int) -> bool:
    """Whether the integer ``v`` is exactly a float32."""
    if v == 0:
        return True
    odd = v // (v & -v)
    return odd < (1 << 24) and v < (1 << 128)


def timed_result_is_exact(world: int, iters: int) -> bool:
    """Whether ``iters`` in-place sums over ``world`` ranks of a tensor of ones are exact in any
    order: every partial sum ``m * world ** (k - 1)`` (``m <= world``, ``k <= iters``) is a
    float32."""
    return all(exact_in_float32(m * world ** (k - 1)) for k in range(1, iters + 1) for m in range(1, world + 1))


def bench(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import gradsync.distributed  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.new_group(backend="gloo"), "gradsync": dist.new_group(backend="gradsync")}
    count = int(args.size_mb * (1 << 20)) // 4
    nbytes = count * 4
    buf = torch.empty(count, dtype=torch.float32)
    times = {name: [] for name in groups}
    wrong = {name: 0 for name in groups}
    slowest = torch.empty(1, dtype=torch.float64)
    check_timed = timed_result_is_exact(world, args.iters)
    expected = float(world**args.iters)

    for rnd in range(args.rounds):
        order = list(groups) if rnd % 2 == 0 else list(reversed(groups))
        for name in order:
            g = groups[name]
            buf.fill_(rank + 1)
            dist.all_reduce(buf, group=g)  # warm-up, and a check of the result
            wrong[name] += int((buf != world * (world + 1) / 2).sum())
            buf.fill_(1.0)  # each timed all-reduce multiplies it by the world size, exactly
            dist.barrier(group=g)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(buf, group=g)
            dt = (time.perf_counter() - t0) / args.iters
            if check_timed:  # the last timed all-reduce's result
                wrong[name] += int((buf != expected).sum())
            slowest.fill_(dt)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # on the default (Gloo) group
            times[name].append(slowest.item())

    # every rank's wrong elements, summed on the default (Gloo) group
    counts = torch.tensor([wrong[name] for name in groups], dtype=torch.int64)
    dist.all_reduce(counts)
    wrong = dict(zip(groups, counts.tolist()))

    if rank == 0:
        factor = 2 * (world - 1) / world
        print(
            f"all_reduce of {nbytes} bytes ({count} float32), {world} ranks, "
            f"{args.rounds} rounds x {args.iters} iterations, median of rounds"
        )
        print(f"{'backend':>10} {'time(ms)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}")
        busbw = {}
        for name in ("gradsync", "gloo"):
            t = statistics.median(times[name])
            busbw[name] = factor * nbytes / t / 1e9
            print(
                f"{name:>10} {t * 1e3:>10.2f} {nbytes / t / 1e9:>12.2f} {busbw[name]:>12.2f} {wrong[name]:>7}"
            )
        print(f"busbw ratio gradsync/gloo: {busbw['gradsync'] / busbw['gloo']:.2f}x")
        if not check_timed:
            print(f"timed results not checked: {world} ** {args.iters} is not exact in float32 (only the warm-ups are)")
        if args.verbose:
            for name in ("gradsync", "gloo"):
                print(name, " ".join(f"{t * 1e3:.2f}" for t in times[name]), "ms per round")
    for g in groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    if any(wrong.values()):
        raise SystemExit("wrong results")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=64.0, help="tensor size in MiB (default 64)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=5, help="all-reduces timed per round and backend")
    p.add_argument("--nproc", type=int, default=2, help="processes to start when not launched (default 2)")
    p.add_argument("--verbose", action="store_true", help="also print every round's time")
    args = p.parse_args()
    if "RANK" not in os.environ:
        return spawn(args.nproc, sys.argv[1:])
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
