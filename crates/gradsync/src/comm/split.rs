//! Communicators made out of an existing one, without a new rendezvous: [`split`] by color
//! and key over every rank (as `ncclCommSplit` and `MPI_Comm_split`), and [`split_ranks`] by
//! the members alone (as `MPI_Comm_create_group`).
//!
//! # How a child is formed
//!
//! 1. *Membership.* `split` all-gathers every rank's (color, key) over the parent, so each
//!    rank knows the members of its child: the ranks of its color ordered by (key, parent
//!    rank). `split_ranks` takes the members from its argument.
//! 2. *Agreement.* The members swap their member lists and a proposed communicator id over the
//!    parent's point-to-point messages ([`ParentExchange`]: through the child's rank 0, between
//!    members only). Every member checks that all lists equal its own, so members that
//!    disagree all fail with the same error, and takes the id that rank 0 proposed: fresh
//!    for every child (it mixes a random id with the parent's id, rank 0's parent rank and its
//!    count of splits), so siblings and the parent never share one.
//! 3. *Connections.* The members then run init's setup among themselves, each record going
//!    over the parent instead of through a store: listening addresses, host identities and
//!    CPUs (the host layout is computed anew for the members), RDMA readiness (and queue pairs
//!    when pairs connect at init) or TCP connections, shared-memory segments between the
//!    members of a host, inbox descriptors.
//!    Children of an in-process communicator ([`Communicator::mem_group`]) get an in-memory
//!    fabric instead, which their members find in a table of this process under the child's
//!    id.
//! 4. A barrier on the child.
//!
//! The child has the parent's configuration (transport choice, tunables, the parent's current
//! timeout) and cost model, its own id and sequence numbers. The whole split is bounded by the
//! parent's timeout, counted from its start: a member that dies or never calls fails the
//! others with a timeout that names the step and the member waited on.
//!
//! [`split`]: Communicator::split
//! [`split_ranks`]: Communicator::split_ranks

use super::bootstrap::{NetSetup, apply_caps, engine_options, meet_inboxes, new_comm_id};
use super::communicator::Communicator;
use super::records::{Exchange, ParentExchange};
use crate::Result;
use crate::config::Config;
use crate::engine::Engine;
use crate::error::Error;
use gradsync_transport::Endpoint;
use gradsync_transport::mem::MemEndpoint;
use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// In-memory fabrics of split communicators, by communicator id, until every member has taken
/// its endpoint.
static FABRICS: Mutex<BTreeMap<u64, Vec<Option<MemEndpoint>>>> = Mutex::new(BTreeMap::new());

/// The endpoint of `rank` in the in-memory fabric of `world` ranks named `id`: the first
/// member to come makes the fabric, each takes its own endpoint once, the last removes the
/// entry.
fn mem_endpoint(id: u64, rank: usize, world: usize) -> Option<MemEndpoint> {
    let mut t = FABRICS.lock().unwrap_or_else(PoisonError::into_inner);
    let eps = t.entry(id).or_insert_with(|| {
        gradsync_transport::mem::fabric(world)
            .into_iter()
            .map(Some)
            .collect()
    });
    let ep = if eps.len() == world {
        eps.get_mut(rank).and_then(Option::take)
    } else {
        None
    };
    if eps.iter().all(Option::is_none) {
        t.remove(&id);
    }
    ep
}

/// A child's id: random, mixed with the parent's id, rank 0's parent rank and its count of
/// splits; never the parent's.
fn child_comm_id(parent: u64, root: usize, splits: u64) -> u64 {
    let mut x = new_comm_id() ^ parent.rotate_left(17) ^ ((root as u64) << 40) ^ splits;
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 29;
    let id = x | 1;
    if id == parent { id ^ 2 } else { id }
}

