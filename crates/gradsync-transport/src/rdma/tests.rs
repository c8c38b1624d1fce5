//! Tests of the RDMA backend. The pure parts run everywhere; the device tests need an active
//! RDMA port (`scripts/rdma-vm.sh` runs them inside a Soft-RoCE VM) and say so when they skip.

use super::completion::{WC_RDMA_WRITE, WC_RECV, WC_RECV_RDMA_WITH_IMM, WC_SEND};
use super::device::Buffer;
use super::device::{GidEntry, active_port_present, parse_hca, pick_gid};
use super::endpoint::RdmaEndpoint;
use super::ffi;
use super::lazy::FirstUse;
use super::options::RdmaOptions;
use super::setup::{RECV_DEPTH, RdmaSetup, cq_entries};
use super::staging::Staging;
use super::wire::ConnInfoRepr;
use crate::error::{Result, TransportError};
use crate::verbs::{Access, Completion, Endpoint, MAX_SEND, MemoryRegion, Sge};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// An active port, or `None` after saying why the calling test skips.
fn device_or_skip(test: &str) -> Option<()> {
    if active_port_present() {
        Some(())
    } else {
        eprintln!(
            "{test}: skipped: no active RDMA port on this machine (scripts/rdma-vm.sh runs it under Soft-RoCE)"
        );
        None
    }
}

fn opts() -> RdmaOptions {
    RdmaOptions {
        hca: std::env::var("GRADSYNC_IB_HCA").ok(),
        staging_bytes: 4 << 20,
        ..RdmaOptions::default()
    }
}

/// `world` connected endpoints in this process.
fn group(world: usize, o: &RdmaOptions) -> Vec<RdmaEndpoint> {
    let setups: Vec<RdmaSetup> = (0..world)
        .map(|r| RdmaSetup::new(r, world, o).expect("setup"))
        .collect();
    let infos: Vec<Vec<u8>> = setups.iter().map(RdmaSetup::info).collect();
    setups
        .into_iter()
        .map(|s| s.connect(&infos).expect("connect"))
        .collect()
}

