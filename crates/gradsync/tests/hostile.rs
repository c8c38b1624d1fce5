//! Hostile input: garbage, truncated frames and oversized lengths sent to the store and data
//! ports while a job runs; and fuzz-style tests of the data header parser.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gradsync::{Communicator, Config, ReduceOp};
use gradsync_core::wire::{DATA_HEADER_LEN, DataHeader, DataHeaderRepr};
use gradsync_store::{ServerConfig, StoreClient, StoreServer};
use proptest::prelude::*;

const TOKEN: &str = "hostile-test-token";
const T: Duration = Duration::from_secs(30);

/// The byte sequences a hostile peer sends: noise, a store header announcing u32::MAX bytes,
/// a truncated store frame, a data hello with a huge frame after it, a truncated hello.
fn payloads(cid: u64) -> Vec<Vec<u8>> {
    let mut store_huge = b"GSKV\x01\x01\x00\x00".to_vec();
    store_huge.extend_from_slice(&u32::MAX.to_le_bytes());
    let mut store_trunc = b"GSKV\x01\x02\x00\x00".to_vec();
    store_trunc.extend_from_slice(&100u32.to_le_bytes());
    store_trunc.extend_from_slice(b"abc");
    let mut hello = Vec::new();
    hello.extend_from_slice(&0x4753_5448u32.to_le_bytes());
    hello.extend_from_slice(&[1, 0, 0, 0]);
    hello.extend_from_slice(&cid.to_le_bytes());
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&[0, 0, 1, 0]);
    let mut data_huge = hello.clone();
    data_huge.extend_from_slice(&[0x5a; 64]);
    let mut hdr = [0u8; 24];
    hdr[0] = 3;
    hdr[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    data_huge.extend_from_slice(&hdr);
    vec![
        (0..=255u8).cycle().take(3000).collect(),
        store_huge,
        store_trunc,
        data_huge,
        hello[..10].to_vec(),
        vec![0xff; 24],
    ]
}

fn spray(addr: &str, cid: u64) {
    for p in payloads(cid) {
        if let Ok(mut s) = TcpStream::connect(addr) {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = s.write_all(&p);
        }
    }
}

#[test]
fn garbage_senders_do_not_disturb_the_job() {
    let mut sc = ServerConfig::default();
    sc.token = Some(TOKEN.as_bytes().to_vec());
    let server = StoreServer::bind_with_config("127.0.0.1:0".parse().unwrap(), sc).unwrap();
    let addr = server.local_addr().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..2)
        .map(|i| {
            let (addr, stop) = (addr.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rounds = 0;
                if i == 1 {
                    // Hit rank 0's data port during setup (rank 1 starts late).
                    let mut s =
                        StoreClient::connect_with_token(&addr, T, Some(TOKEN.as_bytes()), 9)
                            .unwrap();
                    let cid = s.wait(&["gradsync/comm_id"], T).unwrap();
                    let cid = u64::from_le_bytes(cid[0].as_slice().try_into().unwrap());
                    let a0 = s
                        .wait(&[&format!("gradsync/{cid:016x}/addr/0")], T)
                        .unwrap();
                    let a0 = String::from_utf8(a0[0].clone()).unwrap();
                    spray(&a0, cid);
                }
                while !stop.load(Ordering::Relaxed) && rounds < 200 {
                    spray(&addr, 0);
                    rounds += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                rounds
            })
        })
        .collect();
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, 2);
            cfg.host_store = false;
            cfg.timeout = T;
            cfg.nsocks = 1;
            cfg.token = Some(TOKEN.into());
            std::thread::spawn(move || {
                if rank == 1 {
                    std::thread::sleep(Duration::from_millis(1000));
                }
                let mut c = Communicator::init(cfg).unwrap();
                for it in 0..20 {
                    let mut buf = vec![(rank + it) as f32; 10007];
                    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    let want = (2 * it + 1) as f32;
                    assert!(buf.iter().all(|&x| x == want), "iteration {it}");
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        assert!(a.join().unwrap() > 0);
    }
    // The store still serves the job after all of it.
    let mut c = StoreClient::connect_with_token(&addr, T, Some(TOKEN.as_bytes()), 0).unwrap();
    c.set("after", b"ok").unwrap();
    assert_eq!(c.get("after").unwrap().unwrap(), b"ok");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    ))]

    #[test]
    fn fuzz_data_header_parse(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
        let h = DataHeader::new_unchecked(&bytes[..]);
        if let Ok(repr) = DataHeaderRepr::parse(&h) {
            prop_assert!(bytes.len() >= DATA_HEADER_LEN);
            let mut out = [0u8; DATA_HEADER_LEN];
            repr.emit(&mut DataHeader::new_unchecked(&mut out[..]));
            prop_assert_eq!(DataHeaderRepr::parse(&DataHeader::new_unchecked(&out[..])).unwrap(), repr);
        }
    }

    #[test]
    fn fuzz_data_header_roundtrip(seed in proptest::collection::vec(any::<u8>(), DATA_HEADER_LEN)) {
        // Valid headers built from arbitrary field values survive emit and parse.
        let mut b = seed.clone();
        b[0] = 0x53; b[1] = 0x47; b[2] = 1;
        if let Ok(repr) = DataHeaderRepr::parse(&DataHeader::new_unchecked(&b[..])) {
            let mut out = [0u8; DATA_HEADER_LEN];
            repr.emit(&mut DataHeader::new_unchecked(&mut out[..]));
            prop_assert_eq!(DataHeaderRepr::parse(&DataHeader::new_unchecked(&out[..])).unwrap(), repr);
        }
    }
}
