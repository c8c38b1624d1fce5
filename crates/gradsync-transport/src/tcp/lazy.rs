//! Connections on first use: [`TcpEndpoint::lazy`] connects to nobody at setup, and a pair
//! connects when [`Endpoint::connect`](crate::Endpoint::connect) first names it.
//!
//! The roles are those of [`TcpEndpoint::establish`]: of two ranks, the higher one dials the
//! lower one's listener (`nsocks` streams, each with the hello and, with a token, the
//! handshake), and the lower one accepts. Both call `connect` for each other before their first
//! message (the engine does so for the peers of every operation's program), so a pair is never
//! dialed from both sides. The accepting side takes connections whenever it polls, and while
//! its own `connect` waits for higher peers, so a rank that runs ahead and dials a peer still
//! busy with an earlier operation is served at once. A dial blocks until the lower rank
//! accepts; chains of dials only ever go down in rank, so they end at a rank that accepts.
//!
//! While `connect` waits it keeps flushing what is queued to the peers already connected: a
//! peer still finishing an earlier operation gets its last messages.
//!
//! This file holds the state ([`Lazy`]); `first_use` the endpoint's side of it.

use super::options::TcpOptions;
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;

/// Polls between two looks at the listener while some peer is not connected.
const ACCEPT_EVERY: u32 = 16;

/// The state of an endpoint that connects on first use.
#[derive(Debug)]
pub(super) struct Lazy {
    pub(super) listener: TcpListener,
    pub(super) addrs: crate::AddressBook,
    pub(super) comm_id: u64,
    pub(super) opts: TcpOptions,
    /// Streams accepted from peers whose set is not complete yet.
    pub(super) partial: HashMap<usize, Vec<Option<TcpStream>>>,
    /// Peers not connected yet.
    pub(super) missing: usize,
    /// Polls since the listener was last looked at.
    pub(super) polls: u32,
}

impl Lazy {
    /// The listener's descriptor, for a blocking wait to wake on a dial.
    pub(super) fn listener_fd(&self) -> i32 {
        self.listener.as_raw_fd()
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
