//! How a communicator comes to be: init from the environment or a [`Config`], the interface
//! and addresses of the data connections, the setup that init and split share
//! ([`Communicator::connect`]: records swapped through an [`Exchange`], the network,
//! shared-memory and RDMA backends, the settings every rank's inbox must agree on,
//! [`SlotLayout`]), in-process groups over given endpoints, and shrink.

use super::addresses;
use super::choice::no_choices;
use super::communicator::Communicator;
use super::records::{Exchange, StoreExchange, step_budget};
use super::slot_layout::SlotLayout;
use super::state::Layout;
use super::tables;
use crate::Result;
use crate::config::{Config, TransportMode};
use crate::engine::{Engine, EngineOptions};
use crate::error::Error;
use crate::topology::{self, Topology};
use gradsync_core::Collective;
use gradsync_core::schedule::plan::Algorithm;
use gradsync_store::{StoreClient, StoreServer};
use gradsync_transport::hybrid::HybridEndpoint;
use gradsync_transport::shm::{ShmEndpoint, ShmInfo, ShmSetup};
use gradsync_transport::tcp::{self, TcpEndpoint, TcpOptions};
use gradsync_transport::{Endpoint, REMOTE_REGION_LEN, RemoteRegion, Route};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant, SystemTime};

/// How long a waiting rank polls without yielding when every local rank has a core.
const BUSY_SPIN: Duration = Duration::from_micros(50);

