//! The worker data path against real daemons on loopback: RM (fake DAX), agent and
//! maru-server; two engines share KV through `remote_cxl` over the soft transport,
//! and through `cxl`.

mod support;

use maru::wire::rm::{RmReply, RmRequest, SERVICE as RM};
use maru::worker::Handler;
use sha2::{Digest, Sha256};
use std::time::{Duration, Instant};
use support::{
    connect, leases_of, used_bytes, wait_until, Daemon, Stack, AGENT_BIN, RM_BIN, SERVER_BIN,
};

fn stack(remote: bool, extra_server: &[&str]) -> Stack {
    let mut args: Vec<String> = ["--region-size", "8M", "--chunk-size", "64K"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    args.extend(extra_server.iter().map(|x| x.to_string()));
    support::stack("worker", "256M", remote, &args)
}

fn config(st: &Stack, backend: &str, engine: &str) -> String {
    st.handler_config(backend, engine, "llama-test", (8, 16))
        .to_string()
}

fn chunk(i: usize) -> Vec<u8> {
    // Deterministic, different per chunk, various lengths up to the 64 KiB page.
    let len = 1024 + (i * 977) % (63 * 1024);
    support::seeded_bytes((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15), len)
}

fn digest(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

fn share_1000_chunks(backend: &str) {
    let st = stack(backend == "remote_cxl", &[]);
    let a = Handler::open(&config(&st, backend, "engine-a")).expect("open engine A");
    let b = Handler::open(&config(&st, backend, "engine-b")).expect("open engine B");
    let n = 1000;
    let keys: Vec<String> = (0..n).map(|i| format!("prefix-{i:04}")).collect();
    let data: Vec<Vec<u8>> = (0..n).map(chunk).collect();
    support::store_all(&a, &keys, &data, "store");
    let found = b.exists_batch(&keys, Some("route")).unwrap();
    assert!(found.iter().all(|&x| x));
    for batch in keys.chunks(32) {
        let got = b.load_batch(batch, Some("route")).expect("load");
        for (k, g) in batch.iter().zip(got) {
            let i: usize = k[7..].parse().unwrap();
            let g = g.unwrap_or_else(|| panic!("{k} missing"));
            assert_eq!(digest(&g), digest(&data[i]), "checksum of {k}");
        }
    }
    let stats = b.stats();
    assert_eq!(stats["total"]["hits"], n as u64);
    // Per call: results, chunks and a latency histogram (maru_stats_json's "ops").
    let batches = n.div_ceil(32) as u64;
    let ops = &a.stats()["ops"];
    assert_eq!(ops["store"]["ok"], batches);
    assert_eq!(ops["store"]["failed"], 0);
    assert_eq!(ops["store"]["items"], n as u64);
    let le = ops["store"]["latency_us_le"].as_array().expect("buckets");
    let last = le.last().and_then(|b| b[1].as_u64()).unwrap();
    assert!(last <= batches && le.len() == 14, "{le:?}");
    assert!(ops["store"]["latency_us_sum"].as_u64().unwrap() > 0);
    let ops = &stats["ops"];
    assert_eq!(ops["load"]["ok"], batches);
    assert_eq!(ops["exists"]["items"], n as u64);
    // A key nobody stored is a miss, not an error.
    assert_eq!(b.load("nope", Some("route")).unwrap(), None);
    a.close().unwrap();
    b.close().unwrap();
}

/// The zero-copy slot API: engine A fills store slots in place and stores from them
/// (synchronously and submitted), engine B loads into load slots (both ways) and every
/// checksum matches; every slot comes back; misuse gets clear errors.
fn share_through_slots(backend: &str) {
    use maru::worker::{OpOutput, SlotPool, WorkerError};
    let st = stack(backend == "remote_cxl", &[]);
    let a = Handler::open(&config(&st, backend, "engine-a")).expect("open engine A");
    let b = Handler::open(&config(&st, backend, "engine-b")).expect("open engine B");
    let t = Duration::from_secs(5);
    let n = 96;
    let keys: Vec<String> = (0..n).map(|i| format!("slot-{i:04}")).collect();
    let data: Vec<Vec<u8>> = (0..n).map(chunk).collect();
    for (round, idx) in (0..n).collect::<Vec<_>>().chunks(8).enumerate() {
        let slots = a.acquire_slots(SlotPool::Store, idx.len(), t).unwrap();
        assert_eq!(slots.len(), idx.len());
        for (s, &i) in slots.iter().zip(idx) {
            assert!(s.capacity >= data[i].len());
            // SAFETY: the slot is ours until released; capacity checked above.
            unsafe { std::ptr::copy_nonoverlapping(data[i].as_ptr(), s.ptr, data[i].len()) };
        }
        let ks: Vec<String> = idx.iter().map(|&i| keys[i].clone()).collect();
        let ids: Vec<u64> = slots.iter().map(|s| s.id).collect();
        let lens: Vec<usize> = idx.iter().map(|&i| data[i].len()).collect();
        let stored = if round % 2 == 0 {
            a.store_slots(&ks, &ids, &lens, Some("route")).unwrap()
        } else {
            let op = a
                .submit_store_slots(ks, ids.clone(), lens, Some("route".into()))
                .unwrap();
            match op.wait(Duration::from_secs(30)) {
                Some(Ok(OpOutput::Stored(v))) => v,
                other => panic!("submitted store: {other:?}"),
            }
        };
        assert!(stored.iter().all(|&x| x), "round {round}: {stored:?}");
        a.release_slots(&ids).unwrap();
    }
    assert_eq!(a.held_slots(), 0);
    for (round, idx) in (0..n).collect::<Vec<_>>().chunks(8).enumerate() {
        let slots = b.acquire_slots(SlotPool::Load, idx.len(), t).unwrap();
        let ks: Vec<String> = idx.iter().map(|&i| keys[i].clone()).collect();
        let ids: Vec<u64> = slots.iter().map(|s| s.id).collect();
        let got = if round % 2 == 0 {
            b.load_slots(&ks, &ids, Some("route")).unwrap()
        } else {
            let op = b
                .submit_load_slots(ks, ids.clone(), Some("route".into()))
                .unwrap();
            match op.wait(Duration::from_secs(30)) {
                Some(Ok(OpOutput::Loaded(v))) => v,
                other => panic!("submitted load: {other:?}"),
            }
        };
        for ((s, &i), g) in slots.iter().zip(idx).zip(got) {
            let len = g.unwrap_or_else(|| panic!("{} not loaded", keys[i]));
            // SAFETY: the slot is ours and holds `len` loaded bytes.
            let bytes = unsafe { std::slice::from_raw_parts(s.ptr, len) };
            assert_eq!(digest(bytes), digest(&data[i]), "checksum of {}", keys[i]);
        }
        b.release_slots(&ids).unwrap();
    }
    // Misuse: a length larger than the slot, an id never acquired, a miss.
    let s = b.acquire_slots(SlotPool::Store, 1, t).unwrap();
    let big = s[0].capacity + 1;
    assert!(matches!(
        b.store_slots(&["x"], &[s[0].id], &[big], None),
        Err(WorkerError::InvalidArgument(_))
    ));
    assert!(matches!(
        b.store_slots(&["x"], &[987_654], &[1], None),
        Err(WorkerError::InvalidArgument(_))
    ));
    assert_eq!(
        b.load_slots(&["nobody-stored-this"], &[s[0].id], None)
            .unwrap(),
        vec![None]
    );
    b.release_slots(&[s[0].id]).unwrap();
    assert!(
        matches!(
            b.release_slots(&[s[0].id]),
            Err(WorkerError::InvalidArgument(_))
        ),
        "a double release is refused"
    );
    assert_eq!(b.held_slots(), 0);
    let stats = b.stats();
    assert_eq!(stats["total"]["hits"], n as u64);
    assert_eq!(stats["backend"], backend);
    let staging = &stats["staging"];
    assert_eq!(
        (
            &staging["free_load_slots"],
            &staging["free_store_slots"],
            &staging["held_by_caller"]
        ),
        (&8.into(), &16.into(), &0.into()),
        "every slot is back: {staging}"
    );
    a.close().unwrap();
    b.close().unwrap();
}

#[test]
fn remote_cxl_slot_api_shares_chunks_sync_and_submitted() {
    share_through_slots("remote_cxl");
}

#[test]
fn cxl_slot_api_shares_chunks_sync_and_submitted() {
    share_through_slots("cxl");
}

#[test]
fn remote_cxl_engines_share_1000_checksummed_chunks() {
    share_1000_chunks("remote_cxl");
}

#[test]
fn cxl_engines_share_1000_checksummed_chunks() {
    share_1000_chunks("cxl");
}

#[test]
fn a_killed_engines_keys_stay_readable_and_every_region_goes_back() {
    let st = stack(true, &["--session-timeout-s", "1"]);
    let b = Handler::open(&config(&st, "remote_cxl", "engine-b")).unwrap();
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let data: Vec<Vec<u8>> = (0..40).map(chunk).collect();
    {
        let a = Handler::open(&config(&st, "remote_cxl", "engine-a")).unwrap();
        let items = support::items(&keys, &data);
        assert!(a.store_batch(&items, Some("r")).unwrap().iter().all(|&x| x));
        // "Killed": the engine goes away without closing its session.
        std::mem::forget(a);
    }
    // After the session expired, the keeper keeps its region: B still reads every key.
    std::thread::sleep(Duration::from_millis(2500));
    let got = b.load_batch(&keys, Some("r")).unwrap();
    for (g, d) in got.iter().zip(&data) {
        assert_eq!(g.as_deref().map(digest), Some(digest(d)));
    }
    b.close().unwrap();
    // Stopping maru-server gives the kept regions back: released at the agent, then freed.
    let mut rm = connect(&st.rm.addr, RM, "observer");
    let count =
        |rm: &mut maru::net::Client| match rm.call(&RmRequest::Regions { owner: None }).unwrap() {
            RmReply::Regions { regions } => regions.len(),
            r => panic!("{r:?}"),
        };
    assert!(count(&mut rm) > 0);
    assert_eq!(st.server.terminate(), Some(0));
    assert!(
        wait_until(Duration::from_secs(40), || count(&mut rm) == 0),
        "no region left allocated at the RM"
    );
    drop(st.s);
}

#[test]
fn a_pool_that_goes_away_misses_and_serves_again_when_it_is_back() {
    let _ = env_logger::builder().is_test(true).try_init();
    // Two pools (two maru-servers on one RM); keys spread by the router.
    let st = stack(false, &[]);
    let args = vec![
        "--rm-address".to_string(),
        st.rm.addr.clone(),
        "--region-size".into(),
        "8M".into(),
        "--chunk-size".into(),
        "64K".into(),
    ];
    let mut second = Daemon::start(SERVER_BIN, &args, &st.s.dir);
    let urls = format!("{},{}", st.server.addr, second.addr);
    let cfg = |engine: &str| {
        serde_json::json!({"backend": "cxl", "server_url": urls, "server_key_file": support::server_key_file(&second.addr), "engine_id": engine, "load_slots": 4, "store_slots": 4}).to_string()
    };
    let h = Handler::open(&cfg("router-engine")).unwrap();
    let router = maru::worker::PoolRouter::new(vec![st.server.addr.clone(), second.addr.clone()]);
    // Route keys for each pool.
    let rk: Vec<String> = (0..200).map(|i| format!("req-{i}")).collect();
    let on = |pool: usize| rk.iter().find(|k| router.pick(k) == pool).unwrap().clone();
    let (r0, r1) = (on(0), on(1));
    let d = chunk(1);
    assert!(h.store(&format!("{r0}/c0"), &d, Some(&r0)).unwrap());
    assert!(h.store(&format!("{r1}/c0"), &d, Some(&r1)).unwrap());
    // Pool 1 goes away: its prefixes miss, pool 0 keeps serving.
    let port = second.port();
    second.kill9();
    let k1 = format!("{r1}/c0");
    assert_eq!(h.load(&k1, Some(&r1)).unwrap(), None);
    assert!(
        !h.store(&format!("{r1}/c1"), &d, Some(&r1)).unwrap(),
        "a store to a pool that is away is skipped"
    );
    assert_eq!(
        h.load(&format!("{r0}/c0"), Some(&r0)).unwrap().as_deref(),
        Some(d.as_slice())
    );
    // It comes back (empty: a new maru-server); the handler reconnects in the background.
    second = Daemon::start_at(SERVER_BIN, &args, &st.s.dir, port);
    assert!(
        wait_until(Duration::from_secs(15), || h
            .store(&k1, &d, Some(&r1))
            .unwrap_or(false)),
        "stores reach the pool again once it is back"
    );
    assert_eq!(
        h.load(&k1, Some(&r1)).unwrap().as_deref(),
        Some(d.as_slice())
    );
    h.close().unwrap();
    drop(second);
}

/// A cxl pool whose writes of odd-numbered chunks never complete (as when an engine
/// dies or a transfer fails mid-store), and that may pretend a failed write's outcome
/// is unknown (its peer not fenced yet).
fn half_pool(
    session: maru::worker::session::Session,
    unfenced: bool,
) -> maru::worker::pool::StoragePool {
    let seen = std::sync::atomic::AtomicUsize::new(0);
    let hooks = maru::worker::pool::TestHooks {
        after_write: Some(Box::new(move |_, ok| {
            let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            ok && n % 2 == 0
        })),
        unfenced,
        ..Default::default()
    };
    maru::worker::pool::StoragePool::open(session, maru::worker::movers::cxl(true))
        .unwrap()
        .with_test_hooks(hooks)
}

/// Pages of failed writes go back for reuse, except while a transfer of unknown outcome
/// could still land in them (its peer not fenced): then they stay out of reuse.
#[test]
fn pages_of_failed_writes_are_reused_only_when_no_transfer_can_still_land() {
    use maru::wire::meta::Backend;
    use maru::worker::session::Session;
    let st = stack(false, &[]);
    for unfenced in [false, true] {
        let engine = format!("half-writer-{unfenced}");
        let session = Session::open(
            &st.server.addr,
            &engine,
            support::server_key(&st.server.addr),
            &engine,
            "llama-test",
            "default",
            Backend::Cxl,
            Duration::from_secs(10),
        )
        .unwrap();
        let page = session.page_size;
        let pool = half_pool(session, unfenced);
        let keys: Vec<String> = (0..10).map(|i| format!("{engine}-{i}")).collect();
        let data: Vec<Vec<u8>> = (0..10).map(chunk).collect();
        let items = support::items(&keys, &data);
        pool.store(&items, Some("half")).unwrap();
        let pages_in_use = used_bytes(&st.server.addr, &engine) / page;
        assert_eq!(
            pages_in_use,
            if unfenced { 10 } else { 5 },
            "unfenced = {unfenced}"
        );
        pool.close(pool.session.call_deadline()).unwrap();
    }
}

#[test]
fn only_chunks_whose_bytes_are_complete_are_published() {
    use maru::wire::meta::Backend;
    use maru::worker::session::Session;
    let st = stack(false, &[]);
    let t = Duration::from_secs(10);
    let session = Session::open(
        &st.server.addr,
        "writer",
        support::server_key(&st.server.addr),
        "writer",
        "llama-test",
        "default",
        Backend::Cxl,
        t,
    )
    .unwrap();
    let pool = half_pool(session, false);
    let keys: Vec<String> = (0..10).map(|i| format!("half-{i}")).collect();
    let data: Vec<Vec<u8>> = (0..10).map(chunk).collect();
    let items = support::items(&keys, &data);
    let stored = pool.store(&items, Some("half")).unwrap();
    assert_eq!(stored, (0..10).map(|i| i % 2 == 0).collect::<Vec<_>>());
    // Another engine finds exactly the complete chunks, with their bytes.
    let reader = Handler::open(&config(&st, "cxl", "reader")).unwrap();
    let found = reader.exists_batch(&keys, Some("half")).unwrap();
    assert_eq!(
        found, stored,
        "a chunk whose write did not complete is never found"
    );
    for (i, got) in reader
        .load_batch(&keys, Some("half"))
        .unwrap()
        .into_iter()
        .enumerate()
    {
        assert_eq!(got.is_some(), i % 2 == 0);
        if let Some(g) = got {
            assert_eq!(digest(&g), digest(&data[i]));
        }
    }
    pool.close(pool.session.call_deadline()).unwrap();
    reader.close().unwrap();
}

/// A chunk that proves itself: its first 32 bytes are the SHA-256 of the rest, so a
/// reader can tell a complete chunk from a torn one without knowing what was stored.
fn self_checking_chunk(seed: u64, len: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(len);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while body.len() < len - 32 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        body.extend_from_slice(&x.to_le_bytes());
    }
    body.truncate(len - 32);
    let mut out = digest(&body).to_vec();
    out.extend_from_slice(&body);
    out
}

fn chunk_is_whole(c: &[u8]) -> bool {
    c.len() > 32 && digest(&c[32..])[..] == c[..32]
}

const VICTIM_ENV: &str = "MARU_TEST_VICTIM_CONFIG";

/// Not a test by itself: the engine process that
/// `an_engine_killed_mid_store_never_leaves_a_partial_chunk` starts and kills. It
/// stores self-checking 64 KiB chunks in batches of 8 until it is killed (at most 60 s).
#[test]
#[ignore = "run as a child process by an_engine_killed_mid_store_never_leaves_a_partial_chunk"]
fn victim_engine_stores_until_killed() {
    let Ok(cfg) = std::env::var(VICTIM_ENV) else {
        return;
    };
    let round: u64 = std::env::var("MARU_TEST_VICTIM_ROUND")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    let h = Handler::open(&cfg).expect("victim opens its handler");
    let start = std::time::Instant::now();
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(60) {
        let keys: Vec<String> = (i..i + 8).map(|k| format!("victim-{round}-{k}")).collect();
        let data: Vec<Vec<u8>> = (i..i + 8)
            .map(|k| self_checking_chunk(round << 32 | k, 64 * 1024))
            .collect();
        let items = support::items(&keys, &data);
        let _ = h.store_batch(&items, Some("victim-route"));
        i += 8;
    }
}

/// An engine process killed with SIGKILL in the middle of its stores, three times at
/// different moments: every chunk another engine finds afterwards is whole (its
/// embedded checksum matches), because a chunk is published only once its bytes are
/// complete in the region.
#[test]
fn an_engine_killed_mid_store_never_leaves_a_partial_chunk() {
    let st = stack(true, &[]);
    let reader = Handler::open(&config(&st, "remote_cxl", "reader")).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut checked = 0;
    for (round, wait_ms) in [(0u64, 150u64), (1, 400), (2, 900)] {
        let mut child = std::process::Command::new(&exe)
            .args([
                "--exact",
                "victim_engine_stores_until_killed",
                "--ignored",
                "--nocapture",
            ])
            .env(
                VICTIM_ENV,
                config(&st, "remote_cxl", &format!("victim-{round}")),
            )
            .env("MARU_TEST_VICTIM_ROUND", round.to_string())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Kill it once it has stored something, plus a moment that differs per round.
        let first = format!("victim-{round}-0");
        let started = wait_until(Duration::from_secs(30), || {
            reader
                .exists_batch(std::slice::from_ref(&first), Some("victim-route"))
                .map(|v| v[0])
                .unwrap_or(false)
        });
        std::thread::sleep(Duration::from_millis(wait_ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        assert!(started, "round {round}: the victim never stored a chunk");
        // Read back every key the victim could have reached, found ones must be whole.
        let mut found = 0;
        let mut k = 0u64;
        let mut misses_in_a_row = 0;
        while misses_in_a_row < 64 {
            let keys: Vec<String> = (k..k + 32).map(|j| format!("victim-{round}-{j}")).collect();
            for (key, got) in keys
                .iter()
                .zip(reader.load_batch(&keys, Some("victim-route")).unwrap())
            {
                match got {
                    Some(c) => {
                        assert!(chunk_is_whole(&c), "{key} was read torn");
                        found += 1;
                        misses_in_a_row = 0;
                    }
                    None => misses_in_a_row += 1,
                }
            }
            k += 32;
        }
        assert!(
            found >= 8,
            "round {round}: only {found} chunks found; reader stats {}",
            reader.stats()
        );
        checked += found;
    }
    assert!(checked > 0);
    reader.close().unwrap();
}

/// The soft transport, except that while `stall` is set a posted batch is never sent
/// and stays pending until its peer is fenced (a peer that stopped answering).
struct Stalling {
    inner: maru::transport::soft::SoftTransport,
    stall: std::sync::atomic::AtomicBool,
    stalled: std::sync::Mutex<std::collections::HashMap<u64, maru::transport::PeerId>>,
    fenced: std::sync::Mutex<Vec<maru::transport::PeerId>>,
    next: std::sync::atomic::AtomicU64,
}

impl maru::transport::Transport for Stalling {
    fn name(&self) -> &'static str {
        "stalling"
    }
    support::delegate_setup!();
    fn post(
        &self,
        peer: maru::transport::PeerId,
        ops: &[maru::transport::Op],
    ) -> Result<maru::transport::BatchId, maru::transport::TransportError> {
        use std::sync::atomic::Ordering;
        if self.stall.load(Ordering::SeqCst) {
            let id = (1 << 60) + self.next.fetch_add(1, Ordering::SeqCst);
            self.stalled.lock().unwrap().insert(id, peer);
            return Ok(maru::transport::BatchId(id));
        }
        self.inner.post(peer, ops)
    }
    fn state(&self, b: maru::transport::BatchId) -> maru::transport::BatchState {
        match self.stalled.lock().unwrap().get(&b.0) {
            Some(p) if self.fenced.lock().unwrap().contains(p) => {
                maru::transport::BatchState::Failed(maru::transport::TransportError::NoPeer(*p))
            }
            Some(_) => maru::transport::BatchState::Pending,
            None => self.inner.state(b),
        }
    }
    fn wait(&self, b: maru::transport::BatchId, t: Duration) -> maru::transport::BatchState {
        if self.stalled.lock().unwrap().contains_key(&b.0) {
            std::thread::sleep(t);
            return self.state(b);
        }
        self.inner.wait(b, t)
    }
    fn forget(&self, b: maru::transport::BatchId) {
        if self.stalled.lock().unwrap().remove(&b.0).is_none() {
            self.inner.forget(b)
        }
    }
    fn fence(&self, peer: maru::transport::PeerId) -> Result<(), maru::transport::TransportError> {
        self.fenced.lock().unwrap().push(peer);
        self.inner.fence(peer)
    }
}

/// Transfer isolation through the slot API with an injected fault: while the agent's
/// peer stalls, a store and a load through slots time out; their slots are taken back
/// (ids no longer valid, their chunks not stored / not found), the peer is fenced, and
/// every slot is back in its pool exactly once. Once the peer answers again (a new
/// connection after the fence), stores and loads work again.
#[test]
fn slots_of_a_stalled_peer_come_back_after_its_fence_and_the_peer_recovers() {
    use maru::worker::{SlotPool, WorkerError};
    use std::sync::atomic::Ordering;
    let st = stack(true, &[]);
    let key = maru::auth::load_key_file(&st.key_path).unwrap();
    let t = std::sync::Arc::new(Stalling {
        inner: maru::transport::soft::SoftTransport::new("stalling-engine", Some(key)),
        stall: false.into(),
        stalled: Default::default(),
        fenced: Default::default(),
        next: 0.into(),
    });
    let mut cfg: serde_json::Value =
        serde_json::from_str(&config(&st, "remote_cxl", "stall")).unwrap();
    cfg["timeout_ms"] = 300.into();
    let a = Handler::open_with_transport(&cfg.to_string(), t.clone()).unwrap();
    let wait = Duration::from_secs(5);
    // A chunk stored while the peer answers, to load later.
    let d0 = chunk(0);
    assert!(a.store("stall-0", &d0, Some("r")).unwrap());

    t.stall.store(true, Ordering::SeqCst);
    let s = a.acquire_slots(SlotPool::Store, 4, wait).unwrap();
    let ids: Vec<u64> = s.iter().map(|s| s.id).collect();
    let keys: Vec<String> = (1..5).map(|i| format!("stall-{i}")).collect();
    let stored = a.store_slots(&keys, &ids, &[100; 4], Some("r")).unwrap();
    assert_eq!(
        stored,
        vec![false; 4],
        "nothing is published from a stalled WRITE"
    );
    assert_eq!(
        a.held_slots(),
        0,
        "the stalled transfer's slots were taken back"
    );
    assert_eq!(a.slots_held(&ids).unwrap(), vec![false; 4]);
    assert!(matches!(
        a.store_slots(&keys[..1], &ids[..1], &[1], Some("r")),
        Err(WorkerError::InvalidArgument(_))
    ));
    a.release_slots(&ids).unwrap(); // taken back: a no-op
    let l = a.acquire_slots(SlotPool::Load, 1, wait).unwrap();
    let got = a
        .load_slots(&["stall-0".to_string()], &[l[0].id], Some("r"))
        .unwrap();
    assert_eq!(got, vec![None], "a stalled READ finds nothing");
    assert_eq!(a.held_slots(), 0);
    assert!(
        !t.fenced.lock().unwrap().is_empty(),
        "the stalled peer was fenced"
    );

    // Every slot is back exactly once: all of each pool can be taken at once.
    let all_store = a.acquire_slots(SlotPool::Store, 64, wait).unwrap();
    let all_load = a.acquire_slots(SlotPool::Load, 64, wait).unwrap();
    assert_eq!((all_store.len(), all_load.len()), (16, 8));
    let every: Vec<u64> = all_store.iter().chain(&all_load).map(|s| s.id).collect();
    a.release_slots(&every).unwrap();

    // The peer answers again: a new connection, and both directions work.
    t.stall.store(false, Ordering::SeqCst);
    assert!(a.store("stall-5", &chunk(5), Some("r")).unwrap());
    assert_eq!(a.load("stall-0", Some("r")).unwrap(), Some(d0));
    assert_eq!(a.load("stall-1", Some("r")).unwrap(), None);
    a.close().unwrap();
}

/// maru-server restarts (kill -9, then a new run on the same port): the handler's
/// session is gone with it and no keeper will ever release its regions, so the handler
/// releases them at their agents as soon as it has a session with the new run (it
/// tells the two apart by the server's instance id), and serves again.
#[test]
fn after_maru_server_restarts_the_lost_sessions_regions_are_released_at_theiragents() {
    use maru::wire::agent::{AgentReply, AgentRequest, SERVICE as AGENT};
    let Stack {
        s,
        key_path,
        rm,
        agent,
        server,
        ..
    } = stack(true, &[]);
    let agent = agent.unwrap();
    let cfg = serde_json::json!({
        "backend": "remote_cxl", "server_url": server.addr, "engine_id": "restart-engine",
        "server_key_file": support::server_key_file(&server.addr),
        "agent_key_file": key_path.display().to_string(), "load_slots": 4, "store_slots": 4,
    })
    .to_string();
    let h = Handler::open(&cfg).unwrap();
    assert!(h.store("before", &chunk(1), Some("r")).unwrap());
    let key = maru::auth::load_key_file(&key_path).unwrap();
    let status = || {
        let mut o = maru::net::ClientOptions::new(AGENT, "observer");
        o.key = Some(key.clone());
        let mut c = maru::net::Client::connect(&agent.addr, &o).unwrap();
        match c.call(&AgentRequest::Status).unwrap() {
            AgentReply::Status(s) => s.mappings,
            r => panic!("{r:?}"),
        }
    };
    let owned: Vec<u64> = status()
        .iter()
        .filter(|m| !m.released)
        .map(|m| m.region_id)
        .collect();
    assert!(
        !owned.is_empty(),
        "the handler's region is mapped at the agent"
    );

    let port = server.port();
    server.kill9();
    let args: Vec<String> = [
        "--rm-address",
        &rm.addr,
        "--region-size",
        "8M",
        "--chunk-size",
        "64K",
        "--remote-cxl-agent",
        &agent.addr,
        "--remote-cxl-agent-key-file",
        &key_path.display().to_string(),
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    let _server2 = Daemon::start_at(SERVER_BIN, &args, &s.dir, port);
    assert!(
        wait_until(Duration::from_secs(20), || h
            .store("after", &chunk(2), Some("r"))
            .unwrap_or(false)),
        "the handler serves again with the new maru-server"
    );
    // The release comes before the pool serves again (not later, from the agent's
    // sweep once the RM forgot the dead server's regions).
    let now = status();
    assert!(
        owned.iter().all(|id| now
            .iter()
            .find(|m| m.region_id == *id)
            .is_none_or(|m| m.released)),
        "every region of the lost session was released at the agent: {now:?}"
    );
    assert_eq!(h.load("after", Some("r")).unwrap(), Some(chunk(2)));
    h.close().unwrap();
}

/// cxl readers see the chunks in place: a view is this host's mapping of the owner's
/// region, under a lease held until the view is released; remote_cxl refuses views.
#[test]
fn cxl_views_read_chunks_in_place_under_a_lease() {
    let st = stack(false, &[]);
    let a = Handler::open(&config(&st, "cxl", "view-writer")).unwrap();
    let b = Handler::open(&config(&st, "cxl", "view-reader")).unwrap();
    let keys: Vec<String> = (0..8).map(|i| format!("view-{i}")).collect();
    let data: Vec<Vec<u8>> = (0..8).map(chunk).collect();
    let items = support::items(&keys, &data);
    assert!(a.store_batch(&items, Some("v")).unwrap().iter().all(|&x| x));
    let mut ask = keys.clone();
    ask.push("view-never-stored".into());
    let views = b.acquire_views(&ask, Some("v")).unwrap();
    assert!(views[8].is_none(), "a miss has no view");
    for (v, d) in views.iter().zip(&data) {
        let v = v.expect("found");
        assert!(v.valid_ms > 0);
        // SAFETY: the view is held; it points to `len` readable bytes.
        let bytes = unsafe { std::slice::from_raw_parts(v.ptr, v.len) };
        assert_eq!(digest(bytes), digest(d));
    }
    assert_eq!(b.held_views(), 8);
    assert_eq!(
        leases_of(&st.server.addr, "view-reader"),
        8,
        "one lease per view"
    );
    let ids: Vec<u64> = views.iter().flatten().map(|v| v.id).collect();
    b.release_views(&ids).unwrap();
    b.release_views(&ids).unwrap(); // already released: ignored
    assert_eq!(b.held_views(), 0);
    assert_eq!(leases_of(&st.server.addr, "view-reader"), 0);

    // Remove: only the engine that stored a key may unpublish it, and not while a
    // reader holds a lease on it.
    use maru::wire::meta::RemoveResult;
    let held = b.acquire_views(&keys[..1], Some("v")).unwrap();
    let one = vec![keys[0].clone()];
    assert_eq!(
        b.remove_batch(&one, Some("v")).unwrap(),
        vec![RemoveResult::NotOwner]
    );
    assert_eq!(
        a.remove_batch(&one, Some("v")).unwrap(),
        vec![RemoveResult::Leased]
    );
    b.release_views(&[held[0].expect("found").id]).unwrap();
    let two = vec![keys[0].clone(), "view-never-stored".to_string()];
    assert_eq!(
        a.remove_batch(&two, Some("v")).unwrap(),
        vec![RemoveResult::Removed, RemoveResult::NotFound]
    );
    assert_eq!(
        b.exists_batch(&one, Some("v")).unwrap(),
        vec![false],
        "gone for readers"
    );
    assert!(b.acquire_views(&one, Some("v")).unwrap()[0].is_none());
    assert!(a.remove_batch::<&str>(&[], None).unwrap().is_empty());
    // A pin (by any engine of the namespace) keeps a key from removal until unpinned.
    let k1 = vec![keys[1].clone(), "view-never-stored".to_string()];
    assert_eq!(
        b.pin_batch(&k1, Some("v"), true).unwrap(),
        vec![true, false]
    );
    assert_eq!(
        a.remove_batch(&k1[..1], Some("v")).unwrap(),
        vec![RemoveResult::Pinned]
    );
    assert_eq!(
        a.pin_batch(&k1[..1], Some("v"), false).unwrap(),
        vec![false],
        "not a's pin"
    );
    assert_eq!(b.pin_batch(&k1[..1], Some("v"), false).unwrap(), vec![true]);
    assert_eq!(
        a.remove_batch(&k1[..1], Some("v")).unwrap(),
        vec![RemoveResult::Removed]
    );
    a.close().unwrap();
    b.close().unwrap();

    let st = stack(true, &[]);
    let r = Handler::open(&config(&st, "remote_cxl", "remote-viewer")).unwrap();
    assert!(matches!(
        r.acquire_views(&["k"], None),
        Err(maru::worker::WorkerError::InvalidArgument(m)) if m.contains("maru_load_slots")
    ));
    r.close().unwrap();
}

/// One handler used from several threads at once (the C API promises thread safety):
/// threads store and load through both the copying calls and the slot API, on their
/// own routes, and every chunk comes back intact.
#[test]
fn one_handler_serves_many_threads_at_once() {
    use maru::worker::SlotPool;
    let st = stack(true, &[]);
    let h = std::sync::Arc::new(Handler::open(&config(&st, "remote_cxl", "threads")).unwrap());
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let h = h.clone();
            std::thread::spawn(move || {
                let route = format!("thread-{t}");
                for i in 0..24usize {
                    let key = format!("{route}/{i}");
                    let d = chunk(t * 100 + i);
                    if i % 2 == 0 {
                        assert!(h.store(&key, &d, Some(&route)).unwrap());
                    } else {
                        let s = h
                            .acquire_slots(SlotPool::Store, 1, Duration::from_secs(10))
                            .unwrap();
                        // SAFETY: our slot, large enough for one chunk.
                        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), s[0].ptr, d.len()) };
                        let ok = h
                            .store_slots(
                                std::slice::from_ref(&key),
                                &[s[0].id],
                                &[d.len()],
                                Some(&route),
                            )
                            .unwrap();
                        h.release_slots(&[s[0].id]).unwrap();
                        assert!(ok[0]);
                    }
                    let got = h.load(&key, Some(&route)).unwrap().expect("stored");
                    assert_eq!(digest(&got), digest(&d), "{key}");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker thread failed");
    }
    assert_eq!(h.held_slots(), 0);
    assert_eq!(h.stats()["total"]["hits"], 96);
    h.close().unwrap();
}

/// `cxl` stores with prefaulting: the regions are faulted in on a background thread
/// and the next region is taken ahead of need; the bytes other engines read are the
/// bytes stored (populating writes nothing), a key stored twice keeps its first bytes
/// and is published once, and the same holds with prefaulting off.
#[test]
fn cxl_prefaulted_regions_keep_every_stored_byte_and_keys_are_never_overwritten() {
    let st = stack(false, &[]);
    for prefault in [true, false] {
        let engine = format!("prefault-writer-{prefault}");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&config(&st, "cxl", &engine)).unwrap();
        cfg["prefault"] = prefault.into();
        let a = Handler::open(&cfg.to_string()).expect("open writer");
        let reader = Handler::open(&config(&st, "cxl", &format!("prefault-reader-{prefault}")))
            .expect("open reader");
        // 300 chunks of up to 64 KiB over 8 MiB regions of 128 pages: three regions.
        let n = 300;
        let keys: Vec<String> = (0..n).map(|i| format!("pf-{prefault}-{i:04}")).collect();
        let data: Vec<Vec<u8>> = (0..n).map(chunk).collect();
        for (bi, batch) in (0..n).collect::<Vec<_>>().chunks(25).enumerate() {
            let items: Vec<(&str, &[u8])> = batch
                .iter()
                .map(|&i| (keys[i].as_str(), data[i].as_slice()))
                .collect();
            if bi % 2 == 0 {
                assert!(a
                    .store_batch(&items, Some("pf"))
                    .unwrap()
                    .iter()
                    .all(|&x| x));
            } else {
                for (k, d) in items {
                    assert!(a.store(k, d, Some("pf")).unwrap(), "{k} stored");
                }
            }
        }
        // The same keys again, with other bytes, from the writer and from another
        // engine: already present, never overwritten.
        let other: Vec<Vec<u8>> = (0..n).map(|i| chunk(i + 7)).collect();
        for h in [&a, &reader] {
            let items: Vec<(&str, &[u8])> = keys
                .iter()
                .zip(&other)
                .map(|(k, d)| (k.as_str(), d.as_slice()))
                .collect();
            assert!(h
                .store_batch(&items, Some("pf"))
                .unwrap()
                .iter()
                .all(|&x| x));
        }
        for batch in keys.chunks(32) {
            for (k, g) in batch
                .iter()
                .zip(reader.load_batch(batch, Some("pf")).unwrap())
            {
                let i: usize = k.rsplit('-').next().unwrap().parse().unwrap();
                let g = g.unwrap_or_else(|| panic!("{k} missing"));
                assert_eq!(digest(&g), digest(&data[i]), "first bytes of {k}");
            }
        }
        let s = a.stats();
        assert_eq!(s["total"]["stored"], n as u64, "{s}");
        assert_eq!(s["total"]["already_present"], n as u64, "{s}");
        assert_eq!(reader.stats()["total"]["stored"], 0);
        let regions = s["total"]["regions"].as_u64().unwrap();
        let ahead = s["total"]["regions_ahead"].as_u64().unwrap();
        let prefaulted = s["total"]["prefaulted_bytes"].as_u64().unwrap();
        assert!(regions >= 3, "{s}");
        if prefault {
            // Each full region was followed by one taken ahead, before it was needed.
            assert!(ahead >= 2, "{s}");
            // Nothing is prefaulted where the kernel refuses MADV_POPULATE_WRITE (before
            // 5.14); the stores above worked all the same.
            let probe = st.s.dir.join("populate-probe");
            std::fs::File::create(&probe)
                .and_then(|f| f.set_len(2 << 20))
                .unwrap();
            let path = probe.display().to_string();
            let supported = maru::dax::map_range(
                &path,
                maru::dax::DeviceKind::File,
                0,
                2 << 20,
                2 << 20,
                true,
            )
            .unwrap()
            .populate_range(0, 2 << 20)
            .unwrap();
            let done = wait_until(Duration::from_secs(20), || {
                a.stats()["total"]["prefaulted_bytes"].as_u64().unwrap() >= 8 << 20
            });
            assert_eq!(done, supported, "{}", a.stats());
        } else {
            assert_eq!((ahead, prefaulted), (0, 0), "{s}");
        }
        // Pages kept for the next stores are allocated, but never more than a bound
        // (twice the spare target, `PoolCore::keep_spare`).
        let page = 64 * 1024;
        let used = used_bytes(&st.server.addr, &engine) / page;
        let bound = 2 * maru::worker::pool::spare_pages(page, 8 << 20) as u64;
        assert!(
            used >= n as u64 && used <= n as u64 + bound,
            "{used} pages in use for {n} keys (bound {bound} spare)"
        );
        a.close().unwrap();
        reader.close().unwrap();
    }
}

/// The region taken ahead of need (`cxl` with prefaulting) is taken by the handler's
/// `maru-ahead` thread, not by the store whose pages made it due: with the resource
/// manager stopped (SIGSTOP; maru-server's `expand` waits for it), every store into the
/// region the engine holds returns at once, and once the RM goes on the region ahead is
/// taken. Seen failing with the region taken inline again (in `note_fill`): the store
/// that reached the second half of the region waited for the RM until its deadline.
#[test]
fn a_store_does_not_wait_for_the_region_taken_ahead_of_need() {
    let st = stack(false, &[]);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&config(&st, "cxl", "ahead-writer")).unwrap();
    cfg["prefault"] = true.into();
    cfg["timeout_ms"] = 3000.into();
    let h = Handler::open(&cfg.to_string()).expect("open");
    // 7 batches of 16 chunks: 112 of the first region's 128 pages of 64 KiB; the fifth
    // batch's alloc reaches the second half.
    let keys: Vec<String> = (0..112).map(|i| format!("ahead-{i:03}")).collect();
    let data: Vec<Vec<u8>> = (0..112).map(chunk).collect();
    let items = support::items(&keys, &data);
    assert!(h
        .store_batch(&items[..16], None)
        .unwrap()
        .iter()
        .all(|&s| s));
    st.rm.signal(libc::SIGSTOP);
    for b in 1..7 {
        let t = Instant::now();
        let stored = h.store_batch(&items[b * 16..(b + 1) * 16], None).unwrap();
        let took = t.elapsed();
        assert!(stored.iter().all(|&s| s), "batch {b}: {stored:?}");
        assert!(took < Duration::from_secs(1), "batch {b} took {took:?}");
    }
    assert_eq!(h.stats()["total"]["regions_ahead"], 0, "the RM is stopped");
    st.rm.signal(libc::SIGCONT);
    let ahead = wait_until(Duration::from_secs(10), || {
        h.stats()["total"]["regions_ahead"] == 1
    });
    assert!(ahead, "{}", h.stats());
    h.close().unwrap();
}

