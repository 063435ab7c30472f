//! Mooncake Store installed and running for the `mooncake` part: its venv made from
//! PyPI (pinned [`PACKAGE`] [`VERSION`]), `mooncake_master` with its HTTP metadata
//! server on loopback and one storage process holding the segment, each child stopped
//! and reaped on drop; and the bounded runs of bench/python/mooncake_row.py.

use crate::procs::{free_port, stop, with_parent};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The wheel, pinned: the figures and docs/benchmarks.md name this version.
pub(super) const PACKAGE: &str = "mooncake-transfer-engine-non-cuda";
pub(super) const VERSION: &str = "0.3.13.post1";

/// A child process stopped (SIGTERM, then SIGKILL after 3 s) and reaped on drop; its
/// stdin (if piped) closed first.
struct Guard {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        drop(self.stdin.take());
        stop(&mut self.child);
    }
}

/// The last `n` lines of a log, at most 300 characters, for an error message.
fn tail(path: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let t = lines[lines.len().saturating_sub(n)..].join(" | ");
    let skip = t.chars().count().saturating_sub(300);
    t.chars().skip(skip).collect()
}

/// Runs `cmd` (stderr, and stdout unless `stdout` names a file, into `log`) until it
/// exits or `limit` passes (then killed).
pub(super) fn run_bounded(
    cmd: &mut Command,
    log: &Path,
    stdout: Option<&Path>,
    limit: Duration,
    what: &str,
) -> Result<(), String> {
    let err = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let out = match stdout {
        Some(p) => std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => err.try_clone().map_err(|e| e.to_string())?,
    };
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            return if st.success() {
                Ok(())
            } else {
                Err(format!("{what}: {st}: {}", tail(log, 1)))
            };
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "{what}: no answer in {} s: {}",
                limit.as_secs(),
                tail(log, 3)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where the venv lives: `$MARU_MOONCAKE_VENV`, or beside the vLLM venv in the cache.
pub(super) fn venv_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MARU_MOONCAKE_VENV") {
        return PathBuf::from(d);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("maru").join("mooncake-venv")
}

/// The venv's Python and the `mooncake_master` binary of its package, once the venv
/// imports `mooncake.store` at the pinned version; made (or completed) when it does not.
fn ensure_venv(dir: &Path, logs: &Path) -> Result<(PathBuf, PathBuf), String> {
    let py = dir.join("bin/python");
    let probe = |log: &str| -> Result<PathBuf, String> {
        let log = logs.join(log);
        run_bounded(
            Command::new(&py).args([
                "-c",
                &format!(
                    "import importlib.metadata as m, mooncake, mooncake.store, numpy, os; \
                     v = m.version('{PACKAGE}'); \
                     assert v == '{VERSION}', 'version ' + v; \
                     print(os.path.dirname(mooncake.__file__))"
                ),
            ]),
            &log,
            None,
            Duration::from_secs(60),
            "import mooncake.store",
        )?;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let pkg = text.lines().last().unwrap_or_default().trim();
        Ok(Path::new(pkg).join("mooncake_master"))
    };
    if py.exists() {
        if let Ok(m) = probe("probe.log") {
            return Ok((py, m));
        }
    } else {
        let base = std::env::var("MARU_MOONCAKE_PYTHON").unwrap_or_else(|_| "python3.11".into());
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        run_bounded(
            Command::new(&base).args(["-m", "venv"]).arg(dir),
            &logs.join("venv.log"),
            None,
            Duration::from_secs(120),
            &format!("{base} -m venv (the wheel is for CPython 3.11; MARU_MOONCAKE_PYTHON names another)"),
        )?;
    }
    eprintln!(
        "maru-bench: installing {PACKAGE}=={VERSION} into {} (pip; once)",
        dir.display()
    );
    // A short timeout and one retry, so that an unreachable index fails in seconds.
    run_bounded(
        Command::new(&py).args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--timeout",
            "15",
            "--retries",
            "1",
            &format!("{PACKAGE}=={VERSION}"),
            "numpy",
        ]),
        &logs.join("pip.log"),
        None,
        Duration::from_secs(900),
        &format!("pip install {PACKAGE}=={VERSION}"),
    )?;
    let m = probe("probe2.log")?;
    Ok((py, m))
}

