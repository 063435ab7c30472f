//! maru-server restarts without emptying the cache (`--state-dir`), against real
//! daemons on loopback: RM on a fake DAX pool, one agent (soft transport), maru-server
//! with a durable directory, and four engines storing, two `cxl` and two
//! `remote_cxl`. maru-server is killed (SIGKILL, or stopped with SIGTERM) in the
//! middle of their stores and started again on its port with the same directory.
//!
//! A chunk's bytes are a function of its key, so every load is checked: a load is a
//! miss or exactly those bytes. The rules of the durable directory have unit tests in
//! `libmaru/src/meta/durable_tests.rs`; the tests here show them end to end.

mod support;

use maru::worker::Handler;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{wait_until, Stack};

const CHUNK: usize = 16 << 10;

fn server_args(state: &std::path::Path) -> Vec<String> {
    [
        "--region-size",
        "4M",
        "--chunk-size",
        "16K",
        "--session-timeout-s",
        "20",
        "--state-dir",
        &state.display().to_string(),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

/// The state directory of a test's maru-server, removed when the test ends.
struct StateDir(std::path::PathBuf);

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn stack(tag: &str) -> (Stack, StateDir) {
    let dir = std::env::temp_dir().join(format!("maru-durable-state-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let st = support::stack(tag, "512M", true, &server_args(&dir));
    (st, StateDir(dir))
}

/// The bytes of a key: a function of the key only.
fn chunk(key: &str) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let seed = Sha256::digest(key.as_bytes());
    let mut v = Vec::with_capacity(CHUNK);
    let mut block = seed.to_vec();
    while v.len() < CHUNK {
        block = Sha256::digest(&block).to_vec();
        v.extend_from_slice(&block);
    }
    v.truncate(CHUNK);
    v
}

fn config(st: &Stack, engine: &str, backend: &str) -> String {
    serde_json::json!({
        "backend": backend,
        "server_url": st.server.addr,
        "server_key_file": support::server_key_file(&st.server.addr),
        "engine_id": engine,
        "namespace": "durable-test",
        "agent_key_file": st.key_path.display().to_string(),
        "load_slots": 8,
        "store_slots": 16,
        "timeout_ms": 2000,
    })
    .to_string()
}

/// What one engine stored: each key with when its store was acknowledged.
#[derive(Default)]
struct Acked {
    keys: Vec<(String, Instant)>,
    /// First store acknowledged after the restart.
    first_after: Option<Instant>,
}

struct Engines {
    handlers: Vec<Arc<Handler>>,
    acked: Vec<Arc<Mutex<Acked>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    restarted: Arc<Mutex<Option<Instant>>>,
}

/// Four engines storing batches of 8 chunks under keys of their own, as fast as
/// they can, until stopped.
fn start_engines(st: &Stack) -> Engines {
    let stop = Arc::new(AtomicBool::new(false));
    let restarted: Arc<Mutex<Option<Instant>>> = Arc::default();
    let mut e = Engines {
        handlers: Vec::new(),
        acked: Vec::new(),
        stop: stop.clone(),
        threads: Vec::new(),
        restarted: restarted.clone(),
    };
    for (i, backend) in ["cxl", "remote_cxl", "cxl", "remote_cxl"]
        .iter()
        .enumerate()
    {
        let name = format!("engine-{i}-{backend}");
        let h = Arc::new(Handler::open(&config(st, &name, backend)).unwrap());
        let acked: Arc<Mutex<Acked>> = Arc::default();
        let (h2, a2, stop2, rs) = (h.clone(), acked.clone(), stop.clone(), restarted.clone());
        let route = format!("e{i}");
        e.threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop2.load(Ordering::SeqCst) {
                let keys: Vec<String> = (0..8).map(|j| format!("{route}/k{}", n + j)).collect();
                n += 8;
                let data: Vec<Vec<u8>> = keys.iter().map(|k| chunk(k)).collect();
                let items: Vec<(&str, &[u8])> = keys
                    .iter()
                    .zip(&data)
                    .map(|(k, d)| (k.as_str(), d.as_slice()))
                    .collect();
                let Ok(stored) = h2.store_batch(&items, Some(&route)) else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let now = Instant::now();
                let mut a = a2.lock().unwrap();
                for (k, ok) in keys.iter().zip(stored) {
                    if ok {
                        a.keys.push((k.clone(), now));
                        let after = rs.lock().unwrap().is_some_and(|t| now >= t);
                        if after && a.first_after.is_none() {
                            a.first_after = Some(now);
                        }
                    }
                }
                if a.keys.len() >= 6000 {
                    break; // enough for this engine; the pool is not to fill up
                }
                drop(a);
                std::thread::sleep(Duration::from_millis(2));
            }
        }));
        e.handlers.push(h);
        e.acked.push(acked);
    }
    e
}

impl Engines {
    fn total(&self) -> usize {
        self.acked
            .iter()
            .map(|a| a.lock().unwrap().keys.len())
            .sum()
    }

