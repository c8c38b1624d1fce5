//! The conformance suite: every collective, dtype and op, in place and out of place, over
//! every world size 1..=8, on the in-memory, TCP and shared-memory transports and on emulated
//! hosts (shared memory inside a host, TCP across, with the hierarchical and central
//! all-reduce), with a tiny message size that forces many pipeline steps and with the default
//! one.
//!
//! Inputs are small integers whose reduction is exact in every dtype, so each rank's result
//! is compared bit for bit against a locally computed expectation; a random-float all-reduce
//! checks that every rank ends with the same bits.
//!
//! The bitwise operators (`band`, `bor`, `bxor`) run over the integer types with inputs that use
//! all 64 bits (truncated to the element type, which commutes with the operators); over the float
//! types every reducing call must refuse them at once, with an error that names the rank, the
//! call, the operator and the type, and leave the buffers and the communicator as they were. The
//! `bitwise_*` tests run only these operators, over every transport and world 1..=8.

use gradsync::{Algorithm, Communicator, Config, ReduceOp, TransportMode};
use gradsync_store::StoreServer;
use half::{bf16, f16};
use std::fmt::Debug;
use std::sync::mpsc;
use std::time::Duration;

#[cfg(feature = "rdma")]
mod common;

trait TestElem: gradsync::Element + PartialEq + Debug + Default {
    fn from_i64(v: i64) -> Self;
    fn avg(sum: i64, world: usize) -> Self;
    fn bits(&self) -> u64;
}

macro_rules! float_elem {
    ($t:ty, $from:expr, $bits:expr, $avg:expr) => {
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self {
                $from(v)
            }
            fn avg(sum: i64, world: usize) -> Self {
                $avg(sum, world)
            }
            fn bits(&self) -> u64 {
                $bits(*self)
            }
        }
    };
}
float_elem!(
    f32,
    |v| v as f32,
    |x: f32| x.to_bits() as u64,
    |s: i64, w: usize| s as f32 / w as f32
);
float_elem!(
    f64,
    |v| v as f64,
    |x: f64| x.to_bits(),
    |s: i64, w: usize| s as f64 / w as f64
);
float_elem!(
    f16,
    |v| f16::from_f32(v as f32),
    |x: f16| x.to_bits() as u64,
    |s: i64, w: usize| f16::from_f32(s as f32 / w as f32)
);
float_elem!(
    bf16,
    |v| bf16::from_f32(v as f32),
    |x: bf16| x.to_bits() as u64,
    |s: i64, w: usize| bf16::from_f32(s as f32 / w as f32)
);
float_elem!(
    i32,
    |v| v as i32,
    |x: i32| x as u32 as u64,
    |s: i64, w: usize| (s / w as i64) as i32
);
float_elem!(i64, |v| v, |x: i64| x as u64, |s: i64, w: usize| s / w
    as i64);
float_elem!(u8, |v| v as u8, |x: u8| x as u64, |s: i64, w: usize| (s
    as u8)
    / w as u8);

/// SplitMix64 of `(rank, i, salt)`: 64 well-mixed bits.
fn mix(rank: usize, i: usize, salt: u64) -> i64 {
    let mut z = (rank as u64) << 40 ^ (i as u64) << 4 ^ salt;
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as i64
}

fn val(rank: usize, i: usize, op: ReduceOp) -> i64 {
    // Bitwise inputs: `and` of mostly-one bits and `or` of mostly-zero bits (7/8 and 1/8 per bit),
    // so that the reduction over up to 8 ranks is neither all zeros nor all ones.
    let m = |salt| mix(rank, i, salt);
    match op {
        ReduceOp::Band => return m(1) | m(2) | m(3),
        ReduceOp::Bor => return m(1) & m(2) & m(3),
        ReduceOp::Bxor => return m(1),
        _ => {}
    }
    if op == ReduceOp::Prod {
        1 + ((i + rank).is_multiple_of(3)) as i64
    } else {
        ((i * 7 + rank * 3) % 5 + 1) as i64
    }
}

fn expect<T: TestElem>(op: ReduceOp, world: usize, i: usize) -> T {
    let vals: Vec<i64> = (0..world).map(|r| val(r, i, op)).collect();
    match op {
        ReduceOp::Sum => T::from_i64(vals.iter().sum()),
        ReduceOp::Prod => T::from_i64(
            vals.iter().product::<i64>()
                & if std::mem::size_of::<T>() == 1 {
                    0xff
                } else {
                    -1
                },
        ),
        ReduceOp::Min => T::from_i64(*vals.iter().min().unwrap()),
        ReduceOp::Max => T::from_i64(*vals.iter().max().unwrap()),
        ReduceOp::Avg => T::avg(vals.iter().sum(), world),
        ReduceOp::Band => T::from_i64(vals.iter().fold(-1, |a, v| a & v)),
        ReduceOp::Bor => T::from_i64(vals.iter().fold(0, |a, v| a | v)),
        ReduceOp::Bxor => T::from_i64(vals.iter().fold(0, |a, v| a ^ v)),
    }
}

