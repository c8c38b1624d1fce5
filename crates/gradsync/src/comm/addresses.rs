//! The listening addresses of init through the store: each rank publishes its own under
//! `{prefix}/addr/{rank}`, reads at init those of the lower ranks its first operations are
//! likely to dial ([`likely_dialed`]), and fetches any other when it first dials it
//! ([`StoreAddresses`], through a connection of its own to the store). A rank thus reads a few
//! dozen addresses at most in a ring, tree or recursive-doubling job of any size, and every
//! rank's address only in a job that talks to every rank (all-to-all).

use crate::engine::InboxSource;
use gradsync_store::StoreClient;
use gradsync_transport::{AddressBook, AddressSource, REMOTE_REGION_LEN, RemoteRegion};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long a read after init keeps trying to reach the store. The store answered at init, so
/// a store that refuses connections for this long is gone: the operation fails then, naming
/// it, rather than at the end of the operation timeout (300 s by default).
const RECONNECT_WITHIN: Duration = Duration::from_secs(10);

/// The rendezvous store as a rank reaches it anew: its address and the job's token.
#[derive(Clone)]
pub(super) struct Reach {
    pub(super) store_addr: String,
    pub(super) token: Option<Vec<u8>>,
}

/// The records of `ranks` that init reads through its own store connection: the value under
/// `key(prefix, p)` of each rank p, parsed by `parse` (which names this rank and p), in order.
pub(super) fn read_at_init<T>(
    store: &mut StoreClient,
    prefix: &str,
    rank: usize,
    ranks: &[usize],
    timeout: Duration,
    key: fn(&str, usize) -> String,
    parse: fn(&[u8], usize, usize) -> Result<T, String>,
) -> crate::Result<Vec<(usize, T)>> {
    let keys: Vec<String> = ranks.iter().map(|&p| key(prefix, p)).collect();
    let krefs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let vals = store
        .wait(&krefs, timeout)
        .map_err(|source| crate::error::Error::Store { rank, source })?;
    ranks
        .iter()
        .zip(&vals)
        .map(|(&p, v)| Ok((p, parse(v, rank, p).map_err(crate::error::Error::Config)?)))
        .collect()
}

/// The key rank `p` publishes its listening address under.
pub(super) fn addr_key(prefix: &str, p: usize) -> String {
    format!("{prefix}/addr/{p}")
}

/// Rank `p`'s address from the value `v` it published, as `rank` reports a bad one.
pub(super) fn parse_addr(v: &[u8], rank: usize, p: usize) -> Result<SocketAddr, String> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            format!(
                "rank {rank}: rank {p} published a malformed listening address {:?}",
                String::from_utf8_lossy(v)
            )
        })
}

/// The lower ranks that `rank` of `world` dials first: rank 0 and every rank at a power-of-two
/// distance below it, either way round the ring (its ring neighbour, the partners of
/// recursive doubling and halving, its binomial-tree parent, and those of init's own barrier
/// and calibration), about 2 log2 `world` ranks.
pub(super) fn likely_dialed(rank: usize, world: usize) -> Vec<usize> {
    let mut v = Vec::new();
    if rank == 0 || rank >= world {
        return v;
    }
    v.push(0);
    let mut d = 1;
    while d < world {
        if d <= rank {
            v.push(rank - d);
        }
        if rank + d >= world {
            v.push(rank + d - world);
        }
        let x = rank ^ d;
        if x < rank {
            v.push(x);
        }
        d <<= 1;
    }
    v.retain(|&p| p < rank);
    v.sort_unstable();
    v.dedup();
    v
}

/// The ranks that `rank` of `world` talks to first, either way: rank 0 and every rank at a
/// power-of-two distance round the ring or in the bits of its rank (about 3 log2 `world`),
/// whose inbox descriptors it reads at init.
pub(super) fn likely_talked(rank: usize, world: usize) -> Vec<usize> {
    let mut v = crate::recv::slot_peers(rank, world);
    if rank != 0 && rank < world && v.first() != Some(&0) {
        v.insert(0, 0);
    }
    v
}

/// The key of rank `p`'s inbox record (its descriptor, then its slot layout).
pub(super) fn inbox_key(prefix: &str, p: usize) -> String {
    format!("{prefix}/inbox/{p}")
}

/// Rank `p`'s inbox descriptor from its inbox record `v`, as `rank` reports a bad one.
pub(super) fn parse_inbox(v: &[u8], rank: usize, p: usize) -> Result<RemoteRegion, String> {
    v.get(..REMOTE_REGION_LEN)
        .and_then(RemoteRegion::from_bytes)
        .ok_or_else(|| {
            format!(
                "rank {rank}: rank {p} published a malformed inbox descriptor ({} bytes)",
                v.len()
            )
        })
}

/// The requests a rank makes of the store for records after init's tables, and their bytes.
#[derive(Debug, Default)]
pub(super) struct FetchTraffic {
    pub(super) requests: AtomicU64,
    pub(super) sent: AtomicU64,
    pub(super) received: AtomicU64,
}

/// An [`AddressSource`] that reads the published addresses from the rendezvous store, over a
/// connection it opens for each request (a rank makes one request per operation that first
/// dials ranks it has not read yet).
pub(super) struct StoreAddresses {
    pub(super) reach: Reach,
    pub(super) rank: usize,
    pub(super) prefix: String,
    pub(super) traffic: Arc<FetchTraffic>,
}

impl std::fmt::Debug for StoreAddresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StoreAddresses(rank {} at {} under {})",
            self.rank, self.reach.store_addr, self.prefix
        )
    }
}

