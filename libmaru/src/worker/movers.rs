//! What moves the bytes of a pool: one-sided transfers through staging slots
//! (`remote_cxl`) or copies through this host's own mapping of the CXL memory (`cxl`).

use super::agents::{require_boot_id, welcome_identity};
use super::clock::now_ms;
use super::error::WorkerError;
use super::lifecycle::{Action, Lifecycle, Verdict};
use super::prefault::{PrefaultStats, Prefaulter};
use super::staging::{Slot, SlotPool, StagingSlots};
use super::transfer::{post, Isolation, PeerBatch, PeerOutcome, Posted};
use super::windows::{self, InFlightBudget, Windowed};
use crate::dax::{self, Mapping};
use crate::net::{ClientOptions, Link, LinkError};
use crate::transport::{Op, OpKind, PeerId, Transport, TransportError};
use crate::wire::agent::{AgentReply, AgentRequest, MapReply};
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Timeouts of an agent probe (connect, then the status call): short, because a
/// probe runs under the pool's lock and an agent that does not answer is the case
/// it is there to find.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// A chunk to write into a page.
pub struct WriteItem<'a> {
    pub page: PageGrant,
    pub data: &'a [u8],
}

/// A chunk the caller put in a staging slot, to write into a page.
pub struct SlotWrite {
    pub page: PageGrant,
    pub slot: Slot,
    pub len: usize,
}

/// How one slot transfer ended: whether it completed, and the slot, unless a transfer
/// of unknown outcome kept it (it comes back to its pool after the peer's fence).
#[derive(Debug)]
pub struct SlotOutcome {
    pub ok: bool,
    pub slot: Option<Slot>,
}

/// Leased bytes in a mapping this host holds; the mapping stays while the view lives.
#[derive(Clone)]
pub struct View {
    map: Arc<Mapping>,
    offset: usize,
    len: usize,
}

impl View {
    pub fn bytes(&self) -> &[u8] {
        self.map
            .as_slice()
            .ok()
            .and_then(|b| b.get(self.offset..self.offset + self.len))
            .unwrap_or(&[])
    }
}

impl std::fmt::Debug for View {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "View({} bytes at {})", self.len, self.offset)
    }
}

/// Receives the bytes of lease `i` of a read (a view that is only valid during the call).
pub type ReadSink<'s> = dyn FnMut(usize, &[u8]) + 's;

pub trait Mover: Send {
    /// Makes one of the session's own regions usable (map it).
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError>;
    /// Writes each item into its page; true where the bytes are complete in the region.
    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool>;
    /// Writes from the caller's staging slots. By default through `write` (a mover that
    /// copies anyway); a one-sided mover posts from the slots themselves.
    fn write_slots(&mut self, items: Vec<SlotWrite>) -> Vec<SlotOutcome> {
        let ok = {
            let writes: Vec<WriteItem<'_>> = items
                .iter()
                .map(|it| WriteItem {
                    page: it.page,
                    data: &it.slot.bytes()[..it.len.min(it.slot.len())],
                })
                .collect();
            self.write(&writes)
        };
        items
            .into_iter()
            .zip(ok)
            .map(|(it, ok)| SlotOutcome {
                ok,
                slot: Some(it.slot),
            })
            .collect()
    }
    /// Reads each lease's bytes and hands them to `sink(i, bytes)`; a lease whose read
    /// failed is not handed over. A failed batch fails the rest of the request.
    fn read(&mut self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>);
    /// Reads each lease into the slot of the same index. By default through `read`.
    fn read_into(&mut self, leases: &[LeaseGrant], slots: Vec<Slot>) -> Vec<SlotOutcome> {
        let mut slots: Vec<Option<Slot>> = slots.into_iter().map(Some).collect();
        let mut ok = vec![false; slots.len()];
        self.read(leases, &mut |i, bytes| {
            if let Some(Some(s)) = slots.get_mut(i) {
                if bytes.len() <= s.len() {
                    s.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
                    ok[i] = true;
                }
            }
        });
        slots
            .into_iter()
            .zip(ok)
            .map(|(slot, ok)| SlotOutcome { ok, slot })
            .collect()
    }
    /// Boot ids of the session's regions (for heartbeats).
    fn boot_ids(&self) -> BTreeMap<u64, String>;
    /// The session's regions this mover can write into (for heartbeats, beside
    /// `boot_ids`: maru-server answers which are no longer the session's).
    fn own_regions(&self) -> Vec<u64>;
    /// maru-server no longer counts the region among the session's (the RM took it
    /// back): write nothing more into it and forget it. Nothing is released: the
    /// region is no longer this session's to release.
    fn forget_region(&mut self, region_id: u64);
    /// Gives back slots of transfers whose peer can now be fenced.
    fn reclaim(&mut self) {}
    /// True while a transfer of unknown outcome could still land somewhere (a peer
    /// that timed out could not be fenced yet): pages of failed writes must not be
    /// reused then.
    fn may_still_write(&self) -> bool {
        false
    }
    /// The leased bytes in place, for a reader that uses them without a copy (`cxl`:
    /// this host's read-only mapping of the region). `None` where the mover cannot.
    fn view(&mut self, _lease: &LeaseGrant) -> Option<View> {
        None
    }
    /// The session is gone with the maru-server that knew it (it restarted): no keeper
    /// will ever release the regions, so release them at their agents now (nothing can
    /// be written into them after that). Returns (released, failed).
    fn release_all(&mut self) -> (usize, usize) {
        (0, 0)
    }
    /// True when a region should be adopted ahead of need (before the session's
    /// regions are full), so that the work of making it usable (`cxl`: faulting its
    /// pages in) happens off the store path.
    fn wants_lead(&self) -> bool {
        false
    }
    /// What prefaulting did (`cxl`), for stats.
    fn prefault_stats(&self) -> Option<PrefaultStats> {
        None
    }
    /// Periodic work at `now_ms` (probe the agents of own regions, map regions again
    /// where an agent restarted). Returns the own regions to give back to maru-server
    /// (their agent has been silent too long): the pool returns them and forgets them.
    fn tick(&mut self, _now_ms: u64) -> Vec<u64> {
        Vec::new()
    }
    /// Asks every agent of own regions who it is now (before a drained close).
    fn check_agents(&mut self, _now_ms: u64) {}
    /// True when maru-server must hear the regions' boot ids (a heartbeat) before
    /// anything else is published: a region is new, or its memory node rebooted.
    fn must_report(&self) -> bool {
        false
    }
    /// maru-server received these boot ids (a heartbeat it answered).
    fn reported(&mut self, _sent: &BTreeMap<u64, String>) {}
    /// Why the last read that failed failed (an agent's refusal, say), once.
    fn take_read_error(&mut self) -> Option<String> {
        None
    }
}

