//! The handler's JSON configuration. Unknown fields are refused (a typo must not
//! silently fall back to a default); every error names the field and what to do.

use super::router::parse_server_urls;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// Regions in the CXL memory of memory nodes, reached with one-sided RDMA.
    RemoteCxl,
    /// This host is attached to the CXL memory and maps regions itself.
    Cxl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    Soft,
    Verbs,
}

/// Default of `namespace` and `layout`.
fn default_name() -> String {
    "default".into()
}
fn default_load_slots() -> usize {
    16
}
fn default_store_slots() -> usize {
    32
}
fn default_timeout_ms() -> u64 {
    10_000
}
fn default_async_threads() -> usize {
    2
}
/// Default of `reply_spin_us`.
pub const DEFAULT_REPLY_SPIN_US: u64 = 50;
/// Most `reply_spin_us` may be (a longer spin only burns CPU).
pub const MAX_REPLY_SPIN_US: u64 = 1_000;
fn default_reply_spin_us() -> u64 {
    DEFAULT_REPLY_SPIN_US
}
fn default_prefault() -> bool {
    true
}
fn default_rdma_qps_per_agent() -> u8 {
    4
}

fn default_rdma_port() -> u8 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandlerConfig {
    pub backend: BackendKind,
    /// maru-server address(es): `host:port[,host:port...]`, one pool each.
    pub server_url: String,
    /// This engine's id (sessions and ownership are named by it).
    pub engine_id: String,
    /// Cache namespace (model + KV layout scope); keys are shared only within it.
    #[serde(default = "default_name")]
    pub namespace: String,
    /// Digest of the KV layout; keys are shared only between equal layouts.
    #[serde(default = "default_name")]
    pub layout: String,
    /// Agent key file (remote_cxl; default ~/.maru/remote-cxl-agent.key).
    #[serde(default)]
    pub agent_key_file: Option<String>,
    /// The maru-server key this engine proves (its tenant's key file); unset: see
    /// [`server_key_path`].
    #[serde(default)]
    pub server_key_file: Option<String>,
    #[serde(default)]
    pub transport: Option<TransportKind>,
    #[serde(default)]
    pub rdma_device: Option<String>,
    /// Port of the RDMA device (transport verbs), from 1.
    #[serde(default = "default_rdma_port")]
    pub rdma_port: u8,
    /// GID index to source packets from (default: 0 on InfiniBand, a RoCE v2 GID on
    /// Ethernet).
    #[serde(default)]
    pub rdma_gid_index: Option<u8>,
    /// GRH traffic class (RoCE: DSCP << 2 | ECN; the PFC class on a lossless fabric).
    #[serde(default)]
    pub rdma_traffic_class: u8,
    /// Service level, 0-15.
    #[serde(default)]
    pub rdma_service_level: u8,
    /// Queue pairs to each agent (transport verbs; data connections on soft), 1-8.
    #[serde(default = "default_rdma_qps_per_agent")]
    pub rdma_qps_per_agent: u8,
    /// Load staging slots. 0: none (slot loads and `remote_cxl` loads miss at once).
    #[serde(default = "default_load_slots")]
    pub load_slots: usize,
    /// Store staging slots. 0: none (slot stores and `remote_cxl` stores skip at once).
    #[serde(default = "default_store_slots")]
    pub store_slots: usize,
    /// Timeout of one transfer batch and of control calls (ms).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Threads that run submitted (asynchronous) operations; started on first use.
    #[serde(default = "default_async_threads")]
    pub async_threads: usize,
    /// `cxl`: fault each own region in on a background thread and map the next one
    /// ahead of need; a region mapped to be read has the first load's leases faulted in
    /// at once and the rest on that thread (see `prefault`).
    #[serde(default = "default_prefault")]
    pub prefault: bool,
    /// How long a call to maru-server polls for its reply before the thread sleeps
    /// (µs; 0: sleep at once).
    #[serde(default = "default_reply_spin_us")]
    pub reply_spin_us: u64,
    /// Most bytes of regions this engine holds in each pool, in whole regions (0: no
    /// limit); past it, stores evict the engine's own keys.
    #[serde(default)]
    pub max_bytes: u64,
}

