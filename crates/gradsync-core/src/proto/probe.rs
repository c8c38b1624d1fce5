//! Timeout probes: when an operation times out, ask every peer where it is, and name the
//! ranks that do not answer, whose connection is gone, or that are behind.

use std::fmt;

/// The answers to a timeout probe, per peer: the sequence number the peer runs (or ran last)
/// and whether it is inside it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Probe {
    pub(crate) replies: Vec<Option<(u64, bool)>>,
}

impl Probe {
    pub(crate) fn new(world: usize) -> Self {
        Probe {
            replies: vec![None; world],
        }
    }

    pub(crate) fn clear(&mut self) {
        self.replies.iter_mut().for_each(|r| *r = None);
    }

    /// Whether every live peer has answered.
    pub(crate) fn settled(&self, rank: usize, alive: impl Fn(usize) -> bool) -> bool {
        (0..self.replies.len())
            .filter(|&p| p != rank)
            .all(|p| self.replies[p].is_some() || !alive(p))
    }

    /// The verdict on operation `seq` of rank `rank`.
    pub(crate) fn verdict(&self, rank: usize, seq: u64, alive: impl Fn(usize) -> bool) -> Verdict {
        let mut v = Verdict::default();
        for p in (0..self.replies.len()).filter(|&p| p != rank) {
            if !alive(p) {
                v.lost.push(p);
                continue;
            }
            match self.replies[p] {
                None => v.silent.push(p),
                Some((s, inside)) if s < seq || (s == seq && !inside) => {
                    v.behind.push((p, s, inside))
                }
                Some(_) => {}
            }
        }
        v
    }
}

/// What a timeout probe found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Live peers that did not answer (stopped, hung, or not calling into the library).
    pub silent: Vec<usize>,
    /// Peers whose connection is gone.
    pub lost: Vec<usize>,
    /// Peers behind this rank: (peer, the sequence number it is at, whether inside it).
    pub behind: Vec<(usize, u64, bool)>,
    /// Peers this rank has no connection to (a transport that connects on first use): not
    /// asked. The executor moves them here from `silent`.
    pub unreached: Vec<usize>,
}

/// The verdict with the probe's window, for the error message.
#[derive(Debug, Clone)]
pub struct VerdictWithin<'a> {
    /// The verdict.
    pub verdict: &'a Verdict,
    /// How long peers had to answer.
    pub window: std::time::Duration,
}

impl fmt::Display for VerdictWithin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ranks = |v: &[usize]| {
            v.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", rank ")
        };
        let v = self.verdict;
        let mut parts = Vec::new();
        if !v.silent.is_empty() {
            parts.push(format!(
                "rank {} did not answer within {:?} (stopped, hung, or not calling into gradsync)",
                ranks(&v.silent),
                self.window
            ));
        }
        if !v.lost.is_empty() {
            parts.push(format!("lost connection to rank {}", ranks(&v.lost)));
        }
        if !v.behind.is_empty() {
            let behind: Vec<String> = v
                .behind
                .iter()
                .map(|&(p, s, inside)| {
                    format!(
                        "rank {p} (at seq {s}{})",
                        if inside { "" } else { ", not inside it" }
                    )
                })
                .collect();
            parts.push(format!("behind: {}", behind.join(", ")));
        }
        if parts.is_empty() {
            parts.push(if v.unreached.is_empty() {
                "every peer answered and is inside this collective".into()
            } else {
                "every connected peer answered and is inside this collective".into()
            });
        }
        if !v.unreached.is_empty() {
            let shown: Vec<usize> = v.unreached.iter().copied().take(8).collect();
            parts.push(format!(
                "{} rank(s) not connected to this one were not asked (rank {}{})",
                v.unreached.len(),
                ranks(&shown),
                if v.unreached.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            ));
        }
        f.write_str(&parts.join("; "))
    }
}
