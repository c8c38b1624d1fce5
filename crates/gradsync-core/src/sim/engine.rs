//! The execution engine of the simulator: ranks, channels, claims and the random scheduler.
//!
//! A `Post` puts one message into the channel of every other rank when it issues, and
//! completes then (a post is buffered, with rendezvous sends too: see [`Op::Post`]); the messages
//! of a channel are matched with the receiver's receives from that rank in order. The engine
//! checks the matching rule of the [schedule docs](crate::schedule) as messages are issued: the
//! k-th message a rank issues to a peer must be its k-th `Send` or `Post` for that peer in
//! program order, and the k-th receive it posts from a peer its k-th `Recv` from that peer.

use std::collections::VecDeque;

use super::types::{RankSetup, RawOutcome, SimError, SimOptions, SimStats};
use crate::reference;
use crate::rng::XorShift64;
use crate::schedule::{Buf, Loc, Op, OpId, Schedule};
use crate::{DataType, ReduceOp};

const NONE: u32 = u32::MAX;

/// `len` bytes of seeded garbage, eight per draw of `rng`.
pub(super) fn garbage(rng: &mut XorShift64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A set of small integers with O(1) insert, remove and uniform random choice.
struct RandomSet {
    items: Vec<usize>,
    pos: Vec<usize>,
}

impl RandomSet {
    fn new(universe: usize) -> Self {
        RandomSet {
            items: Vec::new(),
            pos: vec![usize::MAX; universe],
        }
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
        Claims {
            writer: vec![NONE; elems],
            readers: vec![0; elems],
            last_reader: vec![NONE; elems],
        }
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
    /// Program order of the messages: see [`Order`].
    order: Order,
}

/// The program order of a rank's messages, to check that they are issued in it.
struct Order {
    /// Per op: for a send, its index among the messages to its peer; for a receive, its index
    /// among the receives from its peer; for a post, the posts before it.
    index: Vec<u32>,
    /// Per peer, the sends to it in program order; kept only when the program has posts, whose
    /// index differs from peer to peer.
    sends: Vec<Vec<OpId>>,
}

impl Order {
    fn new(ops: &[Op], world: usize) -> Self {
        let mut sent = vec![0u32; world];
        let mut received = vec![0u32; world];
        let mut posts = 0;
        let index = ops
            .iter()
            .map(|op| match *op {
                Op::Send { peer, .. } => {
                    sent[peer] += 1;
                    sent[peer] - 1 + posts
                }
                Op::Recv { peer, .. } => {
                    received[peer] += 1;
                    received[peer] - 1
                }
                Op::Post { .. } => {
                    posts += 1;
                    posts - 1
                }
                _ => 0,
            })
            .collect();
        let mut sends = Vec::new();
        if posts > 0 {
            sends = vec![Vec::new(); world];
            for (id, op) in ops.iter().enumerate() {
                if let Op::Send { peer, .. } = *op {
                    sends[peer].push(id as OpId);
                }
            }
        }
        Order { index, sends }
    }

    /// Index of the message of op `id` (a send or a post) among the messages to `peer`.
    fn message(&self, ops: &[Op], id: OpId, peer: usize) -> u64 {
        let i = u64::from(self.index[id as usize]);
        match ops[id as usize] {
            Op::Post { .. } => i + self.sends[peer].partition_point(|&x| x < id) as u64,
            _ => i,
        }
    }

    /// Index of receive `id` among the receives from its peer.
    fn receive(&self, id: OpId) -> u64 {
        u64::from(self.index[id as usize])
    }
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

/// The ranges an op claims, and the two operands (with their lengths) that must not overlap.
type Accesses = ([Option<Access>; 2], Option<(Loc, usize, Loc, usize)>);

/// The accesses of `op` in a world of `world` ranks.
fn accesses(op: &Op, world: usize) -> Accesses {
    let r = |loc, len| {
        Some(Access {
            loc,
            len,
            write: false,
        })
    };
    let w = |loc, len| {
        Some(Access {
            loc,
            len,
            write: true,
        })
    };
    match *op {
        Op::Send { src, len, .. } | Op::Post { src, len } => ([r(src, len), None], None),
        Op::Recv {
            dst,
            reduce_with: Some(with),
            len,
            ..
        } if with == dst => ([w(dst, len), None], None),
        Op::Recv {
            dst,
            reduce_with: Some(with),
            len,
            ..
        } => ([w(dst, len), r(with, len)], Some((dst, len, with, len))),
        Op::Recv {
            dst,
            reduce_with: None,
            len,
            ..
        } => ([w(dst, len), None], None),
        Op::Copy { src, dst, len } => ([w(dst, len), r(src, len)], Some((dst, len, src, len))),
        Op::ReduceParts { src, dst, len } => {
            // The parts span `world * len` elements; `validate` bounds `count * world`.
            let all = len.saturating_mul(world);
            ([w(dst, len), r(src, all)], Some((dst, len, src, all)))
        }
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
    /// Buffers of delivered messages, reused for the next ones.
    spare: Vec<Vec<u8>>,
}

/// Runs explicit programs, one per rank (`setups.len()` is the world size); the building block of
/// [`run`](super::run) for schedules that do not come from
/// [`build`](crate::schedule::plan::build). Returns the final `Output`
/// buffers.
pub fn run_programs(
    setups: Vec<RankSetup>,
    dtype: DataType,
    opts: &SimOptions,
) -> Result<RawOutcome, SimError> {
    let world = setups.len();
    let size = dtype.size();
    let words = world.div_ceil(64).max(1);
    let mut rng = XorShift64::new(opts.seed ^ 0x5c7a_7c4e);
    let mut ranks = Vec::with_capacity(world);
    for (r, s) in setups.into_iter().enumerate() {
        super::timing::check_peers(r, &s.program, world)?;
        let reduces = s.program.ops().iter().any(|o| {
            matches!(
                o,
                Op::ReduceParts { .. }
                    | Op::Recv {
                        reduce_with: Some(_),
                        ..
                    }
            )
        });
        if reduces {
            s.op.check(dtype)
                .map_err(|source| SimError::OpType { rank: r, source })?;
        }
        for (what, b) in [("input", &s.input), ("output", &s.output)] {
            if b.len() % size != 0 || (what == "input" && s.in_place && !b.is_empty()) {
                let want = if s.in_place { 0 } else { b.len() / size * size };
                return Err(SimError::BufferSize {
                    rank: r,
                    what,
                    got: b.len(),
                    want,
                });
            }
        }
        let scratch = garbage(&mut rng, s.program.scratch_elems() * size);
        let n = s.program.len();
        let claims = [
            Claims::new(s.input.len() / size),
            Claims::new(s.output.len() / size),
            Claims::new(scratch.len() / size),
        ];
        let order = Order::new(s.program.ops(), world);
        ranks.push(Rank {
            order,
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
        spare: Vec::new(),
    };
    for r in 0..world {
        sim.pollable.insert(r);
    }
    sim.run()?;
    let heard_from = (0..world).map(|r| sim.heard_from(r)).collect();
    Ok(RawOutcome {
        outputs: sim
            .ranks
            .into_iter()
            .map(|mut r| std::mem::take(&mut r.bufs[1]))
            .collect(),
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
                    return Err(SimError::Unreceived {
                        src,
                        dst,
                        count: ch.msgs.len(),
                    });
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
            return Err(SimError::OutOfBounds {
                rank: r,
                op: id,
                buf: b,
                start,
                len,
                size,
            });
        }
        Ok(())
    }

    fn issue(&mut self, r: usize, id: OpId, op: Op) -> Result<(), SimError> {
        let (acc, pair) = accesses(&op, self.world);
        for a in acc.iter().flatten() {
            self.check_bounds(r, id, a)?;
        }
        if let Some((x, xl, y, yl)) = pair
            && x.buf == y.buf
            && xl > 0
            && yl > 0
            && x.start < y.start + yl
            && y.start < x.start + xl
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
                let waits = self.send(r, id, peer, src, len, self.opts.rendezvous)?;
                if !waits {
                    self.completable.push((r, id));
                }
            }
            Op::Post { src, len } => {
                for k in 1..self.world {
                    let peer = (r + k) % self.world;
                    self.send(r, id, peer, src, len, false)?;
                }
                self.completable.push((r, id));
            }
            Op::Recv { peer, .. } => {
                let c = peer * self.world + r;
                let want = rank.order.receive(id);
                let ch = &mut self.chans[c];
                if ch.posted_total != want {
                    return Err(SimError::OutOfOrder {
                        rank: r,
                        op: id,
                        peer,
                        index: ch.posted_total,
                        expected: want,
                    });
                }
                ch.posted.push_back(id);
                ch.posted_total += 1;
                let posted = ch.posted_total;
                while let Some(&(seq, send)) = self.chans[c].waiting.front()
                    && seq < posted
                {
                    self.chans[c].waiting.pop_front();
                    self.matched(peer, send);
                }
                self.update_deliverable(c);
            }
            Op::Copy { .. } | Op::ReduceParts { .. } | Op::Finalize { .. } => {
                self.completable.push((r, id))
            }
        }
        Ok(())
    }

    /// Puts the message of send or post `id` of rank `r` to `peer` into their channel. Returns
    /// whether it waits for its receive (`rendezvous`) before the op may complete.
    fn send(
        &mut self,
        r: usize,
        id: OpId,
        peer: usize,
        src: Loc,
        len: usize,
        rendezvous: bool,
    ) -> Result<bool, SimError> {
        let rank = &self.ranks[r];
        let bytes = &rank.bufs[buf_index(src.buf)][src.start * self.size..][..len * self.size];
        let mut data = self.spare.pop().unwrap_or_default();
        data.clear();
        data.extend_from_slice(bytes);
        let msg = Msg {
            data,
            len,
            send_op: id,
        };
        self.stats.messages += 1;
        self.stats.bytes += (len * self.size) as u64;
        let want = rank.order.message(rank.sched.program().ops(), id, peer);
        let c = r * self.world + peer;
        let ch = &mut self.chans[c];
        let seq = ch.sent;
        if seq != want {
            return Err(SimError::OutOfOrder {
                rank: r,
                op: id,
                peer,
                index: seq,
                expected: want,
            });
        }
        ch.sent += 1;
        ch.msgs.push_back(msg);
        let waits = rendezvous && ch.posted_total <= seq;
        if waits {
            ch.waiting.push_back((seq, id));
        }
        self.update_deliverable(c);
        Ok(waits)
    }

    /// A rendezvous send of op `id` of rank `r` has met its receive: it may complete now.
    fn matched(&mut self, r: usize, id: OpId) {
        self.completable.push((r, id));
    }

    fn claim(&mut self, r: usize, id: OpId, acc: &[Option<Access>; 2]) -> Result<(), SimError> {
        let rank = &mut self.ranks[r];
        // Check everything first, so that a failed claim leaves no trace. The common case, no
        // conflict, is a branch-free pass over the range; the conflict is then looked up.
        for a in acc.iter().flatten() {
            let cl = &rank.claims[buf_index(a.loc.buf)];
            let range = a.loc.start..a.loc.start + a.len;
            let free = cl.writer[range.clone()]
                .iter()
                .fold(true, |ok, &w| ok & (w == NONE));
            let unread = !a.write || cl.readers[range.clone()].iter().fold(0, |n, &c| n | c) == 0;
            if free && unread {
                continue;
            }
            for i in range {
                let other = if cl.writer[i] != NONE {
                    cl.writer[i]
                } else if a.write && cl.readers[i] > 0 {
                    cl.last_reader[i]
                } else {
                    continue;
                };
                return Err(SimError::Race {
                    rank: r,
                    op: id,
                    other,
                    buf: a.loc.buf,
                    index: i,
                });
            }
        }
        for a in acc.iter().flatten() {
            let cl = &mut rank.claims[buf_index(a.loc.buf)];
            let range = a.loc.start..a.loc.start + a.len;
            if a.write {
                cl.writer[range].fill(id);
            } else {
                cl.readers[range.clone()].iter_mut().for_each(|c| *c += 1);
                cl.last_reader[range].fill(id);
            }
        }
        Ok(())
    }

    fn release(&mut self, r: usize, op: &Op) {
        let (acc, _) = accesses(op, self.world);
        let rank = &mut self.ranks[r];
        for a in acc.iter().flatten() {
            let cl = &mut rank.claims[buf_index(a.loc.buf)];
            let range = a.loc.start..a.loc.start + a.len;
            if a.write {
                cl.writer[range].fill(NONE);
            } else {
                cl.readers[range].iter_mut().for_each(|c| *c -= 1);
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
        let Op::Recv {
            dst: to,
            reduce_with,
            len,
            ..
        } = rank.sched.program().ops()[recv as usize]
        else {
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
                let (out, with) = split(
                    &mut rank.bufs,
                    out_range,
                    (w.buf, w.start * s..(w.start + len) * s),
                );
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
            let [a, b] = self
                .ranks
                .get_disjoint_mut([src, dst])
                .expect("distinct ranks");
            for (k, v) in b.know[to_know..][..w].iter_mut().zip(&a.know[from..][..w]) {
                *k |= v;
            }
        }
        self.spare.push(msg.data);
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
                let (out, from) = split(
                    &mut rank.bufs,
                    to,
                    (src.buf, src.start * s..(src.start + len) * s),
                );
                out.copy_from_slice(from);
            }
            Op::ReduceParts { src, dst, len } => {
                let b = len * s;
                let (out, parts) = split(
                    &mut rank.bufs,
                    (dst.buf, dst.start * s..dst.start * s + b),
                    (src.buf, src.start * s..src.start * s + world * b),
                );
                if b > 0 {
                    // Left to right, as the definition says: ((p0 op p1) op p2) ...
                    out.copy_from_slice(&parts[..b]);
                    for part in parts.chunks_exact(b).skip(1) {
                        reference::reduce_assign(self.dtype, rank.op, out, part);
                    }
                }
            }
            Op::Finalize { loc, len } => {
                let buf = &mut rank.bufs[buf_index(loc.buf)][loc.start * s..][..len * s];
                reference::finalize_avg(self.dtype, buf, world);
            }
            Op::Send { .. } | Op::Post { .. } | Op::Recv { .. } => {}
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
        (0..self.world)
            .map(|q| know[q / 64] >> (q % 64) & 1 == 1)
            .collect()
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
                    Op::Post { len, .. } => format!("post of {len}"),
                    Op::Copy { len, .. } => format!("copy of {len}"),
                    Op::ReduceParts { len, .. } => format!("rank-order reduction of {len}"),
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
                issued
                    .into_iter()
                    .chain(waiting)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        for (c, ch) in self.chans.iter().enumerate() {
            if !ch.msgs.is_empty() {
                let (src, dst) = (c / self.world, c % self.world);
                parts.push(format!(
                    "{} message(s) from {src} to {dst} unreceived",
                    ch.msgs.len()
                ));
            }
        }
        SimError::Deadlock {
            ranks,
            detail: parts.join("; "),
        }
    }
}
