//! Waiting, closing, peers that go away, and connection setup that fails.

use super::{LONG, collect, fabric, pair, remote, tag};
use crate::error::TransportError;
use crate::shm::layout::RING_BYTES;
use crate::shm::liveness::{pidfd_exited, pidfd_open};
use crate::shm::setup::ShmSetup;
use crate::shm::wire::ShmInfo;
use crate::verbs::{Completion, Endpoint, MAX_SEND};
use std::thread;
use std::time::{Duration, Instant};

#[test]
fn wait_times_out_and_wakes_on_post() {
    let (mut e0, mut e1) = pair();
    let t = Instant::now();
    e1.wait(Duration::from_millis(40)).unwrap();
    let idle = t.elapsed();
    assert!(idle >= Duration::from_millis(30), "{idle:?}");
    assert!(idle < Duration::from_secs(1), "{idle:?}");

    let tx = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        e0.post_send(1, &[9, 0, 0, 0], 1).unwrap();
        e0
    });
    let t = Instant::now();
    let mut out = Vec::new();
    while out.is_empty() {
        e1.wait(LONG).unwrap();
        e1.poll(&mut out).unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "no wakeup");
    }
    let woke = t.elapsed();
    assert!(woke >= Duration::from_millis(20), "{woke:?}");
    assert_eq!(tag(&out[0]), 9);
    let _e0 = tx.join().unwrap();
}

#[test]
fn close_and_drop_are_noticed() {
    let mut eps = fabric(3);
    let e2 = eps.pop().unwrap();
    let mut e1 = eps.pop().unwrap();
    let mut e0 = eps.pop().unwrap();
    assert!(e1.peer_alive(0) && e1.peer_alive(2) && !e1.peer_alive(1));
    // Sent before the close, delivered after it.
    e0.post_send(1, &[4, 0, 0, 0], 1).unwrap();
    e0.close(Duration::from_secs(1));
    assert!(!e0.peer_alive(1));
    // A closed peer stays alive until what it sent before closing has been read.
    assert!(e1.peer_alive(0));
    assert_eq!(tag(&collect(&mut e1, 1, remote)[0]), 4);
    assert!(!e1.peer_alive(0));
    let e = e1.post_send(0, b"x", 2).unwrap_err();
    assert!(
        matches!(e, TransportError::PeerClosed { peer: 0, .. }),
        "{e}"
    );
    let e = e0.post_send(1, b"x", 3).unwrap_err();
    assert!(matches!(e, TransportError::PeerClosed { .. }), "{e}");
    let mut out = Vec::new();
    e0.poll(&mut out).unwrap();
    assert_eq!(out, [Completion::SendDone { wr_id: 1 }]);
    drop(e2);
    assert!(!e1.peer_alive(2));
    assert!(e1.post_send(2, b"x", 4).is_err());
    e1.wait(Duration::from_millis(1)).unwrap();
}

/// Two ranks that close at the same moment, each with more queued for the other than its
/// ring holds, both finish: a closing rank keeps reading (and dropping) what it is sent.
#[test]
fn simultaneous_close_with_full_rings_finishes() {
    let (mut e0, mut e1) = pair();
    let msg = [7u8; MAX_SEND];
    for i in 0..(2 * RING_BYTES / MAX_SEND) as u64 {
        e0.post_send(1, &msg, i).unwrap();
        e1.post_send(0, &msg, i).unwrap();
    }
    let timeout = Duration::from_secs(20);
    let t = Instant::now();
    let h = thread::spawn(move || e1.close(timeout));
    e0.close(timeout);
    h.join().unwrap();
    assert!(t.elapsed() < timeout / 2, "close took {:?}", t.elapsed());
}

/// A pidfd keeps naming its process: once that process has exited (and been reaped, so
/// its pid may be reused), the check says so.
#[test]
fn pidfd_notices_an_exited_process() {
    let me = pidfd_open(std::process::id()).expect("pidfd_open of this process");
    assert!(!pidfd_exited(&me));
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let fd = pidfd_open(child.id());
    child.wait().unwrap();
    if let Some(fd) = fd {
        assert!(pidfd_exited(&fd));
    }
}

#[test]
fn connect_fails_fast_or_times_out() {
    // A peer that gave up (its setup dropped) makes connect fail without waiting.
    let local = [0, 1];
    let (s0, i0) = ShmSetup::new(0, 2, &local).unwrap();
    let (s1, i1) = ShmSetup::new(1, 2, &local).unwrap();
    drop(s1);
    let t = Instant::now();
    assert!(s0.connect(&[i0, i1], LONG).is_err());
    assert!(t.elapsed() < Duration::from_secs(2));
    // A peer that never connects: a timeout naming it.
    let (s0, i0) = ShmSetup::new(0, 2, &local).unwrap();
    let (_s1, i1) = ShmSetup::new(1, 2, &local).unwrap();
    let e = s0
        .connect(&[i0, i1], Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("[1]"), "{e}");
    // Infos that do not match the segments.
    let (s0, i0) = ShmSetup::new(0, 2, &local).unwrap();
    let (_s1, i1) = ShmSetup::new(1, 2, &local).unwrap();
    let forged = ShmInfo {
        nonce: i1.nonce ^ 1,
        ..i1
    };
    let e = s0.connect(&[i0, forged], LONG).unwrap_err();
    assert!(matches!(e, TransportError::Protocol { peer: 1, .. }), "{e}");
}
