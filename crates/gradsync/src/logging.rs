//! Logging configured from `GRADSYNC_DEBUG`, `GRADSYNC_DEBUG_SUBSYS` and `GRADSYNC_DEBUG_FILE`.
//!
//! The three variables behave as their NCCL namesakes (`NCCL_DEBUG`, `NCCL_DEBUG_SUBSYS`,
//! `NCCL_DEBUG_FILE`) do:
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `GRADSYNC_DEBUG` | unset (warnings and errors only) | `VERSION` also prints the version once at init; `INFO` adds informational lines; `TRACE` adds everything (`DEBUG` and `TRACE` events) |
//! | `GRADSYNC_DEBUG_SUBSYS` | `INIT,BOOTSTRAP,ENV` | comma-separated subsystems whose `INFO`/`TRACE` lines are shown: `INIT`, `BOOTSTRAP`, `NET`, `COLL`, `P2P`, `ENV`, `ALL`; a leading `^` shows every subsystem except the listed ones |
//! | `GRADSYNC_DEBUG_FILE` | unset (stderr) | file to write to instead of stderr; `%h` expands to the host name, `%p` to the process id, `%%` to `%` |
//!
//! Warnings and errors are always printed, whatever the subsystem. Library code logs through
//! [`tracing`] with a subsystem target, e.g. `tracing::info!(target: "gradsync::init", ...)`;
//! events from the other gradsync crates that use their module path as target are attributed
//! by crate (`gradsync_store` to `BOOTSTRAP`, the transports to `NET`, `gradsync_core` and
//! `gradsync_reduce` to `COLL`). Events whose target belongs to no subsystem are shown only when
//! every subsystem is enabled (`ALL`).
//!
//! Every line has the NCCL layout, `host:pid:tid [rank] GRADSYNC LEVEL message`, where `rank`
//! is `-` until [`set_rank`] is called.
//!
//! [`init_from_env`] installs the subscriber as the global default. It is idempotent; when the
//! application has already installed a global subscriber, that one is kept and the variables
//! have no effect. A malformed value prints a warning to stderr and falls back to the default.

use std::fmt::{self, Write as _};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// A logging subsystem, selected with `GRADSYNC_DEBUG_SUBSYS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Subsys {
    /// Communicator creation and teardown (`gradsync::init`).
    Init,
    /// Rendezvous through the store (`gradsync::bootstrap`).
    Bootstrap,
    /// Transports and connections (`gradsync::net`).
    Net,
    /// Collective operations and algorithm choice (`gradsync::coll`).
    Coll,
    /// Point-to-point operations (`gradsync::p2p`).
    P2p,
    /// Environment variables read and their values (`gradsync::env`).
    Env,
}

impl Subsys {
    /// Every subsystem.
    pub const ALL: [Subsys; 6] = [
        Subsys::Init,
        Subsys::Bootstrap,
        Subsys::Net,
        Subsys::Coll,
        Subsys::P2p,
        Subsys::Env,
    ];

