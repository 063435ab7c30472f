//! Pieces every daemon binary uses: logging, bind-address checks, the ready file.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

/// Logs through `log` with `RUST_LOG` (or `level` when RUST_LOG is unset).
pub fn init_logging(level: &str) {
    let env = env_logger::Env::default().default_filter_or(level);
    let _ = env_logger::Builder::from_env(env)
        .format_timestamp_millis()
        .try_init();
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

/// Prints `msg` as the reason the daemon cannot start and exits with status 2.
pub fn die(msg: impl std::fmt::Display) -> ! {
    log::error!("{msg}");
    eprintln!("error: {msg}");
    std::process::exit(2)
}

/// The bounds of a daemon's port (see `maru::net::ServerOptions`), as flags.
#[derive(clap::Args, Debug, Clone)]
pub struct NetArgs {
    /// Connections open at once; more are closed at accept. At most a quarter of them
    /// may be in their handshake, so the rest stays for clients that proved the key.
    #[arg(short = 'm', long, default_value_t = 1024, env = "MARU_MAX_CLIENTS")]
    pub max_clients: usize,
    /// Milliseconds a new connection has for its whole handshake (hello and key proof).
    #[arg(long, default_value_t = maru::net::server::DEFAULT_HANDSHAKE_TIMEOUT_MS)]
    pub handshake_timeout_ms: u64,
    /// Seconds a connection may send nothing after its handshake before it is closed
    /// (0: never). Clients' heartbeats and calls keep it open.
    #[arg(long, default_value_t = maru::net::server::DEFAULT_IDLE_TIMEOUT_MS / 1000)]
    pub idle_timeout_s: u64,
    /// KiB of replies a client may leave unread before its requests are no longer read.
    #[arg(long, default_value_t = (maru::net::server::DEFAULT_MAX_UNSENT >> 10) as u64)]
    pub max_unsent_kib: u64,
}

impl NetArgs {
    /// The loop's options with these bounds and `key`.
    pub fn options(&self, key: Option<maru::auth::SharedKey>) -> maru::net::ServerOptions {
        maru::net::ServerOptions {
            max_connections: self.max_clients.max(1),
            max_pending: (self.max_clients / 4).max(1),
            key,
            handshake_timeout_ms: self.handshake_timeout_ms,
            idle_timeout_ms: self.idle_timeout_s.saturating_mul(1000),
            max_unsent: (self.max_unsent_kib as usize).saturating_mul(1024),
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
