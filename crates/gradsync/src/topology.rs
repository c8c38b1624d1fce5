//! Which ranks share a host, and facts about this host's network interface and NUMA layout.
//!
//! Host identity is exchanged at rendezvous, never guessed from addresses: two ranks are on the
//! same host when their [`host_identity`] strings are equal. The string joins the hostname, the
//! kernel's boot id and the network namespace, so ranks in different network namespaces of one
//! machine (the emulated hosts of the test harness, or containers) count as different hosts,
//! exactly as they would have to talk over the network to each other. `GRADSYNC_HOST_ID`
//! overrides it.

use std::fs;
use std::io;
use std::net::IpAddr;

/// This process's host identity: `hostname/boot-id/net-namespace`.
pub fn host_identity() -> String {
    let read = |p: &str| {
        fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let host = read("/proc/sys/kernel/hostname");
    let boot = read("/proc/sys/kernel/random/boot_id");
    let netns = fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{host}/{boot}/{netns}")
}

/// The machine of a host identity that [`host_identity`] made: its hostname and boot id, which
/// the ranks in the network namespaces of one machine share, and with them its CPUs. `None`
/// for an identity of another form (one given in `GRADSYNC_HOST_ID`).
pub fn machine_of(identity: &str) -> Option<&str> {
    let mut parts = identity.splitn(3, '/');
    let (host, boot, netns) = (parts.next()?, parts.next()?, parts.next()?);
    let uuid = boot.len() == 36
        && boot.bytes().enumerate().all(|(i, b)| {
            matches!(i, 8 | 13 | 18 | 23) == (b == b'-') && (b == b'-' || b.is_ascii_hexdigit())
        });
    (uuid && netns.starts_with("net:")).then(|| &identity[..host.len() + 1 + boot.len()])
}

/// How many of the ranks of `ids` (host identities) run on the machine of rank `rank`, in
/// whatever network namespace: the ranks that share its CPUs. Where the identities are not
/// [`host_identity`]'s, the ranks of its host.
pub fn machine_ranks(ids: &[String], rank: usize) -> usize {
    match machine_of(&ids[rank]) {
        Some(m) => ids.iter().filter(|id| machine_of(id) == Some(m)).count(),
        None => ids.iter().filter(|id| **id == ids[rank]).count(),
    }
}

/// The short name of a host identity (its hostname part) for messages.
pub fn host_label(identity: &str) -> &str {
    identity.split('/').next().unwrap_or(identity)
}

/// Which host every rank is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Host index of every rank; hosts are numbered in the order of their lowest rank.
    pub host_of: Vec<usize>,
}

impl Topology {
    /// Groups ranks by identical identity strings (`ids[r]` is rank r's).
    pub fn from_identities(ids: &[String]) -> Self {
        let mut seen: Vec<&str> = Vec::new();
        let host_of = ids
            .iter()
            .map(|id| match seen.iter().position(|s| *s == id.as_str()) {
                Some(h) => h,
                None => {
                    seen.push(id);
                    seen.len() - 1
                }
            })
            .collect();
        Topology { host_of }
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.host_of.iter().max().map_or(0, |h| h + 1)
    }

    /// The ranks on `rank`'s host, ascending (including `rank`).
    pub fn local_ranks(&self, rank: usize) -> Vec<usize> {
        let h = self.host_of[rank];
        (0..self.host_of.len())
            .filter(|&r| self.host_of[r] == h)
            .collect()
    }

    /// Ranks per host when every host holds the same number of ranks in one contiguous block
    /// (host h = ranks `h * L .. (h + 1) * L`, as torchrun numbers them); 0 otherwise, and then
    /// hierarchical schedules are not used.
    pub fn uniform_local_size(&self) -> usize {
        let n = self.host_of.len();
        let hosts = self.hosts();
        if hosts == 0 || !n.is_multiple_of(hosts) {
            return 0;
        }
        let l = n / hosts;
        if (0..n).all(|r| self.host_of[r] == r / l) {
            l
        } else {
            0
        }
    }
}

/// MTU of a network interface, from sysfs.
pub fn interface_mtu(ifname: &str) -> Option<u32> {
    fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// NUMA nodes of this machine (1 when sysfs does not say).
pub fn numa_nodes() -> usize {
    Sysfs::HOST.numa_nodes()
}

/// Where the NUMA facts are read: `/sys` on a real machine, a directory of the same layout in
/// tests (a fake two-node machine).
#[derive(Clone, Copy, Debug)]
pub struct Sysfs<'a> {
    root: &'a str,
}

