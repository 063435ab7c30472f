//! The scale bench (`maru-bench --only scale`, `make bench-scale`): how maru-server's
//! CPU, memory and latency grow with sessions, keys and tenants.
//!
//! One real maru-server (this build, durable directory in `--state-dir`) on a real RM
//! whose fake-DAX pool is a sparse file nothing touches (1 KiB pages, 4 MiB regions:
//! 4,096 pages a region, as 1 GiB regions of 256 KiB chunks). The bench publishes the
//! keys itself (alloc + publish in batches of `MAX_BATCH`, several sessions at once),
//! then starts `maru-scale-sim` processes (up to 1,000 sessions each) whose sessions
//! behave as engines (see that binary): heartbeats at the worker's interval, prompts
//! (exists, acquire + release of the hits, alloc + publish of the misses, evictions
//! once full), sessions that come and go. Per step it reads maru-server's CPU per
//! thread and its RSS from /proc, and the latencies the simulated engines saw.
//!
//! Steps: 10, 100, 1,000 and 4,000 sessions on 1 M keys (one tenant); 1,000 sessions
//! of 16 tenants (each writing a namespace of its own); 1,000 sessions on 4 M and
//! 16 M keys. Last, the server is stopped (SIGTERM) and started again on its
//! directory: the recovery time of all its keys.
//!
//! Knobs for a closer look (environment): `MARU_SCALE_IN_MEMORY=1` runs maru-server
//! with `--in-memory` (the key directory's own bytes per key, without the durable
//! store); `MARU_SCALE_ONLY_FILL=1` publishes the keys and times the recovery, without
//! the session steps; `MARU_SCALE_ONLY_BIG=1` publishes the keys and runs only the
//! session step on the most keys, then the recovery (no agent steps, no steps on
//! 1 M keys, no tenants: a before/after of the largest step in about two minutes);
//! `MARU_SCALE_AB_SERVER=path/maru-server` times the recovery of the same directory
//! by that build, then by this one again (in the notes); `MARU_SCALE_REPLOT=scale.json`
//! draws scale.png again.

