//! A memory node that stalls instead of dying, as a C++ runtime meets it: one
//! `remote_cxl` handler (`timeout_ms` 2000) on two pools, each with its own
//! maru-server and agent; 4 threads store and load through it while one agent is
//! stalled for 40 s and then goes on.
//!
//! - `a_stopped_agent_costs_a_call_at_most_its_timeout`: the agent is SIGSTOPped (its
//!   sockets still accept connections and take bytes; nothing answers);
//! - `a_half_open_data_port_costs_a_call_at_most_its_timeout`: the agent's soft NIC is
//!   reached through a proxy that, for the stall, accepts connections and forwards
//!   nothing either way (the control port answers all along).
//!
//! Either way: no call returns later than 2 x its timeout (measured per call); the
//! handler's sessions never expire and no pool is set aside; the other pool keeps its
//! hit rate; and loads of the stalled pool hit again within 2 s of the end of the
//! stall.

mod support;

use maru::worker::{Handler, PoolRouter};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::Stack;

const CHUNK: usize = 64 * 1024;
const TIMEOUT_MS: u64 = 2000;
/// Chunks of one request.
const BATCH: usize = 4;
const THREADS: usize = 4;
/// When the stall starts, how long it lasts, and how long the run goes on after it.
const STALL_AT: Duration = Duration::from_secs(3);
const AFTER: Duration = Duration::from_secs(6);

/// How long the stall lasts: 40 s (`MARU_STALL_S` shortens it while working on this).
fn stall_for() -> Duration {
    let s = std::env::var("MARU_STALL_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    Duration::from_secs(s)
}

fn server_args() -> Vec<String> {
    ["--region-size", "8M", "--chunk-size", "64K"]
        .iter()
        .map(|a| a.to_string())
        .collect()
}

/// The bytes of `key` (their length and content derive from the key alone).
fn content(key: &str) -> Vec<u8> {
    support::key_bytes(key, CHUNK)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Store,
    Load,
}

/// One call: which pool, when it started (since the run's start), how long it took,
/// how many chunks it was for and how many it stored or found.
#[derive(Debug, Clone)]
struct Call {
    pool: usize,
    kind: Kind,
    start: Duration,
    took: Duration,
    asked: usize,
    got: usize,
    err: Option<String>,
}

impl Call {
    fn end(&self) -> Duration {
        self.start + self.took
    }
}

/// A route key per pool (the router's choice is by rendezvous hashing).
fn route_keys(urls: &[String]) -> Vec<String> {
    let router = PoolRouter::new(urls.to_vec());
    (0..urls.len())
        .map(|want| {
            (0..10_000)
                .map(|i| format!("route-{i}"))
                .find(|rk| router.pick(rk) == want)
                .expect("a route key for each pool")
        })
        .collect()
}

/// Thread `me`: store a batch into each pool in turn and load it back, until `stop`.
fn run_thread(h: &Handler, me: usize, rks: &[String], t0: Instant, stop: &AtomicBool) -> Vec<Call> {
    let mut calls = Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let pool = (n as usize + me) % rks.len();
        let keys: Vec<String> = (0..BATCH)
            .map(|c| format!("stall-t{me}-n{n}-c{c}"))
            .collect();
        n += 1;
        let data: Vec<Vec<u8>> = keys.iter().map(|k| content(k)).collect();
        let items = support::items(&keys, &data);
        let start = t0.elapsed();
        let r = h.store_batch(&items, Some(&rks[pool]));
        let took = t0.elapsed() - start;
        let stored: Vec<String> = match &r {
            Ok(ok) => keys
                .iter()
                .zip(ok)
                .filter(|(_, &s)| s)
                .map(|(k, _)| k.clone())
                .collect(),
            Err(_) => Vec::new(),
        };
        calls.push(Call {
            pool,
            kind: Kind::Store,
            start,
            took,
            asked: BATCH,
            got: stored.len(),
            err: r.err().map(|e| e.to_string()),
        });
        if stored.is_empty() {
            continue;
        }
        let start = t0.elapsed();
        let r = h.load_batch(&stored, Some(&rks[pool]));
        let took = t0.elapsed() - start;
        let mut got = 0;
        if let Ok(found) = &r {
            for (k, f) in stored.iter().zip(found) {
                if let Some(bytes) = f {
                    assert_eq!(
                        bytes,
                        &content(k),
                        "{k}: the loaded bytes are the stored ones"
                    );
                    got += 1;
                }
            }
        }
        calls.push(Call {
            pool,
            kind: Kind::Load,
            start,
            took,
            asked: stored.len(),
            got,
            err: r.err().map(|e| e.to_string()),
        });
    }
    calls
}