// ---------------------------------------------------------------- remote_cxl

struct OwnRegion {
    agent: String,
    handle: crate::wire::rm::Handle,
    map: MapReply,
}

struct AgentConn {
    link: Link,
    peer: Option<PeerId>,
}

/// `remote_cxl`: WRITE/READ between staging slots and regions of memory nodes.
pub struct RemoteMover {
    nic: Arc<dyn Transport>,
    staging: StagingSlots,
    iso: Isolation,
    agent_opts: ClientOptions,
    agents: HashMap<String, AgentConn>,
    own: HashMap<u64, OwnRegion>,
    /// Read registrations of leased ranges: (region, offset, length) → where.
    reads: HashMap<(u64, u64, u64), ReadTarget>,
    timeout: Duration,
    last_skip_log: Option<Instant>,
    /// The rules of the own regions' lifecycle (boot ids, restarts, silent agents):
    /// this mover feeds it what agents answer and carries out what it decides.
    life: Lifecycle,
    /// A second, short-timeout connection per agent for probes.
    probes: HashMap<String, Link>,
    /// Why the last failed read failed, for the caller.
    read_error: Option<String>,
    /// Set when a transfer of the current call dropped a failed peer.
    peer_dropped: bool,
    /// Bytes in flight of the windowed transfers of this data path (all its pools).
    budget: Arc<InFlightBudget>,
}

impl RemoteMover {
    pub fn new(
        nic: Arc<dyn Transport>,
        staging: StagingSlots,
        agent_opts: ClientOptions,
        timeout: Duration,
        budget: Arc<InFlightBudget>,
    ) -> RemoteMover {
        RemoteMover {
            nic,
            staging,
            iso: Isolation::new(),
            agent_opts,
            agents: HashMap::new(),
            own: HashMap::new(),
            reads: HashMap::new(),
            timeout,
            last_skip_log: None,
            life: Lifecycle::new(),
            probes: HashMap::new(),
            read_error: None,
            peer_dropped: false,
            budget,
        }
    }

    fn agent(&mut self, addr: &str) -> &mut AgentConn {
        let opts = self.agent_opts.clone();
        self.agents
            .entry(addr.to_string())
            .or_insert_with(|| AgentConn {
                link: Link::new(addr, opts).with_check(require_boot_id),
                peer: None,
            })
    }

    /// Connects to `addr` if needed and tells the lifecycle who answered.
    fn connect_agent(&mut self, addr: &str) -> Result<(), WorkerError> {
        let now = now_ms();
        let conn = self.agent(addr);
        if conn.link.is_connected() {
            return Ok(());
        }
        let seen = conn.link.client().map(|c| welcome_identity(c));
        match seen {
            Ok((boot, epoch)) => {
                let v = self.life.seen(addr, boot.as_deref(), epoch, now);
                self.on_verdict(addr, v)
            }
            Err(e) => {
                self.life.unreachable(addr, now);
                Err(e.into())
            }
        }
    }

    /// Carries out what the lifecycle made of an agent's identity.
    fn on_verdict(&mut self, addr: &str, v: Verdict) -> Result<(), WorkerError> {
        match v {
            Verdict::Same => return Ok(()),
            Verdict::NoBoot => {
                self.agent(addr).link.reset();
                return Err(WorkerError::Unavailable(format!(
                    "agent {addr} reports no boot id: treated as unreachable"
                )));
            }
            Verdict::Restarted => log::info!(
                "agent {addr} restarted (same boot): mapping this worker's regions there again"
            ),
            Verdict::Rebooted(ids) => log::warn!(
                "the memory node of agent {addr} rebooted (new boot id): the keys of region(s) {ids:?} died with it; maru-server is told before they are used again"
            ),
        }
        // Its registrations and data connection are gone with the old process.
        let conn = self.agent(addr);
        let peer = conn.peer.take();
        if let Some(p) = peer {
            self.iso.fence(self.nic.as_ref(), p);
        }
        self.reads.retain(|_, t| t.0 != addr);
        Ok(())
    }

    fn agent_call(&mut self, addr: &str, req: &AgentRequest) -> Result<AgentReply, WorkerError> {
        self.connect_agent(addr)?;
        let conn = self.agent(addr);
        let mut r = conn.link.call::<_, AgentReply>(req);
        if !conn.link.is_connected() {
            // The connection broke (the agent may have restarted, losing its
            // registrations): a new connection is a new peer at the transport too,
            // and this mover's regions there are mapped again before their next use.
            conn.peer = None;
            self.life.link_broken(addr);
            // Read registrations went with the old connection.
            self.reads.retain(|_, t| t.0 != addr);
            if r.is_err() {
                // Failed on the dead connection, so the agent never saw it: once more
                // on a fresh one.
                self.connect_agent(addr)?;
                r = self.agent(addr).link.call::<_, AgentReply>(req);
            }
        }
        if let Err(LinkError::Unreachable(_)) = &r {
            self.life.unreachable(addr, now_ms());
        }
        Ok(r?)
    }

