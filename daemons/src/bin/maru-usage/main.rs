//! maru-usage: what a Maru pool holds and who uses it, as one readable table. It asks
//! maru-server for its statistics and usage (per session; shown per tenant and engine,
//! `--tenant` keeps some tenants only) and, with `--rm`, the resource manager for its
//! pools and regions. `--watch` refreshes it.
//!
//! With an agent key (`--agent-key-file`) it also asks each of the pool's agents (those
//! maru-server names, or `--agent`) for its status: mappings, holders, registrations,
//! quarantine, queued unholds, boot id. Every daemon's version and uptime come from its
//! welcome.
//!
//! This file reads the daemons and drives the terminal; what it read is
//! `snapshot.rs`, the table `table.rs`, the `--metrics` text `metrics.rs`.
//!
//! Exit status: 0 shown; 1 the RM or an agent part could not be read (the server part
//! was shown); 2 bad usage; 69 maru-server could not be reached. A closed output pipe
//! (`maru-usage --watch | head -1`) ends it quietly.

mod metrics;
mod snapshot;
mod table;

use clap::Parser;
use maru::net::{default_client_id, Client, ClientError, ClientOptions};
use maru::wire::agent::{self, AgentReply, AgentRequest};
use maru::wire::meta::{self, MetaReply, MetaRequest};
use maru::wire::rm::{self, RmReply, RmRequest};
use metrics::*;
use snapshot::*;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::exit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use table::*;

#[derive(Parser, Debug)]
#[command(
    name = "maru-usage",
    version,
    about = "Pools, regions, keys and hit rate of a Maru pool, per tenant and engine",
    long_about = "Asks maru-server for its statistics and usage and shows them per tenant and \
engine (the sessions of one engine_id of one tenant summed; TENANT is the tenant whose key \
opened them, `default` for maru-server's own key); --tenant keeps only the sessions of the \
tenants it names, in the table and in --json. SKIPPED: the chunks each engine's stores \
skipped (stored=false, status OK) per reason (no_region, no_slot, pool_unavailable, \
max_bytes), as its workers' last heartbeats said. With --rm also the resource manager's pools \
and regions. --watch refreshes every SECS seconds until q, Ctrl-C or --count refreshes."
)]
struct Args {
    /// maru-server address.
    #[arg(long, default_value = "127.0.0.1:5555", env = "MARU_SERVER_ADDRESS")]
    server: String,
    /// The pool's resource manager (host:port); adds its pools and regions.
    #[arg(long, value_name = "HOST:PORT")]
    rm: Option<String>,
    /// Key file of the resource manager, when it requires one.
    #[arg(long, env = "MARU_RM_KEY_FILE")]
    rm_key_file: Option<PathBuf>,
    /// Key file of maru-server (default ~/.maru/server.key when it exists). Its own key
    /// shows every session; a tenant's key, that tenant's sessions only.
    #[arg(long, env = "MARU_SERVER_KEY_FILE")]
    server_key_file: Option<PathBuf>,
    /// Show only the sessions of this tenant (repeatable), in the table and in --json;
    /// maru-server's totals stay those of every session the key may see.
    #[arg(long = "tenant", value_name = "NAME")]
    tenants: Vec<String>,
    /// Agent key file: adds the status of each agent of the pool (those maru-server
    /// names, or --agent).
    #[arg(long)]
    agent_key_file: Option<PathBuf>,
    /// An agent to show (host:port, repeatable; default: maru-server's agents).
    #[arg(long = "agent", value_name = "HOST:PORT")]
    agents: Vec<String>,
    /// Regions listed at most (the RM's, with --rm); the rest are counted.
    #[arg(long, default_value_t = 20)]
    max_regions: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
    /// Refresh every SECS seconds (default 2) until q, Ctrl-C or --count refreshes.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    watch: Option<f64>,
    /// With --watch: stop after this many refreshes.
    #[arg(long, default_value_t = 1800)]
    count: u64,
    /// Timeout of one request (milliseconds).
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Instead of printing, serve what it reads as Prometheus metrics at /metrics on
    /// ADDR (PORT alone: 127.0.0.1:PORT), read again every --metrics-every seconds:
    /// per tenant sessions, regions, bytes, keys, hits, misses and skipped chunks by
    /// reason; with --agent-key-file whether each agent answers (maru_usage_agent_up).
    /// Runs until killed.
    #[arg(long, value_name = "ADDR", env = "MARU_USAGE_METRICS")]
    metrics: Option<String>,
    /// With --metrics: seconds between two reads of maru-server (and the agents).
    #[arg(long, default_value_t = 5.0)]
    metrics_every: f64,
}

