//! The arithmetic and the output of `gradsync bench`, as pure functions: message sizes,
//! buffer shapes, bandwidths and the nccl-tests table.
//!
//! # Bandwidths
//!
//! As in nccl-tests, `algbw` is the bytes of the row's `size` column divided by the time, and
//! `busbw` scales it by the fraction of the data every link must carry in an optimal algorithm,
//! so that it can be compared with the hardware's peak link bandwidth whatever the world size:
//!
//! - all-reduce: `2(n-1)/n` (a reduce-scatter then an all-gather, each moving `(n-1)/n` of the
//!   buffer through every rank);
//! - reduce-scatter and all-gather: `(n-1)/n` (every rank receives the `n-1` slices it lacks;
//!   `size` is the total, `count * n` elements);
//! - broadcast and reduce: `1` (the whole buffer crosses at least one link in a pipeline).

use std::fmt::Write as _;

use gradsync::{Collective, DataType};
use serde::Serialize;

/// Parses a byte count with an optional binary suffix: `8`, `1K` (1024), `32M`, `1G`, also
/// written `32MB`, `32MiB` or in lower case.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let digits_end = upper
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(upper.len());
    let (digits, suffix) = upper.split_at(digits_end);
    if digits.is_empty() {
        return Err(format!(
            "invalid size {s:?}: expected a number with an optional K, M or G suffix"
        ));
    }
    let shift = match suffix {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        _ => return Err(format!("invalid size suffix in {s:?}: expected K, M or G")),
    };
    let n: u64 = digits
        .parse()
        .map_err(|e| format!("invalid size {s:?}: {e}"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// The message sizes to run, from `min` to at most `max` bytes: multiplied by `factor`, or
/// incremented by `step` when given (as nccl-tests' `-i` does). Stops when a step makes no
/// progress (a `min` of 0 with a factor gives one row).
pub fn sizes(min: u64, max: u64, factor: u64, step: Option<u64>) -> Vec<u64> {
    let mut out = Vec::new();
    let mut size = min;
    while size <= max {
        out.push(size);
        let next = match step {
            Some(step) => size.saturating_add(step),
            None => size.saturating_mul(factor),
        };
        if next <= size {
            break;
        }
        size = next;
    }
    out
}

/// Element counts of one row's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Elements of the input buffer.
    pub send: usize,
    /// Elements of the output buffer.
    pub recv: usize,
    /// The `count` column: the count argument of the collective (per rank for reduce-scatter
    /// and all-gather).
    pub param: usize,
}

impl Shape {
    /// Buffers for a row of `bytes` bytes of elements of `elem_size` bytes on `world` ranks,
    /// as nccl-tests sizes them (all-gather and reduce-scatter divide the total by the ranks).
    pub fn new(coll: Collective, bytes: u64, elem_size: usize, world: usize) -> Shape {
        let count = usize::try_from(bytes).unwrap_or(usize::MAX) / elem_size;
        match coll {
            Collective::ReduceScatter => {
                let per_rank = count / world;
                Shape {
                    send: per_rank * world,
                    recv: per_rank,
                    param: per_rank,
                }
            }
            Collective::AllGather => {
                let per_rank = count / world;
                Shape {
                    send: per_rank,
                    recv: per_rank * world,
                    param: per_rank,
                }
            }
            Collective::AllToAll => {
                let per_peer = count / world;
                Shape {
                    send: per_peer * world,
                    recv: per_peer * world,
                    param: per_peer,
                }
            }
            _ => Shape {
                send: count,
                recv: count,
                param: count,
            },
        }
    }

    /// The `size` column in bytes: the larger of the two buffers.
    pub fn bytes(self, elem_size: usize) -> u64 {
        (self.send.max(self.recv) * elem_size) as u64
    }
}

/// The factor from algorithm bandwidth to bus bandwidth (see the module documentation).
pub fn bus_factor(coll: Collective, world: usize) -> f64 {
    let n = world as f64;
    match coll {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Whether the collective takes a reduction operator.
pub fn has_op(coll: Collective) -> bool {
    !matches!(
        coll,
        Collective::AllGather | Collective::Broadcast | Collective::AllToAll
    )
}

/// Whether the collective takes a root (the `root` column is -1 otherwise).
pub fn has_root(coll: Collective) -> bool {
    matches!(coll, Collective::Broadcast | Collective::Reduce)
}

/// Timing and validation of one variant (out-of-place or in-place) of a row.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Measure {
    /// Average time of one operation in microseconds, the maximum over ranks.
    pub time_us: f64,
    /// Algorithm bandwidth in GB/s (10^9 bytes per second).
    pub algbw: f64,
    /// Bus bandwidth in GB/s.
    pub busbw: f64,
    /// Wrong elements summed over ranks; `None` when validation is off.
    pub wrong: Option<u64>,
}

impl Measure {
    /// The measure of `bytes` moved in `seconds` by `coll` on `world` ranks.
    pub fn new(
        coll: Collective,
        world: usize,
        bytes: u64,
        seconds: f64,
        wrong: Option<u64>,
    ) -> Self {
        let algbw = if seconds > 0.0 {
            bytes as f64 / 1e9 / seconds
        } else {
            0.0
        };
        Measure {
            time_us: seconds * 1e6,
            algbw,
            busbw: algbw * bus_factor(coll, world),
            wrong,
        }
    }
}

/// One row of the table (and one object of the JSON output).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Collective name (`all_reduce`, ...).
    pub collective: &'static str,
    /// Number of ranks.
    pub world: usize,
    /// `size` column, bytes.
    pub size: u64,
    /// `count` column, elements.
    pub count: u64,
    /// `type` column (`float`, ...).
    pub dtype: &'static str,
    /// `redop` column (`sum`, ..., `none` for collectives without an operator).
    pub op: &'static str,
    /// `root` column, -1 for collectives without a root.
    pub root: i64,
    /// Out-of-place variant, `None` when the API has none (broadcast is in place).
    pub out_of_place: Option<Measure>,
    /// In-place variant, `None` when the API has none (reduce-scatter, all-gather, reduce).
    pub in_place: Option<Measure>,
}

impl Row {
    /// Wrong elements of both variants.
    pub fn wrong(&self) -> u64 {
        [self.out_of_place, self.in_place]
            .iter()
            .flatten()
            .filter_map(|m| m.wrong)
            .sum()
    }

    /// The bus bandwidth counted in the average: out-of-place, or in-place when the collective
    /// has no out-of-place variant.
    pub fn reported_busbw(&self) -> Option<f64> {
        self.out_of_place.or(self.in_place).map(|m| m.busbw)
    }
}

/// The table header, as nccl-tests prints it (three lines).
pub fn table_header() -> String {
    let mut s = String::new();
    s.push_str("#                                                              out-of-place                       in-place          \n");
    s.push_str("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
    s.push_str("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       \n");
    s
}

/// A time in microseconds in a 7-character field with nccl-tests' precision (2 decimals below
/// 100 us, 1 below 10 ms, none above).
pub fn format_time(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{us:7.0}")
    } else if us >= 100.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.2}")
    }
}

