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
