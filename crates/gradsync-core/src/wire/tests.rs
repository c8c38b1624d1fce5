//! Literal byte-vector tests and property tests of every wire format.

use super::control::{Cts, Kind};
use super::*;
use crate::{Collective, DataType, ReduceOp};
use proptest::prelude::*;

// ---- data header --------------------------------------------------------------------------

static BYTES: [u8; 64] = [
    0x53, 0x47, 0x01, 0x00, 0x00, 0x02, 0x04, 0x00, // magic, version, flags, coll, dtype, op
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // comm id
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // seq 42
    0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // count 1000
    0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, // root 0, msg 5
    0x00, 0x01, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, // len 256, sender 3
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];

fn repr() -> DataHeaderRepr {
    DataHeaderRepr {
        sig: Signature {
            comm_id: 0x0102030405060708,
            seq: 42,
            coll: Collective::AllReduce,
            dtype: DataType::F16,
            op: ReduceOp::Avg,
            count: 1000,
            root: 0,
        },
        msg: 5,
        payload_len: 256,
        sender: 3,
        crc32c: None,
    }
}

/// [`BYTES`] with a checksum: flag bit 0 set, CRC32C 0xe3069283 at offset 48.
static BYTES_CRC: [u8; 64] = [
    0x53, 0x47, 0x01, 0x01, 0x00, 0x02, 0x04,
    0x00, // magic, version, flags (crc32c), coll, dtype, op
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // comm id
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // seq 42
    0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // count 1000
    0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, // root 0, msg 5
    0x00, 0x01, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, // len 256, sender 3
    0x83, 0x92, 0x06, 0xe3, 0, 0, 0, 0, // crc32c, reserved
    0, 0, 0, 0, 0, 0, 0, 0,
];

fn repr_crc() -> DataHeaderRepr {
    DataHeaderRepr {
        crc32c: Some(0xe306_9283),
        ..repr()
    }
}

#[test]
fn emit_literal_with_checksum() {
    let mut buf = [0xffu8; 64];
    repr_crc().emit(&mut DataHeader::new_unchecked(&mut buf[..]));
    assert_eq!(buf, BYTES_CRC);
}

#[test]
fn parse_literal_with_checksum() {
    let h = DataHeader::new_checked(&BYTES_CRC[..]).unwrap();
    assert_eq!(h.flags(), FLAG_CRC32C);
    assert_eq!(h.crc32c(), 0xe306_9283);
    assert_eq!(DataHeaderRepr::parse(&h).unwrap(), repr_crc());
}

#[test]
fn checksum_field_ignored_without_flag() {
    // A value at offset 48 without the flag bit is reserved space, not a checksum.
    let mut b = BYTES_CRC;
    b[3] = 0;
    let h = DataHeader::new_checked(&b[..]).unwrap();
    assert_eq!(DataHeaderRepr::parse(&h).unwrap().crc32c, None);
}

#[test]
fn emit_literal() {
    let mut buf = [0xffu8; 64];
    repr().emit(&mut DataHeader::new_unchecked(&mut buf[..]));
    assert_eq!(buf, BYTES);
}

#[test]
fn parse_literal() {
    let h = DataHeader::new_checked(&BYTES[..]).unwrap();
    assert_eq!(DataHeaderRepr::parse(&h).unwrap(), repr());
}

#[test]
fn parse_rejects_bad_input() {
    assert!(matches!(
        DataHeader::new_checked(&BYTES[..63]),
        Err(WireError::Truncated {
            got: 63,
            need: 64,
            ..
        })
    ));
    let mut b = BYTES;
    b[0] = 0;
    let h = DataHeader::new_unchecked(&b[..]);
    assert!(matches!(
        DataHeaderRepr::parse(&h),
        Err(WireError::BadMagic(_))
    ));
    let mut b = BYTES;
    b[5] = 99;
    let h = DataHeader::new_unchecked(&b[..]);
    assert!(matches!(
        DataHeaderRepr::parse(&h),
        Err(WireError::BadField(_))
    ));
}