/// One table line (without its newline).
pub fn format_row(row: &Row) -> String {
    let mut s = format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}",
        row.size, row.count, row.dtype, row.op, row.root
    );
    for m in [row.out_of_place, row.in_place] {
        match m {
            Some(m) => {
                let wrong = m.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
                let _ = write!(
                    s,
                    "  {}  {:>6.2}  {:>6.2}  {:>5}",
                    format_time(m.time_us),
                    m.algbw,
                    m.busbw,
                    wrong
                );
            }
            None => {
                let _ = write!(
                    s,
                    "  {:>7}  {:>6}  {:>6}  {:>5}",
                    "N/A", "N/A", "N/A", "N/A"
                );
            }
        }
    }
    s
}

/// A number as C's `%g` prints it: 6 significant digits, trailing zeros dropped, exponent
/// notation below 1e-4 and from 1e6.
pub fn format_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return if x == 0.0 {
            "0".to_string()
        } else {
            x.to_string()
        };
    }
    let exp = x.abs().log10().floor() as i32;
    // Rounding to 6 digits can carry into the next power of ten (999999.5 -> 1e+06).
    let rounded: f64 = format!("{x:.5e}").parse().unwrap_or(x);
    let exp = if rounded.abs() >= 10f64.powi(exp + 1) {
        exp + 1
    } else {
        exp
    };
    if !(-4..6).contains(&exp) {
        let s = format!("{x:.5e}");
        let (mant, e) = s.split_once('e').unwrap_or((&s, "0"));
        let mant = trim_zeros(mant);
        let e: i32 = e.parse().unwrap_or(0);
        format!("{mant}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
    } else {
        let decimals = (5 - exp).max(0) as usize;
        trim_zeros(&format!("{x:.decimals$}")).to_string()
    }
}

