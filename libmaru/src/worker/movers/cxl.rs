//! `cxl`: the engine's host is attached to the CXL memory; it maps its own regions
//! writable and other engines' regions read-only, and copies with memcpy. The
//! mappings are behind a short lock of their own (a lookup, or a local `mmap`); every
//! copy runs without it, through a reference to its mapping (which stays mapped while
//! the copy uses it).

use super::{Mover, ReadSink, SlotOutcome, SlotWrite, View, WriteItem};
use crate::dax::{self, Mapping};
use crate::wire::meta::{LeaseGrant, RegionGrant};
use crate::worker::clock::Deadline;
use crate::worker::error::WorkerError;
use crate::worker::hook::MappingHooks;
use crate::worker::pool::peers::WriteTargets;
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

    /// The writable mappings of these regions, in order, under one lock (`None`: not
    /// an own region now).
    fn own_mappings(&self, regions: impl Iterator<Item = u64>) -> Vec<Option<Arc<Mapping>>> {
        let maps = self.maps();
        per_region(regions, |&r| r, |&r| maps.own.get(&r).cloned())
    }

    /// The read-only mapping of a lease's region (made the first time: then `true`),
    /// under the caller's lock. An `acquire` reply names a region's device on its
    /// first lease there only (`wire::lease_wire`): a lease that names none maps by
    /// the device a lease of its region in `batch` names (no copy of it per lease).
    fn reader_in(
        maps: &mut Maps,
        l: &LeaseGrant,
        batch: &[LeaseGrant],
    ) -> Option<(Arc<Mapping>, bool)> {
        if let Some(m) = maps.readers.get(&l.region_id) {
            return Some((m.clone(), false));
        }
        let mut mine = batch.iter().filter(|b| b.region_id == l.region_id);
        let d = l
            .device
            .as_ref()
            .or_else(|| mine.find_map(|b| b.device.as_ref()))?;
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
        Some((m, true))
    }

    /// The view of a lease in its mapping, if the lease lies inside it.
    fn view_of(map: Arc<Mapping>, l: &LeaseGrant) -> Option<View> {
        let (offset, len) = (l.offset as usize, l.length as usize);
        map.as_slice().ok()?.get(offset..offset.checked_add(len)?)?;
        Some(View { map, offset, len })
    }

    /// Faults in the leased ranges of regions mapped for reading just now, and has
    /// the whole of each such region faulted in on the prefault thread.
    fn prefault_fresh(&self, leases: &[LeaseGrant], found: &[Option<(Arc<Mapping>, bool)>]) {
        if !self.wants_lead() {
            return; // prefaulting off, or refused by the kernel
        }
        let mut fresh: Vec<Arc<Mapping>> = Vec::new();
        for (l, m) in leases.iter().zip(found) {
            let Some((map, true)) = m else { continue };
            if let Err(e) = map.populate_range(l.offset as usize, l.length as usize) {
                log::debug!("prefaulting a lease of region {}: {e}", l.region_id);
            }
            if !fresh.iter().any(|f| Arc::ptr_eq(f, map)) {
                fresh.push(map.clone());
            }
        }
        if let Some(p) = self.prefaulter().as_mut() {
            for m in fresh {
                p.submit(m);
            }
        }
    }
}

