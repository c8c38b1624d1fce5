//! The completion queue of the RDMA endpoint: what each work completion means (a receive,
//! a peer's write with immediate, a finished write or send, a goodbye), and the error a failed
//! one names.

use super::device::{RECV_TAG, post_recv};
use super::endpoint::{RdmaEndpoint, Wr};
use super::ffi;
use super::setup::{CTRL_BYE, setup_err};
use crate::error::TransportError;
use crate::verbs::{Completion, MAX_SEND};
use std::ffi::CStr;

pub(super) const WC_SEND: u32 = 0;
pub(super) const WC_RDMA_WRITE: u32 = 1;
pub(super) const WC_RECV: u32 = 128;
pub(super) const WC_RECV_RDMA_WITH_IMM: u32 = 129;

const WC_SUCCESS: u32 = 0;
const WC_LOC_PROT_ERR: u32 = 4;
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_REM_INV_REQ_ERR: u32 = 9;
const WC_REM_ACCESS_ERR: u32 = 10;
const WC_REM_OP_ERR: u32 = 11;
const WC_RETRY_EXC_ERR: u32 = 12;
const WC_RNR_RETRY_EXC_ERR: u32 = 13;

impl RdmaEndpoint {
    /// The error a failed work completion means.
    pub(super) fn wc_error(&self, wc: &ffi::GsWc, w: Option<Wr>, peer: usize) -> TransportError {
        // SAFETY: returns a static string for any status value.
        let status = unsafe { CStr::from_ptr(ffi::gs_wc_status_str(wc.status)) }
            .to_string_lossy()
            .into_owned();
        let what = match w {
            Some(w) if w.write => format!(
                "RDMA WRITE of {} bytes at offset {} into region 0x{:08x}",
                w.len, w.offset, w.rkey
            ),
            Some(w) => format!("SEND of {} bytes", w.len),
            None => "receive".to_string(),
        };
        let hint = match wc.status {
            WC_REM_ACCESS_ERR => {
                if let Some(w) = w.filter(|w| w.write) {
                    return TransportError::RemoteAccess {
                        rank: self.rank,
                        peer,
                        rkey: w.rkey,
                        offset: w.offset,
                        len: w.len,
                        region_len: w.region_len,
                        why: "the peer's adapter refused the remote key or the bounds (remote access error: the key is unknown, deregistered, lacks remote write, or the span is past the region's end)",
                    };
                }
                "remote access error: a key or bounds mismatch"
            }
            WC_RETRY_EXC_ERR => {
                "transport retries exceeded: the peer or the link is unreachable (peer process gone, port down, or wrong GID/LID/MTU)"
            }
            WC_RNR_RETRY_EXC_ERR => {
                "receiver-not-ready retries exceeded: the peer stopped posting receives"
            }
            WC_REM_INV_REQ_ERR => {
                "the peer's adapter found the request invalid (length past its receive buffer, or an operation its queue pair does not allow)"
            }
            WC_REM_OP_ERR => "the peer's adapter could not complete the operation",
            WC_LOC_PROT_ERR => {
                "local protection error: a gather entry is outside the registration its key names"
            }
            WC_WR_FLUSH_ERR => {
                "work request flushed: the queue pair is in the error state after an earlier failure"
            }
            _ => "work request failed",
        };
        TransportError::Rdma {
            rank: self.rank,
            peer,
            what: "completion",
            msg: format!(
                "{what} on queue pair {}: {status} (status {}, vendor error 0x{:x}): {hint}",
                wc.qp_num, wc.status, wc.vendor_err
            ),
        }
    }

