//! One store serving the init rendezvous of a 4096-rank job: every rank connects at once.
//!
//! The process holds both ends of every connection, so the test raises its soft open-file
//! limit to the hard limit, and skips (saying so) when the hard limit is too low.

use std::collections::{BTreeMap, HashMap};
use std::thread;
use std::time::{Duration, Instant};

use gradsync_store::{ServerConfig, StoreClient, StoreServer};

const RANKS: usize = 4096;
const TOKEN: &[u8] = b"scale-test-job-token";
/// Connect and wait deadline of every rank.
const T: Duration = Duration::from_secs(40);
/// The whole init must finish within this.
const INIT_BOUND: Duration = Duration::from_secs(45);
/// Client threads hold a connection and small frames only.
const CLIENT_STACK: usize = 128 << 10;
/// Descriptors the test needs: both ends of every connection, plus the listener, the
/// harness's own and the handshakes' short-lived reads of the random source.
const FDS_NEEDED: u64 = 2 * RANKS as u64 + 512;

/// Raises the soft open-file limit to the hard limit. Returns why the test cannot run when the
/// hard limit is below [`FDS_NEEDED`].
fn raise_fd_limit() -> Result<(), String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(format!(
            "getrlimit(RLIMIT_NOFILE) failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    if lim.rlim_max < FDS_NEEDED {
        return Err(format!(
            "the hard open-file limit is {}, and {RANKS} clients with the server's ends need about {FDS_NEEDED}",
            lim.rlim_max
        ));
    }
    if lim.rlim_cur == lim.rlim_max {
        return Ok(());
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: `lim` is a valid rlimit; the new soft limit is the hard limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(format!(
            "setrlimit(RLIMIT_NOFILE) to the hard limit {} failed: {}",
            lim.rlim_max,
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// The address rank `r` publishes (about 30 bytes).
fn address(r: usize) -> String {
    format!("10.{}.{}.{}:{}/ib0", r >> 8, r & 0xff, r % 7, 29500 + r)
}

/// The ranks `r` waits for: its ring neighbours and its recursive-doubling partners at
/// distances 2, 8, 64, 512 and 2048.
fn partners(r: usize) -> Vec<usize> {
    let mut p = vec![(r + 1) % RANKS, (r + RANKS - 1) % RANKS];
    p.extend([1, 3, 6, 9, 11].map(|k| r ^ (1 << k)));
    p
}

/// What one rank saw.
struct Seen {
    joined: i64,
    arrived: i64,
}

/// One rank's init: connect with the token, join, publish its address, wait for its
/// partners' addresses, then a barrier whose last arriver sets the release key.
fn rank_init(addr: &str, r: usize) -> Result<Seen, String> {
    let mut c = StoreClient::connect_with_token(addr, T, Some(TOKEN), r)
        .map_err(|e| format!("connect: {e}"))?;
    let joined = c.add("joined", 1).map_err(|e| format!("add joined: {e}"))?;
    c.set(&format!("addr/{r}"), address(r).as_bytes())
        .map_err(|e| format!("set: {e}"))?;
    let peers = partners(r);
    let keys: Vec<String> = peers.iter().map(|p| format!("addr/{p}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = c.wait(&keys, T).map_err(|e| format!("wait: {e}"))?;
    if values.len() != peers.len() {
        return Err(format!(
            "wait returned {} values for {} keys",
            values.len(),
            peers.len()
        ));
    }
    for (p, v) in peers.iter().zip(&values) {
        if *v != address(*p).as_bytes() {
            return Err(format!(
                "addr/{p} is {:?}, expected {:?}",
                String::from_utf8_lossy(v),
                address(*p)
            ));
        }
    }
    let arrived = c
        .add("arrived", 1)
        .map_err(|e| format!("add arrived: {e}"))?;
    if arrived == RANKS as i64 {
        c.set("released", format!("{RANKS} arrived").as_bytes())
            .map_err(|e| format!("set released: {e}"))?;
    }
    let released = c
        .wait(&["released"], T)
        .map_err(|e| format!("wait released: {e}"))?;
    if released != [format!("{RANKS} arrived").into_bytes()] {
        return Err(format!("released is {released:?}"));
    }
    Ok(Seen { joined, arrived })
}

/// Checks that `values` (one per rank) are 1..=RANKS, each once.
fn check_permutation(name: &str, mut values: Vec<i64>) {
    values.sort_unstable();
    let expected: Vec<i64> = (1..=RANKS as i64).collect();
    assert!(
        values == expected,
        "the {name} counter did not hand out 1..={RANKS} once each"
    );
}

/// 4096 ranks, one thread each, run the init against one store with a job token: connect
/// and authenticate, join a counter, publish an address, wait for seven partners' addresses,
/// then a barrier released by the last arriver. Every value every rank got is checked.
#[test]
fn serves_4096_clients() {
    if let Err(why) = raise_fd_limit() {
        eprintln!("serves_4096_clients skipped: {why}");
        return;
    }
    let mut config = ServerConfig::default();
    config.token = Some(TOKEN.to_vec());
    let server = StoreServer::bind_with_config("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = server.local_addr().to_string();
    let start = Instant::now();
    let handles: Vec<_> = (0..RANKS)
        .map(|r| {
            let addr = addr.clone();
            thread::Builder::new()
                .name(format!("rank-{r}"))
                .stack_size(CLIENT_STACK)
                .spawn(move || rank_init(&addr, r))
                .expect("client thread")
        })
        .collect();
    let mut failures: HashMap<usize, String> = HashMap::new();
    let mut joined = Vec::with_capacity(RANKS);
    let mut arrived = Vec::with_capacity(RANKS);
    for (r, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(seen)) => {
                joined.push(seen.joined);
                arrived.push(seen.arrived);
            }
            Ok(Err(e)) => {
                failures.insert(r, e);
            }
            Err(_) => {
                failures.insert(r, "client thread panicked".into());
            }
        }
    }
    let elapsed = start.elapsed();
    eprintln!("serves_4096_clients: {RANKS} ranks through init in {elapsed:?}");
    if !failures.is_empty() {
        // One example (the lowest rank) and a count per step that failed.
        let mut by_step: BTreeMap<&str, (usize, usize, &str)> = BTreeMap::new();
        for (r, e) in &failures {
            let step = e.split(':').next().unwrap_or_default();
            let entry = by_step.entry(step).or_insert((0, *r, e));
            entry.0 += 1;
            if *r < entry.1 {
                (entry.1, entry.2) = (*r, e);
            }
        }
        panic!(
            "{} of {RANKS} ranks failed; per step (count, first rank, its error): {by_step:#?}",
            failures.len()
        );
    }
    assert!(
        elapsed < INIT_BOUND,
        "{RANKS} ranks took {elapsed:?} through init, more than {INIT_BOUND:?}"
    );
    check_permutation("joined", joined);
    check_permutation("arrived", arrived);
    let mut c = StoreClient::connect_with_token(&addr, T, Some(TOKEN), 0).unwrap();
    assert_eq!(
        c.get("joined").unwrap(),
        Some(RANKS.to_string().into_bytes())
    );
    assert_eq!(
        c.get("arrived").unwrap(),
        Some(RANKS.to_string().into_bytes())
    );
    for r in 0..RANKS {
        assert_eq!(
            c.get(&format!("addr/{r}")).unwrap(),
            Some(address(r).into_bytes())
        );
    }
    drop(c);
    server.shutdown();
}
