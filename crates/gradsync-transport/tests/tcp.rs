//! TCP backend: writes land in place, bad keys and out-of-range writes are errors naming the
//! peer, and a closed peer is noticed.

use gradsync_transport::tcp::{self, TcpEndpoint, TcpOptions};
use gradsync_transport::{Access, Completion, Endpoint, RemoteRegion, Sge, TransportError};
use std::time::{Duration, Instant};

fn pair(nsocks: usize) -> (TcpEndpoint, TcpEndpoint) {
    let l0 = tcp::listen("127.0.0.1".parse().unwrap()).unwrap();
    let l1 = tcp::listen("127.0.0.1".parse().unwrap()).unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let opts = TcpOptions {
        nsocks,
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let a2 = addrs.clone();
    let o2 = opts.clone();
    let h = std::thread::spawn(move || TcpEndpoint::establish(1, &a2, l1, 7, &o2).unwrap());
    let e0 = TcpEndpoint::establish(0, &addrs, l0, 7, &opts).unwrap();
    (e0, h.join().unwrap())
}

/// Polls `ep` until `f` accepts a completion or an error occurs.
fn poll_until(
    ep: &mut TcpEndpoint,
    mut f: impl FnMut(&Completion) -> bool,
) -> Result<(), TransportError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    loop {
        ep.poll(&mut out)?;
        if out.iter().any(&mut f) {
            return Ok(());
        }
        out.clear();
        assert!(Instant::now() < deadline, "nothing arrived within 10 s");
        ep.wait(Duration::from_millis(50))?;
    }
}

#[test]
fn write_with_immediate_lands_in_place() {
    for nsocks in [1, 3] {
        let (mut e0, mut e1) = pair(nsocks);
        let mut dst = vec![0u8; 1 << 20];
        // SAFETY: dst outlives the endpoint's use of it in this test.
        let mr = unsafe { e1.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }.unwrap();
        let src: Vec<u8> = (0..200_004u32).map(|i| (i * 7 % 251) as u8).collect();
        // SAFETY: src outlives the write (we poll until WriteDone below).
        let smr =
            unsafe { e0.register(src.as_ptr() as *mut u8, src.len(), Access::LOCAL_READ) }.unwrap();
        for k in 0..4u32 {
            let sge = [Sge {
                addr: src.as_ptr() as usize + k as usize,
                len: src.len() - 4,
                lkey: smr.lkey,
            }];
            // SAFETY: as above.
            unsafe { e0.post_write(1, &sge, mr.remote(), 250_000 * k as u64, Some(k), k as u64) }
                .unwrap();
        }
        let mut imms = Vec::new();
        poll_until(&mut e1, |c| {
            if let Completion::WriteImm { peer: 0, imm, len } = c {
                assert_eq!(*len as usize, src.len() - 4);
                imms.push(*imm);
            }
            imms.len() == 4
        })
        .unwrap();
        imms.sort();
        assert_eq!(imms, vec![0, 1, 2, 3]);
        let mut done = 0;
        poll_until(&mut e0, |c| {
            done += matches!(c, Completion::WriteDone { .. }) as usize;
            done == 4
        })
        .unwrap();
        for k in 0..4usize {
            let at = 250_000 * k;
            assert!(
                dst[at..at + src.len() - 4] == src[k..k + src.len() - 4],
                "write {k} landed wrong"
            );
        }
        // Two-sided send.
        e1.post_send(0, b"credit", 9).unwrap();
        poll_until(
            &mut e0,
            |c| matches!(c, Completion::Recv { peer: 1, data } if data == b"credit"),
        )
        .unwrap();
    }
}