impl<'a> Sysfs<'a> {
    /// This machine's `/sys`.
    pub const HOST: Sysfs<'static> = Sysfs { root: "/sys" };

    /// A directory laid out as `/sys` (`devices/system/node/nodeN/cpulist`,
    /// `devices/system/cpu/online`, `class/net/IF/device/numa_node`).
    pub fn at(root: &'a str) -> Sysfs<'a> {
        Sysfs { root }
    }

    fn read(&self, path: &str) -> Option<String> {
        fs::read_to_string(format!("{}/{path}", self.root)).ok()
    }

    /// NUMA nodes (1 when sysfs does not say).
    pub fn numa_nodes(&self) -> usize {
        fs::read_dir(format!("{}/devices/system/node", self.root))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| {
                        let n = e.file_name();
                        let n = n.to_string_lossy();
                        n.strip_prefix("node")
                            .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
                    })
                    .count()
                    .max(1)
            })
            .unwrap_or(1)
    }

    /// The NUMA node of an interface's device; `None` for virtual interfaces and `-1`.
    pub fn interface_numa_node(&self, ifname: &str) -> Option<usize> {
        let v: i64 = self
            .read(&format!("class/net/{ifname}/device/numa_node"))?
            .trim()
            .parse()
            .ok()?;
        usize::try_from(v).ok()
    }

    /// CPUs of a NUMA node.
    pub fn node_cpus(&self, node: usize) -> Option<Vec<usize>> {
        parse_cpu_list(&self.read(&format!("devices/system/node/node{node}/cpulist"))?)
    }

    /// The CPUs that are online.
    pub fn online_cpus(&self) -> Option<Vec<usize>> {
        parse_cpu_list(&self.read("devices/system/cpu/online")?)
    }
}

/// The NUMA node a network interface's device is attached to; `None` for virtual interfaces
/// (loopback, veth, bridges) and when the platform does not say (`-1`).
pub fn interface_numa_node(ifname: &str) -> Option<usize> {
    Sysfs::HOST.interface_numa_node(ifname)
}

/// Parses a kernel CPU list (`0-3,8,10-11`).
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 1 << 16 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

/// The CPUs the calling thread may run on (its affinity mask), in order; empty if unknown.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by sched_getaffinity; CPU_ISSET
    // reads inside it for CPU numbers below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Busy and total clock ticks of the CPUs in `cpus` since boot (all of them when `cpus` is
/// empty), from `/proc/stat`; `None` where it cannot be read. Busy counts user, nice, system,
/// interrupt and steal time (a hypervisor's other guests); total adds idle and I/O wait.
pub fn cpu_ticks(cpus: &[usize]) -> Option<(u64, u64)> {
    parse_cpu_ticks(&std::fs::read_to_string("/proc/stat").ok()?, cpus)
}

/// [`cpu_ticks`] of the text of a `/proc/stat`.
pub fn parse_cpu_ticks(stat: &str, cpus: &[usize]) -> Option<(u64, u64)> {
    let (mut busy, mut total, mut seen) = (0u64, 0u64, false);
    for line in stat.lines() {
        let mut f = line.split_ascii_whitespace();
        let Some(n) = f.next().and_then(|name| name.strip_prefix("cpu")) else {
            continue;
        };
        let Ok(cpu) = n.parse::<usize>() else {
            continue;
        };
        if !cpus.is_empty() && !cpus.contains(&cpu) {
            continue;
        }
        let v: Vec<u64> = f.take(8).map_while(|x| x.parse().ok()).collect();
        let [user, nice, system, idle, iowait, irq, softirq, steal] = v[..] else {
            return None;
        };
        let b = user + nice + system + irq + softirq + steal;
        busy += b;
        total += b + idle + iowait;
        seen = true;
    }
    seen.then_some((busy, total))
}

/// Clock ticks per second of [`cpu_ticks`].
pub fn ticks_per_second() -> f64 {
    // SAFETY: sysconf reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// CPU seconds the calling thread has used (user and system).
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The part of the CPUs in `cpus` that was busy over `over` (a sample of `/proc/stat` before
/// and after a sleep); `None` where it cannot be read.
pub fn busy_share(cpus: &[usize], over: std::time::Duration) -> Option<f64> {
    let (b0, t0) = cpu_ticks(cpus)?;
    std::thread::sleep(over);
    let (b1, t1) = cpu_ticks(cpus)?;
    (t1 > t0).then(|| (b1.saturating_sub(b0)) as f64 / (t1 - t0) as f64)
}

/// A CPU set of `cpus` (numbers from `CPU_SETSIZE` up are left out), for `sched_setaffinity`.
pub fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET only writes inside it for CPU
    // numbers below CPU_SETSIZE, which the filter guarantees.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        set
    }
}

