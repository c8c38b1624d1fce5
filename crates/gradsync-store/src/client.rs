//! The store client: one TCP connection, one request in flight at a time.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::StoreError;
use crate::auth;
use crate::framed::{self, DeadlineReader, FrameReadError};
use crate::wire::{Frame, MAX_WAIT_TIMEOUT_MS, Repr, WireError};

/// Default per-request I/O deadline.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(60);

/// Added to a wait's own timeout to get the client's read deadline for the reply: the server
/// answers at its deadline, the margin covers transfer and scheduling delays.
pub const WAIT_REPLY_MARGIN: Duration = Duration::from_secs(5);

/// Longest time a client and a server give the authentication handshake (also bounded by
/// their I/O deadlines); a client with a token that gets no challenge within it reports that
/// the store seems to run without a token.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// First pause between connection attempts; it doubles up to [`CONNECT_BACKOFF_MAX`].
const CONNECT_BACKOFF_START: Duration = Duration::from_millis(10);
const CONNECT_BACKOFF_MAX: Duration = Duration::from_millis(250);
/// The request buffer is released before a request when it grew beyond this.
const KEEP_BUFFER: usize = 1 << 20;

/// A connection to a [`StoreServer`](crate::StoreServer).
///
/// Requests are synchronous: each sends one frame and reads one reply, under the I/O deadline
/// of [`StoreClient::set_io_timeout`] (a wait reads under its own timeout plus
/// [`WAIT_REPLY_MARGIN`]). An I/O or protocol error closes the connection, since the stream
/// position is then unknown; later calls fail with [`StoreError::Disconnected`].
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    stream: Option<TcpStream>,
    io_timeout: Duration,
    buf: Vec<u8>,
    /// Bytes of request frames written and of reply frames read, over the client's life.
    traffic: Traffic,
}

/// The bytes a [`StoreClient`] has exchanged with its store: whole frames, headers included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes of the requests sent.
    pub sent: u64,
    /// Bytes of the replies received.
    pub received: u64,
}

/// A reply, owned, as the client acts on it.
enum Reply {
    Ok,
    Value(Vec<u8>),
    Values(Vec<Vec<u8>>),
    NotFound,
    Int(i64),
    Timeout(Vec<String>),
    Error(String),
}

impl Reply {
    fn from_repr(repr: Repr<'_>) -> Option<Reply> {
        Some(match repr {
            Repr::Ok => Reply::Ok,
            Repr::Value { value } => Reply::Value(value.to_vec()),
            Repr::Values { values } => {
                Reply::Values(values.into_iter().map(<[u8]>::to_vec).collect())
            }
            Repr::NotFound => Reply::NotFound,
            Repr::Int { value } => Reply::Int(value),
            Repr::Timeout { missing } => {
                Reply::Timeout(missing.into_iter().map(str::to_owned).collect())
            }
            Repr::Error { message } => Reply::Error(message.to_owned()),
            Repr::Set { .. }
            | Repr::Get { .. }
            | Repr::Wait { .. }
            | Repr::Add { .. }
            | Repr::Delete { .. }
            | Repr::AuthChallenge { .. }
            | Repr::AuthResponse { .. }
            | Repr::AuthConfirm { .. } => {
                return None;
            }
        })
    }

    fn kind(&self) -> crate::wire::Kind {
        use crate::wire::Kind;
        match self {
            Reply::Ok => Kind::Ok,
            Reply::Value(_) => Kind::Value,
            Reply::Values(_) => Kind::Values,
            Reply::NotFound => Kind::NotFound,
            Reply::Int(_) => Kind::Int,
            Reply::Timeout(_) => Kind::Timeout,
            Reply::Error(_) => Kind::Error,
        }
    }
}

/// Why an exchange failed, before context is added.
enum ExchangeError {
    Io(io::Error),
    Timeout(Duration),
    Wire(WireError),
    Unexpected(crate::wire::Kind),
}

impl StoreClient {
    /// Connects to the store at `addr` (`"host:port"`), retrying with back-off while the server
    /// is not up yet, until `timeout` has elapsed. At least one attempt is made.
    ///
    /// The error ([`StoreError::Connect`]) names the address, the timeout, how long the client
    /// tried and the last attempt's error. An address that does not parse fails at once.
    ///
    /// The client sends no token: a store that requires one refuses the first request with
    /// [`StoreError::AuthFailed`]. See [`StoreClient::connect_with_token`].
    pub fn connect(addr: &str, timeout: Duration) -> Result<StoreClient, StoreError> {
        StoreClient::connect_with_token(addr, timeout, None, 0)
    }

