//! gradsync: collective communication for data-parallel training.
//!
//! (Crate documentation is being written; see the README for the architecture.)

mod comm;
mod config;
mod engine;
mod element;
mod error;
pub mod logging;

pub use comm::{Communicator, Pending, Work};
pub use config::Config;
pub use gradsync_core::schedule::plan::Algorithm;
pub use element::Element;
pub use error::Error;
pub use gradsync_core::{Collective, DataType, ReduceOp};

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
