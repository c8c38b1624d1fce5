//! Micro-benchmark of the reduction kernels.
//!
//! Prints the throughput of each kernel as bytes of one buffer processed per second (the way
//! nccl-tests counts `algbw`), next to `memcpy` of the same size and a loop kept scalar with
//! `std::hint::black_box`, all timed in the same run: the ratio to the scalar loop shows that the
//! kernels vectorize, the ratio to `memcpy` that they run at memory bandwidth. Each figure is the
//! median of at least five repetitions after one warm-up.
//!
//! `cargo bench -p gradsync-reduce` runs 1 MiB and 16 MiB buffers; `GRADSYNC_REDUCE_BENCH_LARGE=1`
//! adds 256 MiB (about 800 MiB of memory). Run as a test (`cargo test --benches`) it only checks
//! that every case runs, on a small buffer.

use std::hint::black_box;
use std::time::{Duration, Instant};

use gradsync_core::{DataType, ReduceOp};
use gradsync_reduce::{finalize_avg, isa, reduce_in_place, reduce_into};

const MIB: usize = 1 << 20;

/// How a case is measured.
struct Timing {
    min_reps: usize,
    target: Duration,
}

impl Timing {
    /// Median GB/s of `f`, which processes `bytes` bytes of one buffer per call.
    fn gbps(&self, bytes: usize, mut f: impl FnMut()) -> f64 {
        f();
        let mut samples = Vec::new();
        let start = Instant::now();
        while samples.len() < self.min_reps || start.elapsed() < self.target {
            let t = Instant::now();
            f();
            samples.push(t.elapsed());
        }
        samples.sort();
        bytes as f64 / samples[samples.len() / 2].as_secs_f64() / 1e9
    }
}

/// Three 8-aligned buffers of `bytes` bytes each.
struct Buffers {
    acc: Vec<u64>,
    inc: Vec<u64>,
    dst: Vec<u64>,
}

impl Buffers {
    fn new(bytes: usize) -> Self {
        let words = bytes / 8 + 1;
        Buffers {
            acc: vec![0; words],
            inc: vec![0; words],
            dst: vec![0; words],
        }
    }

    /// Fills all three buffers with copies of `elem`.
    fn fill(&mut self, elem: &[u8]) {
        for buf in [&mut self.acc, &mut self.inc, &mut self.dst] {
            for chunk in bytemuck::cast_slice_mut::<u64, u8>(buf).chunks_exact_mut(elem.len()) {
                chunk.copy_from_slice(elem);
            }
        }
    }

    /// `(acc, inc, dst)` as byte slices of `bytes` bytes starting `offset` bytes in.
    fn slices(&mut self, bytes: usize, offset: usize) -> (&mut [u8], &[u8], &mut [u8]) {
        let acc = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.acc)[offset..offset + bytes];
        let inc = &bytemuck::cast_slice::<u64, u8>(&self.inc)[offset..offset + bytes];
        let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.dst)[offset..offset + bytes];
        (acc, inc, dst)
    }
}

/// One reduction to time.
struct Case {
    name: &'static str,
    dtype: DataType,
    op: ReduceOp,
    /// One element, repeated to fill the buffers.
    elem: &'static [u8],
    /// `reduce_into` (three buffers) rather than `reduce_in_place` (two).
    into: bool,
    /// Byte offset of every buffer from an 8-aligned address.
    offset: usize,
}

const fn case(name: &'static str, dtype: DataType, op: ReduceOp, elem: &'static [u8]) -> Case {
    Case {
        name,
        dtype,
        op,
        elem,
        into: false,
        offset: 0,
    }
}

const F32_HALF: &[u8] = &0.5f32.to_le_bytes();
const F16_HALF: &[u8] = &[0x00, 0x38];