#[test]
fn parse_never_panics_on_garbage() {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    for len in 0..200 {
        let mut b = vec![0u8; len % 80];
        for v in b.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v = x as u8;
        }
        if len % 3 == 0 && b.len() >= 3 {
            b[0] = 0x53;
            b[1] = 0x47;
            b[2] = 1;
        }
        let h = DataHeader::new_unchecked(&b[..]);
        let _ = DataHeaderRepr::parse(&h);
    }
}

#[test]
fn signature_display() {
    let s = repr().sig;
    assert_eq!(s.to_string(), "all_reduce seq 42 half avg count 1000");
}

// ---- signature ----------------------------------------------------------------------------

#[test]
fn signature_is_bytes_4_to_36_of_the_data_header() {
    let sig = Signature::parse(&BYTES[4..36]).unwrap();
    assert_eq!(sig, repr().sig);
    let mut b = [0xffu8; SIGNATURE_LEN];
    sig.emit(&mut b);
    assert_eq!(b[..], BYTES[4..36]);
    assert!(matches!(
        Signature::parse(&BYTES[4..35]),
        Err(WireError::Truncated { need: 32, .. })
    ));
}

/// Byte 2 of a signature is the operator: codes 0..=7 in `ReduceOp::ALL` order (the bitwise
/// operators 5, 6, 7 after the arithmetic ones), 8 and above are rejected.
#[test]
fn signature_op_codes() {
    let ops = [
        (0u8, ReduceOp::Sum, "sum"),
        (1, ReduceOp::Prod, "prod"),
        (2, ReduceOp::Min, "min"),
        (3, ReduceOp::Max, "max"),
        (4, ReduceOp::Avg, "avg"),
        (5, ReduceOp::Band, "band"),
        (6, ReduceOp::Bor, "bor"),
        (7, ReduceOp::Bxor, "bxor"),
    ];
    assert_eq!(ops.len(), ReduceOp::ALL.len());
    for (code, op, name) in ops {
        let mut b: [u8; SIGNATURE_LEN] = BYTES[4..36].try_into().unwrap();
        b[2] = code;
        let sig = Signature::parse(&b).unwrap();
        assert_eq!(sig.op, op);
        assert_eq!(sig.op.name(), name);
        let mut out = [0u8; SIGNATURE_LEN];
        sig.emit(&mut out);
        assert_eq!(out, b, "{name}");
    }
    for code in [8u8, 0x80, 0xff] {
        let mut b: [u8; SIGNATURE_LEN] = BYTES[4..36].try_into().unwrap();
        b[2] = code;
        assert!(
            matches!(Signature::parse(&b), Err(WireError::BadField(_))),
            "op code {code}"
        );
    }
}

// ---- control messages ---------------------------------------------------------------------

fn cts() -> Cts {
    Cts {
        msg: 7,
        sig: repr().sig,
        rkey: 0x1122_3344,
        bytes: 4096,
        offset: 0x10_0000_0020,
    }
}

static CREDIT: [u8; 8] = [1, 0, 0, 0, 3, 0, 0, 0];
static PROBE: [u8; 8] = [4, 0, 0, 0, 0, 0, 0, 0];
static PROBE_REPLY: [u8; 16] = [5, 1, 0, 0, 0, 0, 0, 0, 0x2a, 0, 0, 0, 0, 0, 0, 0];
static READY: [u8; 16] = [6, 1, 0, 0, 7, 0, 0, 0, 0x2a, 0, 0, 0, 0, 0, 0, 1];
static ABORT: [u8; 8] = [2, 0, 0, 0, b'g', b'o', b'n', b'e'];
static CTS: [u8; 56] = [
    3, 0, 0, 0, 7, 0, 0, 0, // kind, message 7
    0x00, 0x02, 0x04, 0x00, // all_reduce, f16, avg
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // comm id
    0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // seq 42
    0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // count 1000
    0x00, 0x00, 0x00, 0x00, // root 0
    0x44, 0x33, 0x22, 0x11, 0x00, 0x10, 0x00, 0x00, // rkey, 4096 bytes
    0x20, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, // offset
];

