//! Fake ports and a test world for the metadata core: an RM with a fixed room and
//! agents that answer, fail, refuse or stay silent on demand. Both write one shared
//! log, so tests check the order of releases and frees.

use super::ports::{AgentPort, PoolSizes, PortError, RmPort};
use super::{Action, Caller, MetaConfig, MetaCore, Ticket, DEFAULT_TENANT};
use crate::wire::meta::{
    Backend, HeartbeatReply, HeldLease, LeaseGrant, MetaReply, MetaRequest, PageGrant, PageRef,
    PublishEntry, RegionGrant, RemoveResult, ReturnReply, SkipCounts,
};
use crate::wire::rm::{AllocReply, Handle, PoolInfo};
use crate::wire::WireError;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

pub const PAGE: u64 = 1 << 20;
pub const REGION: u64 = 4 * PAGE;
pub const A1: &str = "10.0.0.1:9860";
pub const A2: &str = "10.0.0.2:9860";
pub const BOOT: &str = "boot-1";
pub const W1: &str = "worker-1:100";
pub const W2: &str = "worker-2:200";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Alloc(u64),
    Free(u64),
    Map(String, u64),
    Release(String, u64),
}

pub type Log = Rc<RefCell<Vec<Call>>>;

pub struct FakeRm {
    pub log: Log,
    pub largest: u64,
    /// Bytes still free.
    pub room: u64,
    pub allocated: BTreeMap<u64, Handle>,
    /// Every call is unreachable.
    pub down: bool,
    /// FREE answers with a storage error and does nothing.
    pub fail_free: bool,
    next_id: u64,
}

impl FakeRm {
    /// Ids of the regions the RM holds for the server ([`Action::CheckRm`]).
    pub fn owned_regions(&self) -> Result<Vec<u64>, PortError> {
        if self.down {
            return Err(PortError::Unreachable("connection refused".into()));
        }
        Ok(self.allocated.keys().copied().collect())
    }

    pub fn new(log: Log, room: u64) -> FakeRm {
        FakeRm {
            log,
            largest: room,
            room,
            allocated: BTreeMap::new(),
            down: false,
            fail_free: false,
            next_id: 0,
        }
    }
}

impl FakeRm {
    /// ALLOC, as the daemon carries out the core's `Action::Alloc`.
    pub fn alloc(&mut self, size: u64) -> Result<AllocReply, PortError> {
        if self.down {
            return Err(PortError::Unreachable("connection refused".into()));
        }
        self.log.borrow_mut().push(Call::Alloc(size));
        if size > self.room {
            return Err(PortError::Refused("no space".into()));
        }
        self.next_id += 1;
        let id = self.next_id;
        let handle = crate::rm::fake_handle(id, size);
        self.room -= size;
        self.allocated.insert(id, handle.clone());
        Ok(AllocReply {
            handle,
            requested: size,
            pool: PoolInfo {
                pool_id: 0,
                path: "/dev/dax0.0".into(),
                uuid: "00000000-0000-4000-8000-000000000000".into(),
                kind: "devdax".into(),
                total: self.largest,
                free: self.room,
                align: PAGE,
                draining: 0,
            },
        })
    }
}

impl RmPort for FakeRm {
    fn free(&mut self, h: &Handle) -> Result<(), PortError> {
        if self.down {
            return Err(PortError::Unreachable("connection refused".into()));
        }
        if self.fail_free {
            return Err(PortError::Failed("storage: cannot save".into()));
        }
        self.log.borrow_mut().push(Call::Free(h.region_id));
        match self.allocated.remove(&h.region_id) {
            Some(a) if a == *h => {
                self.room += a.length;
                Ok(())
            }
            Some(a) => {
                self.allocated.insert(a.region_id, a);
                Err(PortError::Refused("bad token".into()))
            }
            None => Err(PortError::Refused("unknown region".into())),
        }
    }

    fn pool_sizes(&mut self) -> Result<PoolSizes, PortError> {
        if self.down {
            return Err(PortError::Unreachable("connection refused".into()));
        }
        Ok(PoolSizes {
            largest: self.largest,
            total: self.largest,
        })
    }
}