    /// Asks `addr` who it is on the probe connection (short timeouts), once more on a
    /// fresh connection if the old one was dead.
    fn probe(&mut self, addr: &str, now: u64) {
        let mut opts = self.agent_opts.clone();
        opts.connect_timeout = PROBE_TIMEOUT;
        opts.call_timeout = PROBE_TIMEOUT;
        let link = self
            .probes
            .entry(addr.to_string())
            .or_insert_with(|| Link::new(addr, opts).with_check(require_boot_id));
        let mut r = link.call::<_, AgentReply>(&AgentRequest::Status);
        if r.is_err() && !link.is_connected() {
            r = link.call::<_, AgentReply>(&AgentRequest::Status);
        }
        match r {
            Ok(AgentReply::Status(st)) => {
                let v = self.life.seen(addr, Some(&st.boot_id), Some(st.epoch), now);
                if let Err(e) = self.on_verdict(addr, v) {
                    log::warn!("{e}");
                }
            }
            Ok(other) => log::warn!("agent {addr} answered status with {other:?}"),
            Err(e) => {
                log::debug!("agent {addr} did not answer a probe: {e}");
                self.life.unreachable(addr, now);
            }
        }
    }

    fn peer(&mut self, addr: &str, meta: &serde_json::Value) -> Result<PeerId, WorkerError> {
        if let Some(p) = self.agent(addr).peer {
            return Ok(p);
        }
        let nic = self.nic.clone();
        let conn = self.agent(addr);
        let link = &mut conn.link;
        let mut bringup = |info: &serde_json::Value| -> Result<serde_json::Value, TransportError> {
            match link.call::<_, AgentReply>(&AgentRequest::ConnectPeer { info: info.clone() }) {
                Ok(AgentReply::Peer { info }) => Ok(info),
                Ok(r) => Err(TransportError::Setup(format!("unexpected reply {r:?}"))),
                Err(e) => Err(TransportError::Setup(e.to_string())),
            }
        };
        let p = nic
            .connect(meta, &mut bringup)
            .map_err(|e| WorkerError::Unavailable(format!("agent {addr}: {e}")))?;
        conn.peer = Some(p);
        Ok(p)
    }

    /// A peer whose batch failed with a known outcome: closed at the transport and
    /// forgotten; its agent's own regions are mapped again before their next use.
    fn drop_failed_peer(&mut self, peer: PeerId) {
        for (addr, c) in self.agents.iter_mut() {
            if c.peer == Some(peer) {
                c.peer = None;
                // The agent's control connection likely went with it (a restart):
                // connect afresh rather than find out on the next call.
                c.link.reset();
                self.life.link_broken(addr);
                self.peer_dropped = true;
            }
        }
        // A closed control connection takes its read registrations with it.
        if self.peer_dropped {
            self.reads.clear();
        }
        // Recorded: only a fence that succeeded lets pages of its WRITEs be reused.
        self.iso.fence(self.nic.as_ref(), peer);
    }

    /// Maps this mover's own regions again at the agents whose registrations may be
    /// gone (a broken connection, a restart), unless one of them waits for
    /// maru-server to hear of a reboot. The agent keeps a region's bytes across its
    /// restart, not its registration. An agent that cannot be reached stays due.
    fn remap_failed_agents(&mut self) {
        let mut agents: Vec<String> = self.own.values().map(|r| r.agent.clone()).collect();
        agents.sort();
        agents.dedup();
        agents.retain(|a| self.life.needs_remap(a) && self.life.may_map(a));
        for agent in agents {
            self.remap_agent(&agent);
        }
    }

    fn remap_agent(&mut self, agent: &str) {
        // Connect first: a new connection's welcome may reveal a reboot, and then
        // nothing is mapped before maru-server dropped the keys.
        if let Err(e) = self.connect_agent(agent) {
            log::debug!("mapping again at agent {agent}: {e}");
            return;
        }
        if !self.life.may_map(agent) {
            return;
        }
        let regions: Vec<(u64, crate::wire::rm::Handle)> = self
            .own
            .iter()
            .filter(|(_, r)| r.agent == agent)
            .map(|(id, r)| (*id, r.handle.clone()))
            .collect();
        let mut all = true;
        for (id, handle) in regions {
            let req = AgentRequest::Map {
                handle,
                writable: true,
            };
            match self.agent_call(agent, &req) {
                Ok(AgentReply::Mapped(m)) => {
                    let v = self.life.seen(agent, Some(&m.boot_id), None, now_ms());
                    let same = v == Verdict::Same;
                    if let Err(e) = self.on_verdict(agent, v) {
                        log::warn!("region {id}: {e}");
                    }
                    if !same || !self.life.may_map(agent) {
                        all = false;
                        break;
                    }
                    if let Some(r) = self.own.get_mut(&id) {
                        r.map = m;
                    }
                }
                Ok(r) => {
                    log::warn!("region {id}: agent {agent} answered map with {r:?}");
                    all = false;
                }
                Err(e) => {
                    log::debug!("region {id}: mapping again at agent {agent} failed: {e}");
                    all = false;
                    break;
                }
            }
        }
        if all {
            self.life.remapped(agent);
        }
    }

