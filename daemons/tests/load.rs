//! Load: 64 engines (sessions) at once against one maru-server and one remote CXL
//! agent (RM, fake DAX, soft transport on loopback). Every session stores its own
//! checksummed chunks, then loads its own and a neighbour's: no call fails, no key is
//! lost, every byte is what was stored. The daemons' memory (from /proc) is sampled
//! throughout: a second identical round must not grow it (bounded, no leak per op).
//! Prints the figures (ops, seconds, RSS).

mod support;

use maru::auth::SharedKey;
use maru::net::{Client, ClientOptions};
use maru::wire::agent::{AgentReply, AgentRequest, SERVICE as AGENT};
use maru::wire::rm::{RmReply, RmRequest, SERVICE as RM};
use maru::worker::Handler;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};
use support::{connect, wait_until, Daemon, Scratch, SERVER_BIN};

const SESSIONS: usize = 64;
const KEYS: usize = 32;
const CHUNK: usize = 64 * 1024;

/// The bytes stored under `key`: 1 KiB to a chunk, from the key's SHA-256.
fn chunk_of(key: &str) -> Vec<u8> {
    let d = Sha256::digest(key.as_bytes());
    let len = 1024 + (u16::from_le_bytes([d[0], d[1]]) as usize) % (CHUNK - 1024);
    let mut out = Vec::with_capacity(len + 32);
    let mut block = d.to_vec();
    while out.len() < len {
        block = Sha256::digest(&block).to_vec();
        out.extend_from_slice(&block);
    }
    out.truncate(len);
    out
}

/// (VmRSS, RssAnon) of a process in KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("RssAnon:"))
}

#[derive(Default, Clone, Copy, Debug)]
struct Peak {
    rss: u64,
    anon: u64,
}