/// Waits (≤ `limit`) until `addr` accepts a connection, or `child` exits.
fn wait_listening(
    addr: &str,
    child: &mut Child,
    limit: Duration,
    log: &Path,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    let sa: std::net::SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    while Instant::now() < deadline {
        if std::net::TcpStream::connect_timeout(&sa, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!(
                "mooncake_master exited during start-up ({st}): {}",
                tail(log, 3)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "mooncake_master did not listen on {addr} within {} s",
        limit.as_secs()
    ))
}

/// Mooncake running: the master (with its metadata server) and the storage process.
pub(super) struct Cluster {
    pub(super) py: PathBuf,
    pub(super) master_addr: String,
    pub(super) metadata_url: String,
    pub(super) logs: PathBuf,
    // Dropped in this order: the storage process before the master.
    _serve: Guard,
    _master: Guard,
}

pub(super) fn script() -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let p = root.join("python/mooncake_row.py");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("{} is missing", p.display()))
    }
}

pub(super) fn start(segment: u64, logs: &Path) -> Result<Cluster, String> {
    let (py, master_bin) = ensure_venv(&venv_dir(), logs)?;
    let (rpc, http, metrics) = (free_port()?, free_port()?, free_port()?);
    let mlog = logs.join("master.log");
    let out = std::fs::File::create(&mlog).map_err(|e| e.to_string())?;
    let mut child = with_parent(Command::new(&master_bin))
        .args([
            "--rpc_address=127.0.0.1".to_string(),
            format!("--rpc_port={rpc}"),
            "--enable_http_metadata_server=true".into(),
            "--http_metadata_server_host=127.0.0.1".into(),
            format!("--http_metadata_server_port={http}"),
            "--metrics_host=127.0.0.1".into(),
            format!("--metrics_port={metrics}"),
            "--enable_metric_reporting=false".into(),
        ])
        .env("GLOG_minloglevel", "1")
        .stdin(Stdio::null())
        .stdout(out.try_clone().map_err(|e| e.to_string())?)
        .stderr(out)
        .spawn()
        .map_err(|e| format!("{}: {e}", master_bin.display()))?;
    let master_addr = format!("127.0.0.1:{rpc}");
    let waited =
        wait_listening(&master_addr, &mut child, Duration::from_secs(20), &mlog).and_then(|()| {
            wait_listening(
                &format!("127.0.0.1:{http}"),
                &mut child,
                Duration::from_secs(20),
                &mlog,
            )
        });
    let master = Guard { child, stdin: None };
    waited?;
    let metadata_url = format!("http://127.0.0.1:{http}/metadata");
    // The storage process: prints one line once its segment is mounted.
    let slog = logs.join("serve.log");
    let mut child = with_parent(Command::new(&py))
        .arg(script()?)
        .args([
            "serve",
            "--master",
            &master_addr,
            "--metadata",
            &metadata_url,
        ])
        .arg("--segment")
        .arg(segment.to_string())
        .env("GLOG_minloglevel", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&slog).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("mooncake_row.py serve: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let stdin = child.stdin.take();
    let serve = Guard { child, stdin };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(l) if l.contains("ready") => {}
        Ok(_) => {
            return Err(format!(
                "the Mooncake storage process did not mount its segment: {}",
                tail(&slog, 3)
            ))
        }
        Err(_) => return Err("the Mooncake storage process did not start within 60 s".into()),
    }
    Ok(Cluster {
        py,
        master_addr,
        metadata_url,
        logs: logs.to_path_buf(),
        _serve: serve,
        _master: master,
    })
}
