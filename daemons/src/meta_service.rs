//! maru-server on the event loop: the metadata core with its ports wired to the RM
//! (as the owner of every region it hands out) and to the pool's agents (for the
//! region keeper only; the data path never passes through here).

use crate::meta_store::{SecretOp, SecretRecord, StoreWriter};
use crate::metrics::{op_of, result_of, Metrics, Refresh};
use crate::tenants_file::TenantsFile;
use maru::meta::records::Sealed;
use maru::meta::{
    Action, AgentPort, Caller, MetaCore, PoolSizes, PortError, ReplyTiming, RmPort, Ticket,
    DEFAULT_TENANT,
};
use maru::net::{ClientOptions, ConnId, Link, LinkError, Replier, Service};
use maru::wire::agent::{AgentReply, AgentRequest};
use maru::wire::meta::{MetaReply, MetaRequest, SERVICE};
use maru::wire::rm::{AllocReply, Handle, RmReply, RmRequest};
use maru::wire::{self, Envelope, WireError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// maru-server's gauges (`maru_server_<name>`).
pub const SERVER_GAUGES: &[(&str, &str)] = &[
    ("sessions", "Live storage sessions"),
    ("regions", "Regions of sessions and of the region keeper"),
    ("region_bytes", "Bytes of those regions"),
    ("keys", "Published keys"),
    ("key_bytes", "Bytes of published chunks"),
    ("leases", "Leases held by readers"),
    ("pinned_keys", "Distinct pinned keys"),
    (
        "kept_regions",
        "Regions of departed workers held by the region keeper",
    ),
    ("kept_keys", "Keys in kept regions"),
    (
        "giving_back",
        "Regions on their way back to the RM (release, then free)",
    ),
    (
        "waiting_for_region",
        "Storing sessions waiting for a region of the full pool",
    ),
    (
        "waiting_for_rm",
        "Requests waiting for the RM to allocate a region",
    ),
    (
        "recovered_keys",
        "Keys the last start recovered from the durable directory (--state-dir)",
    ),
    (
        "recovered_regions",
        "Regions the last start recovered from the durable directory",
    ),
    (
        "recovery_ms",
        "How long the last start took to recover the directory, in ms",
    ),
    (
        "pages_in_doubt",
        "Pages the last start found allocated without a key, not yet freed (a reserve, a lost publish)",
    ),
    (
        "pages_in_doubt_freed",
        "Pages in doubt freed since the last start because their session's report of held pages did not name them",
    ),
    (
        "pages_waiting",
        "Freed pages waiting for their key's removal to be durable (or for old leases)",
    ),
    (
        "replies_waiting_for_store",
        "Replies waiting for the changes they follow to be durable",
    ),
];

/// maru-server's totals since start (`maru_server_<name>_total`).
pub const SERVER_TOTALS: &[(&str, &str)] = &[
    ("hits", "Keys found by acquire"),
    ("misses", "Keys not found by acquire"),
    ("evictions", "Keys removed by their owners (evictions)"),
    (
        "chains_cut",
        "Evicted keys that still had stored successors in their prefix chain",
    ),
    (
        "fair_share_returns",
        "Regions sessions returned when asked for their fair share",
    ),
    (
        "store_commits",
        "Commits of the durable directory (each makes every batch waiting durable)",
    ),
];

fn port_error(e: LinkError) -> PortError {
    match e {
        LinkError::Remote(w) => PortError::from(w),
        LinkError::Unreachable(m) | LinkError::Auth(m) | LinkError::Rejected(m) => {
            PortError::Unreachable(m)
        }
    }
}

fn unexpected<T: std::fmt::Debug>(r: T) -> PortError {
    PortError::Failed(format!("unexpected reply {r:?}"))
}

/// A call to the RM made off the event loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum RmKey {
    /// This server's regions, asked after this many allocations had started.
    Owned(u64),
    Free(u64),
    Pools,
}

/// The RM as maru-server uses it. Every call runs on a thread of its own: the core's
/// allocations ([`Action::Alloc`]) on `rm-alloc`, whose answers wake the loop and go to
/// the core as events ([`MetaCore::alloc_done`]); the periodic and keeper calls (which
/// regions the RM holds for this server, frees, the pools' sizes) on `rm-link`, each
/// waiting on the loop at most [`AGENT_WAIT`]. So a stopped RM never stalls the loop,
/// and sessions that do not need it stay fast.
pub struct MetaRm {
    /// The start-up check's connection.
    link: Link,
    /// This server's client id at the RM (the owner of its regions).
    client_id: String,
    opts: ClientOptions,
    bg: OffLoop<RmKey, RmRequest, Result<RmReply, PortError>>,
    allocator: Option<Allocator>,
    /// Allocations started: an answer about the server's regions asked before the
    /// latest one may miss its region, so it is not used.
    allocs: u64,
    sizes: Option<PoolSizes>,
    wait: Duration,
    addr: String,
}

/// Allocations at the RM, one at a time, on the thread `rm-alloc`.
struct Allocator {
    jobs: mpsc::Sender<(u64, u64)>,
    done: mpsc::Receiver<(u64, Result<AllocReply, PortError>)>,
    /// An answer is waiting in `done` (set before the loop is woken).
    ready: Arc<AtomicBool>,
}

impl Allocator {
    fn start(mut link: Link, waker: Replier) -> Allocator {
        let (jobs, rx) = mpsc::channel::<(u64, u64)>();
        let (tx, done) = mpsc::channel();
        let ready = Arc::new(AtomicBool::new(false));
        let flag = ready.clone();
        let spawned = std::thread::Builder::new()
            .name("rm-alloc".into())
            .spawn(move || {
                while let Ok((alloc, size)) = rx.recv() {
                    let req = RmRequest::Alloc {
                        size,
                        pool: None,
                        request_id: 0,
                    };
                    let answer = match link.call::<_, RmReply>(&req).map_err(port_error) {
                        Ok(RmReply::Alloc(a)) => Ok(a),
                        Ok(r) => Err(unexpected(r)),
                        Err(e) => Err(e),
                    };
                    if tx.send((alloc, answer)).is_err() {
                        return;
                    }
                    flag.store(true, Ordering::SeqCst);
                    waker.wake();
                }
            });
        if let Err(e) = spawned {
            log::error!("cannot start thread rm-alloc: {e}");
        }
        Allocator { jobs, done, ready }
    }
}