#[derive(Default)]
pub struct FakeAgents {
    pub log: Log,
    /// Boot id per agent; `BOOT` if not set.
    pub boot: BTreeMap<String, String>,
    /// Agents that do not answer.
    pub down: BTreeSet<String>,
    /// Agents that answer every call with an error that is not a refusal.
    pub failing: BTreeSet<String>,
    /// Regions whose handle the agents refuse.
    pub refuse: BTreeSet<u64>,
    pub mapped: BTreeSet<(String, u64)>,
    pub released: BTreeSet<u64>,
}

impl AgentPort for FakeAgents {
    fn map(&mut self, agent: &str, h: &Handle) -> Result<String, PortError> {
        if self.down.contains(agent) {
            return Err(PortError::Unreachable(format!("{agent}: timed out")));
        }
        self.log
            .borrow_mut()
            .push(Call::Map(agent.to_string(), h.region_id));
        if self.failing.contains(agent) {
            return Err(PortError::Failed("internal".into()));
        }
        if self.refuse.contains(&h.region_id) || self.released.contains(&h.region_id) {
            return Err(PortError::Refused("bad handle".into()));
        }
        self.mapped.insert((agent.to_string(), h.region_id));
        Ok(self
            .boot
            .get(agent)
            .cloned()
            .unwrap_or_else(|| BOOT.to_string()))
    }

    fn release(&mut self, agent: &str, h: &Handle) -> Result<(), PortError> {
        if self.down.contains(agent) {
            return Err(PortError::Unreachable(format!("{agent}: timed out")));
        }
        if self.failing.contains(agent) {
            return Err(PortError::Failed("deregistration failed".into()));
        }
        self.log
            .borrow_mut()
            .push(Call::Release(agent.to_string(), h.region_id));
        self.released.insert(h.region_id);
        self.mapped.retain(|(_, r)| *r != h.region_id);
        Ok(())
    }
}

/// A publish entry of 1000 bytes of `key` at `offset` of the region.
pub fn entry(key: &str, region_id: u64, offset: u64) -> PublishEntry {
    PublishEntry {
        key: key.into(),
        region_id,
        offset,
        length: 1000,
        prev: None,
    }
}

pub fn strings(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}

pub fn config(agents: &[&str]) -> MetaConfig {
    MetaConfig {
        region_size: REGION,
        chunk_size: PAGE,
        agents: agents.iter().map(|a| a.to_string()).collect(),
        rm_address: "10.0.0.1:9850".into(),
        session_timeout_ms: 10_000,
        lease_timeout_ms: 5_000,
        keeper_silence_ms: 30_000,
        keeper_check_ms: 5_000,
        rm_check_ms: 1_000,
        retry_ms: 1_000,
        max_sessions: 8,
        instance: "fake-instance".into(),
        victim_order: Default::default(),
        // Long: tests of other rules open sessions that hold regions without storing
        // (readers); the unused-region rule has tests of its own.
        unused_region_ms: 3_600_000,
        park_max_ms: 8_000,
        max_parked: 64,
    }
}

/// The core with its fake ports and a clock.
pub struct World {
    pub core: MetaCore,
    pub rm: FakeRm,
    pub agents: FakeAgents,
    pub log: Log,
    pub now: u64,
    /// Sessions that heartbeat at every step of the clock (readers in long tests).
    pub alive: Vec<(String, u64)>,
    /// The tenant each client's key proves (`default` when not named here).
    pub tenant_of: BTreeMap<String, String>,
    /// Answers of requests that waited for the RM, by ticket.
    pub answers: BTreeMap<Ticket, Result<MetaReply, WireError>>,
    next_ticket: Ticket,
    /// Allocations a tick asked for, left to `run_actions`.
    held_allocs: std::collections::VecDeque<Action>,
}

impl World {
    pub fn with(cfg: MetaConfig, room: u64) -> World {
        let log: Log = Rc::default();
        World {
            core: MetaCore::new(cfg).unwrap(),
            rm: FakeRm::new(log.clone(), room),
            agents: FakeAgents {
                log: log.clone(),
                ..Default::default()
            },
            log,
            now: 1_000,
            alive: Vec::new(),
            tenant_of: BTreeMap::new(),
            answers: BTreeMap::new(),
            next_ticket: 0,
            held_allocs: Default::default(),
        }
    }

