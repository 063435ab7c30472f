//! maru-server on the event loop: the metadata core with its ports wired to the RM
//! (as the owner of every region it hands out) and to the pool's agents (for the
//! region keeper only; the data path never passes through here).

use crate::metrics::{op_of, result_of, Metrics, Refresh};
use maru::meta::{AgentPort, MetaCore, PortError, RmPort};
use maru::net::{ClientOptions, ConnId, Link, LinkError, Service};
use maru::wire::agent::{AgentReply, AgentRequest};
use maru::wire::meta::{MetaReply, MetaRequest, SERVICE};
use maru::wire::rm::{AllocReply, Handle, RmReply, RmRequest};
use maru::wire::{self, Envelope, ErrorCode, WireError};
use std::collections::HashMap;
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
    Largest,
}

/// The one allocation call (a late answer is a region of the configured size, good for
/// whichever allocation asks next).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct AllocKey;

/// How long an allocation may hold the event loop. A healthy, idle RM answers within
/// it; past it the allocation goes on in the background and the request that needs
/// it waits off the loop ([`MetaService`] parks it and answers it once the region
/// came), while the loop serves everyone else.
pub const ALLOC_WAIT: Duration = Duration::from_millis(20);

/// The RM as maru-server uses it. Every call runs on a thread of its own
/// ([`OffLoop`]): allocations on `rm-alloc` (waiting on the loop at most
/// [`ALLOC_WAIT`]), the periodic and keeper calls (which regions the RM holds for this
/// server, frees, the largest pool) on `rm-link` (at most [`AGENT_WAIT`]). So a stopped
/// RM stalls the loop for one allocation's wait per call timeout at most, and sessions
/// that do not need it stay fast.
pub struct MetaRm {
    /// The start-up check's connection.
    link: Link,
    /// This server's client id at the RM (the owner of its regions).
    client_id: String,
    bg: OffLoop<RmKey, RmRequest, Result<RmReply, PortError>>,
    alloc_bg: OffLoop<AllocKey, RmRequest, Result<RmReply, PortError>>,
    alloc_wait: Duration,
    /// The last allocation got no answer in time (or waited behind another): the
    /// request is to be tried again once the allocation in flight is answered.
    alloc_deferred: bool,
    /// Allocations started: an answer about the server's regions asked before the
    /// latest one may miss its region, so it is not used.
    allocs: u64,
    largest: Option<u64>,
    wait: Duration,
    addr: String,
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
        let mut alloc_link = Link::new(addr, opts.clone());
        let mut alloc_bg = OffLoop::start("rm-alloc".into(), move |req: RmRequest| {
            alloc_link.call::<_, RmReply>(&req).map_err(port_error)
        });
        // A region that came late is the RM's for this server until used: it never
        // goes stale, so the next allocation takes it whatever its age (the region
        // size is fixed). A late failure says nothing about the next call.
        alloc_bg.fresh = |a, _age| a.is_ok();
        MetaRm {
            link: Link::new(addr, opts),
            client_id,
            bg,
            alloc_bg,
            alloc_wait: ALLOC_WAIT,
            alloc_deferred: false,
            allocs: 0,
            largest: None,
            wait: AGENT_WAIT,
            addr: addr.to_string(),
        }
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

    /// Whether an allocation is in flight at the RM with no answer yet.
    pub fn alloc_pending(&mut self) -> bool {
        self.alloc_bg.take_done();
        self.alloc_bg.in_flight.is_some()
    }

