//! `cxl`: the engine's host is attached to the CXL memory; it maps its own regions
//! writable and other engines' regions read-only, and copies with memcpy.

use super::{Mover, ReadSink, View, WriteItem};
use crate::dax::{self, Mapping};
use crate::wire::meta::{LeaseGrant, RegionGrant};
use crate::worker::error::WorkerError;
use crate::worker::hook::MappingHooks;
use crate::worker::prefault::{PrefaultStats, Prefaulter};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// `cxl`: this host maps the regions itself and copies with memcpy.
pub struct CxlMover {
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
            hooks: MappingHooks::default(),
            own: HashMap::new(),
            readers: HashMap::new(),
            prefault,
        }
    }

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
        self.hooks.add(l.region_id, &m);
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
        self.hooks.add(h.region_id, &m);
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

    fn own_mapping(&self, region_id: u64) -> Option<Arc<Mapping>> {
        self.own.get(&region_id).cloned()
    }

    fn writes_in_place(&self) -> bool {
        true
    }

    fn mappings(&self) -> Vec<(u64, Arc<Mapping>)> {
        // Own regions first: an own region read in place has a read-only mapping too.
        let own = self.own.iter();
        own.chain(self.readers.iter())
            .map(|(r, m)| (*r, m.clone()))
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

    fn owns(&self, region_id: u64) -> bool {
        self.own.contains_key(&region_id)
    }

    fn writes_direct(&self) -> bool {
        true
    }

    fn direct(&self, region_id: u64) -> Option<Arc<Mapping>> {
        self.own.get(&region_id).cloned()
    }

    fn own_regions(&self) -> Vec<u64> {
        self.own.keys().copied().collect()
    }

    fn forget_region(&mut self, region_id: u64) {
        // The mapping goes once the prefault thread (if it still has it) lets go;
        // the memory hook hears of it first.
        self.hooks.remove_region(region_id);
        self.own.remove(&region_id);
        self.readers.remove(&region_id);
    }
}
