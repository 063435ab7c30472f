//! `cxl`: the engine's host is attached to the CXL memory; it maps its own regions
//! writable and other engines' regions read-only, and copies with memcpy. The
//! mappings are behind a short lock of their own (a lookup, or a local `mmap`); every
//! copy runs without it, through a reference to its mapping (which stays mapped while
//! the copy uses it).

use super::{ReadSink, SlotOutcome, SlotWrite, View, WriteItem};
use crate::dax::{self, Mapping};
use crate::wire::meta::{LeaseGrant, RegionGrant};
use crate::worker::error::WorkerError;
use crate::worker::hook::MappingHooks;
use crate::worker::prefault::{PrefaultStats, Prefaulter};
use crate::worker::staging::Slot;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// `cxl`: this host maps the regions itself and copies with memcpy.
pub struct CxlMover {
    maps: Mutex<Maps>,
    /// Faults the pages of each adopted region in, off the store path (`None`: off).
    prefault: Mutex<Option<Prefaulter>>,
}

#[derive(Default)]
struct Maps {
    /// Memory-hook registrations of the mappings below (declared first: each is
    /// unregistered before its mapping can go).
    hooks: MappingHooks,
    /// The session's own regions, writable; shared with the prefault thread while it
    /// populates them.
    own: HashMap<u64, Arc<Mapping>>,
    /// Read-only mappings of regions (other engines' and, for views, our own), shared
    /// with the views handed out so that a view outlives neither its mapping nor
    /// keeps one alive longer than it needs.
    readers: HashMap<u64, Arc<Mapping>>,
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
            maps: Mutex::new(Maps::default()),
            prefault: Mutex::new(prefault),
        }
    }

    fn maps(&self) -> MutexGuard<'_, Maps> {
        self.maps.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn prefaulter(&self) -> MutexGuard<'_, Option<Prefaulter>> {
        self.prefault.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Maps one of the session's own regions writable (and has it prefaulted).
    pub fn adopt(&self, grant: &RegionGrant) -> Result<(), WorkerError> {
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
        if let Some(p) = self.prefaulter().as_mut() {
            // Its pages are faulted in by the time the stores reach them (or while
            // they do); the bytes stay as they are.
            p.submit(m.clone());
        }
        let mut maps = self.maps();
        maps.hooks.add(h.region_id, &m);
        maps.own.insert(h.region_id, m);
        Ok(())
    }

    /// The writable mapping of one of the session's own regions (None once it was
    /// forgotten: nothing more is copied into it).
    pub fn own_mapping(&self, region_id: u64) -> Option<Arc<Mapping>> {
        self.maps().own.get(&region_id).cloned()
    }

    /// Copies each chunk into its page, looking its region's mapping up chunk by
    /// chunk (so no copy starts into a region after it was forgotten); the copies run
    /// without the lock. True where the bytes are complete.
    pub fn write(&self, items: &[WriteItem<'_>]) -> Vec<bool> {
        items
            .iter()
            .map(|it| {
                let Some(map) = self.own_mapping(it.page.region_id) else {
                    return false;
                };
                match map.write_at(it.page.offset as usize, it.data) {
                    Ok(()) => true,
                    Err(e) => {
                        log::debug!("write into region {}: {e}", it.page.region_id);
                        false
                    }
                }
            })
            .collect()
    }

    /// Copies from the caller's slots (see `write`); each slot comes back.
    pub fn write_slots(&self, items: Vec<SlotWrite>) -> Vec<SlotOutcome> {
        items
            .into_iter()
            .map(|it| {
                let data = &it.slot.bytes()[..it.len.min(it.slot.len())];
                let ok = self.write(&[WriteItem {
                    page: it.page,
                    data,
                }])[0];
                SlotOutcome {
                    ok,
                    slot: Some(it.slot),
                }
            })
            .collect()
    }

    /// The read-only mapping of a lease's region (made the first time).
    fn reader(&self, l: &LeaseGrant) -> Option<Arc<Mapping>> {
        let mut maps = self.maps();
        if let Some(m) = maps.readers.get(&l.region_id) {
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
        maps.hooks.add(l.region_id, &m);
        maps.readers.insert(l.region_id, m.clone());
        Some(m)
    }

    /// The leased bytes in place: this host's read-only mapping of the region.
    pub fn view(&self, l: &LeaseGrant) -> Option<View> {
        let map = self.reader(l)?;
        let (offset, len) = (l.offset as usize, l.length as usize);
        map.as_slice().ok()?.get(offset..offset + len)?;
        Some(View { map, offset, len })
    }

    /// Hands each lease's bytes to `sink(i, bytes)` from its view (no lock held
    /// while `sink` runs).
    pub fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>) {
        for (i, l) in leases.iter().enumerate() {
            if let Some(v) = self.view(l) {
                sink(i, v.bytes());
            }
        }
    }

    /// Copies each lease's bytes into the slot of the same index.
    pub fn read_into(&self, leases: &[LeaseGrant], slots: Vec<Slot>) -> Vec<SlotOutcome> {
        leases
            .iter()
            .zip(slots)
            .map(|(l, mut s)| {
                let ok = match self.view(l) {
                    Some(v) if v.bytes().len() <= s.len() && !v.bytes().is_empty() => {
                        let b = v.bytes();
                        crate::dax::copy::copy_out(&mut s.bytes_mut()[..b.len()], b);
                        true
                    }
                    _ => false,
                };
                SlotOutcome { ok, slot: Some(s) }
            })
            .collect()
    }

    /// The mappings held now, per region (own ones writable, then the read-only
    /// ones; an own region read in place has both).
    pub fn mappings(&self) -> Vec<(u64, Arc<Mapping>)> {
        let maps = self.maps();
        maps.own
            .iter()
            .chain(maps.readers.iter())
            .map(|(r, m)| (*r, m.clone()))
            .collect()
    }

    /// True while regions are prefaulted: the next one is then taken ahead of need,
    /// so that faulting it in happens off the store path.
    pub fn wants_lead(&self) -> bool {
        self.prefaulter().as_ref().is_some_and(|p| !p.stats().off)
    }

    pub fn prefault_stats(&self) -> Option<PrefaultStats> {
        self.prefaulter().as_ref().map(Prefaulter::stats)
    }

    /// The region is no longer the session's: its mappings go once the copies and
    /// views that hold them let go (the memory hook hears of it first).
    pub fn forget(&self, region_id: u64) {
        let mut maps = self.maps();
        maps.hooks.remove_region(region_id);
        maps.own.remove(&region_id);
        maps.readers.remove(&region_id);
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
