//! One handler, many threads, against real daemons (RM on fake DAX, agent,
//! maru-server on loopback):
//! - a region that vanishes between a store's copy and its publish is never published
//!   into, and nothing more is written into it;
//! - 8 threads on one handler mix store / load / exists / remove / slots / views for a
//!   bounded time while the agent and maru-server restart once: every loaded byte is
//!   checked (a chunk's bytes derive from its key), every slot comes back once, and a
//!   watchdog fails the test with each thread's state if one is stuck;
//! - one thread's remote transfer stuck on the wire, its `map_read` held at the agent,
//!   or its region being taken does not hold another thread of the handler.

mod support;

use maru::worker::Handler;
use maru::worker::SlotPool;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::Stack;

const CHUNK: usize = 64 * 1024;

fn server_args() -> Vec<String> {
    ["--region-size", "8M", "--chunk-size", "64K"]
        .iter()
        .map(|a| a.to_string())
        .collect()
}

fn config(st: &Stack, backend: &str, engine: &str) -> String {
    let mut c = st.handler_config(backend, engine, "stress", (16, 16));
    c["timeout_ms"] = 4000.into();
    c.to_string()
}

/// A cxl storage session of engine `engine` at the stack's maru-server, for tests that
/// drive a pool directly.
fn cxl_session(st: &Stack, engine: &str) -> maru::worker::session::Session {
    maru::worker::session::Session::open(
        &st.server.addr,
        engine,
        support::server_key(&st.server.addr),
        engine,
        "stress",
        "default",
        maru::wire::meta::Backend::Cxl,
        Duration::from_secs(10),
    )
    .unwrap()
}

/// The bytes of `key`: its length and content derive from the key alone, so any
/// reader can check what it loaded.
fn content(key: &str) -> Vec<u8> {
    support::key_bytes(key, CHUNK)
}

/// remote_cxl: a request's transfers hold no lock of the handler while they are on the
/// wire. One thread's store is stuck mid-payload (the soft NIC holds its WRITE's data
/// back 1.5 s); another thread of the same handler loads a stored chunk meanwhile,
/// and that load completes at once (its READ goes on the peer's other lane, planned
/// and settled under the mover's short lock). Seen failing with transfers run under
/// the pool's mover lock again (the load waited for the stuck store: 1.3 s).
#[test]
fn a_stuck_remote_store_does_not_hold_a_load_of_another_thread() {
    use maru::transport::soft::SoftTransport;
    let st = support::stack("stress-stuck", "256M", true, &server_args());
    let key = maru::auth::load_key_file(&st.key_path).unwrap();
    let nic = Arc::new(SoftTransport::new("stuck-writer", Some(key)).with_lanes(2));
    let h = Handler::open_with_transport(&config(&st, "remote_cxl", "stuck"), nic.clone()).unwrap();
    let a = content("stuck-a");
    assert!(h.store("stuck-a", &a, Some("stuck")).unwrap());
    let stall = Duration::from_millis(1500);
    nic.inject_payload_stall(stall);
    let b = content("stuck-b");
    let (load_took, stored_b) = std::thread::scope(|s| {
        let (h, b) = (&h, &b);
        let storer = s.spawn(move || {
            let t = Instant::now();
            let r = h.store("stuck-b", b, Some("stuck"));
            (r, t.elapsed())
        });
        // The store's WRITE is on the wire by now, its payload held back.
        std::thread::sleep(Duration::from_millis(200));
        let took = timed_load(h, "stuck-a", "stuck", &a);
        let (r, store_took) = storer.join().unwrap();
        assert!(
            store_took >= stall,
            "the store was held back ({store_took:?}): else the test shows nothing"
        );
        (took, r.unwrap())
    });
    assert!(stored_b, "the stuck store completes once its payload goes");
    assert!(
        load_took < Duration::from_millis(700),
        "a load beside a store stuck on the wire took {load_took:?}"
    );
    nic.inject_payload_stall(Duration::ZERO);
    assert_eq!(
        h.load("stuck-b", Some("stuck")).unwrap().as_deref(),
        Some(b.as_slice())
    );
}

