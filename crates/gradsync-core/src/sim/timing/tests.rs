//! The timing model against the straightforward implementation it replaced (one
//! [`Schedule`] per rank, tables of world x world), and symmetric predictions against full ones.

use super::*;
use crate::schedule::Schedule;
use crate::schedule::plan::Algorithm;
use crate::{Collective, ReduceOp};

/// The timing model as first written: the same events in the same order, kept to check that
/// the compact implementation predicts exactly the same.
struct RefTimer<'a> {
    topo: &'a Topology,
    elem: usize,
    world: usize,
    scheds: Vec<Schedule>,
    /// Per (rank, link): whether the link is sending, and the sends waiting for it. Link 0 leads
    /// into the rank's host, link 1 out of it.
    busy: Vec<bool>,
    queue: Vec<VecDeque<(OpId, usize, usize)>>,
    /// Per (src, dst): messages arrived before their receive, and receives posted before their
    /// message.
    arrived: Vec<usize>,
    posted: Vec<VecDeque<OpId>>,
    /// Per (rank, op): messages of a post not yet arrived.
    post_left: std::collections::HashMap<(usize, OpId), usize>,
    finish: Vec<f64>,
    events: BinaryHeap<Reverse<Event>>,
    seq: u64,
    messages: u64,
    bytes: u64,
}

impl RefTimer<'_> {
    fn push(&mut self, t: f64, kind: Kind) {
        self.seq += 1;
        self.events.push(Reverse(Event {
            t,
            seq: self.seq,
            kind,
        }));
    }

    /// Index of the link from `r` to `peer` in `busy` and `queue`.
    fn link_index(&self, r: usize, peer: usize) -> usize {
        2 * r + usize::from(!self.topo.same_host(r, peer))
    }

    fn drain(&mut self, r: usize, t: f64) {
        while let Some((id, op)) = self.scheds[r].poll_action() {
            match op {
                Op::Send { peer, len, .. } => {
                    let k = self.link_index(r, peer);
                    self.queue[k].push_back((id, peer, len));
                }
                Op::Post { len, .. } => {
                    let n = self.world;
                    self.post_left.insert((r, id), n - 1);
                    for peer in (1..n).map(|k| (r + k) % n) {
                        let k = self.link_index(r, peer);
                        self.queue[k].push_back((id, peer, len));
                    }
                    if n == 1 {
                        self.push(t, Kind::Complete { rank: r, op: id });
                    }
                }
                Op::Recv { peer, .. } => {
                    let c = peer * self.world + r;
                    if self.arrived[c] > 0 {
                        self.arrived[c] -= 1;
                        self.push(t, Kind::Complete { rank: r, op: id });
                    } else {
                        self.posted[c].push_back(id);
                    }
                }
                Op::Copy { .. } | Op::ReduceParts { .. } | Op::Finalize { .. } => {
                    self.push(t, Kind::Complete { rank: r, op: id })
                }
            }
        }
        self.start_link(2 * r, t);
        self.start_link(2 * r + 1, t);
    }

    /// Starts the next send on link `k` if it is idle.
    fn start_link(&mut self, k: usize, t: f64) {
        if self.busy[k] {
            return;
        }
        if let Some((op, peer, len)) = self.queue[k].pop_front() {
            self.busy[k] = true;
            let r = k / 2;
            let bytes = len * self.elem;
            self.messages += 1;
            self.bytes += bytes as u64;
            let dt = self.topo.link(r, peer).message_s(bytes);
            self.push(t + dt, Kind::Sent { rank: r, op, peer });
        }
    }

    fn complete(&mut self, r: usize, op: OpId, t: f64) {
        self.scheds[r].handle_complete(op);
        self.finish[r] = self.finish[r].max(t);
        self.drain(r, t);
    }
}

