//! Shrink: after a rank dies in the middle of an all-reduce, the survivors build a smaller
//! communicator without it and carry on.

use gradsync::{Communicator, Config, ReduceOp};
use gradsync_store::StoreServer;
use std::time::{Duration, Instant};

#[test]
fn survivors_shrink_and_all_reduce_correctly() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let world = 4;
    let victim = 2;
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, world);
            cfg.host_store = false;
            cfg.timeout = Duration::from_secs(20);
            std::thread::spawn(move || -> Option<(usize, Vec<f32>, Duration)> {
                let mut c = Communicator::init(cfg).unwrap();
                let mut ok = vec![1.0f32; 1000];
                c.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
                assert!(ok.iter().all(|&v| v == world as f32));
                let big = vec![rank as f32; 4 << 20];
                if rank == victim {
                    // Start a large all-reduce and vanish in the middle of it: the
                    // communicator (and its connections) go away with the operation in flight.
                    let w = c.all_reduce_owned(big, ReduceOp::Sum).unwrap();
                    std::thread::sleep(Duration::from_millis(50));
                    c.progress().ok();
                    let _ = w;
                    drop(c);
                    return None;
                }
                let mut big = big;
                let err = c
                    .all_reduce(&mut big, ReduceOp::Sum)
                    .expect_err("the all-reduce must fail when a rank dies");
                let t = Instant::now();
                let failed = c.failed_ranks(Duration::from_secs(5));
                assert_eq!(
                    failed,
                    vec![victim],
                    "rank {rank}: failed ranks after {err}"
                );
                let mut small = c
                    .shrink(&failed)
                    .unwrap_or_else(|e| panic!("rank {rank}: shrink: {e}"));
                let took = t.elapsed();
                assert_eq!(small.world_size(), world - 1);
                assert_eq!(small.rank(), if rank < victim { rank } else { rank - 1 });
                let mut buf: Vec<f32> = (0..10007).map(|i| (i % 7) as f32 + rank as f32).collect();
                small.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                Some((rank, buf, took))
            })
        })
        .collect();
    let results: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let survivors: Vec<usize> = (0..world).filter(|&r| r != victim).collect();
    for (rank, buf, took) in results.into_iter().flatten() {
        for (i, v) in buf.iter().enumerate() {
            let want: f32 = survivors.iter().map(|&r| (i % 7) as f32 + r as f32).sum();
            assert_eq!(*v, want, "rank {rank} element {i}");
        }
        assert!(
            took < Duration::from_secs(10),
            "rank {rank}: shrink took {took:?}"
        );
    }
}
