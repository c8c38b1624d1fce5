//! How the ranks of a communicator being built swap their setup records (listening addresses,
//! host identities, shared-memory segments, RDMA queue pairs, inbox descriptors): through the
//! rendezvous store at init ([`StoreExchange`]), or over the point-to-point messages of the
//! communicator it is split from ([`ParentExchange`]), without any store.

use super::addresses::{self, FetchTraffic, Reach};
use super::communicator::Communicator;
use super::tables;
use crate::Result;
use crate::error::Error;
use gradsync_store::StoreClient;
use gradsync_transport::AddressBook;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest record a member accepts from another over the parent (a peer's claim beyond it is
/// refused before anything is allocated).
const MAX_RECORD: usize = 256 << 20;

/// What [`Exchange::parts`] cuts each rank's part with: the values of all ranks, and the
/// index of the rank the part is for.
pub(super) type PartFn<'a> = dyn Fn(&[Vec<u8>], usize) -> Vec<u8> + 'a;

/// Where the ranks of a communicator being built meet.
pub(super) trait Exchange {
    /// Gives the ranks of `ranks` (ranks of the new communicator, ascending, this one among
    /// them) this rank's `items` (name and value) and returns theirs: `out[i][j]` is the value
    /// of `items[j]` from `ranks[i]`. Every rank of `ranks` calls it with the same names.
    fn swap(&mut self, items: &[(&str, &[u8])], ranks: &[usize]) -> Result<Vec<Vec<Vec<u8>>>>;

    /// When the whole setup must be done, where the exchange has a deadline of its own (a
    /// split); `None` when each step has the full timeout (init).
    fn deadline(&self) -> Option<Instant>;

    /// Every rank of `ranks` gives `value` under `name`; `pack` turns the values, in the order
    /// of `ranks`, into one table, which every rank returns. `pack` must be a function of the
    /// values alone. By default every rank swaps the values and packs them itself; through the
    /// store only the first rank of `ranks` reads the values and the others read its table.
    fn table(
        &mut self,
        name: &str,
        value: &[u8],
        ranks: &[usize],
        pack: &dyn Fn(&[Vec<u8>]) -> Vec<u8>,
    ) -> Result<Vec<u8>> {
        self.parts(name, value, ranks, &|vals, _| pack(vals))
    }

    /// Every rank of `ranks` gives `value` under `name`; `part(values, i)` cuts from the values
    /// (in the order of `ranks`) what the `i`-th rank of `ranks` needs, and each rank returns
    /// its own part. `part` must be a function of its arguments alone. By default every rank
    /// swaps the values and cuts its part itself; through the store the first rank reads the
    /// values and publishes each rank's part under a key of its own, so that a rank reads
    /// only its part.
    fn parts(
        &mut self,
        name: &str,
        value: &[u8],
        ranks: &[usize],
        part: &PartFn<'_>,
    ) -> Result<Vec<u8>> {
        let me = self.me_in(ranks);
        let vals = self.swap(&[(name, value)], ranks)?;
        let vals: Vec<Vec<u8>> = vals
            .into_iter()
            .map(|v| v.into_iter().next().unwrap_or_default())
            .collect();
        Ok(part(&vals, me))
    }

    /// This rank's index in `ranks`.
    fn me_in(&self, ranks: &[usize]) -> usize;

    /// Where per-rank records left out of init's tables can be read after init: the store,
    /// for an exchange through one (`None` by default: every record is in the tables).
    fn on_demand(&mut self) -> Option<OnDemand<'_>> {
        None
    }

    /// The host identity of every rank of `0..world` and this rank's book of their listening
    /// addresses, this rank giving `my_addr` and `host_id`. By default every rank gets every
    /// address (the peers table, 10 bytes a rank).
    fn peers(
        &mut self,
        rank: usize,
        world: usize,
        my_addr: SocketAddr,
        host_id: &str,
    ) -> Result<(Vec<String>, AddressBook)> {
        let everyone: Vec<usize> = (0..world).collect();
        let t = self.table(
            "peers",
            &tables::peer_record(my_addr, host_id),
            &everyone,
            &tables::pack_peers,
        )?;
        let (addrs, ids) = tables::unpack_peers(&t, rank, world)?;
        Ok((ids, AddressBook::full(rank, addrs)))
    }
}

