//! Server and client over loopback TCP.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use gradsync_store::wire::{
    Frame, HEADER_LEN, Kind, MAGIC, MAX_BODY_LEN, MAX_KEY_LEN, MAX_WAIT_KEYS, Repr, VERSION,
};
use gradsync_store::{ServerConfig, StoreClient, StoreError, StoreServer, WireError};

const T: Duration = Duration::from_secs(10);

fn server() -> (StoreServer, String) {
    server_with(ServerConfig::default())
}

fn server_with(config: ServerConfig) -> (StoreServer, String) {
    let server = StoreServer::bind_with_config("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

fn client(addr: &str) -> StoreClient {
    StoreClient::connect(addr, T).unwrap()
}

/// Sends raw bytes and reads everything until the server closes; returns the first reply
/// frame (if the server sent one).
fn raw_exchange(addr: &str, bytes: &[u8]) -> Option<Vec<u8>> {
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    // The server may close before taking all bytes: a failed write is fine.
    let _ = raw.write_all(bytes);
    let mut reply = Vec::new();
    let start = Instant::now();
    let mut chunk = [0u8; 4096];
    loop {
        match raw.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
        assert!(start.elapsed() < T, "server did not close the connection");
    }
    let frame = Frame::new_checked(&reply[..]).ok()?;
    Some(reply[..frame.frame_len()].to_vec())
}

/// The message of an Error reply frame.
fn error_message(reply: &[u8]) -> String {
    match Repr::parse(&Frame::new_checked(reply).unwrap()).unwrap() {
        Repr::Error { message } => message.to_owned(),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

fn header(kind: u8, body_len: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&[VERSION, kind, 0, 0]);
    h.extend_from_slice(&body_len.to_le_bytes());
    h
}

#[test]
fn set_get_delete() {
    let (_server, addr) = server();
    let mut c = client(&addr);
    assert_eq!(c.get("missing").unwrap(), None);
    c.set("addr/0", b"127.0.0.1:1234").unwrap();
    assert_eq!(
        c.get("addr/0").unwrap().as_deref(),
        Some(&b"127.0.0.1:1234"[..])
    );
    c.set("addr/0", b"").unwrap();
    assert_eq!(c.get("addr/0").unwrap().as_deref(), Some(&b""[..]));
    let binary: Vec<u8> = (0..=255).collect();
    c.set("bin", &binary).unwrap();
    // Another connection sees the same map.
    let mut other = client(&addr);
    assert_eq!(other.get("bin").unwrap(), Some(binary));
    assert!(other.delete("bin").unwrap());
    assert!(!other.delete("bin").unwrap());
    assert_eq!(c.get("bin").unwrap(), None);
    assert_eq!(c.addr(), addr);
    assert!(c.is_connected());
}

#[test]
fn large_value_round_trip() {
    let (_server, addr) = server();
    let mut c = client(&addr);
    let value: Vec<u8> = (0..16usize << 20)
        .map(|i| (i * 7 + i / 4099) as u8)
        .collect();
    c.set("big", &value).unwrap();
    assert_eq!(c.get("big").unwrap().unwrap(), value);
    let got = c.wait(&["big"], T).unwrap();
    assert_eq!(got[0], value);
}

#[test]
fn wait_completes_when_another_thread_sets() {
    let (_server, addr) = server();
    let mut c = client(&addr);
    let setter = {
        let addr = addr.clone();
        thread::spawn(move || {
            let mut c = client(&addr);
            thread::sleep(Duration::from_millis(100));
            c.set("rank/2", b"two").unwrap();
            thread::sleep(Duration::from_millis(50));
            c.set("rank/1", b"one").unwrap();
        })
    };
    let start = Instant::now();
    let values = c.wait(&["rank/1", "rank/2"], T).unwrap();
    assert_eq!(values, vec![b"one".to_vec(), b"two".to_vec()]);
    assert!(start.elapsed() >= Duration::from_millis(100));
    setter.join().unwrap();
    // Keys that exist already: immediate.
    assert_eq!(
        c.wait(&["rank/2"], Duration::ZERO).unwrap(),
        vec![b"two".to_vec()]
    );
    assert_eq!(c.wait(&[], Duration::ZERO).unwrap(), Vec::<Vec<u8>>::new());
}

#[test]
fn wait_timeout_names_missing_keys() {
    let (_server, addr) = server();
    let mut c = client(&addr);
    c.set("a", b"1").unwrap();
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let err = c.wait(&["a", "b", "c"], timeout).unwrap_err();
    let elapsed = start.elapsed();
    match &err {
        StoreError::WaitTimeout {
            addr: a,
            timeout: t,
            missing,
        } => {
            assert_eq!(a, &addr);
            assert_eq!(*t, timeout);
            assert_eq!(missing, &["b", "c"]);
        }
        other => panic!("expected a wait timeout, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("\"b\"") && msg.contains("\"c\"") && msg.contains("300ms"),
        "{msg}"
    );
    assert!(!msg.contains("\"a\""), "{msg}");
    assert!(
        elapsed >= timeout && elapsed < Duration::from_secs(3),
        "{elapsed:?}"
    );
    // The connection is fine afterwards.
    assert_eq!(c.get("a").unwrap().as_deref(), Some(&b"1"[..]));
}

#[test]
fn add_from_eight_threads_sums() {
    let (_server, addr) = server();
    const THREADS: i64 = 8;
    const ADDS: i64 = 200;
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (1..=THREADS)
        .map(|delta| {
            let addr = addr.clone();
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                let mut c = client(&addr);
                barrier.wait();
                let mut last = i64::MIN;
                for _ in 0..ADDS {
                    let now = c.add("counter", delta).unwrap();
                    assert!(now > last, "add results from one client increase");
                    last = now;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let expected = ADDS * THREADS * (THREADS + 1) / 2;
    let mut c = client(&addr);
    assert_eq!(c.add("counter", 0).unwrap(), expected);
    assert_eq!(
        c.get("counter").unwrap().unwrap(),
        expected.to_string().into_bytes()
    );
}

#[test]
fn add_semantics() {
    let (_server, addr) = server();
    let mut c = client(&addr);
    assert_eq!(c.add("n", -5).unwrap(), -5);
    c.set("seven", b"7").unwrap();
    assert_eq!(c.add("seven", 3).unwrap(), 10);
    c.set("text", b"hello").unwrap();
    let err = c.add("text", 1).unwrap_err();
    assert!(
        matches!(err, StoreError::Server { op: "add", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("not a decimal integer"), "{err}");
    c.set("max", i64::MAX.to_string().as_bytes()).unwrap();
    let err = c.add("max", 1).unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
    // Refusals keep the connection.
    assert!(c.is_connected());
    assert_eq!(c.add("n", 5).unwrap(), 0);
}

#[test]
fn connect_times_out_when_nothing_listens() {
    let timeout = Duration::from_millis(300);
    // A port freed a moment ago; another process may take it in between, then try another.
    let (addr, err, elapsed) = (0..5)
        .find_map(|_| {
            let port = {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().port()
            };
            let addr = format!("127.0.0.1:{port}");
            let start = Instant::now();
            let err = StoreClient::connect(&addr, timeout).err()?;
            Some((addr, err, start.elapsed()))
        })
        .expect("a free port");
    assert!(
        elapsed >= timeout && elapsed < Duration::from_secs(2),
        "{elapsed:?}"
    );
    match &err {
        StoreError::Connect {
            addr: a, attempts, ..
        } => {
            assert_eq!(a, &addr);
            assert!(*attempts > 1, "retried");
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&addr) && msg.contains("300ms"), "{msg}");
}

#[test]
fn connect_retries_until_the_server_is_up() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let starter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        StoreServer::bind(format!("127.0.0.1:{port}").parse().unwrap())
    });
    let mut c = StoreClient::connect(&addr, T).unwrap();
    // The port might have been taken in between; then there is nothing to check.
    if let Ok(server) = starter.join().unwrap() {
        c.set("up", b"1").unwrap();
        server.shutdown();
    }
}

#[test]
fn connect_rejects_a_bad_address_at_once() {
    let start = Instant::now();
    let err = StoreClient::connect("no-port-here", T).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(err.to_string().contains("no-port-here"), "{err}");
}

#[test]
fn garbage_does_not_disturb_a_good_client() {
    let (_server, addr) = server();
    let mut good = client(&addr);
    good.set("k", b"v").unwrap();

    // Random bytes: bad magic.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let garbage: Vec<u8> = (0..64 << 10)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut bad = garbage.clone();
    bad[0] = b'X';
    let reply = raw_exchange(&addr, &bad).expect("an error reply");
    assert!(error_message(&reply).contains("bad magic"));
    assert_eq!(good.get("k").unwrap().as_deref(), Some(&b"v"[..]));

    // A valid header over a garbage body.
    let mut frame = header(Kind::Set as u8, 100);
    frame.extend_from_slice(&garbage[..100]);
    let reply = raw_exchange(&addr, &frame).expect("an error reply");
    assert!(error_message(&reply).contains("invalid frame"));

    // Another protocol version.
    let mut v2 = header(Kind::Get as u8, 0);
    v2[4] = 2;
    let reply = raw_exchange(&addr, &v2).expect("an error reply");
    assert!(error_message(&reply).contains("version 2"));

    // A response sent to the server.
    let reply = raw_exchange(&addr, &Repr::Ok.to_bytes()).expect("an error reply");
    assert!(error_message(&reply).contains("unexpected"));

    // A peer that stops mid-frame and hangs up.
    let mut partial = TcpStream::connect(&addr).unwrap();
    partial
        .write_all(&header(Kind::Get as u8, 50)[..7])
        .unwrap();
    drop(partial);

    // Many garbage peers at once, while the good client works.
    let peers: Vec<_> = (0..8)
        .map(|i| {
            let addr = addr.clone();
            let mut bytes = garbage[i * 1000..(i + 1) * 1000].to_vec();
            bytes[..4].copy_from_slice(&MAGIC);
            bytes[4] = VERSION;
            thread::spawn(move || raw_exchange(&addr, &bytes))
        })
        .collect();
    for i in 0..100 {
        good.set(&format!("k{i}"), b"x").unwrap();
    }
    for p in peers {
        p.join().unwrap();
    }
    assert_eq!(good.get("k99").unwrap().as_deref(), Some(&b"x"[..]));
    assert!(good.is_connected());
}

#[test]
fn oversized_lengths_are_rejected() {
    let (_server, addr) = server();
    let mut good = client(&addr);
    // Body length over the frame limit: refused from the header.
    for len in [u32::MAX, MAX_BODY_LEN as u32 + 1] {
        let start = Instant::now();
        let reply = raw_exchange(&addr, &header(Kind::Set as u8, len)).expect("an error reply");
        let msg = error_message(&reply);
        assert!(msg.contains("exceeds the limit"), "{msg}");
        assert!(start.elapsed() < Duration::from_secs(3));
    }
    // A key over its limit inside a frame of valid size.
    let key_len = MAX_KEY_LEN as u32 + 1;
    let mut frame = header(Kind::Get as u8, 4 + key_len);
    frame.extend_from_slice(&key_len.to_le_bytes());
    frame.extend(std::iter::repeat_n(b'k', key_len as usize));
    let msg = error_message(&raw_exchange(&addr, &frame).expect("an error reply"));
    assert!(msg.contains("key of 4097 bytes"), "{msg}");
    // A wait announcing u32::MAX keys.
    let mut frame = header(Kind::Wait as u8, 12);
    frame.extend_from_slice(&0u64.to_le_bytes());
    frame.extend_from_slice(&u32::MAX.to_le_bytes());
    let msg = error_message(&raw_exchange(&addr, &frame).expect("an error reply"));
    assert!(msg.contains("4294967295 entries"), "{msg}");
    good.set("still", b"here").unwrap();
}

#[test]
fn client_checks_limits_before_sending() {
    let (_server, addr) = server();
    let mut c = client(&addr);
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    let err = c.set(&long_key, b"v").unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::InvalidRequest {
                op: "set",
                source: WireError::FieldTooLong { field: "key", .. },
                ..
            }
        ),
        "{err:?}"
    );
    let keys = vec!["k"; MAX_WAIT_KEYS + 1];
    let err = c.wait(&keys, T).unwrap_err();
    assert!(
        matches!(err, StoreError::InvalidRequest { op: "wait", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("k (+4096 more)"), "{err}");
    assert!(c.is_connected());
    c.set("ok", b"1").unwrap();
}

#[test]
fn store_capacity_is_bounded() {
    let mut config = ServerConfig::default();
    config.max_total_bytes = 100;
    let (_server, addr) = server_with(config);
    let mut c = client(&addr);
    c.set("a", &[0; 50]).unwrap();
    let err = c.set("b", &[0; 60]).unwrap_err();
    assert!(
        matches!(err, StoreError::Server { op: "set", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("store full"), "{err}");
    // Replacing a value counts only the difference.
    c.set("a", &[0; 90]).unwrap();
    assert!(c.delete("a").unwrap());
    c.set("b", &[0; 60]).unwrap();
}

#[test]
fn io_timeout_bounds_calls_to_a_silent_server() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let holder = thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        thread::sleep(Duration::from_secs(2));
        drop(stream);
    });
    let mut c = client(&addr);
    c.set_io_timeout(Duration::from_millis(200));
    assert_eq!(c.io_timeout(), Duration::from_millis(200));
    let start = Instant::now();
    let err = c.get("k").unwrap_err();
    let elapsed = start.elapsed();
    assert!(
        matches!(err, StoreError::Timeout { op: "get", .. }),
        "{err:?}"
    );
    assert!(
        elapsed >= Duration::from_millis(200) && elapsed < Duration::from_secs(2),
        "{elapsed:?}"
    );
    assert!(err.to_string().contains(&addr), "{err}");
    // The stream position is unknown now: the client refuses further calls.
    assert!(!c.is_connected());
    let err = c.get("k").unwrap_err();
    assert!(matches!(err, StoreError::Disconnected { .. }), "{err:?}");
    holder.join().unwrap();
}

#[test]
fn oversized_reply_is_rejected_by_the_client() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = [0u8; HEADER_LEN + 5];
        stream.read_exact(&mut request).unwrap();
        stream
            .write_all(&header(Kind::Value as u8, u32::MAX))
            .unwrap();
        thread::sleep(Duration::from_millis(200));
    });
    let mut c = client(&addr);
    let err = c.get("a").unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Protocol {
                source: WireError::BodyTooLong { .. },
                ..
            }
        ),
        "{err:?}"
    );
    fake.join().unwrap();
}