    fn finish(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

/// Loads every acknowledged key (by a fresh reader of each backend and by its own
/// engine) until at least `min_loads` loads: (loads, hits, wrong bytes), and per key
/// whether any load found it.
fn load_all(
    st: &Stack,
    e: &Engines,
    min_loads: usize,
) -> (usize, usize, usize, BTreeMap<String, bool>) {
    let readers: Vec<Handler> = ["cxl", "remote_cxl"]
        .iter()
        .map(|b| Handler::open(&config(st, &format!("reader-{b}"), b)).unwrap())
        .collect();
    let (mut loads, mut hits, mut wrong) = (0, 0, 0);
    let mut found: BTreeMap<String, bool> = BTreeMap::new();
    let mut round = 0;
    while loads < min_loads || round == 0 {
        for (i, a) in e.acked.iter().enumerate() {
            let keys: Vec<String> = a
                .lock()
                .unwrap()
                .keys
                .iter()
                .map(|(k, _)| k.clone())
                .collect();
            let route = format!("e{i}");
            let who: &Handler = match round % 3 {
                0 => &e.handlers[i],
                r => &readers[r - 1],
            };
            for k in &keys {
                loads += 1;
                let got = who.load(k, Some(&route)).ok().flatten();
                let hit = got.is_some();
                if let Some(b) = got {
                    hits += 1;
                    if b != chunk(k) {
                        wrong += 1;
                    }
                }
                let f = found.entry(k.clone()).or_insert(false);
                *f |= hit;
            }
        }
        round += 1;
    }
    (loads, hits, wrong, found)
}

/// Kills (or stops) maru-server mid-load, starts it again on its port with the same
/// directory, and checks every load.
fn restart_mid_load(tag: &str, sigterm: bool) {
    let _ = env_logger::builder().is_test(true).try_init();
    let (mut st, _state) = stack(tag);
    let mut e = start_engines(&st);
    assert!(
        wait_until(Duration::from_secs(60), || e.total() >= 4000),
        "the engines store ({} keys)",
        e.total()
    );
    let killed = Instant::now();
    let port = st.server.port();
    let args = st.server_args.clone();
    if sigterm {
        let pid = st.server.child.id() as i32;
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let status = st.server.child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "a clean stop");
    } else {
        let _ = st.server.child.kill();
        let _ = st.server.child.wait();
    }
    st.server = support::Daemon::start_at(support::SERVER_BIN, &args, &st.s.dir, port);
    let back = Instant::now();
    *e.restarted.lock().unwrap() = Some(back);
    eprintln!(
        "maru-server {} and back in {:?}",
        if sigterm {
            "stopped (SIGTERM)"
        } else {
            "killed"
        },
        back - killed
    );
    // Every engine stores again within 2 s of the server being back.
    let all_back = wait_until(Duration::from_secs(10), || {
        e.acked
            .iter()
            .all(|a| a.lock().unwrap().first_after.is_some())
    });
    let firsts: Vec<Duration> = e
        .acked
        .iter()
        .map(|a| {
            a.lock()
                .unwrap()
                .first_after
                .map_or(Duration::MAX, |t| t - back)
        })
        .collect();
    eprintln!("first store after the restart, per engine: {firsts:?}");
    assert!(all_back, "every engine stores again: {firsts:?}");
    assert!(
        firsts.iter().all(|d| *d <= Duration::from_secs(2)),
        "every engine stores again within 2 s: {firsts:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    e.finish();
    let (loads, hits, wrong, found) = load_all(&st, &e, 10_000);
    // Keys acknowledged a second or more before the kill (all, after a SIGTERM).
    let old: Vec<String> = e
        .acked
        .iter()
        .flat_map(|a| {
            a.lock()
                .unwrap()
                .keys
                .iter()
                .filter(|(_, t)| sigterm || *t + Duration::from_secs(1) <= killed)
                .map(|(k, _)| k.clone())
                .collect::<Vec<_>>()
        })
        .collect();
    let old_found = old.iter().filter(|k| found.get(*k) == Some(&true)).count();
    eprintln!(
        "{loads} loads, {hits} hits, {wrong} wrong; {old_found} of {} keys acknowledged before \
         the {} load again; {} keys in all",
        old.len(),
        if sigterm {
            "stop"
        } else {
            "kill (by 1 s or more)"
        },
        found.len()
    );
    assert_eq!(wrong, 0, "every load is a miss or the key's own bytes");
    assert!(loads >= 10_000);
    assert!(!old.is_empty());
    if sigterm {
        assert_eq!(old_found, old.len(), "after SIGTERM every key loads");
    } else {
        assert!(
            old_found * 100 >= old.len() * 99,
            "at least 99 % of the keys acknowledged 1 s before the kill load: {old_found} of {}",
            old.len()
        );
    }
    for h in e.handlers.drain(..) {
        if let Ok(h) = Arc::try_unwrap(h) {
            h.close().unwrap();
        }
    }
}

#[test]
fn a_killed_maru_server_restarts_with_its_keys_and_every_load_is_exact() {
    restart_mid_load("kill", false);
}

#[test]
fn a_stopped_maru_server_restarts_with_every_key() {
    restart_mid_load("term", true);
}
