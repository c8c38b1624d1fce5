//! The network interfaces of this host and the listener a rank accepts its peers on.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};

/// Returns the first IPv4 (else IPv6) address of the network interface `name`.
///
/// An interface that does not exist, or has no address, is an error listing the interfaces
/// that do exist.
pub fn interface_addr(name: &str) -> io::Result<IpAddr> {
    let all = interfaces()?;
    let mut found = all
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, a)| *a)
        .collect::<Vec<_>>();
    found.sort_by_key(|a| a.is_ipv6());
    found.first().copied().ok_or_else(|| {
        let mut names: Vec<_> = all.iter().map(|(n, _)| n.as_str()).collect();
        names.dedup();
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "network interface {name:?} not found or has no IP address (interfaces: {})",
                names.join(", ")
            ),
        )
    })
}

/// Lists (interface name, address) pairs of this host.
pub fn interfaces() -> io::Result<Vec<(String, IpAddr)>> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into ifap; it is freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: p is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose family says its type.
        let fam = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        if fam == libc::AF_INET {
            // SAFETY: the family is AF_INET, so the sockaddr is a sockaddr_in.
            let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            out.push((
                name,
                IpAddr::from(u32::from_be(sa.sin_addr.s_addr).to_be_bytes()),
            ));
        } else if fam == libc::AF_INET6 {
            // SAFETY: the family is AF_INET6, so the sockaddr is a sockaddr_in6.
            let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
            out.push((name, IpAddr::from(sa.sin6_addr.s6_addr)));
        }
    }
    // SAFETY: ifap came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    Ok(out)
}

/// Binds a listener for incoming peer connections on `ip` (port chosen by the kernel).
pub fn listen(ip: IpAddr) -> io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, 0))
}
