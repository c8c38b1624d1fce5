#!/usr/bin/env python3
"""What one rank costs at 16 to 256 ranks on this machine: resident memory, open sockets, init time.

For every world size and transport, `gradsync bench --nproc N all_reduce` (8-byte all-reduces, so
that the job's own buffers cost nothing) runs with `GRADSYNC_DEBUG=INFO`; while it runs, every
rank process is sampled every 0.2 s: its resident memory (`VmRSS` of `/proc/PID/status`, the
largest sample) and its open sockets (links to `socket:` in `/proc/PID/fd`, the median sample:
the count while the job runs its all-reduces). The table gives, per row, the median over the ranks, the
largest over the ranks, and the slowest rank's init
time from its INFO line (setup of connections and inboxes; the first barrier and the cost model
follow it). Ranks are processes of one host: with `GRADSYNC_TRANSPORT=tcp` every pair goes
through loopback TCP, as every pair of a multi-host job does; `auto` uses shared memory.

    python3 scripts/rank_cost.py                                  # 16,32,64,128,256 x tcp,auto
    python3 scripts/rank_cost.py --worlds 16,32 --transports tcp --gradsync /tmp/old/gradsync
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sample(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        socks = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    socks += 1
            except OSError:
                pass
        return rss, socks
    except (OSError, StopIteration):
        return None


def children(pid):
    """Every descendant of `pid`."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


def one(binary, world, transport, iters, timeout):
    env = dict(os.environ, GRADSYNC_DEBUG="INFO", GRADSYNC_TRANSPORT=transport)
    log = tempfile.TemporaryFile(mode="w+")
    p = subprocess.Popen([binary, "bench", "--nproc", str(world), "all_reduce", "-b", "8", "-e", "8",
                          "-n", str(iters), "-w", "5"], stdout=log, stderr=subprocess.STDOUT, env=env)
    peak = {}
    t0 = time.time()
    while p.poll() is None:
        if time.time() - t0 > timeout:
            # The ranks too, not only the launcher: orphans would spin on and load the next run.
            for c in children(p.pid):
                try:
                    os.kill(c, 9)
                except OSError:
                    pass
            p.kill()
            p.wait()
            return None, f"timed out after {timeout}s"
        for c in children(p.pid):
            s = sample(c)
            if s is None:
                continue
            # Resident memory: the largest sample; sockets: every sample, of which the median
            # is the count while the job runs (init briefly adds the store's connection,
            # teardown closes them).
            r, ks = peak.get(c, (0, []))
            peak[c] = (max(r, s[0]), ks + [s[1]])
        time.sleep(0.2)
    log.seek(0)
    text = log.read()
    if p.returncode != 0:
        return None, f"exit {p.returncode}: {text[-1500:]}"
    inits = [float(m) for m in re.findall(r"\(init ([0-9.]+) ms\)", text)]
    # The ranks: the processes that opened sockets (the launcher holds none).
    ranks = [(r, statistics.median(ks)) for r, ks in peak.values() if max(ks) > 0]
    if len(ranks) < world or len(inits) < world:
        return None, f"saw {len(ranks)} rank processes and {len(inits)} init lines of {world}"
    rss = sorted(r for r, _ in ranks)[-world:]
    socks = sorted(k for _, k in ranks)[-world:]
    return {
        "rss_med": statistics.median(rss) / 1024, "rss_max": max(rss) / 1024,
        "socks_med": statistics.median(socks), "socks_max": max(socks),
        "init_max_ms": max(inits),
    }, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="16,32,64,128,256")
    ap.add_argument("--transports", default="tcp,auto")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--label", default="", help="a column naming the binary (before/after)")
    ap.add_argument("--gradsync", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "gradsync"))
    args = ap.parse_args()
    if not os.path.exists(args.gradsync):
        sys.exit(f"{args.gradsync} not found: run `cargo build --release -p gradsync-cli` first")
    print("| binary | ranks | transport | resident MiB per rank (median / max) | sockets per rank (median / max) | init ms (slowest rank) |")
    print("|---|---|---|---|---|---|")
    failed = False
    for w in [int(x) for x in args.worlds.split(",")]:
        for t in args.transports.split(","):
            r, err = one(args.gradsync, w, t, args.iters, args.timeout)
            if err:
                failed = True
                print(f"| {args.label} | {w} | {t} | failed: {err.splitlines()[0][:120]} | | |")
                print(err, file=sys.stderr)
                continue
            print(f"| {args.label} | {w} | {t} | {r['rss_med']:.1f} / {r['rss_max']:.1f} | "
                  f"{r['socks_med']:.0f} / {r['socks_max']:.0f} | {r['init_max_ms']:.0f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
