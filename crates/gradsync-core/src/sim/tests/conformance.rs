//! The conformance sweep: every collective and algorithm, worlds 1..=8 and 16, counts
//! {0, 1, 3, world - 1, 1000, 10007}, every dtype x op, in place and out of place, segments
//! {1, 7, unlimited}, three seeds (the third with rendezvous sends; odd seeds use random floats,
//! even ones exact inputs). Every run checks that ranks agree bit for bit, that exact inputs give
//! exactly the reference, and that random floats are within tolerance. The full cross product
//! runs on the small counts; the larger counts run every world x segment x in-place configuration
//! with the dtype x op pairs in rotation (segment 1 on fewer worlds for 10007). The bitwise
//! operators run with the integer types only; [`bitwise_over_a_float_type_is_refused`] checks
//! that the simulator refuses them over a float type.
//!
//! The hierarchical schedules run the same sweep over two-level topologies (hosts x ranks per
//! host in [`TOPOLOGIES`]) instead of flat worlds. The internal all-reduces (eager and
//! deterministic) run it too (see [`internal`] for where they run less), and in addition every
//! world from 9 to 16 ([`internal_every_world`]); Rabenseifner, whose fold differs from world to
//! world, also runs on every world from 9 to 17 and on 31 to 33 ([`rabenseifner_every_world`]).

use super::*;

const WORLDS: [usize; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 16];
const SEGMENTS: [usize; 3] = [1, 7, usize::MAX];
const SEEDS: usize = 3;
/// `(hosts, ranks per host)` of the hierarchical sweep.
const TOPOLOGIES: [(usize, usize); 7] = [(1, 1), (1, 4), (4, 1), (2, 2), (3, 2), (2, 3), (2, 4)];

/// A world to sweep: its size and `Params::local_size`.
type Shape = (usize, usize);

/// The flat worlds, as shapes.
fn flat_worlds() -> Vec<Shape> {
    WORLDS.iter().map(|&w| (w, 0)).collect()
}

/// The two-level topologies, as shapes.
fn topologies() -> Vec<Shape> {
    TOPOLOGIES.iter().map(|&(h, l)| (h * l, l)).collect()
}

#[derive(Clone, Copy, Debug)]
struct Case {
    coll: Collective,
    algorithm: Algorithm,
    world: usize,
    local_size: usize,
    count: usize,
    root: usize,
    dtype: DataType,
    op: ReduceOp,
    segment: usize,
    in_place: bool,
    /// Index of the seed; also picks the input kind and the send protocol.
    seed: usize,
}

fn reduces(coll: Collective) -> bool {
    matches!(
        coll,
        Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
    )
}

impl Case {
    /// An all-reduce of `algorithm` rooted at 0 with the `i`-th dtype x op pair of `pairs` and
    /// the `i`-th seed, on one rank of nothing: the sweeps fill in the rest.
    fn all_reduce(algorithm: Algorithm, pairs: &[(DataType, ReduceOp)], i: usize) -> Case {
        let (dtype, op) = rotate(pairs, i);
        Case {
            coll: Collective::AllReduce,
            algorithm,
            world: 1,
            local_size: 0,
            count: 0,
            root: 0,
            dtype,
            op,
            segment: usize::MAX,
            in_place: false,
            seed: i % SEEDS,
        }
    }

    fn kind(&self) -> InputKind {
        if !reduces(self.coll) {
            InputKind::Bits
        } else if self.seed % 2 == 1 {
            InputKind::Random
        } else {
            InputKind::Exact
        }
    }

    fn run(&self) -> Result<(), String> {
        let ps: Vec<Params> = (0..self.world)
            .map(|rank| Params {
                coll: self.coll,
                rank,
                world: self.world,
                count: self.count,
                root: self.root,
                op: self.op,
                segment: self.segment,
                in_place: self.in_place,
                algorithm: self.algorithm,
                local_size: self.local_size,
            })
            .collect();
        let kind = self.kind();
        let base = (self.seed as u64) << 32 ^ (self.count as u64) << 8;
        let inputs: Vec<Vec<u8>> = ps
            .iter()
            .map(|p| {
                gen_input(
                    self.dtype,
                    self.op,
                    kind,
                    p.input_elems(),
                    base + p.rank as u64,
                )
            })
            .collect();
        let opts = SimOptions {
            rendezvous: self.seed == 2,
            ..SimOptions::new(base ^ 0xc0ffee)
        };
        let res = run_with(ps, self.dtype, inputs.clone(), &opts).map_err(|e| e.to_string())?;
        let tol = default_tolerance(self.dtype, self.op, self.world, kind);
        check(
            self.coll,
            self.dtype,
            self.op,
            self.world,
            self.root,
            &inputs,
            &res.outputs,
            tol,
        )
        .map_err(|e| e.to_string())
    }
}

