//! `remote_cxl`: WRITE/READ between the staging slots of this host and regions of
//! memory nodes, over a one-sided transport.
//!
//! - `agents`: the control connections to agents, their probes, and the region
//!   lifecycle (boot ids, restarts, silence) they feed (`worker::lifecycle`);
//! - `post`: a window of transfers posted one batch per peer and settled, with
//!   transfer isolation for what did not finish;
//! - `requests`: what a store or load posts window by window (`worker::windows`).

mod agents;
mod post;
mod requests;

use super::{Mover, ReadSink, SlotOutcome, SlotWrite, Transfers, WriteItem};
use crate::net::{ClientOptions, Link};
use crate::transport::{PeerId, Transport};
use crate::wire::agent::{AgentReply, AgentRequest, MapReply};
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use crate::worker::clock::now_ms;
use crate::worker::error::WorkerError;
use crate::worker::lifecycle::Lifecycle;
use crate::worker::staging::{Slot, StagingSlots};
use crate::worker::transfer::Isolation;
use crate::worker::windows::{self, InFlightBudget};
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
    /// The control connection. Behind a lock of its own: a load's `map_read`s use it
    /// without the state's lock (`Shared::map_reads`); everything else under both.
    link: Arc<Mutex<Link>>,
    peer: Option<PeerId>,
}

impl AgentConn {
    fn link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `remote_cxl`: WRITE/READ between staging slots and regions of memory nodes.
///
/// Requests of one handler run side by side: the mover's state (agents, own regions,
/// read registrations, the region lifecycle) is behind a short lock of its own, taken
/// to post a window and to settle it, never while a window is on the wire or its slots
/// are filled or emptied (see [`Shared`]). The pool hands requests to [`Shared`]
/// without its own mover lock (`Mover::transfers`).
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
    /// How long a window's transfers may take.
    timeout: Duration,
    /// Bytes in flight of the windowed transfers of this data path (all its pools).
    budget: Arc<InFlightBudget>,
    /// Store slots held by this mover's copying store windows on the wire (they come
    /// back within a transfer; see `StoreWindows::slots`).
    store_slots_on_wire: AtomicUsize,
}

