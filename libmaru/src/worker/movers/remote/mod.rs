//! `remote_cxl`: WRITE/READ between the staging slots of this host and regions of
//! memory nodes, over a one-sided transport.
//!
//! - [`RemoteMover`] (here): the driver, one per pool: the transport, the staging
//!   slots, the agents' control and probe connections, the in-flight budget; its
//!   state ([`RemoteState`]) is part of the pool core, under the pool's one lock;
//! - `agents`: the control connections to agents, their probes, and the region
//!   lifecycle (boot ids, restarts, silence) they feed (`worker::lifecycle`);
//! - `link`: an agent's control connection, used by one caller at a time;
//! - `post`: a window of transfers posted one batch per peer and settled;
//! - `isolation`: the slots of transfers of unknown outcome, kept until their peer
//!   is fenced;
//! - `windows`: the schedule of a request's windows, the data path's in-flight
//!   budget, and what a store or load posts window by window.
//!
//! No lock is held across a round trip, a connect or a fence: the core's lock is
//! taken to look things up and record outcomes only; a round trip to an agent holds
//! that agent's control connection (taken for the call, see `link`), and every such
//! wait made for a request ends by the request's deadline.

mod agents;
pub(crate) mod isolation;
pub(crate) mod link;
mod post;
pub mod windows;

use super::{ReadSink, SlotOutcome, SlotWrite, WriteItem};
use crate::net::{ClientOptions, Link};
use crate::transport::Transport;
use crate::wire::meta::{LeaseGrant, PageGrant};
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::pool::core::{CoreCell, PoolCore};
pub(crate) use crate::worker::pool::peers::{AgentConn, OwnRegion, ReadTarget, RemoteState};
use crate::worker::staging::{Slot, StagingSlots};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use windows::InFlightBudget;
use windows::{Given, GivenWindows, LoadWindows, StoreWindows};

/// The core, locked, seen as the remote mover's state.
pub(super) struct StateGuard<'a>(MutexGuard<'a, PoolCore>);

impl Deref for StateGuard<'_> {
    type Target = RemoteState;
    fn deref(&self) -> &RemoteState {
        // A remote mover's pool core has remote state from its start (`Mover::remote`).
        self.0.remote.as_ref().unwrap_or_else(|| unreachable!())
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut RemoteState {
        self.0.remote.as_mut().unwrap_or_else(|| unreachable!())
    }
}

/// `remote_cxl`: WRITE/READ between staging slots and regions of memory nodes.
///
/// Requests of one handler run side by side: its state (agents, own regions, read
/// registrations, the region lifecycle) is in the pool core, behind its one short
/// lock, taken to plan a window and to settle it, never while a window is on the
/// wire, its slots are filled or emptied, an agent is called or a peer connected or
/// fenced.
pub struct RemoteMover {
    core: Arc<CoreCell>,
    nic: Arc<dyn Transport>,
    staging: StagingSlots,
    /// A request's timeout (`timeout_ms`): the deadline of the calls the mover makes
    /// outside requests (the tick's maps again, a release).
    timeout: Duration,
    /// Bytes in flight of the windowed transfers of this data path (all its pools).
    budget: Arc<InFlightBudget>,
    /// Store slots held by this mover's copying store windows on the wire (they come
    /// back within a transfer; see `StoreWindows::slots`).
    store_slots_on_wire: AtomicUsize,
    /// A second, short-timeout connection per agent for probes, idle ones (a probe
    /// takes its agent's out while it waits on it).
    probes: Mutex<HashMap<String, Link>>,
    agent_opts: ClientOptions,
}

