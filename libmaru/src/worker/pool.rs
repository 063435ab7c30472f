//! One pool (one maru-server) of a handler: its storage session and its mover.
//! Store = pages → bytes into the region → publish (publish only after the bytes are
//! complete). Load = leases → READ/copy → release the leases.

use super::error::WorkerError;
use super::movers::{Mover, ReadSink, SlotWrite, View, WriteItem};
use super::session::Session;
use super::staging::Slot;
use crate::wire::meta::{LeaseGrant, PageGrant, PublishEntry, RegionGrant};
use std::collections::VecDeque;

/// Pages a handler's pool keeps allocated ahead (taken in the same `alloc` as the
/// pages a store needs), so that most stores need no `alloc` round trip of their own.
pub const SPARE_PAGES: usize = 32;

/// Counters of a pool, reported by `stats()`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PoolStats {
    pub stored: u64,
    pub store_skipped: u64,
    pub already_present: u64,
    pub bytes_stored: u64,
    pub hits: u64,
    pub misses: u64,
    pub load_failed: u64,
    pub bytes_loaded: u64,
    pub regions: u64,
    /// Regions taken before the session's regions were full (see `Mover::wants_lead`).
    pub regions_ahead: u64,
    /// Bytes of own regions faulted in off the store path (`cxl`).
    pub prefaulted_bytes: u64,
    /// Regions maru-server no longer counted among the session's (see `heartbeat`),
    /// or given back because their agent stayed silent (see `tick`).
    pub regions_lost: u64,
    /// Why the last load that failed failed (an agent's refusal, say).
    pub last_load_error: Option<String>,
}

/// Writes the batch items `(index, page)` with the mover; true where complete.
type PageWriter<'w> = dyn FnMut(&mut dyn Mover, &[(usize, PageGrant)]) -> Vec<bool> + 'w;
/// Reads the found items (their batch indices and leases) with the mover.
type LeaseReader<'r> = dyn FnMut(&[usize], &[LeaseGrant], &mut dyn Mover) + 'r;

pub struct StoragePool {
    pub session: Session,
    mover: Box<dyn Mover>,
    stats: PoolStats,
    max_batch: usize,
    /// Pages of the session's regions allocated to it, holding no key and no write
    /// in flight: used by the next stores before asking maru-server for more.
    spare: VecDeque<PageGrant>,
    /// The region adopted last and its page count: when stores reach its second half,
    /// the next region is taken ahead (for movers that want a lead).
    newest: Option<(u64, u64)>,
    /// The newest region for which a region was taken (or tried) ahead already.
    lead_tried: Option<u64>,
    /// Pages to take ahead with each `alloc` (0: none, unused pages are freed at once);
    /// at most twice as many are kept.
    spare_target: usize,
}

impl StoragePool {
    pub fn open(session: Session, mut mover: Box<dyn Mover>) -> Result<StoragePool, WorkerError> {
        mover.adopt(&session.first_region)?;
        let max_batch = session.handshake.max_batch.max(1);
        let newest = Some(region_pages(&session.first_region));
        let mut pool = StoragePool {
            session,
            mover,
            stats: PoolStats {
                regions: 1,
                ..PoolStats::default()
            },
            max_batch,
            spare: VecDeque::new(),
            newest,
            lead_tried: None,
            spare_target: 0,
        };
        pool.report_boots()?;
        Ok(pool)
    }

    /// Tells maru-server the boot ids of the own regions (a heartbeat) when the mover
    /// says it must hear them before anything else is published (a new region, or a
    /// memory node that rebooted: maru-server then drops that region's keys).
    fn report_boots(&mut self) -> Result<(), WorkerError> {
        if self.mover.must_report() {
            self.heartbeat()?;
        }
        Ok(())
    }

    /// Keeps up to about `n` allocated pages for the next stores (see `SPARE_PAGES`):
    /// they count as used at maru-server until a store fills them or the pool closes.
    pub fn with_spare_pages(mut self, n: usize) -> StoragePool {
        self.spare_target = n;
        self
    }

    /// Counters of the pool (prefaulting included).
    pub fn stats(&self) -> PoolStats {
        let mut s = self.stats.clone();
        s.prefaulted_bytes = self.mover.prefault_stats().map_or(0, |p| p.bytes);
        s
    }

    /// Pages for `need` chunks: spare ones first, then one `alloc` that also takes
    /// spares for later stores, expanding the session when its regions are full.
    /// Fewer than `need` when the session cannot grow.
    fn take_pages(
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
            // The session's regions are full: one more region, then the rest.
            let grant = self.session.expand()?;
            self.adopt(&grant)?;
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

    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        self.mover.adopt(grant)?;
        self.stats.regions += 1;
        self.newest = Some(region_pages(grant));
        Ok(())
    }

