//! Unit tests of the protocol machine: each rule, fed events by hand.

use super::*;
use crate::schedule::{Buf, Loc, Op, Program, Schedule};
use crate::wire::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr, Signature};
use crate::{Collective, DataType, ReduceOp};
use std::time::{Duration, Instant};

/// Asserts that the error `e` is a violation by rank `peer` that matches the pattern.
macro_rules! assert_violation {
    ($e:expr, $peer:expr, $pat:pat) => {{
        let e = &$e;
        assert!(
            matches!(e, ProtoError::Violation { peer, violation: $pat } if *peer == $peer),
            "{e}"
        );
    }};
}

fn cfg(rank: usize, world: usize) -> Config {
    Config {
        rank,
        world,
        nslots: 2,
        slot_bytes: 64,
        direct_min: usize::MAX,
        checksum: false,
    }
}

fn sig(seq: u64, count: u64) -> Signature {
    Signature {
        comm_id: 7,
        seq,
        coll: Collective::AllReduce,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        count,
        root: 0,
    }
}

/// A schedule of `n` independent ops, op `i` made by `op(i)`.
fn independent(n: usize, world: usize, op: impl Fn(usize) -> Op) -> Box<Schedule> {
    let mut p = Program::new();
    for i in 0..n {
        p.push(op(i), &[]);
    }
    Box::new(Schedule::new(p, world))
}

/// A program of `n` sends of `len` elements to `peer`.
fn sends(peer: usize, n: usize, len: usize, world: usize) -> Box<Schedule> {
    independent(n, world, |i| Op::Send {
        peer,
        src: Loc::new(Buf::Input, i * len),
        len,
    })
}

/// A program of `n` receives of `len` elements from `peer`.
fn recvs(peer: usize, n: usize, len: usize, world: usize) -> Box<Schedule> {
    independent(n, world, |i| Op::Recv {
        peer,
        dst: Loc::new(Buf::Output, i * len),
        reduce_with: None,
        len,
    })
}

fn actions(p: &mut Protocol) -> Vec<Action> {
    let mut v = Vec::new();
    while let Some(a) = p.poll_action().unwrap() {
        v.push(a);
    }
    v
}

fn header_bytes(h: &DataHeaderRepr) -> [u8; DATA_HEADER_LEN] {
    let mut b = [0u8; DATA_HEADER_LEN];
    h.emit(&mut DataHeader::new_unchecked(&mut b[..]));
    b
}

#[test]
fn sends_wait_for_credits_and_go_in_slot_order() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(0, 2), now);
    p.set_window(1, 2);
    p.start(sig(1, 12), sends(1, 3, 4, 2), Mode::Slots, [0; 3], now);
    let a = actions(&mut p);
    // Two slots, so two writes; the third waits for a credit.
    let writes: Vec<_> = a
        .iter()
        .filter_map(|a| match a {
            Action::Write {
                wr,
                to: Target::Slot { slot, offset, .. },
                imm,
                ..
            } => Some((*wr, *slot, *offset, *imm)),
            _ => None,
        })
        .collect();
    assert_eq!(writes.len(), 2, "{a:?}");
    assert_eq!((writes[0].1, writes[0].3), (0, 0));
    assert_eq!((writes[1].1, writes[1].3), (1, 1));
    // Rank 0's part of the peer's inbox starts at 0; slot 1 one stride further.
    assert_eq!(writes[1].2 as usize, cfg(0, 2).stride());
    assert!(actions(&mut p).is_empty());
    for (wr, ..) in &writes {
        p.handle_write_done(*wr);
    }
    assert!(actions(&mut p).is_empty(), "no credit yet");
    p.handle_message(1, ControlReprExt::credit(1), now).unwrap();
    let a = actions(&mut p);
    assert!(
        matches!(
            a[..],
            [Action::Write {
                imm: 2,
                to: Target::Slot { slot: 0, .. },
                ..
            }]
        ),
        "{a:?}"
    );
    // More credits than the window is a violation naming the peer.
    let e = p
        .handle_message(1, ControlReprExt::credit(3), now)
        .unwrap_err();
    assert_violation!(e, 1, Violation::TooManyCredits { returned: 3, .. });
}

/// Builds control messages for the tests.
struct ControlReprExt;

impl ControlReprExt {
    fn credit(count: u32) -> Vec<u8> {
        crate::wire::ControlRepr::Credit { count }.to_vec()
    }
}