pub(super) fn new_comm_id() -> u64 {
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

impl Communicator {
    /// Builds a communicator from the launcher's environment (torchrun / `gradsync launch`,
    /// Slurm, Open MPI) and the `GRADSYNC_*` variables. See [`Config::from_env`].
    pub fn from_env() -> Result<Self> {
        crate::logging::init_from_env();
        Self::init(Config::from_env()?)
    }

    /// Builds a communicator over TCP: rendezvous through the store at `config.store_addr`
    /// (started by rank 0 when `config.host_store`), exchange of listening addresses and inbox
    /// keys, then a connection of [`Config::tcp_streams`] streams to each peer, made when the first
    /// operation that talks to it starts (`config.runtime_connect`, the default) or to every
    /// peer at init. Bounded by `config.timeout`.
    pub fn init(config: Config) -> Result<Self> {
        let rank = config.rank;
        let world = config.world;
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} is not within world size {world}"
            )));
        }
        check_forced(&config)?;
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
        Self::join(
            store,
            server.map(std::sync::Arc::new),
            comm_id,
            rank,
            world,
            config,
            t0,
        )
    }

    /// The part of init after the communicator id is agreed: the interface, then addresses
    /// and inbox keys through the store, connections, a barrier and the cost model.
    fn join(
        mut store: StoreClient,
        server: Option<std::sync::Arc<StoreServer>>,
        comm_id: u64,
        rank: usize,
        world: usize,
        config: Config,
        t0: Instant,
    ) -> Result<Self> {
        let store_sa = resolve(&config.store_addr)?;
        let (ip, ifname) = match &config.socket_ifname {
            Some(name) => (
                topology::interface_addr(name)
                    .map_err(|e| Error::Config(format!("GRADSYNC_SOCKET_IFNAME: {e}")))?,
                name.clone(),
            ),
            None => {
                let ip = route_to(store_sa).ok_or_else(|| {
                    Error::Config(format!(
                        "no local route to the store at {store_sa}; set GRADSYNC_SOCKET_IFNAME"
                    ))
                })?;
                let name = topology::interfaces()
                    .ok()
                    .and_then(|l| l.into_iter().find(|(_, a)| *a == ip).map(|(n, _)| n))
                    .unwrap_or_else(|| "?".into());
                (ip, name)
            }
        };
        let placement = topology::numa_placement(&ifname, config.numa_bind);
        tracing::info!(target: "gradsync::init", "rank {rank}: interface {ifname}: {placement}");
        let prefix = format!("gradsync/{comm_id:016x}");
        let net = NetSetup {
            ip,
            ifname,
            placement,
        };
        let fetch_traffic = std::sync::Arc::new(super::addresses::FetchTraffic::default());
        let mut ex = StoreExchange {
            store: &mut store,
            prefix: &prefix,
            rank,
            timeout: config.timeout,
            reach: Some(super::addresses::Reach {
                store_addr: config.store_addr.clone(),
                token: config.token.as_ref().map(|t| t.as_bytes().to_vec()),
            }),
            fetch_traffic: fetch_traffic.clone(),
        };
        let mut c = Self::connect(&mut ex, comm_id, rank, world, config, net, t0)?;
        c.fetch_traffic = Some(fetch_traffic);
        // Everyone is connected before anyone may leave (rank 0 keeps the store up until then).
        c.store = Some(store);
        c._store = server;
        c.barrier()?;
        c.settle_costs(&prefix)?;
        // Rank 0 leaves init last: a rank that finished the barrier and read the cost model
        // says so, and rank 0 waits for all of them. Rank 0's barrier may complete before a
        // peer's, and without this wait a rank 0 that aborts, or exits with the store it
        // hosts, right after init would fail the init of ranks still in it.
        let timeout = c.timeout();
        let store = c.store.as_mut().expect("init keeps its store");
        let st = |source| Error::Store { rank, source };
        if rank == 0 {
            let keys: Vec<String> = (1..world).map(|r| format!("{prefix}/init/{r}")).collect();
            let krefs: Vec<&str> = keys.iter().map(String::as_str).collect();
            store.wait(&krefs, timeout).map_err(st)?;
        } else {
            store
                .set(&format!("{prefix}/init/{rank}"), &[1])
                .map_err(st)?;
        }
        // Nothing after init uses the store (shrink connects anew): closing the client spares
        // the store's host one connection per rank.
        c.store_traffic = c.store.take().map(|s| s.traffic());
        if let Some(t) = c.store_traffic {
            tracing::debug!(target: "gradsync::init", "rank {rank}: init sent {} and received {} bytes through the store", t.sent, t.received);
        }
        c.via_store = true;
        Ok(c)
    }

    /// Connects `world` ranks whose setup records go through `ex`: the addresses of the data
    /// connections, host identities and CPUs, then the network backend (RDMA or TCP), shared
    /// memory between the ranks of a host, and the inbox descriptors. What init and split have
    /// in common; the caller runs the first barrier.
    pub(super) fn connect(
        ex: &mut dyn Exchange,
        comm_id: u64,
        rank: usize,
        world: usize,
        config: Config,
        net: NetSetup,
        t0: Instant,
    ) -> Result<Self> {
        let mut config = config;
        let recv = config.recv_layout(world);
        let (slots, over) = (recv.nslots, recv.over);
        if recv.pool_slots > 0 {
            tracing::info!(
                target: "gradsync::init",
                "rank {rank}: {world} ranks x {} slots of {} KiB would exceed GRADSYNC_RECV_BUDGET ({} MiB): {} peers keep {slots} slots, the others share a pool of {} slots",
                config.nslots,
                config.chunk_bytes >> 10,
                config.recv_budget >> 20,
                crate::recv::slot_peers(rank, world).len(),
                recv.pool_slots
            );
            config.nslots = slots;
        } else if slots < config.nslots {
            tracing::info!(
                target: "gradsync::init",
                "rank {rank}: {world} ranks x {} slots of {} KiB would exceed GRADSYNC_RECV_BUDGET ({} MiB): {slots} slots per peer",
                config.nslots,
                config.chunk_bytes >> 10,
                config.recv_budget >> 20
            );
            config.nslots = slots;
        }
        if over && rank == 0 && recv.pool_slots > 0 {
            tracing::warn!(
                target: "gradsync::init",
                "rank 0: {} peers x {slots} slots and a pool of {} slots of {} KiB exceed GRADSYNC_RECV_BUDGET ({} MiB), and none can be fewer: raise GRADSYNC_RECV_BUDGET or lower GRADSYNC_CHUNK_SIZE",
                crate::recv::slot_peers_bound(world),
                recv.pool_slots,
                config.chunk_bytes >> 10,
                config.recv_budget >> 20
            );
        } else if over && rank == 0 {
            tracing::warn!(
                target: "gradsync::init",
                "rank 0: {world} ranks x {slots} slots of {} KiB ({} MiB of receive memory per rank) exceed GRADSYNC_RECV_BUDGET ({} MiB), and no peer gets fewer than {slots}: raise GRADSYNC_RECV_BUDGET or lower GRADSYNC_CHUNK_SIZE",
                config.chunk_bytes >> 10,
                (world * slots * config.chunk_bytes) >> 20,
                config.recv_budget >> 20
            );
        }
        let token = config.token.as_deref().map(str::as_bytes);
        let NetSetup {
            ip,
            ifname,
            placement,
        } = net;
        let listener =
            tcp::listen(ip).map_err(|e| Error::Config(format!("cannot listen on {ip}: {e}")))?;
        let my_addr = listener
            .local_addr()
            .map_err(|e| Error::Config(format!("listener address: {e}")))?;
        let host_id = config
            .host_id
            .clone()
            .unwrap_or_else(topology::host_identity);
        let my_cpus = topology::allowed_cpus();
        let cpu_list = my_cpus
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",");
        // The host of every rank, and the addresses of the ranks this one dials (through the
        // store only those it dials first, the others when it first dials them; see
        // `addresses`); the CPUs only of the ranks of this host, which alone need them.
        let (host_ids, addrs) = ex.peers(rank, world, my_addr, &host_id)?;
        let topo = Topology::from_identities(&host_ids);
        let local = topo.local_ranks(rank);
        let cpus = ex.swap(&[("cpus", cpu_list.as_bytes())], &local)?;
        // The CPUs the ranks of this host may use together: when they number at least the
        // ranks, every rank can have a core of its own (bound by a launcher, or free to move).
        let local_cpus: std::collections::BTreeSet<usize> = cpus
            .iter()
            .flat_map(|v| {
                topology::parse_cpu_list(&String::from_utf8_lossy(&v[0])).unwrap_or_default()
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
        let first_use = RdmaFirstUse {
            addrs: &addrs,
            listener: &listener,
            comm_id,
            token,
        };
        let net: Box<dyn Endpoint> =
            match Self::setup_rdma(ex, rank, world, &local, &config, first_use)? {
                Some(ep) => ep,
                None => {
                    let topts = TcpOptions {
                        nsocks: config.tcp_streams(false),
                        nsocks_local: config.tcp_streams(true),
                        local: (0..world).map(|p| local.contains(&p)).collect(),
                        sock_buf: config.socket_bufsize,
                        timeout: step_budget(ex, config.timeout.saturating_sub(t0.elapsed())),
                        token: token.map(<[u8]>::to_vec),
                        window: Some(tcp_window(&config, true)),
                    };
                    let ep = if config.runtime_connect {
                        TcpEndpoint::lazy(rank, addrs.clone(), listener, comm_id, &topts)
                    } else {
                        // Every pair connects now: every address is needed.
                        let all: Vec<usize> = (0..world).collect();
                        addrs
                            .resolve(&all, Instant::now() + topts.timeout)
                            .and_then(|all| {
                                TcpEndpoint::establish(rank, &all, listener, comm_id, &topts)
                            })
                    };
                    Box::new(ep.map_err(|e| Error::transport(rank, "connect", e))?)
                }
            };
        // The network backend's route (tcp or rdma), for the INFO line.
        let net_route = (0..world)
            .find(|&p| p != rank)
            .map_or(Route::Tcp, |p| net.caps(p).route);
        let shm = if matches!(config.transport, TransportMode::Auto | TransportMode::Shm)
            && local.len() > 1
        {
            match Self::setup_shm(ex, rank, world, &local, &config) {
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
        let ep: Box<dyn Endpoint> = match shm {
            Some(shm) => Box::new(
                HybridEndpoint::new(net, shm).map_err(|e| Error::transport(rank, "connect", e))?,
            ),
            None => net,
        };
        let routes: Vec<Route> = (0..world).map(|p| ep.caps(p).route).collect();
        for (p, t) in routes.iter().enumerate().filter(|(p, _)| *p != rank) {
            tracing::info!(
                target: "gradsync::init",
                "rank {rank} -> rank {p}: {t} ({} host {}, {})",
                if topo.host_of[p] == topo.host_of[rank] { "same" } else { "other" },
                topology::host_label(&host_ids[p]),
                match addrs.known(p) {
                    Some(a) => a.to_string(),
                    // The higher rank of a pair dials the lower one.
                    None if p > rank => "dials this rank".to_string(),
                    None => "address read on first use".to_string(),
                }
            );
        }
        let layout = Layout {
            host_of: topo.host_of.clone(),
            host_ids,
            local_size: topo.uniform_local_size(),
            routes,
            ifname: ifname.clone(),
            addrs: Some(addrs.clone()),
            placement,
        };
        let mut eopts = engine_options(&config);
        // Poll without yielding for a while when every rank of this host has a core: a peer's
        // shared-memory write then lands within the spin (sub-microsecond latency). Ranks in
        // other network namespaces of this machine (emulated hosts) share its cores too: where
        // they outnumber them, a rank spinning for a peer on its own core would keep that peer
        // from running (round trips of 250-270 us instead of 30-45 on 4 such hosts of 2 cores).
        if local.len() <= local_cpus.len()
            && topology::machine_ranks(&layout.host_ids, rank) <= local_cpus.len()
        {
            eopts.busy_spin = BUSY_SPIN.min(config.spin);
        }
        let (mut engine, inbox) = Engine::new(ep, comm_id, eopts)?;
        if recv.pool_slots > 0 {
            let pooled = recv.pooled_peers(rank, world);
            engine.enable_pool(recv.pool_for(pooled.len()), &pooled)?;
        }
        apply_caps(&mut engine, &config, Some(&topo.host_of));
        meet_inboxes(ex, &mut engine, inbox, &config, Some(&addrs))?;
        let (near, far) = (tcp_window(&config, true), tcp_window(&config, false));
        tracing::info!(
            target: "gradsync::init",
            "gradsync {} rank {rank}/{world} interface {ifname} {ip} transport {} hosts {} local ranks {} {} chunk {} KiB x {} slots eager up to {} bytes{} connections {}{} receive memory {} MiB registered{} (budget {} MiB) timeout {:?} (init {:.1} ms)",
            crate::VERSION,
            engine.ep.name(),
            topo.hosts(),
            local.len(),
            if net_route == Route::Rdma {
                format!("rdma queue pairs/peer {}", config.ib.qps_per_conn)
            } else {
                let (here, there) = (config.tcp_streams(true), config.tcp_streams(false));
                let across = if topo.hosts() > 1 && (far != near || there != here) {
                    let s = if there == 1 { "" } else { "s" };
                    format!(" ({there} stream{s} and {far} slots to another host)")
                } else {
                    String::new()
                };
                format!("tcp streams/peer {here} slots/peer {near}{across}")
            },
            config.chunk_bytes / 1024,
            config.nslots,
            engine.eager_limit(),
            if engine.board() { " on the board" } else { "" },
            engine.connections(),
            if engine.connections() + 1 < world {
                " (more on first use)"
            } else {
                ""
            },
            engine.inbox_bytes() >> 20,
            match engine.pool_state() {
                p if p.slots > 0 => {
                    format!(" with a pool of {} slots for {} peers", p.slots, p.pooled_peers)
                }
                _ => String::new(),
            },
            config.recv_budget >> 20,
            config.timeout,
            t0.elapsed().as_secs_f64() * 1e3
        );
        let mut c = Communicator::assemble(engine, rank, world, config.algorithm, None);
        c.coll_algorithms = config.collective_algorithms.clone();
        c.layout = layout;
        c.config = Some(config);
        Ok(c)
    }

    /// The RDMA network backend, when `GRADSYNC_TRANSPORT=rdma` asks for it (an error if it
    /// cannot be had) or the automatic choice can use it: the `rdma` feature is built in, some
    /// peer is on another host, `GRADSYNC_IB_DISABLE` is not set and every rank opened an
    /// active port.
    ///
    /// With connections on first use (the default), every rank only says whether it opened a
    /// port, so all ranks make the same choice, and each pair makes its queue pairs when it is
    /// first used, exchanging their numbers over a connection to the lower rank's listener
    /// (`first_use`). Otherwise every rank publishes its queue pair descriptor (empty when it
    /// has none), every queue pair goes to RTS, and the ranks agree that they are ready before
    /// any traffic.
    fn setup_rdma(
        ex: &mut dyn Exchange,
        rank: usize,
        world: usize,
        local: &[usize],
        config: &Config,
        first_use: RdmaFirstUse<'_>,
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
            let _ = (ex, rank, first_use);
            Err(Error::Config(
                "GRADSYNC_TRANSPORT=rdma: this gradsync was built without the rdma feature (cargo build --features rdma)".into(),
            ))
        }
        #[cfg(feature = "rdma")]
        {
            use gradsync_transport::rdma::{RdmaOptions, RdmaSetup};
            let everyone: Vec<usize> = (0..world).collect();
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
            // The first rank answers for all: empty when every rank's value is "1", else the
            // first rank whose value is not.
            let first_failed = |vals: &[Vec<u8>]| {
                vals.iter()
                    .position(|v| v.as_slice() != b"1")
                    .map_or(Vec::new(), |p| (p as u64).to_le_bytes().to_vec())
            };
            let failed_rank = |failed: &[u8]| {
                failed
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(u64::MAX, u64::from_le_bytes)
            };
            let made = if config.runtime_connect {
                RdmaSetup::open(rank, world, &opts)
            } else {
                RdmaSetup::new(rank, world, &opts)
            };
            if let Err(e) = &made
                && !forced
            {
                tracing::warn!(target: "gradsync::init", "rank {rank}: RDMA setup failed, falling back to tcp (GRADSYNC_TRANSPORT=rdma makes this an error, GRADSYNC_IB_DISABLE=1 silences it): {e}");
            }
            // Which rank has no port, if one has none: under first use every rank only says
            // whether it opened one; otherwise its descriptor says it (empty: none), and each
            // rank gets the columns of the descriptors meant for it.
            let (no_port, vals) = if config.runtime_connect {
                let ok: &[u8] = if made.is_ok() { b"1" } else { b"0" };
                let failed = ex.table("rdma/open", ok, &everyone, &first_failed)?;
                (
                    (!failed.is_empty()).then(|| failed_rank(&failed)),
                    Vec::new(),
                )
            } else {
                let mine = made.as_ref().map_or(Vec::new(), RdmaSetup::info);
                // Each rank's descriptor has an entry for every queue pair to every rank; a
                // rank gets only the columns for itself (see `wire::ConnInfoRepr::column`), so
                // what it reads grows with the world, not with its square. An empty
                // descriptor (no port) stays empty, one that does not parse goes whole, for
                // `connect` to name.
                let columns = |vals: &[Vec<u8>], dst: usize| {
                    let mut t = Vec::new();
                    for v in vals {
                        let col = if v.is_empty() {
                            Vec::new()
                        } else {
                            RdmaSetup::column(v, dst).unwrap_or_else(|| v.clone())
                        };
                        super::records::put(&mut t, &col);
                    }
                    t
                };
                let mine_cols = ex.parts("rdma/info", &mine, &everyone, &columns)?;
                let vals = super::records::take(&mine_cols, world).ok_or_else(|| {
                    Error::Config(format!(
                        "rank {rank}: the RDMA descriptors of init are malformed ({} bytes for {world} ranks)",
                        mine_cols.len()
                    ))
                })?;
                (vals.iter().position(Vec::is_empty).map(|p| p as u64), vals)
            };
            let setup = match made {
                Ok(s) => s,
                Err(e) if forced => {
                    return Err(Error::transport(rank, "GRADSYNC_TRANSPORT=rdma", e));
                }
                Err(_) => return Ok(None),
            };
            if let Some(p) = no_port {
                if forced {
                    return Err(Error::Config(format!(
                        "GRADSYNC_TRANSPORT=rdma: rank {p} has no usable RDMA port (see its log)"
                    )));
                }
                tracing::warn!(target: "gradsync::init", "rank {rank}: rank {p} has no usable RDMA port (see its log), falling back to tcp");
                return Ok(None);
            }
            let device = setup.device();
            let ep = if config.runtime_connect {
                let listener = first_use
                    .listener
                    .try_clone()
                    .map_err(|e| Error::Config(format!("listener: {e}")))?;
                setup
                    .first_use(gradsync_transport::rdma::FirstUse {
                        addrs: first_use.addrs.clone(),
                        listener,
                        comm_id: first_use.comm_id,
                        token: first_use.token.map(<[u8]>::to_vec),
                        timeout: config.timeout,
                    })
                    .map_err(|e| Error::transport(rank, "rdma connect", e))?
            } else {
                // Every rank says whether its queue pairs reached RTS, so a rank whose
                // transition failed does not leave the others waiting for it until the
                // deadline.
                let connected = setup.connect(&vals);
                let ok: &[u8] = if connected.is_ok() { b"1" } else { b"0" };
                let failed = ex.table("rdma/ready", ok, &everyone, &first_failed)?;
                let ep = connected.map_err(|e| Error::transport(rank, "rdma connect", e))?;
                if !failed.is_empty() {
                    let p = failed_rank(&failed);
                    return Err(Error::Config(format!(
                        "rank {p} could not connect its RDMA queue pairs (see its log); rank {rank} stops too"
                    )));
                }
                ep
            };
            tracing::info!(
                target: "gradsync::init",
                "rank {rank}: rdma device {device}, {} queue pairs per peer{}",
                config.ib.qps_per_conn,
                if config.runtime_connect { ", made on first use" } else { "" }
            );
            Ok(Some(Box::new(ep)))
        }
    }

    /// Connects the shared-memory backend to the other ranks of this host. Every local rank
    /// publishes its segment (or an empty value when it could not make one), then whether it
    /// could map every peer's; shared memory is used only when all of them succeeded, so the
    /// ranks of a host always agree on the transport of each pair.
    fn setup_shm(
        ex: &mut dyn Exchange,
        rank: usize,
        world: usize,
        local: &[usize],
        config: &Config,
    ) -> std::result::Result<ShmEndpoint, String> {
        let made = ShmSetup::new(rank, world, local);
        let mine = match &made {
            Ok((_, info)) => info.to_bytes().to_vec(),
            Err(_) => Vec::new(),
        };
        let vals: Vec<Vec<u8>> = ex
            .swap(&[("shm/info", &mine)], local)
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|mut v| v.swap_remove(0))
            .collect();
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
        let connected = setup.connect(&infos, step_budget(ex, config.timeout));
        let ok: &[u8] = if connected.is_ok() { b"1" } else { b"0" };
        let vals: Vec<Vec<u8>> = ex
            .swap(&[("shm/ok", ok)], local)
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|mut v| v.swap_remove(0))
            .collect();
        let mut shm = connected.map_err(|e| e.to_string())?;
        shm.set_huge_pages(config.shm_huge_pages);
        if let Some(i) = vals.iter().position(|v| v.as_slice() != b"1") {
            return Err(format!(
                "rank {} could not map the shared-memory segments of this host",
                local[i]
            ));
        }
        Ok(shm)
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
        check_forced(config)?;
        let comm_id = new_comm_id();
        let mut engines = Vec::with_capacity(world);
        let mut inboxes = Vec::with_capacity(world);
        for ep in endpoints {
            let (mut e, inbox) = Engine::new(ep, comm_id, engine_options(config))?;
            apply_caps(&mut e, config, None);
            engines.push(e);
            inboxes.push(inbox);
        }
        // The board, as init agrees on it: when every endpoint has one.
        let smallest = engines
            .iter_mut()
            .map(|e| e.ep.board().map_or(0, |b| b.capacity()))
            .min()
            .filter(|_| config.shm_board)
            .unwrap_or(0);
        engines.iter_mut().for_each(|e| e.enable_board(smallest));
        Ok(engines
            .into_iter()
            .enumerate()
            .map(|(rank, mut engine)| {
                engine.connect_peers(&inboxes);
                let mut c = Communicator::assemble(engine, rank, world, config.algorithm, None);
                c.coll_algorithms = config.collective_algorithms.clone();
                let mut cfg = config.clone();
                (cfg.rank, cfg.world) = (rank, world);
                c.config = Some(cfg);
                c.in_process = true;
                c
            })
            .collect())
    }

    pub(super) fn assemble(
        engine: Engine,
        rank: usize,
        world: usize,
        algorithm: Option<Algorithm>,
        store: Option<std::sync::Arc<StoreServer>>,
    ) -> Self {
        let layout = Layout::single_host(engine.ep.as_ref());
        let route = layout.routes[(rank + 1) % world];
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
            via_store: false,
            store_traffic: None,
            fetch_traffic: None,
            config: None,
            generation: 0,
            splits: 0,
            in_process: false,
            closed: false,
            current: None,
            finished: HashMap::new(),
            next_work: 1,
            layout,
            _store: store,
            explained: 0,
            costs: crate::cost::LinkCosts::uncalibrated(route, route),
            cost_from: "uncalibrated".to_string(),
            cost_path: None,
            choices: no_choices(),
        }
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
        let (Some(config), true) = (self.config.clone(), self.via_store) else {
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
        // The new communicator keeps the store this process hosts: this one is dropped after a
        // failure, and the other survivors may still be meeting through it.
        let server = self._store.clone();
        Self::join(store, server, comm_id, new_rank, new_world, cfg, t0)
    }
}