/// Runs every case and fails with the first few failures.
fn sweep(cases: impl IntoIterator<Item = Case>) -> usize {
    let mut runs = 0;
    let mut failures = Vec::new();
    for case in cases {
        runs += 1;
        if let Err(e) = case.run() {
            failures.push(format!("{case:?}: {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {runs} runs failed:\n{}",
        failures.len(),
        failures
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(runs > 0);
    runs
}

/// Every dtype x op pair a collective takes: every operator its type supports (the bitwise
/// ones for integer types only) when it reduces, `Sum` otherwise.
fn dtype_ops(coll: Collective) -> Vec<(DataType, ReduceOp)> {
    let ops: &[ReduceOp] = if reduces(coll) {
        &ReduceOp::ALL
    } else {
        &[ReduceOp::Sum]
    };
    DataType::ALL
        .iter()
        .flat_map(|&d| {
            ops.iter()
                .filter(move |o| o.supports(d))
                .map(move |&o| (d, o))
        })
        .collect()
}

/// The `i`-th pair of a rotation through `pairs` that visits every pair: the stride is prime
/// and does not divide the number of pairs.
fn rotate(pairs: &[(DataType, ReduceOp)], i: usize) -> (DataType, ReduceOp) {
    const STRIDE: usize = 13;
    assert!(
        !pairs.len().is_multiple_of(STRIDE),
        "a stride of {STRIDE} does not visit all of {} pairs",
        pairs.len()
    );
    pairs[(i * STRIDE) % pairs.len()]
}

fn small_counts(world: usize) -> Vec<usize> {
    let mut c = vec![0, 1, 3, world - 1];
    c.sort_unstable();
    c.dedup();
    c
}

/// The full cross product over the small counts.
fn small(coll: Collective, algorithm: Algorithm, shapes: &[Shape]) -> usize {
    let mut cases = Vec::new();
    let mut i = 0usize;
    for &(world, local_size) in shapes {
        for count in small_counts(world) {
            for segment in SEGMENTS {
                for in_place in [false, true] {
                    for (dtype, op) in dtype_ops(coll) {
                        for seed in 0..SEEDS {
                            i += 1;
                            let root = i % world;
                            cases.push(Case {
                                coll,
                                algorithm,
                                world,
                                local_size,
                                count,
                                root,
                                dtype,
                                op,
                                segment,
                                in_place,
                                seed,
                            });
                        }
                    }
                }
            }
        }
    }
    sweep(cases)
}

/// `count` elements: every shape x segment x in-place configuration (segment 1 only for worlds in
/// `seg1_worlds`) with `per_config` dtype x op pairs, the pairs, seeds and roots in rotation so
/// that every pair occurs.
fn large(
    coll: Collective,
    algorithm: Algorithm,
    shapes: &[Shape],
    count: usize,
    seg1_worlds: &[usize],
    per_config: usize,
) -> usize {
    let keep = |world: usize, segment: usize| segment != 1 || seg1_worlds.contains(&world);
    large_where(coll, algorithm, shapes, count, per_config, &keep)
}

/// [`large`] with the (world, segment) configurations that `keep` accepts.
fn large_where(
    coll: Collective,
    algorithm: Algorithm,
    shapes: &[Shape],
    count: usize,
    per_config: usize,
    keep: &dyn Fn(usize, usize) -> bool,
) -> usize {
    let pairs = dtype_ops(coll);
    let mut cases = Vec::new();
    let mut i = 0usize;
    for &(world, local_size) in shapes {
        for segment in SEGMENTS {
            for in_place in [false, true] {
                if !keep(world, segment) {
                    continue;
                }
                for _ in 0..per_config {
                    i += 1;
                    let (dtype, op) = rotate(&pairs, i);
                    let (seed, root) = (i % SEEDS, i % world);
                    cases.push(Case {
                        coll,
                        algorithm,
                        world,
                        local_size,
                        count,
                        root,
                        dtype,
                        op,
                        segment,
                        in_place,
                        seed,
                    });
                }
            }
        }
    }
    sweep(cases)
}

macro_rules! conformance {
    ($($name:ident: $coll:ident $alg:ident;)*) => {
        mod small_counts {
            use super::*;
            $(#[test] fn $name() {
                assert!(supports(Collective::$coll, Algorithm::$alg));
                small(Collective::$coll, Algorithm::$alg, &flat_worlds());
            })*
        }
        mod count_1000 {
            use super::*;
            $(#[test] fn $name() {
                large(Collective::$coll, Algorithm::$alg, &flat_worlds(), 1000, &WORLDS, 2);
            })*
        }
        mod count_10007 {
            use super::*;
            $(#[test] fn $name() {
                large(Collective::$coll, Algorithm::$alg, &flat_worlds(), 10007, &[2, 3], 1);
            })*
        }
    };
}

/// The sweep of a hierarchical schedule over [`TOPOLOGIES`]: small counts in full, 1000 with
/// segment 1 everywhere, 10007 with segment 1 on the 2 x 2 topology.
macro_rules! hierarchical {
    ($($name:ident: $coll:ident;)*) => {
        mod hierarchical {
            use super::*;
            $(mod $name {
                use super::*;
                const COLL: Collective = Collective::$coll;
                #[test] fn small_counts() {
                    assert!(supports(COLL, Algorithm::Hierarchical));
                    small(COLL, Algorithm::Hierarchical, &topologies());
                }
                #[test] fn count_1000() {
                    let worlds: Vec<usize> = topologies().iter().map(|s| s.0).collect();
                    large(COLL, Algorithm::Hierarchical, &topologies(), 1000, &worlds, 2);
                }
                #[test] fn count_10007() {
                    large(COLL, Algorithm::Hierarchical, &topologies(), 10007, &[4], 1);
                }
            })*
        }
    };
}