/// An agent that restarts keeps its region's bytes (same boot id) but loses every
/// registration, and its soft NIC listens on a new port: the owner's next transfer
/// fails, drops that peer, maps its regions again and tries once more; readers (whose
/// peer died too) find the chunks stored before and after the restart at the first
/// load.
#[test]
fn after_itsagent_restarts_an_owner_maps_its_regions_again() {
    let mut st = stack(true, &[]);
    let a = Handler::open(&config(&st, "remote_cxl", "remap-writer")).unwrap();
    let b = Handler::open(&config(&st, "remote_cxl", "remap-reader")).unwrap();
    let keys = |tag: &str| -> Vec<String> { (0..8).map(|i| format!("{tag}-{i}")).collect() };
    let data: Vec<Vec<u8>> = (0..8).map(chunk).collect();
    let items = |ks: &[String]| -> Vec<(String, Vec<u8>)> {
        ks.iter().cloned().zip(data.iter().cloned()).collect()
    };
    let store = |h: &Handler, ks: &[String]| -> bool {
        let it = items(ks);
        let refs: Vec<(&str, &[u8])> = it.iter().map(|(k, d)| (k.as_str(), d.as_slice())).collect();
        h.store_batch(&refs, Some("remap"))
            .is_ok_and(|r| r.iter().all(|&x| x))
    };
    let before = keys("before");
    assert!(store(&a, &before));

    let agent = st.agent.take().expect("a remote stack has an agent");
    let port = agent.port();
    agent.kill9();
    let args = support::agent_args(&st.rm.addr, &st.key_path, &st.pool);
    st.agent = Some(Daemon::start_at(AGENT_BIN, &args, &st.s.dir, port));

    let after = keys("after");
    // The first store after the restart finds the old peer dead, drops it, maps the
    // region again and tries once more: it lands at once.
    assert!(
        store(&a, &after),
        "the owner's first store after the agent restarted lands"
    );
    for (k, d) in before.iter().chain(&after).zip(data.iter().chain(&data)) {
        let got = b.load(k, Some("remap")).unwrap();
        assert_eq!(got.as_deref().map(digest), Some(digest(d)), "{k}");
    }
    a.close().unwrap();
    b.close().unwrap();
}