    /// Connects as [`StoreClient::connect`] does, then, with a token, runs the authentication
    /// handshake (see the [crate-level documentation](crate#authentication)) speaking for
    /// `rank`: the client proves it holds the token and checks that the server does too,
    /// without the token crossing the wire.
    ///
    /// A wrong token on either side, a store without a token, or a server that cannot prove it
    /// holds the token fail at once (no retry) with [`StoreError::AuthFailed`] naming the
    /// store address. With `token: None` this is [`StoreClient::connect`].
    pub fn connect_with_token(
        addr: &str,
        timeout: Duration,
        token: Option<&[u8]>,
        rank: usize,
    ) -> Result<StoreClient, StoreError> {
        let start = Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or_else(|| start + Duration::from_secs(365 * 24 * 3600));
        let mut attempts = 0u32;
        let mut backoff = CONNECT_BACKOFF_START;
        loop {
            attempts += 1;
            let error = match try_connect(addr, deadline) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    if let Some(token) = token {
                        let hs_timeout = DEFAULT_IO_TIMEOUT.min(HANDSHAKE_TIMEOUT);
                        if let Err(reason) =
                            auth::client_handshake(&stream, token, rank as u64, hs_timeout)
                        {
                            let _ = stream.shutdown(Shutdown::Both);
                            let error = StoreError::AuthFailed {
                                addr: addr.to_owned(),
                                reason,
                            };
                            warn!(target: "gradsync::bootstrap", error = %error, "store authentication failed");
                            return Err(error);
                        }
                        debug!(target: "gradsync::bootstrap", addr, rank, "authenticated to store");
                    }
                    debug!(target: "gradsync::bootstrap", addr, attempts, waited = ?start.elapsed(), "connected to store");
                    return Ok(StoreClient {
                        addr: addr.to_owned(),
                        stream: Some(stream),
                        io_timeout: DEFAULT_IO_TIMEOUT,
                        buf: Vec::new(),
                        traffic: Traffic::default(),
                    });
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline || error.kind() == io::ErrorKind::InvalidInput {
                warn!(target: "gradsync::bootstrap", addr, attempts, error = %error, "could not connect to store");
                return Err(StoreError::Connect {
                    addr: addr.to_owned(),
                    timeout,
                    waited: now - start,
                    attempts,
                    source: error,
                });
            }
            debug!(target: "gradsync::bootstrap", addr, attempts, error = %error, "store not reachable yet; retrying");
            thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(CONNECT_BACKOFF_MAX);
        }
    }

    /// The store address this client was connected with.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The per-request I/O deadline.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Sets the per-request I/O deadline (default 60 s, at least 1 ms): the time allowed to
    /// send a request and to receive the reply of a set, get, add or delete, so that no call
    /// blocks forever on a dead server.
    pub fn set_io_timeout(&mut self, t: Duration) {
        self.io_timeout = t.max(Duration::from_millis(1));
    }

    /// The bytes this client has sent to and received from the store so far (whole frames).
    pub fn traffic(&self) -> Traffic {
        self.traffic
    }

    /// Whether the connection is still usable (no earlier I/O or protocol error closed it).
    pub fn is_connected(&self) -> bool {
        self.stream.is_some()
    }

