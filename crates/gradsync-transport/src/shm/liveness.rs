//! Whether a peer's process still exists: pidfds, `kill(pid, 0)` and `/proc/<pid>/stat`
//! (zombies, reused pids).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// How often polls and waits look for peers that went away without closing.
pub const LIVENESS_EVERY: Duration = Duration::from_millis(5);

/// A pidfd for `pid`, `None` where the kernel refuses (no `pidfd_open`, or the process is gone).
pub(super) fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = RawFd::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process a pidfd names has exited (signal 0 through the pidfd: `ESRCH` once it
/// is gone, whatever process holds its pid now).
pub(super) fn pidfd_exited(fd: &OwnedFd) -> bool {
    // SAFETY: signal 0 checks existence only; the null info pointer and zero flags are valid.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Whether the process `pid` is gone: `kill(pid, 0)` fails with `ESRCH`, or (with `full`)
/// `/proc/<pid>/stat` shows a zombie or a start time other than `starttime`.
pub(super) fn process_state(pid: u32, starttime: Option<u64>, full: bool) -> Option<&'static str> {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return Some("its pid is invalid");
    };
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    if unsafe { libc::kill(p, 0) } != 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return Some("its process exited");
    }
    if !full {
        return None;
    }
    match read_stat(pid) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Some("its process exited"),
        Err(_) => None,
        Ok((state, _)) if state == 'Z' || state == 'X' => Some("its process exited (zombie)"),
        Ok((_, start)) if starttime.is_some() && start != starttime => {
            Some("its process exited (pid reused)")
        }
        Ok(_) => None,
    }
}

/// State letter and start time of process `pid`, from `/proc/<pid>/stat`.
pub(super) fn read_stat(pid: u32) -> io::Result<(char, Option<u64>)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (in parentheses) may contain spaces; the fields after it do not.
    let rest = s.rfind(')').map_or("", |i| &s[i + 1..]);
    let mut f = rest.split_whitespace();
    let state = f.next().and_then(|s| s.chars().next()).unwrap_or('?');
    // Field 22 of the file is the start time; the state is field 3.
    let start = f.nth(18).and_then(|v| v.parse().ok());
    Ok((state, start))
}