/// A `remote_cxl` stack whose regions name a proxy in front of the agent that holds
/// back `delay` what workers send on their control and probe connections containing
/// `needle`, while the flag returned is set (the soft data connections go straight to
/// the agent); with the proxy's count of held messages.
fn stack_behind_holding_proxy(
    tag: &str,
    needle: &'static [u8],
    delay: Duration,
) -> (Stack, Arc<AtomicBool>, Arc<AtomicUsize>) {
    let mut st = support::stack(tag, "256M", true, &server_args());
    let agent = st.agent.as_ref().map(|a| a.addr.clone()).unwrap();
    let slow = Arc::new(AtomicBool::new(false));
    let (proxy, held) =
        support::holding_proxy(&agent, needle, slow.clone(), delay, Duration::from_secs(60));
    for a in st.server_args.iter_mut() {
        if *a == agent {
            *a = proxy.clone();
        }
    }
    st.restart_server();
    (st, slow, held)
}

/// Loads `key` (namespace `ns`) with `h`, checks the bytes are `want`, and says how
/// long the load took.
fn timed_load(h: &Handler, key: &str, ns: &str, want: &[u8]) -> Duration {
    let t = Instant::now();
    let got = h.load(key, Some(ns)).unwrap();
    let took = t.elapsed();
    assert_eq!(got.as_deref(), Some(want), "{key}: the loaded bytes");
    took
}

/// A `remote_cxl` handler of engine `engine` on `st` that stored `key` (its
/// `content`, in namespace `ns`) and loaded it back once, so that its peer at the
/// agent is connected before a test's clock starts; with the bytes.
fn handler_with_one_chunk(st: &Stack, engine: &str, key: &str, ns: &str) -> (Handler, Vec<u8>) {
    let h = Handler::open(&config(st, "remote_cxl", engine)).unwrap();
    let bytes = content(key);
    assert!(h.store(key, &bytes, Some(ns)).unwrap());
    assert_eq!(
        h.load(key, Some(ns)).unwrap().as_deref(),
        Some(bytes.as_slice())
    );
    (h, bytes)
}

/// remote_cxl: the first load of a range of another engine's region maps it for
/// reading at its agent (`map_read`), a round trip that holds no lock of the handler.
/// The agent is reached through a proxy that holds `map_read` requests back 1.5 s;
/// while one thread's load of the writer's chunk waits for its `map_read`, another
/// thread of the same handler loads the reader's own chunk (no `map_read`: its own
/// region) and that completes at once. Seen failing with the `map_read` made under
/// the mover's state lock again (the own load waited 1.3 s).
#[test]
fn a_slow_map_read_does_not_hold_a_load_of_another_thread() {
    let delay = Duration::from_millis(1500);
    let (st, slow, _) = stack_behind_holding_proxy("stress-mapread", b"map_read", delay);
    let writer = Handler::open(&config(&st, "remote_cxl", "mapread-writer")).unwrap();
    let w = content("mapread-w");
    assert!(writer.store("mapread-w", &w, Some("mapread")).unwrap());
    let (reader, r) = handler_with_one_chunk(&st, "mapread-reader", "mapread-r", "mapread");
    slow.store(true, Ordering::SeqCst);
    let own_took = std::thread::scope(|s| {
        let (reader, w) = (&reader, &w);
        let other = s.spawn(move || {
            let t = Instant::now();
            let got = reader.load("mapread-w", Some("mapread")).unwrap();
            (got, t.elapsed())
        });
        // The other thread's map_read is held at the proxy by now.
        std::thread::sleep(Duration::from_millis(200));
        let took = timed_load(reader, "mapread-r", "mapread", &r);
        let (got, other_took) = other.join().unwrap();
        assert_eq!(
            got.as_deref(),
            Some(w.as_slice()),
            "the writer's chunk's bytes"
        );
        assert!(
            other_took >= delay,
            "the map_read was held back ({other_took:?}): else the test shows nothing"
        );
        took
    });
    assert!(
        own_took < Duration::from_millis(700),
        "a load of an own chunk beside a map_read held at the agent took {own_took:?}"
    );
    // Mapped once: the next load of the writer's chunk sends no map_read (the proxy
    // still holds them back).
    let t = Instant::now();
    assert_eq!(
        reader
            .load("mapread-w", Some("mapread"))
            .unwrap()
            .as_deref(),
        Some(w.as_slice())
    );
    let again = t.elapsed();
    assert!(
        again < Duration::from_millis(700),
        "a second load of the same range took {again:?}"
    );
    slow.store(false, Ordering::SeqCst);
}