/// Every reducing call with a bitwise `op` over a float type fails at once with an error naming
/// the rank, the call, the operator and the type; the buffers keep their contents.
fn bitwise_over_float_is_refused<T: TestElem>(c: &mut Communicator, dt: &str, op: ReduceOp) {
    let (r, w) = (c.rank(), c.world_size());
    let msg = |call: &str| {
        format!(
            "rank {r}: {call}: reduction op {op} is bitwise and is not defined for the \
             floating-point type {dt} (bitwise ops take int32, int64 or uint8)"
        )
    };
    let input: Vec<T> = (0..5).map(|i| T::from_i64(i + 1)).collect();
    let same = |got: &[T], what: &str| {
        check(&format!("rank {r} {dt} {op}: {what} untouched"), got, |i| {
            input[i]
        })
    };
    let mut buf = input.clone();
    let e = c.all_reduce(&mut buf, op).unwrap_err();
    assert_eq!(e.to_string(), msg("all_reduce"));
    same(&buf, "all_reduce buffer");
    let mut out = input.clone();
    let e = c.all_reduce_into(&input, &mut out, op).unwrap_err();
    assert_eq!(e.to_string(), msg("all_reduce"));
    same(&out, "all_reduce output");
    let e = c.all_reduce_async(&mut buf, op).map(drop).unwrap_err();
    assert_eq!(e.to_string(), msg("all_reduce"));
    same(&buf, "all_reduce_async buffer");
    let e = c.all_reduce_owned(input.clone(), op).map(drop).unwrap_err();
    assert_eq!(e.to_string(), msg("all_reduce"));
    let rs_in: Vec<T> = (0..5 * w).map(|i| T::from_i64(i as i64)).collect();
    let e = c.reduce_scatter(&rs_in, &mut out, op).unwrap_err();
    assert_eq!(e.to_string(), msg("reduce_scatter"));
    same(&out, "reduce_scatter output");
    let root = w - 1;
    let e = c.reduce(&input, &mut out, op, root).unwrap_err();
    assert_eq!(e.to_string(), msg("reduce"));
    same(&out, "reduce output");
    if r != root {
        // A rank that is not the root may pass an empty output: refused alike.
        let e = c.reduce(&input, &mut [], op, root).unwrap_err();
        assert_eq!(e.to_string(), msg("reduce"));
    }
}

fn check<T: TestElem>(what: &str, got: &[T], want: impl Fn(usize) -> T) {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        assert!(
            g.bits() == w.bits(),
            "{what}: element {i} of {}: got {g:?}, want {w:?}",
            got.len()
        );
    }
}

/// The counts of DESIGN.md. With the tiny message size 10007 elements would only repeat what
/// 1000 already exercises (hundreds of pipeline steps per block) at many times the cost.
fn counts(world: usize, tiny: bool) -> Vec<usize> {
    let mut c = vec![0, 1, 3, world.saturating_sub(1), 1000];
    if !tiny {
        c.push(10007);
    }
    c.dedup();
    c
}

/// The bitwise operators, which the `bitwise_*` tests run alone.
const BITWISE: [ReduceOp; 3] = [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor];

