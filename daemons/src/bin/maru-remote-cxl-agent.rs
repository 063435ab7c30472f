//! maru-remote-cxl-agent: runs on every memory node. Maps regions of this node's CXL
//! (DAX) devices for workers that reach them with one-sided RDMA, registers them with
//! the NIC (or the soft NIC), and releases them before their ranges are reused.

use clap::{Parser, ValueEnum};
use maru::agent::{AgentCore, DEFAULT_QUARANTINE_MS};
use maru::net::{Clock, Server, SignalPipe};
use maru::transport::soft::SoftTarget;
use maru::transport::Target;
use maru_daemons::agent_service::{bringup_lane, AgentService, DaxMem, Nic, RmLink, AGENT_GAUGES};
use maru_daemons::common::{
    bind_addr, check_advertise, check_host_port, die, die_unavailable, exit_with, notify_ready,
    parse_args, raise_nofile_limit, serve_metrics, write_ready_file, NetArgs, OpsArgs, RdmaArgs,
    EX_FAILURE,
};
use maru_daemons::metrics::Metrics;
use maru_daemons::off_loop::OffLoop;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum TransportKind {
    /// Software NIC over TCP (any host).
    Soft,
    /// RDMA verbs, RC queue pairs (needs an RDMA NIC and a build with --features verbs).
    Verbs,
}

#[derive(Parser, Debug)]
#[command(
    name = "maru-remote-cxl-agent",
    version,
    about = "Maru remote CXL agent: maps and registers this memory node's CXL regions for remote workers",
    long_about = "Every connection must prove the agent key (--key-file) before it may map, unmap or release. \
A map is checked and held at the resource manager before anything is registered; a release deregisters the \
region whoever holds it, then unholds it at the RM at once and keeps its address range mapped without access for \
the quarantine (so no new registration reuses those addresses). \
Refuses to start without a boot id or with an empty RM address."
)]
struct Args {
    /// Address of the control port. The soft NIC listens on the same address.
    #[arg(long, default_value = "127.0.0.1", env = "MARU_REMOTE_CXL_AGENT_HOST")]
    host: String,
    /// Control port (0 picks a free one; see --ready-file).
    #[arg(
        short,
        long,
        default_value_t = 9860,
        env = "MARU_REMOTE_CXL_AGENT_PORT"
    )]
    port: u16,
    /// Port of the soft NIC's data connections (0 picks a free one).
    #[arg(long, default_value_t = 0, env = "MARU_REMOTE_CXL_AGENT_DATA_PORT")]
    data_port: u16,
    /// Host workers use to reach the soft NIC (default: --host).
    #[arg(long, default_value = "", env = "MARU_REMOTE_CXL_AGENT_ADVERTISE")]
    advertise: String,
    /// The resource manager of this pool.
    #[arg(long, default_value = "127.0.0.1:9850", env = "MARU_RM_ADDRESS")]
    rm_address: String,
    /// Key file every connection proves (hex key, mode 0600; made by --create-key, or
    /// `maru-rm-ctl gen-key PATH` writes one).
    #[arg(
        long,
        default_value = "/etc/maru/remote-cxl-agent.key",
        env = "MARU_REMOTE_CXL_AGENT_KEY_FILE"
    )]
    key_file: PathBuf,
    /// Make --key-file (a new random key, mode 0600, its directory 0700) when it does not
    /// exist, as the RM makes its own: for the agent beside the pool's RM, whose unit
    /// passes it. The pool's other agents, maru-server and the workers are given a copy;
    /// without this flag a missing key file refuses the start.
    #[arg(long)]
    create_key: bool,
    /// Key file of the resource manager (its STATE_DIR/rm.key, copied here mode 0600).
    /// Without it the agent can reach only an RM started with --insecure-no-key.
    #[arg(long, env = "MARU_RM_KEY_FILE")]
    rm_key_file: Option<PathBuf>,
    #[command(flatten)]
    net: NetArgs,
    /// Name of this memory node in the RM's holds (default: the host name).
    #[arg(long, env = "MARU_NODE")]
    node: Option<String>,
    /// A DAX device or fake-DAX file of this node (repeatable); regions are found by the
    /// device UUID, so the names may differ from the RM's.
    #[arg(long = "device", value_name = "PATH")]
    devices: Vec<String>,
    /// One-sided transport.
    #[arg(long, value_enum, default_value_t = TransportKind::Soft, env = "MARU_TRANSPORT")]
    transport: TransportKind,
    #[command(flatten)]
    rdma: RdmaArgs,
    /// Seconds a released range stays mapped without access before it is unmapped.
    #[arg(long, default_value_t = DEFAULT_QUARANTINE_MS / 1000)]
    quarantine_s: u64,
    /// Where the node's boot id is read.
    #[arg(
        long,
        default_value = "/proc/sys/kernel/random/boot_id",
        env = "MARU_BOOT_ID_FILE"
    )]
    boot_id_file: PathBuf,
    /// Write the control address to this file once ready.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    #[command(flatten)]
    ops: OpsArgs,
}

fn target(args: &Args, key: &maru::auth::SharedKey) -> Nic {
    let target: Arc<dyn Target> = match args.transport {
        TransportKind::Soft => {
            let bind =
                bind_addr(&args.host, args.data_port, "the soft NIC").unwrap_or_else(|e| die(e));
            let advertise = if args.advertise.is_empty() {
                args.host.as_str()
            } else {
                args.advertise.as_str()
            };
            let t = SoftTarget::start(bind, advertise, Some(key.clone()), Duration::from_secs(10))
                .unwrap_or_else(|e| {
                    die_unavailable(format!("soft NIC cannot listen on {bind}: {e}"))
                });
            log::info!("soft NIC listening on {}", t.local_addr());
            Arc::new(t)
        }
        TransportKind::Verbs => return verbs_target(args),
    };
    Nic {
        target,
        #[cfg(feature = "verbs")]
        verbs: None,
    }
}

