//! `gradsync launch`: starts the local ranks of a job with the torchrun environment.
//!
//! Every rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT` and `GRADSYNC_LAUNCHED=1`; rank 0 hosts the
//! rendezvous store at `MASTER_ADDR:MASTER_PORT`, so nothing else needs to be set up. On a
//! single node without `--master`, the store listens on `127.0.0.1` at a port the kernel picked
//! as free a moment before.
//!
//! Every rank also gets the job token `GRADSYNC_TOKEN`, which authenticates the store and
//! data connections: the launcher's own `GRADSYNC_TOKEN` when set, else, on a single node, a
//! fresh random 32-byte token (64 hex digits) read from `/dev/urandom`. Ranks on several nodes
//! must share one token, so with `--nnodes > 1` the launcher makes none: set the same
//! `GRADSYNC_TOKEN` for every node's launcher (without one the job runs unauthenticated and
//! warns).
//!
//! Each rank runs in its own process group with stdin closed, and its stdout and stderr lines
//! come out of the launcher's stdout and stderr prefixed with `[rank] ` (whole lines, so ranks
//! never interleave within a line; a line longer than 64 KiB is split). The launcher polls its
//! children every 10 ms:
//!
//! - when a rank exits non-zero or is killed by a signal, the launcher prints the rank and its
//!   status, sends `SIGTERM` to the process groups of the others, `SIGKILL` after the grace
//!   period, and exits with the first failing rank's code (128 + signal number for a signal);
//! - `SIGINT`, `SIGTERM` and `SIGHUP` sent to the launcher are forwarded to every rank's process
//!   group, escalated to `SIGKILL` after the grace period or at a second signal, and the
//!   launcher exits with 128 + the signal number;
//! - when every rank succeeds, the launcher exits 0.

use std::ffi::{OsStr, OsString};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

/// How often the launcher looks at its children and at pending signals.
const POLL: Duration = Duration::from_millis(10);
/// The longest piece of a line forwarded at once; longer lines are split.
const MAX_LINE: usize = 64 * 1024;
/// How long output of exited ranks may still drain (from descendants holding the pipes).
const DRAIN: Duration = Duration::from_secs(2);

/// What to launch, and where it sits in the job.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Ranks started on this node.
    pub nproc: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// `host:port` of the rendezvous store (hosted by rank 0); required when `nnodes > 1`.
    pub master: Option<String>,
    /// Whether output lines are prefixed with `[rank] ` (otherwise ranks inherit the launcher's
    /// stdout and stderr directly).
    pub prefix: bool,
    /// Time between `SIGTERM` and `SIGKILL` when stopping ranks.
    pub grace: Duration,
    /// After a rank fails, how long the others may take to exit on their own (gradsync ranks
    /// fail within seconds of a peer's death and print what they saw) before they are stopped.
    pub failure_wait: Duration,
    /// How ranks are bound to CPUs.
    pub bind: Bind,
}

/// CPU binding of the ranks a launcher starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Bind {
    /// Each local rank gets an equal, separate share of the CPUs the launcher may use (in
    /// order), as `mpirun` binds by default, when there are at least as many CPUs as ranks;
    /// otherwise nothing is bound. A rank then keeps its core. Measured on 2 ranks and 2
    /// cores: shared-memory latency about 10% lower, loopback TCP bandwidth about 10% lower
    /// (the kernel's network work can no longer move), so it is not the default.
    Spread,
    /// No binding (the default): ranks inherit the launcher's CPUs.
    None,
}

/// The CPU set of each local rank under `bind`, or `None` where nothing is bound.
fn cpu_sets(bind: Bind, nproc: usize) -> Vec<Option<libc::cpu_set_t>> {
    let cpus = gradsync::topology::allowed_cpus();
    if bind == Bind::None || nproc == 0 || cpus.len() < nproc {
        return vec![None; nproc];
    }
    let share = cpus.len() / nproc;
    (0..nproc)
        .map(|r| {
            Some(gradsync::topology::cpu_set(
                &cpus[r * share..(r + 1) * share],
            ))
        })
        .collect()
}

impl LaunchOptions {
    /// Options for `nproc` ranks on one node, with prefixed output and a 3 s grace period.
    pub fn single_node(nproc: usize) -> Self {
        LaunchOptions {
            nproc,
            nnodes: 1,
            node_rank: 0,
            master: None,
            prefix: true,
            grace: Duration::from_secs(3),
            failure_wait: Duration::from_secs(3),
            bind: Bind::None,
        }
    }
}

