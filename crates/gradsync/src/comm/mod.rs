//! The communicator: the public face of gradsync.
//!
//! The methods of a communicator live by concern, each module adding its own
//! `impl Communicator` block:
//!
//! - [`bootstrap`]: init (from the environment or a [`Config`]), interface and address
//!   resolution, the rendezvous exchange, shared-memory and RDMA setup, in-process groups, and
//!   shrink;
//! - [`calibrate`]: the cost model settled at init (measured, cached or pinned) and its
//!   publication to every rank;
//! - [`choice`]: the algorithm a call runs (forced or chosen by the cost model) and the
//!   explanation of that choice;
//! - [`collectives`]: the public collective calls and point-to-point send/receive, with their
//!   planning;
//! - [`queue`]: [`Pending`] and the queue of operations on owned buffers ([`Work`]);
//! - `call`: a call checked before it starts, shared by the blocking, async and grouped forms;
//! - `exchange`: all-to-all(v), gather, scatter, the in-place all-gather and reduce-scatter,
//!   and the async form of every collective;
//! - `group`: several operations started together and waited for together ([`Group`]);
//! - `addresses`: the listening addresses of init through the store, each rank reading only
//!   those of the peers it dials;
//! - `records`: how the ranks of a communicator being built swap their setup records
//!   (through the store at init, over the parent's messages in a split);
//! - `split`: communicators made out of an existing one without a new rendezvous.

mod addresses;
mod bootstrap;
mod calibrate;
mod call;
mod choice;
mod collectives;
mod communicator;
mod exchange;
mod group;
mod queue;
mod records;
mod slot_layout;
mod split;
mod state;
mod tables;

pub use communicator::{Communicator, PeerRecords};
pub use group::{Group, GroupPending};
pub use queue::{Pending, Work};
