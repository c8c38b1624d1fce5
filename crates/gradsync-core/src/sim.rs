//! In-memory simulator: runs the programs of N ranks with seeded reordering and checks them.
//!
//! [`run`] plans every rank's [`Program`] from its [`Params`], gives each rank the buffers the
//! conventions of [`crate::schedule::plan`] define (filled with seeded garbage, then the input),
//! and executes all ranks together. At every step it picks, at random from a seeded xorshift
//! generator, one of:
//!
//! - a rank issuing the next op its [`Schedule::poll_action`] hands out. A `Send` copies its data
//!   into an in-flight message at once (FIFO per `(source, destination)` pair); a `Recv` is
//!   posted; local ops (`Copy`, `Finalize`) wait;
//! - delivering the oldest message of a pair whose receiver has a posted `Recv` from that source
//!   (matched FIFO; messages that arrive before their receive wait in the queue): its data is
//!   copied or reduced into the destination;
//! - completing an issued op that is able to complete (a send whose data left, a delivered
//!   receive, a local op, which takes effect only now), which may release dependent ops.
//!
//! So sends complete at random times after they issue, messages overtake nothing within a pair
//! but anything across pairs, and local work lags at random. A correct program gives the same
//! result under every interleaving; the simulator reports every way a program can be wrong
//! instead of panicking:
//!
//! - **deadlock**: nothing can make progress while some rank is unfinished (the error names the
//!   ranks and their pending ops);
//! - **length mismatch** between a matched send and receive, and messages never received;
//! - **out of bounds**: a range beyond its buffer — `Input` and `Output` sized by the
//!   conventions ([`Params::input_elems`], [`Params::output_elems`]), `Scratch` by
//!   [`Program::scratch_elems`];
//! - **races**: two ops in flight at once that touch the same element, one of them writing (every
//!   issued op claims what it reads and writes until it completes, so a dependency the program
//!   forgot shows up as soon as an interleaving runs the two ops concurrently);
//! - writes to `Input`, use of `Input` in an in-place program, overlapping operands of one op, and
//!   changes to `Output` outside the rank's [`Params::result_range`].
//!
//! It also tracks causality: [`SimResult::heard_from`] says which ranks' start happens before a
//! rank's last op through the programs' dependencies and messages. A barrier must have heard
//! from everyone on every rank.
//!
//! The reductions use [`crate::reference`]; result checking is [`crate::reference::check`]'s job.
//!
//! # Time
//!
//! Independently of the random interleaving, every run also predicts the collective's duration
//! under an alpha-beta [`LinkModel`]; see [`predict`] for the model.

use std::collections::VecDeque;

use crate::DataType;
use crate::ReduceOp;
use crate::reference;
use crate::rng::XorShift64;
use crate::schedule::plan::{self, Params, PlanError};
use crate::schedule::{Buf, Loc, Op, OpId, Program, Schedule};

mod timing;

pub use timing::{LinkModel, Prediction, predict, predict_programs};