/// Splits `host:port` (or `[v6addr]:port`) into the host and the port.
pub fn parse_master(spec: &str) -> anyhow::Result<(String, u16)> {
    let (host, port) = spec
        .rsplit_once(':')
        .with_context(|| format!("--master {spec:?}: expected HOST:PORT"))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ensure!(!host.is_empty(), "--master {spec:?}: empty host");
    let port: u16 = port
        .parse()
        .with_context(|| format!("--master {spec:?}: bad port {port:?}"))?;
    ensure!(
        port != 0,
        "--master {spec:?}: port 0 cannot be connected to"
    );
    Ok((host.to_string(), port))
}

/// The environment of local rank `local_rank`, in the order it is set.
pub fn rank_env(
    opts: &LaunchOptions,
    master_addr: &str,
    master_port: u16,
    local_rank: usize,
) -> Vec<(&'static str, String)> {
    let rank = opts.node_rank * opts.nproc + local_rank;
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", (opts.nnodes * opts.nproc).to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", opts.nproc.to_string()),
        ("GROUP_RANK", opts.node_rank.to_string()),
        ("NODE_RANK", opts.node_rank.to_string()),
        ("MASTER_ADDR", master_addr.to_string()),
        ("MASTER_PORT", master_port.to_string()),
        ("GRADSYNC_LAUNCHED", "1".to_string()),
    ]
}

/// The exit code a shell would report for `status`: the code, or 128 + the signal number.
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

/// Describes `status` for a message: `exit code 7`, `signal 9 (SIGKILL)`.
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("signal {sig} ({})", signal_name(sig)),
        (None, None) => format!("status {status}"),
    }
}

/// The usual name of a signal number.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

/// Runs `program args...` as `opts.nproc` local ranks and waits for them.
///
/// Returns the launcher's exit code: 0 when every rank succeeded, the first failing rank's code
/// otherwise, 128 + the signal number when the launcher itself was interrupted. Errors are
/// reserved for bad options and ranks that cannot be started (the ones already started are then
/// stopped).
pub fn launch(opts: &LaunchOptions, program: &OsStr, args: &[OsString]) -> anyhow::Result<i32> {
    ensure!(opts.nproc >= 1, "--nproc must be at least 1");
    ensure!(opts.nnodes >= 1, "--nnodes must be at least 1");
    ensure!(
        opts.node_rank < opts.nnodes,
        "--node-rank {} is out of range for --nnodes {}",
        opts.node_rank,
        opts.nnodes
    );
    let (addr, port) = match &opts.master {
        Some(spec) => parse_master(spec)?,
        None if opts.nnodes > 1 => bail!("--master HOST:PORT is required with --nnodes > 1"),
        None => ("127.0.0.1".to_string(), free_port()?),
    };
    let token = job_token(opts.nnodes)?;
    install_signal_handlers()?;

    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut readers = 0usize;
    let mut ranks: Vec<Rank> = Vec::with_capacity(opts.nproc);
    let sets = cpu_sets(opts.bind, opts.nproc);
    for (local, set) in sets.into_iter().enumerate() {
        let env = rank_env(opts, &addr, port, local);
        let rank = opts.node_rank * opts.nproc + local;
        let mut cmd = Command::new(program);
        if let Some(set) = set {
            // SAFETY: the closure runs in the child between fork and exec and makes only
            // sched_setaffinity, an async-signal-safe system call, on a set made before fork.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .envs(token.iter().map(|t| ("GRADSYNC_TOKEN", t.as_str())))
            .stdin(Stdio::null())
            .process_group(0);
        if opts.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut ranks, opts.grace);
                return Err(e).with_context(|| {
                    format!("cannot start rank {rank}: {}", program.to_string_lossy())
                });
            }
        };
        if opts.prefix {
            if let Some(out) = child.stdout.take() {
                readers += 1;
                spawn_forwarder(out, rank, false, done_tx.clone());
            }
            if let Some(err) = child.stderr.take() {
                readers += 1;
                spawn_forwarder(err, rank, true, done_tx.clone());
            }
        }
        ranks.push(Rank {
            rank,
            child,
            status: None,
        });
    }
    drop(done_tx);

    let code = supervise(&mut ranks, opts.grace, opts.failure_wait);

    // Output still buffered in the pipes comes out before the launcher exits, unless some
    // descendant of a rank keeps a pipe open: then give up after a while.
    let deadline = Instant::now() + DRAIN;
    for _ in 0..readers {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    Ok(code)
}

