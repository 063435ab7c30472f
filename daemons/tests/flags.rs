//! Strict flags (issue 24): every value is checked before the daemon creates anything
//! (pool file, state, key, socket); a wrong one stops it with one clear message and
//! exit status 78 (EX_CONFIG), a dependency that cannot be reached with 69
//! (EX_UNAVAILABLE). Each refused value is checked, with its exit code.

mod support;

use maru::auth::{keyfile::write_new_key_file, SharedKey};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{Scratch, AGENT_BIN, RM_BIN, SERVER_BIN};

const CTL_BIN: &str = env!("CARGO_BIN_EXE_maru-rm-ctl");
const EX_CONFIG: i32 = 78;
const EX_UNAVAILABLE: i32 = 69;

/// Runs a command that should stop at once: its exit code (None: still running after
/// 10 s, then killed) and its stderr.
fn run(bin: &str, args: &[&str]) -> (Option<i32>, String) {
    support::refused_start(Command::new(bin).args(args))
}

/// The RM's flags in `s` plus `extra`; the pool file and the state dir are not made.
fn rm_args(s: &mut Scratch, extra: &[&str]) -> (Vec<String>, std::path::PathBuf) {
    let pool = s.fake_dax("flags-pool");
    let mut a = support::rm_args(s, &pool, "64M");
    a.extend(["--port".into(), "0".into()]);
    a.extend(extra.iter().map(|x| x.to_string()));
    (a, pool)
}

/// `bin` started with `args` (which end with `extra`, the flags under test) stops with
/// 78 and says `says` on one line of its stderr.
fn refuses_once(bin: &str, args: &[String], extra: &[&str], says: &str) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, err) = run(bin, &args);
    assert_eq!(code, Some(EX_CONFIG), "{extra:?}: {err}");
    assert!(err.contains(says), "{extra:?}: {err}");
    assert_eq!(
        err.lines().filter(|l| l.contains(says)).count(),
        1,
        "printed once: {err}"
    );
}

/// An RM flag value refused with 78, the message once, and nothing created.
fn rm_refuses(tag: &str, extra: &[&str], says: &str) {
    let mut s = Scratch::new(tag);
    let (args, pool) = rm_args(&mut s, extra);
    refuses_once(RM_BIN, &args, extra, says);
    assert!(
        !pool.exists(),
        "{extra:?}: the pool file was created before the check"
    );
    assert!(
        !s.dir.join("rm").exists(),
        "{extra:?}: the state dir was created before the check"
    );
}

/// Each refused RM value: the scratch tag, the flags, what the message names.
#[test]
fn bad_rm_values_are_refused() {
    for (tag, extra, says) in [
        ("fl-loglevel", ["--log-level", "bogus"], "bogus"),
        ("fl-logfmt", ["--log-format", "xml"], "xml"),
        ("fl-maxcl", ["--max-clients", "0"], "max-clients"),
        (
            "fl-hs",
            ["--handshake-timeout-ms", "0"],
            "handshake-timeout-ms",
        ),
        ("fl-metrics", ["--metrics", "notanaddr"], "--metrics"),
        // Before the pool is made.
        ("fl-host", ["--host", "nohost"], "--host"),
    ] {
        rm_refuses(tag, &extra, says);
    }
}

#[test]
fn an_rm_without_pools_says_so_once() {
    let s = Scratch::new("fl-nopool");
    let (code, err) = run(
        RM_BIN,
        &[
            "--state-dir",
            &s.dir.join("rm").display().to_string(),
            "--port",
            "0",
        ],
    );
    assert_eq!(code, Some(EX_CONFIG), "{err}");
    assert_eq!(err.matches("no pools").count(), 1, "printed once: {err}");
}

/// The agent's flags with an RM address that is never called (the flags stop it first).
fn agent_refuses(tag: &str, extra: &[&str], says: &str) {
    let s = Scratch::new(tag);
    let key = s.dir.join("agent.key");
    write_new_key_file(&key, &SharedKey::generate().unwrap()).unwrap();
    let boot = s.dir.join("boot_id");
    std::fs::write(&boot, "0b0b0b0b-0000-4000-8000-000000000000\n").unwrap();
    let mut args = vec![
        "--key-file".to_string(),
        key.display().to_string(),
        "--boot-id-file".into(),
        boot.display().to_string(),
        "--port".into(),
        "0".into(),
    ];
    args.extend(extra.iter().map(|x| x.to_string()));
    refuses_once(AGENT_BIN, &args, extra, says);
}

#[test]
fn an_agent_rm_address_that_is_not_host_port_is_refused() {
    agent_refuses("fl-agrm", &["--rm-address", "notanaddr"], "notanaddr");
}

#[test]
fn an_agent_on_every_address_without_advertise_is_refused() {
    agent_refuses(
        "fl-agadv",
        &["--rm-address", "127.0.0.1:9", "--host", "0.0.0.0"],
        "--advertise",
    );
}

#[test]
fn an_agent_log_level_typo_is_refused() {
    agent_refuses(
        "fl-aglog",
        &["--rm-address", "127.0.0.1:9", "-l", "verbose"],
        "verbose",
    );
}

