//! The connection descriptor a rank publishes through the rendezvous store
//! ([`ConnInfo`], [`ConnInfoRepr`]): what a peer needs to move its queue pairs to this rank
//! to RTR.
//!
//! Little-endian; a descriptor fills a whole store value:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0 | 4 | magic [`INFO_MAGIC`] (`"BISG"` on the wire) |
//! | 4 | 4 | world size |
//! | 8 | 4 | queue pairs per peer |
//! | 12 | 16 | GID |
//! | 28 | 4 | LID |
//! | 32 | 4 | active path MTU code (1-5: 256-4096 bytes) |
//! | 36 | 4 | 1 when the port is RoCE (a global route is needed), 0 for InfiniBand |
//! | 40 | 8 each | (queue pair number, first packet sequence number), both `u32`, of every queue pair to every rank: rank-major, `world * qps` entries, zeros for the rank itself |
//!
//! A *column* ([`ConnInfoRepr::column`]) is the part of a descriptor that one peer needs: the
//! same fixed part with the magic [`COLUMN_MAGIC`], then only the `qps` entries of the queue
//! pairs to that peer. Init hands each rank the columns meant for it rather than every rank's
//! whole descriptor, whose size grows with the world.

use crate::wire::{WireError, array, put, wire_view};

/// First bytes of a connection descriptor.
pub const INFO_MAGIC: u32 = 0x4753_4942;
/// First bytes of a column: a descriptor's entries for one peer (`"CISG"` on the wire).
pub const COLUMN_MAGIC: u32 = 0x4753_4943;
/// Length of a descriptor's fixed part; the queue pair entries follow.
pub const INFO_HEADER_LEN: usize = 40;
/// Length of one queue pair entry.
pub const INFO_ENTRY_LEN: usize = 8;

const FORMAT: &str = "connection descriptor";

mod field {
    pub(super) const MAGIC: usize = 0;
    pub(super) const WORLD: usize = 4;
    pub(super) const QPS: usize = 8;
    pub(super) const GID: usize = 12;
    pub(super) const LID: usize = 28;
    pub(super) const MTU: usize = 32;
    pub(super) const GLOBAL: usize = 36;
}

wire_view! {
    /// A typed view over the bytes of a connection descriptor.
    ConnInfo {
        /// The magic number.
        magic, set_magic: u32 = field::MAGIC;
        /// The world size.
        world, set_world: u32 = field::WORLD;
        /// Queue pairs per peer.
        qps, set_qps: u32 = field::QPS;
        /// The LID.
        lid, set_lid: u32 = field::LID;
        /// The path MTU code.
        mtu, set_mtu: u32 = field::MTU;
        /// The global-route word (non-zero: RoCE).
        global, set_global: u32 = field::GLOBAL;
    }
}

impl<T: AsRef<[u8]>> ConnInfo<T> {
    /// Checks that the accessors will not panic: the fixed part and every entry it announces.
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        if got < INFO_HEADER_LEN {
            return Err(WireError::Truncated {
                format: FORMAT,
                got,
                need: INFO_HEADER_LEN,
            });
        }
        let need = self.total_len()?;
        if got < need {
            return Err(WireError::Truncated {
                format: FORMAT,
                got,
                need,
            });
        }
        Ok(())
    }

    /// Bytes of the descriptor the fixed part announces.
    fn total_len(&self) -> Result<usize, WireError> {
        let count = u64::from(self.world()) * u64::from(self.qps());
        usize::try_from(count)
            .ok()
            .and_then(|n| n.checked_mul(INFO_ENTRY_LEN))
            .and_then(|n| n.checked_add(INFO_HEADER_LEN))
            .ok_or(WireError::TooManyEntries {
                format: FORMAT,
                count,
            })
    }

    /// The GID.
    pub fn gid(&self) -> [u8; 16] {
        array(self.buffer.as_ref(), field::GID)
    }

    /// Entry `i`: (queue pair number, packet sequence number).
    pub fn qp(&self, i: usize) -> (u32, u32) {
        let at = INFO_HEADER_LEN + i * INFO_ENTRY_LEN;
        let b = self.buffer.as_ref();
        (
            u32::from_le_bytes(array(b, at)),
            u32::from_le_bytes(array(b, at + 4)),
        )
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ConnInfo<T> {
    /// Sets the GID.
    pub fn set_gid(&mut self, v: &[u8; 16]) {
        put(self.buffer.as_mut(), field::GID, v);
    }

    /// Sets entry `i`.
    pub fn set_qp(&mut self, i: usize, (qpn, psn): (u32, u32)) {
        let at = INFO_HEADER_LEN + i * INFO_ENTRY_LEN;
        put(self.buffer.as_mut(), at, &qpn.to_le_bytes());
        put(self.buffer.as_mut(), at + 4, &psn.to_le_bytes());
    }
}

/// Parsed form of a connection descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfoRepr {
    /// World size.
    pub world: u32,
    /// Queue pairs per peer.
    pub qps: u32,
    /// The port's GID.
    pub gid: [u8; 16],
    /// The port's LID.
    pub lid: u32,
    /// The port's active path MTU code.
    pub mtu: u32,
    /// Whether the port is RoCE (a global route is needed).
    pub global: bool,
    /// `(qpn, psn)` of every queue pair to every rank (`world * qps`, zeros for itself).
    pub qp: Vec<(u32, u32)>,
}