#[test]
fn arrivals_are_consumed_in_order_and_credits_go_back_in_batches() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(1, 2), now);
    p.start(sig(1, 8), recvs(0, 2, 4, 2), Mode::Slots, [0; 3], now);
    assert!(actions(&mut p).is_empty());
    let h = |msg| DataHeaderRepr {
        sig: sig(1, 8),
        msg,
        payload_len: 16,
        sender: 0,
        crc32c: None,
    };
    // Message 1 lands first (another stream): it waits for message 0.
    let b1 = header_bytes(&h(1));
    p.handle_write_imm(0, 1, 80, now, |k| {
        assert_eq!(k, 1);
        &b1[..]
    })
    .unwrap();
    assert!(actions(&mut p).is_empty());
    let b0 = header_bytes(&h(0));
    p.handle_write_imm(0, 0, 80, now, |_| &b0[..]).unwrap();
    let a = actions(&mut p);
    let delivered: Vec<u32> = a
        .iter()
        .filter_map(|a| match a {
            Action::Deliver { msg, .. } => Some(*msg),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, [0, 1]);
    // Both slots consumed: half the window (1) is due at once, so credits went back.
    assert!(
        a.iter().any(|a| matches!(
            a,
            Action::Control {
                peer: 0,
                msg: crate::wire::ControlRepr::Credit { .. },
                ..
            }
        )),
        "{a:?}"
    );
    assert!(p.is_done());
}

#[test]
fn writes_outside_the_window_or_unasked_are_violations() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(1, 2), now);
    p.start(sig(1, 8), recvs(0, 2, 4, 2), Mode::Slots, [0; 3], now);
    let e = p.handle_write_imm(0, 5, 80, now, |_| &[]).unwrap_err();
    assert_violation!(e, 0, Violation::UnknownSlot { imm: 5, .. });
    let e = p
        .handle_write_imm(0, IMM_DIRECT | 3, 16, now, |_| &[])
        .unwrap_err();
    assert_violation!(e, 0, Violation::UnsolicitedDirect { msg: 3, len: 16 });
    // A slot longer than a slot.
    let e = p.handle_write_imm(0, 0, 4096, now, |_| &[]).unwrap_err();
    assert_violation!(e, 0, Violation::UnknownSlot { .. });
}

#[test]
fn a_header_of_another_call_is_a_mismatch_and_a_missing_checksum_is_refused() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(1, 2), now);
    p.start(sig(1, 8), recvs(0, 1, 4, 2), Mode::Slots, [0; 3], now);
    let mut other = sig(1, 8);
    other.op = ReduceOp::Max;
    let b = header_bytes(&DataHeaderRepr {
        sig: other,
        msg: 0,
        payload_len: 16,
        sender: 0,
        crc32c: None,
    });
    p.handle_write_imm(0, 0, 80, now, |_| &b[..]).unwrap();
    let e = p.poll_action().unwrap_err();
    assert!(matches!(e, ProtoError::Mismatch { peer: 0, .. }), "{e}");

    let mut c = cfg(1, 2);
    c.checksum = true;
    let mut p = Protocol::new(c, now);
    p.start(sig(1, 8), recvs(0, 1, 4, 2), Mode::Slots, [0; 3], now);
    let b = header_bytes(&DataHeaderRepr {
        sig: sig(1, 8),
        msg: 0,
        payload_len: 16,
        sender: 0,
        crc32c: None,
    });
    p.handle_write_imm(0, 0, 80, now, |_| &b[..]).unwrap();
    let e = p.poll_action().unwrap_err();
    assert_violation!(e, 0, Violation::MissingChecksum { msg: 0, .. });
}

fn eager_message(seq: u64, sender: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = header_bytes(&DataHeaderRepr {
        sig: sig(seq, payload.len() as u64 / 4),
        msg: 0,
        payload_len: payload.len() as u32,
        sender,
        crc32c: None,
    })
    .to_vec();
    m.extend_from_slice(payload);
    m
}

