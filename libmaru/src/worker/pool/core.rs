//! The pool core: what a pool knows (spare pages, own regions, regions being taken,
//! publishes in flight, and for `remote_cxl` the mover's [`RemoteState`]) and the
//! rules it follows, as a state machine with no sockets, threads or clocks inside.
//! The drivers feed it what happened and carry out what it answers, one call per
//! phase, under one short lock ([`CoreCell`]) never held across I/O. The rules are in
//! `docs/worker.md` ("The pool core"); each has a test in `core_tests.rs`.

use super::peers::{RemoteState, WriteTargets};
use super::stats::PoolStats;
use crate::wire::meta::{HeartbeatReply, PageGrant, RegionGrant};
use crate::worker::clock::Deadline;
use crate::worker::condition::Condition;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// After maru-server had no region to give, stores evict without asking again for
/// this long (unless an eviction found nothing): a refused `expand` cost 190 µs of a
/// 256 KiB store's 740 µs eviction round.
pub const EXPAND_BACKOFF_MS: u64 = 250;

/// Reports of boot ids a publish asks for before it gives up (`publish_begin`).
pub const REPORT_TRIES: usize = 3;

/// Rounds of making room that found no page before a store gives up (`room_given_up`).
pub const ROOM_ROUNDS: usize = 8;

/// Rounds of taking pages when some were of a region not the pool's (`take_again`).
pub const TAKE_ROUNDS: usize = 3;

/// Whether a store takes pages once more after its round `round` (from 0): only
/// when that round got pages of a region not the pool's (`strays`, freed again)
/// and none short (maru-server had pages), and fewer than `TAKE_ROUNDS` rounds ran.
pub fn take_again(round: usize, strays: usize, short: usize) -> bool {
    strays > 0 && short == 0 && round + 1 < TAKE_ROUNDS
}

/// Whether a store gives up on the chunks still missing after `dry` rounds of
/// making room that found no page: other stores of the pool make room at the same
/// time (they may take the pages freed here), so a few rounds are tried first.
pub fn room_given_up(dry: usize) -> bool {
    dry >= ROOM_ROUNDS
}

/// What a region's pages were written under: the adoption that mapped it (a region
/// lost and taken again is another adoption) and, on `remote_cxl`, the boot id of
/// its memory node. A publish goes only into a region whose token is unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    adoption: u64,
    boot: Option<String>,
}

#[derive(Debug)]
struct Region {
    /// Which adoption mapped it (unique in the pool).
    adoption: u64,
    /// Pages handed to stores (and writers in place) whose publish has not ended:
    /// such a region is not given back (it is closing).
    writing: usize,
    /// maru-server asked for it while stores wrote into it: no new store takes its
    /// pages, and the last writer gives it back.
    closing: bool,
    /// Its agent stayed silent too long: it goes back to maru-server once no publish
    /// into it is in flight; nothing more is published into it.
    going: bool,
}

/// A publish sent and not answered yet: the regions it writes keys into, and how
/// many reboots the pool had found when it was re-checked.
#[derive(Debug)]
struct InFlight {
    regions: Vec<u64>,
    reboots: u64,
}

/// The pages a store took, marked as being written, and the token of each of their
/// regions then.
#[derive(Debug, Default)]
pub struct Taken {
    pub pages: Vec<PageGrant>,
    tokens: BTreeMap<u64, Token>,
    /// Pages of a region not the pool's (not adopted by the deadline, or lost): the
    /// store frees them and looks for others.
    pub foreign: Vec<PageGrant>,
    /// Pages at an away agent: kept spare, their chunks skipped at once.
    pub away: Vec<PageGrant>,
    /// `remote_cxl`: where WRITEs into the pages' regions go, for those ready when the
    /// pages were taken (the store's windows are planned without the lock).
    pub to: WriteTargets,
}

impl Taken {
    /// Adds the pages of another round of taking (the tokens noted first stay).
    pub fn merge(&mut self, more: Taken) {
        for (r, t) in more.tokens {
            self.tokens.entry(r).or_insert(t);
        }
        for (r, t) in more.to {
            self.to.entry(r).or_insert(t);
        }
        self.pages.extend(more.pages);
        self.foreign.extend(more.foreign);
        self.away.extend(more.away);
    }

