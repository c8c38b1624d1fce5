//! `gradsync bench`: the nccl-tests performance tests on gradsync.
//!
//! The flags are those of nccl-tests (`-b`, `-e`, `-f`, `-i`, `-n`, `-w`, `-c`, `-d`, `-o`,
//! `-r`), and so is the table, printed by rank 0 only (see [`crate::table`] for the columns and
//! the bandwidth formulas). Each row runs `-w` warm-up calls, a barrier, then `-n` timed calls;
//! the time is the average per call, the maximum over ranks. With `-c 1` one more call follows
//! on inputs from [`crate::check`], and every output element is compared bit for bit with its
//! expected value; `#wrong` is the number of wrong elements summed over ranks, and any wrong
//! element makes the command exit non-zero.
//!
//! The API has an out-of-place and an in-place all-reduce, an in-place broadcast only, and
//! out-of-place reduce-scatter, all-gather and reduce only: the variant a collective lacks
//! shows `N/A`. `Avg bus bandwidth` averages the out-of-place rows (in-place for broadcast).
//!
//! Under torchrun variables (from `gradsync launch`, torchrun, Slurm or Open MPI) the process is
//! one rank and joins with [`Communicator::from_env`]. Otherwise, or with `--nproc N`, it starts
//! itself as N ranks (1 by default) through [`crate::launch::launch`].

mod compare;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::ValueEnum;
use gradsync::{Collective, Communicator, DataType, ReduceOp};

use crate::check::{self, CheckElem};
use crate::launch::{self, LaunchOptions};
use crate::table::{self, Measure, Row, Shape};

/// The collective a bench runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CollArg {
    /// All-reduce (out-of-place and in-place).
    #[value(name = "all_reduce", alias = "all-reduce", alias = "allreduce")]
    AllReduce,
    /// Reduce-scatter (out-of-place).
    #[value(
        name = "reduce_scatter",
        alias = "reduce-scatter",
        alias = "reducescatter"
    )]
    ReduceScatter,
    /// All-gather (out-of-place).
    #[value(name = "all_gather", alias = "all-gather", alias = "allgather")]
    AllGather,
    /// Broadcast (in-place).
    #[value(name = "broadcast")]
    Broadcast,
    /// Reduce (out-of-place).
    #[value(name = "reduce")]
    Reduce,
    /// All-to-all (out-of-place): a block of `size / world` bytes to every rank.
    #[value(name = "all_to_all", alias = "all-to-all", alias = "alltoall")]
    AllToAll,
}

impl CollArg {
    /// The library's collective kind.
    pub fn collective(self) -> Collective {
        match self {
            CollArg::AllReduce => Collective::AllReduce,
            CollArg::ReduceScatter => Collective::ReduceScatter,
            CollArg::AllGather => Collective::AllGather,
            CollArg::Broadcast => Collective::Broadcast,
            CollArg::Reduce => Collective::Reduce,
            CollArg::AllToAll => Collective::AllToAll,
        }
    }
}

