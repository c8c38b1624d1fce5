//! The compact tables of init: what every rank must know of every other rank, packed by the
//! first rank so that the others fetch one value of a few bytes per rank instead of every
//! record under its own key.
//!
//! - [`pack_peers`]: each rank's listening address and host identity. Host identities (about 60
//!   bytes each) and IP addresses are listed once, and each rank is a host index, an address
//!   index and a port: 10 bytes.
//! - [`pack_hosts`]: each rank's host identity alone, for init through the store, where a
//!   rank fetches the listening addresses of the peers it dials when it first dials them
//!   (`addresses`): identities once, then runs of consecutive ranks of one host.
//! - The inbox table (in `bootstrap`): the slot settings once, then each rank's inbox
//!   descriptor.
//!
//! A table starts with one byte: 0 for a table, 1 for an error that the packing rank found in
//! some record (a malformed address, settings that differ), which every rank then reports, so
//! that no rank waits for a table that will not come.

use crate::error::Error;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

const TABLE: u8 = 0;
const FAILED: u8 = 1;

/// A table that reports `msg` on every rank.
pub(super) fn failed(msg: &str) -> Vec<u8> {
    let mut t = vec![FAILED];
    t.extend_from_slice(msg.as_bytes());
    t
}

/// The body of table `t` (named `what` in errors), or the error it carries, as `rank` reports
/// it.
pub(super) fn body<'a>(t: &'a [u8], what: &str, rank: usize) -> Result<&'a [u8], Error> {
    match t.split_first() {
        Some((&TABLE, rest)) => Ok(rest),
        Some((&FAILED, msg)) => Err(Error::Config(format!(
            "rank {rank}: {}",
            String::from_utf8_lossy(msg)
        ))),
        _ => Err(Error::Config(format!(
            "rank {rank}: the {what} table of init is malformed"
        ))),
    }
}

/// This rank's record for [`pack_peers`]: its address, a newline, its host identity.
pub(super) fn peer_record(addr: SocketAddr, host_id: &str) -> Vec<u8> {
    format!("{addr}\n{host_id}").into_bytes()
}

/// Packs the [`peer_record`]s of ranks `0..n` (in rank order) into the peers table.
pub(super) fn pack_peers(records: &[Vec<u8>]) -> Vec<u8> {
    let mut hosts: Vec<&str> = Vec::new();
    let mut host_ix: HashMap<&str, u32> = HashMap::new();
    let mut ips: Vec<IpAddr> = Vec::new();
    let mut ip_ix: HashMap<IpAddr, u32> = HashMap::new();
    let mut rows = Vec::with_capacity(records.len() * 10);
    for (r, rec) in records.iter().enumerate() {
        let Ok(text) = std::str::from_utf8(rec) else {
            return failed(&format!(
                "rank {r} published a record that is not text ({} bytes)",
                rec.len()
            ));
        };
        let (addr, host) = text.split_once('\n').unwrap_or((text, ""));
        let Ok(addr) = addr.parse::<SocketAddr>() else {
            return failed(&format!("rank {r} published a malformed address {addr:?}"));
        };
        if host.is_empty() || host.len() > usize::from(u16::MAX) {
            return failed(&format!(
                "rank {r} published a malformed host identity {host:?}"
            ));
        }
        let h = *host_ix.entry(host).or_insert_with(|| {
            hosts.push(host);
            hosts.len() as u32 - 1
        });
        let i = *ip_ix.entry(addr.ip()).or_insert_with(|| {
            ips.push(addr.ip());
            ips.len() as u32 - 1
        });
        rows.extend_from_slice(&h.to_le_bytes());
        rows.extend_from_slice(&i.to_le_bytes());
        rows.extend_from_slice(&addr.port().to_le_bytes());
    }
    let mut t = vec![TABLE];
    t.extend_from_slice(&(hosts.len() as u32).to_le_bytes());
    for h in &hosts {
        t.extend_from_slice(&(h.len() as u16).to_le_bytes());
        t.extend_from_slice(h.as_bytes());
    }
    t.extend_from_slice(&(ips.len() as u32).to_le_bytes());
    for ip in &ips {
        match ip {
            IpAddr::V4(a) => {
                t.push(4);
                t.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                t.push(6);
                t.extend_from_slice(&a.octets());
            }
        }
    }
    t.extend_from_slice(&rows);
    t
}

