//! The store server: one accept thread, one thread per connection, one shared map.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};
use tracing::{debug, warn};

use crate::StoreError;
use crate::auth;
use crate::framed::{self, FrameReadError, ReadSome};
use crate::wire::{self, Frame, MAX_BODY_LEN, MAX_WAIT_TIMEOUT_MS, Repr};

/// Listen backlog asked for; the kernel caps it at its own limit (`net.core.somaxconn` on
/// Linux). Every rank of a job connects at about the same time, and a connection that finds
/// the queue full is retried by the client's kernel only after a second or more.
const LISTEN_BACKLOG: i32 = 65535;
/// How often the accept thread polls its non-blocking listener.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// Back-off after an accept error other than "no connection pending" (e.g. out of descriptors).
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);
/// Socket read timeout of an idle connection: how often it checks for shutdown.
const IDLE_POLL: Duration = Duration::from_millis(200);
/// How long a refused connection gets to receive its error reply.
const REJECT_WRITE_TIMEOUT: Duration = Duration::from_millis(100);
/// After a protocol error: how long the server drains the peer's input before closing, so that
/// the peer reads the error reply instead of a connection reset.
const LINGER: Duration = Duration::from_millis(500);
/// How long `shutdown` waits for connection threads to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Stack size of connection threads (they hold no large stack data).
const CONN_STACK: usize = 512 << 10;
/// A connection's receive buffer is released after a frame when it grew beyond this.
const KEEP_BUFFER: usize = 1 << 20;

/// Server limits, timeouts and job token. Create with [`ServerConfig::default`] and change
/// fields. Its `Debug` form does not show the token.
#[derive(Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Most bytes of keys plus values held at once (default 1 GiB). A set or add that would
    /// exceed it is refused with an error reply; the connection stays open.
    pub max_total_bytes: u64,
    /// Most connections served at once (default 8192). Further connections receive an error
    /// reply and are closed. Each connection holds one descriptor and one thread, so the
    /// process's open-file limit (`RLIMIT_NOFILE`) must leave room for as many connections as
    /// the job has ranks; an accept that fails for want of descriptors is logged and retried.
    pub max_connections: usize,
    /// Deadline for a peer to complete a frame once its first byte arrived, and for the server
    /// to write a reply (default 60 s). Idle connections between frames are not timed out.
    pub io_timeout: Duration,
    /// The job token (default none). With a token, every connection must pass the
    /// challenge-response handshake of the [crate-level documentation](crate#authentication)
    /// within [`HANDSHAKE_TIMEOUT`](crate::HANDSHAKE_TIMEOUT) before its first request; one
    /// that fails is logged at warn level ("authentication failed", with the peer address)
    /// and closed, and other connections are not affected.
    pub token: Option<Vec<u8>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_total_bytes: 1 << 30,
            max_connections: 8192,
            io_timeout: Duration::from_secs(60),
            token: None,
        }
    }
}

impl fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConfig")
            .field("max_total_bytes", &self.max_total_bytes)
            .field("max_connections", &self.max_connections)
            .field("io_timeout", &self.io_timeout)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The rendezvous key-value server.
///
/// [`StoreServer::bind`] starts an accept thread; every accepted connection is served by its
/// own thread. All connections share one map guarded by a mutex. A wait blocks on a condition
/// variable of its own, registered under the first of its keys that is missing; a set or add
/// of a key signals only the waits registered under that key, which then check their keys
/// again. Dropping the server shuts it down as [`StoreServer::shutdown`] does.
#[derive(Debug)]
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    config: ServerConfig,
    local_addr: SocketAddr,
    state: Mutex<State>,
    stopping: AtomicBool,
    conns: Mutex<Conns>,
}

/// The waits registered under one key: waiter id to its condition variable.
type Waiters = HashMap<u64, Arc<Condvar>>;

