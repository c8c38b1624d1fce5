//! The queue pairs of one pair of ranks: made (INIT, receive buffers registered and posted),
//! moved to RTS against the peer's column, or destroyed. Setup does this for every peer at
//! once; connections on first use (`lazy`) for one peer when it is first needed.

use super::device::{Buffer, errno_str, memlock_msg, mtu_bytes, post_recv};
use super::endpoint::{Pinned, Qp, RdmaEndpoint, RecvBuf};
use super::ffi;
use super::setup::{MAX_SGE, RECV_DEPTH, SEND_DEPTH, cq_entries, setup_err};
use super::wire::ConnInfoRepr;
use crate::error::Result;
use crate::verbs::MAX_SEND;

impl RdmaEndpoint {
    /// Queue pairs per peer.
    pub(super) fn qps_per_peer(&self) -> usize {
        self.opts.qps_per_peer.max(1)
    }

    /// Makes the queue pairs to `p` (in INIT, with their receive buffers registered and
    /// posted) and returns their `(qpn, psn)`.
    pub(super) fn open_peer(&mut self, p: usize) -> Result<Vec<(u32, u32)>> {
        let (rank, q) = (self.rank, self.qps_per_peer());
        self.grow_cq(p)?;
        let buf = Buffer::new(q * RECV_DEPTH * MAX_SEND)
            .map_err(|m| setup_err(rank, p, "register", m))?;
        let (mut lkey, mut rkey, mut e) = (0u32, 0u32, 0);
        // SAFETY: a live mapping, deregistered before it is unmapped (`drop_peer_qps`).
        let mr = unsafe {
            ffi::gs_reg(
                self.dev.raw,
                buf.ptr.cast(),
                buf.len,
                1,
                &mut lkey,
                &mut rkey,
                &mut e,
            )
        };
        if mr.is_null() {
            return Err(setup_err(rank, p, "register", memlock_msg(buf.len, e)));
        }
        self.peers[p].recv = Some(RecvBuf { buf, mr, lkey });
        self.open_area(p)?;
        for i in 0..q {
            let mut qpn = 0u32;
            // SAFETY: the device is open; the queue pair is destroyed in `drop_peer_qps`.
            let raw = unsafe {
                ffi::gs_qp_create(
                    self.dev.raw,
                    SEND_DEPTH,
                    RECV_DEPTH as u32,
                    MAX_SGE,
                    0,
                    &mut qpn,
                    &mut e,
                )
            };
            if raw.is_null() {
                return Err(setup_err(
                    rank,
                    p,
                    "create queue pair",
                    format!(
                        "ibv_create_qp (RC, {SEND_DEPTH} sends, {RECV_DEPTH} receives, {MAX_SGE} gather entries): {}",
                        errno_str(e)
                    ),
                ));
            }
            let psn =
                ((self.seed >> ((p * q + i) % 40)) as u32 ^ (p as u32) << 8 ^ i as u32) & 0xff_ffff;
            self.peers[p].qps.push(Qp {
                raw,
                outstanding: 0,
            });
            self.peers[p].local.push((qpn, psn));
            self.by_qpn.insert(qpn, (p, i));
            // SAFETY: `raw` was just created.
            let rc = unsafe { ffi::gs_qp_init(raw, self.port_num) };
            if rc != 0 {
                return Err(setup_err(
                    rank,
                    p,
                    "queue pair RESET->INIT",
                    format!(
                        "queue pair {i} (qpn {qpn}): {}; attributes: pkey_index=0 port_num={} qp_access_flags=REMOTE_WRITE|LOCAL_WRITE",
                        errno_str(rc),
                        self.port_num
                    ),
                ));
            }
            let (base, lkey) = self.peers[p]
                .recv
                .as_ref()
                .map(|rb| (rb.buf.ptr, rb.lkey))
                .expect("registered above");
            for k in 0..RECV_DEPTH {
                post_recv(raw, i * RECV_DEPTH + k, base, lkey)
                    .map_err(|m| setup_err(rank, p, "post receive", m))?;
            }
        }
        Ok(self.peers[p].local.clone())
    }

