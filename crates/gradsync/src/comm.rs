//! The communicator: bootstrap and the collective calls.

use crate::config::Config;
use crate::config::TransportMode;
use crate::engine::{Engine, EngineOptions, Planned, RawBuf};
use crate::error::Error;
use crate::topology::{self, Topology};
use crate::{Element, Result};
use gradsync_core::schedule::plan::{self, Algorithm, Params};
use gradsync_core::schedule::{Buf, Loc, Op, Program};
use gradsync_core::wire::Signature;
use gradsync_core::{Collective, ReduceOp};
use gradsync_store::{StoreClient, StoreServer};
use gradsync_transport::hybrid::{HybridEndpoint, Route};
use gradsync_transport::shm::{ShmEndpoint, ShmInfo, ShmSetup};
use gradsync_transport::tcp::{self, TcpEndpoint, TcpOptions};
use gradsync_transport::{Endpoint, RemoteRegion};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant, SystemTime};

/// How long a waiting rank polls without yielding when every local rank has a core.
const BUSY_SPIN: Duration = Duration::from_micros(50);

/// A group of ranks that run collectives together.
///
/// Every rank calls the same collectives in the same order with matching arguments; each
/// message carries the call's signature, so a rank that does otherwise gets
/// [`Error::Mismatch`] naming both sides. Calls take `&mut self`: one operation runs at a time
/// per communicator.
#[derive(Debug)]
pub struct Communicator {
    engine: Engine,
    rank: usize,
    world: usize,
    seq: u64,
    p2p_seq: Vec<u64>,
    algorithm: Option<Algorithm>,
    /// Forced algorithms of the other collectives.
    coll_algorithms: Vec<(Collective, Algorithm)>,
    queue: VecDeque<Queued>,
    store: Option<StoreClient>,
    config: Option<Config>,
    generation: u64,
    closed: bool,
    current: Option<(u64, Box<dyn Any + Send>)>,
    finished: HashMap<u64, Box<dyn Any + Send>>,
    next_work: u64,
    /// Where every rank is and how this rank reaches it.
    layout: Layout,
    _store: Option<StoreServer>,
    /// Scratch of deterministic all-reduces, kept from one call to the next.
    det_scratch: Vec<u8>,
    /// All-reduce size classes (log2 of the bytes) whose choice was logged at INFO.
    explained: u64,
    /// The cost model of the automatic all-reduce choice.
    costs: crate::cost::LinkCosts,
    /// Where the cost model came from (pinned, cached, measured, uncalibrated).
    cost_from: String,
    /// The file the cost model was read from or saved to, if any.
    cost_path: Option<std::path::PathBuf>,
    /// The model's all-reduce choice per size class ([`crate::cost::size_class`], the index),
    /// computed on first use; read without locking afterwards.
    choices: Box<[std::sync::OnceLock<crate::cost::Choice>]>,
}

/// The cost model as rank 0 publishes it to the other ranks at init.
#[derive(serde::Serialize, serde::Deserialize)]
struct PublishedCosts {
    links: crate::cost::LinkCosts,
    from: String,
    path: Option<std::path::PathBuf>,
}

/// An empty cache of the model's choices: one slot per size class (`0..=usize::BITS`).
fn no_choices() -> Box<[std::sync::OnceLock<crate::cost::Choice>]> {
    (0..=usize::BITS)
        .map(|_| std::sync::OnceLock::new())
        .collect()
}

/// Largest bulk message of the calibration at init.
const CALIBRATION_MAX_BULK: usize = 8 << 20;

/// What init learned about the placement of ranks.
#[derive(Clone, Debug)]
struct Layout {
    /// Host index of every rank.
    host_of: Vec<usize>,
    /// Host identity string of every rank.
    host_ids: Vec<String>,
    /// Ranks per host when hosts are uniform contiguous blocks, else 0.
    local_size: usize,
    /// Transport name to every rank (`self` for this rank).
    routes: Vec<&'static str>,
    /// Network interface of the data connections (empty in process).
    ifname: String,
    /// Listening address of every rank (empty in process).
    addrs: Vec<SocketAddr>,
    /// Where init placed this rank on the NUMA nodes.
    placement: topology::Placement,
}

/// The settings that shape every rank's inbox and its use, which must be alike on all ranks,
/// and the size of the rank's board (eager all-reduces use boards when every rank has one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SlotLayout {
    chunk: u64,
    nslots: u32,
    tcp_nslots: u32,
    /// Bytes of the rank's transport board, 0 without one (or with `GRADSYNC_SHM_BOARD=0`).
    board: u32,
}

impl SlotLayout {
    /// Length of [`to_bytes`](Self::to_bytes), which follows the inbox descriptor.
    const LEN: usize = 20;

    fn of(c: &Config, board: usize) -> Self {
        SlotLayout {
            chunk: c.chunk_bytes as u64,
            nslots: c.nslots as u32,
            tcp_nslots: c.tcp_nslots as u32,
            board: if c.shm_board {
                u32::try_from(board).unwrap_or(u32::MAX)
            } else {
                0
            },
        }
    }

    fn to_bytes(self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.chunk.to_le_bytes());
        b[8..12].copy_from_slice(&self.nslots.to_le_bytes());
        b[12..16].copy_from_slice(&self.tcp_nslots.to_le_bytes());
        b[16..].copy_from_slice(&self.board.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8]) -> Option<Self> {
        (b.len() == Self::LEN).then(|| SlotLayout {
            chunk: u64::from_le_bytes(b[..8].try_into().expect("8")),
            nslots: u32::from_le_bytes(b[8..12].try_into().expect("4")),
            tcp_nslots: u32::from_le_bytes(b[12..16].try_into().expect("4")),
            board: u32::from_le_bytes(b[16..].try_into().expect("4")),
        })
    }

    /// An error naming both ranks and every setting that differs (the board may differ).
    fn check(&self, rank: usize, peer: usize, theirs: &SlotLayout) -> Result<(), Error> {
        let settings = |l: &SlotLayout| (l.chunk, l.nslots, l.tcp_nslots);
        if settings(self) == settings(theirs) {
            return Ok(());
        }
        let mut diff = Vec::new();
        for (name, a, b) in [
            ("GRADSYNC_CHUNK_SIZE", self.chunk, theirs.chunk),
            ("GRADSYNC_NSLOTS", self.nslots.into(), theirs.nslots.into()),
            (
                "GRADSYNC_TCP_NSLOTS",
                self.tcp_nslots.into(),
                theirs.tcp_nslots.into(),
            ),
        ] {
            if a != b {
                diff.push(format!(
                    "{name} is {a} on rank {rank} but {b} on rank {peer}"
                ));
            }
        }
        Err(Error::Config(format!(
            "rank {rank}: {}; set them alike on every rank",
            diff.join(", ")
        )))
    }
}

impl Layout {
    fn single_host(world: usize, rank: usize, transport: &'static str) -> Self {
        Layout {
            host_of: vec![0; world],
            host_ids: vec![String::new(); world],
            local_size: world,
            routes: (0..world)
                .map(|p| if p == rank { "self" } else { transport })
                .collect(),
            ifname: String::new(),
            addrs: Vec::new(),
            placement: topology::Placement::SingleNode,
        }
    }
}

/// An operation on an owned buffer, waiting for its turn.
struct Queued {
    id: u64,
    sig: Signature,
    prog: Planned,
    algo: &'static str,
    buf: RawBuf,
    owner: Box<dyn Any + Send>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Queued({} {})", self.id, self.sig)
    }
}

/// Handle of an operation on an owned buffer (see [`Communicator::all_reduce_owned`]).
#[derive(Debug)]
#[must_use = "the buffer comes back only through Communicator::wait"]
pub struct Work<T> {
    id: u64,
    _t: PhantomData<fn() -> T>,
}

/// An operation in flight. It holds the borrow of its buffers until [`Pending::wait`] (or
/// drop, which waits), so the buffers cannot be touched while the operation may use them.
///
/// Progress is made by the thread that calls [`Pending::test`] or [`Pending::wait`].
#[derive(Debug)]
#[must_use = "an operation completes only when it is waited for (or dropped, which waits)"]
pub struct Pending<'a> {
    comm: &'a mut Communicator,
    done: bool,
    _bufs: PhantomData<&'a mut [u8]>,
}

impl Pending<'_> {
    /// Drives the operation without blocking; `true` once it has completed.
    pub fn test(&mut self) -> Result<bool> {
        if !self.done {
            self.done = self.comm.engine.progress(false)?;
        }
        Ok(self.done)
    }

    /// Waits for completion (bounded by the communicator's timeout).
    pub fn wait(mut self) -> Result<()> {
        if !self.done {
            self.done = true;
            self.comm.engine.progress(true)?;
        }
        Ok(())
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.comm.engine.progress(true)
        {
            tracing::warn!(target: "gradsync::coll", "operation dropped without wait failed: {e}");
        }
    }
}

fn raw<T>(s: &[T]) -> RawBuf {
    RawBuf {
        addr: s.as_ptr() as usize,
        len: std::mem::size_of_val(s),
    }
}

