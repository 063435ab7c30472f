//! Pieces every daemon binary uses: logging, exit codes, flag checks, bind-address
//! checks, the ready file.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

/// Exit status of a configuration error (a flag, a key file, a pool file): restarting
/// does not help, so the systemd units do not (`RestartPreventExitStatus=78`).
pub const EX_CONFIG: i32 = 78;
/// Exit status when something the daemon depends on is unreachable or busy (its RM,
/// its port): restarting later may help.
pub const EX_UNAVAILABLE: i32 = 69;
/// Exit status of any other failure.
pub const EX_FAILURE: i32 = 1;

/// `--log-level`: the levels `log` knows.
pub const LOG_LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// `--log-level`'s value: one of [`LOG_LEVELS`] in any case (`DEBUG`, as upstream's
/// daemons spell it), or Python's `WARNING` / `CRITICAL` (upstream's maru-server), as
/// `warn` / `error`.
pub fn parse_log_level(s: &str) -> Result<String, String> {
    let l = s.trim().to_ascii_lowercase();
    let l = match l.as_str() {
        "warning" => "warn".to_string(),
        "critical" | "fatal" => "error".to_string(),
        _ => l,
    };
    if LOG_LEVELS.contains(&l.as_str()) {
        Ok(l)
    } else {
        Err(format!(
            "{s:?} is not a log level: one of {} (any case; WARNING and CRITICAL too)",
            LOG_LEVELS.join(", ")
        ))
    }
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text each: time, level, target, message.
    Text,
    /// One JSON object a line: `ts`, `level`, `target`, `msg` (for log shippers).
    Json,
}

/// Logs through `log` with `RUST_LOG` (or `level` when RUST_LOG is unset), as text or
/// one JSON object a line.
pub fn init_logging(level: &str, format: LogFormat) {
    let env = env_logger::Env::default().default_filter_or(level);
    let mut b = env_logger::Builder::from_env(env);
    b.format_timestamp_millis();
    if format == LogFormat::Json {
        b.format(|buf, r| {
            let line = serde_json::json!({
                "ts": buf.timestamp_millis().to_string(),
                "level": r.level().as_str(),
                "target": r.target(),
                "msg": r.args().to_string(),
            });
            writeln!(buf, "{line}")
        });
    }
    let _ = b.try_init();
}

/// Parses the command line; a wrong flag or value is a configuration error (status
/// 78, the message printed once), `--help` and `--version` exit 0.
pub fn parse_args<T: clap::Parser>() -> T {
    match T::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            std::process::exit(if e.use_stderr() { EX_CONFIG } else { 0 })
        }
    }
}

/// Checks a `HOST:PORT` flag value without resolving it (a name may resolve later).
pub fn check_host_port(flag: &str, v: &str) -> Result<(), String> {
    let shown = shown(v);
    if v.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let bad =
        || format!("--{flag} {shown:?} is not HOST:PORT (for example 127.0.0.1:9850 or mem0:9850)");
    let (host, port) = v.rsplit_once(':').ok_or_else(bad)?;
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
    match port.parse::<u16>() {
        Ok(p) if p > 0 && host_ok => Ok(()),
        _ => Err(bad()),
    }
}

/// A flag value as shown in a message: at most 64 characters.
fn shown(v: &str) -> String {
    v.chars().take(64).collect()
}

/// Parses `host` and `port` into an address; says plainly when it is not loopback,
/// since the control protocols are plaintext.
pub fn bind_addr(host: &str, port: u16, what: &str) -> Result<SocketAddr, String> {
    let ip: IpAddr = host
        .parse()
        .map_err(|e| format!("--host {host:?} is not an IP address ({e}); give e.g. 127.0.0.1"))?;
    if !ip.is_loopback() {
        log::warn!(
            "{what} listens on {ip}, which is not loopback: its protocol is not encrypted, so keep it on a trusted network"
        );
    }
    Ok(SocketAddr::new(ip, port))
}