/// The `map` of a region a store takes (at the agent a hold at the RM and a NIC
/// registration: on verbs that pins the region, tens of milliseconds for 256 MiB)
/// does not hold the handler's other requests. Maps are held 1.5 s at a proxy in
/// front of the agent; while one thread stores more chunks than its regions hold
/// (it takes new ones), another thread's load of a chunk stored before completes at
/// once. Seen failing with the map made under the mover's state lock again (the load
/// waited 1.4 s).
#[test]
fn a_slow_map_of_a_region_taken_does_not_hold_a_load_of_another_thread() {
    let delay = Duration::from_millis(1500);
    let (st, slow, held) = stack_behind_holding_proxy("stress-adoptmap", b"\"op\":\"map\",", delay);
    let (h, first) = handler_with_one_chunk(&st, "adoptmap", "adoptmap-0", "adoptmap");
    slow.store(true, Ordering::SeqCst);
    // 300 chunks of up to 64 KiB: more than two regions of 8 MiB hold.
    let keys: Vec<String> = (1..=300).map(|i| format!("adoptmap-{i}")).collect();
    let data: Vec<Vec<u8>> = keys.iter().map(|k| content(k)).collect();
    let took = std::thread::scope(|s| {
        let (h, keys, data) = (&h, &keys, &data);
        let storer = s.spawn(move || {
            let t = Instant::now();
            let stored: Vec<bool> = keys
                .iter()
                .zip(data)
                .map(|(k, d)| h.store(k, d, Some("adoptmap")).unwrap())
                .collect();
            (stored, t.elapsed())
        });
        assert!(
            support::wait_until(Duration::from_secs(10), || held.load(Ordering::SeqCst) > 0),
            "no map reached the agent: the store took no region"
        );
        // The map is held at the proxy now, for 1.5 s.
        std::thread::sleep(Duration::from_millis(100));
        let took = timed_load(h, "adoptmap-0", "adoptmap", &first);
        let (stored, storer_took) = storer.join().unwrap();
        assert_eq!(stored, vec![true; keys.len()], "every chunk of the store");
        assert!(
            storer_took >= delay,
            "the store's map was held back ({storer_took:?}): else the test shows nothing"
        );
        took
    });
    assert!(
        took < Duration::from_millis(700),
        "a load beside the map of a region being taken took {took:?}"
    );
    slow.store(false, Ordering::SeqCst);
    for (k, d) in keys.iter().zip(&data).step_by(37) {
        assert_eq!(
            h.load(k, Some("adoptmap")).unwrap().as_deref(),
            Some(d.as_slice()),
            "{k}"
        );
    }
}

/// The tick's probes of an agent (every second while it answers) do not hold the
/// handler's requests: probes are held 900 ms at a proxy in front of the agent (just
/// under the probe's 1 s timeout, an agent slow to answer), and a load and a store in
/// the meantime complete at once. Seen failing with the probe made under the mover's
/// state lock again, with the pool's tick made under its mover lock (the load waited
/// for the probe each time), and with the tick's probes made under the publish gate
/// (the store waited).
#[test]
fn a_slow_probe_does_not_hold_a_load_or_a_store() {
    let delay = Duration::from_millis(900);
    // The probe is an unmap of region u64::MAX.
    let (st, slow, held) =
        stack_behind_holding_proxy("stress-probe", b"18446744073709551615", delay);
    let (h, first) = handler_with_one_chunk(&st, "probed", "probed-0", "probed");
    slow.store(true, Ordering::SeqCst);
    let (mut load_took, mut store_took) = (Duration::ZERO, Duration::ZERO);
    for i in 1..=2 {
        let before = held.load(Ordering::SeqCst);
        assert!(
            support::wait_until(Duration::from_secs(10), || held.load(Ordering::SeqCst)
                > before),
            "no probe reached the agent in 10 s"
        );
        // A probe is held at the proxy now, for 900 ms.
        std::thread::sleep(Duration::from_millis(100));
        load_took = load_took.max(timed_load(&h, "probed-0", "probed", &first));
        let key = format!("probed-{i}");
        let t = Instant::now();
        assert!(h.store(&key, &content(&key), Some("probed")).unwrap());
        store_took = store_took.max(t.elapsed());
    }
    slow.store(false, Ordering::SeqCst);
    assert!(
        load_took < Duration::from_millis(350),
        "a load beside a probe held at the agent took {load_took:?}"
    );
    assert!(
        store_took < Duration::from_millis(350),
        "a store beside a probe held at the agent took {store_took:?}"
    );
    for i in 1..=2 {
        let key = format!("probed-{i}");
        assert_eq!(
            h.load(&key, Some("probed")).unwrap(),
            Some(content(&key)),
            "{key}"
        );
    }
}