impl HandlerConfig {
    /// Parses and checks a configuration. Errors are configuration errors: the open
    /// fails at once and is never retried.
    pub fn parse(json: &str) -> Result<HandlerConfig, String> {
        let c: HandlerConfig =
            serde_json::from_str(json).map_err(|e| format!("configuration JSON: {e}"))?;
        c.check()?;
        Ok(c)
    }

    /// The maru-server key to prove (see `server_key_file` and [`server_key_path`]).
    /// Logs once per process and file which key file it used.
    pub fn server_key(&self) -> Result<Option<crate::auth::SharedKey>, String> {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let Some((path, source)) = server_key_path(
            self.server_key_file.as_deref(),
            std::env::var_os(crate::auth::keyfile::SERVER_KEY_ENV).as_deref(),
            home.as_deref(),
            |p| p.exists(),
        ) else {
            return Ok(None);
        };
        let key = crate::auth::load_key_file(&path).map_err(|e| match source {
            ServerKeySource::Config => format!("server_key_file: {e}"),
            ServerKeySource::Env => format!("{}: {e}", crate::auth::keyfile::SERVER_KEY_ENV),
            ServerKeySource::HostDefault => format!(
                "maru-server key (neither server_key_file nor {} is set, so this host's \
                 default {} was taken): {e}; or name another key file in server_key_file",
                crate::auth::keyfile::SERVER_KEY_ENV,
                path.display()
            ),
        })?;
        log_key_once(&path, source);
        Ok(Some(key))
    }

    pub fn server_urls(&self) -> Result<Vec<String>, String> {
        parse_server_urls(&self.server_url)
    }

    fn check(&self) -> Result<(), String> {
        self.server_urls()?;
        if self.engine_id.trim().is_empty() {
            return Err("engine_id is empty: give each engine a stable, unique id".into());
        }
        if self.async_threads == 0 || self.async_threads > 64 {
            return Err("async_threads must be between 1 and 64".into());
        }
        if self.reply_spin_us > MAX_REPLY_SPIN_US {
            return Err(format!(
                "reply_spin_us is {} µs; it must be at most {MAX_REPLY_SPIN_US} (0 turns polling off)",
                self.reply_spin_us
            ));
        }
        if self.timeout_ms == 0 {
            return Err("timeout_ms must be positive".into());
        }
        if self.rdma_port == 0 {
            return Err("rdma_port must be at least 1 (RDMA ports are numbered from 1)".into());
        }
        if !(1..=8).contains(&self.rdma_qps_per_agent) {
            return Err(format!(
                "rdma_qps_per_agent is {}; it must be 1-8",
                self.rdma_qps_per_agent
            ));
        }
        if self.rdma_service_level > 15 {
            return Err(format!(
                "rdma_service_level is {}; service levels are 0-15",
                self.rdma_service_level
            ));
        }
        if self.backend == BackendKind::Cxl && self.transport.is_some() {
            return Err("transport applies only to backend remote_cxl".into());
        }
        Ok(())
    }
}

/// Where the maru-server key of a worker was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerKeySource {
    /// The configuration's `server_key_file`.
    Config,
    /// The environment variable `MARU_SERVER_KEY_FILE`.
    Env,
    /// `~/.maru/server.key`, the key maru-server makes at its first start on this host.
    HostDefault,
}

/// The key file maru-server makes by default, under `$HOME`.
pub const HOST_SERVER_KEY: &str = ".maru/server.key";