    /// `client` proves the key of `tenant` from now on.
    pub fn as_tenant(&mut self, client: &str, tenant: &str) {
        self.tenant_of.insert(client.into(), tenant.into());
    }

    /// Each client a tenant of its own (`t0`, `t1`, ...), writing namespace `ns-tK`,
    /// where [`open`](Self::open) opens its sessions; the default tenant writes the
    /// rest.
    pub fn split_tenants(&mut self, clients: &[&str]) {
        let mut specs = vec![super::TenantSpec::unclaimed(Default::default())];
        for (i, c) in clients.iter().enumerate() {
            let t = format!("t{i}");
            specs.push(super::TenantSpec::writer(&t, &[&format!("ns-{t}")]).unwrap());
            self.as_tenant(c, &t);
        }
        let tenants = super::Tenants::new(specs).unwrap();
        self.core.set_tenants(tenants, self.now);
    }

    /// The namespace `open` uses for `client`: its tenant's (see `split_tenants`).
    pub fn ns_of(&self, client: &str) -> String {
        match self.tenant_of.get(client) {
            Some(t) if t.starts_with('t') => format!("ns-{t}"),
            _ => "ns".into(),
        }
    }

    fn tenant(&self, client: &str) -> String {
        self.tenant_of
            .get(client)
            .cloned()
            .unwrap_or_else(|| DEFAULT_TENANT.into())
    }

    /// Two agents, room for 16 regions.
    pub fn remote() -> World {
        World::with(config(&[A1, A2]), 16 * REGION)
    }

    /// No agents, room for 16 regions.
    pub fn cxl() -> World {
        World::with(config(&[]), 16 * REGION)
    }

    /// A world on agent [`A1`] with room for 16 regions, its config changed by `tune`.
    pub fn tuned(tune: impl FnOnce(&mut MetaConfig)) -> World {
        let mut cfg = config(&[A1]);
        tune(&mut cfg);
        World::with(cfg, 16 * REGION)
    }

    /// A remote world with a session of [`W1`]: the world, the session, its region and
    /// the region's agent.
    pub fn remote_session() -> (World, u64, u64, String) {
        let mut w = World::remote();
        let (a, g) = w.open(W1);
        let agent = g.agent.expect("a remote_cxl region has an agent");
        (w, a, g.handle.region_id, agent)
    }

    /// This world with a session of [`W1`] and one of [`W2`] open, each with its first
    /// region: the usual start of a test with a writer and a reader.
    pub fn with_two_sessions(mut self) -> (World, (u64, RegionGrant), (u64, RegionGrant)) {
        let one = self.open(W1);
        let two = self.open(W2);
        (self, one, two)
    }

    /// RETURN_REGION of `region_id` by `session`: the reply, or the error.
    pub fn return_region(
        &mut self,
        client: &str,
        session: u64,
        region_id: u64,
        released: bool,
    ) -> Result<ReturnReply, WireError> {
        let req = MetaRequest::ReturnRegion {
            session,
            region_id,
            released,
        };
        match self.req(client, req)? {
            MetaReply::Returned(r) => Ok(r),
            other => panic!("return_region: {other:?}"),
        }
    }

    /// One request, and (when it waits for a region) the RM's answer at once.
    pub fn req(&mut self, client: &str, req: MetaRequest) -> Result<MetaReply, WireError> {
        match self.send(client, req) {
            Ok(r) => r,
            Err(t) => {
                self.run_actions();
                // A request the RM refused may wait for room on its way (a region
                // going back): the clock moves in 10 ms steps, ticking, until it is
                // answered (at most `ROOM_WAIT_MS`).
                let mut waited = 0;
                while !self.answers.contains_key(&t) && waited <= super::alloc_ops::ROOM_WAIT_MS {
                    self.now += 10;
                    waited += 10;
                    self.tick();
                    self.run_actions();
                }
                self.answers
                    .remove(&t)
                    .expect("an answer once the RM answered")
            }
        }
    }

    /// One request: its answer, or the ticket of a request that waits for the RM
    /// (whose allocation is left to [`run_actions`](Self::run_actions)).
    pub fn send(
        &mut self,
        client: &str,
        req: MetaRequest,
    ) -> Result<Result<MetaReply, WireError>, Ticket> {
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let tenant = self.tenant(client);
        let caller = Caller {
            owner: client,
            tenant: &tenant,
        };
        let r = self
            .core
            .handle(&caller, ticket, req, self.now, &mut self.rm);
        self.answers.extend(self.core.take_answers());
        r.ok_or(ticket)
    }