#[test]
fn connection_limit_refuses_extra_clients() {
    let mut config = ServerConfig::default();
    config.max_connections = 2;
    let (_server, addr) = server_with(config);
    let mut a = client(&addr);
    let mut b = client(&addr);
    a.set("k", b"v").unwrap();
    b.set("k", b"v").unwrap();
    let mut extra = client(&addr);
    let err = extra.get("k").unwrap_err();
    assert!(err.to_string().contains("refuses connection"), "{err}");
    drop(a);
    // Once a slot is free (its thread has noticed the close), new clients are served.
    let deadline = Instant::now() + T;
    loop {
        let mut c = client(&addr);
        match c.get("k") {
            Ok(v) => {
                assert_eq!(v.as_deref(), Some(&b"v"[..]));
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "{e}"),
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn shutdown_is_bounded_and_wakes_waiters() {
    let (server, addr) = server();
    let mut idle = client(&addr);
    idle.set("x", b"1").unwrap();
    let waiter = {
        let addr = addr.clone();
        thread::spawn(move || {
            let mut c = client(&addr);
            let start = Instant::now();
            let result = c.wait(&["never"], Duration::from_secs(30));
            (result, start.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    server.shutdown();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let (result, waited) = waiter.join().unwrap();
    assert!(result.is_err(), "{result:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(idle.get("x").is_err());
    assert!(StoreClient::connect(&addr, Duration::from_millis(100)).is_err());
}

#[test]
fn drop_stops_the_server() {
    let (server, addr) = server();
    let _c = client(&addr);
    let start = Instant::now();
    drop(server);
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(StoreClient::connect(&addr, Duration::from_millis(100)).is_err());
}

#[test]
fn bind_error_names_the_address() {
    let (_server, addr) = server();
    let err = StoreServer::bind(addr.parse().unwrap()).unwrap_err();
    assert!(matches!(err, StoreError::Bind { .. }), "{err:?}");
    assert!(err.to_string().contains(&addr), "{err}");
}

#[test]
#[ignore = "stress test"]
fn stress_rendezvous_of_many_ranks() {
    let (_server, addr) = server();
    const RANKS: usize = 64;
    let handles: Vec<_> = (0..RANKS)
        .map(|rank| {
            let addr = addr.clone();
            thread::spawn(move || {
                let mut c = client(&addr);
                for round in 0..20 {
                    c.set(
                        &format!("r{round}/addr/{rank}"),
                        format!("10.0.0.{rank}:{round}").as_bytes(),
                    )
                    .unwrap();
                    let keys: Vec<String> =
                        (0..RANKS).map(|r| format!("r{round}/addr/{r}")).collect();
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let values = c.wait(&keys, Duration::from_secs(60)).unwrap();
                    for (r, v) in values.iter().enumerate() {
                        assert_eq!(v, format!("10.0.0.{r}:{round}").as_bytes());
                    }
                    c.add(&format!("r{round}/arrived"), 1).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let mut c = client(&addr);
    assert_eq!(c.add("r19/arrived", 0).unwrap(), RANKS as i64);
}
