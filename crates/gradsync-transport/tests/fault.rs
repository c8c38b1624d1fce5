//! The fault injector over the in-memory backend: each fault does what it says, only where it
//! is asked to, and the same seed injects the same faults.

use gradsync_transport::fault::{FaultConfig, FaultyEndpoint};
use gradsync_transport::mem::{MemEndpoint, fabric};
use gradsync_transport::{
    Access, Completion, Endpoint, MemoryRegion, RemoteRegion, Sge, TransportError,
};
use std::time::{Duration, Instant};

const LEN: usize = 256;

/// Rank 0 wrapped in a fault injector, and plain peers each with a registered target region.
struct Rig {
    tx: FaultyEndpoint<MemEndpoint>,
    peers: Vec<MemEndpoint>,
    /// Source buffers (header-like first entry, payload second entry).
    head: Box<[u8]>,
    body: Box<[u8]>,
    head_mr: MemoryRegion,
    body_mr: MemoryRegion,
    /// Target region of each peer (index = rank; unused for rank 0).
    dst: Vec<Box<[u8]>>,
    dst_mr: Vec<RemoteRegion>,
}

impl Rig {
    fn new(world: usize, cfg: FaultConfig) -> Rig {
        let mut eps = fabric(world);
        let peers = eps.split_off(1);
        let mut tx = FaultyEndpoint::new(eps.pop().unwrap(), cfg);
        let mut head: Box<[u8]> = (0..16u8).collect();
        let mut body: Box<[u8]> = (0..LEN).map(|i| (i * 7) as u8).collect();
        // SAFETY: the buffers live in the rig, which outlives every write of a test.
        let head_mr =
            unsafe { tx.register(head.as_mut_ptr(), head.len(), Access::LOCAL_READ) }.unwrap();
        // SAFETY: as above.
        let body_mr =
            unsafe { tx.register(body.as_mut_ptr(), body.len(), Access::LOCAL_READ) }.unwrap();
        let mut peers = peers;
        let mut dst = vec![Box::<[u8]>::default()];
        let mut dst_mr = vec![RemoteRegion {
            addr: 0,
            rkey: 0,
            len: 0,
        }];
        for p in peers.iter_mut() {
            let mut b: Box<[u8]> = vec![0u8; 16 + LEN].into();
            // SAFETY: the buffer lives in the rig and is read only after a write completed.
            let mr = unsafe { p.register(b.as_mut_ptr(), b.len(), Access::REMOTE_WRITE) }.unwrap();
            dst.push(b);
            dst_mr.push(mr.remote());
        }
        Rig {
            tx,
            peers,
            head,
            body,
            head_mr,
            body_mr,
            dst,
            dst_mr,
        }
    }

    fn sges(&self) -> [Sge; 2] {
        [
            Sge {
                addr: self.head_mr.addr,
                len: self.head.len(),
                lkey: self.head_mr.lkey,
            },
            Sge {
                addr: self.body_mr.addr,
                len: self.body.len(),
                lkey: self.body_mr.lkey,
            },
        ]
    }

    fn write(&mut self, peer: usize, wr_id: u64) -> Result<(), TransportError> {
        let sges = self.sges();
        // SAFETY: the source buffers live in the rig, unmodified, until the test ends.
        unsafe {
            self.tx
                .post_write(peer, &sges, self.dst_mr[peer], 0, Some(wr_id as u32), wr_id)
        }
    }

    fn poll_tx(&mut self) -> Vec<Completion> {
        let mut out = Vec::new();
        self.tx.poll(&mut out).unwrap();
        out
    }

    fn poll_peer(&mut self, peer: usize) -> Vec<Completion> {
        let mut out = Vec::new();
        self.peers[peer - 1].poll(&mut out).unwrap();
        out
    }

    fn expected(&self) -> Vec<u8> {
        [&self.head[..], &self.body[..]].concat()
    }
}