    /// Stores `value` under `key`, replacing any previous value, and wakes waits on it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        const OP: &str = "set";
        match self.call(OP, key, &Repr::Set { key, value }, self.io_timeout)? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected(OP, key, other)),
        }
    }

    /// The value of `key`, or `None` if it does not exist.
    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        const OP: &str = "get";
        match self.call(OP, key, &Repr::Get { key }, self.io_timeout)? {
            Reply::Value(value) => Ok(Some(value)),
            Reply::NotFound => Ok(None),
            other => Err(self.unexpected(OP, key, other)),
        }
    }

    /// Blocks until every key exists, then returns their values in the order of `keys`.
    ///
    /// The server waits at most `timeout` (rounded up to milliseconds, clamped to 24 hours);
    /// the client waits for the reply that long plus [`WAIT_REPLY_MARGIN`]. On deadline the
    /// error ([`StoreError::WaitTimeout`]) names the keys still missing and the timeout.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, StoreError> {
        const OP: &str = "wait";
        let mut timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        if Duration::from_millis(timeout_ms) < timeout {
            timeout_ms = timeout_ms.saturating_add(1);
        }
        let timeout_ms = timeout_ms.min(MAX_WAIT_TIMEOUT_MS);
        let reply_timeout = Duration::from_millis(timeout_ms) + WAIT_REPLY_MARGIN;
        let summary = summarize(keys);
        let request = Repr::Wait {
            keys: keys.to_vec(),
            timeout_ms,
        };
        match self.call(OP, &summary, &request, reply_timeout)? {
            Reply::Values(values) if values.len() == keys.len() => Ok(values),
            Reply::Timeout(missing) => Err(StoreError::WaitTimeout {
                addr: self.addr.clone(),
                timeout,
                missing,
            }),
            other => Err(self.unexpected(OP, &summary, other)),
        }
    }

    /// Atomically adds `delta` to the integer stored at `key` (a missing key counts as 0) and
    /// returns the new value.
    ///
    /// The integer is stored as ASCII decimal, so [`StoreClient::get`] returns e.g. `b"42"`,
    /// and a key set to `b"7"` can be added to. Overflow and non-integer values are refused
    /// with [`StoreError::Server`].
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        const OP: &str = "add";
        match self.call(OP, key, &Repr::Add { key, delta }, self.io_timeout)? {
            Reply::Int(value) => Ok(value),
            other => Err(self.unexpected(OP, key, other)),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&mut self, key: &str) -> Result<bool, StoreError> {
        const OP: &str = "delete";
        match self.call(OP, key, &Repr::Delete { key }, self.io_timeout)? {
            Reply::Ok => Ok(true),
            Reply::NotFound => Ok(false),
            other => Err(self.unexpected(OP, key, other)),
        }
    }

    /// Sends `request` and reads its reply. Error replies become [`StoreError::Server`]; I/O
    /// and protocol errors close the connection.
    fn call(
        &mut self,
        op: &'static str,
        key: &str,
        request: &Repr<'_>,
        reply_timeout: Duration,
    ) -> Result<Reply, StoreError> {
        if let Err(source) = request.validate() {
            return Err(StoreError::InvalidRequest {
                addr: self.addr.clone(),
                op,
                key: key.to_owned(),
                source,
            });
        }
        let Some(stream) = self.stream.as_ref() else {
            return Err(StoreError::Disconnected {
                addr: self.addr.clone(),
                op,
            });
        };
        if self.buf.capacity() > KEEP_BUFFER {
            self.buf = Vec::new();
        }
        let result = exchange(
            stream,
            &mut self.buf,
            request,
            self.io_timeout,
            reply_timeout,
            &mut self.traffic,
        );
        let error = match result {
            Ok(Reply::Error(message)) => {
                return Err(StoreError::Server {
                    addr: self.addr.clone(),
                    op,
                    key: key.to_owned(),
                    message,
                });
            }
            Ok(reply) => return Ok(reply),
            Err(e) => e,
        };
        self.close();
        let addr = self.addr.clone();
        let error = match error {
            ExchangeError::Io(source) => StoreError::Io {
                addr,
                op,
                key: key.to_owned(),
                source,
            },
            ExchangeError::Timeout(after) => StoreError::Timeout {
                addr,
                op,
                key: key.to_owned(),
                after,
            },
            ExchangeError::Wire(source) => StoreError::Protocol { addr, op, source },
            ExchangeError::Unexpected(kind) if kind.is_auth() => StoreError::AuthFailed {
                addr,
                reason: "the store requires a job token (GRADSYNC_TOKEN) and this client has none"
                    .into(),
            },
            ExchangeError::Unexpected(kind) => StoreError::UnexpectedReply { addr, op, kind },
        };
        warn!(target: "gradsync::bootstrap", error = %error, "store request failed; connection closed");
        Err(error)
    }

    /// A well-formed reply of the wrong kind: the conversation is out of step, so close.
    fn unexpected(&mut self, op: &'static str, key: &str, reply: Reply) -> StoreError {
        self.close();
        let error = StoreError::UnexpectedReply {
            addr: self.addr.clone(),
            op,
            kind: reply.kind(),
        };
        warn!(target: "gradsync::bootstrap", key, error = %error, "store request failed; connection closed");
        error
    }

    fn close(&mut self) {
        if let Some(stream) = self.stream.take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// One request/reply exchange on `stream`, using `buf` for both frames.
fn exchange(
    stream: &TcpStream,
    buf: &mut Vec<u8>,
    request: &Repr<'_>,
    io_timeout: Duration,
    reply_timeout: Duration,
    traffic: &mut Traffic,
) -> Result<Reply, ExchangeError> {
    buf.clear();
    buf.resize(request.buffer_len(), 0);
    traffic.sent += buf.len() as u64;
    request.emit(&mut Frame::new_unchecked(&mut buf[..]));
    let deadline = Instant::now() + io_timeout;
    framed::write_all_by(stream, buf, deadline).map_err(|e| {
        if framed::is_timeout(&e) {
            ExchangeError::Timeout(io_timeout)
        } else {
            ExchangeError::Io(e)
        }
    })?;
    let mut reader = DeadlineReader {
        stream,
        deadline: Instant::now() + reply_timeout,
    };
    match framed::read_frame(&mut reader, buf) {
        Ok(()) => {}
        Err(FrameReadError::Closed) => {
            return Err(ExchangeError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the store closed the connection",
            )));
        }
        Err(FrameReadError::Io(e)) if framed::is_timeout(&e) => {
            return Err(ExchangeError::Timeout(reply_timeout));
        }
        Err(FrameReadError::Io(e)) => return Err(ExchangeError::Io(e)),
        Err(FrameReadError::Header(e)) => return Err(ExchangeError::Wire(e)),
    }
    traffic.received += buf.len() as u64;
    let repr = Repr::parse(&Frame::new_unchecked(&buf[..])).map_err(ExchangeError::Wire)?;
    let kind = repr.kind();
    Reply::from_repr(repr).ok_or(ExchangeError::Unexpected(kind))
}

/// Connects to the first address `addr` resolves to that accepts, before `deadline`.
fn try_connect(addr: &str, deadline: Instant) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        "address resolved to no socket address",
    );
    for a in addrs {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&a, left) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// A short description of a key list for error context: the first key and how many more.
fn summarize(keys: &[&str]) -> String {
    match keys {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [first, rest @ ..] => format!("{first} (+{} more)", rest.len()),
    }
}