    /// Forgets the peers that isolation fenced.
    fn forget_peers(&mut self, fenced: &[PeerId]) {
        for c in self.agents.values_mut() {
            if c.peer.is_some_and(|p| fenced.contains(&p)) {
                c.peer = None;
            }
        }
    }

    fn log_skip(&mut self, n: usize) {
        let now = Instant::now();
        if self
            .last_skip_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60))
        {
            log::warn!(
                "store staging is full: skipping {n} chunk(s) (logged at most once a minute)"
            );
            self.last_skip_log = Some(now);
        }
    }

    fn post_group(&self, group: PeerGroups, writes: bool) -> PostedGroup {
        let peers = group.batches.iter().map(|b| b.peer).collect();
        PostedGroup {
            posted: post(self.nic.as_ref(), group.batches, self.timeout),
            order: group.order,
            peers,
            writes,
        }
    }

    /// Waits for a posted group and records each item's outcome in `out` (the slot
    /// back unless its peer's outcome is unknown). True when any batch did not complete.
    fn settle_posted(&mut self, pending: PostedGroup, out: &mut [SlotOutcome]) -> bool {
        let outcomes = pending.posted.finish(self.nic.as_ref(), &self.iso);
        let writes = pending.writes;
        let mut any_failed = false;
        let mut any_kept = false;
        for ((items, o), peer) in pending.order.iter().zip(outcomes).zip(pending.peers) {
            let (ok, slots) = match o {
                PeerOutcome::Done(s) => (true, s),
                PeerOutcome::Failed(e, s) => {
                    log::debug!("transfer batch failed: {e}");
                    if writes && matches!(e, TransportError::PeerLost { .. }) {
                        // Locally it is over, but the target may still apply WRITEs
                        // it read: their pages wait for a fence that succeeds.
                        self.iso.unknown_writes(peer);
                    }
                    // Nothing of it is in flight here: drop the peer (fenced), so the
                    // next transfer connects again, and map our regions at its agent
                    // again before their next use.
                    self.drop_failed_peer(peer);
                    (false, s)
                }
                PeerOutcome::Kept(_) => {
                    any_kept = true;
                    (false, Vec::new())
                }
            };
            any_failed |= !ok;
            for (&i, slot) in items.iter().zip(slots) {
                out[i] = SlotOutcome {
                    ok,
                    slot: Some(slot),
                };
            }
        }
        if any_kept {
            self.reclaim();
        }
        any_failed
    }
}

/// Posts once more the items (with their slots) of a window that failed while a peer
/// was dropped.
type PostAgain<'a> = dyn FnMut(&mut RemoteMover, Vec<usize>, Vec<Slot>) -> PendingWindow + 'a;

/// One window of a transfer, posted and not yet waited for.
struct PendingWindow {
    /// The request's items it holds, in the order of `out`.
    items: Vec<usize>,
    out: Vec<SlotOutcome>,
    group: PostedGroup,
    reads: bool,
}

/// A copying store's windows: the caller's chunks are copied into store slots.
struct StoreWindows<'a, 'd> {
    m: &'a mut RemoteMover,
    items: &'a [WriteItem<'d>],
    ok: Vec<bool>,
}

