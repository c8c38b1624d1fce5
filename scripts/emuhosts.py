#!/usr/bin/env python3
"""Emulated hosts on one Linux machine: network namespaces on a bridge, with rate-limited links.

Every emulated host is a network namespace `PFX-h<i>` whose only interface, `eth0`
(10.77.K.(10+i)/24), is one end of a veth pair; the other end is a port of a Linux bridge in the
root namespace. Ranks in different namespaces are different hosts to gradsync (its host identity
includes the network namespace), so they talk TCP through the bridge, while ranks of one
namespace share a host. With a rate, both directions of a host's link go through a token bucket
(`tc qdisc ... tbf`): the egress of `eth0` in the namespace is the host's upload, the egress of
the bridge port its download.

    python3 scripts/emuhosts.py up --name demo --hosts 4 --rate 1000 --rate-of 3=500
    python3 scripts/emuhosts.py exec --name demo --host 1 -- iperf3 -s -1 &
    python3 scripts/emuhosts.py exec --name demo --host 0 -- iperf3 -c 10.77.K.11
    python3 scripts/emuhosts.py show --name demo
    python3 scripts/emuhosts.py down --name demo          # idempotent; `down --all` for every one

    # the benchmark driver: gradsync all-reduce across emulated hosts, per algorithm
    python3 scripts/emuhosts.py measure --hosts 4 --nproc 1 --rate 1000 --size 64M \\
        --algos ring,tree --reps 3 --svg busbw.svg
    python3 scripts/emuhosts.py measure --hosts 2,3,4 --rate 1000 --algos ring,tree --svg h.svg
    # beside iperf3's goodput and the cost model's prediction, two binaries alternating
    GRADSYNC_CALIBRATE=always python3 scripts/emuhosts.py measure --hosts 4 --rate 1000 \
        --iperf 5 --predict --bins old/gradsync,new/gradsync

Names, all derived from PFX (letters, digits, `_`, `.`, `-`; at most 32 characters) with the
32-bit FNV-1a hash h of its bytes: tag T = `emu` + the low 24 bits of h in 6 hex digits, bridge
`T` + `br`, bridge port of host i `T` + `b<i>`, subnet K = h >> 24. Interface names stay within
Linux's 15 characters, and two setups with different prefixes coexist (their subnets may be
equal, which is harmless: every namespace sees only its own bridge). Every link created carries
the interface alias `emuhosts:PFX`, which `down --all` uses to find leftovers; `up` also records
its description in /run/emuhosts/PFX.json.

Token bucket: `tbf rate R burst B latency Q` on both ends, B = max(128 KiB, 1 ms at R). On
the download (the bridge port, where the traffic of several hosts meets) Q is the switch's
buffer in time at R (`--queue-ms`, default 10: 375 KB at 300 Mbit/s). On the upload it is the
host's own transmit queue (`--nic-queue-ms`, default 100), which a real NIC's queue of 1000
packets and TCP's small-queue limit keep from dropping: a packet the host's own queue drops
never left it, and when its socket had nothing else in flight Linux sends it again only on its
probe timer, the minimum retransmission timeout of 200 ms, one segment first. With a 10 ms
upload queue, a rank that starts sending to a second peer while the queue holds what it sends
to the first met that stall in some calls (a traced 1 MiB Rabenseifner all-reduce on 4 hosts
at 300 Mbit/s: every host silent for 170-250 ms, then one 1448-byte segment, its ACK 40 ms
later). The
burst stays above the 64 KiB of a GSO packet (smaller bursts make tbf split them and TCP loses
packets); a single TCP stream then gets ~956 Mbit/s of goodput through a 1000 Mbit link, the
rate minus the Ethernet, IP and TCP headers. There is no delay emulation (netem is optional in
kernels and not needed for bandwidth). TCP's congestion control is what a new network namespace
gets, the host's `net.ipv4.tcp_congestion_control`, unless `--cc NAME` sets it in every host;
`up`'s description (`tcp_cc` of each host) and `measure`'s table say which ran. A namespace may
choose only among the host's `net.ipv4.tcp_allowed_congestion_control`; for another name the
script says so, and how to allow it, before it makes any host.

`measure` runs, for every host count of `--hosts`, repetition and algorithm (algorithms alternate
within a repetition so that all see the same machine load), `gradsync launch --nnodes H
--node-rank i --nproc P --master <host 0>:PORT -- gradsync bench all_reduce -b SIZE -e SIZE ...`
in every namespace at once, with `GRADSYNC_ALGO=<algo>` (passed through as given) and one random
`GRADSYNC_TOKEN`; it reads rank 0's `--json` rows and prints a markdown table of the median bus
and algorithm bandwidth and the bus bandwidth as a share of the link rate (the slowest host's
rate). `--iperf S` also runs one iperf3 stream from host 0 to host 1 for S seconds in every
repetition and gives busbw as a share of its goodput (the most TCP gets through a link);
`--predict` runs the bench with `--explain` and gives the time the cost model predicts for each
algorithm beside the measured one (with `GRADSYNC_CALIBRATE=always` every run measures its
links instead of reading the per-host cache); `--bins A,B` alternates binaries within every
repetition (rows `ALGO@0`, `ALGO@1`). The rest of the environment passes through (`GRADSYNC_NSOCKS=4 python3 ...`). It always
tears its hosts down, also on failure and Ctrl-C.

Needs root (network namespaces), iproute2 (`ip`, and `tc` for rates); a bridge in the root
namespace is subject to the host's iptables FORWARD rules when br_netfilter is loaded.
"""
import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STATE_DIR = "/run/emuhosts"
ALIAS = "emuhosts:"
PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")
MAX_HOSTS = 245
TBF_LATENCY_MS = 10.0
# The host's own transmit queue (the upload's token bucket), in ms at the link's rate.
NIC_QUEUE_MS = 100.0
CC_SYSCTL = "net.ipv4.tcp_congestion_control"
CC_ALLOWED = "net.ipv4.tcp_allowed_congestion_control"
CC_AVAILABLE = "net.ipv4.tcp_available_congestion_control"
MIN_BURST = 128 * 1024
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "GRADSYNC_LAUNCHED", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "SLURM_PROCID")