/// Writes the bound address to `path` (atomically) once the daemon listens, so
/// scripts and tests can use `--port 0` and learn the port.
pub fn write_ready_file(path: &Path, addr: SocketAddr) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(f, "{addr}")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Prints `msg` once as the reason the daemon cannot start (through the log when it
/// is on, so a JSON log keeps its shape; else `error: msg` on stderr) and exits with
/// `code` ([`EX_CONFIG`], [`EX_UNAVAILABLE`], [`EX_FAILURE`]).
pub fn exit_with(code: i32, msg: impl std::fmt::Display) -> ! {
    if log::log_enabled!(log::Level::Error) {
        log::error!("{msg}");
    } else {
        eprintln!("error: {msg}");
    }
    std::process::exit(code)
}

/// A configuration error: exits with [`EX_CONFIG`] (78).
pub fn die(msg: impl std::fmt::Display) -> ! {
    exit_with(EX_CONFIG, msg)
}

/// A dependency that cannot be reached: exits with [`EX_UNAVAILABLE`] (69).
pub fn die_unavailable(msg: impl std::fmt::Display) -> ! {
    exit_with(EX_UNAVAILABLE, msg)
}

/// Refuses `--host` on every address (0.0.0.0, ::) without `--advertise` when the
/// address is handed to workers: they cannot connect to 0.0.0.0.
pub fn check_advertise(host: &str, advertise: &str) -> Result<(), String> {
    let unspecified = host.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified());
    if unspecified && advertise.trim().is_empty() {
        return Err(format!(
            "--host {host} listens on every address, but workers are handed the address to \
             reach the soft NIC: give --advertise HOST (this node's address on the workers' network)"
        ));
    }
    Ok(())
}

/// The verbs transport's RDMA flags, as the agent and maru-rdma-check take them. Each
/// field is named as its flag (`rdma_device` is `--rdma-device <RDMA_DEVICE>`), so that
/// it does not clash with the daemon's own flags when flattened into them.
#[derive(clap::Args, Debug, Clone)]
pub struct RdmaArgs {
    /// RDMA device for the verbs transport (default: the first one).
    #[arg(long, env = "MARU_RDMA_DEVICE")]
    pub rdma_device: Option<String>,
    /// Port of the RDMA device, from 1.
    #[arg(long, default_value_t = 1, env = "MARU_RDMA_PORT")]
    pub rdma_port: u8,
    /// GID index (default: 0 on InfiniBand, a RoCE v2 GID on Ethernet).
    #[arg(long, env = "MARU_RDMA_GID_INDEX")]
    pub rdma_gid_index: Option<u8>,
    /// GRH traffic class (RoCE: DSCP << 2 | ECN; the PFC class on a lossless fabric).
    #[arg(long, default_value_t = 0, env = "MARU_RDMA_TRAFFIC_CLASS")]
    pub rdma_traffic_class: u8,
    /// Service level, 0-15.
    #[arg(long, default_value_t = 0, env = "MARU_RDMA_SERVICE_LEVEL")]
    pub rdma_service_level: u8,
}

#[cfg(feature = "verbs")]
impl RdmaArgs {
    /// The verbs settings these flags give (the rest at their defaults).
    pub fn settings(&self) -> maru::transport::verbs::VerbsSettings {
        maru::transport::verbs::VerbsSettings {
            device: self.rdma_device.clone(),
            port: self.rdma_port,
            gid_index: self.rdma_gid_index,
            traffic_class: self.rdma_traffic_class,
            service_level: self.rdma_service_level,
            ..maru::transport::verbs::VerbsSettings::default()
        }
    }
}

/// Flags every daemon has besides its port's bounds.
#[derive(clap::Args, Debug, Clone)]
pub struct OpsArgs {
    /// Serve Prometheus metrics over HTTP at /metrics on this address (PORT alone means
    /// 127.0.0.1:PORT). Off by default.
    #[arg(long, value_name = "ADDR", env = "MARU_METRICS")]
    pub metrics: Option<String>,
    /// Log level when RUST_LOG is unset.
    #[arg(short = 'l', long, default_value = "info", value_parser = parse_log_level)]
    pub log_level: String,
    /// Log as text lines or as one JSON object a line (ts, level, target, msg).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "MARU_LOG_FORMAT")]
    pub log_format: LogFormat,
}

impl OpsArgs {
    /// Starts logging and checks `--metrics` (before any side effect).
    pub fn start(&self) -> Option<SocketAddr> {
        init_logging(&self.log_level, self.log_format);
        self.metrics
            .as_deref()
            .map(|m| crate::metrics_http::parse_metrics_addr(m).unwrap_or_else(|e| die(e)))
    }
}

/// Serves `metrics` at `addr` (when `--metrics` was given), reading the loop's
/// counters; a port that cannot be bound stops the daemon.
pub fn serve_metrics(
    addr: Option<SocketAddr>,
    metrics: &std::sync::Arc<crate::metrics::Metrics>,
    server: &maru::net::Server,
) {
    let Some(addr) = addr else {
        return;
    };
    metrics.watch_net(server.counters());
    if let Err(e) = crate::metrics_http::serve(addr, metrics.clone(), std::time::Instant::now()) {
        die_unavailable(format!("--metrics {addr}: cannot listen: {e}"));
    }
}