    /// The name used in `GRADSYNC_DEBUG_SUBSYS` (`INIT`, `BOOTSTRAP`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Subsys::Init => "INIT",
            Subsys::Bootstrap => "BOOTSTRAP",
            Subsys::Net => "NET",
            Subsys::Coll => "COLL",
            Subsys::P2p => "P2P",
            Subsys::Env => "ENV",
        }
    }

    /// The `tracing` target library code logs this subsystem under (`gradsync::init`, ...).
    pub const fn target(self) -> &'static str {
        match self {
            Subsys::Init => "gradsync::init",
            Subsys::Bootstrap => "gradsync::bootstrap",
            Subsys::Net => "gradsync::net",
            Subsys::Coll => "gradsync::coll",
            Subsys::P2p => "gradsync::p2p",
            Subsys::Env => "gradsync::env",
        }
    }

    /// Parses a subsystem name, ignoring ASCII case.
    pub fn parse(name: &str) -> Option<Subsys> {
        Subsys::ALL
            .into_iter()
            .find(|s| s.name().eq_ignore_ascii_case(name))
    }

    /// The subsystem an event with this `tracing` target belongs to, if any.
    ///
    /// `gradsync::<subsys>` and its sub-targets (`gradsync::net::tcp`) map to the subsystem;
    /// module-path targets of the other gradsync crates map by crate.
    pub fn of_target(target: &str) -> Option<Subsys> {
        let under = |prefix: &str| {
            target
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
        };
        if let Some(s) = Subsys::ALL.into_iter().find(|s| under(s.target())) {
            return Some(s);
        }
        if under("gradsync_store") {
            Some(Subsys::Bootstrap)
        } else if under("gradsync_transport")
            || under("gradsync_tcp")
            || under("gradsync_shm")
            || under("gradsync_rdma")
        {
            Some(Subsys::Net)
        } else if under("gradsync_core") || under("gradsync_reduce") {
            Some(Subsys::Coll)
        } else {
            None
        }
    }

    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A set of [`Subsys`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SubsysMask(u8);

impl SubsysMask {
    /// No subsystem.
    pub const NONE: SubsysMask = SubsysMask(0);
    /// Every subsystem.
    pub const ALL: SubsysMask = SubsysMask(0b11_1111);
    /// The default, as NCCL's: `INIT,BOOTSTRAP,ENV`.
    pub const DEFAULT: SubsysMask =
        SubsysMask(Subsys::Init.bit() | Subsys::Bootstrap.bit() | Subsys::Env.bit());

    /// Whether `s` is in the set.
    pub const fn contains(self, s: Subsys) -> bool {
        self.0 & s.bit() != 0
    }

    /// The set with `s` added.
    pub const fn with(self, s: Subsys) -> SubsysMask {
        SubsysMask(self.0 | s.bit())
    }

    /// Whether every subsystem is in the set.
    pub const fn is_all(self) -> bool {
        self.0 == Self::ALL.0
    }
}

impl fmt::Display for SubsysMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_all() {
            return f.write_str("ALL");
        }
        let mut first = true;
        for s in Subsys::ALL.into_iter().filter(|s| self.contains(*s)) {
            if !first {
                f.write_char(',')?;
            }
            f.write_str(s.name())?;
            first = false;
        }
        Ok(())
    }
}

/// Parses a `GRADSYNC_DEBUG_SUBSYS` value.
///
/// Returns the selected set and the names that were not recognized (ignored). Names are
/// separated by commas and matched ignoring ASCII case; `ALL` selects every subsystem; a
/// leading `^` inverts the list (every subsystem except the listed ones). An empty value
/// selects [`SubsysMask::DEFAULT`].
pub fn parse_subsys(spec: &str) -> (SubsysMask, Vec<String>) {
    let spec = spec.trim();
    if spec.is_empty() {
        return (SubsysMask::DEFAULT, Vec::new());
    }
    let (invert, list) = match spec.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, spec),
    };
    let mut mask = SubsysMask::NONE;
    let mut unknown = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if name.eq_ignore_ascii_case("ALL") {
            mask = SubsysMask::ALL;
        } else if let Some(s) = Subsys::parse(name) {
            mask = mask.with(s);
        } else {
            unknown.push(name.to_string());
        }
    }
    if invert {
        mask = SubsysMask(SubsysMask::ALL.0 & !mask.0);
    }
    (mask, unknown)
}

/// Verbosity selected with `GRADSYNC_DEBUG`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DebugLevel {
    /// Warnings and errors only (the default when the variable is unset).
    Warn,
    /// As [`DebugLevel::Warn`], plus one line with the version at init.
    Version,
    /// Informational lines of the selected subsystems.
    Info,
    /// Everything of the selected subsystems, `DEBUG` and `TRACE` events included.
    Trace,
}

impl DebugLevel {
    /// Parses a `GRADSYNC_DEBUG` value, ignoring ASCII case and surrounding blanks.
    pub fn parse(value: &str) -> Option<DebugLevel> {
        let v = value.trim();
        [
            ("WARN", DebugLevel::Warn),
            ("VERSION", DebugLevel::Version),
            ("INFO", DebugLevel::Info),
            ("TRACE", DebugLevel::Trace),
        ]
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(v))
        .map(|(_, level)| level)
    }

    /// The most verbose `tracing` level this setting lets through.
    pub const fn max_level(self) -> Level {
        match self {
            DebugLevel::Warn | DebugLevel::Version => Level::WARN,
            DebugLevel::Info => Level::INFO,
            DebugLevel::Trace => Level::TRACE,
        }
    }

    /// Whether the version line is printed at init.
    pub const fn prints_version(self) -> bool {
        !matches!(self, DebugLevel::Warn)
    }
}

