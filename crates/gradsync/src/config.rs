//! Configuration: launch conventions and `GRADSYNC_*` tunables.

use crate::error::Error;
use gradsync_core::Collective;
use gradsync_core::schedule::plan::Algorithm;
use std::time::Duration;

/// The largest all-reduce that can go eagerly through a shared-memory board (the board's
/// capacity, and the most `GRADSYNC_EAGER_MAX` accepts).
pub(crate) const BOARD_EAGER_MAX: usize = 16 * 1024;

/// The largest all-reduce that goes eagerly through the board unless `GRADSYNC_EAGER_MAX`
/// says otherwise: above it recursive doubling is faster (`gradsync bench --compare
/// auto,recursive_doubling -b 8K -e 16K -i 2K`, one host of 2 cores: eager 0.84-0.91 of its
/// time at 8 KiB on 2 and 4 ranks, 0.99-1.06 at 10 KiB on 2 and 3 ranks, 1.17-1.30 at 16 KiB
/// on 2 to 4 ranks).
pub(crate) const BOARD_EAGER_DEFAULT: usize = 8 * 1024;

/// How to build a [`Communicator`](crate::Communicator) explicitly.
///
/// [`Config::new`] fills the tunables with their defaults; [`Config::from_env`] reads the launch
/// variables (torchrun, Slurm, Open MPI) and every `GRADSYNC_*` variable (see the README's
/// table).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Address of the rendezvous store, `host:port`.
    pub store_addr: String,
    /// Whether rank 0 starts the store at `store_addr` (as torchrun's rank 0 does); `false` when
    /// a launcher or the caller runs it.
    pub host_store: bool,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank within this host, if known.
    pub local_rank: Option<usize>,
    /// Deadline of init and of every collective (`GRADSYNC_TIMEOUT`, seconds).
    pub timeout: Duration,
    /// TCP streams per peer (`GRADSYNC_NSOCKS`); 0, the default: one to a peer on another host
    /// and two to one on this host (see [`tcp_streams`](Self::tcp_streams)).
    pub nsocks: usize,
    /// Network interface for data connections (`GRADSYNC_SOCKET_IFNAME`).
    pub socket_ifname: Option<String>,
    /// Socket buffer size in bytes, 0 = kernel auto-tuning (`GRADSYNC_SOCKET_BUFSIZE`).
    pub socket_bufsize: usize,
    /// Message (slot) payload size in bytes (`GRADSYNC_CHUNK_SIZE`).
    pub chunk_bytes: usize,
    /// Slots (messages in flight) per peer (`GRADSYNC_NSLOTS`).
    pub nslots: usize,
    /// Of those, the messages in flight to a peer reached over TCP (`GRADSYNC_TCP_NSLOTS`, at
    /// most `nslots`); 0, the default: 3 to a peer on this host and all
    /// `nslots` to a peer on another host. Fewer in flight keep the socket queues and the inbox
    /// slots being filled in the cache (over loopback 3 measured 1.3-1.4x the busbw of 8);
    /// across hosts a switch's queue lengthens the round trip that returns a slot, and 3 slots
    /// left Rabenseifner waiting on its window where two flows share a host's link.
    pub tcp_nslots: usize,
    /// Receive memory per rank (`GRADSYNC_RECV_BUDGET`): the inbox slots' payload bytes over
    /// all peers. Where `world * nslots` slots of `chunk_bytes` would exceed it, every peer gets
    /// fewer slots ([`Config::slots_within_budget`]), at least 2.
    pub recv_budget: usize,
    /// How long a waiting rank spins before it sleeps (`GRADSYNC_SPIN_US`).
    pub spin: Duration,
    /// Forced all-reduce algorithm (`GRADSYNC_ALGO`), `None` = automatic.
    pub algorithm: Option<Algorithm>,
    /// Forced algorithms of the other collectives (`GRADSYNC_ALGO=broadcast:ring,...`); a
    /// collective not listed is chosen automatically.
    pub collective_algorithms: Vec<(Collective, Algorithm)>,
    /// Messages of at least this many bytes that the receiver only copies are written straight
    /// into the receiver's buffer after a clear-to-send (`GRADSYNC_DIRECT_MIN`, pairs over TCP;
    /// default off); smaller ones, and every message that is reduced on arrival, go through an
    /// inbox slot. Over loopback, the slots (with `tcp_nslots` of them) measured faster: the
    /// kernel's copy lands in a slot that is in the cache, not in a destination that is not.
    pub direct_min: usize,
    /// The same for pairs on shared memory (`GRADSYNC_SHM_DIRECT_MIN`, default off): there a
    /// message through an inbox slot costs the sender a copy into the mapped inbox, which
    /// stays in the cache, and the receiver a streaming copy out; a direct write is a
    /// cross-memory copy that pins the destination's pages, measured slower for all-reduces.
    /// Setting the variable sets [`shm_move_direct_min`](Self::shm_move_direct_min) too.
    pub shm_direct_min: usize,
    /// The shared-memory threshold for the collectives that only move data (all-to-all(v),
    /// all-gather; default 64 KiB, or `GRADSYNC_SHM_DIRECT_MIN` where set): there every
    /// message is copied into place, so its sender waits for the clear-to-send instead of
    /// copying it through a slot, and each byte is copied once. It applies to calls whose
    /// blocks (what a pair moves one way) are at least
    /// [`shm_move_block_min`](Self::shm_move_block_min). Set it alike on every rank (init
    /// checks).
    pub shm_move_direct_min: usize,
    /// The block size from which [`shm_move_direct_min`](Self::shm_move_direct_min) applies
    /// (default 8 MiB; 0 where `GRADSYNC_SHM_DIRECT_MIN` is set): an all-to-all or
    /// all-gather of smaller blocks goes through the inbox like an all-reduce. A direct write
    /// pins each destination page in the kernel, about three times the cost of its copy; two
    /// copies through an inbox slot that stays in the cache cost less while the call's
    /// buffers fit in the cache (2 ranks: 1.3-1.9x the busbw of direct writes from 256 KiB
    /// to 8 MiB, 0.8-0.9x from 16 MiB). An all-to-allv's blocks differ per pair: its messages
    /// alone decide. Set it alike on every rank (init checks).
    pub shm_move_block_min: usize,
    /// All-reduces of at most this many bytes run eagerly (`GRADSYNC_EAGER_MAX`, `0` or `off`:
    /// never; only with no forced algorithm and at most 16 ranks): each rank hands its whole
    /// buffer to every peer at once and reduces all contributions in rank order, one message
    /// latency in all. The default, `usize::MAX`, leaves each path its own limit: 4032 bytes
    /// as messages, 16 KiB on a shared-memory board (see [`shm_board`](Self::shm_board)); a
    /// smaller value lowers both (at most 16384 is accepted). Set it alike on every rank.
    pub eager_max: usize,
    /// Whether eager all-reduces of a job whose ranks all share one host go through the
    /// shared-memory board (`GRADSYNC_SHM_BOARD`, `1` default, `0`: as messages through the
    /// rings): every rank posts its buffer once in its own segment and reads the others' there,
    /// with no message per peer. Used only when every rank's transport has a board.
    pub shm_board: bool,
    /// Whether outputs of at least 8 MiB that peers on shared memory wrote by cross-memory
    /// attach get transparent huge pages when an operation uses them again
    /// (`GRADSYNC_SHM_HUGEPAGES`, `1` default, `0`: never), which spares the writers' pinning
    /// and page walks; the rules are those of
    /// [`ShmEndpoint::set_huge_pages`](gradsync_transport::shm::ShmEndpoint::set_huge_pages).
    /// A rank's own setting, need not match.
    pub shm_huge_pages: bool,
    /// Whether TCP pairs connect on first use (`GRADSYNC_RUNTIME_CONNECT`, `1` default, as
    /// NCCL's namesake): a rank connects only to the peers its operations talk to, when the
    /// first one does (a ring two, a tree three, recursive doubling log2 n), so sockets and
    /// resident inbox memory follow those peers, not the world. `0`: every pair connects at
    /// init. Set it alike on every rank.
    pub runtime_connect: bool,
    /// Deterministic floating-point all-reduce (`GRADSYNC_DETERMINISTIC`, `0` or `1`, default
    /// off): every element is reduced in rank order, `((x0 op x1) op x2) ...`, so the result does
    /// not depend on the algorithm, the chunk size or the buffer size. Small buffers go eagerly
    /// (already in rank order); larger ones are all-gathered piece by piece (4 MiB of scratch
    /// at most) and reduced locally, which moves `world - 1` buffers per rank instead of a
    /// ring's `2 (world - 1) / world`. An async or owned all-reduce then completes before it
    /// returns. Integer types are exact in any order and keep the normal path. Set it alike on
    /// every rank.
    pub deterministic: bool,
    /// The job token (`GRADSYNC_TOKEN`): with one, every store and data connection is
    /// authenticated by an HMAC-SHA256 challenge-response on it, and the token never crosses
    /// the wire (see `gradsync_store`'s and `gradsync_transport::tcp`'s documentation). All
    /// ranks of a job need the same token; `gradsync launch` makes one. `None`: connections
    /// are not authenticated, and init warns once per process. The store binds rank 0's
    /// `MASTER_ADDR` interface only, either way.
    pub token: Option<String>,
    /// Integrity option (`GRADSYNC_CHECKSUM`, `0` or `1`, default off): every message carries
    /// a CRC32C of its payload in its header, and the receiver verifies it before reducing or
    /// copying; a mismatch fails the operation with [`Error::Corrupt`] naming the link. All
    /// messages then go through inbox slots (direct writes carry no header). Set it alike on
    /// every rank. Off, nothing is computed.
    pub checksum: bool,
    /// Which transport carries each pair (`GRADSYNC_TRANSPORT`): automatic (shared memory
    /// between ranks of one host, TCP otherwise), or one forced for every pair.
    pub transport: TransportMode,
    /// Host identity override (`GRADSYNC_HOST_ID`): ranks that give the same string are treated
    /// as one host. `None`: hostname, boot id and network namespace identify the host.
    pub host_id: Option<String>,
    /// Whether init binds the calling thread to the NUMA node of the network interface when the
    /// machine has more than one node (`GRADSYNC_NUMA_BIND`): unset, only a thread nobody has
    /// bound yet; `1`, narrowed to the node within its current CPUs; `0`, never. An affinity the
    /// thread already has is never widened or replaced.
    pub numa_bind: crate::topology::NumaBind,
    /// RDMA device settings (`GRADSYNC_IB_*`); used with the `rdma` feature.
    pub ib: IbConfig,
    /// Whether init measures the links for the cost model of the automatic algorithm choice
    /// (`GRADSYNC_CALIBRATE`); see [`Calibrate`].
    pub calibrate: Calibrate,
    /// Most time init may spend timing the all-reduce candidates on one host
    /// (`GRADSYNC_CALIBRATE_BUDGET`, seconds; default 3): the sizes that do not fit are left to
    /// the per-pair model.
    pub calibrate_budget: Duration,
    /// A cost model file (`GRADSYNC_COST_FILE`): when it exists the model is read from it and
    /// nothing is measured (pinned); when it does not, the model init measures is written
    /// there instead of the per-host cache. Read on rank 0 only. See [`crate::cost`].
    pub cost_file: Option<std::path::PathBuf>,
}

