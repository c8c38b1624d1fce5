//! Jobs across emulated hosts: network namespaces on a bridge, each with a veth link (optionally
//! rate-limited with `tc qdisc tbf`, and the traffic between two hosts with an HTB class),
//! set up with the naming of `scripts/emuhosts.py` so that `emuhosts.py down --all` also
//! removes what a killed test left behind.
//!
//! Every test needs root and working `ip netns`; without them it prints why it skipped and
//! passes (under CI, `GRADSYNC_CI=1`, it fails instead). Every wait has a deadline, and the guard that owns the hosts removes them (and
//! whatever still runs inside) when it is dropped, also when the test panics.

mod common;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");

/// Port of the rendezvous store on host 0 (each namespace has its own port space).
const STORE_PORT: u16 = 29500;

/// Token bucket size of every rate limit, bytes: as in emuhosts.py, above a 64 KiB GSO packet.
const BURST: &str = "131072";

/// The jobs of these tests use every core; run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// 32-bit FNV-1a, as `emuhosts.py` derives names and subnets from a prefix.
fn fnv1a(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5, |h: u32, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Runs a command; returns whether it succeeded, and its stdout and stderr.
fn sh(program: &str, args: &[&str]) -> (bool, String) {
    match Command::new(program).args(args).output() {
        Ok(out) => (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        ),
        Err(e) => (false, format!("cannot run {program}: {e}")),
    }
}

/// Runs a command that must succeed.
fn must(program: &str, args: &[&str]) -> String {
    let (ok, out) = sh(program, args);
    assert!(ok, "`{program} {}` failed: {out}", args.join(" "));
    out
}

/// A prefix unique to this process and test: `gsn<pid><index>`.
fn prefix(test_index: u32) -> String {
    format!("gsn{}x{test_index}", std::process::id())
}

/// Why network namespaces cannot be used here, if they cannot.
fn cannot_use_namespaces(pfx: &str) -> Option<String> {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (network namespaces need CAP_SYS_ADMIN)".to_string());
    }
    let probe = format!("{pfx}-probe");
    let (ok, out) = sh("ip", &["netns", "add", &probe]);
    if !ok {
        return Some(format!("`ip netns add` fails here: {}", out.trim()));
    }
    sh("ip", &["netns", "del", &probe]);
    None
}

/// Emulated hosts `PFX-h0..`; dropping it removes them.
struct Hosts {
    pfx: String,
    tag: String,
    subnet: u32,
    n: usize,
    /// The rate of every host's link, Mbit/s, where limited.
    rates: Vec<Option<u32>>,
    /// Where the jobs' output goes.
    dir: PathBuf,
}

impl Hosts {
    /// The guard of hosts named after `pfx` (nothing is created yet).
    fn named(pfx: &str, n: usize) -> Hosts {
        let h = fnv1a(pfx);
        Hosts {
            pfx: pfx.to_string(),
            tag: format!("emu{:06x}", h & 0xff_ffff),
            subnet: h >> 24,
            n,
            rates: vec![None; n],
            dir: std::env::temp_dir().join(format!("gradsync-{pfx}")),
        }
    }

    /// One host per entry of `rates` on one bridge, host i's link limited to `rates[i]` Mbit/s
    /// in both directions when given.
    fn up_with_rates(pfx: &str, rates: &[Option<u32>]) -> Hosts {
        let n = rates.len();
        let mut hosts = Hosts::named(pfx, n);
        hosts.rates = rates.to_vec();
        hosts.teardown();
        fs::create_dir_all(&hosts.dir).expect("create the output directory");
        let alias = format!("emuhosts:{pfx}");
        let br = hosts.bridge();
        must("ip", &["link", "add", &br, "type", "bridge"]);
        must("ip", &["link", "set", &br, "alias", &alias, "up"]);
        for (i, rate) in rates.iter().enumerate() {
            let (ns, port) = (hosts.ns(i), hosts.port(i));
            must("ip", &["netns", "add", &ns]);
            must(
                "ip",
                &[
                    "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns,
                ],
            );
            must(
                "ip",
                &["link", "set", &port, "alias", &alias, "master", &br, "up"],
            );
            must("ip", &["-n", &ns, "link", "set", "lo", "up"]);
            must(
                "ip",
                &["-n", &ns, "link", "set", "eth0", "alias", &alias, "up"],
            );
            let cidr = format!("{}/24", hosts.addr(i));
            must("ip", &["-n", &ns, "addr", "add", &cidr, "dev", "eth0"]);
            if let Some(rate) = rate {
                // The same token bucket as emuhosts.py: the burst stays above a 64 KiB GSO
                // packet, and at 1 Gbit/s a TCP stream gets ~956 Mbit/s of goodput.
                let rate = format!("{rate}mbit");
                let tbf = ["tbf", "rate", &rate, "burst", BURST, "latency", "10ms"];
                let mut upload = vec![
                    "netns", "exec", &ns, "tc", "qdisc", "replace", "dev", "eth0", "root",
                ];
                upload.extend(tbf);
                must("ip", &upload);
                let mut download = vec!["qdisc", "replace", "dev", &port, "root"];
                download.extend(tbf);
                must("tc", &download);
            }
        }
        hosts
    }

