#!/usr/bin/env python3
"""Is a failed rank named by every survivor, and how fast? A check of a whole job, by processes.

`gradsync bench --nproc N all_reduce` runs 1 MiB all-reduces in a loop; once every rank is
running, one rank is killed (`SIGKILL`) or stopped (`SIGSTOP`). Each survivor must then fail
with an error that names the victim (`rank V`), and exit; the script reports how many did, and
when the last one exited after the signal. With `--connect all` every pair connects at init
(`GRADSYNC_RUNTIME_CONNECT=0`); by default pairs connect on first use, so most survivors have
no connection to the victim and learn of it from the ranks that do.

    python3 scripts/failure_check.py --nproc 64 --signal kill
    GRADSYNC_TIMEOUT=2 python3 scripts/failure_check.py --nproc 64 --signal stop
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_cost import children  # noqa: E402  (every descendant of a pid)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=64)
    ap.add_argument("--signal", choices=["kill", "stop"], default="kill")
    ap.add_argument("--victim", type=int, default=None, help="rank to fail (default: nproc/2 + 3)")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--connect", choices=["lazy", "all"], default="lazy")
    ap.add_argument("--limit", type=float, default=60, help="seconds to wait for the survivors")
    ap.add_argument("--gradsync", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "gradsync"))
    args = ap.parse_args()
    n = args.nproc
    victim = args.victim if args.victim is not None else min(n - 1, n // 2 + 3)
    env = dict(os.environ, GRADSYNC_TRANSPORT=args.transport,
               GRADSYNC_RUNTIME_CONNECT="0" if args.connect == "all" else "1")
    log = tempfile.NamedTemporaryFile(mode="w+", prefix="failure-check-", suffix=".log", delete=False)
    p = subprocess.Popen([args.gradsync, "bench", "--nproc", str(n), "all_reduce", "-b", "1M", "-e", "1M",
                          "-n", "100000000", "-w", "0"], stdout=log, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    # Every rank running and past init: all have sockets, then a few seconds of traffic.
    ranks = {}
    t0 = time.time()
    while time.time() - t0 < 300:
        for c in children(p.pid):
            r = rank_of(c)
            if r is not None:
                ranks[r] = c
        if len(ranks) == n and "float" in open(log.name).read():
            break
        if p.poll() is not None:
            sys.exit(f"the job ended before the failure: see {log.name}")
        time.sleep(0.5)
    else:
        os.killpg(p.pid, signal.SIGKILL)
        sys.exit(f"the job did not start within 300 s: see {log.name}")
    time.sleep(3)
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGSTOP
    t_sig = time.time()
    os.kill(ranks[victim], sig)
    exited = {}
    while time.time() - t_sig < args.limit and len(exited) < n - 1:
        for r, pid in ranks.items():
            if r == victim or r in exited:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "gone"
            if state in ("Z", "X", "gone"):
                exited[r] = time.time() - t_sig
        time.sleep(0.05)
    if args.signal == "stop":
        os.kill(ranks[victim], signal.SIGKILL)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    text = open(log.name).read()
    # Each survivor's error line: `gradsync: error: <operation>: rank R: <cause>`; it names the
    # victim when `rank V` appears in the cause.
    reporters = set()
    for line in text.splitlines():
        if "error:" not in line:
            continue
        m = re.search(r"\brank (\d+): (.*)", line)
        if m and re.search(rf"\brank {victim}\b", m.group(2)):
            reporters.add(int(m.group(1)))
    named = len(reporters - {victim})
    last = max(exited.values()) if exited else float("nan")
    print(f"{n} ranks, {args.transport}, connections {args.connect}, SIG{args.signal.upper()} of rank {victim}: "
          f"{len(exited)} of {n - 1} survivors exited within {args.limit:.0f} s, the last after {last:.2f} s; "
          f"{named} named rank {victim} (log: {log.name})")
    return 0 if named == n - 1 and len(exited) == n - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
