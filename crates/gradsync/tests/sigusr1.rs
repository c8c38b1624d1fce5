//! The flight recorder's `SIGUSR1` handler chains to the application's: both run. One test in
//! its own process, since the handler is installed once per process.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static APP_CALLS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn app_handler(_sig: libc::c_int) {
    APP_CALLS.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn the_applications_sigusr1_handler_still_runs() {
    // SAFETY: a zeroed sigaction with a plain handler that only touches an atomic.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = app_handler as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
    let dir = std::env::temp_dir().join(format!("gradsync-sigusr1-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let rec = gradsync::recorder::FlightRecorder::new(0, 1, 8);
    rec.set_dump_dir(&dir);
    gradsync::recorder::install_sigusr1_dump();
    for round in 1..=2 {
        // SAFETY: raising a signal whose handlers are installed above.
        assert_eq!(unsafe { libc::raise(libc::SIGUSR1) }, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while APP_CALLS.load(Ordering::SeqCst) < round {
            assert!(
                Instant::now() < deadline,
                "the application's handler did not run"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    // The recorder dumped too.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dumps = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
        if dumps > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no flight-recorder dump in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(APP_CALLS.load(Ordering::SeqCst), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
