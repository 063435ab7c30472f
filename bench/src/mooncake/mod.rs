//! Part `mooncake`: Maru beside Mooncake Store, the shared KV pool a vLLM, SGLang or
//! LMCache user would pick instead, in the same run and taking turns with it.
//!
//! Mooncake comes from PyPI (`mooncake-transfer-engine-non-cuda`, a manylinux wheel for
//! CPython 3.11) into a venv of its own outside the clone (`$MARU_MOONCAKE_VENV`, by
//! default `~/.cache/maru/mooncake-venv`), made at the first run and reused. The part
//! starts `mooncake_master` with its HTTP metadata server on loopback (free ports), one
//! storage process holding a memory segment of the size of Maru's pool over the TCP
//! transport (bench/python/mooncake_row.py `serve`), and per turn N client processes
//! with no segment of their own, so that every byte crosses Mooncake's TCP transfer
//! engine, as every byte of Maru's remote_cxl crosses the soft transport. Replica
//! count 1 (the default `ReplicateConfig`).
//!
//! Each (chunk, clients) configuration takes turns: Mooncake, Maru remote_cxl/soft and
//! Maru cxl (each on a fresh stack), the order reversed every turn so that the load of
//! the machine weighs on all alike; a figure adds up its turns. Both sides: batch put
//! (32 new keys from cold registered buffers), single put, batch get into cold buffers,
//! single get, exists of a batch of 32 stored keys.
//!
//! When the venv cannot be made (PyPI unreachable, no Python 3.11, the wheel does not
//! install) or Mooncake does not start, the part says it was skipped and why, and the
//! bench goes on.

use crate::harness::{run_clients_raw, Bound, Fig, Rotor, Run};
use crate::maru_io::{handler_config, load_batch_args, CHandler, BATCH};
use crate::procs::{free_port, stack, stop, with_parent, Scratch};
use crate::report::{chunk_name, f0, f2, us, Table};
use serde::{Deserialize, Serialize};
use std::ffi::{c_char, CString};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The wheel, pinned: the figures and docs/benchmarks.md name this version.
pub const PACKAGE: &str = "mooncake-transfer-engine-non-cuda";
pub const VERSION: &str = "0.3.13.post1";
const TURNS: usize = 2;
const REGION: usize = 256 << 20;
const MANY: usize = 4;
/// The systems of a row: Mooncake and the two Maru backends beside it.
pub const SYSTEMS: [&str; 3] = ["mooncake", "remote_cxl", "cxl"];

/// The five figures of one system at one chunk size and client count.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub system: &'static str,
    pub chunk: usize,
    pub clients: usize,
    pub put_batch: Fig,
    pub put_single: Fig,
    pub get_batch: Fig,
    pub get_single: Fig,
    /// Exists of 32 stored keys per operation (ops/s, latency; no bytes).
    pub exists_batch: Fig,
}

#[derive(Debug, Clone, Serialize)]
pub struct MooncakeResult {
    /// Why the part was skipped (Mooncake could not be installed or started).
    pub skipped: Option<String>,
    pub version: String,
    pub segment_bytes: u64,
    pub turns: usize,
    pub rows: Vec<Row>,
}

impl MooncakeResult {
    pub fn row(&self, system: &str, chunk: usize, clients: usize) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.system == system && r.chunk == chunk && r.clients == clients)
    }
}

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
fn run_bounded(
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
pub fn venv_dir() -> PathBuf {
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
struct Cluster {
    py: PathBuf,
    master_addr: String,
    metadata_url: String,
    logs: PathBuf,
    // Dropped in this order: the storage process before the master.
    _serve: Guard,
    _master: Guard,
}

fn script() -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let p = root.join("python/mooncake_row.py");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("{} is missing", p.display()))
    }
}