/// Writes with immediate of 64 KiB and more to a peer of several streams are striped over
/// them: each completes once, whole (one immediate, the full length), in the order posted, its
/// bytes in place, whatever its gather list; smaller writes and sends go whole, as before.
#[test]
fn striped_writes_complete_whole_and_in_order() {
    for nsocks in [2, 3, 5] {
        let (mut e0, mut e1) = pair(nsocks);
        let mut dst = vec![0u8; 8 << 20];
        // SAFETY: dst outlives the endpoint's use of it in this test.
        let mr = unsafe { e1.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }.unwrap();
        let src: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 13 % 241) as u8).collect();
        // SAFETY: src outlives the writes (we poll until every WriteDone below).
        let smr =
            unsafe { e0.register(src.as_ptr() as *mut u8, src.len(), Access::LOCAL_READ) }.unwrap();
        // (length, pieces of the gather list); below 64 KiB a write is not striped.
        let writes = [
            (65_535, 1),
            (65_536, 1),
            (100_003, 3),
            (1 << 20, 2),
            (4096, 1),
            (1_500_001, 7),
            (65_600, 5),
        ];
        let mut at = 0usize;
        let mut placed = Vec::new();
        for (k, &(len, pieces)) in writes.iter().enumerate() {
            // Pieces of uneven length, from different places of src.
            let mut sges = Vec::new();
            let mut left = len;
            for j in 0..pieces {
                let n = if j + 1 == pieces { left } else { left / 3 + j };
                sges.push(Sge {
                    addr: src.as_ptr() as usize + (j * 4099) % 1000,
                    len: n,
                    lkey: smr.lkey,
                });
                left -= n;
            }
            // SAFETY: as above.
            unsafe { e0.post_write(1, &sges, mr.remote(), at as u64, Some(k as u32), k as u64) }
                .unwrap();
            if k == 2 {
                e0.post_send(1, b"between", 99).unwrap();
            }
            placed.push((at, sges));
            at += len + 7;
        }
        let mut imms = Vec::new();
        let mut recv = false;
        poll_until(&mut e1, |c| {
            match c {
                Completion::WriteImm { peer: 0, imm, len } => {
                    assert_eq!(*len as usize, writes[*imm as usize].0, "write {imm}");
                    imms.push(*imm);
                }
                Completion::Recv { peer: 0, data } => recv = data == b"between",
                other => panic!("unexpected {other:?}"),
            }
            imms.len() == writes.len() && recv
        })
        .unwrap();
        // The striped ones (64 KiB and more) in the order posted.
        let striped: Vec<u32> = imms
            .iter()
            .copied()
            .filter(|&k| writes[k as usize].0 >= 65_536)
            .collect();
        assert_eq!(striped, vec![1, 2, 3, 5, 6], "nsocks {nsocks}: {imms:?}");
        let mut done = Vec::new();
        poll_until(&mut e0, |c| {
            match c {
                Completion::WriteDone { wr_id } => done.push(*wr_id),
                Completion::SendDone { wr_id: 99 } => {}
                other => panic!("unexpected {other:?}"),
            }
            done.len() == writes.len()
        })
        .unwrap();
        done.sort();
        assert_eq!(done, (0..writes.len() as u64).collect::<Vec<_>>());
        for (k, (at, sges)) in placed.iter().enumerate() {
            let mut want = Vec::new();
            for s in sges {
                let off = s.addr - src.as_ptr() as usize;
                want.extend_from_slice(&src[off..off + s.len]);
            }
            assert!(
                dst[*at..*at + want.len()] == want[..],
                "nsocks {nsocks}: write {k} landed wrong"
            );
        }
    }
}

#[test]
fn bad_key_is_an_error_naming_the_peer() {
    let (mut e0, mut e1) = pair(1);
    let mut dst = vec![0u8; 4096];
    // SAFETY: dst outlives the endpoint's use of it in this test.
    let mr = unsafe { e1.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }.unwrap();
    let src = [1u8; 64];
    // SAFETY: src outlives the write.
    let smr = unsafe { e0.register(src.as_ptr() as *mut u8, 64, Access::LOCAL_READ) }.unwrap();
    let sge = [Sge {
        addr: src.as_ptr() as usize,
        len: 64,
        lkey: smr.lkey,
    }];
    let wrong = RemoteRegion {
        addr: 0,
        rkey: mr.rkey ^ 0x5555,
        len: 4096,
    };
    // SAFETY: as above.
    unsafe { e0.post_write(1, &sge, wrong, 0, Some(1), 1) }.unwrap();
    let err = poll_until(&mut e1, |_| false).unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::BadKey {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("peer 0"), "{err}");
    assert!(
        dst.iter().all(|&b| b == 0),
        "a rejected write must not touch memory"
    );
}