class Failure(Exception):
    """An error with a message for the user (no traceback)."""


# ---------------------------------------------------------------------------------------------
# names


def fnv1a(data):
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def check_prefix(pfx):
    if not PREFIX_RE.fullmatch(pfx or ""):
        raise Failure(f"--name {pfx!r}: use 1 to 32 letters, digits, '_', '.' or '-'")
    return pfx


def tag_of(pfx):
    return "emu%06x" % (fnv1a(pfx.encode()) & 0xFFFFFF)


def subnet_of(pfx):
    return fnv1a(pfx.encode()) >> 24


def bridge_of(pfx):
    return tag_of(pfx) + "br"


def port_of(pfx, i):
    return f"{tag_of(pfx)}b{i}"


def ns_of(pfx, i):
    return f"{pfx}-h{i}"


def addr_of(pfx, i):
    return f"10.77.{subnet_of(pfx)}.{10 + i}"


def state_path(pfx):
    return os.path.join(STATE_DIR, pfx + ".json")


# ---------------------------------------------------------------------------------------------
# commands


def sh(cmd, check=True):
    """Runs cmd; returns its stdout. Raises Failure with stderr when check and it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise Failure(f"`{' '.join(cmd)}` failed (exit {p.returncode}): {p.stderr.strip()}")
    return p.stdout


def preflight(need_tc=False):
    if os.geteuid() != 0:
        raise Failure("must run as root: creating network namespaces needs CAP_SYS_ADMIN "
                      "(try sudo)")
    for tool in ("ip",) + (("tc",) if need_tc else ()):
        if shutil.which(tool) is None:
            raise Failure(f"`{tool}` not found: install iproute2")
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if p.returncode != 0:
        raise Failure(f"`ip netns list` does not work here: {p.stderr.strip()}")


def netns_list():
    out = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links(ns=None):
    cmd = ["ip"] + (["-n", ns] if ns else []) + ["-j", "-d", "link", "show"]
    try:
        return json.loads(sh(cmd, check=False) or "[]")
    except json.JSONDecodeError:
        return []


def burst_bytes(mbit):
    return max(MIN_BURST, int(mbit * 1e6 / 8 / 1000))


def tbf_args(mbit, queue_ms=TBF_LATENCY_MS):
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst_bytes(mbit)), "latency",
            f"{queue_ms:g}ms"]


# ---------------------------------------------------------------------------------------------
# up / down / show


def parse_rate_of(items, hosts):
    rates = {}
    for item in items or []:
        m = re.fullmatch(r"(\d+)=(\d+(?:\.\d+)?)", item)
        if not m:
            raise Failure(f"--rate-of {item!r}: expected HOST=MBIT, e.g. 3=500")
        i, r = int(m.group(1)), float(m.group(2))
        if i >= hosts:
            raise Failure(f"--rate-of {item!r}: host {i} does not exist ({hosts} hosts)")
        if r <= 0:
            raise Failure(f"--rate-of {item!r}: the rate must be positive")
        rates[i] = r
    return rates


def fmt_rate(r):
    return None if r is None else (int(r) if float(r).is_integer() else r)


def read_sysctl(name):
    """The value of sysctl `name` (dotted) in this namespace, from /proc/sys."""
    with open("/proc/sys/" + name.replace(".", "/")) as f:
        return f.read()


def check_cc(cc):
    """Fails unless `cc` names a congestion control a network namespace may choose: outside
    the initial namespace the kernel takes only those of `CC_ALLOWED` (and loads no module)."""
    if not re.fullmatch(r"[a-z0-9_]{1,15}", cc):
        raise Failure(f"--cc {cc!r}: a congestion control's name (reno, cubic, bbr, ...)")
    try:
        allowed = read_sysctl(CC_ALLOWED).split()
        available = read_sysctl(CC_AVAILABLE).split()
    except OSError:
        return
    if cc in allowed:
        return
    if cc in available:
        how = f"add it: sysctl -w {CC_ALLOWED}=\"{' '.join(allowed + [cc])}\""
    else:
        how = (f"this kernel has not loaded it (available: {' '.join(available)}); "
               f"`modprobe tcp_{cc}` loads it where there is such a module, then allow it")
    raise Failure(f"--cc {cc}: a network namespace may only choose among {CC_ALLOWED} "
                  f"({' '.join(allowed)}); {how}")


def up(pfx, hosts, rate=None, rate_of=None, mtu=1500, cc=None, queue_ms=TBF_LATENCY_MS,
       nic_queue_ms=NIC_QUEUE_MS):
    """Creates the hosts; returns their description. Undoes everything on any failure.

    cc: the TCP congestion control of every host (`net.ipv4.tcp_congestion_control` in each
    namespace); without it a namespace keeps what a new one gets, the host's default.
    queue_ms: the most a download's token bucket queues, in milliseconds of its rate (the
    switch's buffer); nic_queue_ms: the same for an upload's (the host's transmit queue)."""
    check_prefix(pfx)
    if cc is not None:
        check_cc(cc)
    for name, ms in (("--queue-ms", queue_ms), ("--nic-queue-ms", nic_queue_ms)):
        if not 0 < ms <= 1000:
            raise Failure(f"{name} {ms:g}: must be above 0 and at most 1000")
    if not 1 <= hosts <= MAX_HOSTS:
        raise Failure(f"--hosts {hosts}: between 1 and {MAX_HOSTS}")
    if rate is not None and rate <= 0:
        raise Failure("--rate must be positive")
    rates = {i: rate for i in range(hosts)}
    rates.update(parse_rate_of(rate_of, hosts))
    preflight(need_tc=any(r is not None for r in rates.values()))
    if present(pfx):
        raise Failure(f"hosts {pfx!r} are already up (or left over): "
                      f"run `{sys.argv[0]} down --name {pfx}` first")
    alias = ALIAS + pfx
    br = bridge_of(pfx)
    desc = {
        "name": pfx,
        "bridge": br,
        "subnet": f"10.77.{subnet_of(pfx)}.0/24",
        "mtu": mtu,
        "hosts": [],
    }
    try:
        os.makedirs(STATE_DIR, exist_ok=True)
        write_state(pfx, desc)
        sh(["ip", "link", "add", br, "type", "bridge"])
        sh(["ip", "link", "set", br, "alias", alias, "up"])
        for i in range(hosts):
            ns, port = ns_of(pfx, i), port_of(pfx, i)
            p = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if p.returncode != 0:
                raise Failure(f"cannot create network namespace {ns}: {p.stderr.strip()} "
                              "(a container without CAP_SYS_ADMIN?)")
            sh(["ip", "link", "add", port, "mtu", str(mtu), "type", "veth",
                "peer", "name", "eth0", "mtu", str(mtu), "netns", ns])
            sh(["ip", "link", "set", port, "alias", alias, "master", br, "up"])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            sh(["ip", "-n", ns, "link", "set", "eth0", "alias", alias, "up"])
            sh(["ip", "-n", ns, "addr", "add", addr_of(pfx, i) + "/24", "dev", "eth0"])
            if cc is not None:
                sh(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{CC_SYSCTL}={cc}"])
            host_cc = sh(["ip", "netns", "exec", ns, "sysctl", "-n", CC_SYSCTL]).strip()
            r = rates[i]
            if r is not None:
                sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root"]
                   + tbf_args(r, nic_queue_ms))
                sh(["tc", "qdisc", "replace", "dev", port, "root"] + tbf_args(r, queue_ms))
            desc["hosts"].append({
                "index": i,
                "namespace": ns,
                "address": addr_of(pfx, i),
                "ifname": "eth0",
                "bridge_port": port,
                "rate_mbit": fmt_rate(r),
                "tcp_cc": host_cc,
                "tbf": None if r is None else {"burst_bytes": burst_bytes(r),
                                               "latency": f"{queue_ms:g}ms",
                                               "upload_latency": f"{nic_queue_ms:g}ms"},
            })
        write_state(pfx, desc)
    except BaseException:
        down(pfx, quiet=True)
        raise
    return desc


def write_state(pfx, desc):
    tmp = state_path(pfx) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(desc, f, indent=2)
        f.write("\n")
    os.replace(tmp, state_path(pfx))


def our_namespaces(pfx):
    pat = re.compile(re.escape(pfx) + r"-h\d+")
    return [ns for ns in netns_list() if pat.fullmatch(ns)]


def our_links(pfx):
    """Root-namespace links of pfx: ports first, the bridge last."""
    tag = tag_of(pfx)
    pat = re.compile(re.escape(tag) + r"(br|b\d+)")
    found = [l["ifname"] for l in links()
             if l.get("ifalias") == ALIAS + pfx or pat.fullmatch(l.get("ifname", ""))]
    return sorted(set(found), key=lambda n: (n == tag + "br", n))


def present(pfx):
    return bool(our_namespaces(pfx) or our_links(pfx) or os.path.exists(state_path(pfx)))


def kill_in(ns, quiet):
    """SIGKILLs the processes left in namespace ns (they belong to the emulated host)."""
    pids = [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).split() if p.isdigit()]
    pids = [p for p in pids if p != os.getpid()]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids and not quiet:
        print(f"emuhosts: killed {len(pids)} process(es) left in {ns}", file=sys.stderr)
    deadline = time.monotonic() + 2
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if os.path.exists(f"/proc/{p}")
                and not proc_is_zombie(p)]
        time.sleep(0.02)