/// Errors the simulator reports.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The parameters of a rank are inconsistent with its position or the world.
    #[error("rank {rank}: {detail}")]
    Params {
        /// Index of the parameters.
        rank: usize,
        /// What is wrong.
        detail: String,
    },
    /// Planning a rank's program failed.
    #[error("rank {rank}: {source}")]
    Plan {
        /// The rank.
        rank: usize,
        /// Why.
        #[source]
        source: PlanError,
    },
    /// An input does not have the size the conventions require.
    #[error("rank {rank}: {what} has {got} bytes, expected {want}")]
    BufferSize {
        /// The rank.
        rank: usize,
        /// Which buffer.
        what: &'static str,
        /// Bytes given.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// An op names a peer outside the world.
    #[error("rank {rank} op {op} names peer {peer} outside the world of {world}")]
    BadPeer {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
        /// The peer named.
        peer: usize,
        /// The world size.
        world: usize,
    },
    /// No progress is possible while some ranks are unfinished.
    #[error("deadlock: ranks {ranks:?} cannot finish; {detail}")]
    Deadlock {
        /// The unfinished ranks.
        ranks: Vec<usize>,
        /// Their pending ops and stranded messages.
        detail: String,
    },
    /// A send and the receive it matched disagree on the length.
    #[error(
        "length mismatch: rank {src} op {send_op} sends {send_len} elements, \
         rank {dst} op {recv_op} receives {recv_len}"
    )]
    LengthMismatch {
        /// Sending rank.
        src: usize,
        /// The send.
        send_op: OpId,
        /// Elements sent.
        send_len: usize,
        /// Receiving rank.
        dst: usize,
        /// The receive.
        recv_op: OpId,
        /// Elements expected.
        recv_len: usize,
    },
    /// An op reaches past the end of a buffer.
    #[error(
        "rank {rank} op {op} uses {buf:?} elements {start}..{start}+{len}, beyond its {size} elements"
    )]
    OutOfBounds {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
        /// The buffer.
        buf: Buf,
        /// First element.
        start: usize,
        /// Elements.
        len: usize,
        /// Size of the buffer in elements.
        size: usize,
    },
    /// An op writes `Input`, which is read-only.
    #[error("rank {rank} op {op} writes Input")]
    WritesInput {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
    },
    /// An in-place program names `Input` (in place, only `Output` exists).
    #[error("rank {rank} op {op} uses Input in an in-place program")]
    InputInPlace {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
    },
    /// One op's source and destination overlap without being the same range.
    #[error("rank {rank} op {op} has overlapping operands")]
    Overlap {
        /// The rank.
        rank: usize,
        /// The op.
        op: OpId,
    },
    /// Two ops in flight at once touch the same element and at least one writes it.
    #[error("rank {rank}: race on {buf:?} element {index} between op {op} and op {other}")]
    Race {
        /// The rank.
        rank: usize,
        /// The op being issued.
        op: OpId,
        /// An op in flight that conflicts with it.
        other: OpId,
        /// The buffer.
        buf: Buf,
        /// The element.
        index: usize,
    },
    /// Messages were sent that no receive consumed.
    #[error("{count} message(s) from rank {src} to rank {dst} were never received")]
    Unreceived {
        /// Sending rank.
        src: usize,
        /// Destination rank.
        dst: usize,
        /// Messages left.
        count: usize,
    },
    /// A rank changed `Output` outside its result range.
    #[error("rank {rank} changed Output element {index}, outside its result")]
    Clobbered {
        /// The rank.
        rank: usize,
        /// The element.
        index: usize,
    },
}

/// How to run a simulation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimOptions {
    /// Seed of the interleaving and of the garbage that fills buffers.
    pub seed: u64,
    /// If set, a send completes only after the peer has posted the matching receive (as when the
    /// transport writes straight into the receiver's buffer); otherwise sends are buffered and
    /// may complete before.
    pub rendezvous: bool,
    /// Link model of the time prediction.
    pub link: LinkModel,
}

impl SimOptions {
    /// Buffered sends, the default link model, and `seed`.
    pub fn new(seed: u64) -> Self {
        SimOptions { seed, rendezvous: false, link: LinkModel::default() }
    }
}

/// One rank of a raw simulation ([`run_programs`]).
#[derive(Clone, Debug)]
pub struct RankSetup {
    /// The rank's program.
    pub program: Program,
    /// Initial contents of `Input` (ignored and must be empty in place).
    pub input: Vec<u8>,
    /// Initial contents of `Output`.
    pub output: Vec<u8>,
    /// Whether the program runs in place (`Input` then is `Output`).
    pub in_place: bool,
    /// Reduction operator of reducing receives.
    pub op: ReduceOp,
}

