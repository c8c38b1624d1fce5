//! Pure, I/O-free building blocks of gradsync.
//!
//! This crate knows nothing of sockets, threads or clocks. It holds:
//!
//! - the element types and reduction operators ([`DataType`], [`ReduceOp`]);
//! - the signature every data message carries ([`wire::Signature`], [`wire::DataHeader`]), so a
//!   rank that calls a different collective than its peers is caught on the first message;
//! - the collective schedules as deterministic state machines ([`schedule`]): given rank, world,
//!   count and segment size they produce a program of sends, receives and local reductions, and a
//!   [`schedule::Schedule`] hands out the operations that may start now (`poll_action`) and takes
//!   completions (`handle_complete`);
//! - a simulator ([`sim`]) that runs N ranks of any schedule in memory with seeded reordering and
//!   checks the result bit for bit against a naive reference.
#![forbid(unsafe_code)]

pub mod proto;
pub mod reference;
pub mod rng;
pub mod schedule;
pub mod sim;
mod types;
pub mod wire;

pub use types::{Collective, DataType, ReduceOp, TypeError};