/// Samples the daemons' memory every 50 ms until `stop`.
fn sampler(pids: Vec<u32>, stop: Arc<AtomicBool>, peaks: Arc<Mutex<Vec<Peak>>>) {
    while !stop.load(Ordering::Relaxed) {
        for (i, &pid) in pids.iter().enumerate() {
            let (rss, anon) = rss_kib(pid);
            let mut p = peaks.lock().unwrap();
            p[i].rss = p[i].rss.max(rss);
            p[i].anon = p[i].anon.max(anon);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// (mappings, registrations) at the agent now.
fn agent_tables(addr: &str, key: &SharedKey) -> (usize, usize) {
    let mut o = ClientOptions::new(AGENT, "load-observer");
    o.key = Some(key.clone());
    let mut c = Client::connect(addr, &o).expect("agent connect");
    match c.call(&AgentRequest::Status).expect("status") {
        AgentReply::Status(s) => (
            s.mappings.len(),
            s.mappings.iter().map(|m| m.registrations).sum(),
        ),
        r => panic!("{r:?}"),
    }
}

struct Round {
    stores: usize,
    loads: usize,
    secs: f64,
}

/// Every session stores its keys of `round`, then (after all stored) loads its own
/// and its neighbour's; panics on any error, missing key or wrong byte.
fn round(handlers: &[Handler], round: usize) -> Round {
    let t = Instant::now();
    let barrier = Barrier::new(handlers.len());
    let key = |s: usize, k: usize| format!("r{round}-s{s:02}-k{k:02}");
    std::thread::scope(|scope| {
        for (s, h) in handlers.iter().enumerate() {
            let barrier = &barrier;
            scope.spawn(move || {
                let keys: Vec<String> = (0..KEYS).map(|k| key(s, k)).collect();
                let data: Vec<Vec<u8>> = keys.iter().map(|k| chunk_of(k)).collect();
                for part in keys.iter().zip(&data).collect::<Vec<_>>().chunks(8) {
                    let items: Vec<(&str, &[u8])> = part
                        .iter()
                        .map(|(k, d)| (k.as_str(), d.as_slice()))
                        .collect();
                    let ok = h
                        .store_batch(&items, Some("load"))
                        .unwrap_or_else(|e| panic!("session {s}: store: {e}"));
                    assert!(ok.iter().all(|&x| x), "session {s}: a store was skipped");
                }
                barrier.wait();
                let peer = (s + 1) % SESSIONS;
                let mut want: Vec<String> = keys.clone();
                want.extend((0..KEYS).map(|k| key(peer, k)));
                for part in want.chunks(16) {
                    let got = h
                        .load_batch(part, Some("load"))
                        .unwrap_or_else(|e| panic!("session {s}: load: {e}"));
                    for (k, g) in part.iter().zip(got) {
                        let g = g.unwrap_or_else(|| {
                            let st = &h.stats()["pools"][0]["stats"];
                            panic!(
                                "session {s}: key {k} lost (hits {}, misses {}, load_failed {}, last_load_error {}, skipped {})",
                                st["hits"], st["misses"], st["load_failed"], st["last_load_error"], st["skipped"]
                            )
                        });
                        assert!(g == chunk_of(k), "session {s}: key {k}: wrong bytes");
                    }
                }
            });
        }
    });
    Round {
        stores: handlers.len() * KEYS,
        loads: handlers.len() * KEYS * 2,
        secs: t.elapsed().as_secs_f64(),
    }
}

#[test]
fn sixty_four_sessions_store_and_load_without_errors_lost_keys_or_growing_memory() {
    let started = Instant::now();
    let mut s = Scratch::new("load");
    let support::MemoryNode {
        pool: _,
        key_path,
        key,
        agent,
        rm,
    } = support::memory_node(&mut s, "512M");
    let server = Daemon::start(
        SERVER_BIN,
        &[
            "--rm-address".into(),
            rm.addr.clone(),
            "--region-size".into(),
            "4M".into(),
            "--chunk-size".into(),
            "64K".into(),
            "--remote-cxl-agent".into(),
            agent.addr.clone(),
            "--remote-cxl-agent-key-file".into(),
            key_path.display().to_string(),
        ],
        &s.dir,
    );
    let pids = vec![rm.child.id(), agent.child.id(), server.child.id()];
    let idle: Vec<(u64, u64)> = pids.iter().map(|&p| rss_kib(p)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let peaks = Arc::new(Mutex::new(vec![Peak::default(); pids.len()]));
    let sampling = {
        let (pids, stop, peaks) = (pids.clone(), stop.clone(), peaks.clone());
        std::thread::spawn(move || sampler(pids, stop, peaks))
    };

    let handlers: Vec<Handler> = std::thread::scope(|scope| {
        let opens: Vec<_> = (0..SESSIONS)
            .map(|i| {
                let config = serde_json::json!({
                    "backend": "remote_cxl",
                    "server_url": server.addr,
                    "server_key_file": support::server_key_file(&server.addr),
                    "engine_id": format!("load-engine-{i:02}"),
                    "namespace": "load",
                    "agent_key_file": key_path.display().to_string(),
                    "load_slots": 4,
                    "store_slots": 8,
                })
                .to_string();
                scope.spawn(move || Handler::open(&config).expect("open a session"))
            })
            .collect();
        opens.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = round(&handlers, 1);
    let after_first: Vec<(u64, u64)> = pids.iter().map(|&p| rss_kib(p)).collect();
    let tables_first = agent_tables(&agent.addr, &key);
    let second = round(&handlers, 2);
    let after_second: Vec<(u64, u64)> = pids.iter().map(|&p| rss_kib(p)).collect();
    let tables_second = agent_tables(&agent.addr, &key);
    // Keys of round 1 are all still there after round 2.
    let keys1: Vec<String> = (0..SESSIONS)
        .flat_map(|s| (0..KEYS).map(move |k| format!("r1-s{s:02}-k{k:02}")))
        .collect();
    for part in keys1.chunks(64) {
        let found = handlers[0].exists_batch(part, Some("load")).unwrap();
        assert!(found.iter().all(|&x| x), "a key of round 1 was lost");
    }
    // Loading round 1's chunks again (each session its neighbour's, as in round 1)
    // reuses the read registrations made then: the agent's tables do not grow.
    std::thread::scope(|scope| {
        for (s, h) in handlers.iter().enumerate() {
            let keys = &keys1[((s + 1) % SESSIONS) * KEYS..][..KEYS];
            scope.spawn(move || {
                for part in keys.chunks(16) {
                    let got = h.load_batch(part, Some("load")).expect("reload");
                    for (k, g) in part.iter().zip(got) {
                        assert!(g.as_deref() == Some(&chunk_of(k)[..]), "reload of {k}");
                    }
                }
            });
        }
    });
    let tables_reload = agent_tables(&agent.addr, &key);
    assert_eq!(
        tables_reload, tables_second,
        "loading the same chunks again added registrations at the agent"
    );
    for h in &handlers {
        h.close().expect("close");
    }
    drop(handlers);
    stop.store(true, Ordering::Relaxed);
    sampling.join().unwrap();
    let peaks = peaks.lock().unwrap().clone();

    println!(
        "load: {SESSIONS} sessions; round 1: {} stores + {} loads in {:.2} s; round 2: {} + {} in {:.2} s; total {:.1} s",
        first.stores,
        first.loads,
        first.secs,
        second.stores,
        second.loads,
        second.secs,
        started.elapsed().as_secs_f64()
    );
    println!(
        "load: agent tables (mappings, registrations): after round 1 {tables_first:?}, after round 2 {tables_second:?}, after reloading round 1 {tables_reload:?}"
    );
    for (i, name) in [
        "maru-resource-manager",
        "maru-remote-cxl-agent",
        "maru-server",
    ]
    .iter()
    .enumerate()
    {
        println!(
            "load: {name:<22} RSS idle {:>6} KiB, peak {:>6} KiB (anon: idle {:>6}, after round 1 {:>6}, after round 2 {:>6}, peak {:>6} KiB)",
            idle[i].0, peaks[i].rss, idle[i].1, after_first[i].1, after_second[i].1, peaks[i].anon
        );
    }
    for (i, name) in ["RM", "agent", "maru-server"].iter().enumerate() {
        // Heap bounded: far below what the data moved (4 MiB per session), and the
        // second round (same work again) does not add more than a few MiB.
        assert!(
            peaks[i].anon < 128 * 1024,
            "{name}: anonymous memory peaked at {} KiB",
            peaks[i].anon
        );
        let growth = after_second[i].1.saturating_sub(after_first[i].1);
        assert!(
            growth < 8 * 1024,
            "{name}: anonymous memory grew by {growth} KiB in a round that repeats the first"
        );
    }
    // Everything closed: stopping maru-server gives every region back.
    let mut rmc = connect(&rm.addr, RM, "load-observer");
    assert_eq!(server.terminate(), Some(0));
    assert!(wait_until(Duration::from_secs(40), || matches!(
        rmc.call(&RmRequest::Regions { owner: None }),
        Ok(RmReply::Regions { regions }) if regions.is_empty()
    )));
    // A bound against hangs, not a benchmark (make bench measures): on a loaded
    // 2-core machine the run above takes 25-130 s.
    assert!(
        started.elapsed() < Duration::from_secs(400),
        "the load test took {:?}",
        started.elapsed()
    );
    drop(agent);
    drop(rm);
    drop(s);
}