/// The store of an exchange, for records a rank reads only for the ranks it talks to.
pub(super) struct OnDemand<'a> {
    pub(super) store: &'a mut StoreClient,
    pub(super) prefix: &'a str,
    pub(super) timeout: Duration,
    pub(super) reach: Reach,
    pub(super) traffic: Arc<FetchTraffic>,
}

/// What is left of `full` for a setup step under `ex`'s deadline.
pub(super) fn step_budget(ex: &dyn Exchange, full: Duration) -> Duration {
    ex.deadline().map_or(full, |d| {
        full.min(d.saturating_duration_since(Instant::now()))
    })
}

/// The exchange of init: every value under `{prefix}/{name}/{rank}` in the rendezvous store.
pub(super) struct StoreExchange<'a> {
    pub(super) store: &'a mut StoreClient,
    pub(super) prefix: &'a str,
    pub(super) rank: usize,
    pub(super) timeout: Duration,
    /// How to reach the store again after init, for the listening addresses that a rank
    /// fetches when it first dials a peer; `None` where init's exchange names no addresses.
    pub(super) reach: Option<Reach>,
    /// What this rank's address fetches after init send and receive (shared with its book).
    pub(super) fetch_traffic: Arc<FetchTraffic>,
}

impl Exchange for StoreExchange<'_> {
    fn swap(&mut self, items: &[(&str, &[u8])], ranks: &[usize]) -> Result<Vec<Vec<Vec<u8>>>> {
        let rank = self.rank;
        let st = |source| Error::Store { rank, source };
        for (name, value) in items {
            self.store
                .set(&format!("{}/{name}/{rank}", self.prefix), value)
                .map_err(st)?;
        }
        let prefix = self.prefix;
        let keys: Vec<String> = ranks
            .iter()
            .flat_map(|r| {
                items
                    .iter()
                    .map(move |(name, _)| format!("{prefix}/{name}/{r}"))
            })
            .collect();
        let krefs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let vals = self.store.wait(&krefs, self.timeout).map_err(st)?;
        Ok(vals
            .chunks(items.len().max(1))
            .map(<[Vec<u8>]>::to_vec)
            .collect())
    }

    fn deadline(&self) -> Option<Instant> {
        None
    }

    /// Every rank publishes its value under `{name}/{rank}`; the first rank of `ranks` waits
    /// for every value, packs them and publishes the table under `{name}/table`, which every
    /// other rank fetches alone, so what it reads does not grow with the length of the keys
    /// or the records' raw form. A rank whose table does not come names the ranks whose values
    /// are missing.
    fn table(
        &mut self,
        name: &str,
        value: &[u8],
        ranks: &[usize],
        pack: &dyn Fn(&[Vec<u8>]) -> Vec<u8>,
    ) -> Result<Vec<u8>> {
        let table_key = format!("{}/{name}/table", self.prefix);
        match self.gather(name, value, ranks)? {
            Some(vals) => {
                let t = pack(&vals);
                let rank = self.rank;
                self.store
                    .set(&table_key, &t)
                    .map_err(|source| Error::Store { rank, source })?;
                Ok(t)
            }
            None => self.fetch(&table_key, name, ranks),
        }
    }

    /// Every rank publishes its value under `{name}/{rank}`; the first rank of `ranks` waits
    /// for every value and publishes each other rank's part under `{name}/for/{rank}`, which
    /// that rank fetches alone.
    fn parts(
        &mut self,
        name: &str,
        value: &[u8],
        ranks: &[usize],
        part: &PartFn<'_>,
    ) -> Result<Vec<u8>> {
        let rank = self.rank;
        let prefix = self.prefix;
        let for_key = |r: usize| format!("{prefix}/{name}/for/{r}");
        match self.gather(name, value, ranks)? {
            Some(vals) => {
                for (i, &r) in ranks.iter().enumerate().skip(1) {
                    self.store
                        .set(&for_key(r), &part(&vals, i))
                        .map_err(|source| Error::Store { rank, source })?;
                }
                Ok(part(&vals, 0))
            }
            None => {
                let key = for_key(rank);
                self.fetch(&key, name, ranks)
            }
        }
    }

    fn me_in(&self, ranks: &[usize]) -> usize {
        ranks.iter().position(|&r| r == self.rank).unwrap_or(0)
    }

    fn on_demand(&mut self) -> Option<OnDemand<'_>> {
        let reach = self.reach.clone()?;
        Some(OnDemand {
            store: self.store,
            prefix: self.prefix,
            timeout: self.timeout,
            reach,
            traffic: self.fetch_traffic.clone(),
        })
    }

    /// Every rank publishes its address under a key of its own and its host identity for the
    /// hosts table, which every rank reads; then each reads the addresses of the few lower
    /// ranks it is likely to dial first, and its book fetches any other from the store when it
    /// first dials it (see `addresses`).
    fn peers(
        &mut self,
        rank: usize,
        world: usize,
        my_addr: SocketAddr,
        host_id: &str,
    ) -> Result<(Vec<String>, AddressBook)> {
        let Some(reach) = self.reach.clone() else {
            return Err(Error::Internal {
                rank,
                msg: "init's exchange has no way back to the store".into(),
            });
        };
        let st = |source| Error::Store { rank, source };
        let prefix = self.prefix;
        self.store
            .set(
                &addresses::addr_key(prefix, rank),
                my_addr.to_string().as_bytes(),
            )
            .map_err(st)?;
        let everyone: Vec<usize> = (0..world).collect();
        // Every address is published before the host identity it comes with, so every key
        // read below is there once the table is.
        let t = self.table("hosts", host_id.as_bytes(), &everyone, &tables::pack_hosts)?;
        let ids = tables::unpack_hosts(&t, rank, world)?;
        let mut known = vec![(rank, my_addr)];
        known.extend(addresses::read_at_init(
            self.store,
            prefix,
            rank,
            &addresses::likely_dialed(rank, world),
            self.timeout,
            addresses::addr_key,
            addresses::parse_addr,
        )?);
        let source = addresses::StoreAddresses {
            reach,
            rank,
            prefix: prefix.to_string(),
            traffic: self.fetch_traffic.clone(),
        };
        Ok((
            ids,
            AddressBook::on_demand(rank, world, known, Box::new(source)),
        ))
    }
}