/// Runs every collective with each of `ops` that the type has; over a float type, checks that
/// the bitwise ones among `ops` are refused. With no operator for the type (the bitwise tests
/// over a float type), only the refusal is checked.
fn run_dtype<T: TestElem>(c: &mut Communicator, dt: &str, tiny: bool, ops: &[ReduceOp]) {
    let (r, w) = (c.rank(), c.world_size());
    let ops: Vec<ReduceOp> = ops
        .iter()
        .copied()
        .filter(|op| op.supports(T::DTYPE))
        .collect();
    for &op in BITWISE.iter().filter(|op| !op.supports(T::DTYPE)) {
        bitwise_over_float_is_refused::<T>(c, dt, op);
    }
    if ops.is_empty() {
        // The refused calls left nothing behind: the next collective runs as usual.
        c.barrier().unwrap();
        return;
    }
    for count in counts(w, tiny) {
        for &op in &ops {
            let ctx = |coll: &str, place: &str| {
                format!("rank {r}/{w} {coll} {dt} {op} count {count} {place}")
            };
            let input: Vec<T> = (0..count).map(|i| T::from_i64(val(r, i, op))).collect();
            // all_reduce, in place and out of place
            let mut buf = input.clone();
            c.all_reduce(&mut buf, op)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_reduce", "in place")));
            check(&ctx("all_reduce", "in place"), &buf, |i| {
                expect::<T>(op, w, i)
            });
            let mut out = vec![T::default(); count];
            c.all_reduce_into(&input, &mut out, op)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_reduce", "out of place")));
            check(&ctx("all_reduce", "out of place"), &out, |i| {
                expect::<T>(op, w, i)
            });
            // async form
            let mut buf = input.clone();
            let p = c.all_reduce_async(&mut buf, op).unwrap();
            p.wait()
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_reduce_async", "")));
            check(&ctx("all_reduce_async", ""), &buf, |i| {
                expect::<T>(op, w, i)
            });
            // reduce_scatter: input world*count
            let rs_in: Vec<T> = (0..count * w).map(|i| T::from_i64(val(r, i, op))).collect();
            let mut rs_out = vec![T::default(); count];
            c.reduce_scatter(&rs_in, &mut rs_out, op)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("reduce_scatter", "")));
            check(&ctx("reduce_scatter", ""), &rs_out, |j| {
                expect::<T>(op, w, r * count + j)
            });
            // reduce to a rotating root
            let root = (count + op as usize) % w;
            let mut red = if r == root {
                vec![T::default(); count]
            } else {
                Vec::new()
            };
            c.reduce(&input, &mut red, op, root)
                .unwrap_or_else(|e| panic!("{} root {root}: {e}", ctx("reduce", "")));
            if r == root {
                check(&format!("{} root {root}", ctx("reduce", "")), &red, |i| {
                    expect::<T>(op, w, i)
                });
            }
        }
        let ctx = |coll: &str| format!("rank {r}/{w} {coll} {dt} count {count}");
        // all_gather
        let input: Vec<T> = (0..count)
            .map(|i| T::from_i64(val(r, i, ReduceOp::Sum)))
            .collect();
        let mut out = vec![T::default(); count * w];
        c.all_gather(&input, &mut out)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_gather")));
        check(&ctx("all_gather"), &out, |k| {
            T::from_i64(val(k / count.max(1), k % count.max(1), ReduceOp::Sum))
        });
        // broadcast from every root
        for root in 0..w {
            let mut buf: Vec<T> = (0..count)
                .map(|i| T::from_i64(val(r, i, ReduceOp::Sum)))
                .collect();
            c.broadcast(&mut buf, root)
                .unwrap_or_else(|e| panic!("{} root {root}: {e}", ctx("broadcast")));
            check(&format!("{} root {root}", ctx("broadcast")), &buf, |i| {
                T::from_i64(val(root, i, ReduceOp::Sum))
            });
        }
        exchange::<T>(c, &ctx, count);
        // send/recv around the ring (even ranks send first)
        if w > 1 {
            let next = (r + 1) % w;
            let prev = (r + w - 1) % w;
            let mut got = vec![T::default(); count];
            if r % 2 == 0 {
                c.send(&input, next).unwrap();
                c.recv(&mut got, prev).unwrap();
            } else {
                c.recv(&mut got, prev).unwrap();
                c.send(&input, next).unwrap();
            }
            check(&ctx("send/recv"), &got, |i| {
                T::from_i64(val(prev, i, ReduceOp::Sum))
            });
        }
        c.barrier().unwrap();
    }
}

/// Element `j` of the block rank `s` sends rank `d` in the all-to-all tests.
fn a2a_val(s: usize, d: usize, j: usize) -> i64 {
    ((s * 31 + d * 7 + j * 3) % 97) as i64
}

/// Elements rank `s` sends rank `d` in the all-to-allv test: uneven, some zero.
fn a2av_count(s: usize, d: usize, count: usize) -> usize {
    (s * 3 + d * 5 + count) % 7 + if (s + d).is_multiple_of(3) { 0 } else { count }
}