/// Polls every endpoint until `done` holds for what `eps[who]` returned, or 30 s pass.
fn poll_until(
    eps: &mut [RdmaEndpoint],
    who: usize,
    mut done: impl FnMut(&[Completion]) -> bool,
) -> Result<Vec<Completion>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    loop {
        for (i, ep) in eps.iter_mut().enumerate() {
            let mut out = Vec::new();
            let r = ep.poll(&mut out);
            if i == who {
                r?;
                got.extend(out);
            } else if let Err(e) = r {
                eprintln!("(rank {i} while waiting on rank {who}: {e})");
            }
        }
        if done(&got) {
            return Ok(got);
        }
        assert!(
            Instant::now() < deadline,
            "no completion within 30 s: {got:?}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Polls every endpoint until `done` holds for what they returned (by rank), or 30 s pass;
/// any error fails the test.
fn poll_all(
    eps: &mut [RdmaEndpoint],
    mut done: impl FnMut(&[Vec<Completion>]) -> bool,
) -> Vec<Vec<Completion>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = vec![Vec::new(); eps.len()];
    loop {
        for (i, ep) in eps.iter_mut().enumerate() {
            ep.poll(&mut got[i]).unwrap();
        }
        if done(&got) {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "no completion within 30 s: {got:?}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

const RW: Access = Access::REMOTE_WRITE.union(Access::LOCAL_READ);

#[test]
fn completion_opcodes_match_the_headers() {
    // SAFETY: pure functions of their argument.
    let got: Vec<u32> = (0..4).map(|i| unsafe { ffi::gs_wc_opcode(i) }).collect();
    assert_eq!(
        got,
        [WC_SEND, WC_RDMA_WRITE, WC_RECV, WC_RECV_RDMA_WITH_IMM]
    );
}

#[test]
fn info_round_trip_and_rejects() {
    let i = ConnInfoRepr {
        world: 3,
        qps: 2,
        gid: [7; 16],
        lid: 5,
        mtu: 3,
        global: true,
        qp: (0..6).map(|k| (k * 10, k * 100)).collect(),
    };
    let b = i.to_bytes();
    assert_eq!(ConnInfoRepr::from_bytes(&b), Some(i));
    assert_eq!(ConnInfoRepr::from_bytes(&b[..b.len() - 1]), None);
    let mut bad = b.clone();
    bad[0] ^= 1;
    assert_eq!(ConnInfoRepr::from_bytes(&bad), None);
    let mut huge = b;
    huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(ConnInfoRepr::from_bytes(&huge), None);
}

#[test]
fn gid_choice_prefers_roce_v2_ipv4() {
    let g = |index, gid: &str, kind| GidEntry {
        index,
        gid: gid.parse().unwrap(),
        kind,
    };
    let v = vec![
        g(0, "fe80::1", "IB/RoCE v1"),
        g(1, "fe80::1", "RoCE v2"),
        g(2, "::ffff:10.0.0.1", "IB/RoCE v1"),
        g(3, "::ffff:10.0.0.1", "RoCE v2"),
    ];
    assert_eq!(pick_gid(&v), Some(3));
    assert_eq!(pick_gid(&v[..3]), Some(1));
    assert_eq!(pick_gid(&v[..1]), Some(0));
    assert_eq!(pick_gid(&[]), None);
}

#[test]
fn hca_parsing() {
    assert_eq!(parse_hca("mlx5_0").unwrap(), ("mlx5_0".into(), None));
    assert_eq!(parse_hca("rxe0:1").unwrap(), ("rxe0".into(), Some(1)));
    assert!(parse_hca("rxe0:0").unwrap_err().contains("port"));
    assert!(parse_hca(":1").unwrap_err().contains("no device"));
}

#[test]
fn staging_ring_wraps_and_frees_out_of_order() {
    let mut s = Staging {
        buf: Buffer::new(4096).unwrap(),
        mr: std::ptr::null_mut(),
        lkey: 0,
        live: VecDeque::new(),
        first: 0,
        head: 0,
    };
    let (a, oa) = s.alloc(1000).unwrap();
    let (b, ob) = s.alloc(1000).unwrap();
    let (c, oc) = s.alloc(1000).unwrap();
    assert_eq!((oa, ob, oc), (0, 1024, 2048));
    assert!(s.alloc(2000).is_none(), "only 1024 bytes are left");
    s.free(b);
    assert!(
        s.alloc(2000).is_none(),
        "b is free but a still holds the ring's tail"
    );
    s.free(a);
    // a and b are gone: the ring wraps to offset 0 for the next allocation.
    let (d, od) = s.alloc(2000).unwrap();
    assert_eq!(od, 0);
    assert!(
        s.alloc(100).is_none(),
        "wrapped: the room after c is unusable until c is freed"
    );
    s.free(c);
    let (e, oe) = s.alloc(100).unwrap();
    assert_eq!(oe, 2048);
    s.free(d);
    s.free(e);
    assert!(s.live.is_empty());
    assert!(s.alloc(5000).is_none(), "larger than the ring");
}

#[test]
fn write_with_immediate_from_staged_and_pinned_memory() {
    if device_or_skip("write_with_immediate_from_staged_and_pinned_memory").is_none() {
        return;
    }
    let mut eps = group(2, &opts());
    let mut dst = vec![0u8; 1 << 20];
    // SAFETY: `dst` outlives the endpoints' use of it and is read only after completions.
    let dmr = unsafe { eps[1].register(dst.as_mut_ptr(), dst.len(), RW.union(Access::PERSISTENT)) }
        .unwrap();
    let src: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: `src` lives until the end of the test.
    let smr =
        unsafe { eps[0].register(src.as_ptr() as *mut u8, src.len(), Access::LOCAL_READ) }.unwrap();
    let sges = [
        Sge {
            addr: src.as_ptr() as usize,
            len: 100_000,
            lkey: smr.lkey,
        },
        Sge {
            addr: src.as_ptr() as usize + 100_000,
            len: 200_000,
            lkey: smr.lkey,
        },
    ];
    // SAFETY: the spans stay valid until WriteDone.
    unsafe { eps[0].post_write(1, &sges, dmr.remote(), 4096, Some(0xabc), 11) }.unwrap();
    let imm = Completion::WriteImm {
        peer: 0,
        imm: 0xabc,
        len: 300_000,
    };
    let done = Completion::WriteDone { wr_id: 11 };
    poll_all(&mut eps, |g| g[1].contains(&imm) && g[0].contains(&done));
    assert_eq!(&dst[4096..4096 + 300_000], &src[..]);
    // From pinned memory: no staging, WriteDone comes from the adapter's completion.
    let mut pin = vec![9u8; 65536];
    // SAFETY: `pin` lives until the end of the test.
    let pmr = unsafe {
        eps[0].register(
            pin.as_mut_ptr(),
            pin.len(),
            Access::LOCAL_READ.union(Access::PERSISTENT),
        )
    }
    .unwrap();
    let s = [Sge {
        addr: pin.as_ptr() as usize,
        len: pin.len(),
        lkey: pmr.lkey,
    }];
    let staged = eps[0].staging.live.len();
    // SAFETY: as above.
    unsafe { eps[0].post_write(1, &s, dmr.remote(), 0, Some(7), 12) }.unwrap();
    assert_eq!(
        eps[0].staging.live.len(),
        staged,
        "a write from registered memory is not staged"
    );
    let imm = Completion::WriteImm {
        peer: 0,
        imm: 7,
        len: 65536,
    };
    let done = Completion::WriteDone { wr_id: 12 };
    poll_all(&mut eps, |g| g[1].contains(&imm) && g[0].contains(&done));
    assert!(dst[..65536].iter().all(|&b| b == 9));
    eps[0].deregister(&pmr);
    eps[0].deregister(&smr);
    eps[1].deregister(&dmr);
    for e in &mut eps {
        e.close(Duration::from_secs(5));
    }
}

#[test]
fn sends_past_the_posted_receives_arrive_in_order_per_queue_pair() {
    if device_or_skip("sends_past_the_posted_receives_arrive_in_order_per_queue_pair").is_none() {
        return;
    }
    let o = RdmaOptions {
        qps_per_peer: 1,
        ..opts()
    };
    let mut eps = group(3, &o);
    let n = RECV_DEPTH * 3 + 5;
    for i in 0..n {
        let msg = vec![i as u8; 1 + i % MAX_SEND];
        eps[2].post_send(0, &msg, i as u64).unwrap();
    }
    let got = poll_until(&mut eps, 0, |c| c.len() >= n).unwrap();
    for (i, c) in got.iter().enumerate() {
        assert_eq!(
            c,
            &Completion::Recv {
                peer: 2,
                data: vec![i as u8; 1 + i % MAX_SEND]
            }
        );
    }
    assert!(eps.iter().all(|e| (0..3).all(|p| e.peer_alive(p))));
    for e in &mut eps {
        e.close(Duration::from_secs(5));
    }
}

#[test]
fn wrong_remote_key_is_an_error_naming_the_peer() {
    if device_or_skip("wrong_remote_key_is_an_error_naming_the_peer").is_none() {
        return;
    }
    let mut eps = group(2, &opts());
    let mut dst = vec![0u8; 4096];
    // SAFETY: `dst` outlives the endpoints.
    let dmr = unsafe { eps[1].register(dst.as_mut_ptr(), dst.len(), RW.union(Access::PERSISTENT)) }
        .unwrap();
    let src = [1u8; 64];
    // SAFETY: `src` lives until the end of the test.
    let smr = unsafe { eps[0].register(src.as_ptr() as *mut u8, 64, Access::LOCAL_READ) }.unwrap();
    let sge = [Sge {
        addr: src.as_ptr() as usize,
        len: 64,
        lkey: smr.lkey,
    }];
    let mut wrong = dmr.remote();
    wrong.rkey ^= 0x5555_0000;
    let t = Instant::now();
    // SAFETY: as above.
    unsafe { eps[0].post_write(1, &sge, wrong, 0, Some(1), 1) }.unwrap();
    let err = poll_until(&mut eps, 0, |_| false).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            TransportError::RemoteAccess {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("rank 1") && msg.contains("remote key"),
        "{msg}"
    );
    eprintln!("wrong key reported after {:?}: {msg}", t.elapsed());
    // The connection is unusable afterwards, and says so instead of hanging.
    assert!(!eps[0].peer_alive(1));
    let e = eps[0].post_send(1, b"x", 2).unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");
    // A span past the end of what the peer advertised is refused before it is posted.
    let mut eps = group(2, &opts());
    // SAFETY: as above.
    let dmr = unsafe { eps[1].register(dst.as_mut_ptr(), dst.len(), RW.union(Access::PERSISTENT)) }
        .unwrap();
    // SAFETY: as above.
    let smr = unsafe { eps[0].register(src.as_ptr() as *mut u8, 64, Access::LOCAL_READ) }.unwrap();
    let sge = [Sge {
        addr: src.as_ptr() as usize,
        len: 64,
        lkey: smr.lkey,
    }];
    // SAFETY: as above.
    let e = unsafe { eps[0].post_write(1, &sge, dmr.remote(), 4090, None, 3) }.unwrap_err();
    assert!(
        matches!(e, TransportError::RemoteAccess { peer: 1, .. }),
        "{e}"
    );
    // A peer that lies about its region's length is caught by its adapter.
    let mut lie = dmr.remote();
    lie.len = 1 << 20;
    // SAFETY: as above.
    unsafe { eps[0].post_write(1, &sge, lie, 8192, Some(4), 4) }.unwrap();
    let err = poll_until(&mut eps, 0, |_| false).unwrap_err();
    assert!(
        matches!(err, TransportError::RemoteAccess { peer: 1, .. }),
        "{err}"
    );
}

#[test]
fn registration_pool_shares_and_bounds() {
    if device_or_skip("registration_pool_shares_and_bounds").is_none() {
        return;
    }
    let o = RdmaOptions {
        reg_max_bytes: 3 << 20,
        ..opts()
    };
    let mut eps = group(2, &o);
    let mut a = vec![0u8; 2 << 20];
    let p = Access::LOCAL_READ.union(Access::PERSISTENT);
    let e = &mut eps[0];
    // SAFETY: `a` outlives every registration of it.
    let whole = unsafe { e.register(a.as_mut_ptr(), a.len(), p) }.unwrap();
    assert_eq!((e.pinned_regions(), e.pinned_bytes()), (1, 2 << 20));
    // SAFETY: as above.
    let inner = unsafe { e.register(a.as_mut_ptr().add(4096), 65536, p) }.unwrap();
    assert_eq!(
        inner.lkey, whole.lkey,
        "a span inside a registration shares it"
    );
    assert_eq!(e.pinned_regions(), 1);
    let mut b = vec![0u8; 2 << 20];
    // SAFETY: as above.
    let over = unsafe { e.register(b.as_mut_ptr(), b.len(), p) }.unwrap_err();
    assert!(over.to_string().contains("bound"), "{over}");
    // Caller buffers (not persistent) are never pinned.
    // SAFETY: as above.
    let plain = unsafe { e.register(b.as_mut_ptr(), b.len(), Access::LOCAL_READ) }.unwrap();
    assert_eq!(e.pinned_bytes(), 2 << 20);
    e.deregister(&plain);
    e.deregister(&whole);
    assert_eq!(e.pinned_regions(), 1, "still referenced by the inner span");
    e.deregister(&inner);
    assert_eq!((e.pinned_regions(), e.pinned_bytes()), (0, 0));
}

#[test]
fn gid_index_past_the_table_is_named() {
    if device_or_skip("gid_index_past_the_table_is_named").is_none() {
        return;
    }
    let o = RdmaOptions {
        gid_index: Some(100_000),
        ..opts()
    };
    let e = RdmaSetup::new(0, 2, &o).unwrap_err().to_string();
    assert!(e.contains("GRADSYNC_IB_GID_INDEX=100000"), "{e}");
    let o = RdmaOptions {
        hca: Some("nosuchdev0".into()),
        ..opts()
    };
    let e = RdmaSetup::new(0, 2, &o).unwrap_err().to_string();
    assert!(e.contains("nosuchdev0") && e.contains("ports:"), "{e}");
}

#[test]
fn memlock_refusal_says_how_to_raise_the_limit() {
    if device_or_skip("memlock_refusal_says_how_to_raise_the_limit").is_none() {
        return;
    }
    // Root pins past RLIMIT_MEMLOCK through CAP_IPC_LOCK; capabilities belong to a thread, so a
    // thread of its own drops it from its effective set, then lowers the (process-wide) limit
    // for the moment of one setup and puts it back.
    let err = std::thread::spawn(|| {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const CAP_IPC_LOCK: u32 = 14;
        let mut h = Header {
            version: 0x2008_0522,
            pid: 0,
        };
        let mut d = [Data::default(); 2];
        // SAFETY: the kernel fills the header and two data entries.
        let rc = unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) };
        assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
        d[0].effective &= !(1 << CAP_IPC_LOCK);
        // SAFETY: as above; only this thread's effective set changes.
        let rc = unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) };
        assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain structs.
        unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old) };
        let low = libc::rlimit {
            rlim_cur: 64 << 10,
            rlim_max: old.rlim_max,
        };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) }, 0);
        let r = RdmaSetup::new(0, 2, &opts());
        // SAFETY: as above; the soft limit goes back under the unchanged hard limit.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) };
        r.err().map(|e| e.to_string())
    })
    .join()
    .unwrap()
    .expect("registering 512 KiB under a 64 KiB RLIMIT_MEMLOCK must fail");
    assert!(
        err.contains("RLIMIT_MEMLOCK is 64 KiB") && err.contains("ulimit -l"),
        "{err}"
    );
}

