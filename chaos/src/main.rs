//! `make chaos`: the RM, a remote CXL agent, maru-server and two engines on loopback
//! (fake DAX, soft transport). The engines store and load checksummed chunks while
//! this driver kill -9's and restarts, at seeded random points, the agent (also with
//! a new boot id: a reboot of its memory node), maru-server, the RM and engine A. Afterwards it checks that no load returned bytes
//! other than those stored under its key, that every region went back to the RM once
//! everything closed and the keeper drained, and that no hold is left without a
//! region.
//!
//! `maru-chaos [--seed N] [--kills N] [--max-seconds N] [--bin-dir DIR]`; the seed
//! is printed, `CHAOS_SEED=N` (or `--seed N`) replays a run's kill schedule.
//! `maru-chaos engine ...` is the engine process (see `engine.rs`).

mod engine;
mod procs;

use engine::{EngineArgs, Rng};
use maru::auth::{keyfile::write_new_key_file, SharedKey};
use maru::net::{Client, ClientOptions};
use maru::wire::rm::{RmReply, RmRequest, SERVICE as RM};
use procs::{Proc, Scratch};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

struct Opts {
    seed: u64,
    kills: usize,
    max_seconds: u64,
    bin_dir: PathBuf,
}

fn value<T: std::str::FromStr>(args: &mut impl Iterator<Item = String>, flag: &str) -> T {
    let v = args.next().unwrap_or_default();
    v.parse().unwrap_or_else(|_| {
        eprintln!("maru-chaos: {flag} needs a value, got {v:?}");
        std::process::exit(2)
    })
}

fn parse_opts(args: Vec<String>) -> Opts {
    let env_seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok());
    let time_seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    let mut o = Opts {
        seed: env_seed.unwrap_or(time_seed % 1_000_000_007),
        kills: std::env::var("CHAOS_KILLS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60),
        max_seconds: 240,
        bin_dir: exe_dir,
    };
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seed" => o.seed = value(&mut it, "--seed"),
            "--kills" => o.kills = value(&mut it, "--kills"),
            "--max-seconds" => o.max_seconds = value(&mut it, "--max-seconds"),
            "--bin-dir" => o.bin_dir = PathBuf::from(value::<String>(&mut it, "--bin-dir")),
            "-h" | "--help" => {
                println!(
                    "maru-chaos [--seed N] [--kills N] [--max-seconds N] [--bin-dir DIR]\n\
                          CHAOS_SEED=N replays a run; CHAOS_KILLS=N sets the kills."
                );
                std::process::exit(0)
            }
            other => {
                eprintln!("maru-chaos: unknown argument {other:?} (see --help)");
                std::process::exit(2)
            }
        }
    }
    o
}

fn engine_main(args: Vec<String>) -> i32 {
    let mut m: BTreeMap<String, String> = BTreeMap::new();
    let mut it = args.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        m.insert(k.trim_start_matches("--").to_string(), v);
    }
    let get = |k: &str| m.get(k).cloned().unwrap_or_default();
    let a = EngineArgs {
        name: get("name"),
        peer: get("peer"),
        config: get("config"),
        keys: get("keys").parse().unwrap_or(200),
        seed: get("seed").parse().unwrap_or(1),
        stop_file: PathBuf::from(get("stop-file")),
        stats_file: PathBuf::from(get("stats-file")),
        mismatch_file: PathBuf::from(get("mismatch-file")),
        max_seconds: get("max-seconds").parse().unwrap_or(300),
    };
    engine::run(&a)
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("engine") {
        args.remove(0);
        std::process::exit(engine_main(args));
    }
    let o = parse_opts(args);
    match run(&o) {
        Ok(()) => println!("chaos: PASS (seed {})", o.seed),
        Err(e) => {
            eprintln!(
                "chaos: FAIL (seed {}, replay with CHAOS_SEED={}): {e}",
                o.seed, o.seed
            );
            std::process::exit(1);
        }
    }
}

