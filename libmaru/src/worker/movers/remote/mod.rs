//! `remote_cxl`: one-sided WRITE/READ between staging slots and memory nodes.
//! [`RemoteMover`] is the driver (its state, [`RemoteState`], is in the pool core):
//! `windows` (stores and loads, window by window), `state` (the rules of the state:
//! agents, reads, a window's plan and settlement), `agents` and `link` (control
//! connections), `isolation` (slots of transfers of unknown outcome).

mod agents;
pub(crate) mod isolation;
pub(crate) mod link;
mod state;
pub mod windows;

use crate::net::{ClientOptions, Link};
use crate::transport::Transport;
use crate::worker::clock::Deadline;
use crate::worker::pool::core::{CoreCell, CoreGuard, PoolCore};
pub(crate) use crate::worker::pool::peers::{
    AgentConn, OwnRegion, ReadTarget, RemoteState, WriteTargets, WriteTo,
};
use crate::worker::staging::StagingSlots;
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The core, locked, seen as the remote mover's state.
pub(super) struct StateGuard<'a>(CoreGuard<'a>);

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

/// The bytes the windowed transfers of one data path may have in flight together
/// before a request's second window waits: two requests of one handler each get two
/// windows, more keep one each (figures in `docs/worker.md`, "Windows").
pub const IN_FLIGHT_BUDGET: u64 = 8 << 20;
/// The bytes in flight of the windowed transfers of one data path (shared by its
/// pools' movers), against [`IN_FLIGHT_BUDGET`].
#[derive(Debug, Default)]
pub struct InFlightBudget {
    bytes: AtomicU64,
}

impl InFlightBudget {
    /// Bytes in flight now.
    #[cfg(test)]
    pub fn in_flight(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Counts `n` bytes in flight: always for a request's `first` window, else only
    /// within the limit.
    pub(super) fn take(&self, n: u64, first: bool) -> Option<InFlight<'_>> {
        if first {
            self.bytes.fetch_add(n, Ordering::Relaxed);
            return Some(InFlight(self, n));
        }
        self.bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
                (cur + n <= IN_FLIGHT_BUDGET).then_some(cur + n)
            })
            .ok()
            .map(|_| InFlight(self, n))
    }
}

/// A window's share of its budget, given back when it is dropped.
pub(super) struct InFlight<'b>(&'b InFlightBudget, u64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.bytes.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// `remote_cxl`'s driver: its state is in the pool core, locked to plan and settle a
/// window, never across a transfer, a copy, a call, a connect or a fence.
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
    /// A mover and the pool core its state lives in (the pool takes it: `core`).
    pub fn new(
        nic: Arc<dyn Transport>,
        staging: StagingSlots,
        agent_opts: ClientOptions,
        timeout: Duration,
        budget: Arc<InFlightBudget>,
    ) -> RemoteMover {
        let state = RemoteState::new(agent_opts.clone());
        RemoteMover {
            core: Arc::new(CoreCell::new(PoolCore::new(Some(state)))),
            nic,
            staging,
            timeout,
            budget,
            store_slots_on_wire: AtomicUsize::new(0),
            probes: Mutex::new(HashMap::new()),
            agent_opts,
        }
    }

    /// The state, under the core's lock.
    pub(super) fn lock(&self) -> StateGuard<'_> {
        StateGuard(self.core.lock())
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
