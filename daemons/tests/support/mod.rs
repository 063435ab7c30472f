//! Starting real daemons on loopback for integration tests: free ports (port 0 and
//! a ready file), temporary state and fake-DAX files, bounded waits, cleanup on drop.
#![allow(dead_code)]

use maru::net::{Client, ClientOptions};
use maru::wire::meta::{MetaReply, MetaRequest};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The peer connection of a test transport that wraps the soft one in `inner`: it goes
/// straight through.
#[allow(unused_macros)]
macro_rules! delegate_connect {
    () => {
        fn connect(
            &self,
            meta: &serde_json::Value,
            bringup: &mut maru::transport::Bringup<'_>,
        ) -> Result<maru::transport::PeerId, maru::transport::TransportError> {
            self.inner.connect(meta, bringup)
        }
    };
}

/// The set-up half of a test transport that wraps the soft one in `inner`: the buffer
/// registration and the peer connection go straight through.
#[allow(unused_macros)]
macro_rules! delegate_setup {
    () => {
        fn register_local(
            &self,
            b: maru::transport::LocalBuffer,
        ) -> Result<(), maru::transport::TransportError> {
            self.inner.register_local(b)
        }
        $crate::support::delegate_connect!();
    };
}

#[allow(unused_imports)]
pub(crate) use {delegate_connect, delegate_setup};

/// The code of the error reply `r` is; a panic naming what came instead.
pub fn remote_code<T: std::fmt::Debug>(
    r: Result<T, maru::net::ClientError>,
) -> maru::wire::ErrorCode {
    match r {
        Err(maru::net::ClientError::Remote(e)) => e.code,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The key file of every resource manager started here, by address: an RM makes
/// `STATE_DIR/rm.key` on its first start and proves nothing to a client without it.
/// `connect` uses it for that address, and an agent or maru-server started with
/// `--rm-address` of such an RM (and no `--rm-key-file`) is given it.
static RM_KEYS: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());

/// The key file of every maru-server started here, by address. A maru-server
/// started without `--key-file` or `--insecure-no-key` gets `DIR/server.key` of the
/// directory it is started in (made at its first start), so servers of one test share
/// one key (a handler with several pools proves one key to all of them).
static SERVER_KEYS: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());

const RM_NAME: &str = "maru-resource-manager";
const SERVER_NAME: &str = "maru-server";

fn arg_after<'a>(args: &'a [String], flag: &str) -> Option<&'a String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
}

/// The key file recorded in `keys` for the daemon at `addr` (the latest started there).
fn key_of(keys: &Mutex<Vec<(String, PathBuf)>>, addr: &str) -> Option<PathBuf> {
    keys.lock()
        .ok()?
        .iter()
        .rev()
        .find(|(a, _)| a == addr)
        .map(|(_, p)| p.clone())
}

/// The key file of the RM at `addr`, if one was started here with a key.
pub fn rm_key_path(addr: &str) -> Option<PathBuf> {
    key_of(&RM_KEYS, addr)
}

/// The key of the RM at `addr` (see [`rm_key_path`]).
pub fn rm_key(addr: &str) -> Option<maru::auth::SharedKey> {
    rm_key_path(addr).map(|p| maru::auth::load_key_file(&p).expect("the RM's key file"))
}

/// The key file of the maru-server at `addr`, if one was started here with a key.
pub fn server_key_path(addr: &str) -> Option<PathBuf> {
    key_of(&SERVER_KEYS, addr)
}

/// The key file of the maru-server at `addr` as a handler's `server_key_file`.
pub fn server_key_file(addr: &str) -> String {
    server_key_path(addr)
        .unwrap_or_else(|| panic!("no maru-server with a key was started here at {addr}"))
        .display()
        .to_string()
}

/// The key of the maru-server at `addr` (see [`server_key_path`]).
pub fn server_key(addr: &str) -> Option<maru::auth::SharedKey> {
    server_key_path(addr).map(|p| maru::auth::load_key_file(&p).expect("the server's key file"))
}

