//! Time prediction under an alpha-beta link model, flat or two-level (hosts of several ranks).
//!
//! The timing model runs the programs with the semantics of [`crate::schedule::Schedule`], on a
//! compact form of each rank's program (one record per op, lists of dependents and per-peer
//! queues) with nothing sized by the square of the world, and takes the events of one instant
//! from a queue rather than the heap. A prediction therefore costs a few hundred nanoseconds per
//! op of all ranks together, plus building the programs; [`predict_symmetric`] avoids both for
//! symmetric collectives by running one rank.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};

use super::types::SimError;
use crate::DataType;
use crate::rng::XorShift64;
use crate::schedule::plan::{self, Params};
use crate::schedule::{Op, OpId, Program};

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
    /// Messages a rank may have in flight to a peer on another host before that peer has taken
    /// the first of them (the receive slots it gives each sender); 0 for no limit.
    pub inter_slots: usize,
}

impl Topology {
    /// Every rank on one host, connected by `link`: the flat model.
    pub fn flat(link: LinkModel) -> Self {
        Topology {
            local_size: 0,
            intra: link,
            inter: link,
            inter_slots: 0,
        }
    }

    /// Hosts of `local_size` ranks, `intra` inside a host and `inter` across hosts.
    pub fn two_level(local_size: usize, intra: LinkModel, inter: LinkModel) -> Self {
        Topology {
            local_size,
            intra,
            inter,
            inter_slots: 0,
        }
    }