/// Counters of one simulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Scheduler steps taken.
    pub steps: u64,
    /// Messages sent.
    pub messages: u64,
    /// Payload bytes sent.
    pub bytes: u64,
    /// Most ops in flight at once on any rank.
    pub max_in_flight: usize,
}

/// Outcome of [`run_programs`].
#[derive(Clone, Debug)]
pub struct RawOutcome {
    /// Final contents of every rank's `Output`.
    pub outputs: Vec<Vec<u8>>,
    /// `heard_from[r][q]`: rank q's start happens before rank r's end.
    pub heard_from: Vec<Vec<bool>>,
    /// Counters.
    pub stats: SimStats,
}

/// Outcome of [`run`].
#[derive(Clone, Debug)]
pub struct SimResult {
    /// Each rank's result: its `Output` restricted to [`Params::result_range`].
    pub outputs: Vec<Vec<u8>>,
    /// `heard_from[r][q]`: rank q's start happens before rank r's end, through dependencies and
    /// messages.
    pub heard_from: Vec<Vec<bool>>,
    /// Counters.
    pub stats: SimStats,
    /// Predicted duration under the options' link model.
    pub prediction: Prediction,
}

/// Runs one collective call on `params_per_rank.len()` simulated ranks with buffered sends and
/// the default link model; see [`run_with`].
pub fn run(
    params_per_rank: Vec<Params>,
    dtype: DataType,
    inputs: Vec<Vec<u8>>,
    seed: u64,
) -> Result<SimResult, SimError> {
    run_with(params_per_rank, dtype, inputs, &SimOptions::new(seed))
}

/// Runs one collective call: `params_per_rank[r]` are rank r's parameters (`rank == r`,
/// `world == params_per_rank.len()`), `inputs[r]` its logical input of
/// [`Params::input_elems`] elements (in place, it is placed at [`Params::input_offset`] of the
/// shared buffer). Buffers start out as seeded garbage.
pub fn run_with(
    params_per_rank: Vec<Params>,
    dtype: DataType,
    inputs: Vec<Vec<u8>>,
    opts: &SimOptions,
) -> Result<SimResult, SimError> {
    let world = params_per_rank.len();
    let size = dtype.size();
    if inputs.len() != world {
        let detail = format!("{} inputs for a world of {world}", inputs.len());
        return Err(SimError::Params { rank: inputs.len().min(world), detail });
    }
    let mut garbage = XorShift64::new(opts.seed ^ 0x5eed_6a7b_a6e0);
    let mut setups = Vec::with_capacity(world);
    let mut initial = Vec::with_capacity(world);
    for (r, (p, input)) in params_per_rank.iter().zip(inputs).enumerate() {
        if p.rank != r || p.world != world {
            let detail = format!("parameters say rank {} of {}", p.rank, p.world);
            return Err(SimError::Params { rank: r, detail });
        }
        let program = plan::build(p).map_err(|source| SimError::Plan { rank: r, source })?;
        let want = p.input_elems() * size;
        if input.len() != want {
            let got = input.len();
            return Err(SimError::BufferSize { rank: r, what: "input", got, want });
        }
        let mut output: Vec<u8> =
            (0..p.output_elems() * size).map(|_| garbage.next_u64() as u8).collect();
        let input = if p.in_place {
            output[p.input_offset() * size..][..input.len()].copy_from_slice(&input);
            Vec::new()
        } else {
            input
        };
        initial.push(output.clone());
        setups.push(RankSetup { program, input, output, in_place: p.in_place, op: p.op });
    }
    let programs: Vec<Program> = setups.iter().map(|s| s.program.clone()).collect();
    let raw = run_programs(setups, dtype, opts)?;
    let mut outputs = Vec::with_capacity(world);
    for (r, (p, (out, init))) in params_per_rank.iter().zip(raw.outputs.iter().zip(&initial)).enumerate()
    {
        let res = p.result_range();
        let (lo, hi) = (res.start * size, res.end * size);
        let changed = (0..out.len()).find(|&i| (i < lo || i >= hi) && out[i] != init[i]);
        if let Some(i) = changed {
            return Err(SimError::Clobbered { rank: r, index: i / size });
        }
        outputs.push(out[lo..hi].to_vec());
    }
    let prediction = predict_programs(&programs, size, &opts.link)?;
    Ok(SimResult { outputs, heard_from: raw.heard_from, stats: raw.stats, prediction })
}

