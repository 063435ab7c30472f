//! Stores of a pool, the driver of the core's rules (`core`): pages (spare ones
//! first, then `alloc`, expanding the session when its regions are full, a region
//! taken ahead for movers that want a lead) → the mover writes the chunks → only
//! chunks whose bytes are complete are published (after maru-server has the regions'
//! boot ids, and only into regions still the pool's on the boot they were written
//! under) → pages not used are kept or freed, except pages a WRITE of unknown
//! outcome may still reach.
//!
//! Every decision is the core's, under its lock; the round trips (maru-server,
//! agents) and the copies run without it.

use super::core::{PublishCheck, Taken, Unkept};
use super::{PageWriter, StoragePool, EVICT_AHEAD_BYTES, EVICT_AHEAD_PAGES};
use crate::wire::meta::{PageGrant, PublishEntry, RemoveResult};
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::WorkerError;
use crate::worker::movers::{SlotOutcome, SlotWrite, WriteItem};
use crate::worker::skips::SkipReason;
use crate::worker::staging::Slot;
use crate::worker::warn_limit;

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

impl StoragePool {
    /// Pages for `need` chunks: spare ones first, then one `alloc` that also takes
    /// spares for later stores, expanding the session when its regions are full.
    /// Fewer than `need` when the session cannot grow. The pages are marked as being
    /// written (their regions are not given back until `end_writing`), and the token
    /// of each of their regions noted (see `core::Token`).
    ///
    /// Pages of a region that is not the pool's (its adoption not done by `by`, or
    /// the region lost meanwhile) are freed and others looked for, a few rounds; the
    /// chunks still without a page then are counted as skipped (no region), never
    /// left out silently.
    pub(super) fn take_pages(
        &self,
        need: usize,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<Taken, WorkerError> {
        let mut taken = Taken::default();
        // Chunks `find_pages` found no page for (it counted them as skipped), and
        // chunks whose page is at an agent that is away.
        let mut counted = 0;
        let mut strays = 0;
        for round in 0.. {
            let want = need - taken.pages.len() - counted;
            if want == 0 {
                break;
            }
            let pages = self.find_pages(want, route_key, by)?;
            let short = want - pages.len();
            counted += short;
            let mut more = self.core.lock().mark_writing(pages);
            let foreign = std::mem::take(&mut more.foreign);
            let away = std::mem::take(&mut more.away);
            strays = foreign.len();
            taken.merge(more);
            self.free_foreign(foreign, by);
            if !away.is_empty() {
                counted += away.len();
                self.count_skip(
                    SkipReason::PoolUnavailable,
                    away.len() as u64,
                    "the agent of their pages is away (it did not answer); skipped at once until a probe sees it answer",
                );
                self.keep_spare(away, by);
            }
            if !super::core::take_again(round, strays, short) {
                break;
            }
        }
        let left = (need - taken.pages.len() - counted) as u64;
        if left > 0 {
            self.count_skip(
                SkipReason::NoRegion,
                left,
                &format!("{strays} page(s) maru-server gave were of a region this pool has not made usable by the request's deadline (or lost)"),
            );
        }
        Ok(taken)
    }

    /// Counts `n` chunks of a store skipped for `reason` (`why`, in the debug log),
    /// and logs the reason's WARN line when one is due (see `skips`).
    fn count_skip(&self, reason: SkipReason, n: u64, why: &str) {
        let what = format!("pool {}", self.session.url);
        let line = self.core.lock().skipped(reason, n, now_ms(), &what);
        log::debug!("{what}: {n} chunk(s) not stored: {why}");
        if let Some(line) = line {
            log::warn!("{line}");
        }
    }

    /// Frees pages maru-server gave of a region that is not the pool's (see
    /// `Taken::foreign`): they hold no key. A region lost meanwhile took them with
    /// it, and maru-server refuses the free: nothing to do then.
    fn free_foreign(&self, pages: Vec<PageGrant>, by: Deadline) {
        if pages.is_empty() {
            return;
        }
        if let Err(e) = self.session.free_pages(&pages, by) {
            log::debug!(
                "pool {}: {} page(s) of a region not this pool's not freed ({e}); they go with their region",
                self.session.url,
                pages.len()
            );
        }
    }

    fn find_pages(
        &self,
        need: usize,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<Vec<PageGrant>, WorkerError> {
        let mut pages = self.core.lock().take_spare(need);
        if pages.len() == need {
            return Ok(pages);
        }
        let short = need - pages.len();
        let spare_target = self.core.lock().spare_target();
        let ask = (short + spare_target).min(self.max_batch.max(short));
        let (got, _) = self.alloc(ask as u32, route_key, by)?;
        self.note_fill(&got, by);
        let mut got = got.into_iter();
        pages.extend(got.by_ref().take(short));
        let unkept = self.core.lock().keep_spare(got.collect());
        self.free_unkept(unkept, by);
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
            // Other stores of this pool may have taken the room made here as their
            // spare pages (the pool's, so this store's too): those first.
            let spare = self.core.lock().take_spare(missing as usize);
            missing -= spare.len() as u32;
            let mut got_none = spare.is_empty();
            pages.extend(spare);
            if missing > 0 {
                let (more, m) = self.alloc(missing, route_key, by)?;
                self.note_fill(&more, by);
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

    /// `alloc` at maru-server. maru-server allocates from any region of the session,
    /// also one another store is taking now (its `expand` answered, the mover's
    /// adoption not done): pages of a region the pool does not know yet wait (until
    /// `by`) for the adoptions in progress, so no store writes into a region before it
    /// is usable. Other allocs do not wait for a region being taken.
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

    /// One more region for the session, within `max_bytes` (counting the regions
    /// other stores are taking now), made usable by `by`. A region the mover could
    /// not make usable goes back at once.
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
            // The session has the region, the mover could not map it: it goes back
            // at once (maru-server's keeper releases it at its agent), so that no
            // store gets pages of a region no mover knows.
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

    /// Removes up to `want` keys of the session's own regions, in the order
    /// maru-server offers them (tails of prefix chains first; never a leased or
    /// pinned key), so that their pages can take new chunks. A page is reused only
    /// after maru-server acknowledged its key's removal, and a removal is refused
    /// while a lease (a reader's, or one of this handler's views) covers it. Returns
    /// how many keys went.
    fn evict(&self, want: usize, by: Deadline) -> Result<usize, WorkerError> {
        let victims = self.session.victims(want.min(self.max_batch) as u32, by)?;
        if victims.is_empty() {
            return Ok(0);
        }
        let names: Vec<String> = victims.iter().map(|v| v.key.clone()).collect();
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

    /// Takes the next region ahead when stores reach the second half of the newest
    /// (once per region, best effort: a pool without space answers the store that
    /// needs the region).
    pub(super) fn note_fill(&self, pages: &[PageGrant], by: Deadline) {
        if !self.core.lock().lead_due(pages) {
            return;
        }
        match self.grow(by) {
            Ok(()) => self.core.lock().stats.regions_ahead += 1,
            Err(e) => log::debug!(
                "pool {}: no region taken ahead ({e}); the next store that needs one asks again",
                self.session.url
            ),
        }
    }

    /// Frees pages at maru-server (those beyond the spare bound).
    pub(super) fn free(&self, pages: Vec<PageGrant>, by: Deadline) {
        if pages.is_empty() {
            return;
        }
        if let Err(e) = self.session.free_pages(&pages, by) {
            log::warn!(
                "pool {}: cannot return {} unused pages: {e}",
                self.session.url,
                pages.len()
            );
        }
    }

    /// Keeps pages that hold no key for the next stores (those of regions still the
    /// pool's); frees what is beyond the bound.
    pub(super) fn keep_spare(&self, pages: Vec<PageGrant>, by: Deadline) {
        if pages.is_empty() {
            return;
        }
        let unkept = self.core.lock().keep_spare(pages);
        self.free_unkept(unkept, by);
    }

    /// Frees what `keep_spare` did not keep.
    fn free_unkept(&self, unkept: Unkept, by: Deadline) {
        self.free(unkept.extra, by);
        self.free_foreign(unkept.foreign, by);
    }

    /// Writes chunks into their pages through the mover, by `by`; true where the
    /// bytes are complete.
    pub(super) fn write_items(&self, items: &[WriteItem<'_>], by: Deadline) -> Vec<bool> {
        let ok = self.mover.write(items, by);
        let ok: Vec<bool> = match &self.hooks.after_write {
            Some(f) => items
                .iter()
                .zip(ok)
                .map(|(it, ok)| f(&it.page, ok))
                .collect(),
            None => ok,
        };
        self.warn_unwritten(items.iter().map(|it| &it.page).zip(ok.iter().copied()));
        ok
    }

    /// A warning (at most one per pool every 10 s) when chunks were not stored
    /// because their bytes could not be written: an agent that does not answer, a
    /// transfer that failed, a region lost meanwhile.
    fn warn_unwritten<'a>(&self, written: impl Iterator<Item = (&'a PageGrant, bool)>) {
        let mut regions: Vec<u64> = Vec::new();
        let mut n = 0usize;
        for (p, ok) in written {
            if !ok {
                n += 1;
                if !regions.contains(&p.region_id) {
                    regions.push(p.region_id);
                }
            }
        }
        if n == 0 {
            return;
        }
        if let Some(held) = warn_limit::allow(&self.session.url, "unwritten") {
            log::warn!(
                "pool {}: {n} chunk(s) not stored: their bytes could not be written into region(s) {regions:?} by the request's deadline (an agent that does not answer, a failed transfer); they are skipped{}",
                self.session.url,
                warn_limit::held_back(held)
            );
        }
    }

    /// Writes from the caller's staging slots (see `write_items`).
    pub(super) fn write_slots(&self, items: Vec<SlotWrite>, by: Deadline) -> Vec<SlotOutcome> {
        let pages: Vec<PageGrant> = items.iter().map(|it| it.page).collect();
        let mut out = self.mover.write_slots(items, by);
        if let Some(f) = &self.hooks.after_write {
            for (o, p) in out.iter_mut().zip(&pages) {
                o.ok = f(p, o.ok);
            }
        }
        self.warn_unwritten(pages.iter().zip(out.iter().map(|o| o.ok)));
        out
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
        let why = if self.session.away() {
            // maru-server did not answer a call by its deadline.
            Some("maru-server is away (it did not answer)")
        } else if self.core.lock().every_region_away() {
            // Every page this store could take is at an agent that did not answer.
            Some("the agents of every region of the pool are away (they did not answer)")
        } else {
            None
        };
        if let Some(why) = why {
            self.count_skip(
                SkipReason::PoolUnavailable,
                keys.len() as u64,
                &format!("{why}; skipped at once until a probe sees it answer"),
            );
            return Ok(vec![false; keys.len()]);
        }
        let owned: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let present = self.session.exists(&owned, by)?;
        let todo: Vec<usize> = (0..keys.len()).filter(|&i| !present[i]).collect();
        self.core.lock().stats.already_present += (keys.len() - todo.len()) as u64;
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
        let r = self.publish(keys, lens, present, &placed, &ok, &taken, by);
        // Whatever happened: the pages are no longer being written by this store.
        self.end_writing(taken.pages.iter().map(|p| p.region_id), by);
        r
    }

    /// Pages of these regions (one entry per page) are no longer being written (their
    /// store or writer in place published or dropped them): the last writer into a
    /// region maru-server asked for gives it back.
    /// Regions maru-server asked back on the reply to a call of this session: given
    /// back now (or by their last writer), not at the next heartbeat.
    pub(super) fn act_on_asks(&self, by: Deadline) {
        let asked = self.session.take_asked();
        if asked.is_empty() {
            return;
        }
        let gone = self.core.lock().asked_on_reply(&asked);
        self.core.notify();
        self.carry_out(gone, by);
    }

    pub(super) fn end_writing(&self, regions: impl IntoIterator<Item = u64>, by: Deadline) {
        let done = self.core.lock().end_writing(regions);
        self.carry_out(done, by);
    }

    /// The core's re-check of a publish (see `PoolCore::publish_begin`), after
    /// maru-server heard the boot ids of the regions it writes into: reported first
    /// when needed (a region adopted for this store, or a reboot found), at most
    /// `REPORT_TRIES` times, every report by the store's deadline `by`; regions other
    /// stores adopt meanwhile do not hold it back.
    pub(super) fn recheck(
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

    /// Sends a publish the core re-checked (`ticket`) and tells the core how it went
    /// (the publish is no longer in flight); with the pages it freed for later stores
    /// (keys another engine published first).
    pub(super) fn send_publish(
        &self,
        ticket: Option<u64>,
        entries: Vec<PublishEntry>,
        by: Deadline,
    ) -> (Result<Vec<bool>, WorkerError>, Vec<PageGrant>) {
        let page_size = self.page_size().max(1);
        let published: Vec<(PageGrant, u64)> = entries
            .iter()
            .map(|e| {
                let page = PageGrant {
                    region_id: e.region_id,
                    page: e.offset / page_size,
                    offset: e.offset,
                    length: page_size,
                };
                (page, e.length)
            })
            .collect();
        let answer = self.session.publish(entries, by);
        let back = self.core.lock().publish_end(
            ticket,
            &published,
            answer.as_ref().ok().map(Vec::as_slice),
        );
        self.core.notify();
        self.act_on_asks(by);
        (answer, back)
    }

    /// Publishes the chunks whose bytes are complete (`ok`), into regions that are
    /// still the pool's on the boot they were written under (the core's re-check). A
    /// chunk that fails the check is not published and counts as skipped. Pages not
    /// used are kept or freed.
    #[allow(clippy::too_many_arguments)] // one store's state, and its deadline
    pub(super) fn publish(
        &self,
        keys: &[&str],
        lens: &[usize],
        mut result: Vec<bool>,
        placed: &[(usize, PageGrant)],
        ok: &[bool],
        taken: &Taken,
        by: Deadline,
    ) -> Result<Vec<bool>, WorkerError> {
        if let Some(hook) = &self.hooks.before_publish {
            hook(self, &taken.pages);
        }
        let pages: Vec<PageGrant> = placed.iter().map(|(_, p)| *p).collect();
        let mut plan = self.recheck(&pages, ok, taken, by)?;
        if self.hooks.unfenced && !plan.unused.is_empty() {
            plan.held += plan.unused.len();
            plan.unused.clear();
        }
        if plan.lost > 0 {
            log::warn!(
                "pool {}: {} chunk(s) written into a region that was lost or whose memory node rebooted before their publish: not published",
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
        let mut unused = plan.unused;
        // Pages taken beyond the chunks placed (none normally).
        unused.extend(taken.pages.iter().skip(placed.len()).copied());
        if plan.publish.is_empty() {
            self.keep_spare(unused, by);
            return Ok(result);
        }
        let entries: Vec<PublishEntry> = plan
            .publish
            .iter()
            .map(|&k| {
                let (i, page) = placed[k];
                PublishEntry {
                    key: keys[i].to_string(),
                    region_id: page.region_id,
                    offset: page.offset,
                    length: lens[i] as u64,
                    // A batch is the chunks of one request in chain order.
                    prev: i.checked_sub(1).map(|j| keys[j].to_string()),
                }
            })
            .collect();
        let (answer, back) = self.send_publish(plan.ticket, entries, by);
        let is_new = match answer {
            Ok(n) => n,
            Err(e) => {
                // The published chunks' pages stay out of use (the keys may be
                // published); the others hold no key.
                self.keep_spare(unused, by);
                return Err(e);
            }
        };
        for (&k, _) in plan.publish.iter().zip(is_new) {
            result[placed[k].0] = true;
        }
        unused.extend(back);
        // Pages that hold no key (and no write in flight) serve the next stores.
        self.keep_spare(unused, by);
        Ok(result)
    }
}