impl Windowed for StoreWindows<'_, '_> {
    type Posted = PendingWindow;
    fn items(&self) -> usize {
        self.items.len()
    }
    fn bytes(&self, i: usize) -> u64 {
        self.items[i].data.len() as u64
    }
    fn slots(&mut self, _start: usize, want: usize, _first: bool) -> Vec<Slot> {
        self.m.staging.try_acquire(SlotPool::Store, want)
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> PendingWindow {
        let mut filled = Vec::with_capacity(slots.len());
        let mut index = Vec::with_capacity(slots.len());
        for (i, (it, mut slot)) in self.items[start..].iter().zip(slots).enumerate() {
            // A chunk larger than a slot is not stored (its slot goes back).
            if it.data.len() > slot.len() {
                continue;
            }
            slot.bytes_mut()[..it.data.len()].copy_from_slice(it.data);
            filled.push(slot);
            index.push(start + i);
        }
        let items = self.items;
        self.m
            .post_writes(index, filled, &|i| (items[i].page, items[i].data.len()))
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let items = self.items;
        self.m.finish_window(posted, &mut |m, which, slots| {
            m.post_writes(which, slots, &|i| (items[i].page, items[i].data.len()))
        })
    }
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool {
        for (&i, o) in items.iter().zip(outcomes) {
            self.ok[i] = o.ok;
        }
        true
    }
}

/// A copying load's windows: each window's slots go to the sink, then to a later
/// window.
struct LoadWindows<'a, 's> {
    m: &'a mut RemoteMover,
    leases: &'a [LeaseGrant],
    sink: &'a mut ReadSink<'s>,
}

impl Windowed for LoadWindows<'_, '_> {
    type Posted = PendingWindow;
    fn items(&self) -> usize {
        self.leases.len()
    }
    fn bytes(&self, i: usize) -> u64 {
        self.leases[i].length
    }
    fn slots(&mut self, start: usize, want: usize, first: bool) -> Vec<Slot> {
        if !first {
            // What is free now; else the window ahead gives its slots back.
            return self.m.staging.try_acquire(SlotPool::Load, want);
        }
        let slots = self
            .m
            .staging
            .acquire(SlotPool::Load, want, Duration::from_secs(1));
        if slots.is_empty() {
            log::warn!(
                "no load slot free within 1 s: {} chunk(s) not loaded",
                self.leases.len() - start
            );
        }
        slots
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> PendingWindow {
        let items = (start..start + slots.len()).collect();
        self.m.post_reads(items, self.leases, slots)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let leases = self.leases;
        self.m.finish_window(posted, &mut |m, which, slots| {
            m.post_reads(which, leases, slots)
        })
    }
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool {
        let mut all = true;
        for (&i, o) in items.iter().zip(&outcomes) {
            match (&o.slot, o.ok) {
                (Some(s), true) => {
                    let n = self.leases[i].length as usize;
                    (self.sink)(i, &s.bytes()[..n]);
                }
                // A failed window fails the request from that window on.
                _ => all = false,
            }
        }
        all
    }
}

/// What a transfer from or into the caller's slots moves.
enum Given<'a> {
    /// WRITEs: each slot's page and length.
    Write(&'a [(PageGrant, usize)]),
    /// READs: each slot's lease.
    Read(&'a [LeaseGrant]),
}

/// Windows of a transfer between the caller's slots and pages: every item is tried,
/// and each slot comes back in its outcome.
struct GivenWindows<'a> {
    m: &'a mut RemoteMover,
    given: Vec<Option<Slot>>,
    out: Vec<SlotOutcome>,
    kind: Given<'a>,
}

impl GivenWindows<'_> {
    /// One outcome per given slot: the items' in order, then the slots no item used.
    fn into_outcomes(self) -> Vec<SlotOutcome> {
        let mut out = self.out;
        let used = out.len();
        out.extend(
            self.given
                .into_iter()
                .skip(used)
                .map(|slot| SlotOutcome { ok: false, slot }),
        );
        out
    }
}

/// Posts the request's `items` from or into the caller's slots.
fn post_given(
    m: &mut RemoteMover,
    kind: &Given<'_>,
    items: Vec<usize>,
    slots: Vec<Slot>,
) -> PendingWindow {
    match kind {
        Given::Write(pages) => m.post_writes(items, slots, &|i| pages[i]),
        Given::Read(leases) => m.post_reads(items, leases, slots),
    }
}

impl Windowed for GivenWindows<'_> {
    type Posted = PendingWindow;
    fn items(&self) -> usize {
        match self.kind {
            Given::Write(p) => p.len(),
            Given::Read(l) => l.len(),
        }
    }
    fn bytes(&self, i: usize) -> u64 {
        match self.kind {
            Given::Write(p) => p[i].1 as u64,
            Given::Read(l) => l[i].length,
        }
    }
    fn slots(&mut self, start: usize, want: usize, _first: bool) -> Vec<Slot> {
        self.given[start..start + want]
            .iter_mut()
            .filter_map(Option::take)
            .collect()
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> PendingWindow {
        let items = (start..start + slots.len()).collect();
        post_given(self.m, &self.kind, items, slots)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let kind = &self.kind;
        self.m.finish_window(posted, &mut |m, which, slots| {
            post_given(m, kind, which, slots)
        })
    }
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool {
        debug_assert_eq!(
            items.first().copied().unwrap_or(self.out.len()),
            self.out.len()
        );
        self.out.extend(outcomes);
        true
    }
}

/// A posted transfer with, per peer, the items its operations came from.
struct PostedGroup {
    posted: Posted,
    order: Vec<Vec<usize>>,
    peers: Vec<PeerId>,
    /// WRITEs (their pages matter when the connection is lost), or READs.
    writes: bool,
}

impl Mover for RemoteMover {
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        let agent = grant.agent.clone().ok_or_else(|| {
            WorkerError::Config(format!(
                "region {} has no agent: maru-server runs without --remote-cxl-agent",
                grant.handle.region_id
            ))
        })?;
        let m = match self.agent_call(
            &agent,
            &AgentRequest::Map {
                handle: grant.handle.clone(),
                writable: true,
            },
        )? {
            AgentReply::Mapped(m) => m,
            r => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} answered map with {r:?}"
                )))
            }
        };
        let v = self
            .life
            .adopt(grant.handle.region_id, &agent, &m.boot_id, None, now_ms());
        self.on_verdict(&agent, v)?;
        if let Err(e) = self.peer(&agent, &m.transport) {
            self.life.forget(grant.handle.region_id);
            return Err(e);
        }
        self.own.insert(
            grant.handle.region_id,
            OwnRegion {
                agent,
                handle: grant.handle.clone(),
                map: m,
            },
        );
        Ok(())
    }

    /// Copies each window into store slots while the window ahead of it is on the
    /// wire (see [`windows`]); stores never wait for a slot: with none free and nothing
    /// in flight, the rest is skipped.
    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool> {
        self.peer_dropped = false;
        let budget = self.budget.clone();
        let mut w = StoreWindows {
            m: self,
            items,
            ok: vec![false; items.len()],
        };
        let posted = windows::run(&mut w, &budget);
        let ok = w.ok;
        if posted < items.len() {
            self.log_skip(items.len() - posted);
        }
        ok
    }

    /// From the caller's slots, window by window (see [`windows`]).
    fn write_slots(&mut self, items: Vec<SlotWrite>) -> Vec<SlotOutcome> {
        self.peer_dropped = false;
        let budget = self.budget.clone();
        let pages: Vec<(PageGrant, usize)> = items.iter().map(|it| (it.page, it.len)).collect();
        let given: Vec<Option<Slot>> = items.into_iter().map(|it| Some(it.slot)).collect();
        let mut w = GivenWindows {
            m: self,
            given,
            out: Vec::with_capacity(pages.len()),
            kind: Given::Write(&pages),
        };
        windows::run(&mut w, &budget);
        w.into_outcomes()
    }

    /// Each window's slots are handed to `sink` and then take a later window (see
    /// [`windows`]). After a window that failed, nothing more is handed over.
    fn read(&mut self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>) {
        self.peer_dropped = false;
        let budget = self.budget.clone();
        windows::run(
            &mut LoadWindows {
                m: self,
                leases,
                sink,
            },
            &budget,
        );
    }

    /// Into the caller's slots, window by window (see [`windows`]); every lease is
    /// tried.
    fn read_into(&mut self, leases: &[LeaseGrant], slots: Vec<Slot>) -> Vec<SlotOutcome> {
        self.peer_dropped = false;
        let budget = self.budget.clone();
        let n = leases.len().min(slots.len());
        let given: Vec<Option<Slot>> = slots.into_iter().map(Some).collect();
        let mut w = GivenWindows {
            m: self,
            given,
            out: Vec::with_capacity(n),
            kind: Given::Read(&leases[..n]),
        };
        windows::run(&mut w, &budget);
        w.into_outcomes()
    }

    fn boot_ids(&self) -> BTreeMap<u64, String> {
        self.life.boot_ids()
    }

    fn must_report(&self) -> bool {
        self.life.must_report()
    }

    fn reported(&mut self, sent: &BTreeMap<u64, String>) {
        self.life.reported(sent);
        // Regions that waited for the report may be mapped again now.
        self.remap_failed_agents();
    }

    fn take_read_error(&mut self) -> Option<String> {
        self.read_error.take()
    }

    fn tick(&mut self, now_ms: u64) -> Vec<u64> {
        let mut give_back = Vec::new();
        for a in self.life.due(now_ms) {
            match a {
                Action::Probe(agent) => self.probe(&agent, now_ms),
                Action::Remap(agent) => self.remap_agent(&agent),
                // The pool asks `must_report` after the tick.
                Action::ReportBoots => {}
                Action::GiveBack { agent, regions } => {
                    log::warn!(
                        "agent {agent} has not answered for {} s: giving region(s) {regions:?} back (their keys go)",
                        super::lifecycle::AGENT_SILENCE_MS / 1000
                    );
                    give_back.extend(regions);
                }
            }
        }
        // A probe may have found a restart: map again now, not at the next tick.
        self.remap_failed_agents();
        give_back
    }

    fn check_agents(&mut self, now_ms: u64) {
        let mut agents: Vec<String> = self.own.values().map(|r| r.agent.clone()).collect();
        agents.sort();
        agents.dedup();
        for a in agents {
            self.probe(&a, now_ms);
        }
    }

    fn own_regions(&self) -> Vec<u64> {
        self.own.keys().copied().collect()
    }

    fn forget_region(&mut self, region_id: u64) {
        self.own.remove(&region_id);
        self.life.forget(region_id);
        self.reads.retain(|&(r, _, _), _| r != region_id);
    }

    fn reclaim(&mut self) {
        let fenced = self.iso.reclaim(self.nic.as_ref());
        if !fenced.is_empty() {
            self.forget_peers(&fenced);
        }
    }

    fn may_still_write(&self) -> bool {
        self.iso.may_still_write()
    }

    fn release_all(&mut self) -> (usize, usize) {
        let own: Vec<(String, crate::wire::rm::Handle)> = self
            .own
            .values()
            .map(|r| (r.agent.clone(), r.handle.clone()))
            .collect();
        let (mut released, mut failed) = (0, 0);
        for (agent, handle) in own {
            let id = handle.region_id;
            match self.agent_call(&agent, &AgentRequest::Release { handle }) {
                Ok(AgentReply::Released { .. }) => {
                    self.own.remove(&id);
                    self.life.forget(id);
                    released += 1;
                }
                Ok(r) => {
                    log::warn!("agent {agent} answered the release of region {id} with {r:?}");
                    failed += 1;
                }
                Err(e) => {
                    log::warn!("agent {agent}: release of region {id} failed: {e}; the agent's sweep deregisters it once the RM forgets the region");
                    failed += 1;
                }
            }
        }
        (released, failed)
    }
}

