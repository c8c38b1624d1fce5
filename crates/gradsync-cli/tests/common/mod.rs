//! What the test binaries of this crate share.

use std::ffi::OsStr;

/// A test that cannot run here says why, and returns. Under CI (`GRADSYNC_CI=1`, which
/// `.ci/run` sets) nothing may be skipped: the reason becomes the test's failure.
pub fn skip(why: &str) {
    skip_in(std::env::var_os("GRADSYNC_CI").as_deref(), why);
}

/// [`skip`] with the value of `GRADSYNC_CI` given.
pub fn skip_in(ci: Option<&OsStr>, why: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_string();
    if ci.is_some_and(|v| v == "1") {
        panic!("{test} was skipped, which CI does not allow (GRADSYNC_CI=1): {why}");
    }
    eprintln!("skipped {test}: {why}");
}
