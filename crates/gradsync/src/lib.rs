//! gradsync: collective communication for data-parallel training.
//!
//! A [`Communicator`] joins `world` ranks; every rank calls the same collectives in the same
//! order, and each call leaves every rank with bitwise identical results.
//!
//! ```no_run
//! use gradsync::{Communicator, ReduceOp};
//! # fn main() -> gradsync::Result<()> {
//! let mut comm = Communicator::from_env()?; // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce(&mut grads, ReduceOp::Avg)?;
//! # Ok(()) }
//! ```
//!
//! # Layers
//!
//! The arrows point down only: a schedule never knows a socket, a transport never knows an
//! algorithm.
//!
//! | crate | role |
//! |---|---|
//! | `gradsync-ddp` | training-loop layer: gradient buckets, accumulation, overlap with backward |
//! | `gradsync` (this crate) | [`Communicator`], the engine that runs schedules over a transport |
//! | `gradsync-core` | schedules as pure state machines (`poll_action` / `handle_complete`), the signature header, the simulator |
//! | `gradsync-reduce` | reduction kernels, dtype x op, vectorized |
//! | `gradsync-transport` | the verbs-shaped transport trait and its backends (in-memory, TCP, shared memory, RDMA verbs with the `rdma` feature, and the hybrid that routes each peer to shared memory or the network) |
//! | `gradsync-store` | the rendezvous key-value store used at init |
//!
//! # How a collective runs
//!
//! 1. The call is *planned*: `gradsync_core::schedule::plan::build` turns (collective, rank,
//!    world, count, segment size, algorithm) into a program of sends, receives-with-reduction
//!    and local copies with explicit dependencies. The signature (communicator id, sequence
//!    number, collective, type, op, count, root) is fixed.
//! 2. The engine runs the program. Each message goes into a slot of the receiver's *inbox*, a
//!    region registered at init whose key every peer learned through the store, as one
//!    write-with-immediate: a 64-byte header carrying the signature, then the payload straight
//!    from the caller's buffer. Credits (one per slot) flow back as small two-sided sends, the
//!    same clear-to-send scheme an RDMA backend uses. The receiver checks the header, reduces or
//!    copies the payload into place, and hands the slot back.
//! 3. The caller's thread drives all of it: it spins briefly (`GRADSYNC_SPIN_US`: polling
//!    without yielding for up to 50 us when every rank of the host, and of the machine's other
//!    network namespaces, has a core, yielding its core after that) and then sleeps in the
//!    transport, so small messages are fast on an idle machine and oversubscribed ranks (more
//!    ranks than cores) do not starve each other.
//!
//! # Bus bandwidth
//!
//! `gradsync bench` reports nccl-tests' figures: `algbw = bytes / time` and `busbw = algbw x f`
//! with `f = 2(n-1)/n` for all-reduce, `(n-1)/n` for reduce-scatter and all-gather, and 1 for
//! broadcast and reduce: the traffic each rank's link must carry relative to the buffer size, so
//! busbw is comparable with the link's rate whatever the world size.
//!
//! # Safety of buffers in flight
//!
//! A blocking call borrows its buffers for its duration. [`Pending`] holds the `&mut` borrow
//! until it is waited for (dropping it waits). [`Communicator::all_reduce_owned`] takes the
//! buffer by value and gives it back from [`Communicator::wait`]. Either way no gradient can be
//! touched while it is being reduced. Peers write into the engine's own inbox, and into caller
//! memory only after a clear-to-send of the running operation named that span (copy-receives
//! from the sizes `GRADSYNC_DIRECT_MIN` and `GRADSYNC_SHM_DIRECT_MIN` set, both off by default
//! but for all-to-all and all-gather over shared memory, from 64 KiB in blocks of at least
//! 8 MiB).

mod comm;
mod config;
pub mod cost;
mod element;
mod engine;
mod error;
pub mod logging;
pub mod recorder;
mod recv;
pub mod slurm;
pub mod topology;

pub use comm::{Communicator, Group, GroupPending, PeerRecords, Pending, Work};
pub use config::{Calibrate, Config, IbConfig, TransportMode};
pub use element::Element;
pub use engine::ReceivePool;
pub use error::{Error, Result};
pub use gradsync_core::schedule::plan::Algorithm;
pub use gradsync_core::{Collective, DataType, ReduceOp};
/// The route to a peer ([`Communicator::peer_transport`]).
pub use gradsync_transport::Route;
/// The RDMA backend's device queries (`list_ports`, `pick_gid`), with the `rdma` feature.
#[cfg(feature = "rdma")]
pub use gradsync_transport::rdma;
pub use logging::VERSION;
pub use recv::{RecvLayout, slot_peers};