/// CPUs of a NUMA node.
pub fn node_cpus(node: usize) -> Option<Vec<usize>> {
    Sysfs::HOST.node_cpus(node)
}

/// Sets the calling thread's affinity to `cpus`.
pub fn bind_thread(cpus: &[usize]) -> std::io::Result<()> {
    let set = cpu_set(cpus);
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether init binds the calling thread to the network interface's NUMA node
/// (`GRADSYNC_NUMA_BIND`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NumaBind {
    /// Unset: bind only a thread that may run on every online CPU (nobody bound it yet).
    #[default]
    WhenUnbound,
    /// `1`: bind, to the node's CPUs among those the thread may already use (never more).
    On,
    /// `0`: never bind.
    Off,
}

/// What [`numa_placement`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// One NUMA node: nothing to bind.
    SingleNode,
    /// Several nodes but the interface's node is unknown (virtual interface).
    Unknown {
        /// Number of nodes.
        nodes: usize,
    },
    /// Bound to the interface's node.
    Bound {
        /// Number of nodes.
        nodes: usize,
        /// The node.
        node: usize,
        /// The CPUs the thread may now use: the node's, within what it had.
        cpus: Vec<usize>,
    },
    /// Several nodes, binding turned off (`GRADSYNC_NUMA_BIND=0`).
    Disabled {
        /// The interface's node.
        node: usize,
    },
    /// The thread's affinity was already narrowed (by a launcher, `taskset`, the application)
    /// and `GRADSYNC_NUMA_BIND` is unset: left as it was.
    Kept {
        /// The interface's node.
        node: usize,
        /// The CPUs the thread may use, unchanged.
        cpus: Vec<usize>,
    },
    /// Binding was refused, or would have widened the thread's affinity.
    Failed {
        /// The node.
        node: usize,
        /// Why.
        why: String,
    },
}

fn cpu_list(cpus: &[usize]) -> String {
    cpus.iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::SingleNode => write!(f, "1 NUMA node, no binding needed"),
            Placement::Unknown { nodes } => write!(
                f,
                "{nodes} NUMA nodes, interface node unknown (virtual interface): not bound"
            ),
            Placement::Bound { nodes, node, cpus } => write!(
                f,
                "{nodes} NUMA nodes, bound to the interface's node {node} (cpus {})",
                cpu_list(cpus)
            ),
            Placement::Disabled { node } => write!(
                f,
                "interface on NUMA node {node}, not bound (GRADSYNC_NUMA_BIND=0)"
            ),
            Placement::Kept { node, cpus } => write!(
                f,
                "interface on NUMA node {node}; the thread was already bound (cpus {}), left as it is (GRADSYNC_NUMA_BIND=1 narrows it to the node)",
                cpu_list(cpus)
            ),
            Placement::Failed { node, why } => {
                write!(f, "binding to the interface's node {node} failed: {why}")
            }
        }
    }
}

/// Binds the calling thread to the interface's NUMA node when the machine has more than one
/// and `mode` allows it, and says what it did. It never widens or replaces an affinity the
/// thread already has: it binds to the node's CPUs among those the thread may use, and with
/// [`NumaBind::WhenUnbound`] only a thread that may use every online CPU.
pub fn numa_placement(ifname: &str, mode: NumaBind) -> Placement {
    placement_in(Sysfs::HOST, ifname, mode, &allowed_cpus(), bind_thread)
}