/// Expands a `GRADSYNC_DEBUG_FILE` template: `%h` becomes `host`, `%p` becomes `pid`, `%%`
/// becomes `%`; any other `%` sequence is kept as written.
pub fn expand_file_template(template: &str, host: &str, pid: u32) -> String {
    let mut out = String::with_capacity(template.len() + host.len());
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('h') => {
                out.push_str(host);
                chars.next();
            }
            Some('p') => {
                let _ = write!(out, "{pid}");
                chars.next();
            }
            Some('%') => {
                out.push('%');
                chars.next();
            }
            _ => out.push('%'),
        }
    }
    out
}

/// Whether an event or span at `level` with `target` passes the filter.
///
/// Warnings and errors always pass; more verbose levels pass when they are at most `max` and
/// the target's subsystem is in `mask` (a target of no subsystem needs every subsystem).
pub fn allows(max: Level, mask: SubsysMask, level: Level, target: &str) -> bool {
    if level <= Level::WARN {
        return true;
    }
    if level > max {
        return false;
    }
    match Subsys::of_target(target) {
        Some(s) => mask.contains(s),
        None => mask.is_all(),
    }
}

/// Sets the rank shown in every later line (instead of `-`).
pub fn set_rank(rank: usize) {
    RANK.store(rank, Ordering::Relaxed);
}

/// Installs the global `tracing` subscriber configured from the `GRADSYNC_DEBUG*` variables.
///
/// Safe to call any number of times, from any thread: only the first call does anything.
pub fn init_from_env() {
    static INIT: Once = Once::new();
    INIT.call_once(init_once);
}

const NO_RANK: usize = usize::MAX;
static RANK: AtomicUsize = AtomicUsize::new(NO_RANK);

/// The host name up to its first dot, as NCCL shows it.
pub(crate) fn hostname() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let full = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .or_else(|_| std::fs::read_to_string("/etc/hostname"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "localhost".to_string());
        full.split('.').next().unwrap_or(&full).to_string()
    })
}

/// The kernel thread id of the calling thread (read once per thread from `/proc/thread-self`).
fn thread_id() -> u64 {
    thread_local! {
        static TID: u64 = std::fs::read_link("/proc/thread-self")
            .ok()
            .and_then(|p| p.file_name()?.to_str()?.parse().ok())
            .unwrap_or(0);
    }
    TID.with(|t| *t)
}

/// Formats the line prefix `host:pid:tid [rank] GRADSYNC LEVEL ` into `out`.
fn write_prefix(
    out: &mut String,
    host: &str,
    pid: u32,
    tid: u64,
    rank: Option<usize>,
    label: &str,
) {
    let _ = write!(out, "{host}:{pid}:{tid} ");
    match rank {
        Some(r) => {
            let _ = write!(out, "[{r}]");
        }
        None => out.push_str("[-]"),
    }
    let _ = write!(out, " GRADSYNC {label} ");
}

/// A complete line (with its newline) for `message` at `label`, in the current context.
fn line(label: &str, message: &str) -> String {
    let mut out = String::with_capacity(64 + message.len());
    let rank = RANK.load(Ordering::Relaxed);
    write_prefix(
        &mut out,
        hostname(),
        std::process::id(),
        thread_id(),
        (rank != NO_RANK).then_some(rank),
        label,
    );
    out.push_str(message);
    out.push('\n');
    out
}

/// Prints a configuration warning straight to stderr.
fn env_warning(message: &str) {
    let _ = std::io::stderr().write_all(line("WARN", message).as_bytes());
}