/// A store that gets pages of a region another store of the pool is taking (its
/// `expand` answered by maru-server, the answer not yet read by the pool, its
/// adoption not done) waits for the adoption before it writes: maru-server allocates
/// from any region of the session. The second region's answer is held back 400 ms
/// before the pool notes it; a store on another thread that finds the first region
/// full gets pages of the second; every chunk of both stores is stored. Seen failing
/// with the wait removed (10 chunks written into a region that had no mapping yet,
/// so not stored), and with the wait keyed on answers already noted (`adopting`)
/// instead of expands in flight: the other store's 6 chunks were not stored — the
/// race that stopped `make bench` on a store "skipped" with every skip counter at 0
/// (its pages were dropped silently then; now they are freed, others looked for,
/// and what is still missing counted). Before the hook ran ahead of the answer
/// being noted, and the flag was reset after the first region, this test did not
/// reach that window.
#[test]
fn a_store_given_pages_of_a_region_being_taken_waits_for_its_adoption() {
    use maru::worker::pool::StoragePool;
    let st = support::stack("stress-adopt", "256M", false, &server_args());
    let session = cxl_session(&st, "adopter");
    let adopting = Arc::new(AtomicBool::new(false));
    let a = adopting.clone();
    let pool = StoragePool::open(session, maru::worker::movers::cxl(false))
        .unwrap()
        .with_test_hooks(maru::worker::pool::TestHooks {
            before_adopt: Some(Box::new(move |_| {
                a.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(400));
            })),
            ..Default::default()
        });
    // 8 MiB regions of 64 KiB pages: 128 pages each (the first region is taken by
    // the first store; the second when the first is full).
    let keys: Vec<String> = (0..144).map(|i| format!("adopt-{i}")).collect();
    let data: Vec<Vec<u8>> = keys.iter().map(|k| content(k)).collect();
    let items = support::items(&keys, &data);
    // The first region full.
    assert_eq!(
        pool.store(&items[..128], Some("adopt")).unwrap(),
        vec![true; 128]
    );
    // The first region's adoption passed the hook too: only the next one counts.
    adopting.store(false, Ordering::SeqCst);
    std::thread::scope(|s| {
        let pool = &pool;
        let taker = s.spawn(|| pool.store(&items[128..138], Some("adopt")).unwrap());
        // The taker is adopting the second region now.
        assert!(support::wait_until(Duration::from_secs(5), || adopting.load(Ordering::SeqCst)));
        let other = pool.store(&items[138..], Some("adopt")).unwrap();
        assert_eq!(
            other,
            vec![true; 6],
            "every chunk of the waiting store is stored"
        );
        assert_eq!(taker.join().unwrap(), vec![true; 10]);
    });
    let found = pool.exists(&keys).unwrap();
    assert_eq!(found, vec![true; keys.len()]);
    let stats = pool.stats();
    assert_eq!(
        stats.regions, 2,
        "the waiting store wrote into the region being taken, not into a third ({stats:?})"
    );
    assert_eq!(stats.skipped.total(), 0, "{stats:?}");
}

