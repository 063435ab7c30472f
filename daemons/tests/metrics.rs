//! `--metrics`: each daemon serves Prometheus text at /metrics on loopback; the names
//! an operator's dashboards use are there, and counters move with traffic (requests,
//! connections, failed key proofs) while gauges follow the cores.

mod support;

use maru::auth::SharedKey;
use maru::net::{Client, ClientOptions};
use maru::wire::agent::{AgentReply, AgentRequest, SERVICE as AGENT};
use maru::wire::meta::{Backend, MetaReply, MetaRequest, SERVICE as META};
use maru::wire::rm::SERVICE as RM;

use std::net::TcpStream;
use std::time::Duration;
use support::{free_port, get, scrape, Daemon, Scratch, AGENT_BIN, RM_BIN, SERVER_BIN};

fn has(samples: &[(String, f64)], prefix: &str) -> bool {
    samples.iter().any(|(s, _)| s.starts_with(prefix))
}

/// Waits (≤ 5 s) until a scrape of `port` satisfies `f` (gauges are copied from
/// the cores at most once a second).
fn eventually(port: u16, f: impl Fn(&[(String, f64)]) -> bool) -> Vec<(String, f64)> {
    let mut last = Vec::new();
    support::wait_until(Duration::from_secs(5), || {
        last = scrape(port);
        f(&last)
    });
    last
}

fn wrong_key_connect(addr: &str, service: &'static str) {
    let mut o = ClientOptions::new(service, "intruder");
    o.key = Some(SharedKey::generate().unwrap());
    assert!(Client::connect(addr, &o).is_err(), "a wrong key connected");
}