/// The daemons and engines of the run, each restartable where its clients look.
struct Cluster {
    s: Scratch,
    bin: PathBuf,
    key_path: PathBuf,
    pool: PathBuf,
    rm_port: u16,
    agent_port: u16,
    server_port: u16,
    rm: Proc,
    agent: Proc,
    server: Proc,
    engines: Vec<Proc>,
    engine_runs: usize,
    seed: u64,
    /// The agent's boot id file: a "reboot" writes a new boot id before the restart.
    boot_path: PathBuf,
    boots: usize,
}

const ENGINE_KEYS: u64 = 150;

impl Cluster {
    fn rm_args(&self) -> Vec<String> {
        vec![
            "--state-dir".into(),
            self.s.dir.join("rm").display().to_string(),
            // The RM's key (made on the first start); the agent and maru-server prove it.
            "--key-file".into(),
            self.rm_key().display().to_string(),
            "--fake-dax".into(),
            format!("{}:256M", self.pool.display()),
            // A dead maru-server's regions go back soon (its successor has a new id).
            "--grace-period-s".into(),
            "3".into(),
        ]
    }

    fn rm_key(&self) -> PathBuf {
        self.s.dir.join("rm.key")
    }

    /// maru-server's key (made on its first start); the engines prove it.
    fn server_key(&self) -> PathBuf {
        self.s.dir.join("server.key")
    }

    /// How the agent and maru-server reach the RM: its address and key file.
    fn rm_flags(&self) -> Vec<String> {
        vec![
            "--rm-address".into(),
            format!("127.0.0.1:{}", self.rm_port),
            "--rm-key-file".into(),
            self.rm_key().display().to_string(),
        ]
    }

    fn agent_args(&self) -> Vec<String> {
        let mut args = self.rm_flags();
        args.extend([
            "--key-file".into(),
            self.key_path.display().to_string(),
            "--device".into(),
            self.pool.display().to_string(),
            "--node".into(),
            "mem0".into(),
            "--quarantine-s".into(),
            "1".into(),
            "--boot-id-file".into(),
            self.boot_path.display().to_string(),
        ]);
        args
    }

    fn server_args(&self) -> Vec<String> {
        let mut args = self.rm_flags();
        args.extend([
            "--remote-cxl-agent".into(),
            format!("127.0.0.1:{}", self.agent_port),
            "--remote-cxl-agent-key-file".into(),
            self.key_path.display().to_string(),
            "--region-size".into(),
            "4M".into(),
            "--chunk-size".into(),
            "64K".into(),
            "--session-timeout-s".into(),
            "2".into(),
            "--lease-timeout-s".into(),
            "5".into(),
            "--key-file".into(),
            self.server_key().display().to_string(),
            // Its directory is durable: a restart keeps every key, and every load
            // after it is checked like the others.
            "--state-dir".into(),
            self.s.dir.join("server-state").display().to_string(),
        ]);
        args
    }

    fn bin(&self, name: &str) -> String {
        self.bin.join(name).display().to_string()
    }

    fn start_engine(&mut self, name: &str, peer: &str) -> Result<Proc, String> {
        self.engine_runs += 1;
        let n = self.engine_runs;
        let config = serde_json::json!({
            "backend": "remote_cxl",
            "server_url": format!("127.0.0.1:{}", self.server_port),
            "server_key_file": self.server_key().display().to_string(),
            "engine_id": format!("engine-{name}"),
            "namespace": "chaos",
            "agent_key_file": self.key_path.display().to_string(),
            "load_slots": 8,
            "store_slots": 16,
            "timeout_ms": 2000,
        })
        .to_string();
        let d = &self.s.dir;
        let args = vec![
            "engine".to_string(),
            "--name".into(),
            name.into(),
            "--peer".into(),
            peer.into(),
            "--config".into(),
            config,
            "--keys".into(),
            ENGINE_KEYS.to_string(),
            "--seed".into(),
            (self.seed ^ ((n as u64) << 32)).to_string(),
            "--stop-file".into(),
            d.join("stop").display().to_string(),
            "--stats-file".into(),
            d.join(format!("stats-{name}-{n}.json"))
                .display()
                .to_string(),
            "--mismatch-file".into(),
            d.join("mismatches.txt").display().to_string(),
            "--max-seconds".into(),
            "400".into(),
        ];
        let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
        Proc::spawn(
            &exe.display().to_string(),
            &args,
            &self.s.dir.join(format!("engine-{name}-{n}.log")),
        )
    }