/// `GRADSYNC_CALIBRATE`: where the cost model of the automatic choice comes from when no
/// `GRADSYNC_COST_FILE` pins it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Calibrate {
    /// `auto`: read the per-host cache file ([`crate::cost::cache_path`]); when there is none,
    /// measure at init (bounded by [`crate::cost::CALIBRATION_BUDGET`]) and write it.
    #[default]
    Auto,
    /// `always`: measure at every init, and rewrite the cache.
    Always,
    /// `0` or `off`: never measure; the cache file if there is one, else uncalibrated figures.
    Off,
}

impl Calibrate {
    /// Parses `auto` (or `1`), `always`, `off` (or `0`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "1" => Some(Calibrate::Auto),
            "always" => Some(Calibrate::Always),
            "off" | "0" => Some(Calibrate::Off),
            _ => None,
        }
    }
}

/// RDMA settings, read whether or not the `rdma` feature is built in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbConfig {
    /// `GRADSYNC_IB_HCA`: device, or `device:port`; unset picks the first active port.
    pub hca: Option<String>,
    /// `GRADSYNC_IB_GID_INDEX`: GID index (RoCE); unset picks the RoCE v2 GID of an IPv4
    /// address.
    pub gid_index: Option<u32>,
    /// `GRADSYNC_IB_QPS_PER_CONN`: queue pairs per peer, used round-robin (1..=16, default 2).
    pub qps_per_conn: usize,
    /// `GRADSYNC_IB_TIMEOUT`: local ACK timeout exponent, 4.096 µs x 2^n (1..=31, default 18).
    pub timeout: u8,
    /// `GRADSYNC_IB_RETRY_CNT`: transport retries (0..=7, default 7).
    pub retry_cnt: u8,
    /// `GRADSYNC_IB_DISABLE=1`: the automatic choice never uses RDMA.
    pub disable: bool,
}

