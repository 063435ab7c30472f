//! The core's side of durability ([`Journal`]): the batch changes go into, the last
//! one made durable, and the pages freed by key removals that wait to be handed out
//! again ([`PendingPages`]); the rules are in [`durable`](super::durable).
//!
//! A leaf of the meta module: the core holds a journal, and `durable`, which acts on
//! the core, reads and changes it (the types are here, not in `durable`, so that the
//! core does not import the module that imports it).

use super::keys::ScopeId;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// A session's allocation rate is counted over windows this long: a session that
/// took more than half a block in its last full window keeps that many reserved (up
/// to [`RESERVE_MAX_BLOCKS`](super::durable::RESERVE_MAX_BLOCKS) blocks), so that its
/// allocs do not outrun the commit of its next block (4 ms of waiting for others plus
/// the `fdatasync`: far below a window).
pub const RATE_WINDOW_MS: u64 = 100;

/// Pages a session took in its current and its last full [`RATE_WINDOW_MS`] window.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct AllocRate {
    start_ms: u64,
    this: u64,
    pub(super) last: u64,
}

impl AllocRate {
    pub(super) fn note(&mut self, pages: u64, now_ms: u64) {
        let since = now_ms.saturating_sub(self.start_ms);
        if since >= RATE_WINDOW_MS {
            self.last = if since < 2 * RATE_WINDOW_MS {
                self.this
            } else {
                0
            };
            self.this = 0;
            self.start_ms = now_ms;
        }
        self.this = self.this.saturating_add(pages);
    }
}

/// When the reply to the request just handled may go, with a durable directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplyTiming {
    /// Once what the request changed is durable (at once when it changed nothing).
    #[default]
    AfterItsChanges,
    /// At once, before what it changed is durable: a publish (a crash in the window
    /// loses the key, never bytes), an alloc answered from pages whose reservation
    /// is durable (what it changed is only the reserve's next block), a removal of
    /// keys whose publish has not gone to the store yet (both go in one batch: a
    /// crash loses both, so a key said removed never comes back).
    Early,
    /// Once every batch so far is durable, even if the request changed nothing
    /// itself: an alloc that took reserved pages whose reservation is not yet.
    AfterAll,
}

/// A page freed by a key's removal, waiting to be handed out again.
#[derive(Debug, Clone, Copy)]
pub(super) struct PendingPage {
    /// The batch that carries the removal.
    pub(super) batch: u64,
    /// Not before this time (a lease of the last run a worker said it holds).
    pub(super) not_before_ms: u64,
    pub(super) region_id: u64,
    pub(super) page: u64,
    /// A key of the last run held it: it also waits for the leases of that run
    /// ([`OldLeases`]).
    pub(super) recovered: bool,
    /// The scope of the key that held it.
    pub(super) scope: ScopeId,
}

/// The pages waiting to be handed out again, each looked at when it may go rather
/// than at every request and every turn of the loop (issue 46: both walked all of
/// them). A page waits first for its batch to be durable ([`fresh`](Self::fresh), in
/// batch order); a page of a recovered key then waits for the leases of the last run
/// ([`recovered`](Self::recovered)), and once none can cover it, for its own time
/// ([`timed`](Self::timed)).
#[derive(Debug, Default)]
pub(super) struct PendingPages {
    /// Pages whose removal is not durable yet, in the order freed (so by batch).
    fresh: VecDeque<PendingPage>,
    /// Pages of recovered keys, removal durable, while leases of the last run may
    /// cover them: by (region, page).
    recovered: BTreeMap<(u64, u64), PendingPage>,
    /// Pages of recovered keys once no lease of the last run but those reported may
    /// cover them: by (not before, region, page).
    timed: BTreeMap<(u64, u64, u64), PendingPage>,
    /// Pages of recovered keys among all of them.
    recovered_count: usize,
    /// Pages looked at so far (a measure of the work, for the tests).
    visited: std::cell::Cell<u64>,
}