    /// Pages taken earlier, each with its region's token then (writes in place).
    pub fn of(pages: impl IntoIterator<Item = (PageGrant, Option<Token>)>) -> Taken {
        let mut taken = Taken::default();
        for (p, t) in pages {
            if let Some(t) = t {
                taken.tokens.insert(p.region_id, t);
            }
            taken.pages.push(p);
        }
        taken
    }

    /// The token of a page's region when it was taken.
    pub fn token(&self, region: u64) -> Option<Token> {
        self.tokens.get(&region).cloned()
    }
}

/// Pages `keep_spare` did not keep, to free: `extra` (beyond the bound) and `foreign`
/// (of regions not the pool's) apart, since a free is all or nothing.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Unkept {
    pub extra: Vec<PageGrant>,
    pub foreign: Vec<PageGrant>,
}

/// A publish sent (see `Ending::publish`).
pub type Sent = (Option<u64>, Vec<(PageGrant, u64)>, Option<Vec<bool>>);

/// What a store (or a publish in place) tells the core at its end, in one call
/// (`PoolCore::store_end`).
#[derive(Debug, Default)]
pub struct Ending {
    /// The publish sent: ticket, pages with lengths, `is_new` per key (`None`: no answer).
    pub publish: Option<Sent>,
    /// Pages that hold no key.
    pub unused: Vec<PageGrant>,
    /// The regions of the pages taken, one entry per page.
    pub writing: Vec<u64>,
    /// Regions maru-server asked back on the replies.
    pub asked: Vec<u64>,
    /// Chunks found already present.
    pub present: u64,
}

impl Ending {
    /// The end of a use of `pages` that left them all without a key.
    pub fn of(pages: Vec<PageGrant>) -> Ending {
        let writing = pages.iter().map(|p| p.region_id).collect();
        Ending {
            unused: pages,
            writing,
            ..Ending::default()
        }
    }
}

/// What a publish may do now.
#[derive(Debug, PartialEq, Eq)]
pub enum PublishCheck {
    /// maru-server must hear the boot ids of one of its regions first (a heartbeat),
    /// then ask again.
    Report,
    Go(PublishPlan),
}

/// The outcome of a publish's re-check.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PublishPlan {
    /// Set when something is to be published: hand it back to `publish_end`.
    pub ticket: Option<u64>,
    /// Indices (into the pages given) of the chunks to publish.
    pub publish: Vec<usize>,
    /// Pages that hold no key and no write in flight: for the next stores.
    pub unused: Vec<PageGrant>,
    /// Chunks written completely but not published: their region was lost, given
    /// back, taken again or rebooted since the store took its pages.
    pub lost: u64,
    /// Pages of failed writes kept out of use (a write of unknown outcome may land).
    pub held: usize,
}

/// What a heartbeat may do now.
#[derive(Debug, PartialEq, Eq)]
pub enum BeatCheck {
    /// A reboot's report waits for publishes re-checked before it was found.
    Wait,
    /// Send these boot ids (by region) and these regions without one.
    Go {
        boots: BTreeMap<u64, String>,
        regions: Vec<u64>,
    },
}

/// A region the pool no longer writes into, for its driver to carry out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// maru-server no longer counts it among the session's: unmap it (`cxl`).
    Lost(u64),
    /// maru-server asked for it: unmap it, then return it.
    GiveBack(u64),
}

impl Gone {
    pub fn region(self) -> u64 {
        match self {
            Gone::Lost(r) | Gone::GiveBack(r) => r,
        }
    }
}

/// A pool's state (see the module documentation).
#[derive(Default)]
pub struct PoolCore {
    /// Pages to take ahead with each `alloc`; at most twice as many are kept.
    pub spare_target: usize,
    /// Most regions the session takes (`max_bytes`); none: no limit.
    pub max_regions: Option<u64>,
    /// The mover wants a region taken ahead of need (`cxl` prefaults it).
    pub wants_lead: bool,
    pub stats: PoolStats,
    /// Why stores were skipped, and when each reason was last logged.
    skips: crate::worker::skips::SkipLog,
    /// Pages taken for writing in place and not yet published or given back.
    in_place_out: usize,
    spare: VecDeque<PageGrant>,
    regions: BTreeMap<u64, Region>,
    next_adoption: u64,
    /// Regions being taken (an `expand` sent, its adoption not done): counted
    /// against `max_regions`.
    expanding: u64,
    /// Regions maru-server gave whose adoption is not done.
    adopting: BTreeSet<u64>,
    /// When maru-server last had no region to give.
    refused_at: Option<u64>,
    /// The region adopted last and its page count.
    newest: Option<(u64, u64)>,
    /// The newest region for which one was taken (or tried) ahead already.
    lead_tried: Option<u64>,
    publishing: BTreeMap<u64, InFlight>,
    next_ticket: u64,
    /// The `remote_cxl` mover's state (None on `cxl`).
    pub remote: Option<RemoteState>,
}

