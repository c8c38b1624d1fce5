//! Time prediction under an alpha-beta link model, flat or two-level (hosts of several ranks).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};

use super::SimError;
use crate::DataType;
use crate::schedule::plan::{self, Params};
use crate::schedule::{Op, OpId, Program, Schedule};

/// Cost of one message: `alpha_s + bytes * beta_s_per_byte` seconds.
///
/// `alpha_s` is the per-message latency (software overhead and wire latency), `beta_s_per_byte`
/// the inverse of the link bandwidth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Seconds per message.
    pub alpha_s: f64,
    /// Seconds per byte.
    pub beta_s_per_byte: f64,
}

impl LinkModel {
    /// A link of `alpha_s` seconds latency and `bytes_per_s` bandwidth.
    pub fn new(alpha_s: f64, bytes_per_s: f64) -> Self {
        LinkModel {
            alpha_s,
            beta_s_per_byte: 1.0 / bytes_per_s,
        }
    }

    /// Seconds to send one message of `bytes` bytes.
    pub fn message_s(&self, bytes: usize) -> f64 {
        self.alpha_s + bytes as f64 * self.beta_s_per_byte
    }
}

impl Default for LinkModel {
    /// Loopback TCP as measured on the development machines: about 8 us per small message and
    /// 4.2 GB/s for one stream.
    fn default() -> Self {
        LinkModel::new(8e-6, 4.2e9)
    }
}

/// A two-level network: ranks on the same host talk over one kind of link (shared memory,
/// NVLink), ranks on different hosts over another (the network).
///
/// Hosts hold contiguous blocks of `local_size` ranks, as [`Params::local_size`] describes them;
/// `local_size` 0 means a single host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Topology {
    /// Ranks per host; 0 for a single host.
    pub local_size: usize,
    /// Links between two ranks of the same host.
    pub intra: LinkModel,
    /// Links between ranks of different hosts.
    pub inter: LinkModel,
}

impl Topology {
    /// Every rank on one host, connected by `link`: the flat model.
    pub fn flat(link: LinkModel) -> Self {
        Topology {
            local_size: 0,
            intra: link,
            inter: link,
        }
    }

    /// Hosts of `local_size` ranks, `intra` inside a host and `inter` across hosts.
    pub fn two_level(local_size: usize, intra: LinkModel, inter: LinkModel) -> Self {
        Topology {
            local_size,
            intra,
            inter,
        }
    }

    /// Whether ranks `a` and `b` share a host.
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        self.local_size == 0 || a / self.local_size == b / self.local_size
    }

    /// The link a message from `a` to `b` takes.
    pub fn link(&self, a: usize, b: usize) -> &LinkModel {
        if self.same_host(a, b) {
            &self.intra
        } else {
            &self.inter
        }
    }
}

impl From<LinkModel> for Topology {
    fn from(link: LinkModel) -> Self {
        Topology::flat(link)
    }
}

/// Predicted duration of a collective.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    /// Seconds until the last rank finishes.
    pub time_s: f64,
    /// Seconds until each rank finishes.
    pub rank_time_s: Vec<f64>,
    /// Messages sent, over all ranks.
    pub messages: u64,
    /// Payload bytes sent, over all ranks.
    pub bytes: u64,
}

/// Predicts how long the collective `params_per_rank` describes takes on links of `link`, for
/// elements of `dtype`.
///
/// # Model
///
/// An event-driven virtual clock. All ranks start at time 0. Every rank has one outgoing link
/// that carries one message at a time, in the order the sends become ready: a message of `b`
/// bytes occupies it for `alpha + b * beta` and arrives at the end of that interval, when the
/// send also completes. Incoming traffic is not limited (a rank receives from several peers at
/// once, as with full-duplex links into a switch). A receive completes when both its message has
/// arrived and it has been posted. Local ops (copies, the division of an average) and the
/// reductions on arrival take no time. This is the textbook model behind the ring's
/// `2 (n - 1) (alpha + B / n * beta)`; it ignores contention in the network, CPU cost of
/// reductions and eager-versus-rendezvous protocol effects.
///
/// [`predict_on`] extends the model to two levels.
pub fn predict(
    params_per_rank: &[Params],
    dtype: DataType,
    link: &LinkModel,
) -> Result<Prediction, SimError> {
    predict_on(params_per_rank, dtype, &Topology::flat(*link))
}

/// [`predict`] on a two-level network.
///
/// # Model
///
/// As in [`predict`], but every rank has two outgoing links, each carrying one message at a time
/// in the order the sends become ready: one to the ranks of its own host, costed by
/// [`Topology::intra`], and one to the other hosts, costed by [`Topology::inter`]. A rank may
/// thus send inside its host and across hosts at the same time (as a GPU drives NVLink and its NIC
/// independently). On a single host (or with one rank per host) only one of the links is ever
/// used, and the prediction is [`predict`]'s with that link.
pub fn predict_on(
    params_per_rank: &[Params],
    dtype: DataType,
    topo: &Topology,
) -> Result<Prediction, SimError> {
    let programs = params_per_rank
        .iter()
        .enumerate()
        .map(|(r, p)| plan::build(p).map_err(|source| SimError::Plan { rank: r, source }))
        .collect::<Result<Vec<_>, _>>()?;
    predict_programs_on(&programs, dtype.size(), topo)
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A local op or a receive completes.
    Complete { rank: usize, op: OpId },
    /// A rank's link finished sending `op` to `peer`.
    Sent { rank: usize, op: OpId, peer: usize },
}

#[derive(Debug)]
struct Event {
    t: f64,
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    fn cmp(&self, other: &Self) -> Ordering {
        self.t.total_cmp(&other.t).then(self.seq.cmp(&other.seq))
    }
}

struct Timer<'a> {
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
    finish: Vec<f64>,
    events: BinaryHeap<Reverse<Event>>,
    seq: u64,
    messages: u64,
    bytes: u64,
}

impl Timer<'_> {
    fn push(&mut self, t: f64, kind: Kind) {
        self.seq += 1;
        self.events.push(Reverse(Event {
            t,
            seq: self.seq,
            kind,
        }));
    }

    /// Issues everything rank `r` may start at time `t`.
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
                Op::Recv { peer, .. } => {
                    let c = peer * self.world + r;
                    if self.arrived[c] > 0 {
                        self.arrived[c] -= 1;
                        self.push(t, Kind::Complete { rank: r, op: id });
                    } else {
                        self.posted[c].push_back(id);
                    }
                }
                Op::Copy { .. } | Op::Finalize { .. } => {
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

/// [`predict`] for explicit programs (one per rank) with elements of `elem_size` bytes.
pub fn predict_programs(
    programs: &[Program],
    elem_size: usize,
    link: &LinkModel,
) -> Result<Prediction, SimError> {
    predict_programs_on(programs, elem_size, &Topology::flat(*link))
}

/// [`predict_on`] for explicit programs (one per rank) with elements of `elem_size` bytes.
pub fn predict_programs_on(
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
    let mut tm = Timer {
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
