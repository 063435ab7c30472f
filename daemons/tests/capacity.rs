//! A full cache keeps caching: two engine processes store ten times the pool's size
//! of prefix-chained chunks into a 256 MiB pool of 64 MiB regions. Once the pool is
//! full they evict their own keys (tails of chains first) instead of failing; their
//! most recent prompts all load back byte for byte; a third engine opened on the full
//! pool stores within two heartbeats (a fair share given back by the engine holding
//! the most); at the end every region is back at the RM and no hold is left.

mod support;

use maru::net::Client;
use maru::wire::rm::SERVICE as RM;
use maru::worker::Handler;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use support::{connect, wait_until, Stack};

const MIB: usize = 1 << 20;
const POOL: usize = 256 * MIB;
const CHUNK: usize = MIB;
/// Chunks of one prompt (one prefix chain).
const PROMPT: usize = 8;
/// Each engine stores five times the pool: together ten times.
const PROMPTS_PER_ENGINE: usize = 5 * POOL / CHUNK / PROMPT;
/// The most recent prompts each engine loads back at the end (32 MiB each: they fit
/// in one region with its spare pages; the pool's device header leaves room for
/// three regions of 64 MiB, so one engine's share is one region).
const RECENT: usize = 4;
/// maru-server's session timeout; workers heartbeat every third of it.
const SESSION_TIMEOUT_S: u64 = 3;

const ENGINE_ENV: &str = "MARU_TEST_CAPACITY_ENGINE";

fn key(engine: &str, prompt: usize, chunk: usize) -> String {
    format!("{engine}-p{prompt:04}-c{chunk}")
}

/// A chunk's bytes: every word names its engine, prompt, chunk and position, so a
/// page read back with another chunk's bytes (or a stale one) cannot pass.
fn chunk_bytes(engine: &str, prompt: usize, chunk: usize) -> Vec<u8> {
    let seed = engine.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let base = seed ^ ((prompt as u64) << 20) ^ ((chunk as u64) << 8);
    let mut out = Vec::with_capacity(CHUNK);
    for w in 0..(CHUNK / 8) as u64 {
        out.extend_from_slice(&(base.wrapping_add(w.wrapping_mul(0x9e37_79b9))).to_le_bytes());
    }
    out
}

fn store_prompt(h: &Handler, engine: &str, prompt: usize) -> Vec<bool> {
    let keys: Vec<String> = (0..PROMPT).map(|c| key(engine, prompt, c)).collect();
    let data: Vec<Vec<u8>> = (0..PROMPT)
        .map(|c| chunk_bytes(engine, prompt, c))
        .collect();
    let items = support::items(&keys, &data);
    h.store_batch(&items, Some(keys[0].as_str()))
        .unwrap_or_else(|e| panic!("{engine}: store of prompt {prompt} failed: {e}"))
}

/// Not a test by itself: one engine process of
/// `two_engines_store_ten_times_the_pool_and_a_third_gets_its_share`. Stores its
/// prompts, counts chunks not stored once it has stored its fair share, loads its
/// most recent prompts back, reports, then waits for the stop file before closing.
#[test]
#[ignore = "run as a child process by two_engines_store_ten_times_the_pool_and_a_third_gets_its_share"]
fn capacity_engine() {
    let Ok(cfg) = std::env::var(ENGINE_ENV) else {
        return;
    };
    let name = std::env::var("MARU_TEST_ENGINE_NAME").expect("engine name");
    let report = PathBuf::from(std::env::var("MARU_TEST_REPORT").expect("report path"));
    let stop = PathBuf::from(std::env::var("MARU_TEST_STOP").expect("stop path"));
    let h = Handler::open(&cfg).expect("the engine opens its handler");
    let share = POOL / 2 / CHUNK;
    let (mut stored, mut failed_after_fill) = (0usize, 0usize);
    for p in 0..PROMPTS_PER_ENGINE {
        let ok = store_prompt(&h, &name, p);
        let n = ok.iter().filter(|o| **o).count();
        if stored >= share {
            failed_after_fill += PROMPT - n;
        }
        stored += n;
    }
    let mut recent_missing = Vec::new();
    for p in PROMPTS_PER_ENGINE - RECENT..PROMPTS_PER_ENGINE {
        let keys: Vec<String> = (0..PROMPT).map(|c| key(&name, p, c)).collect();
        let got = h.load_batch(&keys, Some(keys[0].as_str())).expect("load");
        for (c, g) in got.into_iter().enumerate() {
            match g {
                Some(b) => assert!(
                    b == chunk_bytes(&name, p, c),
                    "{}: bytes differ",
                    key(&name, p, c)
                ),
                None => recent_missing.push(key(&name, p, c)),
            }
        }
    }
    let stats = h.stats();
    let out = serde_json::json!({
        "stored": stored,
        "failed_after_fill": failed_after_fill,
        "recent_missing": recent_missing,
        "stats": stats["total"],
    });
    std::fs::write(&report, out.to_string()).expect("write the report");
    // Stay alive (heartbeating, able to give a region back) until the test says so.
    let until = Instant::now() + Duration::from_secs(120);
    while !stop.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    h.close().expect("close");
}