/// A started rank.
struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// Polls the ranks until every one has exited; returns the launcher's exit code.
fn supervise(ranks: &mut [Rank], grace: Duration, failure_wait: Duration) -> i32 {
    // First failure of a rank, unless the launcher was interrupted before it.
    let mut failure: Option<i32> = None;
    // Signal the launcher received and forwarded.
    let mut interrupted: Option<i32> = None;
    let mut terminated = false;
    let mut kill_at: Option<Instant> = None;
    let mut failed_at: Option<Instant> = None;
    loop {
        let sig = SIGNALLED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            if interrupted.is_some() {
                eprintln!(
                    "gradsync launch: received {} again; killing the ranks",
                    signal_name(sig)
                );
                signal_live(ranks, libc::SIGKILL);
            } else {
                eprintln!(
                    "gradsync launch: received {}; forwarding it to the ranks",
                    signal_name(sig)
                );
                signal_live(ranks, sig);
                interrupted = Some(sig);
                kill_at.get_or_insert(Instant::now() + grace);
            }
        }

        let mut live = 0;
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    r.status = Some(status);
                    if !status.success() && failure.is_none() && interrupted.is_none() {
                        eprintln!(
                            "gradsync launch: rank {} (pid {}) failed with {}; stopping the other ranks in {:?} unless they exit first",
                            r.rank,
                            r.child.id(),
                            describe(status),
                            failure_wait
                        );
                        failure = Some(exit_code(status));
                        failed_at = Some(Instant::now());
                    }
                }
                Ok(None) => live += 1,
                Err(e) => {
                    eprintln!("gradsync launch: cannot wait for rank {}: {e}", r.rank);
                    live += 1;
                }
            }
        }
        if live == 0 {
            return failure.or(interrupted.map(|s| 128 + s)).unwrap_or(0);
        }
        if failure.is_some()
            && !terminated
            && interrupted.is_none()
            && failed_at.is_some_and(|t| t.elapsed() >= failure_wait)
        {
            signal_live(ranks, libc::SIGTERM);
            terminated = true;
            kill_at = Some(Instant::now() + grace);
        }
        if let Some(at) = kill_at
            && Instant::now() >= at
        {
            signal_live(ranks, libc::SIGKILL);
            kill_at = None;
        }
        thread::sleep(POLL);
    }
}

/// Stops the ranks already started (used when a later one cannot be).
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    signal_live(ranks, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while ranks
        .iter_mut()
        .any(|r| matches!(r.child.try_wait(), Ok(None)))
    {
        if Instant::now() >= deadline {
            signal_live(ranks, libc::SIGKILL);
            for r in ranks.iter_mut() {
                let _ = r.child.wait();
            }
            return;
        }
        thread::sleep(POLL);
    }
}

/// Sends `sig` to the process group of every rank not yet reaped.
///
/// A rank that has not been reaped still holds its pid (at worst as a zombie), so its process
/// group id cannot have been reused by an unrelated process.
fn signal_live(ranks: &[Rank], sig: i32) {
    for r in ranks.iter().filter(|r| r.status.is_none()) {
        let Ok(pgid) = libc::pid_t::try_from(r.child.id()) else {
            continue;
        };
        // SAFETY: kill(2) has no memory-safety preconditions; a negative pid names the
        // process group the rank leads (it was started with `process_group(0)`).
        let rc = unsafe { libc::kill(-pgid, sig) };
        if rc != 0 {
            // ESRCH: the group is already gone, nothing to do.
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::ESRCH) {
                eprintln!("gradsync launch: cannot signal rank {}: {err}", r.rank);
            }
        }
    }
}

/// The job token for the ranks: `GRADSYNC_TOKEN` from the launcher's environment, else (on a
/// single node) a new random one; `None` for a multi-node job without one.
fn job_token(nnodes: usize) -> anyhow::Result<Option<String>> {
    if let Some(t) = std::env::var("GRADSYNC_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(Some(t));
    }
    if nnodes > 1 {
        return Ok(None);
    }
    Ok(Some(random_token()?))
}

/// 32 random bytes from `/dev/urandom`, as 64 lowercase hex digits.
pub fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot read /dev/urandom for the job token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}