    /// Whether an allocation since the last call failed only because the RM had not
    /// answered yet (clears the flag).
    pub fn take_alloc_deferred(&mut self) -> bool {
        std::mem::take(&mut self.alloc_deferred)
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
    fn alloc(&mut self, size: u64) -> Result<AllocReply, PortError> {
        // Counted before the answer: an answer about the server's regions asked
        // before this point may miss the region this call hands out.
        self.allocs += 1;
        let req = RmRequest::Alloc {
            size,
            pool: None,
            request_id: 0,
        };
        let peer = format!("the RM at {}", self.addr);
        let answer = match self.alloc_bg.call(&peer, AllocKey, req, self.alloc_wait) {
            Ok(a) => a?,
            Err(m) => {
                self.alloc_deferred = true;
                return Err(PortError::Unreachable(m));
            }
        };
        match answer {
            RmReply::Alloc(a) => Ok(a),
            r => Err(unexpected(r)),
        }
    }

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

    fn largest_pool(&mut self) -> Result<u64, PortError> {
        match self.bg_call(RmKey::Largest, RmRequest::Pools) {
            Ok(RmReply::Pools { pools }) => {
                let v = pools.iter().map(|p| p.total).max().unwrap_or(0);
                self.largest = Some(v);
                Ok(v)
            }
            Ok(r) => Err(unexpected(r)),
            // The last answer stands while the RM is slow (pools seldom change).
            Err(e) => self.largest.ok_or(e),
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
    /// Whether an answer of this age may be handed to a later call (default: younger
    /// than [`READY_FOR`]).
    fresh: fn(&A, Duration) -> bool,
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
            fresh: |_, age| age < READY_FOR,
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
            if (self.fresh)(&a, at.elapsed()) {
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
/// (its *principal*), never to the client id a peer declares: a new connection acts
/// on an existing session only when its hello presents that session's secret.
#[derive(Default)]
pub struct SessionBinding {
    /// The principal of each open connection.
    conns: HashMap<ConnId, String>,
    /// Session secret (hex) → the principal whose sessions it opens.
    secrets: HashMap<String, String>,
    next_prune_ms: u64,
}

/// How often secrets of principals without a live session are forgotten.
const PRUNE_MS: u64 = 5_000;

impl SessionBinding {
    /// Binds a new connection: to the principal of the session secret it presents,
    /// or else to a principal of its own.
    pub fn open(&mut self, conn: ConnId, client_id: &str, resume: Option<&str>) {
        let known = resume.and_then(|r| {
            self.secrets
                .iter()
                .find(|(s, _)| maru::auth::ct_eq(s.as_bytes(), r.as_bytes()))
                .map(|(_, p)| p.clone())
        });
        if resume.is_some() && known.is_none() {
            log::info!(
                "connection {conn} of {} presented an unknown session secret",
                maru::net::clip(client_id)
            );
        }
        let principal = known.unwrap_or_else(|| format!("{client_id}#{conn}"));
        self.conns.insert(conn, principal);
    }

    pub fn principal(&self, conn: ConnId) -> Option<&str> {
        self.conns.get(&conn).map(String::as_str)
    }

    /// A new secret for a session `conn` opened.
    pub fn new_secret(&mut self, conn: ConnId) -> Option<String> {
        let principal = self.conns.get(&conn)?.clone();
        let secret = maru::auth::to_hex(&maru::auth::random_bytes(16).ok()?);
        self.secrets.insert(secret.clone(), principal);
        Some(secret)
    }

    /// A connection closed; returns its principal when no other open connection
    /// acts as it.
    pub fn close(&mut self, conn: ConnId) -> Option<String> {
        let p = self.conns.remove(&conn)?;
        (!self.conns.values().any(|q| *q == p)).then_some(p)
    }

    /// Forgets secrets whose principal has no live session (at most every few seconds).
    pub fn prune(&mut self, now_ms: u64, live: impl Fn(&str) -> bool) {
        if now_ms < self.next_prune_ms {
            return;
        }
        self.next_prune_ms = now_ms + PRUNE_MS;
        self.secrets.retain(|_, p| live(p));
    }
}

/// A request waiting for an allocation at the RM, off the loop.
struct Parked {
    conn: ConnId,
    client_id: String,
    body: Vec<u8>,
    since_ms: u64,
    started: Instant,
}

/// Requests waiting for the RM at most; more are answered "retry" at once.
const PARKED_MAX: usize = 1024;
/// How long a request waits for its allocation before it is answered "retry" (beyond
/// the RM link's connect and call timeouts, so an answer the RM gives is used).
pub const PARK_MAX_MS: u64 = 8_000;
/// How often parked requests are looked at while they wait.
const PARK_POLL_MS: u64 = 2;

/// Whether a request may need a new region from the RM.
fn may_allocate(req: &MetaRequest) -> bool {
    matches!(
        req,
        MetaRequest::Expand { .. }
            | MetaRequest::OpenSession {
                first_region: true,
                ..
            }
    )
}

pub struct MetaService {
    pub core: MetaCore,
    pub rm: MetaRm,
    pub agents: MetaAgents,
    pub binding: SessionBinding,
    /// Requests waiting for an allocation (oldest first), and replies to requests
    /// answered late, for the loop to send.
    parked: std::collections::VecDeque<Parked>,
    replies: Vec<(ConnId, Vec<u8>)>,
    last_now_ms: u64,
    /// `--metrics`: figures for Prometheus.
    metrics: Option<Arc<Metrics>>,
    refresh: Refresh,
    started: Instant,
}

impl MetaService {
    pub fn new(core: MetaCore, rm: MetaRm, agents: MetaAgents) -> MetaService {
        MetaService {
            core,
            rm,
            agents,
            binding: SessionBinding::default(),
            parked: std::collections::VecDeque::new(),
            replies: Vec::new(),
            last_now_ms: 0,
            metrics: None,
            refresh: Refresh::new(1000),
            started: Instant::now(),
        }
    }

    /// Counts requests into `m` and copies the core's figures into its gauges.
    pub fn with_metrics(mut self, m: Arc<Metrics>) -> MetaService {
        self.metrics = Some(m);
        self
    }

    /// Serves one request; `None` when it waits for an allocation at the RM (it
    /// changed nothing and is served again once the RM answered).
    fn serve(
        &mut self,
        conn: ConnId,
        client_id: &str,
        body: &[u8],
        now_ms: u64,
        started: Instant,
    ) -> Option<Vec<u8>> {
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
                return Some(wire::reply_frame::<()>(wire::request_id_of(body), Err(e)));
            }
        };
        let allocating = may_allocate(&env.body);
        if allocating && self.rm.alloc_pending() {
            return None;
        }
        let principal = self
            .binding
            .principal(conn)
            .map_or_else(|| format!("{client_id}#{conn}"), str::to_string);
        self.rm.take_alloc_deferred();
        let mut result = self.core.handle(&principal, env.body, now_ms, &mut self.rm);
        if allocating && result.is_err() && self.rm.take_alloc_deferred() {
            // Nothing changed (the region comes first): wait off the loop.
            return None;
        }
        if let Ok(MetaReply::Session(s)) = &mut result {
            s.session_secret = self.binding.new_secret(conn);
        }
        if let Err(e) = &result {
            log::debug!(
                "request {} from {}: {e}",
                env.id,
                maru::net::clip(&principal)
            );
        }
        if let Some(m) = &self.metrics {
            m.request(
                &op_of(body),
                result_of(&result),
                started.elapsed().as_secs_f64(),
            );
            self.refresh.touch();
            self.refresh_gauges(now_ms);
        }
        Some(wire::reply_frame(env.id, result))
    }

    /// Serves the parked requests whose allocation can go on now, in their order;
    /// one that waited [`PARK_MAX_MS`] is answered "retry".
    fn retry_parked(&mut self, now_ms: u64) {
        let mut left = std::collections::VecDeque::new();
        while let Some(p) = self.parked.pop_front() {
            if now_ms.saturating_sub(p.since_ms) >= PARK_MAX_MS {
                let e = WireError::new(
                    ErrorCode::Internal,
                    format!(
                        "the RM at {} did not answer an allocation within {} s: retry",
                        self.rm.addr,
                        PARK_MAX_MS / 1000
                    ),
                );
                if let Some(m) = &self.metrics {
                    m.request(
                        &op_of(&p.body),
                        e.code.as_str(),
                        p.started.elapsed().as_secs_f64(),
                    );
                }
                let id = wire::request_id_of(&p.body);
                self.replies
                    .push((p.conn, wire::reply_frame::<()>(id, Err(e))));
                continue;
            }
            if !left.is_empty() || self.rm.alloc_pending() {
                left.push_back(p);
                continue;
            }
            match self.serve(p.conn, &p.client_id, &p.body, now_ms, p.started) {
                Some(r) => self.replies.push((p.conn, r)),
                None => left.push_back(p),
            }
        }
        self.parked = left;
    }

    fn refresh_gauges(&mut self, now_ms: u64) {
        let Some(m) = &self.metrics else {
            return;
        };
        if !self.refresh.due(now_ms) {
            return;
        }
        let t = self.core.total_stats();
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
        ] {
            m.set(name, v as i64);
        }
        for (name, v) in [
            ("hits", t.hits),
            ("misses", t.misses),
            ("evictions", t.removed),
            ("chains_cut", t.chains_cut),
            ("fair_share_returns", t.fair_share_returns),
        ] {
            m.set_total(name, v);
        }
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

    fn on_open(&mut self, conn: ConnId, client_id: &str, resume: Option<&str>, _now_ms: u64) {
        self.binding.open(conn, client_id, resume);
    }

    fn on_request(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        self.last_now_ms = now_ms;
        let started = Instant::now();
        if let Some(r) = self.serve(conn, client_id, body, now_ms, started) {
            return r;
        }
        if self.parked.len() >= PARKED_MAX {
            let e = WireError::new(
                ErrorCode::Internal,
                format!(
                    "{PARKED_MAX} requests already wait for the RM at {}: retry",
                    self.rm.addr
                ),
            );
            return wire::reply_frame::<()>(wire::request_id_of(body), Err(e));
        }
        self.parked.push_back(Parked {
            conn,
            client_id: client_id.to_string(),
            body: body.to_vec(),
            since_ms: now_ms,
            started,
        });
        Vec::new()
    }

    fn take_replies(&mut self) -> Vec<(ConnId, Vec<u8>)> {
        std::mem::take(&mut self.replies)
    }

    fn on_close(&mut self, conn: ConnId, _client_id: &str, now_ms: u64) {
        self.parked.retain(|p| p.conn != conn);
        if let Some(p) = self.binding.close(conn) {
            self.core.client_closed(&p, now_ms);
        }
    }

    fn on_tick(&mut self, now_ms: u64) {
        self.last_now_ms = now_ms;
        self.retry_parked(now_ms);
        self.core.tick(now_ms, &mut self.rm, &mut self.agents);
        let core = &self.core;
        self.binding.prune(now_ms, |p| core.has_session_of(p));
        self.refresh.touch();
        self.refresh_gauges(now_ms);
    }

    fn next_deadline(&self) -> Option<u64> {
        let gauges = self.metrics.as_ref().and_then(|_| self.refresh.deadline());
        let parked = (!self.parked.is_empty()).then(|| self.last_now_ms + PARK_POLL_MS);
        [self.core.next_deadline(), gauges, parked]
            .into_iter()
            .flatten()
            .min()
    }

    /// On SIGTERM: give every kept region back (released at its agent, then freed at the
    /// RM), waiting at most 10 s for the agents and the RM.
    fn on_shutdown(&mut self, now_ms: u64) {
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