impl Drop for RemoteMover {
    fn drop(&mut self) {
        // Fence what is still kept; slots of a peer that cannot be fenced never return
        // to the pool (a late DMA could still land in them).
        self.reclaim();
        let lost = self.iso.abandon();
        if lost > 0 {
            log::warn!("{lost} staging slot(s) stay out of use: their peer could not be fenced");
        }
    }
}

/// Takes the slots of the transfers that failed with a known outcome (their slot came
/// back), with their places in `out`, to try them again.
fn take_failed(out: &mut [SlotOutcome]) -> (Vec<usize>, Vec<Slot>) {
    out.iter_mut()
        .enumerate()
        .filter(|(_, o)| !o.ok)
        .filter_map(|(i, o)| o.slot.take().map(|s| (i, s)))
        .unzip()
}

/// Puts the outcomes of a second try back in the places they were taken from.
fn put_back(out: &mut [SlotOutcome], idx: &[usize], again: Vec<SlotOutcome>) {
    for (&i, o) in idx.iter().zip(again) {
        out[i] = o;
    }
}

/// A remote range to READ: its agent, address, key and transport metadata.
type ReadTarget = (String, u64, u64, serde_json::Value);

/// Operations grouped into one batch per peer, remembering which item each came from.
#[derive(Default)]
struct PeerGroups {
    batches: Vec<PeerBatch>,
    order: Vec<Vec<usize>>,
}

impl PeerGroups {
    fn add(&mut self, peer: PeerId, op: Op, slot: Slot, item: usize) {
        let bi = match self.batches.iter().position(|b| b.peer == peer) {
            Some(bi) => bi,
            None => {
                self.batches.push(PeerBatch {
                    peer,
                    ops: Vec::new(),
                    slots: Vec::new(),
                });
                self.order.push(Vec::new());
                self.batches.len() - 1
            }
        };
        self.batches[bi].ops.push(op);
        self.batches[bi].slots.push(slot);
        self.order[bi].push(item);
    }
}

