//! The slot settings every rank publishes with its inbox descriptor, which must agree.

use crate::config::Config;
use crate::error::Error;

/// The settings that shape every rank's inbox and its use, which must be alike on all ranks,
/// and the size of the rank's board (eager all-reduces use boards when every rank has one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SlotLayout {
    chunk: u64,
    nslots: u32,
    tcp_nslots: u32,
    /// Bytes of the rank's transport board, 0 without one (or with `GRADSYNC_SHM_BOARD=0`).
    pub(super) board: u32,
    /// `GRADSYNC_RECV_BUDGET`, which `nslots` was fitted to: named when the slots differ.
    budget: u64,
    /// The shared-memory direct-write threshold of all-to-all and all-gather
    /// (`GRADSYNC_SHM_DIRECT_MIN`): senders wait for their receivers' offers from it, and the
    /// all-to-all's message size depends on it.
    move_direct: u64,
    /// The block size from which `move_direct` applies (see
    /// [`Config::shm_move_block_min`]).
    move_block: u64,
    /// Whether the pairs beyond the receive budget share pools (1) or not (0).
    pool: u32,
}

impl SlotLayout {
    /// Length of [`to_bytes`](Self::to_bytes), which follows the inbox descriptor.
    pub(super) const LEN: usize = 48;

    pub(super) fn of(c: &Config, board: usize, pool: bool) -> Self {
        SlotLayout {
            chunk: c.chunk_bytes as u64,
            nslots: c.nslots as u32,
            tcp_nslots: c.tcp_nslots as u32,
            board: if c.shm_board {
                u32::try_from(board).unwrap_or(u32::MAX)
            } else {
                0
            },
            budget: c.recv_budget as u64,
            move_direct: c.shm_move_direct_min as u64,
            move_block: c.shm_move_block_min as u64,
            pool: u32::from(pool),
        }
    }

    pub(super) fn to_bytes(self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.chunk.to_le_bytes());
        b[8..12].copy_from_slice(&self.nslots.to_le_bytes());
        b[12..16].copy_from_slice(&self.tcp_nslots.to_le_bytes());
        b[16..20].copy_from_slice(&self.board.to_le_bytes());
        b[20..28].copy_from_slice(&self.budget.to_le_bytes());
        b[28..36].copy_from_slice(&self.move_direct.to_le_bytes());
        b[36..44].copy_from_slice(&self.move_block.to_le_bytes());
        b[44..].copy_from_slice(&self.pool.to_le_bytes());
        b
    }

    pub(super) fn from_bytes(b: &[u8]) -> Option<Self> {
        (b.len() == Self::LEN).then(|| SlotLayout {
            chunk: u64::from_le_bytes(b[..8].try_into().expect("8")),
            nslots: u32::from_le_bytes(b[8..12].try_into().expect("4")),
            tcp_nslots: u32::from_le_bytes(b[12..16].try_into().expect("4")),
            board: u32::from_le_bytes(b[16..20].try_into().expect("4")),
            budget: u64::from_le_bytes(b[20..28].try_into().expect("8")),
            move_direct: u64::from_le_bytes(b[28..36].try_into().expect("8")),
            move_block: u64::from_le_bytes(b[36..44].try_into().expect("8")),
            pool: u32::from_le_bytes(b[44..].try_into().expect("4")),
        })
    }

    /// An error naming both ranks and every setting that differs (the board may differ).
    pub(super) fn check(&self, rank: usize, peer: usize, theirs: &SlotLayout) -> Result<(), Error> {
        match self.differences(rank, peer, theirs) {
            None => Ok(()),
            Some(d) => Err(Error::Config(format!("rank {rank}: {d}"))),
        }
    }

    /// Every setting that differs between this layout (of `rank`) and `theirs` (of `peer`),
    /// with what to do; `None` when they agree (the board may differ).
    pub(super) fn differences(
        &self,
        rank: usize,
        peer: usize,
        theirs: &SlotLayout,
    ) -> Option<String> {
        let settings = |l: &SlotLayout| {
            (
                l.chunk,
                l.nslots,
                l.tcp_nslots,
                l.move_direct,
                l.move_block,
                l.pool,
            )
        };
        if settings(self) == settings(theirs) {
            return None;
        }
        let mut diff = Vec::new();
        for (name, a, b) in [
            ("GRADSYNC_CHUNK_SIZE", self.chunk, theirs.chunk),
            ("GRADSYNC_NSLOTS", self.nslots.into(), theirs.nslots.into()),
            (
                "GRADSYNC_TCP_NSLOTS",
                self.tcp_nslots.into(),
                theirs.tcp_nslots.into(),
            ),
            (
                "GRADSYNC_SHM_DIRECT_MIN",
                self.move_direct,
                theirs.move_direct,
            ),
        ] {
            if a != b {
                // GRADSYNC_TCP_NSLOTS unset is 0: the default by host; a threshold of
                // usize::MAX is off.
                let show = |v: u64| match v {
                    0 if name == "GRADSYNC_TCP_NSLOTS" => "unset".to_string(),
                    u64::MAX => "off".to_string(),
                    v => v.to_string(),
                };
                diff.push(format!(
                    "{name} is {} on rank {rank} but {} on rank {peer}",
                    show(a),
                    show(b)
                ));
            }
        }
        // The same threshold, set on one rank and the default on the other, which limits it
        // to large blocks.
        if self.move_direct == theirs.move_direct && self.move_block != theirs.move_block {
            let set = |b: u64| if b == 0 { "set" } else { "unset" };
            diff.push(format!(
                "GRADSYNC_SHM_DIRECT_MIN is {} on rank {rank} but {} on rank {peer}",
                set(self.move_block),
                set(theirs.move_block)
            ));
        }
        // The slots per peer are GRADSYNC_NSLOTS fitted to the budget, and the budget decides
        // whether pairs share pools: name the budget too.
        if (self.nslots != theirs.nslots || self.pool != theirs.pool)
            && self.budget != theirs.budget
        {
            diff.push(format!(
                "GRADSYNC_RECV_BUDGET is {} on rank {rank} but {} on rank {peer}",
                self.budget, theirs.budget
            ));
        }
        if self.pool != theirs.pool && self.budget == theirs.budget {
            let on = |p: u32| if p != 0 { "on" } else { "off" };
            diff.push(format!(
                "receive pools are {} on rank {rank} but {} on rank {peer} (GRADSYNC_CHECKSUM turns them off)",
                on(self.pool),
                on(theirs.pool)
            ));
        }
        Some(format!("{}; set them alike on every rank", diff.join(", ")))
    }
}