/// Where a call on a kept connection failed.
enum Failed {
    /// No connection could be opened.
    Connect(ClientError),
    /// The call on the connection.
    Call(ClientError),
}

/// `req` on the connection kept in `conn`, opened to `addr` with `opts` first when
/// there is none; one that broke (I/O error or timeout) is dropped, to be opened
/// again at the next call.
fn call_kept<Req: serde::Serialize, Rep: serde::de::DeserializeOwned>(
    conn: &mut Option<Client>,
    addr: &str,
    opts: &ClientOptions,
    req: &Req,
) -> Result<Rep, Failed> {
    let c = match conn {
        Some(c) => c,
        None => conn.insert(Client::connect(addr, opts).map_err(Failed::Connect)?),
    };
    let r = c.call(req);
    if let Err(ClientError::Io { .. } | ClientError::Timeout { .. }) = &r {
        *conn = None;
    }
    r.map_err(Failed::Call)
}

/// Connections kept across refreshes; a broken one is opened again on the next.
struct Source {
    server: String,
    /// --tenant.
    tenants: Vec<String>,
    server_conn: Option<Client>,
    rm: Option<String>,
    rm_conn: Option<Client>,
    rm_key: Option<maru::auth::SharedKey>,
    server_key: Option<maru::auth::SharedKey>,
    agent_key: Option<maru::auth::SharedKey>,
    /// Agents given with --agent (else maru-server's, when there is an agent key).
    agents: Vec<String>,
    agent_conns: BTreeMap<String, Client>,
    timeout: Duration,
}

impl Source {
    fn options(&self, service: &'static str, key: Option<maru::auth::SharedKey>) -> ClientOptions {
        let mut o = ClientOptions::new(service, default_client_id("maru-usage@"));
        o.key = key;
        o.connect_timeout = self.timeout;
        o.call_timeout = self.timeout;
        o
    }

    fn server_call(&mut self, req: &MetaRequest) -> Result<MetaReply, String> {
        let opts = self.options(meta::SERVICE, self.server_key.clone());
        call_kept(&mut self.server_conn, &self.server, &opts, req).map_err(|f| match f {
            Failed::Connect(e) => format!("cannot reach maru-server at {}: {e}", self.server),
            Failed::Call(e) => format!("maru-server at {}: {e}", self.server),
        })
    }

    fn rm_call(&mut self, addr: &str, req: &RmRequest) -> Result<RmReply, String> {
        let opts = self.options(rm::SERVICE, self.rm_key.clone());
        call_kept(&mut self.rm_conn, addr, &opts, req).map_err(|f| match f {
            Failed::Connect(e) => format!("cannot reach the resource manager: {e}"),
            Failed::Call(e) => e.to_string(),
        })
    }

    fn agent_view(&mut self, addr: &str) -> AgentView {
        let mut v = AgentView {
            address: addr.to_string(),
            info: DaemonInfo::default(),
            status: None,
            error: None,
        };
        if !self.agent_conns.contains_key(addr) {
            let opts = self.options(agent::SERVICE, self.agent_key.clone());
            match Client::connect(addr, &opts) {
                Ok(c) => {
                    self.agent_conns.insert(addr.to_string(), c);
                }
                Err(e) => {
                    v.error = Some(format!("cannot reach the agent: {e}"));
                    return v;
                }
            }
        }
        let Some(c) = self.agent_conns.get_mut(addr) else {
            return v;
        };
        v.info = DaemonInfo::of(c);
        match c.call::<_, AgentReply>(&AgentRequest::Status) {
            Ok(AgentReply::Status(st)) => v.status = Some(st),
            Ok(other) => v.error = Some(format!("unexpected reply {other:?}")),
            Err(e) => {
                if matches!(e, ClientError::Io { .. } | ClientError::Timeout { .. }) {
                    self.agent_conns.remove(addr);
                }
                v.error = Some(e.to_string());
            }
        }
        v
    }