    /// Writes the boot id the agent reports from its next start.
    fn write_boot_id(&self) -> Result<(), String> {
        std::fs::write(&self.boot_path, format!("chaos-boot-{}\n", self.boots))
            .map_err(|e| format!("{}: {e}", self.boot_path.display()))
    }

    /// kill -9 one of them and bring it back (same port, same state); `what` is
    /// "rm", "agent", "reboot" (the agent, back with a new boot id: its memory node
    /// rebooted, every key in it goes), "server" or "engine".
    fn kill_and_restart(&mut self, what: &str, pause: Duration) -> Result<(), String> {
        type Slot = fn(&mut Cluster) -> &mut Proc;
        let (slot, bin, args, port): (Slot, _, _, _) = match what {
            "rm" => (
                |c| &mut c.rm,
                "maru-resource-manager",
                self.rm_args(),
                self.rm_port,
            ),
            "agent" | "reboot" => (
                |c| &mut c.agent,
                "maru-remote-cxl-agent",
                self.agent_args(),
                self.agent_port,
            ),
            "server" => (
                |c| &mut c.server,
                "maru-server",
                self.server_args(),
                self.server_port,
            ),
            _ => {
                self.engines[0].kill9();
                std::thread::sleep(pause);
                self.engines[0] = self.start_engine("a", "b")?;
                return Ok(());
            }
        };
        slot(self).kill9();
        if what == "reboot" {
            self.boots += 1;
            self.write_boot_id()?;
        }
        std::thread::sleep(pause);
        *slot(self) = Proc::daemon_at(&self.bin(bin), &args, &self.s, port)?;
        Ok(())
    }
}

fn rm_client(port: u16, key: &std::path::Path) -> Result<Client, String> {
    let mut o = ClientOptions::new(RM, "chaos-observer");
    o.key = Some(maru::auth::load_key_file(key).map_err(|e| format!("RM key: {e}"))?);
    o.call_timeout = Duration::from_secs(5);
    Client::connect(&format!("127.0.0.1:{port}"), &o).map_err(|e| format!("RM: {e}"))
}

/// Region ids, and holds as (region id, node), at the RM.
type RmView = (Vec<u64>, Vec<(u64, String)>);

fn rm_view(rm: &mut Client) -> Result<RmView, String> {
    let regions = match rm.call(&RmRequest::Regions { owner: None }) {
        Ok(RmReply::Regions { regions }) => regions.iter().map(|r| r.region_id).collect(),
        other => return Err(format!("regions: {other:?}")),
    };
    let holds = match rm.call(&RmRequest::Holds { node: None }) {
        Ok(RmReply::Holds { holds }) => holds
            .iter()
            .map(|h| (h.region_id, h.node.clone()))
            .collect(),
        other => return Err(format!("holds: {other:?}")),
    };
    Ok((regions, holds))
}

#[derive(Default, Debug)]
struct Totals {
    stored: u64,
    loads_verified: u64,
    load_misses: u64,
    load_errors: u64,
    store_errors: u64,
    mismatches: u64,
    opens: u64,
}

fn totals(dir: &Path, name: &str) -> Totals {
    let mut t = Totals::default();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return t;
    };
    for e in rd.flatten() {
        let f = e.file_name().to_string_lossy().to_string();
        if !(f.starts_with(&format!("stats-{name}-")) && f.ends_with(".json")) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        let g = |k: &str| v[k].as_u64().unwrap_or(0);
        t.stored += g("stored");
        t.loads_verified += g("loads_verified");
        t.load_misses += g("load_misses");
        t.load_errors += g("load_errors");
        t.store_errors += g("store_errors");
        t.mismatches += g("mismatches");
        t.opens += g("opens");
    }
    t
}