#[derive(Debug, Default)]
struct State {
    map: HashMap<String, Arc<[u8]>>,
    /// Sum of key and value lengths over the map.
    total_bytes: u64,
    /// Blocked waits by the missing key each is registered under. A set or add of the key
    /// takes the whole entry and signals every wait in it.
    waiters: HashMap<String, Waiters>,
    next_waiter: u64,
}

#[derive(Debug, Default)]
struct Conns {
    next_id: u64,
    live: HashMap<u64, Conn>,
}

#[derive(Debug)]
struct Conn {
    /// The served stream, shared with its thread, for shutting it down from outside (one
    /// descriptor per connection).
    stream: Arc<TcpStream>,
    thread: JoinHandle<()>,
}

impl Shared {
    /// Signals every blocked wait, so that it checks `stopping` again.
    fn wake_all_waits(&self) {
        // Taking the lock orders these notifications after any waiter's check of `stopping`.
        let state = lock(&self.state);
        for cv in state.waiters.values().flat_map(HashMap::values) {
            cv.notify_one();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StoreServer {
    /// Binds `addr` and starts serving on background threads, with [`ServerConfig::default`].
    /// Port 0 picks a free port; [`StoreServer::local_addr`] tells which.
    pub fn bind(addr: SocketAddr) -> Result<StoreServer, StoreError> {
        StoreServer::bind_with_config(addr, ServerConfig::default())
    }

    /// Binds `addr` and starts serving with the given limits and timeouts.
    pub fn bind_with_config(
        addr: SocketAddr,
        config: ServerConfig,
    ) -> Result<StoreServer, StoreError> {
        let bind_err = |source| StoreError::Bind { addr, source };
        let listener = listen(addr).map_err(bind_err)?;
        let local_addr = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let shared = Arc::new(Shared {
            config,
            local_addr,
            state: Mutex::new(State::default()),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
        });
        let accept = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("gradsync-store-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .map_err(bind_err)?
        };
        debug!(target: "gradsync::bootstrap", %local_addr, "store server listening");
        Ok(StoreServer {
            local_addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, wakes pending waits (they get an error reply), closes every
    /// connection and waits up to about two seconds for the connection threads to end; threads
    /// still running then are left to finish on their own. Also done on drop.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        debug!(target: "gradsync::bootstrap", local_addr = %self.local_addr, "store server stopping");
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.wake_all_waits();
        // Bounded: the accept loop polls `stopping` every ACCEPT_POLL.
        let _ = accept.join();
        let conns: Vec<Conn> = lock(&self.shared.conns)
            .live
            .drain()
            .map(|(_, c)| c)
            .collect();
        for conn in &conns {
            let _ = conn.stream.shutdown(Shutdown::Both);
        }
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        let mut stragglers = 0usize;
        for conn in conns {
            while !conn.thread.is_finished() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            if conn.thread.is_finished() {
                let _ = conn.thread.join();
            } else {
                stragglers += 1;
            }
        }
        if stragglers > 0 {
            warn!(target: "gradsync::bootstrap", local_addr = %self.local_addr, stragglers,
                "store connection threads still running after shutdown grace period; detached");
        }
        debug!(target: "gradsync::bootstrap", local_addr = %self.local_addr, "store server stopped");
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A listener on `addr` with a backlog of [`LISTEN_BACKLOG`] (the standard library's
/// `TcpListener::bind` asks for 128), with `SO_REUSEADDR` on Unix as `TcpListener::bind` sets it.
fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    #[cfg(unix)]
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stopping.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => admit(stream, peer, shared),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                warn!(target: "gradsync::bootstrap", error = %e, "store server accept failed");
                thread::sleep(ACCEPT_ERROR_BACKOFF);
            }
        }
    }
}

/// Starts a thread for a new connection, or refuses it when at the connection limit.
fn admit(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) {
    if let Err(e) = stream.set_nonblocking(false) {
        warn!(target: "gradsync::bootstrap", %peer, error = %e, "store connection setup failed");
        return;
    }
    let mut conns = lock(&shared.conns);
    if conns.live.len() >= shared.config.max_connections {
        let live = conns.live.len();
        drop(conns);
        warn!(target: "gradsync::bootstrap", %peer, live, "store connection refused: too many connections");
        let msg = format!("store server refuses connection: {live} connections open, the limit");
        let bytes = Repr::Error { message: &msg }.to_bytes();
        let _ = framed::write_all_by(&stream, &bytes, Instant::now() + REJECT_WRITE_TIMEOUT);
        return;
    }
    let stream = Arc::new(stream);
    let thread_stream = Arc::clone(&stream);
    let id = conns.next_id;
    conns.next_id += 1;
    let thread_shared = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name(format!("gradsync-store-conn-{id}"))
        .stack_size(CONN_STACK)
        .spawn(move || {
            serve(&thread_stream, peer, &thread_shared);
            let _ = thread_stream.shutdown(Shutdown::Both);
            lock(&thread_shared.conns).live.remove(&id);
        });
    match spawned {
        Ok(thread) => {
            conns.live.insert(id, Conn { stream, thread });
        }
        Err(e) => {
            warn!(target: "gradsync::bootstrap", %peer, error = %e, "store connection thread not started");
        }
    }
}

/// Reads from an idle-tolerant connection: no deadline before a frame's first byte (checking
/// for shutdown every [`IDLE_POLL`]), then `timeout` to complete the frame.
struct ConnReader<'a> {
    stream: &'a TcpStream,
    shared: &'a Shared,
    frame_deadline: Option<Instant>,
}

impl ReadSome for ConnReader<'_> {
    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.shared.stopping.load(Ordering::SeqCst) {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "store server shutting down",
                ));
            }
            let mut stream = self.stream;
            match stream.read(buf) {
                Ok(n) => {
                    if n > 0 && self.frame_deadline.is_none() {
                        self.frame_deadline = Some(Instant::now() + self.shared.config.io_timeout);
                    }
                    return Ok(n);
                }
                Err(e) if framed::is_timeout(&e) => {
                    if self.frame_deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!(
                                "frame not completed within {:?}",
                                self.shared.config.io_timeout
                            ),
                        ));
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Serves one connection until the peer closes it, sends something invalid, or the server stops.
fn serve(stream: &TcpStream, peer: SocketAddr, shared: &Shared) {
    debug!(target: "gradsync::bootstrap", %peer, "store connection opened");
    let _ = stream.set_nodelay(true);
    if let Err(e) = stream.set_read_timeout(Some(IDLE_POLL)) {
        warn!(target: "gradsync::bootstrap", %peer, error = %e, "store connection setup failed");
        return;
    }
    if let Some(token) = &shared.config.token {
        let id = shared.local_addr.to_string();
        let timeout = shared.config.io_timeout.min(crate::HANDSHAKE_TIMEOUT);
        match auth::server_handshake(stream, token, &id, timeout) {
            Ok(rank) => {
                debug!(target: "gradsync::bootstrap", %peer, rank, "store connection authenticated");
            }
            Err(reason) => {
                if !shared.stopping.load(Ordering::SeqCst) {
                    warn!(target: "gradsync::bootstrap", %peer, %reason,
                        "store connection from {peer} refused: authentication failed");
                    refuse(stream, "authentication failed", shared);
                }
                return;
            }
        }
        if let Err(e) = stream.set_read_timeout(Some(IDLE_POLL)) {
            warn!(target: "gradsync::bootstrap", %peer, error = %e, "store connection setup failed");
            return;
        }
    }
    let mut buf = Vec::new();
    loop {
        let mut reader = ConnReader {
            stream,
            shared,
            frame_deadline: None,
        };
        match framed::read_frame(&mut reader, &mut buf) {
            Ok(()) => {}
            Err(FrameReadError::Closed) => {
                debug!(target: "gradsync::bootstrap", %peer, "store connection closed by peer");
                return;
            }
            Err(FrameReadError::Io(e)) => {
                if shared.stopping.load(Ordering::SeqCst) {
                    debug!(target: "gradsync::bootstrap", %peer, "store connection closed by shutdown");
                } else {
                    warn!(target: "gradsync::bootstrap", %peer, error = %e, "store connection dropped");
                }
                return;
            }
            Err(FrameReadError::Header(e)) => {
                warn!(target: "gradsync::bootstrap", %peer, error = %e, "invalid frame header; closing connection");
                refuse(stream, &format!("invalid frame header: {e}"), shared);
                return;
            }
        }
        let frame = Frame::new_unchecked(&buf[..]);
        let repr = match Repr::parse(&frame) {
            Ok(repr) => repr,
            Err(e) => {
                warn!(target: "gradsync::bootstrap", %peer, error = %e, "invalid frame; closing connection");
                refuse(stream, &format!("invalid frame: {e}"), shared);
                return;
            }
        };
        if !repr.kind().is_request() {
            let kind = repr.kind();
            warn!(target: "gradsync::bootstrap", %peer, %kind, "non-request frame sent to server; closing connection");
            refuse(
                stream,
                &format!("unexpected {kind} frame: clients send requests"),
                shared,
            );
            return;
        }
        let reply = handle(&repr, peer, shared);
        let deadline = Instant::now() + shared.config.io_timeout;
        if let Err(e) = framed::write_all_by(stream, &reply, deadline) {
            if !shared.stopping.load(Ordering::SeqCst) {
                warn!(target: "gradsync::bootstrap", %peer, error = %e, "store reply not sent; closing connection");
            }
            return;
        }
        if buf.capacity() > KEEP_BUFFER {
            buf = Vec::new();
        }
    }
}

/// Sends an error reply, then closes the connection after draining the peer's input for a
/// bounded time, so that the peer can read the reply.
fn refuse(stream: &TcpStream, message: &str, shared: &Shared) {
    let bytes = Repr::Error {
        message: wire::truncate_message(message),
    }
    .to_bytes();
    let deadline = Instant::now() + shared.config.io_timeout.min(LINGER);
    if framed::write_all_by(stream, &bytes, deadline).is_err() {
        return;
    }
    let _ = stream.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    let mut stream = stream;
    while Instant::now() < deadline && !shared.stopping.load(Ordering::SeqCst) {
        match stream.read(&mut sink) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if framed::is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Executes one request and returns the encoded reply.
fn handle(repr: &Repr<'_>, peer: SocketAddr, shared: &Shared) -> Vec<u8> {
    let max = shared.config.max_total_bytes;
    match *repr {
        Repr::Set { key, value } => {
            debug!(target: "gradsync::bootstrap", %peer, key, len = value.len(), "store set");
            let value: Arc<[u8]> = Arc::from(value);
            let result = lock(&shared.state).set_and_release(key, value, max);
            match result {
                Ok(waiters) => {
                    wake(waiters);
                    Repr::Ok.to_bytes()
                }
                Err(msg) => error_reply(&msg, peer),
            }
        }
        Repr::Get { key } => {
            let value = lock(&shared.state).map.get(key).cloned();
            debug!(target: "gradsync::bootstrap", %peer, key, found = value.is_some(), "store get");
            match value {
                Some(value) => Repr::Value { value: &value }.to_bytes(),
                None => Repr::NotFound.to_bytes(),
            }
        }
        Repr::Add { key, delta } => {
            let result = lock(&shared.state).add_and_release(key, delta, max);
            debug!(target: "gradsync::bootstrap", %peer, key, delta, result = ?result.as_ref().map(|r| r.0), "store add");
            match result {
                Ok((value, waiters)) => {
                    wake(waiters);
                    Repr::Int { value }.to_bytes()
                }
                Err(msg) => error_reply(&msg, peer),
            }
        }
        Repr::Delete { key } => {
            let removed = lock(&shared.state).delete(key);
            debug!(target: "gradsync::bootstrap", %peer, key, removed, "store delete");
            if removed { Repr::Ok } else { Repr::NotFound }.to_bytes()
        }
        Repr::Wait {
            ref keys,
            timeout_ms,
        } => {
            debug!(target: "gradsync::bootstrap", %peer, keys = keys.len(), first = keys.first().copied(), timeout_ms, "store wait");
            match wait(shared, keys, timeout_ms) {
                WaitOutcome::Ready(values) => Repr::Values {
                    values: values.iter().map(|v| &v[..]).collect(),
                }
                .to_bytes(),
                WaitOutcome::Missing(missing) => {
                    debug!(target: "gradsync::bootstrap", %peer, missing = missing.len(), timeout_ms, "store wait timed out");
                    Repr::Timeout { missing }.to_bytes()
                }
                WaitOutcome::TooLarge(len) => error_reply(
                    &format!(
                        "values of {} keys total {len} bytes, more than the {MAX_BODY_LEN} bytes one reply holds",
                        keys.len()
                    ),
                    peer,
                ),
                WaitOutcome::Stopping => error_reply("store server shutting down", peer),
            }
        }
        // Responses and handshake frames are refused before `handle` is called.
        Repr::AuthChallenge { .. } | Repr::AuthResponse { .. } | Repr::AuthConfirm { .. } => {
            error_reply("unexpected handshake frame", peer)
        }
        Repr::Ok
        | Repr::Value { .. }
        | Repr::Values { .. }
        | Repr::NotFound
        | Repr::Int { .. }
        | Repr::Timeout { .. }
        | Repr::Error { .. } => error_reply("unexpected response frame", peer),
    }
}

fn error_reply(message: &str, peer: SocketAddr) -> Vec<u8> {
    debug!(target: "gradsync::bootstrap", %peer, message, "store request refused");
    Repr::Error {
        message: wire::truncate_message(message),
    }
    .to_bytes()
}

#[derive(Debug)]
enum WaitOutcome<'k> {
    Ready(Vec<Arc<[u8]>>),
    Missing(Vec<&'k str>),
    TooLarge(usize),
    Stopping,
}

/// Blocks until every key exists or the (clamped) timeout passes.
///
/// While keys are missing, the wait is registered under the first missing one (in request
/// order) with a condition variable of its own, so that it wakes only when that key is set or
/// added to, at its deadline, or at shutdown. A wait on `n` keys thus wakes about `n` times at
/// most, however many other keys change meanwhile.
fn wait<'k>(shared: &Shared, keys: &[&'k str], timeout_ms: u64) -> WaitOutcome<'k> {
    let timeout = Duration::from_millis(timeout_ms.min(MAX_WAIT_TIMEOUT_MS));
    let deadline = Instant::now() + timeout;
    let cv = Arc::new(Condvar::new());
    let mut state = lock(&shared.state);
    let id = state.next_waiter;
    state.next_waiter += 1;
    // The key this wait is registered under, if any.
    let mut registered: Option<&'k str> = None;
    // Where the search for a missing key starts: the keys before the one last found missing
    // were present then, so each key is usually looked up once however often the wait wakes.
    let mut from = 0;
    let outcome = loop {
        if let Some(key) = registered.take() {
            state.unregister(key, id);
        }
        let absent = |k: &&str| !state.map.contains_key(*k);
        let found = match keys[from..].iter().position(absent) {
            Some(i) => Some(from + i),
            // A delete may have removed one of the earlier keys meanwhile.
            None => keys[..from].iter().position(absent),
        };
        let Some(missing) = found.map(|i| {
            from = i;
            keys[i]
        }) else {
            let values: Vec<Arc<[u8]>> = keys
                .iter()
                .filter_map(|k| state.map.get(*k).cloned())
                .collect();
            let len = values
                .iter()
                .fold(4usize, |acc, v| acc.saturating_add(4 + v.len()));
            if len > MAX_BODY_LEN {
                break WaitOutcome::TooLarge(len);
            }
            break WaitOutcome::Ready(values);
        };
        if shared.stopping.load(Ordering::SeqCst) {
            break WaitOutcome::Stopping;
        }
        let now = Instant::now();
        if now >= deadline {
            let missing = keys
                .iter()
                .copied()
                .filter(|k| !state.map.contains_key(*k))
                .collect();
            break WaitOutcome::Missing(missing);
        }
        state.register(missing, id, &cv);
        registered = Some(missing);
        state = cv
            .wait_timeout(state, deadline - now)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    };
    drop(state);
    outcome
}

