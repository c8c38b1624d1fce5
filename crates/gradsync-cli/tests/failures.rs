//! Failures across processes, through `gradsync launch`: a killed rank is named by every
//! survivor within seconds; a stopped rank is named by every other rank when the deadline
//! (`GRADSYNC_TIMEOUT`) passes.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");

/// These tests time how fast failures surface; run them one at a time so that they do not
/// starve each other of the machine's cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Job {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
}

/// Starts 4 ranks running a long loop of 16 MiB all-reduces.
fn start(timeout_s: &str, flight_dir: &std::path::Path) -> Job {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "launch",
        "--nproc",
        "4",
        "--failure-wait-secs",
        "8",
        "--grace-secs",
        "1",
        "--",
    ])
    .args([
        BIN,
        "bench",
        "all_reduce",
        "-b",
        "16M",
        "-e",
        "16M",
        "-n",
        "100000",
        "-w",
        "1",
        "-c",
        "0",
    ])
    .env("GRADSYNC_TIMEOUT", timeout_s)
    .env("GRADSYNC_FLIGHT_DIR", flight_dir)
    .env_remove("RANK");
    spawn(cmd)
}

/// Starts `cmd` with its stdout and stderr lines collected with their arrival times.
fn spawn(mut cmd: Command) -> Job {
    let mut child = cmd
        .env_remove("RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gradsync launch");
    let lines = Arc::new(Mutex::new(Vec::new()));
    for pipe in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push((Instant::now(), l));
            }
        });
    }
    Job { child, lines }
}

/// Waits for the bench header and returns the pid of `rank`.
fn pid_of(job: &Job, rank: usize) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for (_, l) in job.lines.lock().unwrap().iter() {
            // "[0] #  Rank  2 Pid  12345 on  host"
            let f: Vec<&str> = l.split_whitespace().collect();
            if let Some(i) = f.iter().position(|w| *w == "Rank")
                && f.get(i + 1) == Some(&rank.to_string().as_str())
                && f.get(i + 2) == Some(&"Pid")
            {
                return f[i + 3].parse().unwrap();
            }
        }
        assert!(Instant::now() < deadline, "no bench header within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn signal(pid: i32, sig: &str) {
    assert!(
        Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

fn finish(mut job: Job) -> Vec<(Instant, String)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while job.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "launcher did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    job.lines.lock().unwrap().clone()
}

/// The first error line each surviving rank printed, with its time.
fn errors_of(lines: &[(Instant, String)], rank: usize) -> Option<(Instant, String)> {
    let tag = format!("[{rank}] ");
    lines
        .iter()
        .find(|(_, l)| l.starts_with(&tag) && l.contains("error:"))
        .cloned()
}

#[test]
fn killed_rank_is_named_by_every_survivor_within_5_s() {
    let _serial = serial();
    let dir = tempdir("kill");
    let job = start("60", &dir);
    let victim = pid_of(&job, 2);
    std::thread::sleep(Duration::from_millis(1500));
    let t_kill = Instant::now();
    signal(victim, "-KILL");
    let lines = finish(job);
    let all: Vec<&str> = lines.iter().map(|(_, l)| l.as_str()).collect();
    for r in [0, 1, 3] {
        let (t, l) = errors_of(&lines, r)
            .unwrap_or_else(|| panic!("rank {r} reported no error:\n{}", all.join("\n")));
        assert!(l.contains("rank 2"), "rank {r} does not name rank 2: {l}");
        assert!(
            t - t_kill < Duration::from_secs(5),
            "rank {r} took {:?}: {l}",
            t - t_kill
        );
    }
}

#[test]
fn stopped_rank_is_named_by_every_other_rank_at_the_deadline() {
    let _serial = serial();
    let dir = tempdir("stop");
    let job = start("2", &dir);
    let victim = pid_of(&job, 1);
    std::thread::sleep(Duration::from_millis(1000));
    let t_stop = Instant::now();
    signal(victim, "-STOP");
    let lines = finish(job);
    let _ = Command::new("kill")
        .args(["-CONT", &victim.to_string()])
        .stderr(Stdio::null())
        .status();
    let all: Vec<&str> = lines.iter().map(|(_, l)| l.as_str()).collect();
    for r in [0, 2, 3] {
        let (t, l) = errors_of(&lines, r)
            .unwrap_or_else(|| panic!("rank {r} reported no error:\n{}", all.join("\n")));
        assert!(
            l.contains("rank 1 did not answer"),
            "rank {r} does not name rank 1: {l}"
        );
        let after = t - t_stop;
        assert!(
            after >= Duration::from_millis(1000) && after < Duration::from_secs(8),
            "rank {r} after {after:?}: {l}"
        );
    }
    // Every survivor wrote its flight recorder; reading them names the stopped rank, which
    // wrote none.
    let out = Command::new(BIN).arg("flight").arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let verdict = text
        .lines()
        .find(|l| l.starts_with("verdict:"))
        .unwrap_or_else(|| panic!("no verdict:\n{text}"));
    assert!(verdict.contains("rank 1"), "{text}");
    eprintln!("{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("gradsync-failures-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn survivors_of_a_killed_rank_shrink_and_go_on_correctly() {
    let _serial = serial();
    let dir = tempdir("shrink");
    let mut cmd = Command::new(BIN);
    cmd.args(["launch", "--nproc", "4", "--failure-wait-secs", "60", "--"])
        .args([
            BIN,
            "bench",
            "all_reduce",
            "-b",
            "4M",
            "-e",
            "4M",
            "-n",
            "2000",
            "-w",
            "1",
            "-c",
            "1",
            "--shrink-on-failure",
        ])
        .env("GRADSYNC_TIMEOUT", "30")
        .env("GRADSYNC_FLIGHT_DIR", &dir);
    let job = spawn(cmd);
    let victim = pid_of(&job, 2);
    // Early in the run: 300 calls of 4 MiB took about 1 s here, and a victim that had
    // finished them could not be killed.
    std::thread::sleep(Duration::from_millis(300));
    signal(victim, "-KILL");
    let lines = finish(job);
    let text: Vec<String> = lines.into_iter().map(|(_, l)| l).collect();
    let all = text.join("\n");
    for (old, new) in [(0, 0), (1, 1), (3, 2)] {
        let want = format!("[{old}] # rank {old}: lost rank(s) [2]");
        let l = text
            .iter()
            .find(|l| l.starts_with(&want))
            .unwrap_or_else(|| panic!("rank {old} did not shrink:\n{all}"));
        assert!(
            l.ends_with(&format!("continuing as rank {new} of 3")),
            "{l}"
        );
    }
    assert!(
        text.iter()
            .any(|l| l == "[0] # Out of bounds values : 0 OK"),
        "after the shrink the results must be exact:\n{all}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
