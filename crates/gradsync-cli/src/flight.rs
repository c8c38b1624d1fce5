//! `gradsync flight FILE|DIR...`: reads the flight-recorder dumps of several ranks (see
//! `gradsync::recorder`) and names the rank that is behind.
//!
//! Dumps are grouped by communicator. For each, a table shows every rank of the world: its last
//! completed operation, the first operation it has not completed (the one it waits in) and how
//! long that had been running when the dump was taken; a rank without a dump is shown as
//! missing. Then:
//!
//! - an error line for every rank whose operation failed or timed out;
//! - a `mismatch` line when two ranks recorded different calls under the same sequence number;
//! - the verdict: the rank(s) whose last started sequence number is lowest are behind, since
//!   the others wait for them in the next collective; when every rank started the same one,
//!   nobody is behind and the missing ranks (if any) are named.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use gradsync::recorder::{Dump, OpRecord, OpState};

/// Options of `gradsync flight`.
#[derive(Debug, clap::Args)]
pub struct FlightArgs {
    /// Dump files (`gradsync-flight-<comm>-r<rank>.json`), or directories whose such files are
    /// all read.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
}

/// Runs `gradsync flight`: prints the report of the dumps that could be read (unreadable ones
/// are named on stderr). Fails only when none could be read.
pub fn run(args: &FlightArgs) -> anyhow::Result<i32> {
    let mut dumps = Vec::new();
    for path in &args.files {
        for file in expand(path)? {
            match read_dump(&file) {
                Ok(d) => dumps.push(d),
                Err(e) => eprintln!("gradsync flight: skipping {}: {e:#}", file.display()),
            }
        }
    }
    anyhow::ensure!(!dumps.is_empty(), "no flight-recorder dump could be read");
    print!("{}", report(dumps));
    Ok(0)
}