impl PoolCore {
    pub fn new(remote: Option<RemoteState>) -> PoolCore {
        PoolCore {
            next_adoption: 1,
            next_ticket: 1,
            remote,
            ..PoolCore::default()
        }
    }

    /// The own regions (ids).
    pub fn own_regions(&self) -> Vec<u64> {
        self.regions.keys().copied().collect()
    }

    /// Whether a store skips at once, asking nobody: every own region (at least one)
    /// is at an away agent.
    pub fn every_region_away(&self) -> bool {
        let Some(r) = &self.remote else {
            return false;
        };
        !self.regions.is_empty() && self.regions.keys().all(|&id| r.region_away(id))
    }

    /// Whether a load misses at once, asking nobody: every agent the pool knows is away.
    pub fn every_agent_away(&self) -> bool {
        self.remote.as_ref().is_some_and(|r| r.every_agent_away())
    }

    pub fn owns(&self, region: u64) -> bool {
        self.regions.contains_key(&region)
    }

    /// The token of an own region now (None: not the pool's).
    fn token(&self, region: u64) -> Option<Token> {
        let r = self.regions.get(&region)?;
        let boot = self
            .remote
            .as_ref()
            .and_then(|s| s.life.boot_of(region))
            .map(str::to_string);
        Some(Token {
            adoption: r.adoption,
            boot,
        })
    }

    /// Whether an own region's token now is `token`.
    pub fn token_is(&self, region: u64, token: Option<&Token>) -> bool {
        token.is_some() && self.token(region).as_ref() == token
    }

    /// Counts `n` chunks skipped for `reason`; the WARN line when one is due (`skips`).
    pub fn skipped(
        &mut self,
        reason: crate::worker::skips::SkipReason,
        n: u64,
        now_ms: u64,
        what: &str,
    ) -> Option<String> {
        let line = self.skips.note(reason, n, now_ms, what);
        self.stats.skipped = self.skips.counts;
        line
    }

    /// Pages that may be taken in place now: at most half the session's fair share
    /// (within `max_bytes`; one region before either is known) held at once.
    pub fn in_place_room(&self, share_regions: Option<u64>, region_pages: u64) -> usize {
        let share = (share_regions.into_iter().chain(self.max_regions).min()).unwrap_or(1);
        let limit = (share.saturating_mul(region_pages) / 2).max(1) as usize;
        limit.saturating_sub(self.in_place_out)
    }

    /// `n` pages were taken in place (`taken`), or published or given back.
    pub fn in_place_moved(&mut self, n: usize, taken: bool) {
        if taken {
            self.in_place_out += n;
        } else {
            self.in_place_out = self.in_place_out.saturating_sub(n);
        }
    }

    /// Why a store found no page: `max_bytes` reached, or no region to be had.
    pub fn no_room_reason(&self) -> crate::worker::skips::SkipReason {
        if self.may_grow() {
            crate::worker::skips::SkipReason::NoRegion
        } else {
            crate::worker::skips::SkipReason::MaxBytes
        }
    }

    /// Whether one more region fits `max_bytes`, counting those being taken.
    fn may_grow(&self) -> bool {
        self.max_regions
            .is_none_or(|m| self.regions.len() as u64 + self.expanding < m)
    }

    /// A store wants one more region: `Err(why)` when it may not ask now (`max_bytes`,
    /// or the back-off); else it sends `expand`, then `expand_answered`, `adopt_end`.
    pub fn grow_begin(&mut self, now_ms: u64) -> Result<(), String> {
        if !self.may_grow() {
            return Err(format!(
                "the engine holds max_bytes of regions ({} of them)",
                self.regions.len()
            ));
        }
        if let Some(at) = self
            .refused_at
            .filter(|&at| now_ms < at + EXPAND_BACKOFF_MS)
        {
            return Err(format!(
                "maru-server had no region to give {} ms ago (asked again {} ms after that)",
                now_ms.saturating_sub(at),
                EXPAND_BACKOFF_MS
            ));
        }
        self.expanding += 1;
        Ok(())
    }

