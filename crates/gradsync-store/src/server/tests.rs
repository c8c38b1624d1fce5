//! The wait registry: which waits a set or add wakes, and that none stays registered.

use super::*;

const LONG: u64 = 10_000;

fn shared() -> Arc<Shared> {
    Arc::new(Shared {
        config: ServerConfig::default(),
        local_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        state: Mutex::new(State::default()),
        stopping: AtomicBool::new(false),
        conns: Mutex::new(Conns::default()),
    })
}

fn set(shared: &Shared, key: &str, value: &[u8]) {
    let waiters = lock(&shared.state)
        .set_and_release(key, Arc::from(value), u64::MAX)
        .unwrap();
    wake(waiters);
}

/// How many waits are registered under `key`.
fn registered(shared: &Shared, key: &str) -> usize {
    lock(&shared.state).waiters.get(key).map_or(0, HashMap::len)
}

/// Polls until `n` waits are registered under `key`.
fn until_registered(shared: &Shared, key: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while registered(shared, key) != n {
        assert!(
            Instant::now() < deadline,
            "{} waits registered under {key:?}, expected {n}",
            registered(shared, key)
        );
        thread::sleep(Duration::from_millis(1));
    }
}

/// Starts a wait on `keys` in a thread; it returns the values, or panics on another outcome.
fn spawn_wait(shared: &Arc<Shared>, keys: &'static [&'static str]) -> JoinHandle<Vec<Vec<u8>>> {
    let shared = Arc::clone(shared);
    thread::spawn(move || match wait(&shared, keys, LONG) {
        WaitOutcome::Ready(values) => values.iter().map(|v| v.to_vec()).collect(),
        other => panic!("wait on {keys:?} ended as {other:?}"),
    })
}

#[test]
fn a_wait_is_registered_under_its_first_missing_key_only() {
    let shared = shared();
    set(&shared, "b", b"2");
    let waiter = spawn_wait(&shared, &["a", "b", "c"]);
    until_registered(&shared, "a", 1);
    assert_eq!(lock(&shared.state).waiters.len(), 1);
    // A set of another key leaves the registration alone.
    set(&shared, "unrelated", b"x");
    assert_eq!(registered(&shared, "a"), 1);
    set(&shared, "a", b"1");
    until_registered(&shared, "c", 1);
    assert_eq!(registered(&shared, "a"), 0);
    set(&shared, "c", b"3");
    assert_eq!(
        waiter.join().unwrap(),
        [b"1".to_vec(), b"2".to_vec(), b"3".to_vec()]
    );
    assert!(lock(&shared.state).waiters.is_empty());
}

#[test]
fn an_add_wakes_every_wait_on_its_key() {
    let shared = shared();
    let waiters: Vec<_> = (0..64).map(|_| spawn_wait(&shared, &["counter"])).collect();
    until_registered(&shared, "counter", 64);
    let (value, released) = lock(&shared.state)
        .add_and_release("counter", 5, u64::MAX)
        .unwrap();
    assert_eq!(value, 5);
    assert_eq!(released.as_ref().map(HashMap::len), Some(64));
    wake(released);
    for w in waiters {
        assert_eq!(w.join().unwrap(), [b"5".to_vec()]);
    }
    assert!(lock(&shared.state).waiters.is_empty());
}

#[test]
fn a_refused_set_wakes_nobody() {
    let shared = shared();
    let waiter = spawn_wait(&shared, &["k"]);
    until_registered(&shared, "k", 1);
    let refused = lock(&shared.state).set_and_release("k", Arc::from(&b"too long"[..]), 4);
    assert!(refused.is_err());
    assert_eq!(registered(&shared, "k"), 1);
    set(&shared, "k", b"v");
    assert_eq!(waiter.join().unwrap(), [b"v".to_vec()]);
}

#[test]
fn timed_out_and_stopped_waits_leave_no_registration() {
    let shared = shared();
    match wait(&shared, &["x", "y"], 50) {
        WaitOutcome::Missing(missing) => assert_eq!(missing, ["x", "y"]),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(lock(&shared.state).waiters.is_empty());
    let stopped = {
        let shared = Arc::clone(&shared);
        thread::spawn(move || wait(&shared, &["z"], LONG))
    };
    until_registered(&shared, "z", 1);
    let start = Instant::now();
    shared.stopping.store(true, Ordering::SeqCst);
    shared.wake_all_waits();
    let outcome = stopped.join().unwrap();
    assert!(matches!(outcome, WaitOutcome::Stopping), "{outcome:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(lock(&shared.state).waiters.is_empty());
}

#[test]
fn a_key_deleted_after_it_was_seen_is_waited_for_again() {
    let shared = shared();
    set(&shared, "a", b"1");
    let waiter = spawn_wait(&shared, &["a", "b"]);
    until_registered(&shared, "b", 1);
    assert!(lock(&shared.state).delete("a"));
    set(&shared, "b", b"2");
    until_registered(&shared, "a", 1);
    set(&shared, "a", b"3");
    assert_eq!(waiter.join().unwrap(), [b"3".to_vec(), b"2".to_vec()]);
    assert!(lock(&shared.state).waiters.is_empty());
}