fn init_once() {
    let level = match std::env::var("GRADSYNC_DEBUG") {
        Err(std::env::VarError::NotPresent) => DebugLevel::Warn,
        Ok(v) if v.trim().is_empty() => DebugLevel::Warn,
        Ok(v) => DebugLevel::parse(&v).unwrap_or_else(|| {
            env_warning(&format!(
                "GRADSYNC_DEBUG={v:?} is not one of VERSION, WARN, INFO, TRACE; using WARN"
            ));
            DebugLevel::Warn
        }),
        Err(std::env::VarError::NotUnicode(_)) => {
            env_warning("GRADSYNC_DEBUG is not valid UTF-8; using WARN");
            DebugLevel::Warn
        }
    };
    let mask = match std::env::var("GRADSYNC_DEBUG_SUBSYS") {
        Ok(v) => {
            let (mask, unknown) = parse_subsys(&v);
            for name in unknown {
                env_warning(&format!(
                    "GRADSYNC_DEBUG_SUBSYS: unknown subsystem {name:?} ignored (known: INIT, BOOTSTRAP, NET, COLL, P2P, ENV, ALL)"
                ));
            }
            mask
        }
        Err(std::env::VarError::NotPresent) => SubsysMask::DEFAULT,
        Err(std::env::VarError::NotUnicode(_)) => {
            env_warning("GRADSYNC_DEBUG_SUBSYS is not valid UTF-8; using INIT,BOOTSTRAP,ENV");
            SubsysMask::DEFAULT
        }
    };
    let sink: Box<dyn Write + Send> = match std::env::var_os("GRADSYNC_DEBUG_FILE") {
        Some(template) if !template.is_empty() => {
            let template = template.to_string_lossy();
            let path = expand_file_template(&template, hostname(), std::process::id());
            match std::fs::File::create(&path) {
                Ok(f) => Box::new(f),
                Err(e) => {
                    env_warning(&format!(
                        "GRADSYNC_DEBUG_FILE: cannot create {path:?} ({e}); logging to stderr"
                    ));
                    Box::new(std::io::stderr())
                }
            }
        }
        _ => Box::new(std::io::stderr()),
    };
    let layer = LineLayer {
        max: level.max_level(),
        mask,
        sink: Mutex::new(sink),
    };
    if level.prints_version() {
        layer.emit(&line("INFO", &format!("gradsync version {}", VERSION)));
    }
    // Another global subscriber (the application's) wins; ours is then dropped.
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// The layer that filters by level and subsystem and writes NCCL-style lines.
struct LineLayer {
    max: Level,
    mask: SubsysMask,
    sink: Mutex<Box<dyn Write + Send>>,
}

impl LineLayer {
    fn passes(&self, meta: &Metadata<'_>) -> bool {
        allows(self.max, self.mask, *meta.level(), meta.target())
    }

    /// Writes one whole line, so that lines of different threads never interleave.
    fn emit(&self, line: &str) {
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let _ = sink.write_all(line.as_bytes());
        let _ = sink.flush();
    }
}

impl<S: Subscriber> Layer<S> for LineLayer {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if self.passes(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        self.passes(meta)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::from_level(self.max.max(Level::WARN)))
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        if !self.passes(meta) {
            return;
        }
        let mut visitor = MessageVisitor::default();
        event.record(&mut visitor);
        self.emit(&line(meta.level().as_str(), &visitor.finish()));
    }
}

/// Collects an event's message followed by its other fields as ` name=value`.
#[derive(Default)]
struct MessageVisitor {
    out: String,
    fields: String,
}

impl MessageVisitor {
    fn push_field(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        if field.name() == "message" {
            let _ = self.out.write_fmt(value);
        } else {
            let _ = write!(self.fields, " {}={}", field.name(), value);
        }
    }

    /// The message followed by the other fields, whatever order they were recorded in.
    fn finish(mut self) -> String {
        self.out.push_str(&self.fields);
        self.out
    }
}