/// Signals the waits taken from a key's entry (after the state lock is released, so that they
/// do not wake into a held lock).
fn wake(waiters: Option<Waiters>) {
    for cv in waiters.into_iter().flat_map(HashMap::into_values) {
        cv.notify_one();
    }
}

impl State {
    fn entry_bytes(key: &str, value: &[u8]) -> u64 {
        key.len() as u64 + value.len() as u64
    }

    /// Registers wait `id` under the missing `key`.
    fn register(&mut self, key: &str, id: u64, cv: &Arc<Condvar>) {
        if let Some(waiters) = self.waiters.get_mut(key) {
            waiters.insert(id, Arc::clone(cv));
        } else {
            self.waiters
                .insert(key.to_owned(), HashMap::from([(id, Arc::clone(cv))]));
        }
    }

    /// Removes wait `id` from the entry of `key`, if it is still there (a set or add of the
    /// key takes the whole entry).
    fn unregister(&mut self, key: &str, id: u64) {
        if let Some(waiters) = self.waiters.get_mut(key) {
            waiters.remove(&id);
            if waiters.is_empty() {
                self.waiters.remove(key);
            }
        }
    }

    /// [`State::set`], then takes the waits registered under `key`, for the caller to wake.
    fn set_and_release(
        &mut self,
        key: &str,
        value: Arc<[u8]>,
        max: u64,
    ) -> Result<Option<Waiters>, String> {
        self.set(key, value, max)?;
        Ok(self.waiters.remove(key))
    }

