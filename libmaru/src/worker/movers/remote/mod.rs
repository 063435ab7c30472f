//! `remote_cxl`: WRITE/READ between the staging slots of this host and regions of
//! memory nodes, over a one-sided transport.
//!
//! - `agents`: the control connections to agents, their probes, and the region
//!   lifecycle (boot ids, restarts, silence) they feed (`worker::lifecycle`);
//! - `link`: an agent's control connection, used by one caller at a time;
//! - `post`: a window of transfers posted one batch per peer and settled, with
//!   transfer isolation for what did not finish;
//! - `requests`: what a store or load posts window by window (`worker::windows`).
//!
//! No lock is held across a round trip, a connect or a fence: the state's lock
//! guards maps and counters only; a round trip to an agent holds that agent's control
//! connection (taken for the call, see `link`), and every such wait made for a
//! request ends by the request's deadline.

mod agents;
mod link;
mod post;
mod requests;

use super::{Mover, ReadSink, SlotOutcome, SlotWrite, Transfers, WriteItem};
use crate::net::{ClientOptions, Link};
use crate::transport::{PeerId, Transport};
use crate::wire::agent::MapReply;
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::WorkerError;
use crate::worker::lifecycle::Lifecycle;
use crate::worker::staging::{Slot, StagingSlots};
use crate::worker::transfer::Isolation;
use crate::worker::windows::{self, InFlightBudget};
use link::AgentLink;
use requests::{Given, GivenWindows, LoadWindows, StoreWindows};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

struct OwnRegion {
    agent: String,
    handle: crate::wire::rm::Handle,
    map: MapReply,
}

struct AgentConn {
    /// The control connection (map, map_read, release, a peer's bring-up), taken by
    /// one caller at a time and never under the state's lock (see `link`).
    link: Arc<AgentLink>,
    peer: Option<PeerId>,
}

/// `remote_cxl`: WRITE/READ between staging slots and regions of memory nodes.
///
/// Requests of one handler run side by side: the mover's state (agents, own regions,
/// read registrations, the region lifecycle) is behind a short lock of its own, taken
/// to plan a window and to settle it, never while a window is on the wire, its slots
/// are filled or emptied, an agent is called or a peer connected or fenced (see
/// [`Shared`]). The pool hands requests to [`Shared`] without its own mover lock
/// (`Mover::transfers`).
pub struct RemoteMover {
    shared: Arc<Shared>,
}

/// What the transfers of concurrent requests share: the state under its lock, and what
/// needs no lock (the transport, transfer isolation, the staging slots and the
/// in-flight budget are safe to use from any thread).
pub(super) struct Shared {
    st: Mutex<RemoteState>,
    nic: Arc<dyn Transport>,
    iso: Arc<Isolation>,
    staging: StagingSlots,
    /// A request's timeout (`timeout_ms`): the deadline of the calls made for the
    /// mover's own calls outside requests (the tick's maps again, a release).
    timeout: Duration,
    /// Bytes in flight of the windowed transfers of this data path (all its pools).
    budget: Arc<InFlightBudget>,
    /// Store slots held by this mover's copying store windows on the wire (they come
    /// back within a transfer; see `StoreWindows::slots`).
    store_slots_on_wire: AtomicUsize,
    /// A second, short-timeout connection per agent for probes (the pool's tick, one
    /// at a time).
    probes: Mutex<HashMap<String, Arc<Mutex<Link>>>>,
    agent_opts: ClientOptions,
}

