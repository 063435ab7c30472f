//! maru-usage against real daemons on loopback: RM (fake DAX, with a key), agent and
//! maru-server; two engines share chunks over remote_cxl (soft transport) and the
//! table shows both engines, their keys and hit rates, the pool and its regions.

mod support;

use maru::auth::{keyfile::write_new_key_file, SharedKey};
use maru::worker::Handler;
use std::process::{Command, Output};
use support::{Scratch, Stack};

const USAGE_BIN: &str = env!("CARGO_BIN_EXE_maru-usage");

fn stack() -> Stack {
    stack_with(Scratch::new("usage"), &[])
}

/// An RM (its key made in its state directory), an agent and maru-server (regions of
/// 8 MiB, chunks of 64 KiB, then `server_extra`) over a 128 MiB pool, in `s`.
fn stack_with(s: Scratch, server_extra: &[String]) -> Stack {
    let mut args: Vec<String> = ["--region-size", "8M", "--chunk-size", "64K"]
        .map(String::from)
        .to_vec();
    args.extend_from_slice(server_extra);
    let key = SharedKey::generate().unwrap();
    support::stack_keyed(s, "128M", true, &key, |_| Vec::new(), &args)
}

/// maru-usage's flags naming the stack's maru-server, its RM and the RM's key file.
fn server_and_rm(st: &Stack) -> Vec<String> {
    let rm_key = support::rm_key_path(&st.rm.addr).expect("the RM's key file");
    [
        "--server",
        &st.server.addr,
        "--rm",
        &st.rm.addr,
        "--rm-key-file",
        &rm_key.display().to_string(),
    ]
    .map(String::from)
    .to_vec()
}

fn engine(st: &Stack, id: &str) -> Handler {
    engine_as(
        st,
        id,
        &support::server_key_file(&st.server.addr),
        "usage-model",
    )
}

/// An engine proving the maru-server key `key_file` (its tenant's) in `namespace`.
fn engine_as(st: &Stack, id: &str, key_file: &str, namespace: &str) -> Handler {
    let mut cfg = st.handler_config("remote_cxl", id, namespace, (4, 8));
    cfg["server_key_file"] = key_file.into();
    Handler::open(&cfg.to_string()).unwrap_or_else(|e| panic!("open {id}: {e}"))
}

/// Runs maru-usage with `args`, proving the key of the maru-server named by
/// `--server` when it was started here (MARU_SERVER_KEY_FILE).
fn usage(args: &[&str]) -> Output {
    let server = args
        .iter()
        .position(|a| *a == "--server")
        .and_then(|i| args.get(i + 1));
    let mut cmd = Command::new(USAGE_BIN);
    cmd.args(args)
        .env_remove("MARU_SERVER_ADDRESS")
        .env_remove("MARU_RM_KEY_FILE")
        .env_remove("MARU_SERVER_KEY_FILE");
    if let Some(k) = server.and_then(|a| support::server_key_path(a)) {
        cmd.env("MARU_SERVER_KEY_FILE", k);
    }
    cmd.output().expect("run maru-usage")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The row of an engine in the table, split into columns: its tenant, then the
/// columns from ENGINE on.
fn tenant_row<'a>(out: &'a str, engine: &str) -> (&'a str, Vec<&'a str>) {
    let cols: Vec<&str> = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|c| c.get(1) == Some(&engine))
        .unwrap_or_else(|| panic!("no row for {engine} in\n{out}"));
    (cols[0], cols[1..].to_vec())
}

/// The columns of an engine's row from ENGINE on (its tenant is `default`).
fn row<'a>(out: &'a str, engine: &str) -> Vec<&'a str> {
    let (tenant, cols) = tenant_row(out, engine);
    assert_eq!(tenant, "default", "{out}");
    cols
}