/// Where a rank's data connections live: the address to listen on, its interface, and how
/// the rank was placed on the NUMA nodes (found at init, inherited by a split).
pub(super) struct NetSetup {
    pub(super) ip: IpAddr,
    pub(super) ifname: String,
    pub(super) placement: topology::Placement,
}

/// Swaps the inbox descriptors through `ex`, each with the settings that shape every inbox
/// (which must agree), records them in `engine`, and turns the board on where every rank has
/// one.
///
/// Through the store, with connections on first use, the first rank checks every rank's
/// settings and publishes only the agreed layout; each rank reads the descriptors of the few ranks it talks to first
/// (`addresses::likely_talked`), and the engine reads any other from the store when an
/// operation first talks to its rank (with the address of a lower one, from `book`'s view).
pub(super) fn meet_inboxes(
    ex: &mut dyn Exchange,
    engine: &mut Engine,
    inbox: RemoteRegion,
    config: &Config,
    book: Option<&gradsync_transport::AddressBook>,
) -> Result<()> {
    let (rank, world) = (engine.rank, engine.world);
    // Every rank lays out its inbox and picks slots from these three settings, so they travel
    // with the inbox descriptor and must agree.
    let board_capacity = engine.ep.board().map_or(0, |b| b.capacity());
    let slots = SlotLayout::of(config, board_capacity, engine.pool_on);
    let mut mine = inbox.to_bytes().to_vec();
    mine.extend_from_slice(&slots.to_bytes());
    let everyone: Vec<usize> = (0..world).collect();
    // Every pair connects at init without connections on first use: every rank then gets
    // every descriptor, and the job needs the store no more after init.
    if !config.runtime_connect || ex.on_demand().is_none() {
        let table = ex.table("inbox", &mine, &everyone, &pack_inboxes)?;
        let (first, inboxes) = unpack_inboxes(&table, rank, world)?;
        // The first rank checked every rank's settings against its own; this rank's too.
        slots.check(rank, 0, &first)?;
        engine.connect_peers(&inboxes);
        engine.enable_board(first.board as usize);
        return Ok(());
    }
    let table = ex.table("inbox", &mine, &everyone, &pack_layout)?;
    let (first, _) = unpack_inboxes(&table, rank, 0)?;
    slots.check(rank, 0, &first)?;
    let od = ex.on_demand().expect("an exchange through the store");
    let known = addresses::read_at_init(
        od.store,
        od.prefix,
        rank,
        &addresses::likely_talked(rank, world),
        od.timeout,
        addresses::inbox_key,
        addresses::parse_inbox,
    )?;
    let source = addresses::StoreInboxes {
        reach: od.reach,
        rank,
        prefix: od.prefix.to_string(),
        traffic: od.traffic,
        book: book.cloned(),
    };
    engine.connect_peers_on_demand(&known, Box::new(source));
    engine.enable_board(first.board as usize);
    Ok(())
}

