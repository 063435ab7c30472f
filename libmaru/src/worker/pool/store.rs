//! Stores of a pool: pages (spare ones first, then `alloc`, expanding the session
//! when its regions are full, a region taken ahead for movers that want a lead) →
//! the mover writes the chunks → only chunks whose bytes are complete are published
//! (after maru-server has the regions' boot ids, and only into regions still the
//! session's on the boot they were written under) → pages not used are kept or
//! freed, except pages a WRITE of unknown outcome may still reach.
//!
//! The steps: `take_pages` (under the bookkeeping lock: pages marked as written by
//! this store; round trips without it) → `write_items` / `write_slots` (no pool lock
//! on `cxl`) → `publish` (re-checks under the gate and the bookkeeping lock).

use super::{
    region_pages, DataPath, PageWriter, StoragePool, EVICT_AHEAD_BYTES, EVICT_AHEAD_PAGES,
};
use crate::wire::meta::{PageGrant, PublishEntry, RegionGrant, RemoveResult};
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::WorkerError;
use crate::worker::movers::{SlotOutcome, SlotWrite, WriteItem};
use crate::worker::staging::Slot;
use std::collections::BTreeMap;

/// Times a publish asks for the regions' boot ids to be reported before it gives up
/// (other stores keep adopting regions meanwhile).
const REPORT_TRIES: usize = 3;

/// Rounds of making room (a region or evictions, then `alloc`) that found no page
/// before a store gives up on the chunks still missing.
const ROOM_ROUNDS: usize = 8;

/// After maru-server had no region to give (the pool is full), stores make room by
/// evicting without asking again for this long (unless an eviction found nothing to
/// evict): in a full pool every store that
/// evicts would otherwise pay a refused `expand` round trip first (measured: 190 µs
/// of the 740 µs a 256 KiB store's eviction round took). maru-server keeps counting
/// the session as waiting for a region meanwhile (fair share), and the next `expand`
/// after it takes the region given back.
const EXPAND_BACKOFF_MS: u64 = 250;

/// Why `grow` took no region.
#[derive(Debug)]
enum NoRegion {
    /// maru-server had none to give, or the session holds `max_bytes`: room is made
    /// by evicting.
    Full(String),
    /// One was taken and could not be made usable by the request's deadline (its
    /// agent did not answer, say): it went back, and this store goes on without it.
    Unusable(WorkerError),
    /// A call failed (maru-server, or the configuration).
    Failed(WorkerError),
}

impl std::fmt::Display for NoRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoRegion::Full(why) => f.write_str(why),
            NoRegion::Unusable(e) => write!(f, "a region taken is not usable: {e}"),
            NoRegion::Failed(e) => write!(f, "{e}"),
        }
    }
}

/// The pages a store took and, per region, its boot id when they were taken.
pub(super) struct Taken {
    pub(super) pages: Vec<PageGrant>,
    pub(super) boots: BTreeMap<u64, Option<String>>,
}