    /// maru-server answered an `expand`: a region to adopt, none to give (`None`: the
    /// back-off starts) or an error (`failed`).
    pub fn expand_answered(&mut self, region: Option<u64>, failed: bool, now_ms: u64) {
        match region {
            Some(id) => {
                self.adopting.insert(id);
                self.refused_at = None;
            }
            None => {
                self.expanding = self.expanding.saturating_sub(1);
                if !failed {
                    self.refused_at = Some(now_ms);
                }
            }
        }
    }

    /// The mover mapped the region taken (`ok`), or not: true, it goes back at once.
    pub fn adopt_end(&mut self, grant: &RegionGrant, ok: bool) -> bool {
        let id = grant.handle.region_id;
        self.expanding = self.expanding.saturating_sub(1);
        self.adopting.remove(&id);
        if ok {
            self.adopted(grant);
        } else if let Some(r) = self.remote.as_mut() {
            r.forget_region(id);
        }
        !ok
    }

    /// A region the session holds is mapped (taken by a store, or the session's first).
    pub fn adopted(&mut self, grant: &RegionGrant) {
        let id = grant.handle.region_id;
        let adoption = self.next_adoption;
        self.next_adoption += 1;
        self.regions.insert(
            id,
            Region {
                adoption,
                writing: 0,
                closing: false,
                going: false,
            },
        );
        self.stats.regions = self.regions.len() as u64;
        self.newest = Some((id, grant.pages));
    }

    /// Whether a store given `pages` must wait: one is of a region not known yet
    /// while an `expand` is in flight (maru-server may hand its pages out before the
    /// store that asked has read the answer).
    pub fn waits_for_adoption(&self, pages: &[PageGrant]) -> bool {
        self.expanding > 0 && pages.iter().any(|p| !self.owns(p.region_id))
    }

    /// Whether a region is to be taken ahead now: `pages` reach the second half of the
    /// newest region, once per region.
    pub fn lead_due(&mut self, pages: &[PageGrant]) -> bool {
        if !self.wants_lead || !self.may_grow() {
            return false;
        }
        let Some((rid, n)) = self.newest else {
            return false;
        };
        if self.lead_tried == Some(rid) {
            return false;
        }
        let deep = pages
            .iter()
            .any(|p| p.region_id == rid && p.page.saturating_mul(2) >= n);
        if deep {
            self.lead_tried = Some(rid);
        }
        deep
    }

    /// An eviction found nothing: the next round asks for a region, back-off or not.
    pub fn evicted_nothing(&mut self) {
        self.refused_at = None;
    }

    /// Forgets an own region (lost, given back), its spare pages and remote state.
    fn forget(&mut self, id: u64) -> usize {
        let before = self.spare.len();
        self.spare.retain(|p| p.region_id != id);
        self.regions.remove(&id);
        self.stats.regions = self.regions.len() as u64;
        if self.newest.is_some_and(|(r, _)| r == id) {
            self.newest = None;
        }
        if let Some(r) = self.remote.as_mut() {
            r.forget_region(id);
        }
        before - self.spare.len()
    }

    /// maru-server no longer counts the region as the session's: nothing more is
    /// published into it. Returns the spare pages dropped.
    pub fn lose(&mut self, id: u64) -> usize {
        let dropped = self.forget(id);
        self.stats.regions_lost += 1;
        dropped
    }

    /// maru-server asks for the region: closing while stores write into it (its spare
    /// pages go), else forgotten now and returned (`Some`).
    pub fn ask_back(&mut self, id: u64) -> Option<Gone> {
        let Some(r) = self.regions.get_mut(&id) else {
            // Not ours (any more): maru-server asks again until it is returned.
            return Some(Gone::GiveBack(id));
        };
        if r.writing > 0 {
            r.closing = true;
            self.spare.retain(|p| p.region_id != id);
            return None;
        }
        self.forget(id);
        Some(Gone::GiveBack(id))
    }

    /// maru-server asked for these regions on a reply (`alloc`, `publish`): acted on
    /// at once; one not the pool's is left to the next heartbeat's ask.
    pub fn asked_on_reply(&mut self, regions: &[u64]) -> Vec<Gone> {
        let mut out = Vec::new();
        for &id in regions {
            if self.owns(id) {
                out.extend(self.ask_back(id));
            }
        }
        out
    }