/// The mover's state, under `Shared`'s lock: looked up and changed, never waited on.
/// What needs an agent (a connect, a map, a `map_read`, a peer's bring-up, a fence)
/// runs without it and records its outcome under it.
pub(super) struct RemoteState {
    agent_opts: ClientOptions,
    agents: HashMap<String, AgentConn>,
    own: HashMap<u64, OwnRegion>,
    /// Read registrations of leased ranges: (region, offset, length) → where.
    reads: HashMap<(u64, u64, u64), ReadTarget>,
    /// Counts the times read registrations at agents may have gone (`forget_reads`: a
    /// control connection dropped or found dead, an agent restarted, a region
    /// forgotten): a `map_read` made without the lock is recorded only if none went
    /// since it started.
    regs_gen: u64,
    last_skip_log: Option<u64>,
    /// The rules of the own regions' lifecycle (boot ids, restarts, silent agents):
    /// this mover feeds it what agents answer and carries out what it decides.
    life: Lifecycle,
    /// Why the last failed read failed, for the caller.
    read_error: Option<String>,
    /// Peers to fence once the lock is let go (a fence waits on the peer).
    to_fence: Vec<PeerId>,
}

/// A remote range to READ: its agent, address, key and transport metadata.
type ReadTarget = (String, u64, u64, serde_json::Value);

impl RemoteMover {
    pub fn new(
        nic: Arc<dyn Transport>,
        staging: StagingSlots,
        agent_opts: ClientOptions,
        timeout: Duration,
        budget: Arc<InFlightBudget>,
    ) -> RemoteMover {
        let iso = Arc::new(Isolation::new());
        RemoteMover {
            shared: Arc::new(Shared {
                st: Mutex::new(RemoteState {
                    agent_opts: agent_opts.clone(),
                    agents: HashMap::new(),
                    own: HashMap::new(),
                    reads: HashMap::new(),
                    regs_gen: 0,
                    last_skip_log: None,
                    life: Lifecycle::new(),
                    read_error: None,
                    to_fence: Vec::new(),
                }),
                nic,
                iso,
                staging,
                timeout,
                budget,
                store_slots_on_wire: AtomicUsize::new(0),
                probes: Mutex::new(HashMap::new()),
                agent_opts,
            }),
        }
    }

    fn st(&self) -> MutexGuard<'_, RemoteState> {
        self.shared.lock()
    }

    /// A deadline for a call made outside a request (through the `Mover` methods).
    fn by(&self) -> Deadline {
        Deadline::after(self.shared.timeout)
    }
}

impl RemoteState {
    fn log_skip(&mut self, n: usize) {
        let now = now_ms();
        if self
            .last_skip_log
            .is_none_or(|t| now.saturating_sub(t) >= 60_000)
        {
            log::warn!(
                "store staging is full: skipping {n} chunk(s) (logged at most once a minute)"
            );
            self.last_skip_log = Some(now);
        }
    }
}

impl Shared {
    /// The state (a poisoned lock is taken over: a panic between two statements leaves
    /// maps and counters that are still usable).
    pub(super) fn lock(&self) -> MutexGuard<'_, RemoteState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Transfers for Shared {
    fn adopt(&self, grant: &RegionGrant, by: Deadline) -> Result<(), WorkerError> {
        Shared::adopt(self, grant, by)
    }

    fn tick(&self, now_ms: u64) -> Vec<u64> {
        Shared::tick(self, now_ms)
    }

    /// Copies each window into store slots while the window ahead of it is on the
    /// wire (see `worker::windows`); stores never wait for a slot: with none free and
    /// nothing in flight, the rest is skipped.
    fn write(&self, items: &[WriteItem<'_>], by: Deadline) -> Vec<bool> {
        let mut w = StoreWindows {
            m: self,
            items,
            ok: vec![false; items.len()],
            by,
        };
        let posted = windows::run(&mut w, &self.budget);
        let ok = w.ok;
        if posted < items.len() {
            self.lock().log_skip(items.len() - posted);
        }
        ok
    }

    /// From the caller's slots, window by window (see `worker::windows`).
    fn write_slots(&self, items: Vec<SlotWrite>, by: Deadline) -> Vec<SlotOutcome> {
        let pages: Vec<(PageGrant, usize)> = items.iter().map(|it| (it.page, it.len)).collect();
        let given: Vec<Option<Slot>> = items.into_iter().map(|it| Some(it.slot)).collect();
        let mut w = GivenWindows {
            m: self,
            given,
            out: Vec::with_capacity(pages.len()),
            kind: Given::Write(&pages),
            by,
        };
        windows::run(&mut w, &self.budget);
        w.into_outcomes()
    }

    /// Each window's slots are handed to `sink` and then take a later window (see
    /// `worker::windows`). After a window that failed, nothing more is handed over.
    fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>, by: Deadline) {
        self.map_reads(leases, by);
        windows::run(
            &mut LoadWindows {
                m: self,
                leases,
                sink,
                by,
            },
            &self.budget,
        );
    }

