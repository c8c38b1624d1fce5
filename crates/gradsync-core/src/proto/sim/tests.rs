//! Protocol simulations: every algorithm over the real machines, reordering, slow peers,
//! credit starvation, worlds 1 to 64.

use super::*;
use crate::schedule::Algorithm;
use crate::{Collective, DataType, ReduceOp};

fn call(coll: Collective, algorithm: Algorithm, count: usize) -> CallSpec {
    CallSpec {
        coll,
        algorithm,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        count,
        root: 0,
        in_place: false,
    }
}

/// A mix of every collective and algorithm, eager and deterministic all-reduces among them,
/// in place and out of place, with a root that moves.
fn mix(world: usize) -> Vec<CallSpec> {
    use Algorithm::*;
    use Collective::*;
    let mut v = vec![
        call(AllReduce, Ring, 1000),
        call(AllReduce, Eager, 7),
        CallSpec {
            in_place: true,
            op: ReduceOp::Avg,
            ..call(AllReduce, Eager, 33)
        },
        call(AllReduce, RecursiveDoubling, 300),
        call(AllReduce, Eager, 1),
        CallSpec {
            dtype: DataType::I32,
            op: ReduceOp::Max,
            ..call(AllReduce, Tree, 513)
        },
        call(AllReduce, Rabenseifner, 257),
        call(AllReduce, DoubleTree, 700),
        CallSpec {
            in_place: true,
            ..call(AllReduce, Deterministic, 500)
        },
        call(ReduceScatter, Ring, 70),
        call(AllGather, Ring, 65),
        call(AllToAll, Pairwise, 150),
        call(AllToAll, Bruck, 3),
        CallSpec {
            root: world - 1,
            ..call(Broadcast, Tree, 300)
        },
        CallSpec {
            root: world / 2,
            dtype: DataType::U8,
            op: ReduceOp::Min,
            ..call(Reduce, Ring, 301)
        },
        call(Barrier, Ring, 0),
        call(AllReduce, Eager, 64),
        CallSpec {
            dtype: DataType::F64,
            op: ReduceOp::Prod,
            in_place: true,
            ..call(AllReduce, Ring, 999)
        },
    ];
    // The bitwise operators, one per integer type.
    v.extend([
        CallSpec {
            dtype: DataType::I64,
            op: ReduceOp::Band,
            ..call(AllReduce, Eager, 9)
        },
        CallSpec {
            dtype: DataType::U8,
            op: ReduceOp::Bor,
            ..call(ReduceScatter, Ring, 67)
        },
        CallSpec {
            dtype: DataType::I32,
            op: ReduceOp::Bxor,
            in_place: true,
            ..call(AllReduce, Ring, 777)
        },
        CallSpec {
            root: world - 1,
            dtype: DataType::I32,
            op: ReduceOp::Band,
            ..call(Reduce, Tree, 65)
        },
    ]);
    if world > 1 {
        v.push(call(AllReduce, Central, 100));
    }
    v
}

/// A reducing call with a bitwise operator over a float type fails before any rank starts,
/// naming the call, the operator and the type.
#[test]
fn bitwise_over_a_float_type_is_refused() {
    for dtype in [DataType::F32, DataType::F64, DataType::F16, DataType::Bf16] {
        let calls = [
            call(Collective::AllReduce, Algorithm::Ring, 10),
            CallSpec {
                dtype,
                op: ReduceOp::Bor,
                ..call(Collective::ReduceScatter, Algorithm::Ring, 10)
            },
        ];
        let err = run(&SimConfig::new(1), 3, &calls).unwrap_err();
        assert_eq!(
            err,
            SimError::OpType {
                call: 1,
                source: crate::TypeError::OpNotForType {
                    op: ReduceOp::Bor,
                    dtype
                }
            }
        );
        assert!(
            err.to_string()
                .starts_with(&format!("call 1: reduction op bor is bitwise and is not defined for the floating-point type {dtype}")),
            "{err}"
        );
    }
}