/// Packs the host identities of ranks `0..n` (in rank order) into the hosts table: each
/// identity once, then runs of consecutive ranks on one host (host index and length, 8 bytes
/// a run), so a job whose hosts hold consecutive ranks costs a few bytes a host, not a rank.
pub(super) fn pack_hosts(records: &[Vec<u8>]) -> Vec<u8> {
    let mut hosts: Vec<&[u8]> = Vec::new();
    let mut host_ix: HashMap<&[u8], u32> = HashMap::new();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for (r, host) in records.iter().enumerate() {
        if host.is_empty()
            || host.len() > usize::from(u16::MAX)
            || std::str::from_utf8(host).is_err()
        {
            return failed(&format!(
                "rank {r} published a malformed host identity {:?}",
                String::from_utf8_lossy(host)
            ));
        }
        let h = *host_ix.entry(host.as_slice()).or_insert_with(|| {
            hosts.push(host);
            hosts.len() as u32 - 1
        });
        match runs.last_mut() {
            Some((last, n)) if *last == h => *n += 1,
            _ => runs.push((h, 1)),
        }
    }
    let mut t = vec![TABLE];
    t.extend_from_slice(&(hosts.len() as u32).to_le_bytes());
    for h in &hosts {
        t.extend_from_slice(&(h.len() as u16).to_le_bytes());
        t.extend_from_slice(h);
    }
    t.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    for (h, n) in runs {
        t.extend_from_slice(&h.to_le_bytes());
        t.extend_from_slice(&n.to_le_bytes());
    }
    t
}

/// The host identity of each of `world` ranks from the hosts table `t`.
pub(super) fn unpack_hosts(t: &[u8], rank: usize, world: usize) -> Result<Vec<String>, Error> {
    let malformed = || {
        Error::Config(format!(
            "rank {rank}: the hosts table of init is malformed ({} bytes for {world} ranks)",
            t.len()
        ))
    };
    let mut c = Cursor(body(t, "hosts", rank)?);
    let hosts = c.hosts(world).ok_or_else(malformed)?;
    let nruns = c.u32().ok_or_else(malformed)? as usize;
    let mut ids = Vec::with_capacity(world);
    for _ in 0..nruns {
        let h = c.u32().ok_or_else(malformed)? as usize;
        let n = c.u32().ok_or_else(malformed)? as usize;
        let host = hosts.get(h).ok_or_else(malformed)?;
        if n == 0 || ids.len() + n > world {
            return Err(malformed());
        }
        ids.extend(std::iter::repeat_n(host, n).cloned());
    }
    if ids.len() != world || !c.0.is_empty() {
        return Err(malformed());
    }
    Ok(ids)
}

/// A reader over a table body; every read fails (as `None`) past its end.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let (a, b) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = b;
        Some(a)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.bytes(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.bytes(4)?.try_into().ok()?))
    }

    /// A table's list of host identities: a count, then each as a length and its bytes (room
    /// reserved for at most one per rank of `world`, whatever the count says).
    fn hosts(&mut self, world: usize) -> Option<Vec<String>> {
        let n = self.u32()? as usize;
        let mut hosts = Vec::with_capacity(n.min(world));
        for _ in 0..n {
            let len = usize::from(self.u16()?);
            hosts.push(String::from_utf8(self.bytes(len)?.to_vec()).ok()?);
        }
        Some(hosts)
    }
}