/// Options of `gradsync bench`, named as nccl-tests names them.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Collective to measure.
    #[arg(value_enum, default_value = "all_reduce")]
    pub collective: CollArg,
    /// Smallest message size in bytes (K, M, G suffixes are powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = table::parse_size)]
    pub minbytes: u64,
    /// Largest message size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = table::parse_size)]
    pub maxbytes: u64,
    /// Factor between consecutive sizes (ignored with --stepbytes).
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub stepfactor: u64,
    /// Increment between consecutive sizes, instead of a factor.
    #[arg(short = 'i', long = "stepbytes", value_parser = table::parse_size)]
    pub stepbytes: Option<u64>,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Warm-up iterations per size (not timed).
    #[arg(
        short = 'w',
        long = "warmup_iters",
        alias = "warmup-iters",
        default_value_t = 5
    )]
    pub warmup_iters: u32,
    /// Validate results bit for bit (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub check: u8,
    /// Data type: float, double, half, bfloat16, int32, int64, uint8, or all.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub datatype: String,
    /// Reduction operator: sum, prod, min, max, avg, band, bor, bxor, or all (ignored by
    /// all_gather and broadcast). The bitwise band, bor and bxor take the integer data types
    /// only: with `-d all` or `-o all` the float x bitwise pairs are left out, and a float type
    /// with a bitwise operator and nothing else is an error.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Root rank of broadcast and reduce.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Also write the rows as a JSON array to this file (rank 0).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Start this many local ranks (through the launcher) instead of joining a running job.
    #[arg(long)]
    pub nproc: Option<usize>,
    /// When ranks die, the survivors shrink the communicator to themselves and go on measuring
    /// (a drill of failure recovery; rank 0 must survive, it hosts the store).
    #[arg(long)]
    pub shrink_on_failure: bool,
    /// After the table, print the alpha-beta cost model's predicted time of every all-reduce
    /// algorithm next to the measured time and the automatic choice (the model the communicator
    /// settled at init: pinned in `GRADSYNC_COST_FILE`, cached per host, or measured).
    #[arg(long)]
    pub explain: bool,
    /// Instead of the table, compare all-reduce algorithms side by side (`auto` and algorithm
    /// names, comma-separated, for example `auto,ring,rabenseifner,tree`): for every size they
    /// take turns in `--rounds` rounds of `-n` calls each, and the median per call is printed.
    #[arg(long, value_name = "ALGOS")]
    pub compare: Option<String>,
    /// Rounds of `--compare`.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// With `--compare`: add every size's medians of the forced algorithms, as one more run, to
    /// the cost file (the per-host cache, or `GRADSYNC_COST_FILE`). Later runs with the same
    /// world and ranks per host then take, for those size classes, the algorithm with the least
    /// median over the last 5 recorded runs instead of the model's prediction.
    #[arg(long, requires = "compare")]
    pub tune: bool,
    /// Before the first size, every rank runs 8-byte all-reduces for this many milliseconds
    /// (0: none), so that nothing is timed while the processes are still being placed on cores
    /// and warming up: without it the first size measures slower than the same size measured
    /// later in the run.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub settle: u64,
}

/// Parses `-d`: one data type, or `all`.
pub fn parse_dtypes(s: &str) -> anyhow::Result<Vec<DataType>> {
    if s.eq_ignore_ascii_case("all") {
        return Ok(DataType::ALL.to_vec());
    }
    Ok(vec![DataType::parse(s)?])
}

/// Parses `-o`: one operator, or `all`.
pub fn parse_ops(s: &str) -> anyhow::Result<Vec<ReduceOp>> {
    if s.eq_ignore_ascii_case("all") {
        return Ok(ReduceOp::ALL.to_vec());
    }
    Ok(vec![ReduceOp::parse(s)?])
}

/// The command line of `args` without its `--nproc N` / `--nproc=N` option.
pub fn strip_nproc(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip_next = false;
    for a in args {
        if std::mem::take(&mut skip_next) {
            continue;
        }
        if a == "--nproc" {
            skip_next = true;
        } else if !a.to_string_lossy().starts_with("--nproc=") {
            out.push(a.clone());
        }
    }
    out
}

/// Starts `nproc` local ranks running this same command line (without its `--nproc`), as
/// `gradsync launch --nproc N` would; returns the launcher's exit code.
pub(crate) fn launch_self(nproc: usize) -> anyhow::Result<i32> {
    let exe = std::env::current_exe().context("cannot find the gradsync executable")?;
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut opts = LaunchOptions::single_node(nproc);
    opts.prefix = false;
    launch::launch(&opts, exe.as_os_str(), &strip_nproc(&argv))
}

/// Whether this process was started as one rank of a job (torchrun, Slurm `srun`, Open MPI).
pub(crate) fn in_job() -> bool {
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    set("RANK")
        || set("OMPI_COMM_WORLD_RANK")
        || set("PMI_RANK")
        || (set("SLURM_PROCID") && set("SLURM_STEP_ID"))
}

/// What a bench run does, checked before any rank starts.
struct Plan {
    coll: Collective,
    /// The data types that have at least one of `ops`.
    dtypes: Vec<DataType>,
    /// `None` for collectives without an operator.
    ops: Vec<Option<ReduceOp>>,
    sizes: Vec<u64>,
}

