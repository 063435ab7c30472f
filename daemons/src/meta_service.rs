//! maru-server on the event loop: each request through the metadata core, its reply
//! sent once what it changed is durable, the core's ports wired to the RM
//! ([`MetaRm`], the owner of every region it hands out) and to the pool's agents
//! ([`MetaAgents`], for the region keeper only; the data path never passes here).

use crate::meta_agents::MetaAgents;
use crate::meta_rm::MetaRm;
use crate::meta_store::{SecretOp, StoreWriter};
use crate::metrics::{Metrics, Refresh};
use crate::request::{self, Received};
use crate::session_binding::{Bound, SessionBinding};
use crate::tenants_file::TenantsFile;
use maru::meta::{Action, Caller, MetaCore, ReplyTiming, Ticket, DEFAULT_TENANT};
use maru::net::{ConnId, Opened, Replier, Service};
use maru::wire::meta::{decode_request, MetaReply, SERVICE};
use maru::wire::{self, WireError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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

/// maru-server's operations, the labels of `maru_server_request_served_seconds`.
const META_OPS: &[&str] = &[
    "handshake",
    "open_session",
    "expand",
    "alloc",
    "free_pages",
    "publish",
    "exists",
    "acquire",
    "release_leases",
    "victims",
    "remove",
    "pin",
    "unpin",
    "return_region",
    "heartbeat",
    "close",
    "stats",
    "usage",
];

/// A request answered later: it waits in the core for a region from the RM.
struct Pending {
    conn: ConnId,
    /// The request (its reply carries its id).
    req: Received,
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
    /// alloc from the reserve, a removal of keys published in the same batch): (job,
    /// when the first of them was answered), oldest first.
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
        req: &Received,
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
        // Named only in the log line of a failure: no allocation per reply.
        let who = match &result {
            Err(_) => format!("connection {conn}"),
            Ok(_) => String::new(),
        };
        let frame = req.reply(result, &who, log::Level::Debug, self.metrics.as_deref());
        if self.metrics.is_some() {
            self.refresh.touch();
            self.refresh_gauges(now_ms);
        }
        frame
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
        let (req, body) =
            match request::decode_with(body, client_id, self.metrics.as_deref(), decode_request) {
                Ok(r) => r,
                Err(reply) => return reply,
            };
        if self.stop.load(Ordering::SeqCst) {
            let e = WireError::new(
                wire::ErrorCode::Internal,
                "maru-server is stopping (SIGTERM): retry, it answers again once restarted",
            );
            return wire::reply_frame::<()>(req.id, Err(e));
        }
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        // A commit the loop was not woken for may have ended since its last look.
        self.catch_up_durable();
        // Every connection is bound at its handshake; one that is not gets no tenant
        // (no namespace opens for it), never the default tenant's rights.
        let unbound;
        let bound = match self.binding.bound(conn) {
            Some(b) => b,
            None => {
                unbound = Bound {
                    owner: format!("{client_id}#{conn}"),
                    tenant: String::new(),
                };
                &unbound
            }
        };
        let caller = Caller {
            owner: &bound.owner,
            tenant: &bound.tenant,
        };
        let mark = self.core.change_mark();
        let answer = self
            .core
            .handle_request(&caller, ticket, body, now_ms, &mut self.rm);
        self.run_actions(now_ms);
        match answer {
            Some(r) => {
                let frame = self.reply(conn, &req, r, now_ms);
                let secrets = self.durable.as_ref().is_some_and(|d| !d.secrets.is_empty());
                let timing = self.core.reply_timing();
                let changed =
                    self.core.change_mark() != mark || secrets || timing == ReplyTiming::AfterAll;
                let early = timing == ReplyTiming::Early && !secrets;
                self.send_after(conn, frame, changed, early, now_ms)
            }
            None => {
                self.pending.insert(ticket, Pending { conn, req });
                self.tickets_of.entry(conn).or_default().push(ticket);
                Vec::new()
            }
        }
    }

    /// Carries out the core's actions: allocations and checks go to the RM off the loop.
    fn run_actions(&mut self, now_ms: u64) {
        while let Some(action) = self.core.next_action() {
            match action {
                Action::Alloc { alloc, size } => {
                    if let Err(e) = self.rm.start_alloc(alloc, size) {
                        self.core.alloc_done(alloc, Err(e), now_ms, &mut self.rm);
                    }
                }
                Action::CheckRm { check } => {
                    if let Err(e) = self.rm.start_check(check) {
                        self.core.rm_regions(check, Err(e), now_ms);
                    }
                }
            }
        }
    }

    /// Feeds the RM's answers to the core and turns the core's late answers into
    /// replies (once what they changed is durable).
    fn deliver(&mut self, now_ms: u64) {
        for (alloc, answer) in self.rm.take_allocs() {
            self.core.alloc_done(alloc, answer, now_ms, &mut self.rm);
        }
        for (check, held) in self.rm.take_checks() {
            self.core.rm_regions(check, held, now_ms);
        }
        self.run_actions(now_ms);
        for (ticket, result) in self.core.take_answers() {
            let Some(p) = self.pending.remove(&ticket) else {
                continue;
            };
            if let Some(t) = self.tickets_of.get_mut(&p.conn) {
                t.retain(|x| *x != ticket);
            }
            let frame = self.reply(p.conn, &p.req, result, now_ms);
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

    fn on_open(&mut self, o: Opened<'_>) {
        let tenant = o.key_name.unwrap_or(DEFAULT_TENANT);
        self.binding.open(o.conn, o.client_id, tenant, o.resume);
    }

    fn on_request(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        self.serve(conn, client_id, body, now_ms)
    }

    fn request_label(&self, body: &[u8]) -> Option<&'static str> {
        self.metrics.as_ref()?;
        Some(crate::metrics::op_label(body, META_OPS))
    }

    fn on_served(&mut self, label: &'static str, seconds: f64) {
        if let Some(m) = &self.metrics {
            m.served(label, seconds);
        }
    }

    fn loop_timed(&self) -> bool {
        self.metrics.is_some()
    }

    fn on_loop_busy(&mut self, wall: f64, cpu: f64) {
        if let Some(m) = &self.metrics {
            m.loop_busy(wall, cpu);
        }
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
