//! A caller's output buffer accepts peers' writes only while its operation runs: a write
//! replayed after the operation ended (an old clear-to-send, a buggy peer) is refused, named,
//! and never lands in the caller's memory, which it may have freed or reused. The fault
//! injector's replayer records rank 0's writes during one all-reduce and posts those into
//! rank 1's output again, filled with 0xEE, during the next operation.

use gradsync::{Algorithm, Communicator, Config, ReduceOp};
use gradsync_transport::Endpoint;
use gradsync_transport::fault::{FaultConfig, FaultyEndpoint, Replayer};
use gradsync_transport::shm::ShmSetup;
use std::sync::{Arc, Barrier};
use std::time::Duration;

const COUNT: usize = 1 << 16;

/// Every rank's output of the first all-reduce, as it is after the second operation, and the
/// second operation's result; with rank 0's writes replayed into rank 1's first output.
fn replay_into_a_finished_output<E: Endpoint + 'static>(
    eps: Vec<E>,
) -> Vec<(Vec<f32>, Result<(), String>)> {
    let mut cfg = Config::new("unused:0", 0, 1);
    cfg.timeout = Duration::from_secs(20);
    cfg.algorithm = Some(Algorithm::Ring);
    // Every data message goes straight into the destination buffer.
    cfg.direct_min = 0;
    cfg.shm_direct_min = 0;
    let world = eps.len();
    let mut replayer = None;
    let eps: Vec<Box<dyn Endpoint>> = eps
        .into_iter()
        .enumerate()
        .map(|(r, ep)| {
            let f = FaultyEndpoint::new(ep, FaultConfig::default());
            if r == 0 {
                replayer = Some(f.replayer());
            }
            Box::new(f) as Box<dyn Endpoint>
        })
        .collect();
    let replayer: Replayer = replayer.expect("rank 0");
    replayer.record(true);
    let comms = Communicator::from_endpoints(eps, &cfg).unwrap();
    let (ended, replayed) = (
        Arc::new(Barrier::new(world + 1)),
        Arc::new(Barrier::new(world + 1)),
    );
    let done = Arc::new(Barrier::new(world));
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut c)| {
            let (ended, replayed, done) = (ended.clone(), replayed.clone(), done.clone());
            std::thread::spawn(move || {
                let input = vec![(rank + 1) as f32; COUNT];
                let mut first = vec![0f32; COUNT];
                c.all_reduce_into(&input, &mut first, ReduceOp::Sum)
                    .unwrap();
                ended.wait();
                replayed.wait();
                let mut second = vec![1f32; COUNT];
                let r = c
                    .all_reduce(&mut second, ReduceOp::Sum)
                    .map_err(|e| e.to_string());
                done.wait();
                (first, r)
            })
        })
        .collect();
    ended.wait();
    replayer.record(false);
    let out_bytes = (COUNT * 4) as u64;
    let into_output: Vec<_> = replayer
        .writes()
        .into_iter()
        // The inbox (slots of every pair, megabytes) is larger than the output; a direct
        // write names a span of the output.
        .filter(|w| w.peer == 1 && w.remote.len <= out_bytes)
        .collect();
    assert!(
        !into_output.is_empty(),
        "rank 0 wrote nothing straight into rank 1's output: {:?}",
        replayer.writes()
    );
    for w in into_output {
        replayer.replay(w, 0xee);
    }
    replayed.wait();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn check(results: &[(Vec<f32>, Result<(), String>)], transport: &str) {
    // The first all-reduce was right, and stays so: nothing of the replay landed.
    for (rank, (first, _)) in results.iter().enumerate() {
        assert!(
            first.iter().all(|&x| x == 3.0),
            "{transport}: rank {rank}'s finished output was written after its operation: {:?}",
            &first[..8]
        );
    }
    // The refused write is reported, naming both ends.
    let errors: Vec<&String> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().err())
        .collect();
    eprintln!("{transport}: {errors:#?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("rank 1") && e.contains("rank 0") && e.contains("unknown")),
        "{transport}: no error names the stale write: {errors:?}"
    );
}

#[test]
fn a_write_into_a_finished_operations_output_is_refused_in_memory() {
    let results = replay_into_a_finished_output(gradsync_transport::mem::fabric(2));
    check(&results, "mem");
}

#[test]
fn a_write_into_a_finished_operations_output_is_refused_over_shared_memory() {
    let local = [0, 1];
    let eps = ShmSetup::in_process(2, &local, Duration::from_secs(20)).unwrap();
    let results = replay_into_a_finished_output(eps);
    check(&results, "shm");
}