/// Whether a row of `dtype` with `op` is measured: every type takes every operator except a
/// bitwise one over a float type (and collectives without an operator, `None`, take any type).
fn runs(dtype: DataType, op: Option<ReduceOp>) -> bool {
    op.is_none_or(|op| op.supports(dtype))
}

fn plan(args: &BenchArgs) -> anyhow::Result<Plan> {
    let coll = args.collective.collective();
    let mut dtypes = parse_dtypes(&args.datatype)?;
    let ops: Vec<Option<ReduceOp>> = if table::has_op(coll) {
        parse_ops(&args.op)?.into_iter().map(Some).collect()
    } else {
        vec![None]
    };
    if let ([dtype], [Some(op)]) = (&dtypes[..], &ops[..]) {
        ensure!(
            op.supports(*dtype),
            "--op {op} is a bitwise operator, defined for the integer data types only \
             (int32, int64, uint8), not for --datatype {dtype}"
        );
    }
    dtypes.retain(|&d| ops.iter().any(|&op| runs(d, op)));
    ensure!(
        args.stepbytes.is_some() || args.stepfactor >= 2,
        "--stepfactor must be at least 2 (or give --stepbytes)"
    );
    ensure!(args.stepbytes != Some(0), "--stepbytes must be positive");
    ensure!(
        args.minbytes <= args.maxbytes,
        "--minbytes {} is larger than --maxbytes {}",
        args.minbytes,
        args.maxbytes
    );
    let sizes = table::sizes(
        args.minbytes,
        args.maxbytes,
        args.stepfactor,
        args.stepbytes,
    );
    ensure!(args.nproc != Some(0), "--nproc must be at least 1");
    if let (true, Some(list)) = (args.tune, &args.compare) {
        ensure!(
            compare::parse(list)?
                .iter()
                .any(|c| *c != compare::Choice::Auto),
            "--tune needs at least one forced algorithm in --compare"
        );
    }
    if let Some(n) = args.nproc
        && table::has_root(coll)
    {
        ensure!(
            args.root < n,
            "--root {} is out of range for {n} ranks",
            args.root
        );
    }
    Ok(Plan {
        coll,
        dtypes,
        ops,
        sizes,
    })
}

/// Runs `gradsync bench`; returns the exit code.
pub fn run(args: &BenchArgs) -> anyhow::Result<i32> {
    let plan = plan(args)?;
    if args.nproc.is_some() || !in_job() {
        return launch_self(args.nproc.unwrap_or(1));
    }
    gradsync::logging::init_from_env();
    let mut comm = Communicator::from_env().context("cannot join the job")?;
    gradsync::logging::set_rank(comm.rank());
    run_rank(args, &plan, &mut comm)
}

/// Header lines naming the run and every rank.
fn header(args: &BenchArgs, plan: &Plan, comm: &mut Communicator) -> anyhow::Result<String> {
    let world = comm.world_size();
    const HOST_LEN: usize = 64;
    let mut me = [0u8; HOST_LEN];
    let host = hostname();
    let n = host.len().min(HOST_LEN);
    me[..n].copy_from_slice(&host.as_bytes()[..n]);
    let mut hosts = vec![0u8; HOST_LEN * world];
    comm.all_gather(&me, &mut hosts)
        .context("all_gather of host names")?;
    let mut pids = vec![0i64; world];
    comm.all_gather(&[i64::from(std::process::id())], &mut pids)
        .context("all_gather of process ids")?;

    let step = match args.stepbytes {
        Some(b) => format!("{b}(bytes)"),
        None => format!("{}(factor)", args.stepfactor),
    };
    let mut s = format!(
        "# gradsync {} bench {}: {}\n",
        gradsync::VERSION,
        plan.coll,
        table::dtype_names(&plan.dtypes)
    );
    s += &format!(
        "# nRanks {world} minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} validation: {}\n",
        args.minbytes, args.maxbytes, args.warmup_iters, args.iters, args.check
    );
    s += "#\n# Using ranks\n";
    for (r, (pid, host)) in pids.iter().zip(hosts.chunks(HOST_LEN)).enumerate() {
        let end = host.iter().position(|&b| b == 0).unwrap_or(host.len());
        let host = String::from_utf8_lossy(&host[..end]);
        s += &format!("#  Rank {r:>2} Pid {pid:>6} on {host:>10}\n");
    }
    s += "#\n";
    Ok(s)
}

