//! `gradsync bench --compare ALGOS`: all-reduce algorithms side by side in one run.
//!
//! On a shared or oversubscribed machine, separate runs of the benchmark differ by more than
//! the algorithms do. Here the algorithms take turns inside one communicator: for every size,
//! each of `--rounds` rounds times a block of `-n` calls of every algorithm in turn, each round
//! starting one algorithm further along the list (after
//! `-w` warm-up calls of each), so that all of them see the same conditions. A block's time is
//! the slowest rank's; the table gives every algorithm's median block time per call, the
//! fastest forced algorithm, and `auto` (the automatic choice, eager included) against it.
//!
//! The inputs are those of `-c 1` ([`crate::check`]): after its timed rounds every entry makes one
//! more call whose output is checked on every rank; an entry with wrong elements shows
//! `wrong:N` in place of its time, is never the fastest, and makes the command fail.
//!
//! With `--tune`, rank 0 then adds every size's forced medians, as one more run, to the
//! communicator's cost file ([`gradsync::cost::Measured`]): later automatic choices on the same
//! layout of ranks take the algorithm with the least median over the recorded runs in place of
//! the model's prediction.

use std::io::Write;
use std::time::Instant;

use crate::check::{self, total_wrong};
use anyhow::Context;
use gradsync::cost::median;
use gradsync::{Algorithm, Collective, Communicator, ReduceOp};

/// An entry of `--compare`: `auto` or a forced algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The automatic choice.
    Auto,
    /// One algorithm, forced.
    Forced(Algorithm),
}

impl Choice {
    fn name(self) -> &'static str {
        match self {
            Choice::Auto => "auto",
            Choice::Forced(a) => a.name(),
        }
    }
}

/// Parses `--compare`: a comma-separated list of `auto` and all-reduce algorithm names.
pub fn parse(s: &str) -> anyhow::Result<Vec<Choice>> {
    let mut v = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let c = if item.eq_ignore_ascii_case("auto") {
            Choice::Auto
        } else {
            Choice::Forced(Algorithm::parse(item)?)
        };
        if !v.contains(&c) {
            v.push(c);
        }
    }
    anyhow::ensure!(!v.is_empty(), "--compare needs at least one algorithm");
    Ok(v)
}

/// One size of a comparison: every entry's median seconds per call, in the order of the list.
pub struct SizeMedians {
    /// Bytes per rank.
    pub bytes: u64,
    /// Median seconds per call of each entry.
    pub median_s: Vec<f64>,
    /// Wrong output elements of each entry's checked call, summed over ranks.
    pub wrong: Vec<u64>,
}

impl SizeMedians {
    /// Whether every entry's output was right.
    pub fn all_right(&self) -> bool {
        self.wrong.iter().all(|&w| w == 0)
    }
}

/// The fastest forced entry whose output was right (its index), if any.
pub fn fastest(choices: &[Choice], median_s: &[f64], wrong: &[u64]) -> Option<usize> {
    (0..choices.len())
        .filter(|&k| matches!(choices[k], Choice::Forced(_)) && wrong[k] == 0)
        .min_by(|&a, &b| median_s[a].total_cmp(&median_s[b]))
}

