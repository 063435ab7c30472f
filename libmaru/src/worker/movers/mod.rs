//! What moves the bytes of a pool: one-sided transfers through staging slots
//! (`remote_cxl`, [`RemoteMover`]) or copies through this host's own mapping of the
//! CXL memory (`cxl`, [`CxlMover`]). The [`Mover`] trait is what a pool asks of
//! either.

mod cxl;
mod remote;

pub use cxl::CxlMover;
pub use remote::RemoteMover;

use super::clock::Deadline;
use super::error::WorkerError;
use super::prefault::PrefaultStats;
use super::staging::Slot;
use crate::dax::Mapping;
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use std::collections::BTreeMap;
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

/// Transfers that run without the pool's mover lock, side by side with other requests
/// (see `Mover::transfers`), and the adoption of a region and the tick (probes, maps
/// again, fences of kept slots), whose round trips to agents and fences must not hold
/// the pool's other users of the mover (requests, publishes, the heartbeat). Same meaning as
/// the `Mover` methods of the same names; every wait on an agent (connect,
/// handshake, call, transfer, fence) made for a request ends by the request's
/// deadline `by`.
pub trait Transfers: Send + Sync {
    fn adopt(&self, grant: &RegionGrant, by: Deadline) -> Result<(), WorkerError>;
    fn tick(&self, now_ms: u64) -> Vec<u64>;
    fn write(&self, items: &[WriteItem<'_>], by: Deadline) -> Vec<bool>;
    fn write_slots(&self, items: Vec<SlotWrite>, by: Deadline) -> Vec<SlotOutcome>;
    fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>, by: Deadline);
    fn read_into(&self, leases: &[LeaseGrant], slots: Vec<Slot>, by: Deadline) -> Vec<SlotOutcome>;
    /// Asks every agent of own regions who it is now (before a drained close).
    fn check_agents(&self, now_ms: u64);
    /// Connects to the pool's agents (at open), so that a key that does not prove
    /// fails then ([`WorkerError::Auth`]); an agent that does not answer is no error.
    fn greet(&self, agents: &[String], by: Deadline) -> Result<(), WorkerError>;
}

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
    /// Where the pool's requests move bytes without holding the mover's lock
    /// (`remote_cxl`: the mover locks its own state only to post and settle a window).
    /// `None`: through the mover's methods, under its lock (or, on `cxl`, `direct`).
    fn transfers(&self) -> Option<Arc<dyn Transfers>> {
        None
    }
    /// Boot ids of the session's regions (for heartbeats).
    fn boot_ids(&self) -> BTreeMap<u64, String>;
    /// Whether the region is one of the session's this mover writes into.
    fn owns(&self, region_id: u64) -> bool {
        self.own_regions().contains(&region_id)
    }
    /// True when the pool copies chunks itself through `direct` mappings, without
    /// this mover's lock (`cxl`); else every transfer goes through the mover.
    fn writes_direct(&self) -> bool {
        false
    }
    /// The writable mapping of one of the session's regions, for a copy that runs
    /// without the mover's lock (`None`: not a region it writes into, or not a mover
    /// that maps them).
    fn direct(&self, _region_id: u64) -> Option<Arc<Mapping>> {
        None
    }
    /// The session's regions this mover can write into (for heartbeats, beside
    /// `boot_ids`: maru-server answers which are no longer the session's).
    fn own_regions(&self) -> Vec<u64>;
    /// maru-server no longer counts the region among the session's (the RM took it
    /// back): write nothing more into it and forget it. Nothing is released: the
    /// region is no longer this session's to release.
    fn forget_region(&mut self, region_id: u64);
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
    /// The writable mapping of one of the session's own regions, for writes in place by
    /// the caller (`cxl`; see `pool::in_place`). `None` where the mover has none
    /// (`remote_cxl`) or the region is no longer the session's.
    fn own_mapping(&self, _region_id: u64) -> Option<Arc<Mapping>> {
        None
    }
    /// True when the caller may write chunks into own regions in place (`own_mapping`).
    fn writes_in_place(&self) -> bool {
        false
    }
    /// The mappings this mover holds now, per region (own ones writable, others
    /// read-only; an own region read in place also has its read-only mapping, listed
    /// after the writable one), for region views (`cxl`). Empty where it holds none.
    fn mappings(&self) -> Vec<(u64, Arc<Mapping>)> {
        Vec::new()
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
    /// True when maru-server must hear the boot id of one of `regions` before keys are
    /// published into it (new, or its memory node rebooted). Other regions do not
    /// matter to such a publish.
    fn must_report_for(&self, _regions: &[u64]) -> bool {
        self.must_report()
    }
    /// maru-server received these boot ids (a heartbeat it answered).
    fn reported(&mut self, _sent: &BTreeMap<u64, String>) {}
    /// Why the last read that failed failed (an agent's refusal, say), once.
    fn take_read_error(&mut self) -> Option<String> {
        None
    }
}
