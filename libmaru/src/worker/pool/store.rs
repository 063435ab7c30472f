//! Stores of a pool, the driver of the core's rules (`core`): pages (spare, `alloc`,
//! `expand`, evictions) → the mover writes → the core re-checks → `publish` → pages
//! not used kept or freed. Every decision is the core's, under its lock; the round
//! trips and copies run without it.

use super::core::{Ending, PublishCheck, Taken, Unkept};
use super::deferred::Deferred;
use super::wire::EntryRef;
use super::{PageWriter, StoragePool, EVICT_AHEAD_BYTES, EVICT_AHEAD_PAGES};
use crate::wire::meta::{PageGrant, RemoveResult};
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::WorkerError;
use crate::worker::movers::{SlotWrite, WriteItem};
use crate::worker::skips::SkipReason;
use crate::worker::staging::Slot;
use crate::worker::warn_limit;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Pools whose next region is due ahead of need, for the handler's `maru-ahead` thread:
/// taking a region is a round trip to maru-server, which asks the resource manager
/// (milliseconds; 0.6 to 16 ms measured on the 2-core bench VM), so the call whose
/// pages reached the second half of the newest region does not wait for it.
pub type AheadQueue = Deferred<Arc<StoragePool>>;

impl AheadQueue {
    /// After a call of `pool`: queues it when that call found its next region due
    /// (`PoolCore::lead_due`). Best effort: with the queue full or closing, no region
    /// is taken ahead and a later store takes one when it needs it.
    pub fn note(&self, pool: &Arc<StoragePool>) {
        if pool.ahead_due.load(Ordering::Relaxed) && pool.ahead_due.swap(false, Ordering::AcqRel) {
            let _ = self.push(pool.clone());
        }
    }

    /// The ahead thread: takes the next region of each queued pool, by the session's
    /// own call timeout. Returns once the queue is closed; what is queued then is
    /// dropped (a closing handler takes no region).
    pub fn take(&self) {
        while let Some((pool, closing)) = self.next() {
            if !closing {
                pool.take_region_ahead(pool.session.call_deadline());
            }
        }
    }
}

/// Why `grow` took no region.
#[derive(Debug, thiserror::Error)]
enum NoRegion {
    /// None to give, or `max_bytes` held: room is made by evicting.
    #[error("{0}")]
    Full(String),
    /// One was taken and not made usable by the deadline: it went back.
    #[error("a region taken is not usable: {0}")]
    Unusable(WorkerError),
    /// A call failed (maru-server, or the configuration).
    #[error("{0}")]
    Failed(WorkerError),
}