/// [`pack_inboxes`] without the descriptors: the first rank's layout with the least board
/// of all, or the error of a record that does not parse or whose settings differ.
fn pack_layout(records: &[Vec<u8>]) -> Vec<u8> {
    let mut t = pack_inboxes(records);
    if t.first() == Some(&0) {
        t.truncate(1 + SlotLayout::LEN);
    }
    t
}

/// Packs the inbox records (descriptor, then [`SlotLayout`]) of ranks `0..n` into the inbox
/// table: the first rank's layout with the least board of all, then every descriptor. A record
/// that does not parse, or settings that differ from the first rank's, make it an error table.
fn pack_inboxes(records: &[Vec<u8>]) -> Vec<u8> {
    let parse = |v: &[u8]| {
        let (desc, layout) = v.split_at(v.len().saturating_sub(SlotLayout::LEN));
        (desc.len() == REMOTE_REGION_LEN)
            .then_some(())
            .and(SlotLayout::from_bytes(layout))
            .map(|l| (desc.to_vec(), l))
    };
    let mut descs = Vec::with_capacity(records.len() * REMOTE_REGION_LEN);
    let mut first: Option<SlotLayout> = None;
    for (r, v) in records.iter().enumerate() {
        let Some((desc, theirs)) = parse(v) else {
            return tables::failed(&format!("rank {r} published a malformed inbox descriptor"));
        };
        let f = first.get_or_insert(theirs);
        if let Some(d) = f.differences(0, r, &theirs) {
            return tables::failed(&d);
        }
        f.board = f.board.min(theirs.board);
        descs.extend_from_slice(&desc);
    }
    let mut t = vec![0u8];
    t.extend_from_slice(&first.map_or([0; SlotLayout::LEN], SlotLayout::to_bytes));
    t.extend_from_slice(&descs);
    t
}