impl PendingPages {
    pub(super) fn len(&self) -> usize {
        self.fresh.len() + self.recovered.len() + self.timed.len()
    }

    /// Pages looked at so far.
    #[cfg(test)]
    pub(super) fn visited(&self) -> u64 {
        self.visited.get()
    }

    fn visit(&self, n: usize) {
        self.visited.set(self.visited.get() + n as u64);
    }

    /// Whether a page of a recovered key waits.
    pub(super) fn has_recovered(&self) -> bool {
        self.recovered_count > 0
    }

    /// `p` waits, freed in batch `p.batch` (the open one: batches only grow).
    pub(super) fn push(&mut self, p: PendingPage) {
        debug_assert!(self.fresh.back().is_none_or(|b| b.batch <= p.batch));
        if p.recovered {
            self.recovered_count += 1;
        }
        self.fresh.push_back(p);
    }

    fn wait_timed(&mut self, p: PendingPage) {
        self.timed.insert((p.not_before_ms, p.region_id, p.page), p);
    }

    /// The pages that may be handed out at `now_ms`, taken out: every batch up to
    /// `durable` is durable, and `over` says no lease of the last run can cover a
    /// recovered key's page any more (it stays so). Visits the pages it takes out and
    /// at most one more of each kind (and, once, the recovered pages when `over`
    /// first holds).
    pub(super) fn take_ready(&mut self, durable: u64, now_ms: u64, over: bool) -> Vec<PendingPage> {
        let mut out = Vec::new();
        while let Some(p) = self.fresh.front() {
            self.visit(1);
            if p.batch > durable {
                break;
            }
            let Some(p) = self.fresh.pop_front() else {
                break;
            };
            match (p.recovered, over) {
                (false, _) => out.push(p),
                (true, false) => {
                    self.recovered.insert((p.region_id, p.page), p);
                }
                (true, true) => self.wait_timed(p),
            }
        }
        if over && !self.recovered.is_empty() {
            let waiting = std::mem::take(&mut self.recovered);
            self.visit(waiting.len());
            for p in waiting.into_values() {
                self.wait_timed(p);
            }
        }
        let from_fresh = out.len();
        while let Some(e) = self.timed.first_entry() {
            if e.key().0 > now_ms {
                break;
            }
            out.push(e.remove());
        }
        self.visit(out.len() - from_fresh + 1);
        self.recovered_count -= out.iter().filter(|p| p.recovered).count();
        out
    }

    /// When a page whose removal is durable may be handed out: at once when one is
    /// ready (`take_ready` has not run since), at `until` for the pages of recovered
    /// keys while the leases of the last run may cover them, else at the soonest of
    /// their own times. Visits no page but the first of each kind.
    pub(super) fn next_deadline(&self, durable: u64, over: bool, until: u64) -> Option<u64> {
        self.visit(1);
        let fresh = self.fresh.front().filter(|p| p.batch <= durable).map(|_| 0);
        let recovered = (!self.recovered.is_empty()).then_some(if over { 0 } else { until });
        let timed = self.timed.keys().next().map(|k| k.0);
        [fresh, recovered, timed].into_iter().flatten().min()
    }

    /// Session of the last run reports a lease of the page `page` of `region_id`
    /// ending at `ends_ms`: the page, if it waits as a recovered key's of `scope`,
    /// waits until then too. Whether it waits so.
    pub(super) fn lease_held(
        &mut self,
        region_id: u64,
        page: u64,
        scope: ScopeId,
        ends_ms: u64,
    ) -> bool {
        let mine = |p: &PendingPage| p.recovered && p.scope == scope;
        let mut found = false;
        self.visit(1);
        if let Some(p) = self.recovered.get_mut(&(region_id, page)) {
            if mine(p) {
                p.not_before_ms = p.not_before_ms.max(ends_ms);
                found = true;
            }
        }
        // Not yet durable: the last batch or so.
        self.visit(self.fresh.len());
        for p in self.fresh.iter_mut() {
            if p.region_id == region_id && p.page == page && mine(p) {
                p.not_before_ms = p.not_before_ms.max(ends_ms);
                found = true;
            }
        }
        // Past the leases of the last run: a report changes its time (and key).
        let key = self
            .timed
            .iter()
            .find(|(_, p)| p.region_id == region_id && p.page == page && mine(p))
            .map(|(k, _)| *k);
        self.visit(self.timed.len());
        if let Some(mut p) = key.and_then(|k| self.timed.remove(&k)) {
            p.not_before_ms = p.not_before_ms.max(ends_ms);
            self.wait_timed(p);
            found = true;
        }
        found
    }

