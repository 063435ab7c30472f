//! maru-server: the metadata node of one app on one pool. Storage sessions, pages,
//! keys, leases and eviction; regions from the RM; the region keeper. It never
//! touches KV bytes. `maru-server stats` prints a running server's statistics.

use clap::{Args as ClapArgs, Parser, Subcommand};
use maru::meta::{heartbeat_ms, MetaConfig, MetaCore};
use maru::net::{default_client_id, Client, ClientOptions, Clock, Server, SignalPipe};
use maru::wire::meta::{MetaReply, MetaRequest, SERVICE};
use maru_daemons::common::{
    bind_addr, check_host_port, die, die_unavailable, exit_with, notify_ready, parse_args,
    raise_nofile_limit, serve_metrics, write_ready_file, NetArgs, OpsArgs, EX_FAILURE,
};
use maru_daemons::meta_agents::MetaAgents;
use maru_daemons::meta_rm::{MetaRm, RM_KEEPALIVE};
use maru_daemons::meta_service::{MetaService, Recovery, SERVER_GAUGES, SERVER_TOTALS};
use maru_daemons::meta_store::{MetaStore, StoreWriter};
use maru_daemons::meta_watch::{watch_agents, watch_signals, AGENT_CHECK_EVERY};
use maru_daemons::metrics::Metrics;
use maru_daemons::session_binding::SessionBinding;
use maru_daemons::tenants_file::TenantsFile;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "maru-server",
    version,
    about = "Maru metadata server: storage sessions, keys, leases, eviction, region keeper",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    serve: Serve,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print a running server's statistics (per session and total).
    Stats {
        /// Server address.
        #[arg(long, default_value = "127.0.0.1:5555", env = "MARU_SERVER_ADDRESS")]
        server: String,
        /// One session only.
        #[arg(long)]
        session: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The server's key file (default ~/.maru/server.key when it exists; none:
        /// only a server started with --insecure-no-key answers).
        #[arg(long, env = "MARU_SERVER_KEY_FILE")]
        key_file: Option<PathBuf>,
    },
    /// Write a new key file (mode 0600) for a tenant of the tenants file; refuses to
    /// overwrite one.
    GenKey {
        /// Where to write it.
        path: PathBuf,
    },
}