impl StoragePool {
    /// Pages for `need` chunks: spare ones first, then one `alloc` that also takes
    /// spares for later stores, expanding the session when its regions are full.
    /// Fewer than `need` when the session cannot grow. The pages are marked as being
    /// written (their regions are not given back until `publish` ends).
    pub(super) fn take_pages(
        &self,
        need: usize,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<Taken, WorkerError> {
        let mut pages = self.find_pages(need, route_key, by)?;
        let boots = {
            let m = self.mover();
            let now = m.boot_ids();
            pages
                .iter()
                .map(|p| (p.region_id, now.get(&p.region_id).cloned()))
                .collect()
        };
        let mut b = self.book();
        // A region being given back takes no new store (its pages go back with it).
        pages.retain(|p| !b.closing.contains(&p.region_id));
        for p in &pages {
            *b.writing.entry(p.region_id).or_default() += 1;
        }
        Ok(Taken { pages, boots })
    }

    fn find_pages(
        &self,
        need: usize,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<Vec<PageGrant>, WorkerError> {
        let mut pages: Vec<PageGrant> = {
            let mut b = self.book();
            let from_spare = need.min(b.spare.len());
            b.spare.drain(..from_spare).collect()
        };
        if pages.len() == need {
            return Ok(pages);
        }
        let short = need - pages.len();
        let ask = (short + self.spare_target).min(self.max_batch.max(short));
        let (got, _) = self.alloc(ask as u32, route_key)?;
        self.note_fill(&got, by);
        let mut got = got.into_iter();
        pages.extend(got.by_ref().take(short));
        self.book().spare.extend(got);
        let mut missing = (need - pages.len()) as u32;
        // Rounds of making room that ended with no page: other stores of this pool
        // make room at the same time (they may have evicted the victims offered here,
        // or taken the pages freed here), so a few rounds are tried before giving up.
        let mut dry = 0;
        while missing > 0 {
            // The session's regions are full: one more region, or else room made by
            // evicting keys of its own regions; then the rest.
            let why = match self.grow(by) {
                Ok(()) => None,
                Err(NoRegion::Unusable(e)) => {
                    log::warn!(
                        "pool {}: {missing} chunk(s) not stored: a region taken for them could not be made usable ({e}); it went back to maru-server",
                        self.session.url
                    );
                    break;
                }
                Err(NoRegion::Failed(e)) => return Err(e),
                Err(NoRegion::Full(why)) => {
                    let ahead = (EVICT_AHEAD_BYTES / self.page_size().max(1)) as usize;
                    let freed = self.evict(missing as usize + ahead.max(EVICT_AHEAD_PAGES))?;
                    if freed == 0 {
                        // Nothing of its own to evict: the next round asks for a
                        // region again, back-off or not (another engine may have given
                        // one back for this one's fair share).
                        self.book().refused_at = None;
                    }
                    (freed == 0).then_some(why)
                }
            };
            // Other stores of this pool may have taken the room made here as their
            // spare pages (the pool's, so this store's too): those first.
            let spare: Vec<PageGrant> = {
                let mut b = self.book();
                let n = (missing as usize).min(b.spare.len());
                b.spare.drain(..n).collect()
            };
            missing -= spare.len() as u32;
            let mut got_none = spare.is_empty();
            pages.extend(spare);
            if missing > 0 {
                let (more, m) = self.alloc(missing, route_key)?;
                self.note_fill(&more, by);
                got_none &= more.is_empty() && m == missing;
                pages.extend(more);
                missing = m;
            }
            if got_none {
                dry += 1;
                if dry >= ROOM_ROUNDS {
                    self.book().stats.store_no_room += u64::from(missing);
                    log::warn!(
                        "pool {}: {missing} chunk(s) not stored: the pool has no region to \
                         give ({}) and every page of this engine's regions is leased, \
                         pinned or in use",
                        self.session.url,
                        why.as_deref().unwrap_or("a region taken was full at once")
                    );
                    break;
                }
            }
        }
        Ok(pages)
    }

    /// `alloc` at maru-server. maru-server allocates from any region of the session,
    /// also one another store is taking now (its `expand` answered, the mover's
    /// `adopt` not done): pages of a region the mover does not know yet wait for that
    /// adoption (`adopting`, which the taker holds from before its `expand` until its
    /// `adopt` ended), so no store writes into a region before it is usable. Other
    /// allocs do not wait for a region being taken.
    fn alloc(
        &self,
        count: u32,
        route_key: Option<&str>,
    ) -> Result<(Vec<PageGrant>, u32), WorkerError> {
        let got = self.session.alloc(count, route_key)?;
        let new_region = {
            let m = self.mover();
            got.0.iter().any(|p| !m.owns(p.region_id))
        };
        if new_region {
            drop(self.adopting.read().unwrap_or_else(|e| e.into_inner()));
        }
        Ok(got)
    }

    /// One more region for the session, within `max_bytes` (counting the regions
    /// other stores are taking now), made usable by `by`.
    fn grow(&self, by: Deadline) -> Result<(), NoRegion> {
        let now = now_ms();
        {
            let mut b = self.book();
            if !self.may_grow(&b) {
                return Err(NoRegion::Full(format!(
                    "the engine holds max_bytes of regions ({} of them)",
                    b.stats.regions
                )));
            }
            if let Some(at) = b.refused_at.filter(|&at| now < at + EXPAND_BACKOFF_MS) {
                return Err(NoRegion::Full(format!(
                    "maru-server had no region to give {} ms ago (asked again {} ms after that)",
                    now.saturating_sub(at),
                    EXPAND_BACKOFF_MS
                )));
            }
            b.expanding += 1;
        }
        let r = {
            let _alone = self.adopting.write().unwrap_or_else(|e| e.into_inner());
            self.session
                .expand()
                .map(|g| (self.adopt(&g, by), g.handle.region_id))
        };
        {
            let mut b = self.book();
            b.expanding = b.expanding.saturating_sub(1);
            b.refused_at = matches!(r, Err(WorkerError::NoSpace(_))).then_some(now);
        }
        match r {
            Ok((Ok(()), _)) => Ok(()),
            Err(WorkerError::NoSpace(why)) => Err(NoRegion::Full(why)),
            Err(e) => Err(NoRegion::Failed(e)),
            Ok((Err(e), id)) => {
                // The session has the region, the mover could not map it (its agent
                // did not answer by the request's deadline, say): it goes back at
                // once (maru-server's keeper releases it at its agent), so that no
                // store gets pages of a region no mover knows.
                if let Err(re) = self.session.return_region(id, false) {
                    log::warn!(
                        "pool {}: region {id}, taken and not made usable, could not be given back ({re})",
                        self.session.url
                    );
                }
                if e.is_fatal() {
                    // A wrong configuration or key: the caller's to fix.
                    Err(NoRegion::Failed(e))
                } else {
                    Err(NoRegion::Unusable(e))
                }
            }
        }
    }

    /// Removes up to `want` keys of the session's own regions, in the order
    /// maru-server offers them (tails of prefix chains first; never a leased or
    /// pinned key), so that their pages can take new chunks. A page is reused only
    /// after maru-server acknowledged its key's removal, and a removal is refused
    /// while a lease (a reader's, or one of this handler's views) covers it. Returns
    /// how many keys went.
    fn evict(&self, want: usize) -> Result<usize, WorkerError> {
        let victims = self.session.victims(want.min(self.max_batch) as u32)?;
        if victims.is_empty() {
            return Ok(0);
        }
        let names: Vec<String> = victims.iter().map(|v| v.key.clone()).collect();
        let results = self.session.remove(&names)?;
        let mut freed = 0;
        {
            let mut b = self.book();
            for (v, r) in victims.iter().zip(&results) {
                if *r == RemoveResult::Removed {
                    freed += 1;
                    b.stats.evictions += 1;
                    b.stats.bytes_evicted += v.length;
                }
            }
        }
        log::debug!(
            "pool {}: evicted {freed} of {} victims to make room",
            self.session.url,
            victims.len()
        );
        Ok(freed)
    }

    /// Whether the session may take one more region (`max_bytes`).
    fn may_grow(&self, b: &super::Book) -> bool {
        self.max_regions
            .is_none_or(|m| b.stats.regions + b.expanding < m)
    }

    pub(super) fn adopt(&self, grant: &RegionGrant, by: Deadline) -> Result<(), WorkerError> {
        if let Some(f) = &self.before_adopt {
            f(grant);
        }
        // remote_cxl maps the region at its agent without the mover's lock, which
        // publishes and the heartbeat take (`Transfers::adopt`); cxl maps it locally.
        match self.data_path() {
            DataPath::Transfers(t) => t.adopt(grant, by)?,
            DataPath::Direct | DataPath::Mover => self.mover().adopt(grant)?,
        }
        let mut b = self.book();
        b.stats.regions += 1;
        b.newest = Some(region_pages(grant));
        Ok(())
    }

    /// Remembers how far stores got into the newest region, and takes the next
    /// region ahead when they reach its second half (once per region, best effort:
    /// a pool without space answers the store that needs the region).
    pub(super) fn note_fill(&self, pages: &[PageGrant], by: Deadline) {
        if !self.mover().wants_lead() {
            return;
        }
        {
            let mut b = self.book();
            let Some((rid, n)) = b.newest else {
                return;
            };
            if b.lead_tried == Some(rid) || !self.may_grow(&b) {
                return;
            }
            let deep = pages
                .iter()
                .any(|p| p.region_id == rid && p.page.saturating_mul(2) >= n);
            if !deep {
                return;
            }
            // Set before the round trip: one store takes the region ahead.
            b.lead_tried = Some(rid);
        }
        match self.grow(by) {
            Ok(()) => self.book().stats.regions_ahead += 1,
            Err(e) => log::debug!(
                "pool {}: no region taken ahead ({e}); the next store that needs one asks again",
                self.session.url
            ),
        }
    }

    /// Keeps pages that hold no key for the next stores (those of regions still the
    /// session's); frees what is beyond the bound.
    pub(super) fn keep_spare(&self, pages: Vec<PageGrant>) {
        if pages.is_empty() {
            return;
        }
        let pages: Vec<PageGrant> = {
            let m = self.mover();
            pages.into_iter().filter(|p| m.owns(p.region_id)).collect()
        };
        let extra: Vec<PageGrant> = {
            let mut b = self.book();
            b.spare.extend(pages);
            let max = 2 * self.spare_target;
            if b.spare.len() > max {
                b.spare.drain(max..).collect()
            } else {
                Vec::new()
            }
        };
        if !extra.is_empty() {
            if let Err(e) = self.session.free_pages(&extra) {
                log::warn!(
                    "pool {}: cannot return {} unused pages: {e}",
                    self.session.url,
                    extra.len()
                );
            }
        }
    }

    /// Writes chunks into their pages; true where the bytes are complete. On
    /// `remote_cxl` through the mover's transfers, which lock its state only to post
    /// and settle a window (`Mover::transfers`). On `cxl` each chunk is copied through its region's mapping without any pool lock; the
    /// mapping is looked up (briefly under the mover's lock) chunk by chunk, so no
    /// copy starts into a region after it was lost or given back.
    pub(super) fn write_items(&self, items: &[WriteItem<'_>], by: Deadline) -> Vec<bool> {
        match self.data_path() {
            DataPath::Transfers(t) => return t.write(items, by),
            DataPath::Mover => return self.mover().write(items),
            DataPath::Direct => {}
        }
        items
            .iter()
            .map(|it| {
                let Some(map) = self.mover().direct(it.page.region_id) else {
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

    /// Writes from the caller's staging slots (see `write_items`).
    pub(super) fn write_slots(&self, items: Vec<SlotWrite>, by: Deadline) -> Vec<SlotOutcome> {
        match self.data_path() {
            DataPath::Transfers(t) => return t.write_slots(items, by),
            DataPath::Mover => return self.mover().write_slots(items),
            DataPath::Direct => {}
        }
        items
            .into_iter()
            .map(|it| {
                let data = &it.slot.bytes()[..it.len.min(it.slot.len())];
                let ok = self.write_items(
                    &[WriteItem {
                        page: it.page,
                        data,
                    }],
                    by,
                )[0];
                SlotOutcome {
                    ok,
                    slot: Some(it.slot),
                }
            })
            .collect()
    }

    /// Stores chunks; per chunk: true when stored now or already present.
    pub fn store(
        &self,
        items: &[(&str, &[u8])],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let by = self.deadline();
        let mut done = vec![false; items.len()];
        for (ci, chunk) in items.chunks(self.max_batch).enumerate() {
            let base = ci * self.max_batch;
            let keys: Vec<&str> = chunk.iter().map(|(k, _)| *k).collect();
            let lens: Vec<usize> = chunk.iter().map(|(_, d)| d.len()).collect();
            let r = self.store_some(&keys, &lens, route_key, by, &mut |p, todo, by| {
                let writes: Vec<WriteItem<'_>> = todo
                    .iter()
                    .map(|&(i, page)| WriteItem {
                        page,
                        data: chunk[i].1,
                    })
                    .collect();
                p.write_items(&writes, by)
            })?;
            done[base..base + r.len()].copy_from_slice(&r);
        }
        Ok(done)
    }

    /// Stores chunks the caller put in staging slots (`lens[i]` bytes of `slots[i]`).
    /// Each slot is back in `slots` afterwards, except one whose transfer outcome is
    /// unknown (`None`: kept until its peer is fenced, then back in its pool).
    pub fn store_slots(
        &self,
        keys: &[&str],
        slots: &mut [Option<Slot>],
        lens: &[usize],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let by = self.deadline();
        let mut done = vec![false; keys.len()];
        let mut base = 0;
        while base < keys.len() {
            let end = (base + self.max_batch).min(keys.len());
            let part = &mut slots[base..end];
            let r = self.store_some(
                &keys[base..end],
                &lens[base..end],
                route_key,
                by,
                &mut |p, todo, by| {
                    let mut writes = Vec::with_capacity(todo.len());
                    let mut placed = Vec::with_capacity(todo.len());
                    for (k, &(i, page)) in todo.iter().enumerate() {
                        if let Some(slot) = part[i].take() {
                            writes.push(SlotWrite {
                                page,
                                slot,
                                len: lens[base + i],
                            });
                            placed.push((k, i));
                        }
                    }
                    let mut ok = vec![false; todo.len()];
                    for ((k, i), o) in placed.into_iter().zip(p.write_slots(writes, by)) {
                        ok[k] = o.ok;
                        part[i] = o.slot;
                    }
                    ok
                },
            )?;
            done[base..end].copy_from_slice(&r);
            base = end;
        }
        Ok(done)
    }

    /// One batch (at most `max_batch` chunks): exists → pages (`take_pages`) →
    /// `write` the missing chunks into their pages → `publish` the chunks whose bytes
    /// are complete → keep or free every page not used.
    pub(super) fn store_some(
        &self,
        keys: &[&str],
        lens: &[usize],
        route_key: Option<&str>,
        by: Deadline,
        write: &mut PageWriter<'_>,
    ) -> Result<Vec<bool>, WorkerError> {
        for (k, &n) in keys.iter().zip(lens) {
            if k.is_empty() {
                return Err(WorkerError::InvalidArgument("empty key".into()));
            }
            if n as u64 > self.page_size() {
                return Err(WorkerError::InvalidArgument(format!(
                    "chunk {k} is {n} bytes, larger than the page size {}",
                    self.page_size()
                )));
            }
        }
        let owned: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let present = self.session.exists(&owned)?;
        let todo: Vec<usize> = (0..keys.len()).filter(|&i| !present[i]).collect();
        self.book().stats.already_present += (keys.len() - todo.len()) as u64;
        if todo.is_empty() {
            return Ok(present);
        }
        let taken = self.take_pages(todo.len(), route_key, by)?;
        let placed: Vec<(usize, PageGrant)> = todo
            .iter()
            .copied()
            .zip(taken.pages.iter().copied())
            .collect();
        let ok = write(self, &placed, by);
        let r = self.publish(keys, lens, present, &placed, &ok, &taken);
        // Whatever happened: the pages are no longer being written by this store.
        self.end_writing(taken.pages.iter().map(|p| p.region_id));
        r
    }

    /// Pages of these regions (one entry per page) are no longer being written (their
    /// store or writer in place published or dropped them): the last writer into a
    /// region maru-server asked for gives it back. Call without the gate held.
    pub(super) fn end_writing(&self, regions: impl IntoIterator<Item = u64>) {
        let mut done = Vec::new();
        {
            let mut b = self.book();
            for id in regions {
                if let Some(n) = b.writing.get_mut(&id) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        b.writing.remove(&id);
                        if b.closing.contains(&id) {
                            done.push(id);
                        }
                    }
                }
            }
        }
        for id in done {
            self.give_back_closed(id);
        }
    }

    /// The gate, shared, once maru-server has the boot ids of `regions` (the regions a
    /// publish writes keys into: one adopted meanwhile, or a reboot found, is reported
    /// first); `None` when one of them still was not reported after `REPORT_TRIES`
    /// reports (a reboot found again each time): nothing may be published then.
    /// Regions other stores adopt meanwhile do not hold this publish back.
    pub(super) fn gate_reported(
        &self,
        regions: impl IntoIterator<Item = u64>,
    ) -> Result<Option<std::sync::RwLockReadGuard<'_, ()>>, WorkerError> {
        let mut regions: Vec<u64> = regions.into_iter().collect();
        regions.sort_unstable();
        regions.dedup();
        for _ in 0..REPORT_TRIES {
            self.report_boots()?;
            let g = self.gate.read().unwrap_or_else(|e| e.into_inner());
            if !self.mover().must_report_for(&regions) {
                return Ok(Some(g));
            }
        }
        Ok(None)
    }

    /// Publishes the chunks whose bytes are complete (`ok`), into regions that are
    /// still the session's on the boot they were written under: checked under the
    /// gate (no heartbeat or tick, which learn of lost regions and reboots, runs until
    /// the publish is answered) and the bookkeeping lock. A chunk that fails the
    /// check is not published and counts as skipped. Pages not used are kept or freed.
    pub(super) fn publish(
        &self,
        keys: &[&str],
        lens: &[usize],
        mut result: Vec<bool>,
        placed: &[(usize, PageGrant)],
        ok: &[bool],
        taken: &Taken,
    ) -> Result<Vec<bool>, WorkerError> {
        if let Some(hook) = &self.before_publish {
            hook(self, &taken.pages);
        }
        // A region adopted for this store, or a reboot found by it: maru-server hears
        // the boot ids before a key is published.
        let gate = self.gate_reported(placed.iter().map(|(_, p)| p.region_id))?;
        let reported = gate.is_some();
        let (still, boots_now) = {
            let m = self.mover();
            let still: Vec<bool> = placed
                .iter()
                .map(|(_, p)| reported && m.owns(p.region_id))
                .collect();
            (still, m.boot_ids())
        };
        let mut publish = Vec::new();
        let mut unused = Vec::new();
        let mut lost = 0u64;
        for (k, &(i, page)) in placed.iter().enumerate() {
            let good = ok.get(k).copied().unwrap_or(false);
            let same_boot = taken.boots.get(&page.region_id).cloned().flatten()
                == boots_now.get(&page.region_id).cloned();
            if good && still[k] && same_boot {
                publish.push((
                    i,
                    PublishEntry {
                        key: keys[i].to_string(),
                        region_id: page.region_id,
                        offset: page.offset,
                        length: lens[i] as u64,
                        // A batch is the chunks of one request in chain order.
                        prev: i.checked_sub(1).map(|j| keys[j].to_string()),
                    },
                ));
            } else {
                if good {
                    // Written, but its region was lost or rebooted meanwhile.
                    lost += 1;
                }
                unused.push(page);
            }
        }
        if lost > 0 {
            log::warn!(
                "pool {}: {lost} chunk(s) written into a region that was lost or whose memory node rebooted before their publish: not published",
                self.session.url
            );
        }
        if !unused.is_empty() && self.mover().may_still_write() {
            // A WRITE whose outcome is unknown may still land in one of these pages:
            // keep them out of reuse (they go back with their region).
            log::warn!(
                "pool {}: keeping {} pages of failed writes out of reuse until their region goes back (a transfer of unknown outcome was not fenced)",
                self.session.url,
                unused.len()
            );
            unused.clear();
        }
        unused.extend(taken.pages.iter().skip(placed.len()).copied());
        self.book().stats.store_skipped += (placed.len() - publish.len()) as u64;
        // Publish only what was written completely.
        if !publish.is_empty() {
            let entries = publish.iter().map(|(_, e)| e.clone()).collect();
            let is_new = self.session.publish(entries)?;
            drop(gate);
            let page_size = self.session.page_size;
            let mut b = self.book();
            for ((i, e), new) in publish.iter().zip(is_new) {
                result[*i] = true;
                if new {
                    b.stats.stored += 1;
                    b.stats.bytes_stored += e.length;
                } else {
                    // Another engine published the key first; our page is not needed.
                    b.stats.already_present += 1;
                    unused.push(PageGrant {
                        region_id: e.region_id,
                        page: e.offset / page_size,
                        offset: e.offset,
                        length: page_size,
                    });
                }
            }
        }
        // Pages that hold no key (and no write in flight) serve the next stores.
        self.keep_spare(unused);
        Ok(result)
    }
}
