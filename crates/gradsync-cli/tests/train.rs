//! `gradsync train` end to end: real ranks over loopback on Fashion-MNIST.

mod common;

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");
const DATA: &str = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";

fn train(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("train")
        .args(args)
        .env_remove("RANK")
        .env_remove("GRADSYNC_BUCKET_MB")
        .output()
        .expect("run gradsync train")
}

/// Whether the dataset is installed; prints why a test is skipped when it is not.
fn have_data() -> bool {
    let ok = Path::new(DATA).is_file();
    if !ok {
        common::skip(&format!(
            "Fashion-MNIST is not installed ({DATA} is missing; apt-get install dataset-fashion-mnist)"
        ));
    }
    ok
}

/// The loss of every `step N/M  loss L ...` line.
fn losses(text: &str) -> Vec<f64> {
    text.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| {
            let mut words = l.split_whitespace();
            words.find(|&w| w == "loss").expect("a loss column");
            words.next().unwrap().parse().expect("a number")
        })
        .collect()
}

#[test]
fn two_ranks_with_accumulation_learn_and_stay_identical() {
    if !have_data() {
        return;
    }
    let out = train(&[
        "--nproc",
        "2",
        "--accum",
        "2",
        "--steps",
        "20",
        "--log-every",
        "2",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("2 ranks x 2 micro-batches x 64 samples = global batch 256"),
        "{text}"
    );

    let losses = losses(&text);
    assert_eq!(losses.len(), 10, "{text}");
    assert!(
        losses.iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );
    // Cross-entropy of 10 classes starts near ln 10 = 2.3 and must fall well below it.
    assert!(losses[0] > 1.0, "{losses:?}");
    assert!(
        losses[9] < 0.75 * losses[0],
        "the loss did not decrease: {losses:?}"
    );

    let hashes: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("parameter hash rank "))
        .map(|l| l.split_once(": ").expect("rank: hash").1)
        .collect();
    assert_eq!(hashes.len(), 2, "{text}");
    assert_eq!(hashes[0], hashes[1], "{text}");
    assert!(
        text.contains("parameters identical on all 2 ranks: yes"),
        "{text}"
    );

    let acc: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("test accuracy "))
        .and_then(|l| l.split('%').next())
        .expect("an accuracy line")
        .parse()
        .unwrap();
    assert!(acc > 50.0, "test accuracy {acc}% after 20 steps:\n{text}");
    assert!(text.contains("bus bandwidth"), "{text}");
}

#[test]
fn bench_overlap_reports_both_modes_and_the_ratio() {
    if !have_data() {
        return;
    }
    let out = train(&["--nproc", "2", "--bench-overlap", "--batch", "16"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("overlap on :") && text.contains("overlap off:"),
        "{text}"
    );
    let ratio: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("step-time ratio off/on: "))
        .and_then(|l| l.split_whitespace().next())
        .expect("a ratio line")
        .parse()
        .unwrap();
    assert!(ratio > 0.0 && ratio.is_finite(), "{text}");
}

#[test]
fn a_missing_dataset_says_how_to_install_it() {
    let out = train(&["--nproc", "2", "--data", "/nonexistent/fashion-mnist"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("apt-get install dataset-fashion-mnist"),
        "{err}"
    );
    assert!(
        err.contains("/nonexistent/fashion-mnist/train-images-idx3-ubyte.gz"),
        "{err}"
    );
}

#[test]
fn bad_options_are_refused_before_ranks_start() {
    for args in [
        &["--nproc", "0"][..],
        &["--accum", "0"],
        &["--steps", "0"],
        &["--lr=-1"],
        &["--momentum", "1"],
        &["--hidden", "0"],
        &["--bucket-mb", "0"],
    ] {
        let out = train(args);
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
    }
    let out = Command::new(BIN)
        .args(["train", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--nproc",
        "--accum",
        "--steps",
        "--batch",
        "--lr",
        "--hidden",
        "--seed",
        "--no-overlap",
        "--bench-overlap",
        "--bucket-mb",
        "--data",
    ] {
        assert!(text.contains(flag), "{flag} missing from:\n{text}");
    }
}