#[derive(ClapArgs, Debug)]
struct Serve {
    /// Address to listen on (the protocol is plaintext: loopback or a trusted network).
    #[arg(long, default_value = "127.0.0.1", env = "MARU_SERVER_HOST")]
    host: String,
    /// TCP port (0 picks a free one; see --ready-file).
    #[arg(short, long, default_value_t = 5555, env = "MARU_SERVER_PORT")]
    port: u16,
    /// The pool's resource manager.
    #[arg(long, default_value = "127.0.0.1:9850", env = "MARU_RM_ADDRESS")]
    rm_address: String,
    /// Key file of the resource manager (its STATE_DIR/rm.key, copied here mode 0600).
    /// Without it the server can reach only an RM started with --insecure-no-key.
    #[arg(long, env = "MARU_RM_KEY_FILE")]
    rm_key_file: Option<PathBuf>,
    /// Key every client proves before any request (hex key file, mode 0600), default
    /// ~/.maru/server.key. Created (0600) if missing, so the first start makes the key
    /// the workers are then given (server_key_file in their configuration, else
    /// MARU_SERVER_KEY_FILE, else a worker on this host under the same user finds
    /// ~/.maru/server.key itself when it is mode 0600). Its holders are the tenant `default`: every namespace no tenant
    /// of --tenants writes, and the operator's view of every session (stats, usage).
    #[arg(long, env = "MARU_SERVER_KEY_FILE", conflicts_with = "insecure_no_key")]
    key_file: Option<PathBuf>,
    /// Serve without a key: then any process that reaches the port may open sessions,
    /// publish keys first into any namespace (other engines then load its bytes) and
    /// read every namespace. For throwaway tests only; logged as a warning.
    #[arg(long)]
    insecure_no_key: bool,
    /// Tenants file (TOML): each tenant's key file, the namespaces it writes and reads,
    /// its limits (docs/operations.md, "Tenants"). Read again within 2 s of a change.
    #[arg(long, env = "MARU_SERVER_TENANTS", conflicts_with = "insecure_no_key")]
    tenants: Option<PathBuf>,
    #[command(flatten)]
    net: NetArgs,
    /// A remote CXL agent of the pool, host:port (repeat for each memory node of a shared
    /// pool). With agents the server offers remote_cxl_storage_v1.
    #[arg(long = "remote-cxl-agent", value_name = "HOST:PORT")]
    agents: Vec<String>,
    /// Agent key file (default ~/.maru/remote-cxl-agent.key).
    #[arg(long, env = "MARU_REMOTE_CXL_AGENT_KEY_FILE")]
    remote_cxl_agent_key_file: Option<PathBuf>,
    /// Size of one region (K/M/G suffixes).
    #[arg(long, default_value = "1G")]
    region_size: String,
    /// Page (chunk) size inside regions.
    #[arg(long, default_value = "4M")]
    chunk_size: String,
    /// A session that sends nothing for this long expires (its regions go to the keeper).
    /// A region a session holds without storing in it goes back after a third of this
    /// (0.2 to 10 s: about one heartbeat of its worker).
    #[arg(long, default_value_t = 30)]
    session_timeout_s: u64,
    /// A lease not released for this long ends.
    #[arg(long, default_value_t = 60)]
    lease_timeout_s: u64,
    /// Most live sessions, all tenants together (each tenant's own limit is in
    /// --tenants: max_sessions, 64 by default).
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Order of eviction victims (docs/configuration.md). All but `lru` offer tails of
    /// prefix chains first. `reuse`: by last use with half a cache of credit per
    /// read, reads remembered past an eviction; `reuse-ends`: `reuse`, and the last
    /// chunk of a prompt never read before any other (for connectors that store a
    /// partial last chunk); `prefix`: least recently used; `lru`: plain least
    /// recently used, chains ignored (to measure against).
    #[arg(long, default_value = "reuse", value_parser = ["reuse", "reuse-ends", "prefix", "lru"])]
    victim_order: String,
    /// Directory where the key directory is kept durable (keys, regions, sessions:
    /// a restart or an upgrade keeps the cache). Default: `maru-server-state` beside
    /// the key file (~/.maru/maru-server-state; /var/lib/maru/maru-server-state under
    /// the systemd unit). Created 0700; one server per directory.
    #[arg(long, env = "MARU_SERVER_STATE_DIR", conflicts_with = "in_memory")]
    state_dir: Option<PathBuf>,
    /// Keep the key directory in memory only: a restart empties the cache, and on
    /// SIGTERM the region keeper gives its regions back. For throwaway servers.
    #[arg(long)]
    in_memory: bool,
    /// Write the listening address to this file once ready.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Microseconds the event loop keeps polling without sleeping after a turn that
    /// had work, so a client's next request finds it awake (0: sleep at once). An
    /// idle server spins at most this long after its last request.
    #[arg(long, default_value_t = maru::net::server::DEFAULT_POLL_SPIN_US,
          env = "MARU_SERVER_POLL_SPIN_US", value_parser = clap::value_parser!(u64).range(0..=10_000))]
    poll_spin_us: u64,
    #[command(flatten)]
    ops: OpsArgs,
}

fn size(flag: &str, v: &str) -> u64 {
    maru::dax::parse_size(v).unwrap_or_else(|e| die(format!("--{flag} {v}: {e}")))
}

fn stats(server: &str, session: Option<u64>, json: bool, key_file: Option<PathBuf>) {
    let mut opts = ClientOptions::new(SERVICE, default_client_id("maru-server-stats@"));
    let key_file = key_file.or_else(|| Some(default_server_key()).filter(|p| p.exists()));
    opts.key = key_file.map(|p| maru::auth::load_key_file(&p).unwrap_or_else(|e| die(e)));
    let mut c = Client::connect(server, &opts)
        .unwrap_or_else(|e| die_unavailable(format!("cannot reach maru-server at {server}: {e}")));
    let info = c.welcome().info.clone();
    let reply: MetaReply = c
        .call(&MetaRequest::Stats { session })
        .unwrap_or_else(|e| die_unavailable(e));
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&reply).unwrap_or_default()
        );
        return;
    }
    let MetaReply::Stats(s) = reply else {
        exit_with(EX_FAILURE, format!("unexpected reply {reply:?}"))
    };
    println!(
        "maru-server {} at {server}, up {} s",
        info.get("version").and_then(|v| v.as_str()).unwrap_or("?"),
        info.get("uptime_s").and_then(|v| v.as_u64()).unwrap_or(0)
    );
    let rate = |h: u64, m: u64| {
        if h + m == 0 {
            "-".to_string()
        } else {
            format!("{:.1}%", 100.0 * h as f64 / (h + m) as f64)
        }
    };
    println!(
        "{:<8} {:<24} {:<11} {:>8} {:>8} {:>12} {:>10} {:>10} {:>8} {:>7}",
        "SESSION",
        "ENGINE",
        "BACKEND",
        "REGIONS",
        "KEYS",
        "KEY_MiB",
        "HITS",
        "MISSES",
        "HIT%",
        "LEASES"
    );
    for x in &s.sessions {
        println!(
            "{:<8} {:<24} {:<11} {:>8} {:>8} {:>12.1} {:>10} {:>10} {:>8} {:>7}",
            x.session,
            x.engine_id,
            x.backend.map(|b| b.as_str()).unwrap_or("-"),
            x.regions,
            x.keys,
            x.key_bytes as f64 / (1u64 << 20) as f64,
            x.hits,
            x.misses,
            rate(x.hits, x.misses),
            x.leases
        );
    }
    let t = &s.total;
    println!(
        "total: {} sessions, {} regions ({:.1} MiB), {} keys ({:.1} MiB), hits {} misses {} ({}), {} leases, kept {} regions / {} keys, giving back {}",
        t.sessions, t.regions, t.region_bytes as f64 / (1u64 << 20) as f64, t.keys, t.key_bytes as f64 / (1u64 << 20) as f64,
        t.hits, t.misses, rate(t.hits, t.misses), t.leases, t.kept_regions, t.kept_keys, t.giving_back
    );
}