hierarchical! {
    all_reduce: AllReduce;
    reduce_scatter: ReduceScatter;
    all_gather: AllGather;
}

conformance! {
    all_reduce_ring: AllReduce Ring;
    all_reduce_doubling: AllReduce RecursiveDoubling;
    all_reduce_rabenseifner: AllReduce Rabenseifner;
    all_reduce_tree: AllReduce Tree;
    all_reduce_double_tree: AllReduce DoubleTree;
    reduce_scatter_ring: ReduceScatter Ring;
    all_gather_ring: AllGather Ring;
    broadcast_tree: Broadcast Tree;
    broadcast_chain: Broadcast Ring;
    reduce_tree: Reduce Tree;
    reduce_chain: Reduce Ring;
    all_reduce_central: AllReduce Central;
}

/// The sweep of an internal all-reduce. Both move `world - 1` whole buffers out of every rank
/// (the deterministic one as an all-gather in messages of at most `segment` elements, `world / 2`
/// times the ring's messages), so they sweep in full where that is cheap: the small counts on
/// worlds 1 to 8 (worlds 9 to 16 run in [`internal_every_world`]); 1000 on every world, with
/// segment 1 on worlds 2, 3 and 5; 10007 on every world, with segment 7 up to world 4 and
/// segment 1 on world 2.
macro_rules! internal {
    ($($name:ident: $alg:ident;)*) => {
        mod internal {
            use super::*;
            $(mod $name {
                use super::*;
                const ALG: Algorithm = Algorithm::$alg;
                #[test] fn small_counts() {
                    assert!(supports(Collective::AllReduce, ALG));
                    let worlds: Vec<Shape> = (1..=8).map(|w| (w, 0)).collect();
                    small(Collective::AllReduce, ALG, &worlds);
                }
                #[test] fn count_1000() {
                    large(Collective::AllReduce, ALG, &flat_worlds(), 1000, &[2, 3, 5], 2);
                }
                #[test] fn count_10007() {
                    let keep = |w: usize, s: usize| match s {
                        1 => w == 2,
                        7 => w <= 4,
                        _ => true,
                    };
                    large_where(Collective::AllReduce, ALG, &flat_worlds(), 10007, 1, &keep);
                }
            })*
        }
    };
}

internal! {
    eager: Eager;
    deterministic: Deterministic;
}

