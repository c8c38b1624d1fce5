//! Data-parallel training end to end on in-memory ranks: replicas stay bitwise identical, and
//! N ranks x K micro-batches of B samples train like one rank with batches of N x K x B.

use gradsync::{Communicator, Config};
use gradsync_ddp::{Reducer, gather_hashes, hash_f32};
use std::ops::Range;

/// A two-layer perceptron `Linear(D_IN, H) - ReLU - Linear(H, D_OUT)` with softmax
/// cross-entropy; its parameters are one flat vector `[W1, b1, W2, b2]`, weights stored
/// input-major (`w[i * out + j]`).
const D_IN: usize = 12;
const H: usize = 24;
const D_OUT: usize = 4;

fn ranges() -> [Range<usize>; 4] {
    let w1 = 0..D_IN * H;
    let b1 = w1.end..w1.end + H;
    let w2 = b1.end..b1.end + H * D_OUT;
    let b2 = w2.end..w2.end + D_OUT;
    [w1, b1, w2, b2]
}

fn sizes() -> Vec<usize> {
    ranges().iter().map(|r| r.len()).collect()
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Uniform in [-1, 1), a pure function of `(stream, i)`.
fn uniform(stream: u64, i: u64) -> f32 {
    (splitmix(splitmix(stream) ^ i) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

fn init_params(seed: u64) -> Vec<f32> {
    let [w1, b1, w2, _] = ranges();
    let mut p = vec![0.0; ranges()[3].end];
    for i in w1.clone() {
        p[i] = uniform(seed, i as u64) * (3.0 / D_IN as f32).sqrt();
    }
    for i in b1 {
        p[i] = 0.01;
    }
    for i in w2 {
        p[i] = uniform(seed, i as u64) * (3.0 / H as f32).sqrt();
    }
    p
}

/// Sample `n` of the synthetic dataset: features uniform in [-1, 1), label the argmax of a
/// fixed linear map of them.
fn sample(n: u64) -> ([f32; D_IN], usize) {
    let mut x = [0.0; D_IN];
    for (i, v) in x.iter_mut().enumerate() {
        *v = uniform(7, n * D_IN as u64 + i as u64);
    }
    let score = |c: usize| -> f32 {
        x.iter()
            .enumerate()
            .map(|(i, v)| v * uniform(99, (c * D_IN + i) as u64))
            .sum()
    };
    let y = (0..D_OUT)
        .max_by(|&a, &b| score(a).total_cmp(&score(b)))
        .unwrap();
    (x, y)
}

/// Forward and backward over `samples`; the mean loss. Each parameter's gradient (mean over
/// the samples) is handed to `ready` as soon as it is final, last layer first.
fn forward_backward(p: &[f32], samples: Range<u64>, mut ready: impl FnMut(usize, &[f32])) -> f32 {
    let [w1, b1, w2, b2] = ranges();
    let (w1, b1, w2, b2) = (&p[w1], &p[b1], &p[w2], &p[b2]);
    let n = samples.end - samples.start;
    let scale = 1.0 / n as f32;
    let mut xs = Vec::new();
    let mut a1 = Vec::new();
    let mut dz2 = Vec::new();
    let mut loss = 0.0;
    for s in samples {
        let (x, y) = sample(s);
        let mut z1 = b1.to_vec();
        for i in 0..D_IN {
            for j in 0..H {
                z1[j] += x[i] * w1[i * H + j];
            }
        }
        let h: Vec<f32> = z1.iter().map(|v| v.max(0.0)).collect();
        let mut z2 = b2.to_vec();
        for i in 0..H {
            for j in 0..D_OUT {
                z2[j] += h[i] * w2[i * D_OUT + j];
            }
        }
        let m = z2.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = z2.iter().map(|v| (v - m).exp()).collect();
        let sum: f32 = e.iter().sum();
        loss += sum.ln() + m - z2[y];
        for (j, ej) in e.iter().enumerate() {
            dz2.push((ej / sum - if j == y { 1.0 } else { 0.0 }) * scale);
        }
        xs.extend_from_slice(&x);
        a1.extend_from_slice(&h);
    }
    let n = n as usize;
    let mut gw2 = vec![0.0; H * D_OUT];
    let mut gb2 = vec![0.0; D_OUT];
    for s in 0..n {
        for i in 0..H {
            for j in 0..D_OUT {
                gw2[i * D_OUT + j] += a1[s * H + i] * dz2[s * D_OUT + j];
            }
        }
        for j in 0..D_OUT {
            gb2[j] += dz2[s * D_OUT + j];
        }
    }
    ready(3, &gb2);
    ready(2, &gw2);
    let mut gw1 = vec![0.0; D_IN * H];
    let mut gb1 = vec![0.0; H];
    for s in 0..n {
        let mut dz1 = [0.0; H];
        for i in 0..H {
            if a1[s * H + i] > 0.0 {
                for j in 0..D_OUT {
                    dz1[i] += w2[i * D_OUT + j] * dz2[s * D_OUT + j];
                }
            }
        }
        for i in 0..D_IN {
            for j in 0..H {
                gw1[i * H + j] += xs[s * D_IN + i] * dz1[j];
            }
        }
        for j in 0..H {
            gb1[j] += dz1[j];
        }
    }
    ready(1, &gb1);
    ready(0, &gw1);
    loss * scale
}

/// Knobs of one data-parallel run.
#[derive(Clone, Copy)]
struct Run {
    world: usize,
    accum: usize,
    batch: u64,
    steps: usize,
    bucket_bytes: usize,
    overlap: bool,
}

const LR: f32 = 0.5;

/// Trains with `run.world` threads; every rank checks after every step that all ranks'
/// parameter hashes agree. Returns rank 0's parameters and the first and last mean losses.
fn train(run: Run) -> (Vec<f32>, f32, f32) {
    let comms = Communicator::mem_group(run.world, &Config::new("unused:0", 0, run.world)).unwrap();
    let threads: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            std::thread::spawn(move || {
                let rank = comm.rank();
                // Every rank starts elsewhere; the broadcast makes them rank 0's.
                let mut params = init_params(1 + rank as u64);
                comm.broadcast(&mut params, 0).unwrap();
                let mut reducer = Reducer::new(&sizes(), run.bucket_bytes).unwrap();
                reducer.set_overlap(run.overlap);
                let ranges = ranges();
                let global = run.world as u64 * run.accum as u64 * run.batch;
                let (mut first, mut last) = (0.0, 0.0);
                for step in 0..run.steps {
                    reducer.begin_step(run.accum).unwrap();
                    let mut loss = 0.0;
                    for k in 0..run.accum {
                        // Micro-batch k of rank r: its own B samples of the step's global batch.
                        let start =
                            step as u64 * global + ((k * run.world + rank) as u64) * run.batch;
                        loss += forward_backward(&params, start..start + run.batch, |p, g| {
                            reducer.mark_ready(&mut comm, p, g).unwrap()
                        });
                    }
                    let grads = reducer.finish(&mut comm).unwrap();
                    for (p, r) in ranges.iter().enumerate() {
                        for (w, g) in params[r.clone()].iter_mut().zip(grads.get(p)) {
                            *w -= LR * g;
                        }
                    }
                    let mut l = [loss / run.accum as f32];
                    comm.all_reduce(&mut l, gradsync::ReduceOp::Sum).unwrap();
                    last = l[0] / run.world as f32;
                    if step == 0 {
                        first = last;
                    }
                    let hashes = gather_hashes(&mut comm, hash_f32(&params)).unwrap();
                    assert!(
                        hashes.iter().all(|&h| h == hashes[0]),
                        "step {step}: rank {rank} sees differing parameter hashes {hashes:016x?}"
                    );
                }
                (params, first, last)
            })
        })
        .collect();
    let mut results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    results.swap_remove(0)
}

#[test]
fn replicas_stay_bitwise_identical_after_every_step() {
    for overlap in [true, false] {
        // Four buckets of one parameter each (the cap is below every parameter's size).
        let (_, first, last) = train(Run {
            world: 4,
            accum: 2,
            batch: 4,
            steps: 6,
            bucket_bytes: 4,
            overlap,
        });
        assert!(last < first, "loss went from {first} to {last}");
        // One bucket, three ranks (a world that is not a power of two), no accumulation.
        train(Run {
            world: 3,
            accum: 1,
            batch: 5,
            steps: 3,
            bucket_bytes: 1 << 20,
            overlap,
        });
    }
}

#[test]
fn four_ranks_by_two_micro_batches_match_one_rank_with_the_full_batch() {
    let b = 8;
    let (one, first1, last1) = train(Run {
        world: 1,
        accum: 1,
        batch: 4 * 2 * b,
        steps: 20,
        bucket_bytes: 1 << 20,
        overlap: true,
    });
    // Buckets of about 100 elements: several buckets, overlapped.
    let (dp, first4, last4) = train(Run {
        world: 4,
        accum: 2,
        batch: b,
        steps: 20,
        bucket_bytes: 400,
        overlap: true,
    });
    assert!(
        last1 < 0.8 * first1,
        "training should make progress: {first1} -> {last1}"
    );
    let scale = one.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = one
        .iter()
        .zip(&dp)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let rel = diff / scale;
    eprintln!(
        "1 rank x 64: loss {first1} -> {last1}; 4 ranks x 2 x 8: loss {first4} -> {last4}; \
         max |difference| {diff:e}, relative to max |parameter| {scale}: {rel:e}"
    );
    assert!(
        rel < 1e-5,
        "parameters differ by {rel:e} relative after 20 steps"
    );
    assert!(
        ((last1 - last4) / last1).abs() < 1e-4,
        "losses {last1} vs {last4}"
    );
}
