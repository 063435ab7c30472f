//! maru-server's tenants at the door (issue 49): each tenant keeps its share of the
//! connections whatever another tenant opens; the tenants file and its key files are
//! trusted only when no other user could have written them; a key removed or changed
//! ends every connection and session it proved. Real daemons on loopback, bounded in
//! count and time.

mod support;

use maru::auth::SharedKey;
use maru::net::{Client, ClientOptions};
use maru::wire::meta::{Backend, MetaReply, MetaRequest, SERVICE as META};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{Daemon, Scratch, RM_BIN, SERVER_BIN};

/// The tenants file is read again this often (`tenants_file::CHECK_EVERY_MS`).
const RELOAD: Duration = Duration::from_millis(2_000);

fn rm(s: &mut Scratch) -> Daemon {
    let pool = s.fake_dax("tenants-pool");
    Daemon::start(RM_BIN, &support::rm_args(s, &pool, "64M"), &s.dir)
}

fn write_key(path: &Path) -> SharedKey {
    let _ = std::fs::remove_file(path);
    let k = SharedKey::generate().unwrap();
    maru::auth::keyfile::write_new_key_file(path, &k).unwrap();
    k
}

/// A tenant's table: its key file and namespace (its own name).
fn tenant_text(name: &str, extra: &str) -> String {
    format!("[tenants.{name}]\nkey_file = \"{name}.key\"\nwrite = [\"{name}-ns\"]\n{extra}\n")
}

/// A scratch directory of `tag` holding alpha's key file and a tenants file of alpha
/// alone: the directory and the tenants file's path.
fn alpha_only(tag: &str) -> (Scratch, PathBuf) {
    let s = Scratch::new(tag);
    write_key(&s.dir.join("alpha.key"));
    let tenants = s.dir.join("tenants.toml");
    std::fs::write(&tenants, tenant_text("alpha", "")).unwrap();
    (s, tenants)
}