/// The internal all-reduces over worlds 9 to 16, with the dtype x op pairs in rotation: the small
/// counts with every segment, in place and out of place; 1000 with segment 7 out of place and
/// unlimited; 10007 unlimited.
#[test]
fn internal_every_world() {
    let pairs = dtype_ops(Collective::AllReduce);
    let mut cases = Vec::new();
    let mut i = 0usize;
    for algorithm in [Algorithm::Eager, Algorithm::Deterministic] {
        for world in 9..=16 {
            for count in [0, 1, 3, world - 1, 1000, 10007] {
                for segment in SEGMENTS {
                    for in_place in [false, true] {
                        let large = count >= 1000 && segment != usize::MAX;
                        if large && (count > 1000 || segment == 1 || in_place) {
                            continue;
                        }
                        i += 1;
                        cases.push(Case {
                            world,
                            count,
                            segment,
                            in_place,
                            ..Case::all_reduce(algorithm, &pairs, i)
                        });
                    }
                }
            }
        }
    }
    sweep(cases);
}

/// Rabenseifner over every world from 9 to 17 and the worlds around 32, where the fold differs
/// from world to world (`n - p` ranks folded, `p` the largest power of two `<= n`), and over
/// worlds that span hosts, where each step orders its blocks for the next: the small counts and
/// odd ones (`2 n + 1`, 1001, 10007 unsegmented), with every segment, in place and out of place,
/// every seed (the third with rendezvous sends), and the dtype x op pairs in rotation.
#[test]
fn rabenseifner_every_world() {
    let pairs = dtype_ops(Collective::AllReduce);
    let mut cases = Vec::new();
    let mut i = 0usize;
    let flat = (9..=17).chain([31, 32, 33]).map(|w| (w, 0));
    let hosts = [
        (4, 1),
        (5, 1),
        (8, 1),
        (8, 2),
        (12, 3),
        (16, 4),
        (16, 1),
        (32, 8),
    ];
    for (world, local_size) in flat.chain(hosts) {
        for count in [0, 1, 3, world - 1, 2 * world + 1, 1001, 10007] {
            for segment in SEGMENTS {
                if count == 10007 && segment != usize::MAX {
                    continue;
                }
                for in_place in [false, true] {
                    for seed in 0..SEEDS {
                        i += 1;
                        cases.push(Case {
                            world,
                            local_size,
                            count,
                            segment,
                            in_place,
                            seed,
                            ..Case::all_reduce(Algorithm::Rabenseifner, &pairs, i)
                        });
                    }
                }
            }
        }
    }
    sweep(cases);
}

#[test]
fn barrier_every_world_and_algorithm() {
    let cases = (1..=17).flat_map(|world| {
        Algorithm::ALL.into_iter().flat_map(move |algorithm| {
            (0..SEEDS).map(move |seed| Case {
                coll: Collective::Barrier,
                algorithm,
                world,
                local_size: 0,
                count: 0,
                root: 0,
                dtype: DataType::U8,
                op: ReduceOp::Sum,
                segment: 1,
                in_place: seed == 1,
                seed,
            })
        })
    });
    sweep(cases);
}

/// The bitwise operators over every integer type on every world and algorithm of the
/// reducing collectives, at odd counts, so that each shows up on every schedule beyond the
/// rotation of the larger sweeps.
#[test]
fn bitwise_every_algorithm() {
    let mut cases = Vec::new();
    let mut i = 0usize;
    for (coll, algorithm) in [
        (Collective::AllReduce, Algorithm::Ring),
        (Collective::AllReduce, Algorithm::RecursiveDoubling),
        (Collective::AllReduce, Algorithm::Rabenseifner),
        (Collective::AllReduce, Algorithm::Tree),
        (Collective::AllReduce, Algorithm::DoubleTree),
        (Collective::AllReduce, Algorithm::Central),
        (Collective::AllReduce, Algorithm::Eager),
        (Collective::AllReduce, Algorithm::Deterministic),
        (Collective::ReduceScatter, Algorithm::Ring),
        (Collective::Reduce, Algorithm::Tree),
        (Collective::Reduce, Algorithm::Ring),
    ] {
        for world in 1..=8 {
            for count in [1, 3, 2 * world + 1, 1001] {
                for dtype in [DataType::I32, DataType::I64, DataType::U8] {
                    for op in [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor] {
                        i += 1;
                        cases.push(Case {
                            coll,
                            algorithm,
                            world,
                            local_size: 0,
                            count,
                            root: i % world,
                            dtype,
                            op,
                            segment: SEGMENTS[i % 3],
                            in_place: i.is_multiple_of(2),
                            seed: i % SEEDS,
                        });
                    }
                }
            }
        }
    }
    sweep(cases);
}