    /// The same, where a rank has at most `slots` messages in flight to a peer on another host
    /// (0: no limit).
    pub fn with_inter_slots(self, slots: usize) -> Self {
        Topology {
            inter_slots: slots,
            ..self
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
/// once; [`predict_on`] limits it across hosts). A receive completes when both its message has
/// arrived and it has been posted. A post ([`Op::Post`]) costs what a send to every other rank
/// costs: when it becomes ready, one message per peer joins the link to that peer, in the order
/// `r + 1, r + 2, ..., r - 1` (mod n), and the post completes when the last has arrived. Local
/// ops (copies, the rank-order reduction of parts, the division of an average) and the
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
/// independently). On a single host only the first is ever used, and the prediction is
/// [`predict`]'s with that link.
///
/// Across hosts (one rank per host included: `local_size` 1) a rank's download is limited too,
/// as a NIC's is: messages from other hosts arrive through it one after another at the rate of
/// [`Topology::inter`]. A message that leaves its sender's link at `t` arrives at
/// `max(t, d + b * beta)`, where `d` is when the message before it had arrived through the same
/// download; a tree's parent thus takes twice as long to receive from two children sending at
/// once. The sender's link is free at `t` all the same (the bytes wait in the network, as in a
/// switch's buffer), and messages inside a host are not limited on arrival.
///
/// With [`Topology::inter_slots`] `k` above 0, a rank has at most `k` messages to a peer on
/// another host that the peer has not taken yet (as the engine's window of receive slots): a
/// message is taken when its receive completes, the sender learns it a latency
/// ([`Topology::inter`]'s alpha) later, and meanwhile its link sends what waits for other
/// peers. So a leaf of a tree cannot run ahead of its parent by more than `k` segments.
pub fn predict_on(
    params_per_rank: &[Params],
    dtype: DataType,
    topo: &Topology,
) -> Result<Prediction, SimError> {
    // Each program is turned into the timing model's compact form as soon as it is built, so
    // that the programs of all ranks are never held at once.
    let world = params_per_rank.len();
    let mut ranks = Vec::with_capacity(world);
    for (r, p) in params_per_rank.iter().enumerate() {
        let prog = plan::build(p).map_err(|source| SimError::Plan { rank: r, source })?;
        check_peers(r, &prog, world)?;
        ranks.push(Rank::new(&prog, world));
    }
    Timer::new(ranks, dtype.size(), topo, None).run(world)
}

/// A relabeling of the ranks under which a collective's programs are images of one another:
/// rank `r`'s program is rank 0's with every peer `p` replaced by [`Symmetry::map`]`(r, p)`.
///
/// Under such a symmetry every rank goes through the same events at the same times, so the
/// timing model needs to run rank 0 alone (see [`predict_symmetric`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Symmetry {
    /// `p -> (p + r) mod n`: rings, where every rank talks to the ranks at fixed distances.
    Rotation,
    /// `p -> p xor r` (`n` a power of two): butterflies, as recursive doubling.
    Xor,
}

impl Symmetry {
    /// The peer that rank `r` of `world` ranks has where rank 0 has peer `p`.
    pub fn map(self, r: usize, p: usize, world: usize) -> usize {
        match self {
            Symmetry::Rotation => (p + r) % world,
            Symmetry::Xor => p ^ r,
        }
    }

    /// The rank `s` whose messages to rank 0 mirror rank 0's messages to `q`: rank `s` sends to
    /// rank 0 exactly when, and what, rank 0 sends to `q` (`map(s, q) == 0`).
    pub fn source(self, q: usize, world: usize) -> usize {
        match self {
            Symmetry::Rotation => (world - q) % world,
            Symmetry::Xor => q,
        }
    }

    /// Name in snake case (`rotation`, `xor`).
    pub const fn name(self) -> &'static str {
        match self {
            Symmetry::Rotation => "rotation",
            Symmetry::Xor => "xor",
        }
    }
}

/// [`predict_symmetric`] compares every rank's program with rank 0's when all of them together
/// hold at most this many ops, and a sample of ranks otherwise.
pub const SYMMETRY_CHECK_ALL_OPS: usize = 1 << 20;

/// [`predict`] for a collective whose ranks run one program up to a relabeling of the ranks
/// ([`Symmetry`]), by running rank 0's program alone; `Ok(None)` when no symmetry was found
/// (then [`predict`] must run all ranks).
///
/// # How
///
/// The parameters of all ranks must agree except for `rank`. Rank 0's program is built, and the
/// programs of other ranks are compared with it op by op: same kind, length and dependencies, and
/// every peer the image of rank 0's under the symmetry (buffer locations do not matter to the
/// timing model and are not compared). Every rank is compared when the world's programs hold at
/// most [`SYMMETRY_CHECK_ALL_OPS`] ops; above that, a sample: ranks 1 to 8, the last 8, those
/// around `n / 2`, every power of two and 16 pseudo-random ones (building every program is what
/// makes large worlds slow). Then the timing model runs rank 0 only: when rank 0's send to `q`
/// arrives, the message that rank [`Symmetry::source`]`(q)` sends to rank 0 at the same time
/// arrives too. The ranks of a symmetric collective finish together, so every entry of
/// [`Prediction::rank_time_s`] is the same, and the counters are rank 0's times the world.
///
/// Whether two events at the same instant are handled in the same order on every rank is the
/// one place where the full run could tell the ranks apart; the tests compare both ways of
/// predicting over the schedules' own programs.
pub fn predict_symmetric(
    params_per_rank: &[Params],
    dtype: DataType,
    link: &LinkModel,
) -> Result<Option<(Prediction, Symmetry)>, SimError> {
    let world = params_per_rank.len();
    if world < 2 {
        return Ok(None);
    }
    let base = params_per_rank[0];
    let uniform = params_per_rank
        .iter()
        .enumerate()
        .all(|(r, p)| *p == Params { rank: r, ..base });
    if !uniform || base.rank != 0 || base.world != world {
        return Ok(None);
    }
    let build = |r: usize| {
        plan::build(&Params { rank: r, ..base })
            .map_err(|source| SimError::Plan { rank: r, source })
    };
    let p0 = build(0)?;
    let p1 = build(1)?;
    let mut candidates = vec![Symmetry::Rotation];
    if world.is_power_of_two() {
        candidates.push(Symmetry::Xor);
    }
    candidates.retain(|&s| images(s, &p0, &p1, 1, world));
    if candidates.is_empty() {
        return Ok(None);
    }
    for r in check_ranks(world, p0.len()) {
        let pr = build(r)?;
        candidates.retain(|&s| images(s, &p0, &pr, r, world));
        if candidates.is_empty() {
            return Ok(None);
        }
    }
    let sym = candidates[0];
    check_peers(0, &p0, world)?;
    let topo = Topology::flat(*link);
    let tm = Timer::new(
        vec![Rank::new(&p0, world)],
        dtype.size(),
        &topo,
        Some((sym, world)),
    );
    Ok(Some((tm.run(world)?, sym)))
}

/// Whether `pr`, the program of rank `r`, is `p0` with its peers mapped by `sym`, as far as the
/// timing model can tell.
fn images(sym: Symmetry, p0: &Program, pr: &Program, r: usize, world: usize) -> bool {
    if p0.len() != pr.len() {
        return false;
    }
    p0.ops()
        .iter()
        .zip(pr.ops())
        .enumerate()
        .all(|(i, (a, b))| {
            let same = match (*a, *b) {
                (
                    Op::Send {
                        peer: p, len: l, ..
                    },
                    Op::Send {
                        peer: q, len: m, ..
                    },
                )
                | (
                    Op::Recv {
                        peer: p, len: l, ..
                    },
                    Op::Recv {
                        peer: q, len: m, ..
                    },
                ) => l == m && q == sym.map(r, p, world),
                (Op::Post { len: l, .. }, Op::Post { len: m, .. })
                | (Op::Copy { len: l, .. }, Op::Copy { len: m, .. })
                | (Op::ReduceParts { len: l, .. }, Op::ReduceParts { len: m, .. })
                | (Op::Finalize { len: l, .. }, Op::Finalize { len: m, .. }) => l == m,
                _ => false,
            };
            same && p0.deps(i as OpId) == pr.deps(i as OpId)
        })
}

/// The ranks [`predict_symmetric`] compares with rank 0 (rank 1 is compared first, always).
fn check_ranks(world: usize, ops: usize) -> Vec<usize> {
    if world.saturating_mul(ops) <= SYMMETRY_CHECK_ALL_OPS {
        return (2..world).collect();
    }
    let mut v: Vec<usize> = (2..world.min(9)).collect();
    v.extend(world.saturating_sub(8).max(2)..world);
    v.extend((world / 2).saturating_sub(1).max(2)..(world / 2 + 2).min(world));
    v.extend(
        (1..usize::BITS)
            .map(|k| 1usize << k)
            .take_while(|&p| p < world),
    );
    let mut rng = XorShift64::new(world as u64);
    v.extend((0..16).map(|_| 2 + rng.below(world - 2)));
    v.sort_unstable();
    v.dedup();
    v
}

/// Fails with [`SimError::BadPeer`] when an op of rank `r`'s program names a peer outside the
/// world.
pub(super) fn check_peers(r: usize, prog: &Program, world: usize) -> Result<(), SimError> {
    for (id, op) in prog.ops().iter().enumerate() {
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
    Ok(())
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A local op or a receive completes.
    Complete { rank: usize, op: OpId },
    /// A rank's link finished sending `op` to `peer`.
    Sent { rank: usize, op: OpId, peer: usize },
    /// A message from `src` that waited for the download of `dst` has arrived.
    Arrive { dst: usize, src: usize },
    /// `peer` took a message of `rank`'s: one more may be in flight.
    Credit { rank: usize, peer: usize },
}

#[derive(Debug)]
struct Event {
    t: f64,
    seq: u64,
    kind: Kind,
}

impl Event {
    /// Whether `self` comes before `other`: earlier, or at the same time and pushed earlier.
    fn before(&self, other: &Event) -> bool {
        self.cmp(other) == Ordering::Less
    }
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

/// The end of a list of ops, or no queue.
const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    DepsDone,
    Issued,
    Complete,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum What {
    Send,
    Recv,
    Post,
    Local,
}

/// One op as the timing model sees it.
#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Elements.
    len: usize,
    /// Peer of a send or receive; for a post, its index in [`Rank::posts`].
    peer: usize,
    /// Dependencies not yet complete.
    pending: u32,
    /// Where its dependents start in [`Rank::rev`]; they end where the next op's start.
    rev_start: u32,
    /// Index of its (peer, direction) queue in [`Rank::queues`]; [`NONE`] for local ops, [`POST`]
    /// for posts, which are in every send queue.
    queue: u32,
    /// The next op of the same queue; [`NONE`] for the last (for a post: see [`Post::next`]).
    next_in_queue: u32,
    what: What,
    state: State,
}

/// The queue of a post: it is in every send queue.
const POST: u32 = u32::MAX - 1;

/// A post: in the send queue of every peer, which the sends of the program do not all have, so
/// its links to the next op of each queue are kept here rather than in its [`Slot`].
#[derive(Clone, Debug)]
struct Post {
    /// Per send queue (the first [`Rank::send_queues`] of [`Rank::queues`]): the next op after
    /// the post.
    next: Vec<u32>,
    /// Send queues in which an op before the post has not been issued yet.
    blocked: u32,
    /// Messages not yet arrived.
    left: u32,
}

/// The ops to or from one peer, a list through [`Slot::next_in_queue`] in program order.
#[derive(Clone, Copy, Debug)]
struct Queue {
    /// The peer.
    peer: usize,
    /// Receives (or sends).
    recv: bool,
    /// The next op to issue; [`NONE`] when all are issued.
    issue: u32,
    /// For receives: the next receive to match with a message, the one of index
    /// `min(issued, arrived)`.
    matched: u32,
    /// Ops issued so far.
    issued: u32,
    /// For receives: messages arrived so far. The k-th message matches the k-th receive.
    arrived: u32,
    /// For sends to another host: messages sent that the peer has not taken yet.
    in_flight: u32,
}

/// One rank's program and its progress, with the semantics of [`Schedule`]: an op is ready once
/// its dependencies have completed and every earlier op of its (peer, direction) queue has been
/// issued, and the ready op of lowest index is issued first. Nothing in it is sized by the
/// world, and what one event touches lies close together, so thousands of ranks run fast.
///
/// [`Schedule`]: crate::schedule::Schedule
struct Rank {
    /// The ops and a last entry that only ends the dependents of the last op.
    slots: Vec<Slot>,
    rev: Vec<u32>,
    /// Sorted by (direction, peer): the send queues first. A program with posts has a send queue
    /// for every rank of the world.
    queues: Vec<Queue>,
    /// How many of `queues` are send queues.
    send_queues: usize,
    /// The posts, in program order.
    posts: Vec<Post>,
    ready: BinaryHeap<Reverse<u32>>,
    completed: usize,
    /// Link 0 leads into the rank's host, link 1 out of it: whether it is sending, and the
    /// messages (op, peer) waiting for it.
    busy: [bool; 2],
    waiting: [VecDeque<(u32, usize)>; 2],
    /// When the rank's last op completed so far.
    finish: f64,
}

impl Rank {
    /// The compact form of `prog`, a program of a world of `world` ranks.
    fn new(prog: &Program, world: usize) -> Rank {
        let ops = prog.ops();
        let n = ops.len();
        // (direction, peer) of every send and receive, to number the queues in sorted order.
        let mut keys: Vec<(bool, usize)> = Vec::new();
        let mut last: Option<(bool, usize)> = None;
        let mut has_posts = false;
        for op in ops {
            let key = match *op {
                Op::Send { peer, .. } => (false, peer),
                Op::Recv { peer, .. } => (true, peer),
                Op::Post { .. } => {
                    has_posts = true;
                    continue;
                }
                Op::Copy { .. } | Op::ReduceParts { .. } | Op::Finalize { .. } => continue,
            };
            if last != Some(key) {
                keys.push(key);
                last = Some(key);
            }
        }
        if has_posts {
            keys.extend((0..world).map(|p| (false, p)));
        }
        keys.sort_unstable();
        keys.dedup();
        let send_queues = keys.partition_point(|k| !k.0);
        let mut queues: Vec<Queue> = keys
            .iter()
            .map(|&(recv, peer)| Queue {
                peer,
                recv,
                issue: NONE,
                matched: NONE,
                issued: 0,
                arrived: 0,
                in_flight: 0,
            })
            .collect();
        let mut tail = vec![NONE; queues.len()];
        let mut slots: Vec<Slot> = Vec::with_capacity(n + 1);
        let mut posts: Vec<Post> = Vec::new();
        let mut rev_count = vec![0u32; n + 1];
        let mut last: Option<((bool, usize), u32)> = None;
        // Appends op `id` to queue `qi`.
        let mut link = |slots: &mut Vec<Slot>, posts: &mut Vec<Post>, qi: usize, id: usize| {
            match tail[qi] {
                NONE => {
                    queues[qi].issue = id as u32;
                    queues[qi].matched = id as u32;
                }
                t if slots[t as usize].what == What::Post => {
                    posts[slots[t as usize].peer].next[qi] = id as u32
                }
                t => slots[t as usize].next_in_queue = id as u32,
            }
            std::mem::replace(&mut tail[qi], id as u32) != NONE
        };
        for (id, op) in ops.iter().enumerate() {
            let (what, key) = match *op {
                Op::Send { peer, .. } => (What::Send, Some((false, peer))),
                Op::Recv { peer, .. } => (What::Recv, Some((true, peer))),
                Op::Post { .. } => (What::Post, None),
                Op::Copy { .. } | Op::ReduceParts { .. } | Op::Finalize { .. } => {
                    (What::Local, None)
                }
            };
            let (queue, peer) = match key {
                None if what == What::Post => {
                    posts.push(Post {
                        next: vec![NONE; send_queues],
                        blocked: 0,
                        left: 0,
                    });
                    let mut blocked = 0;
                    for qi in 0..send_queues {
                        blocked += u32::from(link(&mut slots, &mut posts, qi, id));
                    }
                    let p = posts.len() - 1;
                    posts[p].blocked = blocked;
                    (POST, p)
                }
                None => (NONE, 0),
                Some(key) => {
                    let q = match last {
                        Some((k, q)) if k == key => q,
                        _ => keys.binary_search(&key).expect("every key was collected") as u32,
                    };
                    last = Some((key, q));
                    link(&mut slots, &mut posts, q as usize, id);
                    (q, key.1)
                }
            };
            let deps = prog.deps(id as OpId);
            for &d in deps {
                rev_count[d as usize + 1] += 1;
            }
            slots.push(Slot {
                len: op.len(),
                peer,
                pending: deps.len() as u32,
                rev_start: 0,
                queue,
                next_in_queue: NONE,
                what,
                state: State::Waiting,
            });
        }
        for i in 0..n {
            rev_count[i + 1] += rev_count[i];
        }
        let mut rev = vec![0u32; rev_count[n] as usize];
        for id in 0..n {
            for &d in prog.deps(id as OpId) {
                rev[rev_count[d as usize] as usize] = id as u32;
                rev_count[d as usize] += 1;
            }
        }
        // `rev_count[d]` now ends the dependents of `d`, which start where those of `d - 1` end.
        let mut start = 0;
        for (s, &end) in slots.iter_mut().zip(&rev_count) {
            s.rev_start = start;
            start = end;
        }
        slots.push(Slot {
            len: 0,
            peer: 0,
            pending: 0,
            rev_start: start,
            queue: NONE,
            next_in_queue: NONE,
            what: What::Local,
            state: State::Complete,
        });
        let mut rank = Rank {
            slots,
            rev,
            queues,
            send_queues,
            posts,
            ready: BinaryHeap::new(),
            completed: 0,
            busy: [false; 2],
            waiting: [VecDeque::new(), VecDeque::new()],
            finish: 0.0,
        };
        for id in 0..n {
            if rank.slots[id].pending == 0 {
                rank.deps_done(id as u32);
            }
        }
        rank
    }

    /// Ops in the program.
    fn len(&self) -> usize {
        self.slots.len() - 1
    }

    fn deps_done(&mut self, id: u32) {
        let s = &mut self.slots[id as usize];
        s.state = State::DepsDone;
        let head = match s.queue {
            NONE => true,
            POST => self.posts[s.peer].blocked == 0,
            q => self.queues[q as usize].issue == id,
        };
        if head {
            self.ready.push(Reverse(id));
        }
    }

    /// Op `id` has become the head of one of its queues: it is ready if it heads all of them and
    /// its dependencies are done.
    fn head(&mut self, id: u32) {
        let s = &self.slots[id as usize];
        if s.queue == POST {
            let p = &mut self.posts[s.peer];
            p.blocked -= 1;
            if p.blocked > 0 {
                return;
            }
        }
        if s.state == State::DepsDone {
            self.ready.push(Reverse(id));
        }
    }

    /// The next op that may start, marked issued, and for a receive whether its message has
    /// arrived already.
    fn poll(&mut self) -> Option<(u32, bool)> {
        let Reverse(id) = self.ready.pop()?;
        let s = &mut self.slots[id as usize];
        debug_assert_eq!(s.state, State::DepsDone);
        s.state = State::Issued;
        let (qi, next, post) = (s.queue, s.next_in_queue, s.peer);
        let mut arrived = false;
        if qi == POST {
            for qi in 0..self.send_queues {
                let next = self.posts[post].next[qi];
                let q = &mut self.queues[qi];
                debug_assert_eq!(q.issue, id);
                q.issue = next;
                q.issued += 1;
                if next != NONE {
                    self.head(next);
                }
            }
        } else if qi != NONE {
            let q = &mut self.queues[qi as usize];
            q.issue = next;
            q.issued += 1;
            if q.recv && q.issued <= q.arrived {
                debug_assert_eq!(q.matched, id);
                q.matched = next;
                arrived = true;
            }
            if next != NONE {
                self.head(next);
            }
        }
        Some((id, arrived))
    }

    fn complete(&mut self, id: u32, t: f64) {
        let i = id as usize;
        debug_assert_eq!(self.slots[i].state, State::Issued);
        self.slots[i].state = State::Complete;
        self.completed += 1;
        self.finish = self.finish.max(t);
        for k in self.slots[i].rev_start..self.slots[i + 1].rev_start {
            let d = self.rev[k as usize];
            let s = &mut self.slots[d as usize];
            s.pending -= 1;
            if s.pending == 0 {
                self.deps_done(d);
            }
        }
    }

    /// A message from `src` arrived: the receive it matches, if that receive is posted already.
    fn arrive(&mut self, src: usize) -> Option<u32> {
        let i = self
            .queues
            .binary_search_by(|q| (q.recv, q.peer).cmp(&(true, src)))
            .ok()?;
        let q = &mut self.queues[i];
        q.arrived += 1;
        if q.arrived > q.issued {
            return None;
        }
        let recv = q.matched;
        q.matched = self.slots[recv as usize].next_in_queue;
        Some(recv)
    }

    fn is_done(&self) -> bool {
        self.completed == self.len()
    }
}

struct Timer<'a> {
    topo: &'a Topology,
    elem: usize,
    /// The ranks that run: all of them, or rank 0 alone under a symmetry of `world` ranks.
    ranks: Vec<Rank>,
    mirror: Option<(Symmetry, usize)>,
    /// Ranks of the world the prediction is for.
    world: usize,
    /// Events of later instants, and those of the instant being handled in the order they were
    /// pushed (most events complete at once; they never need the heap).
    events: BinaryHeap<Reverse<Event>>,
    now: VecDeque<Event>,
    now_t: f64,
    seq: u64,
    messages: u64,
    bytes: u64,
    /// Per rank that runs: when its download from other hosts is free again (see
    /// [`predict_on`]); empty on a single host.
    download_free: Vec<f64>,
}

impl<'a> Timer<'a> {
    fn new(
        ranks: Vec<Rank>,
        elem: usize,
        topo: &'a Topology,
        mirror: Option<(Symmetry, usize)>,
    ) -> Self {
        let world = mirror.map_or(ranks.len(), |m| m.1);
        let download_free = if topo.local_size == 0 {
            Vec::new()
        } else {
            vec![0.0; ranks.len()]
        };
        Timer {
            download_free,
            topo,
            elem,
            ranks,
            mirror,
            world,
            events: BinaryHeap::new(),
            now: VecDeque::new(),
            now_t: 0.0,
            seq: 0,
            messages: 0,
            bytes: 0,
        }
    }

