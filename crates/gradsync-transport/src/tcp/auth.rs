//! The authentication handshake of a TCP data stream: the proofs of both sides and the two
//! halves of the exchange (see the [module documentation](super#authentication)).

use super::wire::{ANSWER_LEN, HandshakeAnswer, HandshakeAnswerRepr, NONCE_LEN, PROOF_LEN};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
/// Label of the dialing side's proof.
const DIALER_LABEL: &[u8] = b"gradsync-data/dialer";
/// Label of the accepting side's proof (another label, so that no proof can be reflected).
const ACCEPTOR_LABEL: &[u8] = b"gradsync-data/acceptor";

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The identity of one data stream that both proofs cover.
#[derive(Clone, Copy, Debug)]
pub(super) struct StreamId {
    pub(super) comm_id: u64,
    pub(super) dialer: usize,
    pub(super) acceptor: usize,
    pub(super) stream: usize,
}

/// `HMAC(token, label || comm_id || dialer || acceptor || stream || nonce_a || nonce_d)`,
/// integers as little-endian u64.
fn stream_mac(
    token: &[u8],
    label: &[u8],
    id: StreamId,
    nonce_a: &[u8; NONCE_LEN],
    nonce_d: &[u8; NONCE_LEN],
) -> HmacSha256 {
    use hmac::Mac;
    let mut mac = HmacSha256::new_from_slice(token).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(&id.comm_id.to_le_bytes());
    mac.update(&(id.dialer as u64).to_le_bytes());
    mac.update(&(id.acceptor as u64).to_le_bytes());
    mac.update(&(id.stream as u64).to_le_bytes());
    mac.update(nonce_a);
    mac.update(nonce_d);
    mac
}

/// A proof of one side (`dialer` true: the dialing side's).
fn stream_proof(
    token: &[u8],
    dialer: bool,
    id: StreamId,
    nonce_a: &[u8; NONCE_LEN],
    nonce_d: &[u8; NONCE_LEN],
) -> [u8; PROOF_LEN] {
    use hmac::Mac;
    let label = if dialer { DIALER_LABEL } else { ACCEPTOR_LABEL };
    stream_mac(token, label, id, nonce_a, nonce_d)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a proof of one side in constant time; `proof` is peer bytes of any length.
fn verify_stream_proof(
    token: &[u8],
    dialer: bool,
    id: StreamId,
    nonce_a: &[u8; NONCE_LEN],
    nonce_d: &[u8; NONCE_LEN],
    proof: &[u8],
) -> bool {
    use hmac::Mac;
    let label = if dialer { DIALER_LABEL } else { ACCEPTOR_LABEL };
    stream_mac(token, label, id, nonce_a, nonce_d)
        .verify_slice(proof)
        .is_ok()
}

fn random_nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut nonce)?;
    Ok(nonce)
}

/// The accepting side of the handshake, after a valid hello; the socket's read timeout is
/// already set. Returns why it failed.
pub(super) fn accept_auth(
    sock: &TcpStream,
    token: &[u8],
    id: StreamId,
) -> std::result::Result<(), String> {
    let nonce_a = random_nonce().map_err(|e| format!("no random nonce: {e}"))?;
    let mut s = sock;
    s.write_all(&nonce_a)
        .map_err(|e| format!("sending the challenge: {e}"))?;
    let mut answer = [0u8; ANSWER_LEN];
    s.read_exact(&mut answer)
        .map_err(|e| format!("no answer to the challenge: {e}"))?;
    let HandshakeAnswerRepr {
        nonce: nonce_d,
        proof,
    } = HandshakeAnswerRepr::parse(&HandshakeAnswer::new_unchecked(&answer[..]))
        .map_err(|e| e.to_string())?;
    if !verify_stream_proof(token, true, id, &nonce_a, &nonce_d, &proof) {
        return Err("wrong proof (another token, or none)".into());
    }
    s.write_all(&stream_proof(token, false, id, &nonce_a, &nonce_d))
        .map_err(|e| format!("sending the proof: {e}"))
}

/// The dialing side of the handshake, after its hello, with reads bounded by `deadline`.
pub(super) fn dial_auth(
    sock: &TcpStream,
    token: &[u8],
    id: StreamId,
    deadline: Instant,
) -> std::result::Result<(), String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    sock.set_read_timeout(Some(left))
        .map_err(|e| format!("setsockopt: {e}"))?;
    let mut s = sock;
    let mut nonce_a = [0u8; NONCE_LEN];
    s.read_exact(&mut nonce_a)
        .map_err(|e| format!("no challenge ({e}); does the peer run without GRADSYNC_TOKEN?"))?;
    let nonce_d = random_nonce().map_err(|e| format!("no random nonce: {e}"))?;
    let mut answer = [0u8; ANSWER_LEN];
    HandshakeAnswerRepr {
        nonce: nonce_d,
        proof: stream_proof(token, true, id, &nonce_a, &nonce_d),
    }
    .emit(&mut HandshakeAnswer::new_unchecked(&mut answer[..]));
    s.write_all(&answer)
        .map_err(|e| format!("sending the answer: {e}"))?;
    let mut proof = [0u8; PROOF_LEN];
    s.read_exact(&mut proof)
        .map_err(|e| format!("the peer refused this token ({e}); check GRADSYNC_TOKEN"))?;
    if !verify_stream_proof(token, false, id, &nonce_a, &nonce_d, &proof) {
        return Err("the peer could not prove that it holds the token".into());
    }
    sock.set_read_timeout(None)
        .map_err(|e| format!("setsockopt: {e}"))
}

#[cfg(test)]
mod tests {
    //! The handshake proofs (fuzz-style: `PROPTEST_CASES` cases).
    use super::*;
    use proptest::prelude::*;

    const ID: StreamId = StreamId {
        comm_id: 0x1122_3344_5566_7788,
        dialer: 2,
        acceptor: 0,
        stream: 1,
    };

    #[test]
    fn proofs_bind_direction_and_stream() {
        let (a, d) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = stream_proof(b"tok", true, ID, &a, &d);
        assert!(verify_stream_proof(b"tok", true, ID, &a, &d, &p));
        assert!(!verify_stream_proof(b"tok", false, ID, &a, &d, &p));
        assert!(!verify_stream_proof(b"other", true, ID, &a, &d, &p));
        assert!(!verify_stream_proof(b"tok", true, ID, &d, &a, &p));
        let other = StreamId { stream: 0, ..ID };
        assert!(!verify_stream_proof(b"tok", true, other, &a, &d, &p));
        assert!(!verify_stream_proof(b"tok", true, ID, &a, &d, &p[..31]));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn fuzz_handshake_answer_never_verifies(
            answer in proptest::collection::vec(any::<u8>(), 0..80),
            a in any::<[u8; NONCE_LEN]>(),
        ) {
            // A stranger's answer (any bytes, any length) is refused, and checking it never
            // panics.
            let d: [u8; NONCE_LEN] = answer.get(..NONCE_LEN).and_then(|s| s.try_into().ok()).unwrap_or([0; NONCE_LEN]);
            let proof = answer.get(NONCE_LEN..).unwrap_or(&[]);
            prop_assert!(!verify_stream_proof(b"job-token", true, ID, &a, &d, proof));
            prop_assert!(!verify_stream_proof(b"job-token", false, ID, &a, &d, proof));
        }
    }
}