/// Runs the comparison of f32 sum all-reduces over `sizes` (bytes) and prints it on rank 0,
/// which also returns the medians (the other ranks return nothing).
pub fn run(
    comm: &mut Communicator,
    choices: &[Choice],
    sizes: &[u64],
    iters: u32,
    warmup: u32,
    rounds: u32,
) -> anyhow::Result<Vec<SizeMedians>> {
    let rank = comm.rank();
    let mut results = Vec::new();
    let mut out = std::io::stdout();
    if rank == 0 {
        writeln!(
            out,
            "# compare: float sum all-reduce, out of place, {rounds} rounds of {iters} calls per algorithm and size, taking turns in a rotating order; median time per call (us), slowest rank"
        )?;
        let mut head = format!("# {:>12}", "size");
        for c in choices {
            head += &format!(" {:>18}", c.name());
        }
        head += &format!(" {:>18} {:>12}", "best forced", "auto / best");
        writeln!(out, "{head}")?;
        out.flush()?;
    }
    for &bytes in sizes {
        let count = (bytes as usize / 4).max(1);
        let world = comm.world_size();
        let mut input = vec![0f32; count];
        check::fill_input(
            &mut input,
            Collective::AllReduce,
            ReduceOp::Sum,
            world,
            rank,
            0,
        );
        let mut output = vec![0f32; count];
        let call =
            |comm: &mut Communicator, c: Choice, output: &mut [f32]| -> gradsync::Result<()> {
                comm.set_algorithm(match c {
                    Choice::Auto => None,
                    Choice::Forced(a) => Some(a),
                })?;
                comm.all_reduce_into(&input, output, ReduceOp::Sum)
            };
        for &c in choices {
            for _ in 0..warmup {
                call(comm, c, &mut output)?;
            }
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); choices.len()];
        for round in 0..rounds as usize {
            // Each round starts with the next algorithm, so none always runs first (after the
            // barrier) or always follows the same one.
            for j in 0..choices.len() {
                let k = (round + j) % choices.len();
                let c = choices[k];
                comm.barrier()?;
                let t = Instant::now();
                for _ in 0..iters {
                    call(comm, c, &mut output)?;
                }
                let mut secs = [t.elapsed().as_secs_f64() / f64::from(iters)];
                comm.set_algorithm(None)?;
                comm.all_reduce(&mut secs, ReduceOp::Max)
                    .context("all_reduce of the times")?;
                times[k].push(secs[0]);
            }
        }
        // One checked call of each entry, from a cleared output.
        let mut wrong = Vec::with_capacity(choices.len());
        for &c in choices {
            output.fill(0.0);
            call(comm, c, &mut output)?;
            let local = check::count_wrong(
                &output,
                Collective::AllReduce,
                ReduceOp::Sum,
                world,
                rank,
                0,
            );
            comm.set_algorithm(None)?;
            wrong.push(total_wrong(comm, local)?);
        }
        comm.set_algorithm(None)?;
        if rank != 0 {
            results.push(SizeMedians {
                bytes,
                median_s: Vec::new(),
                wrong,
            });
            continue;
        }
        let med: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
        let mut line = format!("  {bytes:>12}");
        for (m, w) in med.iter().zip(&wrong) {
            line += &match w {
                0 => format!(" {:>18.1}", m * 1e6),
                w => format!(" {:>18}", format!("wrong:{w}")),
            };
        }
        let best = fastest(choices, &med, &wrong);
        let auto = choices.iter().position(|&c| c == Choice::Auto);
        match (best, auto) {
            (Some(b), Some(a)) if wrong[a] == 0 => {
                line += &format!(" {:>18} {:>12.2}", choices[b].name(), med[a] / med[b]);
            }
            (Some(b), _) => line += &format!(" {:>18} {:>12}", choices[b].name(), "-"),
            _ => line += &format!(" {:>18} {:>12}", "-", "-"),
        }
        let ran = comm
            .algorithm_for(Collective::AllReduce, bytes as usize)
            .map_or("eager", Algorithm::name);
        writeln!(out, "{line}  (auto runs {ran})")?;
        out.flush()?;
        results.push(SizeMedians {
            bytes,
            median_s: med,
            wrong,
        });
    }
    Ok(results)
}

/// Records the forced algorithms' medians of `results` (measured with `choices` on `comm`) in
/// the communicator's cost file as one more tuning run of each size
/// ([`gradsync::cost::LinkCosts::record`]); returns the file and the number of sizes recorded.
/// An algorithm whose output was wrong is not recorded. Run on rank 0.
pub fn tune(
    comm: &Communicator,
    choices: &[Choice],
    results: &[SizeMedians],
) -> anyhow::Result<(std::path::PathBuf, usize)> {
    let path = comm.cost_file().map(std::path::Path::to_path_buf).context(
        "--tune: the cost model is in no file (GRADSYNC_CALIBRATE=off without a cached model, or no home directory); set GRADSYNC_COST_FILE",
    )?;
    let mut links =
        gradsync::cost::LinkCosts::load(&path).unwrap_or_else(|_| comm.cost_model().0.clone());
    for r in results {
        let run: Vec<(String, f64)> = choices
            .iter()
            .zip(&r.median_s)
            .zip(&r.wrong)
            .filter_map(|((c, &t), &w)| match *c {
                // Rounded as the table prints it (to even on a tie), so the file and the
                // table agree to the last digit.
                Choice::Forced(a) if w == 0 => Some((
                    a.name().to_string(),
                    format!("{:.1}", t * 1e6).parse().unwrap_or(t * 1e6),
                )),
                _ => None,
            })
            .collect();
        links.record(comm.world_size(), comm.local_size(), r.bytes as usize, &run);
    }
    links
        .save(&path)
        .with_context(|| format!("--tune: cannot write {}", path.display()))?;
    Ok((path, results.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_list() {
        let v = parse("auto, ring,rd,auto").unwrap();
        assert_eq!(
            v,
            [
                Choice::Auto,
                Choice::Forced(Algorithm::Ring),
                Choice::Forced(Algorithm::RecursiveDoubling)
            ]
        );
        assert!(
            parse("ring,bogus")
                .unwrap_err()
                .to_string()
                .contains("bogus")
        );
        assert!(parse(" , ").is_err());
    }

    #[test]
    fn a_wrong_algorithm_is_never_the_fastest() {
        let choices = parse("auto,ring,tree,rd").unwrap();
        let med = [1.0, 3.0, 1.5, 2.0];
        assert_eq!(fastest(&choices, &med, &[0, 0, 0, 0]), Some(2));
        assert_eq!(fastest(&choices, &med, &[0, 0, 7, 0]), Some(3));
        assert_eq!(fastest(&choices, &med, &[0, 1, 7, 1]), None);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
