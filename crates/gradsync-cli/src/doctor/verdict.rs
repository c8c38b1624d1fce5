//! What `gradsync doctor` concludes from the measured links: which links are slow, and which
//! hosts, or which pair of hosts, explain them. Pure functions of the measurements.
//!
//! Ranks with the same address are one host. A link between two hosts is measured against the
//! fastest link between hosts, a link inside a host against the median link inside a host:
//! shared memory and the network are not compared with each other, and the median of the links
//! between hosts is no reference once several hosts are slow (with two slow hosts of four, 20
//! of the 24 links between hosts of two ranks each are slow).
//!
//! The verdict looks at the links between hosts only: a host all of whose links to the other
//! hosts are slow is a slow host, whatever the links inside it do (as long as some link
//! between other hosts is fine, else nothing tells which end is slow). The slow links between
//! hosts that no slow host explains are named as one link when they all join the same two
//! hosts; slow links inside a host are named per host.

use gradsync::cost::median;

/// One measured link: a pair of ranks, both directions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Link {
    /// The lower rank.
    pub a: usize,
    /// The higher rank.
    pub b: usize,
    /// The slower direction, bytes/s.
    pub bw: f64,
    /// One-way latency, seconds.
    pub lat: f64,
}

/// The ranks of one host: those with the same address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Host {
    /// Its address (`rank N` for a rank without one).
    pub label: String,
    /// Its ranks, in increasing order.
    pub ranks: Vec<usize>,
}

/// Groups ranks by label, hosts in the order of their first rank; returns the hosts and the
/// host index of every rank.
pub(super) fn group_hosts(labels: &[String]) -> (Vec<Host>, Vec<usize>) {
    let mut hosts: Vec<Host> = Vec::new();
    let mut host_of = Vec::with_capacity(labels.len());
    for (r, label) in labels.iter().enumerate() {
        let h = match hosts.iter().position(|h| &h.label == label) {
            Some(h) => h,
            None => {
                hosts.push(Host {
                    label: label.clone(),
                    ranks: Vec::new(),
                });
                hosts.len() - 1
            }
        };
        hosts[h].ranks.push(r);
        host_of.push(h);
    }
    (hosts, host_of)
}

/// The bandwidths links are measured against, bytes/s; `None` where there is no such link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Reference {
    /// The fastest link between two hosts.
    pub between: Option<f64>,
    /// The median link inside a host.
    pub inside: Option<f64>,
}

impl Reference {
    /// The references of `links`, ranks placed by `host_of`.
    pub fn of(links: &[Link], host_of: &[usize]) -> Reference {
        let (mut between, mut inside) = (Vec::new(), Vec::new());
        for l in links {
            if host_of[l.a] == host_of[l.b] {
                inside.push(l.bw);
            } else {
                between.push(l.bw);
            }
        }
        Reference {
            between: between.into_iter().reduce(f64::max),
            inside: (!inside.is_empty()).then(|| median(&mut inside)),
        }
    }

    /// The bandwidth of link `l` as a fraction of its reference (1 where that is 0).
    pub fn fraction(&self, l: &Link, host_of: &[usize]) -> f64 {
        let of = if host_of[l.a] == host_of[l.b] {
            self.inside
        } else {
            self.between
        };
        match of {
            Some(of) if of > 0.0 => l.bw / of,
            _ => 1.0,
        }
    }
}

/// What the slow links point at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Finding {
    /// All `links` links of host `host` to other hosts are slow.
    Host {
        /// Index of the host.
        host: usize,
        /// Its links to other hosts.
        links: usize,
    },
    /// The slow links between hosts that no slow host explains all join hosts `a` and `b`.
    Pair {
        /// Index of one host.
        a: usize,
        /// Index of the other host.
        b: usize,
        /// The slow rank pairs between them.
        slow: Vec<(usize, usize)>,
        /// All links between the two hosts.
        links: usize,
    },
    /// Slow links between hosts that neither a slow host nor one pair of hosts explains.
    Scattered {
        /// How many.
        count: usize,
        /// Whether slow hosts explain other slow links.
        besides_hosts: bool,
    },
    /// Slow links inside host `host`.
    Inside {
        /// Index of the host.
        host: usize,
        /// The slow rank pairs.
        slow: Vec<(usize, usize)>,
    },
}

