//! The posting path of the RDMA endpoint: a write straight from registered memory or through
//! the staging ring, a send through the staging ring, and the per-peer queue of posts that wait
//! for room.

use super::device::errno_str;
use super::endpoint::{Pending, RdmaEndpoint, Wr};
use super::ffi;
use super::setup::{MAX_SGE, SEND_DEPTH, setup_err};
use crate::error::Result;
use crate::verbs::{Completion, Sge};
use crate::wire::RemoteRegion;

impl RdmaEndpoint {
    /// Posts as much of every peer's pending queue as there is room for.
    pub(super) fn flush_pending(&mut self) {
        for peer in 0..self.peers.len() {
            while let Some(item) = self.peers[peer].pending.pop_front() {
                if self.peers[peer].broken.is_some() {
                    // The operation that queued it has failed; its buffers may be gone.
                    self.peers[peer].pending.clear();
                    break;
                }
                match self.try_post(peer, &item) {
                    Ok(true) => {}
                    Ok(false) => {
                        self.peers[peer].pending.push_front(item);
                        break;
                    }
                    Err(e) => {
                        self.peers[peer].broken = Some(e.to_string());
                        self.peers[peer].pending.clear();
                        self.errors.push_back(e);
                        break;
                    }
                }
            }
        }
    }

    /// A queue pair of `peer` with room, round-robin.
    pub(super) fn pick_qp(&mut self, peer: usize) -> Option<usize> {
        let p = &mut self.peers[peer];
        let n = p.qps.len();
        let i = (0..n)
            .map(|k| (p.next + k) % n)
            .find(|&i| p.qps[i].outstanding < SEND_DEPTH)?;
        p.next = (i + 1) % n;
        Some(i)
    }

    /// Posts a queued `item` now; `false` when there is no room.
    pub(super) fn try_post(&mut self, peer: usize, item: &Pending) -> Result<bool> {
        match item {
            Pending::Write {
                sges,
                remote,
                offset,
                imm,
                wr_id,
            } => self.try_write(peer, sges, *remote, *offset, *imm, *wr_id),
            Pending::Send { data, wr_id, ctrl } => self.try_send(peer, data, *wr_id, *ctrl),
        }
    }

