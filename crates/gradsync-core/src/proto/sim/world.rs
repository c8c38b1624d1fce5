//! The simulated world: ranks, boards, events on their way, and the seeded scheduler.

use super::rank::{Board, SimRank, pool_key, rkey};
use super::types::{CallSpec, Event, SimConfig, SimError, SimStats};
use crate::proto::action::Target;
use crate::proto::machine::Config;
use crate::reference::{self, InputKind, Tolerance};
use crate::rng::XorShift64;
use crate::schedule::{Buf, Params};
use crate::wire::{DATA_HEADER_LEN, DataHeader, Signature};
use crate::{Collective, ReduceOp};
use std::time::{Duration, Instant};

/// The address of every rank's pool, for the pairs whose clear-to-sends name addresses.
const POOL_ADDR: u64 = 1 << 40;

struct Sim {
    cfg: SimConfig,
    world: usize,
    ranks: Vec<SimRank>,
    boards: Vec<Board>,
    events: Vec<Event>,
    calls: Vec<CallSpec>,
    inputs: Vec<Vec<Vec<u8>>>,
    t0: Instant,
    stats: SimStats,
}

/// Runs `calls`, in order on every rank, over `world` simulated ranks; checks every result.
pub fn run(cfg: &SimConfig, world: usize, calls: &[CallSpec]) -> Result<SimStats, SimError> {
    let t0 = Instant::now();
    for (call, c) in calls.iter().enumerate() {
        if reduces(c.coll) {
            c.op.check(c.dtype)
                .map_err(|source| SimError::OpType { call, source })?;
        }
    }
    let mut seeds = XorShift64::new(cfg.seed ^ 0x1a2b_3c4d);
    let inputs: Vec<Vec<Vec<u8>>> = calls
        .iter()
        .map(|c| {
            let elems = Params {
                coll: c.coll,
                rank: 0,
                world,
                count: c.count,
                root: c.root,
                op: c.op,
                segment: 1,
                in_place: c.in_place,
                algorithm: c.algorithm,
                local_size: 0,
            }
            .input_elems();
            let kind = if reduces(c.coll) {
                InputKind::Exact
            } else {
                InputKind::Bits
            };
            (0..world)
                .map(|_| reference::gen_input(c.dtype, c.op, kind, elems, seeds.next_u64()))
                .collect()
        })
        .collect();
    let ranks = (0..world)
        .map(|rank| {
            let pc = Config {
                rank,
                world,
                nslots: cfg.nslots,
                slot_bytes: cfg.slot_bytes,
                direct_min: cfg.direct_min,
                checksum: cfg.checksum,
            };
            let mut r = SimRank::new(pc, t0);
            if cfg.no_offers_from == Some(rank) {
                (0..world).for_each(|p| r.proto.set_direct_min(p, usize::MAX, usize::MAX, 0));
            }
            if let Some(w) = cfg.window {
                (0..world).for_each(|p| r.proto.set_window(p, w));
            }
            if cfg.counters_from > 0 {
                let start =
                    |from: usize, to: usize| cfg.counters_from + ((from * 7 + to * 13) % 11) as u64;
                (0..world).for_each(|p| r.proto.set_counters(p, start(rank, p), start(p, rank)));
            }
            r.proto.enable_board(cfg.board);
            if cfg.pool_slots > 0 {
                let stride = pc.stride();
                r.pool = vec![0; cfg.pool_slots * stride];
                r.pool_full = vec![false; cfg.pool_slots];
                r.proto.set_pool(cfg.pool_slots, pool_key(rank), POOL_ADDR);
                for p in (0..world).filter(|&p| cfg.pool_all || p.abs_diff(rank) > 1) {
                    // Odd seeds name slots by address, as for RDMA.
                    r.proto.set_pooled(p, cfg.seed % 2 == 1);
                }
            }
            r
        })
        .collect();
    let mut sim = Sim {
        cfg: *cfg,
        world,
        ranks,
        boards: (0..world).map(|_| Board::default()).collect(),
        events: Vec::new(),
        calls: calls.to_vec(),
        inputs,
        t0,
        stats: SimStats::default(),
    };
    sim.run()?;
    for (i, spec) in calls.iter().enumerate() {
        let outputs: Vec<Vec<u8>> = sim.ranks.iter().map(|r| r.results[i].clone()).collect();
        reference::check(
            spec.coll,
            spec.dtype,
            spec.op,
            world,
            spec.root,
            &sim.inputs[i],
            &outputs,
            Tolerance::Exact,
        )
        .map_err(|m| SimError::Result {
            call: i,
            spec: *spec,
            detail: m.to_string(),
        })?;
    }
    Ok(sim.stats)
}

/// Whether a collective reduces (and so applies its operator).
fn reduces(coll: Collective) -> bool {
    matches!(
        coll,
        Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
    )
}

