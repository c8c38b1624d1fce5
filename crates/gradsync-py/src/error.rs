//! The Python exception of a failed operation.

pyo3::create_exception!(
    gradsync,
    GradsyncError,
    pyo3::exceptions::PyRuntimeError,
    "An operation of gradsync failed. The message is the Rust error's: it names this rank, the \
     operation (with its sequence number) and the peers involved."
);
