#!/usr/bin/env python3
"""Side-by-side all-reduce comparison of gradsync with Open MPI and Gloo on this machine.

Runs, alternating in every repetition so that all of them see the same machine load:
  gradsync      `gradsync bench --nproc N` over TCP loopback (GRADSYNC_TRANSPORT=tcp), float sum
  gradsync-shm  the same over shared memory (GRADSYNC_TRANSPORT=shm)
  ompi-tcp      Open MPI 4, `--mca btl tcp,self` over loopback  (../shared/peers/mpi_allreduce.c)
  ompi-shm      Open MPI 4, default selection (pml ob1, btl vader: shared memory, CMA single copy)
  gloo          torch.distributed backend gloo over loopback      (../shared/peers/gloo_allreduce.py)
and reports the median (and best) over repetitions of the 8-byte time and the busbw at
--size, with ratios of gradsync to each peer.

Needs: openmpi-bin libopenmpi-dev (apt), torch in the venv of ../shared/peers/run-all.sh
(/opt/peers-venv, or PEERS_VENV). Peers that are not installed are skipped and said so.

    python3 scripts/compare_peers.py --reps 5 --nproc 2 --size 64M
    python3 scripts/compare_peers.py --reps 5 --only gradsync-shm,gradsync,ompi-shm
    GRADSYNC_NSOCKS=1 python3 scripts/compare_peers.py --only gradsync   # env passes through
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS = os.path.join(ROOT, "..", "shared", "peers")


def us(t):
    """A time in microseconds, with two decimals below 10 us (sub-microsecond latencies)."""
    return f"{t:.2f}" if t < 10 else f"{t:.1f}"


def size_arg(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def run(cmd, timeout, env=None):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s: {' '.join(cmd)}"
    if p.returncode != 0:
        return None, f"exit {p.returncode}: {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p.stdout, None


def gradsync(binary, n, size, iters, transport="tcp"):
    rows = {}
    env = dict(os.environ, GRADSYNC_TRANSPORT=transport)
    # The peers' harnesses warm up, then time each size for --budget seconds (about a million
    # 8-byte calls); the 8-byte row here gets 1000 warm-up calls and 20000 timed ones.
    for b, e, it, warm in ((8, 8, 20000, 1000), (size, size, iters, 3)):
        out, err = run([binary, "bench", "--nproc", str(n), "-b", str(b), "-e", str(e),
                        "-n", str(it), "-w", str(warm), "-c", "1"], 300, env)
        if err:
            return None, err
        for line in out.splitlines():
            f = line.split()
            if line.startswith("#") or len(f) < 13:
                continue
            # out-of-place: time f[5] (us), busbw f[7]; in-place: f[9], f[11]
            rows[int(f[0])] = (float(f[5]), float(f[7]), f[8], float(f[9]), float(f[11]), f[12])
    if 8 not in rows or size not in rows:
        return None, "missing rows in gradsync output"
    wrong = [rows[k][2] for k in rows] + [rows[k][5] for k in rows]
    if any(w not in ("0",) for w in wrong):
        return None, f"gradsync reported wrong values: {wrong}"
    # nccl-tests reports both; the peers' numbers are out-of-place (MPI) and in-place (Gloo).
    return {"lat_us": rows[8][0], "busbw": rows[size][1], "busbw_inplace": rows[size][4]}, None


def peer_rows(out):
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if line.startswith("#") or len(f) < 7:
            continue
        rows[int(f[0])] = (float(f[3]), float(f[5]), f[6])
    return rows


def ompi(binary, n, size, budget, btl="tcp"):
    # btl None: Open MPI's default selection (shared memory between local ranks), as
    # ../shared/peers/run-all.sh runs ompi-shm.
    transport = ["--mca", "pml", "ob1", "--mca", "btl", f"{btl},self"] if btl else []
    cmd = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo",
           "--mca", "btl_tcp_if_include", "lo", *transport,
           "-np", str(n), binary, "-b", str(size), "-e", str(size), "-t", str(budget)]
    out, err = run(cmd, 300)
    if err:
        return None, err
    rows = peer_rows(out)
    if 8 not in rows or size not in rows or any(r[2] != "ok" for r in rows.values()):
        return None, f"unexpected Open MPI output:\n{out}"
    return {"lat_us": rows[8][0], "busbw": rows[size][1]}, None


def gloo(python, script, n, size, budget, port):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    out, err = run([python, script, "-n", str(n), "-t", str(budget), "-e", str(size), "-p", str(port)], 600, env)
    if err:
        return None, err
    rows = peer_rows(out)
    if 8 not in rows or size not in rows or any(r[2] != "ok" for r in rows.values()):
        return None, f"unexpected Gloo output:\n{out}"
    return {"lat_us": rows[8][0], "busbw": rows[size][1]}, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--size", type=size_arg, default=64 << 20)
    ap.add_argument("--iters", type=int, default=10, help="gradsync timed iterations at --size")
    ap.add_argument("--budget", type=float, default=0.5, help="peers' seconds of timed work per size")
    ap.add_argument("--only", default="gradsync,ompi-tcp,gloo")
    ap.add_argument("--gradsync", default=os.path.join(ROOT, "target", "release", "gradsync"))
    args = ap.parse_args()
    only = args.only.split(",")

    work = tempfile.mkdtemp(prefix="gradsync-peers-")
    have = {"gradsync": os.path.exists(args.gradsync)}
    have["gradsync-shm"] = have["gradsync"]
    if not have["gradsync"]:
        sys.exit(f"{args.gradsync} not found: run `cargo build --release -p gradsync-cli` first")
    mpi_bin = os.path.join(work, "mpi_allreduce.openmpi")
    have["ompi-tcp"] = "ompi-tcp" in only and shutil.which("mpicc.openmpi") is not None and subprocess.run(
        ["mpicc.openmpi", "-O2", "-o", mpi_bin, os.path.join(PEERS, "mpi_allreduce.c")]).returncode == 0
    venv_py = os.path.join(os.environ.get("PEERS_VENV", "/opt/peers-venv"), "bin", "python")
    have["gloo"] = "gloo" in only and os.path.exists(venv_py) and subprocess.run(
        [venv_py, "-c", "import torch.distributed as d; assert d.is_gloo_available()"], capture_output=True).returncode == 0
    have["ompi-shm"] = "ompi-shm" in only and (os.path.exists(mpi_bin) or (
        shutil.which("mpicc.openmpi") is not None and subprocess.run(
            ["mpicc.openmpi", "-O2", "-o", mpi_bin, os.path.join(PEERS, "mpi_allreduce.c")]).returncode == 0))
    for k in ("ompi-tcp", "ompi-shm", "gloo"):
        if k in only and not have[k]:
            print(f"# {k}: not installed, skipped (see ../shared/peers/README.md)")

    names = ("gradsync", "gradsync-shm", "ompi-tcp", "ompi-shm", "gloo")
    res = {k: [] for k in names}
    for rep in range(args.reps):
        load = open("/proc/loadavg").read().split()[:3]
        print(f"# rep {rep + 1}/{args.reps} loadavg {' '.join(load)}", flush=True)
        for name in names:
            if name not in only or not have[name]:
                continue
            if name == "gradsync":
                r, err = gradsync(args.gradsync, args.nproc, args.size, args.iters)
            elif name == "gradsync-shm":
                r, err = gradsync(args.gradsync, args.nproc, args.size, args.iters, "shm")
            elif name == "ompi-tcp":
                r, err = ompi(mpi_bin, args.nproc, args.size, args.budget)
            elif name == "ompi-shm":
                r, err = ompi(mpi_bin, args.nproc, args.size, args.budget, None)
            else:
                r, err = gloo(venv_py, os.path.join(PEERS, "gloo_allreduce.py"), args.nproc, args.size,
                              args.budget, 29700 + rep)
            if err:
                print(f"# {name}: {err}")
                continue
            res[name].append(r)
            print(f"  {name:12s} 8 B {us(r['lat_us']):>9s} us   {args.size >> 20} MiB busbw {r['busbw']:6.2f} GB/s", flush=True)

    def med(name, key):
        v = [r[key] for r in res[name] if key in r]
        return (statistics.median(v), min(v) if key == "lat_us" else max(v)) if v else (None, None)

    print()
    print(f"| {args.nproc} ranks, float sum | 8 B latency us, median (best) | busbw {args.size >> 20} MiB GB/s, median (best) | reps |")
    print("|---|---|---|---|")
    for name in names:
        if not res[name]:
            continue
        (lm, lb), (bm, bb) = med(name, "lat_us"), med(name, "busbw")
        print(f"| {name} | {us(lm)} ({us(lb)}) | {bm:.2f} ({bb:.2f}) | {len(res[name])} |")
    print()
    for ours, peers in (("gradsync", ("ompi-tcp", "gloo")), ("gradsync-shm", ("ompi-shm", "gradsync"))):
        if not res[ours]:
            continue
        (gl, _), (gb, _) = med(ours, "lat_us"), med(ours, "busbw")
        (gi, _) = med(ours, "busbw_inplace")
        print(f"{ours} in-place busbw median {gi:.2f} GB/s")
        for name in peers:
            if res[name]:
                (pl, _), (pb, _) = med(name, "lat_us"), med(name, "busbw")
                print(f"{ours} / {name}: busbw x{gb / pb:.2f}, 8 B latency x{gl / pl:.2f} (lower is better)")
                if name == "gloo":
                    # torch.distributed.all_reduce is in place: like with like.
                    print(f"{ours} / gloo, both in place: busbw x{gi / pb:.2f}")
                if name == "gradsync":
                    (ti, _) = med(name, "busbw_inplace")
                    print(f"{ours} / {name}, both in place: busbw x{gi / ti:.2f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