fn check(cfg: &SimConfig, world: usize, calls: &[CallSpec]) -> SimStats {
    run(cfg, world, calls)
        .unwrap_or_else(|e| panic!("world {world} seed {} {cfg:?}: {e}", cfg.seed))
}

#[test]
fn ring_all_reduce_on_two_ranks() {
    let calls = [call(Collective::AllReduce, Algorithm::Ring, 1000)];
    for seed in 0..20 {
        let s = check(&SimConfig::new(seed), 2, &calls);
        assert!(s.writes > 0, "{s:?}");
    }
}

#[test]
fn every_collective_in_sequence_worlds_1_to_9() {
    for world in 1..=9 {
        for seed in 0..6 {
            let mut cfg = SimConfig::new(seed * 31 + world as u64);
            cfg.board = seed % 2 == 1;
            cfg.fifo = seed % 3 == 2;
            check(&cfg, world, &mix(world));
        }
    }
}

#[test]
fn credit_starvation_one_slot_per_pair() {
    for world in [2, 3, 5] {
        for seed in 0..8 {
            let mut cfg = SimConfig::new(seed);
            cfg.nslots = 2;
            cfg.window = Some(1);
            cfg.slot_bytes = 64;
            cfg.direct_min = usize::MAX;
            check(&cfg, world, &mix(world));
        }
    }
}

/// Messages up to 1 KiB, direct from 512 bytes (all-to-all and all-gather blocks of 150
/// floats go as one message each, in place where the receiver offers).
fn with_direct_moves(seed: u64) -> SimConfig {
    let mut cfg = SimConfig::new(seed);
    cfg.slot_bytes = 1024;
    cfg.fifo = seed % 2 == 1;
    cfg
}

/// In all-to-all and all-gather every message large enough goes straight into place: its
/// sender waits for the receiver's offer rather than taking a slot.
#[test]
fn moves_wait_for_the_offer_and_land_in_place() {
    use Algorithm::*;
    use Collective::*;
    for world in [2, 3, 4] {
        for seed in 0..8 {
            let cfg = with_direct_moves(seed + 300);
            let calls = [call(AllToAll, Pairwise, 150), call(AllGather, Ring, 150)];
            let s = check(&cfg, world, &calls);
            let messages = 2 * world * (world - 1);
            assert_eq!(
                s.direct_writes, messages as u64,
                "world {world} seed {seed}: {s:?}"
            );
        }
    }
}

/// A rank that never offers direct writes (configured otherwise): the sends that wait for its
/// offers go through slots once nothing moves for a while, and every call completes.
#[test]
fn a_rank_that_never_offers() {
    for world in [2, 3, 5] {
        for seed in 0..4 {
            let mut cfg = with_direct_moves(seed + 200);
            cfg.no_offers_from = Some(seed as usize % world);
            let s = check(&cfg, world, &mix(world));
            assert!(s.writes > 0, "{s:?}");
        }
    }
}

#[test]
fn a_slow_peer() {
    for world in [2, 4, 7] {
        for seed in 0..4 {
            let mut cfg = SimConfig::new(seed + 100);
            cfg.slow = Some((world / 2, 20));
            cfg.board = seed % 2 == 0;
            check(&cfg, world, &mix(world));
        }
    }
}

#[test]
fn checksums_on_every_path() {
    for world in [2, 3, 4] {
        let mut cfg = SimConfig::new(world as u64);
        cfg.checksum = true;
        cfg.board = true;
        check(&cfg, world, &mix(world));
        cfg.board = false;
        check(&cfg, world, &mix(world));
    }
}