const CASES: [Case; 12] = [
    case("f32 sum in-place", DataType::F32, ReduceOp::Sum, F32_HALF),
    Case {
        into: true,
        ..case("f32 sum into", DataType::F32, ReduceOp::Sum, F32_HALF)
    },
    Case {
        offset: 1,
        ..case(
            "f32 sum in-place unaligned",
            DataType::F32,
            ReduceOp::Sum,
            F32_HALF,
        )
    },
    case("f32 max in-place", DataType::F32, ReduceOp::Max, F32_HALF),
    case(
        "f64 sum in-place",
        DataType::F64,
        ReduceOp::Sum,
        &0.5f64.to_le_bytes(),
    ),
    case(
        "i32 sum in-place",
        DataType::I32,
        ReduceOp::Sum,
        &3i32.to_le_bytes(),
    ),
    case("u8 sum in-place", DataType::U8, ReduceOp::Sum, &[3]),
    case(
        "i64 bxor in-place",
        DataType::I64,
        ReduceOp::Bxor,
        &3i64.to_le_bytes(),
    ),
    case("u8 band in-place", DataType::U8, ReduceOp::Band, &[3]),
    case("f16 sum in-place", DataType::F16, ReduceOp::Sum, F16_HALF),
    Case {
        into: true,
        ..case("f16 sum into", DataType::F16, ReduceOp::Sum, F16_HALF)
    },
    case(
        "bf16 sum in-place",
        DataType::Bf16,
        ReduceOp::Sum,
        &[0x00, 0x3F],
    ),
];

fn main() {
    let benchmarking = std::env::args().any(|a| a == "--bench");
    // `cargo bench -p gradsync-reduce -- f16` runs only the kernels whose label contains `f16`.
    let filter = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let selected = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    let large = std::env::var_os("GRADSYNC_REDUCE_BENCH_LARGE").is_some_and(|v| v != "0");
    let (sizes, timing) = if benchmarking {
        let mut sizes = vec![MIB, 16 * MIB];
        if large {
            sizes.push(256 * MIB);
        }
        (
            sizes,
            Timing {
                min_reps: 5,
                target: Duration::from_millis(300),
            },
        )
    } else {
        (
            vec![64 << 10],
            Timing {
                min_reps: 1,
                target: Duration::ZERO,
            },
        )
    };

    println!("kernels: {}", isa());
    println!(
        "{:>8}  {:<28} {:>8} {:>10} {:>10}",
        "size", "kernel", "GB/s", "vs memcpy", "vs scalar"
    );
    for bytes in sizes {
        let mut b = Buffers::new(bytes);
        b.fill(&0.5f32.to_le_bytes());
        let label = if bytes >= MIB {
            format!("{} MiB", bytes / MIB)
        } else {
            format!("{} KiB", bytes >> 10)
        };
        let row = |name: &str, gbps: f64, memcpy: f64, scalar: Option<f64>| {
            let vs_scalar = scalar.map_or(String::new(), |s| format!("{:.1}x", gbps / s));
            println!(
                "{label:>8}  {name:<28} {gbps:>8.1} {:>10.2} {vs_scalar:>10}",
                gbps / memcpy
            );
        };

        let memcpy = {
            let (_, inc, dst) = b.slices(bytes, 0);
            timing.gbps(bytes, || {
                dst.copy_from_slice(black_box(inc));
                black_box(&dst);
            })
        };
        row("memcpy (copy_from_slice)", memcpy, memcpy, None);

        let scalar = {
            let (acc, inc, _) = b.slices(bytes, 0);
            let acc: &mut [f32] = bytemuck::cast_slice_mut(acc);
            let inc: &[f32] = bytemuck::cast_slice(inc);
            timing.gbps(bytes, || {
                for (a, x) in acc.iter_mut().zip(inc) {
                    *a += black_box(*x);
                }
                black_box(&acc);
            })
        };
        row("f32 sum in-place, scalar", scalar, memcpy, Some(scalar));

        for Case {
            name,
            dtype,
            op,
            elem,
            into,
            offset,
        } in CASES
        {
            if !selected(name) {
                continue;
            }
            b.fill(elem);
            let (acc, inc, dst) = b.slices(bytes, offset);
            let gbps = if into {
                timing.gbps(bytes, || {
                    reduce_into(dtype, op, black_box(&mut *dst), &*acc, inc)
                })
            } else {
                timing.gbps(bytes, || {
                    reduce_in_place(dtype, op, black_box(&mut *acc), inc)
                })
            };
            row(name, gbps, memcpy, Some(scalar));
        }

        if !selected("f32 finalize_avg") {
            continue;
        }
        // Repeated division shrinks the values: start high and stop after a few repetitions, long
        // before they reach the (slow) subnormal range.
        b.fill(&(f32::MAX / 2.0).to_le_bytes());
        let (acc, _, _) = b.slices(bytes, 0);
        let few = Timing {
            min_reps: timing.min_reps.min(15),
            target: Duration::ZERO,
        };
        let gbps = few.gbps(bytes, || {
            finalize_avg(DataType::F32, black_box(&mut *acc), 3)
        });
        row("f32 finalize_avg", gbps, memcpy, Some(scalar));
    }
}
