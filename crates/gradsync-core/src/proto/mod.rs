//! The protocol of a rank with its peers, as a sans-IO state machine.
//!
//! A [`Protocol`] holds everything one rank knows about its pairs: credits and windows, slot
//! choice and message counters, clear-to-send offers, eager contributions and board postings,
//! timeout probes and aborts. It runs the operation in flight (a [`Schedule`] of the
//! [`crate::schedule`] model) and never touches memory, a clock or a transport: events come in
//! through `handle_*` methods (with the time passed in), and what to do comes out of
//! [`Protocol::poll_action`] as [`Action`]s — writes, control messages, deliveries of arrived
//! payloads, local copies and reductions. A driver (the engine of the `gradsync` crate, or the
//! simulator of [`sim`]) carries the actions out with real memory and a real (or simulated)
//! transport, and decides when to spin and when to sleep. The design is quinn-proto's
//! `Connection`; [`manual`] describes the protocol end to end.
//!
//! [`Schedule`]: crate::schedule::Schedule

mod action;
mod call;
mod eager;
mod eager_mode;
mod error;
mod fast;
mod link;
mod machine;
pub mod manual;
mod pool;
mod probe;
pub mod sim;

pub use action::{Action, Target};
pub use call::Mode;
pub use eager::EAGER_AHEAD_MAX;
pub use error::{ProtoError, Violation};
pub use fast::FastStart;
pub use link::IMM_DIRECT;
pub use machine::{
    BOARD_CHECK_EVERY, Config, Finished, IDLE_CREDIT_RETURN, OFFER_PATIENCE, PACE_MIN, Protocol,
    loc_bytes,
};
pub use probe::{Verdict, VerdictWithin};

#[cfg(test)]
mod tests;
