//! [`TcpOptions`]: the settings of the TCP backend.

use std::time::Duration;

/// Options of the TCP backend. The `Debug` form does not show the token.
#[derive(Clone)]
pub struct TcpOptions {
    /// Streams per peer (at least 1).
    pub nsocks: usize,
    /// Socket send and receive buffer size in bytes; 0 keeps the kernel's auto-tuning.
    pub sock_buf: usize,
    /// Deadline for connection setup.
    pub timeout: Duration,
    /// The job token: with one, every stream is authenticated by the challenge-response
    /// described in the [module documentation](super#authentication) (all ranks must use the
    /// same token); without one, streams are not authenticated.
    pub token: Option<Vec<u8>>,
    /// Messages in flight per peer that suit these streams, if fewer than an inbox holds (the
    /// [`window`](crate::PeerCaps::window) the endpoint reports): fewer keep the socket
    /// queues short.
    pub window: Option<usize>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            nsocks: 2,
            sock_buf: 0,
            timeout: Duration::from_secs(60),
            token: None,
            window: None,
        }
    }
}

impl std::fmt::Debug for TcpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpOptions")
            .field("nsocks", &self.nsocks)
            .field("sock_buf", &self.sock_buf)
            .field("timeout", &self.timeout)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("window", &self.window)
            .finish()
    }
}
