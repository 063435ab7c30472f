//! maru-resource-manager: owns the CXL (DAX) pools of a memory node and hands out
//! regions, capability handles and holds. See docs/rm-protocol.md.

use clap::Parser;
use maru::auth::load_or_create_key;
use maru::dax::{self, PoolSpec};
use maru::net::{Clock, Server, SignalPipe};
use maru::rm::{check_pool_file, load_or_create_secret, DirStore, ResourceManager, RM_KEY_FILE};
use maru_daemons::common::{
    bind_addr, die, die_unavailable, exit_with, notify_ready, parse_args, raise_nofile_limit,
    serve_metrics, write_ready_file, NetArgs, OpsArgs, EX_FAILURE,
};
use maru_daemons::metrics::Metrics;
use maru_daemons::rm_service::{RmService, RM_GAUGES};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "maru-resource-manager",
    version,
    about = "Maru resource manager: CXL/DAX pools, regions, handles and holds",
    long_about = "Owns the DAX pools of this memory node. Allocates regions to owners (maru-server), \
checks handles for agents and workers (GET_ACCESS), records the agents' holds, and keeps its state \
(regions, holds) durable in --state-dir so a restart loses nothing. At least one --dax or --fake-dax pool is required."
)]
struct Args {
    /// Address to listen on. The protocol is plaintext: keep it on loopback or a trusted network.
    #[arg(long, default_value = "127.0.0.1", env = "MARU_RM_HOST")]
    host: String,
    /// TCP port (0 picks a free one; see --ready-file).
    #[arg(short, long, default_value_t = 9850, env = "MARU_RM_PORT")]
    port: u16,
    /// Directory for the durable state (state.json) and the token secret (secret, mode 0600).
    #[arg(
        short = 'd',
        long,
        default_value = "/var/lib/maru-rm",
        env = "MARU_RM_STATE_DIR"
    )]
    state_dir: PathBuf,
    /// A devdax device to serve as a pool (repeatable), e.g. /dev/dax0.0.
    #[arg(long = "dax", value_name = "DEVICE")]
    dax: Vec<String>,
    /// A file-backed pool for hosts without CXL (repeatable): PATH:SIZE, e.g. /dev/shm/maru-pool0:4G.
    /// Created if absent; SIZE must be a multiple of 2 MiB.
    #[arg(long = "fake-dax", value_name = "PATH:SIZE")]
    fake_dax: Vec<String>,
    /// Seconds an owner may stay disconnected before its regions are freed
    /// (`--grace-period`, upstream's spelling, is the same flag).
    #[arg(
        short = 'g',
        long,
        visible_alias = "grace-period",
        default_value_t = 30
    )]
    grace_period_s: u64,
    /// Key every client proves before any request (hex key file, mode 0600). Default
    /// STATE_DIR/rm.key. Created (0600) if missing, so the first start makes the key
    /// that maru-server, the agents and maru-rm-ctl are then given (--rm-key-file).
    #[arg(long, env = "MARU_RM_KEY_FILE", conflicts_with = "insecure_no_key")]
    key_file: Option<PathBuf>,
    /// Serve without a key: then any process that reaches the port may free, hold and
    /// unhold regions and drop holds. For throwaway tests only; logged as a warning.
    #[arg(long)]
    insecure_no_key: bool,
    #[command(flatten)]
    net: NetArgs,
    /// Write the listening address to this file once ready.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    #[command(flatten)]
    ops: OpsArgs,
}

fn main() {
    let args: Args = parse_args();
    // Every flag is checked before anything is created (pool file, state, key, socket).
    let metrics_addr = args.ops.start();
    let addr = bind_addr(&args.host, args.port, "maru-resource-manager").unwrap_or_else(|e| die(e));
    let mut specs = Vec::new();
    for d in &args.dax {
        specs.push(PoolSpec::DevDax { path: d.clone() });
    }
    for f in &args.fake_dax {
        let spec = dax::parse_fake_dax(f).unwrap_or_else(|e| die(format!("--fake-dax {f}: {e}")));
        if let PoolSpec::FakeDax { path, .. } = &spec {
            check_pool_file(std::path::Path::new(path)).unwrap_or_else(|e| die(e));
        }
        specs.push(spec);
    }
    if specs.is_empty() {
        die("no pools: give at least one --dax /dev/daxX.Y or --fake-dax PATH:SIZE (e.g. /dev/shm/maru-pool0:4G)");
    }
    // A key file that exists is checked now (mode, content); a missing one is made
    // once everything else is in place.
    let key_path = args
        .key_file
        .clone()
        .unwrap_or_else(|| args.state_dir.join(RM_KEY_FILE));
    let existing_key = (!args.insecure_no_key && key_path.exists())
        .then(|| maru::auth::load_key_file(&key_path).unwrap_or_else(|e| die(e)));
    let mut pools = Vec::new();
    for s in &specs {
        let info = dax::open_pool(s).unwrap_or_else(|e| die(e));
        log::info!(
            "pool {}: {} ({}), {} MiB usable, align {} KiB, uuid {}",
            pools.len(),
            info.path,
            info.kind.as_str(),
            info.usable() >> 20,
            info.align >> 10,
            info.uuid
        );
        pools.push(info);
    }
    let store =
        DirStore::open(&args.state_dir).unwrap_or_else(|e| die(format!("state directory: {e}")));
    let secret = load_or_create_secret(&args.state_dir).unwrap_or_else(|e| die(e));
    let clock = Clock::new();
    let mut core = ResourceManager::open(pools, Box::new(store), secret, clock.now_ms())
        .unwrap_or_else(|e| die(e));
    core.set_grace_ms(args.grace_period_s * 1000);
    let key = if args.insecure_no_key {
        log::warn!(
            "running WITHOUT a key (--insecure-no-key): any process that reaches this port may \
             free, hold and unhold regions and drop holds"
        );
        None
    } else {
        Some(
            existing_key
                .unwrap_or_else(|| load_or_create_key(&key_path).unwrap_or_else(|e| die(e))),
        )
    };
    raise_nofile_limit();
    let opts = args.net.options(key);
    let pipe = SignalPipe::install()
        .unwrap_or_else(|e| die(format!("cannot install signal handlers: {e}")));
    let mut server = Server::bind(addr, opts, clock)
        .and_then(|s| s.with_signals(pipe))
        .unwrap_or_else(|e| die_unavailable(format!("cannot listen on {addr}: {e}")));
    let bound = server.local_addr().unwrap_or(addr);
    let metrics = Arc::new(Metrics::new("rm", RM_GAUGES));
    serve_metrics(metrics_addr, &metrics, &server);
    log::info!(
        "maru-resource-manager listening on {bound}, state in {}",
        args.state_dir.display()
    );
    if let Some(p) = &args.ready_file {
        write_ready_file(p, bound)
            .unwrap_or_else(|e| die(format!("cannot write {}: {e}", p.display())));
    }
    notify_ready();
    let mut service = RmService::new(core);
    if metrics_addr.is_some() {
        service = service.with_metrics(metrics);
    }
    service.idle_timeout_ms = args.net.idle_timeout_s.saturating_mul(1000);
    if let Err(e) = server.run(&mut service) {
        exit_with(EX_FAILURE, format!("event loop failed: {e}"));
    }
    log::info!("maru-resource-manager stopped");
}