impl Default for IbConfig {
    fn default() -> Self {
        IbConfig {
            hca: None,
            gid_index: None,
            qps_per_conn: 2,
            timeout: 18,
            retry_cnt: 7,
            disable: false,
        }
    }
}

/// `GRADSYNC_TRANSPORT`: how the transport of each rank pair is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportMode {
    /// `auto`: shared memory to ranks on the same host, the network to the others: RDMA when
    /// the `rdma` feature is built in and every rank has an active port (unless
    /// `GRADSYNC_IB_DISABLE=1`), TCP otherwise. When the kernel refuses cross-memory attach,
    /// local pairs fall back to the network (logged at WARN).
    #[default]
    Auto,
    /// `tcp`: every pair over TCP.
    Tcp,
    /// `shm`: every pair over shared memory; an error if a peer is on another host.
    Shm,
    /// `rdma`: every pair over InfiniBand/RoCE verbs (the `rdma` feature and an active port).
    Rdma,
}

impl TransportMode {
    /// Parses `auto`, `tcp`, `shm` or `rdma`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(TransportMode::Auto),
            "tcp" | "net" | "socket" => Some(TransportMode::Tcp),
            "shm" => Some(TransportMode::Shm),
            "rdma" | "ib" | "verbs" => Some(TransportMode::Rdma),
            _ => None,
        }
    }
}

/// TCP streams to a peer on another host unless `GRADSYNC_NSOCKS` is set: one. Across emulated
/// hosts with BBR (the kernel's default here), a 1 MiB all-reduce measured closer to the cost
/// model with one stream than with two, whole writes in turn or striped (docs/hosts.md).
pub const DEFAULT_NSOCKS: usize = 1;
/// TCP streams to a peer on this host unless `GRADSYNC_NSOCKS` is set: over loopback, 2 ranks,
/// 64 MiB, two streams measured 1.08x one.
pub const DEFAULT_NSOCKS_LOCAL: usize = 2;
/// Default `GRADSYNC_RECV_BUDGET`: every peer keeps the default 8 slots of 512 KiB up to 256
/// ranks; 1024 ranks get 2 slots a peer (1 GiB, within a 4 GiB pin limit under RDMA).
pub const DEFAULT_RECV_BUDGET: usize = 1 << 30;
/// Fewest inbox slots a peer gets, whatever the receive budget: one message in flight while
/// the previous one is consumed.
pub const MIN_SLOTS_PER_PEER: usize = 2;

/// Default `GRADSYNC_CHUNK_SIZE`.
pub const DEFAULT_CHUNK: usize = 512 * 1024;
/// Default `GRADSYNC_NSLOTS`.
pub const DEFAULT_NSLOTS: usize = 8;
/// `GRADSYNC_TCP_NSLOTS` by default to a peer on this host (a peer on another host gets all
/// `GRADSYNC_NSLOTS`).
pub const DEFAULT_TCP_NSLOTS: usize = 3;
/// Default `GRADSYNC_TIMEOUT`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default `GRADSYNC_SPIN_US`.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

/// Default [`Config::shm_move_direct_min`]: from 64 KiB, all-to-all and all-gather messages
/// between ranks on shared memory are written straight into place.
pub const DEFAULT_SHM_MOVE_DIRECT_MIN: usize = 64 << 10;
/// Default [`Config::shm_move_block_min`]: all-to-alls and all-gathers whose blocks are
/// smaller than 8 MiB go through the inbox over shared memory.
pub const DEFAULT_SHM_MOVE_BLOCK_MIN: usize = 8 << 20;
/// Default `GRADSYNC_DIRECT_MIN`.
pub const DEFAULT_DIRECT_MIN: usize = usize::MAX;
/// Default `MASTER_PORT`, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// A source of environment variables (the process environment, or a map in tests).
trait Vars {
    fn get(&self, name: &str) -> Option<String>;
}

struct ProcessEnv;

impl Vars for ProcessEnv {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl<F: Fn(&str) -> Option<String>> Vars for F {
    fn get(&self, name: &str) -> Option<String> {
        self(name)
    }
}

struct Env<'a>(&'a dyn Vars);

impl Env<'_> {
    fn var(&self, name: &str) -> Option<String> {
        self.0.get(name).filter(|v| !v.trim().is_empty())
    }

    /// A `0`/`1` switch.
    fn flag(&self, name: &str) -> Result<Option<bool>, Error> {
        match self.var(name) {
            None => Ok(None),
            Some(v) => match v.trim() {
                "0" => Ok(Some(false)),
                "1" => Ok(Some(true)),
                _ => Err(Error::Config(format!("{name}={v:?} must be 0 or 1"))),
            },
        }
    }

    /// [`parse`](Self::parse), and an error naming the variable when the value lies outside
    /// `range`.
    fn parse_in<T>(
        &self,
        name: &str,
        range: std::ops::RangeInclusive<T>,
    ) -> Result<Option<T>, Error>
    where
        T: std::str::FromStr + PartialOrd + std::fmt::Display,
    {
        match self.parse::<T>(name)? {
            Some(n) if !range.contains(&n) => Err(Error::Config(format!(
                "{name}={n} must be between {} and {}",
                range.start(),
                range.end()
            ))),
            n => Ok(n),
        }
    }

    fn parse<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, Error> {
        match self.var(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| Error::Config(format!("{name}={v:?} is not a valid value"))),
        }
    }
}

/// Parses a size with an optional K/M/G suffix (powers of 1024).
pub(crate) fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1 << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
}

