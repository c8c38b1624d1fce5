//! Malformed frames from a connected peer: each is a protocol error naming what the peer did;
//! and the frames of a striped write.

use super::endpoint::TcpEndpoint;
use super::options::TcpOptions;
use super::setup::listen;
use super::wire::{FRAME_HEADER_LEN, FrameHeader, FrameHeaderRepr};
use crate::error::{TransportError, Violation};
use crate::verbs::{Access, Endpoint, MAX_SEND, Sge};
use crate::wire::WireError;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn pair() -> (TcpEndpoint, TcpEndpoint) {
    pair_of(1)
}

fn pair_of(nsocks: usize) -> (TcpEndpoint, TcpEndpoint) {
    let l0 = listen("127.0.0.1".parse().unwrap()).unwrap();
    let l1 = listen("127.0.0.1".parse().unwrap()).unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let opts = TcpOptions {
        nsocks,
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

/// A write with immediate of 64 KiB and more to a peer of several streams leaves as one part
/// per stream, part i on stream i, in shares that tile the write; a smaller one leaves whole.
#[test]
fn writes_are_striped_one_part_per_stream() {
    let (mut e0, mut e1) = pair_of(3);
    let mut dst = vec![0u8; 1 << 20];
    // SAFETY: dst outlives the endpoint's use of it in this test.
    let mr = unsafe { e1.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }.unwrap();
    let src = vec![5u8; 200_001];
    // SAFETY: src outlives the write (the frames are read back below).
    let smr =
        unsafe { e0.register(src.as_ptr() as *mut u8, src.len(), Access::LOCAL_READ) }.unwrap();
    let sge = |len| {
        [Sge {
            addr: src.as_ptr() as usize,
            len,
            lkey: smr.lkey,
        }]
    };
    // SAFETY: as above.
    unsafe { e0.post_write(1, &sge(200_001), mr.remote(), 1000, Some(42), 1) }.unwrap();
    // SAFETY: as above.
    unsafe { e0.post_write(1, &sge(65_535), mr.remote(), 0, Some(43), 2) }.unwrap();
    let header = |i: usize| {
        let st = &e1.peers[0].as_ref().unwrap().streams[i];
        st.sock.set_nonblocking(false).unwrap();
        st.sock
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut h = [0u8; FRAME_HEADER_LEN];
        (&st.sock).read_exact(&mut h).unwrap();
        let repr = FrameHeaderRepr::parse(&FrameHeader::new_unchecked(&h[..])).unwrap();
        let mut payload = vec![0u8; repr.payload_len() as usize];
        (&st.sock).read_exact(&mut payload).unwrap();
        repr
    };
    let mut next = 1000;
    for i in 0..3u8 {
        let FrameHeaderRepr::WritePart {
            offset,
            len,
            imm: 42,
            part,
            parts: 3,
            ..
        } = header(i as usize)
        else {
            panic!("stream {i} did not carry part {i} of 3 of write 42");
        };
        assert_eq!((part, offset), (i, next), "part {i}");
        next += u64::from(len);
    }
    assert_eq!(next, 1000 + 200_001, "the parts do not tile the write");
    // The small write went whole, on the next stream in turn.
    assert!(matches!(
        header(0),
        FrameHeaderRepr::Write {
            len: 65_535,
            imm: Some(43),
            ..
        }
    ));
}

/// The parts of a striped write must fit the pair's streams and one another.
#[test]
fn malformed_parts_are_protocol_errors() {
    let part = |imm, part, parts, rkey| FrameHeaderRepr::WritePart {
        rkey,
        offset: 0,
        len: 8,
        imm,
        part,
        parts,
    };
    // A part of 2 on a pair of one stream.
    let (e0, mut e1) = pair();
    let st = &e0.peers[1].as_ref().unwrap().streams[0];
    (&st.sock).write_all(&part(1, 0, 2, 0).to_bytes()).unwrap();
    let e = poll_err(&mut e1);
    assert!(
        matches!(&e, TransportError::Protocol { rank: 1, peer: 0, violation: Violation::Stripe { why } } if why.contains("part 0 of 2 on stream 0 of 1")),
        "{e}"
    );
    // Part 1 on stream 0.
    let (e0, mut e1) = pair_of(2);
    let st = &e0.peers[1].as_ref().unwrap().streams[0];
    (&st.sock).write_all(&part(1, 1, 2, 0).to_bytes()).unwrap();
    let e = poll_err(&mut e1);
    assert!(
        matches!(&e, TransportError::Protocol { violation: Violation::Stripe { why }, .. } if why.contains("part 1 of 2 on stream 0 of 2")),
        "{e}"
    );
    // The two parts of one write with different immediates.
    let (e0, mut e1) = pair_of(2);
    let mut dst = vec![0u8; 64];
    // SAFETY: dst outlives the endpoint's use of it in this test.
    let mr = unsafe { e1.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }.unwrap();
    let streams = &e0.peers[1].as_ref().unwrap().streams;
    for (i, imm) in [(0u8, 1u32), (1, 2)] {
        let mut frame = part(imm, i, 2, mr.remote().rkey).to_bytes().to_vec();
        frame.extend_from_slice(&[0u8; 8]);
        (&streams[i as usize].sock).write_all(&frame).unwrap();
    }
    let e = poll_err(&mut e1);
    assert!(
        matches!(&e, TransportError::Protocol { violation: Violation::Stripe { why }, .. } if why.contains("immediate")),
        "{e}"
    );
    drop(dst);
}
