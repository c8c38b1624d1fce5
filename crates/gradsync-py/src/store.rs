//! The `StoreServer` class: gradsync's rendezvous store, run from Python.

use crate::error::GradsyncError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Mutex;

/// A rendezvous store that communicators meet at (as ``Communicator(..., host_store=False)``).
///
/// ``StoreServer(host="0.0.0.0", port=0)`` binds ``host:port`` (port 0 picks a free port, see
/// :attr:`port`) and serves on background threads for as long as the object lives or until
/// :meth:`close`. With ``GRADSYNC_TOKEN`` set, every connection must prove it holds the same
/// token. Also a context manager.
#[pyclass(module = "gradsync", frozen)]
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    server: Mutex<Option<gradsync_store::StoreServer>>,
}

#[pymethods]
impl StoreServer {
    #[new]
    #[pyo3(signature = (host="0.0.0.0", port=0))]
    fn new(py: Python<'_>, host: &str, port: u16) -> PyResult<Self> {
        let addr = (host, port)
            .to_socket_addrs()
            .map_err(|e| {
                PyValueError::new_err(format!("StoreServer: cannot resolve {host:?}: {e}"))
            })?
            .next()
            .ok_or_else(|| {
                PyValueError::new_err(format!("StoreServer: {host:?} has no address"))
            })?;
        let mut config = gradsync_store::ServerConfig::default();
        config.token = std::env::var("GRADSYNC_TOKEN")
            .ok()
            .filter(|t| !t.trim().is_empty())
            .map(String::into_bytes);
        let server = py
            .detach(|| gradsync_store::StoreServer::bind_with_config(addr, config))
            .map_err(|e| GradsyncError::new_err(format!("StoreServer: {e}")))?;
        Ok(StoreServer {
            addr: server.local_addr(),
            server: Mutex::new(Some(server)),
        })
    }

    /// The port the store listens on (the one picked when created with port 0).
    #[getter]
    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The address the store listens on, ``host:port``.
    #[getter]
    fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Stops serving (clients waiting on it get an error); closing again does nothing.
    fn close(&self, py: Python<'_>) {
        let server = self
            .server
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(s) = server {
            py.detach(|| s.shutdown());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("<gradsync.StoreServer {}>", self.addr)
    }
}
