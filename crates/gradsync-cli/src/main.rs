//! The `gradsync` command.
//!
//! - `gradsync launch --nproc N [--nnodes M --node-rank R --master HOST:PORT] [--no-prefix] --
//!   CMD ARGS...` starts the local ranks of a job with the torchrun environment variables
//!   (see [`launch`]).
//! - `gradsync bench [all_reduce|reduce_scatter|all_gather|broadcast|reduce] [nccl-tests flags]
//!   [--json FILE] [--nproc N]` measures a collective and prints the nccl-tests table (see
//!   [`mod@bench`]).
//! - `gradsync train [--nproc N] [--accum K] [--steps S] [--batch B] [--bench-overlap] ...`
//!   trains an MLP on Fashion-MNIST with data-parallel ranks (see [`mod@train`]).
//! - `gradsync doctor [--size B] [--iters N] [--threshold F] [--nproc N]` measures every rank
//!   pair's link, prints the matrices with MTU and NUMA placement, and names slow links (see
//!   [`mod@doctor`]).
//! - `gradsync flight FILE|DIR...` reads the flight-recorder dumps of several ranks and names
//!   the rank that is behind (see [`mod@flight`]).
//! - `gradsync scale [--alpha-us A] [--gbit G] [--worlds 8,16,...] [--min-bytes B]
//!   [--max-bytes B] [--factor F] [--segment-bytes B] [--max-ops N] [--jobs N] [--json FILE]`
//!   predicts every all-reduce algorithm's time from 8 to 4096 ranks with the simulator and
//!   prints where they cross (see [`mod@scale`]).
//!
//! The ranks of `gradsync bench` log as `GRADSYNC_DEBUG`, `GRADSYNC_DEBUG_SUBSYS` and
//! `GRADSYNC_DEBUG_FILE` say (see `gradsync::logging`); the launcher itself only writes its own
//! messages to stderr.

mod bench;
mod check;
mod doctor;
mod explain;
mod flight;
mod launch;
mod scale;
mod table;
mod train;

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// Command line of `gradsync`.
#[derive(Debug, Parser)]
#[command(
    name = "gradsync",
    version,
    about = "Collective communication for data-parallel training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Start the local ranks of a job with torchrun environment variables.
    Launch(LaunchArgs),
    /// Measure a collective as nccl-tests does.
    Bench(bench::BenchArgs),
    /// Train an MLP classifier on Fashion-MNIST with data-parallel ranks.
    Train(train::TrainArgs),
    /// Read flight-recorder dumps of several ranks and name the rank that is behind.
    Flight(flight::FlightArgs),
    /// Measure bandwidth and latency of every rank pair and name the slow links.
    Doctor(doctor::DoctorArgs),
    /// Predict every all-reduce algorithm's time for many world sizes under a link model, and
    /// where they cross.
    Scale(scale::ScaleArgs),
}

/// Options of `gradsync launch`.
#[derive(Debug, clap::Args)]
struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(long, alias = "nproc-per-node", alias = "nproc_per_node")]
    nproc: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// Index of this node, 0..nnodes.
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    node_rank: usize,
    /// HOST:PORT of the rendezvous store hosted by rank 0 (required with --nnodes > 1;
    /// default 127.0.0.1 and a free port).
    #[arg(long)]
    master: Option<String>,
    /// Do not prefix output lines with `[rank] `.
    #[arg(long)]
    no_prefix: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 3.0)]
    grace_secs: f64,
    /// Seconds the other ranks get to exit on their own after one fails (they report what they
    /// saw) before they are stopped.
    #[arg(long, default_value_t = 3.0)]
    failure_wait_secs: f64,
    /// CPU binding: `spread` gives each local rank an equal, separate share of the launcher's
    /// CPUs when there are at least as many as ranks (as mpirun binds); `none` binds nothing.
    #[arg(long, value_enum, default_value_t = launch::Bind::None)]
    bind: launch::Bind,
    /// The command every rank runs, and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    command: Vec<OsString>,
}

fn run_launch(args: &LaunchArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(
        args.grace_secs.is_finite() && args.grace_secs >= 0.0,
        "--grace-secs must be a non-negative number"
    );
    anyhow::ensure!(
        args.failure_wait_secs.is_finite() && args.failure_wait_secs >= 0.0,
        "--failure-wait-secs must be a non-negative number"
    );
    let opts = launch::LaunchOptions {
        nproc: args.nproc,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master: args.master.clone(),
        prefix: !args.no_prefix,
        grace: Duration::from_secs_f64(args.grace_secs),
        failure_wait: Duration::from_secs_f64(args.failure_wait_secs),
        bind: args.bind,
    };
    let (program, rest) = args.command.split_first().expect("clap requires a command");
    launch::launch(&opts, program, rest)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Launch(args) => run_launch(args),
        Command::Bench(args) => bench::run(args),
        Command::Train(args) => train::run(args),
        Command::Flight(args) => flight::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Scale(args) => scale::run(args),
    };
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("gradsync: error: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes joined by `: `, leaving out a cause whose text the message before
/// it already contains (library errors carry their cause's text in their own message).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