impl Sim {
    fn now(&self) -> Instant {
        self.t0 + Duration::from_micros(self.stats.steps)
    }

    fn params(&self, spec: &CallSpec, rank: usize) -> Params {
        let segment = (self.cfg.slot_bytes / spec.dtype.size()).max(1);
        Params {
            coll: spec.coll,
            rank,
            world: self.world,
            count: spec.count,
            root: spec.root,
            op: spec.op,
            segment,
            in_place: spec.in_place,
            algorithm: spec.algorithm,
            local_size: 0,
        }
    }

    /// Finishes the rank's operation if it is done and starts its next one.
    fn advance_call(&mut self, r: usize) -> Result<(), SimError> {
        let now = self.now();
        let rank = &mut self.ranks[r];
        if rank.running.is_some() && rank.proto.is_done() {
            let run = rank.running.take().expect("running");
            rank.proto.finish();
            let res = run.params.result_range();
            let ds = run.dtype.size();
            rank.results
                .push(run.bufs[1][res.start * ds..res.end * ds].to_vec());
            rank.moved = true;
        }
        if rank.running.is_none() && rank.next < self.calls.len() {
            let i = rank.next;
            rank.next += 1;
            let spec = self.calls[i];
            let params = self.params(&spec, r);
            let sig = Signature {
                comm_id: 0x5157_0000 + self.cfg.seed,
                seq: i as u64 + 1,
                coll: spec.coll,
                dtype: spec.dtype,
                op: if reduces(spec.coll) {
                    spec.op
                } else {
                    ReduceOp::Sum
                },
                count: spec.count as u64,
                root: if matches!(spec.coll, Collective::Broadcast | Collective::Reduce) {
                    spec.root as u32
                } else {
                    0
                },
            };
            let rank = &mut self.ranks[r];
            rank.start(i, params, spec.dtype, sig, &self.inputs[i][r], now)?;
            rank.moved = true;
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.ranks
            .iter()
            .all(|r| r.running.is_none() && r.next == self.calls.len())
    }

    fn run(&mut self) -> Result<(), SimError> {
        let mut rng = XorShift64::new(self.cfg.seed);
        for r in 0..self.world {
            self.advance_call(r)?;
        }
        // Steps in a row in which nothing moved, and whether an event was pending meanwhile.
        let mut still = 0usize;
        loop {
            if self.finished() {
                return Ok(());
            }
            self.stats.steps += 1;
            if self.stats.steps > self.cfg.max_steps {
                return Err(SimError::Livelock(self.stats.steps));
            }
            if !self.events.is_empty() && (rng.one_in(2) || still > 0) {
                let i = self.pick_event(&mut rng);
                let ev = self.events.swap_remove(i);
                self.deliver(ev)?;
                still = 0;
                continue;
            }
            let r = self.pick_rank(&mut rng);
            let moved = self.step(r)?;
            if moved || !self.events.is_empty() {
                still = 0;
                continue;
            }
            still += 1;
            // Every rank has had many idle rounds (credits flushed, boards looked at, retries
            // made) and nothing moved: no one can.
            if still > 64 * self.world + 4096 {
                return Err(self.deadlock());
            }
        }
    }

    fn pick_rank(&self, rng: &mut XorShift64) -> usize {
        loop {
            let r = rng.below(self.world);
            match self.cfg.slow {
                Some((slow, every)) if r == slow && !rng.one_in(every.max(1)) => continue,
                _ => return r,
            }
        }
    }

    /// An event to deliver: any, or with `fifo` the oldest of a random pair.
    fn pick_event(&self, rng: &mut XorShift64) -> usize {
        let i = rng.below(self.events.len());
        if !self.cfg.fifo {
            return i;
        }
        let pair = self.events[i].pair();
        self.events
            .iter()
            .position(|e| e.pair() == pair)
            .expect("the pair has an event")
    }

    /// One round of rank `r`: its machine's actions carried out, its next call started.
    fn step(&mut self, r: usize) -> Result<bool, SimError> {
        let now = self.now();
        let idle = !self.ranks[r].moved;
        let rank = &mut self.ranks[r];
        rank.moved = false;
        rank.proto.handle_round(now, idle);
        // Actions that only look (a board read finding nothing, a refused posting) are not
        // progress: what the machine says moved is.
        rank.drain(self.world, &mut self.boards, &mut self.events)?;
        rank.moved = rank.proto.take_moved();
        self.advance_call(r)?;
        Ok(self.ranks[r].moved)
    }

    fn deliver(&mut self, ev: Event) -> Result<(), SimError> {
        let now = self.now();
        match ev {
            Event::Done { rank, wr } => {
                self.ranks[rank].proto.handle_write_done(wr);
                self.ranks[rank].moved = true;
            }
            Event::Msg { from, to, data } => {
                self.stats.messages += 1;
                let rank = &mut self.ranks[to];
                rank.moved = true;
                rank.proto
                    .handle_message(from, data, now)
                    .map_err(|error| SimError::Proto { rank: to, error })?;
            }
            Event::Land(l) => {
                self.stats.writes += 1;
                let payload = {
                    let src = self.ranks[l.from].running.as_ref().ok_or_else(|| {
                        SimError::Internal(format!("rank {} wrote outside an operation", l.from))
                    })?;
                    let ds = src.dtype.size();
                    let b = if src.params.in_place && l.src.buf == Buf::Input {
                        1
                    } else {
                        match l.src.buf {
                            Buf::Input => 0,
                            Buf::Output => 1,
                            Buf::Scratch => 2,
                        }
                    };
                    src.bufs[b][l.src.start * ds..(l.src.start + l.len) * ds].to_vec()
                };
                let len = match (l.target, l.header) {
                    (Target::Slot { slot, offset, .. }, Some(h)) => {
                        let rank = &mut self.ranks[l.to];
                        let nslots = rank.proto.config().nslots;
                        let full = &mut rank.slot_full[l.from * nslots + slot];
                        if *full {
                            return Err(SimError::SlotOverrun {
                                from: l.from,
                                to: l.to,
                                slot,
                            });
                        }
                        *full = true;
                        let at = offset as usize;
                        h.emit(&mut DataHeader::new_unchecked(
                            &mut rank.inbox[at..at + DATA_HEADER_LEN],
                        ));
                        rank.inbox[at + DATA_HEADER_LEN..][..payload.len()]
                            .copy_from_slice(&payload);
                        DATA_HEADER_LEN + payload.len()
                    }
                    (Target::Direct { rkey: key, offset }, _) if key == pool_key(l.to) => {
                        self.stats.pool_writes += 1;
                        let rank = &mut self.ranks[l.to];
                        let stride = rank.proto.config().stride();
                        let at = if offset >= POOL_ADDR {
                            offset - POOL_ADDR
                        } else {
                            offset
                        } as usize;
                        let slot = at / stride;
                        let bad = || SimError::BadKey {
                            from: l.from,
                            to: l.to,
                            rkey: key,
                        };
                        if !at.is_multiple_of(stride) || payload.len() > stride {
                            return Err(bad());
                        }
                        let full = rank.pool_full.get_mut(slot).ok_or_else(bad)?;
                        if std::mem::replace(full, true) {
                            return Err(SimError::Internal(format!(
                                "rank {} wrote pool slot {slot} of rank {} before it was delivered",
                                l.from, l.to
                            )));
                        }
                        rank.pool[at..at + payload.len()].copy_from_slice(&payload);
                        payload.len()
                    }
                    (Target::Direct { rkey: key, offset }, _) => {
                        self.stats.direct_writes += 1;
                        let rank = &mut self.ranks[l.to];
                        let run = rank.running.as_mut().ok_or(SimError::BadKey {
                            from: l.from,
                            to: l.to,
                            rkey: key,
                        })?;
                        let b = (0..3)
                            .find(|&b| rkey(l.to, run.index, b) == key)
                            .filter(|&b| b > 0)
                            .ok_or(SimError::BadKey {
                                from: l.from,
                                to: l.to,
                                rkey: key,
                            })?;
                        let at = offset as usize;
                        let dst = run.bufs[b].get_mut(at..at + payload.len()).ok_or(
                            SimError::BadKey {
                                from: l.from,
                                to: l.to,
                                rkey: key,
                            },
                        )?;
                        dst.copy_from_slice(&payload);
                        payload.len()
                    }
                    (Target::Slot { .. }, None) => {
                        return Err(SimError::Internal("slot write without a header".into()));
                    }
                };
                let rank = &mut self.ranks[l.to];
                rank.moved = true;
                let inbox = &rank.inbox;
                let off = |k: usize| rank.proto.slot_offset(l.from, k);
                let offs: Vec<usize> = (0..rank.proto.config().nslots).map(off).collect();
                rank.proto
                    .handle_write_imm(l.from, l.imm, len as u32, now, |k| {
                        &inbox[offs[k]..offs[k] + DATA_HEADER_LEN]
                    })
                    .map_err(|error| SimError::Proto { rank: l.to, error })?;
                self.events.push(Event::Done {
                    rank: l.from,
                    wr: l.wr,
                });
            }
        }
        Ok(())
    }

    fn deadlock(&self) -> SimError {
        let detail = self
            .ranks
            .iter()
            .filter(|r| r.running.is_some() || r.next < self.calls.len())
            .map(|r| {
                let call = r.running.as_ref().map_or(r.next, |x| x.index);
                format!(
                    "rank {} in call {call} waits on {:?}",
                    r.rank,
                    r.proto.waiting_on()
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        SimError::Deadlock {
            steps: self.stats.steps,
            detail,
        }
    }
}