    /// Limits the traffic between hosts `a` and `b` to `mbit` Mbit/s in both directions: the
    /// upload of each (its `eth0`) becomes an HTB whose default class keeps the host's own rate
    /// and whose second class, chosen by a u32 filter on the other host's address, has `mbit`.
    fn limit_pair(&self, a: usize, b: usize, mbit: u32) {
        for (x, y) in [(a, b), (b, a)] {
            let own = self.rates[x].expect("limit_pair needs hosts with a rate");
            let ns = self.ns(x);
            let tc = |args: &[&str]| {
                let mut all = vec!["netns", "exec", &ns, "tc"];
                all.extend_from_slice(args);
                must("ip", &all);
            };
            // r2q 1000 keeps HTB's quantum (rate / r2q) within its limits at these rates.
            tc(&[
                "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1",
                "r2q", "1000",
            ]);
            for (class, rate) in [("1:1", own), ("1:2", mbit)] {
                let rate = format!("{rate}mbit");
                tc(&[
                    "class", "add", "dev", "eth0", "parent", "1:", "classid", class, "htb", "rate",
                    &rate, "ceil", &rate, "burst", BURST, "cburst", BURST,
                ]);
            }
            let dst = format!("{}/32", self.addr(y));
            tc(&[
                "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "dst", &dst, "flowid", "1:2",
            ]);
        }
    }