impl StoreExchange<'_> {
    /// Publishes this rank's value under `{name}/{rank}`; on the first rank of `ranks`, waits
    /// for every other rank's and returns all of them in the order of `ranks`.
    fn gather(
        &mut self,
        name: &str,
        value: &[u8],
        ranks: &[usize],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let rank = self.rank;
        let st = |source| Error::Store { rank, source };
        let prefix = self.prefix;
        self.store
            .set(&format!("{prefix}/{name}/{rank}"), value)
            .map_err(st)?;
        if ranks.first() != Some(&rank) {
            return Ok(None);
        }
        let others = self.keys_of_others(name, ranks);
        let orefs: Vec<&str> = others.iter().map(String::as_str).collect();
        let mut theirs = self
            .store
            .wait(&orefs, self.timeout)
            .map_err(st)?
            .into_iter();
        Ok(Some(
            ranks
                .iter()
                .map(|&r| {
                    if r == rank {
                        value.to_vec()
                    } else {
                        theirs.next().unwrap_or_default()
                    }
                })
                .collect(),
        ))
    }

    /// Waits for `key`, which the first rank of `ranks` publishes once it has every value of
    /// `name`; a timeout names the ranks whose values are missing, where the store can say.
    fn fetch(&mut self, key: &str, name: &str, ranks: &[usize]) -> Result<Vec<u8>> {
        let rank = self.rank;
        let st = |source| Error::Store { rank, source };
        match self.store.wait(&[key], self.timeout) {
            Ok(mut v) => Ok(v.swap_remove(0)),
            Err(e) => {
                let others = self.keys_of_others(name, ranks);
                let orefs: Vec<&str> = others.iter().map(String::as_str).collect();
                let missing = self.store.wait(&orefs, Duration::from_millis(1)).err();
                Err(st(missing.unwrap_or(e)))
            }
        }
    }

    fn keys_of_others(&self, name: &str, ranks: &[usize]) -> Vec<String> {
        ranks
            .iter()
            .filter(|&&r| r != self.rank)
            .map(|&r| format!("{}/{name}/{r}", self.prefix))
            .collect()
    }
}

