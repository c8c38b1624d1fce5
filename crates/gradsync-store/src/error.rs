//! The error type of the store.

use std::net::SocketAddr;
use std::time::Duration;

use crate::wire::{Kind, WireError};

/// Errors of the store server and client.
///
/// Every variant names the store address and, where there is one, the operation (`"set"`,
/// `"get"`, `"wait"`, `"add"`, `"delete"`) and the key it concerns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The server could not bind its listening socket or start its accept thread.
    #[error("could not start store server on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The client could not connect before its deadline.
    #[error(
        "could not connect to store at {addr} within {timeout:?} ({attempts} attempts over {waited:?}): {source}"
    )]
    Connect {
        /// The address, as given.
        addr: String,
        /// The connect timeout asked for.
        timeout: Duration,
        /// How long the client tried.
        waited: Duration,
        /// How many connection attempts were made.
        attempts: u32,
        /// The error of the last attempt.
        #[source]
        source: std::io::Error,
    },
    /// A request was refused locally because it breaks a protocol limit (key, value or list
    /// size); nothing was sent.
    #[error("{op} of key {key:?} not sent to store {addr}: {source}")]
    InvalidRequest {
        /// The store address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// The key (or a summary of the keys of a wait).
        key: String,
        /// The limit broken.
        #[source]
        source: WireError,
    },
    /// Sending a request or receiving its reply failed.
    #[error("{op} of key {key:?} on store {addr} failed: {source}")]
    Io {
        /// The store address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// The key (or a summary of the keys of a wait).
        key: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// No reply came within the I/O deadline (see `StoreClient::set_io_timeout`); the
    /// connection is closed.
    #[error("{op} of key {key:?} on store {addr} timed out after {after:?} without a reply")]
    Timeout {
        /// The store address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// The key (or a summary of the keys of a wait).
        key: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// A wait reached its deadline before every key existed.
    #[error("wait on store {addr} timed out after {timeout:?}; missing keys: {missing:?}")]
    WaitTimeout {
        /// The store address.
        addr: String,
        /// The wait timeout.
        timeout: Duration,
        /// The keys that still did not exist, in request order.
        missing: Vec<String>,
    },
    /// The server answered with an error (for example: store full, value not an integer,
    /// server shutting down).
    #[error("{op} of key {key:?} refused by store {addr}: {message}")]
    Server {
        /// The store address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// The key (or a summary of the keys of a wait).
        key: String,
        /// The server's message.
        message: String,
    },
    /// The server's reply is not a valid frame; the connection is closed.
    #[error("malformed reply to {op} from store {addr}: {source}")]
    Protocol {
        /// The store address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// What is wrong with the reply.
        #[source]
        source: WireError,
    },
    /// The server's reply is a valid frame of the wrong kind; the connection is closed.
    #[error("unexpected {kind} reply to {op} from store {addr}")]
    UnexpectedReply {
        /// The store address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// The kind of reply received.
        kind: Kind,
    },
    /// The authentication handshake failed: a wrong or missing token on one side, a store that
    /// runs without a token while this client has one, or a server that could not prove it
    /// holds the token. The connection is closed.
    #[error("authentication with store {addr} failed: {reason}")]
    AuthFailed {
        /// The store address.
        addr: String,
        /// What went wrong, as far as this side can tell.
        reason: String,
    },
    /// An earlier I/O or protocol error closed the connection; reconnect with
    /// `StoreClient::connect`.
    #[error("{op} on store {addr} not attempted: the connection was closed by an earlier error")]
    Disconnected {
        /// The store address.
        addr: String,
        /// The operation.
        op: &'static str,
    },
}
