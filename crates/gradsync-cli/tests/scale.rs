//! `gradsync scale`: predictions that can be checked by hand, and a crossover summary that agrees
//! with the table.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");

/// Runs `gradsync scale ARGS --json FILE`; returns stdout and the JSON report.
fn scale(args: &[&str], tag: &str) -> (String, Value) {
    let dir = std::env::temp_dir().join(format!("gradsync-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json: PathBuf = dir.join(format!("{tag}.json"));
    let out = Command::new(BIN)
        .arg("scale")
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run gradsync scale");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    (stdout, report)
}

/// The point of `world` ranks and `bytes` bytes.
fn point(report: &Value, world: u64, bytes: u64) -> &Value {
    report["points"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["world"] == world && p["bytes"] == bytes)
        .unwrap_or_else(|| panic!("no point for {world} ranks, {bytes} bytes"))
}

/// Predicted seconds of `algo` at a point.
fn time(p: &Value, algo: &str) -> f64 {
    p["predictions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["algorithm"] == algo)
        .unwrap_or_else(|| panic!("no {algo} in {p}"))["time_s"]
        .as_f64()
        .unwrap_or_else(|| panic!("{algo} was not predicted in {p}"))
}

const GIB: u64 = 1 << 30;
const ALPHA: f64 = 2e-6;
const BYTES_PER_S: f64 = 400e9 / 8.0;

#[test]
fn scale_predicts_the_ring_by_the_book_and_crossovers_that_match_the_table() {
    let (stdout, report) = scale(
        &[
            "--worlds",
            "8,64",
            "--min-bytes",
            "8",
            "--max-bytes",
            "1G",
            "--factor",
            "32",
        ],
        "sweep",
    );
    assert!(
        stdout.contains("alpha 2 us") && stdout.contains("400 Gbit/s"),
        "{stdout}"
    );
    assert!(stdout.contains("segment 512 KiB"), "{stdout}");

    for world in [8u64, 64] {
        let n = world as f64;
        // Every candidate of the library, in its order.
        let want: Vec<String> = gradsync::cost::all_reduce_candidates(world as usize, 0)
            .iter()
            .map(|a| a.name().to_string())
            .collect();
        let big = point(&report, world, GIB);
        let got: Vec<String> = big["predictions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["algorithm"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(got, want);

        // The ring in 512 KiB segments: 2 (n - 1) steps, each of B / n bytes in
        // ceil(B / n / 512 KiB) messages.
        let block = GIB as f64 / n;
        let msgs = (block / (512.0 * 1024.0)).ceil();
        let want = 2.0 * (n - 1.0) * (msgs * ALPHA + block / BYTES_PER_S);
        let ring = time(big, "ring");
        assert!(
            (ring - want).abs() < 0.01 * want,
            "n={world}: {ring} vs {want}"
        );
        // Ring or Rabenseifner beat recursive doubling on large buffers ...
        let bw = time(big, "ring").min(time(big, "rabenseifner"));
        assert!(bw < time(big, "recursive_doubling"), "{big}");
        assert!(big["best"] != "recursive_doubling");
    }
    // ... and recursive doubling wins on 8 bytes over 64 ranks.
    assert_eq!(point(&report, 64, 8)["best"], "recursive_doubling");

    // The summary agrees with the table: each point's best is the fastest prediction, and the
    // spans list the bests in order of size, each from the size after the previous span.
    let points = report["points"].as_array().unwrap();
    for c in report["crossovers"].as_array().unwrap() {
        let world = c["world"].as_u64().unwrap();
        let pts: Vec<&Value> = points.iter().filter(|p| p["world"] == world).collect();
        let mut at = 0;
        for span in c["spans"].as_array().unwrap() {
            let algo = span["algorithm"].as_str().unwrap();
            assert_eq!(span["from_bytes"], pts[at]["bytes"], "{c}");
            while at < pts.len() && pts[at]["bytes"].as_u64() <= span["to_bytes"].as_u64() {
                let p = pts[at];
                assert_eq!(p["best"], algo, "{c}\n{p}");
                let fastest = p["predictions"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|q| q["time_s"].as_f64())
                    .fold(f64::INFINITY, f64::min);
                assert_eq!(time(p, algo), fastest, "{p}");
                at += 1;
            }
        }
        assert_eq!(at, pts.len(), "the spans cover every size: {c}");
        let text = c["text"].as_str().unwrap();
        assert!(stdout.contains(text), "{text} not in\n{stdout}");
        assert!(
            text.starts_with(&format!("n={world}: recursive_doubling")),
            "{text}"
        );
        assert!(text.ends_with(" < ring"), "{text}");
    }
}

#[test]
fn unsegmented_ring_matches_the_textbook_formula() {
    // With segments as large as the buffer every ring step is one message:
    // 2 (n - 1) / n * B / bw + 2 (n - 1) alpha.
    let (_, report) = scale(
        &[
            "--worlds",
            "8,64",
            "--min-bytes",
            "256M",
            "--max-bytes",
            "1G",
            "--segment-bytes",
            "1G",
        ],
        "unsegmented",
    );
    for world in [8u64, 64] {
        let n = world as f64;
        for bytes in [256u64 << 20, GIB] {
            let want = 2.0 * (n - 1.0) / n * bytes as f64 / BYTES_PER_S + 2.0 * (n - 1.0) * ALPHA;
            let ring = time(point(&report, world, bytes), "ring");
            assert!(
                (ring - want).abs() < 0.02 * want,
                "n={world} B={bytes}: {ring} vs {want}"
            );
        }
    }
}

#[test]
fn symmetric_schedules_replay_one_rank_and_the_budget_skips_the_rest() {
    let (stdout, report) = scale(
        &[
            "--worlds",
            "64",
            "--min-bytes",
            "64K",
            "--max-bytes",
            "64K",
            "--max-ops",
            "100",
        ],
        "budget",
    );
    let p = point(&report, 64, 64 << 10);
    let method = |algo: &str| {
        p["predictions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["algorithm"] == algo)
            .unwrap()["method"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(method("ring"), "rotation");
    assert_eq!(method("recursive_doubling"), "xor");
    // Halving-doubling sends one message per step here, to a partner at a fixed xor distance.
    assert_eq!(method("rabenseifner"), "xor");
    // A binomial tree over 64 ranks has more than 100 ops (two per edge and direction).
    assert_eq!(method("tree"), "skipped");
    assert!(p["predictions"][3]["time_s"].is_null(), "{p}");
    assert!(stdout.contains("skipped"), "{stdout}");
    assert!(
        stdout.contains("(not simulated, over --max-ops: tree 64 KiB, double_tree 64 KiB)"),
        "{stdout}"
    );
}

#[test]
fn scale_rejects_impossible_options() {
    let out = Command::new(BIN)
        .args(["scale", "--min-bytes", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--min-bytes"), "{err}");
    let out = Command::new(BIN)
        .args(["scale", "--worlds", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}