/// [`numa_placement`] on the facts of `sys`, for a thread whose affinity is `allowed`,
/// binding with `bind`.
pub fn placement_in(
    sys: Sysfs<'_>,
    ifname: &str,
    mode: NumaBind,
    allowed: &[usize],
    bind: impl FnOnce(&[usize]) -> std::io::Result<()>,
) -> Placement {
    let nodes = sys.numa_nodes();
    if nodes <= 1 {
        return Placement::SingleNode;
    }
    let Some(node) = sys.interface_numa_node(ifname) else {
        return Placement::Unknown { nodes };
    };
    let failed = |why: String| Placement::Failed { node, why };
    match mode {
        NumaBind::Off => return Placement::Disabled { node },
        NumaBind::WhenUnbound => {
            let online = sys.online_cpus().unwrap_or_default();
            let unbound = !online.is_empty() && online.iter().all(|c| allowed.contains(c));
            if !unbound {
                return Placement::Kept {
                    node,
                    cpus: allowed.to_vec(),
                };
            }
        }
        NumaBind::On => {}
    }
    let Some(node_cpus) = sys.node_cpus(node) else {
        return failed(format!("no CPU list for NUMA node {node}"));
    };
    let cpus: Vec<usize> = node_cpus
        .iter()
        .copied()
        .filter(|c| allowed.contains(c))
        .collect();
    if cpus.is_empty() {
        return failed(format!(
            "none of its cpus ({}) is among the thread's (cpus {}), which are kept",
            cpu_list(&node_cpus),
            cpu_list(allowed)
        ));
    }
    if cpus == allowed {
        return Placement::Bound { nodes, node, cpus };
    }
    match bind(&cpus) {
        Ok(()) => Placement::Bound { nodes, node, cpus },
        Err(e) => failed(e.to_string()),
    }
}