/// All-to-all(v), in-place all-gather and reduce-scatter, gather and scatter from every root,
/// the async forms, and a group of sends and receives both ways plus collectives.
fn exchange<T: TestElem>(c: &mut Communicator, ctx: &dyn Fn(&str) -> String, count: usize) {
    let (r, w) = (c.rank(), c.world_size());
    // all_to_all
    let input: Vec<T> = (0..w * count)
        .map(|k| T::from_i64(a2a_val(r, k / count.max(1), k % count.max(1))))
        .collect();
    let mut out = vec![T::default(); w * count];
    c.all_to_all(&input, &mut out)
        .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_to_all")));
    check(&ctx("all_to_all"), &out, |k| {
        T::from_i64(a2a_val(k / count.max(1), r, k % count.max(1)))
    });
    let mut out2 = vec![T::default(); w * count];
    c.all_to_all_async(&input, &mut out2)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        out2.iter().zip(&out).all(|(a, b)| a.bits() == b.bits()),
        "{}",
        ctx("all_to_all_async")
    );
    // all_to_allv with uneven counts
    let sc: Vec<usize> = (0..w).map(|d| a2av_count(r, d, count)).collect();
    let rc: Vec<usize> = (0..w).map(|s| a2av_count(s, r, count)).collect();
    let input: Vec<T> = (0..w)
        .flat_map(|d| (0..sc[d]).map(move |j| T::from_i64(a2a_val(r, d, j))))
        .collect();
    let mut out = vec![T::default(); rc.iter().sum()];
    c.all_to_allv(&input, &sc, &mut out, &rc)
        .unwrap_or_else(|e| panic!("{} counts {sc:?}/{rc:?}: {e}", ctx("all_to_allv")));
    let want: Vec<T> = (0..w)
        .flat_map(|s| (0..rc[s]).map(move |j| T::from_i64(a2a_val(s, r, j))))
        .collect();
    check(&ctx("all_to_allv"), &out, |k| want[k]);
    // in-place all_gather: this rank's input already in block r
    let mut buf: Vec<T> = (0..w * count)
        .map(|k| {
            if k / count.max(1) == r {
                T::from_i64(val(r, k % count.max(1), ReduceOp::Sum))
            } else {
                T::from_i64(99)
            }
        })
        .collect();
    c.all_gather_in_place(&mut buf)
        .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_gather in place")));
    check(&ctx("all_gather in place"), &buf, |k| {
        T::from_i64(val(k / count.max(1), k % count.max(1), ReduceOp::Sum))
    });
    // in-place reduce_scatter: block r ends with the sum, the others keep their contents
    let orig: Vec<T> = (0..w * count)
        .map(|i| T::from_i64(val(r, i, ReduceOp::Sum)))
        .collect();
    let mut buf = orig.clone();
    c.reduce_scatter_in_place_async(&mut buf, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap_or_else(|e| panic!("{}: {e}", ctx("reduce_scatter in place")));
    check(&ctx("reduce_scatter in place"), &buf, |k| {
        if k / count.max(1) == r {
            expect::<T>(ReduceOp::Sum, w, k)
        } else {
            orig[k]
        }
    });
    // gather and scatter from every root
    for root in 0..w {
        let input: Vec<T> = (0..count)
            .map(|i| T::from_i64(val(r, i, ReduceOp::Sum)))
            .collect();
        let mut out = if r == root {
            vec![T::default(); w * count]
        } else {
            Vec::new()
        };
        c.gather(&input, &mut out, root)
            .unwrap_or_else(|e| panic!("{} root {root}: {e}", ctx("gather")));
        if r == root {
            check(&ctx("gather"), &out, |k| {
                T::from_i64(val(k / count.max(1), k % count.max(1), ReduceOp::Sum))
            });
        }
        let input: Vec<T> = if r == root {
            (0..w * count)
                .map(|k| T::from_i64(a2a_val(root, k / count.max(1), k % count.max(1))))
                .collect()
        } else {
            Vec::new()
        };
        let mut out = vec![T::default(); count];
        c.scatter_async(&input, &mut out, root)
            .unwrap()
            .wait()
            .unwrap_or_else(|e| panic!("{} root {root}: {e}", ctx("scatter")));
        check(&ctx("scatter"), &out, |j| T::from_i64(a2a_val(root, r, j)));
    }
    // a group: every rank sends to and receives from both neighbours (sends added first on
    // every rank, which blocking calls in this order could not complete for large messages),
    // with an all-reduce and an all-gather added after them
    if w > 1 {
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let mine: Vec<T> = (0..count).map(|i| T::from_i64(a2a_val(r, 0, i))).collect();
        let mut from_prev = vec![T::default(); count];
        let mut from_next = vec![T::default(); count];
        let mut sum: Vec<T> = (0..count)
            .map(|i| T::from_i64(val(r, i, ReduceOp::Sum)))
            .collect();
        let mut gathered = vec![T::default(); w * count];
        let mut g = c.group().send(&mine, next).unwrap();
        if w > 2 {
            g = g
                .send(&mine, prev)
                .unwrap()
                .recv(&mut from_next, next)
                .unwrap();
        }
        g.recv(&mut from_prev, prev)
            .unwrap()
            .all_reduce(&mut sum, ReduceOp::Sum)
            .unwrap()
            .all_gather(&mine, &mut gathered)
            .unwrap()
            .wait()
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("group")));
        check(&ctx("group recv from prev"), &from_prev, |i| {
            T::from_i64(a2a_val(prev, 0, i))
        });
        if w > 2 {
            check(&ctx("group recv from next"), &from_next, |i| {
                T::from_i64(a2a_val(next, 0, i))
            });
        }
        check(&ctx("group all_reduce"), &sum, |i| {
            expect::<T>(ReduceOp::Sum, w, i)
        });
        check(&ctx("group all_gather"), &gathered, |k| {
            T::from_i64(a2a_val(k / count.max(1), 0, k % count.max(1)))
        });
    }
}

/// Random floats: not exact, but every rank must end with the same bits.
fn random_identity(c: &mut Communicator) -> u64 {
    let mut x = 0x1234_5678_9abc_def0u64 ^ (c.rank() as u64 * 0x9e37_79b9);
    let mut buf: Vec<f32> = (0..30011)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 20) as f32 - 8.0
        })
        .collect();
    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn run_rank(mut c: Communicator, tiny: bool, ops: &[ReduceOp], tx: mpsc::Sender<(usize, u64)>) {
    run_dtype::<f32>(&mut c, "float", tiny, ops);
    run_dtype::<f64>(&mut c, "double", tiny, ops);
    run_dtype::<f16>(&mut c, "half", tiny, ops);
    run_dtype::<bf16>(&mut c, "bfloat16", tiny, ops);
    run_dtype::<i32>(&mut c, "int32", tiny, ops);
    run_dtype::<i64>(&mut c, "int64", tiny, ops);
    run_dtype::<u8>(&mut c, "uint8", tiny, ops);
    let h = random_identity(&mut c);
    tx.send((c.rank(), h)).unwrap();
}

fn finish(rx: mpsc::Receiver<(usize, u64)>, world: usize, what: &str) {
    let hashes: Vec<(usize, u64)> = rx.iter().take(world).collect();
    assert_eq!(hashes.len(), world, "{what}: not every rank finished");
    assert!(
        hashes.iter().all(|h| h.1 == hashes[0].1),
        "{what}: ranks differ in bits: {hashes:?}"
    );
}

