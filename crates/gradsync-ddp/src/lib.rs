//! gradsync-ddp: data-parallel training on top of [`gradsync`]: gradient buckets,
//! accumulation over micro-batches, and communication that overlaps the backward pass.
//!
//! # The two loops of a training step
//!
//! Data-parallel training runs the same model on every rank, each on its own shard of the
//! global batch. A step has two loops:
//!
//! - **Loop 1, compute** (every rank alone): for each of K micro-batches, forward, then backward;
//!   the micro-batch's gradients are *added* into an accumulation buffer. Nothing is sent: the
//!   first K-1 micro-batches run "without sync" (PyTorch's `no_sync()`), since summing K local
//!   gradients and then reducing once gives the same sum as reducing K times, at 1/K of the
//!   traffic.
//! - **Loop 2, synchronisation**: the accumulated gradients are summed over all ranks
//!   (all-reduce), divided by world x K, and every rank applies the same optimiser step to the
//!   same parameters with the same averaged gradient, so the parameters stay bitwise identical
//!   on every rank ([`gradsync`] guarantees that every rank gets the same bits from an
//!   all-reduce).
//!
//! [`Reducer`] is Loop 2, interleaved with the last micro-batch of Loop 1.
//!
//! # Buckets and overlap
//!
//! A model's gradient is many tensors ("parameters" here: any gradient slice whose readiness the
//! caller reports, in a fixed order every rank agrees on). One all-reduce per tensor pays the
//! per-message latency many times; one all-reduce of everything can only start when backward
//! has finished. The reducer packs the parameters into **buckets** of about
//! [`DEFAULT_BUCKET_CAP_BYTES`] (25 MiB, PyTorch DDP's default; `GRADSYNC_BUCKET_MB` overrides
//! it, see [`bucket_cap_from_env`]), each one contiguous flat buffer. Parameters go into buckets
//! in **reverse registration order**: backward produces the last layer's gradient first, so the
//! first bucket holds the last layers and becomes complete first.
//!
//! On the last micro-batch, the moment every parameter of a bucket has been reported with
//! [`Reducer::mark_ready`], the bucket's all-reduce is queued
//! ([`Communicator::all_reduce_owned`], which takes the bucket's buffer by value, so the
//! gradient cannot be touched while it is on the wire) and the communicator is driven
//! ([`Communicator::progress`]). Progress in gradsync is driven by the caller (there is no
//! background thread), so every later `mark_ready` drives it again: the bucket's transfer advances
//! while backward computes the remaining gradients. Buckets are always started in bucket order,
//! even if a rank reports parameters in another order, so that every rank issues the same
//! collectives in the same order. [`Reducer::finish`] then waits for the rest.
//!
//! With [`Reducer::set_overlap`]`(false)` every bucket starts only in `finish`, after backward:
//! the baseline against which the overlap is measured.
//!
//! # Dividing once
//!
//! Each rank's micro-batch gradient is the mean over its B samples. The buckets are all-reduced
//! with [`ReduceOp::Sum`](gradsync::ReduceOp::Sum) and the result is divided by world x K in one
//! correctly rounded division per element. The alternatives round more often: an `Avg`
//! all-reduce followed by `/K` rounds twice, and multiplying by the reciprocal `1/(world*K)`
//! rounds the reciprocal first whenever world x K is not a power of two. With one division the
//! N-rank result differs from the 1-rank full-batch gradient (the mean over N x K x B samples)
//! only by the order of the additions. The sum is bitwise identical on every rank, and so is
//! the division.
//!
//! # Timing
//!
//! Every step's [`StepStats`] reports the time spent blocked in `finish` (the communication the
//! backward pass did not hide), the time from the first bucket's start to the last bucket's
//! completion, and the overlap fraction: the share of that span that passed before `finish` was
//! entered, i.e. behind backward.
//!
//! # Example
//!
//! ```
//! use gradsync::{Communicator, Config};
//! use gradsync_ddp::Reducer;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut comm = Communicator::mem_group(1, &Config::new("unused:0", 0, 1))?.remove(0);
//! // Two parameters (say a weight and a bias), registered in forward order.
//! let mut reducer = Reducer::new(&[6, 2], 1024)?;
//! reducer.begin_step(2)?; // two micro-batches
//! for micro in 0..2 {
//!     let g = micro as f32 + 1.0;
//!     // backward: last parameter first
//!     reducer.mark_ready(&mut comm, 1, &[g; 2])?;
//!     reducer.mark_ready(&mut comm, 0, &[g; 6])?;
//! }
//! let grads = reducer.finish(&mut comm)?;
//! assert_eq!(grads.get(0), &[1.5; 6]); // (1 + 2) / (world 1 x K 2)
//! # Ok(())
//! # }
//! ```
//!
//! [`Communicator::all_reduce_owned`]: gradsync::Communicator::all_reduce_owned
//! [`Communicator::progress`]: gradsync::Communicator::progress

#![forbid(unsafe_code)]

mod error;
mod hash;
mod reducer;

pub use error::{Error, Result};
pub use hash::{gather_hashes, hash_f32};
pub use reducer::{
    DEFAULT_BUCKET_CAP_BYTES, Grads, Reducer, StepStats, assign_buckets, bucket_cap_bytes,
    bucket_cap_from_env,
};