fn start(segment: u64, logs: &Path) -> Result<Cluster, String> {
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

/// What mooncake_row.py run prints, per phase.
#[derive(Deserialize)]
struct PyPhase {
    bytes: u64,
    wall: f64,
    lat: Vec<f64>,
}

impl From<PyPhase> for Run {
    fn from(p: PyPhase) -> Run {
        Run {
            bytes: p.bytes,
            wall: p.wall,
            lat: p.lat,
        }
    }
}

/// The five phases' runs, in the order of [`Row`]'s figures.
type Turn = [Run; 5];

#[allow(clippy::too_many_arguments)]
fn mooncake_turn(
    m: &Cluster,
    chunk: usize,
    clients: usize,
    secs: f64,
    rotate: usize,
    segment: u64,
    tag: &str,
) -> Result<Turn, String> {
    // Puts stay under Mooncake's eviction watermark (0.9 of the segment): 3/4 of each
    // client's share in batches, the rest single.
    let per_client = (segment as usize * 7 / 10) / chunk / clients;
    let max_batches = (per_client * 3 / 4 / BATCH).max(1);
    let max_singles = per_client.saturating_sub(max_batches * BATCH).max(1);
    let out = m.logs.join(format!("{tag}.json"));
    let log = m.logs.join(format!("{tag}.log"));
    run_bounded(
        with_parent(Command::new(&m.py))
            .arg(script()?)
            .args([
                "run",
                "--master",
                &m.master_addr,
                "--metadata",
                &m.metadata_url,
            ])
            .args(["--chunk", &chunk.to_string()])
            .args(["--clients", &clients.to_string()])
            .args(["--secs", &secs.to_string()])
            .args(["--rotate", &rotate.to_string()])
            .args(["--max-batches", &max_batches.to_string()])
            .args(["--max-singles", &max_singles.to_string()])
            .args(["--tag", tag])
            .env("GLOG_minloglevel", "1"),
        &log,
        Some(&out),
        Duration::from_secs_f64(5.0 * secs + 240.0),
        "mooncake_row.py run",
    )?;
    let mut text = String::new();
    std::fs::File::open(&out)
        .and_then(|mut f| f.read_to_string(&mut text))
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let mut doc: std::collections::HashMap<String, PyPhase> = serde_json::from_str(text.trim())
        .map_err(|e| format!("mooncake_row.py printed {} bytes: {e}", text.len()))?;
    let mut take = |k: &str| -> Result<Run, String> {
        doc.remove(k)
            .map(Run::from)
            .ok_or_else(|| format!("mooncake_row.py: no phase {k}"))
    };
    Ok([
        take("put_batch")?,
        take("put_single")?,
        take("get_batch")?,
        take("get_single")?,
        take("exists_batch")?,
    ])
}

fn exists_batch(h: &CHandler, keys: &[CString]) -> Result<(), String> {
    let kp: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
    let mut found = vec![false; keys.len()];
    // SAFETY: arrays of keys.len() entries; the handler is open.
    let st = unsafe {
        maru::ffi::maru_exists_batch(h.as_ptr(), kp.as_ptr(), kp.len(), kp[0], found.as_mut_ptr())
    };
    if st != maru::ffi::maru_status_t::MARU_OK {
        let msg = maru::ffi::last_error().map(|(_, m)| m).unwrap_or_default();
        return Err(format!("maru_exists_batch: {st:?}: {msg}"));
    }
    match found.iter().filter(|&&f| !f).count() {
        0 => Ok(()),
        n => Err(format!(
            "maru_exists_batch missed {n} of {} stored keys",
            keys.len()
        )),
    }
}

/// One turn of Maru `backend` on a fresh stack: the same five phases as Mooncake's.
fn maru_turn(
    s: &Scratch,
    backend: &'static str,
    chunk: usize,
    clients: usize,
    secs: f64,
    rotate: usize,
) -> Result<Turn, String> {
    let st = stack(
        s,
        backend == "remote_cxl",
        &REGION.to_string(),
        &chunk.to_string(),
    )?;
    let handlers: Vec<Arc<CHandler>> = (0..clients)
        .map(|i| {
            CHandler::open(&handler_config(
                &st.server,
                backend,
                &format!("bench-mc-{backend}-{i}"),
                s,
            ))
            .map(Arc::new)
        })
        .collect::<Result<_, _>>()?;
    // Space as maru_io: two regions per engine to spare, 3/4 of a client's share in
    // batches.
    let usable = (s.pool_size as usize)
        .saturating_sub(REGION * (2 * clients + 2))
        .max(chunk * BATCH * 2 * clients);
    let per_client = usable / chunk / clients;
    let max_batches = (per_client * 3 / 4 / BATCH).max(1);
    let max_singles = per_client
        .saturating_sub(max_batches * BATCH + BATCH)
        .max(1);
    let tag = move |c: usize, kind: &str, i: usize| {
        CString::new(format!("mc-{backend}-{chunk}-{kind}-{c}-{i}")).unwrap_or_default()
    };
    let srcs: Vec<_> = (0..clients)
        .map(|c| Arc::new(Mutex::new(Rotor::new(rotate, chunk, 7 + c as u64))))
        .collect();
    let dsts: Vec<_> = (0..clients)
        .map(|_| Arc::new(Mutex::new(Rotor::new(rotate, chunk, 3))))
        .collect();
    // Warm-up, not measured (as Mooncake's): a region's worth of batches per client
    // stored and removed, then the handlers' background prefaulting settled.
    let cycles = REGION / (chunk * BATCH) + 2;
    for (c, h) in handlers.iter().enumerate() {
        let mut src = srcs[c].lock().map_err(|_| "poisoned")?;
        for i in 0..cycles {
            let keys: Vec<CString> = (0..BATCH).map(|j| tag(c, "w", i * BATCH + j)).collect();
            let ptrs: Vec<*const u8> = (0..BATCH).map(|_| src.next_ptr() as *const u8).collect();
            h.store_batch(&keys, &ptrs, chunk)?;
            if i == 0 {
                let mut dst = dsts[c].lock().map_err(|_| "poisoned")?;
                let bufs: Vec<*mut u8> = (0..BATCH).map(|_| dst.next_ptr()).collect();
                h.load_batch(&keys, &bufs, chunk)?;
            }
            h.remove_batch(&keys)?;
        }
    }
    for h in &handlers {
        h.settle_prefault()?;
    }
    let bound = |max_ops| Bound { secs, max_ops };
    let stored = Arc::new(Mutex::new(vec![0usize; clients]));
    let ops: Vec<_> = (0..clients)
        .map(|c| {
            let (h, src, stored) = (handlers[c].clone(), srcs[c].clone(), stored.clone());
            move |i: usize| -> Result<u64, String> {
                let keys: Vec<CString> = (0..BATCH).map(|j| tag(c, "b", i * BATCH + j)).collect();
                let ptrs: Vec<*const u8> = {
                    let mut r = src.lock().map_err(|_| "poisoned")?;
                    (0..BATCH).map(|_| r.next_ptr() as *const u8).collect()
                };
                h.store_batch(&keys, &ptrs, chunk)?;
                if let Ok(mut n) = stored.lock() {
                    n[c] = i + 1;
                }
                Ok((BATCH * chunk) as u64)
            }
        })
        .collect();
    let put_batch = run_clients_raw(ops, bound(max_batches))?;
    let stored: Vec<usize> = stored.lock().map_err(|_| "poisoned")?.clone();
    let ops: Vec<_> = (0..clients)
        .map(|c| {
            let (h, src) = (handlers[c].clone(), srcs[c].clone());
            move |i: usize| -> Result<u64, String> {
                let p = src.lock().map_err(|_| "poisoned")?.next_ptr() as *const u8;
                h.store_one(&tag(c, "s", i), p, chunk)?;
                Ok(chunk as u64)
            }
        })
        .collect();
    let put_single = run_clients_raw(ops, bound(max_singles))?;
    let ops: Vec<_> = (0..clients)
        .map(|c| {
            let (h, dst, n) = (handlers[c].clone(), dsts[c].clone(), stored[c].max(1));
            move |i: usize| -> Result<u64, String> {
                let (keys, bufs) = load_batch_args(&dst, |k| tag(c, "b", k), i % n)?;
                h.load_batch(&keys, &bufs, chunk)
            }
        })
        .collect();
    let get_batch = run_clients_raw(ops, bound(usize::MAX))?;
    let ops: Vec<_> = (0..clients)
        .map(|c| {
            let (h, dst, n) = (
                handlers[c].clone(),
                dsts[c].clone(),
                stored[c].max(1) * BATCH,
            );
            move |i: usize| -> Result<u64, String> {
                let p = dst.lock().map_err(|_| "poisoned")?.next_ptr();
                h.load_one(&tag(c, "b", i % n), p, chunk)
            }
        })
        .collect();
    let get_single = run_clients_raw(ops, bound(usize::MAX))?;
    // The keys of each batch made once, as Mooncake's side does: the figure times the call.
    let ops: Vec<_> = (0..clients)
        .map(|c| {
            let h = handlers[c].clone();
            let batches: Vec<Vec<CString>> = (0..stored[c].max(1))
                .map(|b| (0..BATCH).map(|j| tag(c, "b", b * BATCH + j)).collect())
                .collect();
            move |i: usize| -> Result<u64, String> {
                exists_batch(&h, &batches[i % batches.len()])?;
                Ok(0)
            }
        })
        .collect();
    let exists = run_clients_raw(ops, bound(usize::MAX))?;
    drop(handlers);
    drop(st);
    Ok([put_batch, put_single, get_batch, get_single, exists])
}

/// Runs the part: Mooncake set up (or skipped), then each configuration in turns.
pub fn run(
    s: &Scratch,
    chunks: &[usize],
    clients: &[usize],
    secs: f64,
    rotate: usize,
    say: &dyn Fn(&str),
) -> MooncakeResult {
    let segment = s.pool_size;
    let mut res = MooncakeResult {
        skipped: None,
        version: VERSION.into(),
        segment_bytes: segment,
        turns: TURNS,
        rows: Vec::new(),
    };
    let logs = s.path("mooncake");
    if let Err(e) = std::fs::create_dir_all(&logs) {
        res.skipped = Some(format!("{}: {e}", logs.display()));
        return res;
    }
    say(&format!(
        "mooncake: venv {} ({PACKAGE}=={VERSION}), master and a {} GiB segment on loopback",
        venv_dir().display(),
        segment >> 30
    ));
    let cluster = match start(segment, &logs) {
        Ok(c) => c,
        Err(e) => {
            let why = format!("Mooncake Store not measured: {e}");
            eprintln!("maru-bench: part mooncake skipped: {why}");
            res.skipped = Some(why);
            return res;
        }
    };
    for &chunk in chunks {
        for &n in clients {
            let rot = (rotate / n).max(chunk * BATCH * 2);
            let mut acc: Vec<[Run; 5]> = (0..SYSTEMS.len()).map(|_| Default::default()).collect();
            let mut failed = None;
            'turns: for t in 0..TURNS {
                let mut order: Vec<usize> = (0..SYSTEMS.len()).collect();
                if t % 2 == 1 {
                    order.reverse();
                }
                for i in order {
                    let sys = SYSTEMS[i];
                    say(&format!(
                        "mooncake part: {sys} {} x {n} client(s), turn {} of {TURNS}",
                        chunk_name(chunk),
                        t + 1
                    ));
                    let turn = if sys == "mooncake" {
                        let tag = format!("mc{t}-{chunk}-{n}");
                        mooncake_turn(&cluster, chunk, n, secs, rot, segment, &tag)
                    } else {
                        maru_turn(s, sys, chunk, n, secs, rot)
                    };
                    match turn {
                        Ok(runs) => {
                            for (a, r) in acc[i].iter_mut().zip(runs) {
                                a.add(r);
                            }
                        }
                        Err(e) => {
                            failed = Some(format!("{sys}: {e}"));
                            break 'turns;
                        }
                    }
                }
            }
            if let Some(e) = failed {
                eprintln!(
                    "maru-bench: part mooncake, {} x {n}: {e}",
                    chunk_name(chunk)
                );
                res.skipped.get_or_insert(e);
                continue;
            }
            for (i, runs) in acc.into_iter().enumerate() {
                let [a, b, c, d, e] = runs;
                res.rows.push(Row {
                    system: SYSTEMS[i],
                    chunk,
                    clients: n,
                    put_batch: a.fig(),
                    put_single: b.fig(),
                    get_batch: c.fig(),
                    get_single: d.fig(),
                    exists_batch: e.fig(),
                });
            }
        }
    }
    drop(cluster);
    res
}