impl Config {
    /// A configuration with default tunables for `rank` of `world`, meeting at `store_addr`.
    pub fn new(store_addr: impl Into<String>, rank: usize, world: usize) -> Self {
        Config {
            store_addr: store_addr.into(),
            host_store: true,
            rank,
            world,
            local_rank: None,
            timeout: DEFAULT_TIMEOUT,
            nsocks: 0,
            socket_ifname: None,
            socket_bufsize: 0,
            chunk_bytes: DEFAULT_CHUNK,
            nslots: DEFAULT_NSLOTS,
            recv_budget: DEFAULT_RECV_BUDGET,
            tcp_nslots: 0,
            spin: DEFAULT_SPIN,
            algorithm: None,
            collective_algorithms: Vec::new(),
            direct_min: DEFAULT_DIRECT_MIN,
            shm_direct_min: usize::MAX,
            shm_move_direct_min: DEFAULT_SHM_MOVE_DIRECT_MIN,
            shm_move_block_min: DEFAULT_SHM_MOVE_BLOCK_MIN,
            eager_max: usize::MAX,
            shm_board: true,
            shm_huge_pages: true,
            runtime_connect: true,
            deterministic: false,
            token: None,
            checksum: false,
            transport: TransportMode::Auto,
            host_id: None,
            numa_bind: crate::topology::NumaBind::WhenUnbound,
            ib: IbConfig::default(),
            calibrate: Calibrate::Auto,
            calibrate_budget: Duration::from_secs(3),
            cost_file: None,
        }
    }

    /// TCP streams to a peer on this host (`same_host`) or on another: `GRADSYNC_NSOCKS` if
    /// set, else two on this host and one to another.
    pub fn tcp_streams(&self, same_host: bool) -> usize {
        match self.nsocks {
            0 if same_host => DEFAULT_NSOCKS_LOCAL,
            0 => DEFAULT_NSOCKS,
            n => n,
        }
    }

    /// Inbox slots per peer on `world` ranks: `nslots`, or fewer where `world * nslots`
    /// slots of `chunk_bytes` exceed `recv_budget` (the most that fit, at least
    /// 2, or `nslots` if fewer). A function of the settings and the world alone, so ranks with
    /// the same settings agree. The second value is whether even the fewest slots exceed the
    /// budget.
    pub fn slots_within_budget(&self, world: usize) -> (usize, bool) {
        let per_slot = world.max(1).saturating_mul(self.chunk_bytes.max(1));
        let fit = self.recv_budget / per_slot;
        let least = MIN_SLOTS_PER_PEER.min(self.nslots);
        (fit.clamp(least, self.nslots.max(least)), fit < least)
    }

    /// Reads rank, world and store address from the launcher's environment, then the
    /// `GRADSYNC_*` tunables.
    ///
    /// Launchers recognised, in this order: torchrun / `gradsync launch` (`RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), Open MPI (`OMPI_COMM_WORLD_RANK`,
    /// `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`) and Slurm (`SLURM_PROCID`,
    /// `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODELIST`). `MASTER_ADDR` defaults to the first
    /// Slurm node, or to 127.0.0.1 when all ranks are on one host; `MASTER_PORT` to 29500.
    /// The store's port is `GRADSYNC_STORE_PORT` when set; otherwise `MASTER_PORT`, or
    /// `MASTER_PORT + 1` under torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE=True`,
    /// whose agent already listens on `MASTER_PORT`).
    pub fn from_env() -> Result<Self, Error> {
        Self::from_vars(&Env(&ProcessEnv))
    }

