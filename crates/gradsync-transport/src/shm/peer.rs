//! This rank's view of one local peer ([`Peer`]): its process, its mapped segment, the
//! producer state of this rank's ring in it, and whether it is gone or broken.

use super::liveness::{LIVENESS_EVERY, pidfd_open, process_state, read_stat};
use super::segment::Segment;
use crate::error::{TransportError, Violation};
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::time::Instant;

/// This rank's view of one local peer.
#[derive(Debug)]
pub(super) struct Peer {
    pub(super) rank: usize,
    /// Position in the sorted list of local ranks.
    pub(super) pos: usize,
    pub(super) pid: u32,
    /// Start time of the peer's process (from `/proc/<pid>/stat`), to detect pid reuse.
    pub(super) starttime: Option<u64>,
    /// A pidfd of the peer's process (`None` where the kernel has no `pidfd_open`): it keeps
    /// naming that process after its pid is reused, so a cross-memory-attach write never goes
    /// to another process that got the pid.
    pub(super) pidfd: Option<OwnedFd>,
    /// The peer's segment.
    pub(super) seg: Segment,
    /// Offset, in the peer's segment, of the control block of this rank's ring.
    pub(super) ctl: usize,
    /// Producer position in the peer's ring for this rank (published or about to be).
    pub(super) tail: u64,
    /// Last consumer position read from the peer's ring.
    pub(super) head_cache: u64,
    /// Consumer position in this rank's ring for the peer.
    pub(super) rx_head: u64,
    /// Records waiting for space in the peer's ring, in order.
    pub(super) pending: VecDeque<Vec<u8>>,
    /// This rank's mappings of the peer's shared allocations, by allocation id.
    pub(super) maps: HashMap<u64, Segment>,
    /// Why the peer counts as gone.
    pub(super) down: Option<String>,
    /// The peer broke the ring protocol: its ring is no longer read.
    pub(super) broken: bool,
    /// Last `/proc` check, for `peer_alive` (which only has `&self`).
    pub(super) checked: Cell<Option<Instant>>,
    /// What that check found.
    pub(super) gone: Cell<Option<&'static str>>,
}

/// The rank and ring position of this endpoint.
#[derive(Clone, Copy, Debug)]
pub(super) struct Me {
    pub(super) rank: usize,
    pub(super) pos: usize,
}

impl Peer {
    /// This rank's view of `rank`, at position `pos` among the local ranks, whose process is
    /// `pid` and whose segment is `seg`; `ctl` is the offset of this rank's ring in it.
    pub(super) fn new(rank: usize, pos: usize, pid: u32, seg: Segment, ctl: usize) -> Peer {
        Peer {
            rank,
            pos,
            pid,
            starttime: read_stat(pid).ok().and_then(|(_, s)| s),
            pidfd: pidfd_open(pid),
            seg,
            ctl,
            tail: 0,
            head_cache: 0,
            rx_head: 0,
            pending: VecDeque::new(),
            maps: HashMap::new(),
            down: None,
            broken: false,
            checked: Cell::new(None),
            gone: Cell::new(None),
        }
    }

    /// Marks the peer gone (once), dropping what is queued for it and its mappings.
    pub(super) fn set_down(&mut self, why: String) {
        if self.down.is_none() {
            tracing::debug!(peer = self.rank, "shm peer gone: {why}");
            self.down = Some(why);
            self.pending.clear();
            self.maps.clear();
        }
    }

    /// Marks the peer broken for `violation` and returns the error that reports it.
    pub(super) fn protocol(&mut self, me: Me, violation: Violation) -> TransportError {
        self.broken = true;
        self.set_down(format!("protocol error: {violation}"));
        TransportError::Protocol {
            rank: me.rank,
            peer: self.rank,
            violation,
        }
    }

    /// Whether the peer counts as gone (updating `down` from its `closed` flag).
    pub(super) fn is_down(&mut self) -> bool {
        if self.down.is_none() && self.seg.closed() {
            self.set_down(format!(
                "rank {} closed its shared-memory endpoint",
                self.rank
            ));
        }
        self.down.is_some()
    }

    /// Full process check (`kill` and `/proc`), at most every [`LIVENESS_EVERY`].
    pub(super) fn process_gone(&self) -> Option<&'static str> {
        if let Some(g) = self.gone.get() {
            return Some(g);
        }
        let now = Instant::now();
        if self
            .checked
            .get()
            .is_some_and(|t| now.duration_since(t) < LIVENESS_EVERY)
        {
            return None;
        }
        self.checked.set(Some(now));
        let g = process_state(self.pid, self.starttime, true);
        self.gone.set(g);
        g
    }
}
