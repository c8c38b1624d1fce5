//! How a rank's receive memory is laid out within `GRADSYNC_RECV_BUDGET`: inbox slots for
//! every peer while they fit, else slots for the peers at power-of-two distances and a shared
//! pool for the others (see the protocol manual's pooled pairs).

use crate::config::{Config, MIN_SLOTS_PER_PEER};

/// Fewest and most slots of a rank's shared receive pool ([`Config::recv_layout`]).
pub const MIN_POOL_SLOTS: usize = 4;
/// See [`MIN_POOL_SLOTS`].
pub const MAX_POOL_SLOTS: usize = 256;

/// How a rank's receive memory is laid out ([`Config::recv_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvLayout {
    /// Inbox slots of each peer that has slots.
    pub nslots: usize,
    /// Slots of the shared pool of the other peers; 0: every peer has slots.
    pub pool_slots: usize,
    /// Even the fewest slots exceed the budget.
    pub over: bool,
}

impl RecvLayout {
    /// The peers of `rank` of `world` without inbox slots (none where every peer keeps them).
    pub fn pooled_peers(&self, rank: usize, world: usize) -> Vec<usize> {
        if self.pool_slots == 0 {
            return Vec::new();
        }
        let near = slot_peers(rank, world);
        (0..world)
            .filter(|p| *p != rank && near.binary_search(p).is_err())
            .collect()
    }

    /// Slots of the pool of a rank with `pooled` pooled peers: no more than those peers' own
    /// slots would have been, at least 4, at most `pool_slots`.
    pub fn pool_for(&self, pooled: usize) -> usize {
        self.pool_slots
            .min((pooled * self.nslots).max(MIN_POOL_SLOTS))
    }
}

/// The peers of `rank` of `world` that keep inbox slots when pairs beyond the receive budget
/// share pools: those at a power-of-two distance either way round the ring or in the bits of
/// the rank (the ring's neighbours, recursive doubling and halving, binomial and binary
/// trees). Symmetric: `p` is among `rank`'s exactly when `rank` is among `p`'s.
pub fn slot_peers(rank: usize, world: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut d = 1;
    while d < world {
        v.push((rank + d) % world);
        v.push((rank + world - d) % world);
        if rank ^ d < world {
            v.push(rank ^ d);
        }
        d <<= 1;
    }
    v.retain(|&p| p != rank && p < world);
    v.sort_unstable();
    v.dedup();
    v
}

/// At least as many as [`slot_peers`] gives any rank of `world`: 3 per power of two below
/// the world.
pub fn slot_peers_bound(world: usize) -> usize {
    3 * (usize::BITS - world.saturating_sub(1).leading_zeros()).max(1) as usize
}

impl Config {
    /// How receive memory is laid out on `world` ranks, a function of the settings and the
    /// world alone (so ranks with the same settings agree):
    ///
    /// - where `world * nslots` slots of `chunk_bytes` fit in `recv_budget` (or checksums
    ///   are on, whose messages need a slot's header), every peer gets slots: `nslots`, or
    ///   fewer as [`slots_within_budget`](Self::slots_within_budget) says;
    /// - else only the peers at a power-of-two distance round the ring or in the bits of the
    ///   rank ([`slot_peers`]: ring, trees, recursive doubling and halving) get slots, as many
    ///   as half the budget holds for 3 log2 `world` of them (at least 2, at most
    ///   `nslots`), and the other peers share a pool of the budget's rest (4 to 256 slots).
    pub fn recv_layout(&self, world: usize) -> RecvLayout {
        let chunk = self.chunk_bytes.max(1);
        let all = world.saturating_mul(self.nslots).saturating_mul(chunk);
        if world <= 2 || self.checksum || all <= self.recv_budget {
            let (nslots, over) = self.slots_within_budget(world);
            return RecvLayout {
                nslots,
                pool_slots: 0,
                over,
            };
        }
        let near = slot_peers_bound(world);
        let least = MIN_SLOTS_PER_PEER.min(self.nslots);
        let nslots = (self.recv_budget / 2 / near.saturating_mul(chunk))
            .clamp(least, self.nslots.max(least));
        let private = near * nslots * chunk;
        let pool_slots = (self.recv_budget.saturating_sub(private) / chunk)
            .clamp(MIN_POOL_SLOTS, MAX_POOL_SLOTS);
        RecvLayout {
            nslots,
            pool_slots,
            over: private + pool_slots * chunk > self.recv_budget,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_beyond_the_budget_share_a_pool() {
        let c = Config::new("", 0, 1);
        // 1 GiB holds 8 slots of 512 KiB for 256 ranks; past that, 3 log2(world) peers keep
        // slots within half the budget and the rest share 256 slots.
        for (world, nslots, pool) in [(256, 8, 0), (257, 8, 256), (4096, 8, 256)] {
            let l = c.recv_layout(world);
            assert_eq!(
                (l.nslots, l.pool_slots, l.over),
                (nslots, pool, false),
                "{world}"
            );
        }
        // 16 ranks in 16 MiB: 12 peers x 2 slots, and 8 pool slots.
        let mut small = Config::new("", 0, 1);
        small.recv_budget = 16 << 20;
        let l = small.recv_layout(16);
        assert_eq!((l.nslots, l.pool_slots, l.over), (2, 8, false));
        // Checksums need a slot's header: no pool, fewer slots for every peer.
        let mut sums = small.clone();
        sums.checksum = true;
        assert_eq!(sums.recv_layout(16).pool_slots, 0);
        // The peers with slots are symmetric, and within the bound.
        for world in [3, 5, 8, 16, 100, 257, 4096] {
            for r in (0..world).step_by(world / 7 + 1) {
                let mine = slot_peers(r, world);
                assert!(mine.len() <= slot_peers_bound(world), "{world}");
                for &p in &mine {
                    assert!(slot_peers(p, world).contains(&r), "{r} and {p} of {world}");
                }
            }
        }
        assert_eq!(slot_peers(0, 8), vec![1, 2, 4, 6, 7]);
    }
}
