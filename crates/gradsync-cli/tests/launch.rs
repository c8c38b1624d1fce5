//! `gradsync launch`, run as a binary: environment, output prefixes, failure propagation and
//! signal forwarding.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");

fn launch(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("launch")
        .args(args)
        .output()
        .expect("run gradsync launch")
}

fn stdout_lines(out: &Output) -> Vec<String> {
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    lines.sort();
    lines
}

fn send(signal: &str, pid: u32) {
    let status = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn ranks_get_torchrun_environment_and_prefixes() {
    let out = launch(&[
        "--nproc",
        "3",
        "--",
        "sh",
        "-c",
        "echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR; echo e$LOCAL_WORLD_SIZE$GROUP_RANK$NODE_RANK$GRADSYNC_LAUNCHED >&2",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout_lines(&out),
        [
            "[0] 0 3 0 127.0.0.1",
            "[1] 1 3 1 127.0.0.1",
            "[2] 2 3 2 127.0.0.1"
        ]
    );
    let mut err: Vec<&str> = std::str::from_utf8(&out.stderr).unwrap().lines().collect();
    err.sort();
    assert_eq!(err, ["[0] e3001", "[1] e3001", "[2] e3001"]);
}

/// CPUs this process may run on.
fn allowed_cpus() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string();
    list.split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

#[test]
fn ranks_are_spread_over_the_cpus_when_asked() {
    let cpus = allowed_cpus();
    let nproc = 2;
    let show = "grep Cpus_allowed_list /proc/self/status";
    let spread = launch(&["--nproc", "2", "--bind", "spread", "--", "sh", "-c", show]);
    assert!(spread.status.success(), "{spread:?}");
    let lists: Vec<String> = stdout_lines(&spread)
        .iter()
        .map(|l| l.rsplit('\t').next().unwrap().trim().to_string())
        .collect();
    assert_eq!(lists.len(), nproc, "{lists:?}");
    if cpus >= nproc {
        // Each rank has its own share: disjoint, and no rank has every CPU.
        assert_ne!(lists[0], lists[1], "{lists:?}");
    } else {
        common::skip(&format!(
            "the spread check: {cpus} CPU(s) for {nproc} ranks binds nothing"
        ));
    }
    let none = launch(&["--nproc", "2", "--", "sh", "-c", show]);
    assert!(none.status.success(), "{none:?}");
    let lists: Vec<String> = stdout_lines(&none)
        .iter()
        .map(|l| l.rsplit('\t').next().unwrap().trim().to_string())
        .collect();
    assert_eq!(
        lists[0], lists[1],
        "unbound ranks keep the launcher's CPUs: {lists:?}"
    );
    let bad = launch(&["--nproc", "2", "--bind", "core", "--", "true"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--bind"),
        "{bad:?}"
    );
}

#[test]
fn every_rank_gets_the_same_free_port() {
    let out = launch(&["--nproc", "2", "--", "sh", "-c", "echo $MASTER_PORT"]);
    assert!(out.status.success());
    let ports: Vec<u16> = stdout_lines(&out)
        .iter()
        .map(|l| l.split_once(' ').unwrap().1.parse().unwrap())
        .collect();
    assert_eq!(ports.len(), 2);
    assert_eq!(ports[0], ports[1]);
    assert_ne!(ports[0], 0);
}

#[test]
fn multi_node_ranks() {
    let out = launch(&[
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master",
        "10.1.2.3:29555",
        "--",
        "sh",
        "-c",
        "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout_lines(&out),
        [
            "[2] 2 4 0 2 1 10.1.2.3 29555",
            "[3] 3 4 1 2 1 10.1.2.3 29555"
        ]
    );
}

#[test]
fn bad_options_are_refused() {
    let out = launch(&["--nproc", "2", "--nnodes", "2", "--", "true"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--master"),
        "{out:?}"
    );
    let out = launch(&[
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "2",
        "--master",
        "h:1",
        "--",
        "true",
    ]);
    assert!(!out.status.success());
    let out = launch(&["--nproc", "0", "--", "true"]);
    assert!(!out.status.success());
    let out = launch(&["--nproc", "1", "--", "/nonexistent/program"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot start rank 0"),
        "{out:?}"
    );
}

#[test]
fn no_prefix_and_unterminated_lines() {
    let out = launch(&[
        "--nproc",
        "1",
        "--no-prefix",
        "--",
        "sh",
        "-c",
        "echo plain",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "plain\n");
    let out = launch(&["--nproc", "1", "--", "printf", "a\\nb"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "[0] a\n[0] b\n");
}

#[test]
fn lines_of_ranks_do_not_interleave() {
    let script = "i=0; while [ $i -lt 300 ]; do echo rank$RANK-line$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; i=$((i+1)); done";
    let out = launch(&["--nproc", "3", "--", "sh", "-c", script]);
    assert!(out.status.success());
    let lines = stdout_lines(&out);
    assert_eq!(lines.len(), 900);
    for line in &lines {
        let (prefix, rest) = line.split_once(' ').unwrap();
        let rank = prefix.trim_start_matches('[').trim_end_matches(']');
        assert!(rest.starts_with(&format!("rank{rank}-line")), "{line}");
        assert!(
            rest.ends_with("-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"),
            "{line}"
        );
    }
}

#[test]
fn a_failing_rank_stops_the_others_with_its_code() {
    let start = Instant::now();
    let out = launch(&[
        "--nproc",
        "3",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then exit 7; fi; sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 1") && err.contains("exit code 7"),
        "{err}"
    );
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_signal() {
    let start = Instant::now();
    let out = launch(&[
        "--nproc",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 0 ]; then kill -KILL $$; fi; sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(137), "{out:?}");
    assert!(start.elapsed() < Duration::from_secs(10));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 0") && err.contains("SIGKILL"), "{err}");
}

#[test]
fn ranks_ignoring_sigterm_are_killed_after_the_grace_period() {
    let start = Instant::now();
    let out = launch(&[
        "--nproc",
        "3",
        "--grace-secs",
        "0.5",
        "--",
        "sh",
        "-c",
        "trap '' TERM; if [ $RANK = 2 ]; then exit 3; fi; exec sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
}

/// Starts `ranks` ranks that print their pid then run `tail`; returns the launcher and pids.
fn start_ranks(
    ranks: usize,
    tail: &str,
) -> (
    std::process::Child,
    Vec<u32>,
    BufReader<std::process::ChildStdout>,
) {
    let mut child = Command::new(BIN)
        .args(["launch", "--nproc", &ranks.to_string(), "--", "sh", "-c"])
        .arg(format!("echo $$; {tail}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut pids = Vec::new();
    for _ in 0..ranks {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        pids.push(line.trim().split_once(' ').unwrap().1.parse().unwrap());
    }
    (child, pids, out)
}

fn wait_with_deadline(
    child: &mut std::process::Child,
    limit: Duration,
) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("launcher still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_to_the_launcher_reaches_every_rank() {
    let (mut child, pids, _out) = start_ranks(3, "exec sleep 30");
    assert!(pids.iter().all(|&p| alive(p)));
    send("TERM", child.id());
    let status = wait_with_deadline(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(128 + 15));
    for pid in pids {
        assert!(!alive(pid), "rank pid {pid} survived");
    }
}

#[test]
fn sigint_is_forwarded_as_sigint() {
    let (mut child, _pids, mut out) = start_ranks(
        2,
        "trap 'echo got-int; exit 0' INT; while :; do sleep 0.05; done",
    );
    send("INT", child.id());
    let status = wait_with_deadline(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(128 + 2));
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let mut lines: Vec<&str> = rest.lines().collect();
    lines.sort();
    assert_eq!(lines, ["[0] got-int", "[1] got-int"]);
}
