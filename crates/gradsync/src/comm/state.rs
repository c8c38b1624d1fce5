//! The plain data a communicator keeps: where every rank is ([`Layout`]) and the operations
//! on owned buffers waiting for their turn ([`Queued`]).

use crate::engine::{Planned, RawBuf};
use crate::topology;
use gradsync_core::wire::Signature;
use gradsync_transport::{AddressBook, Endpoint, Route};
use std::any::Any;

/// What init learned about the placement of ranks.
#[derive(Clone, Debug)]
pub(super) struct Layout {
    /// Host index of every rank.
    pub(super) host_of: Vec<usize>,
    /// Host identity string of every rank.
    pub(super) host_ids: Vec<String>,
    /// Ranks per host when hosts are uniform contiguous blocks, else 0.
    pub(super) local_size: usize,
    /// The route to every rank ([`Route::Own`] for this rank).
    pub(super) routes: Vec<Route>,
    /// Network interface of the data connections (empty in process).
    pub(super) ifname: String,
    /// The listening addresses of the ranks, as far as this rank knows them (`None` in
    /// process).
    pub(super) addrs: Option<AddressBook>,
    /// Where init placed this rank on the NUMA nodes.
    pub(super) placement: topology::Placement,
}

impl Layout {
    /// One host, the routes as `ep` reports them.
    pub(super) fn single_host(ep: &dyn Endpoint) -> Self {
        let world = ep.world();
        Layout {
            host_of: vec![0; world],
            host_ids: vec![String::new(); world],
            local_size: world,
            routes: (0..world).map(|p| ep.caps(p).route).collect(),
            ifname: String::new(),
            addrs: None,
            placement: topology::Placement::SingleNode,
        }
    }
}

/// An operation on an owned buffer, waiting for its turn.
pub(super) struct Queued {
    pub(super) id: u64,
    pub(super) sig: Signature,
    pub(super) prog: Planned,
    pub(super) algo: &'static str,
    pub(super) buf: RawBuf,
    pub(super) owner: Box<dyn Any + Send>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Queued({} {})", self.id, self.sig)
    }
}
