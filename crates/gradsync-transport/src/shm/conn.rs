//! The mapped segments of a connected endpoint ([`Conn`]): this rank's own and every peer's,
//! with the liveness sweep, the blocking wait on the eventcount and the board's state.

use super::board::BoardState;
use super::directory::LocalTable;
use super::futex::{Woke, futex_wait};
use super::layout::{C_TAIL, C_WANT_SPACE, H_CLOSED, H_EVENTS, H_SLEEPING, ctl_off};
use super::liveness::process_state;
use super::peer::{Me, Peer};
use super::segment::Segment;
use crate::error::Result;
use crate::verbs::Completion;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

/// How long a sleeping [`Endpoint::wait`](crate::Endpoint::wait) goes before it looks at peer processes again.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// The mapped segments of a connected endpoint.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) own: Segment,
    /// By position in the local ranks; `None` at this rank's own position.
    pub(super) peers: Vec<Option<Peer>>,
    /// This rank's bookkeeping of the board.
    pub(super) board: BoardState,
}

impl Conn {
    /// Moves every peer's pending records into its ring, as many as fit.
    pub(super) fn flush_all(&mut self, me: Me) -> Result<()> {
        for p in self.peers.iter_mut().flatten() {
            p.flush(me)?;
        }
        Ok(())
    }

    /// Whether any ring holds a record not yet polled.
    pub(super) fn rings_ready(&self) -> bool {
        self.peers.iter().flatten().any(|p| {
            !p.broken
                && self
                    .own
                    .a64(ctl_off(p.pos) + C_TAIL)
                    .load(Ordering::Acquire)
                    != p.rx_head
        })
    }

    /// Marks peers that closed or whose process is gone; returns whether any newly went down.
    pub(super) fn check_liveness(&mut self, full: bool) -> bool {
        let mut newly = false;
        for p in self.peers.iter_mut().flatten() {
            if p.down.is_some() {
                continue;
            }
            let gone = if full {
                p.process_gone()
            } else {
                process_state(p.pid, None, false)
            };
            if p.is_down() {
                newly = true;
            } else if let Some(g) = gone {
                p.set_down(format!("rank {}: {g}", p.rank));
                newly = true;
            }
        }
        newly
    }

    /// Sleeps on the eventcount until a peer signals, `deadline` passes or (with `rings`) a
    /// ring has data or a peer goes away.
    pub(super) fn block(&mut self, me: Me, deadline: Option<Instant>, rings: bool) -> Result<()> {
        let sleeping = self.own.a32(H_SLEEPING);
        sleeping.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let ec = self.own.a32(H_EVENTS).load(Ordering::Acquire);
        for p in self.peers.iter().flatten() {
            if p.down.is_none() && !p.pending.is_empty() {
                p.seg.a32(p.ctl + C_WANT_SPACE).store(1, Ordering::Relaxed);
            }
        }
        fence(Ordering::SeqCst);
        let res = self.flush_all(me);
        let ready = res.is_err()
            || (rings
                && (self.rings_ready()
                    || self.board.ready(&self.peers)
                    || self.check_liveness(true)));
        if !ready {
            loop {
                let left =
                    deadline.map_or(WAIT_SLICE, |d| d.saturating_duration_since(Instant::now()));
                if left.is_zero() {
                    break;
                }
                if futex_wait(self.own.a32(H_EVENTS), ec, left.min(WAIT_SLICE)) == Woke::Event
                    || self.check_liveness(true)
                {
                    break;
                }
            }
        }
        self.own.a32(H_SLEEPING).store(0, Ordering::Relaxed);
        res
    }

    /// Delivers every record of the ring of the peer at `pos`.
    pub(super) fn drain(
        &mut self,
        me: Me,
        regions: &LocalTable,
        pos: usize,
        out: &mut Vec<Completion>,
    ) -> Result<()> {
        let own = &self.own;
        let Some(p) = self.peers[pos].as_mut() else {
            return Ok(());
        };
        p.drain(me, own, regions, out)
    }

    /// Posts on this rank's board ([`BoardState::post`]).
    pub(super) fn board_post(&mut self, me: Me, seq: u64, data: &[u8]) -> Result<bool> {
        self.board.post(me, &self.own, &self.peers, seq, data)
    }

    /// Reads the posting of the peer at `pos` ([`BoardState::read`]).
    pub(super) fn board_read(
        &mut self,
        me: Me,
        pos: usize,
        seq: u64,
        out: &mut Vec<u8>,
    ) -> Result<bool> {
        self.board.read(me, &mut self.peers, pos, seq, out)
    }

    /// Releases postings up to `seq` ([`BoardState::release`]).
    pub(super) fn board_release(&mut self, seq: u64) {
        self.board.release(&self.own, seq);
    }

    /// Marks this rank closed and wakes every peer.
    pub(super) fn shutdown(&self) {
        self.own.a32(H_CLOSED).store(1, Ordering::SeqCst);
        for p in self.peers.iter().flatten() {
            p.seg.wake();
        }
    }
}
