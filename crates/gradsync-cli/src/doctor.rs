//! `gradsync doctor`: measure the raw link of every rank pair and name the slow ones.
//!
//! Run under `gradsync launch` (or alone with `--nproc N`), every rank joins the job; then the
//! pairs are measured one at a time while the other ranks wait, so no two measurements share a
//! link: a ping-pong of 8-byte messages (one-way latency) and a stream of `--size` messages in
//! each direction (bandwidth), over the transport the pair uses for collectives (shared memory
//! on one host, TCP or RDMA across hosts). The links found slow are measured a second time and
//! the faster measurement counts: on a busy machine a link can lose much of its rate for the
//! few milliseconds of one measurement, while a slow link is slow every time. Rank 0 prints
//!
//! - one line per rank: host, address, interface, MTU, the peers it was connected to before
//!   the measurements (which connect every pair) and its registered receive memory (inbox),
//!   NUMA placement;
//! - the RDMA devices of its host (with the `rdma` feature): port state, MTU, link layer and
//!   GIDs, as `ibv_devinfo` shows them;
//! - the bandwidth and latency matrices;
//! - one line per link with its slower direction, flagged `SLOW` when that is below
//!   `--threshold` (default 80%) of its reference: the fastest link between hosts for a link
//!   between two hosts, the median link inside a host for one inside a host (ranks with the
//!   same address are one host);
//! - the verdict: every host all of whose links to other hosts are slow, with its address and
//!   ranks; the slow links between hosts that no such host explains, named as one link when
//!   they all join the same two hosts; the slow links inside each host (see [`verdict`]).

mod verdict;

use std::time::Instant;

use anyhow::{Context, ensure};
use gradsync::Communicator;
use gradsync::cost::median;
use gradsync::topology;
use verdict::{Finding, Link, Reference};

/// Options of `gradsync doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Bytes per bandwidth message (K/M/G suffixes).
    #[arg(long, default_value = "4M", value_parser = crate::table::parse_size)]
    pub size: u64,
    /// Timed messages per direction (after one warm-up message).
    #[arg(long, default_value_t = 4)]
    pub iters: usize,
    /// Round trips of the latency ping-pong.
    #[arg(long, default_value_t = 200)]
    pub lat_iters: usize,
    /// A link is slow below this fraction of its reference: the fastest link between hosts,
    /// or the median link inside a host.
    #[arg(long, default_value_t = 0.8)]
    pub threshold: f64,
    /// Start N local ranks (as `gradsync launch --nproc N` would) instead of joining a job.
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Also write the matrices as JSON to FILE (rank 0).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

const INFO_LEN: usize = 256;