fn config(tiny: bool) -> Config {
    let mut c = Config::new("unused:0", 0, 1);
    c.timeout = Duration::from_secs(60);
    if tiny {
        c.chunk_bytes = 24;
        c.nslots = 2;
    }
    c
}

/// Every copy-receive goes straight into place after a clear-to-send (small messages, so the
/// direct path races with slot traffic as much as possible).
fn config_direct() -> Config {
    let mut c = config(false);
    c.chunk_bytes = 256;
    c.nslots = 3;
    c.direct_min = 1;
    c.shm_direct_min = 1;
    c
}

fn mem_suite(world: usize, tiny: bool) {
    mem_suite_with(world, tiny, config(tiny));
}

fn mem_suite_with(world: usize, tiny: bool, cfg: Config) {
    mem_suite_ops(world, tiny, cfg, &ReduceOp::ALL);
}

fn mem_suite_ops(world: usize, tiny: bool, cfg: Config, ops: &'static [ReduceOp]) {
    let comms = Communicator::mem_group(world, &cfg).unwrap();
    let (tx, rx) = mpsc::channel();
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let tx = tx.clone();
            std::thread::spawn(move || run_rank(c, tiny, ops, tx))
        })
        .collect();
    drop(tx);
    for h in hs {
        h.join().expect("rank thread panicked");
    }
    finish(rx, world, &format!("mem world {world}"));
}

fn tcp_suite(world: usize, tiny: bool) {
    let mut cfg = config(tiny);
    cfg.transport = TransportMode::Tcp;
    tcp_suite_with(world, tiny, cfg);
}

/// Every pair over shared memory (all ranks are threads of this process, one host).
fn shm_suite(world: usize, tiny: bool) {
    let mut cfg = config(tiny);
    cfg.transport = TransportMode::Shm;
    tcp_suite_with(world, tiny, cfg);
}

/// Every pair over shared memory with the board off: eager all-reduces as ring messages.
fn shm_no_board(world: usize, tiny: bool) {
    let mut cfg = config(tiny);
    cfg.transport = TransportMode::Shm;
    cfg.shm_board = false;
    tcp_suite_with(world, tiny, cfg);
}

/// `hosts` emulated hosts of `world / hosts` ranks each (`GRADSYNC_HOST_ID`), automatic
/// transport choice: shared memory inside a host, TCP across, with the automatic algorithm
/// choice and then with every all-reduce forced to `algo`.
fn hosts_suite(world: usize, hosts: usize, tiny: bool, algo: Option<Algorithm>) {
    let mut cfg = config(tiny);
    cfg.algorithm = algo;
    cfg.host_id = Some(format!("hosts{hosts}"));
    // The automatic choice on a model measured at this init (across hosts: rank 0 ping-pongs
    // with a rank of its host and one of another), whatever the per-host cache holds.
    if algo.is_none() {
        cfg.cost_file = Some(fresh_cost_file(&format!("hosts{world}x{hosts}")));
    }
    let file = cfg.cost_file.clone();
    tcp_suite_with(world, tiny, cfg);
    if let Some(f) = file {
        let _ = std::fs::remove_file(f);
    }
}

/// A path for a cost model that does not exist yet: init measures the model and writes it there
/// (and not into the per-host cache).
fn fresh_cost_file(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!(
        "gradsync-conformance-cost-{tag}-{}.json",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&p);
    p
}

/// A single host whose model is measured at this init (ring all-gathers on every rank).
fn shm_calibrated(world: usize, tiny: bool) {
    let mut cfg = config(tiny);
    let file = fresh_cost_file(&format!("shm{world}"));
    cfg.cost_file = Some(file.clone());
    cfg.transport = TransportMode::Shm;
    tcp_suite_with(world, tiny, cfg);
    let _ = std::fs::remove_file(file);
}

/// Every all-reduce forced to recursive halving-doubling (the other collectives as usual).
fn mem_forced(world: usize, tiny: bool, algo: Algorithm) {
    let mut cfg = config(tiny);
    cfg.algorithm = Some(algo);
    mem_suite_with(world, tiny, cfg);
}

fn tcp_forced(world: usize, tiny: bool, algo: Algorithm) {
    let mut cfg = config(tiny);
    cfg.algorithm = Some(algo);
    cfg.transport = TransportMode::Tcp;
    tcp_suite_with(world, tiny, cfg);
}

fn shm_forced(world: usize, tiny: bool, algo: Algorithm) {
    let mut cfg = config(tiny);
    cfg.algorithm = Some(algo);
    cfg.transport = TransportMode::Shm;
    tcp_suite_with(world, tiny, cfg);
}

fn mem_direct(world: usize, _: bool) {
    mem_suite_with(world, true, config_direct());
}

fn tcp_direct(world: usize, _: bool) {
    let mut cfg = config_direct();
    cfg.transport = TransportMode::Tcp;
    tcp_suite_with(world, true, cfg);
}

fn shm_direct(world: usize, _: bool) {
    let mut cfg = config_direct();
    cfg.transport = TransportMode::Shm;
    tcp_suite_with(world, true, cfg);
}

