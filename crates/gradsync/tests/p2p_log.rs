//! `GRADSYNC_DEBUG=TRACE GRADSYNC_DEBUG_SUBSYS=P2P` shows point-to-point posting, matching and
//! completion, and nothing of the collectives. One test in its own process: the logging
//! variables are read once per process.

use gradsync::{Communicator, Config, ReduceOp};

#[test]
fn p2p_subsystem_logs_posting_matching_and_completion() {
    let dir = std::env::temp_dir().join(format!("gradsync-p2p-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("log.txt");
    // SAFETY: set before any other thread of this test process starts.
    unsafe {
        std::env::set_var("GRADSYNC_DEBUG", "TRACE");
        std::env::set_var("GRADSYNC_DEBUG_SUBSYS", "P2P");
        std::env::set_var("GRADSYNC_DEBUG_FILE", &file);
    }
    gradsync::logging::init_from_env();
    let cfg = Config::new("unused:0", 0, 2);
    let handles: Vec<_> = Communicator::mem_group(2, &cfg)
        .unwrap()
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let mut v = vec![c.rank() as f32; 300];
                if c.rank() == 0 {
                    c.send(&v, 1).unwrap();
                } else {
                    c.recv(&mut v, 0).unwrap();
                    assert!(v.iter().all(|&x| x == 0.0));
                }
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let log = std::fs::read_to_string(&file).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let has = |needle: &str| {
        log.lines()
            .any(|l| l.contains("TRACE") && l.contains(needle))
    };
    for needle in [
        "rank 0: send #1 to rank 1 posted: 300 x F32 (1200 B), matched with rank 1's recv #1",
        "rank 1: recv #1 from rank 0 posted: 300 x F32 (1200 B), matched with rank 0's send #1",
        "rank 0: send #1 to rank 1 complete: 1200 B in",
        "rank 1: recv #1 from rank 0 complete: 1200 B in",
    ] {
        assert!(has(needle), "no TRACE line with {needle:?} in:\n{log}");
    }
    assert!(
        !log.contains("all_reduce") && !log.contains("plan "),
        "collective lines leaked into the P2P subsystem:\n{log}"
    );
}