impl MetaRm {
    pub fn new(addr: &str, client_id: String, key: Option<maru::auth::SharedKey>) -> MetaRm {
        let mut opts = ClientOptions::new(maru::wire::rm::SERVICE, client_id.clone());
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        let mut bg_link = Link::new(addr, opts.clone());
        let bg = OffLoop::start("rm-link".into(), move |req: RmRequest| {
            bg_link.call::<_, RmReply>(&req).map_err(port_error)
        });
        MetaRm {
            link: Link::new(addr, opts.clone()),
            client_id,
            opts,
            bg,
            allocator: None,
            allocs: 0,
            sizes: None,
            wait: AGENT_WAIT,
            addr: addr.to_string(),
        }
    }

    /// Starts the allocation thread; its answers wake the loop through `waker`.
    fn start_allocator(&mut self, waker: Replier) {
        let link = Link::new(self.addr.clone(), self.opts.clone());
        self.allocator = Some(Allocator::start(link, waker));
    }

    /// Sends the core's allocation to the RM (answered through [`take_allocs`]).
    fn start_alloc(&mut self, alloc: u64, size: u64) -> Result<(), PortError> {
        // Counted before the answer: an answer about the server's regions asked
        // before this point may miss the region this call hands out.
        self.allocs += 1;
        let sent = self
            .allocator
            .as_ref()
            .is_some_and(|a| a.jobs.send((alloc, size)).is_ok());
        if sent {
            Ok(())
        } else {
            Err(PortError::Unreachable(format!(
                "the allocation thread for the RM at {} is gone",
                self.addr
            )))
        }
    }

    /// Whether an allocation's answer waits to be taken.
    fn alloc_answered(&self) -> bool {
        self.allocator
            .as_ref()
            .is_some_and(|a| a.ready.load(Ordering::SeqCst))
    }

    /// The answers of allocations that came back.
    fn take_allocs(&mut self) -> Vec<(u64, Result<AllocReply, PortError>)> {
        let Some(a) = &self.allocator else {
            return Vec::new();
        };
        a.ready.store(false, Ordering::SeqCst);
        a.done.try_iter().collect()
    }

    /// Lets the off-loop calls wait up to `wait` (at shutdown).
    pub fn set_wait(&mut self, wait: Duration) {
        self.wait = wait;
    }

    fn bg_call(&mut self, key: RmKey, req: RmRequest) -> Result<RmReply, PortError> {
        let peer = format!("the RM at {}", self.addr);
        self.bg
            .call(&peer, key, req, self.wait)
            .unwrap_or_else(|m| Err(PortError::Unreachable(m)))
    }