    fn from_vars(env: &Env<'_>) -> Result<Self, Error> {
        let parse_var = |n: &str| env.parse::<usize>(n);
        let var = |n: &str| env.var(n);
        let (rank, world, local, local_world, single_host, launcher) = if let (Some(r), Some(w)) =
            (parse_var("RANK")?, parse_var("WORLD_SIZE")?)
        {
            let lw = parse_var("LOCAL_WORLD_SIZE")?;
            (
                r,
                w,
                parse_var("LOCAL_RANK")?,
                lw,
                lw == Some(w),
                "torchrun",
            )
        } else if let (Some(r), Some(w)) = (
            parse_var("OMPI_COMM_WORLD_RANK")?,
            parse_var("OMPI_COMM_WORLD_SIZE")?,
        ) {
            let lw = parse_var("OMPI_COMM_WORLD_LOCAL_SIZE")?;
            (
                r,
                w,
                parse_var("OMPI_COMM_WORLD_LOCAL_RANK")?,
                lw,
                lw == Some(w),
                "openmpi",
            )
        } else if let (Some(r), Some(w)) = (parse_var("SLURM_PROCID")?, parse_var("SLURM_NTASKS")?)
        {
            let nodes = parse_var("SLURM_NNODES")?;
            (
                r,
                w,
                parse_var("SLURM_LOCALID")?,
                None,
                nodes == Some(1),
                "slurm",
            )
        } else {
            return Err(Error::Config(
                "no launcher environment found: set RANK and WORLD_SIZE (torchrun, `gradsync launch`), or run under Slurm (SLURM_PROCID) or Open MPI (OMPI_COMM_WORLD_RANK)".into(),
            ));
        };
        let _ = local_world;
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} is not within world size {world} (from {launcher} variables)"
            )));
        }
        let addr = match var("MASTER_ADDR") {
            Some(a) => a,
            None => match var("SLURM_NODELIST")
                .or_else(|| var("SLURM_JOB_NODELIST"))
                .map(|l| crate::slurm::first_host(&l))
                .transpose()
                .map_err(|e| Error::Config(format!("{e} (SLURM_NODELIST)")))?
                .flatten()
            {
                Some(h) if !single_host => h,
                _ if single_host || world == 1 => "127.0.0.1".to_string(),
                _ => {
                    return Err(Error::Config(format!(
                        "MASTER_ADDR is not set and the {launcher} ranks span several hosts: set MASTER_ADDR to rank 0's host"
                    )));
                }
            },
        };
        let master_port = env
            .parse::<u16>("MASTER_PORT")?
            .unwrap_or(DEFAULT_MASTER_PORT);
        // torchrun's agent already serves its own store (a different protocol) on MASTER_PORT
        // and tells its workers so: gradsync's store then takes the next port.
        let agent_store = launcher == "torchrun"
            && var("TORCHELASTIC_USE_AGENT_STORE")
                .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1"));
        let port = match env.parse::<u16>("GRADSYNC_STORE_PORT")? {
            Some(p) => p,
            None if agent_store => master_port.checked_add(1).ok_or_else(|| {
                Error::Config(format!(
                    "MASTER_PORT={master_port} is torchrun's agent store and has no next port for gradsync's: set GRADSYNC_STORE_PORT"
                ))
            })?,
            None => master_port,
        };
        let host = if addr.contains(':') && !addr.starts_with('[') {
            format!("[{addr}]")
        } else {
            addr
        };
        let mut c = Config::new(format!("{host}:{port}"), rank, world);
        c.local_rank = local;
        if let Some(v) = env.parse::<u8>("GRADSYNC_STORE_EXTERNAL")? {
            c.host_store = v == 0;
        }
        c.apply_vars(env)?;
        Ok(c)
    }

    /// Applies the `GRADSYNC_*` tunables found in the environment.
    pub fn apply_env(&mut self) -> Result<(), Error> {
        self.apply_vars(&Env(&ProcessEnv))
    }

    fn apply_vars(&mut self, env: &Env<'_>) -> Result<(), Error> {
        let var = |n: &str| env.var(n);
        if let Some(t) = env.parse::<f64>("GRADSYNC_TIMEOUT")? {
            if !(t > 0.0 && t.is_finite()) {
                return Err(Error::Config(format!(
                    "GRADSYNC_TIMEOUT={t} must be a positive number of seconds"
                )));
            }
            self.timeout = Duration::from_secs_f64(t);
        }
        if let Some(n) = env.parse_in::<usize>("GRADSYNC_NSOCKS", 1..=16)? {
            self.nsocks = n;
        }
        if let Some(i) = var("GRADSYNC_SOCKET_IFNAME") {
            self.socket_ifname = Some(i);
        }
        if let Some(v) = var("GRADSYNC_SOCKET_BUFSIZE") {
            self.socket_bufsize = parse_size(&v).ok_or_else(|| {
                Error::Config(format!("GRADSYNC_SOCKET_BUFSIZE={v:?} is not a size"))
            })?;
        }
        if let Some(v) = var("GRADSYNC_CHUNK_SIZE") {
            let b = parse_size(&v)
                .filter(|&b| (8..=(64 << 20)).contains(&b))
                .ok_or_else(|| {
                    Error::Config(format!(
                        "GRADSYNC_CHUNK_SIZE={v:?} must be a size between 8 bytes and 64M"
                    ))
                })?;
            self.chunk_bytes = b;
        }
        if let Some(n) = env.parse_in::<usize>("GRADSYNC_NSLOTS", 1..=1024)? {
            self.nslots = n;
        }
        if let Some(n) = env.parse_in::<usize>("GRADSYNC_TCP_NSLOTS", 1..=1024)? {
            self.tcp_nslots = n;
        }
        if let Some(v) = var("GRADSYNC_RECV_BUDGET") {
            self.recv_budget = parse_size(&v).filter(|&b| b > 0).ok_or_else(|| {
                Error::Config(format!(
                    "GRADSYNC_RECV_BUDGET={v:?} is not a size above 0 (for example 512M or 2G)"
                ))
            })?;
        }
        if let Some(v) = var("GRADSYNC_DIRECT_MIN") {
            self.direct_min = direct_min_var("GRADSYNC_DIRECT_MIN", &v)?;
        }
        if let Some(v) = var("GRADSYNC_EAGER_MAX") {
            let max = BOARD_EAGER_MAX;
            self.eager_max = match v.trim() {
                "off" => 0,
                t => parse_size(t).filter(|&n| n <= max).ok_or_else(|| {
                    Error::Config(format!(
                        "GRADSYNC_EAGER_MAX={v:?} must be a size of at most {max} bytes (or `off`)"
                    ))
                })?,
            };
        }
        if let Some(v) = var("GRADSYNC_SHM_DIRECT_MIN") {
            self.shm_direct_min = direct_min_var("GRADSYNC_SHM_DIRECT_MIN", &v)?;
            self.shm_move_direct_min = self.shm_direct_min;
            self.shm_move_block_min = 0;
        }
        if let Some(v) = var("GRADSYNC_CALIBRATE") {
            self.calibrate = Calibrate::parse(&v).ok_or_else(|| {
                Error::Config(format!(
                    "GRADSYNC_CALIBRATE={v:?} must be auto, always or off (or 1, 0)"
                ))
            })?;
        }
        if let Some(t) = env.parse::<f64>("GRADSYNC_CALIBRATE_BUDGET")? {
            if !(t > 0.0 && t <= 3600.0) {
                return Err(Error::Config(format!(
                    "GRADSYNC_CALIBRATE_BUDGET={t} must be a number of seconds above 0 and at \
                     most 3600"
                )));
            }
            self.calibrate_budget = Duration::from_secs_f64(t);
        }
        if let Some(v) = var("GRADSYNC_COST_FILE") {
            self.cost_file = Some(std::path::PathBuf::from(v));
        }
        if let Some(on) = env.flag("GRADSYNC_DETERMINISTIC")? {
            self.deterministic = on;
        }
        if let Some(on) = env.flag("GRADSYNC_SHM_BOARD")? {
            self.shm_board = on;
        }
        if let Some(on) = env.flag("GRADSYNC_SHM_HUGEPAGES")? {
            self.shm_huge_pages = on;
        }
        if let Some(on) = env.flag("GRADSYNC_RUNTIME_CONNECT")? {
            self.runtime_connect = on;
        }
        if let Some(on) = env.flag("GRADSYNC_CHECKSUM")? {
            self.checksum = on;
        }
        if let Some(t) = var("GRADSYNC_TOKEN") {
            self.token = Some(t);
        }
        if let Some(us) = env.parse::<u64>("GRADSYNC_SPIN_US")? {
            self.spin = Duration::from_micros(us);
        }
        if let Some(v) = var("GRADSYNC_TRANSPORT") {
            self.transport = TransportMode::parse(&v).ok_or_else(|| {
                Error::Config(format!(
                    "GRADSYNC_TRANSPORT={v:?} must be auto, tcp, shm or rdma"
                ))
            })?;
        }
        if let Some(on) = env.flag("GRADSYNC_NUMA_BIND")? {
            self.numa_bind = if on {
                crate::topology::NumaBind::On
            } else {
                crate::topology::NumaBind::Off
            };
        }
        if let Some(v) = var("GRADSYNC_HOST_ID") {
            self.host_id = Some(v);
        }
        if let Some(a) = var("GRADSYNC_ALGO") {
            (self.algorithm, self.collective_algorithms) = parse_algorithms(&a)?;
        }
        if let Some(h) = var("GRADSYNC_IB_HCA") {
            self.ib.hca = Some(h.trim().to_string());
        }
        if let Some(i) = env.parse::<u32>("GRADSYNC_IB_GID_INDEX")? {
            self.ib.gid_index = Some(i);
        }
        if let Some(n) = env.parse_in::<usize>("GRADSYNC_IB_QPS_PER_CONN", 1..=16)? {
            self.ib.qps_per_conn = n;
        }
        if let Some(t) = env.parse_in::<u8>("GRADSYNC_IB_TIMEOUT", 1..=31)? {
            self.ib.timeout = t;
        }
        if let Some(r) = env.parse_in::<u8>("GRADSYNC_IB_RETRY_CNT", 0..=7)? {
            self.ib.retry_cnt = r;
        }
        if let Some(on) = env.flag("GRADSYNC_IB_DISABLE")? {
            self.ib.disable = on;
        }
        Ok(())
    }
}

