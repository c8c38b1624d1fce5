//! Shared allocations: memfds of a rank that its peers map too, so that a large write into a
//! region inside one is a plain `memcpy` ([`SharedAlloc`] on the owner's side,
//! [`Peer::map_alloc`] on the writer's).

use super::directory::AllocRef;
use super::liveness::process_state;
use super::peer::{Me, Peer};
use super::segment::Segment;
use crate::error::{Result, TransportError, Violation};
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

/// The memfd name of shared allocation `id`.
pub(super) fn alloc_name(id: u64) -> String {
    format!("gradsync-shared-{id:016x}")
}

/// A memfd allocation of this rank that its peers map directly ([`SharedMemory::alloc_shared`](crate::SharedMemory::alloc_shared)).
#[derive(Debug)]
pub(super) struct SharedAlloc {
    pub(super) id: u64,
    pub(super) seg: Segment,
}

impl SharedAlloc {
    /// Where `[addr, addr + len)` lies in this allocation, if it lies there entirely.
    pub(super) fn locate(&self, addr: usize, len: usize) -> Option<AllocRef> {
        let base = self.seg.base as usize;
        let off = addr.checked_sub(base)?;
        if off.checked_add(len)? > self.seg.len {
            return None;
        }
        Some(AllocRef {
            fd: self.seg.fd.as_ref()?.as_raw_fd(),
            id: self.id,
            len: self.seg.len as u64,
            off: off as u64,
        })
    }
}

impl Peer {
    /// The start of this rank's mapping of the peer's shared allocation `a`, mapped through
    /// `/proc/<pid>/fd/<fd>` on first use and cached until the peer goes away.
    pub(super) fn map_alloc(&mut self, me: Me, a: AllocRef) -> Result<*mut u8> {
        if let Some(m) = self.maps.get(&a.id) {
            if m.len as u64 == a.len {
                return Ok(m.base);
            }
            let violation = Violation::AllocationResized {
                id: a.id,
                was: m.len as u64,
                now: a.len,
            };
            return Err(self.protocol(me, violation));
        }
        let path = format!("/proc/{}/fd/{}", self.pid, a.fd);
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => {
                if !self.is_down()
                    && let Some(g) = process_state(self.pid, self.starttime, true)
                {
                    self.set_down(format!("rank {}: {g}", self.rank));
                }
                if self.down.is_some() {
                    return Err(TransportError::PeerClosed {
                        rank: me.rank,
                        peer: self.rank,
                        during: format!("post_write: opening its shared allocation {path}: {e}"),
                    });
                }
                return Err(TransportError::Io {
                    rank: me.rank,
                    peer: self.rank,
                    op: "post_write (open the peer's shared allocation)",
                    source: io::Error::new(e.kind(), format!("{path}: {e}")),
                });
            }
        };
        // The descriptor number could have been reused by the owner for another file: the link
        // of the opened file must name this allocation's memfd.
        let want = format!("/memfd:{}", alloc_name(a.id));
        let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default();
        if link.strip_suffix(" (deleted)").unwrap_or(&link) != want {
            let violation = Violation::NotTheAllocation {
                path,
                link,
                id: a.id,
            };
            return Err(self.protocol(me, violation));
        }
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let len = usize::try_from(a.len).ok().filter(|&l| l > 0);
        let Some(len) = len.filter(|_| size == a.len) else {
            let violation = Violation::AllocationSize {
                path,
                size,
                expected: a.len,
            };
            return Err(self.protocol(me, violation));
        };
        // SAFETY: plain system call on a descriptor owned by `file`.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(self.protocol(me, Violation::NotSealed { path }));
        }
        let m = Segment::map(file.as_raw_fd(), len).map_err(|e| TransportError::Io {
            rank: me.rank,
            peer: self.rank,
            op: "post_write (map the peer's shared allocation)",
            source: io::Error::new(e.kind(), format!("{path}: {e}")),
        })?;
        tracing::debug!(
            peer = self.rank,
            id = a.id,
            len,
            "shm: mapped a shared allocation of the peer"
        );
        let base = m.base;
        self.maps.insert(a.id, m);
        Ok(base)
    }
}
