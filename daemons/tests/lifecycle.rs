//! The worker's region lifecycle rules against real daemons on loopback (RM with a
//! fake DAX pool, one agent, maru-server, two `remote_cxl` engines over the soft
//! transport): a reboot of the memory node, an agent restart on the same boot, an
//! agent that stops answering, publish after WRITE on the copying store path, and the
//! client half of the key proof. Each rule also has a unit test in
//! `libmaru/src/worker/lifecycle.rs` or `transfer.rs`.

mod support;

use maru::auth::SharedKey;
use maru::worker::Handler;
use std::time::{Duration, Instant};
use support::{wait_until, Scratch, Stack};

fn stack(tag: &str) -> Stack {
    let server_args: Vec<String> = ["--region-size", "8M", "--chunk-size", "64K"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    // The agent reads its boot id from a file the tests rewrite to "reboot" the node.
    let boot = |s: &Scratch| {
        let path = s.dir.join("boot_id");
        std::fs::write(&path, "boot-one\n").unwrap();
        vec!["--boot-id-file".into(), path.display().to_string()]
    };
    support::stack_with(tag, "256M", true, boot, &server_args)
}

/// What these tests do with a stack.
trait Life {
    fn config(&self, engine: &str) -> String;
    /// kill -9 the agent and start it again on its port, with `boot` as boot id.
    fn restart_agent_on(&mut self, boot: &str);
    fn signal_agent(&self, sig: i32);
}

impl Life for Stack {
    fn config(&self, engine: &str) -> String {
        let mut c = self.handler_config("remote_cxl", engine, "llama-test", (8, 16));
        c["timeout_ms"] = 2000.into();
        c.to_string()
    }

    fn restart_agent_on(&mut self, boot: &str) {
        std::fs::write(self.s.dir.join("boot_id"), format!("{boot}\n")).unwrap();
        self.restart_agent();
    }

    fn signal_agent(&self, sig: i32) {
        let pid = self.agent.as_ref().expect("the agent runs").child.id() as i32;
        // SAFETY: kill(2) on our own, not yet reaped child.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

fn chunk(tag: &str, i: usize) -> Vec<u8> {
    let mut v = vec![0u8; 64 << 10];
    for (j, b) in v.iter_mut().enumerate() {
        *b = (j as u64)
            .wrapping_mul(31)
            .wrapping_add(i as u64 * 7 + tag.len() as u64) as u8;
    }
    v
}

fn keys(tag: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{tag}-{i}")).collect()
}

/// Stores `keys` (chunk per key) in one request; true when every chunk is stored.
fn store_all(h: &Handler, tag: &str, ks: &[String]) -> bool {
    let data: Vec<Vec<u8>> = (0..ks.len()).map(|i| chunk(tag, i)).collect();
    let items = support::items(ks, &data);
    h.store_batch(&items, Some("lc"))
        .is_ok_and(|r| r.iter().all(|&x| x))
}

/// Loads `keys` one by one: per key, None (miss or failed) or whether the bytes are
/// the ones stored under `tag`.
fn load_each(h: &Handler, tag: &str, ks: &[String]) -> Vec<Option<bool>> {
    ks.iter()
        .enumerate()
        .map(|(i, k)| {
            h.load(k, Some("lc"))
                .ok()
                .flatten()
                .map(|b| b == chunk(tag, i))
        })
        .collect()
}

fn all_loaded(h: &Handler, tag: &str, ks: &[String]) -> bool {
    load_each(h, tag, ks).iter().all(|x| *x == Some(true))
}

fn none_found(h: &Handler, ks: &[String]) -> bool {
    h.exists_batch(ks, Some("lc"))
        .is_ok_and(|e| e.iter().all(|&x| !x))
}

/// Rule 1. The memory node reboots (the agent comes back with another boot id; the
/// fake DAX file keeps the old bytes, as CXL memory would not): no load, by the owner
/// or a reader, returns a chunk stored before, from the first load on; within 2 s
/// every old key is gone and both store and load again.
#[test]
fn after_a_reboot_of_the_memory_node_no_old_key_loads_and_stores_resume_within_2_s() {
    let mut st = stack("reboot");
    let owner = Handler::open(&st.config("reboot-owner")).unwrap();
    let reader = Handler::open(&st.config("reboot-reader")).unwrap();
    let before = keys("before", 8);
    assert!(store_all(&owner, "before", &before));
    assert!(
        all_loaded(&reader, "before", &before),
        "read before the reboot"
    );

    st.restart_agent_on("boot-two");
    let t0 = Instant::now();
    // At once: no old chunk comes back, to the owner or the reader.
    for (who, h) in [("owner", &owner), ("reader", &reader)] {
        let got = load_each(h, "before", &before);
        assert!(
            got.iter().all(Option::is_none),
            "{who} loaded a chunk written before the reboot: {got:?}"
        );
    }
    // Within 2 s: every old key is gone for everyone, and stores and loads work.
    let after = keys("after", 8);
    let back = wait_until(Duration::from_secs(2), || {
        none_found(&owner, &before)
            && none_found(&reader, &before)
            && store_all(&owner, "after", &after)
            && all_loaded(&reader, "after", &after)
    });
    assert!(
        back,
        "not back within 2 s of the reboot ({:?}): owner {} reader {}",
        t0.elapsed(),
        owner.stats(),
        reader.stats()
    );
    assert!(
        load_each(&owner, "before", &before)
            .iter()
            .all(Option::is_none),
        "old keys stay gone"
    );
    owner.close().unwrap();
    reader.close().unwrap();
}

/// Rule 4. The agent restarts on the same boot (kill -9, same boot id): the bytes are
/// still there, so keys that `exists` reports load again within 2 s, for the owner
/// (which does nothing meanwhile: it notices by itself) and for a fresh reader.
#[test]
fn after_an_agent_restart_on_the_same_boot_existing_keys_load_within_2_s() {
    let mut st = stack("restart");
    let owner = Handler::open(&st.config("restart-owner")).unwrap();
    let ks = keys("kept", 8);
    assert!(store_all(&owner, "kept", &ks));
    st.restart_agent_on("boot-one");
    let reader = Handler::open(&st.config("restart-reader")).unwrap();
    let t0 = Instant::now();
    let ok = wait_until(Duration::from_secs(2), || {
        all_loaded(&reader, "kept", &ks) && all_loaded(&owner, "kept", &ks)
    });
    assert!(
        ok,
        "existing keys do not load within 2 s of the restart ({:?}): reader {}",
        t0.elapsed(),
        reader.stats()
    );
    assert!(reader
        .exists_batch(&ks, Some("lc"))
        .unwrap()
        .iter()
        .all(|&x| x));
    owner.close().unwrap();
    reader.close().unwrap();
}

/// Rules 5, 2 and 3. The agent stops answering (SIGSTOP): its regions keep their keys
/// for 30 s, then the owner gives them back and no engine finds them. A store while
/// it is stopped times out: its slots stay out of use (the fence cannot succeed while
/// the target may still apply the WRITE), and come back once the agent runs again and
/// confirms; then the owner stores again.
#[test]
fn an_agent_silent_for_30_s_loses_its_keys_and_storing_resumes_when_it_answers() {
    let st = stack("silent");
    let owner = Handler::open(&st.config("silent-owner")).unwrap();
    let reader = Handler::open(&st.config("silent-reader")).unwrap();
    let ks = keys("old", 4);
    assert!(store_all(&owner, "old", &ks));

    st.signal_agent(libc::SIGSTOP);
    let t0 = Instant::now();
    // A store while the target cannot answer: its WRITE's outcome is unknown.
    assert!(!store_all(&owner, "stuck", &keys("stuck", 1)));
    let free_store = |h: &Handler| h.stats()["staging"]["free_store_slots"].as_u64();
    assert!(
        free_store(&owner) < Some(16),
        "the stuck WRITE's slot is kept while its peer cannot be fenced"
    );
    // Keys stay for the first 30 s (only a reader's exists is asked: maru-server).
    std::thread::sleep(Duration::from_secs(20).saturating_sub(t0.elapsed()));
    assert!(
        reader
            .exists_batch(&ks, Some("lc"))
            .unwrap()
            .iter()
            .all(|&x| x),
        "keys of a region whose agent was silent for 20 s are still there"
    );
    let gone = wait_until(Duration::from_secs(25), || none_found(&reader, &ks));
    let after = t0.elapsed();
    assert!(
        gone,
        "keys still found {after:?} after the agent stopped answering"
    );
    assert!(
        after >= Duration::from_secs(29),
        "keys went after {after:?}, before the agent was silent for 30 s"
    );

    st.signal_agent(libc::SIGCONT);
    let new = keys("new", 4);
    let back = wait_until(Duration::from_secs(15), || {
        store_all(&owner, "new", &new) && all_loaded(&reader, "new", &new)
    });
    assert!(
        back,
        "no stores after the agent answers again: {}",
        owner.stats()
    );
    assert!(
        wait_until(Duration::from_secs(10), || free_store(&owner) == Some(16)),
        "the kept slot comes back once the target confirmed: {}",
        owner.stats()
    );
    owner.close().unwrap();
    reader.close().unwrap();
}

/// The soft transport, except that WRITEs of the chunks of odd index (see `chunk`:
/// their first byte) fail at the target, every time (a known outcome: nothing of them
/// was written).
struct FailingWrites {
    inner: maru::transport::soft::SoftTransport,
    local: std::sync::OnceLock<(usize, usize)>,
    failed: std::sync::Mutex<std::collections::HashSet<u64>>,
}

impl FailingWrites {
    /// Whether the chunk at `off` of the staging buffer is one of odd index.
    fn odd(&self, off: u64) -> bool {
        let Some(&(ptr, len)) = self.local.get() else {
            return false;
        };
        if off as usize >= len {
            return false;
        }
        // SAFETY: inside the registered staging buffer, which outlives the transfer.
        let first = unsafe { *(ptr as *const u8).add(off as usize) };
        (0..8).any(|i| i % 2 == 1 && first == chunk("pub", i)[0])
    }
}

impl maru::transport::Transport for FailingWrites {
    fn name(&self) -> &'static str {
        "failing-writes"
    }
    fn register_local(
        &self,
        b: maru::transport::LocalBuffer,
    ) -> Result<(), maru::transport::TransportError> {
        let _ = self.local.set((b.ptr as usize, b.len));
        self.inner.register_local(b)
    }
    support::delegate_connect!();
    fn post(
        &self,
        peer: maru::transport::PeerId,
        ops: &[maru::transport::Op],
    ) -> Result<maru::transport::BatchId, maru::transport::TransportError> {
        let odd = ops
            .iter()
            .any(|o| o.kind == maru::transport::OpKind::Write && self.odd(o.local_offset));
        if odd {
            // Sent with a key the target does not know: it writes nothing.
            let bad: Vec<maru::transport::Op> = ops
                .iter()
                .map(|o| maru::transport::Op { rkey: 0xdead, ..*o })
                .collect();
            let b = self.inner.post(peer, &bad)?;
            self.failed.lock().unwrap().insert(b.0);
            return Ok(b);
        }
        self.inner.post(peer, ops)
    }
    fn state(&self, b: maru::transport::BatchId) -> maru::transport::BatchState {
        self.inner.state(b)
    }
    fn wait(&self, b: maru::transport::BatchId, t: Duration) -> maru::transport::BatchState {
        self.inner.wait(b, t)
    }
    fn forget(&self, b: maru::transport::BatchId) {
        self.inner.forget(b)
    }
    fn fence(&self, peer: maru::transport::PeerId) -> Result<(), maru::transport::TransportError> {
        self.inner.fence(peer)
    }
}

/// Rule 6, publish after WRITE, on the remote_cxl copying store path: a chunk whose
/// WRITE failed is reported not stored and never found; the others load whole.
#[test]
fn a_copying_store_publishes_only_chunks_whose_write_completed() {
    let st = stack("publish");
    let key = maru::auth::load_key_file(&st.key_path).unwrap();
    let t = std::sync::Arc::new(FailingWrites {
        inner: maru::transport::soft::SoftTransport::new("failing-writer", Some(key)),
        local: Default::default(),
        failed: Default::default(),
    });
    let owner = Handler::open_with_transport(&st.config("publish-owner"), t.clone()).unwrap();
    let reader = Handler::open(&st.config("publish-reader")).unwrap();
    let ks = keys("pub", 8);
    let stored: Vec<bool> = ks
        .iter()
        .enumerate()
        .map(|(i, k)| owner.store(k, &chunk("pub", i), Some("lc")).unwrap())
        .collect();
    assert!(!t.failed.lock().unwrap().is_empty(), "some WRITEs failed");
    let odd_fail: Vec<bool> = (0..8).map(|i| i % 2 == 0).collect();
    assert_eq!(stored, odd_fail, "a chunk whose WRITE failed is not stored");
    let found = reader.exists_batch(&ks, Some("lc")).unwrap();
    assert_eq!(
        found, stored,
        "exactly the chunks whose WRITE completed are found"
    );
    for (i, got) in load_each(&reader, "pub", &ks).into_iter().enumerate() {
        assert_eq!(got, stored[i].then_some(true), "chunk {i}");
    }
    owner.close().unwrap();
    reader.close().unwrap();
}

/// Rule 6, the client half of the key proof: a worker holding the agent key refuses a
/// "agent" that does not prove the key (none, or a wrong one), before any request, so
/// a fake agent cannot serve it bogus KV.
#[test]
fn a_client_with_the_key_refuses_an_agent_that_does_not_prove_it() {
    use maru::net::handshake::ServerHandshake;
    use maru::net::{Client, ClientError, ClientOptions};
    use maru::testing::serve_handshake;

    let key = SharedKey::generate().unwrap();
    for server_key in [None, Some(SharedKey::generate().unwrap())] {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let proves = server_key.is_some();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let info = serde_json::json!({"boot_id": "fake", "epoch": 1});
            let hs = ServerHandshake::new(maru::wire::agent::SERVICE, server_key, info);
            // Would now serve requests: the client must not get here.
            serve_handshake(&mut s, hs).is_some()
        });
        let mut opts = ClientOptions::new(maru::wire::agent::SERVICE, "worker");
        opts.key = Some(key.clone());
        opts.connect_timeout = Duration::from_secs(5);
        let r = Client::connect(&addr, &opts);
        assert!(
            matches!(r, Err(ClientError::Auth { .. })),
            "server proving {}: {:?}",
            if proves { "a wrong key" } else { "nothing" },
            r.as_ref().err()
        );
        drop(r);
        let served = fake.join().unwrap();
        if !proves {
            // It "accepted" us, but we refused before sending anything else.
            assert!(served);
        }
    }
}