    /// Carries out the core's actions as the daemon does (the fake RM answers at
    /// once) and collects the answers.
    pub fn run_actions(&mut self) {
        loop {
            let next = match self.held_allocs.pop_front() {
                Some(a) => Some(a),
                None => self.core.next_action(),
            };
            match next {
                Some(Action::Alloc { alloc, size }) => {
                    let r = self.rm.alloc(size);
                    self.core.alloc_done(alloc, r, self.now, &mut self.rm);
                }
                Some(Action::CheckRm { check }) => self.answer_rm_check(check),
                None => break,
            }
        }
        self.answers.extend(self.core.take_answers());
    }

    fn answer_rm_check(&mut self, check: u64) {
        let held = self.rm.owned_regions();
        self.core.rm_regions(check, held, self.now);
    }

    /// Runs the timers; the RM answers a check of its list at once (allocations are
    /// left to [`run_actions`](Self::run_actions)).
    pub fn tick(&mut self) {
        self.core.tick(self.now, &mut self.rm, &mut self.agents);
        while let Some(a) = self.core.next_action() {
            match a {
                Action::CheckRm { check } => self.answer_rm_check(check),
                alloc @ Action::Alloc { .. } => self.held_allocs.push_back(alloc),
            }
        }
        self.answers.extend(self.core.take_answers());
    }

    /// Moves the clock on, heartbeats the sessions kept alive, runs the timers.
    pub fn advance(&mut self, ms: u64) {
        self.now += ms;
        for (client, session) in self.alive.clone() {
            self.heartbeat(&client, session, &[]);
        }
        self.tick();
    }

    /// Moves the clock in steps of `step` ms, ticking at each.
    pub fn run_for(&mut self, ms: u64, step: u64) {
        let end = self.now + ms;
        while self.now < end {
            self.advance(step.min(end - self.now));
        }
    }

    pub fn calls(&self) -> Vec<Call> {
        self.log.borrow().clone()
    }

    pub fn clear_log(&mut self) {
        self.log.borrow_mut().clear();
    }

    pub fn open_in(
        &mut self,
        client: &str,
        namespace: &str,
        backend: Backend,
    ) -> (u64, RegionGrant) {
        match self.req(
            client,
            MetaRequest::OpenSession {
                engine_id: format!("engine-{client}"),
                namespace: namespace.into(),
                layout: "llama-8b/bf16/256".into(),
                backend,
                first_region: true,
            },
        ) {
            Ok(MetaReply::Session(s)) => (s.session, s.region.expect("a first region")),
            other => panic!("open_session: {other:?}"),
        }
    }

    /// Opens a session that takes no region until it expands.
    pub fn open_without_region(&mut self, client: &str) -> u64 {
        let namespace = self.ns_of(client);
        let backend = self.backend();
        match self.req(
            client,
            MetaRequest::OpenSession {
                engine_id: format!("engine-{client}"),
                namespace,
                layout: "llama-8b/bf16/256".into(),
                backend,
                first_region: false,
            },
        ) {
            Ok(MetaReply::Session(s)) => {
                assert!(s.region.is_none());
                s.session
            }
            other => panic!("open_session: {other:?}"),
        }
    }

    /// The heartbeat's whole reply.
    pub fn heartbeat_reply(&mut self, client: &str, session: u64) -> HeartbeatReply {
        self.beat(client, session, Beat::default())
            .expect("heartbeat")
    }

    /// The reply to a heartbeat of `client`'s session that says `beat`; panics on a
    /// reply of another kind.
    pub fn beat(
        &mut self,
        client: &str,
        session: u64,
        beat: Beat,
    ) -> Result<HeartbeatReply, WireError> {
        let req = MetaRequest::Heartbeat {
            session,
            boot_ids: beat.boot_ids,
            regions: beat.regions,
            leases: beat.leases,
            skipped: beat.skipped,
            held_pages: beat.held_pages,
        };
        match self.req(client, req)? {
            MetaReply::Heartbeat(h) => Ok(h),
            other => panic!("heartbeat: {other:?}"),
        }
    }