/// Runs `gradsync doctor`; returns the exit code.
pub fn run(args: &DoctorArgs) -> anyhow::Result<i32> {
    ensure!(args.size >= 1, "--size must be at least 1 byte");
    ensure!(args.iters >= 1, "--iters must be at least 1");
    ensure!(args.lat_iters >= 1, "--lat-iters must be at least 1");
    ensure!(
        args.threshold > 0.0 && args.threshold < 1.0,
        "--threshold must be between 0 and 1"
    );
    ensure!(args.nproc != Some(0), "--nproc must be at least 1");
    if args.nproc.is_some() || !crate::bench::in_job() {
        return crate::bench::launch_self(args.nproc.unwrap_or(1));
    }
    gradsync::logging::init_from_env();
    let mut comm = Communicator::from_env().context("cannot join the job")?;
    gradsync::logging::set_rank(comm.rank());
    let report = measure(args, &mut comm)?;
    if comm.rank() == 0 {
        print!("{}", report.text);
        if let Some(path) = &args.json {
            std::fs::write(path, report.json)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(0)
}

/// What rank 0 prints and writes.
struct Report {
    text: String,
    json: String,
}

/// The RDMA ports of this host, as `ibv_devinfo` shows them: state, MTU, link layer, GIDs.
#[cfg(feature = "rdma")]
fn rdma_devices() -> String {
    let mut s = String::from("#\n# RDMA devices (this host):\n");
    match gradsync::rdma::list_ports() {
        Err(e) => s += &format!("#  none: {e}\n"),
        Ok(ports) if ports.is_empty() => s += "#  none\n",
        Ok(ports) => {
            for p in ports {
                s += &format!(
                    "#  {}:{}  {}  active_mtu {}  max_mtu {}  link_layer {}  lid {}  node_guid {:016x}  fw {}\n",
                    p.device,
                    p.port,
                    p.state,
                    p.active_mtu,
                    p.max_mtu,
                    p.link_layer,
                    p.lid,
                    p.node_guid,
                    if p.fw_ver.is_empty() { "-" } else { &p.fw_ver }
                );
                for g in &p.gids {
                    s += &format!("#      GID[{:>3}]  {}  {}\n", g.index, g.gid, g.kind);
                }
            }
        }
    }
    s
}

/// Without the `rdma` feature there is nothing to list.
#[cfg(not(feature = "rdma"))]
fn rdma_devices() -> String {
    "#\n# RDMA devices: not listed (gradsync built without the rdma feature)\n".into()
}

/// This rank's line: host, address, interface, MTU, connected peers, inbox, NUMA placement.
fn describe_self(comm: &Communicator) -> String {
    let ifname = comm.interface().to_string();
    let mtu = topology::interface_mtu(&ifname).map_or("?".to_string(), |m| m.to_string());
    let numa = comm.numa_placement();
    let addr = comm
        .peer_addr(comm.rank())
        .map_or("-".to_string(), |a| a.ip().to_string());
    format!(
        "host {} addr {addr} if {ifname} mtu {mtu} peers {} inbox {} MiB numa: {numa}",
        comm.host_name(comm.rank()),
        comm.connected_peers().len(),
        comm.receive_memory() >> 20,
    )
}

fn measure(args: &DoctorArgs, comm: &mut Communicator) -> anyhow::Result<Report> {
    let (rank, n) = (comm.rank(), comm.world_size());
    // Per-rank descriptions, gathered to everyone.
    let mut me = [0u8; INFO_LEN];
    let line = describe_self(comm);
    let k = line.len().min(INFO_LEN);
    me[..k].copy_from_slice(&line.as_bytes()[..k]);
    let mut all = vec![0u8; INFO_LEN * n];
    comm.all_gather(&me, &mut all)
        .context("all_gather of rank descriptions")?;
    let infos: Vec<String> = all
        .chunks(INFO_LEN)
        .map(|c| {
            let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
            String::from_utf8_lossy(&c[..end]).into_owned()
        })
        .collect();
    // Transport of every pair as rank r sees it (row r), as route codes.
    let mine: Vec<u8> = (0..n).map(|p| comm.peer_transport(p).code()).collect();
    let mut transports = vec![0u8; n * n];
    comm.all_gather(&mine, &mut transports)
        .context("all_gather of transports")?;

    // bw[i * n + j]: bytes/s from i to j, measured by the sender; lat[i * n + j]: one-way
    // seconds, measured by the lower rank of the pair.
    let mut bw = vec![0f64; n * n];
    let mut lat = vec![0f64; n * n];
    let mut big = vec![0u8; usize::try_from(args.size).context("--size too large")?];
    for i in 0..n {
        for j in i + 1..n {
            comm.barrier()
                .context("barrier between pair measurements")?;
            if rank != i && rank != j {
                continue;
            }
            let other = if rank == i { j } else { i };
            // Latency: i pings, j pongs.
            let mut small = [0u8; 8];
            for round in 0..2 {
                let t = Instant::now();
                let iters = if round == 0 { 10 } else { args.lat_iters };
                for _ in 0..iters {
                    if rank == i {
                        comm.send(&small, other)?;
                        comm.recv(&mut small, other)?;
                    } else {
                        comm.recv(&mut small, other)?;
                        comm.send(&small, other)?;
                    }
                }
                if round == 1 && rank == i {
                    lat[i * n + j] = t.elapsed().as_secs_f64() / (2.0 * iters as f64);
                    lat[j * n + i] = lat[i * n + j];
                }
            }
            bandwidth(args, comm, (i, j), &mut big, &mut bw)?;
        }
    }
    comm.all_reduce(&mut bw, gradsync::ReduceOp::Sum)
        .context("gathering bandwidths")?;
    comm.all_reduce(&mut lat, gradsync::ReduceOp::Sum)
        .context("gathering latencies")?;
    // A second look at the links found slow, as rank 0 finds them.
    let mut again = vec![0u8; n * n];
    if rank == 0 {
        for (a, b) in assess(args, &infos, &bw, &lat).slow {
            again[a * n + b] = 1;
        }
    }
    comm.broadcast(&mut again, 0)
        .context("broadcast of the links to measure again")?;
    let twice: Vec<(usize, usize)> = (0..n)
        .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
        .filter(|&(a, b)| again[a * n + b] == 1)
        .collect();
    if !twice.is_empty() {
        let mut bw2 = vec![0f64; n * n];
        for &(i, j) in &twice {
            comm.barrier()
                .context("barrier between pair measurements")?;
            if rank == i || rank == j {
                bandwidth(args, comm, (i, j), &mut big, &mut bw2)?;
            }
        }
        comm.all_reduce(&mut bw2, gradsync::ReduceOp::Sum)
            .context("gathering bandwidths")?;
        for (x, y) in bw.iter_mut().zip(&bw2) {
            *x = x.max(*y);
        }
    }
    Ok(render(args, n, &infos, &transports, &bw, &lat, &twice))
}

/// Measures the bandwidth of the link between ranks `i` and `j` (this rank is one of them), i
/// to j then j to i: a warm-up message and an ack, then `--iters` messages, and the receiver's
/// one-byte ack ends the clock. The sender writes bytes/s into `bw[src * n + dst]`.
fn bandwidth(
    args: &DoctorArgs,
    comm: &mut Communicator,
    (i, j): (usize, usize),
    big: &mut [u8],
    bw: &mut [f64],
) -> anyhow::Result<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let mut ack = [0u8; 1];
    for (src, dst) in [(i, j), (j, i)] {
        if rank == src {
            comm.send(big, dst)?;
            comm.recv(&mut ack, dst)?;
            let t = Instant::now();
            for _ in 0..args.iters {
                comm.send(big, dst)?;
            }
            comm.recv(&mut ack, dst)?;
            bw[src * n + dst] =
                (args.size as f64) * (args.iters as f64) / t.elapsed().as_secs_f64();
        } else {
            comm.recv(big, src)?;
            comm.send(&ack, src)?;
            for _ in 0..args.iters {
                comm.recv(big, src)?;
            }
            comm.send(&ack, src)?;
        }
    }
    Ok(())
}

/// The address of rank `r` from its description (`rank N` without one).
fn label(infos: &[String], r: usize) -> String {
    infos[r]
        .split_whitespace()
        .nth(3)
        .filter(|a| *a != "-")
        .map(str::to_string)
        .unwrap_or_else(|| format!("rank {r}"))
}

/// What the measurements say: the hosts, the links, their references and the slow links.
struct Assessment {
    hosts: Vec<verdict::Host>,
    host_of: Vec<usize>,
    links: Vec<Link>,
    reference: Reference,
    slow: Vec<(usize, usize)>,
}

/// Groups the ranks of `infos` into hosts and finds the slow links of `bw` (row sends to
/// column, bytes/s).
fn assess(args: &DoctorArgs, infos: &[String], bw: &[f64], lat: &[f64]) -> Assessment {
    let n = infos.len();
    let mut links = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            links.push(Link {
                a,
                b,
                bw: bw[a * n + b].min(bw[b * n + a]),
                lat: lat[a * n + b],
            });
        }
    }
    let labels: Vec<String> = (0..n).map(|r| label(infos, r)).collect();
    let (hosts, host_of) = verdict::group_hosts(&labels);
    let reference = Reference::of(&links, &host_of);
    let slow = links
        .iter()
        .filter(|l| reference.fraction(l, &host_of) < args.threshold)
        .map(|l| (l.a, l.b))
        .collect();
    Assessment {
        hosts,
        host_of,
        links,
        reference,
        slow,
    }
}

