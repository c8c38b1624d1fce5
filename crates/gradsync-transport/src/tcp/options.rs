//! [`TcpOptions`]: the settings of the TCP backend.

use std::time::Duration;

/// Options of the TCP backend. The `Debug` form does not show the token.
#[derive(Clone)]
pub struct TcpOptions {
    /// Streams per peer (at least 1); to a peer on this host (see `local`) `nsocks_local`.
    pub nsocks: usize,
    /// Streams to a peer on this host (at least 1).
    pub nsocks_local: usize,
    /// Which ranks share this rank's host, by rank; empty where unknown (every peer then gets
    /// `nsocks`). Writes to a peer on this host are not striped over its streams: there the
    /// kernel copies, no link is shared, and whole writes taken in turn measured faster.
    pub local: Vec<bool>,
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
            nsocks: 1,
            nsocks_local: 2,
            local: Vec::new(),
            sock_buf: 0,
            timeout: Duration::from_secs(60),
            token: None,
            window: None,
        }
    }
}

impl TcpOptions {
    /// Whether `peer` is on this rank's host, as far as these options know.
    pub fn is_local(&self, peer: usize) -> bool {
        self.local.get(peer).copied().unwrap_or(false)
    }

    /// Streams to `peer` (at least 1).
    pub fn streams_to(&self, peer: usize) -> usize {
        if self.is_local(peer) {
            self.nsocks_local
        } else {
            self.nsocks
        }
        .max(1)
    }
}

impl std::fmt::Debug for TcpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpOptions")
            .field("nsocks", &self.nsocks)
            .field("nsocks_local", &self.nsocks_local)
            .field("local", &self.local)
            .field("sock_buf", &self.sock_buf)
            .field("timeout", &self.timeout)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("window", &self.window)
            .finish()
    }
}