    /// The regions the RM holds for this server, with their handles' tokens, asked
    /// on the start-up connection (a restart, before serving).
    pub fn owned_region_infos(&mut self) -> Result<Vec<maru::wire::rm::RegionInfo>, String> {
        let req = RmRequest::Regions {
            owner: Some(self.client_id.clone()),
        };
        match self.link.call::<_, RmReply>(&req) {
            Ok(RmReply::Regions { regions }) => Ok(regions),
            Ok(r) => Err(format!("unexpected reply {r:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Connects now (maru-server refuses to start without its RM).
    pub fn check(&mut self) -> Result<(), String> {
        self.link.client().map(|_| ()).map_err(|e| e.to_string())
    }

    /// Keeps one connection to the RM open, from a thread of its own, with a cheap
    /// call every `every` (or a third of the idle timeout the RM announces): the RM closes connections idle past its idle timeout, and
    /// an owner with no connection left loses its regions after the RM's grace period.
    /// A quiet server (no new region for minutes) must not look gone.
    pub fn keep_alive(
        addr: &str,
        client_id: String,
        key: Option<maru::auth::SharedKey>,
        every: Duration,
    ) {
        let mut opts = ClientOptions::new(maru::wire::rm::SERVICE, client_id);
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        let mut link = Link::new(addr, opts);
        let spawned = std::thread::Builder::new()
            .name("rm-keepalive".into())
            .spawn(move || loop {
                if let Err(e) = link.call::<_, RmReply>(&RmRequest::Pools) {
                    log::debug!("RM keep-alive: {e}");
                }
                // Well within the idle timeout the RM announces, if it is shorter.
                let idle = link
                    .client()
                    .ok()
                    .and_then(|c| c.welcome().info.get("idle_timeout_ms")?.as_u64())
                    .filter(|ms| *ms > 0)
                    .map_or(every, |ms| every.min(Duration::from_millis(ms / 3)));
                std::thread::sleep(idle);
            });
        if let Err(e) = spawned {
            log::warn!("cannot start the RM keep-alive thread: {e}");
        }
    }
}

/// How often maru-server's keep-alive connection calls the RM.
pub const RM_KEEPALIVE: Duration = Duration::from_secs(15);

impl RmPort for MetaRm {
    fn free(&mut self, h: &Handle) -> Result<(), PortError> {
        let req = RmRequest::Free {
            handle: h.clone(),
            request_id: 0,
        };
        match self.bg_call(RmKey::Free(h.region_id), req)? {
            RmReply::Free(_) => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    fn owned_regions(&mut self) -> Result<Vec<u64>, PortError> {
        let req = RmRequest::Regions {
            owner: Some(self.client_id.clone()),
        };
        match self.bg_call(RmKey::Owned(self.allocs), req)? {
            RmReply::Regions { regions } => Ok(regions.into_iter().map(|r| r.region_id).collect()),
            r => Err(unexpected(r)),
        }
    }

    fn pool_sizes(&mut self) -> Result<PoolSizes, PortError> {
        match self.bg_call(RmKey::Pools, RmRequest::Pools) {
            Ok(RmReply::Pools { pools }) => {
                let v = PoolSizes {
                    largest: pools.iter().map(|p| p.total).max().unwrap_or(0),
                    total: pools.iter().map(|p| p.total).sum(),
                };
                self.sizes = Some(v);
                Ok(v)
            }
            Ok(r) => Err(unexpected(r)),
            // The last answer stands while the RM is slow (pools seldom change).
            Err(e) => self.sizes.ok_or(e),
        }
    }
}

/// How long a call to an agent may hold the event loop. A healthy agent answers well
/// within it; past it the call goes on in the background, the keeper sees the agent
/// as unreachable for now (it retries), and later calls take the answer.
pub const AGENT_WAIT: Duration = Duration::from_millis(20);

/// A call the keeper makes: map or release of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum CallKey {
    Map(u64),
    Release(u64),
}

type Answer = Result<String, PortError>;

/// Calls to one peer, made from a thread of their own, so that a peer that stopped
/// answering (SIGSTOP, a dead host) never stalls maru-server's event loop: at most one
/// call is in flight per peer, and while it is, further calls to that peer fail at
/// once (unreachable) instead of queueing behind it. A call waits on the loop only up
/// to its `wait`; an answer that comes later is kept for the next same call.
struct OffLoop<K, Q, A> {
    jobs: mpsc::Sender<(K, Q)>,
    done: mpsc::Receiver<(K, A)>,
    in_flight: Option<K>,
    ready: HashMap<K, (std::time::Instant, A)>,
}

/// An answer older than this is not handed to a later call (the call is made again).
const READY_FOR: Duration = Duration::from_secs(10);

/// Answers kept for later calls at most (a keeper retries what it needs).
const READY_MAX: usize = 4096;

impl<K, Q, A> OffLoop<K, Q, A>
where
    K: Copy + Eq + std::hash::Hash + std::fmt::Debug + Send + 'static,
    Q: Send + 'static,
    A: Send + 'static,
{
    /// Starts the thread `name`, which answers each job with `call`.
    fn start(name: String, mut call: impl FnMut(Q) -> A + Send + 'static) -> OffLoop<K, Q, A> {
        let (jobs, rx) = mpsc::channel::<(K, Q)>();
        let (tx, done) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                while let Ok((key, q)) = rx.recv() {
                    if tx.send((key, call(q))).is_err() {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            log::error!("cannot start thread {name}: {e}");
        }
        OffLoop {
            jobs,
            done,
            in_flight: None,
            ready: HashMap::new(),
        }
    }

    fn take_done(&mut self) {
        while let Ok((k, a)) = self.done.try_recv() {
            if self.in_flight == Some(k) {
                self.in_flight = None;
            }
            if self.ready.len() >= READY_MAX {
                self.ready.clear();
            }
            self.ready.insert(k, (std::time::Instant::now(), a));
        }
    }

    /// The answer to `q`, or why there is none now (to be treated as unreachable).
    fn call(&mut self, peer: &str, key: K, q: Q, wait: Duration) -> Result<A, String> {
        self.take_done();
        if let Some((at, a)) = self.ready.remove(&key) {
            if at.elapsed() < READY_FOR {
                return Ok(a);
            }
        }
        if let Some(busy) = self.in_flight {
            return Err(format!(
                "{peer} has not answered an earlier call ({busy:?}) yet"
            ));
        }
        if self.jobs.send((key, q)).is_err() {
            return Err(format!("the link thread of {peer} is gone"));
        }
        self.in_flight = Some(key);
        if let Ok((k, a)) = self.done.recv_timeout(wait) {
            self.in_flight = None;
            if k == key {
                return Ok(a);
            }
            self.ready.insert(k, (std::time::Instant::now(), a));
        }
        Err(format!(
            "{peer} did not answer within {} ms; the call goes on in the background",
            wait.as_millis()
        ))
    }
}

/// One agent's calls ([`OffLoop`]).
struct AgentWorker(OffLoop<CallKey, AgentRequest, Answer>);

impl AgentWorker {
    fn start(agent: &str, opts: ClientOptions) -> AgentWorker {
        let mut link = Link::new(agent, opts).with_check(maru::worker::agents::require_boot_id);
        let name = format!("agent-link-{}", maru::net::clip(agent));
        AgentWorker(OffLoop::start(name, move |req: AgentRequest| {
            match link.call::<_, AgentReply>(&req).map_err(port_error) {
                Ok(AgentReply::Mapped(m)) => Ok(m.boot_id),
                Ok(AgentReply::Released { .. }) => Ok(String::new()),
                Ok(r) => Err(unexpected(r)),
                Err(e) => Err(e),
            }
        }))
    }

    fn call(&mut self, agent: &str, key: CallKey, req: AgentRequest, wait: Duration) -> Answer {
        self.0
            .call(&format!("agent {agent}"), key, req, wait)
            .unwrap_or_else(|m| Err(PortError::Unreachable(m)))
    }
}

/// The pool's agents, each on a link thread of its own ([`AgentWorker`]).
pub struct MetaAgents {
    workers: HashMap<String, AgentWorker>,
    opts: ClientOptions,
    /// How long a call may wait on the loop ([`AGENT_WAIT`]; longer at shutdown,
    /// when the loop serves nobody else).
    wait: Duration,
}

impl MetaAgents {
    pub fn new(client_id: String, key: Option<maru::auth::SharedKey>) -> MetaAgents {
        let mut opts = ClientOptions::new(maru::wire::agent::SERVICE, client_id);
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        MetaAgents {
            workers: HashMap::new(),
            opts,
            wait: AGENT_WAIT,
        }
    }

    /// Lets calls wait for their answer up to `wait` (at shutdown: the call timeout).
    pub fn set_wait(&mut self, wait: Duration) {
        self.wait = wait;
    }

    /// The options of the links to the agents (client id, key, timeouts).
    pub fn options(&self) -> ClientOptions {
        self.opts.clone()
    }

    fn worker(&mut self, agent: &str) -> &mut AgentWorker {
        let opts = self.opts.clone();
        self.workers
            .entry(agent.to_string())
            .or_insert_with(|| AgentWorker::start(agent, opts))
    }
}

impl AgentPort for MetaAgents {
    fn map(&mut self, agent: &str, h: &Handle) -> Result<String, PortError> {
        let req = AgentRequest::Map {
            handle: h.clone(),
            writable: false,
        };
        let wait = self.wait;
        match self
            .worker(agent)
            .call(agent, CallKey::Map(h.region_id), req, wait)
        {
            Ok(boot) if boot.is_empty() => Err(PortError::Unreachable(format!(
                "agent {agent} reported no boot id"
            ))),
            other => other,
        }
    }

    fn release(&mut self, agent: &str, h: &Handle) -> Result<(), PortError> {
        let req = AgentRequest::Release { handle: h.clone() };
        let wait = self.wait;
        self.worker(agent)
            .call(agent, CallKey::Release(h.region_id), req, wait)
            .map(|_| ())
    }
}

/// Who each connection acts as. A session belongs to the connection that opened it
/// (its *owner*), never to the client id a peer declares: a new connection acts on an
/// existing session only when its hello presents that session's secret and it proved
/// the key of the same tenant. The tenant is the keyring's name of the key the
/// connection proved (the `default` tenant without a key).
///
/// Secrets are kept by a keyed hash only (so the durable directory never holds one
/// that would open a session), and an owner's name carries the server's run number,
/// so a connection of a later run never takes the name of an owner recorded by an
/// earlier one.
#[derive(Default)]
pub struct SessionBinding {
    /// The owner and tenant of each open connection.
    conns: HashMap<ConnId, Bound>,
    /// Hash of a session secret → the owner and tenant whose sessions it opens.
    secrets: HashMap<String, Bound>,
    next_prune_ms: u64,
    /// Starts of this server on its state directory (0 without one).
    run: u64,
}

/// Whom a connection acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    pub owner: String,
    pub tenant: String,
}

/// How often secrets of owners without a live session are forgotten.
const PRUNE_MS: u64 = 5_000;

/// The keyed hash a session secret is kept under.
pub fn secret_hash(secret: &str) -> String {
    maru::auth::to_hex(&maru::auth::hmac_parts(
        b"maru-server session secret",
        &[secret.as_bytes()],
    ))
}

impl SessionBinding {
    /// A binding for run `run` of the server, knowing the secrets an earlier run
    /// handed out (by hash).
    pub fn restored(run: u64, secrets: Vec<(String, SecretRecord)>) -> SessionBinding {
        SessionBinding {
            run,
            secrets: secrets
                .into_iter()
                .map(|(h, r)| {
                    (
                        h,
                        Bound {
                            owner: r.owner,
                            tenant: r.tenant,
                        },
                    )
                })
                .collect(),
            ..Default::default()
        }
    }

    fn own(&self, client_id: &str, conn: ConnId) -> String {
        if self.run == 0 {
            format!("{client_id}#{conn}")
        } else {
            format!("{client_id}#{}.{conn}", self.run)
        }
    }

    /// Binds a new connection: to the owner of the session secret it presents when
    /// it proved that owner's tenant, or else to an owner of its own.
    pub fn open(&mut self, conn: ConnId, client_id: &str, tenant: &str, resume: Option<&str>) {
        let known = resume.and_then(|r| self.secrets.get(&secret_hash(r)).cloned());
        let bound = match known {
            Some(b) if b.tenant == tenant => b,
            Some(b) => {
                log::warn!(
                    "connection {conn} of {} (tenant {tenant}) presented the session secret of \
                     tenant {}: refused, it acts as itself",
                    maru::net::clip(client_id),
                    b.tenant
                );
                Bound {
                    owner: self.own(client_id, conn),
                    tenant: tenant.to_string(),
                }
            }
            None => {
                if resume.is_some() {
                    log::info!(
                        "connection {conn} of {} presented an unknown session secret",
                        maru::net::clip(client_id)
                    );
                }
                Bound {
                    owner: self.own(client_id, conn),
                    tenant: tenant.to_string(),
                }
            }
        };
        self.conns.insert(conn, bound);
    }

    pub fn bound(&self, conn: ConnId) -> Option<&Bound> {
        self.conns.get(&conn)
    }

    /// A new secret for a session `conn` opened, and what to keep of it.
    pub fn new_secret(&mut self, conn: ConnId) -> Option<(String, SecretOp)> {
        let bound = self.conns.get(&conn)?.clone();
        let secret = maru::auth::to_hex(&maru::auth::random_bytes(16).ok()?);
        let hash = secret_hash(&secret);
        self.secrets.insert(hash.clone(), bound.clone());
        let keep = SecretOp::Put(
            hash,
            SecretRecord {
                owner: bound.owner,
                tenant: bound.tenant,
                check: 0,
            }
            .sealed(),
        );
        Some((secret, keep))
    }

    /// A connection closed; returns its owner when no other open connection acts
    /// as it.
    pub fn close(&mut self, conn: ConnId) -> Option<String> {
        let b = self.conns.remove(&conn)?;
        (!self.conns.values().any(|q| q.owner == b.owner)).then_some(b.owner)
    }

    /// Forgets every secret of `tenant` (its key was removed or changed): no later
    /// connection resumes what the old key opened. Returns what to remove from the
    /// kept ones.
    pub fn forget_tenant(&mut self, tenant: &str) -> Vec<SecretOp> {
        let gone: Vec<String> = self
            .secrets
            .iter()
            .filter(|(_, b)| b.tenant == tenant)
            .map(|(h, _)| h.clone())
            .collect();
        for h in &gone {
            self.secrets.remove(h);
        }
        gone.into_iter().map(SecretOp::Delete).collect()
    }

    /// Forgets secrets whose owner has no live session (at most every few seconds);
    /// returns what to remove from the kept ones.
    pub fn prune(&mut self, now_ms: u64, live: impl Fn(&str) -> bool) -> Vec<SecretOp> {
        if now_ms < self.next_prune_ms {
            return Vec::new();
        }
        self.next_prune_ms = now_ms + PRUNE_MS;
        let gone: Vec<String> = self
            .secrets
            .iter()
            .filter(|(_, b)| !live(&b.owner))
            .map(|(h, _)| h.clone())
            .collect();
        for h in &gone {
            self.secrets.remove(h);
        }
        gone.into_iter().map(SecretOp::Delete).collect()
    }
}

/// A request answered later: it waits in the core for a region from the RM.
struct Pending {
    conn: ConnId,
    /// The request's id (its reply carries it).
    id: u64,
    op: String,
    started: Instant,
}

/// What a restart recovered, for `stats`, `/metrics` and `maru-usage`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recovery {
    pub keys: u64,
    pub regions: u64,
    pub sessions: u64,
    /// Keys dropped after the store was read: regions the RM no longer held, memory
    /// nodes that rebooted, records that no longer fit.
    pub dropped_keys: u64,
    /// Records that failed their own check or did not decode (dropped, never served).
    pub unverified: u64,
    /// From opening the state directory to serving.
    pub took_ms: u64,
}

/// The durable directory as the service drives it.
struct Durable {
    writer: StoreWriter,
    /// Replies waiting for their job to be durable: (job, connection, frame).
    held: std::collections::VecDeque<(u64, ConnId, Vec<u8>)>,
    /// Secret changes for the next job.
    secrets: Vec<SecretOp>,
    /// When to hand the core's reads (use stamps) to the store next.
    next_flush_ms: u64,
    /// Jobs whose requests were answered before they were durable (a publish, an
    /// alloc from the reserve): (job, when the first of them was answered), oldest
    /// first.
    early: std::collections::VecDeque<(u64, u64)>,
    /// Changes of requests answered early that are still in the core, not yet handed
    /// to the store: since when (they go at most [`LAZY_COMMIT_MS`] later, or sooner
    /// with the next change a reply waits for).
    lazy_since_ms: Option<u64>,
}

/// Changes whose replies went early are handed to the store at most this long after
/// the first of them (with every change made meanwhile, as one job: one hand-over and
/// one wake-up of the store thread per window, not one per request). A crash loses at
/// most about this much more than the commit in flight.
const LAZY_COMMIT_MS: u64 = 4;

/// Reads (use stamps) go to the store at least this often.
const FLUSH_MS: u64 = 200;

/// Replies go before their commit (see [`ReplyTiming::Early`]) only while the store
/// keeps up: at most this many jobs answered early and not yet durable, the oldest
/// sent at most [`EARLY_MAX_MS`] ago, and no commit failing. Otherwise they wait for
/// their commit as every other change: what a crash may lose stays within a few
/// commits (about [`EARLY_MAX_MS`]), and a stalled disk never queues changes without
/// bound.
const EARLY_MAX_JOBS: usize = 4096;
const EARLY_MAX_MS: u64 = 250;

impl Durable {
    /// Whether a reply may go before its commit now.
    fn may_answer_early(&mut self, now_ms: u64) -> bool {
        let seq = self.writer.durable_seq();
        while self.early.front().is_some_and(|(s, _)| *s <= seq) {
            self.early.pop_front();
        }
        !self.writer.is_failing()
            && self.early.len() < EARLY_MAX_JOBS
            && self
                .early
                .front()
                .is_none_or(|(_, at)| now_ms.saturating_sub(*at) <= EARLY_MAX_MS)
    }
}

pub struct MetaService {
    pub core: MetaCore,
    pub rm: MetaRm,
    pub agents: MetaAgents,
    pub binding: SessionBinding,
    /// Requests waiting in the core, by ticket, and each connection's tickets.
    pending: HashMap<Ticket, Pending>,
    tickets_of: HashMap<ConnId, Vec<Ticket>>,
    next_ticket: Ticket,
    /// Replies to requests answered late, for the loop to send.
    replies: Vec<(ConnId, Vec<u8>)>,
    /// `--tenants`: the file, read again when it changes.
    tenants_file: Option<TenantsFile>,
    /// `--metrics`: figures for Prometheus.
    metrics: Option<Arc<Metrics>>,
    refresh: Refresh,
    started: Instant,
    /// `--state-dir`: replies that change the directory wait until it is durable.
    durable: Option<Durable>,
    recovery: Option<Recovery>,
    /// Set by SIGTERM/SIGINT (see [`watch_signals`]); the loop then drains and exits.
    stop: Arc<AtomicBool>,
    stopping: Stopping,
    last_now_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopping {
    No,
    /// Replies answered and the store flushed: exit at the next tick (after the loop
    /// sent them).
    Drained,
}

impl MetaService {
    /// The service; `waker` wakes the loop when the RM answers an allocation.
    pub fn new(core: MetaCore, mut rm: MetaRm, agents: MetaAgents, waker: Replier) -> MetaService {
        rm.start_allocator(waker);
        MetaService {
            core,
            rm,
            agents,
            binding: SessionBinding::default(),
            pending: HashMap::new(),
            tickets_of: HashMap::new(),
            next_ticket: 0,
            replies: Vec::new(),
            tenants_file: None,
            metrics: None,
            refresh: Refresh::new(1000),
            started: Instant::now(),
            durable: None,
            recovery: None,
            stop: Arc::new(AtomicBool::new(false)),
            stopping: Stopping::No,
            last_now_ms: 0,
        }
    }

    /// Counts requests into `m` and copies the core's figures into its gauges.
    pub fn with_metrics(mut self, m: Arc<Metrics>) -> MetaService {
        self.metrics = Some(m);
        self
    }

    /// Reads `file` again whenever it changes and puts its tenants in force.
    pub fn with_tenants_file(mut self, file: TenantsFile) -> MetaService {
        self.tenants_file = Some(file);
        self
    }

    /// Keeps the directory durable through `writer` (the core keeps its journal),
    /// with the binding of this run and what the restart recovered.
    pub fn with_store(
        mut self,
        writer: StoreWriter,
        binding: SessionBinding,
        recovery: Recovery,
    ) -> MetaService {
        self.binding = binding;
        self.recovery = Some(recovery);
        self.durable = Some(Durable {
            writer,
            held: Default::default(),
            secrets: Vec::new(),
            next_flush_ms: 0,
            early: Default::default(),
            lazy_since_ms: None,
        });
        self
    }

    /// The flag a signal sets to stop the service (see [`watch_signals`]).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// The reply frame of a request's result, counted in the metrics.
    fn reply(
        &mut self,
        conn: ConnId,
        id: u64,
        op: &str,
        started: Instant,
        mut result: Result<MetaReply, WireError>,
        now_ms: u64,
    ) -> Vec<u8> {
        if let Ok(MetaReply::Session(s)) = &mut result {
            s.session_secret = self.binding.new_secret(conn).map(|(secret, keep)| {
                if let Some(d) = &mut self.durable {
                    d.secrets.push(keep);
                }
                secret
            });
        }
        if let Err(e) = &result {
            log::debug!("request {id} on connection {conn}: {e}");
        }
        if let Some(m) = &self.metrics {
            m.request(op, result_of(&result), started.elapsed().as_secs_f64());
            self.refresh.touch();
            self.refresh_gauges(now_ms);
        }
        wire::reply_frame(id, result)
    }

    /// Hands everything that changed (and the secrets made) to the store, early
    /// answered changes gathered so far included; returns the job that carries it
    /// (or the last one sent, when nothing changed).
    fn flush(&mut self, now_ms: u64) -> u64 {
        let Some(d) = &mut self.durable else {
            return 0;
        };
        d.next_flush_ms = now_ms.saturating_add(FLUSH_MS);
        let lazy = d.lazy_since_ms.take();
        let changes = self.core.take_changes();
        if changes.is_none() && d.secrets.is_empty() {
            return d.writer.sent_seq();
        }
        let secrets = std::mem::take(&mut d.secrets);
        let seq = d.writer.send(changes, secrets);
        if let Some(at) = lazy {
            d.early.push_back((seq, at));
        }
        seq
    }

    /// Sends `frame` now, or once what changed before it is durable. `early`: the
    /// reply need not wait for what changed (while the store keeps up), which goes to
    /// the store with the next hand-over, at most [`LAZY_COMMIT_MS`] from now.
    fn send_after(
        &mut self,
        conn: ConnId,
        frame: Vec<u8>,
        changed: bool,
        early: bool,
        now_ms: u64,
    ) -> Vec<u8> {
        if self.durable.is_none() || !changed {
            return frame;
        }
        let early = early
            && self
                .durable
                .as_mut()
                .is_some_and(|d| d.may_answer_early(now_ms));
        if early {
            if let Some(d) = &mut self.durable {
                d.lazy_since_ms.get_or_insert(now_ms);
            }
            return frame;
        }
        let seq = self.flush(now_ms);
        let Some(d) = &mut self.durable else {
            return frame;
        };
        d.held.push_back((seq, conn, frame));
        Vec::new()
    }

    /// Serves one request: its reply, or an empty one when it waits in the core for
    /// a region (answered by [`deliver`](Self::deliver)) or for the store.
    fn serve(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        self.last_now_ms = now_ms;
        let started = Instant::now();
        let env: Envelope<MetaRequest> = match wire::decode_json(body) {
            Ok(e) => e,
            Err(e) => {
                log::info!(
                    "bad request from {}: {}",
                    maru::net::clip(client_id),
                    maru::net::clip(&e.message)
                );
                if let Some(m) = &self.metrics {
                    m.request(
                        "malformed",
                        e.code.as_str(),
                        started.elapsed().as_secs_f64(),
                    );
                }
                return wire::reply_frame::<()>(wire::request_id_of(body), Err(e));
            }
        };
        if self.stop.load(Ordering::SeqCst) {
            let e = WireError::new(
                wire::ErrorCode::Internal,
                "maru-server is stopping (SIGTERM): retry, it answers again once restarted",
            );
            return wire::reply_frame::<()>(env.id, Err(e));
        }
        // Every connection is bound at its handshake; one that is not gets no tenant
        // (no namespace opens for it), never the default tenant's rights.
        let bound = self.binding.bound(conn).cloned().unwrap_or_else(|| Bound {
            owner: format!("{client_id}#{conn}"),
            tenant: String::new(),
        });
        let caller = Caller {
            owner: &bound.owner,
            tenant: &bound.tenant,
        };
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let op = op_of(body);
        // A commit the loop was not woken for may have ended since its last look.
        self.catch_up_durable();
        let mark = self.core.change_mark();
        let answer = self
            .core
            .handle(&caller, ticket, env.body, now_ms, &mut self.rm);
        self.run_actions(now_ms);
        match answer {
            Some(r) => {
                let frame = self.reply(conn, env.id, &op, started, r, now_ms);
                let secrets = self.durable.as_ref().is_some_and(|d| !d.secrets.is_empty());
                let timing = self.core.reply_timing();
                let changed =
                    self.core.change_mark() != mark || secrets || timing == ReplyTiming::AfterAll;
                let early = timing == ReplyTiming::Early && !secrets;
                self.send_after(conn, frame, changed, early, now_ms)
            }
            None => {
                self.pending.insert(
                    ticket,
                    Pending {
                        conn,
                        id: env.id,
                        op,
                        started,
                    },
                );
                self.tickets_of.entry(conn).or_default().push(ticket);
                Vec::new()
            }
        }
    }

    /// Carries out the core's actions: allocations go to the RM off the loop.
    fn run_actions(&mut self, now_ms: u64) {
        while let Some(Action::Alloc { alloc, size }) = self.core.next_action() {
            if let Err(e) = self.rm.start_alloc(alloc, size) {
                self.core.alloc_done(alloc, Err(e), now_ms, &mut self.rm);
            }
        }
    }

    /// Feeds the RM's answers to the core and turns the core's late answers into
    /// replies (once what they changed is durable).
    fn deliver(&mut self, now_ms: u64) {
        for (alloc, answer) in self.rm.take_allocs() {
            self.core.alloc_done(alloc, answer, now_ms, &mut self.rm);
        }
        self.run_actions(now_ms);
        for (ticket, result) in self.core.take_answers() {
            let Some(p) = self.pending.remove(&ticket) else {
                continue;
            };
            if let Some(t) = self.tickets_of.get_mut(&p.conn) {
                t.retain(|x| *x != ticket);
            }
            let frame = self.reply(p.conn, p.id, &p.op, p.started, result, now_ms);
            // A late answer hands out a region or opens a session: durable first.
            let frame = self.send_after(p.conn, frame, true, false, now_ms);
            if !frame.is_empty() {
                self.replies.push((p.conn, frame));
            }
        }
    }

    /// Replies whose changes are durable now, and pages their removals freed.
    fn release_durable(&mut self) {
        let Some(d) = &mut self.durable else {
            return;
        };
        if !d.held.is_empty() || self.core.pages_waiting() > 0 {
            d.writer.wake_when_durable();
        }
        let seq = d.writer.durable_seq();
        while d.held.front().is_some_and(|(s, _, _)| *s <= seq) {
            if let Some((_, conn, frame)) = d.held.pop_front() {
                self.replies.push((conn, frame));
            }
        }
        self.catch_up_durable();
    }

    /// Tells the core how far the store got (pages reserved in batches durable now
    /// are handed out with no wait; pages freed by removals durable now come back).
    fn catch_up_durable(&mut self) {
        let Some(d) = &self.durable else {
            return;
        };
        let batch = d.writer.durable_batch();
        if batch > self.core.durable_batch() {
            self.core.durable(batch, self.last_now_ms);
        }
    }

    /// Recovery figures, as `stats` shows them.
    fn total_stats(&self) -> maru::wire::meta::TotalStats {
        let mut t = self.core.total_stats();
        if let Some(r) = &self.recovery {
            t.recovered_keys = r.keys;
            t.recovered_regions = r.regions;
            t.recovery_ms = r.took_ms;
        }
        t
    }

    fn refresh_gauges(&mut self, now_ms: u64) {
        let Some(m) = &self.metrics else {
            return;
        };
        if !self.refresh.due(now_ms) {
            return;
        }
        let t = self.total_stats();
        for (name, v) in [
            ("sessions", t.sessions),
            ("regions", t.regions),
            ("region_bytes", t.region_bytes),
            ("keys", t.keys),
            ("key_bytes", t.key_bytes),
            ("leases", t.leases),
            ("pinned_keys", t.pinned_keys),
            ("kept_regions", t.kept_regions),
            ("kept_keys", t.kept_keys),
            ("giving_back", t.giving_back),
            ("waiting_for_region", t.waiting_for_region),
            ("waiting_for_rm", t.waiting_for_rm),
            ("recovered_keys", t.recovered_keys),
            ("recovered_regions", t.recovered_regions),
            ("recovery_ms", t.recovery_ms),
            ("pages_in_doubt", t.pages_in_doubt),
            ("pages_in_doubt_freed", t.pages_in_doubt_freed),
            ("pages_waiting", self.core.pages_waiting() as u64),
            (
                "replies_waiting_for_store",
                self.durable.as_ref().map_or(0, |d| d.held.len() as u64),
            ),
        ] {
            m.set(name, v as i64);
        }
        for (name, v) in [
            ("hits", t.hits),
            ("misses", t.misses),
            ("evictions", t.removed),
            ("chains_cut", t.chains_cut),
            ("fair_share_returns", t.fair_share_returns),
            (
                "store_commits",
                self.durable
                    .as_ref()
                    .map_or(0, |d| d.writer.commits.load(Ordering::Relaxed)),
            ),
        ] {
            m.set_total(name, v);
        }
    }

    /// SIGTERM: every request read so far is answered (those waiting for the store
    /// once it flushed), then the process exits. With a durable directory every
    /// region stays with maru-server at the RM (within its grace period) so that the
    /// next start keeps every key; without one, kept regions are given back first.
    fn drain(&mut self, now_ms: u64) {
        log::info!("signal received; answering what was asked and stopping");
        self.deliver(now_ms);
        if self.durable.is_some() {
            self.flush(now_ms);
            let synced = self
                .durable
                .as_ref()
                .is_some_and(|d| d.writer.sync(Duration::from_secs(10)));
            if !synced {
                log::error!("the store did not flush within 10 s; what it did not write is lost");
            }
            self.release_durable();
            if let Some(d) = &mut self.durable {
                // Durable or not, nothing more will be: answer what was asked.
                for (_, conn, frame) in d.held.drain(..) {
                    self.replies.push((conn, frame));
                }
            }
        } else {
            self.give_back_before_stop(now_ms);
        }
        self.stopping = Stopping::Drained;
    }

    /// Without a durable directory: give every kept region back (released at its
    /// agent, then freed at the RM), waiting at most 10 s for the agents and the RM.
    fn give_back_before_stop(&mut self, now_ms: u64) {
        // Nobody else is served now: agent and RM calls may wait for their answers.
        self.agents.set_wait(Duration::from_secs(6));
        self.rm.set_wait(Duration::from_secs(6));
        let n = self.core.give_back_kept(now_ms);
        let start = std::time::Instant::now();
        let mut now = now_ms;
        while self.core.regions_going_back() > 0 && start.elapsed() < Duration::from_secs(10) {
            self.core.tick(now, &mut self.rm, &mut self.agents);
            if self.core.regions_going_back() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            now += 100;
        }
        let left = self.core.regions_going_back();
        if left > 0 {
            log::warn!("stopping with {left} region(s) not yet given back; the RM frees them after its grace period");
        } else if n > 0 {
            log::info!("gave {n} kept region(s) back before stopping");
        }
    }

    fn exit(&mut self) -> ! {
        if let Some(d) = &mut self.durable {
            d.writer.close();
        }
        log::info!("maru-server stopped");
        std::process::exit(0)
    }
}

impl Service for MetaService {
    fn service_name(&self) -> &'static str {
        SERVICE
    }

    fn welcome_info(&self) -> serde_json::Value {
        serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_s": self.started.elapsed().as_secs(),
        })
    }

    fn on_open(
        &mut self,
        conn: ConnId,
        client_id: &str,
        key_name: Option<&str>,
        resume: Option<&str>,
        _now_ms: u64,
    ) {
        let tenant = key_name.unwrap_or(DEFAULT_TENANT);
        self.binding.open(conn, client_id, tenant, resume);
    }

    fn on_request(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        self.serve(conn, client_id, body, now_ms)
    }

    fn take_replies(&mut self) -> Vec<(ConnId, Vec<u8>)> {
        self.release_durable();
        std::mem::take(&mut self.replies)
    }

    fn on_close(&mut self, conn: ConnId, _client_id: &str, now_ms: u64) {
        for t in self.tickets_of.remove(&conn).unwrap_or_default() {
            self.pending.remove(&t);
            self.core.cancel(t);
        }
        if let Some(owner) = self.binding.close(conn) {
            self.core.client_closed(&owner, now_ms);
        }
    }

    fn on_tick(&mut self, now_ms: u64) {
        self.last_now_ms = now_ms;
        match self.stopping {
            Stopping::Drained => self.exit(),
            Stopping::No if self.stop.load(Ordering::SeqCst) => return self.drain(now_ms),
            Stopping::No => {}
        }
        if let Some(f) = &mut self.tenants_file {
            if let Some(r) = f.reload_if_changed(now_ms) {
                // What a removed or changed key opened ends with it (the loop closes
                // its connections after this tick).
                let mut ended = 0;
                for tenant in &r.rekeyed {
                    ended += self.core.end_tenant_sessions(tenant, now_ms);
                    let forgot = self.binding.forget_tenant(tenant);
                    if let Some(d) = &mut self.durable {
                        d.secrets.extend(forgot);
                    }
                }
                ended += self.core.set_tenants(r.tenants, now_ms);
                log::info!(
                    "tenants of {} in force: {:?}; keys removed or changed: {:?}; {ended} \
                     session(s) ended",
                    f.path().display(),
                    self.core.tenants().names().collect::<Vec<_>>(),
                    r.rekeyed
                );
            }
        }
        if self.core.next_deadline().is_some_and(|d| d <= now_ms) {
            self.core.tick(now_ms, &mut self.rm, &mut self.agents);
        }
        self.deliver(now_ms);
        let core = &self.core;
        let pruned = self.binding.prune(now_ms, |p| core.has_session_of(p));
        if let Some(d) = &mut self.durable {
            d.secrets.extend(pruned);
            // Reads (use stamps) and what timers changed; replies wait for nothing here.
            self.flush(now_ms);
        }
        self.refresh.touch();
        self.refresh_gauges(now_ms);
    }

    fn next_deadline(&self) -> Option<u64> {
        if self.stopping == Stopping::Drained || self.stop.load(Ordering::SeqCst) {
            return Some(0);
        }
        let gauges = self.metrics.as_ref().and_then(|_| self.refresh.deadline());
        // An allocation answered (the loop was woken for it), or answers of the core
        // to hand over: at once.
        let answered = (self.rm.alloc_answered() || self.core.has_answers()).then_some(0);
        let tenants = self.tenants_file.as_ref().map(TenantsFile::next_check_ms);
        let flush = self.durable.as_ref().map(|d| match d.lazy_since_ms {
            Some(at) => d.next_flush_ms.min(at.saturating_add(LAZY_COMMIT_MS)),
            None => d.next_flush_ms,
        });
        [self.core.next_deadline(), gauges, answered, tenants, flush]
            .into_iter()
            .flatten()
            .min()
    }

    /// The loop stopped on a signal it was given itself (maru-server watches its
    /// signals with [`watch_signals`] instead, to drain first).
    fn on_shutdown(&mut self, now_ms: u64) {
        if self.durable.is_some() {
            self.flush(now_ms);
            if let Some(d) = &mut self.durable {
                d.writer.sync(Duration::from_secs(10));
                d.writer.close();
            }
        } else {
            self.give_back_before_stop(now_ms);
        }
    }
}

/// Watches SIGTERM and SIGINT on a thread of its own: the first sets `stop` and wakes
/// the loop, which answers what it was asked, flushes the durable directory and exits
/// (see `MetaService::drain`).
pub fn watch_signals(pipe: maru::net::SignalPipe, stop: Arc<AtomicBool>, waker: Replier) {
    let spawned = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let mut fds = [libc::pollfd {
                fd: pipe.fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: one valid pollfd for the pipe this thread owns.
            unsafe { libc::poll(fds.as_mut_ptr(), 1, 1000) };
            if pipe.drain() {
                stop.store(true, Ordering::SeqCst);
                waker.wake();
            }
        });
    if let Err(e) = spawned {
        log::error!("cannot start the signal thread: {e}");
    }
}

/// How often maru-server checks its agents (reachable, key proof) after start.
pub const AGENT_CHECK_EVERY: Duration = Duration::from_secs(30);

/// Checks every agent at once and then every `every`, from a thread of its own: that
/// it answers and that the agent key proves (a wrong `--remote-cxl-agent-key-file`
/// would otherwise show only when the region keeper calls it). Logs each agent that
/// fails, naming why, and each one that comes back; says nothing while nothing changes.
pub fn watch_agents(agents: Vec<String>, opts: ClientOptions, every: Duration) {
    if agents.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("agent-check".into())
        .spawn(move || {
            let mut failing: HashMap<String, bool> = HashMap::new();
            loop {
                for a in &agents {
                    let r = maru::net::Client::connect(a, &opts);
                    let was = failing.get(a).copied();
                    match r {
                        Ok(c) if c.welcome().info.get("boot_id").is_some() => {
                            if was != Some(false) {
                                log::info!("agent {a}: reachable, agent key proved");
                            }
                            failing.insert(a.clone(), false);
                        }
                        Ok(_) => {
                            if was != Some(true) {
                                log::error!(
                                    "agent {a}: answers without a boot id (not a maru-remote-cxl-agent?); \
                                     its regions cannot be kept"
                                );
                            }
                            failing.insert(a.clone(), true);
                        }
                        Err(e) => {
                            if was != Some(true) {
                                let why = match &e {
                                    maru::net::ClientError::Auth { .. } => {
                                        " (the agent key file, --remote-cxl-agent-key-file, is not this agent's --key-file?)"
                                    }
                                    _ => "",
                                };
                                log::error!(
                                    "agent {a}: check failed: {}{why}; checked again every {} s",
                                    maru::net::clip(&e.to_string()),
                                    every.as_secs()
                                );
                            }
                            failing.insert(a.clone(), true);
                        }
                    }
                }
                std::thread::sleep(every);
            }
        });
    if let Err(e) = spawned {
        log::warn!("cannot start the agent check thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_secret_resumes_only_under_the_tenant_that_opened_it() {
        let mut b = SessionBinding::default();
        b.open(1, "engine", "victim", None);
        let (secret, _) = b.new_secret(1).unwrap();
        let owner = b.bound(1).unwrap().owner.clone();
        // Another connection of the same tenant with the secret acts as the owner.
        b.open(2, "engine", "victim", Some(&secret));
        assert_eq!(b.bound(2).unwrap().owner, owner);
        // A key holder of another tenant who learned the secret does not.
        b.open(3, "engine", "attacker", Some(&secret));
        let thief = b.bound(3).unwrap();
        assert_ne!(thief.owner, owner);
        assert_eq!(thief.tenant, "attacker");
        // Nor does a declared client id by itself.
        b.open(4, "engine", "victim", None);
        assert_ne!(b.bound(4).unwrap().owner, owner);
    }
}