impl RemoteMover {
    /// Where a lease's bytes are: our own mapping, or a read registration at its agent.
    fn read_target(&mut self, l: &LeaseGrant) -> Result<ReadTarget, WorkerError> {
        if let Some(r) = self.own.get(&l.region_id) {
            if !self.life.usable(l.region_id) {
                return Err(WorkerError::Unavailable(format!(
                    "region {}: its memory node rebooted; its keys are being dropped",
                    l.region_id
                )));
            }
            return Ok((
                r.agent.clone(),
                r.map.addr + l.offset,
                r.map.rkey,
                r.map.transport.clone(),
            ));
        }
        if let Some(t) = self.reads.get(&(l.region_id, l.offset, l.length)) {
            return Ok(t.clone());
        }
        let agent = l.agent.clone().ok_or_else(|| {
            WorkerError::Transport(format!("lease {} names no agent", l.lease_id))
        })?;
        let req = AgentRequest::MapRead {
            region_id: l.region_id,
            offset: l.offset,
            length: l.length,
            read_token: l.read_token.clone(),
        };
        let m = match self.agent_call(&agent, &req) {
            Ok(AgentReply::Mapped(m)) => m,
            Ok(r) => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} answered map_read with {r:?}"
                )))
            }
            Err(e) => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} refused to map region {} for reading: {e}",
                    l.region_id
                )))
            }
        };
        let v = self.life.seen(&agent, Some(&m.boot_id), None, now_ms());
        self.on_verdict(&agent, v)?;
        let t = (agent, m.addr, m.rkey, m.transport);
        self.reads
            .insert((l.region_id, l.offset, l.length), t.clone());
        Ok(t)
    }
}

// ---------------------------------------------------------------- cxl

/// `cxl`: this host maps the regions itself and copies with memcpy.
pub struct CxlMover {
    /// The session's own regions, writable; shared with the prefault thread while it
    /// populates them.
    own: HashMap<u64, Arc<Mapping>>,
    /// Read-only mappings of regions (other engines' and, for views, our own), shared
    /// with the views handed out so that a view outlives neither its mapping nor
    /// keeps one alive longer than it needs.
    readers: HashMap<u64, Arc<Mapping>>,
    /// Faults the pages of each adopted region in, off the store path (`None`: off).
    prefault: Option<Prefaulter>,
}

impl CxlMover {
    pub fn new() -> CxlMover {
        CxlMover::with_prefault(true)
    }

    /// A mover that prefaults its own regions in the background, or not.
    pub fn with_prefault(on: bool) -> CxlMover {
        CxlMover::with_prefaulter(on.then(Prefaulter::new))
    }

    /// A mover with the given prefaulter (tests: one whose kernel refuses).
    pub fn with_prefaulter(prefault: Option<Prefaulter>) -> CxlMover {
        CxlMover {
            own: HashMap::new(),
            readers: HashMap::new(),
            prefault,
        }
    }
}

impl CxlMover {
    /// The bytes of a lease in this host's mapping (mapping the owner's region read-only
    /// the first time).
    fn leased_bytes(&mut self, l: &LeaseGrant) -> Option<&[u8]> {
        if !self.own.contains_key(&l.region_id) {
            self.reader(l)?;
        }
        let m = match self.own.get(&l.region_id) {
            Some(m) => m.as_ref(),
            None => self.readers.get(&l.region_id)?.as_ref(),
        };
        m.as_slice()
            .ok()?
            .get(l.offset as usize..(l.offset + l.length) as usize)
    }

    /// The read-only mapping of a lease's region (made the first time).
    fn reader(&mut self, l: &LeaseGrant) -> Option<Arc<Mapping>> {
        if let Some(m) = self.readers.get(&l.region_id) {
            return Some(m.clone());
        }
        let d = l.device.as_ref()?;
        let path = local_path(&d.uuid, &d.path).ok()?;
        let m = dax::map_range(
            &path,
            dax::kind_of_path(&path),
            d.region_offset,
            d.region_length,
            2 << 20,
            false,
        )
        .ok()?;
        let m = Arc::new(m);
        self.readers.insert(l.region_id, m.clone());
        Some(m)
    }
}

impl Default for CxlMover {
    fn default() -> Self {
        CxlMover::new()
    }
}

fn local_path(uuid: &str, path: &str) -> Result<String, WorkerError> {
    match dax::scan_uuid(path) {
        Ok(Some(u)) if u == uuid => Ok(path.to_string()),
        Ok(_) => Err(WorkerError::Config(format!("device {path} here is not the pool's device (uuid {uuid}): is this host attached to that CXL memory?"))),
        Err(e) => Err(WorkerError::Config(format!("{e}: backend cxl needs the pool's device on this host"))),
    }
}