    /// The agents to show: --agent, or maru-server's when an agent key was given.
    fn agent_list(&mut self) -> Vec<String> {
        if !self.agents.is_empty() || self.agent_key.is_none() {
            return self.agents.clone();
        }
        match self.server_call(&MetaRequest::Handshake {}) {
            Ok(MetaReply::Handshake(h)) => h.agents,
            _ => Vec::new(),
        }
    }

    fn rm_view(&mut self, addr: &str) -> RmView {
        let mut v = RmView {
            address: addr.to_string(),
            info: DaemonInfo::default(),
            pools: Vec::new(),
            regions: Vec::new(),
            error: None,
        };
        match self.rm_call(addr, &RmRequest::Pools) {
            Ok(RmReply::Pools { pools }) => {
                v.pools = pools;
                v.info = self
                    .rm_conn
                    .as_ref()
                    .map(DaemonInfo::of)
                    .unwrap_or_default();
            }
            Ok(other) => v.error = Some(format!("unexpected reply {other:?}")),
            Err(e) => v.error = Some(e),
        }
        if v.error.is_none() {
            match self.rm_call(addr, &RmRequest::Regions { owner: None }) {
                Ok(RmReply::Regions { regions }) => v.regions = regions,
                Ok(other) => v.error = Some(format!("unexpected reply {other:?}")),
                Err(e) => v.error = Some(e),
            }
        }
        v
    }

    fn snapshot(&mut self) -> Result<Snapshot, String> {
        let stats = match self.server_call(&MetaRequest::Stats { session: None })? {
            MetaReply::Stats(s) => s,
            other => return Err(format!("unexpected reply to stats: {other:?}")),
        };
        let usage = match self.server_call(&MetaRequest::Usage)? {
            MetaReply::Usage(u) => u,
            other => return Err(format!("unexpected reply to usage: {other:?}")),
        };
        let server_info = self
            .server_conn
            .as_ref()
            .map(DaemonInfo::of)
            .unwrap_or_default();
        let rm = self.rm.clone().map(|a| self.rm_view(&a));
        let agents = self
            .agent_list()
            .iter()
            .map(|a| self.agent_view(a))
            .collect();
        let (mut stats, mut usage) = (stats, usage);
        keep_tenants(&mut stats, &mut usage, &self.tenants);
        Ok(Snapshot {
            server: self.server.clone(),
            server_info,
            tenants: self.tenants.clone(),
            stats,
            usage,
            rm,
            agents,
        })
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM end the watch loop (without SA_RESTART, so a wait returns at once).
fn install_stop_signals() {
    // SAFETY: the handler only stores to an atomic; sigaction is given a zeroed,
    // then filled, struct that lives across the call.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
    }
}

fn is_tty(fd: libc::c_int) -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(fd) == 1 }
}

/// A terminal on stdin in non-canonical mode without echo (keys arrive one by one),
/// restored on drop.
struct RawStdin {
    saved: Option<libc::termios>,
}

impl RawStdin {
    fn new() -> RawStdin {
        if !is_tty(0) {
            return RawStdin { saved: None };
        }
        // SAFETY: termios is plain data filled by tcgetattr; tcsetattr reads it.
        unsafe {
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut t) != 0 {
                return RawStdin { saved: None };
            }
            let saved = t;
            t.c_lflag &= !(libc::ICANON | libc::ECHO);
            t.c_cc[libc::VMIN] = 1;
            t.c_cc[libc::VTIME] = 0;
            if libc::tcsetattr(0, libc::TCSANOW, &t) != 0 {
                return RawStdin { saved: None };
            }
            RawStdin { saved: Some(saved) }
        }
    }

    /// Waits up to `d`; true when q was typed or a stop signal came.
    fn wait_quit(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        // Bounded: one poll per 100 ms at most until the deadline.
        while !STOP.load(Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let step = left.min(Duration::from_millis(100));
            if self.saved.is_none() {
                std::thread::sleep(step);
                continue;
            }
            let mut pfd = libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, step.as_millis() as libc::c_int) };
            if n > 0 {
                let mut buf = [0u8; 64];
                // SAFETY: reads at most buf.len() bytes into buf.
                let got = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
                if got <= 0 {
                    // The terminal went away: keep waiting on the clock only.
                    std::thread::sleep(step);
                } else if buf[..got as usize].iter().any(|&b| b == b'q' || b == b'Q') {
                    return true;
                }
            }
        }
        true
    }
}

