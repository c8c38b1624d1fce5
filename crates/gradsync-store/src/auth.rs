//! The proofs of the store's authentication handshake (see the
//! [crate-level documentation](crate#authentication)).

use std::io::{self, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::framed::{self, DeadlineReader, FrameReadError};
use crate::wire::{Frame, MAC_LEN, MAX_ERROR_LEN, NONCE_LEN, Repr};

/// Largest frame body read during the handshake (an error reply is the largest expected):
/// a peer that has not authenticated gets no large buffer.
const HANDSHAKE_MAX_BODY: usize = MAX_ERROR_LEN + 64;

type HmacSha256 = Hmac<Sha256>;

/// Domain label of the client's proof.
const CLIENT_LABEL: &[u8] = b"gradsync-store/client";
/// Domain label of the server's proof: another label than the client's, so that a proof
/// reflected back to its sender is never accepted.
const SERVER_LABEL: &[u8] = b"gradsync-store/server";

/// `NONCE_LEN` bytes from the kernel's random source.
pub(crate) fn random_nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut nonce)?;
    Ok(nonce)
}

fn keyed(
    token: &[u8],
    label: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    rank: u64,
) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(token).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(server_nonce);
    mac.update(client_nonce);
    mac.update(&rank.to_le_bytes());
    mac
}

/// The client's proof: `HMAC(token, "gradsync-store/client" || server_nonce || client_nonce ||
/// rank as u64 LE)`.
pub(crate) fn client_proof(
    token: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    rank: u64,
) -> [u8; MAC_LEN] {
    keyed(token, CLIENT_LABEL, server_nonce, client_nonce, rank)
        .finalize()
        .into_bytes()
        .into()
}

/// The server's proof: as [`client_proof`] with the label `"gradsync-store/server"`.
pub(crate) fn server_proof(
    token: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    rank: u64,
) -> [u8; MAC_LEN] {
    keyed(token, SERVER_LABEL, server_nonce, client_nonce, rank)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a client's proof in constant time.
pub(crate) fn verify_client(
    token: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    rank: u64,
    proof: &[u8; MAC_LEN],
) -> bool {
    keyed(token, CLIENT_LABEL, server_nonce, client_nonce, rank)
        .verify_slice(proof)
        .is_ok()
}

/// Checks the server's proof in constant time.
pub(crate) fn verify_server(
    token: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    rank: u64,
    proof: &[u8; MAC_LEN],
) -> bool {
    keyed(token, SERVER_LABEL, server_nonce, client_nonce, rank)
        .verify_slice(proof)
        .is_ok()
}

/// Reads one small frame before `deadline` into `buf` and parses it.
fn read_small<'b>(
    stream: &TcpStream,
    buf: &'b mut Vec<u8>,
    deadline: Instant,
) -> Result<Repr<'b>, String> {
    let mut reader = DeadlineReader { stream, deadline };
    match framed::read_frame_limited(&mut reader, buf, HANDSHAKE_MAX_BODY) {
        Ok(()) => {}
        Err(FrameReadError::Closed) => return Err("the peer closed the connection".into()),
        Err(FrameReadError::Io(e)) if framed::is_timeout(&e) => {
            return Err("no handshake frame before the deadline".into());
        }
        Err(FrameReadError::Io(e)) => return Err(format!("read failed: {e}")),
        Err(FrameReadError::Header(e)) => return Err(format!("invalid frame: {e}")),
    }
    Repr::parse(&Frame::new_unchecked(&buf[..])).map_err(|e| format!("invalid frame: {e}"))
}

fn write(stream: &TcpStream, repr: &Repr<'_>, deadline: Instant) -> Result<(), String> {
    framed::write_all_by(stream, &repr.to_bytes(), deadline)
        .map_err(|e| format!("write failed: {e}"))
}

/// The server's side: challenge, check the client's proof, answer with its own. Returns the
/// rank the client proved it speaks for, or why it failed (the caller logs and closes).
pub(crate) fn server_handshake(
    stream: &TcpStream,
    token: &[u8],
    server_id: &str,
    timeout: Duration,
) -> Result<u64, String> {
    let deadline = Instant::now() + timeout;
    let server_nonce = random_nonce().map_err(|e| format!("no random nonce: {e}"))?;
    write(
        stream,
        &Repr::AuthChallenge {
            nonce: &server_nonce,
            server_id,
        },
        deadline,
    )?;
    let mut buf = Vec::new();
    let (rank, client_nonce) = match read_small(stream, &mut buf, deadline)? {
        Repr::AuthResponse { rank, nonce, mac } => {
            if !verify_client(token, &server_nonce, nonce, rank, mac) {
                return Err(format!("wrong token (client claims rank {rank})"));
            }
            (rank, *nonce)
        }
        other => {
            return Err(format!(
                "no token: the client sent a {} frame instead of answering the challenge",
                other.kind()
            ));
        }
    };
    let proof = server_proof(token, &server_nonce, &client_nonce, rank);
    write(stream, &Repr::AuthConfirm { mac: &proof }, deadline)?;
    Ok(rank)
}

/// The client's side: answer the challenge, then check the server's proof. Returns why it
/// failed.
pub(crate) fn client_handshake(
    stream: &TcpStream,
    token: &[u8],
    rank: u64,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut buf = Vec::new();
    let server_nonce = match read_small(stream, &mut buf, deadline) {
        Ok(Repr::AuthChallenge { nonce, .. }) => *nonce,
        Ok(Repr::Error { message }) => return Err(format!("the store refused: {message}")),
        Ok(other) => {
            return Err(format!(
                "expected an authentication challenge, got a {} frame",
                other.kind()
            ));
        }
        Err(e) => {
            return Err(format!(
                "no authentication challenge within {timeout:?} ({e}); does the store run without a token?"
            ));
        }
    };
    let client_nonce = random_nonce().map_err(|e| format!("no random nonce: {e}"))?;
    let proof = client_proof(token, &server_nonce, &client_nonce, rank);
    write(
        stream,
        &Repr::AuthResponse {
            rank,
            nonce: &client_nonce,
            mac: &proof,
        },
        deadline,
    )?;
    match read_small(stream, &mut buf, deadline) {
        Ok(Repr::AuthConfirm { mac }) => {
            if verify_server(token, &server_nonce, &client_nonce, rank, mac) {
                Ok(())
            } else {
                Err("the store could not prove that it holds the token (not this job's store, or another token)".into())
            }
        }
        Ok(Repr::Error { message }) => Err(format!(
            "the store refused this token ({message}): check GRADSYNC_TOKEN"
        )),
        Ok(other) => Err(format!(
            "expected the store's proof, got a {} frame",
            other.kind()
        )),
        Err(e) => Err(format!(
            "the store refused this token ({e}): check GRADSYNC_TOKEN"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_every_input_and_direction() {
        let (s, c) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = client_proof(b"tok", &s, &c, 3);
        assert!(verify_client(b"tok", &s, &c, 3, &p));
        assert!(!verify_client(b"tok2", &s, &c, 3, &p));
        assert!(!verify_client(b"tok", &c, &s, 3, &p));
        assert!(!verify_client(b"tok", &s, &c, 4, &p));
        // A reflected proof is not the server's.
        assert!(!verify_server(b"tok", &s, &c, 3, &p));
        let q = server_proof(b"tok", &s, &c, 3);
        assert!(verify_server(b"tok", &s, &c, 3, &q));
        assert_ne!(p, q);
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(random_nonce().unwrap(), random_nonce().unwrap());
    }
}
