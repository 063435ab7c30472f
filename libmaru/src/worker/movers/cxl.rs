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

    /// A mover with the given prefaulter (tests: one whose kernel refuses), whose
    /// mappings are registered with the memory hook in force now.
    pub fn with_prefaulter(prefault: Option<Prefaulter>) -> CxlMover {
        CxlMover {
            maps: Mutex::new(Maps {
                hooks: MappingHooks::new(crate::worker::hook::memory_hook()),
                ..Maps::default()
            }),
            prefault: Mutex::new(prefault),
        }
    }

    /// The mover with its mappings registered with `hook` (its handler's).
    pub fn with_hook(self, hook: crate::worker::hook::MemoryHook) -> CxlMover {
        self.maps().hooks = MappingHooks::new(hook);
        self
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

    /// Copies each chunk into its page; true where the bytes are complete. The
    /// mappings of the batch's regions are looked up once, under one short lock (a
    /// region forgotten before the call is not written into; one being written is not
    /// given back before its store ends, see `PoolCore::mark_writing`), and the copies
    /// run without it, with one store fence for the whole batch.
    pub fn write(&self, items: &[WriteItem<'_>]) -> Vec<bool> {
        let maps = self.own_mappings(items.iter().map(|it| it.page.region_id));
        let mut ok = vec![false; items.len()];
        let mut pieces = Vec::with_capacity(items.len());
        for ((it, map), done) in items.iter().zip(&maps).zip(ok.iter_mut()) {
            let Some(map) = map else { continue };
            match map.writable_range(it.page.offset as usize, it.data.len()) {
                Ok(dst) => {
                    pieces.push((dst, it.data.as_ptr(), it.data.len()));
                    *done = true;
                }
                Err(e) => log::debug!("write into region {}: {e}", it.page.region_id),
            }
        }
        // SAFETY: each destination lies inside a writable, unprotected mapping that
        // `maps` keeps mapped until the copies end (`writable_range`); pages are
        // distinct per chunk of a store, and the sources are the caller's memory, not
        // these mappings.
        unsafe { crate::dax::copy::copy_pieces(&pieces, true) };
        drop(maps);
        ok
    }

    /// The writable mappings of these regions, in order, under one lock (`None`: not
    /// an own region now).
    fn own_mappings(&self, regions: impl Iterator<Item = u64>) -> Vec<Option<Arc<Mapping>>> {
        let maps = self.maps();
        per_region(regions, |&r| r, |&r| maps.own.get(&r).cloned())
    }

    /// Copies from the caller's slots (see `write`); each slot comes back.
    pub fn write_slots(&self, items: Vec<SlotWrite>) -> Vec<SlotOutcome> {
        let writes: Vec<WriteItem<'_>> = items
            .iter()
            .map(|it| WriteItem {
                page: it.page,
                data: &it.slot.bytes()[..it.len.min(it.slot.len())],
            })
            .collect();
        let ok = self.write(&writes);
        drop(writes);
        items
            .into_iter()
            .zip(ok)
            .map(|(it, ok)| SlotOutcome {
                ok,
                slot: Some(it.slot),
            })
            .collect()
    }

    /// The read-only mapping of a lease's region (made the first time), under the
    /// caller's lock.
    fn reader_in(maps: &mut Maps, l: &LeaseGrant) -> Option<Arc<Mapping>> {
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

    /// The view of a lease in its mapping, if the lease lies inside it.
    fn view_of(map: Arc<Mapping>, l: &LeaseGrant) -> Option<View> {
        let (offset, len) = (l.offset as usize, l.length as usize);
        map.as_slice().ok()?.get(offset..offset.checked_add(len)?)?;
        Some(View { map, offset, len })
    }

    /// The leased bytes in place: this host's read-only mapping of the region.
    pub fn view(&self, l: &LeaseGrant) -> Option<View> {
        let map = Self::reader_in(&mut self.maps(), l)?;
        Self::view_of(map, l)
    }

    /// The views of a batch's leases, their mappings looked up under one lock (a
    /// batch's leases lie in a few regions: one `Arc` each).
    pub fn views(&self, leases: &[LeaseGrant]) -> Vec<Option<View>> {
        let mut maps = self.maps();
        let found = per_region(
            leases.iter(),
            |l| l.region_id,
            |l| Self::reader_in(&mut maps, l),
        );
        drop(maps);
        found
            .into_iter()
            .zip(leases)
            .map(|(m, l)| Self::view_of(m?, l))
            .collect()
    }

    /// Hands each lease's bytes to `sink(i, bytes)` from its view (no lock held
    /// while `sink` runs).
    pub fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>) {
        for (i, v) in self.views(leases).into_iter().enumerate() {
            if let Some(v) = v {
                sink(i, v.bytes());
            }
        }
    }

    /// Copies each lease's bytes into the slot of the same index.
    pub fn read_into(&self, leases: &[LeaseGrant], slots: Vec<Slot>) -> Vec<SlotOutcome> {
        self.views(leases)
            .into_iter()
            .zip(slots)
            .map(|(v, mut s)| {
                let ok = match v {
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

/// `find(item)` for each item in order, called once per run of items of one region
/// (`region(item)`): a batch's pages or leases lie in a region or two, one `Arc` each.
fn per_region<I, T: Clone>(
    items: impl Iterator<Item = I>,
    region: impl Fn(&I) -> u64,
    mut find: impl FnMut(&I) -> T,
) -> Vec<T> {
    let mut last: Option<(u64, T)> = None;
    items
        .map(|it| {
            let id = region(&it);
            match &last {
                Some((at, found)) if *at == id => found.clone(),
                _ => {
                    let found = find(&it);
                    last = Some((id, found.clone()));
                    found
                }
            }
        })
        .collect()
}

fn local_path(uuid: &str, path: &str) -> Result<String, WorkerError> {
    match dax::scan_uuid(path) {
        Ok(Some(u)) if u == uuid => Ok(path.to_string()),
        Ok(_) => Err(WorkerError::Config(format!("device {path} here is not the pool's device (uuid {uuid}): is this host attached to that CXL memory?"))),
        Err(e) => Err(WorkerError::Config(format!("{e}: backend cxl needs the pool's device on this host"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dax::test_support::ScratchPath;
    use crate::wire::meta::PageGrant;

    const REGION: u64 = 2 << 20;

    /// A mover whose own region 7 is a fresh 2 MiB file (no prefaulting).
    fn mover_with_region(path: &ScratchPath) -> CxlMover {
        std::fs::write(&path.0, vec![0u8; REGION as usize]).expect("scratch file");
        let m = dax::map_range(
            path.as_str(),
            dax::DeviceKind::File,
            0,
            REGION,
            REGION,
            true,
        )
        .expect("map");
        let mover = CxlMover::with_prefault(false);
        mover.maps().own.insert(7, Arc::new(m));
        mover
    }

    fn page(region_id: u64, offset: u64) -> PageGrant {
        PageGrant {
            region_id,
            page: offset / (256 << 10),
            offset,
            length: 256 << 10,
        }
    }

    /// A batch is written with one lookup of its regions: every chunk of an own
    /// region lands at its page, and a chunk of a region that is not the mover's
    /// (forgotten, or never adopted) or out of the mapping is not written and says so.
    #[test]
    fn a_batch_lands_in_own_regions_only() {
        let path = ScratchPath::new("cxl-batch");
        let mover = mover_with_region(&path);
        let big: Vec<u8> = (0..(256 << 10)).map(|i| (i % 251) as u8).collect();
        let small = [9u8; 64];
        let items = [
            WriteItem {
                page: page(7, 0),
                data: &big,
            },
            WriteItem {
                page: page(8, 0),
                data: &small,
            },
            WriteItem {
                page: page(7, 256 << 10),
                data: &small,
            },
            WriteItem {
                page: page(7, REGION - 32),
                data: &small,
            },
        ];
        assert_eq!(mover.write(&items), vec![true, false, true, false]);
        let bytes = std::fs::read(&path.0).expect("read back");
        assert_eq!(&bytes[..256 << 10], &big[..]);
        assert_eq!(&bytes[256 << 10..(256 << 10) + 64], &small[..]);
        assert!(bytes[(REGION - 32) as usize..].iter().all(|&b| b == 0));
        // Once forgotten, nothing more is written into the region.
        mover.forget(7);
        assert_eq!(mover.write(&items[..1]), vec![false]);
    }
}