/// The last signal received (0 when none is pending).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// Routes `SIGINT`, `SIGTERM` and `SIGHUP` to [`SIGNALLED`] (children get the default
/// dispositions back at `exec`).
fn install_signal_handlers() -> io::Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: an all-zero `sigaction` is a valid value of this plain C struct; the handler
        // only stores into an atomic, which is async-signal-safe; the pointers passed are valid
        // for the duration of the calls.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Copies `src` line by line to the launcher's stdout or stderr with the prefix `[rank] `,
/// on a thread of its own; sends on `done` at end of input.
fn spawn_forwarder<R: Read + Send + 'static>(
    src: R,
    rank: usize,
    to_stderr: bool,
    done: mpsc::Sender<()>,
) {
    let spawned = thread::Builder::new()
        .name(format!(
            "rank{rank}-{}",
            if to_stderr { "err" } else { "out" }
        ))
        .spawn(move || {
            let prefix = format!("[{rank}] ");
            let mut reader = BufReader::with_capacity(MAX_LINE, src);
            let mut line = Vec::with_capacity(256);
            let mut sink_ok = true;
            loop {
                line.clear();
                line.extend_from_slice(prefix.as_bytes());
                match read_line_capped(&mut reader, &mut line, MAX_LINE) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                // Keep draining after the sink fails (a closed pipe), so the rank never blocks.
                if sink_ok {
                    sink_ok = if to_stderr {
                        write_whole(&mut io::stderr().lock(), &line)
                    } else {
                        write_whole(&mut io::stdout().lock(), &line)
                    };
                }
            }
            let _ = done.send(());
        });
    if let Err(e) = spawned {
        eprintln!("gradsync launch: cannot start the output thread of rank {rank}: {e}");
    }
}

fn write_whole(sink: &mut impl Write, line: &[u8]) -> bool {
    sink.write_all(line).and_then(|()| sink.flush()).is_ok()
}

/// Appends to `out` the bytes up to and including the next newline, or at most `cap` bytes;
/// returns how many were appended (0 at end of input).
pub fn read_line_capped(
    reader: &mut impl BufRead,
    out: &mut Vec<u8>,
    cap: usize,
) -> io::Result<usize> {
    let mut total = 0;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(total);
        }
        let room = &buf[..buf.len().min(cap - total)];
        let (take, newline) = match room.iter().position(|&b| b == b'\n') {
            Some(p) => (p + 1, true),
            None => (room.len(), false),
        };
        out.extend_from_slice(&room[..take]);
        reader.consume(take);
        total += take;
        if newline || total >= cap {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_hex() {
        let (a, b) = (random_token().unwrap(), random_token().unwrap());
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn env_of_ranks() {
        let mut opts = LaunchOptions::single_node(4);
        opts.nnodes = 3;
        opts.node_rank = 2;
        let env = rank_env(&opts, "10.0.0.1", 29500, 1);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("9"));
        assert_eq!(get("WORLD_SIZE"), Some("12"));
        assert_eq!(get("LOCAL_RANK"), Some("1"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("4"));
        assert_eq!(get("GROUP_RANK"), Some("2"));
        assert_eq!(get("NODE_RANK"), Some("2"));
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("29500"));
        assert_eq!(get("GRADSYNC_LAUNCHED"), Some("1"));
    }

    #[test]
    fn master_spec() {
        assert_eq!(
            parse_master("node0:29500").unwrap(),
            ("node0".to_string(), 29500)
        );
        assert_eq!(parse_master("[::1]:80").unwrap(), ("::1".to_string(), 80));
        assert!(parse_master("node0").is_err());
        assert!(parse_master(":80").is_err());
        assert!(parse_master("h:0").is_err());
        assert!(parse_master("h:99999").is_err());
    }

    #[test]
    fn statuses() {
        let exited = ExitStatus::from_raw(7 << 8);
        assert_eq!(exit_code(exited), 7);
        assert_eq!(describe(exited), "exit code 7");
        let killed = ExitStatus::from_raw(libc::SIGKILL);
        assert_eq!(exit_code(killed), 137);
        assert_eq!(describe(killed), "signal 9 (SIGKILL)");
    }

    #[test]
    fn lines_are_capped() {
        let data = b"short\nlonger line\nno newline at end";
        let mut r = BufReader::with_capacity(4, &data[..]);
        let mut got = Vec::new();
        loop {
            let mut line = Vec::new();
            if read_line_capped(&mut r, &mut line, 8).unwrap() == 0 {
                break;
            }
            got.push(String::from_utf8(line).unwrap());
        }
        assert_eq!(
            got,
            ["short\n", "longer l", "ine\n", "no newli", "ne at en", "d"]
        );
    }
}