/// The bounds of a daemon's port (see `maru::net::ServerOptions`), as flags.
#[derive(clap::Args, Debug, Clone)]
pub struct NetArgs {
    /// Connections open at once (at least 1). At most a quarter of them may be in their
    /// handshake, so the rest stays for clients that proved the key: a new connection
    /// beyond that, or when all are open, pushes out the oldest unfinished handshake,
    /// and is closed at accept only when every connection is a client's.
    #[arg(short = 'm', long, default_value_t = 1024, env = "MARU_MAX_CLIENTS",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_clients: u64,
    /// Milliseconds a new connection has for its whole handshake (hello and key proof).
    #[arg(long, default_value_t = maru::net::server::DEFAULT_HANDSHAKE_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout_ms: u64,
    /// Seconds a connection may send nothing after its handshake before it is closed
    /// (0: never). Clients' heartbeats and calls keep it open.
    #[arg(long, default_value_t = maru::net::server::DEFAULT_IDLE_TIMEOUT_MS / 1000)]
    pub idle_timeout_s: u64,
    /// KiB of replies a client may leave unread before its requests are no longer read.
    #[arg(long, default_value_t = (maru::net::server::DEFAULT_MAX_UNSENT >> 10) as u64)]
    pub max_unsent_kib: u64,
    /// MiB of requests larger than 16 KiB held while they arrive, every client
    /// together; the clients of one key (one tenant) hold at most half of it (and at
    /// least one largest request, 1 MiB). Such a request is read only once it fits
    /// whole; until then its connection is not read.
    #[arg(long, default_value_t = (maru::net::server::DEFAULT_FRAME_ROOM >> 20) as u64,
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub frame_room_mib: u64,
}

impl NetArgs {
    /// The loop's options with these bounds and `key`.
    pub fn options(&self, key: Option<maru::auth::SharedKey>) -> maru::net::ServerOptions {
        self.options_with_keys(key.map(maru::auth::Keyring::single))
    }

    /// As [`options`](Self::options), with several named keys (maru-server's tenants).
    pub fn options_with_keys(&self, keys: Option<maru::auth::Keyring>) -> maru::net::ServerOptions {
        let max = self.max_clients.max(1) as usize;
        maru::net::ServerOptions {
            max_connections: max,
            max_pending: (max / 4).max(1),
            keys,
            handshake_timeout_ms: self.handshake_timeout_ms,
            idle_timeout_ms: self.idle_timeout_s.saturating_mul(1000),
            max_unsent: (self.max_unsent_kib as usize).saturating_mul(1024),
            frame_room: (self.frame_room_mib as usize) << 20,
            frame_room_per_tenant: ((self.frame_room_mib as usize) << 20) / 2,
            ..maru::net::ServerOptions::default()
        }
    }
}

/// Raises this process's open-file limit to its hard limit, so the connection cap,
/// not the default soft limit of 1,024 descriptors, bounds the connections (the
/// systemd units also set `LimitNOFILE`). Returns the limit in force.
pub fn raise_nofile_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: r is a valid rlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 0;
    }
    if r.rlim_cur < r.rlim_max {
        let want = libc::rlimit {
            rlim_cur: r.rlim_max,
            rlim_max: r.rlim_max,
        };
        // SAFETY: want is a valid rlimit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            return want.rlim_cur;
        }
    }
    r.rlim_cur
}

/// Tells systemd (`Type=notify`) that the daemon is ready: it listens and has written
/// its ready file. Does nothing when not started by systemd (`NOTIFY_SOCKET` unset).
pub fn notify_ready() {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(e) => return log::warn!("cannot tell systemd the daemon is ready: {e}"),
    };
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    let r = if let Some(name) = bytes.strip_prefix(b"@") {
        // An abstract socket name.
        <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            name,
        )
        .and_then(|a| sock.send_to_addr(b"READY=1\n", &a))
    } else {
        sock.send_to(b"READY=1\n", std::path::Path::new(&path))
    };
    if let Err(e) = r {
        log::warn!("cannot tell systemd the daemon is ready: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_levels_in_any_case_and_python_names() {
        assert_eq!(parse_log_level("DEBUG").unwrap(), "debug");
        assert_eq!(parse_log_level("Info").unwrap(), "info");
        assert_eq!(parse_log_level("WARNING").unwrap(), "warn");
        assert_eq!(parse_log_level("CRITICAL").unwrap(), "error");
        assert_eq!(parse_log_level("off").unwrap(), "off");
        let e = parse_log_level("verbose").unwrap_err();
        assert!(e.contains("verbose") && e.contains("debug"), "{e}");
    }
}