    fn push(&mut self, t: f64, kind: Kind) {
        self.seq += 1;
        let ev = Event {
            t,
            seq: self.seq,
            kind,
        };
        if t == self.now_t {
            self.now.push_back(ev);
        } else {
            self.events.push(Reverse(ev));
        }
    }

    /// The next event in (time, push order).
    fn pop(&mut self) -> Option<Event> {
        let heap_first = match (self.now.front(), self.events.peek()) {
            (None, None) => return None,
            (Some(a), Some(Reverse(b))) => b.before(a),
            (None, Some(_)) => true,
            (Some(_), None) => false,
        };
        let ev = if heap_first {
            self.events.pop().expect("peeked").0
        } else {
            self.now.pop_front().expect("peeked")
        };
        self.now_t = ev.t;
        Some(ev)
    }

    /// Which of the two links of `r` leads to `peer`.
    fn link_of(&self, r: usize, peer: usize) -> usize {
        usize::from(!self.topo.same_host(r, peer))
    }

    /// Issues everything rank `r` may start at time `t`.
    fn drain(&mut self, r: usize, t: f64) {
        while let Some((id, arrived)) = self.ranks[r].poll() {
            let s = self.ranks[r].slots[id as usize];
            match s.what {
                What::Send => {
                    let k = self.link_of(r, s.peer);
                    self.ranks[r].waiting[k].push_back((id, s.peer));
                }
                What::Post => {
                    // One message to every other rank, nearest first in rank order.
                    let n = self.world;
                    self.ranks[r].posts[s.peer].left = (n - 1) as u32;
                    for peer in (1..n).map(|k| (r + k) % n) {
                        let k = self.link_of(r, peer);
                        self.ranks[r].waiting[k].push_back((id, peer));
                    }
                    if n == 1 {
                        self.push(t, Kind::Complete { rank: r, op: id });
                    }
                }
                What::Recv => {
                    if arrived {
                        self.push(t, Kind::Complete { rank: r, op: id });
                    }
                }
                What::Local => self.push(t, Kind::Complete { rank: r, op: id }),
            }
        }
        self.start_link(r, 0, t);
        self.start_link(r, 1, t);
    }