impl ConnInfoRepr {
    /// Parses a descriptor: the magic, and a length of exactly the fixed part and the entries
    /// it announces (so nothing is allocated for entries that are not there).
    pub fn parse<T: AsRef<[u8]>>(v: &ConnInfo<T>) -> Result<Self, WireError> {
        let got = v.buffer.as_ref().len();
        if got < INFO_HEADER_LEN {
            return Err(WireError::Truncated {
                format: FORMAT,
                got,
                need: INFO_HEADER_LEN,
            });
        }
        if v.magic() != INFO_MAGIC {
            return Err(WireError::BadMagic {
                format: FORMAT,
                found: u64::from(v.magic()),
            });
        }
        let expected = v.total_len()?;
        if got != expected {
            return Err(WireError::Length {
                format: FORMAT,
                got,
                expected,
            });
        }
        Ok(Self::read(v, (expected - INFO_HEADER_LEN) / INFO_ENTRY_LEN))
    }

    /// The fixed part of `v` and its first `n` entries, whose bounds the caller checked.
    fn read<T: AsRef<[u8]>>(v: &ConnInfo<T>, n: usize) -> Self {
        ConnInfoRepr {
            world: v.world(),
            qps: v.qps(),
            gid: v.gid(),
            lid: v.lid(),
            mtu: v.mtu(),
            global: v.global() != 0,
            qp: (0..n).map(|i| v.qp(i)).collect(),
        }
    }

    /// Length of the emitted descriptor.
    pub fn buffer_len(&self) -> usize {
        INFO_HEADER_LEN + self.qp.len() * INFO_ENTRY_LEN
    }