impl Communicator {
    /// Splits this communicator into disjoint new ones, as `ncclCommSplit` and
    /// `MPI_Comm_split` do: every rank calls it; the ranks that pass the same `color` form a
    /// new communicator, in which they are numbered in the order of their `key`, ties broken
    /// by their rank here. A rank that passes `None` (`NCCL_SPLIT_NOCOLOR`, `MPI_UNDEFINED`)
    /// takes part in the call and gets no communicator.
    ///
    /// No rendezvous store is involved:
    ///
    /// 1. the colors and keys are all-gathered over this communicator;
    /// 2. the members of each new one swap their member lists and an id proposed by each
    ///    over this communicator's point-to-point messages, between members only (each sends
    ///    its record to the new rank 0 and gets the table of all records back); every member
    ///    checks that all lists equal its own and takes rank 0's id;
    /// 3. they connect as init does, each record going over this communicator instead of
    ///    through a store: listening addresses, host identities and CPUs, RDMA readiness (and
    ///    queue pairs when pairs connect at init) or TCP connections, shared-memory segments
    ///    between the members of a host, inbox descriptors;
    /// 4. a barrier on the new communicator.
    ///
    /// Each new communicator has its own id and sequence numbers, this one's
    /// configuration (transport choice, tunables, its current [`timeout`](Self::timeout)) and
    /// cost model, and a host layout of its own members ([`local_size`](Self::local_size)
    /// and the hierarchical all-reduce follow it). This communicator stays usable and
    /// independent of the new ones; children of one in-process group
    /// ([`mem_group`](Self::mem_group), [`from_endpoints`](Self::from_endpoints)) are
    /// in-memory groups.
    ///
    /// The call is bounded by this communicator's timeout: a rank that never calls it, or
    /// dies, fails the others with an error naming `split`, the step and the rank waited on.
    /// A failed split leaves this communicator as a failed collective does: unusable on every
    /// rank when a message timed out or the deadline passed; usable when the members found
    /// that they disagree.
    pub fn split(&mut self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        const OP: &str = "split";
        let deadline = Instant::now() + self.timeout();
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * self.world];
        self.all_gather(&mine, &mut all).map_err(|e| Error::Split {
            rank: self.rank,
            op: OP,
            msg: "all-gathering every rank's color and key".into(),
            source: Some(Box::new(e)),
        })?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = all
            .chunks(2)
            .enumerate()
            .filter(|(_, ck)| ck[0] == i64::from(color))
            .map(|(r, ck)| (ck[1], r))
            .collect();
        members.sort_unstable();
        let members: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        self.form(OP, &members, deadline).map(Some)
    }

    /// A new communicator of the ranks `ranks` (ranks of this one), built by them alone, as
    /// `MPI_Comm_create_group` does: every rank of `ranks` calls it with the same list, the
    /// others do not call it at all. The new rank of a member is its position in `ranks`.
    ///
    /// As [`split`](Self::split) otherwise: no rendezvous store, the members' records go over
    /// this communicator's point-to-point messages between members only, so the other ranks
    /// may meanwhile run anything that does not involve the members. Between two members,
    /// their splits and their other calls on this communicator must come in the same order
    /// (as every operation of a pair must). Bounded by this communicator's timeout; members
    /// that pass different lists all get an error naming both lists.
    pub fn split_ranks(&mut self, ranks: &[usize]) -> Result<Communicator> {
        const OP: &str = "split_ranks";
        let deadline = Instant::now() + self.timeout();
        if let Some(bad) = ranks.iter().find(|&&r| r >= self.world) {
            return Err(self.invalid(
                OP,
                format!(
                    "rank {bad} of {ranks:?} is not a rank of a world of {}",
                    self.world
                ),
            ));
        }
        for (i, r) in ranks.iter().enumerate() {
            if ranks[..i].contains(r) {
                return Err(self.invalid(OP, format!("rank {r} appears twice in {ranks:?}")));
            }
        }
        if !ranks.contains(&self.rank) {
            return Err(self.invalid(
                OP,
                format!(
                    "rank {} is not among {ranks:?}: only the members call it",
                    self.rank
                ),
            ));
        }
        self.form(OP, ranks, deadline)
    }

    /// Forms the communicator of `members` (parent ranks in their new order, this rank
    /// among them) over this one's point-to-point messages.
    fn form(
        &mut self,
        op: &'static str,
        members: &[usize],
        deadline: Instant,
    ) -> Result<Communicator> {
        let t0 = Instant::now();
        let rank = self.rank;
        let me = members
            .iter()
            .position(|&r| r == rank)
            .expect("the caller is a member");
        let n = members.len();
        self.splits += 1;
        let proposal = child_comm_id(self.engine.comm_id, rank, self.splits);
        let Some(mut config) = self.config.clone() else {
            return Err(Error::Internal {
                rank,
                msg: format!("{op}: a communicator without its configuration"),
            });
        };
        (config.rank, config.world) = (me, n);
        config.timeout = self.timeout();
        config.host_store = false;
        let in_process = self.in_process;
        let net = if in_process {
            None
        } else {
            Some(NetSetup {
                ip: self
                    .layout
                    .addrs
                    .as_ref()
                    .and_then(|b| b.known(rank))
                    .map(|a| a.ip())
                    .ok_or_else(|| Error::Internal {
                        rank,
                        msg: format!("{op}: no listening address of this rank"),
                    })?,
                ifname: self.layout.ifname.clone(),
                placement: self.layout.placement.clone(),
            })
        };
        let costs = (
            self.costs.clone(),
            format!("{} (this communicator's parent)", self.cost_from),
            self.cost_path.clone(),
        );
        let everyone: Vec<usize> = (0..n).collect();
        let mut ex = ParentExchange::new(self, members, me, op, deadline);
        // Agreement: the same members everywhere, and rank 0's id.
        let list: Vec<u8> = members
            .iter()
            .flat_map(|&r| (r as u64).to_le_bytes())
            .collect();
        let records = ex.swap(
            &[("id", &proposal.to_le_bytes()), ("members", &list)],
            &everyone,
        )?;
        let decode = |b: &[u8]| -> Vec<u64> {
            b.chunks(8)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w[..c.len()].copy_from_slice(c);
                    u64::from_le_bytes(w)
                })
                .collect()
        };
        let Ok(id) = <[u8; 8]>::try_from(records[0][0].as_slice()) else {
            return Err(Error::Split {
                rank,
                op,
                msg: format!(
                    "rank 0 of the new communicator (parent rank {}) proposed an id of {} bytes (expected 8)",
                    members[0],
                    records[0][0].len()
                ),
                source: None,
            });
        };
        for (q, rec) in records.iter().enumerate() {
            if rec[1] != list {
                return Err(Error::Split {
                    rank,
                    op,
                    msg: format!(
                        "rank {q} of the new communicator (parent rank {}) forms it of ranks {:?} but this rank of {members:?}",
                        members[q],
                        decode(&rec[1])
                    ),
                    source: None,
                });
            }
        }
        let comm_id = u64::from_le_bytes(id);
        tracing::info!(target: "gradsync::init", "rank {rank}: {op}: rank {me} of {n} in communicator {comm_id:016x} of ranks {members:?}");
        let mut child = match net {
            Some(net) => Communicator::connect(&mut ex, comm_id, me, n, config, net, t0)?,
            None => Self::mem_child(&mut ex, comm_id, config)?,
        };
        child.set_costs(costs.0, costs.1, costs.2);
        // The first barrier too ends by the split's deadline.
        let full = child.timeout();
        let left = deadline.saturating_duration_since(Instant::now());
        child.set_timeout(left.min(full).max(Duration::from_millis(1)));
        let met = child.barrier();
        child.set_timeout(full);
        met.map_err(|e| Error::Split {
            rank,
            op,
            msg: format!("the first barrier of the new communicator (rank {me} of {n})"),
            source: Some(Box::new(e)),
        })?;
        Ok(child)
    }

    /// The child of an in-process communicator: an in-memory fabric shared by its members,
    /// the inbox descriptors swapped over the parent.
    fn mem_child(ex: &mut dyn Exchange, comm_id: u64, config: Config) -> Result<Communicator> {
        let (me, n) = (config.rank, config.world);
        let ep = mem_endpoint(comm_id, me, n).ok_or_else(|| {
            Error::Internal {
                rank: me,
                msg: format!(
                    "split: the in-memory fabric of communicator {comm_id:016x} has no free endpoint for rank {me} of {n}"
                ),
            }
        })?;
        let (mut engine, inbox) = Engine::new(
            Box::new(ep) as Box<dyn Endpoint>,
            comm_id,
            engine_options(&config),
        )?;
        apply_caps(&mut engine, &config, None);
        meet_inboxes(ex, &mut engine, inbox, &config, None)?;
        let mut c = Communicator::assemble(engine, me, n, config.algorithm, None);
        c.coll_algorithms = config.collective_algorithms.clone();
        c.config = Some(config);
        c.in_process = true;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::{child_comm_id, mem_endpoint};

    #[test]
    fn child_ids_differ_from_the_parent_and_each_other() {
        let parent = 0x1234_5678_9abc_def1;
        let ids: Vec<u64> = (0..64)
            .flat_map(|root| (1..4).map(move |s| child_comm_id(parent, root, s)))
            .collect();
        assert!(ids.iter().all(|&id| id != parent && id & 1 == 1));
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len(), "ids repeat: {ids:x?}");
    }

    #[test]
    fn each_member_takes_its_endpoint_once() {
        let id = 0xfeed_0001;
        assert!(mem_endpoint(id, 1, 3).is_some());
        assert!(mem_endpoint(id, 1, 3).is_none(), "taken twice");
        assert!(mem_endpoint(id, 0, 2).is_none(), "another world size");
        assert!(mem_endpoint(id, 0, 3).is_some());
        assert!(mem_endpoint(id, 2, 3).is_some());
        // The entry is gone: the id would make a fresh fabric.
        assert!(mem_endpoint(id, 2, 3).is_some());
    }
}
