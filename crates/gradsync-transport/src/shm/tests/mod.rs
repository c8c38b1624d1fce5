//! Tests of the shared-memory backend: several endpoints in one process (cross-memory attach
//! into one's own pid is always allowed), each used from its own thread where the test needs
//! concurrency. The helpers live here; the tests by concern in the files below.

mod huge;
mod lifecycle;
mod shared;
mod writes;

use super::endpoint::ShmEndpoint;
use super::setup::ShmSetup;
use crate::verbs::{Access, Completion, Endpoint, MemoryRegion, Sge};
use crate::wire::RemoteRegion;
use std::time::{Duration, Instant};

const RW: Access = Access::LOCAL_READ.union(Access::REMOTE_WRITE);
const LONG: Duration = Duration::from_secs(10);

fn fabric_in(world: usize, local: &[usize]) -> Vec<ShmEndpoint> {
    ShmSetup::in_process(world, local, LONG).unwrap()
}

pub(in crate::shm) fn fabric(n: usize) -> Vec<ShmEndpoint> {
    fabric_in(n, &(0..n).collect::<Vec<_>>())
}

fn pair() -> (ShmEndpoint, ShmEndpoint) {
    let mut v = fabric(2);
    let e1 = v.pop().unwrap();
    (v.pop().unwrap(), e1)
}

/// A registered buffer (the vector's heap block never moves).
struct Buf {
    v: Vec<u8>,
    mr: MemoryRegion,
}

fn buf(ep: &mut ShmEndpoint, v: Vec<u8>, access: Access) -> Buf {
    let mut v = v;
    // SAFETY: the heap block stays valid and in place until the test ends, after the
    // endpoints' last use of it.
    let mr = unsafe { ep.register(v.as_mut_ptr(), v.len(), access) }.unwrap();
    Buf { v, mr }
}

fn sge(b: &Buf, off: usize, len: usize) -> Sge {
    assert!(off + len <= b.v.len());
    Sge {
        addr: b.v.as_ptr() as usize + off,
        len,
        lkey: b.mr.lkey,
    }
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed * 17) % 251) as u8)
        .collect()
}

fn remote(c: &Completion) -> bool {
    matches!(c, Completion::WriteImm { .. } | Completion::Recv { .. })
}

/// Polls until `n` completions accepted by `keep` arrived.
fn collect(ep: &mut ShmEndpoint, n: usize, keep: impl Fn(&Completion) -> bool) -> Vec<Completion> {
    let deadline = Instant::now() + LONG;
    let mut got = Vec::new();
    let mut out = Vec::new();
    loop {
        ep.poll(&mut out).unwrap();
        got.extend(out.drain(..).filter(|c| keep(c)));
        if got.len() >= n {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            got.len()
        );
        ep.wait(Duration::from_millis(20)).unwrap();
    }
}

/// The tag of a completion: the immediate, or the first 4 bytes of a message.
fn tag(c: &Completion) -> u32 {
    match c {
        Completion::WriteImm { imm, .. } => *imm,
        Completion::Recv { data, .. } => u32::from_le_bytes(data[..4].try_into().unwrap()),
        other => panic!("unexpected {other:?}"),
    }
}

/// Writes 3 MiB from `e0`'s buffers `a` and `b` (2 MiB each) to offset 17 of `e1`'s region
/// `r`, as a three-entry gather list with immediate 9 (work request 4); checks `e1`'s one
/// completion and returns the bytes that must have landed.
fn write_three_mib(
    e0: &mut ShmEndpoint,
    e1: &mut ShmEndpoint,
    r: RemoteRegion,
    a: &Buf,
    b: &Buf,
) -> Vec<u8> {
    let mib = 1 << 20;
    let s = [sge(a, 5, mib + 3), sge(b, 0, mib - 3), sge(a, 1000, mib)];
    // SAFETY: the sources outlive the writes (the caller keeps them).
    unsafe { e0.post_write(1, &s, r, 17, Some(9), 4) }.unwrap();
    let got = collect(e1, 1, remote);
    assert_eq!(
        got,
        [Completion::WriteImm {
            peer: 0,
            imm: 9,
            len: 3 * mib as u32
        }]
    );
    let mut want = a.v[5..mib + 8].to_vec();
    want.extend_from_slice(&b.v[..mib - 3]);
    want.extend_from_slice(&a.v[1000..mib + 1000]);
    want
}