    pub(super) fn handle(&mut self, wc: ffi::GsWc, out: &mut Vec<Completion>) {
        let Some(&(peer, qi)) = self.by_qpn.get(&wc.qp_num) else {
            return;
        };
        if wc.wr_id & RECV_TAG != 0 {
            let idx = (wc.wr_id & !RECV_TAG) as usize;
            if wc.status != WC_SUCCESS {
                if self.peers[peer].broken.is_none() {
                    let e = self.wc_error(&wc, None, peer);
                    let why = match &e {
                        TransportError::Rdma { msg, .. } => msg.clone(),
                        other => other.to_string(),
                    };
                    self.peers[peer].broken = Some(why);
                    self.peers[peer].pending.clear();
                    if wc.status != WC_WR_FLUSH_ERR || self.peers[peer].byes == 0 {
                        self.errors.push_back(TransportError::PeerClosed {
                            rank: self.rank,
                            peer,
                            during: format!("receiving: {e}"),
                        });
                    }
                }
                return;
            }
            let len = (wc.byte_len as usize).min(MAX_SEND);
            match wc.opcode {
                WC_RECV_RDMA_WITH_IMM => out.push(Completion::WriteImm {
                    peer,
                    imm: wc.imm,
                    len: wc.byte_len,
                }),
                WC_RECV if wc.with_imm != 0 && wc.imm == CTRL_BYE => {
                    self.peers[peer].byes += 1;
                }
                WC_RECV => {
                    if let Some(rb) = &self.peers[peer].recv {
                        // SAFETY: buffer slot `idx` of the peer's receive buffers holds the
                        // `len` bytes the adapter wrote.
                        let data = unsafe {
                            std::slice::from_raw_parts(rb.buf.ptr.add(idx * MAX_SEND), len)
                        }
                        .to_vec();
                        out.push(Completion::Recv { peer, data });
                    }
                }
                _ => {}
            }
            if self.peers[peer].broken.is_none()
                && let Some(rb) = &self.peers[peer].recv
            {
                let qp = self.peers[peer].qps[qi].raw;
                if let Err(m) = post_recv(qp, idx, rb.buf.ptr, rb.lkey) {
                    self.errors
                        .push_back(setup_err(self.rank, peer, "post receive", m));
                }
            }
            return;
        }
        let w = self.wrs.remove(&wc.wr_id);
        if let Some(w) = w {
            let q = &mut self.peers[w.peer].qps[w.qp];
            q.outstanding = q.outstanding.saturating_sub(1);
            if let Some(seq) = w.staged {
                self.staging.free(seq);
            }
        }
        if wc.status != WC_SUCCESS {
            let e = self.wc_error(&wc, w, peer);
            let first = self.peers[peer].broken.is_none();
            if first {
                self.peers[peer].broken = Some(e.to_string());
            }
            if first || wc.status != WC_WR_FLUSH_ERR {
                self.errors.push_back(e);
            }
            return;
        }
        if let Some(w) = w
            && let Some(user) = w.user
        {
            debug_assert!(matches!(wc.opcode, WC_RDMA_WRITE | WC_SEND));
            out.push(Completion::WriteDone { wr_id: user });
        }
    }

    pub(super) fn drain_cq(&mut self, out: &mut Vec<Completion>) {
        let stash = std::mem::take(&mut self.stash);
        for wc in stash {
            self.handle(wc, out);
        }
        let mut wcs = [ffi::GsWc::default(); 32];
        loop {
            // SAFETY: `wcs` has room for 32 completions.
            let n = unsafe { ffi::gs_poll(self.dev.raw, wcs.as_mut_ptr(), 32) };
            if n < 0 {
                self.errors.push_back(setup_err(
                    self.rank,
                    usize::MAX,
                    "completion queue",
                    format!("ibv_poll_cq failed ({n})"),
                ));
                break;
            }
            if n == 0 {
                break;
            }
            for wc in &wcs[..n as usize] {
                self.handle(*wc, out);
            }
            if n < 32 {
                break;
            }
        }
    }

    pub(super) fn has_outstanding(&self) -> bool {
        self.peers.iter().any(|p| {
            p.broken.is_none() && (!p.pending.is_empty() || p.qps.iter().any(|q| q.outstanding > 0))
        })
    }
}
