//! The agent side of the scale bench: one real maru-remote-cxl-agent beside an RM and
//! a maru-server that hands `remote_cxl` regions out with it, and 1, 64 and 256
//! simulated workers (a thread, a session and an agent connection each). Each worker
//! opens a `remote_cxl` session, takes a region and maps it at the agent (`map`, as a
//! worker's store does before its first WRITE), publishes one chunk, then for the
//! step's seconds loads it as a worker does: `acquire` at maru-server and `map_read`
//! of the leased range at the agent with the lease's read token, then `release`.
//! The agent's CPU per thread and RSS are read from /proc; the latencies are the
//! workers'. The bytes' READ over the transport is not part of it (make bench
//! measures remote_cxl loads).

use crate::harness::percentile;
use crate::idle::{clk_tck, stat_ticks};
use crate::procs::{bin_dir, start_agent, start_daemon, start_rm, Proc, TempDir};
use crate::report::Table;
use maru::auth::{keyfile::write_new_key_file, load_key_file, SharedKey};
use maru::net::{Client, ClientOptions};
use maru::wire::agent::{AgentReply, AgentRequest, ReadRange};
use maru::wire::meta::Backend;
use maru::worker::session::Session;
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const PAGE: u64 = 4096;
/// The RM aligns regions to 2 MiB.
const REGION: u64 = 2 << 20;
/// Loads per second of all workers together.
const RATE: f64 = 1000.0;

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct AgentStep {
    pub workers: usize,
    pub seconds: f64,
    pub cpu_pct: f64,
    pub threads: Vec<(String, f64)>,
    pub rss_mib: f64,
    pub map: Lat,
    pub map_read: Lat,
    pub errors: Vec<String>,
}

struct Stack {
    /// Removed (with the agent's and maru-server's files) when the stack goes.
    _dir: TempDir,
    pool: PathBuf,
    agent: Proc,
    agent_addr: String,
    agent_key: PathBuf,
    server: String,
    server_key: PathBuf,
    _rm: Proc,
    _srv: Proc,
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.pool);
    }
}

fn stack(max_workers: usize) -> Result<Stack, String> {
    let dir = TempDir::fresh("scale-agent")?;
    // In /dev/shm: the agent maps it; only the pages the workers publish are touched.
    let pool =
        PathBuf::from("/dev/shm").join(format!("maru-bench-scale-agent-{}", std::process::id()));
    let size = (max_workers as u64 + 16) * REGION;
    let bins = bin_dir();
    let (rm, rm_addr, rm_key) =
        start_rm(&dir.join("rm-state"), &pool, size, &dir.join("rm.ready"))?;
    let agent_key = dir.join("agent.key");
    let key = SharedKey::generate().map_err(|e| format!("agent key: {e}"))?;
    write_new_key_file(&agent_key, &key).map_err(|e| format!("agent key file: {e}"))?;
    let (agent, agent_addr) = start_agent(
        &rm_addr,
        &rm_key,
        &agent_key,
        &pool,
        "scale-mem0",
        &["--max-clients".into(), (2 * max_workers + 64).to_string()],
        &dir.join("agent.ready"),
    )?;
    let server_key = dir.join("server.key");
    let (srv, server) = start_daemon(
        &bins.join("maru-server"),
        &[
            "--rm-address".into(),
            rm_addr,
            "--rm-key-file".into(),
            rm_key,
            "--region-size".into(),
            REGION.to_string(),
            "--chunk-size".into(),
            PAGE.to_string(),
            "--max-sessions".into(),
            (max_workers + 64).to_string(),
            "--key-file".into(),
            server_key.display().to_string(),
            "--in-memory".into(),
            "--remote-cxl-agent".into(),
            agent_addr.clone(),
            "--remote-cxl-agent-key-file".into(),
            agent_key.display().to_string(),
        ],
        &dir.join("server.ready"),
    )?;
    Ok(Stack {
        _dir: dir,
        pool,
        agent,
        agent_addr,
        agent_key,
        server,
        server_key,
        _rm: rm,
        _srv: srv,
    })
}

struct WorkerOut {
    map: Vec<f64>,
    map_read: Vec<f64>,
    errors: Vec<String>,
}