fn trim_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

/// The footer: wrong values and the average bus bandwidth over the rows.
pub fn table_footer(rows: &[Row]) -> String {
    let wrong: u64 = rows.iter().map(Row::wrong).sum();
    let bws: Vec<f64> = rows.iter().filter_map(Row::reported_busbw).collect();
    let avg = if bws.is_empty() {
        0.0
    } else {
        bws.iter().sum::<f64>() / bws.len() as f64
    };
    format!(
        "# Out of bounds values : {wrong} {}\n# Avg bus bandwidth    : {} \n#\n",
        if wrong == 0 { "OK" } else { "FAILED" },
        format_g(avg)
    )
}

/// The name of a data type list entry for the header (`float`, or `all`).
pub fn dtype_names(types: &[DataType]) -> String {
    types.iter().map(|t| t.name()).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_parsing() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("32M"), Ok(32 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("16mb"), Ok(16 << 20));
        assert_eq!(parse_size("0"), Ok(0));
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("12T").is_err());
        assert!(parse_size("1.5M").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }

    #[test]
    fn size_sequences() {
        assert_eq!(sizes(8, 64, 2, None), [8, 16, 32, 64]);
        assert_eq!(sizes(8, 100, 4, None), [8, 32]);
        assert_eq!(sizes(1024, 4096, 2, Some(1024)), [1024, 2048, 3072, 4096]);
        assert_eq!(sizes(0, 64, 2, None), [0]);
        assert_eq!(sizes(64, 8, 2, None), Vec::<u64>::new());
        assert_eq!(sizes(8, 8, 2, None), [8]);
    }

    #[test]
    fn shapes() {
        let s = Shape::new(Collective::AllReduce, 1024, 4, 3);
        assert_eq!(
            s,
            Shape {
                send: 256,
                recv: 256,
                param: 256
            }
        );
        assert_eq!(s.bytes(4), 1024);
        let s = Shape::new(Collective::AllGather, 1024, 4, 3);
        assert_eq!(
            s,
            Shape {
                send: 85,
                recv: 255,
                param: 85
            }
        );
        assert_eq!(s.bytes(4), 1020);
        let s = Shape::new(Collective::ReduceScatter, 1024, 4, 3);
        assert_eq!(
            s,
            Shape {
                send: 255,
                recv: 85,
                param: 85
            }
        );
        assert_eq!(s.bytes(4), 1020);
        let s = Shape::new(Collective::Broadcast, 7, 2, 8);
        assert_eq!(
            s,
            Shape {
                send: 3,
                recv: 3,
                param: 3
            }
        );
        assert_eq!(Shape::new(Collective::AllGather, 8, 4, 4).param, 0);
    }

    #[test]
    fn bus_factors() {
        assert_eq!(bus_factor(Collective::AllReduce, 4), 1.5);
        assert_eq!(bus_factor(Collective::AllReduce, 1), 0.0);
        assert_eq!(bus_factor(Collective::ReduceScatter, 4), 0.75);
        assert_eq!(bus_factor(Collective::AllGather, 2), 0.5);
        assert_eq!(bus_factor(Collective::Broadcast, 8), 1.0);
        assert_eq!(bus_factor(Collective::Reduce, 8), 1.0);
        let m = Measure::new(Collective::AllReduce, 2, 1_000_000, 1e-3, Some(0));
        assert!((m.algbw - 1.0).abs() < 1e-12);
        assert!((m.busbw - 1.0).abs() < 1e-12);
        assert!((m.time_us - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn times() {
        assert_eq!(format_time(12.345), "  12.35");
        assert_eq!(format_time(123.45), "  123.5");
        assert_eq!(format_time(12345.6), "  12346");
        assert_eq!(format_time(1234567.0), "1234567");
    }

    #[test]
    fn percent_g() {
        assert_eq!(format_g(0.0), "0");
        assert_eq!(format_g(1.5), "1.5");
        assert_eq!(format_g(12.345678), "12.3457");
        assert_eq!(format_g(0.000123456), "0.000123456");
        assert_eq!(format_g(0.0000123456), "1.23456e-05");
        assert_eq!(format_g(123456.0), "123456");
        assert_eq!(format_g(1234567.0), "1.23457e+06");
        assert_eq!(format_g(999999.6), "1e+06");
    }

    fn row(oop: Option<Measure>, ip: Option<Measure>) -> Row {
        Row {
            collective: "all_reduce",
            world: 2,
            size: 1048576,
            count: 262144,
            dtype: "float",
            op: "sum",
            root: -1,
            out_of_place: oop,
            in_place: ip,
        }
    }

    #[test]
    fn table_lines() {
        let header = table_header();
        let cols: Vec<&str> = header.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                "time", "algbw", "busbw", "#wrong"
            ]
        );
        let m = Measure {
            time_us: 251.3,
            algbw: 4.17,
            busbw: 4.17,
            wrong: Some(0),
        };
        let r = row(Some(m), Some(Measure { wrong: None, ..m }));
        let line = format_row(&r);
        assert_eq!(
            line,
            "     1048576        262144     float     sum      -1    251.3    4.17    4.17      0    251.3    4.17    4.17    N/A"
        );
        // The columns line up with the header's.
        let header_line = header.lines().nth(1).unwrap();
        assert_eq!(line.len(), header_line.len());
        assert_eq!(
            line.find("    -1").unwrap() + 6,
            header_line.find("root").unwrap() + 4
        );
        let na = format_row(&row(None, Some(m)));
        assert!(
            na.contains("      N/A     N/A     N/A    N/A    251.3"),
            "{na}"
        );
        assert_eq!(na.len(), header_line.len());
    }

    #[test]
    fn footer() {
        let m = |busbw, wrong| Measure {
            time_us: 1.0,
            algbw: 1.0,
            busbw,
            wrong: Some(wrong),
        };
        let rows = [
            row(Some(m(2.0, 0)), Some(m(9.0, 0))),
            row(Some(m(4.0, 0)), None),
        ];
        assert_eq!(
            table_footer(&rows),
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 3 \n#\n"
        );
        let rows = [row(None, Some(m(5.0, 3))), row(Some(m(1.0, 2)), None)];
        assert_eq!(
            table_footer(&rows),
            "# Out of bounds values : 5 FAILED\n# Avg bus bandwidth    : 3 \n#\n"
        );
        assert!(table_footer(&[]).contains(": 0 OK"));
    }

    #[test]
    fn json_row() {
        let m = Measure {
            time_us: 2.5,
            algbw: 1.0,
            busbw: 1.0,
            wrong: Some(0),
        };
        let v = serde_json::to_value(row(Some(m), None)).unwrap();
        assert_eq!(v["collective"], "all_reduce");
        assert_eq!(v["dtype"], "float");
        assert_eq!(v["op"], "sum");
        assert_eq!(v["world"], 2);
        assert_eq!(v["root"], -1);
        assert_eq!(v["out_of_place"]["time_us"], 2.5);
        assert_eq!(v["out_of_place"]["wrong"], 0);
        assert!(v["in_place"].is_null());
    }
}