/// Every 100 ms: each pool is up and keeps the session it opened with.
fn watch_sessions(h: &Handler, stop: &AtomicBool) -> Vec<String> {
    let sessions = |s: &serde_json::Value| -> Vec<(bool, Option<u64>, Option<String>)> {
        s["pools"]
            .as_array()
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        (
                            p["up"].as_bool() == Some(true),
                            p["session"].as_u64(),
                            p["instance"].as_str().map(str::to_string),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let first = sessions(&h.stats());
    let mut seen = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let now = sessions(&h.stats());
        if now != first {
            seen.push(format!("sessions {first:?} became {now:?}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    seen
}

/// Runs the load with pool 0's memory node stalled by `stall(true)` from
/// `STALL_AT` for `stall_for()`, released by `stall(false)`, and checks the outcome.
fn stalled_run(stacks: &[Stack], stall: &dyn Fn(bool)) {
    let urls: Vec<String> = stacks.iter().map(|s| s.server.addr.clone()).collect();
    let cfg = serde_json::json!({
        "backend": "remote_cxl",
        "server_url": urls.join(","),
        "server_key_file": support::server_key_file(&urls[0]),
        "engine_id": "stalled",
        "namespace": "stall",
        "agent_key_file": stacks[0].key_path.display().to_string(),
        "load_slots": 64,
        "store_slots": 64,
        "timeout_ms": TIMEOUT_MS,
    })
    .to_string();
    let h = Handler::open(&cfg).unwrap();
    let rks = route_keys(&urls);
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let stall_len = stall_for();
    let released_at: Mutex<Option<Duration>> = Mutex::new(None);
    let (calls, session_changes) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|me| {
                let (h, rks, stop) = (&h, &rks, &stop);
                s.spawn(move || run_thread(h, me, rks, t0, stop))
            })
            .collect();
        let watcher = s.spawn(|| watch_sessions(&h, &stop));
        std::thread::sleep(STALL_AT);
        stall(true);
        std::thread::sleep(stall_len);
        stall(false);
        *released_at.lock().unwrap() = Some(t0.elapsed());
        std::thread::sleep(AFTER);
        stop.store(true, Ordering::SeqCst);
        let calls: Vec<Call> = workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        (calls, watcher.join().unwrap())
    });
    let released = released_at.lock().unwrap().expect("the stall ended");
    let slowest = calls.iter().map(|c| c.took).max().unwrap_or_default();
    let errors = calls.iter().filter(|c| c.err.is_some()).count();
    eprintln!(
        "{} calls, the slowest {slowest:?}, {errors} answered with an error",
        calls.len()
    );
    let stalled_from = STALL_AT;
    let limit = Duration::from_millis(2 * TIMEOUT_MS);
    support::assert_none(
        &calls,
        |c| c.took > limit,
        &format!("calls took longer than 2 x timeout_ms ({limit:?})"),
    );
    assert!(
        session_changes.is_empty(),
        "a pool was set aside or its session changed: {:?}",
        &session_changes[..session_changes.len().min(4)]
    );
    // The other pool during the stall: every load of what it stored hits.
    let during = |c: &&Call| c.start >= stalled_from && c.end() <= released;
    let other: Vec<&Call> = calls
        .iter()
        .filter(|c| c.pool == 1 && c.kind == Kind::Load)
        .filter(during)
        .collect();
    let (asked, got) = other
        .iter()
        .fold((0, 0), |(a, g), c| (a + c.asked, g + c.got));
    assert!(
        other.len() >= 20,
        "only {} loads of the other pool in {stall_len:?} of stall",
        other.len()
    );
    assert!(
        got as f64 >= 0.98 * asked as f64,
        "the other pool's loads hit {got} of {asked} chunks during the stall"
    );
    let stores_b = calls
        .iter()
        .filter(|c| c.pool == 1 && c.kind == Kind::Store)
        .filter(during)
        .fold((0, 0), |(a, g), c| (a + c.asked, g + c.got));
    assert!(
        stores_b.1 as f64 >= 0.98 * stores_b.0 as f64,
        "the other pool stored {} of {} chunks during the stall",
        stores_b.1,
        stores_b.0
    );
    // The stalled pool after the stall: a load that hits, within 2 s.
    let back = calls
        .iter()
        .filter(|c| c.pool == 0 && c.kind == Kind::Load && c.got == c.asked && c.got > 0)
        .map(Call::end)
        .filter(|&end| end > released)
        .min();
    let back = back.map(|b| b - released);
    assert!(
        back.is_some_and(|b| b <= Duration::from_secs(2)),
        "loads of the stalled pool hit again {back:?} after the stall ended (calls of pool 0 \
         after it: {:#?})",
        calls
            .iter()
            .filter(|c| c.pool == 0 && c.end() > released)
            .take(8)
            .collect::<Vec<_>>()
    );
    h.close().unwrap();
}

/// Two stacks sharing one agent key (a handler has one agent key file).
fn two_stacks(tag: &str, agent_extra: impl FnOnce(&support::Scratch) -> Vec<String>) -> Vec<Stack> {
    let key = maru::auth::SharedKey::generate().unwrap();
    let a = support::stack_keyed(
        support::Scratch::new(&format!("{tag}-a")),
        "256M",
        true,
        &key,
        agent_extra,
        &server_args(),
    );
    // The handler proves one maru-server key to both pools: b's server uses a's key.
    let mut b_server = server_args();
    b_server.push("--key-file".into());
    b_server.push(support::server_key_file(&a.server.addr));
    let b = support::stack_keyed(
        support::Scratch::new(&format!("{tag}-b")),
        "256M",
        true,
        &key,
        |_| Vec::new(),
        &b_server,
    );
    vec![a, b]
}

/// SIGSTOP of pool 0's agent for 40 s, then SIGCONT.
#[test]
fn a_stopped_agent_costs_a_call_at_most_its_timeout() {
    let stacks = two_stacks("stall-stop", |_| Vec::new());
    let agent = stacks[0].agent.as_ref().unwrap();
    let stall = |on: bool| agent.signal(if on { libc::SIGSTOP } else { libc::SIGCONT });
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stalled_run(&stacks, &stall)
    }));
    // Never leave a stopped process behind.
    agent.signal(libc::SIGCONT);
    if let Err(e) = r {
        std::panic::resume_unwind(e);
    }
}