    /// The backend of the world: remote_cxl with agents, else cxl.
    pub fn backend(&self) -> Backend {
        if self.core.config().agents.is_empty() {
            Backend::Cxl
        } else {
            Backend::RemoteCxl
        }
    }

    pub fn open(&mut self, client: &str) -> (u64, RegionGrant) {
        let backend = self.backend();
        let ns = self.ns_of(client);
        self.open_in(client, &ns, backend)
    }

    pub fn expand(&mut self, client: &str, session: u64) -> Result<RegionGrant, WireError> {
        match self.req(client, MetaRequest::Expand { session })? {
            MetaReply::Region(g) => Ok(g),
            other => panic!("expand: {other:?}"),
        }
    }

    pub fn alloc(&mut self, client: &str, session: u64, count: u32) -> (Vec<PageGrant>, u32) {
        match self.req(
            client,
            MetaRequest::Alloc {
                session,
                count,
                route_key: None,
            },
        ) {
            Ok(MetaReply::Pages(p)) => (p.pages, p.missing),
            other => panic!("alloc: {other:?}"),
        }
    }

    pub fn publish_at(
        &mut self,
        client: &str,
        session: u64,
        entries: Vec<PublishEntry>,
    ) -> Result<Vec<bool>, WireError> {
        match self.req(client, MetaRequest::Publish { session, entries })? {
            MetaReply::Published { is_new, .. } => Ok(is_new),
            other => panic!("publish: {other:?}"),
        }
    }

    /// Allocates a page per key and publishes each key in it (after its WRITE).
    pub fn store(&mut self, client: &str, session: u64, keys: &[&str]) -> Vec<PageGrant> {
        self.store_entries(client, session, keys, |pages| {
            keys.iter()
                .zip(pages)
                .map(|(k, p)| p.entry(k.to_string(), 1000))
                .collect()
        })
    }

    /// Like [`World::store`], each key published with the one before it as its
    /// predecessor in a prefix chain (the first with `prev`).
    pub fn store_chain(
        &mut self,
        client: &str,
        session: u64,
        prev: Option<&str>,
        keys: &[&str],
    ) -> Vec<PageGrant> {
        self.store_entries(client, session, keys, |pages| {
            chain_entries(prev, keys, pages)
        })
    }

    /// Allocates a page per key and publishes the `entries` made for those pages, each
    /// one new.
    fn store_entries(
        &mut self,
        client: &str,
        session: u64,
        keys: &[&str],
        entries: impl FnOnce(&[PageGrant]) -> Vec<PublishEntry>,
    ) -> Vec<PageGrant> {
        let (pages, missing) = self.alloc(client, session, keys.len() as u32);
        assert_eq!(missing, 0, "room for {} keys", keys.len());
        let is_new = self.publish_at(client, session, entries(&pages)).unwrap();
        assert!(is_new.iter().all(|n| *n), "{keys:?} were new");
        pages
    }

    /// PIN (`on`) or UNPIN of `keys` by `session`: each key's result, or the error.
    pub fn try_pin(
        &mut self,
        client: &str,
        session: u64,
        keys: &[&str],
        on: bool,
    ) -> Result<Vec<bool>, WireError> {
        let keys = owned(keys);
        let req = if on {
            MetaRequest::Pin { session, keys }
        } else {
            MetaRequest::Unpin { session, keys }
        };
        match self.req(client, req)? {
            MetaReply::Pinned { pinned } => Ok(pinned),
            MetaReply::Unpinned { unpinned } => Ok(unpinned),
            r => panic!("pin: {r:?}"),
        }
    }

    /// As [`World::try_pin`], which must succeed.
    pub fn pin(&mut self, client: &str, session: u64, keys: &[&str], on: bool) -> Vec<bool> {
        self.try_pin(client, session, keys, on).unwrap()
    }

    /// REMOVE of `keys` by `session`: each key's result.
    pub fn remove(&mut self, client: &str, session: u64, keys: &[&str]) -> Vec<RemoveResult> {
        let keys = owned(keys);
        match self.req(client, MetaRequest::Remove { session, keys }) {
            Ok(MetaReply::Removed { results }) => results,
            other => panic!("remove: {other:?}"),
        }
    }

