//! Authenticated join over TCP: a job with a token runs while an intruder is refused, and a
//! rank with a wrong token fails init naming the store.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use gradsync::{Communicator, Config, ReduceOp, TransportMode};
use gradsync_store::{ServerConfig, StoreClient, StoreServer};

const TOKEN: &str = "3f1c0e9d4b7a26580f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a6978";
const T: Duration = Duration::from_secs(20);

fn store(token: &str) -> (StoreServer, String) {
    let mut sc = ServerConfig::default();
    sc.token = Some(token.as_bytes().to_vec());
    let server = StoreServer::bind_with_config("127.0.0.1:0".parse().unwrap(), sc).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

fn hello(comm_id: u64, rank: u32, stream: u16, nsocks: u16) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[0..4].copy_from_slice(&0x4753_5448u32.to_le_bytes());
    b[4..6].copy_from_slice(&gradsync_transport::tcp::wire::HELLO_VERSION.to_le_bytes());
    b[8..16].copy_from_slice(&comm_id.to_le_bytes());
    b[16..20].copy_from_slice(&rank.to_le_bytes());
    b[20..22].copy_from_slice(&stream.to_le_bytes());
    b[22..24].copy_from_slice(&nsocks.to_le_bytes());
    b
}

#[test]
fn intruder_with_wrong_proof_is_refused_and_job_is_correct() {
    let (_server, addr) = store(TOKEN);
    let world = 3;
    // The intruder knows the communicator id and rank 0's data address (read with the token,
    // the worst case), and claims to be rank 2, stream 0, before the real rank 2 connects.
    let intruder = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut s =
                StoreClient::connect_with_token(&addr, T, Some(TOKEN.as_bytes()), 99).unwrap();
            let cid = s.wait(&["gradsync/comm_id"], T).unwrap();
            let cid = u64::from_le_bytes(cid[0].as_slice().try_into().unwrap());
            let a0 = s
                .wait(&[&format!("gradsync/{cid:016x}/addr/0")], T)
                .unwrap();
            let a0 = String::from_utf8(a0[0].clone()).unwrap();
            let mut sock = TcpStream::connect(&a0).unwrap();
            sock.set_read_timeout(Some(T)).unwrap();
            sock.write_all(&hello(cid, 2, 0, 2)).unwrap();
            let mut nonce = [0u8; 32];
            sock.read_exact(&mut nonce).unwrap();
            sock.write_all(&[0x5a; 64]).unwrap();
            let mut proof = [0u8; 32];
            // Refused: the connection closes instead of a proof arriving.
            sock.read_exact(&mut proof).is_err()
        })
    };
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, world);
            cfg.host_store = false;
            cfg.timeout = T;
            cfg.nsocks = 2;
            cfg.token = Some(TOKEN.into());
            // Every pair over TCP: the ranks' connections (on first use) go through the
            // listener the intruder dials.
            cfg.transport = TransportMode::Tcp;
            std::thread::spawn(move || {
                if rank == 2 {
                    std::thread::sleep(Duration::from_millis(1500));
                }
                let mut c = Communicator::init(cfg).unwrap();
                let mut buf = vec![(rank + 1) as f32; 1000];
                c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                buf
            })
        })
        .collect();
    for h in hs {
        assert!(h.join().unwrap().iter().all(|&x| x == 6.0));
    }
    assert!(intruder.join().unwrap(), "the intruder got a proof back");
}

#[test]
fn wrong_token_fails_init_naming_the_store() {
    let (_server, addr) = store(TOKEN);
    let mut cfg = Config::new(addr.clone(), 1, 2);
    cfg.host_store = false;
    cfg.timeout = Duration::from_secs(5);
    cfg.token = Some("not-the-job-token".into());
    let Err(e) = Communicator::init(cfg) else {
        panic!("init must fail with a wrong token");
    };
    let e = e.to_string();
    assert!(e.contains("authentication"), "{e}");
    assert!(e.contains(&addr), "{e} does not name {addr}");
}