    /// A region given back was returned (`ok`), or not (maru-server asks again).
    pub fn given_back(&mut self, ok: bool) {
        self.stats.regions_given_back += u64::from(ok);
    }

    /// These regions' agents stayed silent too long: nothing more goes into them, and
    /// they go back once no publish into them is in flight (`returnable`).
    pub fn going(&mut self, regions: &[u64]) {
        for id in regions {
            if let Some(r) = self.regions.get_mut(id) {
                r.going = true;
            }
            self.spare.retain(|p| p.region_id != *id);
        }
    }

    /// Regions going back that no publish in flight writes keys into.
    pub fn returnable(&self) -> Vec<u64> {
        self.regions
            .iter()
            .filter(|(id, r)| r.going && !self.publishing.values().any(|p| p.regions.contains(id)))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Up to `need` of the pages kept for the next stores.
    pub fn take_spare(&mut self, need: usize) -> Vec<PageGrant> {
        let n = need.min(self.spare.len());
        self.spare.drain(..n).collect()
    }

    /// Keeps pages that hold no key for the next stores; returns, to free, those beyond
    /// twice the spare target and those of regions not the pool's.
    pub fn keep_spare(&mut self, pages: Vec<PageGrant>) -> Unkept {
        let mut foreign = Vec::new();
        for p in pages {
            match self.regions.get(&p.region_id) {
                Some(r) if !r.closing && !r.going => self.spare.push_back(p),
                Some(_) => {}
                None => foreign.push(p),
            }
        }
        let max = 2 * self.spare_target;
        let extra = if self.spare.len() > max {
            self.spare.drain(max..).collect()
        } else {
            Vec::new()
        };
        Unkept { extra, foreign }
    }

    /// The start of a store of `n` chunks, one call: `None` when every own region is
    /// at an away agent (the store skips, asking nobody); else spare pages for all `n`
    /// taken and marked (`mark_writing`) when there are that many and none is at an
    /// away agent (the usual case), or none (the driver then looks for pages).
    pub fn store_begin(&mut self, n: usize) -> Option<Taken> {
        if self.every_region_away() {
            return None;
        }
        let remote = self.remote.as_ref();
        let away = |p: &PageGrant| remote.is_some_and(|m| m.region_away(p.region_id));
        if n == 0 || self.spare.len() < n || self.spare.iter().take(n).any(away) {
            return Some(Taken::default());
        }
        let spare = self.take_spare(n);
        Some(self.mark_writing(spare))
    }

    /// A store is done, one call: its publish answered (`publish_end`: pages of keys
    /// another engine published first join `unused`), regions asked back on the
    /// replies acted on (`asked_on_reply`), its `unused` pages kept (`keep_spare`),
    /// then its pages no longer written (`end_writing`), in that order, so a closing
    /// region's unused pages go with it, not freed into it.
    pub fn store_end(&mut self, end: Ending) -> (Unkept, Vec<Gone>) {
        let mut unused = end.unused;
        if let Some((ticket, published, is_new)) = end.publish {
            unused.extend(self.publish_end(ticket, &published, is_new.as_deref()));
        }
        self.stats.already_present += end.present;
        let mut gone = self.asked_on_reply(&end.asked);
        let unkept = self.keep_spare(unused);
        gone.extend(self.end_writing(end.writing));
        (unkept, gone)
    }

    /// Marks `pages` as being written (their regions stay until `end_writing`) and
    /// notes each region's token; pages of a closing or going region are dropped, of a
    /// foreign one or at an away agent handed back (`Taken::foreign`, `Taken::away`).
    pub fn mark_writing(&mut self, pages: Vec<PageGrant>) -> Taken {
        let mut taken = Taken::default();
        for p in pages {
            let Some(r) = self.regions.get_mut(&p.region_id) else {
                taken.foreign.push(p);
                continue;
            };
            if r.closing || r.going {
                continue;
            }
            if self
                .remote
                .as_ref()
                .is_some_and(|m| m.region_away(p.region_id))
            {
                taken.away.push(p);
                continue;
            }
            r.writing += 1;
            taken.pages.push(p);
        }
        for p in &taken.pages {
            if let std::collections::btree_map::Entry::Vacant(e) = taken.tokens.entry(p.region_id) {
                if let Some(t) = self.token(p.region_id) {
                    e.insert(t);
                }
                let to = self.remote.as_ref().and_then(|m| m.write_to(p.region_id));
                if let Some(to) = to {
                    taken.to.insert(p.region_id, to);
                }
            }
        }
        taken
    }

    /// Of `leases`, those at an away agent: a load misses them at once.
    pub fn leases_away(&self, leases: &[crate::wire::meta::LeaseGrant]) -> Vec<bool> {
        leases
            .iter()
            .map(|l| self.remote.as_ref().is_some_and(|m| m.lease_away(l)))
            .collect()
    }

    /// Pages of these regions (one entry per page) are no longer written: the closing
    /// regions whose last writer this was, forgotten now, to give back.
    pub fn end_writing(&mut self, regions: impl IntoIterator<Item = u64>) -> Vec<Gone> {
        let mut done = Vec::new();
        for id in regions {
            if let Some(r) = self.regions.get_mut(&id) {
                r.writing = r.writing.saturating_sub(1);
                if r.writing == 0 && r.closing {
                    done.push(id);
                }
            }
        }
        done.sort_unstable();
        done.dedup();
        done.into_iter()
            .map(|id| {
                self.forget(id);
                Gone::GiveBack(id)
            })
            .collect()
    }

    /// A store's publish re-check: of `pages` (complete where `ok`), those whose
    /// region is still the pool's on the token noted when taken. `Report` while
    /// maru-server lacks a boot id of theirs (after `REPORT_TRIES`: nothing published).
    /// In flight from here until `publish_end`.
    pub fn publish_begin(
        &mut self,
        pages: &[PageGrant],
        ok: &[bool],
        taken: &Taken,
        reports: usize,
    ) -> PublishCheck {
        // After `REPORT_TRIES` reports the publish goes on with what is reported.
        let give_up = reports >= REPORT_TRIES;
        let mut regions: Vec<u64> = pages.iter().map(|p| p.region_id).collect();
        regions.sort_unstable();
        regions.dedup();
        let unreported = self
            .remote
            .as_ref()
            .is_some_and(|r| r.life.must_report_for(&regions));
        if unreported && !give_up {
            return PublishCheck::Report;
        }
        let mut plan = PublishPlan::default();
        let mut unused = Vec::new();
        for (k, p) in pages.iter().enumerate() {
            let good = ok.get(k).copied().unwrap_or(false);
            let same = !unreported
                && self.regions.get(&p.region_id).is_some_and(|r| !r.going)
                && self.token(p.region_id).as_ref() == taken.tokens.get(&p.region_id);
            if good && same {
                plan.publish.push(k);
            } else {
                if good {
                    plan.lost += 1;
                }
                unused.push(*p);
            }
        }
        if !unused.is_empty() && self.may_still_write() {
            plan.held = unused.len();
            unused.clear();
        }
        plan.unused = unused;
        self.stats.store_skipped += (pages.len() - plan.publish.len()) as u64;
        if !plan.publish.is_empty() {
            let ticket = self.next_ticket;
            self.next_ticket += 1;
            let mut regions: Vec<u64> = plan.publish.iter().map(|&k| pages[k].region_id).collect();
            regions.sort_unstable();
            regions.dedup();
            self.publishing.insert(
                ticket,
                InFlight {
                    regions,
                    reboots: self.reboots(),
                },
            );
            plan.ticket = Some(ticket);
        }
        PublishCheck::Go(plan)
    }

    /// maru-server answered a publish (`is_new` per chunk), or not (`None`: the pages
    /// stay out of use). Returns the pages of keys another engine published first.
    pub fn publish_end(
        &mut self,
        ticket: Option<u64>,
        published: &[(PageGrant, u64)],
        is_new: Option<&[bool]>,
    ) -> Vec<PageGrant> {
        if let Some(t) = ticket {
            self.publishing.remove(&t);
        }
        let Some(is_new) = is_new else {
            return Vec::new();
        };
        let mut unused = Vec::new();
        for ((page, len), &new) in published.iter().zip(is_new) {
            if new {
                self.stats.stored += 1;
                self.stats.bytes_stored += len;
            } else {
                // Another engine published the key first; this page is not needed.
                self.stats.already_present += 1;
                unused.push(*page);
            }
        }
        unused
    }

    /// Whether a transfer still in flight may land in pages of failed writes.
    pub fn may_still_write(&self) -> bool {
        self.remote
            .as_ref()
            .is_some_and(|r| r.iso.may_still_write())
    }

    /// How many reboots were found so far.
    fn reboots(&self) -> u64 {
        self.remote.as_ref().map_or(0, |r| r.reboots)
    }

    /// Whether maru-server must hear boot ids before anything else is published.
    pub fn must_report(&self) -> bool {
        self.remote.as_ref().is_some_and(|r| r.life.must_report())
    }

    /// What a heartbeat sends: boot ids and the regions without one; `Wait` while a
    /// reboot's report would pass a publish re-checked before it.
    pub fn heartbeat_begin(&self) -> BeatCheck {
        let boots = self
            .remote
            .as_ref()
            .map(|r| r.life.boot_ids())
            .unwrap_or_default();
        if let Some(r) = &self.remote {
            let reboot_unreported = r.life.rebooted_unreported();
            if reboot_unreported && self.publishing.values().any(|p| p.reboots < r.reboots) {
                return BeatCheck::Wait;
            }
        }
        let regions = self
            .regions
            .keys()
            .copied()
            .filter(|r| !boots.contains_key(r))
            .collect();
        BeatCheck::Go { boots, regions }
    }

    /// maru-server answered a heartbeat that sent `sent`: regions lost and regions to
    /// give back (now, or by their last writer), for the driver to carry out.
    pub fn heartbeat_answered(
        &mut self,
        sent: &BTreeMap<u64, String>,
        reply: &HeartbeatReply,
    ) -> Vec<Gone> {
        if let Some(r) = self.remote.as_mut() {
            r.life.reported(sent);
        }
        let mut out = Vec::new();
        for &id in &reply.unknown_regions {
            self.lose(id);
            out.push(Gone::Lost(id));
        }
        for &id in &reply.give_back {
            out.extend(self.ask_back(id));
        }
        out
    }
}

/// Whether maru-server is away: a call ran into its deadline (`unanswered_ms`, 0:
/// never) no earlier than the last answer.
pub fn server_away(answered_ms: u64, unanswered_ms: u64) -> bool {
    unanswered_ms != 0 && unanswered_ms >= answered_ms
}

/// The pool core behind its one short lock, with the condition stores wait on (an
/// adoption done, a publish answered), and whether every agent is away as of the
/// last unlock (read without the lock: a load that would ask nobody takes none).
pub struct CoreCell {
    core: Mutex<PoolCore>,
    changed: Condition,
    all_away: AtomicBool,
}

/// The core, locked; on unlock it notes [`PoolCore::every_agent_away`] in its cell.
pub struct CoreGuard<'a> {
    g: MutexGuard<'a, PoolCore>,
    all_away: &'a AtomicBool,
}