#[test]
fn worlds_up_to_64() {
    use Algorithm::*;
    use Collective::*;
    for world in [16, 31, 64] {
        let calls = [
            call(AllReduce, Ring, 2 * world + 3),
            call(AllReduce, Eager, 5),
            call(AllReduce, RecursiveDoubling, 40),
            call(AllReduce, DoubleTree, 300),
            call(AllGather, Ring, 3),
            call(Barrier, Ring, 0),
        ];
        for seed in 0..2 {
            let mut cfg = SimConfig::new(seed + world as u64);
            cfg.board = seed == 1;
            cfg.slot_bytes = 128;
            check(&cfg, world, &calls);
        }
    }
}

/// Sender and receiver stay on the same slot, with a window that divides no power of two,
/// when the message counters pass 2^31 and 2^32 (the immediate carries only their low 31 bits;
/// the top bit marks direct writes).
#[test]
fn slots_stay_in_step_across_the_counters_wrap() {
    use Algorithm::*;
    use Collective::*;
    for from in [(1u64 << 31) - 8, (1 << 32) - 8] {
        for seed in 0..4 {
            let mut cfg = SimConfig::new(seed);
            cfg.nslots = 8;
            cfg.window = Some(3);
            cfg.slot_bytes = 64;
            cfg.counters_from = from;
            let calls = [
                call(AllReduce, Ring, 300),
                call(AllReduce, Tree, 200),
                call(AllGather, Ring, 40),
            ];
            check(&cfg, 3, &calls);
        }
    }
}

/// Pairs without inbox slots between them (receive memory beyond the budget): messages copied
/// into place go straight there, those reduced on receipt (and empty ones) are staged in the
/// receiver's shared pool, granted in the order its schedule issued them. Every collective
/// and algorithm completes with a pool of 1 to 8 slots, every pair pooled or only the pairs
/// that are not ring neighbours, with and without boards and per-pair order.
#[test]
fn pooled_pairs_share_a_pool_of_receive_slots() {
    for world in [2, 3, 5, 8] {
        for seed in 0..6u64 {
            let mut cfg = SimConfig::new(seed * 7 + world as u64 + 500);
            cfg.pool_slots = [1, 2, 8][seed as usize % 3];
            cfg.pool_all = seed % 2 == 0;
            cfg.board = seed % 4 == 1;
            cfg.fifo = seed % 3 == 2;
            cfg.slot_bytes = 128;
            if seed % 3 == 1 {
                // A transport that takes writes only into long-lived regions: copies are
                // staged in the pool too.
                cfg.direct_min = usize::MAX;
            }
            let s = check(&cfg, world, &mix(world));
            if world > 2 || cfg.pool_all {
                assert!(s.pool_writes > 0, "world {world} seed {seed}: {s:?}");
            }
        }
    }
}

/// A slow rank among pooled pairs: its pool slots stay taken longer and its peers' sends wait
/// for its grants; every call still completes.
#[test]
fn a_slow_peer_with_a_pool_of_two() {
    for world in [4, 7] {
        for seed in 0..3 {
            let mut cfg = SimConfig::new(seed + 900);
            cfg.pool_slots = 2;
            cfg.pool_all = true;
            cfg.slow = Some((world / 2, 20));
            cfg.slot_bytes = 64;
            check(&cfg, world, &mix(world));
        }
    }
}

/// With checksums on a pair cannot be pooled (its messages need a slot's header).
#[test]
fn checksums_keep_every_pair_on_slots() {
    let mut cfg = crate::proto::Config {
        rank: 0,
        world: 3,
        nslots: 2,
        slot_bytes: 64,
        direct_min: usize::MAX,
        checksum: true,
    };
    let mut p = crate::proto::Protocol::new(cfg, std::time::Instant::now());
    assert!(!p.set_pooled(1, false));
    assert!(!p.pooled(1));
    cfg.checksum = false;
    let mut p = crate::proto::Protocol::new(cfg, std::time::Instant::now());
    assert!(p.set_pooled(1, false) && p.pooled(1) && p.window(1) == 0);
    assert!(!p.set_pooled(0, false), "a rank is not pooled with itself");
    p.set_window(1, 2);
    assert_eq!(p.window(1), 0, "a pooled pair keeps no window");
}