/// Operations numbered past the last one and then numbered again from it (the calibration at
/// init) leave no trace: a peer's eager message for the next collective, arriving while this
/// rank is between operations, is kept for it, not taken for a late one.
#[test]
fn renumbered_operations_leave_no_late_mark() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(1, 2), now);
    for seq in 1..=3 {
        p.start(sig(seq, 1), recvs(0, 1, 1, 2), Mode::Eager, [0; 3], now);
        p.handle_message(0, eager_message(seq, 0, &[0; 4]), now)
            .unwrap();
        actions(&mut p);
        assert!(p.is_done());
        p.finish();
    }
    let e = p
        .handle_message(0, eager_message(2, 0, &[0; 4]), now)
        .unwrap_err();
    assert_violation!(e, 0, Violation::Late { done: 3, .. });
    p.renumber(1);
    assert_eq!(p.current_seq(), 1);
    p.handle_message(0, eager_message(2, 0, &[2; 4]), now)
        .unwrap();
    p.start(sig(2, 1), recvs(0, 1, 1, 2), Mode::Eager, [0; 3], now);
    actions(&mut p);
    assert_eq!(p.eager_payload(0), &[2u8; 4]);
    assert!(p.is_done());
    p.finish();
}

#[test]
fn eager_messages_are_kept_until_their_call_and_never_late() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(1, 2), now);
    // Messages for calls 1 to 4 arrive before this rank starts any; a fifth is too many.
    for seq in 1..=4 {
        p.handle_message(0, eager_message(seq, 0, &[seq as u8; 4]), now)
            .unwrap();
    }
    let e = p
        .handle_message(0, eager_message(5, 0, &[0; 4]), now)
        .unwrap_err();
    assert_violation!(e, 0, Violation::TooFarAhead { max: 4 });
    // Call 1 runs eagerly: its receive takes message 1.
    p.start(sig(1, 1), recvs(0, 1, 1, 2), Mode::Eager, [0; 3], now);
    let a = actions(&mut p);
    assert!(
        matches!(
            a[..],
            [Action::DeliverEager {
                peer: 0,
                len: 1,
                ..
            }]
        ),
        "{a:?}"
    );
    assert_eq!(p.eager_payload(0), &[1u8; 4]);
    assert!(p.is_done());
    p.finish();
    // A message for call 1 again is late.
    let e = p
        .handle_message(0, eager_message(1, 0, &[0; 4]), now)
        .unwrap_err();
    assert_violation!(e, 0, Violation::Late { done: 1, .. });
    // One whose header names another sender, or does not match its length.
    let e = p
        .handle_message(0, eager_message(6, 1, &[0; 4]), now)
        .unwrap_err();
    assert_violation!(e, 0, Violation::BadFraming { .. });
    // Call 2 runs through slots here: the peer's eager message for it is a mismatch.
    p.start(sig(2, 1), recvs(0, 1, 1, 2), Mode::Slots, [0; 3], now);
    let e = p.poll_action().unwrap_err();
    assert!(
        matches!(e, ProtoError::Mismatch { peer: 0, ref detail, .. } if detail.contains("eagerly")),
        "{e}"
    );
}

#[test]
fn board_postings_retry_until_accepted_and_are_released() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(0, 2), now);
    p.enable_board(true);
    let mut prog = Program::new();
    let post = prog.push(
        Op::Post {
            src: Loc::new(Buf::Input, 0),
            len: 1,
        },
        &[],
    );
    prog.push(
        Op::Recv {
            peer: 1,
            dst: Loc::new(Buf::Scratch, 1),
            reduce_with: None,
            len: 1,
        },
        &[],
    );
    let _ = post;
    p.start(
        sig(3, 1),
        Box::new(Schedule::new(prog, 2)),
        Mode::Eager,
        [0; 3],
        now,
    );
    let a = actions(&mut p);
    assert!(
        a.iter().any(|a| matches!(a, Action::BoardWatch { seq: 3 })),
        "{a:?}"
    );
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Post { board: true, .. })),
        "{a:?}"
    );
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::BoardRead { peer: 1, seq: 3 })),
        "{a:?}"
    );
    p.handle_posted(false);
    p.handle_board_read(1, 3, false).unwrap();
    // Nothing again in the same round.
    assert!(actions(&mut p).is_empty());
    p.handle_round(now, true);
    let a = actions(&mut p);
    assert!(a.iter().any(|a| matches!(a, Action::Post { .. })), "{a:?}");
    p.handle_posted(true);
    // A posting's header carries sequence number 0; the number it was read under stands for
    // it.
    let mut posting = eager_message(3, 1, &[9; 4]);
    DataHeader::new_unchecked(&mut posting[..]).set_seq(0);
    p.board_buf(1).clear();
    p.board_buf(1).extend_from_slice(&posting);
    p.handle_board_read(1, 3, true).unwrap();
    let a = actions(&mut p);
    assert!(
        matches!(a[..], [Action::DeliverEager { peer: 1, .. }]),
        "{a:?}"
    );
    assert!(p.is_done());
    p.finish();
    // The release of 3 goes out when the next operation starts, before its posting (which
    // carries the release mark to the peers), not between the end of 3 and the return.
    let mut prog = Program::new();
    prog.push(
        Op::Post {
            src: Loc::new(Buf::Input, 0),
            len: 1,
        },
        &[],
    );
    p.start(
        sig(4, 1),
        Box::new(Schedule::new(prog, 2)),
        Mode::Eager,
        [0; 3],
        now,
    );
    let a = actions(&mut p);
    let post = a.iter().position(|a| matches!(a, Action::Post { .. }));
    let release = a
        .iter()
        .position(|a| matches!(a, Action::BoardRelease { seq: 3 }));
    assert!(
        post.is_some() && release < post && release.is_some(),
        "{a:?}"
    );
}