fn diff_positions(a: &[u8], b: &[u8]) -> Vec<usize> {
    a.iter()
        .zip(b)
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn no_faults_passes_writes_through() {
    let mut rig = Rig::new(2, FaultConfig::default());
    rig.write(1, 7).unwrap();
    assert_eq!(rig.poll_tx(), vec![Completion::WriteDone { wr_id: 7 }]);
    assert_eq!(
        rig.poll_peer(1),
        vec![Completion::WriteImm {
            peer: 0,
            imm: 7,
            len: (16 + LEN) as u32
        }]
    );
    assert_eq!(&rig.dst[1][..], &rig.expected()[..]);
    let s = rig.tx.stats();
    assert_eq!((s.writes, s.dropped, s.corrupted, s.delayed), (1, 0, 0, 0));
    assert_eq!(rig.tx.name(), "mem");
    assert!(rig.tx.peer_alive(1));
}

#[test]
fn corruption_flips_one_payload_byte_on_the_way_out() {
    let cfg = FaultConfig {
        seed: 42,
        corrupt_writes: 1.0,
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(2, cfg);
    for wr in 1..=20u64 {
        rig.write(1, wr).unwrap();
        assert_eq!(rig.poll_tx(), vec![Completion::WriteDone { wr_id: wr }]);
        assert_eq!(rig.poll_peer(1).len(), 1);
        let d = diff_positions(&rig.dst[1], &rig.expected());
        assert_eq!(d.len(), 1, "write {wr}: exactly one byte differs: {d:?}");
        assert!(d[0] >= 16, "write {wr}: the header entry stays intact");
        let (x, y) = (rig.dst[1][d[0]], rig.expected()[d[0]]);
        assert_eq!((x ^ y).count_ones(), 1, "one bit flipped");
    }
    // The caller's memory is never touched.
    assert_eq!(
        &rig.body[..],
        &(0..LEN).map(|i| (i * 7) as u8).collect::<Vec<_>>()[..]
    );
    assert_eq!(rig.tx.stats().corrupted, 20);
}

#[test]
fn dropped_writes_are_acknowledged_but_never_delivered() {
    let cfg = FaultConfig {
        seed: 1,
        drop_writes: 1.0,
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(2, cfg);
    rig.write(1, 3).unwrap();
    assert_eq!(rig.poll_tx(), vec![Completion::WriteDone { wr_id: 3 }]);
    assert!(rig.poll_peer(1).is_empty());
    assert!(rig.dst[1].iter().all(|&b| b == 0));
    assert_eq!(rig.tx.stats().dropped, 1);
}

/// Which of `n` writes to peer 1 were delivered (by immediate) and which were corrupted.
fn pattern(seed: u64, n: u64) -> (Vec<u32>, Vec<u32>) {
    let cfg = FaultConfig {
        seed,
        drop_writes: 0.3,
        corrupt_writes: 0.3,
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(2, cfg);
    let (mut delivered, mut corrupted) = (Vec::new(), Vec::new());
    for wr in 0..n {
        rig.dst[1].fill(0);
        rig.write(1, wr).unwrap();
        rig.poll_tx();
        for c in rig.poll_peer(1) {
            if let Completion::WriteImm { imm, .. } = c {
                delivered.push(imm);
                if rig.dst[1][..] != rig.expected()[..] {
                    corrupted.push(imm);
                }
            }
        }
    }
    (delivered, corrupted)
}

#[test]
fn same_seed_same_faults() {
    let a = pattern(9, 200);
    assert_eq!(a, pattern(9, 200));
    assert_ne!(a, pattern(10, 200));
    // Roughly the configured rates.
    assert!((110..=170).contains(&a.0.len()), "{} delivered", a.0.len());
    assert!(!a.1.is_empty() && a.1.len() < a.0.len());
}

#[test]
fn delayed_writes_land_after_the_delay_in_order() {
    let delay = Duration::from_millis(150);
    let cfg = FaultConfig {
        delay: Some(delay),
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(2, cfg);
    let t0 = Instant::now();
    rig.write(1, 1).unwrap();
    rig.write(1, 2).unwrap();
    assert!(
        rig.poll_tx().is_empty(),
        "nothing completes before the delay"
    );
    assert!(
        rig.poll_peer(1).is_empty(),
        "nothing lands before the delay"
    );
    let mut done = Vec::new();
    while done.len() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "delayed writes never went out"
        );
        rig.tx.wait(Duration::from_secs(1)).unwrap();
        done.extend(rig.poll_tx());
    }
    assert!(t0.elapsed() >= delay);
    assert_eq!(
        done,
        vec![
            Completion::WriteDone { wr_id: 1 },
            Completion::WriteDone { wr_id: 2 }
        ]
    );
    let imms: Vec<u32> = rig
        .poll_peer(1)
        .into_iter()
        .filter_map(|c| match c {
            Completion::WriteImm { imm, .. } => Some(imm),
            _ => None,
        })
        .collect();
    assert_eq!(imms, vec![1, 2]);
    assert_eq!(&rig.dst[1][..], &rig.expected()[..]);
    assert_eq!(rig.tx.stats().delayed, 2);
}

#[test]
fn killed_endpoint_fails_every_call_and_sees_no_peer() {
    let cfg = FaultConfig {
        kill_after_writes: Some(2),
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(3, cfg);
    rig.write(1, 1).unwrap();
    assert!(rig.tx.peer_alive(1) && rig.tx.peer_alive(2));
    rig.write(2, 2).unwrap();
    assert!(rig.tx.stats().killed);
    assert!(!rig.tx.peer_alive(1) && !rig.tx.peer_alive(2));
    let closed = |r: Result<(), TransportError>| {
        matches!(r, Err(TransportError::PeerClosed { rank: 0, .. }))
    };
    assert!(closed(rig.write(1, 3)));
    assert!(closed(rig.tx.post_send(2, b"x", 4)));
    assert!(closed(rig.tx.poll(&mut Vec::new())));
    assert!(closed(rig.tx.wait(Duration::from_millis(1))));
    let e = rig.write(2, 5).unwrap_err();
    assert!(
        e.to_string().contains("killed by the fault injector"),
        "{e}"
    );
    assert_eq!(e.peer(), Some(2));
    // Only the two writes before the kill arrived.
    assert_eq!(rig.poll_peer(1).len(), 1);
    assert_eq!(rig.poll_peer(2).len(), 1);
}

#[test]
fn only_peer_limits_faults_to_one_link() {
    let cfg = FaultConfig {
        seed: 5,
        corrupt_writes: 1.0,
        only_peer: Some(2),
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(3, cfg);
    rig.write(1, 1).unwrap();
    rig.write(2, 2).unwrap();
    let mut done = rig.poll_tx();
    done.sort_by_key(|c| match c {
        Completion::WriteDone { wr_id } => *wr_id,
        _ => u64::MAX,
    });
    assert_eq!(
        done,
        vec![
            Completion::WriteDone { wr_id: 1 },
            Completion::WriteDone { wr_id: 2 }
        ]
    );
    assert_eq!(&rig.dst[1][..], &rig.expected()[..], "link 0 -> 1 is clean");
    assert_eq!(diff_positions(&rig.dst[2], &rig.expected()).len(), 1);
    let s = rig.tx.stats();
    assert_eq!((s.writes, s.corrupted), (1, 1));
}

#[test]
fn sends_and_registrations_pass_through() {
    let cfg = FaultConfig {
        drop_writes: 1.0,
        corrupt_writes: 1.0,
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(2, cfg);
    rig.tx.post_send(1, b"credit", 9).unwrap();
    assert_eq!(rig.poll_tx(), vec![Completion::SendDone { wr_id: 9 }]);
    assert_eq!(
        rig.poll_peer(1),
        vec![Completion::Recv {
            peer: 0,
            data: b"credit".to_vec()
        }]
    );
    let mr = rig.head_mr;
    rig.tx.deregister(&mr);
    assert_eq!(rig.tx.rank(), 0);
    assert_eq!(rig.tx.world(), 2);
}

#[test]
fn corrupt_sends_flip_one_byte_past_the_skip_to_the_subject_peer_only() {
    let cfg = FaultConfig {
        corrupt_sends: 1.0,
        corrupt_skip: 8,
        only_peer: Some(2),
        ..FaultConfig::default()
    };
    let mut rig = Rig::new(3, cfg);
    let msg: Vec<u8> = (0..40).collect();
    rig.tx.post_send(1, &msg, 1).unwrap();
    rig.tx.post_send(2, &msg, 2).unwrap();
    // Too short to reach past the skip: left whole.
    rig.tx.post_send(2, &msg[..8], 3).unwrap();
    let got = |c: Vec<Completion>| match &c[..] {
        [Completion::Recv { data, .. }] => data.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(got(rig.poll_peer(1)), msg, "rank 1 is not the subject");
    let mut to2 = rig.poll_peer(2).into_iter();
    let Some(Completion::Recv { data, .. }) = to2.next() else {
        panic!("no message to rank 2")
    };
    let d = diff_positions(&data, &msg);
    assert_eq!(d.len(), 1, "one byte flipped");
    assert!(d[0] >= 8, "at or past the skip: {d:?}");
    assert!(matches!(to2.next(), Some(Completion::Recv { data, .. }) if data == msg[..8]));
    assert_eq!(rig.tx.stats().corrupted_sends, 1);
}

#[test]
fn shared_memory_keeps_its_board_and_capabilities_inside_the_injector() {
    use gradsync_transport::Route;
    let local = [0, 1, 2];
    let mut eps =
        gradsync_transport::shm::ShmSetup::in_process(3, &local, Duration::from_secs(10)).unwrap();
    let e2 = eps.pop().unwrap();
    let mut e1 = eps.pop().unwrap();
    let e0 = eps.pop().unwrap();
    let cap = e1.board().expect("shared memory has a board").capacity();
    let cfg = FaultConfig {
        corrupt_postings: 1.0,
        corrupt_skip: 4,
        only_peer: Some(2),
        ..FaultConfig::default()
    };
    let mut f0 = FaultyEndpoint::new(e0, cfg);
    let mut f2 = FaultyEndpoint::new(e2, FaultConfig::default());
    // Every capability comes through the wrapper.
    for p in [1, 2] {
        assert_eq!(f0.caps(p), f0.inner().caps(p));
        assert_eq!(f0.caps(p).route, Route::Shm);
        assert!(f0.caps(p).mapped);
    }
    assert!(f0.shared_memory().is_some());
    assert_eq!(
        f0.board()
            .expect("the board survives the wrapper")
            .capacity(),
        cap
    );
    // Rank 1 and rank 2 post; rank 0 reads both through the wrapper: only what comes from its
    // subject peer, rank 2, is damaged, past the skip.
    let post: Vec<u8> = (0..32).collect();
    assert!(e1.board().unwrap().post(1, &post).unwrap());
    assert!(f2.board().unwrap().post(1, &post).unwrap());
    let b = f0.board().unwrap();
    let mut out = Vec::new();
    assert!(b.read(1, 1, &mut out).unwrap());
    assert_eq!(out, post, "the link from rank 1 is clean");
    assert!(b.read(2, 1, &mut out).unwrap());
    let d = diff_positions(&out, &post);
    assert_eq!(
        d.len(),
        1,
        "one byte flipped in the posting read from rank 2"
    );
    assert!(d[0] >= 4);
    assert_eq!(f0.stats().corrupted_postings, 1);
    // Release and watch go through to the board underneath: rank 1 may post under 3 (slot 1)
    // only once every peer released 1.
    f0.board().unwrap().release(1).unwrap();
    f2.board().unwrap().release(1).unwrap();
    f0.board().unwrap().watch(3);
    assert!(e1.board().unwrap().post(3, &post).unwrap());
}