impl StoragePool {
    /// Pages for `need` chunks beyond those `taken` already, marked as being written
    /// with their regions' tokens (`mark_writing`): spare ones first (taken and marked
    /// under one lock), else `find_pages`. Pages of a region not the pool's are freed
    /// and others looked for (`take_again`); chunks left without a page are counted as
    /// skipped.
    pub(super) fn take_pages(
        &self,
        mut taken: Taken,
        need: usize,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<Taken, WorkerError> {
        // Chunks counted as skipped already (no page, or an away agent's page).
        let mut counted = 0;
        let mut strays = 0;
        for round in 0.. {
            let want = need.saturating_sub(taken.pages.len() + counted);
            if want == 0 {
                break;
            }
            // Spare pages enough (the usual case): taken and marked under one lock.
            let (spare, marked) = {
                let mut c = self.core.lock();
                let spare = c.take_spare(want);
                if spare.len() == want {
                    (Vec::new(), Some(c.mark_writing(spare)))
                } else {
                    (spare, None)
                }
            };
            let (mut more, short) = match marked {
                Some(m) => (m, 0),
                None => {
                    let pages = self.find_pages(spare, want, route_key, by)?;
                    let short = want - pages.len();
                    (self.core.lock().mark_writing(pages), short)
                }
            };
            counted += short;
            let foreign = std::mem::take(&mut more.foreign);
            let away = std::mem::take(&mut more.away);
            strays = foreign.len();
            taken.merge(more);
            self.free_unkept(
                Unkept {
                    extra: Vec::new(),
                    foreign,
                },
                by,
            );
            if !away.is_empty() {
                counted += away.len();
                self.count_skip(
                    SkipReason::PoolUnavailable,
                    away.len() as u64,
                    "the agent of their pages is away (it did not answer); skipped at once until a probe sees it answer",
                );
                let unkept = self.core.lock().keep_spare(away);
                self.free_unkept(unkept, by);
            }
            if !super::core::take_again(round, strays, short) {
                break;
            }
        }
        let left = need.saturating_sub(taken.pages.len() + counted) as u64;
        if left > 0 {
            self.count_skip(
                SkipReason::NoRegion,
                left,
                &format!("{strays} page(s) maru-server gave were of a region this pool has not made usable by the request's deadline (or lost)"),
            );
        }
        Ok(taken)
    }

    /// Counts `n` chunks skipped for `reason` (`why` in the debug log; see `skips`).
    fn count_skip(&self, reason: SkipReason, n: u64, why: &str) {
        let what = format!("pool {}", self.session.url);
        let line = self.core.lock().skipped(reason, n, now_ms(), &what);
        log::debug!("{what}: {n} chunk(s) not stored: {why}");
        if let Some(line) = line {
            log::warn!("{line}");
        }
    }

    /// `pages` and more up to `need`: one `alloc` (with spares), then room made.
    fn find_pages(
        &self,
        mut pages: Vec<PageGrant>,
        need: usize,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<Vec<PageGrant>, WorkerError> {
        let short = need - pages.len();
        let spare_target = self.core.lock().spare_target;
        let ask = (short + spare_target).min(self.max_batch.max(short));
        let (got, _) = self.alloc(ask as u32, route_key, by)?;
        self.note_fill(&got);
        let mut got = got.into_iter();
        pages.extend(got.by_ref().take(short));
        let unkept = self.core.lock().keep_spare(got.collect());
        self.free_unkept(unkept, by);
        let mut missing = (need - pages.len()) as u32;
        // Rounds that ended with no page (other stores make room too: `room_given_up`).
        let mut dry = 0;
        while missing > 0 {
            let why = match self.grow(by) {
                Ok(()) => None,
                Err(NoRegion::Unusable(e)) => {
                    // Its own WARN below says more than the reason's line.
                    let what = format!("pool {}", self.session.url);
                    self.core.lock().skipped(
                        SkipReason::NoRegion,
                        u64::from(missing),
                        now_ms(),
                        &what,
                    );
                    if let Some(n) = warn_limit::allow(&self.session.url, "unusable_region") {
                        log::warn!(
                            "pool {}: {missing} chunk(s) not stored: a region taken for them could not be made usable ({e}); it went back to maru-server{}",
                            self.session.url,
                            warn_limit::held_back(n)
                        );
                    }
                    break;
                }
                Err(NoRegion::Failed(e)) => return Err(e),
                Err(NoRegion::Full(why)) => {
                    let ahead = (EVICT_AHEAD_BYTES / self.page_size().max(1)) as usize;
                    let freed = self.evict(missing as usize + ahead.max(EVICT_AHEAD_PAGES), by)?;
                    if freed == 0 {
                        self.core.lock().evicted_nothing();
                    }
                    (freed == 0).then_some(why)
                }
            };
            // Room other stores made may be spare pages now: those first.
            let spare = self.core.lock().take_spare(missing as usize);
            missing -= spare.len() as u32;
            let mut got_none = spare.is_empty();
            pages.extend(spare);
            if missing > 0 {
                let (more, m) = self.alloc(missing, route_key, by)?;
                self.note_fill(&more);
                got_none &= more.is_empty() && m == missing;
                pages.extend(more);
                missing = m;
            }
            if got_none {
                dry += 1;
                if super::core::room_given_up(dry) {
                    let reason = {
                        let mut c = self.core.lock();
                        c.stats.store_no_room += u64::from(missing);
                        c.no_room_reason()
                    };
                    self.count_skip(
                        reason,
                        u64::from(missing),
                        &format!(
                            "the pool has no region to give ({}) and every page of this \
                             engine's regions is leased, pinned or in use",
                            why.as_deref().unwrap_or("a region taken was full at once")
                        ),
                    );
                    break;
                }
            }
        }
        Ok(pages)
    }

    /// `alloc`; pages of a region not known yet wait (until `by`) while one is being
    /// taken (`waits_for_adoption`).
    fn alloc(
        &self,
        count: u32,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<(Vec<PageGrant>, u32), WorkerError> {
        let got = self.session.alloc(count, route_key, by)?;
        self.act_on_asks(by);
        drop(self.core.wait_while(by, |c| c.waits_for_adoption(&got.0)));
        Ok(got)
    }

    /// One more region, made usable by `by`; one the mover could not use goes back.
    fn grow(&self, by: Deadline) -> Result<(), NoRegion> {
        self.core
            .lock()
            .grow_begin(now_ms())
            .map_err(NoRegion::Full)?;
        let grant = match self.session.expand(by) {
            Ok(g) => g,
            Err(e) => {
                let full = matches!(e, WorkerError::NoSpace(_));
                self.core.lock().expand_answered(None, !full, now_ms());
                // Stores waiting for a region being taken (`waits_for_adoption`) go on.
                self.core.notify();
                return Err(match e {
                    WorkerError::NoSpace(why) => NoRegion::Full(why),
                    e => NoRegion::Failed(e),
                });
            }
        };
        let id = grant.handle.region_id;
        if let Some(f) = &self.hooks.before_adopt {
            f(&grant);
        }
        self.core.lock().expand_answered(Some(id), false, now_ms());
        let r = self.adopt_region(&grant, by);
        let back = self.core.lock().adopt_end(&grant, r.is_ok());
        self.core.notify();
        let Err(e) = r else {
            return Ok(());
        };
        if back {
            // So that no store gets pages of a region no mover knows.
            self.mover.forget(id);
            if let Err(re) = self.session.return_region(id, false, by) {
                log::warn!(
                    "pool {}: region {id}, taken and not made usable, could not be given back ({re})",
                    self.session.url
                );
            }
        }
        if e.is_fatal() {
            // A wrong configuration or key: the caller's to fix.
            Err(NoRegion::Failed(e))
        } else {
            Err(NoRegion::Unusable(e))
        }
    }

    /// Removes up to `want` of the session's keys in maru-server's victim order (never
    /// a leased or pinned one); returns how many went.
    fn evict(&self, want: usize, by: Deadline) -> Result<usize, WorkerError> {
        let victims = self.session.victims(want.min(self.max_batch) as u32, by)?;
        if victims.is_empty() {
            return Ok(0);
        }
        let names: Vec<&str> = victims.iter().map(|v| v.key.as_str()).collect();
        let results = self.session.remove(&names, by)?;
        let mut freed = 0;
        {
            let mut c = self.core.lock();
            for (v, r) in victims.iter().zip(&results) {
                if *r == RemoveResult::Removed {
                    freed += 1;
                    c.stats.evictions += 1;
                    c.stats.bytes_evicted += v.length;
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

    /// Notes whether these pages, just allocated, make the next region due ahead of
    /// need (`lead_due`): the handler's ahead thread takes it after the call
    /// (`AheadQueue`).
    pub(super) fn note_fill(&self, pages: &[PageGrant]) {
        if self.core.lock().lead_due(pages) {
            self.ahead_due.store(true, Ordering::Relaxed);
        }
    }

    /// Takes the next region ahead of need, best effort (the `maru-ahead` thread).
    pub fn take_region_ahead(&self, by: Deadline) {
        match self.grow(by) {
            Ok(()) => self.core.lock().stats.regions_ahead += 1,
            Err(e) => log::debug!(
                "pool {}: no region taken ahead ({e}); the next store that needs one asks again",
                self.session.url
            ),
        }
    }

    /// Frees at maru-server what `keep_spare` did not keep: pages beyond the spare
    /// bound, and pages of a region not the pool's (a lost one's free is refused:
    /// fine, they go with their region).
    fn free_unkept(&self, unkept: Unkept, by: Deadline) {
        for (pages, foreign) in [(unkept.extra, false), (unkept.foreign, true)] {
            if pages.is_empty() {
                continue;
            }
            if let Err(e) = self.session.free_pages(&pages, by) {
                let (url, n) = (&self.session.url, pages.len());
                if foreign {
                    log::debug!("pool {url}: {n} page(s) of a region not this pool's not freed ({e}); they go with their region");
                } else {
                    log::warn!("pool {url}: cannot return {n} unused pages: {e}");
                }
            }
        }
    }

    /// What the mover wrote, through the test hook (`after_write`); a warning (at most
    /// one per pool every 10 s) for chunks whose bytes were not written.
    fn written(&self, placed: &[(usize, PageGrant)], mut ok: Vec<bool>) -> Vec<bool> {
        if let Some(f) = &self.hooks.after_write {
            for ((_, p), ok) in placed.iter().zip(ok.iter_mut()) {
                *ok = f(p, *ok);
            }
        }
        let mut regions: Vec<u64> = Vec::new();
        let mut n = 0usize;
        for ((_, p), _) in placed.iter().zip(&ok).filter(|(_, &ok)| !ok) {
            n += 1;
            if !regions.contains(&p.region_id) {
                regions.push(p.region_id);
            }
        }
        if n > 0 {
            if let Some(held) = warn_limit::allow(&self.session.url, "unwritten") {
                log::warn!(
                    "pool {}: {n} chunk(s) not stored: their bytes could not be written into region(s) {regions:?} by the request's deadline (an agent that does not answer, a failed transfer); they are skipped{}",
                    self.session.url,
                    warn_limit::held_back(held)
                );
            }
        }
        ok
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
            let r = self.store_some(&keys, &lens, route_key, by, &mut |p, todo, to, by| {
                let writes: Vec<WriteItem<'_>> = todo
                    .iter()
                    .map(|&(i, page)| WriteItem {
                        page,
                        data: chunk[i].1,
                    })
                    .collect();
                p.mover.write(&writes, to, by)
            })?;
            done[base..base + r.len()].copy_from_slice(&r);
        }
        Ok(done)
    }

    /// Stores `lens[i]` bytes of `slots[i]`; each slot back in `slots` afterwards but
    /// one of unknown outcome (`None`: back in its pool once its peer is fenced).
    pub fn store_slots(
        &self,
        keys: &[&str],
        slots: &mut [Option<Slot>],
        lens: &[usize],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let by = self.deadline();
        let mut done = Vec::with_capacity(keys.len());
        for (c, part) in slots[..keys.len()].chunks_mut(self.max_batch).enumerate() {
            let base = c * self.max_batch;
            let end = base + part.len();
            let r = self.store_some(
                &keys[base..end],
                &lens[base..end],
                route_key,
                by,
                &mut |p, todo, to, by| {
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
                    for ((k, i), o) in placed.into_iter().zip(p.mover.write_slots(writes, to, by)) {
                        ok[k] = o.ok;
                        part[i] = o.slot;
                    }
                    ok
                },
            )?;
            done.extend(r);
        }
        Ok(done)
    }

    /// One batch (at most `max_batch` chunks), one core call per phase: the start
    /// (`PoolCore::store_begin`: skip at once, or the spare pages taken) → `exists` →
    /// more pages only if needed → `write` → the re-check (`publish_begin`) and
    /// `publish` → the end (`PoolCore::store_end`).
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
        let begun = if self.session.away() {
            Err("maru-server is away (it did not answer)")
        } else {
            let t = self.core.lock().store_begin(keys.len());
            t.ok_or("the agents of every region of the pool are away (they did not answer)")
        };
        let first = match begun {
            Ok(t) => t,
            Err(why) => {
                self.count_skip(
                    SkipReason::PoolUnavailable,
                    keys.len() as u64,
                    &format!("{why}; skipped at once until a probe sees it answer"),
                );
                return Ok(vec![false; keys.len()]);
            }
        };
        // Keys already present are not written again: `exists` says which, unless
        // the session's last store found none present (a run of new keys, the common
        // case), when the store saves that round trip and writes them all; its publish
        // (the first publish of a key wins, the others change nothing) then says which
        // were present, their pages go back to the spares, and the next store asks.
        let present = if self.session.store_asks_exists() {
            match self.session.exists(keys, by) {
                Ok(p) => {
                    self.session.note_store_found(p.contains(&true));
                    p
                }
                Err(e) => {
                    self.store_end(Ending::of(first.pages), by);
                    return Err(e);
                }
            }
        } else {
            vec![false; keys.len()]
        };
        let todo: Vec<usize> = (0..keys.len()).filter(|&i| !present[i]).collect();
        let taken = self.take_pages(first, todo.len(), route_key, by)?;
        let placed: Vec<(usize, PageGrant)> = todo
            .iter()
            .copied()
            .zip(taken.pages.iter().copied())
            .collect();
        // Pages taken beyond the chunks placed (for chunks already present) are unused.
        let mut end = Ending::of(taken.pages.iter().skip(placed.len()).copied().collect());
        end.writing = taken.pages.iter().map(|p| p.region_id).collect();
        end.present = (keys.len() - todo.len()) as u64;
        let r = if placed.is_empty() {
            Ok(present)
        } else {
            let ok = self.written(&placed, write(self, &placed, &taken.to, by));
            let pages: Vec<PageGrant> = placed.iter().map(|(_, p)| *p).collect();
            let entry = |k: usize, _| {
                let (i, page) = placed[k];
                EntryRef {
                    key: keys[i],
                    region_id: page.region_id,
                    offset: page.offset,
                    length: lens[i] as u64,
                    // A batch is the chunks of one request in chain order.
                    prev: i.checked_sub(1).map(|j| keys[j]),
                }
            };
            self.publish(&pages, &ok, &taken, &entry, &mut end, by)
                .map(|done| {
                    let mut stored = present;
                    for k in done {
                        stored[placed[k].0] = true;
                    }
                    stored
                })
        };
        // Whatever happened: the pages are no longer being written by this store.
        self.store_end(end, by);
        r
    }

    /// The end of a store, one core call (`PoolCore::store_end`), then what it decided
    /// carried out: pages not kept freed, regions given back.
    pub(super) fn store_end(&self, end: Ending, by: Deadline) {
        let (unkept, gone) = self.core.lock().store_end(end);
        self.core.notify();
        self.free_unkept(unkept, by);
        self.carry_out(gone, by);
    }

    /// Regions maru-server asked back on a reply: given back now (or by their last writer).
    pub(super) fn act_on_asks(&self, by: Deadline) {
        let asked = self.session.take_asked();
        if asked.is_empty() {
            return;
        }
        let gone = self.core.lock().asked_on_reply(&asked);
        self.core.notify();
        self.carry_out(gone, by);
    }

    /// The core's re-check of a publish (`PoolCore::publish_begin`), a heartbeat first
    /// when it asks (at most `REPORT_TRIES`, each by `by`).
    fn recheck(
        &self,
        pages: &[PageGrant],
        ok: &[bool],
        taken: &Taken,
        by: Deadline,
    ) -> Result<super::core::PublishPlan, WorkerError> {
        let mut reports = 0;
        loop {
            match self.core.lock().publish_begin(pages, ok, taken, reports) {
                PublishCheck::Go(plan) => return Ok(plan),
                PublishCheck::Report => {}
            }
            // Fails once `by` passed: the loop ends by the deadline whatever the core says.
            self.heartbeat(by)?;
            reports += 1;
        }
    }

    /// Publishes the chunks of `pages` (complete where `ok`) that pass the core's
    /// re-check, chunk `k` as `entry(k, the chunk published before it)`; the pages that
    /// hold no key, the publish's answer and the asks on its reply go to `end`.
    /// Returns the chunks published.
    pub(super) fn publish<'k>(
        &self,
        pages: &[PageGrant],
        ok: &[bool],
        taken: &Taken,
        entry: &dyn Fn(usize, Option<usize>) -> EntryRef<'k>,
        end: &mut Ending,
        by: Deadline,
    ) -> Result<Vec<usize>, WorkerError> {
        if let Some(hook) = &self.hooks.before_publish {
            hook(self, pages);
        }
        let mut plan = self.recheck(pages, ok, taken, by)?;
        if self.hooks.unfenced && !plan.unused.is_empty() {
            plan.held += plan.unused.len();
            plan.unused.clear();
        }
        if plan.lost > 0 {
            log::warn!(
                "pool {}: {} chunk(s) written into a region that was lost, taken again or whose memory node rebooted before their publish: not published",
                self.session.url,
                plan.lost
            );
        }
        if plan.held > 0 {
            log::warn!(
                "pool {}: keeping {} pages of failed writes out of reuse until their region goes back (a transfer of unknown outcome was not fenced)",
                self.session.url,
                plan.held
            );
        }
        end.unused.extend(plan.unused);
        if plan.publish.is_empty() {
            return Ok(Vec::new());
        }
        let before = |j: usize| j.checked_sub(1).map(|p| plan.publish[p]);
        let entries: Vec<EntryRef<'_>> = (plan.publish.iter().enumerate())
            .map(|(j, &k)| entry(k, before(j)))
            .collect();
        let published = (plan.publish.iter().zip(&entries))
            .map(|(&k, e)| (pages[k], e.length))
            .collect();
        let answer = self.session.publish_refs(&entries, by);
        // Not answered: the published chunks' pages stay out of use (the keys may be
        // published).
        end.publish = Some((plan.ticket, published, answer.as_ref().ok().cloned()));
        end.asked.extend(self.session.take_asked());
        if answer?.contains(&false) {
            self.session.note_store_found(true);
        }
        Ok(plan.publish)
    }
}