/// The findings for slow links `slow` (rank pairs, lower rank first) among every pair of the
/// `host_of.len()` ranks, ranks placed on hosts by `host_of`: slow hosts first, then what is
/// left between hosts, then the hosts with slow links inside. Empty when no link is slow.
pub(super) fn diagnose(host_of: &[usize], slow: &[(usize, usize)]) -> Vec<Finding> {
    let n = host_of.len();
    let nhosts = host_of.iter().max().map_or(0, |h| h + 1);
    let between = |&(a, b): &(usize, usize)| host_of[a] != host_of[b];
    let links_between = (0..n)
        .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
        .filter(between)
        .count();
    let slow_between: Vec<(usize, usize)> = slow.iter().copied().filter(between).collect();
    // Links from host h to other hosts: ranks of h times ranks elsewhere.
    let size = |h: usize| host_of.iter().filter(|&&x| x == h).count();
    let mut findings = Vec::new();
    let mut slow_hosts = Vec::new();
    if slow_between.len() < links_between {
        for h in 0..nhosts {
            let links = size(h) * (n - size(h));
            let touching = slow_between
                .iter()
                .filter(|&&(a, b)| host_of[a] == h || host_of[b] == h)
                .count();
            if links > 0 && touching == links {
                slow_hosts.push(h);
                findings.push(Finding::Host { host: h, links });
            }
        }
    }
    let left: Vec<(usize, usize)> = slow_between
        .iter()
        .copied()
        .filter(|&(a, b)| !slow_hosts.contains(&host_of[a]) && !slow_hosts.contains(&host_of[b]))
        .collect();
    let key = |&(a, b): &(usize, usize)| {
        let (x, y) = (host_of[a], host_of[b]);
        (x.min(y), x.max(y))
    };
    if let Some(first) = left.first() {
        let (a, b) = key(first);
        if left.iter().all(|l| key(l) == (a, b)) {
            findings.push(Finding::Pair {
                a,
                b,
                slow: left,
                links: size(a) * size(b),
            });
        } else {
            findings.push(Finding::Scattered {
                count: left.len(),
                besides_hosts: !slow_hosts.is_empty(),
            });
        }
    }
    for h in 0..nhosts {
        let inside: Vec<(usize, usize)> = slow
            .iter()
            .copied()
            .filter(|&(a, b)| host_of[a] == h && host_of[b] == h)
            .collect();
        if !inside.is_empty() {
            findings.push(Finding::Inside {
                host: h,
                slow: inside,
            });
        }
    }
    findings
}

/// `rank 3`, `ranks 4, 5`, `ranks 0-7, 9`: runs of three or more ranks as ranges.
pub(super) fn rank_list(ranks: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        if j >= i + 2 {
            parts.push(format!("{}-{}", ranks[i], ranks[j]));
            i = j + 1;
        } else {
            parts.push(ranks[i].to_string());
            i += 1;
        }
    }
    let word = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", parts.join(", "))
}