/// maru-server with its log in a file, as an operator runs it.
struct Server {
    child: Child,
    addr: String,
    log: PathBuf,
    server_key: PathBuf,
    _rm: Daemon,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn server_command(s: &Scratch, rm: &Daemon, tenants: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(SERVER_BIN);
    cmd.args(["--rm-address", &rm.addr])
        .args(["--region-size", "4M", "--chunk-size", "1M", "--in-memory"])
        .arg("--key-file")
        .arg(s.dir.join("server.key"))
        .arg("--tenants")
        .arg(tenants)
        .args(extra);
    if let Some(k) = support::rm_key_path(&rm.addr) {
        cmd.arg("--rm-key-file").arg(k);
    }
    cmd
}

fn start_server(s: &mut Scratch, tenants: &Path, extra: &[&str]) -> Server {
    let rm = rm(s);
    let ready = s.dir.join("server-ready");
    let log = s.dir.join("server.log");
    let mut cmd = server_command(s, &rm, tenants, extra);
    cmd.args(["--port", "0"])
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&ready) {
            if a.ends_with('\n') {
                break a.trim().to_string();
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "maru-server exited during start-up ({st}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "maru-server did not start in 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    Server {
        child,
        addr,
        log,
        server_key: s.dir.join("server.key"),
        _rm: rm,
    }
}

fn opts(key: &Path, id: &str) -> ClientOptions {
    let mut o = ClientOptions::new(META, id);
    o.key = Some(maru::auth::load_key_file(key).unwrap());
    o.connect_timeout = Duration::from_secs(2);
    o.call_timeout = Duration::from_secs(2);
    o
}

fn open_in(c: &mut Client, ns: &str) -> Result<(u64, Option<String>), String> {
    match c.call::<_, MetaReply>(&MetaRequest::OpenSession {
        engine_id: "e".into(),
        namespace: ns.into(),
        layout: "l".into(),
        backend: Backend::Cxl,
        first_region: false,
    }) {
        Ok(MetaReply::Session(s)) => Ok((s.session, s.session_secret)),
        other => Err(format!("{other:?}")),
    }
}

/// Whether the connection still answers (a request any connection may make).
fn answers(c: &mut Client) -> bool {
    c.call::<_, MetaReply>(&MetaRequest::Handshake {}).is_ok()
}

/// Issue 49, item 1: a key holder of tenant beta opens connections until maru-server
/// is full (`--max-clients 48`) and leaves them idle. Tenants alpha and gamma then
/// each connect and open a session 6 times, each within 1 s: a newcomer pushes out
/// an idle connection of beta, the tenant furthest over its share (48 / 4 keys = 12),
/// never one of alpha's or gamma's, whose earlier connections all keep working.
/// Seen failing with the push-out off: alpha connected 0 of 6 times.
#[test]
fn a_tenants_idle_flood_leaves_every_other_tenant_able_to_connect_and_open() {
    let mut s = Scratch::new("ten-flood");
    let mut text = String::new();
    for t in ["alpha", "beta", "gamma"] {
        write_key(&s.dir.join(format!("{t}.key")));
        text.push_str(&tenant_text(t, ""));
    }
    let tenants = s.dir.join("tenants.toml");
    std::fs::write(&tenants, text).unwrap();
    let srv = start_server(&mut s, &tenants, &["--max-clients", "48"]);
    let beta_key = s.dir.join("beta.key");
    // Beta fills every slot (and keeps trying: its newcomers push out its own).
    let mut flood = Vec::new();
    for i in 0..60 {
        if let Ok(c) = Client::connect(&srv.addr, &opts(&beta_key, &format!("beta-{i}"))) {
            flood.push(c);
        }
    }
    assert!(flood.len() >= 48, "beta connected {} times", flood.len());
    let mut kept: Vec<(Client, u64)> = Vec::new();
    for round in 0..6 {
        for t in ["alpha", "gamma"] {
            let key = s.dir.join(format!("{t}.key"));
            let started = Instant::now();
            let mut c = Client::connect(&srv.addr, &opts(&key, &format!("{t}-{round}")))
                .unwrap_or_else(|e| panic!("{t} round {round}: cannot connect: {e}"));
            let (session, _) = open_in(&mut c, &format!("{t}-ns"))
                .unwrap_or_else(|e| panic!("{t} round {round}: cannot open: {e}"));
            let took = started.elapsed();
            assert!(
                took <= Duration::from_secs(1),
                "{t} round {round}: connected and opened in {took:?}"
            );
            kept.push((c, session));
        }
    }
    // None of the other tenants' connections was pushed out for another.
    for (i, (c, session)) in kept.iter_mut().enumerate() {
        assert!(
            support::session_answers(c, *session),
            "connection {i} of alpha/gamma was closed"
        );
    }
    let log = srv.log();
    assert!(
        log.contains("of tenant beta (over its share"),
        "the push-outs are logged: {log}"
    );
    assert!(!log.contains("of tenant alpha (over") && !log.contains("of tenant gamma (over"));
}

/// Issue 49, item 2, at start: a tenants file group or others can write, one owned by
/// another user, and a key file it names owned by another user are each refused with
/// an error naming the file and the fix. Seen failing without the checks (started).
#[test]
fn a_tenants_file_others_could_have_written_is_refused_at_start() {
    let (mut s, tenants) = alpha_only("ten-start");
    let rm = rm(&mut s);
    let refused = |s: &Scratch, says: &str| {
        let (code, err) =
            support::refused_start(&mut server_command(s, &rm, &tenants, &["--port", "0"]));
        assert!(code.is_some_and(|c| c != 0), "started: {err}");
        assert!(
            err.contains("tenants.toml") || err.contains("alpha.key"),
            "{err}"
        );
        assert!(err.contains(says), "{says}: {err}");
    };
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused(&s, "chmod go-w");
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o644)).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: files of another user cannot be made here; mode checked only");
        return;
    }
    std::os::unix::fs::chown(&tenants, Some(65534), None).unwrap();
    refused(&s, "chown");
    std::os::unix::fs::chown(&tenants, Some(0), None).unwrap();
    std::os::unix::fs::chown(s.dir.join("alpha.key"), Some(65534), None).unwrap();
    refused(&s, "chown");
}

/// Issue 49, item 2, at reload: the file is rewritten to take alpha's namespace away,
/// but left writable by others (then owned by another user): the reload is refused
/// with an error naming the file and the fix, and alpha keeps its namespace. Once the
/// mode is fixed, the change is read. Seen failing without the checks (alpha lost its
/// namespace at the first reload).
#[test]
fn a_tenants_file_others_could_have_written_is_ignored_at_reload() {
    let (mut s, tenants) = alpha_only("ten-reload");
    let srv = start_server(&mut s, &tenants, &[]);
    let key = s.dir.join("alpha.key");
    let taken = "[tenants.alpha]\nkey_file = \"alpha.key\"\nwrite = [\"other-ns\"]\n";
    type Spoil<'a> = Box<dyn Fn() + 'a>;
    let mut cases: Vec<(Spoil, &str)> = vec![(
        Box::new(|| {
            std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o666)).unwrap()
        }),
        "chmod go-w",
    )];
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cases.push((
            Box::new(|| {
                std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o644)).unwrap();
                std::os::unix::fs::chown(&tenants, Some(65534), None).unwrap();
            }),
            "chown",
        ));
    }
    for (i, (spoil, fix)) in cases.iter().enumerate() {
        std::fs::write(&tenants, format!("{taken}# {i}\n")).unwrap();
        spoil();
        let seen = support::wait_until(RELOAD * 3, || {
            srv.log().contains("not reloaded") && srv.log().contains(fix)
        });
        assert!(
            seen,
            "the refused reload is logged naming {fix}: {}",
            srv.log()
        );
        std::thread::sleep(RELOAD + Duration::from_millis(500));
        let mut c = Client::connect(&srv.addr, &opts(&key, "alpha")).unwrap();
        open_in(&mut c, "alpha-ns").expect("alpha keeps its namespace");
        assert!(srv.log().contains(&tenants.display().to_string()));
    }
    // Fixed: the change is read.
    std::os::unix::fs::chown(&tenants, Some(unsafe { libc::geteuid() }), None).unwrap();
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o600)).unwrap();
    let moved = support::wait_until(RELOAD * 3, || {
        Client::connect(&srv.addr, &opts(&key, "alpha"))
            .ok()
            .is_some_and(|mut c| open_in(&mut c, "alpha-ns").is_err())
    });
    assert!(moved, "a trusted file is read again: {}", srv.log());
}