/// The mover's state, under `Shared`'s lock. Held to look things up, post a window,
/// settle one, to connect to an agent (its control connection or transport peer, when
/// there is none), and for the maps that bring an agent's regions back after a
/// restart. The round trips of normal running go without it, each holding only the
/// connection it uses: the `map` of a region taken (`Shared::adopt`), a load's
/// `map_read`s of other engines' ranges (`Shared::map_reads`) and the probes of the
/// tick (`Shared::probe`); when a connection is down, or registrations may have gone
/// meanwhile (`regs_gen`), the call is made again under the lock.
pub(super) struct RemoteState {
    nic: Arc<dyn Transport>,
    iso: Arc<Isolation>,
    agent_opts: ClientOptions,
    agents: HashMap<String, AgentConn>,
    own: HashMap<u64, OwnRegion>,
    /// Read registrations of leased ranges: (region, offset, length) → where.
    reads: HashMap<(u64, u64, u64), ReadTarget>,
    /// Counts the times registrations at agents may have gone (`forget_reads`: a
    /// control connection dropped or found dead, an agent restarted, a region
    /// forgotten): a `map` or `map_read` made without the lock is recorded only if
    /// none went since it started.
    regs_gen: u64,
    last_skip_log: Option<u64>,
    /// The rules of the own regions' lifecycle (boot ids, restarts, silent agents):
    /// this mover feeds it what agents answer and carries out what it decides.
    life: Lifecycle,
    /// A second, short-timeout connection per agent for probes (used without the
    /// state's lock, `Shared::probe`; probes come from the pool's tick, one at a time).
    probes: HashMap<String, Arc<Mutex<Link>>>,
    /// Why the last failed read failed, for the caller.
    read_error: Option<String>,
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
                    nic: nic.clone(),
                    iso: iso.clone(),
                    agent_opts,
                    agents: HashMap::new(),
                    own: HashMap::new(),
                    reads: HashMap::new(),
                    regs_gen: 0,
                    last_skip_log: None,
                    life: Lifecycle::new(),
                    probes: HashMap::new(),
                    read_error: None,
                }),
                nic,
                iso,
                staging,
                timeout,
                budget,
                store_slots_on_wire: AtomicUsize::new(0),
            }),
        }
    }

    fn st(&self) -> MutexGuard<'_, RemoteState> {
        self.shared.lock()
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

    fn reclaim(&mut self) {
        let fenced = self.iso.reclaim(self.nic.as_ref());
        if !fenced.is_empty() {
            self.forget_peers(&fenced);
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
    fn adopt(&self, grant: &RegionGrant) -> Result<(), WorkerError> {
        Shared::adopt(self, grant)
    }

    fn tick(&self, now_ms: u64) -> Vec<u64> {
        Shared::tick(self, now_ms)
    }

    /// Copies each window into store slots while the window ahead of it is on the
    /// wire (see `worker::windows`); stores never wait for a slot: with none free and
    /// nothing in flight, the rest is skipped.
    fn write(&self, items: &[WriteItem<'_>]) -> Vec<bool> {
        let mut w = StoreWindows {
            m: self,
            items,
            ok: vec![false; items.len()],
        };
        let posted = windows::run(&mut w, &self.budget);
        let ok = w.ok;
        if posted < items.len() {
            self.lock().log_skip(items.len() - posted);
        }
        ok
    }

    /// From the caller's slots, window by window (see `worker::windows`).
    fn write_slots(&self, items: Vec<SlotWrite>) -> Vec<SlotOutcome> {
        let pages: Vec<(PageGrant, usize)> = items.iter().map(|it| (it.page, it.len)).collect();
        let given: Vec<Option<Slot>> = items.into_iter().map(|it| Some(it.slot)).collect();
        let mut w = GivenWindows {
            m: self,
            given,
            out: Vec::with_capacity(pages.len()),
            kind: Given::Write(&pages),
        };
        windows::run(&mut w, &self.budget);
        w.into_outcomes()
    }

    /// Each window's slots are handed to `sink` and then take a later window (see
    /// `worker::windows`). After a window that failed, nothing more is handed over.
    fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>) {
        self.map_reads(leases);
        windows::run(
            &mut LoadWindows {
                m: self,
                leases,
                sink,
            },
            &self.budget,
        );
    }

    /// Into the caller's slots, window by window (see `worker::windows`); every lease
    /// is tried.
    fn read_into(&self, leases: &[LeaseGrant], slots: Vec<Slot>) -> Vec<SlotOutcome> {
        let n = leases.len().min(slots.len());
        self.map_reads(&leases[..n]);
        let given: Vec<Option<Slot>> = slots.into_iter().map(Some).collect();
        let mut w = GivenWindows {
            m: self,
            given,
            out: Vec::with_capacity(n),
            kind: Given::Read(&leases[..n]),
        };
        windows::run(&mut w, &self.budget);
        w.into_outcomes()
    }
}

impl Mover for RemoteMover {
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        self.shared.adopt(grant)
    }

    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool> {
        self.shared.write(items)
    }

    fn write_slots(&mut self, items: Vec<SlotWrite>) -> Vec<SlotOutcome> {
        self.shared.write_slots(items)
    }

    fn read(&mut self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>) {
        self.shared.read(leases, sink)
    }

    fn read_into(&mut self, leases: &[LeaseGrant], slots: Vec<Slot>) -> Vec<SlotOutcome> {
        self.shared.read_into(leases, slots)
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
        let mut st = self.st();
        st.life.reported(sent);
        // Regions that waited for the report may be mapped again now.
        st.remap_failed_agents();
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

    fn reclaim(&mut self) {
        self.st().reclaim()
    }

    fn may_still_write(&self) -> bool {
        self.shared.iso.may_still_write()
    }

    fn release_all(&mut self) -> (usize, usize) {
        self.st().release_all()
    }
}

impl RemoteState {
    /// Records a region taken, mapped at its agent (`reply` to the map).
    fn adopted(
        &mut self,
        grant: &RegionGrant,
        agent: String,
        reply: AgentReply,
    ) -> Result<(), WorkerError> {
        let m = match reply {
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

impl Drop for Shared {
    fn drop(&mut self) {
        // Fence what is still kept; slots of a peer that cannot be fenced never return
        // to the pool (a late DMA could still land in them).
        self.lock().reclaim();
        let lost = self.iso.abandon();
        if lost > 0 {
            log::warn!("{lost} staging slot(s) stay out of use: their peer could not be fenced");
        }
    }
}