#[cfg(feature = "verbs")]
fn verbs_target(args: &Args) -> Nic {
    let settings = args.rdma.settings();
    match maru::transport::verbs::VerbsTarget::open_with(&settings) {
        Ok(t) => {
            let t = Arc::new(t);
            Nic {
                target: t.clone(),
                verbs: Some(t),
            }
        }
        Err(e) => die(e),
    }
}

#[cfg(not(feature = "verbs"))]
fn verbs_target(args: &Args) -> Nic {
    die(format!(
        "--transport verbs{}: this build has no verbs support; rebuild with `cargo build --features verbs` or use --transport soft",
        args.rdma.rdma_device.as_deref().map(|d| format!(" (device {d})")).unwrap_or_default()
    ))
}

fn main() {
    let args: Args = parse_args();
    let metrics_addr = args.ops.start();
    if args.rm_address.trim().is_empty() {
        die("the resource manager address is empty: set --rm-address or MARU_RM_ADDRESS");
    }
    check_host_port("rm-address", &args.rm_address).unwrap_or_else(|e| die(e));
    if matches!(args.transport, TransportKind::Soft) {
        check_advertise(&args.host, &args.advertise).unwrap_or_else(|e| die(e));
    }
    let addr = bind_addr(&args.host, args.port, "maru-remote-cxl-agent").unwrap_or_else(|e| die(e));
    if matches!(args.transport, TransportKind::Soft) {
        bind_addr(&args.host, args.data_port, "the soft NIC").unwrap_or_else(|e| die(e));
    }
    let boot_id = std::fs::read_to_string(&args.boot_id_file)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| {
            die(format!(
                "cannot read the boot id from {}: {e}; the agent refuses to start without one",
                args.boot_id_file.display()
            ))
        });
    // A key file that exists is checked now (as is one whose path cannot be looked at,
    // so that its error is the one reported); a missing one is made (--create-key) only
    // once the other flags and the devices have been checked.
    let existing_key = (!matches!(args.key_file.try_exists(), Ok(false)))
        .then(|| maru::auth::load_key_file(&args.key_file).unwrap_or_else(|e| die(e)));
    if existing_key.is_none() && !args.create_key {
        die(format!(
            "the agent key file {} does not exist: copy the pool's agent key there (mode \
             0600, owned by the user that runs the agent), or pass --create-key on the memory \
             node of the pool's resource manager to make it",
            args.key_file.display()
        ));
    }
    let rm_key = args
        .rm_key_file
        .as_ref()
        .map(|p| maru::auth::load_key_file(p).unwrap_or_else(|e| die(e)));
    let node = args.node.clone().unwrap_or_else(maru::net::hostname);
    // The epoch grows with every start: holds of earlier runs are reset at the RM.
    let epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(1);
    let core = AgentCore::new(
        node.clone(),
        epoch,
        boot_id.clone(),
        args.quarantine_s * 1000,
    )
    .unwrap_or_else(|e| die(e));
    let mem = DaxMem::new(&args.devices).unwrap_or_else(|e| die(e));
    let key = existing_key.unwrap_or_else(|| {
        maru::auth::load_or_create_key(&args.key_file).unwrap_or_else(|e| die(e))
    });
    let nic = target(&args, &key);
    let rm = RmLink::new(args.rm_address.clone(), format!("agent@{node}"), rm_key);
    raise_nofile_limit();
    let opts = args.net.options(Some(key));
    let pipe = SignalPipe::install()
        .unwrap_or_else(|e| die(format!("cannot install signal handlers: {e}")));
    let clock = Clock::new();
    let mut server = Server::bind(addr, opts, clock)
        .and_then(|s| s.with_signals(pipe))
        .unwrap_or_else(|e| die_unavailable(format!("cannot listen on {addr}: {e}")));
    let bound = server.local_addr().unwrap_or(addr);
    let lane = bringup_lane(&nic);
    let mut service = AgentService::new(core, rm, mem, nic);
    let metrics = Arc::new(Metrics::new("agent", AGENT_GAUGES));
    serve_metrics(metrics_addr, &metrics, &server);
    if metrics_addr.is_some() {
        service = service.with_metrics(metrics);
    }
    // The core and its verbs work (registration, deregistration) run off the event
    // loop on a thread of their own; queue-pair bring-ups on a small pool.
    let mut service = OffLoop::new(service, server.replier(), Some(lane)).unwrap_or_else(|e| {
        exit_with(
            EX_FAILURE,
            format!("cannot start the agent's worker threads: {e}"),
        )
    });
    log::info!(
        "maru-remote-cxl-agent {node} (epoch {epoch}, boot {boot_id}) listening on {bound}, RM {}",
        args.rm_address
    );
    if let Some(p) = &args.ready_file {
        write_ready_file(p, bound)
            .unwrap_or_else(|e| die(format!("cannot write {}: {e}", p.display())));
    }
    notify_ready();
    if let Err(e) = server.run(&mut service) {
        exit_with(EX_FAILURE, format!("event loop failed: {e}"));
    }
    log::info!("maru-remote-cxl-agent stopped");
}