/// maru-server's flags of these tests: regions of `region_size`, their chunk size and
/// session timeout.
fn server_args(region_size: &str) -> Vec<String> {
    [
        "--region-size",
        region_size,
        "--chunk-size",
        &format!("{}K", CHUNK >> 10),
        "--session-timeout-s",
        &SESSION_TIMEOUT_S.to_string(),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

fn stack() -> Stack {
    let args = server_args("64M");
    support::stack("capacity", &format!("{}M", POOL / MIB), true, &args)
}

fn config(st: &Stack, engine: &str) -> String {
    config_for(st, "remote_cxl", engine)
}

fn config_for(st: &Stack, backend: &str, engine: &str) -> String {
    st.handler_config(backend, engine, "capacity", (16, 16))
        .to_string()
}

fn rm_regions(rm: &mut Client) -> usize {
    support::rm_regions(rm).len()
}

fn rm_holds(rm: &mut Client) -> usize {
    support::rm_holds(rm).len()
}

fn spawn_engine(st: &Stack, name: &str, dir: &Path) -> (std::process::Child, PathBuf) {
    let report = dir.join(format!("{name}.json"));
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "capacity_engine", "--ignored", "--nocapture"])
        .env(ENGINE_ENV, config(st, name))
        .env("MARU_TEST_ENGINE_NAME", name)
        .env("MARU_TEST_REPORT", &report)
        .env("MARU_TEST_STOP", dir.join("stop"))
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    (child, report)
}

#[test]
fn two_engines_store_ten_times_the_pool_and_a_third_gets_its_share() {
    let st = stack();
    let mut engines: Vec<(String, std::process::Child, PathBuf)> = ["engine-a", "engine-b"]
        .iter()
        .map(|n| {
            let (c, r) = spawn_engine(&st, n, &st.s.dir);
            (n.to_string(), c, r)
        })
        .collect();
    let done = wait_until(Duration::from_secs(600), || {
        engines
            .iter_mut()
            .all(|(_, c, r)| r.exists() || matches!(c.try_wait(), Ok(Some(_))))
    });
    assert!(done, "the engines did not finish storing within 600 s");
    for (name, child, report) in &mut engines {
        let text = std::fs::read_to_string(&*report)
            .unwrap_or_else(|_| panic!("{name} exited without a report: {:?}", child.try_wait()));
        let r: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            r["failed_after_fill"], 0,
            "{name}: stores failed after the first fill: {r}"
        );
        assert_eq!(
            r["recent_missing"].as_array().map(Vec::len),
            Some(0),
            "{name}: its most recent prompts must all hit: {r}"
        );
        assert!(
            r["stats"]["evictions"].as_u64().unwrap_or(0) > 0,
            "{name} evicted to keep storing: {r}"
        );
    }
    // Both engines hold the whole pool now. A third one stores within two heartbeats.
    let c = Handler::open(&config(&st, "engine-c")).expect("engine C opens on the full pool");
    assert_eq!(c.stats()["total"]["regions"], 0, "opening took no region");
    let beat = Duration::from_millis(SESSION_TIMEOUT_S * 1000 / 3);
    let t = Instant::now();
    let mut p = 0;
    let stored = wait_until(2 * beat + Duration::from_secs(3), || {
        p += 1;
        store_prompt(&c, "engine-c", p).iter().all(|o| *o)
    });
    let took = t.elapsed();
    assert!(
        stored,
        "engine C could not store within {took:?} (two heartbeats are {:?}): {}",
        2 * beat,
        c.stats()
    );
    c.close().unwrap();
    std::fs::write(st.s.dir.join("stop"), b"").unwrap();
    for (name, child, _) in &mut engines {
        let ok = wait_until(Duration::from_secs(30), || {
            matches!(child.try_wait(), Ok(Some(_)))
        });
        assert!(ok, "{name} did not close");
        assert!(child.wait().unwrap().success(), "{name} failed");
    }
    // maru-server gives every kept region back on SIGTERM: then the RM holds nothing.
    let mut rm = connect(&st.rm.addr, RM, "capacity-test");
    let Stack { server, agent, .. } = st;
    assert_eq!(server.terminate(), Some(0), "maru-server stops cleanly");
    let empty = wait_until(Duration::from_secs(15), || {
        rm_regions(&mut rm) == 0 && rm_holds(&mut rm) == 0
    });
    assert!(
        empty,
        "every region back at the RM and no hold left: {} regions, {} holds",
        rm_regions(&mut rm),
        rm_holds(&mut rm)
    );
    drop(agent);
}