    /// Starts the next send on link `k` of rank `r` if it is idle: the first waiting one whose
    /// peer has a slot for it (across hosts, with [`Topology::inter_slots`]).
    fn start_link(&mut self, r: usize, k: usize, t: f64) {
        let slots = if k == 1 { self.topo.inter_slots } else { 0 };
        let rank = &mut self.ranks[r];
        if rank.busy[k] {
            return;
        }
        let next = if slots == 0 {
            rank.waiting[k].pop_front()
        } else {
            let (ops, queues) = (&rank.slots, &rank.queues);
            let i = rank.waiting[k].iter().position(|&(op, _)| {
                let q = ops[op as usize].queue;
                q == POST || (queues[q as usize].in_flight as usize) < slots
            });
            i.and_then(|i| rank.waiting[k].remove(i))
        };
        if let Some((op, peer)) = next {
            if slots > 0 {
                let q = rank.slots[op as usize].queue;
                if q != POST {
                    rank.queues[q as usize].in_flight += 1;
                }
            }
            rank.busy[k] = true;
            let bytes = rank.slots[op as usize].len * self.elem;
            self.messages += 1;
            self.bytes += bytes as u64;
            let dt = self.topo.link(r, peer).message_s(bytes);
            self.push(t + dt, Kind::Sent { rank: r, op, peer });
        }
    }

