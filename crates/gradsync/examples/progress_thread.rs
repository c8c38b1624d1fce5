//! Caller-driven progress versus a progress thread, measured.
//!
//! With a progress thread (Gloo's design), a blocking collective hands its request to the
//! thread that owns the connections and waits for the answer: two thread wake-ups per call on
//! top of the network. gradsync drives the connections from the calling thread instead. This
//! example runs the same 8-byte all-reduce both ways on the same communicator:
//!
//! ```sh
//! cargo build --release --example progress_thread -p gradsync
//! target/release/gradsync launch --nproc 2 -- target/release/examples/progress_thread
//! ```
//!
//! The difference per call is the price of the hand-off, which a worker thread would pay on
//! every small collective.

use gradsync::{Communicator, ReduceOp};
use std::sync::mpsc;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> gradsync::Result<()> {
    let mut comm = Communicator::from_env()?;
    let iters = 2000;
    let reps = 5;
    let mut direct = Vec::new();
    let mut threaded = Vec::new();
    for _ in 0..reps {
        // Caller-driven: the calling thread runs the engine.
        let mut buf = [1.0f32; 2];
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        direct.push(t.elapsed().as_secs_f64() / iters as f64 * 1e6);

        // Progress thread: a worker owns the communicator; the caller hands it each request.
        let (req_tx, req_rx) = mpsc::channel::<[f32; 2]>();
        let (rep_tx, rep_rx) = mpsc::channel::<gradsync::Result<[f32; 2]>>();
        let worker = std::thread::spawn(move || {
            for mut b in req_rx {
                let r = comm.all_reduce(&mut b, ReduceOp::Sum).map(|_| b);
                if rep_tx.send(r).is_err() {
                    break;
                }
            }
            comm
        });
        let t = Instant::now();
        for _ in 0..iters {
            req_tx.send([1.0, 1.0]).expect("worker alive");
            rep_rx.recv().expect("worker alive")?;
        }
        threaded.push(t.elapsed().as_secs_f64() / iters as f64 * 1e6);
        drop(req_tx);
        comm = worker.join().expect("worker panicked");
    }
    if comm.rank() == 0 {
        let (d, t) = (median(direct), median(threaded));
        println!(
            "8-byte all_reduce, {} ranks, median of {reps} x {iters} calls:",
            comm.world_size()
        );
        println!("  caller-driven   {d:8.1} us");
        println!("  progress thread {t:8.1} us  (x{:.2})", t / d);
    }
    Ok(())
}