/// Every pair over RDMA verbs (all ranks are threads of this process, each with its own device
/// context and queue pairs). Needs an active RDMA port: `scripts/rdma-vm.sh` runs these inside
/// a Soft-RoCE VM; elsewhere they say that they skip.
#[cfg(feature = "rdma")]
fn rdma_suite(world: usize, tiny: bool) {
    let mut cfg = config(tiny);
    cfg.transport = TransportMode::Rdma;
    rdma_run(world, tiny, cfg);
}

/// The direct-write configuration over RDMA: the engine must not offer a caller's buffer to an
/// RDMA peer, so everything still lands through the inbox.
#[cfg(feature = "rdma")]
fn rdma_direct(world: usize, _: bool) {
    let mut cfg = config_direct();
    cfg.transport = TransportMode::Rdma;
    rdma_run(world, true, cfg);
}

/// Emulated hosts with the automatic choice: shared memory inside a host, RDMA across.
#[cfg(feature = "rdma")]
fn rdma_hosts(world: usize, hosts: usize, tiny: bool, algo: Option<Algorithm>) {
    let mut cfg = config(tiny);
    cfg.algorithm = algo;
    cfg.host_id = Some(format!("hosts{hosts}"));
    rdma_run(world, tiny, cfg);
}

#[cfg(feature = "rdma")]
fn rdma_run(world: usize, tiny: bool, cfg: Config) {
    if !gradsync_transport::rdma::active_port_present() {
        eprintln!(
            "skipped: no active RDMA port on this machine (scripts/rdma-vm.sh runs the rdma suites under Soft-RoCE)"
        );
        return;
    }
    tcp_suite_with(world, tiny, cfg);
}

/// The transport the automatic choice gives ranks on different hosts.
fn network_transport() -> &'static str {
    #[cfg(feature = "rdma")]
    if gradsync_transport::rdma::active_port_present() {
        return "rdma";
    }
    "tcp"
}

fn tcp_suite_with(world: usize, tiny: bool, base: Config) {
    tcp_suite_ops(world, tiny, base, &ReduceOp::ALL);
}

fn tcp_suite_ops(world: usize, tiny: bool, base: Config, ops: &'static [ReduceOp]) {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let (tx, rx) = mpsc::channel();
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let tx = tx.clone();
            let mut cfg = base.clone();
            cfg.store_addr = addr.clone();
            cfg.host_store = false;
            cfg.rank = rank;
            cfg.world = world;
            if let Some(tag) = &base.host_id {
                // `hostsN`: N emulated hosts holding contiguous blocks of ranks.
                if let Some(h) = tag
                    .strip_prefix("hosts")
                    .and_then(|h| h.parse::<usize>().ok())
                {
                    cfg.host_id = Some(format!("emulated-host-{}", rank / world.div_ceil(h)));
                }
            }
            let (transport, emulated) = (base.transport, base.host_id.is_some());
            let shm_board = base.shm_board;
            std::thread::spawn(move || {
                let c = Communicator::init(cfg).unwrap();
                let want = match transport {
                    TransportMode::Tcp => "tcp",
                    TransportMode::Shm => "shm",
                    TransportMode::Rdma => "rdma",
                    TransportMode::Auto => "",
                };
                for p in (0..world).filter(|&p| p != rank && !want.is_empty()) {
                    assert_eq!(c.peer_transport(p).name(), want, "rank {rank} -> {p}");
                }
                // Small all-reduces use the shared-memory board exactly when every rank is on
                // this host's shared memory and the board is not turned off.
                let board = world > 1 && transport == TransportMode::Shm && shm_board;
                assert_eq!(c.eager_board(), board, "rank {rank}");
                if emulated {
                    for p in (0..world).filter(|&p| p != rank) {
                        let same = c.host_of(p) == c.host_of(rank);
                        let want = if same { "shm" } else { network_transport() };
                        assert_eq!(c.peer_transport(p).name(), want, "rank {rank} -> {p}");
                    }
                }
                run_rank(c, tiny, ops, tx)
            })
        })
        .collect();
    drop(tx);
    for h in hs {
        h.join().expect("rank thread panicked");
    }
    finish(rx, world, &format!("tcp world {world}"));
}

/// Only the bitwise operators, over memory.
fn bitwise_mem(world: usize, tiny: bool) {
    mem_suite_ops(world, tiny, config(tiny), &BITWISE);
}

/// Only the bitwise operators, over TCP.
fn bitwise_tcp(world: usize, tiny: bool) {
    let mut cfg = config(tiny);
    cfg.transport = TransportMode::Tcp;
    tcp_suite_ops(world, tiny, cfg, &BITWISE);
}

/// Only the bitwise operators, over shared memory.
fn bitwise_shm(world: usize, tiny: bool) {
    let mut cfg = config(tiny);
    cfg.transport = TransportMode::Shm;
    tcp_suite_ops(world, tiny, cfg, &BITWISE);
}

macro_rules! suite {
    ($($name:ident: $f:ident($($arg:expr),*);)*) => {$(
        #[test]
        fn $name() {
            $f($($arg),*);
        }
    )*};
}