    fn complete(&mut self, r: usize, op: OpId, t: f64) {
        self.ranks[r].complete(op, t);
        let s = self.ranks[r].slots[op as usize];
        if s.what == What::Recv && self.topo.inter_slots > 0 && self.link_of(r, s.peer) == 1 {
            // The message's slot is free: the sender hears it a latency later. Under a
            // symmetry, rank 0's receive from `src` mirrors the receive that frees a slot of
            // rank 0's messages to `source(src)`.
            let (rank, peer) = match self.mirror {
                None => (s.peer, r),
                Some((sym, n)) => (0, sym.source(s.peer, n)),
            };
            self.push(t + self.topo.inter.alpha_s, Kind::Credit { rank, peer });
        }
        self.drain(r, t);
    }

    /// `peer` took one of `r`'s messages: `r` may send it another.
    fn credit(&mut self, r: usize, peer: usize, t: f64) {
        let rank = &mut self.ranks[r];
        let i = rank.queues[..rank.send_queues]
            .binary_search_by(|q| q.peer.cmp(&peer))
            .expect("a rank that received from a peer sent to it");
        // A post's messages took no slot.
        rank.queues[i].in_flight = rank.queues[i].in_flight.saturating_sub(1);
        self.start_link(r, 1, t);
    }

    /// When a message of `bytes` bytes that left its sender's link `k` at `t` has arrived at
    /// rank `dst`: across hosts, not before `dst`'s download has carried it after the messages
    /// that came before (the download runs at the link's rate, cut through: a message that
    /// finds it free arrives as it is sent); inside a host, at `t`.
    fn download(&mut self, dst: usize, k: usize, bytes: usize, t: f64) -> f64 {
        if k == 0 || self.download_free.is_empty() {
            return t;
        }
        let wire = bytes as f64 * self.topo.inter.beta_s_per_byte;
        let at = t.max(self.download_free[dst] + wire);
        self.download_free[dst] = at;
        at
    }