/// A directory (and /dev/shm files) removed on drop.
pub struct Scratch {
    pub dir: PathBuf,
    shm: Vec<PathBuf>,
}

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("maru-it-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch {
            dir,
            shm: Vec::new(),
        }
    }

    /// A fake-DAX file path: in /dev/shm when present (as users run it), else the scratch dir.
    pub fn fake_dax(&mut self, name: &str) -> PathBuf {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            self.dir.clone()
        };
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let p = base.join(format!("maru-it-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        self.shm.push(p.clone());
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        for p in &self.shm {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A running daemon, killed on drop.
pub struct Daemon {
    pub child: Child,
    pub addr: String,
    pub name: String,
}

impl Daemon {
    /// Starts `bin` with `args` plus `--port 0 --ready-file F` and waits (≤ 20 s) until it listens.
    pub fn start(bin: &str, args: &[String], ready_dir: &Path) -> Daemon {
        Daemon::start_at(bin, args, ready_dir, 0)
    }

    /// As `start`, on a given port (to bring a daemon back where its clients look).
    pub fn start_at(bin: &str, args: &[String], ready_dir: &Path, port: u16) -> Daemon {
        let mut args = args.to_vec();
        let is_rm = bin.ends_with(RM_NAME);
        let is_server = bin.ends_with(SERVER_NAME);
        if is_server
            && !args
                .iter()
                .any(|a| a == "--key-file" || a == "--insecure-no-key")
        {
            args.push("--key-file".into());
            args.push(ready_dir.join("server.key").display().to_string());
        }
        // Tests of a restart that empties the directory, and several servers in one
        // scratch directory: in memory unless the test names a state directory.
        if is_server
            && !args
                .iter()
                .any(|a| a == "--state-dir" || a == "--in-memory")
        {
            args.push("--in-memory".into());
        }
        if !is_rm && !args.iter().any(|a| a == "--rm-key-file") {
            if let Some(k) = arg_after(&args, "--rm-address").and_then(|a| rm_key_path(a)) {
                args.push("--rm-key-file".into());
                args.push(k.display().to_string());
            }
        }
        let mut cmd = Command::new(bin);
        cmd.args(&args);
        if std::env::var_os("MARU_TEST_VERBOSE").is_none() {
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
        }
        let (child, addr) = spawn_listening(&mut cmd, ready_dir, port)
            .unwrap_or_else(|st| panic!("{bin} exited during start-up: {st}"));
        if is_rm && !args.iter().any(|a| a == "--insecure-no-key") {
            let key = match arg_after(&args, "--key-file") {
                Some(k) => Some(PathBuf::from(k)),
                None => arg_after(&args, "--state-dir").map(|d| Path::new(d).join("rm.key")),
            };
            if let (Some(k), Ok(mut keys)) = (key, RM_KEYS.lock()) {
                keys.push((addr.clone(), k));
            }
        }
        if is_server {
            if let (Some(k), Ok(mut keys)) = (arg_after(&args, "--key-file"), SERVER_KEYS.lock()) {
                keys.push((addr.clone(), PathBuf::from(k)));
            }
        }
        Daemon {
            child,
            addr,
            name: bin.to_string(),
        }
    }

    /// kill -9, and wait for the process to be gone.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// kill -9 and start it again on its port (where its clients look) with `args`.
    pub fn restart(&mut self, args: &[String], ready_dir: &Path) {
        let port = self.port();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let bin = self.name.clone();
        *self = Daemon::start_at(&bin, args, ready_dir, port);
    }

    pub fn port(&self) -> u16 {
        maru_testkit::port_of(&self.addr)
    }

    /// Sends `sig` to the process (`libc::SIGSTOP` stalls it as a swapping or busy
    /// node would: its sockets still accept connections and take bytes, nothing
    /// answers; `libc::SIGCONT` lets it go on).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child this test started and still owns.
        let r = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(r, 0, "kill({}, {sig})", self.child.id());
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM and wait (≤ 10 s) for a clean exit; returns the exit status code.
    pub fn terminate(mut self) -> Option<i32> {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

/// Starts the daemon `cmd` (stdout and stderr as the caller set them, stdin none) with
/// `--port port --ready-file F` (F in `ready_dir`) added, and waits (≤ 20 s) until it
/// listens: the process and its address, or how it ended when it exited first.
/// Panics, the process killed, when it neither listens nor exits within 20 s.
pub fn spawn_listening(
    cmd: &mut Command,
    ready_dir: &Path,
    port: u16,
) -> Result<(Child, String), std::process::ExitStatus> {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let ready = ready_dir.join(format!("ready-{n}"));
    let what = cmd.get_program().to_string_lossy().into_owned();
    match maru_testkit::spawn_ready(cmd, &ready, port, Duration::from_secs(20)) {
        Ok(up) => Ok(up),
        Err(maru_testkit::StartError::Exited(st)) => Err(st),
        Err(e) => panic!("{what}: {e}"),
    }
}

/// A worker's soft NIC, client `id`, proving the agent key `key`, with `staging`
/// registered as its local buffer (keep `staging` alive and in place while the NIC
/// may use it).
pub fn soft_nic(
    id: impl Into<String>,
    key: &maru::auth::SharedKey,
    staging: &mut [u8],
) -> maru::transport::soft::SoftTransport {
    use maru::transport::{LocalBuffer, Transport};
    let nic = maru::transport::soft::SoftTransport::new(id, Some(key.clone()));
    nic.register_local(LocalBuffer::of(staging))
        .expect("register the staging buffer");
    nic
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Connects to a daemon as `client_id` (with the key of an RM or a maru-server
/// started here).
pub fn connect(addr: &str, service: &'static str, client_id: &str) -> Client {
    let mut o = ClientOptions::new(service, client_id);
    if service == maru::wire::rm::SERVICE {
        o.key = rm_key(addr);
    }
    if service == maru::wire::meta::SERVICE {
        o.key = server_key(addr);
    }
    o.call_timeout = Duration::from_secs(10);
    Client::connect(addr, &o).unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// A region of `size` bytes allocated at the RM over `rm` (as maru-server does).
pub fn rm_alloc(rm: &mut Client, size: u64) -> maru::wire::rm::Handle {
    use maru::wire::rm::{RmReply, RmRequest};
    match rm
        .call(&RmRequest::Alloc {
            size,
            pool: None,
            request_id: 0,
        })
        .expect("alloc")
    {
        RmReply::Alloc(a) => a.handle,
        r => panic!("unexpected {r:?}"),
    }
}

/// The regions the RM over `rm` has allocated.
pub fn rm_regions(rm: &mut Client) -> Vec<maru::wire::rm::RegionInfo> {
    use maru::wire::rm::{RmReply, RmRequest};
    match rm
        .call(&RmRequest::Regions { owner: None })
        .expect("regions")
    {
        RmReply::Regions { regions } => regions,
        r => panic!("unexpected {r:?}"),
    }
}

/// The holds on regions that the RM over `rm` knows of.
pub fn rm_holds(rm: &mut Client) -> Vec<maru::wire::rm::HoldInfo> {
    use maru::wire::rm::{RmReply, RmRequest};
    match rm.call(&RmRequest::Holds { node: None }).expect("holds") {
        RmReply::Holds { holds } => holds,
        r => panic!("unexpected {r:?}"),
    }
}

/// A connection to the agent at `addr` that proves `key`, as client `id`.
pub fn agent_client(addr: &str, key: &maru::auth::SharedKey, id: &str) -> Client {
    let mut o = ClientOptions::new(maru::wire::agent::SERVICE, id);
    o.key = Some(key.clone());
    Client::connect(addr, &o).expect("agent connect")
}

/// Maps region `h` writable over the agent connection `c` (as a storing worker does).
pub fn map_writable(c: &mut Client, h: &maru::wire::rm::Handle) -> maru::wire::agent::MapReply {
    use maru::wire::agent::{AgentReply, AgentRequest};
    match c
        .call(&AgentRequest::Map {
            handle: h.clone(),
            writable: true,
        })
        .expect("map")
    {
        AgentReply::Mapped(m) => m,
        r => panic!("unexpected {r:?}"),
    }
}

/// Leases the sessions of `engine` hold at maru-server now.
pub fn leases_of(server: &str, engine: &str) -> u64 {
    engine_total(server, engine, MetaRequest::Stats { session: None })
}

/// Bytes of pages in use by the sessions of `engine` at maru-server now.
pub fn used_bytes(server: &str, engine: &str) -> u64 {
    engine_total(server, engine, MetaRequest::Usage)
}

/// maru-server's answer to `req`, asked as an observer, summed over the sessions of
/// `engine`: their leases for `Stats`, their bytes in use for `Usage`.
fn engine_total(server: &str, engine: &str, req: MetaRequest) -> u64 {
    let mut c = connect(server, maru::wire::meta::SERVICE, "observer");
    let each: Vec<(String, u64)> = match c.call(&req).unwrap() {
        MetaReply::Stats(s) => s
            .sessions
            .into_iter()
            .map(|s| (s.engine_id, s.leases))
            .collect(),
        MetaReply::Usage(u) => u
            .sessions
            .into_iter()
            .map(|s| (s.engine_id, s.used))
            .collect(),
        r => panic!("{req:?}: {r:?}"),
    };
    each.into_iter()
        .filter(|(e, _)| e == engine)
        .map(|(_, n)| n)
        .sum()
}

/// `args` as owned strings (a daemon's command line).
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// No item of `items` is `bad`; else a panic saying how many are, of how many, what
/// they did (`what`), and the first 8 of them.
pub fn assert_none<T: std::fmt::Debug>(items: &[T], bad: impl Fn(&T) -> bool, what: &str) {
    let found: Vec<&T> = items.iter().filter(|i| bad(i)).collect();
    assert!(
        found.is_empty(),
        "{} of {} {what}: {:#?}",
        found.len(),
        items.len(),
        &found[..found.len().min(8)]
    );
}

/// Polls `f` every 20 ms until it is true, for at most `limit`.
pub fn wait_until(limit: Duration, f: impl FnMut() -> bool) -> bool {
    maru_testkit::wait_until(limit, Duration::from_millis(20), f)
}

/// A memory node on loopback: a resource manager over a fake-DAX pool and a remote CXL
/// agent bound to it, with a fresh agent key (mode 0600). Dropped agent first.
pub struct MemoryNode {
    pub pool: PathBuf,
    pub key_path: PathBuf,
    pub key: maru::auth::SharedKey,
    pub agent: Daemon,
    pub rm: Daemon,
}

/// A [`MemoryNode`] in a scratch directory of its own (dereferences to the node).
/// Fields drop in order: the daemons stop before their directory goes.
pub struct OwnNode {
    pub node: MemoryNode,
    pub s: Scratch,
}

impl std::ops::Deref for OwnNode {
    type Target = MemoryNode;

    fn deref(&self) -> &MemoryNode {
        &self.node
    }
}

/// Starts an [`OwnNode`] in a scratch directory of `tag`, with a pool of `size`.
pub fn own_node(tag: &str, size: &str) -> OwnNode {
    let mut s = Scratch::new(tag);
    let node = memory_node(&mut s, size);
    OwnNode { node, s }
}

/// The arguments of a resource manager with its state in `s` and a fake-DAX pool
/// `pool` of `size` (`64M`, `1G`: the RM's syntax).
pub fn rm_args(s: &Scratch, pool: &Path, size: &str) -> Vec<String> {
    vec![
        "--state-dir".into(),
        s.dir.join("rm").display().to_string(),
        "--fake-dax".into(),
        format!("{}:{size}", pool.display()),
    ]
}

/// The arguments of an agent of node `mem0` for the RM at `rm`, with the key file
/// `key_path` and the device `pool`.
pub fn agent_args(rm: &str, key_path: &Path, pool: &Path) -> Vec<String> {
    vec![
        "--rm-address".into(),
        rm.to_string(),
        "--key-file".into(),
        key_path.display().to_string(),
        "--device".into(),
        pool.display().to_string(),
        "--node".into(),
        "mem0".into(),
    ]
}

/// Starts a [`MemoryNode`] in `s` with a pool of `size` (`64M`, `1G`: the RM's syntax).
pub fn memory_node(s: &mut Scratch, size: &str) -> MemoryNode {
    let pool = s.fake_dax("pool");
    let key_path = s.dir.join("agent.key");
    let key = maru::auth::SharedKey::generate().expect("a random agent key");
    maru::auth::keyfile::write_new_key_file(&key_path, &key).expect("the agent key file");
    let rm = Daemon::start(RM_BIN, &rm_args(s, &pool, size), &s.dir);
    let agent = Daemon::start(AGENT_BIN, &agent_args(&rm.addr, &key_path, &pool), &s.dir);
    MemoryNode {
        pool,
        key_path,
        key,
        agent,
        rm,
    }
}

/// An RM on a fake-DAX pool of `pool` (e.g. "256M"), with `remote` an agent on it, and
/// maru-server (`server_args` after its RM and agent flags). Fields drop in order: the
/// daemons stop before their scratch directory goes (a running RM could write its
/// state into it while it is being removed).
pub struct Stack {
    pub key_path: PathBuf,
    pub pool: PathBuf,
    pub server: Daemon,
    pub agent: Option<Daemon>,
    pub rm: Daemon,
    pub s: Scratch,
    /// The agent's and maru-server's arguments as started (for restarts).
    pub agent_args: Vec<String>,
    pub server_args: Vec<String>,
}

impl Stack {
    /// kill -9 the agent and start it again on its port.
    pub fn restart_agent(&mut self) {
        let args = self.agent_args.clone();
        if let Some(a) = self.agent.as_mut() {
            a.restart(&args, &self.s.dir);
        }
    }

    /// kill -9 maru-server and start it again on its port.
    pub fn restart_server(&mut self) {
        let args = self.server_args.clone();
        self.server.restart(&args, &self.s.dir);
    }

    /// A handler's configuration on this stack: `backend` (`cxl`, `remote_cxl`), engine
    /// `engine` in `namespace`, the stack's key files, `(load, store)` staging slots.
    /// Tests add or change fields on it, then `to_string()` it.
    pub fn handler_config(
        &self,
        backend: &str,
        engine: &str,
        namespace: &str,
        (load_slots, store_slots): (u32, u32),
    ) -> serde_json::Value {
        serde_json::json!({
            "backend": backend,
            "server_url": self.server.addr,
            "server_key_file": server_key_file(&self.server.addr),
            "engine_id": engine,
            "namespace": namespace,
            "agent_key_file": self.key_path.display().to_string(),
            "load_slots": load_slots,
            "store_slots": store_slots,
        })
    }
}

pub const RM_BIN: &str = env!("CARGO_BIN_EXE_maru-resource-manager");
pub const AGENT_BIN: &str = env!("CARGO_BIN_EXE_maru-remote-cxl-agent");
pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_maru-server");

pub fn stack(tag: &str, pool_size: &str, remote: bool, server_args: &[String]) -> Stack {
    stack_with(tag, pool_size, remote, |_| Vec::new(), server_args)
}

/// As [`stack`], the agent started with the arguments `agent_extra` makes in the
/// scratch directory (a boot id file, say) after its usual ones.
pub fn stack_with(
    tag: &str,
    pool_size: &str,
    remote: bool,
    agent_extra: impl FnOnce(&Scratch) -> Vec<String>,
    server_args: &[String],
) -> Stack {
    let key = maru::auth::SharedKey::generate().unwrap();
    stack_keyed(
        Scratch::new(tag),
        pool_size,
        remote,
        &key,
        agent_extra,
        server_args,
    )
}

/// As [`stack_with`], in the scratch directory `s` (where a test may have put files
/// the daemons' arguments name: a tenants file, say), with the agent key `key`
/// (stacks that one handler reaches share it: a handler has one agent key file).
pub fn stack_keyed(
    mut s: Scratch,
    pool_size: &str,
    remote: bool,
    key: &maru::auth::SharedKey,
    agent_extra: impl FnOnce(&Scratch) -> Vec<String>,
    server_args: &[String],
) -> Stack {
    let pool = s.fake_dax("pool");
    let key_path = s.dir.join("agent.key");
    maru::auth::keyfile::write_new_key_file(&key_path, key).unwrap();
    let rm = Daemon::start(RM_BIN, &rm_args(&s, &pool, pool_size), &s.dir);
    let mut agent_args = agent_args(&rm.addr, &key_path, &pool);
    agent_args.extend(agent_extra(&s));
    let agent = remote.then(|| Daemon::start(AGENT_BIN, &agent_args, &s.dir));
    let mut args = vec!["--rm-address".to_string(), rm.addr.clone()];
    if let Some(a) = &agent {
        args.extend([
            "--remote-cxl-agent".into(),
            a.addr.clone(),
            "--remote-cxl-agent-key-file".into(),
            key_path.display().to_string(),
        ]);
    }
    args.extend_from_slice(server_args);
    let server = Daemon::start(SERVER_BIN, &args, &s.dir);
    Stack {
        key_path,
        pool,
        server,
        agent,
        rm,
        s,
        agent_args,
        server_args: args,
    }
}

/// Runs a daemon that should refuse to start: its exit code (None when it was still
/// running after 10 s, then killed) and its stderr.
#[allow(dead_code)] // not every test binary uses every helper
pub fn refused_start(cmd: &mut Command) -> (Option<i32>, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut code = None;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            code = st.code();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if code.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    (code, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A port free on loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET /metrics: the samples, `series value` each.
pub fn scrape(port: u16) -> Vec<(String, f64)> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("the metrics port");
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    c.read_to_string(&mut r).unwrap();
    assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
    let body = r.split_once("\r\n\r\n").unwrap().1;
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (s, v) = l.rsplit_once(' ').unwrap();
            (s.to_string(), v.parse().unwrap())
        })
        .collect()
}

pub fn get(samples: &[(String, f64)], series: &str) -> f64 {
    samples
        .iter()
        .find(|(s, _)| s == series)
        .map(|(_, v)| *v)
        .unwrap_or(0.0)
}

/// A TCP proxy on loopback in front of a daemon: what a client sends that contains
/// `needle` is held back `delay` while `slow` is set (a daemon slow to answer one
/// kind of request). Returns its address and the count of messages held so far
/// (counted as the hold starts). Each connection's two pumps end with it; the
/// acceptor ends after `life`.
#[allow(dead_code)] // not every test binary uses every helper
pub fn holding_proxy(
    to: &str,
    needle: &'static [u8],
    slow: Arc<AtomicBool>,
    delay: Duration,
    life: Duration,
) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let held_count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = held_count.clone();
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let to = to.to_string();
    let pump = move |mut from: TcpStream, mut into: TcpStream, hold: Option<Arc<AtomicBool>>| {
        let counted = counted.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let held = hold.as_ref().is_some_and(|s| s.load(Ordering::SeqCst))
                    && buf[..n].windows(needle.len()).any(|w| w == needle);
                if held {
                    counted.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(delay);
                }
                if into.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = into.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        });
    };
    accept_for(listener, life, move |client| {
        let Ok(daemon) = TcpStream::connect(&to) else {
            return;
        };
        if let (Ok(c2), Ok(d2)) = (client.try_clone(), daemon.try_clone()) {
            pump(client, daemon, Some(slow.clone()));
            pump(d2, c2, None);
        }
    });
    (addr, held_count)
}

/// Accepts connections on `listener` until `life` has passed, on a thread of its own,
/// and hands each (blocking again) to `serve` on that thread: a proxy's acceptor.
#[allow(dead_code)] // not every test binary uses every helper
pub fn accept_for(
    listener: std::net::TcpListener,
    life: Duration,
    serve: impl Fn(std::net::TcpStream) + Send + 'static,
) {
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let end = Instant::now() + life;
        while Instant::now() < end {
            match listener.accept() {
                Ok((client, _)) => {
                    let _ = client.set_nonblocking(false);
                    serve(client);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
}

/// A soft NIC data connection to `addr` that proved `key` and bound itself to the
/// owner of the registration whose transport metadata is `meta` (as a worker's lane
/// does). Panics when the binding is refused.
pub fn bound_soft_connection(
    addr: &str,
    key: &maru::auth::SharedKey,
    meta: &serde_json::Value,
) -> std::net::TcpStream {
    use maru::transport::soft::proto;
    use std::io::{Read, Write};
    let mut opts = ClientOptions::new(proto::SERVICE, "bound-lane");
    opts.key = Some(key.clone());
    opts.connect_timeout = Duration::from_secs(10);
    let c = Client::connect(addr, &opts).expect("a proven data connection");
    let (mut s, head) = c.into_parts();
    assert!(
        head.is_empty(),
        "nothing comes before the BIND's completion"
    );
    let secret = u128::from_str_radix(meta["soft"]["bind"].as_str().expect("soft.bind"), 16)
        .expect("a hex binding secret");
    let bind = proto::Request {
        op: proto::OP_BIND,
        seq: 0,
        addr: (secret >> 64) as u64,
        rkey: secret as u64,
        len: 0,
    };
    s.write_all(&bind.encode()).expect("send BIND");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut cpl = [0u8; proto::CPL_LEN];
    s.read_exact(&mut cpl).expect("the BIND's completion");
    let c = proto::Completion::decode(&cpl);
    assert_eq!(c.status, proto::ST_OK, "BIND refused: {c:?}");
    s
}

/// The `(key, bytes)` items of a store batch: `keys[i]` with `data[i]`.
pub fn items<'a>(keys: &'a [String], data: &'a [Vec<u8>]) -> Vec<(&'a str, &'a [u8])> {
    keys.iter()
        .zip(data)
        .map(|(k, d)| (k.as_str(), d.as_slice()))
        .collect()
}

/// Stores `keys[i]` with `data[i]` through `h` in batches of 32 under the route key
/// `route`, each chunk stored (`what` names the path in the message).
pub fn store_all(h: &maru::worker::Handler, keys: &[String], data: &[Vec<u8>], what: &str) {
    for (ks, ds) in keys.chunks(32).zip(data.chunks(32)) {
        let ok = h.store_batch(&items(ks, ds), Some("route")).expect(what);
        assert!(ok.iter().all(|&x| x), "every chunk stored ({what})");
    }
}

/// A small deterministic generator (xorshift): a test that fails can be run again
/// with the same seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// `len` bytes that follow from `seed` alone (xorshift), so any reader can check what
/// it loaded.
pub fn seeded_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The bytes of `key` for pages of `page` bytes: their length (512 bytes to a page) and
/// content derive from the key alone.
pub fn key_bytes(key: &str, page: usize) -> Vec<u8> {
    let mut x: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        x = (x ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    seeded_bytes(x, 512 + (x as usize % (page - 512)))
}

/// Whether maru-server answers an `exists` in `session` on this connection (the
/// session is open here and the connection acts for its owner).
pub fn session_answers(c: &mut Client, session: u64) -> bool {
    matches!(
        c.call::<_, MetaReply>(&MetaRequest::Exists {
            session,
            keys: vec!["k".into()],
        }),
        Ok(MetaReply::Exists { .. })
    )
}