suite! {
    mem_w1: mem_suite(1, false);
    mem_w2_tiny: mem_suite(2, true);
    mem_w2: mem_suite(2, false);
    mem_w3_tiny: mem_suite(3, true);
    mem_w4: mem_suite(4, false);
    mem_w5_tiny: mem_suite(5, true);
    mem_w6: mem_suite(6, false);
    mem_w7_tiny: mem_suite(7, true);
    mem_w8: mem_suite(8, false);
    mem_w8_tiny: mem_suite(8, true);
    tcp_w1: tcp_suite(1, false);
    tcp_w2_tiny: tcp_suite(2, true);
    tcp_w2: tcp_suite(2, false);
    tcp_w3: tcp_suite(3, false);
    tcp_w4_tiny: tcp_suite(4, true);
    tcp_w5: tcp_suite(5, false);
    tcp_w6_tiny: tcp_suite(6, true);
    tcp_w7: tcp_suite(7, false);
    tcp_w8: tcp_suite(8, false);
    mem_direct_w2: mem_direct(2, true);
    mem_direct_w5: mem_direct(5, true);
    tcp_direct_w2: tcp_direct(2, true);
    tcp_direct_w3: tcp_direct(3, true);
    tcp_direct_w4: tcp_direct(4, true);
    shm_w1: shm_suite(1, false);
    shm_w2: shm_suite(2, false);
    shm_w2_tiny: shm_suite(2, true);
    shm_w3: shm_suite(3, false);
    shm_w4_tiny: shm_suite(4, true);
    shm_w5: shm_suite(5, false);
    shm_w8: shm_suite(8, false);
    shm_w3_no_board_tiny: shm_no_board(3, true);
    shm_w4_no_board: shm_no_board(4, false);
    shm_direct_w2: shm_direct(2, true);
    shm_direct_w4: shm_direct(4, true);
    hosts_2x2: hosts_suite(4, 2, false, None);
    hosts_2x2_tiny_hier: hosts_suite(4, 2, true, Some(Algorithm::Hierarchical));
    hosts_2x2_hier: hosts_suite(4, 2, false, Some(Algorithm::Hierarchical));
    hosts_3x2_hier: hosts_suite(6, 3, false, Some(Algorithm::Hierarchical));
    hosts_2x3_hier: hosts_suite(6, 2, false, Some(Algorithm::Hierarchical));
    hosts_4x1_hier: hosts_suite(4, 4, true, Some(Algorithm::Hierarchical));
    hosts_3x2_central: hosts_suite(6, 3, true, Some(Algorithm::Central));
    mem_w6_rabenseifner_tiny: mem_forced(6, true, Algorithm::Rabenseifner);
    mem_w7_rabenseifner_tiny: mem_forced(7, true, Algorithm::Rabenseifner);
    mem_w8_rabenseifner: mem_forced(8, false, Algorithm::Rabenseifner);
    tcp_w3_rabenseifner: tcp_forced(3, false, Algorithm::Rabenseifner);
    shm_w4_rabenseifner_tiny: shm_forced(4, true, Algorithm::Rabenseifner);
    shm_w5_rabenseifner: shm_forced(5, false, Algorithm::Rabenseifner);
    shm_w3_calibrated: shm_calibrated(3, false);
    mem_w7_double_tree_tiny: mem_forced(7, true, Algorithm::DoubleTree);
    mem_w8_double_tree: mem_forced(8, false, Algorithm::DoubleTree);
    tcp_w4_double_tree: tcp_forced(4, false, Algorithm::DoubleTree);
    shm_w3_double_tree_tiny: shm_forced(3, true, Algorithm::DoubleTree);
    shm_w6_double_tree: shm_forced(6, false, Algorithm::DoubleTree);
    bitwise_mem_w1: bitwise_mem(1, false);
    bitwise_mem_w2: bitwise_mem(2, false);
    bitwise_mem_w3_tiny: bitwise_mem(3, true);
    bitwise_mem_w4: bitwise_mem(4, false);
    bitwise_mem_w5_tiny: bitwise_mem(5, true);
    bitwise_mem_w6: bitwise_mem(6, false);
    bitwise_mem_w7_tiny: bitwise_mem(7, true);
    bitwise_mem_w8: bitwise_mem(8, false);
    bitwise_tcp_w1: bitwise_tcp(1, false);
    bitwise_tcp_w2_tiny: bitwise_tcp(2, true);
    bitwise_tcp_w3: bitwise_tcp(3, false);
    bitwise_tcp_w4_tiny: bitwise_tcp(4, true);
    bitwise_tcp_w5: bitwise_tcp(5, false);
    bitwise_tcp_w6: bitwise_tcp(6, false);
    bitwise_tcp_w7_tiny: bitwise_tcp(7, true);
    bitwise_tcp_w8: bitwise_tcp(8, false);
    bitwise_shm_w1: bitwise_shm(1, false);
    bitwise_shm_w2: bitwise_shm(2, false);
    bitwise_shm_w3_tiny: bitwise_shm(3, true);
    bitwise_shm_w4: bitwise_shm(4, false);
    bitwise_shm_w5: bitwise_shm(5, false);
    bitwise_shm_w6_tiny: bitwise_shm(6, true);
    bitwise_shm_w7: bitwise_shm(7, false);
    bitwise_shm_w8: bitwise_shm(8, false);
}