fn run(o: &Opts) -> Result<(), String> {
    let started = Instant::now();
    println!(
        "chaos: seed {} (replay: CHAOS_SEED={} make chaos), {} kills",
        o.seed, o.seed, o.kills
    );
    let mut s = Scratch::new("chaos")?;
    let pool = s.shm_file("pool");
    let key_path = s.dir.join("agent.key");
    let key = SharedKey::generate().map_err(|e| format!("key: {e}"))?;
    write_new_key_file(&key_path, &key).map_err(|e| format!("key file: {e}"))?;
    let bin = o.bin_dir.clone();
    for b in [
        "maru-resource-manager",
        "maru-remote-cxl-agent",
        "maru-server",
    ] {
        if !bin.join(b).is_file() {
            return Err(format!(
                "{} not found: build the daemons first (cargo build -p maru-daemons --bins)",
                bin.join(b).display()
            ));
        }
    }
    // Ports: each daemon first starts on a free port, which it keeps across restarts.
    let mut c = Cluster {
        s,
        bin,
        key_path,
        pool,
        rm_port: 0,
        agent_port: 0,
        server_port: 0,
        rm: Proc::none(),
        agent: Proc::none(),
        server: Proc::none(),
        engines: Vec::new(),
        engine_runs: 0,
        seed: o.seed,
        boot_path: PathBuf::new(),
        boots: 0,
    };
    c.boot_path = c.s.dir.join("boot_id");
    c.write_boot_id()?;
    c.rm = Proc::daemon_at(&c.bin("maru-resource-manager"), &c.rm_args(), &c.s, 0)?;
    c.rm_port = c.rm.port;
    c.agent = Proc::daemon_at(&c.bin("maru-remote-cxl-agent"), &c.agent_args(), &c.s, 0)?;
    c.agent_port = c.agent.port;
    c.server = Proc::daemon_at(&c.bin("maru-server"), &c.server_args(), &c.s, 0)?;
    c.server_port = c.server.port;
    let a = c.start_engine("a", "b")?;
    let b = c.start_engine("b", "a")?;
    c.engines = vec![a, b];
    let result = exercise(&mut c, o, started);
    if result.is_err() {
        c.s.keep();
    }
    result
}

