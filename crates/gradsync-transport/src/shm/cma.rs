//! Cross-memory attach: `process_vm_writev` of a gather list into a peer's process, and the
//! error that explains a refusal.

use crate::error::TransportError;
use crate::verbs::Sge;
use std::io;

/// `process_vm_writev` accepts at most this many local entries per call.
const IOV_MAX: usize = 1024;

/// Writes the gather list into process `pid` at `dst` with `process_vm_writev`, looping over
/// partial transfers and [`IOV_MAX`]-sized batches.
///
/// # Safety
///
/// Every span of `sges` must be readable.
pub(super) unsafe fn cma_write(pid: u32, sges: &[Sge], dst: u64, total: usize) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::ErrorKind::InvalidInput)?;
    let mut iov: Vec<libc::iovec> = sges
        .iter()
        .filter(|s| s.len > 0)
        .map(|s| libc::iovec {
            iov_base: s.addr as *mut libc::c_void,
            iov_len: s.len,
        })
        .collect();
    let mut first = 0;
    let mut remote = dst;
    let mut left = total;
    while left > 0 {
        let end = (first + IOV_MAX).min(iov.len());
        let batch: usize = iov[first..end].iter().map(|v| v.iov_len).sum();
        let riov = libc::iovec {
            iov_base: remote as usize as *mut libc::c_void,
            iov_len: batch,
        };
        // SAFETY: the local entries describe readable spans (caller) and the array holds
        // `end - first` of them; the remote entry is only dereferenced by the kernel, in the
        // other process, where a bad address yields an error.
        let n = unsafe {
            libc::process_vm_writev(pid, iov[first..].as_ptr(), (end - first) as _, &riov, 1, 0)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "process_vm_writev transferred nothing",
            ));
        }
        let mut n = n as usize;
        left -= n;
        remote += n as u64;
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// The error of a refused cross-memory attach, with the likely reason.
pub(super) fn cma_refused(rank: usize, peer: usize, pid: u32, e: io::Error) -> TransportError {
    let why = match e.raw_os_error() {
        Some(libc::EPERM) => {
            "the kernel denies ptrace access to that process (a different user, a non-dumpable \
             process, or Yama ptrace_scope above 0; kernel.yama.ptrace_scope=0 or \
             CAP_SYS_PTRACE allows it)"
        }
        Some(libc::ENOSYS) => "the kernel or a seccomp filter does not provide process_vm_writev",
        Some(libc::EFAULT) => "the address the peer advertised is not writable in its process",
        Some(libc::ESRCH) => "the process does not exist",
        _ => "unexpected error",
    };
    TransportError::Io {
        rank,
        peer,
        op: "probe cross-memory attach",
        source: io::Error::new(
            e.kind(),
            format!(
                "cross-memory attach (process_vm_writev) into pid {pid} is not permitted: {e}; {why}"
            ),
        ),
    }
}