/// Reads `keys` from the store `reach` names, over a connection of its own, within `timeout`,
/// counting the bytes in `traffic`.
fn read_keys(
    reach: &Reach,
    rank: usize,
    keys: &[String],
    timeout: Duration,
    traffic: &FetchTraffic,
) -> Result<Vec<Vec<u8>>, String> {
    let at = &reach.store_addr;
    let start = std::time::Instant::now();
    let within = timeout.min(RECONNECT_WITHIN);
    let mut store = StoreClient::connect_with_token(at, within, reach.token.as_deref(), rank)
        .map_err(|e| format!("cannot reach the store at {at}: {e}"))?;
    let krefs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let left = timeout.saturating_sub(start.elapsed());
    let got = store.wait(&krefs, left);
    let t = store.traffic();
    traffic.requests.fetch_add(1, Ordering::Relaxed);
    traffic.sent.fetch_add(t.sent, Ordering::Relaxed);
    traffic.received.fetch_add(t.received, Ordering::Relaxed);
    got.map_err(|e| format!("the store at {at}: {e}"))
}

impl AddressSource for StoreAddresses {
    fn fetch(&mut self, peers: &[usize], timeout: Duration) -> Result<Vec<SocketAddr>, String> {
        let keys: Vec<String> = peers.iter().map(|&p| addr_key(&self.prefix, p)).collect();
        let vals = read_keys(&self.reach, self.rank, &keys, timeout, &self.traffic)?;
        peers
            .iter()
            .zip(&vals)
            .map(|(&p, v)| parse_addr(v, self.rank, p))
            .collect()
    }
}

/// An [`InboxSource`] that reads the inbox records from the rendezvous store, and in the same
/// request the addresses of the lower ranks among them that `book` does not know yet (which
/// the connect that follows dials).
pub(super) struct StoreInboxes {
    pub(super) reach: Reach,
    pub(super) rank: usize,
    pub(super) prefix: String,
    pub(super) traffic: Arc<FetchTraffic>,
    pub(super) book: Option<AddressBook>,
}

impl std::fmt::Debug for StoreInboxes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StoreInboxes(rank {} at {} under {})",
            self.rank, self.reach.store_addr, self.prefix
        )
    }
}

impl InboxSource for StoreInboxes {
    fn fetch(&mut self, peers: &[usize], timeout: Duration) -> Result<Vec<RemoteRegion>, String> {
        let rank = self.rank;
        let dial: Vec<usize> = match &self.book {
            Some(b) => peers
                .iter()
                .copied()
                .filter(|&p| p < rank && b.known(p).is_none())
                .collect(),
            None => Vec::new(),
        };
        let mut keys: Vec<String> = peers.iter().map(|&p| inbox_key(&self.prefix, p)).collect();
        keys.extend(dial.iter().map(|&p| addr_key(&self.prefix, p)));
        let vals = read_keys(&self.reach, rank, &keys, timeout, &self.traffic).map_err(|e| {
            let ranks = gradsync_transport::rank_list(peers);
            format!("the inbox descriptors of {ranks}: {e}")
        })?;
        let (inboxes, addrs) = vals.split_at(peers.len().min(vals.len()));
        if let Some(b) = &self.book {
            for (&p, v) in dial.iter().zip(addrs) {
                b.learn(p, parse_addr(v, rank, p)?);
            }
        }
        peers
            .iter()
            .zip(inboxes)
            .map(|(&p, v)| parse_inbox(v, rank, p))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_reads_at_init_the_inboxes_of_a_few_ranks_either_way() {
        assert_eq!(likely_talked(0, 1), Vec::<usize>::new());
        assert_eq!(likely_talked(0, 2), vec![1]);
        // Rank 5 of 16: 6, 4 (distance 1), 7, 3 (2), 9, 1 (4), 13 (8), and 0.
        assert_eq!(likely_talked(5, 16), vec![0, 1, 3, 4, 6, 7, 9, 13]);
        for world in [3usize, 6, 64, 4096] {
            let lg = world.next_power_of_two().trailing_zeros() as usize;
            for rank in 0..world {
                let v = likely_talked(rank, world);
                assert!(v.len() <= 3 * lg + 1, "{rank} of {world}: {v:?}");
                assert!(!v.contains(&rank) && v.iter().all(|&p| p < world));
                // Both ring neighbours.
                assert!(v.contains(&((rank + 1) % world)), "{rank} of {world}");
                assert!(
                    v.contains(&((rank + world - 1) % world)),
                    "{rank} of {world}"
                );
            }
        }
    }

    #[test]
    fn a_rank_reads_at_init_a_few_lower_ranks_at_power_of_two_distances() {
        assert!(likely_dialed(0, 16).is_empty());
        assert_eq!(likely_dialed(1, 16), vec![0]);
        assert_eq!(likely_dialed(5, 16), vec![0, 1, 3, 4]);
        // Rank 12 of 16: 11, 10, 8, 4 below; 12 + 4 and 12 + 8 wrap to 0 and 4.
        assert_eq!(likely_dialed(12, 16), vec![0, 4, 8, 10, 11]);
        for world in [2usize, 3, 7, 64, 4096] {
            let lg = world.next_power_of_two().trailing_zeros() as usize;
            for rank in 0..world {
                let v = likely_dialed(rank, world);
                assert!(v.len() <= 3 * lg + 1, "{rank} of {world}: {v:?}");
                assert!(v.iter().all(|&p| p < rank), "{rank} of {world}: {v:?}");
                if rank > 0 {
                    // The ring's left neighbour and the binomial-tree parent.
                    assert!(v.contains(&(rank - 1)), "{rank} of {world}");
                    assert!(v.contains(&(rank & (rank - 1))), "{rank} of {world}");
                }
            }
        }
    }
}
