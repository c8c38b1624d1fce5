//! A skipped test says why; under CI (`GRADSYNC_CI=1`) a skip fails.

mod common;

use std::ffi::OsStr;

#[test]
fn outside_ci_a_skip_returns() {
    common::skip_in(None, "nothing to do");
    common::skip_in(Some(OsStr::new("0")), "nothing to do");
}

#[test]
#[should_panic(expected = "was skipped, which CI does not allow (GRADSYNC_CI=1): no namespaces")]
fn in_ci_a_skip_fails() {
    common::skip_in(Some(OsStr::new("1")), "no namespaces");
}

#[test]
fn skip_reads_gradsync_ci_from_the_environment() {
    let ci = std::env::var_os("GRADSYNC_CI").is_some_and(|v| v == "1");
    let failed = std::panic::catch_unwind(|| common::skip("checking the variable")).is_err();
    assert_eq!(failed, ci);
}