impl Drop for RawStdin {
    fn drop(&mut self) {
        if let Some(t) = &self.saved {
            // SAFETY: restores the settings read in new().
            unsafe {
                libc::tcsetattr(0, libc::TCSANOW, t);
            }
        }
    }
}

fn utc_clock() -> String {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
        % 86_400;
    format!("{:02}:{:02}:{:02} UTC", s / 3600, s / 60 % 60, s % 60)
}

/// Writes `text` to stdout; a reader that went away (`| head -1`) ends the program
/// quietly instead of a panic on the broken pipe.
fn out(text: &str) {
    let mut o = std::io::stdout().lock();
    if o.write_all(text.as_bytes())
        .and_then(|_| o.flush())
        .is_err()
    {
        exit(0);
    }
}

fn show(snap: &Snapshot, args: &Args) {
    if args.json {
        out(&format!(
            "{}\n",
            serde_json::to_string(snap).unwrap_or_default()
        ));
    } else {
        out(&render(snap, args.max_regions));
    }
}

fn rm_failed(snap: &Snapshot) -> bool {
    snap.rm.as_ref().is_some_and(|r| r.error.is_some())
        || snap.agents.iter().any(|a| a.error.is_some())
}

fn watch(src: &mut Source, args: &Args, secs: f64) {
    install_stop_signals();
    let every = Duration::from_secs_f64(secs.max(0.1));
    let clear = is_tty(1) && !args.json;
    let stdin = RawStdin::new();
    for i in 1..=args.count.max(1) {
        let mut head = String::new();
        if clear {
            head.push_str("\x1b[H\x1b[2J");
        }
        if !args.json {
            let _ = writeln!(
                head,
                "maru-usage: {}, every {secs} s ({i}/{}); q or Ctrl-C quits",
                utc_clock(),
                args.count
            );
        }
        out(&head);
        match src.snapshot() {
            Ok(s) => show(&s, args),
            Err(e) => out(&format!("{e} (retrying)\n")),
        }
        if i == args.count || stdin.wait_quit(every) {
            break;
        }
    }
}

/// `--metrics`: reads maru-server (and the agents) every `every` and serves the last
/// read at `addr` until killed.
fn export(src: &mut Source, addr: &str, every: f64) -> ! {
    let addr = maru_daemons::metrics_http::parse_metrics_addr(addr).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        exit(2)
    });
    if !(every.is_finite() && every > 0.0) {
        eprintln!("error: --metrics-every {every}: give a number of seconds > 0");
        exit(2);
    }
    let latest: std::sync::Arc<std::sync::Mutex<Option<Snapshot>>> = Default::default();
    let shown = latest.clone();
    let local = maru_daemons::metrics_http::serve_render(addr, move || {
        let s = shown.lock().unwrap_or_else(|e| e.into_inner());
        metrics_text(s.as_ref())
    })
    .unwrap_or_else(|e| {
        eprintln!("error: --metrics {addr}: cannot listen: {e}");
        exit(maru_daemons::common::EX_UNAVAILABLE)
    });
    eprintln!(
        "maru-usage: metrics of maru-server {} at http://{local}/metrics",
        src.server
    );
    let mut failing = false;
    loop {
        let snap = src.snapshot();
        match &snap {
            Err(e) if !failing => eprintln!("maru-usage: {e} (maru_usage_up 0 until it answers)"),
            Ok(_) if failing => eprintln!("maru-usage: maru-server answers again"),
            _ => {}
        }
        failing = snap.is_err();
        *latest.lock().unwrap_or_else(|e| e.into_inner()) = snap.ok();
        std::thread::sleep(Duration::from_secs_f64(every));
    }
}

