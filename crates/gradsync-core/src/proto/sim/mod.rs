//! The protocol machines of N ranks, run together over a simulated transport.
//!
//! [`run`] gives every rank a real [`Protocol`](super::Protocol) and a sequence of collective
//! calls, and plays the transport: one-sided writes land in the receiver's inbox (or straight
//! in its buffer) and notify it, two-sided messages arrive, local completions come back, boards
//! hold postings. At every step a seeded generator picks one of: a pending event (in any order
//! across pairs, and within a pair too unless [`SimConfig::fifo`]), or a rank that takes its
//! machine's actions and carries them out (a [`SimConfig::slow`] rank seldom). Ranks move on to
//! their next call on their own, so a fast rank's messages for a later call meet a slow rank
//! still in an earlier one.
//!
//! It checks what a real transport cannot: a write into a slot whose message was not consumed
//! (a credit rule broken), a write with a key of another operation, results that differ from
//! the reference bit for bit (inputs are exact in any order), and deadlock — no event pending
//! and no rank able to move, while some have calls left.

mod rank;
mod types;
mod world;

pub use types::{CallSpec, SimConfig, SimError, SimStats};
pub use world::run;

#[cfg(test)]
mod tests;