#[test]
fn probes_are_answered_and_judged() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(0, 4), now);
    p.start(sig(5, 1), recvs(1, 1, 1, 4), Mode::Slots, [0; 3], now);
    p.handle_message(2, crate::wire::ControlRepr::Probe.to_vec(), now)
        .unwrap();
    let a = actions(&mut p);
    assert!(
        a.iter().any(|a| matches!(
            a,
            Action::Control {
                peer: 2,
                msg: crate::wire::ControlRepr::ProbeReply {
                    seq: 5,
                    inside: true
                },
                ..
            }
        )),
        "{a:?}"
    );
    let alive = |p: usize| p != 3;
    p.begin_probe(alive);
    let probes = actions(&mut p)
        .iter()
        .filter(|a| {
            matches!(
                a,
                Action::Control {
                    msg: crate::wire::ControlRepr::Probe,
                    ..
                }
            )
        })
        .count();
    assert_eq!(probes, 2, "ranks 1 and 2; rank 3 is gone");
    assert!(!p.probe_settled(alive));
    let reply = |seq, inside| crate::wire::ControlRepr::ProbeReply { seq, inside }.to_vec();
    p.handle_message(2, reply(4, true), now).unwrap();
    let v = p.verdict(alive);
    assert_eq!(v.silent, [1]);
    assert_eq!(v.lost, [3]);
    assert_eq!(v.behind, [(2, 4, true)]);
    let text = VerdictWithin {
        verdict: &v,
        window: Duration::from_millis(100),
    }
    .to_string();
    assert!(
        text.contains("rank 1 did not answer") && text.contains("rank 2 (at seq 4)"),
        "{text}"
    );
    // An abort names its sender and reason; garbage is a violation.
    let e = p
        .handle_message(
            1,
            crate::wire::ControlRepr::Abort {
                reason: "oom".into(),
            }
            .to_vec(),
            now,
        )
        .unwrap_err();
    assert_eq!(
        e,
        ProtoError::PeerAborted {
            peer: 1,
            reason: "oom".into()
        }
    );
    let e = p.handle_message(1, vec![77, 1, 2], now).unwrap_err();
    assert_violation!(e, 1, Violation::BadControl { len: 3, .. });
}

#[test]
fn idle_rounds_return_every_credit() {
    let now = Instant::now();
    let mut c = cfg(1, 2);
    c.nslots = 4;
    let mut p = Protocol::new(c, now);
    p.start(sig(1, 4), recvs(0, 1, 4, 2), Mode::Slots, [0; 3], now);
    let b = header_bytes(&DataHeaderRepr {
        sig: sig(1, 4),
        msg: 0,
        payload_len: 16,
        sender: 0,
        crc32c: None,
    });
    p.handle_write_imm(0, 0, 80, now, |_| &b[..]).unwrap();
    let a = actions(&mut p);
    // One of four slots consumed: below the batch of two, no credit yet.
    assert!(
        !a.iter().any(|a| matches!(a, Action::Control { .. })),
        "{a:?}"
    );
    p.handle_round(now, true);
    assert!(actions(&mut p).is_empty(), "not idle long enough");
    p.handle_round(now + IDLE_CREDIT_RETURN, true);
    let a = actions(&mut p);
    assert!(
        matches!(
            a[..],
            [Action::Control {
                peer: 0,
                msg: crate::wire::ControlRepr::Credit { count: 1 },
                ..
            }]
        ),
        "{a:?}"
    );
}