/// The first rank's slot layout (with the least board of all) and every rank's inbox from the
/// inbox table `t` of `world` ranks.
fn unpack_inboxes(t: &[u8], rank: usize, world: usize) -> Result<(SlotLayout, Vec<RemoteRegion>)> {
    let body = tables::body(t, "inbox", rank)?;
    let malformed = || {
        Error::Config(format!(
            "rank {rank}: the inbox table of init is malformed ({} bytes for {world} ranks)",
            t.len()
        ))
    };
    if body.len() != SlotLayout::LEN + world * REMOTE_REGION_LEN {
        return Err(malformed());
    }
    let (layout, descs) = body.split_at(SlotLayout::LEN);
    let layout = SlotLayout::from_bytes(layout).ok_or_else(malformed)?;
    let inboxes = descs
        .chunks(REMOTE_REGION_LEN)
        .map(|d| RemoteRegion::from_bytes(d).ok_or_else(malformed))
        .collect::<Result<Vec<_>>>()?;
    Ok((layout, inboxes))
}

pub(super) fn engine_options(c: &Config) -> EngineOptions {
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

/// What the RDMA backend needs to connect its pairs on first use: every rank's listening
/// address, this rank's listener, the communicator and the job token.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
struct RdmaFirstUse<'a> {
    addrs: &'a gradsync_transport::AddressBook,
    listener: &'a std::net::TcpListener,
    comm_id: u64,
    token: Option<&'a [u8]>,
}

