//! The progress engine: drives a communicator's protocol machine over a transport endpoint.
//!
//! The protocol itself — inbox and slots, credits and windows, clear-to-send, eager messages
//! and board postings, probes and aborts — is the sans-IO [`Protocol`] of `gradsync-core`
//! (see [`gradsync_core::proto::manual`]). The engine is its driver:
//!
//! - **memory**: it allocates and registers the inbox and the header staging area, registers
//!   caller buffers (through a cache) and scratch, and checks every op of a program against
//!   the buffers before the operation starts ([`memory`]);
//! - **actions**: it carries out what the machine asks — posts writes and sends, copies or
//!   reduces arrived payloads into place (checking checksums first), runs local copies and
//!   rank-order reductions, posts on and reads from the transport's board — and feeds the
//!   transport's completions back ([`exec`]);
//! - **the fast path**: a small all-reduce over the board runs straight through when it can,
//!   with the machine's bytes and checks but none of its rounds, and goes to the machine when
//!   it cannot ([`fast`]);
//! - **waiting**: it spins for a short while when nothing moves (`GRADSYNC_SPIN_US`), then
//!   sleeps in the transport until data arrives, so an idle rank leaves its core to the others;
//!   every wait has a deadline, and a timeout asks every peer where it is ([`diagnose`]).
//!
//! The engine is driven by the calling thread: blocking calls run it to completion, an async
//! handle runs it from `test()`/`wait()`.

mod diagnose;
mod driver;
mod exec;
mod fast;
mod memory;

pub use driver::ReceivePool;
pub(crate) use driver::{Engine, EngineOptions, InboxSource, Planned};
pub(crate) use memory::RawBuf;