    fn ns(&self, i: usize) -> String {
        format!("{}-h{i}", self.pfx)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.tag)
    }

    fn port(&self, i: usize) -> String {
        format!("{}b{i}", self.tag)
    }

    fn addr(&self, i: usize) -> String {
        format!("10.77.{}.{}", self.subnet, 10 + i)
    }

    /// Whether any namespace or link of these hosts exists.
    fn any_left(&self) -> bool {
        let (_, namespaces) = sh("ip", &["netns", "list"]);
        let (_, links) = sh("ip", &["-o", "link", "show"]);
        (0..self.n).any(|i| {
            namespaces
                .split_whitespace()
                .any(|w| w == self.ns(i).as_str())
        }) || links.contains(&self.tag)
    }

    /// Removes the processes in the namespaces, the links and the namespaces; what is already
    /// gone is skipped.
    fn teardown(&self) {
        for i in 0..self.n {
            let (_, pids) = sh("ip", &["netns", "pids", &self.ns(i)]);
            for pid in pids.split_whitespace().filter(|p| p.parse::<u32>().is_ok()) {
                sh("kill", &["-KILL", pid]);
            }
        }
        // Deleting a bridge port deletes its veth peer in the namespace at once.
        for i in 0..self.n {
            sh("ip", &["link", "del", &self.port(i)]);
        }
        sh("ip", &["link", "del", &self.bridge()]);
        for i in 0..self.n {
            sh("ip", &["netns", "del", &self.ns(i)]);
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.teardown();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A job token shared by all nodes: 32 random bytes as hex.
fn random_token() -> String {
    let mut bytes = [0u8; 32];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("read /dev/urandom");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The outcome of one node's launcher.
struct NodeResult {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

fn read(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Runs `gradsync launch --nnodes N --node-rank i --nproc P --master <host 0> -- gradsync
/// ARGS...` on every host at once; fails the test with every node's output when the deadline
/// passes.
fn run_job(
    hosts: &Hosts,
    nproc: usize,
    bench: &[&str],
    env: &[(&str, &str)],
    deadline: Duration,
) -> Vec<NodeResult> {
    let token = random_token();
    let master = format!("{}:{STORE_PORT}", hosts.addr(0));
    let (nnodes, nproc) = (hosts.n.to_string(), nproc.to_string());
    let files = |i: usize| {
        (
            hosts.dir.join(format!("node{i}.out")),
            hosts.dir.join(format!("node{i}.err")),
        )
    };
    let mut children: Vec<Child> = Vec::new();
    for i in 0..hosts.n {
        let (out, err) = files(i);
        let node_rank = i.to_string();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &hosts.ns(i), BIN, "launch"])
            .args(["--nnodes", &nnodes, "--node-rank", &node_rank])
            .args(["--nproc", &nproc, "--master", &master, "--grace-secs", "1"])
            .args(["--", BIN])
            .args(bench)
            .envs(env.iter().copied())
            .env("GRADSYNC_TOKEN", &token)
            .env("GRADSYNC_TIMEOUT", "30")
            .stdin(Stdio::null())
            .stdout(fs::File::create(&out).expect("create the output file"))
            .stderr(fs::File::create(&err).expect("create the output file"));
        for var in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "OMPI_COMM_WORLD_RANK",
            "PMI_RANK",
            "SLURM_PROCID",
        ] {
            cmd.env_remove(var);
        }
        children.push(cmd.spawn().expect("start ip netns exec gradsync launch"));
    }
    let outputs = || {
        (0..hosts.n)
            .map(|i| {
                let (out, err) = files(i);
                format!(
                    "--- node {i} stdout:\n{}\n--- node {i} stderr:\n{}",
                    read(&out),
                    read(&err)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let end = Instant::now() + deadline;
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; hosts.n];
    while statuses.iter().any(Option::is_none) {
        for (child, status) in children.iter_mut().zip(statuses.iter_mut()) {
            if status.is_none() {
                *status = child.try_wait().expect("wait for a launcher");
            }
        }
        if Instant::now() >= end && statuses.iter().any(Option::is_none) {
            for child in &mut children {
                let _ = child.kill();
                let _ = child.wait();
            }
            // The ranks left in the namespaces go with the hosts (the guard kills them).
            panic!(
                "the job did not finish within {deadline:?}; outputs:\n{}",
                outputs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    statuses
        .into_iter()
        .enumerate()
        .map(|(i, status)| {
            let (out, err) = files(i);
            NodeResult {
                status: status.expect("every launcher exited"),
                stdout: read(&out),
                stderr: read(&err),
            }
        })
        .collect()
}

/// Rank 0's table rows (`[0] ` stripped) with their out-of-place and in-place `#wrong`.
fn table_rows(stdout: &str) -> Vec<(String, String, String)> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[0] "))
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<u64>().is_ok())
        })
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 13, "unexpected table row: {l}");
            (l.to_string(), f[8].to_string(), f[12].to_string())
        })
        .collect()
}

/// Checks that every node succeeded and that rank 0's table is complete and correct.
fn check_job(results: &[NodeResult], expected_rows: usize) -> Vec<String> {
    let all = || {
        results
            .iter()
            .enumerate()
            .map(|(i, r)| {
                format!(
                    "--- node {i} ({:?}) stdout:\n{}\n--- node {i} stderr:\n{}",
                    r.status, r.stdout, r.stderr
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    for r in results {
        assert!(r.status.success(), "a node failed:\n{}", all());
    }
    let rank0 = &results[0].stdout;
    assert!(
        rank0.contains("# Out of bounds values : 0 OK"),
        "rank 0 did not report 0 wrong values:\n{}",
        all()
    );
    let rows = table_rows(rank0);
    assert_eq!(rows.len(), expected_rows, "table rows:\n{}", all());
    for (line, oop, ip) in &rows {
        assert!(oop == "0" && ip == "0", "wrong values in row: {line}");
    }
    rows.into_iter().map(|(l, _, _)| l).collect()
}

/// Emulated hosts for test `index`, one per entry of `rates` (Mbit/s), with the lock that runs
/// these tests one at a time; `None` (after saying why) where namespaces cannot be made.
fn hosts_or_skip(
    index: u32,
    rates: &[Option<u32>],
) -> Option<(std::sync::MutexGuard<'static, ()>, Hosts)> {
    let serial = serial();
    let pfx = prefix(index);
    if let Some(why) = cannot_use_namespaces(&pfx) {
        common::skip(&why);
        return None;
    }
    Some((serial, Hosts::up_with_rates(&pfx, rates)))
}

#[test]
fn netns_two_hosts_two_ranks_every_dtype() {
    let Some((_serial, hosts)) = hosts_or_skip(0, &[Some(1000); 2]) else {
        return;
    };
    let started = Instant::now();
    let results = run_job(
        &hosts,
        2,
        &[
            "bench",
            "all_reduce",
            "-b",
            "8",
            "-e",
            "1M",
            "-f",
            "8",
            "-c",
            "1",
            "-d",
            "all",
            "-n",
            "2",
            "-w",
            "1",
        ],
        &[("GRADSYNC_DEBUG", "INFO")],
        Duration::from_secs(60),
    );
    // 7 data types x sizes 8, 64, 512, 4K, 32K, 256K.
    check_job(&results, 7 * 6);
    // The ranks saw two hosts and talked over the emulated links.
    let init = results[0]
        .stderr
        .lines()
        .find(|l| l.starts_with("[0] ") && l.contains(" rank 0/4 "))
        .unwrap_or_else(|| panic!("no init line of rank 0:\n{}", results[0].stderr));
    assert!(
        init.contains(" interface eth0 ") && init.contains(" hosts 2 "),
        "{init}"
    );
    eprintln!(
        "2 hosts x 2 ranks, every dtype: ok in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn netns_four_hosts_ring_fills_link() {
    let Some((_serial, hosts)) = hosts_or_skip(1, &[Some(1000); 4]) else {
        return;
    };
    let started = Instant::now();
    let results = run_job(
        &hosts,
        1,
        &[
            "bench",
            "all_reduce",
            "-b",
            "64M",
            "-e",
            "64M",
            "-c",
            "1",
            "-n",
            "2",
            "-w",
            "1",
        ],
        &[("GRADSYNC_ALGO", "ring")],
        Duration::from_secs(60),
    );
    let rows = check_job(&results, 1);
    // Speed is measured by scripts/emuhosts.py measure, not asserted here.
    eprintln!(
        "4 hosts x 1 rank, ring, 1000 Mbit/s links ({:.1} s):\n#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n{}",
        started.elapsed().as_secs_f64(),
        rows[0]
    );
}

/// Rank 0's `gradsync doctor ARGS...` report (lines without `[0] `) on every host with `nproc`
/// ranks each; fails the test with every node's output unless every node succeeded.
fn doctor(hosts: &Hosts, nproc: usize, args: &[&str]) -> String {
    let mut all = vec!["doctor"];
    all.extend_from_slice(args);
    let results = run_job(hosts, nproc, &all, &[], Duration::from_secs(60));
    for (i, r) in results.iter().enumerate() {
        assert!(
            r.status.success(),
            "node {i} failed:\n{}\n{}",
            r.stdout,
            r.stderr
        );
    }
    let report: Vec<&str> = results[0]
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[0] "))
        .collect();
    report.join("\n")
}

/// One link line of a doctor report.
struct DoctorLink {
    slow: bool,
    ranks: (usize, usize),
    addrs: (String, String),
}

/// The link lines of a doctor report.
fn doctor_links(report: &str) -> Vec<DoctorLink> {
    report
        .lines()
        .filter(|l| l.starts_with("SLOW") || l.starts_with("  ok"))
        .map(|l| {
            // `SLOW rank   0 (10.77.18.10) <-> rank   2 (10.77.18.12)  tcp ...`
            let f: Vec<&str> = l.split_whitespace().collect();
            let rank = |s: &str| s.parse::<usize>().expect("a rank");
            let addr = |s: &str| s.trim_matches(|c| c == '(' || c == ')').to_string();
            DoctorLink {
                slow: f[0] == "SLOW",
                ranks: (rank(f[2]), rank(f[6])),
                addrs: (addr(f[3]), addr(f[7])),
            }
        })
        .collect()
}

/// The verdict lines of a doctor report, without `# verdict: `.
fn doctor_verdicts(report: &str) -> Vec<&str> {
    report
        .lines()
        .filter_map(|l| l.strip_prefix("# verdict: "))
        .collect()
}

/// Runs the doctor on `hosts` with two ranks each (small messages: the limits differ by more
/// than three times, and `--threshold 0.5` leaves room on both sides for a loaded machine,
/// where a fast link measured over a few milliseconds can lose a third of its rate),
/// checks that a link between hosts x and y is SLOW exactly where `slow(x, y)` says, and
/// that the verdict lines are `expected`, apart from lines about links inside a host (shared
/// memory between ranks that share two cores varies with the load). Returns the report.
fn check_doctor_two_ranks(
    hosts: &Hosts,
    slow: impl Fn(usize, usize) -> bool,
    expected: &[String],
) -> String {
    let started = Instant::now();
    let args = [
        "--size",
        "1M",
        "--iters",
        "2",
        "--lat-iters",
        "20",
        "--threshold",
        "0.5",
    ];
    let out = doctor(hosts, 2, &args);
    let host = |addr: &str| {
        (0..hosts.n)
            .position(|i| hosts.addr(i) == addr)
            .unwrap_or_else(|| panic!("unknown address {addr}:\n{out}"))
    };
    let links = doctor_links(&out);
    let n = 2 * hosts.n;
    assert_eq!(links.len(), n * (n - 1) / 2, "one line per link:\n{out}");
    for l in &links {
        let (x, y) = (host(&l.addrs.0), host(&l.addrs.1));
        assert_eq!(
            (x, y),
            (l.ranks.0 / 2, l.ranks.1 / 2),
            "ranks 2i and 2i+1 on host i:\n{out}"
        );
        if x != y {
            assert_eq!(
                l.slow,
                slow(x, y),
                "link {:?} between hosts {x} and {y}:\n{out}",
                l.ranks
            );
        }
    }
    let verdicts: Vec<&str> = doctor_verdicts(&out)
        .into_iter()
        .filter(|v| !v.contains(" inside host "))
        .collect();
    assert_eq!(verdicts, expected, "verdict:\n{out}");
    eprintln!(
        "{}\n{} hosts x 2 ranks: doctor in {:.1} s",
        out.lines()
            .filter(|l| l.starts_with("# verdict") || l.starts_with("SLOW"))
            .collect::<Vec<_>>()
            .join("\n"),
        hosts.n,
        started.elapsed().as_secs_f64()
    );
    out
}

/// Four hosts, host 2's link at half the rate of the others: `gradsync doctor` flags exactly the
/// three links of host 2 and names that host.
#[test]
fn netns_doctor_names_the_slow_host() {
    let Some((_serial, hosts)) = hosts_or_skip(3, &[Some(1000), Some(1000), Some(500), Some(1000)])
    else {
        return;
    };
    let out = doctor(
        &hosts,
        1,
        &["--size", "2M", "--iters", "3", "--lat-iters", "50"],
    );
    eprintln!("{out}");
    let links = doctor_links(&out);
    let slow: Vec<&DoctorLink> = links.iter().filter(|l| l.slow).collect();
    assert_eq!(
        slow.len(),
        3,
        "exactly host 2's three links are slow:\n{out}"
    );
    assert_eq!(links.len(), 6, "the other three links are fine:\n{out}");
    let host2 = hosts.addr(2);
    assert!(
        slow.iter()
            .all(|l| l.addrs.0 == host2 || l.addrs.1 == host2),
        "every slow link involves host 2 ({host2}):\n{out}"
    );
    assert!(
        out.contains(&format!("verdict: slow host {host2} (rank 2)")),
        "the verdict names host 2:\n{out}"
    );
    assert!(out.contains(" mtu 1500 "), "MTU reported:\n{out}");
    assert!(out.contains("numa: "), "NUMA placement reported:\n{out}");
}

/// The verdict line of a slow host of two ranks on four hosts of two ranks.
fn slow_host_verdict(hosts: &Hosts, i: usize) -> String {
    format!(
        "slow host {} (ranks {}, {}): all 12 of its links to other hosts below 50% of the \
         fastest link between hosts",
        hosts.addr(i),
        2 * i,
        2 * i + 1
    )
}

/// Four hosts of two ranks, host 2's link at 300 Mbit/s and the others at 1 Gbit/s: the 12
/// links between host 2 and the others are slow, and the verdict names host 2 with its two
/// ranks, whatever the links inside the hosts do.
#[test]
fn netns_doctor_names_the_slow_host_of_two_ranks() {
    let Some((_serial, hosts)) = hosts_or_skip(4, &[Some(1000), Some(1000), Some(300), Some(1000)])
    else {
        return;
    };
    check_doctor_two_ranks(
        &hosts,
        |x, y| x == 2 || y == 2,
        &[slow_host_verdict(&hosts, 2)],
    );
}

/// Four hosts of two ranks, hosts 1 and 2 at 300 Mbit/s: 20 of the 24 links between hosts are
/// slow, and the verdict names both hosts.
#[test]
fn netns_doctor_names_two_slow_hosts() {
    let Some((_serial, hosts)) = hosts_or_skip(5, &[Some(1000), Some(300), Some(300), Some(1000)])
    else {
        return;
    };
    check_doctor_two_ranks(
        &hosts,
        |x, y| [x, y].iter().any(|&h| h == 1 || h == 2),
        &[slow_host_verdict(&hosts, 1), slow_host_verdict(&hosts, 2)],
    );
}

/// Four hosts of two ranks at 1 Gbit/s, the traffic between hosts 1 and 3 at 300 Mbit/s (an
/// HTB class for the other's address on the upload of each): the four links between them are
/// slow, and the verdict names that pair of hosts as a link, no host.
#[test]
fn netns_doctor_names_a_slow_pair_as_a_link() {
    let Some((_serial, hosts)) = hosts_or_skip(6, &[Some(1000); 4]) else {
        return;
    };
    hosts.limit_pair(1, 3, 300);
    check_doctor_two_ranks(
        &hosts,
        |x, y| (x.min(y), x.max(y)) == (1, 3),
        &[format!(
            "slow link between hosts {} (ranks 2, 3) and {} (ranks 6, 7): all 4 links between \
             them below 50% of the fastest link between hosts",
            hosts.addr(1),
            hosts.addr(3)
        )],
    );
}

/// Reads the hosts' TCP counters as `emuhosts.py measure --nstat` does, sends 100 kB over
/// loopback inside host 0, reads them again; prints both lists as JSON. Arguments: the
/// script's folder, `up`'s description.
const NSTAT_CHECK: &str = r#"
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import emuhosts
desc = json.loads(sys.argv[2])
before = emuhosts.tcp_counters(desc)
send = ("import socket\n"
        "s = socket.create_server(('127.0.0.1', 0))\n"
        "c = socket.create_connection(s.getsockname())\n"
        "c.sendall(b'x' * 100000)\n"
        "c.close()\n")
subprocess.run(["ip", "netns", "exec", desc["hosts"][0]["namespace"], "python3", "-c", send],
               check=True)
print(json.dumps([before, emuhosts.tcp_counters(desc)]))
"#;

/// Reads the token buckets' drops around a burst of UDP from host 1 to host 0 (18 MB in
/// datagrams of 60 kB, through a socket buffer of 16 MB, forced), faster than host 1's upload
/// takes and larger than its queue: the upload's count grows. Prints `[before, after]`, each
/// `[uploads, downloads]`.
const DROPS_CHECK: &str = r#"
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import emuhosts
desc = json.loads(sys.argv[2])
before = emuhosts.queue_drops(desc)
send = ("import socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "s.setsockopt(socket.SOL_SOCKET, 32, 16 << 20)\n"
        "for _ in range(300):\n"
        "    s.sendto(b'x' * 60000, (%r, 9))\n" % desc["hosts"][0]["address"])
subprocess.run(["ip", "netns", "exec", desc["hosts"][1]["namespace"], "python3", "-c", send],
               check=True)
print(json.dumps([before, emuhosts.queue_drops(desc)]))
"#;

#[test]
fn netns_script_up_exec_down() {
    let _serial = serial();
    let pfx = prefix(2);
    if let Some(why) = cannot_use_namespaces(&pfx) {
        common::skip(&why);
        return;
    }
    if !sh("python3", &["--version"]).0 {
        common::skip("python3 not found");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/emuhosts.py");
    let script = script.to_str().expect("utf-8 path");
    // Removes whatever the script leaves, should an assertion fail.
    let guard = Hosts::named(&pfx, 2);
    let desc = must(
        "python3",
        &[
            script,
            "up",
            "--name",
            &pfx,
            "--hosts",
            "2",
            "--rate",
            "1000",
            "--rate-of",
            "1=100",
            "--cc",
            "reno",
            "--queue-ms",
            "4",
            "--nic-queue-ms",
            "20",
        ],
    );
    let desc: serde_json::Value = serde_json::from_str(&desc).expect("up prints JSON");
    assert_eq!(desc["bridge"], guard.bridge().as_str(), "{desc}");
    for i in 0..2 {
        let host = &desc["hosts"][i];
        assert_eq!(host["namespace"], guard.ns(i).as_str(), "{desc}");
        assert_eq!(host["address"], guard.addr(i).as_str(), "{desc}");
        assert_eq!(host["bridge_port"], guard.port(i).as_str(), "{desc}");
        // Reno is built into every kernel; the namespace reports what it runs.
        assert_eq!(host["tcp_cc"], "reno", "{desc}");
    }
    assert_eq!(desc["hosts"][1]["rate_mbit"], 100, "{desc}");
    assert_eq!(desc["hosts"][1]["tbf"]["latency"], "4ms", "{desc}");
    assert_eq!(desc["hosts"][1]["tbf"]["upload_latency"], "20ms", "{desc}");
    let exec = |args: &[&str]| {
        let mut all = vec![script, "exec", "--name", &pfx, "--host", "1", "--"];
        all.extend_from_slice(args);
        must("python3", &all)
    };
    let cc = exec(&["sysctl", "-n", "net.ipv4.tcp_congestion_control"]);
    assert_eq!(cc.trim(), "reno", "host 1 runs {cc}");
    // `measure --nstat` reads every host's TCP counters: a transfer inside host 0 raises its
    // segments sent, and every counter is read.
    let counters = must(
        "python3",
        &[
            "-c",
            NSTAT_CHECK,
            Path::new(script).parent().unwrap().to_str().unwrap(),
            &desc.to_string(),
        ],
    );
    let counters: Vec<Vec<u64>> = serde_json::from_str(counters.trim()).expect("JSON");
    assert_eq!(counters.len(), 2, "{counters:?}");
    assert_eq!(counters[0].len(), 6, "{counters:?}");
    assert_eq!(counters[1].len(), 6, "{counters:?}");
    assert!(
        counters[1][0] > counters[0][0],
        "segments sent did not grow: {counters:?}"
    );
    let addr = exec(&["ip", "-o", "addr", "show", "dev", "eth0"]);
    assert!(addr.contains(&format!("{}/24", guard.addr(1))), "{addr}");
    let qdisc = exec(&["tc", "qdisc", "show", "dev", "eth0"]);
    // The upload (the host's own queue) queues at most the 20 ms given, the download (the
    // switch's port) the 4 ms (`lat`).
    assert!(
        qdisc.contains("tbf") && qdisc.contains("100Mbit") && qdisc.contains("lat 20ms"),
        "{qdisc}"
    );
    // What a full upload queue drops is counted (`measure --nstat`). Host 1 uploads at
    // 100 Mbit/s so that one Python sender outruns it: at 500 Mbit/s the sender was at times
    // held to the rate itself (18 MB in 0.29 s, its CPU busy throughout, nothing dropped).
    let drops = must(
        "python3",
        &[
            "-c",
            DROPS_CHECK,
            Path::new(script).parent().unwrap().to_str().unwrap(),
            &desc.to_string(),
        ],
    );
    let drops: Vec<Vec<u64>> = serde_json::from_str(drops.trim()).expect("JSON");
    assert!(
        drops.len() == 2 && drops[0].len() == 2 && drops[1][0] > drops[0][0],
        "the upload dropped nothing of a burst larger than its queue: {drops:?}"
    );
    let qdisc = must("tc", &["qdisc", "show", "dev", &guard.port(0)]);
    assert!(
        qdisc.contains("tbf") && qdisc.contains("1Gbit") && qdisc.contains("lat 4ms"),
        "{qdisc}"
    );
    must("python3", &[script, "down", "--name", &pfx]);
    assert!(!guard.any_left(), "down left namespaces or links of {pfx}");
    // Idempotent.
    must("python3", &[script, "down", "--name", &pfx]);
    // A congestion control a namespace may not choose is named with what it may, before any
    // host is made.
    let (ok, out) = sh(
        "python3",
        &[
            script, "up", "--name", &pfx, "--hosts", "1", "--cc", "nosuchcc",
        ],
    );
    assert!(!ok, "up --cc nosuchcc succeeded: {out}");
    assert!(
        out.contains("--cc nosuchcc") && out.contains("net.ipv4.tcp_allowed_congestion_control"),
        "{out}"
    );
    assert!(
        !guard.any_left(),
        "a refused up left namespaces or links of {pfx}"
    );
}