/// A bitwise operator over a float type is an error of the run, naming the rank, the operator
/// and the type, for every reducing collective and world (one rank included, where nothing is
/// reduced); collectives that do not reduce ignore the operator.
#[test]
fn bitwise_over_a_float_type_is_refused() {
    for (coll, algorithm) in [
        (Collective::AllReduce, Algorithm::Ring),
        (Collective::AllReduce, Algorithm::Eager),
        (Collective::ReduceScatter, Algorithm::Ring),
        (Collective::Reduce, Algorithm::Tree),
    ] {
        for world in [1, 2, 5] {
            let ps: Vec<Params> = (0..world)
                .map(|rank| Params {
                    coll,
                    rank,
                    world,
                    count: 3,
                    root: 0,
                    op: ReduceOp::Bxor,
                    segment: 7,
                    in_place: false,
                    algorithm,
                    local_size: 0,
                })
                .collect();
            let inputs = ps.iter().map(|p| vec![0; p.input_elems() * 4]).collect();
            let err = run_with(ps, DataType::F32, inputs, &SimOptions::new(1)).unwrap_err();
            assert!(
                matches!(err, SimError::OpType { rank: 0, .. }),
                "{coll} world {world}: {err:?}"
            );
            assert_eq!(
                err.to_string(),
                "rank 0: reduction op bxor is bitwise and is not defined for the floating-point \
                 type float (bitwise ops take int32, int64 or uint8)"
            );
        }
    }
    let ps: Vec<Params> = (0..3)
        .map(|rank| Params {
            coll: Collective::AllGather,
            rank,
            world: 3,
            count: 2,
            root: 0,
            op: ReduceOp::Band,
            segment: 7,
            in_place: false,
            algorithm: Algorithm::Ring,
            local_size: 0,
        })
        .collect();
    let inputs: Vec<Vec<u8>> = (0..3).map(|r| vec![r as u8; 16]).collect();
    let res = run_with(ps, DataType::F64, inputs.clone(), &SimOptions::new(2)).unwrap();
    assert_eq!(res.outputs, vec![inputs.concat(); 3]);
}

#[test]
fn every_root() {
    let pairs = [
        (DataType::F32, ReduceOp::Sum),
        (DataType::Bf16, ReduceOp::Avg),
        (DataType::I64, ReduceOp::Max),
        (DataType::F16, ReduceOp::Prod),
    ];
    let mut cases = Vec::new();
    let mut i = 0usize;
    for coll in [Collective::Broadcast, Collective::Reduce] {
        for algorithm in [Algorithm::Tree, Algorithm::Ring] {
            for world in WORLDS {
                for root in 0..world {
                    for count in [0, 1, 3, 1000] {
                        i += 1;
                        let (dtype, op) = pairs[i % pairs.len()];
                        let segment = if count == 1000 {
                            SEGMENTS[1 + i % 2]
                        } else {
                            SEGMENTS[i % 3]
                        };
                        let (in_place, seed) = (i.is_multiple_of(2), i % SEEDS);
                        cases.push(Case {
                            coll,
                            algorithm,
                            world,
                            local_size: 0,
                            count,
                            root,
                            dtype,
                            op,
                            segment,
                            in_place,
                            seed,
                        });
                    }
                }
            }
        }
    }
    sweep(cases);
}

/// All-to-all (pairwise and Bruck), gather and scatter from every root: every flat world, the
/// small and odd counts, every segment, every seed, the dtypes in rotation (they only move
/// data, so the op does not matter).
#[test]
fn all_to_all_gather_scatter() {
    let dtypes = DataType::ALL;
    let mut cases = Vec::new();
    let mut i = 0usize;
    for world in WORLDS {
        for count in [0, 1, 3, world.saturating_sub(1), 1000] {
            for segment in SEGMENTS {
                if count == 1000 && segment == 1 && world > 4 {
                    continue;
                }
                let mut runs: Vec<(Collective, Algorithm, usize)> = vec![
                    (Collective::AllToAll, Algorithm::Pairwise, 0),
                    (Collective::AllToAll, Algorithm::Bruck, 0),
                ];
                for root in 0..world {
                    runs.push((Collective::Gather, Algorithm::Central, root));
                    runs.push((Collective::Scatter, Algorithm::Central, root));
                }
                for (coll, algorithm, root) in runs {
                    for seed in 0..SEEDS {
                        i += 1;
                        cases.push(Case {
                            coll,
                            algorithm,
                            world,
                            local_size: 0,
                            count,
                            root,
                            dtype: dtypes[i % dtypes.len()],
                            op: ReduceOp::Sum,
                            segment,
                            in_place: false,
                            seed,
                        });
                    }
                }
            }
        }
    }
    sweep(cases);
}