#[cfg(feature = "rdma")]
suite! {
    rdma_w1: rdma_suite(1, false);
    rdma_w2: rdma_suite(2, false);
    rdma_w2_tiny: rdma_suite(2, true);
    rdma_w3: rdma_suite(3, false);
    rdma_w4_tiny: rdma_suite(4, true);
    rdma_w5: rdma_suite(5, false);
    rdma_direct_w3: rdma_direct(3, true);
    rdma_hosts_2x2: rdma_hosts(4, 2, false, None);
    rdma_hosts_2x2_hier: rdma_hosts(4, 2, true, Some(Algorithm::Hierarchical));
}

/// Over RDMA a pair's queue pairs are made on first use: after a ring all-reduce on 8 ranks a
/// rank has them to its ring neighbours and to the peers init's own operations talked to (all
/// at power-of-two distances), not to the ranks 3 and 5 away; an all-to-all then connects
/// every pair. With `runtime_connect` off every pair is connected at init.
#[cfg(feature = "rdma")]
#[test]
fn rdma_queue_pairs_follow_the_peers_an_operation_talks_to() {
    if !gradsync_transport::rdma::active_port_present() {
        eprintln!(
            "skipped: no active RDMA port on this machine (scripts/rdma-vm.sh runs the rdma suites under Soft-RoCE)"
        );
        return;
    }
    use std::sync::{Arc, Barrier};
    let world = 8;
    let phase = Arc::new(Barrier::new(world));
    let res = common::run_ranks(
        world,
        |c| {
            c.transport = TransportMode::Rdma;
            c.algorithm = Some(Algorithm::Ring);
            c.eager_max = 0;
        },
        move |mut c| {
            let rank = c.rank();
            let mut a: Vec<f32> = (0..1000).map(|i| (rank * 1000 + i) as f32).collect();
            c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            for (i, x) in a.iter().enumerate() {
                let want: usize = (0..world).map(|r| r * 1000 + i).sum();
                assert_eq!(*x, want as f32, "rank {rank} element {i}");
            }
            // Ranks that run ahead would already dial for the all-to-all.
            phase.wait();
            let after_ring = c.connected_peers();
            phase.wait();
            let input: Vec<i64> = (0..world).map(|p| (rank * 100 + p) as i64).collect();
            let mut output = vec![0i64; world];
            c.all_to_all(&input, &mut output).unwrap();
            for (p, x) in output.iter().enumerate() {
                assert_eq!(*x, (p * 100 + rank) as i64, "rank {rank} block {p}");
            }
            (rank, after_ring, c.connected_peers())
        },
    );
    for (rank, ring, all) in res {
        for d in [1, 7] {
            assert!(
                ring.contains(&((rank + d) % world)),
                "rank {rank}: {ring:?}"
            );
        }
        for d in [3, 5] {
            assert!(
                !ring.contains(&((rank + d) % world)),
                "rank {rank}: {ring:?}"
            );
        }
        assert_eq!(
            all.len(),
            world - 1,
            "rank {rank} after all-to-all: {all:?}"
        );
    }
    let eager = common::run_ranks(
        3,
        |c| {
            c.transport = TransportMode::Rdma;
            c.runtime_connect = false;
        },
        |mut c| {
            let at_init = c.connected_peers().len();
            let mut a = vec![c.rank() as i32 + 1; 5000];
            c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            (at_init, a.iter().all(|&x| x == 6))
        },
    );
    assert_eq!(eager, vec![(2, true); 3]);
}

/// Board postings alternate between two slots, so a rank may reuse one only after every peer
/// has read what it held. Rooted collectives let a rank run ahead of its peers; this mixes them
/// with eager all-reduces of several sizes, on 4 ranks over shared memory, and checks every
/// result.
#[test]
fn shm_board_slots_survive_ranks_that_run_ahead() {
    let world = 4;
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, world);
            cfg.host_store = false;
            cfg.transport = TransportMode::Shm;
            cfg.timeout = Duration::from_secs(60);
            std::thread::spawn(move || {
                let mut c = Communicator::init(cfg).unwrap();
                assert!(c.eager_board(), "rank {rank}");
                for it in 0..300usize {
                    let root = it % world;
                    let n = [2, 100, 4096][it % 3];
                    let mut a: Vec<f32> = (0..n).map(|i| (rank * n + i + it) as f32).collect();
                    c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
                    for (i, x) in a.iter().enumerate() {
                        let want: usize = (0..world).map(|r| r * n + i + it).sum();
                        assert_eq!(*x, want as f32, "it {it} all_reduce element {i}");
                    }
                    let mut b = vec![if rank == root { it as i64 } else { -1 }; 16];
                    c.broadcast(&mut b, root).unwrap();
                    assert!(b.iter().all(|&v| v == it as i64), "it {it} broadcast");
                    let mut red = if rank == root {
                        vec![0i32; 64]
                    } else {
                        Vec::new()
                    };
                    c.reduce(&vec![rank as i32 + 1; 64], &mut red, ReduceOp::Sum, root)
                        .unwrap();
                    if rank == root {
                        assert!(red.iter().all(|&v| v == 10), "it {it} reduce");
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().expect("rank thread panicked");
    }
}