/// The addresses and host identities of `world` ranks from the peers table `t`.
pub(super) fn unpack_peers(
    t: &[u8],
    rank: usize,
    world: usize,
) -> Result<(Vec<SocketAddr>, Vec<String>), Error> {
    let malformed = || {
        Error::Config(format!(
            "rank {rank}: the peers table of init is malformed ({} bytes for {world} ranks)",
            t.len()
        ))
    };
    let mut c = Cursor(body(t, "peers", rank)?);
    let hosts = c.hosts(world).ok_or_else(malformed)?;
    let nips = c.u32().ok_or_else(malformed)? as usize;
    let mut ips = Vec::with_capacity(nips.min(world));
    for _ in 0..nips {
        let ip = match c.bytes(1).ok_or_else(malformed)?[0] {
            4 => IpAddr::from(
                <[u8; 4]>::try_from(c.bytes(4).ok_or_else(malformed)?).map_err(|_| malformed())?,
            ),
            6 => IpAddr::from(
                <[u8; 16]>::try_from(c.bytes(16).ok_or_else(malformed)?)
                    .map_err(|_| malformed())?,
            ),
            _ => return Err(malformed()),
        };
        ips.push(ip);
    }
    let (mut addrs, mut ids) = (Vec::with_capacity(world), Vec::with_capacity(world));
    for _ in 0..world {
        let h = c.u32().ok_or_else(malformed)? as usize;
        let i = c.u32().ok_or_else(malformed)? as usize;
        let port = c.u16().ok_or_else(malformed)?;
        let (Some(host), Some(&ip)) = (hosts.get(h), ips.get(i)) else {
            return Err(malformed());
        };
        addrs.push(SocketAddr::new(ip, port));
        ids.push(host.clone());
    }
    if !c.0.is_empty() {
        return Err(malformed());
    }
    Ok((addrs, ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peers_table_lists_hosts_and_addresses_once_and_ten_bytes_per_rank() {
        let host =
            |h: usize| format!("node{h}/0f2b6c1e-aaaa-bbbb-cccc-1234567890ab/net:[4026531840]");
        let world = 64;
        let records: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                let ip: IpAddr = if r % 8 == 7 {
                    "::1".parse().unwrap()
                } else {
                    format!("10.0.0.{}", r / 8).parse().unwrap()
                };
                peer_record(SocketAddr::new(ip, 40000 + r as u16), &host(r / 8))
            })
            .collect();
        let t = pack_peers(&records);
        let (addrs, ids) = unpack_peers(&t, 0, world).unwrap();
        for r in 0..world {
            assert_eq!(peer_record(addrs[r], &ids[r]), records[r], "rank {r}");
        }
        let hosts_and_ips: usize = 8 * (2 + host(0).len()) + 8 * 5 + 17;
        assert_eq!(t.len(), 1 + 4 + 4 + hosts_and_ips + world * 10);
        // The table of one world does not read as another's.
        assert!(unpack_peers(&t, 0, world - 1).is_err());
        assert!(unpack_peers(&t, 0, world + 1).is_err());
        assert!(unpack_peers(&t[..t.len() - 1], 0, world).is_err());
    }

    #[test]
    fn the_hosts_table_costs_a_run_of_ranks_not_a_rank() {
        let host = |h: usize| format!("node{h}/0f2b6c1e-aaaa-bbbb-cccc-1234567890ab/net:[1]");
        // 64 ranks on 8 hosts of 8 consecutive ranks, then ranks 64 and 65 back on host 0.
        let mut records: Vec<Vec<u8>> = (0..64).map(|r| host(r / 8).into_bytes()).collect();
        records.extend([host(0).into_bytes(), host(0).into_bytes()]);
        let world = records.len();
        let t = pack_hosts(&records);
        let ids = unpack_hosts(&t, 3, world).unwrap();
        for r in 0..world {
            assert_eq!(ids[r].as_bytes(), records[r].as_slice(), "rank {r}");
        }
        assert_eq!(t.len(), 1 + 4 + 8 * (2 + host(0).len()) + 4 + 9 * 8);
        assert!(unpack_hosts(&t, 0, world - 1).is_err());
        assert!(unpack_hosts(&t, 0, world + 1).is_err());
        assert!(unpack_hosts(&t[..t.len() - 1], 0, world).is_err());
        let e = unpack_hosts(&pack_hosts(&[b"h".to_vec(), Vec::new()]), 0, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 0: rank 1 published a malformed host identity"),
            "{e}"
        );
    }

    #[test]
    fn a_bad_record_fails_every_rank_with_the_packers_words() {
        let good = peer_record("127.0.0.1:5".parse().unwrap(), "h/b/n");
        let t = pack_peers(&[good.clone(), b"not an address\nh/b/n".to_vec()]);
        let e = unpack_peers(&t, 1, 2).unwrap_err().to_string();
        assert!(
            e.contains("rank 1: rank 1 published a malformed address \"not an address\""),
            "{e}"
        );
        let t = pack_peers(&[good, b"127.0.0.1:6\n".to_vec()]);
        let e = unpack_peers(&t, 1, 2).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 published a malformed host identity"),
            "{e}"
        );
        assert!(unpack_peers(&[7, 0], 0, 1).is_err());
        assert!(unpack_peers(&[], 0, 1).is_err());
    }
}