fn main() {
    let args = Args::parse();
    if let Some(s) = args.watch {
        if !(s.is_finite() && s > 0.0) {
            eprintln!("error: --watch {s}: give a number of seconds > 0");
            exit(2);
        }
    }
    let load = |p: &PathBuf| {
        maru::auth::load_key_file(p).unwrap_or_else(|e| {
            eprintln!("error: {e}");
            exit(2)
        })
    };
    let rm_key = args.rm_key_file.as_ref().map(load);
    let default_server_key = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".maru/server.key"))
        .filter(|p| p.exists());
    let server_key = args
        .server_key_file
        .as_ref()
        .or(default_server_key.as_ref())
        .map(load);
    let agent_key = args.agent_key_file.as_ref().map(load);
    let mut src = Source {
        server: args.server.clone(),
        tenants: args.tenants.clone(),
        server_conn: None,
        rm: args.rm.clone(),
        rm_conn: None,
        rm_key,
        server_key,
        agent_key,
        agents: args.agents.clone(),
        agent_conns: BTreeMap::new(),
        timeout: Duration::from_millis(args.timeout_ms.max(1)),
    };
    if let Some(addr) = &args.metrics {
        export(&mut src, addr, args.metrics_every);
    }
    if let Some(secs) = args.watch {
        return watch(&mut src, &args, secs);
    }
    match src.snapshot() {
        Ok(s) => {
            show(&s, &args);
            if rm_failed(&s) {
                exit(1);
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            // The server (or its key) is what it could not reach: a dependency.
            exit(maru_daemons::common::EX_UNAVAILABLE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru::wire::meta::{
        Backend, SessionStats, SessionUsage, SkipCounts, StatsReply, TotalStats, UsageReply,
    };
    use maru::wire::rm::{PoolInfo, RegionInfo};

    fn stats(engine: &str, session: u64, hits: u64, misses: u64) -> SessionStats {
        SessionStats {
            session,
            engine_id: engine.into(),
            tenant: "default".into(),
            backend: Some(Backend::RemoteCxl),
            keys: 3,
            regions: 1,
            region_bytes: 64 << 20,
            key_bytes: 3 << 20,
            hits,
            misses,
            leases: 1,
            pins: 2,
            skipped: SkipCounts {
                max_bytes: session,
                ..Default::default()
            },
        }
    }

    fn usage(engine: &str, session: u64, connected: bool) -> SessionUsage {
        SessionUsage {
            session,
            engine_id: engine.into(),
            client_id: format!("{engine}@host"),
            tenant: "default".into(),
            backend: Backend::RemoteCxl,
            namespace: "model".into(),
            regions: 1,
            allocated: 64 << 20,
            used: 4 << 20,
            connected,
        }
    }

    /// The row of `engine` of the tenant `default`.
    fn of(engine: &str) -> RowKey {
        ("default".into(), engine.into())
    }

    fn reply(s: Vec<SessionStats>, u: Vec<SessionUsage>) -> (StatsReply, UsageReply) {
        (
            StatsReply {
                total: TotalStats::default(),
                sessions: s,
            },
            UsageReply {
                sessions: u,
                kept_regions: 0,
                kept_bytes: 0,
                giving_back: 0,
                giving_back_bytes: 0,
            },
        )
    }

    #[test]
    fn metrics_are_per_tenant_and_say_when_maru_server_did_not_answer() {
        let down = metrics_text(None);
        assert!(down.contains("maru_usage_up 0"), "{down}");
        assert!(!down.contains("maru_usage_tenant_"), "{down}");
        let mut alpha = stats("e", 2, 1, 3);
        alpha.tenant = "alpha".into();
        let (s, u) = reply(
            vec![stats("a", 1, 2, 2), stats("b", 3, 4, 0), alpha],
            vec![usage("a", 1, true), usage("b", 3, true)],
        );
        let sums = tenant_sums(&s, &u);
        assert_eq!(sums["default"].sessions, 2);
        assert_eq!(sums["default"].allocated, 128 << 20);
        assert_eq!(sums["default"].used, 8 << 20);
        assert_eq!(
            sums["default"].skipped.max_bytes, 4,
            "sessions 1 and 3 summed"
        );
        assert_eq!((sums["alpha"].hits, sums["alpha"].misses), (1, 3));
        let snap = Snapshot {
            server: "s".into(),
            server_info: DaemonInfo::default(),
            tenants: vec![],
            stats: s,
            usage: u,
            rm: None,
            agents: vec![AgentView {
                address: "10.0.0.2:9860".into(),
                info: DaemonInfo::default(),
                status: None,
                error: Some("cannot reach the agent".into()),
            }],
        };
        let text = metrics_text(Some(&snap));
        for line in [
            "maru_usage_up 1",
            r#"maru_usage_tenant_region_bytes{tenant="default"} 134217728"#,
            r#"maru_usage_tenant_sessions{tenant="alpha"} 1"#,
            r#"maru_usage_tenant_skipped_chunks{tenant="default",reason="max_bytes"} 4"#,
            r#"maru_usage_agent_up{agent="10.0.0.2:9860",node=""} 0"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn sessions_of_one_engine_are_summed() {
        let (s, u) = reply(
            vec![
                stats("a", 1, 2, 2),
                stats("a", 2, 4, 0),
                stats("b", 3, 0, 5),
            ],
            vec![
                usage("a", 1, true),
                usage("a", 2, false),
                usage("b", 3, true),
            ],
        );
        let rows = engines(&s, &u);
        assert_eq!(rows.len(), 2);
        let a = &rows[&of("a")];
        assert_eq!((a.sessions, a.regions, a.keys), (2, 2, 6));
        assert_eq!(
            (a.hits, a.misses, a.leases, a.pins, a.connected),
            (6, 2, 2, 4, 1)
        );
        assert_eq!((a.allocated, a.used), (128 << 20, 8 << 20));
        assert_eq!(skips(&a.skipped), "max_bytes:3", "sessions 1 and 2 summed");
        assert_eq!(skips(&SkipCounts::default()), "0");
        assert_eq!(rate(a.hits, a.misses), "75.0%");
        assert_eq!(rows[&of("b")].hits, 0);
        assert_eq!(rate(0, 0), "-");
    }

    #[test]
    fn each_tenants_engines_are_rows_of_their_own_and_tenant_keeps_only_those_named() {
        let in_tenant = |mut st: SessionStats, mut us: SessionUsage, tenant: &str| {
            st.tenant = tenant.into();
            us.tenant = tenant.into();
            (st, us)
        };
        let (s1, u1) = in_tenant(stats("e", 1, 1, 0), usage("e", 1, true), "alpha");
        let (s2, u2) = in_tenant(stats("e", 2, 0, 1), usage("e", 2, true), "beta");
        let (s3, u3) = (stats("f", 3, 0, 0), usage("f", 3, false));
        let (mut s, mut u) = reply(vec![s1, s2, s3], vec![u1, u2, u3]);
        // One engine id in two tenants: two rows.
        let rows = engines(&s, &u);
        let alpha = ("alpha".to_string(), "e".to_string());
        let beta = ("beta".to_string(), "e".to_string());
        assert_eq!(rows.len(), 3);
        assert_eq!((rows[&alpha].hits, rows[&beta].misses), (1, 1));
        keep_tenants(&mut s, &mut u, &["alpha".into(), "default".into()]);
        let rows = engines(&s, &u);
        assert_eq!(
            rows.keys().cloned().collect::<Vec<_>>(),
            vec![alpha, of("f")],
            "beta's sessions left out"
        );
        keep_tenants(&mut s, &mut u, &[]);
        assert_eq!(engines(&s, &u).len(), 2, "no --tenant: every session kept");
        keep_tenants(&mut s, &mut u, &["gamma".into()]);
        assert!(s.sessions.is_empty() && u.sessions.is_empty());
    }

    #[test]
    fn a_session_in_only_one_reply_still_counts() {
        let (s, u) = reply(vec![stats("a", 1, 1, 0)], vec![usage("c", 9, true)]);
        let rows = engines(&s, &u);
        assert_eq!(
            rows[&of("a")].allocated,
            64 << 20,
            "from the stats' region bytes"
        );
        assert_eq!(rows[&of("c")].sessions, 1);
        assert_eq!(rows[&of("c")].used, 4 << 20);
    }

    /// `snap` rendered has no line saying `text` (`why`: the figures it would show are 0).
    fn assert_no_line(snap: &Snapshot, text: &str, why: &str) {
        let out = render(snap, 2);
        assert!(!out.contains(text), "{why}: no line {text:?} in\n{out}");
    }

    #[test]
    fn render_shows_engines_pools_and_caps_regions() {
        let (s, u) = reply(
            vec![stats("engine-1", 1, 3, 1)],
            vec![usage("engine-1", 1, true)],
        );
        let region = |id| RegionInfo {
            region_id: id,
            owner: "maru-server@x".into(),
            pool_id: 0,
            offset: 0,
            length: 64 << 20,
            requested: 64 << 20,
            state: "allocated".into(),
            token: None,
            holds: vec![],
        };
        let snap = Snapshot {
            server: "127.0.0.1:5555".into(),
            server_info: DaemonInfo {
                version: Some("9.9.9".into()),
                uptime_s: Some(3725),
            },
            tenants: Vec::new(),
            stats: s,
            usage: u,
            agents: vec![AgentView {
                address: "10.0.0.2:9860".into(),
                info: DaemonInfo::default(),
                status: None,
                error: Some("cannot reach the agent: refused".into()),
            }],
            rm: Some(RmView {
                address: "127.0.0.1:9850".into(),
                info: DaemonInfo::default(),
                pools: vec![PoolInfo {
                    pool_id: 0,
                    path: "/dev/shm/p".into(),
                    uuid: "u-1".into(),
                    kind: "file".into(),
                    total: 1 << 30,
                    free: 512 << 20,
                    align: 2 << 20,
                    draining: 0,
                }],
                regions: (1..=3).map(region).collect(),
                error: None,
            }),
        };
        let mut snap = snap;
        snap.stats.total.removed = 40;
        snap.stats.total.chains_cut = 3;
        snap.stats.total.waiting_for_region = 1;
        assert_no_line(&snap, "durable directory", "in memory");
        snap.stats.total.recovered_keys = 1200;
        snap.stats.total.recovered_regions = 5;
        snap.stats.total.recovery_ms = 37;
        assert_no_line(&snap, "without a key", "none in doubt");
        snap.stats.total.pages_in_doubt = 12;
        snap.stats.total.pages_in_doubt_freed = 52;
        let out = render(&snap, 2);
        assert!(
            out.contains("pages found allocated without a key at the last start: 52 freed as their sessions said which they hold, 12 not (yet) freed"),
            "{out}"
        );
        assert!(
            out.contains(
                "durable directory: its last start recovered 1200 keys in 5 regions in 37 ms"
            ),
            "{out}"
        );
        assert!(out.contains("version 9.9.9, up 1h02m"), "{out}");
        assert!(
            out.contains("10.0.0.2:9860          cannot reach the agent"),
            "{out}"
        );
        assert!(
            out.contains("eviction: 40 keys removed by their engines (3 of them cut a prefix chain), 0 regions given back for a fair share, 1 engines waiting"),
            "{out}"
        );
        assert!(out.contains("\nTENANT       ENGINE "), "{out}");
        assert!(
            out.lines().any(|l| l.starts_with("default      engine-1 ")),
            "the tenant, then the engine\n{out}"
        );
        assert!(!out.contains("tenants shown"), "{out}");
        assert!(out.contains("75.0%"), "{out}");
        assert!(out.contains("/dev/shm/p"), "{out}");
        assert!(out.contains("1024.0"), "{out}");
        assert!(out.contains("... and 1 more regions"), "{out}");
        assert!(
            rm_failed(&snap),
            "an agent that did not answer makes the status 1"
        );
        snap.agents.clear();
        assert!(!rm_failed(&snap));
        // --tenant names what is shown, and says so when none of them has a session.
        snap.tenants = vec!["alpha".into()];
        keep_tenants(&mut snap.stats, &mut snap.usage, &["alpha".into()]);
        let out = render(&snap, 2);
        assert!(out.contains("tenants shown (--tenant): alpha"), "{out}");
        assert!(
            out.contains("(no engine of these tenants has a session)"),
            "{out}"
        );
    }
}
