//! The error type of the data-parallel layer.

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of [`Reducer`](crate::Reducer) and the helpers of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The reducer's configuration is unusable (bucket cap, parameter sizes, environment).
    #[error("config: {0}")]
    Config(String),
    /// A parameter index outside the registered parameters.
    #[error("parameter {param} is not registered ({count} parameters are)")]
    UnknownParam {
        /// The index given.
        param: usize,
        /// How many parameters are registered.
        count: usize,
    },
    /// A gradient whose length differs from its parameter's registered size.
    #[error("parameter {param}: gradient has {got} elements but the parameter has {expected}")]
    GradientLength {
        /// The parameter.
        param: usize,
        /// Its registered size.
        expected: usize,
        /// The gradient's length.
        got: usize,
    },
    /// A parameter reported twice in one micro-batch.
    #[error("parameter {param} marked ready twice in micro-batch {micro}")]
    AlreadyReady {
        /// The parameter.
        param: usize,
        /// The micro-batch (0-based) of the step.
        micro: usize,
    },
    /// A call out of the step's order: `mark_ready` or `finish` outside a step, `begin_step`
    /// within one, or `finish` before every micro-batch was reported.
    #[error("{op}: {msg}")]
    State {
        /// The call.
        op: &'static str,
        /// What is out of order.
        msg: String,
    },
    /// A collective failed.
    #[error("rank {rank}: {what}: {source}")]
    Comm {
        /// This rank.
        rank: usize,
        /// What the reducer was doing (names the bucket where there is one).
        what: String,
        /// The communicator's error (boxed: it is large, and this path is cold).
        #[source]
        source: Box<gradsync::Error>,
    },
}