fn home_file(name: &str) -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
        .join(".maru")
        .join(name)
}

fn default_agent_key() -> PathBuf {
    home_file("remote-cxl-agent.key")
}

/// maru-server's own key file when `--key-file` is not given.
fn default_server_key() -> PathBuf {
    home_file("server.key")
}

fn gen_key(path: &std::path::Path) {
    let key = maru::auth::SharedKey::generate()
        .unwrap_or_else(|e| exit_with(EX_FAILURE, format!("cannot draw random bytes: {e}")));
    maru::auth::keyfile::write_new_key_file(path, &key)
        .unwrap_or_else(|e| die(format!("cannot create key file {}: {e}", path.display())));
    println!(
        "wrote {} (mode 0600): name it as a tenant's key_file in the tenants file, and give \
         it to that tenant's workers (server_key_file or MARU_SERVER_KEY_FILE)",
        path.display()
    );
}

/// Rebuilds the core from the directory read, then checks it against the world before
/// anything is served: the regions the RM still holds for this server, and the boot
/// id of every agent.
fn recover(
    cfg: MetaConfig,
    tenants: maru::meta::Tenants,
    clock: &Clock,
    rm: &mut MetaRm,
    agents: &MetaAgents,
    image: maru::meta::records::Image,
) -> (MetaCore, Recovery) {
    let started = std::time::Instant::now();
    let agent_list = cfg.agents.clone();
    let (mut core, rec) =
        MetaCore::restore(cfg, tenants, image, clock.now_ms()).unwrap_or_else(|e| die(e));
    // The RM must answer: without its answer no recovered key can be vouched for.
    let mut tries = 0;
    let held = loop {
        match rm.owned_region_infos() {
            Ok(h) => break h,
            Err(e) if tries < 20 => {
                tries += 1;
                log::warn!("recovery: cannot ask the RM which regions it holds ({e}); retrying");
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            Err(e) => die_unavailable(format!(
                "recovery: the RM did not say which regions it holds for maru-server: {e}"
            )),
        }
    };
    let (_, dropped_rm) = core.recovered_rm(&held, clock.now_ms());
    let mut boots = std::collections::BTreeMap::new();
    for agent in agent_list {
        let answer = Client::connect(&agent, &agents.options())
            .map_err(|e| maru::meta::PortError::Unreachable(e.to_string()))
            .and_then(|c| {
                c.welcome()
                    .info
                    .get("boot_id")
                    .and_then(|b| b.as_str())
                    .filter(|b| !b.is_empty())
                    .map(str::to_string)
                    .ok_or_else(|| maru::meta::PortError::Unreachable("no boot id".into()))
            });
        if let Err(e) = &answer {
            log::warn!("recovery: agent {agent} did not say its boot id ({e}); its regions' keys stay, checked later");
        }
        boots.insert(agent, answer);
    }
    let dropped_boots = core.recovered_boots(&boots, clock.now_ms());
    let stats = core.total_stats();
    let recovery = Recovery {
        keys: stats.keys,
        regions: stats.regions,
        sessions: rec.sessions,
        dropped_keys: rec.left_out + (dropped_rm + dropped_boots) as u64,
        unverified: rec.unverified,
        took_ms: started.elapsed().as_millis() as u64,
    };
    (core, recovery)
}

fn main() {
    let cli: Cli = parse_args();
    match cli.cmd {
        Some(Cmd::Stats {
            server,
            session,
            json,
            key_file,
        }) => return stats(&server, session, json, key_file),
        Some(Cmd::GenKey { path }) => return gen_key(&path),
        None => {}
    }
    let a = cli.serve;
    let metrics_addr = a.ops.start();
    if a.rm_address.trim().is_empty() {
        die("the resource manager address is empty: set --rm-address or MARU_RM_ADDRESS");
    }
    check_host_port("rm-address", &a.rm_address).unwrap_or_else(|e| die(e));
    for g in &a.agents {
        check_host_port("remote-cxl-agent", g).unwrap_or_else(|e| die(e));
    }
    let addr = bind_addr(&a.host, a.port, "maru-server").unwrap_or_else(|e| die(e));
    let mut cfg = MetaConfig {
        region_size: size("region-size", &a.region_size),
        chunk_size: size("chunk-size", &a.chunk_size),
        agents: a.agents.clone(),
        rm_address: a.rm_address.clone(),
        session_timeout_ms: a.session_timeout_s * 1000,
        lease_timeout_ms: a.lease_timeout_s * 1000,
        max_sessions: a.max_sessions,
        victim_order: a
            .victim_order
            .parse()
            .unwrap_or_else(|e| die(format!("--victim-order: {e}"))),
        // A region a session holds without storing goes back within about one of its
        // worker's heartbeats.
        unused_region_ms: heartbeat_ms(a.session_timeout_s * 1000),
        ..MetaConfig::default()
    };
    MetaCore::new(cfg.clone()).unwrap_or_else(|e| die(e));
    // The key (and the tenants file) are checked before anything connects; a missing
    // key file is made once the rest is in place.
    let key_path = a.key_file.clone().unwrap_or_else(default_server_key);
    let existing_key = (!a.insecure_no_key && key_path.exists())
        .then(|| maru::auth::load_key_file(&key_path).unwrap_or_else(|e| die(e)));
    let rm_key = a
        .rm_key_file
        .as_ref()
        .map(|p| maru::auth::load_key_file(p).unwrap_or_else(|e| die(e)));
    let clock = Clock::new();
    // The RM first: a server that cannot start touches no state directory.
    if let Err(e) = MetaRm::new(
        &a.rm_address,
        default_client_id("maru-server@"),
        rm_key.clone(),
    )
    .check()
    {
        die_unavailable(format!(
            "{e}; maru-server needs its resource manager (start it first or fix --rm-address)"
        ));
    }
    let opened = (!a.in_memory).then(|| {
        let dir = a.state_dir.clone().unwrap_or_else(|| {
            key_path
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join("maru-server-state")
        });
        let (store, loaded) = MetaStore::open(&dir, maru::meta::new_instance, cfg.lease_timeout_ms)
            .unwrap_or_else(|e| die(e));
        log::info!(
            "durable directory {} (instance {}, start {}): {} keys, {} regions, {} sessions \
             read in {} ms",
            store.path().display(),
            loaded.instance,
            loaded.run,
            loaded.image.keys.len(),
            loaded.image.regions.len(),
            loaded.image.sessions.len(),
            loaded.read.as_millis()
        );
        (store, loaded)
    });
    // A server with a durable directory is one logical server across restarts: the
    // same instance for workers (they resume their sessions) and the same owner at the
    // RM (which keeps its regions for its grace period, not freeing them when the
    // process exits as it does for an owner named by host and pid).
    let client_id = match &opened {
        Some((_, l)) => {
            cfg.instance = l.instance.clone();
            format!("maru-server/{}@{}", l.instance, maru::net::hostname())
        }
        None => default_client_id("maru-server@"),
    };
    let mut rm = MetaRm::new(&a.rm_address, client_id.clone(), rm_key.clone());
    if let Err(e) = rm.check() {
        die_unavailable(format!(
            "{e}; maru-server needs its resource manager (start it first or fix --rm-address)"
        ));
    }
    MetaRm::keep_alive(&a.rm_address, client_id.clone(), rm_key, RM_KEEPALIVE);
    let agent_key = if a.agents.is_empty() {
        None
    } else {
        let p = a
            .remote_cxl_agent_key_file
            .clone()
            .unwrap_or_else(default_agent_key);
        Some(
            maru::auth::load_key_file(&p)
                .unwrap_or_else(|e| die(format!("{e} (needed for --remote-cxl-agent)"))),
        )
    };
    let agents = MetaAgents::new(client_id, agent_key);
    watch_agents(a.agents.clone(), agents.options(), AGENT_CHECK_EVERY);
    let pipe = SignalPipe::install()
        .unwrap_or_else(|e| die(format!("cannot install signal handlers: {e}")));
    let keys = if a.insecure_no_key {
        log::warn!(
            "running WITHOUT a key (--insecure-no-key): any process that reaches this port \
             may open sessions, publish keys first into any namespace (other engines then \
             load its bytes) and read every namespace"
        );
        None
    } else {
        let key = existing_key.unwrap_or_else(|| {
            maru::auth::load_or_create_key(&key_path).unwrap_or_else(|e| die(e))
        });
        let ring = maru::auth::Keyring::single(key.clone());
        Some((key, ring))
    };
    let mut tenants = maru::meta::Tenants::default();
    let tenants_file = match (&a.tenants, &keys) {
        (Some(path), Some((key, ring))) => {
            let (file, t) =
                TenantsFile::open(path, key.clone(), ring.clone()).unwrap_or_else(|e| die(e));
            log::info!(
                "tenants of {}: {:?}",
                path.display(),
                t.names().collect::<Vec<_>>()
            );
            tenants = t;
            Some(file)
        }
        _ => None,
    };
    let (core, durable) = match opened {
        None => (
            MetaCore::new(cfg)
                .unwrap_or_else(|e| die(e))
                .with_tenants(tenants),
            None,
        ),
        Some((store, loaded)) => {
            let (core, recovery) = recover(cfg, tenants, &clock, &mut rm, &agents, loaded.image);
            give_back_freed_memory();
            let recovery = Recovery {
                took_ms: loaded.read.as_millis() as u64 + recovery.took_ms,
                unverified: recovery.unverified + loaded.dropped,
                ..recovery
            };
            let binding = SessionBinding::restored(loaded.run, loaded.secrets);
            let settle = loaded.lease_timeout_settles;
            (core, Some((store, binding, recovery, settle)))
        }
    };
    raise_nofile_limit();
    let keyring = keys.map(|(_, ring)| ring);
    let opts = maru::net::ServerOptions {
        poll_spin: std::time::Duration::from_micros(a.poll_spin_us),
        ..a.net.options_with_keys(keyring)
    };
    let mut server = Server::bind(addr, opts, clock)
        .unwrap_or_else(|e| die_unavailable(format!("cannot listen on {addr}: {e}")));
    let bound = server.local_addr().unwrap_or(addr);
    let mut gauges = SERVER_GAUGES.to_vec();
    gauges.push((
        "max_sessions",
        "Most live sessions, all tenants together (--max-sessions)",
    ));
    let metrics = Arc::new(Metrics::new("server", &gauges).with_totals(SERVER_TOTALS));
    metrics.set(
        "max_sessions",
        i64::try_from(a.max_sessions).unwrap_or(i64::MAX),
    );
    serve_metrics(metrics_addr, &metrics, &server);
    log::info!(
        "maru-server listening on {bound}, RM {}, agents {:?}",
        a.rm_address,
        a.agents
    );
    if let Some(p) = &a.ready_file {
        write_ready_file(p, bound)
            .unwrap_or_else(|e| die(format!("cannot write {}: {e}", p.display())));
    }
    notify_ready();
    let mut service = MetaService::new(core, rm, agents, server.replier());
    if let Some((store, binding, recovery, settle)) = durable {
        log::info!(
            "recovered {} keys in {} regions and {} sessions in {} ms ({} keys dropped; {} \
             records failed their check or did not decode: never served)",
            recovery.keys,
            recovery.regions,
            recovery.sessions,
            recovery.took_ms,
            recovery.dropped_keys,
            recovery.unverified
        );
        let waker = server.replier();
        let writer = StoreWriter::start(store, move || waker.wake(), settle);
        service = service.with_store(writer, binding, recovery);
    }
    watch_signals(pipe, service.stop_flag(), server.replier());
    if metrics_addr.is_some() {
        service = service.with_metrics(metrics);
    }
    if let Some(f) = tenants_file {
        service = service.with_tenants_file(f);
    }
    if let Err(e) = server.run(&mut service) {
        exit_with(EX_FAILURE, format!("event loop failed: {e}"));
    }
    log::info!("maru-server stopped");
}

/// Returns the allocator's free memory to the system. The records read back at
/// recovery are freed by now, in holes between the key names made meanwhile, which
/// glibc keeps (as RSS) otherwise.
fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}
