//! The `SIGUSR1` handler of the flight recorder: a self-pipe and a thread that dumps, chained
//! to the handler the application had before.

use std::io::{self, Read as _};
use std::os::fd::{FromRawFd as _, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

/// Write end of the self-pipe, `-1` until installed; never closed once set.
static WRITE_FD: AtomicI32 = AtomicI32::new(-1);

/// The application's handler before ours (`SIG_DFL` or `SIG_IGN`: none to call), and whether it
/// takes `siginfo` (`SA_SIGINFO`). Set before ours is installed, never changed after.
static PREVIOUS: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PREVIOUS_SIGINFO: AtomicBool = AtomicBool::new(false);

type SigInfoHandler = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);
type PlainHandler = extern "C" fn(libc::c_int);

extern "C" fn on_sigusr1(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    wake_dumper();
    let prev = PREVIOUS.load(Ordering::Relaxed);
    if prev == libc::SIG_DFL || prev == libc::SIG_IGN {
        return;
    }
    if PREVIOUS_SIGINFO.load(Ordering::Relaxed) {
        // SAFETY: `prev` is the `sa_sigaction` of the application's SA_SIGINFO handler, a
        // function of this signature; it gets the arguments this handler got.
        let f: SigInfoHandler = unsafe { std::mem::transmute::<usize, SigInfoHandler>(prev) };
        f(sig, info, ctx);
    } else {
        // SAFETY: `prev` is the `sa_handler` of the application's plain handler.
        let f: PlainHandler = unsafe { std::mem::transmute::<usize, PlainHandler>(prev) };
        f(sig);
    }
}

fn wake_dumper() {
    let fd = WRITE_FD.load(Ordering::Relaxed);
    if fd < 0 {
        return;
    }
    // SAFETY: `__errno_location` returns the calling thread's errno slot, valid for the
    // thread's lifetime; saving and restoring it keeps the interrupted code's errno intact.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: see above; reading an int the thread owns.
    let saved = unsafe { *errno };
    let byte = 1u8;
    // SAFETY: write(2) is async-signal-safe; the buffer is one valid byte on this stack and
    // `fd` is the pipe's non-blocking write end, open for the life of the process. A full
    // pipe (EAGAIN) drops the byte, which is fine: a wake-up is already pending.
    unsafe { libc::write(fd, (&raw const byte).cast(), 1) };
    // SAFETY: as above.
    unsafe { *errno = saved };
}

/// Installs the handler; `on_signal` runs on the dumping thread once per (coalesced) signal.
pub(super) fn install(on_signal: fn()) -> io::Result<()> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fcntl on a descriptor we own, with valid flags.
    if unsafe { libc::fcntl(fds[1], libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut reader = std::fs::File::from(reader);
    std::thread::Builder::new()
        .name("gradsync-flight".into())
        .spawn(move || {
            let mut buf = [0u8; 64];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {
                        // A bug in one dump must not end the thread and with it every
                        // later dump.
                        let dumped = std::panic::catch_unwind(on_signal);
                        if dumped.is_err() {
                            tracing::error!(
                                target: "gradsync::coll",
                                "flight recorder: SIGUSR1 dump panicked"
                            );
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        })?;
    // The handler may run at any time from now on: the write end stays open for good.
    let raw = std::os::fd::IntoRawFd::into_raw_fd(writer);
    WRITE_FD.store(raw, Ordering::Relaxed);
    // The application's handler, kept to be chained to.
    // SAFETY: a zeroed `sigaction` is valid for sigaction(2) to fill; a null new action only
    // reads the current one.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::sigaction(libc::SIGUSR1, std::ptr::null(), &mut old) } != 0 {
        return Err(io::Error::last_os_error());
    }
    PREVIOUS_SIGINFO.store(old.sa_flags & libc::SA_SIGINFO != 0, Ordering::Relaxed);
    PREVIOUS.store(old.sa_sigaction, Ordering::Relaxed);
    // SAFETY: an all-zero `sigaction` is a valid starting value (no flags, empty mask once
    // sigemptyset runs); the handler has the SA_SIGINFO signature, and it only calls
    // async-signal-safe functions and the application's own handler.
    let rc = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigusr1 as SigInfoHandler as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART | libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