    /// The names `victims` offers, in its order.
    pub fn victims(&mut self, client: &str, session: u64, max: u32) -> Vec<String> {
        match self.req(client, MetaRequest::Victims { session, max }) {
            Ok(MetaReply::Victims { victims }) => victims.into_iter().map(|v| v.key).collect(),
            other => panic!("victims: {other:?}"),
        }
    }

    pub fn exists(&mut self, client: &str, session: u64, keys: &[&str]) -> Vec<bool> {
        let keys = owned(keys);
        match self.req(client, MetaRequest::Exists { session, keys }) {
            Ok(MetaReply::Exists { found }) => found,
            other => panic!("exists: {other:?}"),
        }
    }

    pub fn try_acquire(
        &mut self,
        client: &str,
        session: u64,
        keys: &[&str],
    ) -> Result<Vec<Option<LeaseGrant>>, WireError> {
        let keys = owned(keys);
        match self.req(client, MetaRequest::Acquire { session, keys })? {
            MetaReply::Leases { leases } => Ok(leases),
            other => panic!("acquire: {other:?}"),
        }
    }

    pub fn acquire(
        &mut self,
        client: &str,
        session: u64,
        keys: &[&str],
    ) -> Vec<Option<LeaseGrant>> {
        self.try_acquire(client, session, keys).unwrap()
    }

    pub fn release_leases(
        &mut self,
        client: &str,
        session: u64,
        lease_ids: Vec<u64>,
    ) -> Result<Vec<bool>, WireError> {
        match self.req(client, MetaRequest::ReleaseLeases { session, lease_ids })? {
            MetaReply::LeasesReleased { released } => Ok(released),
            other => panic!("release_leases: {other:?}"),
        }
    }

    pub fn heartbeat(&mut self, client: &str, session: u64, boots: &[(u64, &str)]) {
        let boot_ids = boots.iter().map(|(r, b)| (*r, b.to_string())).collect();
        let beat = Beat {
            boot_ids,
            ..Beat::default()
        };
        self.beat(client, session, beat).expect("heartbeat");
    }

    pub fn close(&mut self, client: &str, session: u64, drained: bool) -> (Vec<u64>, Vec<u64>) {
        match self.req(client, MetaRequest::Close { session, drained }) {
            Ok(MetaReply::Closed(c)) => (c.kept, c.given_back),
            other => panic!("close: {other:?}"),
        }
    }

    /// Whether the RM still has the region allocated.
    pub fn at_rm(&self, region_id: u64) -> bool {
        self.rm.allocated.contains_key(&region_id)
    }

    /// Every FREE of a region with an agent came after that region's release.
    pub fn assert_released_before_freed(&self) {
        let calls = self.calls();
        for (i, c) in calls.iter().enumerate() {
            if let Call::Free(r) = c {
                let released = calls[..i]
                    .iter()
                    .any(|c| matches!(c, Call::Release(_, x) if x == r));
                assert!(released, "region {r} freed before its release: {calls:?}");
            }
        }
    }
}

/// What a heartbeat of [`World::beat`] says besides its session; what a test leaves
/// out is empty (no boot ids, regions or reports).
#[derive(Debug, Default)]
pub struct Beat {
    pub boot_ids: BTreeMap<u64, String>,
    pub regions: Vec<u64>,
    pub leases: Option<Vec<HeldLease>>,
    pub skipped: Option<SkipCounts>,
    pub held_pages: Option<Vec<PageRef>>,
}

/// `keys[i]` published at `pages[i]` (1000 bytes), each with the one before it as its
/// predecessor in a prefix chain (the first with `prev`).
pub fn chain_entries(prev: Option<&str>, keys: &[&str], pages: &[PageGrant]) -> Vec<PublishEntry> {
    let prevs = std::iter::once(prev).chain(keys.iter().map(|k| Some(*k)));
    keys.iter()
        .zip(pages)
        .zip(prevs)
        .map(|((k, p), prev)| PublishEntry {
            key: k.to_string(),
            region_id: p.region_id,
            offset: p.offset,
            length: 1000,
            prev: prev.map(str::to_string),
        })
        .collect()
}

/// `keys` as a request carries them.
fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}
