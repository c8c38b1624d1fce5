//! Owned-buffer operations: several queued at once, driven by any call, in call order.

use gradsync::{Communicator, Config, ReduceOp};

#[test]
fn queued_owned_all_reduces_complete_in_order() {
    for world in [1, 2, 3, 4] {
        let mut cfg = Config::new("unused:0", 0, world);
        cfg.chunk_bytes = 256;
        let comms = Communicator::mem_group(world, &cfg).unwrap();
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let r = c.rank() as f32;
                    let w = c.world_size() as f32;
                    let works: Vec<_> = (0..5)
                        .map(|k| {
                            c.all_reduce_owned(vec![r + k as f32; 1000 + 37 * k], ReduceOp::Sum)
                                .unwrap()
                        })
                        .collect();
                    let mut seen = 0;
                    while !c.test(&works[4]).unwrap() {
                        seen += 1;
                        assert!(seen < 10_000_000, "queue never drained");
                    }
                    // A blocking call after the queue: ordering is preserved on every rank.
                    let mut x = vec![1i64; 10];
                    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    assert!(x.iter().all(|&v| v == c.world_size() as i64));
                    // Wait in reverse order.
                    for (k, wk) in works.into_iter().enumerate().rev() {
                        let buf = c.wait(wk).unwrap();
                        assert_eq!(buf.len(), 1000 + 37 * k);
                        let want = (0..c.world_size())
                            .map(|q| q as f32 + k as f32)
                            .sum::<f32>();
                        assert!(
                            buf.iter().all(|&v| v == want),
                            "bucket {k}: {} != {want} (world {w})",
                            buf[0]
                        );
                    }
                    // Queue then a blocking collective that must drain it first.
                    let wk = c.all_reduce_owned(vec![2.0f64; 33], ReduceOp::Max).unwrap();
                    c.barrier().unwrap();
                    assert!(c.test(&wk).unwrap());
                    assert_eq!(c.wait(wk).unwrap(), vec![2.0f64; 33]);
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }
}