fn worker(st: &StackRef, w: usize, secs: f64, every: Duration, go: &Barrier) -> WorkerOut {
    let mut out = WorkerOut {
        map: Vec::new(),
        map_read: Vec::new(),
        errors: Vec::new(),
    };
    let mut waited = false;
    let r = (|| -> Result<(), String> {
        let key = load_key_file(&st.server_key).map_err(|e| e.to_string())?;
        let id = format!("agent-worker-{w}-{}", st.tag);
        let s = Session::open(
            &st.server,
            &id,
            Some(key),
            &id,
            "scale-agent",
            "scale-bench",
            Backend::RemoteCxl,
            Duration::from_secs(60),
        )
        .map_err(|e| format!("{id}: {e}"))?;
        s.set_reply_spin(Duration::ZERO);
        let g = s
            .expand(s.call_deadline())
            .map_err(|e| format!("{id} expand: {e}"))?;
        let mut opts = ClientOptions::new(maru::wire::agent::SERVICE, id.clone());
        opts.key = Some(load_key_file(&st.agent_key).map_err(|e| e.to_string())?);
        opts.call_timeout = Duration::from_secs(30);
        let mut agent =
            Client::connect(&st.agent_addr, &opts).map_err(|e| format!("{id} agent: {e}"))?;
        let t = Instant::now();
        match agent.call::<_, AgentReply>(&AgentRequest::Map {
            handle: g.handle.clone(),
            writable: true,
        }) {
            Ok(AgentReply::Mapped(_)) => out.map.push(t.elapsed().as_secs_f64() * 1e6),
            r => return Err(format!("{id} map: {r:?}")),
        }
        let (pages, _) = s
            .alloc(1, None, s.call_deadline())
            .map_err(|e| e.to_string())?;
        let p = pages.first().ok_or("no page")?;
        let k = format!("agent-key-{id}");
        s.publish(vec![p.entry(k.clone(), PAGE)], s.call_deadline())
            .map_err(|e| e.to_string())?;
        let keys = vec![k];
        go.wait();
        waited = true;
        let start = Instant::now();
        let mut n: u32 = 0;
        while start.elapsed().as_secs_f64() < secs {
            let due = start + every * n;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            n += 1;
            let leases = s
                .acquire(&keys, s.call_deadline())
                .map_err(|e| e.to_string())?;
            let Some(l) = leases.into_iter().flatten().next() else {
                return Err(format!("{id}: its key was not found"));
            };
            let t = Instant::now();
            let ranges = vec![ReadRange {
                region_id: l.region_id,
                offset: l.offset,
                length: l.length,
                read_token: l.read_token.clone(),
            }];
            match agent.call::<_, AgentReply>(&AgentRequest::MapReads { ranges }) {
                Ok(r) if r.clone().single_read().is_ok() => {
                    out.map_read.push(t.elapsed().as_secs_f64() * 1e6)
                }
                r => return Err(format!("{id} map_reads: {r:?}")),
            }
            s.release_leases(vec![l.lease_id], s.call_deadline())
                .map_err(|e| e.to_string())?;
        }
        let _ = agent.call::<_, AgentReply>(&AgentRequest::Unmap {
            region_id: g.handle.region_id,
        });
        let _ = s.return_region(g.handle.region_id, true, s.call_deadline());
        let _ = s.close(s.call_deadline());
        Ok(())
    })();
    if let Err(e) = r {
        out.errors.push(e);
        // Do not leave the others waiting at the barrier.
        if !waited {
            go.wait();
        }
    }
    out
}

/// What a worker thread needs of the stack.
struct StackRef {
    server: String,
    server_key: PathBuf,
    agent_addr: String,
    agent_key: PathBuf,
    tag: usize,
}

/// p50/p99/max of unsorted samples.
pub fn lat(mut v: Vec<f64>) -> Lat {
    v.sort_by(|a, b| a.total_cmp(b));
    Lat {
        count: v.len(),
        p50_us: percentile(&v, 0.5),
        p99_us: percentile(&v, 0.99),
        max_us: v.last().copied().unwrap_or(0.0),
    }
}