#[test]
fn every_daemon_serves_its_metrics_and_they_move_with_traffic() {
    let mut s = Scratch::new("metrics");
    let pool = s.fake_dax("pool");
    let key_path = s.dir.join("agent.key");
    let key = SharedKey::generate().unwrap();
    maru::auth::keyfile::write_new_key_file(&key_path, &key).unwrap();
    let (rm_m, agent_m, srv_m) = (free_port(), free_port(), free_port());
    let mut rm_args = support::rm_args(&s, &pool, "64M");
    rm_args.extend(["--metrics".into(), rm_m.to_string()]);
    let rm = Daemon::start(RM_BIN, &rm_args, &s.dir);
    let mut agent_args = support::agent_args(&rm.addr, &key_path, &pool);
    agent_args.extend(["--metrics".into(), format!("127.0.0.1:{agent_m}")]);
    let agent = Daemon::start(AGENT_BIN, &agent_args, &s.dir);
    let srv = Daemon::start(
        SERVER_BIN,
        &[
            "--rm-address".into(),
            rm.addr.clone(),
            "--remote-cxl-agent".into(),
            agent.addr.clone(),
            "--remote-cxl-agent-key-file".into(),
            key_path.display().to_string(),
            "--region-size".into(),
            "4M".into(),
            "--chunk-size".into(),
            "1M".into(),
            "--metrics".into(),
            srv_m.to_string(),
        ],
        &s.dir,
    );

    // The names, before any traffic of ours.
    let version = format!("{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"));
    for (port, d, gauges) in [
        (
            rm_m,
            "rm",
            &["regions", "holds", "pool_bytes", "pool_free_bytes"][..],
        ),
        (
            agent_m,
            "agent",
            &["mappings", "registrations", "quarantined", "queued_unholds"][..],
        ),
        (
            srv_m,
            "server",
            &[
                "sessions",
                "regions",
                "keys",
                "leases",
                "kept_regions",
                "giving_back",
            ][..],
        ),
    ] {
        let m = scrape(port);
        assert_eq!(
            get(&m, &format!("maru_{d}_build_info{version}")),
            1.0,
            "{d}: {m:?}"
        );
        for name in [
            "uptime_seconds",
            "connections_open",
            "connections_accepted_total",
            "auth_failures_total",
        ] {
            assert!(
                has(&m, &format!("maru_{d}_{name}")),
                "{d}: no {name} in {m:?}"
            );
        }
        for g in gauges {
            assert!(
                has(&m, &format!("maru_{d}_{g}")),
                "{d}: no gauge {g} in {m:?}"
            );
        }
    }
    let srv0 = scrape(srv_m);
    assert!(has(&srv0, "maru_server_evictions_total"), "{srv0:?}");
    assert!(has(&srv0, "maru_server_hits_total"), "{srv0:?}");
    let rm0 = scrape(rm_m);
    let agent0 = scrape(agent_m);

    // Traffic: a session with its first region (an alloc at the RM), an exists, a
    // status at the agent, and one failed key proof at each daemon.
    let mut w = support::connect(&srv.addr, META, "metrics-engine");
    let session = match w
        .call::<_, MetaReply>(&MetaRequest::OpenSession {
            engine_id: "e".into(),
            namespace: "ns".into(),
            layout: "l".into(),
            backend: Backend::RemoteCxl,
            first_region: true,
        })
        .unwrap()
    {
        MetaReply::Session(x) => x.session,
        r => panic!("{r:?}"),
    };
    w.call::<_, MetaReply>(&MetaRequest::Exists {
        session,
        keys: vec!["k".into()],
    })
    .unwrap();
    let mut o = ClientOptions::new(AGENT, "metrics-probe");
    o.key = Some(key.clone());
    let mut a = Client::connect(&agent.addr, &o).unwrap();
    assert!(matches!(
        a.call::<_, AgentReply>(&AgentRequest::Status).unwrap(),
        AgentReply::Status(_)
    ));
    wrong_key_connect(&rm.addr, RM);
    wrong_key_connect(&agent.addr, AGENT);
    let mut bad = ClientOptions::new(META, "intruder");
    bad.key = Some(SharedKey::generate().unwrap());
    // maru-server runs without a key here: a client proving one is refused instead.
    let _ = Client::connect(&srv.addr, &bad);

    let srv1 = eventually(srv_m, |m| get(m, "maru_server_sessions") == 1.0);
    assert_eq!(get(&srv1, "maru_server_sessions"), 1.0, "{srv1:?}");
    assert_eq!(get(&srv1, "maru_server_regions"), 1.0, "{srv1:?}");
    assert_eq!(
        get(
            &srv1,
            r#"maru_server_requests_total{op="open_session",result="ok"}"#
        ),
        1.0,
        "{srv1:?}"
    );
    assert_eq!(
        get(
            &srv1,
            r#"maru_server_requests_total{op="exists",result="ok"}"#
        ),
        1.0,
        "{srv1:?}"
    );
    assert!(
        get(
            &srv1,
            r#"maru_server_request_duration_seconds_count{op="exists"}"#
        ) >= 1.0
    );
    // Its own time per request (read to reply written), each request once by its op,
    // and the loop's busy stretches.
    assert_eq!(
        get(
            &srv1,
            r#"maru_server_request_served_seconds_count{op="exists"}"#
        ),
        1.0,
        "{srv1:?}"
    );
    assert!(get(&srv1, "maru_server_loop_busy_seconds_count") >= 1.0);
    assert!(get(&srv1, "maru_server_loop_busy_cpu_seconds_count") >= 1.0);
    assert!(
        get(&srv1, "maru_server_connections_open") >= 1.0,
        "{srv1:?}"
    );
    assert!(
        get(&srv1, "maru_server_connections_accepted_total")
            > get(&srv0, "maru_server_connections_accepted_total")
    );
    assert!(
        get(&srv1, r#"maru_server_bytes_total{direction="in"}"#)
            > get(&srv0, r#"maru_server_bytes_total{direction="in"}"#)
    );

    let rm1 = eventually(rm_m, |m| get(m, "maru_rm_regions") == 1.0);
    assert_eq!(get(&rm1, "maru_rm_regions"), 1.0, "{rm1:?}");
    assert!(
        get(&rm1, r#"maru_rm_requests_total{op="alloc",result="ok"}"#) >= 1.0,
        "{rm1:?}"
    );
    assert!(
        get(&rm1, "maru_rm_auth_failures_total") > get(&rm0, "maru_rm_auth_failures_total"),
        "{rm1:?}"
    );
    assert!(
        get(&rm1, "maru_rm_pool_free_bytes") < get(&rm1, "maru_rm_pool_bytes"),
        "{rm1:?}"
    );

    let agent1 = scrape(agent_m);
    assert!(
        get(
            &agent1,
            r#"maru_agent_requests_total{op="status",result="ok"}"#
        ) >= 1.0,
        "{agent1:?}"
    );
    assert!(
        get(&agent1, "maru_agent_auth_failures_total")
            > get(&agent0, "maru_agent_auth_failures_total"),
        "{agent1:?}"
    );
}

/// Without `--metrics` nothing listens for them (off by default).
#[test]
fn metrics_are_off_by_default() {
    let mut s = Scratch::new("metrics-off");
    let pool = s.fake_dax("pool");
    let port = free_port();
    let _rm = Daemon::start(RM_BIN, &support::rm_args(&s, &pool, "64M"), &s.dir);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}