impl Mover for CxlMover {
    /// Maps one of the session's own regions writable (and has it prefaulted).
    fn adopt(&self, grant: &RegionGrant, _by: Deadline) -> Result<(), WorkerError> {
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
    fn own_mapping(&self, region_id: u64) -> Option<Arc<Mapping>> {
        self.maps().own.get(&region_id).cloned()
    }

    /// Copies each chunk into its page; true where the bytes are complete. The
    /// mappings of the batch's regions are looked up once, under one short lock (a
    /// region forgotten before the call is not written into; one being written is not
    /// given back before its store ends, see `PoolCore::mark_writing`), and the copies
    /// run without it, with one store fence for the whole batch.
    fn write(&self, items: &[WriteItem<'_>], _: &WriteTargets, _by: Deadline) -> Vec<bool> {
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

    /// Copies from the caller's slots (see `write`); each slot comes back.
    fn write_slots(
        &self,
        items: Vec<SlotWrite>,
        to: &WriteTargets,
        by: Deadline,
    ) -> Vec<SlotOutcome> {
        let writes: Vec<WriteItem<'_>> = items
            .iter()
            .map(|it| WriteItem {
                page: it.page,
                data: &it.slot.bytes()[..it.len.min(it.slot.len())],
            })
            .collect();
        let ok = self.write(&writes, to, by);
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

    /// The views of a batch's leases, their mappings looked up under one lock (a
    /// batch's leases lie in a few regions: one `Arc` each).
    ///
    /// A region mapped for reading by this call is prefaulted (when prefaulting is
    /// on): the leased ranges of this batch now (`MADV_POPULATE_READ`, one call per
    /// lease, without the lock), so that its first loads take no page fault per
    /// page, and the whole region on the prefault thread for the loads after it.
    fn views(&self, leases: &[LeaseGrant]) -> Vec<Option<View>> {
        let mut maps = self.maps();
        let found = per_region(
            leases.iter(),
            |l| l.region_id,
            |l| Self::reader_in(&mut maps, l, leases),
        );
        drop(maps);
        if found
            .iter()
            .any(|m| m.as_ref().is_some_and(|(_, fresh)| *fresh))
        {
            self.prefault_fresh(leases, &found);
        }
        found
            .into_iter()
            .zip(leases)
            .map(|(m, l)| Self::view_of(m?.0, l))
            .collect()
    }

    /// Hands each lease's bytes to `sink(i, bytes)` from its view (no lock held
    /// while `sink` runs).
    fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>, _by: Deadline) {
        for (i, v) in self.views(leases).into_iter().enumerate() {
            if let Some(v) = v {
                sink(i, v.bytes());
            }
        }
    }

    /// Copies each lease's bytes into the slot of the same index.
    fn read_into(
        &self,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
        _by: Deadline,
    ) -> Vec<SlotOutcome> {
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
    fn mappings(&self) -> Vec<(u64, Arc<Mapping>)> {
        let maps = self.maps();
        maps.own
            .iter()
            .chain(maps.readers.iter())
            .map(|(r, m)| (*r, m.clone()))
            .collect()
    }

    /// True while regions are prefaulted: the next one is then taken ahead of need,
    /// so that faulting it in happens off the store path.
    fn wants_lead(&self) -> bool {
        self.prefaulter().as_ref().is_some_and(|p| !p.stats().off)
    }

    fn prefault_stats(&self) -> Option<PrefaultStats> {
        self.prefaulter().as_ref().map(Prefaulter::stats)
    }

    /// The region is no longer the session's: its mappings go once the copies and
    /// views that hold them let go (the memory hook hears of it first).
    fn forget(&self, region_id: u64) {
        let mut maps = self.maps();
        maps.hooks.remove_region(region_id);
        maps.own.remove(&region_id);
        maps.readers.remove(&region_id);
    }
    fn writes_in_place(&self) -> bool {
        true
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
    use std::time::Duration;

    /// A call's deadline (the cxl mover waits on nothing).
    fn by() -> Deadline {
        Deadline::after(Duration::from_secs(1))
    }

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
        assert_eq!(
            mover.write(&items, &WriteTargets::new(), by()),
            vec![true, false, true, false]
        );
        let bytes = std::fs::read(&path.0).expect("read back");
        assert_eq!(&bytes[..256 << 10], &big[..]);
        assert_eq!(&bytes[256 << 10..(256 << 10) + 64], &small[..]);
        assert!(bytes[(REGION - 32) as usize..].iter().all(|&b| b == 0));
        // Once forgotten, nothing more is written into the region.
        mover.forget(7);
        assert_eq!(
            mover.write(&items[..1], &WriteTargets::new(), by()),
            vec![false]
        );
    }

    /// A batch costs the same heap allocations whatever its size: the mover's work
    /// per chunk allocates nothing (writes, views and reads alike).
    #[test]
    fn a_batch_allocates_per_call_not_per_chunk() {
        use crate::test_alloc::allocations_in;
        let path = ScratchPath::new("cxl-allocs");
        let mover = mover_with_region(&path);
        let data = [5u8; 64];
        let items: Vec<WriteItem<'_>> = (0..32)
            .map(|i| WriteItem {
                page: page(7, i * (64 << 10)),
                data: &data,
            })
            .collect();
        let (ok, one) = allocations_in(|| mover.write(&items[..1], &WriteTargets::new(), by()));
        assert_eq!(ok, vec![true]);
        let (ok, all) = allocations_in(|| mover.write(&items, &WriteTargets::new(), by()));
        assert!(ok.iter().all(|&b| b));
        assert_eq!(one, all, "a write of 32 chunks allocates as one of 1");

        let rpath = ScratchPath::new("cxl-allocs-read");
        let (_, lease) = pool_with_pattern(&rpath, 0, 64 << 10);
        let leases: Vec<LeaseGrant> = (0..32)
            .map(|i| LeaseGrant {
                offset: i * (64 << 10),
                ..lease.clone()
            })
            .collect();
        // The region's mapping is made (once) before the counts.
        assert!(mover.views(std::slice::from_ref(&lease))[0].is_some());
        let (v, one) = allocations_in(|| mover.views(&leases[..1]));
        assert!(v[0].is_some());
        let (v, all) = allocations_in(|| mover.views(&leases));
        assert!(v.iter().all(Option::is_some));
        assert_eq!(one, all, "the views of 32 leases allocate as those of 1");
        let mut seen = 0;
        let ((), one) = allocations_in(|| mover.read(&leases[..1], &mut |_, _| seen += 1, by()));
        let ((), all) = allocations_in(|| mover.read(&leases, &mut |_, _| seen += 1, by()));
        assert_eq!(
            (seen, one),
            (33, all),
            "a read of 32 leases allocates as one of 1"
        );
    }

    /// Whether the page of this process at `addr` is mapped now (`/proc/self/pagemap`
    /// bit 63: present).
    fn page_present(addr: usize) -> bool {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
        let mut e = [0u8; 8];
        f.read_exact_at(&mut e, (addr / 4096 * 8) as u64)
            .expect("pagemap entry");
        u64::from_le_bytes(e) >> 63 == 1
    }

    /// A fake DAX pool whose second unit (region 9 here) holds a pattern, and a lease
    /// of `len` bytes at `offset` of that region.
    fn pool_with_pattern(path: &ScratchPath, offset: u64, len: u64) -> (Vec<u8>, LeaseGrant) {
        let info = dax::open_pool(&dax::PoolSpec::FakeDax {
            path: path.as_str().into(),
            size: 2 * REGION,
        })
        .expect("fake pool");
        let bytes: Vec<u8> = (0..REGION as usize).map(|i| (i / 4096 + i) as u8).collect();
        let w = dax::map_range(
            path.as_str(),
            dax::DeviceKind::File,
            REGION,
            REGION,
            REGION,
            true,
        )
        .expect("map");
        w.write_at(0, &bytes).expect("write");
        drop(w);
        let lease = LeaseGrant {
            lease_id: 1,
            region_id: 9,
            offset,
            length: len,
            read_token: String::new(),
            agent: None,
            device: Some(crate::wire::meta::DeviceRange {
                uuid: info.uuid,
                path: path.as_str().into(),
                region_offset: REGION,
                region_length: REGION,
            }),
            expires_in_ms: 60_000,
            boot_id: None,
        };
        (bytes, lease)
    }

    fn populate_nothing(_: &Mapping, _: usize, _: usize) -> Result<bool, dax::DaxError> {
        Ok(true)
    }

    /// The load that maps a region for reading faults its leased pages in at once
    /// (not one page fault per page as the copy reaches it), and the bytes read are
    /// the region's. The prefault thread here populates nothing, so only the load's
    /// own prefault can have mapped the pages.
    #[test]
    fn a_fresh_read_mapping_has_its_leased_pages_faulted_in() {
        let path = ScratchPath::new("cxl-read-prefault");
        let (off, len) = (256 << 10, 256 << 10);
        let (bytes, lease) = pool_with_pattern(&path, off, len);
        let mover = CxlMover::with_prefaulter(Some(Prefaulter::with_populate(populate_nothing)));
        let mut first = None;
        // The sink touches one byte: the pages past the first are mapped only if
        // they were prefaulted.
        let sink = &mut |_, b: &[u8]| first = Some((b.as_ptr() as usize, b.len(), b[0]));
        mover.read(std::slice::from_ref(&lease), sink, by());
        let (at, n, b0) = first.expect("the lease was read");
        assert_eq!((n, b0), (len as usize, bytes[off as usize]));
        let absent: Vec<usize> = (0..n)
            .step_by(4096)
            .filter(|&o| !page_present(at + o))
            .collect();
        assert!(
            absent.is_empty(),
            "{} of {} leased pages not faulted in (first at +{:?})",
            absent.len(),
            n / 4096,
            absent.first()
        );
        // The mapping reads the region's bytes, here and through a later view.
        let v = mover.views(std::slice::from_ref(&lease))[0]
            .clone()
            .expect("view");
        assert_eq!(v.bytes(), &bytes[off as usize..(off + len) as usize]);
    }

    /// The prefault thread faults the whole of a region mapped for reading in, and
    /// its bytes stay the region's.
    #[test]
    fn a_read_mapping_is_prefaulted_whole_and_reads_the_regions_bytes() {
        let path = ScratchPath::new("cxl-read-prefault-whole");
        let (bytes, lease) = pool_with_pattern(&path, 0, 64 << 10);
        let mover = CxlMover::with_prefault(true);
        let v = mover.views(std::slice::from_ref(&lease));
        let v = v[0].as_ref().expect("a view");
        if let Some(p) = mover.prefaulter().as_ref() {
            p.wait_idle();
        }
        let s = mover.prefault_stats().expect("prefaulting on");
        if s.off {
            return; // a kernel without MADV_POPULATE_READ: nothing to check
        }
        assert_eq!((s.regions, s.bytes), (1, REGION), "{s:?}");
        let base = v.bytes().as_ptr() as usize;
        assert!((0..REGION as usize)
            .step_by(4096)
            .all(|o| page_present(base + o)));
        let (_, map) = mover
            .mappings()
            .into_iter()
            .find(|(r, _)| *r == 9)
            .expect("the read mapping");
        assert_eq!(map.as_slice().expect("readable"), &bytes[..]);
    }

    /// An `acquire` reply names a region's device on its first lease there only: the
    /// batch's other leases of that region map by it, wherever it stands in the batch,
    /// and read the region's bytes; a lease of a region no lease of the batch names
    /// the device of is not mapped.
    #[test]
    fn a_batchs_leases_map_by_the_device_one_of_them_names() {
        let path = ScratchPath::new("cxl-read-named-once");
        let (bytes, lease) = pool_with_pattern(&path, 0, 64 << 10);
        let at = |offset: u64, named: bool| LeaseGrant {
            offset,
            device: lease.device.clone().filter(|_| named),
            ..lease.clone()
        };
        let mover = CxlMover::with_prefault(false);
        let batch = [at(64 << 10, false), at(0, true), at(128 << 10, false)];
        let views = mover.views(&batch);
        for (l, v) in batch.iter().zip(&views) {
            let v = v.as_ref().expect("a view by the batch's device");
            let o = l.offset as usize;
            assert_eq!(v.bytes(), &bytes[o..o + (64 << 10)]);
        }
        let other = CxlMover::with_prefault(false);
        assert!(other.views(&[at(0, false)])[0].is_none(), "no device named");
    }
}