// ---- the engine ---------------------------------------------------------------------------------

const NONE: u32 = u32::MAX;

/// A set of small integers with O(1) insert, remove and uniform random choice.
struct RandomSet {
    items: Vec<usize>,
    pos: Vec<usize>,
}

impl RandomSet {
    fn new(universe: usize) -> Self {
        RandomSet { items: Vec::new(), pos: vec![usize::MAX; universe] }
    }
    fn insert(&mut self, x: usize) {
        if self.pos[x] == usize::MAX {
            self.pos[x] = self.items.len();
            self.items.push(x);
        }
    }
    fn remove(&mut self, x: usize) {
        let p = std::mem::replace(&mut self.pos[x], usize::MAX);
        if p != usize::MAX {
            let last = self.items.pop().expect("non-empty");
            if p < self.items.len() {
                self.items[p] = last;
                self.pos[last] = p;
            }
        }
    }
    fn pick(&self, rng: &mut XorShift64) -> usize {
        self.items[rng.below(self.items.len())]
    }
}

/// Which in-flight op claims an element: its writer, and how many readers (plus the last one, for
/// reports).
#[derive(Clone, Default)]
struct Claims {
    writer: Vec<u32>,
    readers: Vec<u32>,
    last_reader: Vec<u32>,
}

impl Claims {
    fn new(elems: usize) -> Self {
        Claims { writer: vec![NONE; elems], readers: vec![0; elems], last_reader: vec![NONE; elems] }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    Waiting,
    Issued,
    Done,
}

struct Msg {
    data: Vec<u8>,
    len: usize,
    /// The send; its causal knowledge is looked up at delivery (it never changes after issue).
    send_op: OpId,
}

#[derive(Default)]
struct Channel {
    msgs: VecDeque<Msg>,
    posted: VecDeque<OpId>,
    sent: u64,
    posted_total: u64,
    /// Rendezvous sends waiting for their receive: (sequence number, op).
    waiting: VecDeque<(u64, OpId)>,
}

struct Rank {
    sched: Schedule,
    in_place: bool,
    op: ReduceOp,
    /// Input, Output, Scratch.
    bufs: [Vec<u8>; 3],
    claims: [Claims; 3],
    status: Vec<Status>,
    know: Vec<u64>,
}

fn buf_index(b: Buf) -> usize {
    match b {
        Buf::Input => 0,
        Buf::Output => 1,
        Buf::Scratch => 2,
    }
}

/// A mutable and a shared view of two disjoint byte ranges of a rank's buffers.
fn split(
    bufs: &mut [Vec<u8>; 3],
    out: (Buf, std::ops::Range<usize>),
    src: (Buf, std::ops::Range<usize>),
) -> (&mut [u8], &[u8]) {
    let (ob, sb) = (buf_index(out.0), buf_index(src.0));
    if ob == sb {
        let buf = &mut bufs[ob];
        if out.1.start >= src.1.end {
            let (lo, hi) = buf.split_at_mut(out.1.start);
            (&mut hi[..out.1.len()], &lo[src.1])
        } else {
            let (lo, hi) = buf.split_at_mut(src.1.start);
            (&mut lo[out.1], &hi[..src.1.len()])
        }
    } else {
        let [o, s] = bufs.get_disjoint_mut([ob, sb]).expect("distinct buffers");
        (&mut o[out.1], &s[src.1])
    }
}

/// A range an op touches, and how.
#[derive(Clone, Copy)]
struct Access {
    loc: Loc,
    len: usize,
    write: bool,
}

fn accesses(op: &Op) -> ([Option<Access>; 2], Option<(Loc, Loc, usize)>) {
    let r = |loc, len| Some(Access { loc, len, write: false });
    let w = |loc, len| Some(Access { loc, len, write: true });
    match *op {
        Op::Send { src, len, .. } => ([r(src, len), None], None),
        Op::Recv { dst, reduce_with: Some(with), len, .. } if with == dst => ([w(dst, len), None], None),
        Op::Recv { dst, reduce_with: Some(with), len, .. } => {
            ([w(dst, len), r(with, len)], Some((dst, with, len)))
        }
        Op::Recv { dst, reduce_with: None, len, .. } => ([w(dst, len), None], None),
        Op::Copy { src, dst, len } => ([w(dst, len), r(src, len)], Some((dst, src, len))),
        Op::Finalize { loc, len } => ([w(loc, len), None], None),
    }
}

struct Sim<'a> {
    dtype: DataType,
    size: usize,
    world: usize,
    words: usize,
    opts: &'a SimOptions,
    ranks: Vec<Rank>,
    chans: Vec<Channel>,
    pollable: RandomSet,
    deliverable: RandomSet,
    /// (rank, op) that may complete now.
    completable: Vec<(usize, OpId)>,
    stats: SimStats,
}