fn reference_predict(
    programs: &[Program],
    elem_size: usize,
    topo: &Topology,
) -> Result<Prediction, SimError> {
    let world = programs.len();
    for (r, p) in programs.iter().enumerate() {
        for (id, op) in p.ops().iter().enumerate() {
            if let Op::Send { peer, .. } | Op::Recv { peer, .. } = *op
                && peer >= world
            {
                return Err(SimError::BadPeer {
                    rank: r,
                    op: id as OpId,
                    peer,
                    world,
                });
            }
        }
    }
    let mut tm = RefTimer {
        topo,
        elem: elem_size,
        world,
        scheds: programs
            .iter()
            .map(|p| Schedule::new(p.clone(), world))
            .collect(),
        busy: vec![false; 2 * world],
        queue: vec![VecDeque::new(); 2 * world],
        arrived: vec![0; world * world],
        posted: vec![VecDeque::new(); world * world],
        post_left: Default::default(),
        finish: vec![0.0; world],
        events: BinaryHeap::new(),
        seq: 0,
        messages: 0,
        bytes: 0,
    };
    for r in 0..world {
        tm.drain(r, 0.0);
    }
    while let Some(Reverse(ev)) = tm.events.pop() {
        match ev.kind {
            Kind::Complete { rank, op } => tm.complete(rank, op, ev.t),
            Kind::Sent { rank, op, peer } => {
                let k = tm.link_index(rank, peer);
                tm.busy[k] = false;
                let c = rank * world + peer;
                match tm.posted[c].pop_front() {
                    Some(recv) => tm.push(
                        ev.t,
                        Kind::Complete {
                            rank: peer,
                            op: recv,
                        },
                    ),
                    None => tm.arrived[c] += 1,
                }
                if let Some(left) = tm.post_left.get_mut(&(rank, op)) {
                    *left -= 1;
                    if *left > 0 {
                        tm.start_link(k, ev.t);
                        continue;
                    }
                }
                tm.complete(rank, op, ev.t);
            }
        }
    }
    let stuck: Vec<usize> = (0..world).filter(|&r| !tm.scheds[r].is_done()).collect();
    if !stuck.is_empty() {
        let detail = "the timing model found no possible progress".to_string();
        return Err(SimError::Deadlock {
            ranks: stuck,
            detail,
        });
    }
    Ok(Prediction {
        time_s: tm.finish.iter().copied().fold(0.0, f64::max),
        rank_time_s: tm.finish,
        messages: tm.messages,
        bytes: tm.bytes,
    })
}

fn params(
    coll: Collective,
    algorithm: Algorithm,
    world: usize,
    count: usize,
    segment: usize,
    in_place: bool,
    local_size: usize,
) -> Vec<Params> {
    (0..world)
        .map(|rank| Params {
            coll,
            rank,
            world,
            count,
            root: world / 2,
            op: ReduceOp::Avg,
            segment,
            in_place,
            algorithm,
            local_size,
        })
        .collect()
}

fn programs(ps: &[Params]) -> Option<Vec<Program>> {
    ps.iter().map(|p| plan::build(p).ok()).collect()
}

const COLLECTIVES: [Collective; 6] = [
    Collective::AllReduce,
    Collective::ReduceScatter,
    Collective::AllGather,
    Collective::Broadcast,
    Collective::Reduce,
    Collective::Barrier,
];