// ---- network interfaces ------------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_of_chosen_cpus() {
        let stat = "cpu  30 0 10 100 5 0 0 0 0 0\n\
                    cpu0 10 0 5 50 5 0 0 0 0 0\n\
                    cpu1 20 0 5 50 0 0 0 3 0 0\n\
                    intr 12345\nctxt 99\n";
        assert_eq!(parse_cpu_ticks(stat, &[]), Some((43, 148)));
        assert_eq!(parse_cpu_ticks(stat, &[0]), Some((15, 70)));
        assert_eq!(parse_cpu_ticks(stat, &[1]), Some((28, 78)));
        assert_eq!(parse_cpu_ticks(stat, &[7]), None);
        assert_eq!(parse_cpu_ticks("cpu0 1 2\n", &[]), None, "a short line");
        // This machine's own.
        let (busy, total) = cpu_ticks(&allowed_cpus()).expect("/proc/stat");
        assert!(busy <= total && total > 0);
        let share = busy_share(&[], std::time::Duration::from_millis(30)).unwrap();
        assert!((0.0..=1.0).contains(&share), "{share}");
        let t0 = thread_cpu_seconds();
        let mut x = 0u64;
        while thread_cpu_seconds() - t0 < 0.01 {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(x > 0);
    }

    #[test]
    fn grouping() {
        let ids: Vec<String> = ["a", "a", "b", "b"].iter().map(|s| s.to_string()).collect();
        let t = Topology::from_identities(&ids);
        assert_eq!(t.host_of, vec![0, 0, 1, 1]);
        assert_eq!(t.hosts(), 2);
        assert_eq!(t.local_ranks(3), vec![2, 3]);
        assert_eq!(t.uniform_local_size(), 2);
        let ids: Vec<String> = ["a", "b", "a", "b"].iter().map(|s| s.to_string()).collect();
        let t = Topology::from_identities(&ids);
        assert_eq!(t.local_ranks(0), vec![0, 2]);
        assert_eq!(
            t.uniform_local_size(),
            0,
            "interleaved hosts are not contiguous"
        );
        let ids: Vec<String> = ["a", "a", "b"].iter().map(|s| s.to_string()).collect();
        assert_eq!(Topology::from_identities(&ids).uniform_local_size(), 0);
        let one = Topology::from_identities(&["x".to_string()]);
        assert_eq!((one.hosts(), one.uniform_local_size()), (1, 1));
    }

    #[test]
    fn identity_has_namespace() {
        let id = host_identity();
        assert!(id.contains("net:["), "{id}");
        assert_eq!(host_identity(), id);
    }

    #[test]
    fn ranks_in_other_namespaces_of_a_machine_share_it() {
        let own = host_identity();
        assert_eq!(
            machine_of(&own),
            own.rsplit_once('/').map(|(m, _)| m),
            "{own}"
        );
        let boot = "0c6f3b8e-2b1d-4f4e-9a57-1d2e3f4a5b6c";
        let id = |host: &str, boot: &str, ns: u32| format!("{host}/{boot}/net:[{ns}]");
        // Two emulated hosts of machine a (two namespaces each), and machine b.
        let ids = vec![
            id("a", boot, 1),
            id("a", boot, 2),
            id("a", boot, 1),
            id("b", boot, 1),
            id("a", boot, 3),
        ];
        assert_eq!(machine_of(&ids[0]), Some(&*format!("a/{boot}")));
        assert_eq!(Topology::from_identities(&ids).local_ranks(0), vec![0, 2]);
        assert_eq!(machine_ranks(&ids, 0), 4);
        assert_eq!(machine_ranks(&ids, 1), 4);
        assert_eq!(machine_ranks(&ids, 3), 1);
        // GRADSYNC_HOST_ID's identities are hosts of their own, whatever they hold.
        for given in [
            "node7",
            "a/b/c",
            "a/not-a-boot-id-of-36-characters-xx/net:[1]",
        ] {
            assert_eq!(machine_of(given), None, "{given}");
        }
        let given = vec![
            "a/b/c".to_string(),
            "a/b/d".to_string(),
            "a/b/c".to_string(),
        ];
        assert_eq!(machine_ranks(&given, 0), 2);
        assert_eq!(machine_ranks(&given, 1), 1);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert!(numa_nodes() >= 1);
        assert_eq!(interface_numa_node("lo"), None);
        assert!(interface_mtu("lo").is_some());
    }

    /// A fake machine: two NUMA nodes (cpus 0-1 and 2-3), `eth0` on node 1.
    fn two_nodes() -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("gradsync-sysfs-{}", std::process::id()));
        for (path, text) in [
            ("devices/system/node/node0/cpulist", "0-1\n"),
            ("devices/system/node/node1/cpulist", "2-3\n"),
            ("devices/system/cpu/online", "0-3\n"),
            ("class/net/eth0/device/numa_node", "1\n"),
            ("class/net/veth0/device/numa_node", "-1\n"),
        ] {
            let p = root.join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
        root
    }

    #[test]
    fn numa_binding_never_widens_or_replaces_an_affinity() {
        let root = two_nodes();
        let sys = Sysfs::at(root.to_str().unwrap());
        assert_eq!(sys.numa_nodes(), 2);
        let place = |mode, allowed: &[usize]| {
            let mut bound = None;
            let p = placement_in(sys, "eth0", mode, allowed, |c| {
                bound = Some(c.to_vec());
                Ok(())
            });
            (p, bound)
        };
        // Nobody bound the thread: by default it goes to the interface's node.
        let (p, bound) = place(NumaBind::WhenUnbound, &[0, 1, 2, 3]);
        assert_eq!(bound, Some(vec![2, 3]));
        assert_eq!(
            p,
            Placement::Bound {
                nodes: 2,
                node: 1,
                cpus: vec![2, 3]
            }
        );
        // A launcher's `--bind spread` or the user's taskset: left alone by default...
        let (p, bound) = place(NumaBind::WhenUnbound, &[0]);
        assert_eq!(bound, None);
        assert_eq!(
            p,
            Placement::Kept {
                node: 1,
                cpus: vec![0]
            }
        );
        assert!(p.to_string().contains("left as it is"), "{p}");
        // ... narrowed to the node when asked, never widened ...
        let (p, bound) = place(NumaBind::On, &[1, 2]);
        assert_eq!(bound, Some(vec![2]));
        assert!(matches!(p, Placement::Bound { ref cpus, .. } if cpus == &[2]));
        // ... and kept when the node has none of its CPUs.
        let (p, bound) = place(NumaBind::On, &[0, 1]);
        assert_eq!(bound, None);
        assert!(
            matches!(p, Placement::Failed { node: 1, ref why } if why.contains("kept")),
            "{p}"
        );
        // Turned off, or a virtual interface: nothing happens.
        assert_eq!(
            place(NumaBind::Off, &[0, 1, 2, 3]),
            (Placement::Disabled { node: 1 }, None)
        );
        let (p, bound) = place(NumaBind::On, &[0, 1, 2, 3]);
        assert_eq!(bound, Some(vec![2, 3]));
        assert!(matches!(p, Placement::Bound { .. }));
        let p = placement_in(sys, "veth0", NumaBind::On, &[0, 1, 2, 3], |_| {
            panic!("bound")
        });
        assert_eq!(p, Placement::Unknown { nodes: 2 });
        let _ = fs::remove_dir_all(root);
    }

    #[test]
    fn unknown_interface_is_an_error() {
        let e = interface_addr("no-such-if0").unwrap_err();
        assert!(e.to_string().contains("no-such-if0"), "{e}");
        assert!(interface_addr("lo").unwrap().is_loopback());
    }
}