/// A proxy in front of a soft NIC: passes bytes both ways (half-closes passed on)
/// until `stalled` is set; then it forwards nothing either way and accepts new
/// connections without answering them, until `stalled` is cleared again.
fn half_open_proxy(listen: &str, to: &str, stalled: Arc<AtomicBool>, life: Duration) {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let listener = TcpListener::bind(listen).unwrap();
    let to = to.to_string();
    let hold = |stalled: &AtomicBool| {
        while stalled.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let pump = move |mut from: TcpStream, mut into: TcpStream, stalled: Arc<AtomicBool>| {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                hold(&stalled);
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                hold(&stalled);
                if into.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = into.shutdown(Shutdown::Write);
        });
    };
    support::accept_for(listener, life, move |client| {
        let (to, stalled) = (to.clone(), stalled.clone());
        std::thread::spawn(move || {
            // Accepted, and nothing answers while stalled.
            hold(&stalled);
            let Ok(daemon) = TcpStream::connect(&to) else {
                return;
            };
            if let (Ok(c2), Ok(d2)) = (client.try_clone(), daemon.try_clone()) {
                pump(client, daemon, stalled.clone());
                pump(d2, c2, stalled);
            }
        });
    });
}

/// Pool 0's agent advertises its soft NIC at 127.0.0.2 (a proxy, same port) and
/// listens on 127.0.0.1; the proxy goes half-open for 40 s.
#[test]
fn a_half_open_data_port_costs_a_call_at_most_its_timeout() {
    let port = support::free_port();
    let stalled = Arc::new(AtomicBool::new(false));
    half_open_proxy(
        &format!("127.0.0.2:{port}"),
        &format!("127.0.0.1:{port}"),
        stalled.clone(),
        Duration::from_secs(300),
    );
    let stacks = two_stacks("stall-halfopen", |_| {
        [
            "--host",
            "127.0.0.1",
            "--data-port",
            &port.to_string(),
            "--advertise",
            "127.0.0.2",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    });
    let stall = |on: bool| stalled.store(on, Ordering::SeqCst);
    stalled_run(&stacks, &stall);
}

/// maru-server stalled (issue 32): every maru-server call a request makes (exists,
/// alloc, publish, acquire...) ends by the request's deadline (`timeout_ms` from its
/// start), so a stalled maru-server costs a request about its timeout, however many
/// calls it makes or connections it opens. The engine reaches maru-server through a
/// proxy. Two stalls: maru-server SIGSTOPped for 3 s (no store, load or exists
/// returns later than 2 x its timeout), then 5 s in which the proxy holds every
/// session request 800 ms (each call alone answers within its own timeout, but a
/// store's calls add up to 1.6 s or more unless they share the request's deadline:
/// none may take more than 1.5 x the timeout). Then the pool stores and loads again.
#[test]
fn a_stalled_maru_server_costs_a_call_at_most_its_timeout() {
    const T_MS: u64 = 1000;
    let st = support::stack("stall-server", "64M", false, &server_args());
    let slow = Arc::new(AtomicBool::new(false));
    let (proxy, held) = support::holding_proxy(
        &st.server.addr,
        b"\"session\":",
        slow.clone(),
        Duration::from_millis(800),
        Duration::from_secs(120),
    );
    // maru-server reached through the proxy, with its key file.
    let mut cfg = st.handler_config("cxl", "stall-server-engine", "default", (4, 8));
    cfg["server_url"] = proxy.into();
    cfg["timeout_ms"] = T_MS.into();
    let h = Handler::open(&cfg.to_string()).expect("open");
    // 48 chunks a store: more than the pool's spare pages, so a store makes several
    // maru-server calls (exists, alloc, expand or evict, publish).
    let batch = |tag: &str| -> (Vec<String>, Vec<Vec<u8>>) {
        let keys: Vec<String> = (0..48).map(|c| format!("stall-server-{tag}-{c}")).collect();
        let data = keys.iter().map(|k| content(k)).collect();
        (keys, data)
    };
    let store =
        |keys: &[String], data: &[Vec<u8>]| h.store_batch(&support::items(keys, data), None);
    let (before, before_data) = batch("before");
    assert_eq!(store(&before, &before_data).unwrap(), vec![true; 48]);

    let mut worst = Duration::ZERO;
    let mut calls = 0;
    let mut n = 0;
    let mut run_for = |d: Duration, limit: Duration, phase: &str| {
        let t0 = Instant::now();
        while t0.elapsed() < d {
            let (keys, data) = batch(&format!("{phase}-{n}"));
            n += 1;
            for what in ["store", "load", "exists"] {
                let start = Instant::now();
                let r = match what {
                    "store" => store(&keys, &data).map(|_| ()),
                    "load" => h.load_batch(&before, None).map(|_| ()),
                    _ => h.exists_batch(&before, None).map(|_| ()),
                };
                let took = start.elapsed();
                calls += 1;
                worst = worst.max(took);
                assert!(
                    took <= limit,
                    "{phase}: {what} took {took:?} (timeout {T_MS} ms): {r:?}"
                );
            }
        }
    };
    st.server.signal(libc::SIGSTOP);
    run_for(
        Duration::from_secs(3),
        Duration::from_millis(2 * T_MS),
        "stopped",
    );
    st.server.signal(libc::SIGCONT);
    slow.store(true, Ordering::SeqCst);
    run_for(
        Duration::from_secs(5),
        Duration::from_millis(3 * T_MS / 2),
        "slow",
    );
    slow.store(false, Ordering::SeqCst);
    eprintln!(
        "{calls} calls with maru-server stalled ({} requests held), the slowest {worst:?}",
        held.load(Ordering::SeqCst)
    );
    // The pool comes back: stores are stored and the chunks stored before load.
    let t0 = Instant::now();
    let back = support::wait_until(Duration::from_secs(30), || {
        let (keys, data) = batch(&format!("after-{}", t0.elapsed().as_millis()));
        let stored = store(&keys, &data).is_ok_and(|s| s == vec![true; 48]);
        let loaded = h.load_batch(&before, None).is_ok_and(|got| {
            got.iter()
                .zip(&before_data)
                .all(|(g, d)| g.as_ref() == Some(d))
        });
        stored && loaded
    });
    assert!(
        back,
        "the pool did not store and load again within 30 s of the stall"
    );
    drop(h);
}