impl Visit for MessageVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push_field(field, format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push_field(field, format_args!("{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subsys_default_and_empty() {
        assert_eq!(parse_subsys(""), (SubsysMask::DEFAULT, vec![]));
        assert_eq!(parse_subsys("  "), (SubsysMask::DEFAULT, vec![]));
        assert_eq!(SubsysMask::DEFAULT.to_string(), "INIT,BOOTSTRAP,ENV");
    }

    #[test]
    fn subsys_list() {
        let (m, unknown) = parse_subsys("net,COLL, p2p");
        assert!(unknown.is_empty());
        assert_eq!(m.to_string(), "NET,COLL,P2P");
        assert!(!m.contains(Subsys::Init));
    }

    #[test]
    fn subsys_all() {
        assert_eq!(parse_subsys("ALL").0, SubsysMask::ALL);
        assert_eq!(parse_subsys("init,all").0, SubsysMask::ALL);
        assert_eq!(SubsysMask::ALL.to_string(), "ALL");
    }

    #[test]
    fn subsys_exclusion() {
        let (m, unknown) = parse_subsys("^NET,COLL");
        assert!(unknown.is_empty());
        assert_eq!(m.to_string(), "INIT,BOOTSTRAP,P2P,ENV");
        assert_eq!(parse_subsys("^ALL").0, SubsysMask::NONE);
        assert_eq!(parse_subsys("^").0, SubsysMask::ALL);
    }

    #[test]
    fn subsys_unknown_names_are_reported() {
        let (m, unknown) = parse_subsys("INIT,GRAPH,,tuning");
        assert_eq!(m, SubsysMask::NONE.with(Subsys::Init));
        assert_eq!(unknown, vec!["GRAPH".to_string(), "tuning".to_string()]);
    }

    #[test]
    fn file_template() {
        assert_eq!(
            expand_file_template("/tmp/gs.%h.%p.log", "node7", 42),
            "/tmp/gs.node7.42.log"
        );
        assert_eq!(expand_file_template("a%%p%q%", "h", 1), "a%p%q%");
        assert_eq!(expand_file_template("plain", "h", 1), "plain");
        assert_eq!(expand_file_template("%p%p", "h", 9), "99");
    }

    #[test]
    fn levels() {
        assert_eq!(DebugLevel::parse("info"), Some(DebugLevel::Info));
        assert_eq!(DebugLevel::parse(" TRACE "), Some(DebugLevel::Trace));
        assert_eq!(DebugLevel::parse("Version"), Some(DebugLevel::Version));
        assert_eq!(DebugLevel::parse("WARN"), Some(DebugLevel::Warn));
        assert_eq!(DebugLevel::parse("verbose"), None);
        assert!(DebugLevel::Version.prints_version());
        assert!(!DebugLevel::Warn.prints_version());
        assert_eq!(DebugLevel::Version.max_level(), Level::WARN);
    }

    #[test]
    fn targets() {
        assert_eq!(Subsys::of_target("gradsync::init"), Some(Subsys::Init));
        assert_eq!(Subsys::of_target("gradsync::net::tcp"), Some(Subsys::Net));
        assert_eq!(Subsys::of_target("gradsync::network"), None);
        assert_eq!(
            Subsys::of_target("gradsync_store::server"),
            Some(Subsys::Bootstrap)
        );
        assert_eq!(Subsys::of_target("gradsync_core"), Some(Subsys::Coll));
        assert_eq!(Subsys::of_target("gradsync::comm"), None);
        assert_eq!(Subsys::of_target("hyper"), None);
    }

    #[test]
    fn filter() {
        let d = SubsysMask::DEFAULT;
        assert!(allows(Level::WARN, d, Level::ERROR, "gradsync::coll"));
        assert!(allows(
            Level::WARN,
            SubsysMask::NONE,
            Level::WARN,
            "anything"
        ));
        assert!(!allows(Level::WARN, d, Level::INFO, "gradsync::init"));
        assert!(allows(Level::INFO, d, Level::INFO, "gradsync::init"));
        assert!(!allows(Level::INFO, d, Level::INFO, "gradsync::coll"));
        assert!(!allows(Level::INFO, d, Level::DEBUG, "gradsync::init"));
        assert!(allows(Level::TRACE, d, Level::TRACE, "gradsync::env"));
        assert!(!allows(Level::TRACE, d, Level::TRACE, "gradsync::comm"));
        assert!(allows(
            Level::TRACE,
            SubsysMask::ALL,
            Level::TRACE,
            "gradsync::comm"
        ));
    }

    #[test]
    fn prefix() {
        let mut s = String::new();
        write_prefix(&mut s, "node1", 10, 11, None, "INFO");
        assert_eq!(s, "node1:10:11 [-] GRADSYNC INFO ");
        s.clear();
        write_prefix(&mut s, "node1", 10, 11, Some(3), "WARN");
        assert_eq!(s, "node1:10:11 [3] GRADSYNC WARN ");
    }

    #[test]
    fn message_and_fields() {
        // The visitor puts the message first and the other fields after it.
        let mut v = MessageVisitor::default();
        v.out.push_str("hello");
        v.fields.push_str(" peer=3");
        assert_eq!(v.finish(), "hello peer=3");
    }

    #[test]
    fn init_is_idempotent() {
        init_from_env();
        init_from_env();
        set_rank(2);
        tracing::warn!(target: "gradsync::init", "logging test line");
        assert!(thread_id() > 0);
        assert!(!hostname().is_empty());
    }
}
