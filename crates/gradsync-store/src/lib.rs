//! Rendezvous key-value store over TCP, used to bootstrap a gradsync job.
//!
//! Rank 0 (or the launcher) runs a [`StoreServer`] on `MASTER_ADDR:MASTER_PORT`; every rank
//! connects a [`StoreClient`] and exchanges what the transports need to find each other
//! (addresses, ports, memory-region keys): each rank [`set`](StoreClient::set)s its own entry,
//! [`wait`](StoreClient::wait)s for its peers' entries, and counters built on
//! [`add`](StoreClient::add) make barriers and rank assignment.
//!
//! ```
//! use std::time::Duration;
//! use gradsync_store::{StoreClient, StoreServer};
//!
//! let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
//! let addr = server.local_addr().to_string();
//! let mut rank0 = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
//! let mut rank1 = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
//! rank1.set("addr/1", b"10.0.0.2:29500").unwrap();
//! let peers = rank0.wait(&["addr/1"], Duration::from_secs(5)).unwrap();
//! assert_eq!(peers[0], b"10.0.0.2:29500");
//! assert_eq!(rank0.add("barrier", 1).unwrap(), 1);
//! server.shutdown();
//! ```
//!
//! # Deadlines
//!
//! Nothing blocks forever. [`StoreClient::connect`] retries until its timeout; every request is
//! bounded by the client's I/O deadline ([`StoreClient::set_io_timeout`], 60 s by default); a
//! wait carries its timeout to the server, which answers `Timeout` with the missing keys when it
//! passes, and the client reads that answer under the wait timeout plus
//! [`WAIT_REPLY_MARGIN`]. The server gives a peer [`ServerConfig::io_timeout`] to finish a frame
//! it started and to take a reply, and [`StoreServer::shutdown`] is bounded in time.
//!
//! # Wire format
//!
//! Each request and each response is one frame: a 12-byte header, then a body. Integers are
//! little-endian. The typed view is [`wire::Frame`], the parsed form [`wire::Repr`].
//!
//! | offset | size | field     | value                                                   |
//! |-------:|-----:|-----------|---------------------------------------------------------|
//! | 0      | 4    | magic     | `"GSKV"` (`47 53 4b 56`)                                |
//! | 4      | 1    | version   | `1`                                                     |
//! | 5      | 1    | kind      | see below                                               |
//! | 6      | 2    | flags     | `0` (reserved; nonzero is rejected in version 1)        |
//! | 8      | 4    | body_len  | `u32`, at most [`wire::MAX_BODY_LEN`] (65 MiB)          |
//! | 12     | …    | body      | `body_len` bytes, fields of the kind in order           |
//!
//! Body fields are `u64`/`i64` (8 bytes), `u32` counts, and length-prefixed byte strings
//! `bytes = u32 len, len bytes`; keys and messages are UTF-8.
//!
//! | kind   | name     | body                                                      |
//! |--------|----------|-----------------------------------------------------------|
//! | `0x01` | Set      | `key: bytes, value: bytes`                                |
//! | `0x02` | Get      | `key: bytes`                                              |
//! | `0x03` | Wait     | `timeout_ms: u64, count: u32, count × key: bytes`         |
//! | `0x04` | Add      | `key: bytes, delta: i64`                                  |
//! | `0x05` | Delete   | `key: bytes`                                              |
//! | `0x40` | AuthChallenge | `nonce: 32 bytes, server_id: bytes` (server to client) |
//! | `0x41` | AuthResponse  | `rank: u64, nonce: 32 bytes, mac: 32 bytes`            |
//! | `0x42` | AuthConfirm   | `mac: 32 bytes` (server to client)                     |
//! | `0x80` | Ok       | empty (set done; delete removed the key)                  |
//! | `0x81` | Value    | `value: bytes` (get)                                      |
//! | `0x82` | Values   | `count: u32, count × value: bytes` (wait, request order)  |
//! | `0x83` | NotFound | empty (get; delete of a missing key)                      |
//! | `0x84` | Int      | `value: i64` (add)                                        |
//! | `0x85` | Timeout  | `count: u32, count × key: bytes` (wait: keys missing)     |
//! | `0x86` | Error    | `message: bytes`                                          |
//!
//! For example `Get { key: "a" }` is `47 53 4b 56 01 02 00 00 05 00 00 00 01 00 00 00 61`.
//!
//! Limits: key ≤ [`wire::MAX_KEY_LEN`] (4 KiB), value ≤ [`wire::MAX_VALUE_LEN`] (64 MiB),
//! keys per wait ≤ [`wire::MAX_WAIT_KEYS`] (4096), error message ≤ [`wire::MAX_ERROR_LEN`],
//! and the keys plus values held by a server ≤ [`ServerConfig::max_total_bytes`] (1 GiB by
//! default). Each length is checked before anything is allocated from it, and the body is
//! read (and its buffer grown) in 1 MiB steps as bytes arrive, so a peer that only announces a
//! large frame gets no large buffer. A frame that breaks the format or a limit gets an `Error`
//! reply, and its connection is closed; other connections are not affected. A request the
//! server cannot satisfy (store full, value not an integer) gets an `Error` reply and the
//! connection stays open. Encoding is canonical: every `Repr` has exactly one byte form.
//!
//! # Versioning
//!
//! The version byte is checked on every frame; a peer speaking another version gets an
//! `Error` reply naming both versions. The header flags are reserved (zero).
//!
//! # Authentication
//!
//! A job shares one secret, the job token (`GRADSYNC_TOKEN`; `gradsync launch` makes a random
//! one per job). A server given a token ([`ServerConfig::token`]) makes every new connection
//! prove it holds the token before serving any request, and proves the same in return, with a
//! challenge-response on HMAC-SHA256; the token itself never crosses the wire:
//!
//! ```text
//! server                                               client (rank r)
//!   AuthChallenge { Ns (32 random bytes), server_id } ->
//!                  <- AuthResponse { r, Nc (32 random bytes),
//!                                    HMAC(token, "gradsync-store/client" || Ns || Nc || r) }
//!   checks the proof (constant time)
//!   AuthConfirm { HMAC(token, "gradsync-store/server" || Ns || Nc || r) } ->
//!                                                      checks the proof (constant time)
//! ```
//!
//! (`r` is a little-endian `u64`.) Why this shape: fresh nonces from both sides make every
//! proof single-use, so a recorded handshake cannot be replayed to either side; the distinct
//! labels keep a proof from being reflected back to its sender; the server's proof lets a
//! rank refuse a look-alike store (for example a stale server of an earlier job on the same
//! port); HMAC verification compares in constant time. The handshake authenticates, it does
//! not encrypt: later frames travel in clear, as NCCL's and Gloo's do; the token only keeps
//! strangers (and other jobs) out.
//!
//! A connection that sends anything else first, a wrong proof, or nothing within
//! [`HANDSHAKE_TIMEOUT`] is logged once at warn level ("authentication failed", naming the
//! peer address), gets an `Error` reply and is closed; other connections are not affected,
//! and before authenticating a peer can make the server read at most a few KiB per
//! connection. The client reports every failure as [`StoreError::AuthFailed`] naming the
//! store address: a wrong token, a store that needs a token when the client has none (the
//! challenge arrives as the reply to its first request), or a store that sends no challenge
//! (it runs without a token). Kinds `0x43..=0x4f` are unassigned.
//!
//! The store binds the address it is given, which a job takes from `MASTER_ADDR` (rank 0's
//! interface), never the wildcard address: it is not reachable through other interfaces.
//!
//! # Logging
//!
//! Through `tracing` with target `gradsync::bootstrap`: connections, requests and retries at
//! debug level, refused frames, dropped connections and failed requests at warn level.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod auth;
mod client;
mod error;
mod framed;
mod server;
pub mod wire;

pub use client::{DEFAULT_IO_TIMEOUT, HANDSHAKE_TIMEOUT, StoreClient, Traffic, WAIT_REPLY_MARGIN};
pub use error::StoreError;
pub use server::{ServerConfig, StoreServer};
pub use wire::WireError;