/// The kills, the recovery, the close and the checks.
fn exercise(c: &mut Cluster, o: &Opts, started: Instant) -> Result<(), String> {
    std::thread::sleep(Duration::from_secs(2));

    // The kill schedule: each victim equally often, in a seeded order, at seeded times.
    let mut rng = Rng::new(o.seed);
    let victims = ["agent", "server", "rm", "engine", "reboot"];
    let mut schedule: Vec<&str> = (0..o.kills).map(|i| victims[i % victims.len()]).collect();
    for i in (1..schedule.len()).rev() {
        let j = rng.range(0, i as u64 + 1) as usize;
        schedule.swap(i, j);
    }
    let mut kills: BTreeMap<&str, usize> = BTreeMap::new();
    let budget = Duration::from_secs(o.max_seconds);
    for (i, what) in schedule.iter().enumerate() {
        if started.elapsed() > budget {
            return Err(format!("ran out of time after {i} kills"));
        }
        std::thread::sleep(Duration::from_millis(rng.range(150, 900)));
        let pause = Duration::from_millis(rng.range(0, 300));
        c.kill_and_restart(what, pause)?;
        *kills.entry(what).or_default() += 1;
        if (i + 1) % 10 == 0 {
            // Mid-run, the RM never has a hold of a region it does not list.
            let (regions, holds) =
                rm_client(c.rm_port, &c.rm_key()).and_then(|mut rm| rm_view(&mut rm))?;
            if let Some(h) = holds.iter().find(|(r, _)| !regions.contains(r)) {
                return Err(format!(
                    "after {} kills the RM holds region {} for {} without listing it",
                    i + 1,
                    h.0,
                    h.1
                ));
            }
            let (ta, tb) = (totals(&c.s.dir, "a"), totals(&c.s.dir, "b"));
            println!(
                "chaos: {:>3} kills, {:>5.1} s: loads verified {}, mismatches {}, RM: {} regions, {} holds",
                i + 1,
                started.elapsed().as_secs_f64(),
                ta.loads_verified + tb.loads_verified,
                ta.mismatches + tb.mismatches,
                regions.len(),
                holds.len()
            );
        }
        // B is never killed: it must still be running.
        if !c.engines[1].is_running() {
            return Err(format!(
                "engine B exited during the run (log {})",
                c.engines[1].log.display()
            ));
        }
    }

    // Recovery: with everything back, both engines verify loads again.
    let before = totals(&c.s.dir, "b").loads_verified + totals(&c.s.dir, "a").loads_verified;
    let recovered = procs::wait_until(Duration::from_secs(30), || {
        totals(&c.s.dir, "b").loads_verified + totals(&c.s.dir, "a").loads_verified > before + 20
    });
    if !recovered {
        return Err("after the last kill the engines verified no more loads within 30 s".into());
    }

    // Close everything: engines first (they close their sessions), then maru-server
    // (SIGTERM: it keeps its regions for its next start; the RM reaps them after its
    // grace period, and the agent's sweep lets go of them).
    std::fs::write(c.s.dir.join("stop"), b"stop").map_err(|e| format!("stop file: {e}"))?;
    for (e, name) in c.engines.iter_mut().zip(["A", "B"]) {
        match e.wait_exit(Duration::from_secs(30)) {
            Some(0) => {}
            code => {
                return Err(format!(
                    "engine {name} ended with {code:?} (log {})",
                    e.log.display()
                ))
            }
        }
    }
    let server_exit = c.server.terminate(Duration::from_secs(30));
    if server_exit != Some(0) {
        return Err(format!("maru-server did not stop cleanly: {server_exit:?}"));
    }
    let mut rm = rm_client(c.rm_port, &c.rm_key())?;
    let mut view = rm_view(&mut rm)?;
    let drained = procs::wait_until(Duration::from_secs(60), || match rm_view(&mut rm) {
        Ok(v) => {
            let done = v.0.is_empty() && v.1.is_empty();
            view = v;
            done
        }
        Err(_) => false,
    });
    let (regions, holds) = view;
    let orphan_holds: Vec<_> = holds.iter().filter(|(r, _)| !regions.contains(r)).collect();

    let (ta, tb) = (totals(&c.s.dir, "a"), totals(&c.s.dir, "b"));
    let mismatch_lines =
        std::fs::read_to_string(c.s.dir.join("mismatches.txt")).unwrap_or_default();
    println!("chaos: summary (seed {})", o.seed);
    println!(
        "  kills: {} total; agent {} (with a new boot id {}), maru-server {}, rm {}, engine A {}",
        kills.values().sum::<usize>(),
        kills.get("agent").unwrap_or(&0),
        kills.get("reboot").unwrap_or(&0),
        kills.get("server").unwrap_or(&0),
        kills.get("rm").unwrap_or(&0),
        kills.get("engine").unwrap_or(&0)
    );
    for (n, t) in [("A", &ta), ("B", &tb)] {
        println!(
            "  engine {n}: opens {}, chunks stored {}, loads checked {}, misses {}, failed calls: store {} load {}, mismatches {}",
            t.opens, t.stored, t.loads_verified, t.load_misses, t.store_errors, t.load_errors, t.mismatches
        );
    }
    println!(
        "  loads checked {}, mismatches={}, regions left {}, holds left {} ({} without a region), {:.1} s",
        ta.loads_verified + tb.loads_verified,
        ta.mismatches + tb.mismatches,
        regions.len(),
        holds.len(),
        orphan_holds.len(),
        started.elapsed().as_secs_f64()
    );
    if ta.mismatches + tb.mismatches > 0 || !mismatch_lines.is_empty() {
        return Err(format!("loads returned wrong bytes:\n{mismatch_lines}"));
    }
    if ta.loads_verified + tb.loads_verified == 0 {
        return Err("no load was checked: the workload did not run".into());
    }
    if !drained {
        return Err(format!(
            "after everything closed the RM still has regions {regions:?} and holds {holds:?}"
        ));
    }
    let total_kills: usize = kills.values().sum();
    if total_kills < o.kills {
        return Err(format!("only {total_kills} of {} kills done", o.kills));
    }
    Ok(())
}