/// Runs explicit programs, one per rank (`setups.len()` is the world size); the building block of
/// [`run`] for schedules that do not come from [`plan::build`]. Returns the final `Output`
/// buffers.
pub fn run_programs(
    setups: Vec<RankSetup>,
    dtype: DataType,
    opts: &SimOptions,
) -> Result<RawOutcome, SimError> {
    let world = setups.len();
    let size = dtype.size();
    let words = world.div_ceil(64).max(1);
    let mut garbage = XorShift64::new(opts.seed ^ 0x5c7a_7c4e);
    let mut ranks = Vec::with_capacity(world);
    for (r, s) in setups.into_iter().enumerate() {
        for (id, op) in s.program.ops().iter().enumerate() {
            if let Op::Send { peer, .. } | Op::Recv { peer, .. } = *op
                && peer >= world
            {
                return Err(SimError::BadPeer { rank: r, op: id as OpId, peer, world });
            }
        }
        for (what, b) in [("input", &s.input), ("output", &s.output)] {
            if b.len() % size != 0 || (what == "input" && s.in_place && !b.is_empty()) {
                let want = if s.in_place { 0 } else { b.len() / size * size };
                return Err(SimError::BufferSize { rank: r, what, got: b.len(), want });
            }
        }
        let scratch: Vec<u8> =
            (0..s.program.scratch_elems() * size).map(|_| garbage.next_u64() as u8).collect();
        let n = s.program.len();
        let claims = [
            Claims::new(s.input.len() / size),
            Claims::new(s.output.len() / size),
            Claims::new(scratch.len() / size),
        ];
        ranks.push(Rank {
            sched: Schedule::new(s.program, world),
            in_place: s.in_place,
            op: s.op,
            bufs: [s.input, s.output, scratch],
            claims,
            status: vec![Status::Waiting; n],
            know: vec![0; n * words],
        });
    }
    let mut sim = Sim {
        dtype,
        size,
        world,
        words,
        opts,
        ranks,
        chans: (0..world * world).map(|_| Channel::default()).collect(),
        pollable: RandomSet::new(world),
        deliverable: RandomSet::new(world * world),
        completable: Vec::new(),
        stats: SimStats::default(),
    };
    for r in 0..world {
        sim.pollable.insert(r);
    }
    sim.run()?;
    let heard_from = (0..world).map(|r| sim.heard_from(r)).collect();
    Ok(RawOutcome {
        outputs: sim.ranks.into_iter().map(|mut r| std::mem::take(&mut r.bufs[1])).collect(),
        heard_from,
        stats: sim.stats,
    })
}

