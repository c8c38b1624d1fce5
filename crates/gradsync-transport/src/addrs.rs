//! Where a rank learns the listening addresses of the peers it dials: an [`AddressBook`].
//!
//! Of two ranks, the higher one dials the lower one's listener, so a rank needs the address of
//! a lower peer only when it first talks to it. A book made with [`AddressBook::full`] knows
//! every address from the start; one made with [`AddressBook::on_demand`] knows some and asks
//! its [`AddressSource`] (the rendezvous store) for the others, all the missing ones of one
//! connect in one request, and remembers them.

use crate::error::{Result, TransportError};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What an on-demand [`AddressBook`] asks for the addresses it does not know.
pub trait AddressSource: Send + std::fmt::Debug {
    /// The listening addresses of `peers`, in their order, within `timeout`; an error says
    /// what failed (the book adds this rank and the peers).
    fn fetch(
        &mut self,
        peers: &[usize],
        timeout: Duration,
    ) -> std::result::Result<Vec<SocketAddr>, String>;
}

#[derive(Debug)]
struct Book {
    rank: usize,
    known: Vec<Option<SocketAddr>>,
    source: Option<Box<dyn AddressSource>>,
    requests: u64,
    fetched: u64,
}

/// The listening addresses of a world's ranks, known or fetched on demand. A handle: clones
/// share one book.
#[derive(Debug, Clone)]
pub struct AddressBook(Arc<Mutex<Book>>);

impl AddressBook {
    /// A book that knows every address: `addrs[p]` is rank p's.
    pub fn full(rank: usize, addrs: Vec<SocketAddr>) -> AddressBook {
        AddressBook(Arc::new(Mutex::new(Book {
            rank,
            known: addrs.into_iter().map(Some).collect(),
            source: None,
            requests: 0,
            fetched: 0,
        })))
    }

    /// A book of `world` ranks that knows `known` and asks `source` for the rest.
    pub fn on_demand(
        rank: usize,
        world: usize,
        known: impl IntoIterator<Item = (usize, SocketAddr)>,
        source: Box<dyn AddressSource>,
    ) -> AddressBook {
        let mut k = vec![None; world];
        for (p, a) in known {
            if let Some(slot) = k.get_mut(p) {
                *slot = Some(a);
            }
        }
        AddressBook(Arc::new(Mutex::new(Book {
            rank,
            known: k,
            source: Some(source),
            requests: 0,
            fetched: 0,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.lock().known.len()
    }

    /// Rank `p`'s address, if the book knows it.
    pub fn known(&self, p: usize) -> Option<SocketAddr> {
        self.lock().known.get(p).copied().flatten()
    }

    /// Records rank `p`'s address, read elsewhere (with another record of `p`).
    pub fn learn(&self, p: usize, addr: SocketAddr) {
        if let Some(slot) = self.lock().known.get_mut(p) {
            *slot = Some(addr);
        }
    }

    /// How many addresses the book knows.
    pub fn known_count(&self) -> usize {
        self.lock().known.iter().flatten().count()
    }

    /// How many requests the book made of its source, and how many addresses they brought.
    pub fn fetches(&self) -> (u64, u64) {
        let b = self.lock();
        (b.requests, b.fetched)
    }

    /// The addresses of `peers`, asking the source in one request for those the book does not
    /// know, before `deadline`.
    pub fn resolve(&self, peers: &[usize], deadline: Instant) -> Result<Vec<SocketAddr>> {
        let mut b = self.lock();
        let (rank, world) = (b.rank, b.known.len());
        if let Some(&p) = peers.iter().find(|&&p| p >= world) {
            return Err(TransportError::Invalid {
                rank,
                op: "connect",
                msg: format!("rank {p} is not a peer in a world of {world}"),
            });
        }
        let mut missing: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| b.known[p].is_none())
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if !missing.is_empty() {
            let names = rank_list(&missing);
            let Some(source) = b.source.as_mut() else {
                return Err(TransportError::Address {
                    rank,
                    peers: names,
                    msg: "the book has no source to ask".into(),
                });
            };
            let timeout = deadline.saturating_duration_since(Instant::now());
            let got = source
                .fetch(&missing, timeout)
                .map_err(|msg| TransportError::Address {
                    rank,
                    peers: names.clone(),
                    msg,
                })?;
            if got.len() != missing.len() {
                return Err(TransportError::Address {
                    rank,
                    peers: names,
                    msg: format!("{} addresses came for {} ranks", got.len(), missing.len()),
                });
            }
            b.requests += 1;
            b.fetched += got.len() as u64;
            for (p, a) in missing.into_iter().zip(got) {
                b.known[p] = Some(a);
            }
        }
        Ok(peers
            .iter()
            .map(|&p| b.known[p].expect("resolved"))
            .collect())
    }
}

/// Ranks as errors name them: `rank 3` or `ranks 3, 5, 9`.
pub fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    format!(
        "rank{} {}",
        if ranks.len() > 1 { "s" } else { "" },
        list.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Counting(Arc<Mutex<Vec<Vec<usize>>>>);

    impl AddressSource for Counting {
        fn fetch(
            &mut self,
            peers: &[usize],
            _timeout: Duration,
        ) -> std::result::Result<Vec<SocketAddr>, String> {
            self.0.lock().unwrap().push(peers.to_vec());
            if peers.contains(&6) {
                return Err("rank 6 never published one".into());
            }
            Ok(peers
                .iter()
                .map(|&p| SocketAddr::from(([127, 0, 0, 1], 1000 + p as u16)))
                .collect())
        }
    }

    #[test]
    fn a_book_asks_once_for_what_it_does_not_know_and_remembers_it() {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], 1000 + p));
        let book = AddressBook::on_demand(
            7,
            8,
            [(7, a(7)), (5, a(5))],
            Box::new(Counting(asked.clone())),
        );
        let soon = Instant::now() + Duration::from_secs(1);
        assert_eq!(book.resolve(&[5], soon).unwrap(), vec![a(5)]);
        assert!(asked.lock().unwrap().is_empty());
        assert_eq!(
            book.resolve(&[3, 0, 5, 3], soon).unwrap(),
            vec![a(3), a(0), a(5), a(3)]
        );
        assert_eq!(*asked.lock().unwrap(), vec![vec![0, 3]]);
        book.resolve(&[0, 3], soon).unwrap();
        assert_eq!(asked.lock().unwrap().len(), 1);
        assert_eq!(book.fetches(), (1, 2));
        assert_eq!(book.known_count(), 4);
        let e = book.resolve(&[4, 6], soon).unwrap_err().to_string();
        assert!(
            e.contains("rank 7") && e.contains("ranks 4, 6") && e.contains("never published"),
            "{e}"
        );
        assert!(book.resolve(&[8], soon).is_err());
        let full = AddressBook::full(0, vec![a(0), a(1)]);
        assert_eq!(full.resolve(&[1], soon).unwrap(), vec![a(1)]);
        assert_eq!(full.fetches(), (0, 0));
    }
}