/// The host name of this machine, up to its first dot.
fn hostname() -> String {
    let full = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let short = full.split('.').next().unwrap_or("").to_string();
    if short.is_empty() {
        "localhost".to_string()
    } else {
        short
    }
}

/// Calls `$f::<T>($args)` with `T` the element type of the runtime data type `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DataType::F32 => $f::<f32>($($arg),*),
            DataType::F64 => $f::<f64>($($arg),*),
            DataType::F16 => $f::<half::f16>($($arg),*),
            DataType::Bf16 => $f::<half::bf16>($($arg),*),
            DataType::I32 => $f::<i32>($($arg),*),
            DataType::I64 => $f::<i64>($($arg),*),
            DataType::U8 => $f::<u8>($($arg),*),
        }
    };
}

/// Runs 8-byte all-reduces on every rank until `time` has passed on one of them (the ranks
/// agree through the all-reduce, a max of "done" flags).
fn settle(comm: &mut Communicator, time: Duration) -> anyhow::Result<()> {
    if time.is_zero() || comm.world_size() < 2 {
        return Ok(());
    }
    let start = Instant::now();
    loop {
        let mut done = [i64::from(start.elapsed() >= time)];
        comm.all_reduce(&mut done, ReduceOp::Max)
            .context("all_reduce of --settle")?;
        if done[0] == 1 {
            return Ok(());
        }
    }
}

/// The bench on one rank of a running job; returns the exit code.
fn run_rank(args: &BenchArgs, plan: &Plan, comm: &mut Communicator) -> anyhow::Result<i32> {
    let world = comm.world_size();
    let rank = comm.rank();
    if table::has_root(plan.coll) {
        ensure!(
            args.root < world,
            "--root {} is out of range for {world} ranks",
            args.root
        );
    }
    if rank == 0 && args.check == 1 && !check::avg_varies(world, 256) {
        eprintln!(
            "# note: at {world} ranks, avg inputs in bfloat16 and half are the same on both ranks of a pair (exactness)"
        );
    }
    settle(comm, Duration::from_millis(args.settle))?;
    if let Some(list) = &args.compare {
        ensure!(
            plan.coll == Collective::AllReduce,
            "--compare compares all-reduce algorithms only"
        );
        let choices = compare::parse(list)?;
        let head = header(args, plan, comm)?;
        if rank == 0 {
            std::io::stdout().write_all(head.as_bytes())?;
        }
        let results = compare::run(
            comm,
            &choices,
            &plan.sizes,
            args.iters,
            args.warmup_iters,
            args.rounds,
        )?;
        if args.tune && rank == 0 {
            let (path, n) = compare::tune(comm, &choices, &results)?;
            println!(
                "# tune: recorded the fastest algorithm of {n} sizes on {} ranks in {}",
                comm.world_size(),
                path.display()
            );
        }
        let right = results.iter().all(compare::SizeMedians::all_right);
        if !right && rank == 0 {
            eprintln!("# compare: some algorithm's output was wrong (wrong:N in the table)");
        }
        return Ok(i32::from(!right));
    }
    let head = header(args, plan, comm)?;
    let mut out = std::io::stdout();
    if rank == 0 {
        out.write_all(head.as_bytes())?;
        out.write_all(table::table_header().as_bytes())?;
        out.flush()?;
    }
    let mut rows = Vec::new();
    let mut explained = Vec::new();
    for &dtype in &plan.dtypes {
        for &op in plan.ops.iter().filter(|&&op| runs(dtype, op)) {
            for &bytes in &plan.sizes {
                let cfg = RowConfig {
                    coll: plan.coll,
                    op,
                    root: args.root,
                    warmup: args.warmup_iters,
                    iters: args.iters,
                    check: args.check == 1,
                    bytes,
                };
                let context = || {
                    format!(
                        "{} of {bytes} bytes of {dtype} ({})",
                        plan.coll,
                        op.map_or("none", ReduceOp::name)
                    )
                };
                let row = loop {
                    match dispatch!(dtype, measure(comm, &cfg)) {
                        Ok(row) => break row,
                        Err(e) if args.shrink_on_failure => {
                            let failed = comm.failed_ranks(Duration::from_secs(5));
                            if failed.is_empty() {
                                return Err(e.context(context()));
                            }
                            let old = comm.rank();
                            let smaller = comm
                                .shrink(&failed)
                                .with_context(|| format!("shrinking without rank(s) {failed:?}"))?;
                            *comm = smaller;
                            eprintln!(
                                "# rank {old}: lost rank(s) {failed:?} ({}); continuing as rank {} of {}",
                                e.root_cause(),
                                comm.rank(),
                                comm.world_size()
                            );
                        }
                        Err(e) => return Err(e.context(context())),
                    }
                };
                let rank = comm.rank();
                if rank == 0 {
                    writeln!(out, "{}", table::format_row(&row))?;
                    out.flush()?;
                }
                if args.explain {
                    explained.push((dtype, row.clone()));
                }
                rows.push(row);
            }
        }
    }
    if rank == 0 {
        out.write_all(table::table_footer(&rows).as_bytes())?;
        if args.explain {
            out.write_all(crate::explain::render(comm, &explained)?.as_bytes())?;
        }
        out.flush()?;
        if let Some(path) = &args.json {
            let file = std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?;
            let mut w = std::io::BufWriter::new(file);
            serde_json::to_writer_pretty(&mut w, &rows)?;
            writeln!(w)?;
            w.flush()?;
        }
    }
    let wrong: u64 = rows.iter().map(Row::wrong).sum();
    Ok(i32::from(wrong > 0))
}