    /// Into the caller's slots, window by window (see `worker::windows`); every lease
    /// is tried.
    fn read_into(&self, leases: &[LeaseGrant], slots: Vec<Slot>, by: Deadline) -> Vec<SlotOutcome> {
        let n = leases.len().min(slots.len());
        self.map_reads(&leases[..n], by);
        let given: Vec<Option<Slot>> = slots.into_iter().map(Some).collect();
        let mut w = GivenWindows {
            m: self,
            given,
            out: Vec::with_capacity(n),
            kind: Given::Read(&leases[..n]),
            by,
        };
        windows::run(&mut w, &self.budget);
        w.into_outcomes()
    }

    fn check_agents(&self, now_ms: u64) {
        Shared::check_agents(self, now_ms)
    }

    fn greet(&self, agents: &[String], by: Deadline) -> Result<(), WorkerError> {
        Shared::greet(self, agents, by)
    }
}

impl Mover for RemoteMover {
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        self.shared.adopt(grant, self.by())
    }

    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool> {
        Transfers::write(self.shared.as_ref(), items, self.by())
    }

    fn write_slots(&mut self, items: Vec<SlotWrite>) -> Vec<SlotOutcome> {
        Transfers::write_slots(self.shared.as_ref(), items, self.by())
    }

    fn read(&mut self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>) {
        Transfers::read(self.shared.as_ref(), leases, sink, self.by())
    }

    fn read_into(&mut self, leases: &[LeaseGrant], slots: Vec<Slot>) -> Vec<SlotOutcome> {
        Transfers::read_into(self.shared.as_ref(), leases, slots, self.by())
    }

    fn transfers(&self) -> Option<Arc<dyn Transfers>> {
        Some(self.shared.clone())
    }

    fn boot_ids(&self) -> BTreeMap<u64, String> {
        self.st().life.boot_ids()
    }

    fn must_report(&self) -> bool {
        self.st().life.must_report()
    }

    fn must_report_for(&self, regions: &[u64]) -> bool {
        self.st().life.must_report_for(regions)
    }

    fn reported(&mut self, sent: &BTreeMap<u64, String>) {
        // Regions that waited for the report may be mapped again now: the tick (or
        // the next window to them) does it.
        self.st().life.reported(sent);
    }

    fn take_read_error(&mut self) -> Option<String> {
        self.st().read_error.take()
    }

    fn tick(&mut self, now_ms: u64) -> Vec<u64> {
        self.shared.tick(now_ms)
    }

    fn check_agents(&mut self, now_ms: u64) {
        self.shared.check_agents(now_ms)
    }

    fn owns(&self, region_id: u64) -> bool {
        self.st().own.contains_key(&region_id)
    }

    fn own_regions(&self) -> Vec<u64> {
        self.st().own.keys().copied().collect()
    }

    fn forget_region(&mut self, region_id: u64) {
        let mut st = self.st();
        st.own.remove(&region_id);
        st.life.forget(region_id);
        st.reads.retain(|&(r, _, _), _| r != region_id);
        st.regs_gen += 1;
    }

    fn may_still_write(&self) -> bool {
        self.shared.iso.may_still_write()
    }

    fn release_all(&mut self) -> (usize, usize) {
        self.shared.release_all()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Fence what is still kept; slots of a peer that cannot be fenced never return
        // to the pool (a late DMA could still land in them).
        self.reclaim(Deadline::after(Duration::from_secs(1)));
        let lost = self.iso.abandon();
        if lost > 0 {
            log::warn!("{lost} staging slot(s) stay out of use: their peer could not be fenced");
        }
    }
}
