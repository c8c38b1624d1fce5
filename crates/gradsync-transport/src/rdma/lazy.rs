//! The state of an endpoint whose queue pairs are made on first use ([`Lazy`]) and what it is
//! given for that ([`FirstUse`]); `first_use` holds the endpoint's side: the connect, the dial
//! and the accept.

use crate::error::{Result, TransportError};
use crate::tcp::TcpOptions;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// Polls between two looks at the listener while some peer is not connected. A poll of the
/// completion queue makes no system call, and a job whose algorithms never reach some peers
/// keeps looking for good: the look (an `accept(2)`) is kept rare. A rank that sleeps wakes on
/// a dial (the listener is in its `poll(2)` set), and one that waits to connect looks at once.
const ACCEPT_EVERY: u32 = 1024;

/// What an endpoint needs to connect its pairs on first use.
#[derive(Debug)]
pub struct FirstUse {
    /// The listening addresses of the ranks: known, or fetched when this rank first dials
    /// them.
    pub addrs: crate::AddressBook,
    /// This rank's listener, already published to the peers.
    pub listener: TcpListener,
    /// The communicator's id, which every hello carries.
    pub comm_id: u64,
    /// The job's token: with one, every connection is authenticated as TCP's are.
    pub token: Option<Vec<u8>>,
    /// Deadline of the exchange on a connection this rank accepts.
    pub timeout: Duration,
}

/// The state of an endpoint that connects on first use.
#[derive(Debug)]
pub(super) struct Lazy {
    pub(super) listener: TcpListener,
    pub(super) addrs: crate::AddressBook,
    pub(super) comm_id: u64,
    pub(super) topts: TcpOptions,
    /// Peers not connected yet.
    pub(super) missing: usize,
    /// Polls since the listener was last looked at.
    pub(super) polls: u32,
}

impl Lazy {
    pub(super) fn new(rank: usize, world: usize, f: FirstUse) -> Result<Lazy> {
        if f.addrs.world() != world {
            return Err(TransportError::Rdma {
                rank,
                peer: usize::MAX,
                what: "connect",
                msg: format!("{} addresses for a world of {world}", f.addrs.world()),
            });
        }
        crate::tcp::setup::set_nonblocking(rank, &f.listener)?;
        Ok(Lazy {
            listener: f.listener,
            addrs: f.addrs,
            comm_id: f.comm_id,
            topts: TcpOptions {
                nsocks: 1,
                nsocks_local: 1,
                local: Vec::new(),
                sock_buf: 0,
                timeout: f.timeout,
                token: f.token,
                window: None,
            },
            missing: world.saturating_sub(1),
            polls: 0,
        })
    }

    /// The listener's descriptor while some peer is not connected (a blocking wait wakes on a
    /// dial).
    pub(super) fn listener_fd(&self) -> Option<RawFd> {
        (self.missing > 0).then(|| self.listener.as_raw_fd())
    }

    /// Whether a poll should look at the listener now.
    pub(super) fn accept_due(&mut self) -> bool {
        if self.missing == 0 {
            return false;
        }
        self.polls = self.polls.wrapping_add(1);
        self.polls.is_multiple_of(ACCEPT_EVERY)
    }
}
