//! Slurm host lists (`SLURM_NODELIST`, `SLURM_JOB_NODELIST`) in their compressed syntax.
//!
//! A list is a comma-separated sequence of host expressions. An expression is literal text and
//! bracket groups in any order: `a[1-2]-ib` is `a1-ib,a2-ib`, `n[01-03,7]` is
//! `n01,n02,n03,n7`, and several groups multiply out left to right (`r[1-2]n[1-2]` is
//! `r1n1,r1n2,r2n1,r2n2`). A range keeps the width of its lower bound when that has leading
//! zeros (`[08-10]` is `08,09,10`), and is plain decimal otherwise.

/// One piece of a host expression: literal text, or a bracket group's alternatives.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Choice(Vec<Range>),
}

/// `lo-hi` (or a single number), printed `width` digits wide (zero padded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    fn len(&self) -> u64 {
        (self.hi - self.lo).saturating_add(1)
    }

    fn nth(&self, i: u64) -> String {
        format!("{:0w$}", self.lo + i, w = self.width)
    }
}

/// Most hosts one list may expand to: a bound on memory for a malformed or hostile variable.
pub const MAX_HOSTS: u64 = 1 << 20;

/// The hosts of a Slurm node list, in order, or what is wrong with it.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let exprs = parse(list)?;
    let mut total: u64 = 0;
    for e in &exprs {
        total = total.saturating_add(count(e));
        if total > MAX_HOSTS {
            return Err(format!(
                "node list {list:?} names more than {MAX_HOSTS} hosts"
            ));
        }
    }
    let mut hosts = Vec::with_capacity(total as usize);
    for e in &exprs {
        let n = count(e);
        for i in 0..n {
            hosts.push(nth(e, i));
        }
    }
    Ok(hosts)
}

/// The first host of a Slurm node list (the usual rank 0 host), without expanding the rest.
pub fn first_host(list: &str) -> Result<Option<String>, String> {
    Ok(parse(list)?.first().map(|e| nth(e, 0)))
}

fn count(expr: &[Piece]) -> u64 {
    expr.iter().fold(1u64, |n, p| match p {
        Piece::Text(_) => n,
        Piece::Choice(rs) => {
            n.saturating_mul(rs.iter().fold(0u64, |m, r| m.saturating_add(r.len())))
        }
    })
}

/// Host `i` of an expression, the last group varying fastest.
fn nth(expr: &[Piece], mut i: u64) -> String {
    let mut parts: Vec<String> = Vec::with_capacity(expr.len());
    for p in expr.iter().rev() {
        match p {
            Piece::Text(t) => parts.push(t.clone()),
            Piece::Choice(rs) => {
                let n = rs.iter().fold(0u64, |m, r| m.saturating_add(r.len()));
                let mut k = i % n;
                i /= n;
                for r in rs {
                    if k < r.len() {
                        parts.push(r.nth(k));
                        break;
                    }
                    k -= r.len();
                }
            }
        }
    }
    parts.reverse();
    parts.concat()
}

fn parse(list: &str) -> Result<Vec<Vec<Piece>>, String> {
    let bad = |why: &str| format!("bad Slurm node list {list:?}: {why}");
    let mut exprs = Vec::new();
    let mut expr: Vec<Piece> = Vec::new();
    let mut text = String::new();
    let mut chars = list.trim().char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        match c {
            ',' => {
                if !text.is_empty() {
                    expr.push(Piece::Text(std::mem::take(&mut text)));
                }
                if expr.is_empty() {
                    return Err(bad("empty host name"));
                }
                exprs.push(std::mem::take(&mut expr));
            }
            '[' => {
                if !text.is_empty() {
                    expr.push(Piece::Text(std::mem::take(&mut text)));
                }
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some((_, ']')) => break,
                        Some((_, '[')) => return Err(bad("nested '['")),
                        Some((_, c)) => inner.push(c),
                        None => return Err(bad("'[' without ']'")),
                    }
                }
                expr.push(Piece::Choice(ranges(&inner).map_err(|w| bad(&w))?));
            }
            ']' => return Err(bad("']' without '['")),
            c if c.is_whitespace() => return Err(bad("whitespace inside the list")),
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        expr.push(Piece::Text(text));
    }
    if !expr.is_empty() {
        exprs.push(expr);
    } else if !exprs.is_empty() {
        return Err(bad("empty host name"));
    }
    Ok(exprs)
}