/// One row to measure.
struct RowConfig {
    coll: Collective,
    op: Option<ReduceOp>,
    root: usize,
    warmup: u32,
    iters: u32,
    check: bool,
    bytes: u64,
}

/// The out-of-place call of `coll` (none for broadcast, which is in place only).
fn out_of_place<T: CheckElem>(
    comm: &mut Communicator,
    cfg: &RowConfig,
    input: &[T],
    output: &mut [T],
) -> gradsync::Result<()> {
    let op = cfg.op.unwrap_or(ReduceOp::Sum);
    match cfg.coll {
        Collective::AllReduce => comm.all_reduce_into(input, output, op),
        Collective::ReduceScatter => comm.reduce_scatter(input, output, op),
        Collective::AllGather => comm.all_gather(input, output),
        Collective::Reduce => comm.reduce(input, output, op, cfg.root),
        Collective::AllToAll => comm.all_to_all(input, output),
        other => unreachable!("{other} has no out-of-place variant"),
    }
}

/// The in-place call of `coll` (all-reduce and broadcast only).
fn in_place<T: CheckElem>(
    comm: &mut Communicator,
    cfg: &RowConfig,
    buf: &mut [T],
) -> gradsync::Result<()> {
    match cfg.coll {
        Collective::AllReduce => comm.all_reduce(buf, cfg.op.unwrap_or(ReduceOp::Sum)),
        Collective::Broadcast => comm.broadcast(buf, cfg.root),
        other => unreachable!("{other} has no in-place variant"),
    }
}

/// Runs `warmup` untimed and `iters` timed calls of `f`; returns the seconds per call, the
/// maximum over ranks.
fn time_calls(
    comm: &mut Communicator,
    cfg: &RowConfig,
    mut f: impl FnMut(&mut Communicator) -> gradsync::Result<()>,
) -> anyhow::Result<f64> {
    for _ in 0..cfg.warmup {
        f(comm)?;
    }
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..cfg.iters {
        f(comm)?;
    }
    let elapsed: Duration = start.elapsed();
    let mut t = [elapsed.as_secs_f64() / f64::from(cfg.iters)];
    comm.all_reduce(&mut t, ReduceOp::Max)
        .context("all_reduce of the times")?;
    Ok(t[0])
}