fn rm_args(st: &Stack, grace_s: u32) -> Vec<String> {
    vec![
        "--state-dir".into(),
        st.s.dir.join("rm").display().to_string(),
        "--fake-dax".into(),
        format!("{}:256M", st.pool.display()),
        "--grace-period-s".into(),
        grace_s.to_string(),
    ]
}

/// Kills the stack's RM (SIGKILL: its state on disk stays) and starts it again with
/// `args` on `port` (0: a free one, where maru-server does not look for it).
fn restart_rm(st: &mut Stack, args: &[String], port: u16) {
    // SAFETY: kill(2) on our own, not yet reaped child.
    unsafe {
        libc::kill(st.rm.child.id() as i32, libc::SIGKILL);
    }
    let _ = st.rm.child.wait();
    st.rm = Daemon::start_at(RM_BIN, args, &st.s.dir, port);
}

fn total_stat(h: &Handler, name: &str) -> u64 {
    h.stats()["total"][name].as_u64().unwrap_or(0)
}

/// The RM reaps a region while maru-server cannot reach it (here: the RM restarted
/// where maru-server does not look, then came back): maru-server drops the region at
/// its next check, and the owner learns it at its next heartbeat. The owner then
/// drops the spare pages it kept in that region and writes nothing more into it, so
/// every next store lands in a new region and is published.
#[test]
fn stores_after_the_rm_took_a_region_back_go_to_a_new_one() {
    let mut st = stack(false, &["--session-timeout-s", "3"]);
    let h = Handler::open(&config(&st, "cxl", "engine-a")).unwrap();
    let data: Vec<Vec<u8>> = (0..50).map(chunk).collect();
    let keys: Vec<String> = (0..50).map(|i| format!("before-{i}")).collect();
    let items = |keys: &[String], data: &[Vec<u8>]| -> Vec<(String, Vec<u8>)> {
        keys.iter().cloned().zip(data.iter().cloned()).collect()
    };
    let store = |h: &Handler, it: &[(String, Vec<u8>)]| -> Vec<bool> {
        let v: Vec<(&str, &[u8])> = it.iter().map(|(k, d)| (k.as_str(), d.as_slice())).collect();
        h.store_batch(&v, Some("r")).unwrap()
    };
    // A few stores: the pool now keeps spare pages in its first region.
    assert!(store(&h, &items(&keys[..5], &data[..5])).iter().all(|&x| x));
    let port = st.rm.port();
    let args = rm_args(&st, 1);
    restart_rm(&mut st, &args, 0);
    // The restarted RM reaps the regions of an owner absent past the grace period.
    std::thread::sleep(Duration::from_millis(2500));
    let args = rm_args(&st, 30);
    restart_rm(&mut st, &args, port);
    let deadline = Instant::now() + Duration::from_secs(20);
    while total_stat(&h, "regions_lost") == 0 {
        assert!(
            Instant::now() < deadline,
            "the owner never heard that its region went"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let after: Vec<String> = (0..50).map(|i| format!("after-{i}")).collect();
    let ok = store(&h, &items(&after, &data));
    assert!(ok.iter().all(|&x| x), "stores after the loss: {ok:?}");
    let got = h.load_batch(&after, Some("r")).unwrap();
    for (g, d) in got.iter().zip(&data) {
        assert_eq!(g.as_deref().map(digest), Some(digest(d)));
    }
    assert_eq!(
        h.exists_batch(&keys[..5], Some("r")).unwrap(),
        vec![false; 5],
        "the lost region's keys went with it"
    );
    h.close().unwrap();
}

/// Threads sharing a `cxl` handler: while one thread's load copies out of the shared
/// mapping, another thread's request on the same pool goes through (the copy runs
/// without the pool's lock). With the lock held over the copy, the second request
/// waits for the first, which here waits for it: the test fails at its timeout.
#[test]
fn a_cxl_load_copies_without_holding_the_pool() {
    let st = stack(false, &[]);
    let h = std::sync::Arc::new(Handler::open(&config(&st, "cxl", "engine-a")).unwrap());
    let keys: Vec<String> = (0..4).map(|i| format!("par-{i}")).collect();
    let data: Vec<Vec<u8>> = (0..4).map(chunk).collect();
    let items = support::items(&keys, &data);
    assert!(h
        .store_batch(&items, Some("par"))
        .unwrap()
        .iter()
        .all(|&x| x));
    let (in_copy_tx, in_copy_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Vec<bool>>();
    let other = {
        let h = h.clone();
        let keys = keys.clone();
        std::thread::spawn(move || {
            // Once the first thread is inside its copy, ask the same pool.
            in_copy_rx.recv().expect("the loader signals");
            let _ = done_tx.send(h.exists_batch(&keys, Some("par")).unwrap());
        })
    };
    let mut seen = Vec::new();
    let mut answered = None;
    h.load_each(&keys, Some("par"), false, &mut |i, b| {
        if i == 0 {
            in_copy_tx.send(()).expect("the other thread waits");
            answered = done_rx.recv_timeout(Duration::from_secs(10)).ok();
        }
        seen.push((i, digest(b)));
    })
    .unwrap();
    assert_eq!(
        answered,
        Some(vec![true; 4]),
        "another thread's exists went through while a load was copying"
    );
    let want: Vec<(usize, [u8; 32])> = data.iter().map(|d| digest(d)).enumerate().collect();
    assert_eq!(seen, want);
    other.join().unwrap();
    match std::sync::Arc::try_unwrap(h) {
        Ok(h) => h.close().unwrap(),
        Err(_) => panic!("the other thread still holds the handler"),
    }
}

/// The soft transport, counting the bytes of READ and of WRITE batches posted and not
/// yet waited for (a batch is forgotten once its outcome is taken), and the most seen
/// at once.
#[derive(Default)]
struct Counts {
    open: std::collections::HashMap<u64, u64>,
    posts: u64,
    most: u64,
}

struct CountingTransfers {
    inner: maru::transport::soft::SoftTransport,
    reads: std::sync::Mutex<Counts>,
    writes: std::sync::Mutex<Counts>,
}

impl CountingTransfers {
    /// (batches posted, most bytes in flight at once) of one kind since the last call.
    fn take(&self, kind: maru::transport::OpKind) -> (u64, u64) {
        let mut c = self.counts(kind).lock().unwrap();
        let r = (c.posts, c.most);
        c.posts = 0;
        c.most = 0;
        r
    }
    fn counts(&self, kind: maru::transport::OpKind) -> &std::sync::Mutex<Counts> {
        match kind {
            maru::transport::OpKind::Read => &self.reads,
            maru::transport::OpKind::Write => &self.writes,
        }
    }
}

impl maru::transport::Transport for CountingTransfers {
    fn name(&self) -> &'static str {
        "counting"
    }
    support::delegate_setup!();
    fn post(
        &self,
        peer: maru::transport::PeerId,
        ops: &[maru::transport::Op],
    ) -> Result<maru::transport::BatchId, maru::transport::TransportError> {
        let Some(kind) = ops.first().map(|o| o.kind) else {
            return self.inner.post(peer, ops);
        };
        let bytes: u64 = ops.iter().map(|o| o.len).sum();
        let mut c = self.counts(kind).lock().unwrap();
        let id = self.inner.post(peer, ops)?;
        c.open.insert(id.0, bytes);
        c.posts += 1;
        c.most = c.most.max(c.open.values().sum());
        Ok(id)
    }
    fn state(&self, b: maru::transport::BatchId) -> maru::transport::BatchState {
        self.inner.state(b)
    }
    fn wait(&self, b: maru::transport::BatchId, t: Duration) -> maru::transport::BatchState {
        self.inner.wait(b, t)
    }
    fn forget(&self, b: maru::transport::BatchId) {
        self.reads.lock().unwrap().open.remove(&b.0);
        self.writes.lock().unwrap().open.remove(&b.0);
        self.inner.forget(b)
    }
    fn fence(&self, peer: maru::transport::PeerId) -> Result<(), maru::transport::TransportError> {
        self.inner.fence(peer)
    }
}

/// Stores and loads of many chunks, copying or through the caller's slots, transfer
/// them in windows of 2 MiB with at most two windows in flight, not all at once (a
/// copying load's slots take the next window once copied out, a copying store's slots
/// are filled for the next window while the one ahead is on the wire); every byte
/// arrives, and every slot is back afterwards.
#[test]
fn transfers_go_in_windows_of_at_most_two_in_flight_and_every_byte_arrives() {
    use maru::transport::OpKind::{Read, Write};
    use maru::worker::SlotPool;
    const N: usize = 96; // 6 MiB of 64 KiB chunks: three windows
    const LEN: usize = 64 << 10;
    let st = stack(true, &[]);
    let key = maru::auth::load_key_file(&st.key_path).unwrap();
    let t = std::sync::Arc::new(CountingTransfers {
        inner: maru::transport::soft::SoftTransport::new("windows-engine", Some(key)),
        reads: Default::default(),
        writes: Default::default(),
    });
    let mut cfg: serde_json::Value =
        serde_json::from_str(&config(&st, "remote_cxl", "windows")).unwrap();
    cfg["load_slots"] = N.into();
    cfg["store_slots"] = N.into();
    let h = Handler::open_with_transport(&cfg.to_string(), t.clone()).unwrap();
    let in_windows = |what: &str, (posts, most): (u64, u64)| {
        assert!(posts >= 3, "{what}: {posts} batches, not in windows");
        assert!(
            most <= 4 << 20,
            "{what}: {most} bytes in flight at once, more than two windows of 2 MiB"
        );
    };
    let data: Vec<Vec<u8>> = (0..2 * N)
        .map(|i| self_checking_chunk(i as u64, LEN))
        .collect();
    let keys: Vec<String> = (0..2 * N).map(|i| format!("window-{i}")).collect();

    // Copying store of the first N, through the caller's slots for the next N.
    let items: Vec<(&str, &[u8])> = keys[..N]
        .iter()
        .map(|k| k.as_str())
        .zip(data.iter().map(|d| d.as_slice()))
        .collect();
    assert_eq!(h.store_batch(&items, Some("w")).unwrap(), vec![true; N]);
    in_windows("copying store", t.take(Write));
    let slots = h
        .acquire_slots(SlotPool::Store, N, Duration::from_secs(5))
        .unwrap();
    assert_eq!(slots.len(), N);
    for (s, d) in slots.iter().zip(&data[N..]) {
        // SAFETY: our slot, large enough for one chunk.
        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), s.ptr, LEN) };
    }
    let ids: Vec<u64> = slots.iter().map(|s| s.id).collect();
    assert_eq!(
        h.store_slots(&keys[N..], &ids, &[LEN; N], Some("w"))
            .unwrap(),
        vec![true; N]
    );
    in_windows("store from slots", t.take(Write));
    h.release_slots(&ids).unwrap();

    // Copying load of all 2N, then into the caller's slots.
    let got = h.load_batch(&keys, Some("w")).unwrap();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(
            g.as_deref().map(digest),
            Some(digest(&data[i])),
            "chunk {i}"
        );
    }
    in_windows("copying load", t.take(Read));
    let slots = h
        .acquire_slots(SlotPool::Load, N, Duration::from_secs(5))
        .unwrap();
    assert_eq!(slots.len(), N);
    let ids: Vec<u64> = slots.iter().map(|s| s.id).collect();
    let lens = h.load_slots(&keys[N..], &ids, Some("w")).unwrap();
    for (i, s) in slots.iter().enumerate() {
        assert_eq!(lens[i], Some(LEN), "chunk {}", N + i);
        // SAFETY: our slot, holding the chunk just loaded.
        let b = unsafe { std::slice::from_raw_parts(s.ptr, LEN) };
        assert_eq!(
            digest(b),
            digest(&data[N + i]),
            "chunk {} in its slot",
            N + i
        );
    }
    in_windows("load into slots", t.take(Read));
    h.release_slots(&ids).unwrap();

    assert_eq!(h.held_slots(), 0);
    for pool in [SlotPool::Load, SlotPool::Store] {
        let all = h.acquire_slots(pool, N, Duration::from_secs(5)).unwrap();
        assert_eq!(all.len(), N, "every {pool} slot is back");
        h.release_slots(&all.iter().map(|s| s.id).collect::<Vec<_>>())
            .unwrap();
    }
    h.close().unwrap();
}