    /// Posts a write now, straight from registered memory or through the staging ring;
    /// `false` when there is no room (queue pair or staging).
    pub(super) fn try_write(
        &mut self,
        peer: usize,
        sges: &[Sge],
        remote: RemoteRegion,
        offset: u64,
        imm: Option<u32>,
        wr_id: u64,
    ) -> Result<bool> {
        let Some(qi) = self.pick_qp(peer) else {
            return Ok(false);
        };
        // A peer whose region is registered by areas gave the key of its area for this rank.
        let remote = match self.peers[peer].remote_area {
            Some((key, area_key)) if key == remote.rkey => RemoteRegion {
                rkey: area_key,
                ..remote
            },
            _ => remote,
        };
        let total: usize = sges.iter().map(|s| s.len).sum();
        let mut addrs = [0u64; MAX_SGE as usize];
        let mut lens = [0u32; MAX_SGE as usize];
        let mut keys = [0u32; MAX_SGE as usize];
        // Straight from registered memory when every span has an adapter key, found once.
        let direct = sges.len() <= MAX_SGE as usize
            && sges.iter().enumerate().all(|(i, s)| {
                self.local_key(s).is_some_and(|key| {
                    (addrs[i], lens[i], keys[i]) = (s.addr as u64, s.len as u32, key);
                    true
                })
            });
        let (n, staged) = if direct {
            (sges.len(), None)
        } else {
            let Some((seq, off)) = self.staging.alloc(total) else {
                return Ok(false);
            };
            let mut at = off;
            for s in sges {
                // SAFETY: the caller keeps every span valid until WriteDone, which is reported
                // only after this copy; the staging span is ours until the adapter completes
                // the write.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.addr as *const u8,
                        self.staging.buf.ptr.add(at),
                        s.len,
                    );
                }
                at += s.len;
            }
            addrs[0] = self.staging.buf.ptr as u64 + off as u64;
            lens[0] = total as u32;
            keys[0] = self.staging.lkey;
            (1, Some(seq))
        };
        let id = self.next_wr;
        // SAFETY: every span is registered (an adapter registration or the staging ring) and
        // stays valid until the completion of work request `id`.
        let rc = unsafe {
            ffi::gs_post_write(
                self.peers[peer].qps[qi].raw,
                id,
                addrs.as_ptr(),
                lens.as_ptr(),
                keys.as_ptr(),
                if total == 0 { 0 } else { n as u32 },
                remote.addr.wrapping_add(offset),
                remote.rkey,
                u32::from(imm.is_some()),
                imm.unwrap_or(0),
            )
        };
        if rc != 0 {
            if let Some(seq) = staged {
                self.staging.free(seq);
            }
            return Err(setup_err(
                self.rank,
                peer,
                "post_write",
                format!(
                    "ibv_post_send (RDMA WRITE of {total} bytes): {}",
                    errno_str(rc)
                ),
            ));
        }
        self.posted(
            id,
            Wr {
                peer,
                qp: qi,
                staged,
                user: direct.then_some(wr_id),
                write: true,
                rkey: remote.rkey,
                offset,
                len: total as u64,
                region_len: remote.len,
            },
        );
        if !direct {
            self.ready.push_back(Completion::WriteDone { wr_id });
        }
        Ok(true)
    }

    /// Posts a send (with `ctrl`, an internal message carrying it as immediate) through the
    /// staging ring; `false` when there is no room.
    pub(super) fn try_send(
        &mut self,
        peer: usize,
        data: &[u8],
        wr_id: u64,
        ctrl: Option<u32>,
    ) -> Result<bool> {
        let Some(qi) = self.pick_qp(peer) else {
            return Ok(false);
        };
        let Some((seq, off)) = self.staging.alloc(data.len()) else {
            return Ok(false);
        };
        // SAFETY: the staging span is ours until the send completes.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.staging.buf.ptr.add(off), data.len());
        }
        let id = self.next_wr;
        // SAFETY: the span lies in the registered staging ring.
        let rc = unsafe {
            ffi::gs_post_send(
                self.peers[peer].qps[qi].raw,
                id,
                self.staging.buf.ptr as u64 + off as u64,
                data.len() as u32,
                self.staging.lkey,
                u32::from(ctrl.is_some()),
                ctrl.unwrap_or(0),
            )
        };
        if rc != 0 {
            self.staging.free(seq);
            return Err(setup_err(
                self.rank,
                peer,
                "post_send",
                format!(
                    "ibv_post_send (SEND of {} bytes): {}",
                    data.len(),
                    errno_str(rc)
                ),
            ));
        }
        self.posted(
            id,
            Wr {
                peer,
                qp: qi,
                staged: Some(seq),
                user: None,
                write: false,
                rkey: 0,
                offset: 0,
                len: data.len() as u64,
                region_len: 0,
            },
        );
        if ctrl.is_none() {
            self.ready.push_back(Completion::SendDone { wr_id });
        }
        Ok(true)
    }

    /// Books work request `id`, just posted.
    pub(super) fn posted(&mut self, id: u64, w: Wr) {
        self.next_wr += 1;
        self.peers[w.peer].qps[w.qp].outstanding += 1;
        self.wrs.insert(id, w);
    }

    /// A send now, or queued (copied) behind what waits for room.
    pub(super) fn send_or_queue(
        &mut self,
        peer: usize,
        data: &[u8],
        wr_id: u64,
        ctrl: Option<u32>,
    ) -> Result<()> {
        if self.peers[peer].pending.is_empty() && self.try_send(peer, data, wr_id, ctrl)? {
            return Ok(());
        }
        self.peers[peer].pending.push_back(Pending::Send {
            data: data.to_vec(),
            wr_id,
            ctrl,
        });
        Ok(())
    }
}
