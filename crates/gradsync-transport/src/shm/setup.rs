//! Setting up shared memory: [`ShmSetup`] creates this rank's segment, then maps and checks
//! every local peer's, probes cross-memory attach into it and waits for the peers to do the
//! same.

use super::board::BoardState;
use super::cma::{cma_refused, cma_write};
use super::conn::Conn;
use super::endpoint::ShmEndpoint;
use super::layout::{
    ATTACH_FAILED, ATTACH_OK, C_ATTACH, C_PROBE, DIR_CAP, H_CLOSED, H_DIR_CAP, H_MAGIC, H_NLOCAL,
    H_NONCE, H_PID, H_RANK, H_RING_BYTES, H_SELF_ADDR, H_TOTAL_LEN, H_VERSION, H_WORLD, MAGIC,
    MAX_LOCAL, RING_BYTES, VERSION, board_off, ctl_off, segment_len,
};
use super::peer::Peer;
use super::segment::Segment;
use super::wire::ShmInfo;
use crate::error::{Result, TransportError, Violation};
use crate::verbs::Sge;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn random_nonce() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is valid for 8 bytes of writes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 8 {
        return u64::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let a = b.as_ptr() as usize as u64;
    (t ^ a.rotate_left(32) ^ u64::from(std::process::id())).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// First half of the shared-memory setup: this rank's segment, before peers are known.
#[derive(Debug)]
pub struct ShmSetup {
    rank: usize,
    world: usize,
    local: Vec<usize>,
    pos: usize,
    nonce: u64,
    /// Taken by a successful [`connect`](Self::connect); otherwise marked closed on drop so
    /// peers waiting in theirs give up at once.
    seg: Option<Segment>,
}

impl Drop for ShmSetup {
    fn drop(&mut self) {
        if let Some(seg) = &self.seg {
            seg.a32(H_CLOSED).store(1, Ordering::SeqCst);
        }
    }
}

impl ShmSetup {
    /// The endpoints of `local` ranks (of a world of `world`) all in this process, connected to
    /// each other: what tests and tools use in place of processes. Each endpoint may then be
    /// moved to a thread of its own.
    pub fn in_process(
        world: usize,
        local: &[usize],
        timeout: Duration,
    ) -> Result<Vec<ShmEndpoint>> {
        let (setups, infos): (Vec<_>, Vec<_>) = local
            .iter()
            .map(|&r| ShmSetup::new(r, world, local))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let infos = &infos;
        std::thread::scope(|s| {
            let hs: Vec<_> = setups
                .into_iter()
                .map(|st| s.spawn(move || st.connect(infos, timeout)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("connect does not panic"))
                .collect()
        })
    }

    /// Creates this rank's segment. `local` is the sorted list of all ranks on this host,
    /// including `rank`. Returns the setup and the [`ShmInfo`] to publish to the local peers.
    pub fn new(rank: usize, world: usize, local: &[usize]) -> Result<(ShmSetup, ShmInfo)> {
        let invalid = |msg: String| TransportError::Invalid {
            rank,
            op: "shm setup",
            msg,
        };
        if local.len() > MAX_LOCAL {
            return Err(invalid(format!(
                "{} local ranks exceed the limit of {MAX_LOCAL}",
                local.len()
            )));
        }
        if !local.windows(2).all(|w| w[0] < w[1]) {
            return Err(invalid(format!(
                "local ranks {local:?} are not sorted and distinct"
            )));
        }
        if world > u32::MAX as usize || local.last().is_some_and(|&r| r >= world) {
            return Err(invalid(format!(
                "local ranks {local:?} do not fit a world of {world}"
            )));
        }
        let pos = local.binary_search(&rank).map_err(|_| {
            invalid(format!(
                "rank {rank} is not among the local ranks {local:?}"
            ))
        })?;
        let len = segment_len(local.len());
        let seg = Segment::create(c"gradsync-shm", len).map_err(|source| TransportError::Io {
            rank,
            peer: usize::MAX,
            op: "create shared-memory segment",
            source,
        })?;
        let Some(fd) = seg.fd.as_ref().map(AsRawFd::as_raw_fd) else {
            return Err(invalid("segment without descriptor".into()));
        };
        let nonce = random_nonce();
        let pid = std::process::id();
        seg.a32(H_VERSION).store(VERSION, Ordering::Relaxed);
        seg.a32(H_PID).store(pid, Ordering::Relaxed);
        seg.a32(H_RANK).store(rank as u32, Ordering::Relaxed);
        seg.a32(H_WORLD).store(world as u32, Ordering::Relaxed);
        seg.a32(H_NLOCAL)
            .store(local.len() as u32, Ordering::Relaxed);
        seg.a32(H_DIR_CAP).store(DIR_CAP as u32, Ordering::Relaxed);
        seg.a32(H_RING_BYTES)
            .store(RING_BYTES as u32, Ordering::Relaxed);
        seg.a64(H_NONCE).store(nonce, Ordering::Relaxed);
        seg.a64(H_SELF_ADDR)
            .store(seg.base as usize as u64, Ordering::Relaxed);
        seg.a64(H_TOTAL_LEN).store(len as u64, Ordering::Relaxed);
        seg.a64(H_MAGIC).store(MAGIC, Ordering::Release);
        let info = ShmInfo {
            pid,
            fd,
            len: len as u64,
            nonce,
        };
        let setup = ShmSetup {
            rank,
            world,
            local: local.to_vec(),
            pos,
            nonce,
            seg: Some(seg),
        };
        Ok((setup, info))
    }

    /// Maps every local peer's segment (`infos[i]` is the info of `local[i]`; this rank's own
    /// entry is ignored), checks it (magic, version, nonce, the peer's rank and layout), probes
    /// cross-memory attach into each peer, and waits at most `timeout` for every peer to have
    /// done the same with this rank.
    ///
    /// Every local rank must call it at about the same time. If the kernel refuses
    /// `process_vm_writev` into a peer (`EPERM`, `ENOSYS`, ...), the error says that
    /// cross-memory attach is not permitted and why; the peers then fail too, so the caller can
    /// fall back to the network for all local pairs.
    pub fn connect(mut self, infos: &[ShmInfo], timeout: Duration) -> Result<ShmEndpoint> {
        let rank = self.rank;
        if infos.len() != self.local.len() {
            return Err(TransportError::Invalid {
                rank,
                op: "shm connect",
                msg: format!("{} infos for {} local ranks", infos.len(), self.local.len()),
            });
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut peers: Vec<Option<Peer>> = (0..self.local.len()).map(|_| None).collect();
        let res = self
            .attach(infos, &mut peers)
            .and_then(|()| self.await_peers(infos, &peers, deadline, timeout));
        if let Err(e) = res {
            for p in peers.iter().flatten() {
                p.seg
                    .a32(p.ctl + C_ATTACH)
                    .store(ATTACH_FAILED, Ordering::SeqCst);
                p.seg.wake();
            }
            return Err(e);
        }
        let Some(own) = self.seg.take() else {
            return Err(TransportError::Invalid {
                rank,
                op: "shm connect",
                msg: "setup without segment".into(),
            });
        };
        let nlocal = self.local.len();
        let conn = Conn {
            own,
            peers,
            board: BoardState::new(board_off(nlocal), nlocal),
        };
        let local = std::mem::take(&mut self.local);
        Ok(ShmEndpoint::new(
            rank, self.world, local, self.pos, conn, self.nonce,
        ))
    }

    /// Maps and checks every peer's segment and probes cross-memory attach into it; marks
    /// this rank attached in each peer's segment.
    fn attach(&self, infos: &[ShmInfo], peers: &mut [Option<Peer>]) -> Result<()> {
        for (i, info) in infos.iter().enumerate() {
            if i == self.pos {
                continue;
            }
            let seg = self.open_peer(i, info)?;
            let p = peers[i].insert(Peer::new(
                self.local[i],
                i,
                info.pid,
                seg,
                ctl_off(self.pos),
            ));
            self.probe(p)?;
        }
        for p in peers.iter().flatten() {
            p.seg
                .a32(p.ctl + C_ATTACH)
                .store(ATTACH_OK, Ordering::SeqCst);
            p.seg.wake();
        }
        Ok(())
    }

    /// Opens, checks and maps the segment of `local[i]`.
    fn open_peer(&self, i: usize, info: &ShmInfo) -> Result<Segment> {
        let (rank, peer) = (self.rank, self.local[i]);
        let proto = |violation| TransportError::Protocol {
            rank,
            peer,
            violation,
        };
        let expect = segment_len(self.local.len());
        if info.len != expect as u64 {
            return Err(proto(Violation::SegmentLength {
                len: info.len,
                nlocal: self.local.len(),
                expected: expect as u64,
            }));
        }
        if info.pid == 0 || libc::pid_t::try_from(info.pid).is_err() {
            return Err(proto(Violation::InvalidPid { pid: info.pid }));
        }
        let path = format!("/proc/{}/fd/{}", info.pid, info.fd);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| TransportError::Io {
                rank,
                peer,
                op: "open shared-memory segment",
                source: io::Error::new(e.kind(), format!("{path}: {e}")),
            })?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if size != expect as u64 {
            return Err(proto(Violation::SegmentSize {
                path,
                size,
                expected: expect as u64,
            }));
        }
        // SAFETY: plain system call on a descriptor owned by `file`.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(proto(Violation::NotSealed { path }));
        }
        let seg = Segment::map(file.as_raw_fd(), expect).map_err(|source| TransportError::Io {
            rank,
            peer,
            op: "map shared-memory segment",
            source,
        })?;
        let magic = seg.a64(H_MAGIC).load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(proto(Violation::SegmentMagic { path, found: magic }));
        }
        let u32_field = |off| seg.a32(off).load(Ordering::Relaxed) as u64;
        let checks: [(&str, u64, u64); 9] = [
            ("version", u32_field(H_VERSION), u64::from(VERSION)),
            ("pid", u32_field(H_PID), u64::from(info.pid)),
            (
                "nonce",
                seg.a64(H_NONCE).load(Ordering::Relaxed),
                info.nonce,
            ),
            ("rank", u32_field(H_RANK), peer as u64),
            ("world", u32_field(H_WORLD), self.world as u64),
            ("local ranks", u32_field(H_NLOCAL), self.local.len() as u64),
            ("directory capacity", u32_field(H_DIR_CAP), DIR_CAP as u64),
            ("ring size", u32_field(H_RING_BYTES), RING_BYTES as u64),
            (
                "length",
                seg.a64(H_TOTAL_LEN).load(Ordering::Relaxed),
                expect as u64,
            ),
        ];
        for (field, got, expected) in checks {
            if got != expected {
                return Err(proto(Violation::SegmentField {
                    path,
                    field,
                    got,
                    expected,
                }));
            }
        }
        Ok(seg)
    }

    /// Writes this rank's nonce into the peer's probe word with `process_vm_writev` and checks
    /// that it shows up in the mapped segment.
    fn probe(&self, p: &Peer) -> Result<()> {
        let (rank, peer) = (self.rank, p.rank);
        let base = p.seg.a64(H_SELF_ADDR).load(Ordering::Relaxed);
        let Some(target) = base.checked_add((p.ctl + C_PROBE) as u64) else {
            return Err(TransportError::Protocol {
                rank,
                peer,
                violation: Violation::SegmentAddress { addr: base },
            });
        };
        let value = self.nonce.to_ne_bytes();
        let sge = [Sge {
            addr: value.as_ptr() as usize,
            len: value.len(),
            lkey: 0,
        }];
        // SAFETY: the only span is `value`, readable for its length.
        unsafe { cma_write(p.pid, &sge, target, value.len()) }
            .map_err(|e| cma_refused(rank, peer, p.pid, e))?;
        let seen = p.seg.a64(p.ctl + C_PROBE).load(Ordering::Acquire);
        if seen != self.nonce {
            return Err(TransportError::Protocol {
                rank,
                peer,
                violation: Violation::ProbeLost { target, pid: p.pid },
            });
        }
        Ok(())
    }

    /// Waits until every peer has marked itself attached in this rank's segment.
    fn await_peers(
        &self,
        infos: &[ShmInfo],
        peers: &[Option<Peer>],
        deadline: Option<Instant>,
        timeout: Duration,
    ) -> Result<()> {
        let rank = self.rank;
        let Some(own) = self.seg.as_ref() else {
            return Ok(());
        };
        loop {
            let mut missing = Vec::new();
            for p in peers.iter().flatten() {
                let ctl = ctl_off(p.pos);
                match own.a32(ctl + C_ATTACH).load(Ordering::Acquire) {
                    ATTACH_OK => {
                        let seen = own.a64(ctl + C_PROBE).load(Ordering::Relaxed);
                        if seen != infos[p.pos].nonce {
                            return Err(TransportError::Protocol {
                                rank,
                                peer: p.rank,
                                violation: Violation::ProbeValue {
                                    seen,
                                    nonce: infos[p.pos].nonce,
                                },
                            });
                        }
                    }
                    ATTACH_FAILED => {
                        return Err(TransportError::Io {
                            rank,
                            peer: p.rank,
                            op: "shm connect",
                            source: io::Error::new(
                                io::ErrorKind::PermissionDenied,
                                format!(
                                    "rank {} could not attach to this rank's shared-memory \
                                     segment (cross-memory attach not permitted or mapping failed)",
                                    p.rank
                                ),
                            ),
                        });
                    }
                    _ if p.seg.closed() => {
                        return Err(TransportError::PeerClosed {
                            rank,
                            peer: p.rank,
                            during: "shm connect: the peer gave up on shared memory".into(),
                        });
                    }
                    _ if p.process_gone().is_some() => {
                        return Err(TransportError::PeerClosed {
                            rank,
                            peer: p.rank,
                            during: "shm connect: the peer's process exited before attaching"
                                .into(),
                        });
                    }
                    _ => missing.push(p.rank),
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(TransportError::Timeout {
                    rank,
                    timeout,
                    msg: format!("local ranks {missing:?} did not attach to this rank's segment"),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
