//! What moves the bytes of a pool: copies through this host's own mapping of the CXL
//! memory (`cxl`, [`CxlMover`]) or one-sided transfers through staging slots
//! (`remote_cxl`, [`RemoteMover`], with everything only it needs under `remote/`).
//! [`Mover`] is the one trait a pool holds and asks.

mod cxl;
pub(crate) mod remote;

pub use cxl::CxlMover;
pub use remote::RemoteMover;

use super::clock::Deadline;
use super::error::WorkerError;
use super::pool::core::CoreCell;
use super::pool::peers::WriteTargets;
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

/// What a pool asks of its mover: `cxl`'s copies through this host's mapping, or
/// `remote_cxl`'s transfers (its state in the pool core it hands the pool: `core`).
/// What only one backend does has a default that does nothing.
pub trait Mover: Send + Sync {
    /// The pool core the mover's state lives in (`remote_cxl`); `None`: the pool makes
    /// one.
    fn core(&self) -> Option<Arc<CoreCell>> {
        None
    }
    /// Makes a region the session took usable (mapped), by `by`.
    fn adopt(&self, grant: &RegionGrant, by: Deadline) -> Result<(), WorkerError>;
    /// Writes chunks into their pages, by `by`; true where the bytes are complete.
    fn write(&self, items: &[WriteItem<'_>], to: &WriteTargets, by: Deadline) -> Vec<bool>;
    /// Writes from the caller's slots; each slot comes back in its outcome.
    fn write_slots(
        &self,
        items: Vec<SlotWrite>,
        to: &WriteTargets,
        by: Deadline,
    ) -> Vec<SlotOutcome>;
    /// Hands each lease's bytes to `sink`, by `by`.
    fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>, by: Deadline);
    /// Reads into the caller's slots; each slot comes back in its outcome.
    fn read_into(&self, leases: &[LeaseGrant], slots: Vec<Slot>, by: Deadline) -> Vec<SlotOutcome>;
    /// Views of leased bytes in place (`cxl`), one lookup for the batch.
    fn views(&self, leases: &[LeaseGrant]) -> Vec<Option<View>> {
        vec![None; leases.len()]
    }
    /// This host's writable mapping of an own region (`cxl`).
    fn own_mapping(&self, _region_id: u64) -> Option<Arc<Mapping>> {
        None
    }
    /// Every mapping this host holds (`cxl`).
    fn mappings(&self) -> Vec<(u64, Arc<Mapping>)> {
        Vec::new()
    }
    /// The region is no longer the pool's: unmap it (`cxl`).
    fn forget(&self, _region_id: u64) {}
    /// The pool's tick, every wait by `by`; returns regions of agents silent too
    /// long, to give back.
    fn tick(&self, _now_ms: u64, _by: Deadline) -> Vec<u64> {
        Vec::new()
    }
    /// Probes the agents that are away.
    fn probe_away(&self, _now_ms: u64, _by: Deadline) {}
    /// Asks the agents of own regions who they are (before a close's heartbeat).
    fn check_agents(&self, _now_ms: u64) {}
    /// Connects to the pool's agents at open, so a wrong key fails the open.
    fn greet(&self, _agents: &[String], _by: Deadline) -> Result<(), WorkerError> {
        Ok(())
    }
    /// Releases the regions at their agents (a lost session of another maru-server
    /// run): (released, failed).
    fn release_all(&self) -> (usize, usize) {
        (0, 0)
    }
    /// Whether the next region is to be taken ahead of need (`cxl` prefaults it).
    fn wants_lead(&self) -> bool {
        false
    }
    fn prefault_stats(&self) -> Option<PrefaultStats> {
        None
    }
    /// Whether callers may write in place (`cxl`); also: no agents to be away.
    fn writes_in_place(&self) -> bool {
        false
    }
}

/// A `cxl` mover, its regions prefaulted in the background, or not.
pub fn cxl(prefault: bool) -> Box<dyn Mover> {
    Box::new(CxlMover::with_prefault(prefault))
}
