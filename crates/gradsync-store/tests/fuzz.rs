//! Fuzz-style property tests of the store's wire format (peer input). The case count comes
//! from `PROPTEST_CASES` (default 256 here).

use gradsync_store::wire::{Frame, HEADER_LEN, MAGIC, Repr, VERSION};
use proptest::prelude::*;

/// Arbitrary bytes, and bytes behind a valid-looking header of any kind, so that body parsers
/// are reached often.
fn frames() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..256),
        (
            any::<u8>(),
            proptest::collection::vec(any::<u8>(), 0..200),
            any::<bool>()
        )
            .prop_map(|(kind, body, honest)| {
                let mut b = Vec::with_capacity(HEADER_LEN + body.len());
                b.extend_from_slice(&MAGIC);
                b.push(VERSION);
                // Handshake and request kinds are few; bias towards them.
                b.push(if kind < 128 {
                    kind % 8 + 0x40 * (kind % 2)
                } else {
                    kind
                });
                b.extend_from_slice(&[0, 0]);
                let len = if honest { body.len() as u32 } else { u32::MAX };
                b.extend_from_slice(&len.to_le_bytes());
                b.extend_from_slice(&body);
                b
            }),
    ]
}

fn key() -> impl Strategy<Value = String> {
    "[a-z/0-9]{0,12}"
}

fn nonce() -> impl Strategy<Value = [u8; 32]> {
    any::<[u8; 32]>()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    ))]

    #[test]
    fn fuzz_wire_parse_never_panics(bytes in frames()) {
        let frame = Frame::new_unchecked(&bytes[..]);
        let _ = frame.check_header();
        if let Ok(checked) = Frame::new_checked(&bytes[..])
            && let Ok(repr) = Repr::parse(&checked)
        {
            // Canonical: what parses re-emits to the same bytes.
            prop_assert!(repr.validate().is_ok());
            prop_assert_eq!(repr.to_bytes(), &bytes[..checked.frame_len()]);
        }
    }

    #[test]
    fn fuzz_wire_roundtrip(
        k in key(),
        v in proptest::collection::vec(any::<u8>(), 0..64),
        keys in proptest::collection::vec(key(), 0..6),
        n in any::<i64>(),
        t in any::<u64>(),
    ) {
        let vals: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let reprs = [
            Repr::Set { key: &k, value: &v },
            Repr::Get { key: &k },
            Repr::Wait { keys: keys.iter().map(String::as_str).collect(), timeout_ms: t },
            Repr::Add { key: &k, delta: n },
            Repr::Delete { key: &k },
            Repr::Ok,
            Repr::Value { value: &v },
            Repr::Values { values: vals },
            Repr::NotFound,
            Repr::Int { value: n },
            Repr::Timeout { missing: keys.iter().map(String::as_str).collect() },
            Repr::Error { message: &k },
        ];
        for repr in reprs {
            let bytes = repr.to_bytes();
            let parsed = Repr::parse(&Frame::new_checked(&bytes[..]).unwrap()).unwrap();
            prop_assert_eq!(parsed, repr);
            // Every strict prefix is refused, never a panic.
            for cut in [0, bytes.len() / 2, bytes.len() - 1] {
                prop_assert!(Frame::new_checked(&bytes[..cut]).is_err());
            }
        }
    }

    #[test]
    fn fuzz_handshake_roundtrip(a in nonce(), b in nonce(), rank in any::<u64>(), id in "[0-9.:]{0,40}") {
        let reprs = [
            Repr::AuthChallenge { nonce: &a, server_id: &id },
            Repr::AuthResponse { rank, nonce: &a, mac: &b },
            Repr::AuthConfirm { mac: &b },
        ];
        for repr in reprs {
            let bytes = repr.to_bytes();
            prop_assert!(repr.kind().is_auth() && !repr.kind().is_request());
            let parsed = Repr::parse(&Frame::new_checked(&bytes[..]).unwrap()).unwrap();
            prop_assert_eq!(parsed, repr);
            // A body one byte short or long is refused.
            let mut longer = bytes.clone();
            longer.push(0);
            longer[8..12].copy_from_slice(&((bytes.len() - HEADER_LEN + 1) as u32).to_le_bytes());
            prop_assert!(Repr::parse(&Frame::new_checked(&longer[..]).unwrap()).is_err());
            let mut shorter = bytes[..bytes.len() - 1].to_vec();
            shorter[8..12].copy_from_slice(&((bytes.len() - HEADER_LEN - 1) as u32).to_le_bytes());
            prop_assert!(Repr::parse(&Frame::new_checked(&shorter[..]).unwrap()).is_err());
        }
    }
}