/// `GRADSYNC_ALGO`: comma-separated items, each `ALGO` (the all-reduce's) or `COLL:ALGO` with
/// `COLL` one of `all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `reduce` (also
/// without the underscore); `auto` leaves a collective to the automatic choice.
#[allow(clippy::type_complexity)]
fn parse_algorithms(v: &str) -> Result<(Option<Algorithm>, Vec<(Collective, Algorithm)>), Error> {
    let bad = |msg: String| Error::Config(format!("GRADSYNC_ALGO={v:?}: {msg}"));
    let mut all_reduce = None;
    let mut others: Vec<(Collective, Algorithm)> = Vec::new();
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (coll, algo) = match item.split_once(':') {
            None => (Collective::AllReduce, item),
            Some((c, a)) => {
                let c = c.trim().to_ascii_lowercase().replace('_', "");
                let coll = Collective::ALL
                    .into_iter()
                    .filter(|k| {
                        !matches!(
                            k,
                            Collective::Barrier | Collective::SendRecv | Collective::AllToAllV
                        )
                    })
                    .find(|k| k.name().replace('_', "") == c)
                    .ok_or_else(|| {
                        bad(format!(
                            "unknown collective {c:?} (all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, gather, scatter)"
                        ))
                    })?;
                (coll, a.trim())
            }
        };
        let algo = if algo.eq_ignore_ascii_case("auto") {
            None
        } else {
            let a = Algorithm::parse(algo).map_err(|e| bad(e.to_string()))?;
            if !gradsync_core::schedule::plan::supports(coll, a) {
                let ok: Vec<&str> = Algorithm::ALL
                    .into_iter()
                    .filter(|&x| gradsync_core::schedule::plan::supports(coll, x))
                    .map(Algorithm::name)
                    .collect();
                return Err(bad(format!(
                    "{} has no {} algorithm (it has {})",
                    coll.name(),
                    a.name(),
                    ok.join(", ")
                )));
            }
            Some(a)
        };
        others.retain(|(c, _)| *c != coll);
        match (coll, algo) {
            (Collective::AllReduce, a) => all_reduce = a,
            (c, Some(a)) => others.push((c, a)),
            (_, None) => {}
        }
    }
    Ok((all_reduce, others))
}