    /// Writes the descriptor into the first [`buffer_len`](Self::buffer_len) bytes. It parses
    /// back only when `qp` holds `world * qps` entries.
    ///
    /// # Panics
    ///
    /// If the buffer is shorter.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, v: &mut ConnInfo<T>) {
        v.set_magic(INFO_MAGIC);
        v.set_world(self.world);
        v.set_qps(self.qps);
        v.set_gid(&self.gid);
        v.set_lid(self.lid);
        v.set_mtu(self.mtu);
        v.set_global(u32::from(self.global));
        for (i, &e) in self.qp.iter().enumerate() {
            v.set_qp(i, e);
        }
    }

    /// The emitted descriptor (for the rendezvous store).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.buffer_len()];
        self.emit(&mut ConnInfo::new_unchecked(&mut b[..]));
        b
    }

    /// Parses [`to_bytes`](Self::to_bytes); `None` if the bytes are not a descriptor.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        Self::parse(&ConnInfo::new_unchecked(b)).ok()
    }

    /// The column of this descriptor for rank `dst`: the fixed part (magic
    /// [`COLUMN_MAGIC`]) and the `qps` entries of the queue pairs to `dst`. `None` when `dst`
    /// has no entries here.
    pub fn column(&self, dst: usize) -> Option<Vec<u8>> {
        let q = self.qps as usize;
        let entries = self
            .qp
            .get(dst.checked_mul(q)?..dst.checked_mul(q)?.checked_add(q)?)?;
        let part = ConnInfoRepr {
            qp: entries.to_vec(),
            ..self.clone()
        };
        Some(part.to_column())
    }

    /// This descriptor as a column (magic [`COLUMN_MAGIC`]), its `qp` entries as they are:
    /// what a pair that connects on first use sends, `qp` holding the `qps` entries to the
    /// other rank of the pair.
    pub fn to_column(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.buffer_len()];
        let mut v = ConnInfo::new_unchecked(&mut b[..]);
        self.emit(&mut v);
        v.set_magic(COLUMN_MAGIC);
        b
    }

    /// Parses a [`column`](Self::column): `qp` then holds the `qps` entries to the rank it was
    /// made for. `None` if the bytes are not a column (wrong magic or length).
    pub fn from_column(b: &[u8]) -> Option<Self> {
        let v = ConnInfo::new_unchecked(b);
        if b.len() < INFO_HEADER_LEN || v.magic() != COLUMN_MAGIC {
            return None;
        }
        let q = v.qps() as usize;
        if b.len() != INFO_HEADER_LEN.checked_add(q.checked_mul(INFO_ENTRY_LEN)?)? {
            return None;
        }
        Some(Self::read(&v, q))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn repr() -> ConnInfoRepr {
        ConnInfoRepr {
            world: 2,
            qps: 1,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            lid: 5,
            mtu: 3,
            global: true,
            qp: vec![(0, 0), (0x11, 0xab_cdef)],
        }
    }

    static BYTES: [u8; 56] = [
        0x42, 0x49, 0x53, 0x47, // magic
        0x02, 0x00, 0x00, 0x00, // world 2
        0x01, 0x00, 0x00, 0x00, // 1 queue pair per peer
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, // GID fe80::1
        0x05, 0x00, 0x00, 0x00, // LID 5
        0x03, 0x00, 0x00, 0x00, // MTU code 3 (1024 bytes)
        0x01, 0x00, 0x00, 0x00, // RoCE
        0, 0, 0, 0, 0, 0, 0, 0, // rank 0 (itself)
        0x11, 0x00, 0x00, 0x00, 0xef, 0xcd, 0xab, 0x00, // rank 1: qpn 0x11, psn 0xabcdef
    ];

    #[test]
    fn a_column_holds_the_entries_for_one_rank() {
        let r = ConnInfoRepr {
            world: 3,
            qps: 2,
            qp: vec![(0, 0), (0, 0), (0x21, 1), (0x22, 2), (0x31, 3), (0x32, 4)],
            ..repr()
        };
        let c = r.column(2).unwrap();
        assert_eq!(c.len(), INFO_HEADER_LEN + 2 * INFO_ENTRY_LEN);
        assert_eq!(&c[..4], b"CISG");
        let back = ConnInfoRepr::from_column(&c).unwrap();
        assert_eq!(back.qp, vec![(0x31, 3), (0x32, 4)]);
        assert_eq!(
            (back.world, back.qps, back.gid, back.lid),
            (3, 2, r.gid, r.lid)
        );
        assert!(r.column(3).is_none(), "no rank 3 in a world of 3");
        // A column is not a descriptor, a descriptor not a column, and lengths are exact.
        assert!(ConnInfoRepr::from_bytes(&c).is_none());
        assert!(ConnInfoRepr::from_column(&r.to_bytes()).is_none());
        assert!(ConnInfoRepr::from_column(&c[..c.len() - 1]).is_none());
        assert!(ConnInfoRepr::from_column(&[c.clone(), vec![0; 8]].concat()).is_none());
    }

    #[test]
    fn conn_info_literal() {
        assert_eq!(repr().to_bytes(), BYTES);
        let v = ConnInfo::new_checked(&BYTES[..]).unwrap();
        assert_eq!((v.world(), v.qps(), v.lid(), v.mtu()), (2, 1, 5, 3));
        assert_eq!(v.qp(1), (0x11, 0xab_cdef));
        assert_eq!(ConnInfoRepr::parse(&v), Ok(repr()));
    }

    #[test]
    fn conn_info_rejects() {
        let parse = |b: &[u8]| ConnInfoRepr::parse(&ConnInfo::new_unchecked(b));
        assert!(matches!(
            parse(&BYTES[..55]),
            Err(WireError::Length {
                got: 55,
                expected: 56,
                ..
            })
        ));
        assert!(matches!(
            parse(&BYTES[..39]),
            Err(WireError::Truncated { .. })
        ));
        let mut b = BYTES;
        b[0] ^= 1;
        assert!(matches!(parse(&b), Err(WireError::BadMagic { .. })));
        let mut b = BYTES;
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse(&b).is_err());
        assert!(ConnInfo::new_checked(&b[..]).is_err());
        // Any non-zero global word is RoCE.
        let mut b = BYTES;
        b[36] = 7;
        assert!(parse(&b).unwrap().global);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn fuzz_conn_info_parse(
            mut b in proptest::collection::vec(any::<u8>(), 0..80),
            world in 0u32..4,
            qps in 0u32..3,
        ) {
            // Half the inputs get the magic and a small table, so that parsing goes deep.
            if b.len() >= INFO_HEADER_LEN && world % 2 == 0 {
                b[..4].copy_from_slice(&INFO_MAGIC.to_le_bytes());
                b[4..8].copy_from_slice(&world.to_le_bytes());
                b[8..12].copy_from_slice(&qps.to_le_bytes());
            }
            if let Ok(r) = ConnInfoRepr::parse(&ConnInfo::new_unchecked(&b[..])) {
                prop_assert_eq!(r.qp.len() as u64, u64::from(r.world) * u64::from(r.qps));
                let out = r.to_bytes();
                prop_assert_eq!(&out[..36], &b[..36]);
                prop_assert_eq!(&out[40..], &b[40..]);
            }
        }

        #[test]
        fn fuzz_conn_info_round_trip(
            world in 0u32..5, qps in 0u32..4, gid: [u8; 16], lid: u32, mtu: u32, global: bool,
            seed: u32,
        ) {
            let n = (world * qps) as usize;
            let qp = (0..n as u32).map(|i| (seed ^ i, seed.wrapping_mul(i))).collect();
            let r = ConnInfoRepr { world, qps, gid, lid, mtu, global, qp };
            prop_assert_eq!(ConnInfoRepr::from_bytes(&r.to_bytes()), Some(r));
        }
    }
}