fn literals() -> Vec<(&'static [u8], ControlRepr<'static>)> {
    vec![
        (&CREDIT, ControlRepr::Credit { count: 3 }),
        (&PROBE, ControlRepr::Probe),
        (
            &PROBE_REPLY,
            ControlRepr::ProbeReply {
                seq: 42,
                inside: true,
            },
        ),
        (
            &ABORT,
            ControlRepr::Abort {
                reason: "gone".into(),
            },
        ),
        (&CTS, ControlRepr::ClearToSend(cts())),
        (
            &READY,
            ControlRepr::ReadyToSend {
                msg: 7,
                seq: (1 << 56) | 42,
                p2p: true,
            },
        ),
    ]
}

#[test]
fn control_literals_parse_and_emit() {
    for (bytes, want) in literals() {
        assert_eq!(ControlRepr::parse_bytes(bytes).unwrap(), want, "{bytes:?}");
        assert_eq!(want.buffer_len(), bytes.len());
        let mut buf = vec![0xffu8; bytes.len()];
        want.emit(&mut Control::new_unchecked(&mut buf[..]));
        assert_eq!(buf, bytes, "{want:?}");
        assert_eq!(want.to_vec(), bytes);
        assert!(!is_data(bytes));
    }
}

#[test]
fn control_parse_rejects_bad_input() {
    assert!(matches!(
        ControlRepr::parse_bytes(&[]),
        Err(WireError::Truncated { .. })
    ));
    assert_eq!(
        ControlRepr::parse_bytes(&[9, 0, 0, 0]),
        Err(WireError::UnknownKind(9))
    );
    assert_eq!(
        ControlRepr::parse_bytes(&CREDIT[..7]),
        Err(WireError::BadLength {
            what: "credit",
            got: 7,
            want: 8
        })
    );
    assert!(matches!(
        ControlRepr::parse_bytes(&ABORT[..3]),
        Err(WireError::Truncated { need: 4, .. })
    ));
    let mut b = CTS;
    b[9] = 77;
    assert!(matches!(
        ControlRepr::parse_bytes(&b),
        Err(WireError::BadField(_))
    ));
    // Invalid UTF-8 in a reason is replaced, never refused.
    let r = ControlRepr::parse_bytes(&[2, 0, 0, 0, 0xff, b'x']).unwrap();
    assert_eq!(
        r,
        ControlRepr::Abort {
            reason: "\u{fffd}x".into()
        }
    );
    assert!(is_data(&BYTES));
    assert_eq!(Kind::from_code(3), Ok(Kind::ClearToSend));
}

// ---- slot settings ------------------------------------------------------------------------

static SETTINGS: [u8; 20] = [
    0x00, 0x00, 0x08, 0x00, 0, 0, 0, 0, // 512 KiB
    8, 0, 0, 0, 3, 0, 0, 0, // 8 slots, 3 over TCP
    0x40, 0x40, 0, 0, // board of 16448 bytes
];

#[test]
fn slot_settings_literal() {
    let want = SlotSettingsRepr {
        chunk: 512 * 1024,
        nslots: 8,
        tcp_nslots: 3,
        board: 16448,
    };
    let s = SlotSettings::new_checked(&SETTINGS[..]).unwrap();
    assert_eq!(SlotSettingsRepr::parse(&s).unwrap(), want);
    assert_eq!(want.to_bytes(), SETTINGS);
    assert!(matches!(
        SlotSettings::new_checked(&SETTINGS[..19]),
        Err(WireError::BadLength { got: 19, .. })
    ));
}

// ---- property tests -----------------------------------------------------------------------

