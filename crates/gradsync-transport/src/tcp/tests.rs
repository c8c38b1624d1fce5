//! Malformed frames from a connected peer: each is a protocol error naming what the peer did.

use super::endpoint::TcpEndpoint;
use super::options::TcpOptions;
use super::setup::listen;
use super::wire::{FRAME_HEADER_LEN, FrameHeader, FrameHeaderRepr};
use crate::error::{TransportError, Violation};
use crate::verbs::{Endpoint, MAX_SEND};
use crate::wire::WireError;
use std::io::Write;
use std::time::{Duration, Instant};

fn pair() -> (TcpEndpoint, TcpEndpoint) {
    let l0 = listen("127.0.0.1".parse().unwrap()).unwrap();
    let l1 = listen("127.0.0.1".parse().unwrap()).unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let opts = TcpOptions {
        nsocks: 1,
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let (a2, o2) = (addrs.clone(), opts.clone());
    let h = std::thread::spawn(move || TcpEndpoint::establish(1, &a2, l1, 7, &o2).unwrap());
    let e0 = TcpEndpoint::establish(0, &addrs, l0, 7, &opts).unwrap();
    (e0, h.join().unwrap())
}

/// Polls `ep` until it fails (or 10 s pass).
fn poll_err(ep: &mut TcpEndpoint) -> TransportError {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Err(e) = ep.poll(&mut Vec::new()) {
            return e;
        }
        assert!(Instant::now() < deadline, "no error within 10 s");
        ep.wait(Duration::from_millis(20)).unwrap();
    }
}

#[test]
fn malformed_frames_are_typed_protocol_errors() {
    let send = FrameHeaderRepr::Send { len: 8 }.to_bytes();
    let with = |f: &dyn Fn(&mut FrameHeader<&mut [u8]>)| {
        let mut b = send;
        f(&mut FrameHeader::new_unchecked(&mut b[..]));
        b
    };
    let reserved = with(&|h| h.set_reserved(0x01_0000));
    let kind = with(&|h| h.set_kind(9));
    let huge = FrameHeaderRepr::Send {
        len: MAX_SEND as u32 + 1,
    }
    .to_bytes();
    let cases: [([u8; FRAME_HEADER_LEN], Violation, &str); 3] = [
        (
            reserved,
            Violation::FrameHeader {
                error: WireError::Reserved {
                    format: "frame header",
                    found: 0x01_0000,
                },
                header: reserved,
            },
            "reserved bytes set in frame header",
        ),
        (
            kind,
            Violation::FrameHeader {
                error: WireError::UnknownKind {
                    format: "frame",
                    kind: 9,
                },
                header: kind,
            },
            "unknown frame kind 9",
        ),
        (
            huge,
            Violation::OversizedSend {
                len: MAX_SEND as u32 + 1,
                max: MAX_SEND,
            },
            "exceeds the 4096-byte limit",
        ),
    ];
    for (bytes, want, why) in cases {
        let (e0, mut e1) = pair();
        let st = &e0.peers[1].as_ref().unwrap().streams[0];
        (&st.sock).write_all(&bytes).unwrap();
        let e = poll_err(&mut e1);
        assert!(
            matches!(&e, TransportError::Protocol { rank: 1, peer: 0, violation } if *violation == want),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.starts_with("rank 1: protocol error from rank 0: ") && msg.contains(why),
            "{msg}"
        );
    }
}