/// The verdict line of finding `f` (without the `# verdict: ` prefix); `pct` is the threshold
/// in percent.
pub(super) fn describe(f: &Finding, hosts: &[Host], host_of: &[usize], pct: f64) -> String {
    let host = |h: usize| format!("{} ({})", hosts[h].label, rank_list(&hosts[h].ranks));
    let rank = |r: usize| format!("rank {r} ({})", hosts[host_of[r]].label);
    let between = format!("below {pct:.0}% of the fastest link between hosts");
    let all_or = |k: usize, of: usize| {
        if k == of {
            format!("all {of}")
        } else {
            format!("{k} of the {of}")
        }
    };
    match f {
        Finding::Host { host: h, links } => format!(
            "slow host {}: all {links} of its links to other hosts {between}",
            host(*h)
        ),
        Finding::Pair { slow, .. } if slow.len() == 1 => {
            let (a, b) = slow[0];
            format!("slow link {} <-> {}: {between}", rank(a), rank(b))
        }
        Finding::Pair { a, b, slow, links } => format!(
            "slow link between hosts {} and {}: {} links between them {between}",
            host(*a),
            host(*b),
            all_or(slow.len(), *links)
        ),
        Finding::Scattered {
            count,
            besides_hosts,
        } => format!(
            "{count} {}slow link(s) between hosts that no single host or pair of hosts explains",
            if *besides_hosts { "other " } else { "" }
        ),
        Finding::Inside { host: h, slow } if slow.len() == 1 => {
            let (a, b) = slow[0];
            format!(
                "slow link inside host {}: rank {a} <-> rank {b}, below {pct:.0}% of the median link inside a host",
                hosts[*h].label
            )
        }
        Finding::Inside { host: h, slow } => format!(
            "{} slow links inside host {}: below {pct:.0}% of the median link inside a host",
            slow.len(),
            host(*h)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `hosts` hosts of `per` ranks each, in blocks (ranks 0..per on host 0, ...).
    fn blocks(hosts: usize, per: usize) -> Vec<usize> {
        (0..hosts * per).map(|r| r / per).collect()
    }

    /// Every pair of ranks (lower first) for which `slow` holds, given the host of each rank.
    fn pairs(host_of: &[usize], slow: impl Fn(usize, usize) -> bool) -> Vec<(usize, usize)> {
        let n = host_of.len();
        (0..n)
            .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
            .filter(|&(a, b)| slow(host_of[a], host_of[b]))
            .collect()
    }

    #[test]
    fn one_slow_host_of_two_ranks_is_named() {
        let host_of = blocks(4, 2);
        let slow = pairs(&host_of, |x, y| x != y && (x == 2 || y == 2));
        assert_eq!(slow.len(), 12);
        assert_eq!(
            diagnose(&host_of, &slow),
            vec![Finding::Host { host: 2, links: 12 }]
        );
    }

    #[test]
    fn slow_links_inside_do_not_hide_a_slow_host() {
        let host_of = blocks(4, 2);
        // Host 2's links to other hosts and its own link inside (4 <-> 5), and 0 <-> 1.
        let slow = pairs(&host_of, |x, y| x == 2 || y == 2 || (x == 0 && y == 0));
        assert_eq!(
            diagnose(&host_of, &slow),
            vec![
                Finding::Host { host: 2, links: 12 },
                Finding::Inside {
                    host: 0,
                    slow: vec![(0, 1)]
                },
                Finding::Inside {
                    host: 2,
                    slow: vec![(4, 5)]
                },
            ]
        );
    }

    #[test]
    fn two_slow_hosts_are_both_named() {
        let host_of = blocks(4, 2);
        let slow = pairs(&host_of, |x, y| {
            x != y && (x == 1 || x == 2 || y == 1 || y == 2)
        });
        assert_eq!(slow.len(), 20);
        assert_eq!(
            diagnose(&host_of, &slow),
            vec![
                Finding::Host { host: 1, links: 12 },
                Finding::Host { host: 2, links: 12 },
            ]
        );
    }

    #[test]
    fn a_slow_pair_of_hosts_is_named_as_a_link() {
        let host_of = blocks(4, 2);
        let slow = pairs(&host_of, |x, y| (x, y) == (1, 3));
        assert_eq!(
            diagnose(&host_of, &slow),
            vec![Finding::Pair {
                a: 1,
                b: 3,
                slow: vec![(2, 6), (2, 7), (3, 6), (3, 7)],
                links: 4
            }]
        );
    }

    #[test]
    fn a_slow_host_and_a_slow_pair_are_both_named() {
        let host_of = blocks(5, 2);
        let slow = pairs(&host_of, |x, y| {
            x != y && (x == 4 || y == 4 || (x, y) == (0, 2))
        });
        assert_eq!(
            diagnose(&host_of, &slow),
            vec![
                Finding::Host { host: 4, links: 16 },
                Finding::Pair {
                    a: 0,
                    b: 2,
                    slow: vec![(0, 4), (0, 5), (1, 4), (1, 5)],
                    links: 4
                }
            ]
        );
    }

    #[test]
    fn one_slow_rank_pair_is_named_as_a_link() {
        // Between two hosts of two ranks, and between hosts of one rank.
        assert_eq!(
            diagnose(&blocks(4, 2), &[(1, 6)]),
            vec![Finding::Pair {
                a: 0,
                b: 3,
                slow: vec![(1, 6)],
                links: 4
            }]
        );
        assert_eq!(
            diagnose(&blocks(4, 1), &[(0, 2)]),
            vec![Finding::Pair {
                a: 0,
                b: 2,
                slow: vec![(0, 2)],
                links: 1
            }]
        );
    }

    #[test]
    fn no_slow_link_no_finding() {
        assert_eq!(diagnose(&blocks(4, 2), &[]), vec![]);
        assert_eq!(diagnose(&blocks(1, 4), &[]), vec![]);
        assert_eq!(diagnose(&[], &[]), vec![]);
    }

    #[test]
    fn one_rank_per_host_as_before() {
        // Host 3's three links: named.
        let host_of = blocks(4, 1);
        let slow = pairs(&host_of, |x, y| x == 3 || y == 3);
        assert_eq!(
            diagnose(&host_of, &slow),
            vec![Finding::Host { host: 3, links: 3 }]
        );
        // Two links of different hosts: nothing explains them.
        assert_eq!(
            diagnose(&host_of, &[(0, 1), (2, 3)]),
            vec![Finding::Scattered {
                count: 2,
                besides_hosts: false
            }]
        );
    }

    #[test]
    fn every_link_between_hosts_slow_names_no_host() {
        // Two hosts: either end may be the slow one.
        let host_of = blocks(2, 2);
        let slow = pairs(&host_of, |x, y| x != y);
        assert_eq!(
            diagnose(&host_of, &slow),
            vec![Finding::Pair {
                a: 0,
                b: 1,
                slow: slow.clone(),
                links: 4
            }]
        );
        // Three hosts, every link slow.
        let host_of = blocks(3, 1);
        assert_eq!(
            diagnose(&host_of, &[(0, 1), (0, 2), (1, 2)]),
            vec![Finding::Scattered {
                count: 3,
                besides_hosts: false
            }]
        );
    }

    #[test]
    fn one_host_only_inside() {
        assert_eq!(
            diagnose(&blocks(1, 4), &[(1, 3)]),
            vec![Finding::Inside {
                host: 0,
                slow: vec![(1, 3)]
            }]
        );
    }

    #[test]
    fn hosts_by_label() {
        let labels: Vec<String> = ["10.0.0.1", "10.0.0.2", "10.0.0.1", "rank 3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (hosts, host_of) = group_hosts(&labels);
        assert_eq!(host_of, vec![0, 1, 0, 2]);
        assert_eq!(hosts[0].ranks, vec![0, 2]);
        assert_eq!(hosts[2].label, "rank 3");
    }

    #[test]
    fn references_by_kind() {
        let link = |a, b, bw| Link { a, b, bw, lat: 0.0 };
        let host_of = blocks(2, 2);
        let links = [
            link(0, 1, 3e9),
            link(0, 2, 100e6),
            link(0, 3, 120e6),
            link(1, 2, 30e6),
            link(1, 3, 110e6),
            link(2, 3, 1e9),
        ];
        let r = Reference::of(&links, &host_of);
        assert_eq!(r.between, Some(120e6));
        assert_eq!(r.inside, Some(2e9));
        assert_eq!(r.fraction(&links[0], &host_of), 1.5);
        assert_eq!(r.fraction(&links[3], &host_of), 0.25);
        let r = Reference::of(&links[..1], &[0, 0]);
        assert_eq!((r.between, r.inside), (None, Some(3e9)));
    }

    #[test]
    fn rank_lists() {
        assert_eq!(rank_list(&[3]), "rank 3");
        assert_eq!(rank_list(&[4, 5]), "ranks 4, 5");
        assert_eq!(rank_list(&[0, 1, 2, 3, 4, 5, 6, 7, 9]), "ranks 0-7, 9");
        assert_eq!(rank_list(&[1, 3, 4, 5, 8, 9]), "ranks 1, 3-5, 8, 9");
    }
}