/// A store whose region goes between its copy and its publish: maru-server takes
/// the region back from the session (returned under it) and the pool hears it at a
/// heartbeat, both in the pool's test hook, after the bytes were written. The pool
/// re-checks its regions before publishing: the chunk is not stored, not found, and
/// the next stores write into another region. (Checked to fail with the re-check
/// removed: the publish then names a region that is not the session's, maru-server
/// refuses it, and the store fails instead of answering "not stored".)
#[test]
fn a_region_lost_between_copy_and_publish_is_not_published_into() {
    use maru::worker::pool::StoragePool;
    let st = support::stack("stress-loss", "256M", false, &server_args());
    let session = cxl_session(&st, "loser");
    let lost: Arc<Mutex<Option<u64>>> = Arc::default();
    let written: Arc<Mutex<Vec<u64>>> = Arc::default();
    let (l, w) = (lost.clone(), written.clone());
    let hook: maru::worker::pool::BeforePublish = Box::new(
        move |pool: &StoragePool, pages: &[maru::wire::meta::PageGrant]| {
            w.lock().unwrap().extend(pages.iter().map(|p| p.region_id));
            let mut l = l.lock().unwrap();
            if l.is_none() {
                let id = pages[0].region_id;
                *l = Some(id);
                // maru-server no longer counts the region as the session's...
                pool.session
                    .return_region(id, false, pool.session.call_deadline())
                    .unwrap();
                // ...and the pool hears it (as from the background thread's heartbeat).
                pool.heartbeat(pool.session.call_deadline()).unwrap();
            }
        },
    );
    let pool = StoragePool::open(session, maru::worker::movers::cxl(true))
        .unwrap()
        .with_spare_pages(8)
        .with_test_hooks(maru::worker::pool::TestHooks {
            before_publish: Some(hook),
            ..Default::default()
        });
    let first = content("lost-0");
    let r = pool.store(&[("lost-0", &first)], Some("loss"));
    assert_eq!(
        r.expect("a store whose region was lost before its publish answers, it does not fail"),
        vec![false],
        "the chunk written into a region lost before its publish is not stored"
    );
    let lost_id = lost.lock().unwrap().expect("the hook ran");
    let s = pool.stats();
    assert_eq!(s.regions_lost, 1);
    assert_eq!(s.store_skipped, 1);
    assert_eq!(s.stored, 0);
    assert_eq!(pool.exists(&["lost-0".to_string()]).unwrap(), vec![false]);
    // Later stores go to another region, never to the lost one.
    written.lock().unwrap().clear();
    let keys: Vec<String> = (1..6).map(|i| format!("lost-{i}")).collect();
    let data: Vec<Vec<u8>> = keys.iter().map(|k| content(k)).collect();
    let items = support::items(&keys, &data);
    assert_eq!(pool.store(&items, Some("loss")).unwrap(), vec![true; 5]);
    let after = written.lock().unwrap().clone();
    assert!(!after.is_empty());
    assert!(
        !after.contains(&lost_id),
        "nothing is written into region {lost_id} after its loss (wrote into {after:?})"
    );
    let reader = Handler::open(&config(&st, "cxl", "reader")).unwrap();
    assert_eq!(
        reader
            .exists_batch(&["lost-0".to_string()], Some("loss"))
            .unwrap(),
        vec![false]
    );
    for (k, d) in keys.iter().zip(&data) {
        assert_eq!(
            reader.load(k, Some("loss")).unwrap().as_deref(),
            Some(d.as_slice())
        );
    }
    reader.close().unwrap();
    pool.close(pool.session.call_deadline()).unwrap();
}

/// What each worker thread is doing now, for the watchdog.
struct Doing {
    what: Mutex<Vec<(String, Instant)>>,
}

impl Doing {
    fn set(&self, t: usize, what: String) {
        if let Ok(mut w) = self.what.lock() {
            w[t] = (what, Instant::now());
        }
    }
}

/// Counters of the run (what was checked).
#[derive(Default)]
struct Tally {
    stored: AtomicU64,
    loaded: AtomicU64,
    bytes_checked: AtomicU64,
    removed: AtomicU64,
    slot_rounds: AtomicU64,
    views: AtomicU64,
    errors: AtomicU64,
}