impl Mover for CxlMover {
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        let path = local_path(&grant.pool.uuid, &grant.pool.path)?;
        let h = &grant.handle;
        let m = dax::map_range(
            &path,
            dax::kind_of_path(&path),
            h.offset,
            h.length,
            grant.pool.align,
            true,
        )
        .map_err(|e| WorkerError::Config(e.to_string()))?;
        let m = Arc::new(m);
        if let Some(p) = self.prefault.as_mut() {
            // Its pages are faulted in by the time the stores reach them (or while
            // they do); the bytes stay as they are.
            p.submit(m.clone());
        }
        self.own.insert(h.region_id, m);
        Ok(())
    }

    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool> {
        items
            .iter()
            .map(|it| {
                let Some(m) = self.own.get(&it.page.region_id) else {
                    return false;
                };
                match m.write_at(it.page.offset as usize, it.data) {
                    Ok(()) => true,
                    Err(e) => {
                        log::debug!("write into region {}: {e}", it.page.region_id);
                        false
                    }
                }
            })
            .collect()
    }

    fn wants_lead(&self) -> bool {
        self.prefault.as_ref().is_some_and(|p| !p.stats().off)
    }

    fn prefault_stats(&self) -> Option<PrefaultStats> {
        self.prefault.as_ref().map(Prefaulter::stats)
    }

    fn view(&mut self, l: &LeaseGrant) -> Option<View> {
        let map = self.reader(l)?;
        let (offset, len) = (l.offset as usize, l.length as usize);
        map.as_slice().ok()?.get(offset..offset + len)?;
        Some(View { map, offset, len })
    }

    fn read(&mut self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>) {
        for (i, l) in leases.iter().enumerate() {
            if let Some(bytes) = self.leased_bytes(l) {
                // Straight from the shared mapping: the one copy is the sink's.
                sink(i, bytes);
            }
        }
    }

    fn boot_ids(&self) -> BTreeMap<u64, String> {
        BTreeMap::new()
    }

    fn own_regions(&self) -> Vec<u64> {
        self.own.keys().copied().collect()
    }

    fn forget_region(&mut self, region_id: u64) {
        // The mapping goes once the prefault thread (if it still has it) lets go.
        self.own.remove(&region_id);
        self.readers.remove(&region_id);
    }
}

/// Windows of transfers: post, then wait (with one more try for what failed while a
/// peer was dropped).
impl RemoteMover {
    /// Posts a WRITE of each of the request's `items` from the slot of the same index
    /// into its page; `page(item)` is the page and the bytes to write.
    fn post_writes(
        &mut self,
        items: Vec<usize>,
        slots: Vec<Slot>,
        page: &dyn Fn(usize) -> (PageGrant, usize),
    ) -> PendingWindow {
        self.remap_failed_agents();
        let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
        let mut group = PeerGroups::default();
        for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
            out.push(SlotOutcome {
                ok: false,
                slot: None,
            });
            let (page, len) = page(item);
            let usable = self.life.usable(page.region_id);
            let target = self.own.get(&page.region_id).filter(|_| usable).map(|r| {
                (
                    r.agent.clone(),
                    r.map.addr,
                    r.map.rkey,
                    r.map.transport.clone(),
                )
            });
            let Some((agent, addr, rkey, meta)) = target else {
                out[i].slot = Some(slot);
                continue;
            };
            let peer = match self.peer(&agent, &meta) {
                Ok(p) if len <= slot.len() => p,
                _ => {
                    out[i].slot = Some(slot);
                    continue;
                }
            };
            let op = Op {
                kind: OpKind::Write,
                local_offset: slot.offset() as u64,
                remote_addr: addr + page.offset,
                rkey,
                len: len as u64,
            };
            group.add(peer, op, slot, i);
        }
        PendingWindow {
            items,
            out,
            group: self.post_group(group, true),
            reads: false,
        }
    }

    /// Posts a READ of each of the request's `items` (its lease in `leases`, the
    /// request's) into the slot of the same index.
    fn post_reads(
        &mut self,
        items: Vec<usize>,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
    ) -> PendingWindow {
        self.remap_failed_agents();
        let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
        let mut group = PeerGroups::default();
        for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
            let l = &leases[item];
            out.push(SlotOutcome {
                ok: false,
                slot: None,
            });
            let peer = match self.read_target(l) {
                Ok((agent, addr, rkey, meta)) if l.length as usize <= slot.len() => {
                    match self.peer(&agent, &meta) {
                        Ok(p) => Some((p, addr, rkey)),
                        Err(e) => {
                            self.read_error = Some(e.to_string());
                            None
                        }
                    }
                }
                Ok(_) => None,
                Err(e) => {
                    // Said once per request, not per chunk.
                    if self.read_error.is_none() {
                        log::warn!("load of {} bytes of region {}: {e}", l.length, l.region_id);
                    }
                    self.read_error = Some(e.to_string());
                    None
                }
            };
            let Some((peer, addr, rkey)) = peer else {
                out[i].slot = Some(slot);
                continue;
            };
            let op = Op {
                kind: OpKind::Read,
                local_offset: slot.offset() as u64,
                remote_addr: addr,
                rkey,
                len: l.length,
            };
            group.add(peer, op, slot, i);
        }
        PendingWindow {
            items,
            out,
            group: self.post_group(group, false),
            reads: true,
        }
    }

    /// Waits for a posted window: its items and their outcomes. Transfers that failed
    /// while a peer was dropped (an agent restarted, say: their outcome is known,
    /// nothing of them is in flight) are posted once more through `again(items, slots)`
    /// and waited for; the next try connects again and maps the regions again.
    fn finish_window(
        &mut self,
        pending: PendingWindow,
        again: &mut PostAgain<'_>,
    ) -> (Vec<usize>, Vec<SlotOutcome>) {
        let PendingWindow {
            items,
            mut out,
            group,
            reads,
        } = pending;
        let mut failed = self.settle_posted(group, &mut out);
        if self.peer_dropped && out.iter().any(|o| !o.ok) {
            let (idx, slots) = take_failed(&mut out);
            let which = idx.iter().map(|&k| items[k]).collect();
            let retry = again(self, which, slots);
            let mut retried = retry.out;
            failed = self.settle_posted(retry.group, &mut retried);
            put_back(&mut out, &idx, retried);
        }
        if failed && reads {
            // Read registrations may have gone with their region: map again next time.
            self.reads.clear();
        }
        (items, out)
    }
}
