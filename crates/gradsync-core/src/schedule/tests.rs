use super::*;

mod halving;
mod internal;

#[test]
fn deps_and_fifo_order() {
    let mut p = Program::new();
    let l = |s| Loc::new(Buf::Output, s);
    let r0 = p.push(
        Op::Recv {
            peer: 1,
            dst: l(0),
            reduce_with: None,
            len: 1,
        },
        &[],
    );
    let s0 = p.push(
        Op::Send {
            peer: 1,
            src: l(0),
            len: 1,
        },
        &[r0],
    );
    let s1 = p.push(
        Op::Send {
            peer: 1,
            src: l(1),
            len: 1,
        },
        &[],
    );
    let mut s = Schedule::new(p, 2);
    // s1 has no deps but must wait behind s0 in the send queue to peer 1.
    assert_eq!(s.poll_action().map(|x| x.0), Some(r0));
    assert_eq!(s.poll_action(), None);
    s.handle_complete(r0);
    assert_eq!(s.poll_action().map(|x| x.0), Some(s0));
    assert_eq!(s.poll_action().map(|x| x.0), Some(s1));
    s.handle_complete(s1);
    assert!(!s.is_done());
    s.handle_complete(s0);
    assert!(s.is_done());
    // A restarted schedule runs the same program again, in the same order.
    s.restart();
    assert!(!s.is_done());
    assert_eq!(s.in_flight(), 0);
    assert_eq!(s.poll_action().map(|x| x.0), Some(r0));
    assert_eq!(s.poll_action(), None);
    s.handle_complete(r0);
    assert_eq!(s.poll_action().map(|x| x.0), Some(s0));
    assert_eq!(s.poll_action().map(|x| x.0), Some(s1));
    s.handle_complete(s1);
    s.handle_complete(s0);
    assert!(s.is_done());
}

/// Restarting a schedule halfway, or after it finished, leaves it exactly as new: every
/// generated program hands out the same op sequence again.
#[test]
fn restart_replays_every_program() {
    use plan::{Algorithm, Params, build};
    for algorithm in Algorithm::EVERY {
        if !plan::supports(crate::Collective::AllReduce, algorithm) {
            continue;
        }
        for (world, local_size) in [(4, 2), (3, 0), (6, 3)] {
            let params = Params {
                coll: crate::Collective::AllReduce,
                rank: 1,
                world,
                count: 37,
                root: 0,
                op: crate::ReduceOp::Sum,
                segment: 5,
                in_place: false,
                algorithm,
                local_size,
            };
            let prog = build(&params).unwrap();
            // Drive to completion, completing ops in issue order; record the sequence.
            let run = |s: &mut Schedule, stop_after: usize| {
                let mut seq = Vec::new();
                while let Some((id, _)) = s.poll_action() {
                    seq.push(id);
                    if seq.len() == stop_after {
                        return seq;
                    }
                    s.handle_complete(id);
                }
                seq
            };
            let mut fresh = Schedule::new(prog.clone(), world);
            let want = run(&mut fresh, usize::MAX);
            assert!(fresh.is_done(), "{algorithm}");
            fresh.restart();
            assert_eq!(
                run(&mut fresh, usize::MAX),
                want,
                "{algorithm} after finishing"
            );
            let mut half = Schedule::new(prog, world);
            run(&mut half, want.len() / 2);
            half.restart();
            assert_eq!(
                run(&mut half, usize::MAX),
                want,
                "{algorithm} after a partial run"
            );
        }
    }
}

mod plan_tests {
    use super::super::plan::{
        Algorithm, Params, PlanError, SMALL_ALL_REDUCE_BYTES, block_range, build,
        bus_bandwidth_factor, default_algorithm, host_shape, supports,
    };
    use super::*;
    use crate::{Collective, ReduceOp};

    fn p(
        coll: Collective,
        algorithm: Algorithm,
        rank: usize,
        world: usize,
        count: usize,
    ) -> Params {
        Params {
            coll,
            rank,
            world,
            count,
            root: 0,
            op: ReduceOp::Sum,
            segment: usize::MAX,
            in_place: false,
            algorithm,
            local_size: 0,
        }
    }