def proc_is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def down(pfx, quiet=False):
    """Removes the hosts of pfx: processes in them, bridge ports, bridge, namespaces, state."""
    check_prefix(pfx)
    namespaces = our_namespaces(pfx)
    for ns in namespaces:
        kill_in(ns, quiet)
    # Deleting a bridge port deletes its veth peer in the namespace at once (deleting the
    # namespace first would leave the port to an asynchronous cleanup).
    removed = []
    for name in our_links(pfx):
        p = subprocess.run(["ip", "link", "del", name], capture_output=True, text=True)
        if p.returncode == 0:
            removed.append(name)
    for ns in namespaces:
        sh(["ip", "netns", "del", ns], check=False)
    try:
        os.remove(state_path(pfx))
    except FileNotFoundError:
        pass
    left = our_namespaces(pfx) + our_links(pfx)
    if left:
        raise Failure(f"could not remove {', '.join(left)}")
    if not quiet:
        print(f"emuhosts: {pfx}: removed {len(namespaces)} namespace(s), "
              f"{len(removed)} link(s)", file=sys.stderr)


def all_prefixes():
    """Prefixes of every setup of this script: state files, and links with its alias."""
    found = set()
    if os.path.isdir(STATE_DIR):
        for f in os.listdir(STATE_DIR):
            if f.endswith(".json") and PREFIX_RE.fullmatch(f[:-5]):
                found.add(f[:-5])
    for l in links():
        a = l.get("ifalias", "")
        if a.startswith(ALIAS) and PREFIX_RE.fullmatch(a[len(ALIAS):]):
            found.add(a[len(ALIAS):])
    for ns in netns_list():
        if re.fullmatch(r".+-h\d+", ns):
            for l in links(ns):
                a = l.get("ifalias", "")
                if a.startswith(ALIAS) and PREFIX_RE.fullmatch(a[len(ALIAS):]):
                    found.add(a[len(ALIAS):])
    return sorted(found)