    /// Until when each of `regions` must be held back for the pages of recovered keys
    /// that wait in it (a reader of the last run may still read them), at `now_ms`:
    /// those waiting for the leases of the last run (`over` false) until `recheck` or
    /// their own time, the others until their own time; only times after `now_ms`.
    /// Looks up each region, and the pages not durable yet and those past the leases
    /// of the last run (a few).
    pub(super) fn holds(
        &self,
        regions: &BTreeSet<u64>,
        now_ms: u64,
        over: bool,
        recheck: u64,
    ) -> BTreeMap<u64, u64> {
        let mut out: BTreeMap<u64, u64> = BTreeMap::new();
        let mut hold = |p: &PendingPage| {
            let t = if p.recovered && !over {
                recheck.max(p.not_before_ms)
            } else {
                p.not_before_ms
            };
            if t > now_ms && regions.contains(&p.region_id) {
                let h = out.entry(p.region_id).or_default();
                *h = (*h).max(t);
            }
        };
        for &rid in regions {
            for p in self
                .recovered
                .range((rid, 0)..=(rid, u64::MAX))
                .map(|(_, p)| p)
            {
                self.visit(1);
                hold(p);
            }
        }
        self.visit(self.fresh.len() + self.timed.len());
        self.fresh
            .iter()
            .filter(|p| p.recovered)
            .for_each(&mut hold);
        self.timed.values().for_each(&mut hold);
        out
    }
}

/// The leases of the last run, which a restart does not know.
#[derive(Debug)]
pub(super) struct OldLeases {
    /// Keys up to this id were recovered.
    pub(super) last_key: u64,
    /// Every lease of the last run has run out by then.
    pub(super) until_ms: u64,
    /// Sessions of the last run that have not yet said which leases they hold.
    pub(super) silent: BTreeSet<u64>,
    /// Some session of the last run was not restored: only `until_ms` ends the wait.
    pub(super) unknown: bool,
    /// Lease ids up to this one are of earlier runs.
    pub(super) base: u64,
}

/// The core's side of durability.
#[derive(Debug, Default)]
pub(super) struct Journal {
    /// The batch that changes made now go into (the next `take_changes`).
    pub(super) batch: u64,
    /// The last batch the driver made durable.
    pub(super) durable: u64,
    pub(super) pending: PendingPages,
    /// Until every lease of the last run is accounted for (None: none can be left).
    pub(super) recovered: Option<OldLeases>,
    /// The latest time the core was given.
    pub(super) now_ms: u64,
    /// When the reply to the request being handled may go.
    pub(super) reply: ReplyTiming,
    /// Pages a restore found allocated without a key, (region, page), while leases
    /// of the last run may cover them: reserved ones, or ones whose publish was lost
    /// (answered before its commit), which a reader of the last run may still read.
    /// Never handed out again while allocated; once their session frees them, they
    /// wait like pages of recovered keys. Kept after those leases ran out while a
    /// session of the last run may still say which pages it holds (`unreported`).
    pub(super) in_doubt: BTreeSet<(u64, u64)>,
    /// Sessions of the last run that have not said which pages they hold without a
    /// key (`held_pages`): their heartbeat replies ask for it.
    pub(super) unreported: BTreeSet<u64>,
    /// Pages in doubt freed because their session's report did not name them.
    pub(super) held_freed: u64,
    /// Each session's recent allocations (how far ahead its reserve is topped up).
    pub(super) rates: BTreeMap<u64, AllocRate>,
}