pub fn run(quick: bool) -> Result<Vec<AgentStep>, String> {
    let secs = if quick { 3.0 } else { 8.0 };
    let steps = [1usize, 64, 256];
    let st = stack(256)?;
    let pid = st.agent.pid();
    let mut out = Vec::new();
    for (tag, &workers) in steps.iter().enumerate() {
        eprintln!("  agent: {workers} workers");
        let sr = Arc::new(StackRef {
            server: st.server.clone(),
            server_key: st.server_key.clone(),
            agent_addr: st.agent_addr.clone(),
            agent_key: st.agent_key.clone(),
            tag,
        });
        let every = Duration::from_secs_f64(workers as f64 / RATE);
        let go = Arc::new(Barrier::new(workers + 1));
        let hs: Vec<_> = (0..workers)
            .map(|w| {
                let (sr, go) = (sr.clone(), go.clone());
                std::thread::Builder::new()
                    .stack_size(256 << 10)
                    .spawn(move || worker(&sr, w, secs, every, &go))
            })
            .collect::<Result<_, _>>()
            .map_err(|e| format!("worker thread: {e}"))?;
        go.wait();
        let t0 = thread_ticks(pid);
        let start = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        let t1 = thread_ticks(pid);
        let window = start.elapsed().as_secs_f64();
        let rss = rss_bytes(pid);
        let mut map = Vec::new();
        let mut map_read = Vec::new();
        let mut errors = Vec::new();
        for h in hs {
            let o = h.join().map_err(|_| "agent worker panicked".to_string())?;
            map.extend(o.map);
            map_read.extend(o.map_read);
            errors.extend(o.errors);
        }
        errors.truncate(3);
        let threads = thread_cpu(&t0, &t1, window);
        out.push(AgentStep {
            workers,
            seconds: window,
            cpu_pct: threads.iter().map(|t| t.1).sum(),
            threads,
            rss_mib: rss as f64 / (1 << 20) as f64,
            map: lat(map),
            map_read: lat(map_read),
            errors,
        });
    }
    Ok(out)
}

pub fn table(steps: &[AgentStep]) -> Table {
    let mut t = Table::new(
        "maru-remote-cxl-agent with 1, 64 and 256 workers (1,000 loads/s in all: acquire at maru-server, map_read at the agent)",
        &[
            "workers", "agent CPU %", "per thread", "RSS MiB", "map p50/p99 µs",
            "map_read p50/p99 µs", "map_reads", "errors",
        ],
    );
    for s in steps {
        t.row(vec![
            s.workers.to_string(),
            format!("{:.1}", s.cpu_pct),
            s.threads
                .iter()
                .map(|(n, c)| format!("{n} {c:.1}"))
                .collect::<Vec<_>>()
                .join(", "),
            format!("{:.1}", s.rss_mib),
            format!("{:.0} / {:.0}", s.map.p50_us, s.map.p99_us),
            format!("{:.0} / {:.0}", s.map_read.p50_us, s.map_read.p99_us),
            s.map_read.count.to_string(),
            if s.errors.is_empty() {
                "0".into()
            } else {
                s.errors.join("; ")
            },
        ]);
    }
    t
}

// What both scale parts read from /proc and how they sum latencies (the server part,
// `scale`, uses these too; this module imports nothing of it).

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Lat {
    pub count: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

/// (thread name, utime + stime ticks) of every thread of `pid`.
pub fn thread_ticks(pid: u32) -> Vec<(u32, String, u64)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let tid: u32 = e.file_name().to_string_lossy().parse().unwrap_or(0);
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        out.push((tid, name, stat_ticks(&stat).unwrap_or(0)));
    }
    out
}

pub fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Per-thread CPU (% of a core) between two samples, grouped by thread name.
pub fn thread_cpu(
    a: &[(u32, String, u64)],
    b: &[(u32, String, u64)],
    secs: f64,
) -> Vec<(String, f64)> {
    let mut by: std::collections::BTreeMap<String, f64> = Default::default();
    for (tid, name, t) in b {
        let before = a.iter().find(|x| x.0 == *tid).map_or(0, |x| x.2);
        *by.entry(name.clone()).or_default() +=
            (t.saturating_sub(before)) as f64 / clk_tck() / secs * 100.0;
    }
    let mut v: Vec<(String, f64)> = by.into_iter().filter(|(_, c)| *c >= 0.05).collect();
    v.sort_by(|x, y| y.1.total_cmp(&x.1));
    v
}