/// `max_bytes` caps what one engine holds: past it, its stores evict its own keys
/// instead of taking another region, and none of them fails (both backends).
#[test]
fn max_bytes_caps_the_regions_an_engine_holds_and_it_keeps_storing() {
    for backend in ["remote_cxl", "cxl"] {
        capped_engine_keeps_storing(backend);
    }
}

fn capped_engine_keeps_storing(backend: &str) {
    let st = stack();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&config_for(&st, backend, "capped")).unwrap();
    cfg["max_bytes"] = serde_json::json!(64 * MIB);
    let h = Handler::open(&cfg.to_string()).unwrap();
    let prompts = 3 * 64 / PROMPT; // three regions' worth
    for p in 0..prompts {
        let ok = store_prompt(&h, "capped", p);
        assert!(
            ok.iter().all(|o| *o),
            "{backend}: prompt {p} not stored: {}",
            h.stats()
        );
    }
    let t = &h.stats()["total"];
    assert_eq!(t["regions"], 1, "{backend}: {t}");
    assert!(t["evictions"].as_u64().unwrap() >= 64, "{backend}: {t}");
    let last: Vec<String> = (0..PROMPT).map(|c| key("capped", prompts - 1, c)).collect();
    assert!(h.exists_batch(&last, None).unwrap().iter().all(|f| *f));
    h.close().unwrap();
}