#[test]
fn maru_server_refuses_an_agent_that_is_not_host_port() {
    let (code, err) = run(
        SERVER_BIN,
        &[
            "--rm-address",
            "127.0.0.1:9",
            "--remote-cxl-agent",
            "mem0",
            "--port",
            "0",
        ],
    );
    assert_eq!(code, Some(EX_CONFIG), "{err}");
    assert!(err.contains("--remote-cxl-agent \"mem0\""), "{err}");
}

#[test]
fn maru_server_without_its_rm_exits_unavailable() {
    // Port 9 on loopback: nothing listens (connection refused at once).
    let (code, err) = run(SERVER_BIN, &["--rm-address", "127.0.0.1:9", "--port", "0"]);
    assert_eq!(code, Some(EX_UNAVAILABLE), "{err}");
    assert_eq!(
        err.matches("maru-server needs its resource manager")
            .count(),
        1,
        "{err}"
    );
}

#[test]
fn rm_ctl_alloc_without_a_client_id_is_explained() {
    let (code, err) = run(CTL_BIN, &["--rm", "127.0.0.1:9", "alloc", "2M"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--client-id"), "{err}");
}

/// Waits (≤ 15 s) until the file at `path` holds `what`; returns what it holds.
fn wait_for_text(path: &Path, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(path) {
            let _ = f.read_to_string(&mut text);
        }
        if text.contains(what) || Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// maru-server checks its agents at start: one whose key differs is named, with the
/// flag to fix, while the server keeps running (and checking).
#[test]
fn maru_server_names_an_agent_whose_key_it_cannot_prove() {
    let mut s = Scratch::new("fl-agkey");
    let node = support::memory_node(&mut s, "64M");
    let wrong = s.dir.join("wrong.key");
    write_new_key_file(&wrong, &SharedKey::generate().unwrap()).unwrap();
    let log = s.dir.join("server.log");
    let mut child = Command::new(SERVER_BIN)
        .args([
            "--rm-address",
            &node.rm.addr,
            "--rm-key-file",
            &support::rm_key_path(&node.rm.addr)
                .unwrap()
                .display()
                .to_string(),
            "--remote-cxl-agent",
            &node.agent.addr,
            "--remote-cxl-agent-key-file",
            &wrong.display().to_string(),
            "--port",
            "0",
            // Its own state directory: the default one under ~/.maru is the user's.
            "--state-dir",
            &s.dir.join("state").display().to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let text = wait_for_text(&log, "check failed");
    let running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(running, "maru-server stopped: {text}");
    let line = text
        .lines()
        .find(|l| l.contains("check failed"))
        .unwrap_or_else(|| panic!("no agent check line: {text}"));
    assert!(line.contains(&node.agent.addr), "{line}");
    assert!(line.contains("--remote-cxl-agent-key-file"), "{line}");
}

/// `--log-format json`: every line on stderr is one JSON object with ts, level,
/// target and msg.
#[test]
fn json_logs_are_one_object_a_line() {
    let mut s = Scratch::new("fl-json");
    let (mut args, _pool) = rm_args(&mut s, &["--log-format", "json"]);
    let ready = s.dir.join("ready");
    args.extend(["--ready-file".to_string(), ready.display().to_string()]);
    let log = s.dir.join("rm.log");
    let mut child = Command::new(RM_BIN)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let text = wait_for_text(&log, "listening on");
    let _ = child.kill();
    let _ = child.wait();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 2, "{text}");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        for k in ["ts", "level", "target", "msg"] {
            assert!(v[k].is_string(), "{k} missing in {l}");
        }
    }
    assert!(lines.iter().any(|l| l.contains("listening on")), "{text}");
    // And a refusal at start keeps the JSON shape (printed once, through the log).
    let (code, err) = run(
        RM_BIN,
        &[
            "--log-format",
            "json",
            "--state-dir",
            "/nonexistent/x",
            "--port",
            "0",
        ],
    );
    assert_eq!(code, Some(EX_CONFIG), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(err.trim()).unwrap_or_else(|e| panic!("{e}: {err}"));
    assert_eq!(v["level"], "ERROR", "{err}");
}

/// Upstream's spellings start the daemons: `--log-level DEBUG` (and Python's
/// `WARNING`), the RM's `--grace-period`. The level is the one given: the INFO line
/// "listening on" appears at DEBUG and not at WARNING.
#[test]
fn upstream_spellings_of_log_level_and_grace_period_are_accepted() {
    for (level, info_lines) in [("DEBUG", true), ("WARNING", false)] {
        let mut s = Scratch::new("fl-upstream");
        let (mut args, _pool) = rm_args(&mut s, &["--log-level", level, "--grace-period", "5"]);
        let ready = s.dir.join("ready");
        args.extend(["--ready-file".to_string(), ready.display().to_string()]);
        let log = s.dir.join("rm.log");
        let mut child = Command::new(RM_BIN)
            .args(&args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready.exists() && Instant::now() < deadline {
            if let Ok(Some(st)) = child.try_wait() {
                let mut err = String::new();
                let _ = std::fs::File::open(&log).and_then(|mut f| f.read_to_string(&mut err));
                panic!("--log-level {level} --grace-period 5: exited with {st}: {err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            ready.exists(),
            "--log-level {level}: not ready in 20 s: {text}"
        );
        assert_eq!(
            text.contains("listening on"),
            info_lines,
            "--log-level {level}: {text}"
        );
    }
}