    /// Remembers how far stores got into the newest region, and takes the next
    /// region ahead when they reach its second half (once per region, best effort:
    /// a pool without space answers the store that needs the region).
    fn note_fill(&mut self, pages: &[PageGrant]) {
        let Some((rid, n)) = self.newest else {
            return;
        };
        if !self.mover.wants_lead() || self.lead_tried == Some(rid) {
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
    fn keep_spare(&mut self, pages: Vec<PageGrant>) {
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

    pub fn page_size(&self) -> u64 {
        self.session.page_size
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
    fn store_some(
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

    /// Loads chunks, handing each found chunk's bytes to `sink(i, bytes)` (a view valid
    /// during the call). Chunks not handed over missed or failed.
    pub fn load(&mut self, keys: &[String], sink: &mut ReadSink<'_>) -> Result<(), WorkerError> {
        let (mut found, mut hits, mut bytes) = (0, 0u64, 0u64);
        let mut base = 0;
        while base < keys.len() {
            let end = (base + self.max_batch).min(keys.len());
            found += self.load_some(&keys[base..end], &mut |lease_ix, grants, m| {
                m.read(grants, &mut |k, b| {
                    hits += 1;
                    bytes += b.len() as u64;
                    sink(base + lease_ix[k], b)
                });
            })?;
            base = end;
        }
        self.count_loads(found, hits, bytes);
        Ok(())
    }

    /// Loads chunks into the caller's staging slots: `Some(len)` where chunk `i` is now
    /// in `slots[i]`. Each slot is back in `slots` afterwards, except one whose transfer
    /// outcome is unknown (`None`: kept until its peer is fenced).
    pub fn load_slots(
        &mut self,
        keys: &[String],
        slots: &mut [Option<Slot>],
    ) -> Result<Vec<Option<usize>>, WorkerError> {
        let mut out = vec![None; keys.len()];
        let mut found = 0;
        let mut base = 0;
        while base < keys.len() {
            let end = (base + self.max_batch).min(keys.len());
            let part = &mut slots[base..end];
            let got = &mut out[base..end];
            found += self.load_some(&keys[base..end], &mut |lease_ix, grants, m| {
                let mut ls = Vec::with_capacity(grants.len());
                let mut gs = Vec::with_capacity(grants.len());
                let mut ix = Vec::with_capacity(grants.len());
                for (k, &i) in lease_ix.iter().enumerate() {
                    if let Some(s) = part[i].take() {
                        ls.push(s);
                        gs.push(grants[k].clone());
                        ix.push(i);
                    }
                }
                for ((i, g), o) in ix.into_iter().zip(&gs).zip(m.read_into(&gs, ls)) {
                    if o.ok {
                        got[i] = Some(g.length as usize);
                    }
                    part[i] = o.slot;
                }
            })?;
            base = end;
        }
        let hits = out.iter().filter(|o| o.is_some()).count() as u64;
        let bytes = out.iter().flatten().map(|&n| n as u64).sum::<u64>();
        self.count_loads(found, hits, bytes);
        Ok(out)
    }

    fn count_loads(&mut self, found: usize, hits: u64, bytes: u64) {
        self.stats.hits += hits;
        self.stats.bytes_loaded += bytes;
        self.stats.load_failed += (found as u64).saturating_sub(hits);
    }

    /// One batch: acquire leases → `read(found indices, their leases, mover)` → release
    /// the leases. Counts misses; returns how many keys were found.
    fn load_some(
        &mut self,
        keys: &[String],
        read: &mut LeaseReader<'_>,
    ) -> Result<usize, WorkerError> {
        let leases = self.session.acquire(keys)?;
        let found: Vec<usize> = (0..keys.len()).filter(|&i| leases[i].is_some()).collect();
        let grants: Vec<LeaseGrant> = found.iter().filter_map(|&i| leases[i].clone()).collect();
        read(&found, &grants, self.mover.as_mut());
        if let Some(e) = self.mover.take_read_error() {
            self.stats.last_load_error = Some(e);
        }
        self.release_leases(grants.iter().map(|g| g.lease_id).collect());
        // A reboot found by this read: every reader misses those keys from now on.
        self.report_boots()?;
        self.stats.misses += (keys.len() - found.len()) as u64;
        Ok(found.len())
    }

    /// Pins (`pin`) or unpins found keys, a batch of at most `max_batch` at a time.
    pub fn pin(&mut self, keys: &[String], pin: bool) -> Result<Vec<bool>, WorkerError> {
        if pin {
            self.per_batch(keys, Session::pin)
        } else {
            self.per_batch(keys, Session::unpin)
        }
    }

    /// Unpublishes keys this session stored (see `RemoveResult` for the others).
    pub fn remove(
        &mut self,
        keys: &[String],
    ) -> Result<Vec<crate::wire::meta::RemoveResult>, WorkerError> {
        self.per_batch(keys, Session::remove)
    }

    pub fn exists(&mut self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        self.per_batch(keys, Session::exists)
    }

    /// One session call per `max_batch` keys, the answers in order.
    fn per_batch<T>(
        &mut self,
        keys: &[String],
        call: impl Fn(&mut Session, &[String]) -> Result<Vec<T>, WorkerError>,
    ) -> Result<Vec<T>, WorkerError> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.max_batch) {
            out.extend(call(&mut self.session, chunk)?);
        }
        Ok(out)
    }

    pub fn heartbeat(&mut self) -> Result<(), WorkerError> {
        self.mover.reclaim();
        let boots = self.mover.boot_ids();
        let regions = self
            .mover
            .own_regions()
            .into_iter()
            .filter(|r| !boots.contains_key(r))
            .collect();
        let reply = self.session.heartbeat(boots.clone(), regions)?;
        self.mover.reported(&boots);
        for id in &reply.rebooted_regions {
            log::warn!(
                "pool {}: maru-server dropped the keys of region {id}: its memory node rebooted",
                self.session.url
            );
        }
        for id in reply.unknown_regions {
            self.lose_region(id);
        }
        Ok(())
    }

    /// Periodic work (about once a second): the mover probes the agents of own
    /// regions; regions whose agent stayed silent too long are given back to
    /// maru-server (their keys go at once; its keeper releases them at the agent);
    /// a reboot found is reported.
    pub fn tick(&mut self, now_ms: u64) -> Result<(), WorkerError> {
        for id in self.mover.tick(now_ms) {
            match self.session.return_region(id, false) {
                Ok(()) | Err(WorkerError::Refused(_)) => self.lose_region(id),
                Err(e) => return Err(e),
            }
        }
        self.report_boots()
    }

    /// maru-server says the region is no longer the session's (the RM took it back
    /// while maru-server could not reach it, say): the spare pages in it go, and
    /// nothing more is written into it. Stores go on in the session's other regions.
    fn lose_region(&mut self, id: u64) {
        let before = self.spare.len();
        self.spare.retain(|p| p.region_id != id);
        self.mover.forget_region(id);
        if self.newest.is_some_and(|(r, _)| r == id) {
            self.newest = None;
        }
        self.stats.regions = self.stats.regions.saturating_sub(1);
        self.stats.regions_lost += 1;
        log::warn!(
            "pool {}: region {id} is no longer this session's (its memory went back to the resource manager): {} spare page(s) in it dropped; nothing more is written into it",
            self.session.url,
            before - self.spare.len()
        );
    }

    /// Views of the chunks in place (`cxl`): per key, its lease and view, the lease held
    /// until the caller releases it with `release_leases`. Keys that missed or whose
    /// view failed are `None` (their leases are released at once).
    pub fn acquire_views(
        &mut self,
        keys: &[String],
    ) -> Result<Vec<Option<(LeaseGrant, View)>>, WorkerError> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(self.max_batch) {
            let leases = self.session.acquire(part)?;
            let mut unused = Vec::new();
            for l in leases {
                let Some(l) = l else {
                    self.stats.misses += 1;
                    out.push(None);
                    continue;
                };
                match self.mover.view(&l) {
                    Some(v) => {
                        self.stats.hits += 1;
                        self.stats.bytes_loaded += l.length;
                        out.push(Some((l, v)));
                    }
                    None => {
                        self.stats.load_failed += 1;
                        unused.push(l.lease_id);
                        out.push(None);
                    }
                }
            }
            self.release_leases(unused);
        }
        Ok(out)
    }

    /// Ends leases (they also end by themselves when they time out).
    pub fn release_leases(&mut self, ids: Vec<u64>) {
        if let Err(e) = self.session.release_leases(ids) {
            log::warn!(
                "pool {}: releasing leases failed (they expire on their own): {e}",
                self.session.url
            );
        }
    }

    /// The maru-server this pool's session lived in restarted: release the session's
    /// regions at their agents (see `Mover::release_all`).
    pub fn release_regions(&mut self) -> (usize, usize) {
        self.mover.release_all()
    }

    pub fn close(&mut self) -> Result<(), WorkerError> {
        // maru-server hears the boot ids at a drained close too (the keeper compares
        // them): ask the agents first, so a reboot not seen yet is reported now.
        self.mover.check_agents(super::clock::now_ms());
        if let Err(e) = self.heartbeat() {
            log::warn!(
                "pool {}: heartbeat before close failed: {e}",
                self.session.url
            );
        }
        let spare: Vec<PageGrant> = self.spare.drain(..).collect();
        if let Err(e) = self.session.free_pages(&spare) {
            log::warn!(
                "pool {}: cannot return {} spare pages before closing: {e}",
                self.session.url,
                spare.len()
            );
        }
        self.session.close()
    }
}

/// A region's id and page count.
fn region_pages(g: &RegionGrant) -> (u64, u64) {
    (g.handle.region_id, g.pages)
}