    /// A message from `src` has arrived at `dst`: the receive it matches completes, if posted.
    fn arrive(&mut self, dst: usize, src: usize, t: f64) {
        if let Some(recv) = self.ranks[dst].arrive(src) {
            self.push(
                t,
                Kind::Complete {
                    rank: dst,
                    op: recv,
                },
            );
        }
    }

    /// Runs to the end; `world` is the number of ranks the prediction is for.
    fn run(mut self, world: usize) -> Result<Prediction, SimError> {
        for r in 0..self.ranks.len() {
            self.drain(r, 0.0);
        }
        while let Some(ev) = self.pop() {
            match ev.kind {
                Kind::Complete { rank, op } => self.complete(rank, op, ev.t),
                Kind::Arrive { dst, src } => self.arrive(dst, src, ev.t),
                Kind::Credit { rank, peer } => self.credit(rank, peer, ev.t),
                Kind::Sent { rank, op, peer } => {
                    let k = self.link_of(rank, peer);
                    self.ranks[rank].busy[k] = false;
                    let (dst, src) = match self.mirror {
                        None => (peer, rank),
                        Some((sym, n)) => (0, sym.source(peer, n)),
                    };
                    let s = self.ranks[rank].slots[op as usize];
                    let at = self.download(dst, k, s.len * self.elem, ev.t);
                    if at > ev.t {
                        self.push(at, Kind::Arrive { dst, src });
                    } else {
                        self.arrive(dst, src, ev.t);
                    }
                    if s.what == What::Post {
                        // A post completes with its last message.
                        let p = &mut self.ranks[rank].posts[s.peer];
                        p.left -= 1;
                        if p.left > 0 {
                            self.start_link(rank, k, ev.t);
                            continue;
                        }
                    }
                    self.complete(rank, op, ev.t);
                }
            }
        }
        let stuck: Vec<usize> = (0..self.ranks.len())
            .filter(|&r| !self.ranks[r].is_done())
            .collect();
        if !stuck.is_empty() {
            let detail = "the timing model found no possible progress".to_string();
            return Err(SimError::Deadlock {
                ranks: stuck,
                detail,
            });
        }
        let finish: Vec<f64> = self.ranks.iter().map(|r| r.finish).collect();
        let time_s = finish.iter().copied().fold(0.0, f64::max);
        Ok(match self.mirror {
            None => Prediction {
                time_s,
                rank_time_s: finish,
                messages: self.messages,
                bytes: self.bytes,
            },
            Some(_) => Prediction {
                time_s,
                rank_time_s: vec![time_s; world],
                messages: self.messages * world as u64,
                bytes: self.bytes * world as u64,
            },
        })
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
        check_peers(r, p, world)?;
    }
    let ranks = programs.iter().map(|p| Rank::new(p, world)).collect();
    Timer::new(ranks, elem_size, topo, None).run(world)
}

#[cfg(test)]
mod tests;