impl RemoteMover {
    /// A mover over `nic` and `staging`, reaching agents with `agent_opts`; it makes
    /// the pool core its state lives in (the pool takes it: `core`).
    pub fn new(
        nic: Arc<dyn Transport>,
        staging: StagingSlots,
        agent_opts: ClientOptions,
        timeout: Duration,
        budget: Arc<InFlightBudget>,
    ) -> RemoteMover {
        let state = RemoteState::new(agent_opts.clone());
        RemoteMover {
            core: Arc::new(CoreCell::new(PoolCore::new(1, Some(state)))),
            nic,
            staging,
            timeout,
            budget,
            store_slots_on_wire: AtomicUsize::new(0),
            probes: Mutex::new(HashMap::new()),
            agent_opts,
        }
    }

    /// The pool core this mover's state is in.
    pub(crate) fn core(&self) -> Arc<CoreCell> {
        self.core.clone()
    }

    /// The state, under the core's lock.
    pub(super) fn lock(&self) -> StateGuard<'_> {
        StateGuard(self.core.lock())
    }

    /// Copies each window into store slots while the window ahead of it is on the
    /// wire (see `windows`); stores never wait for a slot: with none free and nothing
    /// in flight, the rest is skipped.
    pub fn write(&self, items: &[WriteItem<'_>], by: Deadline) -> Vec<bool> {
        let mut w = StoreWindows {
            m: self,
            items,
            ok: vec![false; items.len()],
            by,
        };
        let posted = windows::run(&mut w, &self.budget);
        let ok = w.ok;
        if posted < items.len() {
            let line = self.core.lock().skipped(
                crate::worker::skips::SkipReason::NoSlot,
                (items.len() - posted) as u64,
                now_ms(),
                "remote_cxl store staging",
            );
            if let Some(line) = line {
                log::warn!("{line}");
            }
        }
        ok
    }

    /// From the caller's slots, window by window (see `windows`).
    pub fn write_slots(&self, items: Vec<SlotWrite>, by: Deadline) -> Vec<SlotOutcome> {
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
    /// `windows`). After a window that failed, nothing more is handed over.
    pub fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>, by: Deadline) {
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

    /// Into the caller's slots, window by window (see `windows`); every lease is
    /// tried.
    pub fn read_into(
        &self,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
        by: Deadline,
    ) -> Vec<SlotOutcome> {
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
}

impl Drop for RemoteMover {
    fn drop(&mut self) {
        // Fence what is still kept; slots of a peer that cannot be fenced never return
        // to the pool (a late DMA could still land in them).
        self.reclaim(Deadline::after(Duration::from_secs(1)));
        let lost = self.lock().iso.abandon();
        if lost > 0 {
            log::warn!("{lost} staging slot(s) stay out of use: their peer could not be fenced");
        }
    }
}

/// Regions and map replies for the unit tests of the remote state and the pool core.
#[cfg(test)]
pub(crate) mod fixtures {
    use crate::wire::agent::{AgentReply, MapReply};
    use crate::wire::meta::RegionGrant;

    /// Pages of the test regions.
    pub const PAGE: u64 = 64 << 10;

    /// Region `id` of 128 pages, served by `agent`.
    pub fn grant(id: u64, agent: &str) -> RegionGrant {
        serde_json::from_value(serde_json::json!({
            "handle": {"region_id": id, "offset": id << 30, "length": 128 * PAGE,
                       "token": "00".repeat(16)},
            "pool": {"pool_id": 0, "path": "/dev/shm/pool", "uuid": "u", "kind": "file",
                     "total": 1u64 << 40, "free": 1u64 << 40, "align": PAGE, "draining": 0},
            "agent": agent, "page_size": PAGE, "pages": 128
        }))
        .unwrap_or_else(|e| panic!("a test region: {e}"))
    }

    /// An agent's reply to the map of region `id`, from a node on `boot`.
    pub fn mapped(id: u64, boot: &str) -> AgentReply {
        AgentReply::Mapped(MapReply {
            region_id: id,
            addr: 0x10000,
            rkey: 42,
            length: 128 * PAGE,
            offset_in_region: 0,
            transport: serde_json::Value::Null,
            boot_id: boot.into(),
        })
    }
}
