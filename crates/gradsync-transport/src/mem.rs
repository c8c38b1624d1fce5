//! In-process reference backend: ranks are threads of one process.
//!
//! A write copies the gather list straight into the target rank's registered region under the
//! target's lock and queues the completion there, so it exercises exactly the key and bounds
//! checks and the completion flow of a real backend. It exists for tests and the conformance
//! suite.

use crate::caps::{Board, PeerCaps, Route, SharedMemory};
use crate::error::{Result, TransportError};
use crate::regions::RegionTable;
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion, Sge, check_send_len};
use crate::wire::RemoteRegion;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

#[derive(Debug)]
struct RankState {
    regions: RegionTable,
    cq: VecDeque<Completion>,
    closed: bool,
}

#[derive(Debug)]
struct Slot {
    state: Mutex<RankState>,
    cv: Condvar,
}

/// One rank of an in-memory fabric.
#[derive(Debug)]
pub struct MemEndpoint {
    rank: usize,
    slots: Arc<Vec<Slot>>,
}

/// Creates `world` connected endpoints.
pub fn fabric(world: usize) -> Vec<MemEndpoint> {
    let slots: Arc<Vec<Slot>> = Arc::new(
        (0..world)
            .map(|r| Slot {
                state: Mutex::new(RankState {
                    regions: RegionTable::new(r),
                    cq: VecDeque::new(),
                    closed: false,
                }),
                cv: Condvar::new(),
            })
            .collect(),
    );
    (0..world)
        .map(|rank| MemEndpoint {
            rank,
            slots: slots.clone(),
        })
        .collect()
}

impl MemEndpoint {
    fn lock(&self, r: usize) -> std::sync::MutexGuard<'_, RankState> {
        self.slots[r]
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn check_peer(&self, peer: usize, op: &'static str) -> Result<()> {
        if peer >= self.slots.len() || peer == self.rank {
            return Err(TransportError::Invalid {
                rank: self.rank,
                op,
                msg: format!(
                    "peer {peer} is not another rank of a world of {}",
                    self.slots.len()
                ),
            });
        }
        if self.lock(peer).closed {
            return Err(TransportError::PeerClosed {
                rank: self.rank,
                peer,
                during: op.to_string(),
            });
        }
        Ok(())
    }

    fn push(&self, r: usize, c: Completion) {
        self.lock(r).cq.push_back(c);
        self.slots[r].cv.notify_all();
    }
}

impl Drop for MemEndpoint {
    fn drop(&mut self) {
        self.lock(self.rank).closed = true;
    }
}

impl Endpoint for MemEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.slots.len()
    }

    fn name(&self) -> &'static str {
        "mem"
    }

    fn caps(&self, peer: usize) -> PeerCaps {
        PeerCaps::plain(if peer == self.rank {
            Route::Own
        } else {
            Route::Mem
        })
    }

    fn board(&mut self) -> Option<&mut dyn Board> {
        None
    }

    fn shared_memory(&mut self) -> Option<&mut dyn SharedMemory> {
        None
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        Ok(self
            .lock(self.rank)
            .regions
            .register(addr as usize, len, access))
    }

    fn deregister(&mut self, mr: &MemoryRegion) {
        self.lock(self.rank).regions.deregister(mr);
    }

    unsafe fn post_write(
        &mut self,
        peer: usize,
        sges: &[Sge],
        remote: RemoteRegion,
        offset: u64,
        imm: Option<u32>,
        wr_id: u64,
    ) -> Result<()> {
        self.check_peer(peer, "post_write")?;
        self.lock(self.rank).regions.check_local(sges)?;
        let total: usize = sges.iter().map(|s| s.len).sum();
        {
            let mut st = self.lock(peer);
            let dst =
                st.regions
                    .check_remote_write(self.rank, remote.rkey, offset, total as u64)?;
            let mut at = dst;
            for s in sges {
                // SAFETY: the source span lies in a region registered by this rank (checked
                // above) whose memory the caller keeps valid until the completion; the
                // destination was bounds-checked against the peer's registered region, which
                // its owner keeps valid and does not touch until it sees the completion queued
                // below (both happen under the peer's lock).
                unsafe { std::ptr::copy_nonoverlapping(s.addr as *const u8, at as *mut u8, s.len) };
                at += s.len;
            }
            if let Some(imm) = imm {
                st.cq.push_back(Completion::WriteImm {
                    peer: self.rank,
                    imm,
                    len: total as u32,
                });
            }
        }
        self.slots[peer].cv.notify_all();
        self.push(self.rank, Completion::WriteDone { wr_id });
        Ok(())
    }

    fn post_send(&mut self, peer: usize, data: &[u8], wr_id: u64) -> Result<()> {
        self.check_peer(peer, "post_send")?;
        check_send_len(self.rank, data.len())?;
        self.push(
            peer,
            Completion::Recv {
                peer: self.rank,
                data: data.to_vec(),
            },
        );
        self.push(self.rank, Completion::SendDone { wr_id });
        Ok(())
    }

    fn connect(&mut self, _peers: &[usize], _timeout: Duration) -> Result<()> {
        // Every peer is connected at setup.
        Ok(())
    }

    fn peer_alive(&self, peer: usize) -> bool {
        if peer >= self.slots.len() {
            return false;
        }
        if !self.lock(peer).closed {
            return true;
        }
        // As a stream's end is seen only after its data: a closed peer is gone once what it
        // delivered has been polled.
        self.lock(self.rank).cq.iter().any(|c| {
            matches!(c, Completion::WriteImm { peer: p, .. } | Completion::Recv { peer: p, .. } if *p == peer)
        })
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        out.extend(self.lock(self.rank).cq.drain(..));
        Ok(())
    }

    /// Writes and sends land in the peer's memory at the post: nothing waits to be handed on.
    fn tx_pending(&self) -> bool {
        false
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let st = self.lock(self.rank);
        if st.cq.is_empty() {
            let _ = self.slots[self.rank].cv.wait_timeout(st, timeout);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_peer_stays_alive_until_what_it_sent_is_polled() {
        let mut eps = fabric(2);
        let b = eps.pop().unwrap();
        let mut a = eps.pop().unwrap();
        a.post_send(1, b"last words", 7).unwrap();
        drop(a);
        let mut b = b;
        assert!(b.peer_alive(0), "its message is still unread");
        let mut out = Vec::new();
        b.poll(&mut out).unwrap();
        assert!(matches!(&out[..], [Completion::Recv { peer: 0, data }] if data == b"last words"));
        assert!(!b.peer_alive(0), "gone once everything it sent was read");
    }
}