    /// Grows the completion queue, if it must, to hold the completions of the queue pairs of
    /// every pair that has them and of `p`'s: to twice its size at least, within the device's
    /// limit.
    fn grow_cq(&mut self, p: usize) -> Result<()> {
        let q = self.qps_per_peer();
        let peers = 1 + self.peers.iter().filter(|x| !x.qps.is_empty()).count();
        let need = cq_entries(peers, q);
        if need <= self.cq_size {
            return Ok(());
        }
        let want = need
            .max(self.cq_size.saturating_mul(2))
            .min(self.max_cqe.max(need));
        if self.max_cqe > 0 && need > self.max_cqe {
            return Err(setup_err(
                self.rank,
                p,
                "completion queue",
                format!(
                    "the queue pairs to {peers} peers need {need} completion entries ({q} queue pairs a peer, {SEND_DEPTH} sends and {RECV_DEPTH} receives each); the device allows {} (fewer peers per rank, or GRADSYNC_IB_QPS_PER_CONN=1)",
                    self.max_cqe
                ),
            ));
        }
        // SAFETY: the device is open; completions in the queue are kept.
        let rc = unsafe { ffi::gs_resize_cq(self.dev.raw, want as i32) };
        if rc != 0 {
            return Err(setup_err(
                self.rank,
                p,
                "completion queue",
                format!(
                    "ibv_resize_cq from {} to {want} entries: {}",
                    self.cq_size,
                    errno_str(rc)
                ),
            ));
        }
        // SAFETY: as above.
        self.cq_size = unsafe { ffi::gs_cq_size(self.dev.raw) }.max(0) as usize;
        Ok(())
    }

    /// Checks a peer's descriptor or column against this rank's: world, queue pairs per peer
    /// and link layer.
    pub(super) fn check_remote(&self, p: usize, i: &ConnInfoRepr) -> Result<()> {
        let (rank, world, q) = (self.rank, self.world, self.qps_per_peer());
        if i.world as usize != world || i.qps as usize != q {
            return Err(setup_err(
                rank,
                p,
                "connect",
                format!(
                    "the peer has {} queue pairs per peer in a world of {}, this rank {q} in a world of {world} (GRADSYNC_IB_QPS_PER_CONN must match)",
                    i.qps, i.world
                ),
            ));
        }
        if i.global != self.local.global {
            return Err(setup_err(
                rank,
                p,
                "connect",
                "one side is RoCE (Ethernet), the other InfiniBand".into(),
            ));
        }
        if i.qp.len() != q && i.qp.len() != world * q {
            return Err(setup_err(
                rank,
                p,
                "connect",
                format!(
                    "the descriptor has {} queue pair entries, neither {q} (a column) nor {} (a whole descriptor)",
                    i.qp.len(),
                    world * q
                ),
            ));
        }
        Ok(())
    }