fn system_name(sys: &str) -> &'static str {
    match sys {
        "mooncake" => "mooncake store (tcp)",
        "remote_cxl" => "maru remote_cxl/soft",
        _ => "maru cxl",
    }
}

/// The part's table: every figure of every system, in the order they are compared.
pub fn table(m: &MooncakeResult) -> Table {
    let mut t = Table::new(
        &format!(
            "Maru beside Mooncake Store {VERSION} (TCP transport, segment {} GiB, 1 replica; {} interleaved turns; batch = 32 chunks; µs)",
            m.segment_bytes >> 30,
            m.turns
        ),
        &["system", "op", "chunk", "clients", "GB/s", "ops/s", "p50", "p99"],
    );
    if let Some(why) = &m.skipped {
        t.row(vec![
            format!("skipped: {why}"),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
    }
    let mut chunks: Vec<usize> = m.rows.iter().map(|r| r.chunk).collect();
    chunks.dedup();
    for chunk in chunks {
        for (op, pick) in [
            ("batch put", 0),
            ("single put", 1),
            ("batch get", 2),
            ("single get", 3),
            ("exists x32", 4),
        ] {
            for n in [1, MANY] {
                for sys in SYSTEMS {
                    let Some(r) = m.row(sys, chunk, n) else {
                        continue;
                    };
                    let f = match pick {
                        0 => &r.put_batch,
                        1 => &r.put_single,
                        2 => &r.get_batch,
                        3 => &r.get_single,
                        _ => &r.exists_batch,
                    };
                    t.row(vec![
                        system_name(sys).into(),
                        op.into(),
                        chunk_name(chunk),
                        n.to_string(),
                        if pick == 4 { "-".into() } else { f2(f.gbs) },
                        f0(f.ops_per_s),
                        us(f.p50_us),
                        us(f.p99_us),
                    ]);
                }
            }
        }
    }
    t
}

fn clients_name(n: usize) -> String {
    if n == 1 {
        "1 client".into()
    } else {
        format!("{n} clients")
    }
}

type Pick = fn(&Row) -> f64;
/// A ratio table cell by chunk size.
pub type PerChunk<'a> = Box<dyn Fn(usize) -> Option<f64> + 'a>;

fn ratio_of(
    m: Option<&MooncakeResult>,
    sys: &str,
    chunk: usize,
    n: usize,
    pick: Pick,
) -> Option<f64> {
    let m = m?;
    let a = m.row(sys, chunk, n).map(pick)?;
    let b = m.row("mooncake", chunk, n).map(pick)?;
    (b > 0.0).then(|| a / b)
}

/// Rows of the ratio table (one cell per chunk size).
pub fn ratio_rows(m: Option<&MooncakeResult>) -> Vec<(String, PerChunk<'_>)> {
    let mut v: Vec<(String, PerChunk<'_>)> = Vec::new();
    if m.is_none() {
        return v;
    }
    let ops: [(&str, &str, Pick); 5] = [
        ("load", "get", |r: &Row| r.get_batch.gbs),
        ("store", "put", |r: &Row| r.put_batch.gbs),
        ("single load", "single get", |r: &Row| r.get_single.gbs),
        ("single store", "single put", |r: &Row| r.put_single.gbs),
        ("exists x32 ops/s", "exists x32 ops/s", |r: &Row| {
            r.exists_batch.ops_per_s
        }),
    ];
    for (sys, name) in [("remote_cxl", "remote_cxl/soft"), ("cxl", "cxl")] {
        for (ours, theirs, pick) in ops {
            for n in [1, MANY] {
                v.push((
                    format!(
                        "{name} {ours} / Mooncake Store {theirs} over TCP ({})",
                        clients_name(n)
                    ),
                    Box::new(move |c| ratio_of(m, sys, c, n, pick)),
                ));
            }
        }
    }
    v
}

/// The targets: (what, measured ratio, least ratio that meets it).
pub fn targets(m: Option<&MooncakeResult>) -> Vec<(String, Option<f64>, f64)> {
    let mut v = Vec::new();
    let Some(m) = m else { return v };
    for chunk in [256 << 10, 2 << 20] {
        for n in [1, MANY] {
            for (op, theirs, pick) in [
                (
                    "batch load",
                    "batch_get_into",
                    (|r: &Row| r.get_batch.gbs) as Pick,
                ),
                ("batch store", "batch_put_from", |r: &Row| r.put_batch.gbs),
            ] {
                v.push((
                    format!(
                        "remote_cxl/soft {op} {}, {} >= 1.0 x Mooncake Store {theirs} over TCP",
                        chunk_name(chunk),
                        clients_name(n)
                    ),
                    ratio_of(Some(m), "remote_cxl", chunk, n, pick),
                    1.0,
                ));
            }
        }
    }
    for chunk in [256 << 10, 2 << 20] {
        for n in [1, MANY] {
            v.push((
                format!(
                    "cxl batch load {}, {} >= 3 x Mooncake Store batch_get_into",
                    chunk_name(chunk),
                    clients_name(n)
                ),
                ratio_of(Some(m), "cxl", chunk, n, |r: &Row| r.get_batch.gbs),
                3.0,
            ));
        }
    }
    for sys in ["remote_cxl", "cxl"] {
        for n in [1, MANY] {
            v.push((
                format!(
                    "{sys} exists x32 ops/s, {} >= 2 x Mooncake Store batch_is_exist (256 KiB keys)",
                    clients_name(n)
                ),
                ratio_of(Some(m), sys, 256 << 10, n, |r: &Row| r.exists_batch.ops_per_s),
                2.0,
            ));
        }
    }
    v
}

/// Chart bars (GB/s, 1 and 4 clients) of Mooncake, and of the Maru figures taken
/// beside it when `with_maru` (the part `maru` did not run).
pub fn bars(m: Option<&MooncakeResult>, chunk: usize, with_maru: bool) -> Vec<crate::chart::Bars> {
    let mut v = Vec::new();
    let Some(m) = m else { return v };
    for sys in SYSTEMS {
        if sys != "mooncake" && !with_maru {
            continue;
        }
        for (op, pick) in [
            ("put", (|r: &Row| r.put_batch.gbs) as Pick),
            ("get", |r: &Row| r.get_batch.gbs),
        ] {
            if let Some(r) = m.row(sys, chunk, 1) {
                let label = if sys == "mooncake" {
                    format!("mooncake {op} (tcp, batch 32)")
                } else {
                    format!("{sys} {op} (mooncake part)")
                };
                v.push(crate::chart::Bars {
                    system: label,
                    one: pick(r),
                    many: m.row(sys, chunk, MANY).map(pick),
                });
            }
        }
    }
    v
}