/// A direct-write threshold: a size, or `off`.
fn direct_min_var(name: &str, v: &str) -> Result<usize, Error> {
    if v.trim() == "off" {
        return Ok(usize::MAX);
    }
    parse_size(v).ok_or_else(|| Error::Config(format!("{name}={v:?} is not a size (or `off`)")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512K"), Some(512 << 10));
        assert_eq!(parse_size("4m"), Some(4 << 20));
        assert_eq!(parse_size("17"), Some(17));
        assert_eq!(parse_size("x"), None);
    }

    fn from(vars: &[(&str, &str)]) -> Result<Config, Error> {
        let map: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let f = move |n: &str| map.get(n).cloned();
        Config::from_vars(&Env(&f))
    }

    #[test]
    fn launchers() {
        let c = from(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world, c.local_rank, c.store_addr.as_str()),
            (3, 4, Some(1), "10.1.2.3:1234")
        );
        let c = from(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world, c.store_addr.as_str()),
            (1, 2, "127.0.0.1:29500")
        );
        let c = from(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODELIST", "gpu[07-08]"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world, c.store_addr.as_str()),
            (5, 8, "gpu07:29500")
        );
        let slurm = |list| {
            from(&[
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_NNODES", "2"),
                ("SLURM_NODELIST", list),
            ])
        };
        let c = slurm("a[01-04,7]-ib,b3").unwrap();
        assert_eq!(c.store_addr, "a01-ib:29500");
        let e = slurm("a[1-2-ib").unwrap_err().to_string();
        assert!(
            e.contains("a[1-2-ib") && e.contains("SLURM_NODELIST"),
            "{e}"
        );
        let e = from(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4")]).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR is not set"), "{e}");
        assert!(
            from(&[])
                .unwrap_err()
                .to_string()
                .contains("no launcher environment")
        );
        assert!(
            from(&[("RANK", "4"), ("WORLD_SIZE", "4")])
                .unwrap_err()
                .to_string()
                .contains("not within world size 4")
        );
        for (name, v) in [
            ("GRADSYNC_NSOCKS", "99"),
            ("GRADSYNC_TCP_NSLOTS", "0"),
            ("GRADSYNC_CALIBRATE_BUDGET", "0"),
            ("GRADSYNC_CALIBRATE_BUDGET", "-1"),
        ] {
            let e = from(&[("RANK", "0"), ("WORLD_SIZE", "1"), (name, v)]).unwrap_err();
            assert!(e.to_string().contains(&format!("{name}={v}")), "{e}");
        }
        let c = from(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("GRADSYNC_TCP_NSLOTS", "5"),
        ])
        .unwrap();
        assert_eq!((c.nslots, c.tcp_nslots), (DEFAULT_NSLOTS, 5));
        assert_eq!(c.calibrate_budget, Duration::from_secs(3));
        let c = from(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("GRADSYNC_CALIBRATE_BUDGET", "0.5"),
        ])
        .unwrap();
        assert_eq!(c.calibrate_budget, Duration::from_millis(500));
        let c = from(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("GRADSYNC_CHUNK_SIZE", "1M"),
            ("GRADSYNC_TIMEOUT", "2.5"),
            ("GRADSYNC_ALGO", "ring"),
        ])
        .unwrap();
        assert_eq!(
            (c.chunk_bytes, c.timeout, c.algorithm),
            (1 << 20, Duration::from_millis(2500), Some(Algorithm::Ring))
        );
        assert!(
            from(&[("RANK", "x"), ("WORLD_SIZE", "1")])
                .unwrap_err()
                .to_string()
                .contains("RANK=\"x\"")
        );
    }

    #[test]
    fn store_port_beside_torchrun_agent_store() {
        let torchrun = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "40251"),
        ];
        let port = |extra: &[(&str, &str)]| {
            let mut v = torchrun.to_vec();
            v.extend_from_slice(extra);
            from(&v).map(|c| c.store_addr)
        };
        // No agent store: MASTER_PORT itself, as before.
        assert_eq!(port(&[]).unwrap(), "localhost:40251");
        // torchrun's agent listens on MASTER_PORT: the next port.
        let agent = ("TORCHELASTIC_USE_AGENT_STORE", "True");
        assert_eq!(port(&[agent]).unwrap(), "localhost:40252");
        assert_eq!(
            port(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).unwrap(),
            "localhost:40251"
        );
        // GRADSYNC_STORE_PORT wins either way.
        let explicit = ("GRADSYNC_STORE_PORT", "31000");
        assert_eq!(port(&[agent, explicit]).unwrap(), "localhost:31000");
        assert_eq!(port(&[explicit]).unwrap(), "localhost:31000");
        let e = port(&[("GRADSYNC_STORE_PORT", "70000")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_STORE_PORT"), "{e}");
        let e = from(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_PORT", "65535"),
            agent,
        ])
        .unwrap_err();
        assert!(e.to_string().contains("set GRADSYNC_STORE_PORT"), "{e}");
        // Only torchrun's variables count: Open MPI and Slurm ranks keep MASTER_PORT.
        let c = from(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
            ("MASTER_PORT", "1234"),
            agent,
        ])
        .unwrap();
        assert_eq!(c.store_addr, "127.0.0.1:1234");
    }

    #[test]
    fn transport_option() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        assert_eq!(from(&base).unwrap().transport, TransportMode::Auto);
        let c = from(&[base[0], base[1], ("GRADSYNC_TRANSPORT", "SHM")]).unwrap();
        assert_eq!(c.transport, TransportMode::Shm);
        let c = from(&[base[0], base[1], ("GRADSYNC_TRANSPORT", "tcp")]).unwrap();
        assert_eq!(c.transport, TransportMode::Tcp);
        let c = from(&[base[0], base[1], ("GRADSYNC_TRANSPORT", "rdma")]).unwrap();
        assert_eq!(c.transport, TransportMode::Rdma);
        let e = from(&[base[0], base[1], ("GRADSYNC_TRANSPORT", "udp")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_TRANSPORT=\"udp\""), "{e}");
        let c = from(&[base[0], base[1], ("GRADSYNC_HOST_ID", "node-a")]).unwrap();
        assert_eq!(c.host_id.as_deref(), Some("node-a"));
    }

    #[test]
    fn rdma_options() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        assert_eq!(from(&base).unwrap().ib, IbConfig::default());
        let c = from(&[
            base[0],
            base[1],
            ("GRADSYNC_IB_HCA", "mlx5_1:2"),
            ("GRADSYNC_IB_GID_INDEX", "3"),
            ("GRADSYNC_IB_QPS_PER_CONN", "4"),
            ("GRADSYNC_IB_TIMEOUT", "20"),
            ("GRADSYNC_IB_RETRY_CNT", "5"),
            ("GRADSYNC_IB_DISABLE", "1"),
        ])
        .unwrap();
        assert_eq!(
            c.ib,
            IbConfig {
                hca: Some("mlx5_1:2".into()),
                gid_index: Some(3),
                qps_per_conn: 4,
                timeout: 20,
                retry_cnt: 5,
                disable: true,
            }
        );
        for (k, v) in [
            ("GRADSYNC_IB_QPS_PER_CONN", "0"),
            ("GRADSYNC_IB_QPS_PER_CONN", "17"),
            ("GRADSYNC_IB_TIMEOUT", "32"),
            ("GRADSYNC_IB_RETRY_CNT", "8"),
            ("GRADSYNC_IB_GID_INDEX", "-1"),
        ] {
            let e = from(&[base[0], base[1], (k, v)]).unwrap_err();
            let e = e.to_string();
            assert!(e.contains(k) && e.contains(v), "{e}");
        }
    }

    #[test]
    fn direct_write_thresholds() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        let c = from(&base).unwrap();
        assert_eq!(
            (c.direct_min, c.shm_direct_min, c.shm_move_direct_min),
            (DEFAULT_DIRECT_MIN, usize::MAX, DEFAULT_SHM_MOVE_DIRECT_MIN)
        );
        assert_eq!(c.shm_move_block_min, DEFAULT_SHM_MOVE_BLOCK_MIN);
        let c = from(&[
            base[0],
            base[1],
            ("GRADSYNC_DIRECT_MIN", "off"),
            ("GRADSYNC_SHM_DIRECT_MIN", "1M"),
        ])
        .unwrap();
        assert_eq!(
            (c.direct_min, c.shm_direct_min, c.shm_move_direct_min),
            (usize::MAX, 1 << 20, 1 << 20)
        );
        // Set, it holds for every block size.
        assert_eq!(c.shm_move_block_min, 0);
        let c = from(&[base[0], base[1], ("GRADSYNC_SHM_DIRECT_MIN", "off")]).unwrap();
        assert_eq!(
            (c.shm_direct_min, c.shm_move_direct_min),
            (usize::MAX, usize::MAX)
        );
        let e = from(&[base[0], base[1], ("GRADSYNC_SHM_DIRECT_MIN", "big")]).unwrap_err();
        assert!(
            e.to_string().contains("GRADSYNC_SHM_DIRECT_MIN=\"big\""),
            "{e}"
        );
    }

    #[test]
    fn algorithm_per_collective() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        let algo = |v: &'static str| from(&[base[0], base[1], ("GRADSYNC_ALGO", v)]);
        let c = algo("ring").unwrap();
        assert_eq!(
            (c.algorithm, c.collective_algorithms.len()),
            (Some(Algorithm::Ring), 0)
        );
        let c = algo("broadcast:ring, all_gather:hierarchical,AllReduce:tree").unwrap();
        assert_eq!(c.algorithm, Some(Algorithm::Tree));
        assert_eq!(
            c.collective_algorithms,
            vec![
                (Collective::Broadcast, Algorithm::Ring),
                (Collective::AllGather, Algorithm::Hierarchical)
            ]
        );
        let c = algo("auto,reduce:auto").unwrap();
        assert_eq!((c.algorithm, c.collective_algorithms.len()), (None, 0));
        let e = algo("reduce_scatter:tree").unwrap_err().to_string();
        assert!(
            e.contains("reduce_scatter has no tree algorithm (it has ring, hierarchical)"),
            "{e}"
        );
        let e = algo("gather:ring").unwrap_err().to_string();
        assert!(
            e.contains("gather has no ring algorithm (it has central)"),
            "{e}"
        );
        let e = algo("allgatherv:ring").unwrap_err().to_string();
        assert!(e.contains("unknown collective \"allgatherv\""), "{e}");
        let c = algo("all_to_all:bruck").unwrap();
        assert_eq!(
            c.collective_algorithms,
            vec![(Collective::AllToAll, Algorithm::Bruck)]
        );
        let e = algo("all_to_all:ring").unwrap_err().to_string();
        assert!(e.contains("(it has pairwise, bruck)"), "{e}");
    }

    #[test]
    fn calibrate_and_cost_file_options() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        let c = from(&base).unwrap();
        assert_eq!((c.calibrate, c.cost_file), (Calibrate::Auto, None));
        for (v, want) in [
            ("0", Calibrate::Off),
            ("always", Calibrate::Always),
            ("auto", Calibrate::Auto),
        ] {
            let c = from(&[base[0], base[1], ("GRADSYNC_CALIBRATE", v)]).unwrap();
            assert_eq!(c.calibrate, want, "{v}");
        }
        let e = from(&[base[0], base[1], ("GRADSYNC_CALIBRATE", "yes")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_CALIBRATE=\"yes\""), "{e}");
        let c = from(&[base[0], base[1], ("GRADSYNC_COST_FILE", "/tmp/m.json")]).unwrap();
        assert_eq!(
            c.cost_file.as_deref(),
            Some(std::path::Path::new("/tmp/m.json"))
        );
    }

    #[test]
    fn receive_budget_fits_the_slots_per_peer() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        let c = from(&base).unwrap();
        assert_eq!(c.recv_budget, DEFAULT_RECV_BUDGET);
        // 8 slots of 512 KiB per peer fit 1 GiB up to 256 ranks; then fewer, at least 2.
        for (world, slots, over) in [
            (2, 8, false),
            (256, 8, false),
            (257, 7, false),
            (512, 4, false),
            (1024, 2, false),
            (1025, 2, true),
            (4096, 2, true),
        ] {
            assert_eq!(c.slots_within_budget(world), (slots, over), "{world} ranks");
        }
        let small = from(&[base[0], base[1], ("GRADSYNC_RECV_BUDGET", "3M")]).unwrap();
        assert_eq!(small.recv_budget, 3 << 20);
        assert_eq!(small.slots_within_budget(2), (3, false));
        // GRADSYNC_NSLOTS below the minimum stays as set.
        let one = from(&[base[0], base[1], ("GRADSYNC_NSLOTS", "1")]).unwrap();
        assert_eq!(one.slots_within_budget(1 << 20), (1, true));
        for bad in ["0", "lots", "-1M"] {
            let e = from(&[base[0], base[1], ("GRADSYNC_RECV_BUDGET", bad)]).unwrap_err();
            assert!(e.to_string().contains("GRADSYNC_RECV_BUDGET"), "{e}");
        }
    }

    #[test]
    fn deterministic_option() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        assert!(!from(&base).unwrap().deterministic);
        let on = from(&[base[0], base[1], ("GRADSYNC_DETERMINISTIC", "1")]).unwrap();
        assert!(on.deterministic);
        let e = from(&[base[0], base[1], ("GRADSYNC_DETERMINISTIC", "on")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_DETERMINISTIC"), "{e}");
    }

    #[test]
    fn eager_and_board_options() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        let c = from(&base).unwrap();
        assert_eq!((c.eager_max, c.shm_board), (usize::MAX, true));
        let c = from(&[base[0], base[1], ("GRADSYNC_EAGER_MAX", "8K")]).unwrap();
        assert_eq!(c.eager_max, 8192);
        let c = from(&[base[0], base[1], ("GRADSYNC_EAGER_MAX", "off")]).unwrap();
        assert_eq!(c.eager_max, 0);
        let e = from(&[base[0], base[1], ("GRADSYNC_EAGER_MAX", "17K")]).unwrap_err();
        assert!(e.to_string().contains("at most 16384 bytes"), "{e}");
        let c = from(&[base[0], base[1], ("GRADSYNC_SHM_BOARD", "0")]).unwrap();
        assert!(!c.shm_board);
        assert!(from(&base).unwrap().runtime_connect);
        let c = from(&[base[0], base[1], ("GRADSYNC_RUNTIME_CONNECT", "0")]).unwrap();
        assert!(!c.runtime_connect);
        let e = from(&[base[0], base[1], ("GRADSYNC_RUNTIME_CONNECT", "x")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_RUNTIME_CONNECT"), "{e}");
        let e = from(&[base[0], base[1], ("GRADSYNC_SHM_BOARD", "no")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_SHM_BOARD"), "{e}");
        assert!(from(&base).unwrap().shm_huge_pages);
        let c = from(&[base[0], base[1], ("GRADSYNC_SHM_HUGEPAGES", "0")]).unwrap();
        assert!(!c.shm_huge_pages);
        let e = from(&[base[0], base[1], ("GRADSYNC_SHM_HUGEPAGES", "off")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_SHM_HUGEPAGES"), "{e}");
    }

    #[test]
    fn checksum_option() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1")];
        assert!(!from(&base).unwrap().checksum);
        let on = from(&[base[0], base[1], ("GRADSYNC_CHECKSUM", "1")]).unwrap();
        assert!(on.checksum);
        let off = from(&[base[0], base[1], ("GRADSYNC_CHECKSUM", "0")]).unwrap();
        assert!(!off.checksum);
        let e = from(&[base[0], base[1], ("GRADSYNC_CHECKSUM", "yes")]).unwrap_err();
        assert!(e.to_string().contains("GRADSYNC_CHECKSUM=\"yes\""), "{e}");
    }
}