/// In a full pool a store makes room by evicting its own keys; after maru-server had
/// no region to give, it does not ask again at every eviction round but at most once
/// per 250 ms (each refused `expand` was a round trip before every eviction). One
/// cxl engine stores three times a 256 MiB pool of 8 MiB regions in 16 KiB chunks;
/// maru-server's metrics count the refused `expand`s. Seen failing with the back-off
/// removed (one refused `expand` per eviction round).
#[test]
fn a_full_pool_is_not_asked_for_a_region_at_every_eviction_round() {
    let port = support::free_port();
    let args: Vec<String> = [
        "--region-size",
        "8M",
        "--chunk-size",
        "16K",
        "--metrics",
        &format!("127.0.0.1:{port}"),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let st = support::stack("backoff", "256M", false, &args);
    let h = Handler::open(&config_for(&st, "cxl", "backoff")).unwrap();
    let chunk = vec![7u8; 16 << 10];
    let batches = 3 * POOL / (16 << 10) / 32;
    let t = Instant::now();
    for b in 0..batches {
        let keys: Vec<String> = (0..32).map(|i| format!("bo-{b}-{i}")).collect();
        let items: Vec<(&str, &[u8])> = keys.iter().map(|k| (k.as_str(), &chunk[..])).collect();
        assert_eq!(h.store_batch(&items, Some("bo")).unwrap(), vec![true; 32]);
    }
    let took = t.elapsed();
    let rounds = h.stats()["total"]["evictions"].as_u64().unwrap();
    let refused: f64 = support::scrape(port)
        .iter()
        .filter(|(s, _)| {
            s.starts_with("maru_server_requests_total{op=\"expand\"")
                && !s.contains("result=\"ok\"")
        })
        .map(|(_, v)| v)
        .sum();
    let allowed = 2.0 + took.as_millis() as f64 / 250.0;
    assert!(rounds > 0, "the pool filled and stores evicted");
    assert!(
        refused <= allowed,
        "{refused} refused expands in {took:?} ({rounds} keys evicted): at most one per 250 ms ({allowed})"
    );
}

/// Regions a handler's pool holds, as it knows them.
fn regions_of(h: &Handler) -> u64 {
    h.stats()["total"]["regions"].as_u64().unwrap_or(0)
}

/// A newcomer on a full pool shared by idle engines (issue 34): A fills the pool, B
/// stores as much after it (taking regions A sits idle in), both then stay open and
/// idle. C opens and its first store succeeds within 1 s (maru-server takes a region
/// of the engine furthest above its share that nobody is writing into, instead of
/// asking it at its next heartbeat); after C stored for 10 s the three hold equal
/// shares (±1 region). Both backends. Seen failing (C's first store skipped, 0 of 8)
/// with the idle-region take-back disabled in maru-server, and with shares [7, 3, 4]
/// (remote_cxl) with `FairShare::forget_satisfied` taken out: A, refused a region on
/// the pool it filled alone, stayed a waiter and was not asked for B's share.
#[test]
fn a_newcomer_on_a_pool_full_of_idle_engines_stores_within_a_second_and_shares_even_out() {
    for backend in ["remote_cxl", "cxl"] {
        newcomer_on_a_full_pool(backend);
    }
}

fn newcomer_on_a_full_pool(backend: &str) {
    let mut args = server_args("16M");
    // Shares are per principal (tenant): each engine its own tenant and namespace.
    let dir = std::env::temp_dir().join(format!("maru-newcomer-{backend}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut toml = String::new();
    for e in ["a", "b", "c"] {
        let k = dir.join(format!("{e}.key"));
        maru::auth::keyfile::write_new_key_file(&k, &maru::auth::SharedKey::generate().unwrap())
            .unwrap();
        toml.push_str(&format!(
            "[tenants.t{e}]\nkey_file = \"{e}.key\"\nwrite = [\"cap-{e}\"]\n\n"
        ));
    }
    let tenants = dir.join("tenants.toml");
    std::fs::write(&tenants, toml).unwrap();
    args.extend(["--tenants".to_string(), tenants.display().to_string()]);
    let st = support::stack("newcomer", &format!("{}M", POOL / MIB), true, &args);
    let open = |name: &str| {
        let e = &name[name.len() - 1..];
        let mut cfg: serde_json::Value =
            serde_json::from_str(&config_for(&st, backend, name)).unwrap();
        cfg["server_key_file"] = dir.join(format!("{e}.key")).display().to_string().into();
        cfg["namespace"] = format!("cap-{e}").into();
        Handler::open(&cfg.to_string()).unwrap()
    };
    // Each stores 1.5 times the pool: A fills it, B takes its share from idle A.
    let prompts = 3 * POOL / CHUNK / PROMPT / 2;
    let a = open("engine-a");
    for p in 0..prompts {
        store_prompt(&a, "engine-a", p);
    }
    let b = open("engine-b");
    for p in 0..prompts {
        store_prompt(&b, "engine-b", p);
    }
    // The set-up, not the claim: on a loaded machine B's first take-back can outlast
    // its request's 1 s wait and B backs off its expands; B goes on storing (at most
    // 30 s) until it holds a region, so that C meets two engines sharing the pool.
    let settle = Instant::now();
    let mut p = prompts;
    while regions_of(&b) == 0 && settle.elapsed() < Duration::from_secs(30) {
        store_prompt(&b, "engine-b", p);
        p += 1;
    }
    if p > prompts {
        println!(
            "{backend}: B stored {} more prompts ({:?}) before it held a region",
            p - prompts,
            settle.elapsed()
        );
    }
    let beat = Duration::from_millis(SESSION_TIMEOUT_S * 1000 / 3);
    std::thread::sleep(2 * beat);
    let (ra, rb) = (regions_of(&a), regions_of(&b));
    assert!(
        ra > 0 && rb > 0 && a.stats()["total"]["evictions"].as_u64() > Some(0),
        "{backend}: A and B share the full pool: {ra} and {rb} regions"
    );
    // C's first store, A and B idle.
    let c = open("engine-c");
    let t = Instant::now();
    let first = store_prompt(&c, "engine-c", 0);
    let took = t.elapsed();
    assert!(
        first.iter().all(|o| *o) && took < Duration::from_secs(1),
        "{backend}: C's first store on the full pool: {first:?} in {took:?}: {}",
        c.stats()
    );
    // C keeps storing for 10 s.
    let t = Instant::now();
    let mut p = 1;
    while t.elapsed() < Duration::from_secs(10) {
        store_prompt(&c, "engine-c", p);
        p += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    // A and B hear of the regions taken from them at their heartbeats.
    std::thread::sleep(2 * beat);
    let shares = [regions_of(&a), regions_of(&b), regions_of(&c)];
    let (min, max) = (
        shares.iter().min().copied().unwrap_or(0),
        shares.iter().max().copied().unwrap_or(0),
    );
    println!("{backend}: after 10 s the three engines hold {shares:?} regions");
    assert!(
        max - min <= 1,
        "{backend}: after 10 s the three engines hold equal shares (±1 region): {shares:?}"
    );
    let last: Vec<String> = (0..PROMPT).map(|k| key("engine-c", p - 1, k)).collect();
    assert!(
        c.exists_batch(&last, None).unwrap().iter().all(|f| *f),
        "{backend}: C's latest prompt is stored"
    );
    for h in [a, b, c] {
        h.close().unwrap();
    }
    drop(st);
    let _ = std::fs::remove_dir_all(&dir);
}

fn skipped(h: &Handler, reason: &str) -> u64 {
    h.stats()["total"]["skipped"][reason].as_u64().unwrap_or(0)
}

/// Every chunk a store skips is counted under its reason in the handler's stats
/// (issue 34): over `max_bytes` with every key of its region pinned, no region to be
/// had with every key pinned, and the pool unavailable (maru-server stopped). Seen
/// failing with the `pool_unavailable` count taken out of `store_on_pool` (0, not 8).
#[test]
fn skipped_chunks_are_counted_per_reason() {
    let args = support::strings(&["--region-size", "16M", "--chunk-size", "1024K"]);
    // Three regions of 16 MiB fit the 64 MiB pool beside its header.
    let st = support::stack("skips", "64M", false, &args);
    let open = |name: &str, max_bytes: usize| {
        let mut cfg: serde_json::Value =
            serde_json::from_str(&config_for(&st, "cxl", name)).unwrap();
        if max_bytes > 0 {
            cfg["max_bytes"] = serde_json::json!(max_bytes);
        }
        Handler::open(&cfg.to_string()).unwrap()
    };
    // `prompts` prompts of `engine` stored whole and every key of them pinned: the next
    // prompt is skipped, each of its chunks counted under `reason`.
    let fill_pin_and_skip = |h: &Handler, engine: &str, prompts: usize, reason: &str| {
        for p in 0..prompts {
            assert!(store_prompt(h, engine, p).iter().all(|o| *o));
        }
        let keys: Vec<String> = (0..prompts)
            .flat_map(|p| (0..PROMPT).map(move |c| key(engine, p, c)))
            .collect();
        assert!(h.pin_batch(&keys, None, true).unwrap().iter().all(|p| *p));
        assert_eq!(store_prompt(h, engine, prompts), vec![false; PROMPT]);
        assert_eq!(skipped(h, reason), PROMPT as u64, "{}", h.stats());
    };
    // Capped at one region, every key of it pinned: the next prompt is skipped.
    let capped = open("capped", 16 * MIB);
    fill_pin_and_skip(&capped, "capped", 2, "max_bytes");
    assert_eq!(skipped(&capped, "no_region"), 0);
    // The rest of the pool, every key pinned: no region to be had.
    let full = open("full", 0);
    fill_pin_and_skip(&full, "full", 4, "no_region");
    // maru-server stops: the pool is unavailable.
    let Stack { server, .. } = st;
    drop(server);
    assert_eq!(store_prompt(&full, "full", 5), vec![false; PROMPT]);
    assert_eq!(skipped(&full, "pool_unavailable"), PROMPT as u64);
    let t = &full.stats()["total"]["skipped"];
    assert_eq!(t["no_slot"], 0, "{t}");
    drop(capped);
    drop(full);
}