impl Journal {
    /// Whether no lease of the last run can still cover a recovered key's page.
    pub(super) fn old_leases_over(&self, now_ms: u64) -> bool {
        self.recovered
            .as_ref()
            .is_none_or(|o| now_ms >= o.until_ms || (o.silent.is_empty() && !o.unknown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::keys::{KeyDirectory, Scope};

    fn scope() -> ScopeId {
        KeyDirectory::new().scope_id(Scope {
            namespace: "ns".into(),
            layout: "l".into(),
            backend: crate::wire::meta::Backend::Cxl,
        })
    }

    fn page(batch: u64, region_id: u64, page: u64, recovered: bool) -> PendingPage {
        PendingPage {
            batch,
            not_before_ms: 0,
            region_id,
            page,
            recovered,
            scope: scope(),
        }
    }

    /// `n` pages of recovered keys waiting for the leases of the last run (`over`
    /// false), then one page freed by this run: what taking it out, the next
    /// deadline and the holds of one region visit.
    fn visits_with(n: u64) -> u64 {
        let mut p = PendingPages::default();
        for i in 0..n {
            p.push(page(1, 1 + i / 64, i % 64, true));
        }
        assert!(p.take_ready(1, 10, false).is_empty());
        let before = p.visited();
        p.push(page(2, 1, 99, false));
        let ready = p.take_ready(2, 20, false);
        assert_eq!(
            ready.len(),
            1,
            "the fresh page goes once its batch is durable"
        );
        assert_eq!(p.next_deadline(2, false, 500), Some(500));
        let holds = p.holds(&BTreeSet::from([1]), 20, false, 1_000);
        assert_eq!(
            holds.get(&1),
            Some(&1_000),
            "region 1 waits for the last run"
        );
        p.visited() - before
    }

    /// Rule (issue 46): handing out a page, the next deadline and the holds of a
    /// region do not walk every page waiting. Seen failing with `take_ready` looking
    /// at every page of `recovered` (about 10,000 visited with 10,000 waiting).
    #[test]
    fn the_work_of_a_put_back_does_not_grow_with_the_pages_waiting() {
        let (small, large) = (visits_with(100), visits_with(10_000));
        assert!(
            large <= small.max(8) + 64,
            "{small} pages visited with 100 waiting, {large} with 10,000"
        );
    }

    #[test]
    fn recovered_pages_wait_for_the_last_run_then_for_their_own_time() {
        let mut p = PendingPages::default();
        p.push(page(1, 7, 0, true));
        p.push(page(1, 7, 1, true));
        p.push(page(2, 8, 0, false));
        assert!(p.take_ready(0, 0, false).is_empty(), "nothing durable");
        assert_eq!(p.next_deadline(0, false, 100), None);
        assert!(p.lease_held(7, 1, scope(), 300), "a lease of the last run");
        assert!(!p.lease_held(7, 5, scope(), 300), "no such page waits");
        let ready = p.take_ready(2, 10, false);
        assert_eq!(
            ready.iter().map(|r| r.region_id).collect::<Vec<_>>(),
            vec![8]
        );
        assert!(p.has_recovered());
        assert_eq!(p.next_deadline(2, false, 100), Some(100));
        // The last run's leases are over: page 0 goes, page 1 waits for its lease.
        let ready = p.take_ready(2, 100, true);
        assert_eq!(ready.iter().map(|r| r.page).collect::<Vec<_>>(), vec![0]);
        assert_eq!(p.next_deadline(2, true, 100), Some(300));
        assert_eq!(
            p.holds(&BTreeSet::from([7]), 100, true, 0).get(&7),
            Some(&300)
        );
        assert!(p.take_ready(2, 299, true).is_empty());
        assert_eq!(p.take_ready(2, 300, true).len(), 1);
        assert!(!p.has_recovered());
        assert_eq!((p.len(), p.next_deadline(2, true, 100)), (0, None));
    }
}