    /// Moves the queue pairs to `p` (made by [`open_peer`](Self::open_peer)) to RTR and RTS
    /// against `col`, the peer's column for this rank (its `qps` entries to this rank), which
    /// [`check_remote`](Self::check_remote) accepted.
    pub(super) fn join_peer(&mut self, p: usize, col: &ConnInfoRepr) -> Result<()> {
        let rank = self.rank;
        let port = self.port_num;
        let mtu = self.local.mtu.min(col.mtu);
        if !(1..=5).contains(&mtu) {
            return Err(setup_err(
                rank,
                p,
                "queue pair INIT->RTR",
                format!(
                    "path_mtu: rank {p} advertises MTU code {}, this port {}; valid codes are 1-5 (256-4096 bytes)",
                    col.mtu, self.local.mtu
                ),
            ));
        }
        for (i, qp) in self.peers[p].qps.iter().enumerate() {
            let (dqpn, rpsn) = col.qp[i];
            let (_, spsn) = self.peers[p].local[i];
            let gid = std::net::Ipv6Addr::from(col.gid);
            let attrs = format!(
                "path_mtu={} dest_qp_num={dqpn} rq_psn={rpsn} ah_attr.is_global={} ah_attr.grh.dgid={gid} ah_attr.grh.sgid_index={} ah_attr.dlid={} port_num={port}",
                mtu_bytes(mtu),
                u8::from(self.local.global),
                self.gid_index,
                col.lid
            );
            if dqpn == 0 {
                return Err(setup_err(
                    rank,
                    p,
                    "queue pair INIT->RTR",
                    format!("dest_qp_num is 0 ({attrs})"),
                ));
            }
            // SAFETY: `qp` is in INIT; `col.gid` holds 16 bytes.
            let rc = unsafe {
                ffi::gs_qp_rtr(
                    qp.raw,
                    port,
                    mtu,
                    dqpn,
                    rpsn,
                    u32::from(self.local.global),
                    col.gid.as_ptr(),
                    self.gid_index,
                    col.lid,
                )
            };
            if rc != 0 {
                return Err(setup_err(
                    rank,
                    p,
                    "queue pair INIT->RTR",
                    format!("queue pair {i}: {}; attributes: {attrs}", errno_str(rc)),
                ));
            }
            // SAFETY: `qp` is in RTR.
            let rc = unsafe {
                ffi::gs_qp_rts(
                    qp.raw,
                    spsn,
                    u32::from(self.opts.ib_timeout),
                    u32::from(self.opts.retry_cnt.min(7)),
                    7,
                )
            };
            if rc != 0 {
                return Err(setup_err(
                    rank,
                    p,
                    "queue pair RTR->RTS",
                    format!(
                        "queue pair {i}: {}; attributes: sq_psn={spsn} timeout={} retry_cnt={} rnr_retry=7 max_rd_atomic=1",
                        errno_str(rc),
                        self.opts.ib_timeout,
                        self.opts.retry_cnt
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Registers `p`'s area of the region registered by areas, if there is one.
    fn open_area(&mut self, p: usize) -> Result<()> {
        let Some(ar) = self
            .areas
            .as_ref()
            .filter(|ar| !ar.unused.get(p).is_some_and(|&u| u))
        else {
            return Ok(());
        };
        let (addr, len) = (ar.addr + p * ar.area, ar.area);
        let (mut lkey, mut rkey, mut e) = (0u32, 0u32, 0);
        // SAFETY: the area lies inside the region its registrant keeps valid until it
        // deregisters it, which deregisters every area first.
        let mr = unsafe {
            ffi::gs_reg(
                self.dev.raw,
                addr as *mut std::ffi::c_void,
                len,
                3,
                &mut lkey,
                &mut rkey,
                &mut e,
            )
        };
        if mr.is_null() {
            return Err(setup_err(self.rank, p, "register", memlock_msg(len, e)));
        }
        self.pinned_bytes += len;
        self.peers[p].area = Some(Pinned {
            mr,
            addr,
            len,
            lkey,
            rkey,
            access: crate::verbs::Access::REMOTE_WRITE.union(crate::verbs::Access::LOCAL_READ),
            refs: 1,
        });
        Ok(())
    }

    /// The keys a peer's writes into `p`'s area need: the region's key and the area's, or
    /// zeros when no region is registered by areas.
    pub(super) fn area_keys(&self, p: usize) -> (u32, u32) {
        match (&self.areas, &self.peers[p].area) {
            (Some(ar), Some(a)) => (ar.key, a.rkey),
            _ => (0, 0),
        }
    }

    /// Deregisters `p`'s area, if it is registered.
    pub(super) fn drop_area(&mut self, p: usize) {
        if let Some(a) = self.peers[p].area.take() {
            self.pinned_bytes -= a.len;
            // SAFETY: registered in `open_area`, deregistered once (taken).
            unsafe { ffi::gs_dereg(a.mr) };
        }
    }

    /// Destroys the queue pairs to `p` and deregisters their receive buffers (the pair is then
    /// as if never made).
    pub(super) fn drop_peer_qps(&mut self, p: usize) {
        let peer = &mut self.peers[p];
        for q in peer.qps.drain(..) {
            // SAFETY: created by `gs_qp_create`, destroyed once (drained).
            unsafe { ffi::gs_qp_destroy(q.raw) };
        }
        for (qpn, _) in peer.local.drain(..) {
            self.by_qpn.remove(&qpn);
        }
        if let Some(rb) = peer.recv.take() {
            // SAFETY: registered in `open_peer`, deregistered once (taken), before `rb.buf`
            // unmaps at the end of this scope.
            unsafe { ffi::gs_dereg(rb.mr) };
        }
        peer.joined = false;
        peer.next = 0;
        peer.remote_area = None;
        self.drop_area(p);
    }
}
