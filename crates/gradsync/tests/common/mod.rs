//! What several test files share: ranks as threads of the test process.

use gradsync::{Communicator, Config};
use gradsync_store::{ServerConfig, StoreServer};
use std::time::Duration;

/// Runs `f(comm)` on `world` ranks (threads of this process) that meet through a store of
/// their own, with the job token if `tweak` gives one; `tweak` is applied to every rank's
/// config (after `host_store` off and a 60 s timeout).
pub fn run_ranks<R: Send + 'static>(
    world: usize,
    tweak: impl Fn(&mut Config) + Send + Sync + Clone + 'static,
    f: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let mut probe = Config::new("", 0, world);
    tweak(&mut probe);
    let mut sc = ServerConfig::default();
    sc.token = probe.token.map(String::into_bytes);
    let server = StoreServer::bind_with_config("127.0.0.1:0".parse().unwrap(), sc).unwrap();
    let addr = server.local_addr().to_string();
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = Config::new(addr.clone(), rank, world);
            cfg.host_store = false;
            cfg.timeout = Duration::from_secs(60);
            tweak(&mut cfg);
            let f = f.clone();
            std::thread::spawn(move || f(Communicator::init(cfg).expect("init")))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}
