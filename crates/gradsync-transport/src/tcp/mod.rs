//! TCP backend: verbs over sockets.
//!
//! Each pair of ranks is joined by `nsocks` TCP streams (`GRADSYNC_NSOCKS`). Every frame starts
//! with a 24-byte header ([`wire::FrameHeader`]: kind, immediate, remote key, payload length,
//! offset in the remote region).
//!
//! A write's payload is read straight into the destination region after the key and bounds
//! are checked: the first bytes that came with the header through the receive buffer are
//! copied, the rest is read from the socket directly into place. Sends go out with one
//! `sendmsg` over the header and the gather list. All sockets are non-blocking and driven by
//! [`Endpoint::poll`](crate::Endpoint::poll) from the caller's thread;
//! [`Endpoint::wait`](crate::Endpoint::wait) sleeps in `poll(2)`. A write with immediate of at
//! least 64 KiB to a peer on another host (see [`TcpOptions::local`]) with several streams is
//! striped: one part on each stream, and it
//! completes once every part has landed, the striped writes of a pair in the order they were
//! posted, so that one write does not share the link with the next. Smaller writes and sends
//! travel whole on one stream, the streams taken in turn, so their completions may arrive out
//! of order (the engine orders them by its slot counters).
//!
//! # Authentication
//!
//! The dialing rank opens each stream with a 24-byte hello ([`wire::Hello`]: magic `"GSTH"`,
//! version, communicator id, its rank, stream index, streams per peer); a hello that is malformed,
//! names another communicator or a slot already taken drops that connection. With a job token
//! ([`TcpOptions::token`]) the hello is followed by a mutual HMAC-SHA256 challenge-response,
//! so the token never crosses the wire:
//!
//! ```text
//! acceptor                                   dialer
//!                               <- hello
//!   Na (32 random bytes)        ->
//!                               <- Nd (32 random bytes), HMAC(token, "gradsync-data/dialer" || id || Na || Nd)
//!   HMAC(token, "gradsync-data/acceptor" || id || Na || Nd) ->
//! ```
//!
//! where `id` is the communicator id, dialer rank, acceptor rank and stream index (each a
//! little-endian u64). Fresh nonces on both sides make each proof single-use (no replay), the
//! two labels keep a proof from being reflected, and binding the communicator, both ranks and
//! the stream keeps a proof for one stream from opening another. Proofs are compared in
//! constant time. On the accepting side every read and write of the hello and handshake has a
//! timeout of at most 5 s and never past the setup deadline, all message sizes are fixed, and
//! a connection that fails is dropped with a warning while setup goes on, so the real peer can
//! still connect: a stranger (a port scanner, another job, a sender of garbage) neither stalls
//! setup past its deadline nor makes the rank allocate. The dialing side fails setup at once
//! with an error naming the peer and its address, since retrying with the same token cannot
//! help. Authentication covers who may connect; the data that follows is not encrypted.
//!
//! # Connections on first use
//!
//! [`TcpEndpoint::establish`] connects every pair at setup. [`TcpEndpoint::lazy`] connects to
//! nobody at setup: a pair connects when [`Endpoint::connect`](crate::Endpoint::connect) first
//! names it, which both ranks do before their first message (the engine does so for the peers
//! of every operation's program). In both, the higher rank of a pair dials the lower one's
//! listener and the lower one accepts; a lazy endpoint accepts whenever it polls and while its
//! own `connect` waits, so a dial is served as soon as the lower rank calls into the library,
//! and chains of dials, which only go down in rank, always end. Messages to a peer not
//! connected yet fail; [`PeerCaps::connected`](crate::PeerCaps::connected) tells. A lazy
//! endpoint's [`AddressBook`](crate::AddressBook) may know only some addresses: those of the
//! lower ranks a `connect` dials are fetched then, in one request.
//!
//! # Modules
//!
//! [`wire`] holds the formats; `options` [`TcpOptions`]; `setup` connection setup at init and
//! the listener; `auth` the handshake; `lazy` and `first_use` connections on first use;
//! `stream` one stream's receive state machine and send queue; `endpoint` the [`TcpEndpoint`]
//! and its [`Endpoint`](crate::Endpoint) implementation. The host's interfaces are the
//! communicator's business (`gradsync::topology`).

mod auth;
mod endpoint;
mod first_use;
mod lazy;
mod options;
pub(crate) mod setup;
mod stream;
#[cfg(test)]
mod tests;
pub mod wire;

pub use endpoint::TcpEndpoint;

pub use options::TcpOptions;
pub use setup::{LISTEN_BACKLOG, listen};