    /// [`State::add`], then takes the waits registered under `key`, for the caller to wake.
    fn add_and_release(
        &mut self,
        key: &str,
        delta: i64,
        max: u64,
    ) -> Result<(i64, Option<Waiters>), String> {
        let value = self.add(key, delta, max)?;
        Ok((value, self.waiters.remove(key)))
    }

    /// Replaces the value of `key`, keeping the total under `max`.
    fn set(&mut self, key: &str, value: Arc<[u8]>, max: u64) -> Result<(), String> {
        let old = self.map.get(key).map_or(0, |v| Self::entry_bytes(key, v));
        let new = Self::entry_bytes(key, &value);
        let total = self.total_bytes - old + new;
        if total > max {
            return Err(format!(
                "store full: setting key {key:?} ({new} bytes) would hold {total} bytes, more than the limit of {max}"
            ));
        }
        self.total_bytes = total;
        if let Some(slot) = self.map.get_mut(key) {
            *slot = value;
        } else {
            self.map.insert(key.to_owned(), value);
        }
        Ok(())
    }

    /// Adds `delta` to the decimal integer at `key` (missing counts as 0).
    fn add(&mut self, key: &str, delta: i64, max: u64) -> Result<i64, String> {
        let current = match self.map.get(key) {
            None => 0,
            Some(v) => core::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| {
                    format!(
                        "value of key {key:?} ({} bytes) is not a decimal integer",
                        v.len()
                    )
                })?,
        };
        let value = current
            .checked_add(delta)
            .ok_or_else(|| format!("adding {delta} to {current} at key {key:?} overflows i64"))?;
        self.set(key, Arc::from(value.to_string().as_bytes()), max)?;
        Ok(value)
    }

    /// Removes `key`; whether it existed.
    fn delete(&mut self, key: &str) -> bool {
        match self.map.remove(key) {
            Some(v) => {
                self.total_bytes -= Self::entry_bytes(key, &v);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests;