impl Deref for CoreGuard<'_> {
    type Target = PoolCore;
    fn deref(&self) -> &PoolCore {
        &self.g
    }
}

impl DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut PoolCore {
        &mut self.g
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        self.all_away
            .store(self.g.every_agent_away(), Ordering::Relaxed);
    }
}

impl CoreCell {
    pub fn new(core: PoolCore) -> CoreCell {
        CoreCell {
            core: Mutex::new(core),
            changed: Condition::default(),
            all_away: AtomicBool::new(false),
        }
    }

    /// The core (a poisoned lock is taken over: its maps stay usable).
    pub fn lock(&self) -> CoreGuard<'_> {
        self.lock_then(|g| g)
    }

    /// The core once `blocked` is false, or at `by` (then `blocked` may still hold).
    pub fn wait_while(
        &self,
        by: Deadline,
        mut blocked: impl FnMut(&mut PoolCore) -> bool,
    ) -> CoreGuard<'_> {
        self.lock_then(|g| {
            let waited = (self.changed).wait_timeout_while(g, by.left(), |c| blocked(c));
            waited.map_or_else(|e| e.into_inner().0, |(g, _)| g)
        })
    }

    fn lock_then<'a>(
        &'a self,
        then: impl FnOnce(MutexGuard<'a, PoolCore>) -> MutexGuard<'a, PoolCore>,
    ) -> CoreGuard<'a> {
        crate::worker::op_stats::core_locked();
        let g = self.core.lock().unwrap_or_else(|e| e.into_inner());
        CoreGuard {
            g: then(g),
            all_away: &self.all_away,
        }
    }

    /// Whether every agent the pool knows was away at the core's last unlock.
    pub fn every_agent_away(&self) -> bool {
        self.all_away.load(Ordering::Relaxed)
    }

    /// Something waiters may be waiting for happened.
    pub fn notify(&self) {
        self.changed.notify_all();
    }
}
