//! `gradsync flight` on hand-made flight-recorder dumps.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");

/// A fresh empty directory under the system temporary directory.
fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("gradsync-flight-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One operation as a dump writes it.
fn op(seq: u64, state: &str, started: u64) -> String {
    let ended = if state == "started" {
        "null".to_string()
    } else {
        (started + 4_200).to_string()
    };
    format!(
        r#"{{"seq":{seq},"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"algorithm":"ring","peers":[1,3],"state":"{state}","started_unix_us":{started},"ended_unix_us":{ended},"bytes":4194304,"error":null}}"#
    )
}

/// Writes rank `rank`'s dump: seqs 39..=41 completed, then seq 42 started unless `behind`.
fn write_dump(dir: &Path, rank: usize, behind: bool) -> PathBuf {
    let t0 = 1_718_000_010_000_000u64;
    let mut ops: Vec<String> = (39..=41)
        .map(|s| op(s, "completed", t0 + (s - 39) * 10_000))
        .collect();
    if !behind {
        ops.push(op(42, "started", t0 + 30_000));
    }
    let reason = if behind { "SIGUSR1" } else { "timeout" };
    let text = format!(
        "{{\n  \"rank\": {rank},\n  \"world\": 4,\n  \"host\": \"node1\",\n  \"pid\": {pid},\n  \
         \"comm_id\": \"5f3a9c2e11d04b7a\",\n  \"dumped_unix_us\": {dumped},\n  \
         \"reason\": \"{reason}\",\n  \"capacity\": 64,\n  \"recorded\": {n},\n  \
         \"ops\": [\n    {ops}\n  ]\n}}\n",
        pid = 48211 + rank,
        dumped = t0 + 2_034_000,
        n = ops.len() + 38,
        ops = ops.join(",\n    "),
    );
    let path = dir.join(format!("gradsync-flight-5f3a9c2e11d04b7a-r{rank}.json"));
    std::fs::write(&path, text).unwrap();
    path
}

fn flight(args: &[&Path]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .arg("flight")
        .args(args)
        .output()
        .expect("run gradsync");
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn verdict(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|l| l.starts_with("verdict: "))
        .unwrap_or_else(|| panic!("no verdict in:\n{stdout}"))
}

#[test]
fn names_rank_2_as_behind() {
    let dir = temp_dir("behind");
    let files: Vec<PathBuf> = (0..4).map(|r| write_dump(&dir, r, r == 2)).collect();
    let args: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let (ok, stdout, stderr) = flight(&args);
    assert!(ok, "{stderr}");
    assert_eq!(
        verdict(&stdout),
        "verdict: rank 2 is behind: ranks 0,1,3 are in all_reduce seq 42 (started), \
         rank 2 last started seq 41 (completed)",
        "{stdout}"
    );
    assert!(
        stdout.starts_with("communicator 5f3a9c2e11d04b7a: world 4, 4 dumps\n"),
        "{stdout}"
    );
    // The table: one row per rank, rank 2 idle after seq 41, the others 2.004 s into seq 42.
    let row = |r: usize| {
        stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&r.to_string()))
            .unwrap_or_else(|| panic!("no row for rank {r}:\n{stdout}"))
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        row(0),
        [
            "0",
            "node1",
            "48211",
            "timeout",
            "41",
            "all_reduce",
            "42",
            "all_reduce",
            "started",
            "2.004",
            "s"
        ]
    );
    assert_eq!(
        row(2),
        [
            "2",
            "node1",
            "48213",
            "SIGUSR1",
            "41",
            "all_reduce",
            "-",
            "-"
        ]
    );

    // A directory argument reads every dump in it.
    let (ok, by_dir, _) = flight(&[dir.as_path()]);
    assert!(ok);
    assert_eq!(by_dir, stdout);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn names_a_missing_rank() {
    let dir = temp_dir("missing");
    let files: Vec<PathBuf> = [0, 1, 3]
        .iter()
        .map(|&r| write_dump(&dir, r, false))
        .collect();
    let args: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let (ok, stdout, stderr) = flight(&args);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("no dump from rank 2"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["2", "-", "-", "missing", "-", "-", "-"]),
        "{stdout}"
    );
    assert_eq!(
        verdict(&stdout),
        "verdict: rank 2 is missing (no dump): ranks 0,1,3 are in all_reduce seq 42 (started); \
         it may have died or not received the signal"
    );

    // Rank 3 behind as well as rank 2 missing: both are named.
    write_dump(&dir, 3, true);
    let (ok, stdout, _) = flight(&args);
    assert!(ok);
    assert_eq!(
        verdict(&stdout),
        "verdict: rank 3 is behind: ranks 0,1 are in all_reduce seq 42 (started), \
         rank 3 last started seq 41 (completed); no dump from rank 2 (missing)"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unreadable_dumps_are_named_and_skipped() {
    let dir = temp_dir("garbage");
    let good = write_dump(&dir, 0, false);
    let bad = dir.join("gradsync-flight-5f3a9c2e11d04b7a-r1.json");
    std::fs::write(&bad, "{\"rank\": 1, \"wor").unwrap();
    let absent = dir.join("nope.json");
    let (ok, stdout, stderr) = flight(&[&good, &bad, &absent]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("r1.json") && stderr.contains("nope.json"),
        "{stderr}"
    );
    assert!(stdout.contains("verdict: "), "{stdout}");
    // Nothing readable at all is an error.
    let (ok, _, stderr) = flight(&[&bad]);
    assert!(!ok);
    assert!(stderr.contains("no flight-recorder dump"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