/// Issue 49, item 3: beta's key is changed (its key file replaced in place), then beta
/// is removed and added back. A connection that proved the old key is closed within
/// one reload interval (and so can no longer allocate or open); the session it opened
/// ends, so a connection of the new key presenting its secret gets nothing of it;
/// after beta is removed and added back, nothing of before is left either. Alpha's
/// connection is never touched. Seen failing without the close: the old connection
/// still opened sessions 5 s after the change.
#[test]
fn a_changed_or_removed_key_ends_its_connections_and_sessions() {
    let mut s = Scratch::new("ten-rotate");
    write_key(&s.dir.join("alpha.key"));
    write_key(&s.dir.join("beta.key"));
    let tenants = s.dir.join("tenants.toml");
    let both = format!("{}{}", tenant_text("alpha", ""), tenant_text("beta", ""));
    std::fs::write(&tenants, &both).unwrap();
    let srv = start_server(&mut s, &tenants, &[]);
    let beta_key = s.dir.join("beta.key");
    let alpha_key = s.dir.join("alpha.key");
    let mut alpha = Client::connect(&srv.addr, &opts(&alpha_key, "alpha")).unwrap();
    let (alpha_session, _) = open_in(&mut alpha, "alpha-ns").unwrap();
    let mut old = Client::connect(&srv.addr, &opts(&beta_key, "beta-old")).unwrap();
    let (old_session, old_secret) = open_in(&mut old, "beta-ns").unwrap();
    let old_opts = opts(&beta_key, "beta-old");

    // The key changes.
    let changed = Instant::now();
    write_key(&beta_key);
    let closed = support::wait_until(RELOAD * 3, || !answers(&mut old));
    let took = changed.elapsed();
    assert!(
        closed,
        "the old key's connection still answers: {}",
        srv.log()
    );
    assert!(open_in(&mut old, "beta-ns").is_err());
    // Its session ended with it (the operator sees alpha's only), not left to expire.
    let sessions = || {
        let mut admin = Client::connect(&srv.addr, &opts(&srv.server_key, "admin")).unwrap();
        match admin.call::<_, MetaReply>(&MetaRequest::Stats { session: None }) {
            Ok(MetaReply::Stats(st)) => st.total.sessions,
            other => panic!("stats: {other:?}"),
        }
    };
    assert_eq!(sessions(), 1, "beta's old session ended: {}", srv.log());
    assert!(
        took <= RELOAD + Duration::from_millis(1_500),
        "closed {took:?} after the change (one reload interval is {RELOAD:?})"
    );
    let again = Client::connect(&srv.addr, &old_opts).map(|mut c| open_in(&mut c, "beta-ns"));
    assert!(
        !matches!(again, Ok(Ok(_))),
        "the old key is refused: {again:?} {}",
        srv.log()
    );
    let mut new_opts = opts(&beta_key, "beta-new");
    new_opts.resume = old_secret.clone();
    let mut new = Client::connect(&srv.addr, &new_opts)
        .unwrap_or_else(|e| panic!("the new key: {e} {}", srv.log()));
    assert!(
        !support::session_answers(&mut new, old_session),
        "the old key's session ended with it"
    );
    let (new_session, new_secret) = open_in(&mut new, "beta-ns").unwrap();
    assert!(support::session_answers(&mut new, new_session));

    // Beta removed, then added back with the same key: nothing of before is left.
    std::fs::write(&tenants, tenant_text("alpha", "")).unwrap();
    let gone = support::wait_until(RELOAD * 3, || {
        !support::session_answers(&mut new, new_session)
    });
    assert!(gone, "a removed tenant's connection is closed");
    std::fs::write(&tenants, &both).unwrap();
    let mut back_opts = opts(&beta_key, "beta-back");
    back_opts.resume = new_secret;
    let back = support::wait_until(RELOAD * 3, || {
        Client::connect(&srv.addr, &back_opts).is_ok()
    });
    assert!(back, "beta is back");
    let mut again = Client::connect(&srv.addr, &back_opts).unwrap();
    assert!(
        !support::session_answers(&mut again, new_session),
        "beta added back starts with nothing"
    );
    assert!(!support::session_answers(&mut again, old_session));
    assert!(
        support::session_answers(&mut alpha, alpha_session),
        "alpha is never touched"
    );
    let log = srv.log();
    assert!(log.contains("no longer in force"), "{log}");
}