/// The exchange of a split: over the point-to-point messages of the parent communicator,
/// between the members of the new one only. A swap among `ranks` goes through the first of
/// them: every other rank sends it its record (length, then bytes) and receives the table of
/// all records back, so `2 (n - 1)` small messages, none between two other members, and no
/// rank outside `ranks` is involved. The parent numbers its sends and receives per pair of
/// ranks apart from its collectives, so a split among some members leaves the others free to
/// run anything that does not involve the members meanwhile.
///
/// Every message is bounded by what is left of the split's deadline (the parent's timeout,
/// counted from the start of the split), and a failure names the step, the member waited on
/// and its rank in the parent.
pub(super) struct ParentExchange<'a> {
    parent: &'a mut Communicator,
    /// The parent rank of every rank of the new communicator.
    members: &'a [usize],
    /// This rank in the new communicator.
    me: usize,
    op: &'static str,
    deadline: Instant,
}

impl<'a> ParentExchange<'a> {
    pub(super) fn new(
        parent: &'a mut Communicator,
        members: &'a [usize],
        me: usize,
        op: &'static str,
        deadline: Instant,
    ) -> Self {
        ParentExchange {
            parent,
            members,
            me,
            op,
            deadline,
        }
    }

    fn error(&self, msg: String, source: Option<Error>) -> Error {
        Error::Split {
            rank: self.parent.rank(),
            op: self.op,
            msg,
            source: source.map(Box::new),
        }
    }

    /// `rank q of the new communicator (parent rank p)`.
    fn who(&self, q: usize) -> String {
        format!(
            "rank {q} of the new communicator (parent rank {})",
            self.members[q]
        )
    }

    /// Runs a send or receive with member `q` under what is left of the deadline; `step`
    /// says what it does, for the error.
    fn with_peer<T>(
        &mut self,
        q: usize,
        step: &str,
        f: impl FnOnce(&mut Communicator, usize) -> Result<T>,
    ) -> Result<T> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        let saved = self.parent.timeout();
        if left.is_zero() {
            let e = self.error(
                format!("{step}: the deadline of {saved:?} passed before it"),
                None,
            );
            // As when a message times out: the parent is unusable and its peers are told, so
            // that none of them waits for this rank's next message.
            self.parent.engine.fail(&e);
            return Err(e);
        }
        self.parent.set_timeout(left.min(saved));
        let peer = self.members[q];
        let r = f(self.parent, peer);
        self.parent.set_timeout(saved);
        r.map_err(|e| self.error(step.to_string(), Some(e)))
    }

    fn send_bytes(&mut self, q: usize, what: &str, bytes: &[u8]) -> Result<()> {
        let step = format!("sending the {what} record to {}", self.who(q));
        let len = [bytes.len() as i64];
        self.with_peer(q, &step, |c, p| c.send(&len, p))?;
        self.with_peer(q, &step, |c, p| c.send(bytes, p))
    }

    fn recv_bytes(&mut self, q: usize, what: &str) -> Result<Vec<u8>> {
        let who = self.who(q);
        let step = format!("waiting for the {what} record of {who}");
        let mut len = [0i64];
        self.with_peer(q, &step, |c, p| c.recv(&mut len, p))?;
        let n = usize::try_from(len[0])
            .ok()
            .filter(|&n| n <= MAX_RECORD)
            .ok_or_else(|| {
                self.error(
                    format!(
                        "{who} announced a {what} record of {} bytes (at most {MAX_RECORD})",
                        len[0]
                    ),
                    None,
                )
            })?;
        let mut buf = vec![0u8; n];
        self.with_peer(q, &step, |c, p| c.recv(&mut buf, p))?;
        Ok(buf)
    }
}

/// Appends `value` with its length (u32, little-endian) in front.
pub(super) fn put(out: &mut Vec<u8>, value: &[u8]) {
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
}

/// Splits `bytes` into exactly `n` length-prefixed values.
pub(super) fn take(mut bytes: &[u8], n: usize) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
        out.push(bytes.get(4..4 + len)?.to_vec());
        bytes = &bytes[4 + len..];
    }
    bytes.is_empty().then_some(out)
}

