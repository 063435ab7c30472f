//! Stores of a pool: pages (spare ones first, then `alloc`, expanding the session
//! when its regions are full, a region taken ahead for movers that want a lead) →
//! the mover writes the chunks → only chunks whose bytes are complete are published
//! (after maru-server has the regions' boot ids) → pages not used are kept or freed,
//! except pages a WRITE of unknown outcome may still reach.

use super::{region_pages, PageWriter, StoragePool, EVICT_AHEAD_BYTES, EVICT_AHEAD_PAGES};
use crate::wire::meta::{PageGrant, PublishEntry, RegionGrant, RemoveResult};
use crate::worker::error::WorkerError;
use crate::worker::movers::{SlotWrite, WriteItem};
use crate::worker::staging::Slot;

impl StoragePool {
    /// Pages for `need` chunks: spare ones first, then one `alloc` that also takes
    /// spares for later stores, expanding the session when its regions are full.
    /// Fewer than `need` when the session cannot grow.
    pub(super) fn take_pages(
        &mut self,
        need: usize,
        route_key: Option<&str>,
    ) -> Result<Vec<PageGrant>, WorkerError> {
        let from_spare = need.min(self.spare.len());
        let mut pages: Vec<PageGrant> = self.spare.drain(..from_spare).collect();
        if pages.len() == need {
            return Ok(pages);
        }
        let short = need - pages.len();
        let ask = (short + self.spare_target).min(self.max_batch.max(short));
        let (got, _) = self.session.alloc(ask as u32, route_key)?;
        self.note_fill(&got);
        let mut got = got.into_iter();
        pages.extend(got.by_ref().take(short));
        self.spare.extend(got);
        let mut missing = (need - pages.len()) as u32;
        while missing > 0 {
            // The session's regions are full: one more region, or else room made by
            // evicting keys of its own regions; then the rest.
            let grown = if self.may_grow() {
                self.session.expand()
            } else {
                Err(WorkerError::NoSpace(format!(
                    "the engine holds max_bytes of regions ({} of them)",
                    self.stats.regions
                )))
            };
            match grown {
                Ok(grant) => self.adopt(&grant)?,
                Err(WorkerError::NoSpace(why)) => {
                    let ahead = (EVICT_AHEAD_BYTES / self.page_size().max(1)) as usize;
                    let freed = self.evict(missing as usize + ahead.max(EVICT_AHEAD_PAGES))?;
                    if freed == 0 {
                        self.stats.store_no_room += u64::from(missing);
                        log::warn!(
                            "pool {}: {missing} chunk(s) not stored: the pool has no region to \
                             give ({why}) and every page of this engine's regions is leased, \
                             pinned or in use",
                            self.session.url
                        );
                        break;
                    }
                }
                Err(e) => return Err(e),
            }
            let (more, m) = self.session.alloc(missing, route_key)?;
            self.note_fill(&more);
            if more.is_empty() && m == missing {
                break;
            }
            pages.extend(more);
            missing = m;
        }
        Ok(pages)
    }