#[test]
fn a_bad_descriptor_names_the_transition_and_attribute() {
    if device_or_skip("a_bad_descriptor_names_the_transition_and_attribute").is_none() {
        return;
    }
    let o = opts();
    let a = RdmaSetup::new(0, 2, &o).unwrap();
    let b = RdmaSetup::new(1, 2, &o).unwrap();
    let mut bad = ConnInfoRepr::from_bytes(&b.info()).unwrap();
    bad.mtu = 0;
    let e = a
        .connect(&[Vec::new(), bad.to_bytes()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("with rank 1") && e.contains("INIT->RTR") && e.contains("path_mtu"),
        "{e}"
    );
    let mut other = ConnInfoRepr::from_bytes(&b.info()).unwrap();
    other.qps = 3;
    other.qp = vec![(1, 1); 6];
    let a = RdmaSetup::new(0, 2, &o).unwrap();
    let e = a
        .connect(&[Vec::new(), other.to_bytes()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("GRADSYNC_IB_QPS_PER_CONN"), "{e}");
    let a = RdmaSetup::new(0, 2, &o).unwrap();
    let e = a
        .connect(&[Vec::new(), vec![1, 2, 3]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("malformed") && e.contains("rank 1"), "{e}");
}

/// `world` endpoints in this process whose pairs connect on first use, listening on loopback.
fn lazy_group(
    world: usize,
    o: &RdmaOptions,
    token: impl Fn(usize) -> Option<Vec<u8>>,
) -> Vec<RdmaEndpoint> {
    let listeners: Vec<std::net::TcpListener> = (0..world)
        .map(|_| crate::tcp::listen([127, 0, 0, 1].into()).expect("listen"))
        .collect();
    let addrs: Vec<std::net::SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr().expect("address"))
        .collect();
    listeners
        .into_iter()
        .enumerate()
        .map(|(r, listener)| {
            RdmaSetup::open(r, world, o)
                .expect("open")
                .first_use(FirstUse {
                    addrs: crate::AddressBook::full(r, addrs.clone()),
                    listener,
                    comm_id: 0x5eed,
                    token: token(r),
                    timeout: Duration::from_secs(10),
                })
                .expect("first use")
        })
        .collect()
}

/// Every endpoint connects to its `peers[r]` at once, each on its own thread (a dial waits for
/// the lower rank to accept); the endpoints come back with what each connect returned.
fn connect_all(
    eps: Vec<RdmaEndpoint>,
    peers: &[Vec<usize>],
) -> (Vec<RdmaEndpoint>, Vec<Result<()>>) {
    let handles: Vec<_> = eps
        .into_iter()
        .zip(peers.iter().cloned())
        .map(|(mut ep, ps)| {
            std::thread::spawn(move || {
                let r = ep.connect(&ps, Duration::from_secs(10));
                (ep, r)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .unzip()
}

fn connected(ep: &RdmaEndpoint) -> Vec<usize> {
    (0..ep.world)
        .filter(|&p| p != ep.rank && ep.caps(p).connected)
        .collect()
}

#[test]
fn queue_pairs_are_made_on_first_use() {
    if device_or_skip("queue_pairs_are_made_on_first_use").is_none() {
        return;
    }
    let o = RdmaOptions {
        qps_per_peer: 2,
        ..opts()
    };
    let eps = lazy_group(3, &o, |_| Some(b"job token".to_vec()));
    for ep in &eps {
        assert!(
            connected(ep).is_empty(),
            "rank {} connected at setup",
            ep.rank
        );
        assert!(
            ep.peers
                .iter()
                .all(|p| p.qps.is_empty() && p.recv.is_none())
        );
        // Room for one peer's queue pairs; it grows as pairs connect.
        assert!(ep.cq_size < cq_entries(2, 2), "{}", ep.cq_size);
    }
    // Inboxes written by areas: each rank pins a peer's area only once the pair connects.
    let area = 64 << 10;
    let mut inboxes: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 3 * area]).collect();
    let mut eps = eps;
    let imrs: Vec<MemoryRegion> = eps
        .iter_mut()
        .zip(inboxes.iter_mut())
        .map(|(ep, b)| {
            // SAFETY: each inbox outlives its registration and is read after completions.
            unsafe {
                ep.register(
                    b.as_mut_ptr(),
                    b.len(),
                    RW.union(Access::PERSISTENT).union(Access::PEER_AREAS),
                )
            }
            .unwrap()
        })
        .collect();
    assert!(eps.iter().all(|e| e.pinned_bytes() == 0));
    // Only ranks 0 and 2 talk: rank 1 makes no queue pair and registers no receive buffer.
    let (mut eps, res) = connect_all(eps, &[vec![2], vec![], vec![0]]);
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    assert_eq!(connected(&eps[0]), [2]);
    assert_eq!(connected(&eps[2]), [0]);
    assert!(connected(&eps[1]).is_empty());
    assert!(
        eps[1]
            .peers
            .iter()
            .all(|p| p.qps.is_empty() && p.recv.is_none())
    );
    assert_eq!(eps[0].peers[2].qps.len(), 2);
    let e = eps[0].post_send(1, b"early", 1).unwrap_err().to_string();
    assert!(e.contains("rank 1 is not connected"), "{e}");
    // Traffic both ways on the pair, sends past the posted receives and a write with an
    // immediate value.
    let n = RECV_DEPTH + 3;
    for i in 0..n {
        eps[2].post_send(0, &[i as u8; 100], i as u64).unwrap();
        eps[0].post_send(2, &[i as u8; 50], i as u64).unwrap();
    }
    let got = poll_all(&mut eps, |g| {
        let recvs = |r: usize| {
            g[r].iter()
                .filter(|c| matches!(c, Completion::Recv { .. }))
                .count()
        };
        recvs(0) >= n && recvs(2) >= n
    });
    let from = |r: usize, peer: usize, len: usize| {
        let v: Vec<&Completion> = got[r]
            .iter()
            .filter(|c| matches!(c, Completion::Recv { .. }))
            .collect();
        v.iter().enumerate().all(|(i, c)| {
            **c == Completion::Recv {
                peer,
                data: vec![i as u8; len],
            }
        })
    };
    assert!(from(0, 2, 100) && from(2, 0, 50));
    let mut dst = vec![0u8; 4096];
    // SAFETY: `dst` outlives the endpoints' use of it and is read only after completions.
    let dmr = unsafe { eps[0].register(dst.as_mut_ptr(), dst.len(), RW.union(Access::PERSISTENT)) }
        .unwrap();
    let src = vec![0x5au8; 4096];
    // SAFETY: `src` lives until the end of the test.
    let smr =
        unsafe { eps[2].register(src.as_ptr() as *mut u8, src.len(), Access::LOCAL_READ) }.unwrap();
    let s = [Sge {
        addr: src.as_ptr() as usize,
        len: src.len(),
        lkey: smr.lkey,
    }];
    // SAFETY: the span stays valid until WriteDone.
    unsafe { eps[2].post_write(0, &s, dmr.remote(), 0, Some(0x77), 9) }.unwrap();
    let imm = Completion::WriteImm {
        peer: 2,
        imm: 0x77,
        len: 4096,
    };
    poll_all(&mut eps, |g| g[0].contains(&imm));
    assert!(dst.iter().all(|&b| b == 0x5a));
    eps[0].deregister(&dmr);
    // Into rank 0's inbox, at rank 2's area, with the key rank 0's inbox was published with.
    assert_eq!(eps[0].pinned_bytes(), area);
    assert_eq!(eps[1].pinned_bytes(), 0);
    // SAFETY: as above.
    unsafe { eps[2].post_write(0, &s, imrs[0].remote(), 2 * area as u64, Some(0x78), 10) }.unwrap();
    let imm = Completion::WriteImm {
        peer: 2,
        imm: 0x78,
        len: 4096,
    };
    poll_all(&mut eps, |g| g[0].contains(&imm));
    assert!(
        inboxes[0][2 * area..2 * area + 4096]
            .iter()
            .all(|&b| b == 0x5a)
    );
    // And on from there, a span of rank 0's inbox as the source: its area's key, no staging.
    let fwd = [Sge {
        addr: inboxes[0].as_ptr() as usize + 2 * area,
        len: 4096,
        lkey: imrs[0].lkey,
    }];
    let staged = eps[0].staging.live.len();
    // SAFETY: as above.
    unsafe { eps[0].post_write(2, &fwd, imrs[2].remote(), 0, Some(0x79), 11) }.unwrap();
    assert_eq!(
        eps[0].staging.live.len(),
        staged,
        "a span of a pinned area is not staged"
    );
    let imm = Completion::WriteImm {
        peer: 0,
        imm: 0x79,
        len: 4096,
    };
    poll_all(&mut eps, |g| g[2].contains(&imm));
    assert!(inboxes[2][..4096].iter().all(|&b| b == 0x5a));
    eps[2].deregister(&smr);
    // Rank 1 joins later, with both.
    let (mut eps, res) = connect_all(eps, &[vec![1], vec![0, 2], vec![1]]);
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    assert_eq!(connected(&eps[1]), [0, 2]);
    assert!(eps[1].cq_size >= cq_entries(2, 2), "{}", eps[1].cq_size);
    assert_eq!(eps[1].pinned_bytes(), 2 * area);
    eps[1].post_send(0, b"late", 5).unwrap();
    eps[2].post_send(1, b"hello", 6).unwrap();
    poll_all(&mut eps, |g| {
        g[0].contains(&Completion::Recv {
            peer: 1,
            data: b"late".to_vec(),
        }) && g[1].contains(&Completion::Recv {
            peer: 2,
            data: b"hello".to_vec(),
        })
    });
    for (e, mr) in eps.iter_mut().zip(&imrs) {
        e.deregister(mr);
        assert_eq!(e.pinned_bytes(), 0);
    }
    for e in &mut eps {
        e.close(Duration::from_secs(5));
    }
}

#[test]
fn a_first_use_dial_with_the_wrong_token_fails_naming_the_peer() {
    if device_or_skip("a_first_use_dial_with_the_wrong_token_fails_naming_the_peer").is_none() {
        return;
    }
    let eps = lazy_group(2, &opts(), |r| Some(format!("token {r}").into_bytes()));
    let (eps, res) = connect_all(eps, &[vec![1], vec![0]]);
    let e = res[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank 0") && e.contains("authentication"), "{e}");
    // The accepting rank dropped the connection and made nothing; it still waits for rank 1.
    let e = res[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("[1]"), "{e}");
    assert!(eps.iter().all(|ep| connected(ep).is_empty()));
    assert!(eps[0].peers[1].qps.is_empty() && eps[0].peers[1].recv.is_none());
}

#[test]
fn a_completion_queue_past_the_device_limit_is_named() {
    if device_or_skip("a_completion_queue_past_the_device_limit_is_named").is_none() {
        return;
    }
    // Room for one peer's queue pairs at setup: rank 2's second pair must grow the queue.
    let mut eps = lazy_group(3, &opts(), |_| None);
    eps[2].max_cqe = 100;
    let (eps, res) = connect_all(eps, &[vec![2], vec![2], vec![0, 1]]);
    let e = res[2].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("completion queue") && e.contains("the device allows 100"),
        "{e}"
    );
    assert!(res[0].is_ok() && res[1].is_err(), "{res:?}");
    assert_eq!(connected(&eps[2]), [0]);
    assert!(connected(&eps[1]).is_empty());
    assert!(eps[2].peers[1].qps.is_empty() && eps[2].peers[1].recv.is_none());
}