/// The pairwise all-to-allv with counts that differ per pair (some zero), every window from 1
/// to past the world, against a direct computation of where each element lands.
#[test]
fn all_to_allv_uneven_counts() {
    use crate::schedule::alltoall::{Block, all_to_allv, contiguous};
    for world in [1, 2, 3, 5, 8] {
        for window in [1, 2, 3, 8] {
            for segment in [1, 4, usize::MAX] {
                // Rank s sends (s * 3 + d * 5) % 7 elements to rank d.
                let n = |s: usize, d: usize| (s * 3 + d * 5) % 7;
                let sends: Vec<Vec<Block>> = (0..world)
                    .map(|s| contiguous(&(0..world).map(|d| n(s, d)).collect::<Vec<_>>()).unwrap())
                    .collect();
                let recvs: Vec<Vec<Block>> = (0..world)
                    .map(|d| contiguous(&(0..world).map(|s| n(s, d)).collect::<Vec<_>>()).unwrap())
                    .collect();
                let progs: Vec<_> = (0..world)
                    .map(|r| all_to_allv(r, &sends[r], &recvs[r], segment, window))
                    .collect();
                // Element j of rank s's block for d is s * 1000 + d * 10 + j.
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|s| {
                        (0..world)
                            .flat_map(|d| (0..n(s, d)).map(move |j| (s * 1000 + d * 10 + j) as u32))
                            .flat_map(u32::to_le_bytes)
                            .collect()
                    })
                    .collect();
                let setups: Vec<RankSetup> = progs
                    .into_iter()
                    .zip(inputs)
                    .enumerate()
                    .map(|(d, (program, input))| RankSetup {
                        program,
                        input,
                        output: vec![0xee; (0..world).map(|s| n(s, d)).sum::<usize>() * 4],
                        in_place: false,
                        op: ReduceOp::Sum,
                    })
                    .collect();
                let opts = SimOptions::new(world as u64 * 31 + window as u64);
                let res = crate::sim::run_programs(setups, DataType::I32, &opts)
                    .unwrap_or_else(|e| panic!("world {world} window {window}: {e}"))
                    .outputs;
                for (d, got) in res.iter().enumerate() {
                    let want: Vec<u8> = (0..world)
                        .flat_map(|s| (0..n(s, d)).map(move |j| (s * 1000 + d * 10 + j) as u32))
                        .flat_map(u32::to_le_bytes)
                        .collect();
                    assert_eq!(
                        *got, want,
                        "world {world} window {window} segment {segment} rank {d}"
                    );
                }
            }
        }
    }
}

/// The all-reduces whose programs change across hosts (`local_size` below the world: the tree's
/// segments, Rabenseifner's message order, the double tree's), over the two-level topologies and
/// 2, 5 and 8 hosts of one rank, with segments that the tree cuts finer there (an eighth of 512
/// and 4096 elements, four per level) as well as the sweep's, every dtype x op pair in rotation,
/// in place and out of place.
#[test]
fn all_reduce_across_hosts() {
    let mut cases = Vec::new();
    let mut i = 0usize;
    let pairs = dtype_ops(Collective::AllReduce);
    for algorithm in [
        Algorithm::Tree,
        Algorithm::Rabenseifner,
        Algorithm::DoubleTree,
    ] {
        let shapes = topologies().into_iter().chain([(2, 1), (5, 1), (8, 1)]);
        for (world, local_size) in shapes {
            for (count, segment) in [(1000, 512), (10007, 4096), (1000, 7), (257, usize::MAX)] {
                for in_place in [false, true] {
                    i += 1;
                    cases.push(Case {
                        world,
                        local_size,
                        count,
                        segment,
                        in_place,
                        ..Case::all_reduce(algorithm, &pairs, i)
                    });
                }
            }
        }
    }
    sweep(cases);
}