def read_state(pfx):
    try:
        with open(state_path(pfx)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise Failure(f"no hosts named {pfx!r} are up") from None


# ---------------------------------------------------------------------------------------------
# measure


def size_arg(s):
    m = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (e.g. 64M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def int_list(s):
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas: {s!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers: {s!r}")
    return vals


def fmt_size(b):
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def resolve_bin(path):
    for cand in (path, os.path.join(ROOT, path)):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    raise Failure(f"gradsync binary {path!r} not found: "
                  "build it with `cargo build --release -p gradsync-cli` or pass --bin")


def tail(path, n=15):
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def first_error(paths):
    for p in paths:
        try:
            with open(p, errors="replace") as f:
                for line in f:
                    if "error" in line.lower():
                        return line.strip()
        except OSError:
            pass
    return None


def stop(procs):
    """Stops the launchers: SIGTERM (they forward it to their ranks), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def one_run(args, desc, algo, hosts, port, token, workdir, tag):
    """Runs the bench once across all hosts; returns (row, None) or (None, why)."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    binary = args.bin
    if "@" in algo:
        # `ALGO@K`: the K-th binary of --bins
        algo, k = algo.rsplit("@", 1)
        binary = args.bins[int(k)]
    env["GRADSYNC_ALGO"] = algo
    env["GRADSYNC_TOKEN"] = token
    master = f"{desc['hosts'][0]['address']}:{port}"
    procs, outs, errs = [], [], []
    jsons = [os.path.join(workdir, f"{tag}-h{i}.json") for i in range(hosts)]
    try:
        for i, h in enumerate(desc["hosts"]):
            cmd = ["ip", "netns", "exec", h["namespace"], binary, "launch",
                   "--nnodes", str(hosts), "--node-rank", str(i), "--nproc", str(args.nproc),
                   "--master", master, "--", binary, "bench", "all_reduce",
                   "-b", str(args.size), "-e", str(args.size), "-n", str(args.iters),
                   "-w", str(args.warmup), "-c", str(args.check), "-d", args.dtype,
                   "--json", jsons[i]] + (["--explain"] if args.predict else [])
            out = os.path.join(workdir, f"{tag}-h{i}.out")
            err = os.path.join(workdir, f"{tag}-h{i}.err")
            outs.append(out)
            errs.append(err)
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fo,
                                              stderr=fe, env=env, start_new_session=True))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                stop(procs)
                return None, f"timed out after {args.timeout} s\n" + tail(errs[0])
            if any(p.returncode not in (None, 0) for p in procs):
                # The others fail on their own within seconds once a peer is gone.
                try:
                    for p in procs:
                        p.wait(timeout=max(0.1, min(15, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    stop(procs)
                break
            time.sleep(0.05)
    finally:
        stop(procs)
    codes = [p.returncode for p in procs]
    if any(codes):
        i = next(i for i, c in enumerate(codes) if c)
        why = first_error(errs) or f"see {errs[i]}"
        return None, f"exit codes {codes}: {why}\n--- host {i} stderr:\n{tail(errs[i])}"
    try:
        with open(jsons[0]) as f:
            rows = json.load(f)
        row = next(r for r in rows if r.get("size") == args.size or len(rows) == 1)
        m = row.get("out_of_place") or row.get("in_place")
        res = {"busbw": m["busbw"], "algbw": m["algbw"], "time_us": m["time_us"],
               "wrong": m.get("wrong"), "world": row.get("world")}
        if args.predict:
            with open(outs[0]) as f:
                text = f.read()
            res["predicted_us"] = predicted_us(text, args.size, algo)
            model = [line for line in text.splitlines() if "# explain:" in line]
            if model:
                print(f"# {tag} {algo}: {model[0].split('# explain: ', 1)[1]}", file=sys.stderr)
        return res, None
    except (OSError, ValueError, KeyError, StopIteration, TypeError) as e:
        return None, f"cannot read rank 0's JSON {jsons[0]}: {e}\n{tail(outs[0])}"


NSTAT = ("TcpOutSegs", "TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPLossProbes",
         "TcpExtTCPToZeroWindowAdv", "TcpExtTCPWinProbe")


def tcp_counters(desc):
    """The kernel's TCP counters of `NSTAT` summed over the hosts' namespaces, since the hosts
    came up: segments sent, segments retransmitted, retransmission timeouts, tail loss probes,
    zero windows advertised (a receiver that had no room), window probes sent (a sender that
    met a zero window, on its persist timer)."""
    total = [0] * len(NSTAT)
    for h in desc["hosts"]:
        out = sh(["ip", "netns", "exec", h["namespace"], "nstat", "-asz", *NSTAT])
        for line in out.splitlines():
            f = line.split()
            if len(f) >= 2 and f[0] in NSTAT:
                total[NSTAT.index(f[0])] += int(f[1])
    return total


def queue_drops(desc):
    """Packets the hosts' token buckets dropped since the hosts came up, summed over the hosts:
    (on the uploads, the hosts' own transmit queues; on the downloads, the switch's ports)."""
    total = [0, 0]
    for h in desc["hosts"]:
        for k, cmd in enumerate((["ip", "netns", "exec", h["namespace"], "tc", "-s", "qdisc",
                                  "show", "dev", h["ifname"]],
                                 ["tc", "-s", "qdisc", "show", "dev", h["bridge_port"]])):
            m = re.search(r"\(dropped (\d+),", sh(cmd))
            if m:
                total[k] += int(m.group(1))
    return total


def iperf_goodput(desc, seconds, port=5201):
    """TCP goodput in GB/s of one iperf3 stream from host 0 to host 1 for `seconds` (what the
    receiver got), or None with the reason printed."""
    h0, h1 = desc["hosts"][0], desc["hosts"][1]
    server = subprocess.Popen(["ip", "netns", "exec", h1["namespace"], "iperf3", "-s", "-1",
                               "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(50):
            p = subprocess.run(["ip", "netns", "exec", h0["namespace"], "iperf3", "-c",
                                h1["address"], "-p", str(port), "-t", str(seconds), "-J"],
                               capture_output=True, text=True, timeout=seconds + 30)
            try:
                bps = json.loads(p.stdout)["end"]["sum_received"]["bits_per_second"]
                if p.returncode == 0:
                    return bps / 8e9
            except (ValueError, KeyError, TypeError):
                pass
            if "Connection refused" not in p.stdout + p.stderr and "busy" not in p.stdout:
                print(f"# iperf3 failed: {(p.stdout + p.stderr).strip()[-300:]}",
                      file=sys.stderr)
                return None
            time.sleep(0.1)
        print("# iperf3: the server never listened", file=sys.stderr)
        return None
    finally:
        stop([server])


def predicted_us(text, size, algo):
    """The time (us) `gradsync bench --explain` predicts for `algo` at `size` bytes, from rank
    0's output (the table after `# explain:`), or None."""
    names = None
    for line in text.splitlines():
        f = re.sub(r"^\[\d+\]\s*", "", line).lstrip("#").split()
        if f[:2] == ["size", "eager"]:
            names = f[1:]
        elif names and f and f[0] == str(size):
            name = {"rd": "recursive_doubling", "dbtree": "double_tree", "rhd": "rabenseifner",
                    "halving_doubling": "rabenseifner"}.get(algo.lower(), algo.lower())
            if name in names:
                try:
                    return float(f[1 + names.index(name)])
                except (ValueError, IndexError):
                    return None
    return None


def measure(args):
    if not args.bins:
        args.bin = resolve_bin(args.bin)
    if args.iperf and shutil.which("iperf3") is None:
        raise Failure("--iperf needs iperf3 (apt-get install iperf3)")
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    if not algos:
        raise Failure("--algos: give at least one algorithm")
    if args.bins:
        # Every algorithm with every binary, alternating within each repetition.
        args.bins = [resolve_bin(b) for b in args.bins.split(",") if b]
        algos = [f"{a}@{k}" for a in algos for k in range(len(args.bins))]
        for k, b in enumerate(args.bins):
            print(f"# @{k}: {b}", file=sys.stderr)
    if args.nproc < 1 or args.reps < 1 or args.iters < 1:
        raise Failure("--nproc, --reps and --iters must be at least 1")
    if max(args.hosts) > MAX_HOSTS:
        raise Failure(f"--hosts: at most {MAX_HOSTS}")
    preflight(need_tc=args.rate is not None or bool(args.rate_of))
    token = secrets.token_hex(32)
    results = {}  # (hosts, algo) -> list of rows
    failures = {}  # (hosts, algo) -> first failure
    link = {}  # hosts -> slowest link rate (Mbit/s) or None
    goodput = {}  # hosts -> iperf3 goodputs (GB/s), one per repetition
    ccs = set()  # the TCP congestion controls the hosts ran
    t0 = time.monotonic()
    run_no = 0
    with tempfile.TemporaryDirectory(prefix="emuhosts-") as workdir:
        for hosts in args.hosts:
            if present(args.name):
                down(args.name)
            t_up = time.monotonic()
            desc = up(args.name, hosts, args.rate, args.rate_of, args.mtu, args.cc,
                      args.queue_ms, args.nic_queue_ms)
            try:
                rates = [h["rate_mbit"] for h in desc["hosts"]]
                ccs.update(h["tcp_cc"] for h in desc["hosts"])
                link[hosts] = None if None in rates else min(rates)
                print(f"# {hosts} hosts up in {time.monotonic() - t_up:.2f} s "
                      f"(link rates, Mbit/s: {rates})", file=sys.stderr)
                for rep in range(args.reps):
                    if args.iperf and hosts >= 2:
                        g = iperf_goodput(desc, args.iperf)
                        if g is not None:
                            goodput.setdefault(hosts, []).append(g)
                            print(f"# hosts {hosts} rep {rep + 1} iperf3: {g:.4f} GB/s "
                                  f"({g * 8000:.1f} Mbit/s)", file=sys.stderr)
                    for algo in algos:
                        run_no += 1
                        port = args.port + run_no % 1000
                        before = tcp_counters(desc) if args.nstat else None
                        drops = queue_drops(desc) if args.nstat else None
                        t = time.monotonic()
                        row, why = one_run(args, desc, algo, hosts, port, token, workdir,
                                           f"r{run_no}")
                        dt = time.monotonic() - t
                        if before is not None:
                            sent, retrans, rto, tlp, zero, probes = (
                                a - b for a, b in zip(tcp_counters(desc), before))
                            up_drops, down_drops = (
                                a - b for a, b in zip(queue_drops(desc), drops))
                            print(f"# hosts {hosts} rep {rep + 1} {algo}: TCP sent {sent} "
                                  f"segments, retransmitted {retrans} "
                                  f"({100 * retrans / max(sent, 1):.2f}%), {rto} timeouts, "
                                  f"{tlp} loss probes, {zero} zero windows, {probes} window "
                                  f"probes; dropped {up_drops} packets in the hosts' own "
                                  f"queues, {down_drops} in the switch", file=sys.stderr)
                        if row is None:
                            failures.setdefault((hosts, algo), why)
                            print(f"# hosts {hosts} rep {rep + 1} {algo}: FAILED after "
                                  f"{dt:.1f} s: {why}", file=sys.stderr)
                            continue
                        results.setdefault((hosts, algo), []).append(row)
                        print(f"# hosts {hosts} rep {rep + 1} {algo}: busbw "
                              f"{row['busbw']:.3f} GB/s algbw {row['algbw']:.3f} GB/s "
                              f"({row['time_us'] / 1e3:.1f} ms per call, run {dt:.1f} s)",
                              file=sys.stderr)
            finally:
                down(args.name, quiet=True)
    elapsed = time.monotonic() - t0
    print(table(args, algos, results, failures, link, goodput, sorted(ccs)))
    print(f"\n{run_no} runs in {elapsed:.1f} s")
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(svg(args, algos, results, link))
        print(f"plot: {args.svg}")
    return 1 if failures else 0


def pct_of_link(busbw, mbit):
    return None if not mbit else busbw * 8000.0 / mbit * 100.0


def table(args, algos, results, failures, link, goodput=None, ccs=()):
    goodput = goodput or {}
    parts = [f"{fmt_rate(args.rate)} Mbit/s"] if args.rate else []
    parts += ["host %s %s Mbit/s" % tuple(x.split("=", 1)) for x in args.rate_of or []]
    rate = (f"{', '.join(parts)} (switch queue {args.queue_ms:g} ms, "
            f"host queue {args.nic_queue_ms:g} ms)" if parts else "unlimited")
    lines = [
        f"all_reduce {fmt_size(args.size)} {args.dtype} sum, {args.nproc} rank(s) per host, "
        f"links {rate}, "
        f"TCP {'/'.join(ccs) or '?'}, {args.iters} iters + {args.warmup} "
        f"warm-up, median of {args.reps} rep(s) (min-max)",
        "",
        "| hosts | ranks | algo | busbw GB/s | algbw GB/s | time ms | busbw % of link | "
        "busbw % of iperf3 | wrong |" + (" predicted ms | predicted / measured |"
                                         if args.predict else ""),
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.predict else ""),
    ]
    for hosts in args.hosts:
        for algo in algos:
            rows = results.get((hosts, algo), [])
            if not rows:
                why = (failures.get((hosts, algo)) or "no result").splitlines()[0]
                why = why.replace("|", "/")[:120]
                lines.append(f"| {hosts} | {hosts * args.nproc} | {algo} | failed: {why} "
                             "| | | | | |")
                continue
            bus = [r["busbw"] for r in rows]
            alg = [r["algbw"] for r in rows]
            ms = [r["time_us"] / 1e3 for r in rows]
            pct = pct_of_link(statistics.median(bus), link.get(hosts))
            g = goodput.get(hosts)
            of_g = statistics.median(bus) / statistics.median(g) * 100 if g else None
            wrong = [r.get("wrong") for r in rows]
            wrong = "-" if all(w is None for w in wrong) else str(sum(w or 0 for w in wrong))
            note = "" if len(rows) == args.reps else f" ({len(rows)}/{args.reps} ok)"
            lines.append(
                f"| {hosts} | {hosts * args.nproc} | {algo}{note} | "
                f"{statistics.median(bus):.3f} ({min(bus):.3f}-{max(bus):.3f}) | "
                f"{statistics.median(alg):.3f} | {statistics.median(ms):.1f} | "
                + ("-" if pct is None else f"{pct:.1f}%") + " | "
                + ("-" if of_g is None else f"{of_g:.1f}%") + f" | {wrong} |"
                + (predicted_cells(rows, ms) if args.predict else ""))
    for hosts in args.hosts:
        g = goodput.get(hosts)
        if g:
            lines.append(f"\n{hosts} hosts: iperf3 goodput, one stream host 0 -> host 1, median "
                         f"of {len(g)}: {statistics.median(g):.4f} GB/s "
                         f"({statistics.median(g) * 8000:.1f} Mbit/s)")
    if args.nproc > 1:
        lines += ["", "busbw = algbw x 2(n-1)/n over all n ranks (nccl-tests); with several "
                  "ranks per host, an algorithm that reduces within each host first moves less "
                  "over the links, so it can exceed 100% of the link."]
    return "\n".join(lines)


def predicted_cells(rows, ms):
    pred = [r.get("predicted_us") for r in rows if r.get("predicted_us") is not None]
    if not pred:
        return " - | - |"
    p = statistics.median(pred) / 1e3
    return f" {p:.1f} | {p / statistics.median(ms):.3f} |"


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]


def svg(args, algos, results, link):
    """A bar chart of busbw per algorithm (one host count), or lines of busbw vs hosts."""
    W, H, L, R, T, B = 640, 400, 70, 150, 50, 60
    pw, ph = W - L - R, H - T - B
    med = {k: statistics.median(r["busbw"] for r in v) for k, v in results.items() if v}
    rng = {k: (min(r["busbw"] for r in v), max(r["busbw"] for r in v))
           for k, v in results.items() if v}
    rates = [link[h] for h in args.hosts if link.get(h)]
    link_gbs = min(rates) / 8000.0 if rates else None
    top = max([hi for _, hi in rng.values()] + ([link_gbs] if link_gbs else []) + [1e-3]) * 1.1
    y = lambda v: T + ph - v / top * ph  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">'
           f'all_reduce {fmt_size(args.size)}: bus bandwidth, {args.nproc} rank(s) per host'
           '</text>']
    for k in range(6):
        v = top * k / 5
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   'stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3f}</text>')
    out.append(f'<text x="16" y="{T + ph / 2}" transform="rotate(-90 16 {T + ph / 2})" '
               'text-anchor="middle">busbw (GB/s)</text>')
    if len(args.hosts) == 1:
        hosts = args.hosts[0]
        slot = pw / max(1, len(algos))
        for i, algo in enumerate(algos):
            cx = L + slot * (i + 0.5)
            bw = slot * 0.6
            if (hosts, algo) in med:
                v = med[(hosts, algo)]
                lo, hi = rng[(hosts, algo)]
                out.append(f'<rect x="{cx - bw / 2:.1f}" y="{y(v):.1f}" width="{bw:.1f}" '
                           f'height="{T + ph - y(v):.1f}" fill="{COLORS[i % len(COLORS)]}"/>')
                out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(lo):.1f}" '
                           f'y2="{y(hi):.1f}" stroke="black"/>')
                out.append(f'<text x="{cx:.1f}" y="{y(hi) - 6:.1f}" text-anchor="middle">'
                           f'{v:.3f}</text>')
            else:
                out.append(f'<text x="{cx:.1f}" y="{T + ph - 6}" text-anchor="middle">'
                           'failed</text>')
            out.append(f'<text x="{cx:.1f}" y="{T + ph + 18}" text-anchor="middle">'
                       f'{esc(algo)}</text>')
        out.append(f'<text x="{L + pw / 2}" y="{H - 16}" text-anchor="middle">'
                   f'algorithm ({hosts} hosts)</text>')
    else:
        xs = sorted(set(args.hosts))
        x = (lambda h: L + pw / 2) if len(xs) == 1 else \
            (lambda h: L + (h - xs[0]) / (xs[-1] - xs[0]) * pw)  # noqa: E731
        for h in xs:
            out.append(f'<text x="{x(h):.1f}" y="{T + ph + 18}" text-anchor="middle">{h}</text>')
        out.append(f'<text x="{L + pw / 2}" y="{H - 16}" text-anchor="middle">hosts</text>')
        for i, algo in enumerate(algos):
            c = COLORS[i % len(COLORS)]
            pts = [(x(h), y(med[(h, algo)])) for h in xs if (h, algo) in med]
            if len(pts) > 1:
                out.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>'
                           % (c, " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)))
            for px, py in pts:
                out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{c}"/>')
            ly = T + 20 * i + 10
            out.append(f'<rect x="{L + pw + 15}" y="{ly - 9}" width="12" height="12" '
                       f'fill="{c}"/>')
            out.append(f'<text x="{L + pw + 32}" y="{ly + 1}">{esc(algo)}</text>')
    if link_gbs:
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{y(link_gbs):.1f}" '
                   f'y2="{y(link_gbs):.1f}" stroke="#c00" stroke-dasharray="6,4"/>')
        out.append(f'<text x="{L + pw + 6}" y="{y(link_gbs) + 4:.1f}" fill="#c00">'
                   f'link {fmt_rate(min(rates))} Mbit/s</text>')
    out.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{T + ph}" stroke="black"/>')
    out.append(f'<line x1="{L}" x2="{L + pw}" y1="{T + ph}" y2="{T + ph}" stroke="black"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# command line


def interrupt(signum, frame):
    raise KeyboardInterrupt


def link_args(p):
    """The options of the hosts' links, which `up` and `measure` share (after --rate)."""
    p.add_argument("--rate-of", action="append", metavar="I=MBIT",
                   help="a different rate for host I (repeatable)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of the links (default 1500)")
    p.add_argument("--cc", help="TCP congestion control of every host (reno, cubic, bbr, ...; "
                   "default: what a new network namespace gets, the host's "
                   "net.ipv4.tcp_congestion_control; one of "
                   "net.ipv4.tcp_allowed_congestion_control)")
    p.add_argument("--queue-ms", type=float, default=TBF_LATENCY_MS,
                   help="the most a host's download queues, in ms at its rate: the switch's "
                        f"buffer (default {TBF_LATENCY_MS:g})")
    p.add_argument("--nic-queue-ms", type=float, default=NIC_QUEUE_MS,
                   help="the most a host's upload queues, in ms at its rate: its own transmit "
                        f"queue (default {NIC_QUEUE_MS:g})")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("up", help="create N emulated hosts and print their JSON description")
    p.add_argument("--name", required=True, help="prefix of every name (namespaces PFX-h<i>)")
    p.add_argument("--hosts", type=int, required=True, help="number of hosts")
    p.add_argument("--rate", type=float, help="link rate of every host in Mbit/s (both "
                   "directions); unlimited without")
    link_args(p)

    p = sub.add_parser("down", help="remove the hosts of a prefix (idempotent)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--name", help="prefix given to up")
    g.add_argument("--all", action="store_true", help="every setup of this script")

    p = sub.add_parser("show", help="print the JSON description of running hosts")
    p.add_argument("--name", help="one prefix (default: every one)")

    p = sub.add_parser("exec", help="run a command in host I's namespace (environment kept)")
    p.add_argument("--name", required=True)
    p.add_argument("--host", type=int, required=True)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    p = sub.add_parser("measure", help="gradsync all-reduce across emulated hosts per algorithm")
    p.add_argument("--hosts", type=int_list, default=[4], help="host count(s): 4 or 2,3,4")
    p.add_argument("--nproc", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--rate", type=float, help="link rate in Mbit/s (default unlimited)")
    link_args(p)
    p.add_argument("--size", type=size_arg, default=64 << 20, help="bytes (default 64M)")
    p.add_argument("--algos", default="ring", help="GRADSYNC_ALGO values, comma separated")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--iters", type=int, default=5,
                   help="timed calls per run (-n, default 5); bench times out-of-place and "
                   "in-place, so a run makes 2 x (warmup + iters) calls")
    p.add_argument("--warmup", type=int, default=1, help="warm-up calls (-w, default 1)")
    p.add_argument("--check", type=int, choices=(0, 1), default=0, help="-c (default 0)")
    p.add_argument("--dtype", default="float", help="-d (default float)")
    p.add_argument("--bin", default="target/release/gradsync",
                   help="gradsync binary (default target/release/gradsync of the repository)")
    p.add_argument("--name", default="emumeasure", help="prefix of the hosts")
    p.add_argument("--port", type=int, default=29500, help="base store port (default 29500)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    p.add_argument("--svg", help="also write a plot of busbw to this SVG file")
    p.add_argument("--bins", help="several gradsync binaries, comma separated, alternating "
                   "within each repetition (before and after a change); rows are ALGO@K")
    p.add_argument("--predict", action="store_true",
                   help="run the bench with --explain and give the cost model's predicted time "
                        "of each algorithm beside the measured one (GRADSYNC_CALIBRATE=always "
                        "makes every run measure its links)")
    p.add_argument("--iperf", type=float, metavar="SECONDS",
                   help="also measure one iperf3 stream from host 0 to host 1 for SECONDS in "
                        "every repetition, and give busbw as a share of its goodput")
    p.add_argument("--nstat", action="store_true",
                   help="also give, per run, the TCP segments the hosts sent, how many of "
                        "them were retransmissions, the retransmission timeouts, tail loss "
                        "probes, zero windows advertised and window probes (the kernel's "
                        "counters in each host), and the packets the token buckets dropped "
                        "on the uploads (the hosts' own queues) and downloads (the switch)")

    args = ap.parse_args(argv)
    # SIGTERM and SIGHUP unwind like Ctrl-C, so that every `finally` tears the hosts down.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    try:
        if args.cmd == "up":
            desc = up(args.name, args.hosts, args.rate, args.rate_of, args.mtu, args.cc,
                      args.queue_ms, args.nic_queue_ms)
            print(json.dumps(desc, indent=2))
        elif args.cmd == "down":
            preflight()
            for pfx in (all_prefixes() if args.all else [args.name]):
                down(pfx)
        elif args.cmd == "show":
            names = [args.name] if args.name else all_prefixes()
            print(json.dumps([read_state(n) for n in names
                              if args.name or os.path.exists(state_path(n))], indent=2))
        elif args.cmd == "exec":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not cmd:
                raise Failure("exec: give a command after --")
            check_prefix(args.name)
            preflight()
            ns = ns_of(args.name, args.host)
            if ns not in netns_list():
                raise Failure(f"no namespace {ns}: is `up --name {args.name}` running?")
            os.execvp("ip", ["ip", "netns", "exec", ns] + cmd)
        elif args.cmd == "measure":
            return measure(args)
        return 0
    except Failure as e:
        print(f"emuhosts: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("emuhosts: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