impl Exchange for ParentExchange<'_> {
    fn swap(&mut self, items: &[(&str, &[u8])], ranks: &[usize]) -> Result<Vec<Vec<Vec<u8>>>> {
        let what = items.iter().map(|(n, _)| *n).collect::<Vec<_>>().join("/");
        let mut record = Vec::new();
        for (_, value) in items {
            put(&mut record, value);
        }
        let root = ranks[0];
        let malformed = |this: &Self, q: usize, len: usize| {
            this.error(
                format!(
                    "{} sent a malformed {what} record of {len} bytes (expected {} values)",
                    this.who(q),
                    items.len()
                ),
                None,
            )
        };
        let records: Vec<Vec<u8>> = if self.me == root {
            let mut records = vec![record];
            for &q in &ranks[1..] {
                let r = self.recv_bytes(q, &what)?;
                if take(&r, items.len()).is_none() {
                    return Err(malformed(self, q, r.len()));
                }
                records.push(r);
            }
            let mut table = Vec::new();
            for r in &records {
                put(&mut table, r);
            }
            for &q in &ranks[1..] {
                self.send_bytes(q, &what, &table)?;
            }
            records
        } else {
            self.send_bytes(root, &what, &record)?;
            let table = self.recv_bytes(root, &what)?;
            take(&table, ranks.len()).ok_or_else(|| malformed(self, root, table.len()))?
        };
        records
            .iter()
            .zip(ranks)
            .map(|(r, &q)| take(r, items.len()).ok_or_else(|| malformed(self, q, r.len())))
            .collect()
    }

    fn deadline(&self) -> Option<Instant> {
        Some(self.deadline)
    }

    fn me_in(&self, ranks: &[usize]) -> usize {
        ranks.iter().position(|&r| r == self.me).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::{Exchange, StoreExchange, put, take};
    use gradsync_store::{StoreClient, StoreServer};
    use std::time::Duration;

    #[test]
    fn through_the_store_each_rank_reads_only_its_part() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr().to_string();
        let world = 6;
        let ranks: Vec<usize> = (0..world).collect();
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (addr, ranks) = (addr.clone(), ranks.clone());
                std::thread::spawn(move || {
                    let t = Duration::from_secs(20);
                    let mut store = StoreClient::connect(&addr, t).unwrap();
                    let mut ex = StoreExchange {
                        store: &mut store,
                        prefix: "p",
                        rank,
                        timeout: t,
                        reach: None,
                        fetch_traffic: Default::default(),
                    };
                    // A value of 1000 bytes each; rank i's part: byte i of every value.
                    let value = vec![rank as u8; 1000];
                    let part = |vals: &[Vec<u8>], i: usize| -> Vec<u8> {
                        vals.iter().map(|v| v[i] + 100).collect()
                    };
                    let got = ex.parts("x", &value, &ranks, &part).unwrap();
                    (got, store.traffic().received)
                })
            })
            .collect();
        for (rank, h) in hs.into_iter().enumerate() {
            let (got, received) = h.join().unwrap();
            let want: Vec<u8> = (0..world).map(|r| r as u8 + 100).collect();
            assert_eq!(got, want, "rank {rank}");
            if rank > 0 {
                // Its part (6 bytes) and the framing, not the 6000 bytes of the values.
                assert!(received < 200, "rank {rank} received {received} bytes");
            }
        }
    }

    #[test]
    fn records_round_trip_and_reject_bad_lengths() {
        let mut r = Vec::new();
        put(&mut r, b"abc");
        put(&mut r, b"");
        assert_eq!(r, [3, 0, 0, 0, b'a', b'b', b'c', 0, 0, 0, 0]);
        assert_eq!(take(&r, 2), Some(vec![b"abc".to_vec(), Vec::new()]));
        assert_eq!(take(&r, 1), None, "trailing bytes");
        assert_eq!(take(&r, 3), None, "a value missing");
        assert_eq!(take(&r[..6], 2), None, "truncated value");
        assert_eq!(take(&[9, 0, 0, 0, 1], 1), None, "length beyond the record");
    }
}