/// Pages of `len` bytes at `ptr` that are in memory (`mincore`).
fn resident_pages(ptr: *mut u8, len: usize) -> usize {
    let page = 4096;
    let start = ptr as usize & !(page - 1);
    let n = (ptr as usize + len - start).div_ceil(page);
    let mut v = vec![0u8; n];
    // SAFETY: a page-aligned range inside the handler's staging buffer, which stays
    // mapped while the handler is open; one byte per page.
    let r = unsafe { libc::mincore(start as *mut libc::c_void, n * page, v.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    v.iter().filter(|&&b| b & 1 == 1).count()
}

/// A remote_cxl handler's staging buffer is in memory from the open on, so no
/// transfer stops to fault a page in (as an RDMA registration pins it); a cxl
/// handler's, which only the slot API uses, costs memory only where it is touched.
#[test]
fn a_remote_cxl_handlers_staging_buffer_is_resident_from_the_open() {
    use maru::worker::SlotPool;
    let st = stack(true, &[]);
    for backend in ["remote_cxl", "cxl"] {
        let h = Handler::open(&config(&st, backend, &format!("resident-{backend}"))).unwrap();
        let mut ids = Vec::new();
        let (mut pages, mut resident) = (0, 0);
        for pool in [SlotPool::Load, SlotPool::Store] {
            for s in h.acquire_slots(pool, 64, Duration::from_secs(5)).unwrap() {
                pages += s.capacity.div_ceil(4096);
                resident += resident_pages(s.ptr, s.capacity);
                ids.push(s.id);
            }
        }
        assert_eq!(ids.len(), 24, "{backend}: every slot");
        if backend == "remote_cxl" {
            assert_eq!(resident, pages, "{backend}: every staging page in memory");
        } else {
            assert_eq!(resident, 0, "{backend}: no staging page touched yet");
        }
        h.release_slots(&ids).unwrap();
        h.close().unwrap();
    }
}

/// The walks of `docs/worker.md` hold: a warm store or load takes the pool core's
/// lock exactly as often as its walk says, the same for 16 chunks as for 8, not once
/// per chunk (`maru::worker::core_locks`, counted on the calling thread): a store 3
/// times on both backends (its start, which on remote_cxl also notes where its
/// pages' WRITEs go, so its windows are planned without the lock; the publish's
/// re-check; its end: a window whose batches all completed settles without it); a
/// load once on cxl and 3 times on remote_cxl (its leases' agents away, its first
/// window's plan with every range of the request mapped, its end; whether every agent
/// is away is read without it). A lock added back fails it: seen failing with
/// `PoolCore::store_begin` taking no spare pages (cxl stores took 4) and with the
/// write targets unused (remote_cxl stores took 4).
#[test]
fn a_store_or_a_load_takes_the_pool_core_lock_a_few_times_whatever_its_chunks() {
    let st = stack(true, &[]);
    for (backend, walk) in [("cxl", (3, 1)), ("remote_cxl", (3, 3))] {
        let cfg = st.handler_config(backend, &format!("locks-{backend}"), "llama-test", (16, 16));
        let h = Handler::open(&cfg.to_string()).expect("open");
        let keys: Vec<String> = (0..40).map(|i| format!("locks/{backend}/{i}")).collect();
        let data: Vec<Vec<u8>> = (0..40).map(chunk).collect();
        let items = support::items(&keys, &data);
        // Warm: a region taken (the first store), spare pages kept (the second's alloc).
        for r in [0..8, 8..16] {
            assert!(h.store_batch(&items[r], None).unwrap().iter().all(|&s| s));
        }
        let mut counted = Vec::new();
        for r in [16..24, 24..40] {
            let before = maru::worker::core_locks();
            let stored = h.store_batch(&items[r.clone()], None).unwrap();
            let store = maru::worker::core_locks() - before;
            assert!(stored.iter().all(|&s| s), "{backend}: stored");
            // `maru_load_pieces`' call: the leases released after it returns.
            let mut got: Vec<Option<Vec<u8>>> = vec![None; r.len()];
            let before = maru::worker::core_locks();
            h.load_each(&keys[r.clone()], None, true, &mut |i, b| {
                got[i] = Some(b.to_vec())
            })
            .unwrap();
            let load = maru::worker::core_locks() - before;
            for (g, d) in got.iter().zip(&data[r]) {
                assert_eq!(
                    g.as_deref().map(digest),
                    Some(digest(d)),
                    "{backend}: loaded whole"
                );
            }
            counted.push((store, load));
        }
        eprintln!("{backend}: pool core locks (store, load), 8 then 16 chunks: {counted:?}");
        assert_eq!(
            counted[0], counted[1],
            "{backend}: as many for 16 chunks as for 8"
        );
        assert_eq!(
            counted[0], walk,
            "{backend}: pool core locks (store, load) as docs/worker.md's walks say"
        );
        h.close().unwrap();
    }
}

/// Requests at the agent whose `--metrics` listen on `port` that mapped ranges for
/// reading (`map_reads`, and the single-range `map_read` of earlier versions), any
/// result.
fn read_map_requests(port: u16) -> f64 {
    support::scrape(port)
        .iter()
        .filter(|(s, _)| s.starts_with(r#"maru_agent_requests_total{op="map_read"#))
        .map(|(_, v)| v)
        .sum()
}

/// A first load of another engine's 16 chunks maps all their ranges at their agent
/// with one `map_reads` request, not one round trip per range (under a CPU hog 16
/// round trips in a row ran past the request's deadline: the connection dropped, the
/// agent was marked away and the load missed every key); a second load asks nothing.
/// Counted at the agent's metrics. Seen failing with the ranges sent one to a
/// request (16 requests).
#[test]
fn a_first_load_of_another_engines_chunks_maps_them_with_one_request_at_their_agent() {
    let metrics = support::free_port();
    let args = support::strings(&["--region-size", "8M", "--chunk-size", "64K"]);
    let agent_args =
        |_: &support::Scratch| support::strings(&["--metrics", &format!("127.0.0.1:{metrics}")]);
    let st = support::stack_with("worker-mapreads", "256M", true, agent_args, &args);
    let a = Handler::open(&config(&st, "remote_cxl", "mapreads-writer")).unwrap();
    let b = Handler::open(&config(&st, "remote_cxl", "mapreads-reader")).unwrap();
    let keys: Vec<String> = (0..16).map(|i| format!("mapreads-{i}")).collect();
    let data: Vec<Vec<u8>> = (0..16).map(chunk).collect();
    let stored = a
        .store_batch(&support::items(&keys, &data), Some("mr"))
        .unwrap();
    assert!(stored.iter().all(|&x| x), "{stored:?}");

    let before = read_map_requests(metrics);
    let got = b.load_batch(&keys, Some("mr")).unwrap();
    let first = read_map_requests(metrics) - before;
    for ((k, d), g) in keys.iter().zip(&data).zip(&got) {
        assert_eq!(g.as_deref().map(digest), Some(digest(d)), "{k}");
    }
    assert_eq!(first, 1.0, "requests mapping the 16 ranges for reading");
    let again = b.load_batch(&keys, Some("mr")).unwrap();
    assert!(again.iter().all(Option::is_some));
    assert_eq!(
        read_map_requests(metrics) - before,
        1.0,
        "a second load of the same ranges maps nothing"
    );
    a.close().unwrap();
    b.close().unwrap();
}