    /// Removes up to `want` keys of the session's own regions, in the order
    /// maru-server offers them (tails of prefix chains first; never a leased or
    /// pinned key), so that their pages can take new chunks. A page is reused only
    /// after maru-server acknowledged its key's removal, and a removal is refused
    /// while a lease (a reader's, or one of this handler's views) covers it. Returns
    /// how many keys went.
    fn evict(&mut self, want: usize) -> Result<usize, WorkerError> {
        let victims = self.session.victims(want.min(self.max_batch) as u32)?;
        if victims.is_empty() {
            return Ok(0);
        }
        let names: Vec<String> = victims.iter().map(|v| v.key.clone()).collect();
        let results = self.session.remove(&names)?;
        let mut freed = 0;
        for (v, r) in victims.iter().zip(&results) {
            if *r == RemoveResult::Removed {
                freed += 1;
                self.stats.evictions += 1;
                self.stats.bytes_evicted += v.length;
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
    fn may_grow(&self) -> bool {
        self.max_regions.is_none_or(|m| self.stats.regions < m)
    }

    pub(super) fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        self.mover.adopt(grant)?;
        self.stats.regions += 1;
        self.newest = Some(region_pages(grant));
        Ok(())
    }

    /// Remembers how far stores got into the newest region, and takes the next
    /// region ahead when they reach its second half (once per region, best effort:
    /// a pool without space answers the store that needs the region).
    pub(super) fn note_fill(&mut self, pages: &[PageGrant]) {
        let Some((rid, n)) = self.newest else {
            return;
        };
        if !self.mover.wants_lead() || self.lead_tried == Some(rid) || !self.may_grow() {
            return;
        }
        let deep = pages
            .iter()
            .any(|p| p.region_id == rid && p.page.saturating_mul(2) >= n);
        if !deep {
            return;
        }
        self.lead_tried = Some(rid);
        let ahead = self.session.expand().and_then(|g| self.adopt(&g));
        match ahead {
            Ok(()) => self.stats.regions_ahead += 1,
            Err(e) => log::debug!(
                "pool {}: no region taken ahead ({e}); the next store that needs one asks again",
                self.session.url
            ),
        }
    }

    /// Keeps pages that hold no key for the next stores; frees what is beyond the
    /// bound.
    pub(super) fn keep_spare(&mut self, pages: Vec<PageGrant>) {
        self.spare.extend(pages);
        let max = 2 * self.spare_target;
        if self.spare.len() > max {
            let extra: Vec<PageGrant> = self.spare.drain(max..).collect();
            if let Err(e) = self.session.free_pages(&extra) {
                log::warn!(
                    "pool {}: cannot return {} unused pages: {e}",
                    self.session.url,
                    extra.len()
                );
            }
        }
    }

    /// Stores chunks; per chunk: true when stored now or already present.
    pub fn store(
        &mut self,
        items: &[(&str, &[u8])],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let mut done = vec![false; items.len()];
        for (ci, chunk) in items.chunks(self.max_batch).enumerate() {
            let base = ci * self.max_batch;
            let keys: Vec<&str> = chunk.iter().map(|(k, _)| *k).collect();
            let lens: Vec<usize> = chunk.iter().map(|(_, d)| d.len()).collect();
            let r = self.store_some(&keys, &lens, route_key, &mut |m, todo| {
                let writes: Vec<WriteItem<'_>> = todo
                    .iter()
                    .map(|&(i, page)| WriteItem {
                        page,
                        data: chunk[i].1,
                    })
                    .collect();
                m.write(&writes)
            })?;
            done[base..base + r.len()].copy_from_slice(&r);
        }
        Ok(done)
    }

    /// Stores chunks the caller put in staging slots (`lens[i]` bytes of `slots[i]`).
    /// Each slot is back in `slots` afterwards, except one whose transfer outcome is
    /// unknown (`None`: kept until its peer is fenced, then back in its pool).
    pub fn store_slots(
        &mut self,
        keys: &[&str],
        slots: &mut [Option<Slot>],
        lens: &[usize],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let mut done = vec![false; keys.len()];
        let mut base = 0;
        while base < keys.len() {
            let end = (base + self.max_batch).min(keys.len());
            let part = &mut slots[base..end];
            let r = self.store_some(
                &keys[base..end],
                &lens[base..end],
                route_key,
                &mut |m, todo| {
                    let mut writes = Vec::with_capacity(todo.len());
                    let mut placed = Vec::with_capacity(todo.len());
                    for (p, &(i, page)) in todo.iter().enumerate() {
                        if let Some(slot) = part[i].take() {
                            writes.push(SlotWrite {
                                page,
                                slot,
                                len: lens[base + i],
                            });
                            placed.push((p, i));
                        }
                    }
                    let mut ok = vec![false; todo.len()];
                    for ((p, i), o) in placed.into_iter().zip(m.write_slots(writes)) {
                        ok[p] = o.ok;
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

    /// One batch (at most `max_batch` chunks): exists → alloc (expanding the session
    /// when its regions are full) → `write` the missing chunks into their pages →
    /// publish only the chunks whose bytes are complete → free every page not used.
    pub(super) fn store_some(
        &mut self,
        keys: &[&str],
        lens: &[usize],
        route_key: Option<&str>,
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
        let mut result = present.clone();
        let todo: Vec<usize> = (0..keys.len()).filter(|&i| !present[i]).collect();
        self.stats.already_present += (keys.len() - todo.len()) as u64;
        if todo.is_empty() {
            return Ok(result);
        }
        let pages = self.take_pages(todo.len(), route_key)?;
        let placed: Vec<(usize, PageGrant)> =
            todo.iter().copied().zip(pages.iter().copied()).collect();
        let ok = write(self.mover.as_mut(), &placed);
        // A region adopted for this store, or a reboot found by it: maru-server hears
        // the boot ids before a key is published.
        self.report_boots()?;
        let mut publish = Vec::new();
        let mut unused = Vec::new();
        for (&(i, page), good) in placed
            .iter()
            .zip(ok.iter().chain(std::iter::repeat(&false)))
        {
            if *good {
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
                unused.push(page);
            }
        }
        if !unused.is_empty() && self.mover.may_still_write() {
            // A WRITE whose outcome is unknown may still land in one of these pages:
            // keep them out of reuse (they go back with their region).
            log::warn!(
                "pool {}: keeping {} pages of failed writes out of reuse until their region goes back (a transfer of unknown outcome was not fenced)",
                self.session.url,
                unused.len()
            );
            unused.clear();
        }
        unused.extend(pages.iter().skip(placed.len()).copied());
        self.stats.store_skipped += (todo.len() - publish.len()) as u64;
        // Publish only what was written completely.
        if !publish.is_empty() {
            let entries = publish.iter().map(|(_, e)| e.clone()).collect();
            let is_new = self.session.publish(entries)?;
            for ((i, e), new) in publish.iter().zip(is_new) {
                result[*i] = true;
                if new {
                    self.stats.stored += 1;
                    self.stats.bytes_stored += e.length;
                } else {
                    // Another engine published the key first; our page is not needed.
                    self.stats.already_present += 1;
                    unused.push(PageGrant {
                        region_id: e.region_id,
                        page: e.offset / self.session.page_size,
                        offset: e.offset,
                        length: self.session.page_size,
                    });
                }
            }
        }
        // Pages that hold no key (and no write in flight) serve the next stores.
        self.keep_spare(unused);
        Ok(result)
    }
}