/// Keys the threads use: a small space, so that stores, loads and removes of
/// different threads meet on the same keys.
fn key(thread: u64, n: u64) -> String {
    format!("s{thread}-k{n}")
}

const KEYS_PER_THREAD: u64 = 48;
const THREADS: usize = 8;

fn check(key: &str, got: &[u8], t: &Tally) {
    let want = content(key);
    assert!(
        got == want.as_slice(),
        "{key}: loaded {} bytes that are not the key's ({} bytes)",
        got.len(),
        want.len()
    );
    t.loaded.fetch_add(1, Ordering::Relaxed);
    t.bytes_checked
        .fetch_add(got.len() as u64, Ordering::Relaxed);
}

/// An error a request may answer while a daemon restarts (a bug: anything else).
fn tolerable(e: &maru::worker::WorkerError, t: &Tally) {
    use maru::worker::WorkerError as E;
    match e {
        E::InvalidArgument(m) => panic!("a request was refused as invalid: {m}"),
        E::Closed => panic!("the handler answered closed while open"),
        _ => {
            t.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One thread's work until `stop`: a random mix of the handler's calls.
fn worker(h: &Handler, me: usize, views: bool, stop: &AtomicBool, doing: &Doing, t: &Tally) {
    let mut rng = support::Rng(0x9E37_79B9_7F4A_7C15 ^ ((me as u64 + 1) << 32));
    let rk = |k: &str| k.to_string();
    while !stop.load(Ordering::Relaxed) {
        let op = rng.below(if views { 8 } else { 7 });
        let n = 1 + rng.below(4);
        let owner = if rng.below(2) == 0 {
            me as u64
        } else {
            rng.below(THREADS as u64)
        };
        let base = rng.below(KEYS_PER_THREAD);
        let keys: Vec<String> = (0..n)
            .map(|i| key(owner, (base + i) % KEYS_PER_THREAD))
            .collect();
        let route = rk(&keys[0]);
        doing.set(me, format!("op {op} on {keys:?}"));
        match op {
            0 | 1 => {
                let data: Vec<Vec<u8>> = keys.iter().map(|k| content(k)).collect();
                let items = support::items(&keys, &data);
                match h.store_batch(&items, Some(&route)) {
                    Ok(r) => {
                        t.stored
                            .fetch_add(r.iter().filter(|&&x| x).count() as u64, Ordering::Relaxed);
                    }
                    Err(e) => tolerable(&e, t),
                }
            }
            2 => match h.load_batch(&keys, Some(&route)) {
                Ok(got) => {
                    for (k, g) in keys.iter().zip(got) {
                        if let Some(g) = g {
                            check(k, &g, t);
                        }
                    }
                }
                Err(e) => tolerable(&e, t),
            },
            3 => {
                let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; CHUNK]).collect();
                let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                match h.load_into(&keys, &mut refs, Some(&route)) {
                    Ok(got) => {
                        for ((k, g), b) in keys.iter().zip(got).zip(&bufs) {
                            match g {
                                maru::worker::Loaded::Bytes(len) => check(k, &b[..len], t),
                                maru::worker::Loaded::TooSmall(len) => {
                                    panic!("{k}: {len} bytes do not fit a chunk")
                                }
                                maru::worker::Loaded::Miss => {}
                            }
                        }
                    }
                    Err(e) => tolerable(&e, t),
                }
            }
            4 => {
                if rng.below(2) == 0 {
                    if let Err(e) = h.exists_batch(&keys, Some(&route)) {
                        tolerable(&e, t);
                    }
                } else {
                    match h.remove_batch(&keys, Some(&route)) {
                        Ok(r) => {
                            let gone = r
                                .iter()
                                .filter(|x| **x == maru::wire::meta::RemoveResult::Removed)
                                .count();
                            t.removed.fetch_add(gone as u64, Ordering::Relaxed);
                        }
                        Err(e) => tolerable(&e, t),
                    }
                }
            }
            5 => slot_store(h, &keys, &route, t),
            6 => slot_load(h, &keys, &route, t),
            _ => match h.acquire_views(&keys, Some(&route)) {
                Ok(vs) => {
                    let mut ids = Vec::new();
                    for (k, v) in keys.iter().zip(vs) {
                        if let Some(v) = v {
                            // SAFETY: the view's bytes stay the key's until released.
                            let b = unsafe { std::slice::from_raw_parts(v.ptr, v.len) };
                            check(k, b, t);
                            ids.push(v.id);
                        }
                    }
                    t.views.fetch_add(ids.len() as u64, Ordering::Relaxed);
                    h.release_views(&ids).expect("views are released once");
                }
                Err(e) => tolerable(&e, t),
            },
        }
    }
    doing.set(me, "done".into());
}

/// Store through staging slots: take, fill, store, give back (each slot once).
fn slot_store(h: &Handler, keys: &[String], route: &str, t: &Tally) {
    let slots = match h.acquire_slots(SlotPool::Store, keys.len(), Duration::from_secs(2)) {
        Ok(s) => s,
        Err(e) => return tolerable(&e, t),
    };
    let keys = &keys[..slots.len()];
    let mut lens = Vec::new();
    for (k, s) in keys.iter().zip(&slots) {
        let d = content(k);
        // SAFETY: the slot is the caller's until released.
        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), s.ptr, d.len()) };
        lens.push(d.len());
    }
    let ids: Vec<u64> = slots.iter().map(|s| s.id).collect();
    match h.store_slots(keys, &ids, &lens, Some(route)) {
        Ok(r) => {
            t.stored
                .fetch_add(r.iter().filter(|&&x| x).count() as u64, Ordering::Relaxed);
        }
        Err(e) => tolerable(&e, t),
    }
    h.release_slots(&ids).expect("slots are released once");
    t.slot_rounds.fetch_add(1, Ordering::Relaxed);
}