fn ranges(inner: &str) -> Result<Vec<Range>, String> {
    inner
        .split(',')
        .map(|item| {
            let (lo, hi) = item.split_once('-').unwrap_or((item, item));
            let num = |s: &str| -> Result<u64, String> {
                if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(format!("{item:?} is not a number or a range of numbers"));
                }
                s.parse::<u64>()
                    .map_err(|_| format!("{s:?} is too large a number"))
            };
            let (l, h) = (num(lo)?, num(hi)?);
            if h < l {
                return Err(format!("range {item:?} runs backwards"));
            }
            let width = if lo.len() > 1 && lo.starts_with('0') {
                lo.len()
            } else {
                0
            };
            Ok(Range {
                lo: l,
                hi: h,
                width,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hosts(list: &str) -> Vec<String> {
        expand_nodelist(list).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn plain_names_and_lists() {
        assert_eq!(hosts("gpu7"), ["gpu7"]);
        assert_eq!(hosts("a,b"), ["a", "b"]);
        assert_eq!(hosts(""), Vec::<String>::new());
        assert_eq!(first_host("").unwrap(), None);
    }

    #[test]
    fn ranges_lists_and_padding() {
        assert_eq!(
            hosts("node[01-04,07]"),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(hosts("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(hosts("n[08-11]"), ["n08", "n09", "n10", "n11"]);
        assert_eq!(hosts("n[0-1]"), ["n0", "n1"]);
        assert_eq!(hosts("n[007]"), ["n007"]);
        assert_eq!(hosts("n[98-101]"), ["n98", "n99", "n100", "n101"]);
        assert_eq!(hosts("n[098-101]"), ["n098", "n099", "n100", "n101"]);
    }

    #[test]
    fn suffixes_after_brackets_and_several_groups() {
        assert_eq!(hosts("a[1-2]-ib"), ["a1-ib", "a2-ib"]);
        assert_eq!(first_host("a[1-2]-ib").unwrap().as_deref(), Some("a1-ib"));
        assert_eq!(
            hosts("a[01-04,7]-ib,b3"),
            ["a01-ib", "a02-ib", "a03-ib", "a04-ib", "a7-ib", "b3"]
        );
        assert_eq!(hosts("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(hosts("[1-2]x"), ["1x", "2x"]);
    }

    #[test]
    fn malformed_lists_are_errors_naming_the_list() {
        for bad in [
            "a[1-2",
            "a]1",
            "a[2-1]",
            "a[x]",
            "a[1-]",
            "a[]",
            "a,,b",
            ",a",
            "a,",
            "a[[1]]",
            "a b",
            "n[0-99999999999999999999]",
        ] {
            let e = expand_nodelist(bad).expect_err(bad);
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        let e = expand_nodelist("n[0-99999999]").unwrap_err();
        assert!(e.contains("more than"), "{e}");
        // The first host is found without expanding a huge list.
        assert_eq!(first_host("n[0-99999999]").unwrap().as_deref(), Some("n0"));
    }

    /// A host list and its compressed form, built the way Slurm prints them.
    fn compressed() -> impl Strategy<Value = (String, Vec<String>)> {
        let group = prop::collection::vec((0u64..200, 0u64..4, 0usize..4), 1..4);
        let expr = (
            "[a-z]{1,3}",
            group,
            "(-[a-z]{1,3})?",
            prop::option::of(0u64..3),
        );
        prop::collection::vec(expr, 1..4).prop_map(|exprs| {
            let mut text = Vec::new();
            let mut want = Vec::new();
            for (prefix, group, suffix, second) in exprs {
                let mut items = Vec::new();
                let mut names = Vec::new();
                for (lo, span, width) in group {
                    let w = if width > 1 {
                        width.max(lo.to_string().len())
                    } else {
                        0
                    };
                    let f = |v: u64| format!("{v:0w$}");
                    items.push(if span == 0 {
                        f(lo)
                    } else {
                        format!("{}-{}", f(lo), f(lo + span))
                    });
                    names.extend((lo..=lo + span).map(f));
                }
                let tail = second.map(|s| format!("[0-{s}]"));
                text.push(format!(
                    "{prefix}[{}]{suffix}{}",
                    items.join(","),
                    tail.as_deref().unwrap_or("")
                ));
                for n in &names {
                    match second {
                        None => want.push(format!("{prefix}{n}{suffix}")),
                        Some(s) => want.extend((0..=s).map(|k| format!("{prefix}{n}{suffix}{k}"))),
                    }
                }
            }
            (text.join(","), want)
        })
    }

    proptest! {
        // A local variable, not peer bytes: CI's million-case step gets a tenth of that here.
        #![proptest_config(ProptestConfig {
            cases: ProptestConfig::default().cases.min(100_000),
            ..ProptestConfig::default()
        })]

        #[test]
        fn fuzz_nodelist_never_panics(s in "[a-z0-9,\\[\\]\\- ]{0,40}") {
            let all = expand_nodelist(&s);
            let first = first_host(&s);
            match (all, first) {
                (Ok(h), Ok(f)) => prop_assert_eq!(h.first().cloned(), f),
                (Err(_), Err(_)) => {}
                (Err(e), Ok(_)) => prop_assert!(e.contains("more than"), "{}", e),
                (Ok(_), Err(e)) => prop_assert!(false, "first_host fails alone: {}", e),
            }
        }

        #[test]
        fn fuzz_nodelist_expands_what_was_compressed((text, want) in compressed()) {
            prop_assert_eq!(expand_nodelist(&text).unwrap(), want.clone());
            prop_assert_eq!(first_host(&text).unwrap(), want.first().cloned());
        }
    }
}