/// Large direct writes go one per peer and pass: the copy that waits for a write's completion
/// runs before the next write is posted (the all-gather's own block, piece by piece).
#[test]
fn large_direct_writes_are_paced_one_per_round() {
    let now = Instant::now();
    let mut p = Protocol::new(cfg(0, 2), now);
    p.set_direct_min(1, usize::MAX, 1024, 0);
    let len = PACE_MIN / 4;
    let mut prog = Program::new();
    for i in 0..3 {
        let send = prog.push(
            Op::Send {
                peer: 1,
                src: Loc::new(Buf::Input, i * len),
                len,
            },
            &[],
        );
        let dst = Loc::new(Buf::Output, i * len);
        let src = Loc::new(Buf::Input, i * len);
        prog.push(Op::Copy { src, dst, len }, &[send]);
    }
    let s = Signature {
        coll: Collective::AllGather,
        ..sig(1, 3 * len as u64)
    };
    p.start(
        s,
        Box::new(Schedule::new(prog, 2)),
        Mode::Slots,
        [0; 3],
        now,
    );
    for msg in 0..3u32 {
        let cts = crate::wire::Cts {
            msg,
            sig: s,
            rkey: 9,
            bytes: PACE_MIN as u32,
            offset: u64::from(msg) * PACE_MIN as u64,
        };
        p.handle_message(1, crate::wire::ControlRepr::ClearToSend(cts).to_vec(), now)
            .unwrap();
    }
    let direct = |a: &Action| match *a {
        Action::Write {
            wr,
            to: Target::Direct { offset, .. },
            ..
        } => Some((wr, offset)),
        _ => None,
    };
    let is_copy = |a: &Action| matches!(a, Action::Local(Op::Copy { .. }));
    let a = actions(&mut p);
    let w: Vec<_> = a.iter().filter_map(direct).collect();
    assert_eq!(w.len(), 1, "one write in the first pass: {a:?}");
    assert_eq!(w[0].1, 0);
    // Its completion releases its copy, which comes before the second write.
    p.handle_write_done(w[0].0);
    let a = actions(&mut p);
    assert!(a.len() == 2 && is_copy(&a[0]), "{a:?}");
    let w = direct(&a[1]).expect("the second write");
    assert_eq!(w.1, PACE_MIN as u64);
    // The third waits for the next round, not for the second's completion.
    assert!(actions(&mut p).is_empty());
    p.handle_round(now, false);
    let a = actions(&mut p);
    assert_eq!(a.iter().filter_map(direct).count(), 1, "{a:?}");
}

/// Over a pair whose moving collectives write in place only blocks of at least `move_block`
/// bytes, an all-to-all of smaller blocks goes through the slots on both sides (no offer, no
/// waiting for one), and one of larger blocks is offered and waited for.
#[test]
fn small_blocks_of_moving_collectives_go_through_slots() {
    let now = Instant::now();
    // Messages of 64 bytes (16 f32) in blocks of 32 or 64 elements; direct from 64 bytes in
    // blocks of at least 256 bytes.
    let len = 16;
    for (block, direct) in [(32u64, false), (64, true)] {
        let s = Signature {
            coll: Collective::AllToAll,
            ..sig(1, block)
        };
        let cts_sent = |a: &[Action]| {
            a.iter().any(|a| {
                matches!(
                    a,
                    Action::Control {
                        msg: crate::wire::ControlRepr::ClearToSend(_),
                        ..
                    }
                )
            })
        };
        let slot_write = |a: &[Action]| {
            a.iter().any(|a| {
                matches!(
                    a,
                    Action::Write {
                        to: Target::Slot { .. },
                        ..
                    }
                )
            })
        };
        // The receiver offers only the large block's message.
        let mut r = Protocol::new(cfg(0, 2), now);
        r.set_direct_min(1, usize::MAX, 64, 256);
        r.start(s, recvs(1, 1, len, 2), Mode::Slots, [0, 5, 0], now);
        let a = actions(&mut r);
        assert_eq!(cts_sent(&a), direct, "block of {block} elements: {a:?}");
        // The sender writes the small block's message into a slot at once and waits for the
        // offer of the large one.
        let mut t = Protocol::new(cfg(1, 2), now);
        t.set_direct_min(0, usize::MAX, 64, 256);
        t.start(s, sends(0, 1, len, 2), Mode::Slots, [0; 3], now);
        let a = actions(&mut t);
        assert_eq!(slot_write(&a), !direct, "block of {block} elements: {a:?}");
        assert_eq!(
            r.move_direct_min(1, block as usize * 4),
            if direct { 64 } else { usize::MAX }
        );
    }
}