#[test]
fn table_shows_engines_pool_and_regions() {
    let st = stack();
    let a = engine(&st, "usage-engine-a");
    let b = engine(&st, "usage-engine-b");
    let data: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 4096 + i as usize]).collect();
    let keys: Vec<String> = (0..6).map(|i| format!("usage-{i}")).collect();
    let items = support::items(&keys, &data);
    assert!(a.store_batch(&items, Some("r")).unwrap().iter().all(|&x| x));
    // Engine B finds all six and misses two it asks for on top: 75 % hits.
    let mut ask = keys.clone();
    ask.extend(["usage-x".to_string(), "usage-y".to_string()]);
    let got = b.load_batch(&ask, Some("r")).unwrap();
    assert_eq!(got.iter().filter(|g| g.is_some()).count(), 6);

    let args = server_and_rm(&st);
    let o = usage(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    // Columns: TENANT, then (row) ENGINE NAMESPACE BACKEND SESS REGIONS ALLOC USED KEYS
    // KEY_MiB HITS MISSES HIT% LEASES PINS CONN
    let ra = row(&out, "usage-engine-a");
    assert_eq!(ra[1], "usage-model", "{out}");
    assert_eq!(ra[2], "remote_cxl", "{out}");
    assert_eq!(ra[7], "6", "engine A's regions hold its 6 keys\n{out}");
    assert_eq!(ra[11], "-", "engine A asked for nothing\n{out}");
    let rb = row(&out, "usage-engine-b");
    assert_eq!((rb[9], rb[10], rb[11]), ("6", "2", "75.0%"), "{out}");
    assert_eq!(rb[13], "0", "B pins nothing\n{out}");
    assert_eq!(rb[14], "1/1", "B's session is connected\n{out}");
    assert!(out.contains("hit rate 75.0% (6 hits, 2 misses)"), "{out}");
    assert!(
        out.contains(&st.pool.display().to_string()),
        "the pool\n{out}"
    );
    assert!(
        out.contains("maru-server@"),
        "regions owned by maru-server\n{out}"
    );
    assert!(
        out.contains("mem0@"),
        "the agent's hold on A's region\n{out}"
    );

    // JSON: the same figures for scripts.
    let o = usage(&["--server", &st.server.addr, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["stats"]["total"]["hits"], 6);
    assert_eq!(v["usage"]["sessions"].as_array().map(|s| s.len()), Some(2));
    assert!(v["rm"].is_null());

    // --watch refreshes and stops after --count, without a terminal.
    let o = usage(&[
        "--server",
        &st.server.addr,
        "--watch",
        "0.2",
        "--count",
        "3",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert_eq!(out.matches("q or Ctrl-C quits").count(), 3, "{out}");
    assert_eq!(out.matches("usage-engine-b").count(), 3, "{out}");

    // The RM without its key: the server part is shown, the RM's error named, status 1.
    let o = usage(&["--server", &st.server.addr, "--rm", &st.rm.addr]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("usage-engine-a"), "{out}");
    assert!(
        out.contains(&format!("resource manager {}:", st.rm.addr)),
        "{out}"
    );

    a.close().unwrap();
    b.close().unwrap();
    // After both closed: no engine, A's region kept by the region keeper.
    let o = usage(&["--server", &st.server.addr]);
    let out = text(&o);
    assert!(out.contains("(no engine has a session)"), "{out}");
    assert!(out.contains("region keeper: 1 regions kept"), "{out}");
}

/// Issue 34: the chunks an engine's stores skip reach maru-server with its heartbeat
/// and show, per reason, in maru-usage's SKIPPED column and totals (and in `--json`).
/// An engine capped at one region (`max_bytes`) with every key of it pinned skips its
/// next stores as `max_bytes`; maru-usage shows them within two heartbeats (1 s each
/// here). Seen failing (SKIPPED `0` after 5 s) with the worker sending `skipped: None`.
#[test]
fn an_engines_skipped_chunks_show_per_reason_within_a_heartbeat() {
    let st = stack_with(
        Scratch::new("usage-skips"),
        &["--session-timeout-s".into(), "3".into()],
    );
    let mut cfg = st.handler_config("remote_cxl", "usage-skipper", "usage-model", (4, 8));
    cfg["max_bytes"] = (8 << 20).into();
    let h = Handler::open(&cfg.to_string()).expect("open");
    // One region of 8 MiB holds 128 pages of 64 KiB: fill it, pin every key.
    let data = vec![7u8; 4096];
    let store = |from: usize, n: usize| -> usize {
        let keys: Vec<String> = (from..from + n).map(|i| format!("skip-{i}")).collect();
        let items: Vec<(&str, &[u8])> = keys.iter().map(|k| (k.as_str(), &data[..])).collect();
        let ok = h.store_batch(&items, None).expect("store");
        ok.iter().filter(|o| **o).count()
    };
    let mut stored = 0;
    for b in 0..8 {
        stored += store(b * 16, 16);
    }
    assert_eq!(stored, 128, "one region's pages");
    let keys: Vec<String> = (0..128).map(|i| format!("skip-{i}")).collect();
    assert!(h.pin_batch(&keys, None, true).unwrap().iter().all(|p| *p));
    assert_eq!(
        store(128, 8),
        0,
        "nothing to evict, no region beyond max_bytes"
    );
    let skipped = h.stats()["total"]["skipped"]["max_bytes"].as_u64();
    assert_eq!(skipped, Some(8), "{}", h.stats());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let out = loop {
        let o = usage(&["--server", &st.server.addr]);
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        // Columns from ENGINE on: ... LEASES PINS CONN SKIPPED.
        if row(&out, "usage-skipper")[15] == "max_bytes:8" {
            break out;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no skip counts after 5 s\n{out}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(
        out.contains(
            "skipped chunks (stores not stored, as the workers' last heartbeats said): max_bytes:8"
        ),
        "{out}"
    );
    let o = usage(&["--server", &st.server.addr, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["stats"]["total"]["skipped"]["max_bytes"], 8, "{v}");
    assert_eq!(v["stats"]["sessions"][0]["skipped"]["no_region"], 0, "{v}");
    h.close().unwrap();
}

#[test]
fn unreachable_server_is_a_clear_error() {
    let o = usage(&["--server", "127.0.0.1:1", "--timeout-ms", "500"]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(69), "{out}");
    assert!(
        out.contains("cannot reach maru-server at 127.0.0.1:1"),
        "{out}"
    );
}

/// The agents' status (mappings, holders, boot id), every daemon's version and uptime,
/// in the table and in `--json`; a closed output pipe ends `--watch` quietly.
#[test]
fn agents_versions_and_a_closed_pipe() {
    let st = stack();
    let a = engine(&st, "usage-engine-c");
    let data = vec![7u8; 4096];
    assert!(a
        .store_batch(&[("usage-agent-0", data.as_slice())], Some("r"))
        .unwrap()
        .iter()
        .all(|&x| x));
    let mut owned = server_and_rm(&st);
    owned.extend(["--agent-key-file".into(), st.key_path.display().to_string()]);
    let args: Vec<&str> = owned.iter().map(String::as_str).collect();
    let o = usage(&args);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        out.contains(&format!("({}", format_args!("version {version}, up "))),
        "{out}"
    );
    let agent_row = out
        .lines()
        .find(|l| l.starts_with(st.agent.as_ref().unwrap().addr.as_str()))
        .unwrap_or_else(|| panic!("no agent row in\n{out}"));
    let cols: Vec<&str> = agent_row.split_whitespace().collect();
    assert_eq!(cols[1], "mem0", "{agent_row}");
    assert_eq!(cols[3], "1", "engine C's region is mapped\n{out}");

    let mut j = args.to_vec();
    j.push("--json");
    let o = usage(&j);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["server_info"]["version"], version);
    assert!(v["server_info"]["uptime_s"].is_u64());
    assert_eq!(v["rm"]["info"]["version"], version);
    let ag = &v["agents"][0];
    assert_eq!(ag["info"]["version"], version);
    assert_eq!(ag["status"]["node"], "mem0");
    assert!(!ag["status"]["boot_id"].as_str().unwrap().is_empty());
    assert_eq!(
        ag["status"]["mappings"].as_array().map(|m| m.len()),
        Some(1)
    );

    // `maru-usage --watch | head -1`: the reader goes, maru-usage ends without a panic.
    let mut child = Command::new(USAGE_BIN)
        .args([
            "--server",
            &st.server.addr,
            "--watch",
            "0.1",
            "--count",
            "100",
        ])
        .env(
            "MARU_SERVER_KEY_FILE",
            support::server_key_path(&st.server.addr).unwrap(),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    use std::io::Read;
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Tenants in maru-usage: a TENANT column (the tenant whose key opened the sessions),
/// and `--tenant` to show some tenants only, in the table and in `--json`.
#[test]
fn tenants_have_a_column_and_a_filter() {
    let s = Scratch::new("usage-tenants");
    let alpha_key = s.dir.join("alpha.key");
    write_new_key_file(&alpha_key, &SharedKey::generate().unwrap()).unwrap();
    let tenants = s.dir.join("tenants.toml");
    std::fs::write(
        &tenants,
        "[tenants.alpha]\nkey_file = \"alpha.key\"\nwrite = [\"alpha-model\"]\n",
    )
    .unwrap();
    let st = stack_with(s, &["--tenants".into(), tenants.display().to_string()]);
    let own = engine(&st, "usage-engine-own");
    let alpha = engine_as(
        &st,
        "usage-engine-alpha",
        &alpha_key.display().to_string(),
        "alpha-model",
    );
    let data = vec![5u8; 4096];
    for (h, k) in [(&own, "usage-own-0"), (&alpha, "usage-alpha-0")] {
        assert!(h
            .store_batch(&[(k, data.as_slice())], Some("r"))
            .unwrap()
            .iter()
            .all(|&x| x));
    }
    // maru-server's own key sees both tenants, each row naming its tenant.
    let o = usage(&["--server", &st.server.addr]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("\nTENANT "), "{out}");
    assert_eq!(tenant_row(&out, "usage-engine-own").0, "default", "{out}");
    let (tenant, cols) = tenant_row(&out, "usage-engine-alpha");
    assert_eq!((tenant, cols[1]), ("alpha", "alpha-model"), "{out}");
    // --tenant alpha: alpha's engines only.
    let o = usage(&["--server", &st.server.addr, "--tenant", "alpha"]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("tenants shown (--tenant): alpha"), "{out}");
    assert_eq!(tenant_row(&out, "usage-engine-alpha").0, "alpha");
    assert!(!out.contains("usage-engine-own"), "{out}");
    // And in JSON.
    let o = usage(&["--server", &st.server.addr, "--tenant", "alpha", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["tenants"], serde_json::json!(["alpha"]));
    for part in ["usage", "stats"] {
        let sessions = v[part]["sessions"].as_array().unwrap();
        assert_eq!(sessions.len(), 1, "{part}: {sessions:?}");
        assert_eq!(sessions[0]["tenant"], "alpha");
    }
    // A tenant without sessions: said so.
    let o = usage(&["--server", &st.server.addr, "--tenant", "nobody"]);
    let out = text(&o);
    assert!(
        out.contains("(no engine of these tenants has a session)"),
        "{out}"
    );
    // The help says so.
    let o = Command::new(USAGE_BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("--tenant <NAME>"), "{help}");
    assert!(help.contains("TENANT"), "{help}");
    own.close().unwrap();
    alpha.close().unwrap();
}

/// A failed open leaves nothing open (issue 36): an engine whose `agent_key_file` is
/// not the agent's fails to open with an auth error, again and again, and maru-server
/// (at most one session per tenant here) keeps no session of it: `maru-usage` shows
/// no row for it and a good engine still opens.
#[test]
fn a_failed_open_leaves_no_session_open() {
    let st = stack_with(
        Scratch::new("usage-failed-open"),
        &["--max-sessions".into(), "1".into()],
    );
    let wrong = st.key_path.with_file_name("wrong-agent.key");
    write_new_key_file(&wrong, &SharedKey::generate().unwrap()).unwrap();
    let cfg = serde_json::json!({
        "backend": "remote_cxl",
        "server_url": st.server.addr,
        "server_key_file": support::server_key_file(&st.server.addr),
        "engine_id": "bad-agent-key",
        "agent_key_file": wrong.display().to_string(),
        "load_slots": 4,
        "store_slots": 8,
        "timeout_ms": 3000,
    });
    for attempt in 0..3 {
        match Handler::open(&cfg.to_string()) {
            Ok(_) => panic!("attempt {attempt}: an open with a wrong agent key succeeded"),
            Err(e) => assert!(e.is_fatal(), "attempt {attempt}: {e}"),
        }
    }
    let out = text(&usage(&[
        "--server",
        &st.server.addr,
        "--timeout-ms",
        "3000",
    ]));
    assert!(
        !out.contains("bad-agent-key"),
        "the failed opens left a session:\n{out}"
    );
    // With --max-sessions 1, a session left over would refuse this one.
    let good = engine(&st, "good-engine");
    assert!(good.store("k", &[7u8; 4096], None).unwrap());
    let out = text(&usage(&[
        "--server",
        &st.server.addr,
        "--timeout-ms",
        "3000",
    ]));
    assert!(out.contains("good-engine"), "{out}");
    drop(good);
}
