//! When an operation cannot finish: lost peers, timeouts and their diagnosis.

use super::driver::Engine;
use crate::error::Error;
use gradsync_core::proto::VerdictWithin;
use std::time::{Duration, Instant};

/// How long a rank that lost a connection looks for an abort that explains it.
const ABORT_BEHIND_WAIT: Duration = Duration::from_millis(50);

impl Engine {
    /// A lost connection may be the consequence of an abort whose message is already here (the
    /// aborting rank's message arrived, then a third rank that read it closed): report the
    /// abort, the cause, rather than the connection.
    pub(super) fn abort_behind(&mut self, e: Error) -> Error {
        if !matches!(e, Error::Transport { .. } | Error::PeerLost { .. }) {
            return e;
        }
        self.await_abort(ABORT_BEHIND_WAIT).unwrap_or(e)
    }

    /// Polls for up to `wait` for an abort from a peer, answering the peers' probes meanwhile;
    /// completions a failing poll returned before its error are looked at too (a peer that aborted then closed: its message comes
    /// before the end of its stream).
    fn await_abort(&mut self, wait: Duration) -> Option<Error> {
        let end = Instant::now() + wait;
        let mut comps = Vec::new();
        loop {
            comps.clear();
            let polled = self.ep.poll(&mut comps);
            for c in comps.drain(..) {
                if let Err(a @ Error::PeerAborted { .. }) = self.feed(c) {
                    return Some(a);
                }
            }
            if polled.is_err() || Instant::now() >= end {
                return None;
            }
            // Answers to the peers' probes: this rank is alive and says where it is.
            self.send_controls_only();
            let _ = self.ep.wait(Duration::from_millis(5));
        }
    }

    pub(super) fn check_peers_alive(&self) -> Result<(), Error> {
        for p in self.proto.waiting_on() {
            if !self.ep.peer_alive(p) {
                let sig = *self.proto.running().expect("running");
                return Err(Error::PeerLost {
                    rank: self.rank,
                    peer: p,
                    sig,
                });
            }
        }
        Ok(())
    }

    /// Peers whose connection is down, after polling the transport for up to `wait`.
    pub(crate) fn dead_peers(&mut self, wait: Duration) -> Vec<usize> {
        let end = Instant::now() + wait;
        let mut sink = Vec::new();
        loop {
            sink.clear();
            // Errors here are about peers that are going away; what matters is who is gone.
            let _ = self.ep.poll(&mut sink);
            let dead: Vec<usize> = (0..self.world)
                .filter(|&p| p != self.rank && !self.ep.peer_alive(p))
                .collect();
            if !dead.is_empty() || Instant::now() >= end {
                return dead;
            }
            let _ = self.ep.wait(Duration::from_millis(10));
        }
    }

    /// On a timeout, asks every peer where it is and names the ranks that do not answer
    /// (stopped, hung, or not inside any collective) or that are behind. Every rank that times
    /// out asks everyone, so all of them name the same culprit.
    pub(super) fn diagnose_timeout(&mut self) -> Error {
        let window =
            (self.opts.timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
        // Only connected peers are asked: a probe opens no connection.
        let ep = &self.ep;
        self.proto
            .begin_probe(|p| ep.peer_alive(p) && ep.caps(p).connected);
        // The probes, and anything else queued (best effort from here on).
        self.send_controls_only();
        let end = Instant::now() + window;
        let mut comps = Vec::new();
        while Instant::now() < end
            && !self
                .proto
                .probe_settled(|p| self.ep.peer_alive(p) && self.ep.caps(p).connected)
        {
            comps.clear();
            if self.ep.poll(&mut comps).is_err() {
                break;
            }
            for c in comps.drain(..) {
                if let Err(e @ Error::PeerAborted { .. }) = self.feed(c) {
                    // Another rank finished its diagnosis first: its verdict is the job's.
                    return e;
                }
            }
            // Answers to the peers' own probes.
            self.send_controls_only();
            let _ = self.ep.wait(Duration::from_millis(10));
        }
        let mut verdict = self.proto.verdict(|p| self.ep.peer_alive(p));
        let (unreached, silent) = verdict
            .silent
            .iter()
            .partition(|&&p| !self.ep.caps(p).connected);
        (verdict.unreached, verdict.silent) = (unreached, silent);
        // Every rank this rank could ask answered (some may be behind, waiting themselves),
        // and there are ranks it cannot ask: the culprit may be among those. A rank connected
        // to it finds it silent or lost, and its abort travels from rank to rank (each passes
        // it on once): wait for that before giving the job a verdict that names no silent or
        // lost rank.
        if verdict.silent.is_empty()
            && verdict.lost.is_empty()
            && !verdict.unreached.is_empty()
            && let Some(a) = self.await_abort(2 * window)
        {
            return a;
        }
        let mut e = self.timeout_error();
        if let Error::Timeout { verdict: v, .. } = &mut e {
            *v = VerdictWithin {
                verdict: &verdict,
                window,
            }
            .to_string();
        }
        e
    }

    fn timeout_error(&self) -> Error {
        let sig = *self.proto.running().expect("running");
        let now = Instant::now();
        let waits = self
            .proto
            .waiting_on()
            .into_iter()
            .map(|p| {
                let heard = match self.proto.last_heard(p) {
                    Some((t, seq)) => format!(
                        "last heard {:.1} s ago (seq {seq})",
                        (now - t).as_secs_f64()
                    ),
                    None => "never heard from".to_string(),
                };
                format!("rank {p} ({heard})")
            })
            .collect::<Vec<_>>();
        Error::Timeout {
            rank: self.rank,
            sig,
            timeout: self.opts.timeout,
            waiting: waits.join(", "),
            verdict: String::new(),
        }
    }
}
