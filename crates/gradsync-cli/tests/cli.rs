//! The command line of `gradsync`, run as a binary, for what needs no running communicator.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");

fn run(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("run gradsync")
}

#[test]
fn help_lists_the_commands() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("launch") && text.contains("bench"), "{text}");
    let out = run(&["bench", "--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--minbytes",
        "--maxbytes",
        "--stepfactor",
        "--stepbytes",
        "--iters",
        "--warmup_iters",
        "--check",
        "--datatype",
        "--op",
        "--root",
        "--json",
        "--nproc",
    ] {
        assert!(text.contains(flag), "{flag} missing from:\n{text}");
    }
}

#[test]
fn bench_refuses_bad_options_before_starting_ranks() {
    for args in [
        &["bench", "-d", "complex64"][..],
        &["bench", "-o", "xor"],
        &["bench", "-b", "1M", "-e", "1K"],
        &["bench", "-f", "1"],
        &["bench", "-e", "3Q"],
        &["bench", "alltoallw"],
    ] {
        let out = run(args);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(!out.stderr.is_empty());
    }
}