fn slot_load(h: &Handler, keys: &[String], route: &str, t: &Tally) {
    let slots = match h.acquire_slots(SlotPool::Load, keys.len(), Duration::from_secs(2)) {
        Ok(s) => s,
        Err(e) => return tolerable(&e, t),
    };
    let keys = &keys[..slots.len()];
    let ids: Vec<u64> = slots.iter().map(|s| s.id).collect();
    match h.load_slots(keys, &ids, Some(route)) {
        Ok(got) => {
            for ((k, g), s) in keys.iter().zip(got).zip(&slots) {
                if let Some(len) = g {
                    // SAFETY: the slot is the caller's until released.
                    let b = unsafe { std::slice::from_raw_parts(s.ptr, len) };
                    check(k, b, t);
                }
            }
        }
        Err(e) => tolerable(&e, t),
    }
    h.release_slots(&ids).expect("slots are released once");
    t.slot_rounds.fetch_add(1, Ordering::Relaxed);
}

/// Restarts the agent (remote stacks) and then maru-server, each once, at their ports.
fn restarts(st: &mut Stack, at: &[Duration; 2], start: Instant, stop: &AtomicBool) {
    let wait_for = |d: Duration| {
        while start.elapsed() < d && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_for(at[0]);
    if st.agent.is_some() {
        st.restart_agent();
        eprintln!("stress: agent restarted at {:?}", start.elapsed());
    }
    wait_for(at[1]);
    st.restart_server();
    eprintln!("stress: maru-server restarted at {:?}", start.elapsed());
}

fn stress(backend: &str, run: Duration) {
    let remote = backend == "remote_cxl";
    let mut st = support::stack(&format!("stress-{backend}"), "512M", remote, &server_args());
    let h = Arc::new(Handler::open(&config(&st, backend, "stressed")).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let doing = Arc::new(Doing {
        what: Mutex::new(vec![("starting".into(), Instant::now()); THREADS]),
    });
    let tally = Arc::new(Tally::default());
    let finished = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let views = backend == "cxl";
    let workers: Vec<_> = (0..THREADS)
        .map(|me| {
            let (h, stop, doing, tally, finished) = (
                h.clone(),
                stop.clone(),
                doing.clone(),
                tally.clone(),
                finished.clone(),
            );
            std::thread::Builder::new()
                .name(format!("stress-{me}"))
                .spawn(move || {
                    worker(&h, me, views, &stop, &doing, &tally);
                    finished.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
        })
        .collect();
    // The watchdog: no call may run longer than `STUCK` (every wait of the handler is
    // bounded by its timeout_ms and the slot timeouts), and the threads end soon
    // after `stop`.
    const STUCK: Duration = Duration::from_secs(40);
    let watchdog = {
        let (doing, stop, finished) = (doing.clone(), stop.clone(), finished.clone());
        std::thread::spawn(move || -> Result<(), String> {
            let end = start + run;
            loop {
                std::thread::sleep(Duration::from_millis(200));
                if Instant::now() >= end {
                    stop.store(true, Ordering::SeqCst);
                }
                if finished.load(Ordering::SeqCst) == THREADS {
                    return Ok(());
                }
                let w = doing.what.lock().map_err(|_| "poisoned".to_string())?;
                let stuck: Vec<String> = w
                    .iter()
                    .enumerate()
                    .filter(|(_, (what, since))| what != "done" && since.elapsed() > STUCK)
                    .map(|(i, (what, since))| {
                        format!("thread {i}: {what} for {:?}", since.elapsed())
                    })
                    .collect();
                if !stuck.is_empty() {
                    stop.store(true, Ordering::SeqCst);
                    let all: Vec<String> = w
                        .iter()
                        .enumerate()
                        .map(|(i, (what, since))| {
                            format!("  thread {i}: {what} (since {:?})", since.elapsed())
                        })
                        .collect();
                    return Err(format!(
                        "stuck: {stuck:?}\nall threads:\n{}",
                        all.join("\n")
                    ));
                }
            }
        })
    };
    let at = [run / 3, run / 2 + run / 6];
    restarts(&mut st, &at, start, &stop);
    let verdict = watchdog.join().expect("the watchdog ends");
    if let Err(e) = verdict {
        // The stuck threads are left behind (the process ends with the test run).
        panic!("{backend}: a thread is stuck: {e}");
    }
    for w in workers {
        if let Err(p) = w.join() {
            std::panic::resume_unwind(p);
        }
    }
    let t = &tally;
    eprintln!(
        "stress {backend}: {:?}: stored {}, loaded and checked {} ({} MiB), removed {}, slot rounds {}, views {}, errors during restarts {}",
        start.elapsed(),
        t.stored.load(Ordering::Relaxed),
        t.loaded.load(Ordering::Relaxed),
        t.bytes_checked.load(Ordering::Relaxed) >> 20,
        t.removed.load(Ordering::Relaxed),
        t.slot_rounds.load(Ordering::Relaxed),
        t.views.load(Ordering::Relaxed),
        t.errors.load(Ordering::Relaxed),
    );
    assert!(t.stored.load(Ordering::Relaxed) > 0, "something was stored");
    assert!(t.loaded.load(Ordering::Relaxed) > 0, "something was loaded");
    assert!(t.slot_rounds.load(Ordering::Relaxed) > 0);
    // Every slot is back: none held by the caller, all free (a slot kept for a
    // transfer of unknown outcome comes back after its peer's fence, at a heartbeat).
    let slots_back = || {
        let s = h.stats();
        let st = &s["staging"];
        st["held_by_caller"].as_u64() == Some(0)
            && st["free_load_slots"] == st["load_slots"]
            && st["free_store_slots"] == st["store_slots"]
    };
    assert!(
        support::wait_until(Duration::from_secs(15), slots_back),
        "every slot comes back: {}",
        h.stats()["staging"]
    );
    // Everything still found is the key's.
    let everything: Vec<String> = (0..THREADS as u64)
        .flat_map(|o| (0..KEYS_PER_THREAD).map(move |n| key(o, n)))
        .collect();
    let mut seen = HashSet::new();
    for k in &everything {
        if let Ok(Some(g)) = h.load(k, Some(k)) {
            check(k, &g, t);
            seen.insert(k.clone());
        }
    }
    eprintln!("stress {backend}: {} keys found at the end", seen.len());
    h.close().unwrap();
}

#[test]
fn one_handler_eight_threads_remote_cxl_with_restarts() {
    stress("remote_cxl", Duration::from_secs(24));
}

#[test]
fn one_handler_eight_threads_cxl_with_views_and_a_server_restart() {
    stress("cxl", Duration::from_secs(20));
}