    const PLANNED: [Collective; 9] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Barrier,
        Collective::AllToAll,
        Collective::Gather,
        Collective::Scatter,
    ];

    #[test]
    fn errors() {
        use Algorithm::*;
        use Collective::*;
        for alg in [Ring, Tree] {
            for coll in [Broadcast, Reduce] {
                for root in [4, 5, usize::MAX] {
                    let err = build(&Params {
                        root,
                        ..p(coll, alg, 0, 4, 8)
                    })
                    .unwrap_err();
                    assert_eq!(
                        err,
                        PlanError::RootOutOfRange {
                            coll,
                            root,
                            world: 4
                        }
                    );
                }
                build(&Params {
                    root: 3,
                    ..p(coll, alg, 0, 4, 8)
                })
                .unwrap();
            }
        }
        // Collectives without a root ignore it.
        build(&Params {
            root: 9,
            ..p(AllReduce, Ring, 0, 4, 8)
        })
        .unwrap();
        assert_eq!(
            build(&p(AllReduce, Ring, 0, 0, 8)).unwrap_err(),
            PlanError::EmptyWorld
        );
        assert_eq!(
            build(&p(AllReduce, Ring, 4, 4, 8)).unwrap_err(),
            PlanError::RankOutOfRange { rank: 4, world: 4 }
        );
        let zero = Params {
            segment: 0,
            ..p(AllReduce, Ring, 0, 4, 8)
        };
        assert_eq!(build(&zero).unwrap_err(), PlanError::ZeroSegment);
        for (coll, alg) in [
            (ReduceScatter, RecursiveDoubling),
            (ReduceScatter, Rabenseifner),
            (ReduceScatter, Tree),
            (AllGather, RecursiveDoubling),
            (AllGather, Tree),
            (Broadcast, RecursiveDoubling),
            (Reduce, RecursiveDoubling),
            (SendRecv, Ring),
        ] {
            let err = build(&p(coll, alg, 0, 4, 8)).unwrap_err();
            assert_eq!(
                err,
                PlanError::Unsupported {
                    coll,
                    algorithm: alg
                }
            );
        }
        let huge = Params {
            segment: 1,
            ..p(AllReduce, Ring, 0, 4, usize::MAX / 2)
        };
        assert!(matches!(build(&huge), Err(PlanError::TooLarge { .. })));
        let huge = p(AllGather, Ring, 0, 1 << 20, usize::MAX >> 10);
        assert!(matches!(build(&huge), Err(PlanError::TooLarge { .. })));
        // Schedules with ops per peer and segment count those against the limit too.
        let many = Params {
            segment: 1,
            ..p(AllReduce, Ring, 0, 512, 1 << 20)
        };
        assert!(many.validate().is_ok());
        for q in [
            Params {
                algorithm: Central,
                ..many
            },
            Params {
                coll: AllGather,
                ..many
            },
        ] {
            assert!(matches!(q.validate(), Err(PlanError::TooLarge { .. })));
        }
        assert_eq!(
            PlanError::RootOutOfRange {
                coll: Broadcast,
                root: 4,
                world: 4
            }
            .to_string(),
            "root 4 of broadcast is out of range for world size 4"
        );
        assert_eq!(
            PlanError::Unsupported {
                coll: AllGather,
                algorithm: Tree
            }
            .to_string(),
            "all_gather has no tree schedule"
        );
    }

    #[test]
    fn supports_agrees_with_build() {
        for coll in Collective::ALL {
            for alg in Algorithm::EVERY {
                assert_eq!(
                    supports(coll, alg),
                    build(&p(coll, alg, 1, 3, 5)).is_ok(),
                    "{coll} {alg}"
                );
            }
        }
    }

    #[test]
    fn algorithm_names() {
        for alg in Algorithm::ALL {
            assert_eq!(Algorithm::parse(alg.name()), Ok(alg));
            assert_eq!(alg.to_string(), alg.name());
        }
        assert_eq!(Algorithm::parse("RD"), Ok(Algorithm::RecursiveDoubling));
        assert_eq!(Algorithm::parse("rhd"), Ok(Algorithm::Rabenseifner));
        assert_eq!(Algorithm::parse("hier"), Ok(Algorithm::Hierarchical));
        assert_eq!(
            Algorithm::parse("Hierarchical"),
            Ok(Algorithm::Hierarchical)
        );
        assert_eq!(Algorithm::parse("CENTRAL"), Ok(Algorithm::Central));
        assert_eq!(
            Algorithm::parse("star"),
            Err(PlanError::UnknownAlgorithm("star".into()))
        );
        let msg = PlanError::UnknownAlgorithm("star".into()).to_string();
        for alg in Algorithm::ALL {
            assert!(msg.contains(alg.name()), "{msg}");
        }
        // The internal algorithms have names, but nobody can ask for them.
        for alg in Algorithm::EVERY {
            assert_eq!(alg.to_string(), alg.name());
            assert_eq!(Algorithm::ALL.contains(&alg), !alg.is_internal(), "{alg}");
            if alg.is_internal() {
                assert!(Algorithm::parse(alg.name()).is_err(), "{alg}");
                assert!(!msg.contains(alg.name()), "{msg}");
                for coll in Collective::ALL {
                    assert_eq!(supports(coll, alg), coll == Collective::AllReduce);
                }
            }
        }
        assert_eq!(Algorithm::Eager.name(), "eager");
        assert_eq!(Algorithm::Deterministic.name(), "deterministic");
        let mut every = Algorithm::EVERY.to_vec();
        every.dedup();
        assert_eq!(every.len(), 11);
    }

    #[test]
    fn host_shapes() {
        assert_eq!(host_shape(8, 0), Ok((1, 8)));
        assert_eq!(host_shape(8, 8), Ok((1, 8)));
        assert_eq!(host_shape(8, 4), Ok((2, 4)));
        assert_eq!(host_shape(8, 1), Ok((8, 1)));
        assert_eq!(host_shape(1, 1), Ok((1, 1)));
        assert_eq!(host_shape(0, 4), Err(PlanError::EmptyWorld));
        for (world, local_size) in [(6, 4), (4, 8), (7, 2)] {
            assert_eq!(
                host_shape(world, local_size),
                Err(PlanError::NonUniformHosts { world, local_size })
            );
        }
    }

    #[test]
    fn hierarchical_needs_uniform_hosts() {
        use Algorithm::*;
        use Collective::*;
        for coll in [AllReduce, ReduceScatter, AllGather] {
            for (world, local_size) in [(6, 4), (4, 8), (5, 2)] {
                let q = Params {
                    local_size,
                    ..p(coll, Hierarchical, 0, world, 8)
                };
                assert_eq!(
                    build(&q).unwrap_err(),
                    PlanError::NonUniformHosts { world, local_size }
                );
                // Other algorithms ignore the host layout.
                build(&Params {
                    algorithm: Ring,
                    ..q
                })
                .unwrap();
            }
        }
        // So does the barrier, whatever the algorithm.
        build(&Params {
            local_size: 4,
            ..p(Barrier, Hierarchical, 0, 6, 0)
        })
        .unwrap();
        assert_eq!(
            PlanError::NonUniformHosts {
                world: 6,
                local_size: 4
            }
            .to_string(),
            "world size 6 is not a multiple of local_size 4: hierarchical schedules need hosts of \
             equally many ranks"
        );
    }

    /// Op lists and dependencies of two programs are the same.
    fn same_program(a: &Program, b: &Program) -> bool {
        a.ops() == b.ops()
            && a.scratch_elems() == b.scratch_elems()
            && (0..a.len()).all(|i| a.deps(i as OpId) == b.deps(i as OpId))
    }

    #[test]
    fn hierarchical_on_one_level_is_the_ring() {
        use Collective::*;
        for coll in [AllReduce, ReduceScatter, AllGather] {
            for world in [1, 2, 3, 6] {
                for local_size in [0, 1, world] {
                    for in_place in [false, true] {
                        for rank in 0..world {
                            let ring = Params {
                                in_place,
                                segment: 3,
                                op: ReduceOp::Avg,
                                ..p(coll, Algorithm::Ring, rank, world, 10)
                            };
                            let hier = Params {
                                local_size,
                                algorithm: Algorithm::Hierarchical,
                                ..ring
                            };
                            assert!(
                                same_program(&build(&ring).unwrap(), &build(&hier).unwrap()),
                                "{hier:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn default_rule() {
        use Collective::*;
        assert_eq!(
            default_algorithm(AllReduce, 8, 0),
            Algorithm::RecursiveDoubling
        );
        assert_eq!(
            default_algorithm(AllReduce, 8, SMALL_ALL_REDUCE_BYTES),
            Algorithm::RecursiveDoubling
        );
        assert_eq!(
            default_algorithm(AllReduce, 8, SMALL_ALL_REDUCE_BYTES + 1),
            Algorithm::Ring
        );
        assert_eq!(default_algorithm(Broadcast, 8, 1 << 30), Algorithm::Tree);
        assert_eq!(default_algorithm(Reduce, 8, 4), Algorithm::Tree);
        for coll in [ReduceScatter, AllGather, Barrier] {
            assert_eq!(default_algorithm(coll, 8, 4), Algorithm::Ring);
        }
        for coll in PLANNED {
            assert!(supports(coll, default_algorithm(coll, 8, 4)));
        }
    }

    #[test]
    fn bus_bandwidth_factors() {
        assert_eq!(bus_bandwidth_factor(Collective::AllReduce, 4), 1.5);
        assert_eq!(bus_bandwidth_factor(Collective::AllGather, 4), 0.75);
        assert_eq!(bus_bandwidth_factor(Collective::ReduceScatter, 1), 0.0);
        assert_eq!(bus_bandwidth_factor(Collective::Broadcast, 8), 1.0);
    }

    #[test]
    fn blocks_partition_the_buffer() {
        for world in 1..=17 {
            for count in [0, 1, 3, world - 1, world, world + 1, 1000, 10007] {
                let mut next = 0;
                for b in 0..world {
                    let r = block_range(count, world, b);
                    assert_eq!(r.start, next);
                    assert!(r.len() == count / world || r.len() == count / world + 1);
                    next = r.end;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn buffer_conventions() {
        use Collective::*;
        let q = |coll, in_place, rank| Params {
            in_place,
            root: 1,
            ..p(coll, Algorithm::Ring, rank, 4, 5)
        };
        let sizes = |x: Params| {
            (
                x.input_elems(),
                x.output_elems(),
                x.result_range(),
                x.input_offset(),
            )
        };
        assert_eq!(sizes(q(AllReduce, false, 2)), (5, 5, 0..5, 0));
        assert_eq!(sizes(q(ReduceScatter, false, 2)), (20, 5, 0..5, 0));
        assert_eq!(sizes(q(ReduceScatter, true, 2)), (20, 20, 10..15, 0));
        assert_eq!(sizes(q(AllGather, false, 2)), (5, 20, 0..20, 0));
        assert_eq!(sizes(q(AllGather, true, 2)), (5, 20, 0..20, 10));
        assert_eq!(sizes(q(Broadcast, true, 2)), (5, 5, 0..5, 0));
        assert_eq!(sizes(q(Reduce, false, 2)), (5, 5, 0..0, 0));
        assert_eq!(sizes(q(Reduce, true, 1)), (5, 5, 0..5, 0));
        assert_eq!(sizes(q(Barrier, false, 2)), (0, 0, 0..0, 0));
    }

    /// Whether `coll` has an in-place form.
    fn has_in_place(coll: Collective) -> bool {
        !matches!(
            coll,
            Collective::AllToAll | Collective::AllToAllV | Collective::Gather | Collective::Scatter
        )
    }

    /// Every supported program over a grid of parameters, with its parameters.
    fn programs() -> impl Iterator<Item = (Params, Program)> {
        let mut out = Vec::new();
        for coll in PLANNED {
            for alg in Algorithm::EVERY {
                if !supports(coll, alg) {
                    continue;
                }
                let shapes: &[(usize, usize)] = if alg == Algorithm::Hierarchical {
                    &[(1, 0), (2, 1), (4, 2), (6, 2), (6, 3), (8, 4), (8, 2)]
                } else {
                    &[(1, 0), (2, 0), (3, 0), (5, 0), (8, 0)]
                };
                for &(world, local_size) in shapes {
                    for count in [0, 1, 3, 10, 37] {
                        for segment in [1, 4, usize::MAX] {
                            for in_place in [false, true] {
                                if in_place && !has_in_place(coll) {
                                    continue;
                                }
                                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                                    for rank in 0..world {
                                        let params = Params {
                                            root: (count + 1) % world,
                                            op,
                                            segment,
                                            in_place,
                                            local_size,
                                            ..p(coll, alg, rank, world, count)
                                        };
                                        out.push((params, build(&params).unwrap()));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        out.into_iter()
    }

    type Ranges = Vec<(Loc, usize)>;

    /// What `op` reads and writes in a world of `world` ranks.
    fn locs(op: &Op, world: usize) -> (Ranges, Ranges) {
        let (read, write) = op.extents(world);
        (read.into_iter().collect(), write.into_iter().collect())
    }

    #[test]
    fn programs_respect_the_conventions() {
        for (params, prog) in programs() {
            let ctx = format!("{params:?}");
            for (id, op) in prog.ops().iter().enumerate() {
                // The eager all-reduce sends whole buffers, by design.
                assert!(
                    op.len() <= params.segment || params.algorithm == Algorithm::Eager,
                    "{ctx}: op {id} longer than a segment"
                );
                if params.coll != Collective::Barrier {
                    assert!(!op.is_empty(), "{ctx}: op {id} is empty");
                }
                let (reads, writes) = locs(op, params.world);
                for &(l, len) in reads.iter().chain(&writes) {
                    let size = match l.buf {
                        Buf::Input => params.input_elems(),
                        Buf::Output => params.output_elems(),
                        Buf::Scratch => prog.scratch_elems(),
                    };
                    assert!(l.start + len <= size, "{ctx}: op {id} {op:?} out of bounds");
                    if params.in_place {
                        assert_ne!(l.buf, Buf::Input, "{ctx}: op {id} uses Input in place");
                    }
                }
                for &(l, _) in &writes {
                    assert_ne!(l.buf, Buf::Input, "{ctx}: op {id} writes Input");
                    let non_root_reduce =
                        params.coll == Collective::Reduce && params.rank != params.root;
                    assert!(
                        !(non_root_reduce && l.buf == Buf::Output),
                        "{ctx}: non-root reduce writes Output"
                    );
                }
                let finalize = matches!(op, Op::Finalize { .. });
                assert!(
                    !finalize || (params.op == ReduceOp::Avg && params.world > 1),
                    "{ctx}"
                );
                if let Op::Send { peer, .. } | Op::Recv { peer, .. } = *op {
                    assert_ne!(peer, params.rank, "{ctx}: op {id} talks to itself");
                }
            }
        }
    }

    /// The programs of every rank for `params`.
    fn world_of(params: Params) -> Vec<Program> {
        (0..params.world)
            .map(|rank| build(&Params { rank, ..params }).unwrap())
            .collect()
    }

    fn sends(progs: &[Program]) -> usize {
        progs
            .iter()
            .map(|p| {
                p.ops()
                    .iter()
                    .filter(|o| matches!(o, Op::Send { .. }))
                    .count()
            })
            .sum()
    }

    #[test]
    fn message_counts() {
        use Algorithm::*;
        use Collective::*;
        for n in 1..=9usize {
            let log = n.next_power_of_two().trailing_zeros() as usize;
            let base = p(AllReduce, Ring, 0, n, 8 * n);
            assert_eq!(
                sends(&world_of(base)),
                n * 2 * (n - 1),
                "ring all-reduce, n = {n}"
            );
            assert_eq!(
                sends(&world_of(Params {
                    coll: ReduceScatter,
                    ..base
                })),
                n * (n - 1)
            );
            assert_eq!(
                sends(&world_of(Params {
                    coll: AllGather,
                    ..base
                })),
                n * (n - 1)
            );
            let pow = if n.is_power_of_two() {
                n
            } else {
                n.next_power_of_two() / 2
            };
            let rd = sends(&world_of(Params {
                algorithm: RecursiveDoubling,
                ..base
            }));
            assert_eq!(
                rd,
                pow * pow.trailing_zeros() as usize + 2 * (n - pow),
                "rd, n = {n}"
            );
            for alg in [Ring, Tree] {
                assert_eq!(
                    sends(&world_of(Params {
                        coll: Broadcast,
                        algorithm: alg,
                        ..base
                    })),
                    n - 1
                );
                assert_eq!(
                    sends(&world_of(Params {
                        coll: Reduce,
                        algorithm: alg,
                        ..base
                    })),
                    n - 1
                );
            }
            assert_eq!(
                sends(&world_of(Params {
                    algorithm: Tree,
                    ..base
                })),
                2 * (n - 1)
            );
            assert_eq!(
                sends(&world_of(Params {
                    coll: Barrier,
                    count: 0,
                    ..base
                })),
                n * log
            );
            // Segments multiply the messages of a pipelined schedule.
            let seg = Params {
                coll: Broadcast,
                algorithm: Tree,
                segment: 3,
                count: 10,
                ..base
            };
            assert_eq!(sends(&world_of(seg)), 4 * (n - 1));
            // Central: every rank to the root and back.
            assert_eq!(
                sends(&world_of(Params {
                    algorithm: Central,
                    ..base
                })),
                2 * (n - 1)
            );
        }
        // Hierarchical over hosts x local ranks: rings of L inside and of H across hosts; the
        // intra-host phases of all-gather and reduce-scatter send the H slices of a column apart.
        for (hosts, local) in [(2, 2), (3, 2), (2, 3), (2, 4), (4, 1), (1, 4)] {
            let n = hosts * local;
            let base = Params {
                local_size: local,
                ..p(AllReduce, Hierarchical, 0, n, 8 * n)
            };
            let (h1, l1) = (hosts - 1, local - 1);
            assert_eq!(sends(&world_of(base)), n * 2 * (l1 + h1), "{hosts}x{local}");
            let columns = if hosts > 1 && local > 1 { hosts } else { 1 };
            for coll in [ReduceScatter, AllGather] {
                assert_eq!(
                    sends(&world_of(Params { coll, ..base })),
                    n * (l1 * columns + h1),
                    "{coll} {hosts}x{local}"
                );
            }
        }
    }

    /// The double binary tree: two spanning trees of depth about log2 n in which every rank is
    /// interior at most once; the all-reduce sends each half of the buffer once up and once down
    /// every edge of its tree, and the sends of a rank never exceed twice the buffer.
    #[test]
    fn double_tree_shape_and_traffic() {
        use super::super::tree::double_tree_interior;
        for n in 2..=300usize {
            let a = double_tree_interior(0, n);
            let b = double_tree_interior(1, n);
            assert!(
                a.iter().all(|r| !b.contains(r)),
                "n = {n}: ranks interior in both trees: {a:?} / {b:?}"
            );
            assert!(a.len() + b.len() <= n);
            // Both trees span the world: count = 2 elements, one per tree, so every rank sends
            // one element up its tree (root excepted) and one down to each child.
            let progs = world_of(p(Collective::AllReduce, Algorithm::DoubleTree, 0, n, 2));
            assert_eq!(sends(&progs), 2 * 2 * (n - 1), "n = {n}");
            if n <= 64 {
                // Each rank's elements sent, with a large buffer in segments of 16.
                let count = 64 * 16;
                let big = Params {
                    segment: 16,
                    ..p(Collective::AllReduce, Algorithm::DoubleTree, 0, n, count)
                };
                for (rank, prog) in world_of(big).iter().enumerate() {
                    let sent: usize = prog
                        .ops()
                        .iter()
                        .filter(|o| matches!(o, Op::Send { .. }))
                        .map(Op::len)
                        .sum();
                    assert!(sent <= 2 * count, "n = {n} rank {rank} sends {sent}");
                    let recvs = prog
                        .ops()
                        .iter()
                        .filter(|o| matches!(o, Op::Recv { .. }))
                        .count();
                    assert!(recvs > 0, "n = {n} rank {rank} receives nothing");
                }
            }
        }
    }

    #[test]
    fn central_root_reduces_in_rank_order() {
        for n in [2, 3, 5, 8] {
            let base = Params {
                segment: 3,
                op: ReduceOp::Avg,
                ..p(Collective::AllReduce, Algorithm::Central, 0, n, 10)
            };
            let root = build(&base).unwrap();
            let recvs: Vec<(usize, Option<Loc>)> = root
                .ops()
                .iter()
                .filter_map(|o| match *o {
                    Op::Recv {
                        peer, reduce_with, ..
                    } => Some((peer, reduce_with)),
                    _ => None,
                })
                .collect();
            // Per segment: ranks 1, 2, ..., n - 1, the first folded into the input.
            assert_eq!(recvs.len(), 4 * (n - 1));
            for (i, &(peer, with)) in recvs.iter().enumerate() {
                assert_eq!(peer, 1 + i % (n - 1));
                let buf = with.map(|w| w.buf);
                let want = if i % (n - 1) == 0 {
                    Buf::Input
                } else {
                    Buf::Output
                };
                assert_eq!(buf, Some(want));
            }
            // Other ranks only send their input and receive the result.
            for rank in 1..n {
                let prog = build(&Params { rank, ..base }).unwrap();
                assert!(prog.ops().iter().all(|o| match *o {
                    Op::Send { peer, .. } | Op::Recv { peer, .. } => peer == 0,
                    _ => false,
                }));
            }
        }
    }

    #[test]
    fn hierarchical_and_central_average_once() {
        use Collective::*;
        for (coll, alg, local_size) in [
            (AllReduce, Algorithm::Central, 0),
            (AllReduce, Algorithm::Hierarchical, 2),
            (AllReduce, Algorithm::Hierarchical, 3),
            (ReduceScatter, Algorithm::Hierarchical, 2),
            (ReduceScatter, Algorithm::Hierarchical, 3),
        ] {
            for count in [1, 7, 100] {
                for in_place in [false, true] {
                    let base = Params {
                        op: ReduceOp::Avg,
                        segment: 4,
                        in_place,
                        local_size,
                        ..p(coll, alg, 0, 6, count)
                    };
                    let divided: usize = world_of(base)
                        .iter()
                        .flat_map(|prog| prog.ops())
                        .map(|o| match o {
                            Op::Finalize { len, .. } => *len,
                            _ => 0,
                        })
                        .sum();
                    // All-reduce: every element of the result once; reduce-scatter: every
                    // rank's slice once.
                    let want = if coll == AllReduce { count } else { 6 * count };
                    assert_eq!(divided, want, "{base:?}");
                }
            }
        }
    }

    #[test]
    fn ring_all_reduce_reads_input_directly_and_averages_once() {
        for n in [2, 3, 5, 8] {
            for count in [1, 7, 100] {
                let base = Params {
                    op: ReduceOp::Avg,
                    segment: 4,
                    ..p(Collective::AllReduce, Algorithm::Ring, 0, n, count)
                };
                let progs = world_of(base);
                let mut divided = 0;
                for prog in &progs {
                    assert!(
                        !prog.ops().iter().any(|o| matches!(o, Op::Copy { .. })),
                        "no staging copy"
                    );
                    assert_eq!(prog.scratch_elems(), 0);
                    divided += prog
                        .ops()
                        .iter()
                        .map(|o| {
                            if let Op::Finalize { len, .. } = o {
                                *len
                            } else {
                                0
                            }
                        })
                        .sum::<usize>();
                }
                assert_eq!(divided, count, "each element divided exactly once");
            }
        }
    }
}