/// Measures (and validates) one row with elements of type `T`.
fn measure<T: CheckElem>(comm: &mut Communicator, cfg: &RowConfig) -> anyhow::Result<Row> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let elem = T::DTYPE.size();
    let shape = Shape::new(cfg.coll, cfg.bytes, elem, world);
    let size = shape.bytes(elem);
    let op = cfg.op.unwrap_or(ReduceOp::Sum);
    let zero = T::from_small(0);
    let mut input = vec![zero; shape.send];
    check::fill_input(&mut input, cfg.coll, op, world, rank, cfg.root);

    let oop = if cfg.coll == Collective::Broadcast {
        None
    } else {
        let mut output = vec![zero; shape.recv];
        let secs = time_calls(comm, cfg, |c| out_of_place(c, cfg, &input, &mut output))?;
        let wrong = if cfg.check {
            output.fill(zero);
            out_of_place(comm, cfg, &input, &mut output)?;
            let local = check::count_wrong(&output, cfg.coll, op, world, rank, cfg.root);
            Some(check::total_wrong(comm, local)?)
        } else {
            None
        };
        Some(Measure::new(cfg.coll, world, size, secs, wrong))
    };

    let ip = if matches!(cfg.coll, Collective::AllReduce | Collective::Broadcast) {
        let mut buf = input.clone();
        let secs = time_calls(comm, cfg, |c| in_place(c, cfg, &mut buf))?;
        let wrong = if cfg.check {
            // The timed calls changed the buffer: start again from the inputs (zeros on the
            // ranks that receive a broadcast).
            buf.copy_from_slice(&input);
            in_place(comm, cfg, &mut buf)?;
            let local = check::count_wrong(&buf, cfg.coll, op, world, rank, cfg.root);
            Some(check::total_wrong(comm, local)?)
        } else {
            None
        };
        Some(Measure::new(cfg.coll, world, size, secs, wrong))
    } else {
        None
    };

    Ok(Row {
        collective: cfg.coll.name(),
        world,
        size,
        count: shape.param as u64,
        dtype: T::DTYPE.name(),
        op: cfg.op.map_or("none", ReduceOp::name),
        root: if table::has_root(cfg.coll) {
            cfg.root as i64
        } else {
            -1
        },
        out_of_place: oop,
        in_place: ip,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_of_wrong_elements_never_wraps_to_zero() {
        for locals in [[u64::MAX, u64::MAX], [i64::MAX as u64, 1], [0, 3]] {
            let cfg = gradsync::Config::new("unused:0", 0, 2);
            let totals: Vec<u64> = Communicator::mem_group(2, &cfg)
                .unwrap()
                .into_iter()
                .zip(locals)
                .map(|(mut c, local)| {
                    std::thread::spawn(move || check::total_wrong(&mut c, local).unwrap())
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect();
            let want = locals.iter().map(|&l| l.min(1 << 40)).sum::<u64>();
            assert_eq!(totals, [want, want], "{locals:?}");
        }
    }
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.bench)
    }

    #[test]
    fn defaults_are_nccl_tests_ones() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.collective, CollArg::AllReduce);
        assert_eq!((a.minbytes, a.maxbytes, a.stepfactor), (8, 32 << 20, 2));
        assert_eq!((a.iters, a.warmup_iters, a.check, a.root), (20, 5, 1, 0));
        assert_eq!(a.stepbytes, None);
        assert_eq!(a.datatype, "float");
        assert_eq!(a.op, "sum");
    }

    #[test]
    fn flags() {
        let a = parse(&[
            "all_gather",
            "-b",
            "1K",
            "-e",
            "1M",
            "-f",
            "4",
            "-n",
            "3",
            "-w",
            "0",
            "-c",
            "0",
            "-d",
            "all",
            "-o",
            "max",
            "-r",
            "1",
            "--json",
            "x.json",
            "--nproc",
            "2",
        ])
        .unwrap();
        assert_eq!(a.collective, CollArg::AllGather);
        assert_eq!((a.minbytes, a.maxbytes, a.stepfactor), (1024, 1 << 20, 4));
        assert_eq!((a.iters, a.warmup_iters, a.check, a.root), (3, 0, 0, 1));
        assert_eq!(a.nproc, Some(2));
        assert_eq!(parse(&["--warmup_iters", "7"]).unwrap().warmup_iters, 7);
        assert_eq!(parse(&["-i", "2M"]).unwrap().stepbytes, Some(2 << 20));
        assert_eq!(
            parse(&["reduce-scatter"]).unwrap().collective,
            CollArg::ReduceScatter
        );
        assert!(parse(&["-c", "2"]).is_err());
        assert!(parse(&["-n", "0"]).is_err());
        assert!(parse(&["-b", "1X"]).is_err());
        assert_eq!(parse(&["alltoall"]).unwrap().collective, CollArg::AllToAll);
        assert!(parse(&["alltoallw"]).is_err());
    }

    #[test]
    fn plans() {
        let p = plan(&parse(&["-d", "all", "-o", "all", "-b", "8", "-e", "64"]).unwrap()).unwrap();
        assert_eq!(p.dtypes.len(), 7);
        assert_eq!(p.ops.len(), 8);
        assert_eq!(p.sizes, [8, 16, 32, 64]);
        let p = plan(&parse(&["broadcast", "-o", "all"]).unwrap()).unwrap();
        assert_eq!(p.ops, [None]);
        assert!(plan(&parse(&["-d", "complex"]).unwrap()).is_err());
        assert!(plan(&parse(&["-o", "xor"]).unwrap()).is_err());
        // Bitwise operators take the integer types; with `all`, the other pairs are left out.
        let p = plan(&parse(&["-d", "int64", "-o", "bxor"]).unwrap()).unwrap();
        assert_eq!(
            (p.dtypes, p.ops),
            (vec![DataType::I64], vec![Some(ReduceOp::Bxor)])
        );
        let p = plan(&parse(&["-d", "all", "-o", "band"]).unwrap()).unwrap();
        assert_eq!(p.dtypes, [DataType::I32, DataType::I64, DataType::U8]);
        let p = plan(&parse(&["-d", "half", "-o", "all"]).unwrap()).unwrap();
        assert_eq!(p.dtypes, [DataType::F16]);
        assert!(!runs(DataType::F16, Some(ReduceOp::Bor)));
        assert!(runs(DataType::F16, Some(ReduceOp::Max)));
        assert!(runs(DataType::F16, None));
        let e = plan(&parse(&["-d", "float", "-o", "bor"]).unwrap())
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            "--op bor is a bitwise operator, defined for the integer data types only (int32, \
             int64, uint8), not for --datatype float"
        );
        // Collectives without an operator ignore it.
        let p = plan(&parse(&["all_gather", "-d", "float", "-o", "bxor"]).unwrap()).unwrap();
        assert_eq!((p.dtypes, p.ops), (vec![DataType::F32], vec![None]));
        assert!(plan(&parse(&["-f", "1"]).unwrap()).is_err());
        assert!(plan(&parse(&["-f", "1", "-i", "8"]).unwrap()).is_ok());
        assert!(plan(&parse(&["-b", "1M", "-e", "1K"]).unwrap()).is_err());
        assert!(plan(&parse(&["--nproc", "0"]).unwrap()).is_err());
        assert!(plan(&parse(&["reduce", "-r", "2", "--nproc", "2"]).unwrap()).is_err());
        assert!(plan(&parse(&["reduce", "-r", "1", "--nproc", "2"]).unwrap()).is_ok());
        assert!(plan(&parse(&["all_reduce", "-r", "7", "--nproc", "2"]).unwrap()).is_ok());
    }

    #[test]
    fn nproc_is_stripped() {
        let os = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            strip_nproc(&os(&["bench", "--nproc", "2", "-b", "8"])),
            os(&["bench", "-b", "8"])
        );
        assert_eq!(
            strip_nproc(&os(&["bench", "--nproc=4", "-e", "1M"])),
            os(&["bench", "-e", "1M"])
        );
        assert_eq!(strip_nproc(&os(&["bench"])), os(&["bench"]));
    }
}