/// The maru-server key file a worker proves: `server_key_file`, else
/// `MARU_SERVER_KEY_FILE` (set, not empty), else `$HOME/.maru/server.key` when it
/// `exists`; `None`: no key (only `--insecure-no-key` accepts it). Pure.
pub fn server_key_path(
    field: Option<&str>,
    env: Option<&std::ffi::OsStr>,
    home: Option<&Path>,
    exists: impl Fn(&Path) -> bool,
) -> Option<(PathBuf, ServerKeySource)> {
    if let Some(p) = field {
        return Some((PathBuf::from(p), ServerKeySource::Config));
    }
    if let Some(p) = env.filter(|p| !p.is_empty()) {
        return Some((PathBuf::from(p), ServerKeySource::Env));
    }
    home.filter(|h| !h.as_os_str().is_empty())
        .map(|h| h.join(HOST_SERVER_KEY))
        .filter(|p| exists(p))
        .map(|p| (p, ServerKeySource::HostDefault))
}

fn log_key_once(path: &Path, source: ServerKeySource) {
    static LOGGED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let mut logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner());
    if logged.iter().any(|p| p == path) {
        return;
    }
    logged.push(path.to_path_buf());
    let from = match source {
        ServerKeySource::Config => "server_key_file",
        ServerKeySource::Env => crate::auth::keyfile::SERVER_KEY_ENV,
        ServerKeySource::HostDefault => {
            "this host's default (no server_key_file, no MARU_SERVER_KEY_FILE)"
        }
    };
    log::info!("maru-server key: {} (from {from})", path.display());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn minimal_and_full() {
        let c = HandlerConfig::parse(
            r#"{"backend":"remote_cxl","server_url":"127.0.0.1:5555","engine_id":"e"}"#,
        )
        .unwrap();
        assert_eq!(c.load_slots, 16);
        assert_eq!(c.namespace, "default");
        assert_eq!(c.reply_spin_us, DEFAULT_REPLY_SPIN_US);
        assert!(HandlerConfig::parse(
            r#"{"backend":"cxl","server_url":"a:1,b:2","engine_id":"e","load_slots":2}"#
        )
        .is_ok());
    }

    #[test]
    fn errors_name_the_problem() {
        let e = HandlerConfig::parse(
            r#"{"backend":"remote_cxl","server_url":"a:1","engine_id":"e","load_slot":3}"#,
        )
        .unwrap_err();
        assert!(e.contains("load_slot"), "{e}");
        let e = HandlerConfig::parse(r#"{"backend":"nvme","server_url":"a:1","engine_id":"e"}"#)
            .unwrap_err();
        assert!(e.contains("nvme"), "{e}");
        assert!(
            HandlerConfig::parse(r#"{"backend":"cxl","server_url":"","engine_id":"e"}"#)
                .unwrap_err()
                .contains("empty")
        );
        assert!(
            HandlerConfig::parse(r#"{"backend":"cxl","server_url":"a:1","engine_id":" "}"#)
                .unwrap_err()
                .contains("engine_id")
        );
        assert!(HandlerConfig::parse("not json").is_err());
        let e = HandlerConfig::parse(
            r#"{"backend":"cxl","server_url":"a:1","engine_id":"e","reply_spin_us":5000}"#,
        )
        .unwrap_err();
        assert!(e.contains("reply_spin_us") && e.contains("1000"), "{e}");
        let c = HandlerConfig::parse(
            r#"{"backend":"cxl","server_url":"a:1","engine_id":"e","reply_spin_us":0}"#,
        )
        .unwrap();
        assert_eq!(c.reply_spin_us, 0);
    }

    #[test]
    fn rdma_settings_default_and_are_checked() {
        let base = r#""backend":"remote_cxl","server_url":"a:1","engine_id":"e""#;
        let c = HandlerConfig::parse(&format!("{{{base}}}")).unwrap();
        assert_eq!(
            (
                c.rdma_port,
                c.rdma_gid_index,
                c.rdma_traffic_class,
                c.rdma_service_level
            ),
            (1, None, 0, 0)
        );
        let c = HandlerConfig::parse(&format!(
            r#"{{{base},"transport":"verbs","rdma_port":2,"rdma_gid_index":3,"rdma_traffic_class":106,"rdma_service_level":3}}"#
        ))
        .unwrap();
        assert_eq!(
            (
                c.rdma_port,
                c.rdma_gid_index,
                c.rdma_traffic_class,
                c.rdma_service_level
            ),
            (2, Some(3), 106, 3)
        );
        let e = HandlerConfig::parse(&format!(r#"{{{base},"rdma_port":0}}"#)).unwrap_err();
        assert!(e.contains("rdma_port"), "{e}");
        let e =
            HandlerConfig::parse(&format!(r#"{{{base},"rdma_service_level":16}}"#)).unwrap_err();
        assert!(e.contains("rdma_service_level"), "{e}");
        let e =
            HandlerConfig::parse(&format!(r#"{{{base},"rdma_traffic_class":256}}"#)).unwrap_err();
        assert!(e.contains("rdma_traffic_class") || e.contains("256"), "{e}");
        let c = HandlerConfig::parse(&format!("{{{base}}}")).unwrap();
        assert_eq!(c.rdma_qps_per_agent, 4);
        let c = HandlerConfig::parse(&format!(r#"{{{base},"rdma_qps_per_agent":4}}"#)).unwrap();
        assert_eq!(c.rdma_qps_per_agent, 4);
        for bad in [0, 9] {
            let e = HandlerConfig::parse(&format!(r#"{{{base},"rdma_qps_per_agent":{bad}}}"#))
                .unwrap_err();
            assert!(e.contains("rdma_qps_per_agent"), "{e}");
        }
    }

    #[test]
    fn server_key_lookup_order() {
        use std::ffi::OsStr;
        let home = Path::new("/h");
        let default = PathBuf::from("/h/.maru/server.key");
        let yes = |_: &Path| true;
        let no = |_: &Path| false;
        // The configuration's field wins over the environment and the host default.
        assert_eq!(
            server_key_path(Some("/c.key"), Some(OsStr::new("/e.key")), Some(home), yes),
            Some((PathBuf::from("/c.key"), ServerKeySource::Config))
        );
        // Then the environment, over the host default.
        assert_eq!(
            server_key_path(None, Some(OsStr::new("/e.key")), Some(home), yes),
            Some((PathBuf::from("/e.key"), ServerKeySource::Env))
        );
        // An empty variable counts as unset.
        assert_eq!(
            server_key_path(None, Some(OsStr::new("")), Some(home), yes),
            Some((default.clone(), ServerKeySource::HostDefault))
        );
        // The host default only when the file exists; the exists check sees its path.
        assert_eq!(
            server_key_path(None, None, Some(home), |p| p == default),
            Some((default.clone(), ServerKeySource::HostDefault))
        );
        assert_eq!(server_key_path(None, None, Some(home), no), None);
        assert_eq!(server_key_path(None, None, None, yes), None);
        assert_eq!(server_key_path(None, None, Some(Path::new("")), yes), None);
    }

    #[test]
    fn host_default_key_is_refused_when_open_to_others() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("maru-cfg-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join(".maru")).unwrap();
        let p = dir.join(HOST_SERVER_KEY);
        crate::auth::keyfile::write_new_key_file(&p, &crate::auth::SharedKey::generate().unwrap())
            .unwrap();
        let (path, source) =
            server_key_path(None, None, Some(&dir), |p| p.exists()).expect("found");
        assert_eq!(
            (path.as_path(), source),
            (p.as_path(), ServerKeySource::HostDefault)
        );
        assert!(crate::auth::load_key_file(&path).is_ok());
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = crate::auth::load_key_file(&path).unwrap_err().to_string();
        assert!(e.contains(&p.display().to_string()), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    proptest! {
        #[test]
        fn the_config_parser_never_panics(s in ".{0,200}") {
            let _ = HandlerConfig::parse(&s);
        }
    }
}