/// An `n` x `n` matrix of the report under `title`: row and column numbers, `cell(i, j)` off
/// the diagonal, `-` on it.
fn matrix(title: &str, n: usize, cell: impl Fn(usize, usize) -> String) -> String {
    let mut s = format!("#\n# {title}\n#      ");
    for j in 0..n {
        s += &format!("{j:>8}");
    }
    s += "\n";
    for i in 0..n {
        s += &format!("# {i:>4} ");
        for j in 0..n {
            if i == j {
                s += &format!("{:>8}", "-");
            } else {
                s += &cell(i, j);
            }
        }
        s += "\n";
    }
    s
}

/// Rank 0's report of the measurements; `twice` are the links measured a second time.
fn render(
    args: &DoctorArgs,
    n: usize,
    infos: &[String],
    transports: &[u8],
    bw: &[f64],
    lat: &[f64],
    twice: &[(usize, usize)],
) -> Report {
    let tname = |c: u8| gradsync::Route::from_code(c).map_or("?", gradsync::Route::name);
    let gb = |x: f64| x / 1e9;
    let mut s = format!(
        "# gradsync {} doctor: {n} ranks, bandwidth {} B x {} per direction, latency 8 B x {} round trips\n#\n",
        gradsync::VERSION,
        args.size,
        args.iters,
        args.lat_iters
    );
    for (r, info) in infos.iter().enumerate() {
        s += &format!("#  rank {r:>3}  {info}\n");
    }
    s += &rdma_devices();
    s += &matrix("bandwidth GB/s (row sends to column)", n, |i, j| {
        format!("{:>8.3}", gb(bw[i * n + j]))
    });
    s += &matrix("latency us (one way, 8 B)", n, |i, j| {
        format!("{:>8.1}", lat[i * n + j] * 1e6)
    });
    let Assessment {
        hosts,
        host_of,
        links,
        reference,
        slow,
    } = assess(args, infos, bw, lat);
    let med = median(&mut links.iter().map(|l| l.bw).collect::<Vec<_>>());
    let pct = args.threshold * 100.0;
    let gbs = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{:.3} GB/s", gb(r)));
    s += &format!(
        "#\n# links (slower direction), slow below {pct:.0}% of the fastest link between hosts ({}) \
         or of the median link inside a host ({})\n",
        gbs(reference.between),
        gbs(reference.inside),
    );
    if !twice.is_empty() {
        s += &format!(
            "# {} link(s) found slow were measured again, the faster measurement counts\n",
            twice.len()
        );
    }
    for l in &links {
        let frac = reference.fraction(l, &host_of);
        s += &format!(
            "{} rank {:>3} ({}) <-> rank {:>3} ({})  {}  {:.3} GB/s  {:>4.0}% of {}  {:.1} us\n",
            if frac < args.threshold {
                "SLOW"
            } else {
                "  ok"
            },
            l.a,
            hosts[host_of[l.a]].label,
            l.b,
            hosts[host_of[l.b]].label,
            tname(transports[l.a * n + l.b]),
            gb(l.bw),
            frac * 100.0,
            if host_of[l.a] == host_of[l.b] {
                "median"
            } else {
                "fastest"
            },
            l.lat * 1e6
        );
    }
    let findings = verdict::diagnose(&host_of, &slow);
    if findings.is_empty() {
        s += "# verdict: no slow link\n";
    }
    for f in &findings {
        s += &format!(
            "# verdict: {}\n",
            verdict::describe(f, &hosts, &host_of, pct)
        );
    }
    let slow_hosts: Vec<&verdict::Host> = findings
        .iter()
        .filter_map(|f| match f {
            Finding::Host { host, .. } => Some(&hosts[*host]),
            _ => None,
        })
        .collect();
    let json = serde_json::json!({
        "ranks": n,
        "size": args.size,
        "iters": args.iters,
        "ranks_info": infos,
        "bandwidth_bytes_per_s": (0..n).map(|i| bw[i * n..(i + 1) * n].to_vec()).collect::<Vec<_>>(),
        "latency_s": (0..n).map(|i| lat[i * n..(i + 1) * n].to_vec()).collect::<Vec<_>>(),
        "median_link_bytes_per_s": med,
        "fastest_link_between_hosts_bytes_per_s": reference.between,
        "median_link_inside_hosts_bytes_per_s": reference.inside,
        "measured_twice": twice.iter().map(|&(a, b)| [a, b]).collect::<Vec<_>>(),
        "slow_links": slow.iter().map(|&(a, b)| [a, b]).collect::<Vec<_>>(),
        "slow_hosts": slow_hosts
            .iter()
            .map(|h| serde_json::json!({"address": h.label, "ranks": h.ranks}))
            .collect::<Vec<_>>(),
        "slow_ranks": slow_hosts.iter().flat_map(|h| h.ranks.iter().copied()).collect::<Vec<_>>(),
        "verdict": findings
            .iter()
            .map(|f| verdict::describe(f, &hosts, &host_of, pct))
            .collect::<Vec<_>>(),
    });
    Report {
        text: s,
        json: serde_json::to_string_pretty(&json).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> DoctorArgs {
        DoctorArgs {
            size: 1 << 20,
            iters: 2,
            lat_iters: 10,
            threshold: 0.8,
            nproc: None,
            json: None,
        }
    }

    #[test]
    fn names_the_slow_host() {
        let n = 4;
        let infos: Vec<String> = (0..n)
            .map(|r| format!("host h addr 10.0.0.{r} if eth0 mtu 1500 numa: 1"))
            .collect();
        let mut bw = vec![100e6; n * n];
        for p in 0..n {
            bw[3 * n + p] = 50e6;
            bw[p * n + 3] = 50e6;
        }
        let r = render(
            &args(),
            n,
            &infos,
            &vec![2; n * n],
            &bw,
            &vec![1e-5; n * n],
            &[],
        );
        let slow: Vec<&str> = r.text.lines().filter(|l| l.starts_with("SLOW")).collect();
        assert_eq!(slow.len(), 3, "{}", r.text);
        assert!(slow.iter().all(|l| l.contains("rank   3")), "{}", r.text);
        assert!(r.text.contains("slow host 10.0.0.3 (rank 3)"), "{}", r.text);
    }

    /// `hosts` emulated hosts of `per` ranks each (10.0.0.H), 2 GB/s shared memory inside a
    /// host, 120 MB/s between hosts except where `rate(host, host)` says otherwise; rank 0's
    /// report.
    fn hosts_of(hosts: usize, per: usize, rate: impl Fn(usize, usize) -> Option<f64>) -> String {
        let n = hosts * per;
        let infos: Vec<String> = (0..n)
            .map(|r| format!("host vm addr 10.0.0.{} if eth0 mtu 1500 numa: 1", r / per))
            .collect();
        let (mut bw, mut routes) = (vec![0.0; n * n], vec![0u8; n * n]);
        for i in 0..n {
            for j in 0..n {
                let (x, y) = (i / per, j / per);
                let (b, route) = if x == y {
                    (2e9, gradsync::Route::Shm)
                } else {
                    (rate(x, y).unwrap_or(120e6), gradsync::Route::Tcp)
                };
                bw[i * n + j] = b;
                routes[i * n + j] = route.code();
            }
        }
        render(&args(), n, &infos, &routes, &bw, &vec![2e-5; n * n], &[]).text
    }

    fn verdicts(text: &str) -> Vec<&str> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# verdict: "))
            .collect()
    }

    fn slow_lines(text: &str) -> Vec<&str> {
        text.lines().filter(|l| l.starts_with("SLOW")).collect()
    }

    #[test]
    fn names_the_slow_host_of_two_ranks() {
        // Host 2 (ranks 4, 5) at 300 Mbit/s, the others at 1 Gbit/s.
        let text = hosts_of(4, 2, |x, y| (x == 2 || y == 2).then_some(36e6));
        let slow = slow_lines(&text);
        assert_eq!(slow.len(), 12, "{text}");
        assert!(slow.iter().all(|l| l.contains("(10.0.0.2)")), "{text}");
        assert_eq!(
            verdicts(&text),
            [
                "slow host 10.0.0.2 (ranks 4, 5): all 12 of its links to other hosts below 80% \
              of the fastest link between hosts"
            ],
            "{text}"
        );
    }

    #[test]
    fn names_two_slow_hosts() {
        let text = hosts_of(4, 2, |x, y| {
            [x, y].iter().any(|h| *h == 1 || *h == 2).then_some(36e6)
        });
        assert_eq!(slow_lines(&text).len(), 20, "{text}");
        assert_eq!(
            verdicts(&text),
            [
                "slow host 10.0.0.1 (ranks 2, 3): all 12 of its links to other hosts below 80% \
                 of the fastest link between hosts",
                "slow host 10.0.0.2 (ranks 4, 5): all 12 of its links to other hosts below 80% \
                 of the fastest link between hosts"
            ],
            "{text}"
        );
    }

    #[test]
    fn names_a_slow_pair_of_hosts_as_a_link() {
        let text = hosts_of(4, 2, |x, y| {
            ((x.min(y), x.max(y)) == (1, 3)).then_some(36e6)
        });
        assert_eq!(slow_lines(&text).len(), 4, "{text}");
        assert_eq!(
            verdicts(&text),
            [
                "slow link between hosts 10.0.0.1 (ranks 2, 3) and 10.0.0.3 (ranks 6, 7): all 4 \
              links between them below 80% of the fastest link between hosts"
            ],
            "{text}"
        );
    }

    #[test]
    fn names_a_slow_rank_pair_as_a_link() {
        let text = hosts_of(4, 1, |x, y| {
            ((x.min(y), x.max(y)) == (0, 2)).then_some(36e6)
        });
        assert_eq!(
            verdicts(&text),
            [
                "slow link rank 0 (10.0.0.0) <-> rank 2 (10.0.0.2): below 80% of the fastest link \
              between hosts"
            ],
            "{text}"
        );
    }

    #[test]
    fn hosts_of_two_ranks_without_slow_links_pass() {
        let text = hosts_of(4, 2, |_, _| None);
        assert!(slow_lines(&text).is_empty(), "{text}");
        assert_eq!(verdicts(&text), ["no slow link"], "{text}");
    }

    #[test]
    fn says_which_links_were_measured_twice() {
        let n = 3;
        let infos: Vec<String> = (0..n).map(|r| format!("host h addr 10.0.0.{r}")).collect();
        let bw = vec![100e6; n * n];
        let r = render(
            &args(),
            n,
            &infos,
            &vec![2; n * n],
            &bw,
            &vec![1e-6; n * n],
            &[(0, 2)],
        );
        assert!(
            r.text.contains(
                "# 1 link(s) found slow were measured again, the faster measurement counts\n"
            ),
            "{}",
            r.text
        );
        assert!(
            r.json
                .contains("\"measured_twice\": [\n    [\n      0,\n      2\n    ]\n  ]"),
            "{}",
            r.json
        );
    }

    #[test]
    fn healthy_links_pass() {
        let n = 3;
        let infos: Vec<String> = (0..n).map(|r| format!("host h addr - r{r}")).collect();
        let bw = vec![100e6; n * n];
        let r = render(
            &args(),
            n,
            &infos,
            &vec![1; n * n],
            &bw,
            &vec![1e-6; n * n],
            &[],
        );
        assert!(r.text.contains("verdict: no slow link"), "{}", r.text);
        assert!(!r.text.contains("SLOW"));
    }
}