impl Sim<'_> {
    fn run(&mut self) -> Result<(), SimError> {
        let mut rng = XorShift64::new(self.opts.seed);
        loop {
            let cats = [
                !self.pollable.items.is_empty(),
                !self.deliverable.items.is_empty(),
                !self.completable.is_empty(),
            ];
            let mut avail = [0usize; 3];
            let mut n = 0;
            for (c, _) in cats.iter().enumerate().filter(|(_, nonempty)| **nonempty) {
                avail[n] = c;
                n += 1;
            }
            if n == 0 {
                break;
            }
            self.stats.steps += 1;
            match avail[rng.below(n)] {
                0 => {
                    let r = self.pollable.pick(&mut rng);
                    match self.ranks[r].sched.poll_action() {
                        Some((id, op)) => self.issue(r, id, op)?,
                        None => self.pollable.remove(r),
                    }
                }
                1 => {
                    let c = self.deliverable.pick(&mut rng);
                    self.deliver(c)?;
                }
                _ => {
                    let i = rng.below(self.completable.len());
                    let (r, id) = self.completable.swap_remove(i);
                    self.complete(r, id);
                }
            }
        }
        if self.ranks.iter().all(|r| r.sched.is_done()) {
            for (c, ch) in self.chans.iter().enumerate() {
                if !ch.msgs.is_empty() {
                    let (src, dst) = (c / self.world, c % self.world);
                    return Err(SimError::Unreceived { src, dst, count: ch.msgs.len() });
                }
            }
            return Ok(());
        }
        Err(self.deadlock())
    }

    fn check_bounds(&self, r: usize, id: OpId, a: &Access) -> Result<(), SimError> {
        let rank = &self.ranks[r];
        let b = a.loc.buf;
        if rank.in_place && b == Buf::Input {
            return Err(SimError::InputInPlace { rank: r, op: id });
        }
        if a.write && b == Buf::Input {
            return Err(SimError::WritesInput { rank: r, op: id });
        }
        let size = rank.bufs[buf_index(b)].len() / self.size;
        if a.loc.start.checked_add(a.len).is_none_or(|end| end > size) {
            let (start, len) = (a.loc.start, a.len);
            return Err(SimError::OutOfBounds { rank: r, op: id, buf: b, start, len, size });
        }
        Ok(())
    }

    fn issue(&mut self, r: usize, id: OpId, op: Op) -> Result<(), SimError> {
        let (acc, pair) = accesses(&op);
        for a in acc.iter().flatten() {
            self.check_bounds(r, id, a)?;
        }
        if let Some((x, y, len)) = pair
            && x.buf == y.buf
            && x.start < y.start + len
            && y.start < x.start + len
        {
            return Err(SimError::Overlap { rank: r, op: id });
        }
        self.claim(r, id, &acc)?;
        let rank = &mut self.ranks[r];
        rank.status[id as usize] = Status::Issued;
        self.stats.max_in_flight = self.stats.max_in_flight.max(rank.sched.in_flight());
        // Causality: what this op knows is what its dependencies knew, and this rank.
        let w = self.words;
        let i = id as usize * w;
        rank.know[i + r / 64] |= 1 << (r % 64);
        for &d in rank.sched.program().deps(id) {
            for k in 0..w {
                rank.know[i + k] |= rank.know[d as usize * w + k];
            }
        }
        match op {
            Op::Send { peer, src, len } => {
                let bytes = &rank.bufs[buf_index(src.buf)][src.start * self.size..][..len * self.size];
                let msg = Msg { data: bytes.to_vec(), len, send_op: id };
                self.stats.messages += 1;
                self.stats.bytes += (len * self.size) as u64;
                let c = r * self.world + peer;
                let ch = &mut self.chans[c];
                let seq = ch.sent;
                ch.sent += 1;
                ch.msgs.push_back(msg);
                if !self.opts.rendezvous || ch.posted_total > seq {
                    self.completable.push((r, id));
                } else {
                    ch.waiting.push_back((seq, id));
                }
                self.update_deliverable(c);
            }
            Op::Recv { peer, .. } => {
                let c = peer * self.world + r;
                let ch = &mut self.chans[c];
                ch.posted.push_back(id);
                ch.posted_total += 1;
                while ch.waiting.front().is_some_and(|&(seq, _)| seq < ch.posted_total) {
                    let (_, send) = ch.waiting.pop_front().expect("non-empty");
                    self.completable.push((peer, send));
                }
                self.update_deliverable(c);
            }
            Op::Copy { .. } | Op::Finalize { .. } => self.completable.push((r, id)),
        }
        Ok(())
    }

    fn claim(&mut self, r: usize, id: OpId, acc: &[Option<Access>; 2]) -> Result<(), SimError> {
        let rank = &mut self.ranks[r];
        // Check everything first, so that a failed claim leaves no trace.
        for a in acc.iter().flatten() {
            let cl = &rank.claims[buf_index(a.loc.buf)];
            for i in a.loc.start..a.loc.start + a.len {
                let other = if cl.writer[i] != NONE {
                    cl.writer[i]
                } else if a.write && cl.readers[i] > 0 {
                    cl.last_reader[i]
                } else {
                    continue;
                };
                return Err(SimError::Race { rank: r, op: id, other, buf: a.loc.buf, index: i });
            }
        }
        for a in acc.iter().flatten() {
            let cl = &mut rank.claims[buf_index(a.loc.buf)];
            for i in a.loc.start..a.loc.start + a.len {
                if a.write {
                    cl.writer[i] = id;
                } else {
                    cl.readers[i] += 1;
                    cl.last_reader[i] = id;
                }
            }
        }
        Ok(())
    }

    fn release(&mut self, r: usize, op: &Op) {
        let (acc, _) = accesses(op);
        let rank = &mut self.ranks[r];
        for a in acc.iter().flatten() {
            let cl = &mut rank.claims[buf_index(a.loc.buf)];
            for i in a.loc.start..a.loc.start + a.len {
                if a.write {
                    cl.writer[i] = NONE;
                } else {
                    cl.readers[i] -= 1;
                }
            }
        }
    }

    fn update_deliverable(&mut self, c: usize) {
        let ch = &self.chans[c];
        if !ch.msgs.is_empty() && !ch.posted.is_empty() {
            self.deliverable.insert(c);
        } else {
            self.deliverable.remove(c);
        }
    }

    fn deliver(&mut self, c: usize) -> Result<(), SimError> {
        let (src, dst) = (c / self.world, c % self.world);
        let ch = &mut self.chans[c];
        let msg = ch.msgs.pop_front().expect("deliverable");
        let recv = ch.posted.pop_front().expect("deliverable");
        self.update_deliverable(c);
        let rank = &mut self.ranks[dst];
        let Op::Recv { dst: to, reduce_with, len, .. } = rank.sched.program().ops()[recv as usize] else {
            unreachable!("posted ops are receives")
        };
        if len != msg.len {
            return Err(SimError::LengthMismatch {
                src,
                send_op: msg.send_op,
                send_len: msg.len,
                dst,
                recv_op: recv,
                recv_len: len,
            });
        }
        let s = self.size;
        let out_range = (to.buf, to.start * s..(to.start + len) * s);
        match reduce_with {
            None => rank.bufs[buf_index(to.buf)][out_range.1].copy_from_slice(&msg.data),
            Some(w) if w == to => {
                let out = &mut rank.bufs[buf_index(to.buf)][out_range.1];
                reference::reduce_assign(self.dtype, rank.op, out, &msg.data);
            }
            Some(w) => {
                let (out, with) = split(&mut rank.bufs, out_range, (w.buf, w.start * s..(w.start + len) * s));
                reference::reduce_slices(self.dtype, rank.op, out, with, &msg.data);
            }
        }
        let w = self.words;
        let (from, to_know) = (msg.send_op as usize * w, recv as usize * w);
        if src == dst {
            for k in 0..w {
                rank.know[to_know + k] |= rank.know[from + k];
            }
        } else {
            let [a, b] = self.ranks.get_disjoint_mut([src, dst]).expect("distinct ranks");
            for (k, v) in b.know[to_know..][..w].iter_mut().zip(&a.know[from..][..w]) {
                *k |= v;
            }
        }
        self.completable.push((dst, recv));
        Ok(())
    }

    fn complete(&mut self, r: usize, id: OpId) {
        let op = self.ranks[r].sched.program().ops()[id as usize];
        let s = self.size;
        let world = self.world;
        let rank = &mut self.ranks[r];
        match op {
            Op::Copy { src, dst, len } => {
                let to = (dst.buf, dst.start * s..(dst.start + len) * s);
                let (out, from) = split(&mut rank.bufs, to, (src.buf, src.start * s..(src.start + len) * s));
                out.copy_from_slice(from);
            }
            Op::Finalize { loc, len } => {
                let buf = &mut rank.bufs[buf_index(loc.buf)][loc.start * s..][..len * s];
                reference::finalize_avg(self.dtype, buf, world);
            }
            Op::Send { .. } | Op::Recv { .. } => {}
        }
        self.release(r, &op);
        let rank = &mut self.ranks[r];
        rank.status[id as usize] = Status::Done;
        rank.sched.handle_complete(id);
        self.pollable.insert(r);
    }

    fn heard_from(&self, r: usize) -> Vec<bool> {
        let rank = &self.ranks[r];
        let w = self.words;
        let mut know = vec![0u64; w];
        know[r / 64] |= 1 << (r % 64);
        for op in rank.know.chunks_exact(w) {
            for (k, v) in know.iter_mut().zip(op) {
                *k |= v;
            }
        }
        (0..self.world).map(|q| know[q / 64] >> (q % 64) & 1 == 1).collect()
    }

    fn deadlock(&self) -> SimError {
        let mut ranks = Vec::new();
        let mut parts = Vec::new();
        for (r, rank) in self.ranks.iter().enumerate() {
            if rank.sched.is_done() {
                continue;
            }
            ranks.push(r);
            let prog = rank.sched.program();
            let describe = |id: usize| {
                let what = match prog.ops()[id] {
                    Op::Send { peer, len, .. } => format!("send of {len} to rank {peer}"),
                    Op::Recv { peer, len, .. } => format!("recv of {len} from rank {peer}"),
                    Op::Copy { len, .. } => format!("copy of {len}"),
                    Op::Finalize { len, .. } => format!("finalize of {len}"),
                };
                format!("op {id} {what}")
            };
            let issued: Vec<String> = (0..prog.len())
                .filter(|&i| rank.status[i] == Status::Issued)
                .take(4)
                .map(|i| format!("{} (issued)", describe(i)))
                .collect();
            let waiting: Vec<String> = (0..prog.len())
                .filter(|&i| rank.status[i] == Status::Waiting)
                .take(4 - issued.len().min(3))
                .map(|i| format!("{} (after {:?})", describe(i), prog.deps(i as OpId)))
                .collect();
            let done = rank.status.iter().filter(|&&s| s == Status::Done).count();
            parts.push(format!(
                "rank {r} ({done}/{} done): {}",
                prog.len(),
                issued.into_iter().chain(waiting).collect::<Vec<_>>().join(", ")
            ));
        }
        for (c, ch) in self.chans.iter().enumerate() {
            if !ch.msgs.is_empty() {
                let (src, dst) = (c / self.world, c % self.world);
                parts.push(format!("{} message(s) from {src} to {dst} unreceived", ch.msgs.len()));
            }
        }
        SimError::Deadlock { ranks, detail: parts.join("; ") }
    }
}

#[cfg(test)]
mod tests;
