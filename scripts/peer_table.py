#!/usr/bin/env python3
"""All-gather, reduce-scatter and all-to-all of gradsync against Open MPI, as one markdown table.

For every collective x size x ranks x transport, gradsync (`gradsync bench --nproc N <coll>`,
GRADSYNC_TRANSPORT=shm|tcp) and Open MPI (`../shared/peers/mpi_coll.c`: `btl vader,self` with
CMA single copy for shared memory, `btl tcp,self` over loopback for TCP) run in turns, in
`--reps` repetitions whose order alternates (gradsync first in odd repetitions, Open MPI first
in even ones), so both see the same machine load. The table gives the median busbw of each
and their ratio. Both use nccl-tests' conventions: size is the larger buffer of one rank,
busbw = algbw x (n-1)/n, float (sum), and every result is checked.

Needs: openmpi-bin libopenmpi-dev (apt), and `cargo build --release -p gradsync-cli`.

    python3 scripts/peer_table.py                       # the full table, 5 repetitions
    python3 scripts/peer_table.py --colls all_gather --sizes 64M --nproc 2 --transports shm
    GRADSYNC_SHM_DIRECT_MIN=1M python3 scripts/peer_table.py ...   # env passes to gradsync
"""
import argparse
import json
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
# gradsync bench's collective name -> mpi_coll.c's -o
MPI_NAME = {"all_gather": "allgather", "reduce_scatter": "reducescatter",
            "all_to_all": "alltoall", "all_reduce": "allreduce"}


def size_arg(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def human(b):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def run(cmd, timeout, env=None):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s: {' '.join(cmd)}"
    if p.returncode != 0:
        return None, f"exit {p.returncode}: {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p.stdout, None


def gradsync(binary, coll, n, size, transport, iters, work):
    """busbw (GB/s) of one out-of-place row of `gradsync bench`, or an error."""
    js = os.path.join(work, "bench.json")
    env = dict(os.environ, GRADSYNC_TRANSPORT=transport)
    # Large rows: few iterations (each ~10-100 ms); small ones enough to time ~0.1-0.5 s.
    warm = max(3, iters // 10)
    out, err = run([binary, "bench", "--nproc", str(n), coll, "-b", str(size), "-e", str(size),
                    "-n", str(iters), "-w", str(warm), "-c", "1", "--json", js], 600, env)
    if err:
        return None, err
    with open(js) as f:
        rows = json.load(f)
    row = next((r for r in rows if r["size"] == size), None)
    m = row and (row.get("out_of_place") or row.get("in_place"))
    if not m:
        return None, f"no {size}-byte row in gradsync's output:\n{out}"
    if m.get("wrong") not in (0, None):
        return None, f"gradsync reported {m['wrong']} wrong elements"
    return m["busbw"], None


def ompi(binary, coll, n, size, transport, budget):
    """busbw (GB/s) of mpi_coll.c's row of `size` bytes, or an error."""
    btl = "vader,self" if transport == "shm" else "tcp,self"
    cmd = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe",
           "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo",
           "--mca", "pml", "ob1", "--mca", "btl", btl,
           "-np", str(n), binary, "-o", MPI_NAME[coll], "-b", str(size), "-e", str(size),
           "-t", str(budget)]
    out, err = run(cmd, 600)
    if err:
        return None, err
    for line in out.splitlines():
        f = line.split()
        if line.startswith("#") or len(f) < 7:
            continue
        if int(float(f[0])) == size // 4 // n * n * 4:
            if f[6] != "ok":
                return None, f"Open MPI's result check failed:\n{out}"
            return float(f[5]), None
    return None, f"no {size}-byte row in Open MPI's output:\n{out}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--colls", default="all_gather,reduce_scatter,all_to_all")
    ap.add_argument("--sizes", default="1M,64M")
    ap.add_argument("--nproc", default="2,4")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--budget", type=float, default=0.5, help="Open MPI's seconds of timed work per row")
    ap.add_argument("--gradsync", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "gradsync"))
    args = ap.parse_args()
    colls = args.colls.split(",")
    sizes = [size_arg(s) for s in args.sizes.split(",")]
    nprocs = [int(n) for n in args.nproc.split(",")]
    transports = args.transports.split(",")
    if not os.path.exists(args.gradsync):
        sys.exit(f"{args.gradsync} not found: run `cargo build --release -p gradsync-cli` first")
    if shutil.which("mpicc.openmpi") is None:
        sys.exit("Open MPI is not installed: apt-get install openmpi-bin libopenmpi-dev")
    work = tempfile.mkdtemp(prefix="gradsync-peer-table-")
    mpi_bin = os.path.join(work, "mpi_coll.openmpi")
    if subprocess.run(["mpicc.openmpi", "-O2", "-o", mpi_bin, os.path.join(PEERS, "mpi_coll.c")]).returncode:
        sys.exit("cannot build ../shared/peers/mpi_coll.c")

    cases = [(c, s, n, t) for c in colls for n in nprocs for t in transports for s in sizes]
    loads = []
    res = {k: {"gradsync": [], "ompi": []} for k in cases}
    failed = False
    for rep in range(args.reps):
        load = open("/proc/loadavg").read().split()[:3]
        loads.append(float(load[0]))
        print(f"# rep {rep + 1}/{args.reps} loadavg {' '.join(load)}", file=sys.stderr, flush=True)
        for case in cases:
            coll, size, n, transport = case
            order = ("gradsync", "ompi") if rep % 2 == 0 else ("ompi", "gradsync")
            for who in order:
                # One more try after a failure: Open MPI's TCP runs of 4 ranks now and then
                # crash in MPI_Finalize after their results are out.
                for _ in range(2):
                    if who == "gradsync":
                        iters = 20 if size >= 16 << 20 else 400
                        bw, err = gradsync(args.gradsync, coll, n, size, transport, iters, work)
                    else:
                        bw, err = ompi(mpi_bin, coll, n, size, transport, args.budget)
                    if not err:
                        break
                    print(f"# {who} {coll} {human(size)} {n} ranks {transport}: {err}", file=sys.stderr)
                if err:
                    failed = True
                    continue
                res[case][who].append(bw)
                print(f"  {coll:14s} {human(size):>7s} {n} ranks {transport:3s} {who:8s} busbw {bw:7.2f} GB/s",
                      file=sys.stderr, flush=True)

    print(f"{args.reps} alternating runs each, medians; load average {min(loads):.1f}-{max(loads):.1f} "
          f"at the start of the repetitions ({os.cpu_count()} CPUs)\n")
    print(f"| collective | size | ranks | transport | gradsync busbw GB/s | Open MPI busbw GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        coll, size, n, transport = case
        g, o = res[case]["gradsync"], res[case]["ompi"]
        if not g or not o:
            continue
        gm, om = statistics.median(g), statistics.median(o)
        tname = "shared memory" if transport == "shm" else "TCP"
        print(f"| {coll} | {human(size)} | {n} | {tname} | {gm:.2f} | {om:.2f} | x{gm / om:.2f} |")
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