fn tcp_window(c: &Config, same_host: bool) -> usize {
    match c.tcp_nslots {
        0 if same_host => crate::config::DEFAULT_TCP_NSLOTS,
        0 => c.nslots,
        n => n,
    }
    .min(c.nslots)
}

/// Sets every pair's window and direct-write threshold from what the transport can do for it:
/// the window it suggests, no direct writes where it cannot land them in caller buffers (RDMA
/// pins only long-lived regions), the shared-memory threshold where the peer maps this rank's
/// memory, the network's otherwise. With `host_of` (every rank's host), a TCP pair across hosts
/// gets the window for another host (see [`Config::tcp_nslots`]).
pub(super) fn apply_caps(engine: &mut Engine, config: &Config, host_of: Option<&[usize]>) {
    let (rank, world) = (engine.rank, engine.world);
    for p in (0..world).filter(|&p| p != rank) {
        let caps = engine.ep.caps(p);
        let across = host_of.is_some_and(|h| h.get(p) != h.get(rank));
        if caps.route == Route::Tcp && across {
            engine.set_window(p, tcp_window(config, false));
        } else if let Some(w) = caps.window {
            engine.set_window(p, w);
        }
        let (direct_min, move_direct_min, move_block) = if !caps.direct_writes {
            (usize::MAX, usize::MAX, 0)
        } else if caps.mapped {
            (
                config.shm_direct_min,
                config.shm_move_direct_min,
                config.shm_move_block_min,
            )
        } else {
            (config.direct_min, config.direct_min, 0)
        };
        engine.set_direct_min(p, direct_min, move_direct_min, move_block);
    }
}

/// Rejects a configuration that forces an algorithm the engine chooses itself
/// ([`Algorithm::is_internal`]).
fn check_forced(config: &Config) -> Result<()> {
    let forced = config
        .algorithm
        .map(|a| (Collective::AllReduce, a))
        .into_iter()
        .chain(config.collective_algorithms.iter().copied());
    for (coll, a) in forced {
        if a.is_internal() {
            return Err(Error::Config(format!(
                "rank {}: {}: the {} algorithm is chosen by the engine and cannot be forced",
                config.rank,
                coll.name(),
                a.name()
            )));
        }
    }
    Ok(())
}