/// The dump files a command-line argument names: itself, or a directory's
/// `gradsync-flight-*.json` files in name order.
fn expand(path: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path)
        .map_err(|e| anyhow::anyhow!("cannot list {}: {e}", path.display()))?
    {
        let p = entry?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("gradsync-flight-") && name.ends_with(".json") {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

fn read_dump(path: &Path) -> anyhow::Result<Dump> {
    let text = std::fs::read_to_string(path)?;
    Ok(serde_json::from_str(&text)?)
}

/// The whole report of a set of dumps, one section per communicator.
pub fn report(dumps: Vec<Dump>) -> String {
    let mut groups: BTreeMap<String, Vec<Dump>> = BTreeMap::new();
    for d in dumps {
        groups.entry(d.comm_id.clone()).or_default().push(d);
    }
    let mut out = String::new();
    for (i, (comm, group)) in groups.into_iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        section(&mut out, &comm, group);
    }
    out
}

/// Ranks as `0,1,3`, runs of four or more shortened to `4-9`.
fn ranks(list: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < list.len() {
        let mut j = i;
        while j + 1 < list.len() && list[j + 1] == list[j] + 1 {
            j += 1;
        }
        if j - i >= 3 {
            parts.push(format!("{}-{}", list[i], list[j]));
        } else {
            parts.extend(list[i..=j].iter().map(usize::to_string));
        }
        i = j + 1;
    }
    parts.join(",")
}

/// `rank 3` or `ranks 0,1`.
fn ranks_noun(list: &[usize]) -> String {
    match list {
        [r] => format!("rank {r}"),
        _ => format!("ranks {}", ranks(list)),
    }
}

fn age(us: u64) -> String {
    if us < 1_000 {
        format!("{us} us")
    } else if us < 1_000_000 {
        format!("{:.1} ms", us as f64 / 1e3)
    } else {
        format!("{:.3} s", us as f64 / 1e6)
    }
}

/// The first operation the rank has not completed: the one it waits in.
fn in_flight(d: &Dump) -> Option<&OpRecord> {
    d.ops
        .iter()
        .filter(|r| r.state != OpState::Completed)
        .min_by_key(|r| r.seq)
}

/// What a group of leading ranks does at the frontier: `are in all_reduce seq 42 (started)`.
fn doing(n: usize, op: &OpRecord) -> String {
    let (is, has) = if n == 1 {
        ("is", "has")
    } else {
        ("are", "have")
    };
    match op.state {
        OpState::Completed => format!("{has} completed {} seq {}", op.op, op.seq),
        s => format!("{is} in {} seq {} ({s})", op.op, op.seq),
    }
}

fn signature(r: &OpRecord) -> String {
    let mut s = format!("{}({} x {}", r.op, r.dtype, r.count);
    if let Some(root) = r.root {
        let _ = write!(s, ", root {root}");
    }
    s.push(')');
    s
}

fn section(out: &mut String, comm: &str, mut group: Vec<Dump>) {
    // One dump per rank: the latest.
    group.sort_by_key(|d| (d.rank, d.dumped_unix_us));
    let mut by_rank: BTreeMap<usize, Dump> = BTreeMap::new();
    let mut replaced = Vec::new();
    for d in group {
        let rank = d.rank;
        if by_rank.insert(rank, d).is_some() {
            replaced.push(rank);
        }
    }
    let world = by_rank
        .values()
        .map(|d| d.world.max(d.rank + 1))
        .max()
        .unwrap_or(0);
    let missing: Vec<usize> = (0..world).filter(|r| !by_rank.contains_key(r)).collect();
    let n = by_rank.len();
    let dumps = if n == 1 { "dump" } else { "dumps" };
    let _ = write!(out, "communicator {comm}: world {world}, {n} {dumps}");
    if !missing.is_empty() {
        let _ = write!(out, ", no dump from {}", ranks_noun(&missing));
    }
    out.push('\n');
    replaced.dedup();
    if !replaced.is_empty() {
        let _ = writeln!(
            out,
            "note: several dumps of {}; the latest of each is used",
            ranks_noun(&replaced)
        );
    }

    // The table.
    let mut rows: Vec<[String; 7]> = vec![
        [
            "rank",
            "host",
            "pid",
            "reason",
            "last completed",
            "in flight",
            "age",
        ]
        .map(String::from),
    ];
    for r in 0..world {
        let Some(d) = by_rank.get(&r) else {
            rows.push([
                r.to_string(),
                "-".into(),
                "-".into(),
                "missing".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
            continue;
        };
        let done = d
            .last_completed()
            .map_or("-".into(), |o| format!("{} {}", o.seq, o.op));
        let (flight, flight_age) = match in_flight(d) {
            Some(o) => (
                format!("{} {} {}", o.seq, o.op, o.state),
                age(d.dumped_unix_us.saturating_sub(o.started_unix_us)),
            ),
            None => ("-".into(), "-".into()),
        };
        rows.push([
            r.to_string(),
            d.host.clone(),
            d.pid.to_string(),
            d.reason.clone(),
            done,
            flight,
            flight_age,
        ]);
    }
    let mut widths = [0usize; 7];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }

    // Errors of failed and timed-out operations.
    for (r, d) in &by_rank {
        for o in d.ops.iter().filter(|o| o.state != OpState::Completed) {
            if let Some(e) = &o.error {
                let _ = writeln!(out, "rank {r} {} seq {} {}: {e}", o.op, o.seq, o.state);
            }
        }
    }

    // The first sequence number two ranks recorded as different calls.
    let mut calls: BTreeMap<u64, BTreeMap<String, Vec<usize>>> = BTreeMap::new();
    for (r, d) in &by_rank {
        for o in &d.ops {
            calls
                .entry(o.seq)
                .or_default()
                .entry(signature(o))
                .or_default()
                .push(*r);
        }
    }
    if let Some((seq, sigs)) = calls.iter().find(|(_, sigs)| sigs.len() > 1) {
        let sides: Vec<String> = sigs
            .iter()
            .map(|(sig, rs)| {
                let verb = if rs.len() == 1 { "calls" } else { "call" };
                format!("{} {verb} {sig}", ranks_noun(rs))
            })
            .collect();
        let _ = writeln!(out, "mismatch at seq {seq}: {}", sides.join(", "));
    }

    out.push_str("verdict: ");
    out.push_str(&verdict(&by_rank, &missing));
    out.push('\n');
}

fn verdict(by_rank: &BTreeMap<usize, Dump>, missing: &[usize]) -> String {
    let last: BTreeMap<usize, Option<&OpRecord>> = by_rank
        .iter()
        .map(|(r, d)| (*r, d.last_started()))
        .collect();
    let Some(frontier) = last.values().flatten().map(|o| o.seq).max() else {
        let mut v = "no rank recorded an operation".to_string();
        if !missing.is_empty() {
            let _ = write!(v, "; no dump from {} (missing)", ranks_noun(missing));
        }
        return v;
    };
    // The leading ranks, grouped by what they do at the frontier.
    let mut leaders: BTreeMap<(String, OpState), Vec<usize>> = BTreeMap::new();
    let mut behind = Vec::new();
    for (r, o) in &last {
        match o {
            Some(o) if o.seq == frontier => leaders
                .entry((o.op.to_string(), o.state))
                .or_default()
                .push(*r),
            _ => behind.push(*r),
        }
    }
    let leading: Vec<String> = leaders
        .values()
        .map(|rs| {
            let o = last[&rs[0]].expect("leaders have an operation");
            format!("{} {}", ranks_noun(rs), doing(rs.len(), o))
        })
        .collect();
    let leading = leading.join(", ");
    let missing_note = if missing.is_empty() {
        String::new()
    } else {
        format!("; no dump from {} (missing)", ranks_noun(missing))
    };
    if behind.is_empty() {
        if missing.is_empty() {
            return format!("no rank is behind: {leading}");
        }
        let (is, died) = if missing.len() == 1 {
            ("is", "it may have died or not received the signal")
        } else {
            ("are", "they may have died or not received the signal")
        };
        return format!(
            "{} {is} missing (no dump): {leading}; {died}",
            ranks_noun(missing)
        );
    }
    let is = if behind.len() == 1 { "is" } else { "are" };
    let lagging: Vec<String> = behind
        .iter()
        .map(|r| match last[r] {
            Some(o) => format!("rank {r} last started seq {} ({})", o.seq, o.state),
            None => format!("rank {r} recorded no operation"),
        })
        .collect();
    format!(
        "{} {is} behind: {leading}, {}{missing_note}",
        ranks_noun(&behind),
        lagging.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    fn op(seq: u64, name: &'static str, state: OpState) -> OpRecord {
        OpRecord {
            state,
            started_unix_us: 1_000_000 + seq * 10_000,
            ended_unix_us: (state != OpState::Started).then_some(1_000_000 + seq * 10_000 + 500),
            algorithm: Cow::Borrowed("ring"),
            ..OpRecord::new(seq, name, "float32", 256)
        }
    }

    fn dump(rank: usize, world: usize, ops: Vec<OpRecord>) -> Dump {
        Dump {
            rank,
            world,
            host: "node1".into(),
            pid: 100 + rank as u32,
            comm_id: "00000000000000aa".into(),
            dumped_unix_us: 3_000_000,
            reason: "timeout".into(),
            capacity: 64,
            recorded: ops.len() as u64,
            ops,
        }
    }

    fn done(n: u64) -> Vec<OpRecord> {
        (1..=n)
            .map(|s| op(s, "all_reduce", OpState::Completed))
            .collect()
    }

    fn verdict_line(text: &str) -> &str {
        text.lines()
            .find(|l| l.starts_with("verdict: "))
            .expect("a verdict")
    }

    #[test]
    fn rank_lists() {
        assert_eq!(ranks(&[0, 1, 3]), "0,1,3");
        assert_eq!(ranks(&[0, 1, 2, 3, 5, 7, 8, 9, 10, 11]), "0-3,5,7-11");
        assert_eq!(ranks_noun(&[2]), "rank 2");
    }

    #[test]
    fn names_the_rank_behind() {
        let mut d = Vec::new();
        for r in [0, 1, 3] {
            let mut ops = done(41);
            ops.push(op(42, "all_reduce", OpState::Started));
            d.push(dump(r, 4, ops));
        }
        d.push(dump(2, 4, done(41)));
        let text = report(d);
        assert_eq!(
            verdict_line(&text),
            "verdict: rank 2 is behind: ranks 0,1,3 are in all_reduce seq 42 (started), \
             rank 2 last started seq 41 (completed)"
        );
        assert!(text.contains("1.580 s"), "{text}");
    }

    #[test]
    fn several_behind_and_missing() {
        let mut ops = done(9);
        ops.push(op(10, "broadcast", OpState::TimedOut));
        ops[9].error = Some("waited 2 s for rank 2".into());
        let d = vec![
            dump(0, 5, ops),
            dump(1, 5, done(8)),
            dump(2, 5, Vec::new()),
            dump(4, 5, done(9)),
        ];
        let text = report(d);
        assert!(text.contains("no dump from rank 3"), "{text}");
        assert!(text.contains("3     -      -    missing"), "{text}");
        assert!(
            text.contains("rank 0 broadcast seq 10 timed_out: waited 2 s for rank 2"),
            "{text}"
        );
        assert_eq!(
            verdict_line(&text),
            "verdict: ranks 1,2,4 are behind: rank 0 is in broadcast seq 10 (timed_out), \
             rank 1 last started seq 8 (completed), rank 2 recorded no operation, \
             rank 4 last started seq 9 (completed); no dump from rank 3 (missing)"
        );
    }

    #[test]
    fn nobody_behind() {
        let d: Vec<Dump> = (0..3).map(|r| dump(r, 3, done(5))).collect();
        assert_eq!(
            verdict_line(&report(d.clone())),
            "verdict: no rank is behind: ranks 0,1,2 have completed all_reduce seq 5"
        );
        let text = report(d[..2].to_vec());
        assert_eq!(
            verdict_line(&text),
            "verdict: rank 2 is missing (no dump): ranks 0,1 have completed all_reduce seq 5; \
             it may have died or not received the signal"
        );
    }

    #[test]
    fn mismatch_and_communicators() {
        let mut a = dump(0, 2, done(3));
        a.ops.push(op(4, "all_reduce", OpState::Started));
        let mut b = dump(1, 2, done(3));
        b.ops.push(op(4, "broadcast", OpState::Started));
        b.ops[3].root = Some(0);
        let mut other = dump(0, 1, done(1));
        other.comm_id = "00000000000000bb".into();
        let text = report(vec![a, b, other]);
        assert!(
            text.contains(
                "mismatch at seq 4: rank 0 calls all_reduce(float32 x 256), \
                 rank 1 calls broadcast(float32 x 256, root 0)"
            ),
            "{text}"
        );
        assert!(text.contains("communicator 00000000000000aa: world 2, 2 dumps"));
        assert!(text.contains("communicator 00000000000000bb: world 1, 1 dump"));
    }
}