#[test]
fn out_of_bounds_write_is_an_error_naming_the_peer() {
    let (mut e0, mut e1) = pair(2);
    let mut dst = vec![0u8; 4096];
    // SAFETY: dst outlives the endpoint's use of it in this test.
    let mr = unsafe { e1.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }.unwrap();
    let src = [1u8; 64];
    // SAFETY: src outlives the write.
    let smr = unsafe { e0.register(src.as_ptr() as *mut u8, 64, Access::LOCAL_READ) }.unwrap();
    let sge = [Sge {
        addr: src.as_ptr() as usize,
        len: 64,
        lkey: smr.lkey,
    }];
    // SAFETY: as above.
    unsafe { e0.post_write(1, &sge, mr.remote(), 4096 - 63, Some(1), 1) }.unwrap();
    let err = poll_until(&mut e1, |_| false).unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::OutOfBounds {
                rank: 1,
                peer: 0,
                offset: 4033,
                len: 64,
                ..
            }
        ),
        "{err}"
    );
    assert!(dst.iter().all(|&b| b == 0));
    // A span outside any local region is refused before anything is sent.
    let bad = [Sge {
        addr: src.as_ptr() as usize + 1,
        len: 64,
        lkey: smr.lkey,
    }];
    // SAFETY: the call fails before reading memory.
    let e = unsafe { e0.post_write(1, &bad, mr.remote(), 0, None, 2) }.unwrap_err();
    assert!(matches!(e, TransportError::Invalid { .. }), "{e}");
}

#[test]
fn closed_peer_is_noticed() {
    let (mut e0, e1) = pair(2);
    drop(e1);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut out = Vec::new();
    while e0.peer_alive(1) {
        e0.poll(&mut out).unwrap();
        e0.wait(Duration::from_millis(20)).unwrap();
        assert!(
            Instant::now() < deadline,
            "peer close not noticed within 5 s"
        );
    }
    assert!(matches!(
        e0.post_send(1, b"x", 0),
        Err(TransportError::PeerClosed { peer: 1, .. })
    ));
}

#[test]
fn queued_bytes_are_pending_until_the_peer_drains_them() {
    let (mut e0, mut e1) = pair(1);
    assert!(!e0.tx_pending(), "nothing posted yet");
    // 64 MiB to a peer that does not read: more than the sockets' buffers take at once.
    let len = 64 << 20;
    let mut dst = vec![0u8; len];
    // SAFETY: dst outlives the endpoint's use of it in this test.
    let mr = unsafe { e1.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }.unwrap();
    let src = vec![5u8; len];
    // SAFETY: src outlives the write (we poll until WriteDone below).
    let smr =
        unsafe { e0.register(src.as_ptr() as *mut u8, src.len(), Access::LOCAL_READ) }.unwrap();
    let sge = [Sge {
        addr: src.as_ptr() as usize,
        len,
        lkey: smr.lkey,
    }];
    // SAFETY: as above.
    unsafe { e0.post_write(1, &sge, mr.remote(), 0, Some(1), 1) }.unwrap();
    let mut out = Vec::new();
    e0.poll(&mut out).unwrap();
    assert!(e0.tx_pending(), "64 MiB cannot all be in the socket yet");
    // The peer drains; the writer's polls hand on the rest, then nothing is pending.
    let h = std::thread::spawn(move || {
        poll_until(&mut e1, |c| matches!(c, Completion::WriteImm { .. })).unwrap();
        assert!(dst.iter().all(|&b| b == 5));
    });
    poll_until(&mut e0, |c| matches!(c, Completion::WriteDone { .. })).unwrap();
    assert!(!e0.tx_pending(), "the write is done");
    h.join().unwrap();
}
