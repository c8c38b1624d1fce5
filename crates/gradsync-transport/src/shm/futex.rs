//! Futex wait and wake on words of a shared mapping (shared, not private, futexes: other
//! processes wake them).

use std::io;
use std::ptr;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Wakes every process waiting on `word`.
pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address to find waiters; the word is a valid, aligned
    // u32 in a shared mapping that outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            ptr::null::<libc::timespec>(),
            ptr::null::<u32>(),
            0,
        )
    };
}

/// How a futex wait ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Woke {
    /// Woken, the word had already changed, or a signal arrived.
    Event,
    /// The timeout passed.
    Timeout,
}

/// Sleeps while `word` holds `expected`, at most `timeout`.
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> Woke {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the word is a valid, aligned u32 in a shared mapping that outlives the call, and
    // `ts` a valid relative timeout. A shared (not private) futex, since other processes wake it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            ptr::null::<u32>(),
            0,
        )
    };
    if r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT) {
        Woke::Timeout
    } else {
        Woke::Event
    }
}
