//! The store's authentication handshake: right, wrong and missing tokens, and strangers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use gradsync_store::wire::{Frame, Repr};
use gradsync_store::{ServerConfig, StoreClient, StoreError, StoreServer};

const T: Duration = Duration::from_secs(5);

fn server(token: Option<&[u8]>) -> (StoreServer, String) {
    let mut config = ServerConfig::default();
    config.token = token.map(<[u8]>::to_vec);
    let server = StoreServer::bind_with_config("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

fn auth_failed(e: StoreError, addr: &str) -> String {
    let msg = e.to_string();
    assert!(
        matches!(e, StoreError::AuthFailed { .. }),
        "not an authentication error: {msg}"
    );
    assert!(msg.contains(addr), "{msg} does not name {addr}");
    msg
}

#[test]
fn right_token_works() {
    let (_server, addr) = server(Some(b"secret"));
    let mut a = StoreClient::connect_with_token(&addr, T, Some(b"secret"), 0).unwrap();
    let mut b = StoreClient::connect_with_token(&addr, T, Some(b"secret"), 1).unwrap();
    a.set("k", b"v").unwrap();
    assert_eq!(b.wait(&["k"], T).unwrap()[0], b"v");
    assert_eq!(b.add("n", 2).unwrap(), 2);
}

#[test]
fn wrong_token_is_refused() {
    let (_server, addr) = server(Some(b"secret"));
    let t0 = Instant::now();
    let e = StoreClient::connect_with_token(&addr, T, Some(b"guess"), 1).unwrap_err();
    let msg = auth_failed(e, &addr);
    assert!(msg.contains("GRADSYNC_TOKEN"), "{msg}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // The server keeps serving the job.
    let mut ok = StoreClient::connect_with_token(&addr, T, Some(b"secret"), 0).unwrap();
    ok.set("k", b"v").unwrap();
}

#[test]
fn missing_token_is_refused() {
    let (_server, addr) = server(Some(b"secret"));
    let mut c = StoreClient::connect(&addr, T).unwrap();
    let msg = auth_failed(c.set("k", b"v").unwrap_err(), &addr);
    assert!(msg.contains("requires a job token"), "{msg}");
    let mut ok = StoreClient::connect_with_token(&addr, T, Some(b"secret"), 0).unwrap();
    assert_eq!(
        ok.get("k").unwrap(),
        None,
        "an unauthenticated set must not land"
    );
}

#[test]
fn token_against_a_store_without_one_is_refused() {
    let (_server, addr) = server(None);
    let e = StoreClient::connect_with_token(&addr, T, Some(b"secret"), 0).unwrap_err();
    let msg = auth_failed(e, &addr);
    assert!(msg.contains("without a token"), "{msg}");
}

/// Reads everything the server sends until it closes (bounded in time).
fn drain(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
        }
    }
}

#[test]
fn raw_requests_get_nothing_and_do_not_disturb() {
    let (_server, addr) = server(Some(b"secret"));
    let mut good = StoreClient::connect_with_token(&addr, T, Some(b"secret"), 0).unwrap();
    good.set("secret-key", b"payload").unwrap();

    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.write_all(&Repr::Get { key: "secret-key" }.to_bytes())
        .unwrap();
    raw.write_all(
        &Repr::Set {
            key: "x",
            value: b"y",
        }
        .to_bytes(),
    )
    .unwrap();
    let got = drain(&mut raw);
    // A challenge, then an error reply, then the server closes: no value.
    let first = Frame::new_checked(&got[..]).unwrap();
    assert!(matches!(
        Repr::parse(&first).unwrap(),
        Repr::AuthChallenge { .. }
    ));
    let rest = &got[first.frame_len()..];
    let second = Frame::new_checked(rest).unwrap();
    match Repr::parse(&second).unwrap() {
        Repr::Error { message } => assert!(message.contains("authentication failed")),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(rest.len(), second.frame_len(), "nothing after the refusal");
    assert!(
        !got.windows(7).any(|w| w == b"payload"),
        "a value leaked to an unauthenticated peer"
    );

    // A forged response (right shape, wrong proof) is refused too.
    let mut forged = TcpStream::connect(&addr).unwrap();
    forged.set_read_timeout(Some(T)).unwrap();
    let mut hdr = [0u8; 12];
    forged.read_exact(&mut hdr).unwrap();
    let mut body = vec![0u8; Frame::new_unchecked(&hdr[..]).body_len() as usize];
    forged.read_exact(&mut body).unwrap();
    let nonce = [7u8; 32];
    let mac = [9u8; 32];
    forged
        .write_all(
            &Repr::AuthResponse {
                rank: 0,
                nonce: &nonce,
                mac: &mac,
            }
            .to_bytes(),
        )
        .unwrap();
    let reply = drain(&mut forged);
    let f = Frame::new_checked(&reply[..]).unwrap();
    assert!(matches!(Repr::parse(&f).unwrap(), Repr::Error { .. }));

    // The authenticated client never noticed.
    assert_eq!(good.get("secret-key").unwrap().unwrap(), b"payload");
    assert_eq!(good.get("x").unwrap(), None);
}

#[test]
fn silent_stranger_does_not_block_others() {
    let (_server, addr) = server(Some(b"secret"));
    let _silent = TcpStream::connect(&addr).unwrap();
    let t0 = Instant::now();
    let mut ok = StoreClient::connect_with_token(&addr, T, Some(b"secret"), 0).unwrap();
    ok.set("k", b"v").unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2));
}