#[test]
fn compact_model_predicts_exactly_as_the_reference() {
    let fast = LinkModel::new(1e-6, 10e9);
    let slow = LinkModel::new(7e-6, 1e9);
    let mut cases = 0;
    for coll in COLLECTIVES {
        for algorithm in Algorithm::EVERY {
            for world in [1, 2, 3, 4, 5, 6, 8, 9, 12, 16] {
                for count in [0, 5, 1000] {
                    for segment in [7, usize::MAX] {
                        for in_place in [false, true] {
                            for local in [0, 2, 3] {
                                // The internal all-reduces move `world` times the buffer in
                                // small segments: their largest worlds run unsegmented only.
                                let big = count == 1000 && segment == 7 && world > 6;
                                if big && algorithm.is_internal() {
                                    continue;
                                }
                                let ps =
                                    params(coll, algorithm, world, count, segment, in_place, local);
                                let Some(progs) = programs(&ps) else {
                                    continue;
                                };
                                let topo = if local == 0 {
                                    Topology::flat(fast)
                                } else {
                                    Topology::two_level(local, fast, slow)
                                };
                                let want = reference_predict(&progs, 4, &topo);
                                let got = predict_programs_on(&progs, 4, &topo);
                                assert_eq!(
                                    got, want,
                                    "{coll} {algorithm} n={world} count={count} seg={segment} \
                                     in_place={in_place} local={local}"
                                );
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(cases > 3000, "{cases}");
}

#[test]
fn compact_model_reports_deadlocks_and_bad_peers_as_the_reference() {
    use crate::schedule::{Buf, Loc};
    let recv = |peer| Op::Recv {
        peer,
        dst: Loc::new(Buf::Output, 0),
        reduce_with: None,
        len: 1,
    };
    let send = |peer| Op::Send {
        peer,
        src: Loc::new(Buf::Input, 0),
        len: 1,
    };
    // Both ranks receive before they send.
    let mut a = Program::new();
    let r = a.push(recv(1), &[]);
    a.push(send(1), &[r]);
    let mut b = Program::new();
    let r = b.push(recv(0), &[]);
    b.push(send(0), &[r]);
    let progs = vec![a, b];
    let topo = Topology::flat(LinkModel::default());
    let got = predict_programs_on(&progs, 4, &topo);
    assert!(matches!(got, Err(SimError::Deadlock { ref ranks, .. }) if ranks == &[0, 1]));
    assert_eq!(got, reference_predict(&progs, 4, &topo));
    let mut c = Program::new();
    c.push(send(5), &[]);
    let got = predict_programs_on(&[c.clone(), Program::new()], 4, &topo);
    assert!(matches!(got, Err(SimError::BadPeer { peer: 5, .. })));
    assert_eq!(got, reference_predict(&[c, Program::new()], 4, &topo));
}

#[test]
fn symmetric_predictions_equal_full_ones() {
    let link = LinkModel::new(2e-6, 50e9);
    let mut found = Vec::new();
    for algorithm in Algorithm::EVERY {
        for world in [2, 3, 4, 5, 6, 8, 12, 16, 32, 64] {
            for count in [1, 7, 1000, 4096, 12288] {
                for segment in [1000, usize::MAX] {
                    for in_place in [false, true] {
                        let mut ps = params(
                            Collective::AllReduce,
                            algorithm,
                            world,
                            count,
                            segment,
                            in_place,
                            0,
                        );
                        for p in &mut ps {
                            p.op = ReduceOp::Sum;
                        }
                        if programs(&ps[..1]).is_none() {
                            continue;
                        }
                        let Some((got, sym)) =
                            predict_symmetric(&ps, DataType::F32, &link).unwrap()
                        else {
                            continue;
                        };
                        let want = predict(&ps, DataType::F32, &link).unwrap();
                        assert_eq!(
                            got, want,
                            "{algorithm} n={world} count={count} seg={segment} \
                             in_place={in_place} under {sym:?}"
                        );
                        found.push((algorithm, world, count, sym));
                    }
                }
            }
        }
    }
    // The fast path is taken where it should be: rings whose blocks are all alike, and
    // recursive doubling and halving-doubling on powers of two.
    let has = |a, n, c, s| found.contains(&(a, n, c, s));
    assert!(has(Algorithm::Ring, 64, 4096, Symmetry::Rotation));
    assert!(has(Algorithm::Ring, 12, 12288, Symmetry::Rotation));
    assert!(has(Algorithm::RecursiveDoubling, 64, 7, Symmetry::Xor));
    // Every rank of the eager all-reduce posts once and receives from the others in turn; the
    // deterministic one is a ring all-gather of each piece.
    assert!(has(Algorithm::Eager, 64, 4096, Symmetry::Rotation));
    assert!(has(Algorithm::Deterministic, 64, 4096, Symmetry::Rotation));
    // Rabenseifner on a power of two, with blocks all alike, is a butterfly: one message per
    // step to the partner at a fixed xor distance.
    assert!(has(Algorithm::Rabenseifner, 32, 4096, Symmetry::Xor));
    assert!(has(Algorithm::Rabenseifner, 64, 12288, Symmetry::Xor));
    // Ragged blocks, folded worlds and trees are not symmetric.
    assert!(
        !found
            .iter()
            .any(|f| f.0 == Algorithm::Ring && f.1 == 64 && f.2 == 7)
    );
    assert!(
        !found
            .iter()
            .any(|f| f.0 == Algorithm::RecursiveDoubling && f.1 == 12)
    );
    assert!(!found.iter().any(|f| f.0 == Algorithm::Tree));
}

#[test]
fn symmetric_prediction_of_a_large_world_checks_a_sample() {
    // 2048 ranks whose programs together exceed the limit of a full check.
    let ps = params(
        Collective::AllReduce,
        Algorithm::Ring,
        2048,
        2048 * 4,
        1 << 20,
        false,
        0,
    );
    let ops = plan::build(&ps[0]).unwrap().len();
    assert!(2048 * ops > SYMMETRY_CHECK_ALL_OPS);
    let sample = check_ranks(2048, ops);
    assert!(sample.len() < 64 && sample.iter().all(|&r| (2..2048).contains(&r)));
    for r in [2, 8, 1023, 1024, 1025, 2040, 2047, 512] {
        assert!(sample.contains(&r), "{r}");
    }
    let link = LinkModel::new(2e-6, 50e9);
    let (t, sym) = predict_symmetric(&ps, DataType::F32, &link)
        .unwrap()
        .expect("the ring is symmetric");
    assert_eq!(sym, Symmetry::Rotation);
    // 2 (n - 1) messages of B / n bytes in a row.
    let want = 2.0 * 2047.0 * link.message_s(16);
    assert!(
        (t.time_s - want).abs() < 1e-9 * want,
        "{} vs {want}",
        t.time_s
    );
    assert_eq!(t.messages, 2048 * 2 * 2047);
    // Parameters that differ between ranks (other than the rank) are never symmetric.
    let mut odd = ps.clone();
    odd[7].count += 1;
    assert_eq!(predict_symmetric(&odd, DataType::F32, &link).unwrap(), None);
}