fn any_signature() -> impl Strategy<Value = Signature> {
    (
        any::<u64>(),
        any::<u64>(),
        0..Collective::ALL.len(),
        0..DataType::ALL.len(),
        0..ReduceOp::ALL.len(),
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(|(comm_id, seq, c, d, o, count, root)| Signature {
            comm_id,
            seq,
            coll: Collective::ALL[c],
            dtype: DataType::ALL[d],
            op: ReduceOp::ALL[o],
            count,
            root,
        })
}

fn any_control() -> impl Strategy<Value = ControlRepr<'static>> {
    prop_oneof![
        any::<u32>().prop_map(|count| ControlRepr::Credit { count }),
        Just(ControlRepr::Probe),
        (any::<u64>(), any::<bool>())
            .prop_map(|(seq, inside)| ControlRepr::ProbeReply { seq, inside }),
        (any::<u32>(), any::<u64>(), any::<bool>())
            .prop_map(|(msg, seq, p2p)| ControlRepr::ReadyToSend { msg, seq, p2p }),
        "[ -~]{0,40}".prop_map(|r| ControlRepr::Abort { reason: r.into() }),
        (
            any::<u32>(),
            any_signature(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>()
        )
            .prop_map(
                |(msg, sig, rkey, bytes, offset)| ControlRepr::ClearToSend(Cts {
                    msg,
                    sig,
                    rkey,
                    bytes,
                    offset
                })
            ),
    ]
}

proptest! {
    #[test]
    fn fuzz_data_header_parse_never_panics(b in proptest::collection::vec(any::<u8>(), 0..80)) {
        let _ = DataHeaderRepr::parse(&DataHeader::new_unchecked(&b[..]));
    }

    #[test]
    fn fuzz_data_header_roundtrip(sig in any_signature(), msg in any::<u32>(), len in any::<u32>(),
                                   sender in any::<u32>(), crc in any::<Option<u32>>()) {
        let r = DataHeaderRepr { sig, msg, payload_len: len, sender, crc32c: crc };
        let mut b = [0u8; DATA_HEADER_LEN];
        r.emit(&mut DataHeader::new_unchecked(&mut b[..]));
        prop_assert!(is_data(&b));
        prop_assert_eq!(DataHeaderRepr::parse(&DataHeader::new_checked(&b[..]).unwrap()), Ok(r));
    }

    #[test]
    fn data_header_setters_equal_emit(a in any_signature(), b in any_signature(),
                                           la in any::<u32>(), lb in any::<u32>()) {
        // Emitting `a` and setting `b`'s signature and length gives the bytes of emitting `b`.
        let r = |sig, payload_len| DataHeaderRepr { sig, msg: 7, payload_len, sender: 3, crc32c: None };
        let mut got = [0u8; DATA_HEADER_LEN];
        r(a, la).emit(&mut DataHeader::new_unchecked(&mut got[..]));
        let mut h = DataHeader::new_unchecked(&mut got[..]);
        h.set_signature(&b);
        h.set_payload_len(lb);
        let mut want = [0u8; DATA_HEADER_LEN];
        r(b, lb).emit(&mut DataHeader::new_unchecked(&mut want[..]));
        prop_assert_eq!(got, want);
    }

    #[test]
    fn fuzz_signature_parse_never_panics(b in proptest::collection::vec(any::<u8>(), 0..40)) {
        if let Ok(s) = Signature::parse(&b) {
            let mut out = [0u8; SIGNATURE_LEN];
            s.emit(&mut out);
            prop_assert_eq!(Signature::parse(&out), Ok(s));
        }
    }

    #[test]
    fn fuzz_control_parse_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64),
                                       kind in 0u8..7) {
        let mut b = b;
        if let Some(k) = b.first_mut() {
            *k = kind;
        }
        if let Ok(r) = ControlRepr::parse_bytes(&b) {
            // What parses re-emits to bytes that parse the same (reserved bytes become 0).
            let again = r.to_vec();
            prop_assert_eq!(ControlRepr::parse_bytes(&again), Ok(r));
        }
    }

    #[test]
    fn fuzz_control_roundtrip(r in any_control()) {
        let b = r.to_vec();
        prop_assert_eq!(b.len(), r.buffer_len());
        prop_assert!(!is_data(&b));
        prop_assert_eq!(ControlRepr::parse_bytes(&b), Ok(r));
    }

    #[test]
    fn fuzz_slot_settings(b in proptest::collection::vec(any::<u8>(), 0..24)) {
        if let Ok(s) = SlotSettings::new_checked(&b[..]) {
            let r = SlotSettingsRepr::parse(&s).unwrap();
            prop_assert_eq!(&r.to_bytes()[..], &b[..]);
        } else {
            prop_assert!(b.len() != SlotSettingsRepr::LEN);
        }
    }
}