use crate::harness::percentile;
use crate::idle::{clk_tck, process_ticks};
use crate::meta::{count_found, dir_bytes, open_session, publish_pages};
use crate::procs::{bin_dir, start_daemon, start_daemon_within, start_rm, Proc, TempDir};
use crate::report::Table;
use crate::scale_agent::{rss_bytes, thread_cpu, thread_ticks, Lat};
use maru::auth::{keyfile::write_new_key_file, SharedKey};
use maru::wire::meta::{MetaReply, MetaRequest, TotalStats, MAX_BATCH};
use maru::worker::session::Session;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PAGE: u64 = 1024;
const REGION: u64 = 4 << 20;
const PAGES_PER_REGION: u64 = REGION / PAGE;
/// Tenants of the tenants step.
const TENANTS: usize = 16;
/// Sessions per simulator process.
const PER_PROC: usize = 1000;
/// Prompts per second of all simulated engines together, at every step (so that the
/// steps compare the cost of sessions and keys, not of load).
const RATE: f64 = 400.0;

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Step {
    pub name: String,
    pub sessions: usize,
    pub tenants: usize,
    /// Keys maru-server holds (its stats) at the end of the step.
    pub keys: u64,
    pub regions: u64,
    pub seconds: f64,
    /// maru-server's CPU over the step (% of one core), all threads and per thread.
    pub cpu_pct: f64,
    pub threads: Vec<(String, f64)>,
    pub rss_mib: f64,
    /// RSS the step's sessions added once open, per session (bytes).
    pub bytes_per_session: f64,
    pub requests_per_s: f64,
    pub ops: Vec<(String, Lat)>,
    pub prompts: u64,
    pub stored: u64,
    pub skipped: u64,
    pub evicted: u64,
    pub errors: Vec<String>,
    /// The simulators' CPU over the step (% of one core, all processes).
    pub sim_cpu_pct: f64,
    /// The engines' latency of every request but open and close.
    #[serde(default)]
    pub all: Lat,
    /// Where the time went (see [`crate::scale_split`]).
    #[serde(default)]
    pub split: crate::scale_split::Split,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Fill {
    pub keys_to: u64,
    pub seconds: f64,
    pub keys_per_s: f64,
    pub rss_mib: f64,
    /// RSS growth over this fill per key it added (bytes): measured from just before
    /// the fill, so the session steps run since the previous fill (their sessions,
    /// the 16 tenants' keys) are not counted as this fill's.
    pub bytes_per_key: f64,
    /// Keys maru-server holds after the fill (every tenant's).
    #[serde(default)]
    pub held_keys: u64,
    /// RSS per key held after the fill (bytes): the whole process over every key.
    #[serde(default)]
    pub bytes_per_held_key: f64,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ScaleResult {
    pub machine_load: String,
    pub steps: Vec<Step>,
    pub fills: Vec<Fill>,
    pub recovery_keys: u64,
    pub recovery_s: f64,
    pub recovered_found: usize,
    pub recovered_sampled: usize,
    pub dir_mib: f64,
    pub rss_after_recovery_mib: f64,
    pub recovery_cpu_s: f64,
    pub agent: Vec<crate::scale_agent::AgentStep>,
    pub notes: Vec<String>,
}

struct Env {
    dir: TempDir,
    rm_addr: String,
    rm_key: String,
    server_key: PathBuf,
    tenants_file: PathBuf,
    tenant_keys: Vec<PathBuf>,
    state: PathBuf,
    /// maru-server's `--metrics` port (its histogram of its own time per request).
    metrics_port: u16,
    _rm: Proc,
}

fn ns(t: usize) -> String {
    format!("scale-ns-{t}")
}

/// `regions`: the RM's pool, in regions.
fn setup(regions: u64, max_sessions: usize) -> Result<Env, String> {
    let dir = TempDir::fresh("scale")?;
    let pool = dir.join("pool");
    let (rm, rm_addr, rm_key) = start_rm(
        &dir.join("rm-state"),
        &pool,
        regions * REGION,
        &dir.join("rm.ready"),
    )?;
    let server_key = dir.join("server.key");
    let mut toml = String::new();
    let mut tenant_keys = Vec::new();
    for t in 0..TENANTS {
        let k = dir.join(format!("t{t}.key"));
        let key = SharedKey::generate().map_err(|e| format!("tenant key: {e}"))?;
        write_new_key_file(&k, &key).map_err(|e| format!("{}: {e}", k.display()))?;
        toml.push_str(&format!(
            "[tenants.t{t}]\nkey_file = \"t{t}.key\"\nwrite = [\"{}\"]\nmax_sessions = {}\n\n",
            ns(t),
            max_sessions + 64
        ));
        tenant_keys.push(k);
    }
    let tenants_file = dir.join("tenants.toml");
    std::fs::write(&tenants_file, toml).map_err(|e| e.to_string())?;
    Ok(Env {
        state: dir.join("server-state"),
        dir,
        rm_addr,
        rm_key,
        server_key,
        tenants_file,
        tenant_keys,
        metrics_port: crate::scale_split::free_port()?,
        _rm: rm,
    })
}

fn server_args(env: &Env, max_sessions: usize) -> Vec<String> {
    vec![
        "--rm-address".into(),
        env.rm_addr.clone(),
        "--rm-key-file".into(),
        env.rm_key.clone(),
        "--region-size".into(),
        REGION.to_string(),
        "--chunk-size".into(),
        PAGE.to_string(),
        "--max-sessions".into(),
        (max_sessions + 64).to_string(),
        "--max-clients".into(),
        (2 * max_sessions + 256).to_string(),
        "--key-file".into(),
        env.server_key.display().to_string(),
        "--tenants".into(),
        env.tenants_file.display().to_string(),
        "--metrics".into(),
        format!("127.0.0.1:{}", env.metrics_port),
        "--state-dir".into(),
        env.state.display().to_string(),
    ]
    .into_iter()
    .map(|a| {
        if std::env::var_os("MARU_SCALE_IN_MEMORY").is_some()
            && a == env.state.display().to_string()
        {
            "--in-memory".into()
        } else {
            a
        }
    })
    .filter(|a| !(std::env::var_os("MARU_SCALE_IN_MEMORY").is_some() && a == "--state-dir"))
    .collect()
}

fn open(addr: &str, key: &Path, id: &str) -> Result<Session, String> {
    let ns = ns_of_key(key_index(id));
    let spin = Duration::ZERO;
    open_session(
        addr,
        key,
        id,
        (&ns, "scale-bench"),
        Duration::from_secs(60),
        spin,
    )
}

fn key_index(id: &str) -> usize {
    id.rsplit('@')
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or(0)
}

fn ns_of_key(t: usize) -> String {
    ns(t)
}

/// The operator's totals.
fn totals(addr: &str, env: &Env) -> Result<TotalStats, String> {
    let mut opts = maru::net::ClientOptions::new(maru::wire::meta::SERVICE, "scale-bench-stats");
    opts.key = Some(maru::auth::load_key_file(&env.server_key).map_err(|e| e.to_string())?);
    opts.call_timeout = Duration::from_secs(60);
    let mut c = maru::net::Client::connect(addr, &opts).map_err(|e| e.to_string())?;
    match c
        .call::<_, MetaReply>(&MetaRequest::Stats { session: None })
        .map_err(|e| e.to_string())?
    {
        MetaReply::Stats(s) => Ok(s.total),
        r => Err(format!("stats: {r:?}")),
    }
}

/// Publishes `fill_key(from..to)` in tenant `t`'s namespace, from 4 sessions at once
/// (batches of `MAX_BATCH`). The sessions close drained: their regions stay readable
/// with the region keeper, as an engine's that stopped.
fn fill(addr: &str, env: &Env, t: usize, from: u64, to: u64) -> Result<(), String> {
    const FILLERS: u64 = 4;
    let per = (to - from).div_ceil(FILLERS);
    let handles: Vec<_> = (0..FILLERS)
        .map(|f| {
            let (addr, key) = (addr.to_string(), env.tenant_keys[t].clone());
            let lo = from + f * per;
            let hi = (lo + per).min(to);
            std::thread::spawn(move || -> Result<(), String> {
                if lo >= hi {
                    return Ok(());
                }
                let s = open(&addr, &key, &format!("filler-{lo}@{t}"))?;
                let mut n = lo;
                // A loaded machine can keep the RM from answering an allocation in
                // time; maru-server then says so and to retry (bounded here).
                let mut retries = 0u32;
                while n < hi {
                    let want = (hi - n).min(MAX_BATCH as u64) as u32;
                    let (pages, missing) = s
                        .alloc(want, None, s.call_deadline())
                        .map_err(|e| e.to_string())?;
                    if pages.is_empty() && missing > 0 {
                        match s.expand(s.call_deadline()) {
                            Ok(_) => retries = 0,
                            Err(e) if retries < 5 && e.to_string().ends_with("retry") => {
                                retries += 1;
                                eprintln!("  fill: expand at key {n}: {e} (retry {retries} of 5)");
                            }
                            Err(e) => return Err(format!("expand at key {n}: {e}")),
                        }
                        continue;
                    }
                    let key = |i: usize| fill_key(n + i as u64);
                    publish_pages(&s, &pages, key, PAGE)?;
                    n += pages.len() as u64;
                }
                s.close(s.call_deadline()).map_err(|e| e.to_string())
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "filler panicked".to_string())??;
    }
    Ok(())
}

/// The bench's `i`-th key (as `maru-scale-sim`'s `fill_key`).
pub fn fill_key(i: u64) -> String {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    format!("{:016x}{:016x}", mix(i), mix(i ^ 0x5eed))
}

struct StepPlan<'a> {
    name: String,
    sessions: usize,
    tenants: usize,
    fill_keys: u64,
    secs: f64,
    addr: &'a str,
    server_pid: u32,
}

/// How much lower the simulated engines run than maru-server (`nice`): 10, or
/// `MARU_SCALE_SIM_NICE` (0: the same, as the bench ran before issue 46's split).
fn sim_nice() -> i32 {
    std::env::var("MARU_SCALE_SIM_NICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

/// maru-server's histograms of its own time per request (by operation) and of its
/// loop's busy stretches, now.
fn served_now(env: &Env) -> Result<crate::scale_split::ServerHistograms, String> {
    crate::scale_split::ServerHistograms::scrape(env.metrics_port)
}

fn run_step(env: &Env, p: &StepPlan<'_>) -> Result<Step, String> {
    let procs = p.sessions.div_ceil(PER_PROC).max(1);
    let go = env.dir.join(format!("go-{}", p.name.replace(' ', "_")));
    let _ = std::fs::remove_file(&go);
    let rss_before = rss_bytes(p.server_pid);
    let mut children = Vec::new();
    let mut outs = Vec::new();
    let mut readies = Vec::new();
    for i in 0..procs {
        let n = p.sessions / procs + usize::from(i < p.sessions % procs);
        let tag = format!("{}-{i}", p.name.replace(' ', "_"));
        let ready = env.dir.join(format!("ready-{tag}"));
        let out = env.dir.join(format!("out-{tag}.json"));
        let mut cmd = std::process::Command::new(bin_dir().join("maru-scale-sim"));
        cmd.args(["--server", p.addr, "--tag", &tag])
            .args(["--sessions", &n.to_string()])
            .args(["--rate", &(RATE / procs as f64).to_string()])
            .args(["--fill-keys", &p.fill_keys.to_string()])
            .args(["--seconds", &p.secs.to_string()])
            .args(["--churn-per-s", &(2.0 / procs as f64).to_string()])
            .args(["--nice", &sim_nice().to_string()])
            .arg("--ready")
            .arg(&ready)
            .arg("--go")
            .arg(&go)
            .arg("--out")
            .arg(&out)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null());
        for t in 0..p.tenants {
            // Spread the tenants over the processes' sessions.
            let t = (t + i) % p.tenants;
            cmd.arg("--tenant")
                .arg(format!("{}={}", env.tenant_keys[t].display(), ns(t)));
        }
        children.push(cmd.spawn().map_err(|e| format!("maru-scale-sim: {e}"))?);
        outs.push(out);
        readies.push(ready);
    }
    let wait = Instant::now();
    while !readies.iter().all(|r| r.exists()) {
        for c in &mut children {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!("maru-scale-sim exited before it was ready: {st}"));
            }
        }
        if wait.elapsed() > Duration::from_secs(240) {
            return Err("the simulated engines did not open their sessions within 240 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let open_s = wait.elapsed().as_secs_f64();
    // Let the opens settle (their durable records, the first heartbeats).
    std::thread::sleep(Duration::from_millis(500));
    let rss_open = rss_bytes(p.server_pid);
    let load = crate::loadavg();
    let served0 = served_now(env)?;
    let loop_wait0 = crate::scale_split::thread_cpu_wait_ns(p.server_pid, "maru-server");
    let t0 = thread_ticks(p.server_pid);
    let s0: u64 = children.iter().map(|c| process_ticks(c.id())).sum();
    let start = Instant::now();
    std::fs::write(&go, "go\n").map_err(|e| e.to_string())?;
    let mut done = vec![false; children.len()];
    let mut t1 = t0.clone();
    let mut secs = p.secs;
    let (mut s1, mut loop_wait1, mut served1) = (s0, loop_wait0, served0.clone());
    let sims: Vec<u32> = children.iter().map(|c| c.id()).collect();
    while done.iter().any(|d| !d) {
        for (i, c) in children.iter_mut().enumerate() {
            if !done[i] && outs[i].exists() {
                if done.iter().all(|d| !d) {
                    // The first process is done: the end of the window.
                    t1 = thread_ticks(p.server_pid);
                    secs = start.elapsed().as_secs_f64();
                    // (The simulators are all still there: a process that exited
                    // has no ticks left to read.)
                    s1 = sims.iter().map(|id| process_ticks(*id)).sum();
                    loop_wait1 =
                        crate::scale_split::thread_cpu_wait_ns(p.server_pid, "maru-server");
                    served1 = served_now(env)?;
                }
                done[i] = true;
            }
            if let Ok(Some(st)) = c.try_wait() {
                if !outs[i].exists() {
                    return Err(format!("maru-scale-sim exited without results: {st}"));
                }
            }
        }
        if start.elapsed().as_secs_f64() > p.secs + 120.0 {
            return Err("the simulated engines did not finish".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let rss = rss_bytes(p.server_pid);
    for mut c in children {
        let _ = c.wait();
    }
    // Once every simulated engine closed its sessions (the loop's work then: the
    // closes, the regions of sessions without keys given back).
    let closed = served_now(env)?;
    let mut ops: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut step = Step {
        name: p.name.clone(),
        sessions: p.sessions,
        tenants: p.tenants,
        seconds: secs,
        ..Default::default()
    };
    let mut total = 0usize;
    let mut sim_secs = 0.0f64;
    let mut samples = crate::scale_split::EngineSamples::default();
    for o in &outs {
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(o).map_err(|e| format!("{}: {e}", o.display()))?,
        )
        .map_err(|e| format!("{}: {e}", o.display()))?;
        sim_secs = sim_secs.max(v["seconds"].as_f64().unwrap_or(secs));
        let r = &v["record"];
        samples.add(r);
        for (op, lat) in r["lat"].as_object().into_iter().flatten() {
            let l = ops.entry(op.clone()).or_default();
            for x in lat.as_array().into_iter().flatten() {
                l.push(x.as_f64().unwrap_or(0.0));
            }
        }
        for (op, e) in r["errors"].as_object().into_iter().flatten() {
            step.errors.push(format!("{op}: {} ({})", e[0], e[1]));
        }
        step.prompts += r["prompts"].as_u64().unwrap_or(0);
        step.stored += r["stored"].as_u64().unwrap_or(0);
        step.skipped += r["skipped"].as_u64().unwrap_or(0);
        step.evicted += r["evicted"].as_u64().unwrap_or(0);
    }
    for (op, mut l) in ops {
        l.sort_by(|a, b| a.total_cmp(b));
        if op != "open" && op != "close" {
            total += l.len();
        }
        step.ops.push((
            op,
            Lat {
                count: l.len(),
                p50_us: percentile(&l, 0.5),
                p99_us: percentile(&l, 0.99),
                max_us: l.last().copied().unwrap_or(0.0),
            },
        ));
    }
    step.all = crate::scale_agent::lat(
        samples
            .by_op
            .iter()
            .filter(|(o, _)| !matches!(o.as_str(), "open" | "close"))
            .flat_map(|(_, v)| v.iter().map(|x| x.0))
            .collect(),
    );
    step.split.load = load.split_whitespace().next().unwrap_or("").to_string();
    samples.fill(&mut step.split);
    crate::scale_split::server_side(&mut step.split, &served0, &served1, &closed);
    let sim_secs = sim_secs.max(0.001);
    step.split.loop_cpu_wait_ms_per_s =
        loop_wait1.saturating_sub(loop_wait0) as f64 / 1e6 / secs.max(0.001);
    step.requests_per_s = total as f64 / sim_secs;
    let cpu = thread_cpu(&t0, &t1, secs);
    step.cpu_pct = cpu.iter().map(|c| c.1).sum();
    step.threads = cpu;
    step.sim_cpu_pct = s1.saturating_sub(s0) as f64 / clk_tck() / secs.max(0.001) * 100.0;
    step.rss_mib = rss as f64 / (1 << 20) as f64;
    step.bytes_per_session = rss_open.saturating_sub(rss_before) as f64 / p.sessions.max(1) as f64;
    let t = totals(p.addr, env)?;
    step.keys = t.keys;
    step.regions = t.regions;
    let planned = (RATE * secs) as u64;
    if step.prompts < planned * 9 / 10 {
        step.errors.push(format!(
            "the engines sent {} prompts of the {planned} planned: the machine was too \
             loaded for them to keep pace (they run at nice +{}), so this step's figures \
             are not comparable",
            step.prompts,
            sim_nice()
        ));
    }
    eprintln!(
        "  {}: {} sessions opened in {open_s:.1} s; server {:.0} % CPU, {:.0} MiB; {:.0} req/s",
        p.name, p.sessions, step.cpu_pct, step.rss_mib, step.requests_per_s
    );
    Ok(step)
}

pub fn run(quick: bool, max_keys_flag: Option<u64>) -> Result<ScaleResult, String> {
    eprintln!("  agent steps");
    let agent = if std::env::var_os("MARU_SCALE_ONLY_FILL").is_some()
        || std::env::var_os("MARU_SCALE_ONLY_BIG").is_some()
    {
        Vec::new()
    } else {
        crate::scale_agent::run(quick)?
    };
    let mut r = server_steps(quick, max_keys_flag)?;
    r.agent = agent;
    Ok(r)
}

fn server_steps(quick: bool, max_keys_flag: Option<u64>) -> Result<ScaleResult, String> {
    let secs = if quick { 4.0 } else { 12.0 };
    // 16 M keys take longer to publish than the bench's 15 minutes on a loaded
    // 2-core machine (about 20,000 keys/s there): --scale-keys 16777216 for them.
    let big = max_keys_flag.unwrap_or(if quick { 1 << 20 } else { 4 << 20 });
    let base = (1u64 << 20).min(big);
    let sessions: &[usize] = if quick {
        &[10, 100, 1000]
    } else {
        &[10, 100, 1000, 4000]
    };
    let max_sessions = *sessions.iter().max().unwrap_or(&1000);
    let n16 = 1000.min(max_sessions);
    let key_steps = {
        let (mut k, mut n) = (base, 0usize);
        while k < big {
            k = (k * 4).min(big);
            n += 1;
        }
        n
    };
    // The pool, a sparse file nothing touches (maru-server never reads or writes KV
    // bytes; the simulated engines do not either): room for every key the bench
    // publishes, and for a region of every session any step opens (its own, the
    // churn's, the fillers'). A simulated engine that stored keeps its region with
    // the region keeper after it leaves, so those add up over the steps; a pool that
    // runs out makes maru-server give back every kept region at once (the rule for a
    // full RM: departed engines' keys first), the bench's published keys with them.
    let keys = big + (TENANTS as u64) * (base / TENANTS as u64);
    let steps = sessions.len() + 1 + key_steps;
    let opened = sessions.iter().sum::<usize>()
        + n16 * (1 + key_steps)
        + steps * (2.0 * (secs + 4.0_f64)).ceil() as usize
        + 4 * (TENANTS + key_steps);
    let env = setup(
        keys.div_ceil(PAGES_PER_REGION) + opened as u64 + 64,
        max_sessions,
    )?;
    let args = server_args(&env, max_sessions);
    let server = bin_dir().join("maru-server");
    let (srv, addr) = start_daemon(&server, &args, &env.dir.join("server.ready"))?;
    let mut r = ScaleResult {
        machine_load: crate::loadavg(),
        ..Default::default()
    };
    let pid = srv.pid();
    let mut have = 0u64;
    let mut fill_to = |to: u64, r: &mut ScaleResult| -> Result<(), String> {
        eprintln!("  publishing keys {have}..{to}");
        let (rss0, held0) = (rss_bytes(pid), totals(&addr, &env)?.keys);
        let t = Instant::now();
        let c0 = thread_ticks(pid);
        fill(&addr, &env, 0, have, to)?;
        let s = t.elapsed().as_secs_f64();
        let cpu = thread_cpu(&c0, &thread_ticks(pid), s);
        eprintln!(
            "  fill: {:.0} keys/s, server threads {cpu:?}",
            (to - have) as f64 / s
        );
        std::thread::sleep(Duration::from_millis(300));
        let (rss, held) = (rss_bytes(pid), totals(&addr, &env)?.keys);
        r.fills.push(Fill {
            keys_to: to,
            seconds: s,
            keys_per_s: (to - have) as f64 / s,
            rss_mib: rss as f64 / (1 << 20) as f64,
            bytes_per_key: rss.saturating_sub(rss0) as f64
                / held.saturating_sub(held0).max(1) as f64,
            held_keys: held,
            bytes_per_held_key: rss as f64 / held.max(1) as f64,
        });
        have = to;
        Ok(())
    };
    fill_to(base, &mut r)?;
    let only_fill = std::env::var_os("MARU_SCALE_ONLY_FILL").is_some();
    let only_big = std::env::var_os("MARU_SCALE_ONLY_BIG").is_some();
    let plan = |name: String, sessions: usize, tenants: usize, fill_keys: u64| StepPlan {
        name,
        sessions,
        tenants,
        fill_keys,
        secs,
        addr: &addr,
        server_pid: pid,
    };
    for &n in sessions.iter().filter(|_| !only_fill && !only_big) {
        let name = format!("{n} sessions, {} keys", keys_name(base));
        eprintln!("  step: {name}");
        r.steps
            .push(held(run_step(&env, &plan(name, n, 1, base))?, base)?);
    }
    // 16 tenants: each writes a namespace of its own, with base / 16 keys of it.
    let per_tenant = if only_big { 0 } else { base / TENANTS as u64 };
    if !only_fill && !only_big {
        for t in 1..TENANTS {
            fill(&addr, &env, t, 0, per_tenant)?;
        }
        let name = format!("{n16} sessions, {TENANTS} tenants");
        eprintln!("  step: {name}");
        let published = base + (TENANTS as u64 - 1) * per_tenant;
        let step = run_step(&env, &plan(name, n16, TENANTS, per_tenant))?;
        r.steps.push(held(step, published)?);
    }
    let mut k = base;
    while k < big {
        k = (k * 4).min(big);
        fill_to(k, &mut r)?;
        if only_fill {
            continue;
        }
        let name = format!("{n16} sessions, {} keys", keys_name(k));
        eprintln!("  step: {name}");
        let published = k + (TENANTS as u64 - 1) * per_tenant;
        r.steps
            .push(held(run_step(&env, &plan(name, n16, 1, k))?, published)?);
    }
    let t = totals(&addr, &env)?;
    r.recovery_keys = t.keys;
    drop(srv);
    r.dir_mib = dir_bytes(&env.state) as f64 / (1 << 20) as f64;
    eprintln!("  recovery of {} keys", r.recovery_keys);
    let srv = recover(&server, &args, &env)?;
    r.recovery_s = srv.seconds;
    r.recovery_cpu_s = srv.cpu_s;
    r.rss_after_recovery_mib = srv.rss_mib;
    let s = open(&srv.addr, &env.tenant_keys[0], "scale-check@0")?;
    let sample: Vec<String> = (0..have)
        .step_by((have / 1000).max(1) as usize)
        .map(fill_key)
        .collect();
    r.recovered_sampled = sample.len();
    r.recovered_found = count_found(&s, &sample)?;
    let _ = s.close(s.call_deadline());
    drop(srv);
    if let Some(other) = std::env::var_os("MARU_SCALE_AB_SERVER") {
        // The same directory recovered by another build, then by this one again
        // (before/after side by side on the same data).
        for bin in [PathBuf::from(other), server.clone()] {
            let p = recover(&bin, &args, &env)?;
            let note = format!(
                "recovery by {}: {:.1} s, {:.1} CPU s, RSS after {:.0} MiB",
                bin.display(),
                p.seconds,
                p.cpu_s,
                p.rss_mib
            );
            eprintln!("  {note}");
            r.notes.push(note);
        }
    }
    if big < 16 << 20 {
        r.notes.push(format!(
            "largest step {} keys (--scale-keys 16777216 for 16 M; the default stops at 4 M, --quick at 1 M, to fit 15 minutes on a loaded 2-core machine); 16 M not measured in this run",
            keys_name(big)
        ));
    }
    Ok(r)
}

/// maru-server (`bin`) started on the durable directory, once it serves.
struct Recovered {
    _srv: Proc,
    addr: String,
    /// Seconds from its start until it served.
    seconds: f64,
    /// CPU seconds it took meanwhile (its CPU time when it serves): the wall time grows
    /// with the machine's load, this does not.
    cpu_s: f64,
    rss_mib: f64,
}

fn recover(bin: &Path, args: &[String], env: &Env) -> Result<Recovered, String> {
    let started = Instant::now();
    let (srv, addr) = start_daemon_within(
        bin,
        args,
        &env.dir.join("server.ready"),
        Duration::from_secs(300),
    )?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(Recovered {
        seconds,
        cpu_s: process_ticks(srv.pid()) as f64 / clk_tck(),
        rss_mib: rss_bytes(srv.pid()) as f64 / (1 << 20) as f64,
        addr,
        _srv: srv,
    })
}

/// The step, if maru-server still holds every key the bench published
/// (`published`): the simulated engines evict only keys they stored themselves.
fn held(step: Step, published: u64) -> Result<Step, String> {
    if step.keys < published {
        return Err(format!(
            "after step \"{}\" maru-server holds {} keys, fewer than the {published} the \
             bench published: keys were lost (the usual cause: the RM's pool ran out, \
             and maru-server gave back every kept region at once)",
            step.name, step.keys
        ));
    }
    Ok(step)
}

fn keys_name(k: u64) -> String {
    if k >= 1 << 20 {
        format!("{} M", k >> 20)
    } else {
        format!("{} K", k >> 10)
    }
}

fn lat_of<'a>(s: &'a Step, op: &str) -> Option<&'a Lat> {
    s.ops.iter().find(|(o, _)| o == op).map(|(_, l)| l)
}

fn us1(x: f64) -> String {
    format!("{x:.0}")
}

/// The tables of `scale.md`.
pub fn tables(r: &ScaleResult) -> Vec<Table> {
    let mut main = Table::new(
        "maru-server at scale (one process; simulated engines over the wire protocol)",
        &[
            "step",
            "keys",
            "CPU %",
            "RSS MiB",
            "B/session",
            "req/s",
            "exists p50/p99 µs",
            "publish p50/p99 µs",
            "alloc p50/p99 µs",
            "heartbeat p50/p99 µs",
            "acquire p50/p99 µs",
            "errors",
        ],
    );
    for s in &r.steps {
        let pair = |op: &str| {
            lat_of(s, op).map_or("-".to_string(), |l| {
                format!("{} / {}", us1(l.p50_us), us1(l.p99_us))
            })
        };
        main.row(vec![
            s.name.clone(),
            s.keys.to_string(),
            format!("{:.1}", s.cpu_pct),
            format!("{:.0}", s.rss_mib),
            format!("{:.0}", s.bytes_per_session),
            format!("{:.0}", s.requests_per_s),
            pair("exists"),
            pair("publish"),
            pair("alloc"),
            pair("heartbeat"),
            pair("acquire"),
            if s.errors.is_empty() {
                "0".into()
            } else {
                s.errors.join("; ")
            },
        ]);
    }
    let mut threads = Table::new(
        "maru-server CPU per thread (% of one core) and the load of each step",
        &[
            "step",
            "threads",
            "prompts",
            "stored",
            "skipped",
            "evicted",
            "sims' CPU %",
        ],
    );
    for s in &r.steps {
        threads.row(vec![
            s.name.clone(),
            s.threads
                .iter()
                .map(|(n, c)| format!("{n} {c:.1}"))
                .collect::<Vec<_>>()
                .join(", "),
            s.prompts.to_string(),
            s.stored.to_string(),
            s.skipped.to_string(),
            s.evicted.to_string(),
            format!("{:.0}", s.sim_cpu_pct),
        ]);
    }
    let mut fills = Table::new(
        "Publishing the keys (alloc + publish, batches of 4,096, 4 sessions) and memory per key",
        &[
            "keys",
            "seconds",
            "keys/s",
            "RSS MiB",
            "RSS bytes/key (this fill)",
            "keys held",
            "RSS bytes/key held",
        ],
    );
    for f in &r.fills {
        fills.row(vec![
            f.keys_to.to_string(),
            format!("{:.1}", f.seconds),
            format!("{:.0}", f.keys_per_s),
            format!("{:.0}", f.rss_mib),
            format!("{:.0}", f.bytes_per_key),
            f.held_keys.to_string(),
            format!("{:.0}", f.bytes_per_held_key),
        ]);
    }
    let mut rec = Table::new(
        "Recovery of the durable directory (--state-dir): SIGTERM, start, until it serves",
        &[
            "keys",
            "directory MiB",
            "seconds",
            "CPU seconds",
            "RSS after MiB",
            "sample found",
        ],
    );
    rec.row(vec![
        r.recovery_keys.to_string(),
        format!("{:.0}", r.dir_mib),
        format!("{:.1}", r.recovery_s),
        format!("{:.1}", r.recovery_cpu_s),
        format!("{:.0}", r.rss_after_recovery_mib),
        format!("{} / {}", r.recovered_found, r.recovered_sampled),
    ]);
    vec![
        main,
        crate::scale_split::table(
            &r.steps
                .iter()
                .map(|s| crate::scale_split::StepView {
                    name: &s.name,
                    ops: &s.ops,
                    all: &s.all,
                    split: &s.split,
                })
                .collect::<Vec<_>>(),
        ),
        threads,
        fills,
        rec,
        crate::scale_agent::table(&r.agent),
    ]
}
