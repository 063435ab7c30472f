//! What moves the bytes of a pool: copies through this host's own mapping of the CXL
//! memory (`cxl`, [`CxlMover`]) or one-sided transfers through staging slots
//! (`remote_cxl`, [`RemoteMover`], with everything only it needs under `remote/`).
//! [`Mover`] is the one enum a pool holds and asks.

mod cxl;
pub(crate) mod remote;

pub use cxl::CxlMover;
pub use remote::RemoteMover;

use super::clock::Deadline;
use super::error::WorkerError;
use super::prefault::PrefaultStats;
use super::staging::Slot;
use crate::dax::Mapping;
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use std::sync::Arc;

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

/// What moves a pool's bytes.
pub enum Mover {
    /// This host maps the regions and copies.
    Cxl(CxlMover),
    /// One-sided WRITE/READ through the staging slots; its state is in the pool core
    /// it was made with (`RemoteMover::new`).
    Remote(RemoteMover),
}

impl Mover {
    /// `cxl`, its regions prefaulted in the background, or not.
    pub fn cxl(prefault: bool) -> Mover {
        Mover::Cxl(CxlMover::with_prefault(prefault))
    }

    /// As [`Mover::cxl`], its mappings registered with `hook` (the handler's).
    pub(crate) fn cxl_with_hook(prefault: bool, hook: crate::worker::hook::MemoryHook) -> Mover {
        Mover::Cxl(CxlMover::with_prefault(prefault).with_hook(hook))
    }

    /// Makes a region the session took usable: maps it (`cxl`: locally; `remote_cxl`:
    /// at its agent, and connects its peer), every wait by `by`.
    pub(crate) fn adopt(&self, grant: &RegionGrant, by: Deadline) -> Result<(), WorkerError> {
        match self {
            Mover::Cxl(m) => m.adopt(grant),
            Mover::Remote(m) => m.adopt(grant, by),
        }
    }

    /// Writes each item into its page; true where the bytes are complete.
    pub(crate) fn write(&self, items: &[WriteItem<'_>], by: Deadline) -> Vec<bool> {
        match self {
            Mover::Cxl(m) => m.write(items),
            Mover::Remote(m) => m.write(items, by),
        }
    }

    /// Writes from the caller's staging slots (no copy on `remote_cxl`).
    pub(crate) fn write_slots(&self, items: Vec<SlotWrite>, by: Deadline) -> Vec<SlotOutcome> {
        match self {
            Mover::Cxl(m) => m.write_slots(items),
            Mover::Remote(m) => m.write_slots(items, by),
        }
    }

    /// Hands each lease's bytes to `sink(i, bytes)` (a view valid during the call); a
    /// lease whose read failed is not handed over.
    pub(crate) fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>, by: Deadline) {
        match self {
            Mover::Cxl(m) => m.read(leases, sink),
            Mover::Remote(m) => m.read(leases, sink, by),
        }
    }

    /// Reads each lease into the slot of the same index.
    pub(crate) fn read_into(
        &self,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
        by: Deadline,
    ) -> Vec<SlotOutcome> {
        match self {
            Mover::Cxl(m) => m.read_into(leases, slots),
            Mover::Remote(m) => m.read_into(leases, slots, by),
        }
    }

    /// The leased bytes in place (`cxl`).
    pub(crate) fn view(&self, lease: &LeaseGrant) -> Option<View> {
        match self {
            Mover::Cxl(m) => m.view(lease),
            Mover::Remote(_) => None,
        }
    }

    /// The writable mapping of an own region, for writes in place (`cxl`).
    pub(crate) fn own_mapping(&self, region_id: u64) -> Option<Arc<Mapping>> {
        match self {
            Mover::Cxl(m) => m.own_mapping(region_id),
            Mover::Remote(_) => None,
        }
    }

    /// The mappings this host holds, for region views (`cxl`).
    pub(crate) fn mappings(&self) -> Vec<(u64, Arc<Mapping>)> {
        match self {
            Mover::Cxl(m) => m.mappings(),
            Mover::Remote(_) => Vec::new(),
        }
    }

    /// A region the pool no longer writes into: `cxl` unmaps it (once the copies and
    /// views holding it let go); the remote state forgot it with the pool core.
    pub(crate) fn forget(&self, region_id: u64) {
        if let Mover::Cxl(m) = self {
            m.forget(region_id)
        }
    }

    /// Periodic work (`remote_cxl`: probes, maps again, fences): the own regions
    /// whose agent has been silent too long, to give back.
    pub(crate) fn tick(&self, now_ms: u64) -> Vec<u64> {
        match self {
            Mover::Cxl(_) => Vec::new(),
            Mover::Remote(m) => m.tick(now_ms),
        }
    }

    /// Probes the agents that are away, when due (between ticks, every
    /// `lifecycle::AWAY_PROBE_EVERY_MS`).
    pub(crate) fn probe_away(&self, now_ms: u64, by: Deadline) {
        if let Mover::Remote(m) = self {
            m.probe_away(now_ms, by)
        }
    }

    /// Asks every agent of own regions who it is now (before a drained close).
    pub(crate) fn check_agents(&self, now_ms: u64) {
        if let Mover::Remote(m) = self {
            m.check_agents(now_ms)
        }
    }

    /// Proves the agent key to the pool's agents (at open).
    pub(crate) fn greet(&self, agents: &[String], by: Deadline) -> Result<(), WorkerError> {
        match self {
            Mover::Cxl(_) => Ok(()),
            Mover::Remote(m) => m.greet(agents, by),
        }
    }

    /// Releases every own region at its agent (the maru-server that knew the session
    /// restarted); (released, failed).
    pub(crate) fn release_all(&self) -> (usize, usize) {
        match self {
            Mover::Cxl(_) => (0, 0),
            Mover::Remote(m) => m.release_all(),
        }
    }

    /// Whether a region is taken ahead of need (`cxl` prefaults it).
    pub(crate) fn wants_lead(&self) -> bool {
        match self {
            Mover::Cxl(m) => m.wants_lead(),
            Mover::Remote(_) => false,
        }
    }

    pub(crate) fn prefault_stats(&self) -> Option<PrefaultStats> {
        match self {
            Mover::Cxl(m) => m.prefault_stats(),
            Mover::Remote(_) => None,
        }
    }

    /// True when the caller may write chunks into own regions in place (`cxl`).
    pub(crate) fn writes_in_place(&self) -> bool {
        matches!(self, Mover::Cxl(_))
    }
}