fn new_comm_id() -> u64 {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut x = (t as u64) ^ ((std::process::id() as u64) << 32) ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x | 1
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("cannot resolve store address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("store address {addr:?} resolves to nothing")))
}

/// The local address the kernel would use to reach `to` (no packet is sent).
fn route_to(to: SocketAddr) -> Option<IpAddr> {
    if to.ip().is_loopback() {
        return Some(to.ip());
    }
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let s = UdpSocket::bind(any).ok()?;
    s.connect(to).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

/// Publishes this rank's `value` under `{prefix}/{what}/{rank}` and waits until every rank of
/// `ranks` has published its own; returns their values in the order of `ranks`.
fn exchange(
    store: &mut StoreClient,
    prefix: &str,
    what: &str,
    rank: usize,
    ranks: impl Iterator<Item = usize>,
    value: &[u8],
    timeout: Duration,
) -> std::result::Result<Vec<Vec<u8>>, gradsync_store::StoreError> {
    store.set(&format!("{prefix}/{what}/{rank}"), value)?;
    let keys: Vec<String> = ranks.map(|r| format!("{prefix}/{what}/{r}")).collect();
    let krefs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&krefs, timeout)
}

impl Communicator {
    /// Builds a communicator from the launcher's environment (torchrun / `gradsync launch`,
    /// Slurm, Open MPI) and the `GRADSYNC_*` variables. See [`Config::from_env`].
    pub fn from_env() -> Result<Self> {
        crate::logging::init_from_env();
        Self::init(Config::from_env()?)
    }

    /// Builds a communicator over TCP: rendezvous through the store at `config.store_addr`
    /// (started by rank 0 when `config.host_store`), exchange of listening addresses and inbox
    /// keys, then one connection of `config.nsocks` streams to every peer. Bounded by
    /// `config.timeout`.
    pub fn init(config: Config) -> Result<Self> {
        let rank = config.rank;
        let world = config.world;
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} is not within world size {world}"
            )));
        }
        crate::logging::set_rank(rank);
        // `kill -USR1 <pid>` writes every communicator's flight recorder (GRADSYNC_FLIGHT_DIR).
        crate::recorder::install_sigusr1_dump();
        let t0 = Instant::now();
        let store_sa = resolve(&config.store_addr)?;
        let token = config.token.as_deref().map(str::as_bytes);
        if token.is_none() {
            static NO_TOKEN: std::sync::Once = std::sync::Once::new();
            NO_TOKEN.call_once(|| {
                tracing::warn!(
                    target: "gradsync::init",
                    "running without GRADSYNC_TOKEN: connections are not authenticated"
                );
            });
        }
        let server = if config.host_store && rank == 0 {
            let mut server_config = gradsync_store::ServerConfig::default();
            server_config.token = token.map(<[u8]>::to_vec);
            Some(
                StoreServer::bind_with_config(store_sa, server_config)
                    .map_err(|source| Error::Store { rank, source })?,
            )
        } else {
            None
        };
        let mut store =
            StoreClient::connect_with_token(&config.store_addr, config.timeout, token, rank)
                .map_err(|source| Error::Store { rank, source })?;
        let st = |source| Error::Store { rank, source };
        // A fresh id per communicator; every key of this communicator lives under it.
        let comm_id = if rank == 0 {
            let id = new_comm_id();
            store
                .set("gradsync/comm_id", &id.to_le_bytes())
                .map_err(st)?;
            id
        } else {
            let v = store
                .wait(&["gradsync/comm_id"], config.timeout)
                .map_err(st)?;
            u64::from_le_bytes(
                v[0].as_slice()
                    .try_into()
                    .map_err(|_| Error::Config("malformed communicator id in the store".into()))?,
            )
        };
        Self::join(store, server, comm_id, rank, world, config, t0)
    }

    /// The part of init after the communicator id is agreed: addresses and inbox keys through
    /// the store, connections, then a barrier.
    fn join(
        mut store: StoreClient,
        server: Option<StoreServer>,
        comm_id: u64,
        rank: usize,
        world: usize,
        config: Config,
        t0: Instant,
    ) -> Result<Self> {
        let st = |source| Error::Store { rank, source };
        let token = config.token.as_deref().map(str::as_bytes);
        let store_sa = resolve(&config.store_addr)?;
        let (ip, ifname) = match &config.socket_ifname {
            Some(name) => (
                tcp::interface_addr(name)
                    .map_err(|e| Error::Config(format!("GRADSYNC_SOCKET_IFNAME: {e}")))?,
                name.clone(),
            ),
            None => {
                let ip = route_to(store_sa).ok_or_else(|| {
                    Error::Config(format!(
                        "no local route to the store at {store_sa}; set GRADSYNC_SOCKET_IFNAME"
                    ))
                })?;
                let name = tcp::interfaces()
                    .ok()
                    .and_then(|l| l.into_iter().find(|(_, a)| *a == ip).map(|(n, _)| n))
                    .unwrap_or_else(|| "?".into());
                (ip, name)
            }
        };
        let placement = topology::numa_placement(&ifname, config.numa_bind);
        tracing::info!(target: "gradsync::init", "rank {rank}: interface {ifname}: {placement}");
        let listener =
            tcp::listen(ip).map_err(|e| Error::Config(format!("cannot listen on {ip}: {e}")))?;
        let my_addr = listener
            .local_addr()
            .map_err(|e| Error::Config(format!("listener address: {e}")))?;
        let prefix = format!("gradsync/{comm_id:016x}");
        let host_id = config
            .host_id
            .clone()
            .unwrap_or_else(topology::host_identity);
        store
            .set(
                &format!("{prefix}/addr/{rank}"),
                my_addr.to_string().as_bytes(),
            )
            .map_err(st)?;
        store
            .set(&format!("{prefix}/host/{rank}"), host_id.as_bytes())
            .map_err(st)?;
        let my_cpus = topology::allowed_cpus();
        let cpu_list = my_cpus
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",");
        store
            .set(&format!("{prefix}/cpus/{rank}"), cpu_list.as_bytes())
            .map_err(st)?;
        let keys: Vec<String> = (0..world)
            .map(|r| format!("{prefix}/addr/{r}"))
            .chain((0..world).map(|r| format!("{prefix}/host/{r}")))
            .chain((0..world).map(|r| format!("{prefix}/cpus/{r}")))
            .collect();
        let krefs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let vals = store.wait(&krefs, config.timeout).map_err(st)?;
        let mut addrs = Vec::with_capacity(world);
        for (r, v) in vals[..world].iter().enumerate() {
            let s = String::from_utf8_lossy(v);
            addrs.push(s.parse::<SocketAddr>().map_err(|_| {
                Error::Config(format!("rank {r} published a malformed address {s:?}"))
            })?);
        }
        let host_ids: Vec<String> = vals[world..2 * world]
            .iter()
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        let topo = Topology::from_identities(&host_ids);
        let local = topo.local_ranks(rank);
        // The CPUs the ranks of this host may use together: when they number at least the
        // ranks, every rank can have a core of its own (bound by a launcher, or free to move).
        let local_cpus: std::collections::BTreeSet<usize> = local
            .iter()
            .flat_map(|&r| {
                topology::parse_cpu_list(&String::from_utf8_lossy(&vals[2 * world + r]))
                    .unwrap_or_default()
            })
            .collect();
        if config.transport == TransportMode::Shm
            && let Some(p) = (0..world).find(|p| !local.contains(p))
        {
            return Err(Error::Config(format!(
                "GRADSYNC_TRANSPORT=shm: rank {rank} (host {}) and rank {p} (host {}) are on different hosts",
                topology::host_label(&host_ids[rank]),
                topology::host_label(&host_ids[p])
            )));
        }
        let net: Box<dyn Endpoint> =
            match Self::setup_rdma(&mut store, &prefix, rank, world, &local, &config)? {
                Some(ep) => ep,
                None => {
                    let topts = TcpOptions {
                        nsocks: config.nsocks,
                        sock_buf: config.socket_bufsize,
                        timeout: config.timeout.saturating_sub(t0.elapsed()),
                        token: token.map(<[u8]>::to_vec),
                    };
                    Box::new(
                        TcpEndpoint::establish(rank, &addrs, listener, comm_id, &topts)
                            .map_err(|e| Error::transport(rank, "connect", e))?,
                    )
                }
            };
        let net_name = net.name();
        let shm = if matches!(config.transport, TransportMode::Auto | TransportMode::Shm)
            && local.len() > 1
        {
            match Self::setup_shm(&mut store, &prefix, rank, world, &local, &config) {
                Ok(shm) => Some(shm),
                Err(why) if config.transport == TransportMode::Shm => {
                    return Err(Error::Config(format!(
                        "GRADSYNC_TRANSPORT=shm: rank {rank}: {why}"
                    )));
                }
                Err(why) => {
                    tracing::warn!(target: "gradsync::init", "rank {rank}: shared memory unavailable, ranks on this host use tcp: {why}");
                    None
                }
            }
        } else {
            None
        };
        let (ep, routes): (Box<dyn Endpoint>, Vec<&'static str>) = match shm {
            Some(shm) => {
                let h = HybridEndpoint::new(net, shm)
                    .map_err(|e| Error::transport(rank, "connect", e))?;
                let routes = h.routes().iter().map(|r| r.name(net_name)).collect();
                (Box::new(h), routes)
            }
            None => (
                net,
                (0..world)
                    .map(|p| {
                        if p == rank {
                            Route::Own.name(net_name)
                        } else {
                            net_name
                        }
                    })
                    .collect(),
            ),
        };
        for (p, t) in routes.iter().enumerate().filter(|(p, _)| *p != rank) {
            tracing::info!(
                target: "gradsync::init",
                "rank {rank} -> rank {p}: {t} ({} host {}, {})",
                if topo.host_of[p] == topo.host_of[rank] { "same" } else { "other" },
                topology::host_label(&host_ids[p]),
                addrs[p]
            );
        }
        let layout = Layout {
            host_of: topo.host_of.clone(),
            host_ids,
            local_size: topo.uniform_local_size(),
            routes,
            ifname: ifname.clone(),
            addrs,
            placement,
        };
        let mut eopts = engine_options(&config);
        // Poll without yielding for a while when every rank of this host has a core: a peer's
        // shared-memory write then lands within the spin (sub-microsecond latency).
        if local.len() <= local_cpus.len() {
            eopts.busy_spin = BUSY_SPIN.min(config.spin);
        }
        let (mut engine, inbox) = Engine::new(ep, comm_id, eopts)?;
        let tcp_window = config.tcp_nslots.min(config.nslots);
        for (p, t) in layout.routes.iter().enumerate() {
            match *t {
                "shm" => engine.set_direct_min(p, config.shm_direct_min),
                // RDMA writes only into the peer's inbox (registered for the communicator's
                // life); caller buffers are never pinned, so no clear-to-send names one.
                "rdma" => engine.set_direct_min(p, usize::MAX),
                "tcp" => engine.set_window(p, tcp_window),
                _ => {}
            }
        }
        // Every rank lays out its inbox and picks slots from these three settings, so they
        // travel with the inbox descriptor and must agree.
        let slots = SlotLayout::of(&config, engine.ep.board_capacity());
        let mut mine = inbox.to_bytes().to_vec();
        mine.extend_from_slice(&slots.to_bytes());
        let vals = exchange(
            &mut store,
            &prefix,
            "inbox",
            rank,
            0..world,
            &mine,
            config.timeout,
        )
        .map_err(st)?;
        let mut inboxes = Vec::with_capacity(world);
        let mut board = usize::MAX;
        for (r, v) in vals.iter().enumerate() {
            let (desc, theirs) = v.split_at(v.len().saturating_sub(SlotLayout::LEN));
            inboxes.push(
                RemoteRegion::from_bytes(desc)
                    .zip(SlotLayout::from_bytes(theirs))
                    .ok_or_else(|| {
                        Error::Config(format!("rank {r} published a malformed inbox descriptor"))
                    })
                    .and_then(|(d, theirs)| {
                        board = board.min(theirs.board as usize);
                        slots.check(rank, r, &theirs).map(|()| d)
                    })?,
            );
        }
        engine.connect_peers(&inboxes);
        engine.enable_board(board);
        tracing::info!(
            target: "gradsync::init",
            "gradsync {} rank {rank}/{world} interface {ifname} {ip} transport {} hosts {} local ranks {} {} chunk {} KiB x {} slots eager up to {} bytes{} timeout {:?} (init {:.1} ms)",
            crate::VERSION,
            engine.ep.name(),
            topo.hosts(),
            local.len(),
            if net_name == "rdma" {
                format!("rdma queue pairs/peer {}", config.ib.qps_per_conn)
            } else {
                format!(
                    "tcp streams/peer {} slots/peer {}",
                    config.nsocks, tcp_window
                )
            },
            config.chunk_bytes / 1024,
            config.nslots,
            engine.eager_limit(),
            if engine.board() { " on the board" } else { "" },
            config.timeout,
            t0.elapsed().as_secs_f64() * 1e3
        );
        // Everyone is connected before anyone may leave (rank 0 keeps the store up until then).
        let mut c = Communicator::assemble(engine, rank, world, config.algorithm, server);
        c.coll_algorithms = config.collective_algorithms.clone();
        c.layout = layout;
        c.store = Some(store);
        c.config = Some(config);
        c.barrier()?;
        c.settle_costs(&prefix)?;
        Ok(c)
    }

    /// Settles the cost model of the automatic choice at init (see [`crate::cost`]). Rank 0
    /// takes it from `GRADSYNC_COST_FILE` or from the per-host cache, or has it measured, and
    /// publishes it in the store; every rank reads it from there, so all ranks choose alike.
    ///
    /// A measurement loads the links as a collective does. On a single host every rank joins
    /// ring all-gathers (see [`calibration_ring`](Self::calibration_ring)); across hosts rank 0
    /// ping-pongs with the first other rank of its host and the first rank of another host.
    /// Afterwards the ranks agree through the store that all of them are done, then put their
    /// sequence numbers and flight recorders back as they were: the calibration never shows in
    /// the numbering of the caller's operations.
    fn settle_costs(&mut self, prefix: &str) -> Result<()> {
        use crate::cost::LinkCosts;
        let rank = self.rank;
        let st = |source| Error::Store { rank, source };
        let Some(config) = self.config.clone() else {
            return Ok(());
        };
        let host0 = self.host_of(0);
        let intra_peer = (1..self.world).find(|&r| self.host_of(r) == host0);
        let inter_peer = (1..self.world).find(|&r| self.host_of(r) != host0);
        let timeout = self.timeout();
        let intra_t = intra_peer.map_or("shm", |p| self.peer_transport(p));
        let inter_t = inter_peer.map_or(intra_t, |p| self.peer_transport(p));
        // Rank 0 decides: a model it already has, or a measurement (plan byte 1).
        let mut decided: Option<(LinkCosts, String, Option<std::path::PathBuf>)> = None;
        if rank == 0 {
            let cache = crate::cost::cache_path(self.host_name(0), intra_t, inter_t);
            if let Some(f) = config.cost_file.as_ref().filter(|f| f.exists()) {
                let links = LinkCosts::load(f)
                    .map_err(|e| Error::Config(format!("GRADSYNC_COST_FILE: {e}")))?;
                decided = Some((links, format!("pinned in {}", f.display()), Some(f.clone())));
            } else if config.cost_file.is_none()
                && config.calibrate != crate::Calibrate::Always
                && let Some(c) = cache.as_ref().filter(|c| c.exists())
            {
                match LinkCosts::load(c) {
                    Ok(links) => {
                        decided =
                            Some((links, format!("cached in {}", c.display()), Some(c.clone())))
                    }
                    Err(e) => {
                        tracing::warn!(target: "gradsync::init", "rank 0: {e}; measuring again")
                    }
                }
            }
            if decided.is_none() && (config.calibrate == crate::Calibrate::Off || self.world < 2) {
                decided = Some((
                    LinkCosts::uncalibrated(intra_t, inter_t),
                    "uncalibrated".to_string(),
                    None,
                ));
            }
            let plan = [u8::from(decided.is_none())];
            let store = self.store.as_mut().expect("init keeps its store");
            store
                .set(&format!("{prefix}/cost/plan"), &plan)
                .map_err(st)?;
        }
        let store = self.store.as_mut().expect("init keeps its store");
        let plan = store
            .wait(&[&format!("{prefix}/cost/plan")], timeout)
            .map_err(st)?;
        if plan[0].first() == Some(&1) {
            let t0 = Instant::now();
            let (seq, p2p_seq) = (self.seq, self.p2p_seq.clone());
            let measured = if let Some(far) = inter_peer.filter(|_| rank == 0) {
                let budget = crate::cost::CALIBRATION_BUDGET / 2;
                let intra = match intra_peer {
                    Some(p) => self.calibration_lead(p, budget)?,
                    None => crate::cost::CostModel::uncalibrated(intra_t),
                };
                let inter = self.calibration_lead(far, budget)?;
                Some((intra, inter))
            } else if inter_peer.is_none() {
                self.calibration_ring()?.map(|m| (m.clone(), m))
            } else {
                if Some(rank) == intra_peer || Some(rank) == inter_peer {
                    self.calibration_follow(0)?;
                }
                None
            };
            let store = self.store.as_mut().expect("init keeps its store");
            exchange(
                store,
                prefix,
                "cost/done",
                rank,
                0..self.world,
                &[1],
                timeout,
            )
            .map_err(st)?;
            // Every rank has finished every calibration operation: none of their messages is
            // still on its way, so the numbering can start again where init left it.
            (self.seq, self.p2p_seq) = (seq, p2p_seq);
            self.engine.recorder.clear();
            if let Some((intra, inter)) = measured {
                let mut links = LinkCosts {
                    intra,
                    inter,
                    measured: Vec::new(),
                };
                let mut from = format!(
                    "measured at init in {:.0} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
                let cache = crate::cost::cache_path(self.host_name(0), intra_t, inter_t);
                let mut saved = None;
                if let Some(path) = config.cost_file.as_ref().or(cache.as_ref()) {
                    // Algorithms timed on this host stay valid when its links are measured
                    // again: keep them.
                    if let Ok(old) = LinkCosts::load(path) {
                        links.measured = old.measured;
                    }
                    match links.save(path) {
                        Ok(()) => {
                            from += &format!(", saved to {}", path.display());
                            saved = Some(path.clone());
                        }
                        Err(e) => tracing::warn!(
                            target: "gradsync::init",
                            "rank 0: cannot save the cost model to {}: {e}",
                            path.display()
                        ),
                    }
                }
                decided = Some((links, from, saved));
            }
        }
        let model_key = format!("{prefix}/cost/model");
        if let Some((links, from, path)) = decided {
            tracing::info!(
                target: "gradsync::init",
                "rank 0: cost model ({from}): inside a host {} alpha {:.2} us {:.3} GB/s, across hosts {} alpha {:.2} us {:.3} GB/s",
                links.intra.transport, links.intra.alpha_us, links.intra.gbytes_per_s,
                links.inter.transport, links.inter.alpha_us, links.inter.gbytes_per_s
            );
            let published = PublishedCosts { links, from, path };
            let text = serde_json::to_vec(&published)
                .map_err(|e| Error::Config(format!("cannot encode the cost model: {e}")))?;
            let store = self.store.as_mut().expect("init keeps its store");
            store.set(&model_key, &text).map_err(st)?;
            self.set_costs(published.links, published.from, published.path);
        } else {
            let store = self.store.as_mut().expect("init keeps its store");
            let v = store.wait(&[&model_key], timeout).map_err(st)?;
            let p: PublishedCosts = serde_json::from_slice(&v[0]).map_err(|e| {
                Error::Config(format!("rank 0 published a malformed cost model: {e}"))
            })?;
            self.set_costs(p.links, p.from, p.path);
        }
        Ok(())
    }

    /// The calibration of a single host, on every rank at once: ring all-gathers, which keep
    /// every rank sending and receiving as an all-reduce does, so that ranks sharing cores or
    /// memory bandwidth are measured sharing them. The median of 10 all-gathers of 8 bytes per
    /// rank gives the latency of a step, `t / (n - 1)`; then rank 0 announces (by broadcast) blocks of 64 KiB
    /// per rank and up, doubling while a round takes under a sixteenth of the budget (up to
    /// 16 MiB gathered), three rounds at the last size or until the budget is spent, and the
    /// fastest round there gives the bandwidth of a link,
    /// `(n - 1) * (block - 8) / (t_block - t_8)`. Returns the model on rank 0.
    fn calibration_ring(&mut self) -> Result<Option<crate::cost::CostModel>> {
        let n = self.world;
        let lead = self.rank == 0;
        let budget = crate::cost::CALIBRATION_BUDGET;
        let start = Instant::now();
        let mut input = vec![0u8; 8];
        let mut out = vec![0u8; 8 * n];
        let mut smalls = Vec::new();
        for i in 0..13 {
            let t = Instant::now();
            self.all_gather(&input, &mut out)?;
            if i >= 3 {
                smalls.push(t.elapsed().as_secs_f64());
            }
        }
        smalls.sort_by(f64::total_cmp);
        let small = smalls[smalls.len() / 2];
        let max_block = (16usize << 20) / n;
        let mut block = (64usize << 10).min(max_block).max(16);
        let (mut best, mut at_size) = (f64::INFINITY, 0);
        loop {
            let mut ann = [0i64];
            if lead {
                ann[0] = block as i64;
            }
            self.broadcast(&mut ann, 0)?;
            let b = usize::try_from(ann[0]).unwrap_or(0);
            if b == 0 {
                break;
            }
            if b > max_block.max(16) {
                return Err(self.invalid(
                    "calibrate",
                    format!("rank 0 announced blocks of {b} bytes, above {max_block}"),
                ));
            }
            input.resize(b, 0);
            out.resize(b * n, 0);
            let t = Instant::now();
            self.all_gather(&input, &mut out)?;
            let secs = t.elapsed().as_secs_f64();
            if !lead {
                continue;
            }
            at_size += 1;
            best = best.min(secs);
            if start.elapsed() >= budget || at_size >= 3 {
                block = 0;
            } else if secs < budget.as_secs_f64() / 16.0 && block * 2 <= max_block {
                block *= 2;
                (best, at_size) = (f64::INFINITY, 0);
            }
            if block == 0 {
                // Announce the end; the last measured size stays in `input`.
                let mut stop = [0i64];
                self.broadcast(&mut stop, 0)?;
                break;
            }
        }
        if !lead {
            return Ok(None);
        }
        let steps = (n - 1) as f64;
        let b = input.len() as f64;
        let per_step = (best - small).max(best / 2.0) / steps;
        Ok(Some(crate::cost::CostModel {
            transport: self.peer_transport(1).to_string(),
            alpha_us: small / steps * 1e6,
            gbytes_per_s: (b - 8.0) / per_step / 1e9,
        }))
    }

    /// Rank 0's side of the calibration of its link to `peer`: the latency from the median
    /// round trip of small ping-pongs, the bandwidth from bulk messages that double in size
    /// (64 KiB up to [`CALIBRATION_MAX_BULK`]) while a round takes under a sixteenth of
    /// `budget`, three rounds at the last size, the whole within about `budget`.
    fn calibration_lead(
        &mut self,
        peer: usize,
        budget: Duration,
    ) -> Result<crate::cost::CostModel> {
        let start = Instant::now();
        let mut ctl = [0i64; 2];
        let mut rtts = Vec::new();
        for i in 0..40 {
            let t = Instant::now();
            self.send(&[1i64, 0], peer)?;
            self.recv(&mut ctl, peer)?;
            if i >= 3 {
                rtts.push(t.elapsed().as_secs_f64());
            }
            if rtts.len() >= 5 && start.elapsed() > budget / 4 {
                break;
            }
        }
        rtts.sort_by(f64::total_cmp);
        let rtt = rtts[rtts.len() / 2];
        let mut size = 64usize << 10;
        let mut bulk = Vec::new();
        let (mut best, mut at_size) = (0f64, 0);
        loop {
            bulk.resize(size, 0u8);
            let t = Instant::now();
            self.send(&[2i64, size as i64], peer)?;
            self.send(&bulk, peer)?;
            self.recv(&mut ctl, peer)?;
            let secs = t.elapsed().as_secs_f64();
            let bw = size as f64 / (secs - rtt).max(secs / 2.0);
            at_size += 1;
            best = if at_size == 1 { bw } else { best.max(bw) };
            if start.elapsed() >= budget || at_size >= 3 {
                break;
            }
            if secs < budget.as_secs_f64() / 16.0 && size < CALIBRATION_MAX_BULK {
                size *= 2;
                at_size = 0;
            }
        }
        self.send(&[0i64, 0], peer)?;
        Ok(crate::cost::CostModel {
            transport: self.peer_transport(peer).to_string(),
            alpha_us: rtt / 2.0 * 1e6,
            gbytes_per_s: best / 1e9,
        })
    }

    /// The other side of [`calibration_lead`](Self::calibration_lead): answers pings and bulk
    /// messages from `lead` until it says stop.
    fn calibration_follow(&mut self, lead: usize) -> Result<()> {
        let mut ctl = [0i64; 2];
        let mut bulk = Vec::new();
        loop {
            self.recv(&mut ctl, lead)?;
            match ctl[0] {
                0 => return Ok(()),
                1 => self.send(&ctl, lead)?,
                _ => {
                    let n = usize::try_from(ctl[1])
                        .ok()
                        .filter(|&n| n <= CALIBRATION_MAX_BULK)
                        .ok_or_else(|| {
                            self.invalid(
                                "calibrate",
                                format!("rank {lead} announced a bulk message of {} bytes", ctl[1]),
                            )
                        })?;
                    bulk.resize(n, 0u8);
                    self.recv(&mut bulk, lead)?;
                    self.send(&ctl, lead)?;
                }
            }
        }
    }

    /// The RDMA network backend, when `GRADSYNC_TRANSPORT=rdma` asks for it (an error if it
    /// cannot be had) or the automatic choice can use it: the `rdma` feature is built in, some
    /// peer is on another host, `GRADSYNC_IB_DISABLE` is not set and every rank opened an
    /// active port. Every rank publishes its queue pair descriptor (empty when it has none), so
    /// all ranks make the same choice; then every queue pair goes to RTS and the ranks agree
    /// that they are ready before any traffic.
    fn setup_rdma(
        store: &mut StoreClient,
        prefix: &str,
        rank: usize,
        world: usize,
        local: &[usize],
        config: &Config,
    ) -> Result<Option<Box<dyn Endpoint>>> {
        let forced = config.transport == TransportMode::Rdma;
        let wanted = forced
            || (config.transport == TransportMode::Auto
                && cfg!(feature = "rdma")
                && !config.ib.disable
                && local.len() < world);
        if !wanted {
            return Ok(None);
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (store, prefix, rank);
            Err(Error::Config(
                "GRADSYNC_TRANSPORT=rdma: this gradsync was built without the rdma feature (cargo build --features rdma)".into(),
            ))
        }
        #[cfg(feature = "rdma")]
        {
            use gradsync_transport::rdma::{RdmaOptions, RdmaSetup};
            let st = |source| Error::Store { rank, source };
            let opts = RdmaOptions {
                hca: config.ib.hca.clone(),
                gid_index: config.ib.gid_index,
                qps_per_peer: config.ib.qps_per_conn,
                ib_timeout: config.ib.timeout,
                retry_cnt: config.ib.retry_cnt,
                // Room for several slot writes (header + chunk) in flight at any chunk size.
                staging_bytes: gradsync_transport::rdma::DEFAULT_STAGING
                    .max(4 * (config.chunk_bytes + 4096)),
                ..RdmaOptions::default()
            };
            let made = RdmaSetup::new(rank, world, &opts);
            let mine = match &made {
                Ok(s) => s.info(),
                Err(e) => {
                    if !forced {
                        tracing::info!(target: "gradsync::init", "rank {rank}: no RDMA, using tcp: {e}");
                    }
                    Vec::new()
                }
            };
            let vals = exchange(
                store,
                prefix,
                "rdma/info",
                rank,
                0..world,
                &mine,
                config.timeout,
            )
            .map_err(st)?;
            let setup = match made {
                Ok(s) => s,
                Err(e) if forced => {
                    return Err(Error::transport(rank, "GRADSYNC_TRANSPORT=rdma", e));
                }
                Err(_) => return Ok(None),
            };
            if let Some(p) = vals.iter().position(Vec::is_empty) {
                if forced {
                    return Err(Error::Config(format!(
                        "GRADSYNC_TRANSPORT=rdma: rank {p} has no usable RDMA port (see its log)"
                    )));
                }
                tracing::info!(target: "gradsync::init", "rank {rank}: rank {p} has no RDMA port, using tcp");
                return Ok(None);
            }
            let device = setup.device();
            // Every rank says whether its queue pairs reached RTS, so a rank whose transition
            // failed does not leave the others waiting for it until the deadline.
            let connected = setup.connect(&vals);
            let ok: &[u8] = if connected.is_ok() { b"1" } else { b"0" };
            let ready = exchange(
                store,
                prefix,
                "rdma/ready",
                rank,
                0..world,
                ok,
                config.timeout,
            )
            .map_err(st)?;
            let ep = connected.map_err(|e| Error::transport(rank, "rdma connect", e))?;
            if let Some(p) = ready.iter().position(|v| v.as_slice() != b"1") {
                return Err(Error::Config(format!(
                    "rank {p} could not connect its RDMA queue pairs (see its log); rank {rank} stops too"
                )));
            }
            tracing::info!(
                target: "gradsync::init",
                "rank {rank}: rdma device {device}, {} queue pairs per peer",
                config.ib.qps_per_conn
            );
            Ok(Some(Box::new(ep)))
        }
    }

    /// Connects the shared-memory backend to the other ranks of this host. Every local rank
    /// publishes its segment (or an empty value when it could not make one), then whether it
    /// could map every peer's; shared memory is used only when all of them succeeded, so the
    /// ranks of a host always agree on the transport of each pair.
    fn setup_shm(
        store: &mut StoreClient,
        prefix: &str,
        rank: usize,
        world: usize,
        local: &[usize],
        config: &Config,
    ) -> std::result::Result<ShmEndpoint, String> {
        let st = |e: gradsync_store::StoreError| format!("store: {e}");
        let made = ShmSetup::new(rank, world, local);
        let mine = match &made {
            Ok((_, info)) => info.to_bytes().to_vec(),
            Err(_) => Vec::new(),
        };
        let vals = exchange(
            store,
            prefix,
            "shm/info",
            rank,
            local.iter().copied(),
            &mine,
            config.timeout,
        )
        .map_err(st)?;
        let (setup, _) = made.map_err(|e| e.to_string())?;
        let mut infos = Vec::with_capacity(local.len());
        for (i, v) in vals.iter().enumerate() {
            match ShmInfo::from_bytes(v) {
                Some(info) => infos.push(info),
                None => {
                    return Err(format!(
                        "rank {} could not create its shared-memory segment",
                        local[i]
                    ));
                }
            }
        }
        let connected = setup.connect(&infos, config.timeout);
        let ok: &[u8] = if connected.is_ok() { b"1" } else { b"0" };
        let vals = exchange(
            store,
            prefix,
            "shm/ok",
            rank,
            local.iter().copied(),
            ok,
            config.timeout,
        )
        .map_err(st)?;
        let shm = connected.map_err(|e| e.to_string())?;
        if let Some(i) = vals.iter().position(|v| v.as_slice() != b"1") {
            return Err(format!(
                "rank {} could not map the shared-memory segments of this host",
                local[i]
            ));
        }
        Ok(shm)
    }

    /// The transport that carries traffic between this rank and `peer`: `shm`, `tcp`, `mem`,
    /// or `self`.
    pub fn peer_transport(&self, peer: usize) -> &'static str {
        self.layout.routes.get(peer).copied().unwrap_or("?")
    }

    /// Whether small all-reduces go eagerly through the transports' shared-memory boards
    /// (every rank on one host, `GRADSYNC_SHM_BOARD` on) rather than as messages.
    pub fn eager_board(&self) -> bool {
        self.engine.board()
    }

    /// Host index of `rank` (hosts numbered in order of their lowest rank).
    pub fn host_of(&self, rank: usize) -> usize {
        self.layout.host_of.get(rank).copied().unwrap_or(0)
    }

    /// Short name (hostname) of `rank`'s host, as its host identity gives it.
    pub fn host_name(&self, rank: usize) -> &str {
        self.layout
            .host_ids
            .get(rank)
            .map_or("", |s| topology::host_label(s))
    }

    /// Listening address of `rank`'s data connections (`None` in process).
    pub fn peer_addr(&self, rank: usize) -> Option<SocketAddr> {
        self.layout.addrs.get(rank).copied()
    }

    /// Network interface of this rank's data connections (empty in process).
    pub fn interface(&self) -> &str {
        &self.layout.ifname
    }

    /// How init placed this rank on the machine's NUMA nodes (`GRADSYNC_NUMA_BIND`).
    pub fn numa_placement(&self) -> &topology::Placement {
        &self.layout.placement
    }

    /// Ranks per host when every host holds one contiguous block of equally many ranks (what
    /// the hierarchical all-reduce needs), else 0.
    pub fn local_size(&self) -> usize {
        self.layout.local_size
    }

    /// The peers whose connection is gone (process exited or killed), after giving the
    /// transport `wait` to notice. Use it after a failure to decide what to
    /// [`shrink`](Self::shrink) away.
    pub fn failed_ranks(&mut self, wait: Duration) -> Vec<usize> {
        self.engine.dead_peers(wait)
    }

    /// Builds a new communicator of the ranks not in `exclude` (typically
    /// [`failed_ranks`](Self::failed_ranks)), as `ncclCommShrink` does: every surviving rank
    /// calls it with the same `exclude`; ranks are renumbered in order (the new rank of a
    /// survivor is the number of survivors below it). It meets through the same rendezvous
    /// store, so rank 0's process (which hosts the store unless it is external) must be among
    /// the survivors. This communicator stays unusable after a failure; drop it.
    pub fn shrink(&mut self, exclude: &[usize]) -> Result<Communicator> {
        let t0 = Instant::now();
        let (Some(config), Some(_)) = (self.config.clone(), self.store.as_ref()) else {
            return Err(self.invalid(
                "shrink",
                "this communicator was not built through a rendezvous store".into(),
            ));
        };
        if exclude.contains(&self.rank) {
            return Err(self.invalid(
                "shrink",
                format!("rank {} cannot exclude itself", self.rank),
            ));
        }
        if let Some(bad) = exclude.iter().find(|&&r| r >= self.world) {
            return Err(self.invalid(
                "shrink",
                format!("rank {bad} is not a rank of a world of {}", self.world),
            ));
        }
        let survivors: Vec<usize> = (0..self.world).filter(|r| !exclude.contains(r)).collect();
        let new_rank = survivors
            .iter()
            .position(|&r| r == self.rank)
            .expect("self survives");
        let new_world = survivors.len();
        self.generation += 1;
        let key = format!(
            "gradsync/{:016x}/shrink/{}/comm_id",
            self.engine.comm_id, self.generation
        );
        let rank = self.rank;
        let st = |source| Error::Store { rank, source };
        let token = config.token.as_deref().map(str::as_bytes);
        let mut store =
            StoreClient::connect_with_token(&config.store_addr, config.timeout, token, new_rank)
                .map_err(st)?;
        let comm_id = if new_rank == 0 {
            let id = new_comm_id();
            store.set(&key, &id.to_le_bytes()).map_err(st)?;
            id
        } else {
            let v = store.wait(&[key.as_str()], config.timeout).map_err(st)?;
            u64::from_le_bytes(
                v[0].as_slice()
                    .try_into()
                    .map_err(|_| Error::Config("malformed communicator id in the store".into()))?,
            )
        };
        tracing::info!(target: "gradsync::init", "rank {rank}: shrinking to {new_world} ranks without {exclude:?}; new rank {new_rank}");
        let mut cfg = config;
        cfg.rank = new_rank;
        cfg.world = new_world;
        crate::logging::set_rank(new_rank);
        Self::join(store, None, comm_id, new_rank, new_world, cfg, t0)
    }

    #[cfg(test)]
    pub(crate) fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// In-process communicators for `world` ranks joined by the in-memory transport: one per
    /// rank, to be moved into one thread each. Tunables come from `config` (its rank, world and
    /// store fields are ignored).
    pub fn mem_group(world: usize, config: &Config) -> Result<Vec<Communicator>> {
        let eps = gradsync_transport::mem::fabric(world)
            .into_iter()
            .map(|ep| Box::new(ep) as Box<dyn Endpoint>)
            .collect();
        Self::from_endpoints(eps, config)
    }

    /// In-process communicators over endpoints that are already connected to each other, one
    /// per rank in rank order (for example an in-memory fabric wrapped in
    /// [`FaultyEndpoint`](gradsync_transport::fault::FaultyEndpoint)s). The inbox descriptors
    /// are exchanged in process, so every returned communicator must be driven by its own
    /// thread. Tunables come from `config` (its rank, world and store fields are ignored).
    pub fn from_endpoints(
        endpoints: Vec<Box<dyn Endpoint>>,
        config: &Config,
    ) -> Result<Vec<Communicator>> {
        let world = endpoints.len();
        for (i, ep) in endpoints.iter().enumerate() {
            if ep.rank() != i || ep.world() != world {
                return Err(Error::Config(format!(
                    "endpoint {i} of {world} is rank {} of a world of {}; pass one endpoint per rank, in rank order",
                    ep.rank(),
                    ep.world()
                )));
            }
        }
        let comm_id = new_comm_id();
        let mut engines = Vec::with_capacity(world);
        let mut inboxes = Vec::with_capacity(world);
        for ep in endpoints {
            let (e, inbox) = Engine::new(ep, comm_id, engine_options(config))?;
            engines.push(e);
            inboxes.push(inbox);
        }
        Ok(engines
            .into_iter()
            .enumerate()
            .map(|(rank, mut engine)| {
                engine.connect_peers(&inboxes);
                let mut c = Communicator::assemble(engine, rank, world, config.algorithm, None);
                c.coll_algorithms = config.collective_algorithms.clone();
                c
            })
            .collect())
    }

    fn assemble(
        engine: Engine,
        rank: usize,
        world: usize,
        algorithm: Option<Algorithm>,
        store: Option<StoreServer>,
    ) -> Self {
        let engine_name = engine.ep.name();
        let layout = Layout::single_host(world, rank, engine_name);
        Communicator {
            engine,
            rank,
            world,
            seq: 0,
            p2p_seq: vec![0; world],
            algorithm,
            coll_algorithms: Vec::new(),
            queue: VecDeque::new(),
            store: None,
            config: None,
            generation: 0,
            closed: false,
            current: None,
            finished: HashMap::new(),
            next_work: 1,
            layout,
            _store: store,
            det_scratch: Vec::new(),
            explained: 0,
            costs: crate::cost::LinkCosts::uncalibrated(engine_name, engine_name),
            cost_from: "uncalibrated".to_string(),
            cost_path: None,
            choices: no_choices(),
        }
    }

    /// Drives the queue of owned-buffer operations: blocks until `until` has finished (or the
    /// whole queue, with `None`) when `block`, else makes one round of progress.
    fn drive(&mut self, block: bool, until: Option<u64>) -> Result<()> {
        loop {
            let target_done = |c: &Self| match until {
                Some(id) => c.finished.contains_key(&id),
                None => c.current.is_none() && c.queue.is_empty(),
            };
            if self.current.is_some() {
                let done = match self.engine.progress(block) {
                    Ok(d) => d,
                    Err(e) => {
                        self.current = None;
                        self.queue.clear();
                        return Err(e);
                    }
                };
                if !done {
                    return Ok(());
                }
                let (id, owner) = self.current.take().expect("current");
                self.finished.insert(id, owner);
            }
            if target_done(self) {
                return Ok(());
            }
            let Some(q) = self.queue.pop_front() else {
                return Ok(());
            };
            // SAFETY: the buffer is owned by `q.owner`, which the communicator keeps (in
            // `current`, then `finished`) until the operation has ended.
            unsafe { self.engine.start(q.sig, q.prog, q.algo, q.buf, q.buf)? };
            self.current = Some((q.id, q.owner));
            if !block {
                self.engine.progress(false)?;
            }
        }
    }

    /// Queues an in-place all-reduce of an owned buffer and returns a handle for it.
    ///
    /// Queued operations run one after another in the order they were queued, and before any
    /// later call on this communicator; they progress whenever the communicator is driven:
    /// [`progress`](Self::progress), [`test`](Self::test), [`wait`](Self::wait), or any
    /// blocking collective (which first completes the queue). Owning the buffer, the
    /// communicator can never leave memory shared with an operation in flight.
    pub fn all_reduce_owned<T: Element>(&mut self, buf: Vec<T>, op: ReduceOp) -> Result<Work<T>> {
        self.engine.check_usable_or_running()?;
        if self.deterministic_path(T::DTYPE, buf.len()) {
            let b = raw(&buf);
            // SAFETY: the communicator owns `buf` for the call, which runs to its end (after
            // the queue ahead of it).
            unsafe { self.deterministic_all_reduce(T::DTYPE, op, buf.len(), b, b)? };
            let id = self.next_work;
            self.next_work += 1;
            self.finished.insert(id, Box::new(buf));
            return Ok(Work {
                id,
                _t: PhantomData,
            });
        }
        let raw_buf = raw(&buf);
        let (sig, prog, algo) =
            self.plan(Collective::AllReduce, T::DTYPE, op, 0, buf.len(), true)?;
        let id = self.next_work;
        self.next_work += 1;
        self.queue.push_back(Queued {
            id,
            sig,
            prog,
            algo,
            buf: raw_buf,
            owner: Box::new(buf),
        });
        self.drive(false, Some(id))?;
        Ok(Work {
            id,
            _t: PhantomData,
        })
    }

    /// Drives queued operations without blocking; whether `w` has finished.
    pub fn test<T: Element>(&mut self, w: &Work<T>) -> Result<bool> {
        self.drive(false, Some(w.id))?;
        Ok(self.finished.contains_key(&w.id))
    }

    /// Waits for `w` and returns its buffer.
    pub fn wait<T: Element>(&mut self, w: Work<T>) -> Result<Vec<T>> {
        self.drive(true, Some(w.id))?;
        let b = self.finished.remove(&w.id).ok_or_else(|| Error::Internal {
            rank: self.rank,
            msg: format!("work {} is not known to this communicator", w.id),
        })?;
        b.downcast::<Vec<T>>()
            .map(|b| *b)
            .map_err(|_| Error::Internal {
                rank: self.rank,
                msg: "work handle of another element type".into(),
            })
    }

    /// Drives queued operations without blocking.
    pub fn progress(&mut self) -> Result<()> {
        self.drive(false, None)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Name of the transport (`tcp`, `mem`).
    pub fn transport(&self) -> &'static str {
        self.engine.ep.name()
    }

    /// Sets the deadline of the calls that follow (overrides `GRADSYNC_TIMEOUT` for them).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.engine.opts.timeout = timeout;
    }

    /// The deadline of each call.
    pub fn timeout(&self) -> Duration {
        self.engine.opts.timeout
    }

    /// Aborts the communicator: every peer is told (so its pending and next calls fail at once
    /// naming this rank) and the connections are closed. Bounded in time (about a second), also
    /// when a peer is stopped or gone; buffers of an operation in flight are never touched
    /// again.
    pub fn abort(mut self, reason: &str) {
        let e = Error::Aborted {
            rank: self.rank,
            reason: reason.to_string(),
        };
        self.engine.fail(&e);
        self.queue.clear();
        self.current = None;
        self.engine.ep.close(Duration::from_millis(500));
        self.closed = true;
    }

    /// Forces an all-reduce algorithm (`None` = automatic), as `GRADSYNC_ALGO` does.
    pub fn set_algorithm(&mut self, algorithm: Option<Algorithm>) {
        self.algorithm = algorithm;
    }

    /// Forces the algorithm of collective `coll` (`None` = automatic), as
    /// `GRADSYNC_ALGO=COLL:ALGO` does. All-reduce is [`set_algorithm`](Self::set_algorithm)'s.
    /// Fails for an algorithm the collective does not have.
    pub fn set_collective_algorithm(
        &mut self,
        coll: Collective,
        algorithm: Option<Algorithm>,
    ) -> Result<()> {
        if let Some(a) = algorithm
            && !plan::supports(coll, a)
        {
            return Err(self.invalid(coll.name(), format!("no {} algorithm", a.name())));
        }
        if coll == Collective::AllReduce {
            self.algorithm = algorithm;
            return Ok(());
        }
        self.coll_algorithms.retain(|(k, _)| *k != coll);
        if let Some(a) = algorithm {
            self.coll_algorithms.push((coll, a));
        }
        Ok(())
    }

    fn invalid(&self, op: &'static str, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.rank,
            op,
            msg,
        }
    }

    /// The schedule a call of `coll` on `bytes` bytes per rank runs: `None` for the eager path of
    /// a small all-reduce, else the algorithm as the flight recorder names it: forced by
    /// `GRADSYNC_ALGO`, or for an all-reduce the cost model's fastest for the size class of
    /// `bytes` ([`crate::cost::choose_all_reduce`]), or the default of the collective.
    pub fn algorithm_for(&self, coll: Collective, bytes: usize) -> Option<Algorithm> {
        if coll == Collective::AllReduce
            && self.algorithm.is_none()
            && self.engine.eager_fits(bytes)
        {
            return None;
        }
        Some(match (coll, self.algorithm) {
            (Collective::AllReduce, Some(a)) => a,
            (Collective::AllReduce, None)
                if (2..=crate::cost::MODEL_MAX_WORLD).contains(&self.world) =>
            {
                self.model_choice(bytes).best
            }
            (c, _) => match self.coll_algorithms.iter().find(|(k, _)| *k == c) {
                Some(&(_, a)) => a,
                None => plan::default_algorithm(coll, self.world, bytes),
            },
        })
    }

    /// Elements of `dtype` per pipeline segment (one message, `GRADSYNC_CHUNK_SIZE`).
    pub fn segment_elems(&self, dtype: gradsync_core::DataType) -> usize {
        self.engine.segment_elems(dtype)
    }
    /// The cost model of the automatic all-reduce choice, and where it came from (`pinned in
    /// PATH`, `cached in PATH`, `measured at init ...`, `uncalibrated`).
    pub fn cost_model(&self) -> (&crate::cost::LinkCosts, &str) {
        (&self.costs, &self.cost_from)
    }

    /// The model's predictions and choice for the size class of `bytes`, computed once per class.
    pub fn model_choice(&self, bytes: usize) -> &crate::cost::Choice {
        let class = crate::cost::size_class(bytes);
        self.choices[class as usize].get_or_init(|| {
            crate::cost::choose_all_reduce(
                self.world,
                self.layout.local_size,
                self.engine.segment_elems(gradsync_core::DataType::F32),
                class,
                &self.costs,
            )
        })
    }

    /// The file the cost model was read from or saved to (pinned in `GRADSYNC_COST_FILE` or
    /// the per-host cache); `None` when it is in no file.
    pub fn cost_file(&self) -> Option<&std::path::Path> {
        self.cost_path.as_deref()
    }

    /// Takes `links` as the cost model (from `from`, in file `path`), forgetting the choices of
    /// the previous one.
    fn set_costs(
        &mut self,
        links: crate::cost::LinkCosts,
        from: String,
        path: Option<std::path::PathBuf>,
    ) {
        (self.costs, self.cost_from, self.cost_path) = (links, from, path);
        self.choices = no_choices();
    }

    /// Logs at INFO (`COLL`, rank 0), once per power-of-two size class, the cost model's
    /// predicted time of every all-reduce algorithm for that class, its choice, and what this
    /// communicator runs (eager, or a forced algorithm, where those apply).
    fn explain_choice(&mut self, bytes: usize) {
        let class = crate::cost::size_class(bytes);
        if self.explained & (1u64 << class.min(63)) != 0 || self.world < 2 || self.rank != 0 {
            return;
        }
        self.explained |= 1u64 << class.min(63);
        let runs = self.algorithm_for(Collective::AllReduce, bytes);
        let choice = self.model_choice(bytes);
        let mut line = String::new();
        if runs.is_none() {
            let (intra, inter) = (self.costs.intra.link(), self.costs.inter.link());
            let (world, local) = (self.world, self.layout.local_size);
            let seg = self.engine.segment_elems(gradsync_core::DataType::F32);
            let dt = gradsync_core::DataType::F32;
            if let Ok(t) = crate::cost::predict_all_reduce(
                world,
                local,
                seg,
                dt,
                crate::cost::class_bytes(class),
                None,
                &intra,
                &inter,
            ) {
                line += &format!(" eager {:.1} us", t * 1e6);
            }
        }
        for (a, t) in &choice.predicted {
            match t {
                Ok(t) => line += &format!(" {a} {:.1} us", t * 1e6),
                Err(e) => line += &format!(" {a} ({e})"),
            }
        }
        let mut measured = String::new();
        if let Some(m) = &choice.measured {
            let runs = m.runs();
            let plural = if runs == 1 { "" } else { "s" };
            line += &format!(
                "; measured at {} bytes (median of {runs} run{plural}):",
                m.bytes
            );
            for (a, us) in m.medians() {
                line += &format!(" {a} {us:.1} us");
            }
            measured = format!(", measured choice {}", m.algorithm);
        }
        tracing::info!(
            target: "gradsync::coll",
            "rank {}: all_reduce of {bytes} bytes on {} ranks, predicted at {} bytes ({}):{line}; model's choice {}{measured}, runs {}",
            self.rank,
            self.world,
            crate::cost::class_bytes(class),
            self.cost_from,
            choice.model,
            runs.map_or("eager", Algorithm::name)
        );
    }

    /// Plans a collective and takes its sequence number.
    fn plan(
        &mut self,
        coll: Collective,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        root: usize,
        count: usize,
        in_place: bool,
    ) -> Result<(Signature, Planned, &'static str)> {
        let bytes = count * dtype.size();
        if coll == Collective::AllReduce
            && tracing::enabled!(target: "gradsync::coll", tracing::Level::INFO)
        {
            self.explain_choice(bytes);
        }
        let (prog, algo) = if let Some(algorithm) = self.algorithm_for(coll, bytes) {
            let local = self.layout.local_size;
            let params = Params {
                coll,
                rank: self.rank,
                world: self.world,
                count,
                root,
                op,
                segment: self.engine.segment_elems(dtype),
                in_place,
                algorithm,
                local_size: local,
            };
            let prog = self
                .engine
                .schedule_for(&params)
                .map_err(|e| self.invalid(coll.name(), e.to_string()))?;
            (prog, algorithm.name())
        } else {
            (self.engine.eager_planned(), "eager")
        };
        self.seq += 1;
        let reduces = matches!(
            coll,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        );
        let sig = Signature {
            comm_id: self.engine.comm_id,
            seq: self.seq,
            coll,
            dtype,
            op: if reduces { op } else { ReduceOp::Sum },
            count: count as u64,
            root: if matches!(coll, Collective::Broadcast | Collective::Reduce) {
                root as u32
            } else {
                0
            },
        };
        tracing::trace!(target: "gradsync::coll", "rank {}: plan {sig} algorithm {algo}", self.rank);
        Ok((sig, prog, algo))
    }

    /// Runs a collective to its end (see [`start`](Self::start)).
    ///
    /// # Safety
    ///
    /// As [`start`](Self::start).
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &mut self,
        coll: Collective,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        root: usize,
        count: usize,
        input: RawBuf,
        output: RawBuf,
        in_place: bool,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.start(coll, dtype, op, root, count, input, output, in_place)? };
        self.engine.progress(true).map(drop)
    }

    /// Completes queued owned-buffer operations, then plans and starts a collective.
    ///
    /// # Safety
    ///
    /// As [`Engine::start`]: the buffers stay valid and untouched until the operation ends.
    #[allow(clippy::too_many_arguments)]
    unsafe fn start(
        &mut self,
        coll: Collective,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        root: usize,
        count: usize,
        input: RawBuf,
        output: RawBuf,
        in_place: bool,
    ) -> Result<()> {
        self.drive(true, None)?;
        self.engine.check_usable()?;
        let (sig, prog, algo) = self.plan(coll, dtype, op, root, count, in_place)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.start(sig, prog, algo, input, output) }
    }

    /// Checks that the `big` buffer has `world` times the elements of the `small` one.
    fn check_world_multiple(
        &self,
        op: &'static str,
        big: (&str, usize),
        small: (&str, usize),
    ) -> Result<()> {
        if Some(big.1) != small.1.checked_mul(self.world) {
            return Err(self.invalid(
                op,
                format!(
                    "{} has {} elements but must have world {} x {} {} = {}",
                    big.0,
                    big.1,
                    self.world,
                    small.0,
                    small.1,
                    small.1.saturating_mul(self.world)
                ),
            ));
        }
        Ok(())
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(self.invalid(
                op,
                format!("root {root} is not a rank of a world of {}", self.world),
            ));
        }
        Ok(())
    }

    /// All-reduce in place: every rank ends with `op` over all ranks' `buf`, bitwise identical on
    /// every rank.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_async(buf, op)?.wait()
    }

    /// All-reduce out of place: `output` gets `op` over all ranks' `input`.
    pub fn all_reduce_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if input.len() != output.len() {
            return Err(self.invalid(
                "all_reduce",
                format!(
                    "input has {} elements but output has {}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        if self.deterministic_path(T::DTYPE, input.len()) {
            // SAFETY: both borrows outlive the call, which runs to its end.
            return unsafe {
                self.deterministic_all_reduce(T::DTYPE, op, input.len(), raw(input), raw(output))
            };
        }
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::AllReduce,
                T::DTYPE,
                op,
                0,
                input.len(),
                raw(input),
                raw(output),
                false,
            )
        }
    }

    /// Whether an all-reduce of `count` elements of `dtype` takes the deterministic path of
    /// [`Config::deterministic`] (floats, larger than an eager message or with a forced
    /// algorithm; eager all-reduces already reduce in rank order).
    fn deterministic_path(&self, dtype: gradsync_core::DataType, count: usize) -> bool {
        self.engine.opts.deterministic
            && dtype.is_float()
            && (self.algorithm.is_some() || !self.engine.eager_fits(count * dtype.size()))
    }

    /// The deterministic all-reduce: pieces of the input are all-gathered into scratch and
    /// every element is reduced in rank order, so the bits do not depend on how the data
    /// moved.
    ///
    /// # Safety
    ///
    /// `input` readable and `output` writable for `count` elements of `dtype` (they may be the
    /// same span), untouched by anything else until this returns.
    unsafe fn deterministic_all_reduce(
        &mut self,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        count: usize,
        input: RawBuf,
        output: RawBuf,
    ) -> Result<()> {
        self.drive(true, None)?;
        let ds = dtype.size();
        let w = self.world;
        let piece = (DETERMINISTIC_SCRATCH / w / ds).clamp(1, count.max(1));
        let mut scratch = std::mem::take(&mut self.det_scratch);
        scratch.resize(w * piece * ds, 0);
        // SAFETY: forwarded from the caller; `scratch` holds `w * piece` elements.
        let res = unsafe {
            self.deterministic_pieces(dtype, op, count, piece, &mut scratch, input, output)
        };
        self.det_scratch = scratch;
        res
    }

    /// The pieces of [`deterministic_all_reduce`](Self::deterministic_all_reduce).
    ///
    /// # Safety
    ///
    /// As `deterministic_all_reduce`; `scratch` holds `world * piece` elements.
    #[allow(clippy::too_many_arguments)]
    unsafe fn deterministic_pieces(
        &mut self,
        dtype: gradsync_core::DataType,
        op: ReduceOp,
        count: usize,
        piece: usize,
        scratch: &mut [u8],
        input: RawBuf,
        output: RawBuf,
    ) -> Result<()> {
        let ds = dtype.size();
        let w = self.world;
        let mut off = 0;
        loop {
            let n = piece.min(count - off);
            let part = RawBuf {
                addr: input.addr + off * ds,
                len: n * ds,
            };
            let gathered = RawBuf {
                addr: scratch.as_mut_ptr() as usize,
                len: w * n * ds,
            };
            // SAFETY: `part` lies inside `input`, readable per the caller; `gathered` is this
            // function's scratch; the call runs to its end.
            unsafe {
                self.run(
                    Collective::AllGather,
                    dtype,
                    ReduceOp::Sum,
                    0,
                    n,
                    part,
                    gathered,
                    false,
                )?
            };
            let nb = n * ds;
            // SAFETY: the piece lies inside `output`, writable per the caller; the all-gather
            // that read the same span of `input` has ended.
            let out =
                unsafe { std::slice::from_raw_parts_mut((output.addr + off * ds) as *mut u8, nb) };
            crate::engine::reduce_rank_order(dtype, op, out, w, |r| &scratch[r * nb..(r + 1) * nb]);
            off += n;
            if off >= count {
                return Ok(());
            }
        }
    }

    /// Starts an in-place all-reduce; the returned handle holds `buf` until it is waited for.
    pub fn all_reduce_async<'a, T: Element>(
        &'a mut self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Pending<'a>> {
        let b = raw(buf);
        if self.deterministic_path(T::DTYPE, buf.len()) {
            // SAFETY: `buf` is borrowed for the call, which runs to its end.
            unsafe { self.deterministic_all_reduce(T::DTYPE, op, buf.len(), b, b)? };
            return Ok(Pending {
                comm: self,
                done: true,
                _bufs: PhantomData,
            });
        }
        // SAFETY: `buf` stays mutably borrowed by the returned Pending until it completes (its
        // wait or drop); a leaked Pending poisons the communicator and its buffer is never
        // touched again (no progress happens outside calls made through the handle).
        unsafe {
            self.start(
                Collective::AllReduce,
                T::DTYPE,
                op,
                0,
                buf.len(),
                b,
                b,
                true,
            )?
        };
        Ok(Pending {
            comm: self,
            done: false,
            _bufs: PhantomData,
        })
    }

    /// Reduce-scatter: `input` holds `world * n` elements, `output` gets slice `rank` (n
    /// elements) of `op` over all ranks' inputs.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_world_multiple(
            "reduce_scatter",
            ("input", input.len()),
            ("output", output.len()),
        )?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::ReduceScatter,
                T::DTYPE,
                op,
                0,
                output.len(),
                raw(input),
                raw(output),
                false,
            )
        }
    }

    /// All-gather: `output` (`world * input.len()` elements) gets every rank's `input`, rank r's
    /// at `r * input.len()`.
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.check_world_multiple(
            "all_gather",
            ("output", output.len()),
            ("input", input.len()),
        )?;
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::AllGather,
                T::DTYPE,
                ReduceOp::Sum,
                0,
                input.len(),
                raw(input),
                raw(output),
                false,
            )
        }
    }

    /// Broadcast in place: every rank's `buf` gets the root's.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        let b = raw(buf);
        // SAFETY: `buf` is borrowed for the whole call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::Broadcast,
                T::DTYPE,
                ReduceOp::Sum,
                root,
                buf.len(),
                b,
                b,
                true,
            )
        }
    }

    /// Reduce: the root's `output` gets `op` over all ranks' `input`. Other ranks' `output` is
    /// not touched and may be empty.
    pub fn reduce<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        if output.len() != input.len() && (self.rank == root || !output.is_empty()) {
            return Err(self.invalid("reduce", format!("input has {} elements but output has {} (the root's output must match; others may pass an empty one)", input.len(), output.len())));
        }
        let out = if self.rank == root {
            raw(output)
        } else {
            RawBuf::default()
        };
        // SAFETY: both borrows outlive the call, which runs the operation to its end.
        unsafe {
            self.run(
                Collective::Reduce,
                T::DTYPE,
                op,
                root,
                input.len(),
                raw(input),
                out,
                false,
            )
        }
    }

    /// Barrier: returns once every rank has entered it.
    pub fn barrier(&mut self) -> Result<()> {
        // SAFETY: a barrier touches no caller memory.
        unsafe {
            self.run(
                Collective::Barrier,
                gradsync_core::DataType::U8,
                ReduceOp::Sum,
                0,
                0,
                RawBuf::default(),
                RawBuf::default(),
                false,
            )
        }
    }

    fn p2p(
        &mut self,
        peer: usize,
        dtype: gradsync_core::DataType,
        count: usize,
        buf: RawBuf,
        send: bool,
    ) -> Result<()> {
        let op_name = if send { "send" } else { "recv" };
        if peer >= self.world || peer == self.rank {
            return Err(self.invalid(
                op_name,
                format!(
                    "peer {peer} is not another rank of a world of {}",
                    self.world
                ),
            ));
        }
        self.drive(true, None)?;
        self.engine.check_usable()?;
        let seg = self.engine.segment_elems(dtype);
        let mut prog = Program::new();
        let mut start = 0;
        while start < count || (count == 0 && start == 0) {
            let len = seg.min(count - start);
            let op = if send {
                Op::Send {
                    peer,
                    src: Loc::new(Buf::Input, start),
                    len,
                }
            } else {
                Op::Recv {
                    peer,
                    dst: Loc::new(Buf::Output, start),
                    reduce_with: None,
                    len,
                }
            };
            prog.push(op, &[]);
            start += len.max(1);
        }
        // Send/recv pairs are numbered per pair of ranks, apart from the collectives.
        self.p2p_seq[peer] += 1;
        let (lo, hi) = if send {
            (self.rank, peer)
        } else {
            (peer, self.rank)
        };
        let sig = Signature {
            comm_id: self.engine.comm_id,
            seq: self.p2p_seq[peer],
            coll: Collective::SendRecv,
            dtype,
            op: ReduceOp::Sum,
            count: count as u64,
            root: ((lo as u32) << 16) | hi as u32,
        };
        let (i, o) = if send {
            (buf, RawBuf::default())
        } else {
            (RawBuf::default(), buf)
        };
        let planned = self.engine.one_off(prog);
        // SAFETY: the buffer is borrowed by the caller for the whole call.
        unsafe { self.engine.start(sig, planned, "p2p", i, o)? };
        self.engine.progress(true).map(drop)
    }

    /// Sends `buf` to `peer`, which must call [`recv`](Self::recv) with as many elements of the
    /// same type.
    pub fn send<T: Element>(&mut self, buf: &[T], peer: usize) -> Result<()> {
        self.p2p(peer, T::DTYPE, buf.len(), raw(buf), true)
    }

    /// The flight recorder's record of this communicator's last operations (see
    /// [`recorder`](crate::recorder)): what ran, with which algorithm, how it ended.
    pub fn flight_snapshot(&self) -> crate::recorder::Dump {
        self.engine.recorder.snapshot()
    }

    /// Receives into `buf` from `peer`.
    pub fn recv<T: Element>(&mut self, buf: &mut [T], peer: usize) -> Result<()> {
        self.p2p(peer, T::DTYPE, buf.len(), raw(buf), false)
    }
}

/// Scratch of a deterministic all-reduce: the all-gathered piece of every rank.
const DETERMINISTIC_SCRATCH: usize = 4 << 20;

fn engine_options(c: &Config) -> EngineOptions {
    EngineOptions {
        slot_bytes: c.chunk_bytes,
        nslots: c.nslots,
        timeout: c.timeout,
        spin: c.spin,
        busy_spin: Duration::ZERO,
        direct_min: c.direct_min,
        checksum: c.checksum,
        eager_max: c.eager_max,
        deterministic: c.deterministic,
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.closed {
            self.engine.ep.close(Duration::from_secs(2));
        }
    }
}
