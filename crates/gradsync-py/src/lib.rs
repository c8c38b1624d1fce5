//! The native module `gradsync._gradsync` of the Python package `gradsync`.
//!
//! It wraps [`gradsync::Communicator`] for numpy arrays and CPU torch tensors:
//!
//! - `buffer`: finds the memory of a numpy ndarray (through `ndarray`'s own array interface;
//!   other objects are refused) or a torch tensor (`tensor.numpy()`, viewed as int16 for
//!   bfloat16), checks type, contiguity, writability and alignment, keeps the owning objects
//!   alive while an operation uses them, and bumps the version counters of written tensors;
//! - `worker`: one thread per communicator builds it and runs its operations in submission
//!   order; Python waits for them with the GIL released;
//! - `comm`: the `Communicator` and `Work` classes, dispatching on the element type to the
//!   generic Rust calls;
//! - `exchange`: all-to-all(v), gather and scatter on `Communicator`;
//! - `store`: `StoreServer`, the rendezvous store for explicitly built communicators.
//!
//! Build it with maturin (`maturin develop --release` in `crates/gradsync-py`); see the README
//! there.

use pyo3::prelude::*;

mod buffer;
mod comm;
mod error;
mod exchange;
mod store;
mod worker;

use error::GradsyncError;

/// Collective communication for data-parallel training (native part of the ``gradsync``
/// package).
#[pymodule]
fn _gradsync(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<comm::Communicator>()?;
    m.add_class::<comm::Work>()?;
    m.add_class::<store::StoreServer>()?;
    m.add("GradsyncError", m.py().get_type::<GradsyncError>())?;
    m.add("__version__", gradsync::VERSION)?;
    Ok(())
}
