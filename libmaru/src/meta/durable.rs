//! A durable directory: the core emits what changed as numbered batches of
//! [records](super::records), its driver makes them durable in order and says so,
//! and a restarted server rebuilds the core from them. Sans-I/O: no file is touched
//! here.
//!
//! The rule that keeps bytes right across a crash: **a page is handed out again only
//! after its key's removal is durable** (and, for a key that a restart brought back,
//! only once no lease of the last run may still cover it: readers of the last run may
//! still be reading it). So a recovered key never points at a page rewritten with
//! other bytes.
//!
//! **A page is never handed out twice.** Pages are reserved for a session in blocks
//! ahead of need ([`RESERVE_BLOCK`]): a reserved page is allocated in its region's
//! record, and an alloc hands out reserved pages once the batch that recorded them is
//! durable, with no commit of its own ([`ReplyTiming::Early`]); a page taken otherwise
//! (no durable reserve left) is answered once its record is durable. A restart cannot
//! tell which recorded pages without a key were handed out (reserved, or a publish
//! lost), so it hands none of them out again on its own: they stay their session's
//! until its worker says which pages it holds (`pages_held`:
//! the others are freed), or frees them, or its region goes. Once freed they wait for
//! the leases of the last run, like pages of recovered keys: a reader may still read
//! a key whose publish was lost.
//!
//! **A publish is answered before its commit** (the driver hands its batch to the
//! store at once): a crash in that window loses the key, never bytes, since its page
//! stays its session's as above. Removals, frees, regions granted and sessions
//! opened or closed are answered once their batch is durable.
//!
//! Leases are not kept durable (every load takes some; an fsync before each acquire's
//! reply would cost every load a disk write). Instead a worker says in each heartbeat
//! which leases it still holds. After a restart, the first such heartbeat of each
//! session of the last run puts its leases back (same ids, same end); once every
//! session of the last run has said (or ended), pages of recovered keys are handed out
//! again at once. A session that never says (its worker is gone, or too old to say)
//! holds that up until its session expires, at most until the longest lease of the
//! last run could have run out. Lease ids carry the run (see [`LEASE_RUN_SHIFT`]), so
//! an id of the last run never names a lease of this one.
//!
//! After [`restore`](MetaCore::restore), before serving, the driver tells the core
//! which regions the RM still holds for the server
//! ([`recovered_rm`](MetaCore::recovered_rm)) and what boot id each agent reports
//! ([`recovered_boots`](MetaCore::recovered_boots)): a region the RM no longer holds
//! loses its keys and goes, a region of a rebooted memory node loses its keys.

use super::config::{ConfigError, MetaConfig};
use super::core::MetaCore;
use super::journal::{Journal, OldLeases, PendingPage, ReplyTiming};
use super::keeper::{GiveBackReason, KeeperEvent};
use super::keys::{KeyDirectory, KeyId, Location, Published, Scope, ScopeId};
use super::pages::PageAllocator;
use super::ports::PortError;
use super::records::{
    Changes, HolderRecord, Image, KeyRecord, Record, RegionRecord, ScopeRecord, Sealed,
    SessionRecord,
};
use super::regions::{agent_for, Holder, Region};
use super::sessions::Session;
use super::tenants::Tenants;
use crate::wire::meta::{Backend, HeldLease, PageRef};
use crate::wire::rm::{Handle, RegionInfo};
use std::collections::{BTreeMap, BTreeSet};

/// Lease ids of run `r` of a server on its state directory are above `r <<
/// LEASE_RUN_SHIFT` (2^40 leases per run before they reach the next run's).
pub const LEASE_RUN_SHIFT: u32 = 40;

/// Session ids of run `r` of a server on its state directory are above `r <<
/// SESSION_RUN_SHIFT`: an id handed out in one run is never handed out in a later
/// one, whatever the counter read back says (changed on disk, or rolled back with
/// the commits the store's repair after a crash could not keep).
pub const SESSION_RUN_SHIFT: u32 = 32;

/// How often a region held back for the leases of the last run is looked at again.
const HOLD_BACK_RECHECK_MS: u64 = 1_000;

/// The longest region a restore takes from a record (longer ones, or ones whose page
/// count is not their length in chunks, are left out and go back if the RM holds
/// them): a record read back never makes the server hold pages beyond a region's.
pub const MAX_RESTORED_REGION: u64 = 64 << 30;

/// Pages reserved for a session at a time, ahead of its allocs (at most an eighth
/// of a region): an alloc is answered from pages whose reservation is durable, with
/// no commit of its own. A crash keeps the pages of the reserve out of use until their
/// session's worker says which pages it holds, frees them, or ends (a restart cannot
/// tell which of them were handed out).
pub const RESERVE_BLOCK: u64 = 1024;

/// Most blocks reserved for one session at a time, however fast it allocates (what
/// a crash leaves in doubt until its worker says which pages it holds).
pub const RESERVE_MAX_BLOCKS: u64 = 4;

/// What a restore found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    pub keys: u64,
    pub regions: u64,
    pub sessions: u64,
    /// Records left out (naming what they no longer fit: a missing region or scope,
    /// a page out of range); their records go with the next batch.
    pub left_out: u64,
    /// Of those, records whose own check failed (a bit changed on disk) or whose
    /// region overlaps another's: never served.
    pub unverified: u64,
}

/// A key record recovery leaves out (never served; its id is not handed out again).
fn leave_out(core: &mut MetaCore, out: &mut Recovered, id: u64) {
    core.keys.note_gone(id);
    out.left_out += 1;
}

impl MetaCore {
    /// Keeps the directory durable from now on: changes are recorded for
    /// [`take_changes`](Self::take_changes), and a page freed by a key's removal is
    /// handed out again only once that removal is [`durable`](Self::durable).
    pub fn keep_durable(mut self) -> MetaCore {
        self.keys.keep_journal();
        self.regions.keep_journal();
        self.sessions.keep_journal();
        self.journal = Some(Journal {
            batch: 1,
            ..Default::default()
        });
        self
    }

    pub fn is_durable(&self) -> bool {
        self.journal.is_some()
    }

    /// When the reply to the request just handled may go (see [`ReplyTiming`]);
    /// `AfterItsChanges` without a durable directory.
    pub fn reply_timing(&self) -> ReplyTiming {
        self.journal
            .as_ref()
            .map_or(ReplyTiming::default(), |j| j.reply)
    }

    pub(super) fn set_reply_timing(&mut self, t: ReplyTiming) {
        if let Some(j) = &mut self.journal {
            j.reply = t;
        }
    }

    /// Pages reserved for a session at a time (see [`RESERVE_BLOCK`]).
    fn reserve_block(&self) -> u64 {
        let pages = self.cfg.region_size / self.cfg.chunk_size.max(1);
        RESERVE_BLOCK.min(pages / 8).max(1)
    }

    /// `session` took `pages` pages at `now_ms` (its allocation rate).
    pub(super) fn note_alloc(&mut self, session: u64, pages: u64, now_ms: u64) {
        if let Some(j) = &mut self.journal {
            j.rates.entry(session).or_default().note(pages, now_ms);
        }
    }

    /// A session ended: its allocation rate goes.
    pub(super) fn alloc_rate_ended(&mut self, session: u64) {
        if let Some(j) = &mut self.journal {
            j.rates.remove(&session);
        }
    }

    /// Reserves pages for `session` in its regions (`order`, but not `asked`: the
    /// one it is asked to give back) when fewer than its low mark are reserved: half
    /// a block, or what it took in its last full
    /// [`RATE_WINDOW_MS`](super::journal::RATE_WINDOW_MS) window if more;
    /// up to that mark and half a block more (a block at rest, at most
    /// [`RESERVE_MAX_BLOCKS`] blocks). They go in the open batch, and allocs take them once it is durable.
    pub(super) fn top_up_reserve(&mut self, session: u64, asked: Option<u64>, order: &[u64]) {
        let Some((batch, recent)) = self.journal.as_ref().map(|j| {
            let recent = j.rates.get(&session).map_or(0, |r| r.last);
            (j.batch, recent)
        }) else {
            return;
        };
        let block = self.reserve_block();
        let low = block
            .div_ceil(2)
            .max(recent)
            .min(RESERVE_MAX_BLOCKS * block - block / 2);
        let target = low + block / 2;
        let mine = || order.iter().copied().filter(|r| Some(*r) != asked);
        let have: u64 = mine()
            .filter_map(|r| self.regions.get(r))
            .map(|r| r.pages.reserved())
            .sum();
        if have >= low {
            return;
        }
        let mut want = target - have;
        let asked_for = want;
        for rid in mine() {
            if self
                .regions
                .get(rid)
                .is_none_or(|r| r.pages.free_count() == 0)
            {
                continue;
            }
            if let Some(r) = self.regions.get_mut(rid) {
                want -= r.pages.reserve(want, batch);
            }
            if want == 0 {
                break;
            }
        }
        log::trace!(
            "session {session}: {} page(s) reserved in batch {batch}",
            asked_for - want
        );
    }

    /// Counts changes that must be durable before a reply that follows them goes
    /// out: the driver compares it before and after a request.
    pub fn change_mark(&self) -> u64 {
        self.keys.changes() + self.regions.changes() + self.sessions.changes()
    }

    /// The batch that changes made now go into.
    pub fn open_batch(&self) -> u64 {
        self.journal.as_ref().map_or(0, |j| j.batch)
    }

    pub(super) fn note_now(&mut self, now_ms: u64) {
        if let Some(j) = &mut self.journal {
            j.now_ms = j.now_ms.max(now_ms);
        }
    }

    /// The records of everything that changed since the last call, as the next
    /// batch (None when nothing changed). Batches must be made durable in order.
    pub fn take_changes(&mut self) -> Option<Changes> {
        self.journal.as_ref()?;
        let kj = self.keys.take_journal().unwrap_or_default();
        let regions = self.regions.take_dirty();
        let sessions = self.sessions.take_dirty();
        let mut records = Vec::new();
        for id in kj.scopes {
            if let Some(r) = self.scope_record(id) {
                records.push(Record::Scope(r));
            }
        }
        for id in &sessions {
            records.push(match self.sessions.get(*id) {
                Some(s) => Record::Session(self.session_record(s)),
                None => Record::SessionGone(*id),
            });
        }
        if !sessions.is_empty() {
            records.push(Record::NextSession(self.sessions.next_id()));
        }
        for id in regions {
            records.push(match self.regions.get(id) {
                Some(r) => Record::Region(region_record(r)),
                None => Record::RegionGone(id),
            });
        }
        for id in kj.gone {
            records.push(Record::KeyGone(id.get()));
        }
        for id in &kj.put {
            if let Some(r) = self.key_record(*id) {
                records.push(Record::Key(r));
            }
        }
        for id in kj.used.difference(&kj.put) {
            if let Some(e) = self.keys.get(*id) {
                records.push(Record::Used {
                    id: id.get(),
                    used: e.used(),
                });
            }
        }
        if records.is_empty() {
            return None;
        }
        let j = self.journal.as_mut()?;
        let batch = j.batch;
        j.batch += 1;
        Some(Changes { batch, records })
    }

    /// The driver made every batch up to `batch` durable: pages whose removal it
    /// carried are handed out again.
    pub fn durable(&mut self, batch: u64, now_ms: u64) {
        self.note_now(now_ms);
        if let Some(j) = &mut self.journal {
            j.durable = j.durable.max(batch);
        }
        self.put_back_pages(now_ms);
    }

    /// The last batch made durable.
    pub fn durable_batch(&self) -> u64 {
        self.journal.as_ref().map_or(0, |j| j.durable)
    }

    /// Pages freed and not yet handed out again (their removal is not durable yet,
    /// or they held recovered keys whose old leases may still run).
    pub fn pages_waiting(&self) -> usize {
        self.journal.as_ref().map_or(0, |j| j.pending.len())
    }

    pub(super) fn put_back_pages(&mut self, now_ms: u64) {
        let Some(j) = &mut self.journal else {
            return;
        };
        let over = j.old_leases_over(now_ms);
        if over {
            if let Some(o) = j.recovered.take() {
                let why = if now_ms >= o.until_ms {
                    format!(
                        "the longest lease of the last run has run out ({} session(s) of it \
                         never said which leases they hold)",
                        o.silent.len()
                    )
                } else {
                    "every session of the last run said which leases it holds, or ended".into()
                };
                log::info!("recovery: pages of recovered keys are handed out again: {why}");
            }
            if j.unreported.is_empty() {
                j.in_doubt.clear();
            }
        }
        let ready = j.pending.take_ready(j.durable, now_ms, over);
        let mut regions = BTreeSet::new();
        for p in ready {
            if let Some(r) = self.regions.get_mut_quiet(p.region_id) {
                r.pages.put_back(p.page);
                regions.insert(p.region_id);
            }
        }
        // A region whose last waiting page came back may be unused now.
        for rid in regions {
            self.note_region_use(rid, now_ms);
        }
    }

    /// Holds back regions going back that hold a page a reader of the last run may
    /// still read (a recovered key's page waiting for the leases of that run): neither
    /// released nor freed at the RM, which could hand the range out again to be
    /// rewritten under that reader. Looked at again at least every second.
    pub(super) fn hold_back_regions(&mut self, now_ms: u64) {
        let Some(j) = &self.journal else {
            return;
        };
        let over = j.old_leases_over(now_ms);
        let until = j.recovered.as_ref().map_or(0, |o| o.until_ms);
        let recheck = now_ms.saturating_add(HOLD_BACK_RECHECK_MS).min(until);
        if !j.pending.has_recovered() && j.in_doubt.is_empty() {
            return;
        }
        // Only regions on their way back are held back: look up those.
        let going: BTreeSet<u64> = self.keeper.giving_back_ids().collect();
        let mut holds = j.pending.holds(&going, now_ms, over, recheck);
        if !over && recheck > now_ms {
            for &rid in &going {
                if j.in_doubt
                    .range((rid, 0)..=(rid, u64::MAX))
                    .next()
                    .is_some()
                {
                    let h = holds.entry(rid).or_default();
                    *h = (*h).max(recheck);
                }
            }
        }
        for (rid, t) in holds {
            if self.keeper.is_giving_back(rid) {
                self.keeper.hold_back(rid, t);
            }
        }
    }

    /// When a page held for old leases may be handed out.
    pub(super) fn next_page_deadline(&self) -> Option<u64> {
        let j = self.journal.as_ref()?;
        let over = j.old_leases_over(j.now_ms);
        let until = j.recovered.as_ref().map_or(0, |o| o.until_ms);
        j.pending.next_deadline(j.durable, over, until)
    }

    /// Sessions of the last run that have not said which leases they hold, while
    /// pages of recovered keys wait for them (None: nothing waits for them).
    pub fn last_run_sessions_silent(&self) -> Option<usize> {
        let j = self.journal.as_ref()?;
        let o = j.recovered.as_ref()?;
        Some(o.silent.len())
    }

    /// A session says which leases it holds (a heartbeat): a session of the last run,
    /// the first time after a restart, gets those of its leases on recovered keys
    /// back (same id, at most until the last run's leases run out; a key removed since
    /// the restart keeps its page from reuse as long), and no longer holds up the
    /// pages of recovered keys. A lease on a key of another scope (not one the session
    /// can read), or of this run, is ignored. Later heartbeats change nothing here.
    pub(super) fn leases_held(&mut self, session: u64, held: &[HeldLease], now_ms: u64) {
        let Some(j) = &mut self.journal else {
            return;
        };
        let Some(old) = &mut j.recovered else {
            return;
        };
        if !old.silent.remove(&session) {
            return;
        }
        let (until, base, last_key) = (old.until_ms, old.base, old.last_key);
        let Some(scope) = self.sessions.get(session).map(|s| s.scope) else {
            return;
        };
        let chunk = self.cfg.chunk_size;
        let (mut leases, mut pages, mut ignored) = (0, 0, 0);
        for h in held {
            let ends = now_ms.saturating_add(h.expires_in_ms).min(until);
            if h.lease_id > base || ends <= now_ms || h.offset % chunk != 0 {
                ignored += 1;
                continue;
            }
            match self.keys.at(h.region_id, h.offset) {
                Some(k)
                    if k.get() <= last_key
                        && self.keys.get(k).is_some_and(|e| e.scope == scope)
                        && self.leases.check_room(session, 1).is_ok()
                        && self
                            .leases
                            .grant_as(h.lease_id, session, k, h.region_id, ends) =>
                {
                    leases += 1;
                }
                Some(_) => ignored += 1,
                None => {
                    let page = h.offset / chunk;
                    if j.pending.lease_held(h.region_id, page, scope, ends) {
                        pages += 1;
                    } else {
                        ignored += 1;
                    }
                }
            }
        }
        let silent = old.silent.len();
        log::info!(
            "recovery: session {session} of the last run holds {} lease(s): {leases} put back, \
             {pages} on pages of keys removed since the restart, {ignored} ignored; {silent} \
             session(s) of the last run not heard from yet",
            held.len()
        );
        self.put_back_pages(now_ms);
    }

    /// A session ended: it no longer holds up the pages of recovered keys (its leases
    /// ended with it), nor will it say which pages it holds (its regions left it).
    pub(super) fn old_leases_session_ended(&mut self, session: u64, now_ms: u64) {
        let unreported = self
            .journal
            .as_mut()
            .is_some_and(|j| j.unreported.remove(&session));
        let ended = self
            .journal
            .as_mut()
            .and_then(|j| j.recovered.as_mut())
            .is_some_and(|o| o.silent.remove(&session));
        if ended || unreported {
            self.put_back_pages(now_ms);
        }
    }

    /// A key was published into a page: no longer in doubt (a report leaves it be).
    pub(super) fn page_keyed(&mut self, region_id: u64, page: u64) {
        if let Some(j) = &mut self.journal {
            if !j.in_doubt.is_empty() {
                j.in_doubt.remove(&(region_id, page));
            }
        }
    }

    /// Whether a heartbeat reply of `session` asks which pages it holds: a session
    /// of the last run that has not said yet.
    pub(super) fn wants_held_pages(&self, session: u64) -> bool {
        self.journal
            .as_ref()
            .is_some_and(|j| j.unreported.contains(&session))
    }

    /// Pages a restore found allocated without a key and not yet freed (while a
    /// session of the last run may still report), and those freed so far because
    /// their session's report did not name them.
    pub fn pages_in_doubt(&self) -> (usize, u64) {
        self.journal
            .as_ref()
            .map_or((0, 0), |j| (j.in_doubt.len(), j.held_freed))
    }

    /// A session of the last run says which pages it holds without a key (`held`,
    /// the first time after a restart; later reports change nothing): every page of
    /// its regions that the restore found allocated without a key, that still is
    /// and that `held` does not name, is freed as `free_pages` frees it (it waits
    /// for the leases of the last run: a reader may still read a key whose publish
    /// was lost). Only the session's own regions are looked at: a report naming pages
    /// of others, or pages it does not hold, changes nothing of theirs.
    pub(super) fn pages_held(&mut self, session: u64, held: &[PageRef], now_ms: u64) {
        let Some(j) = &mut self.journal else {
            return;
        };
        if !j.unreported.remove(&session) {
            return;
        }
        let Some(s) = self.sessions.get(session) else {
            return;
        };
        let (scope, mine) = (s.scope, s.regions.clone());
        let chunk = self.cfg.chunk_size;
        let named: BTreeSet<(u64, u64)> = held.iter().map(|p| (p.region_id, p.page)).collect();
        let doubt: Vec<(u64, u64)> = j
            .in_doubt
            .iter()
            .copied()
            .filter(|(rid, _)| mine.contains(rid))
            .collect();
        let (mut freed, mut kept) = (0u64, 0u64);
        for (rid, page) in doubt {
            if named.contains(&(rid, page)) {
                kept += 1;
                continue;
            }
            let unkeyed = self.keys.at(rid, page * chunk).is_none()
                && self
                    .regions
                    .get(rid)
                    .is_some_and(|r| r.pages.is_allocated(page));
            if !unkeyed {
                continue;
            }
            self.free_unkeyed_page(rid, page, scope);
            self.note_region_use(rid, now_ms);
            freed += 1;
        }
        if let Some(j) = &mut self.journal {
            j.held_freed += freed;
        }
        log::info!(
            "recovery: session {session} of the last run holds {} page(s) without a key: \
             {freed} page(s) found allocated without a key in its regions are freed (once no \
             lease of the last run can cover them), {kept} stay its own",
            held.len()
        );
        self.put_back_pages(now_ms);
    }

    /// Frees the page of key `key` (removed, or dropped with its region): at once
    /// without a durable directory, else once the removal is durable.
    pub(super) fn free_key_page(&mut self, region_id: u64, page: u64, key: KeyId, scope: ScopeId) {
        let Some(r) = self.regions.get_mut(region_id) else {
            return;
        };
        let Some(j) = &mut self.journal else {
            let _ = r.pages.free(page);
            return;
        };
        if r.pages.free_later(page).is_err() {
            return;
        }
        let recovered = j
            .recovered
            .as_ref()
            .is_some_and(|o| key.get() <= o.last_key);
        j.pending.push(PendingPage {
            batch: j.batch,
            not_before_ms: 0,
            region_id,
            page,
            recovered,
            scope,
        });
    }

    /// Frees a page its session holds without a key (`free_pages`): at once, unless
    /// a restore found it allocated without a key while leases of the last run may
    /// still cover it (its publish may have been lost in the crash, and a reader of
    /// the last run may still read it): then it waits like a page of a recovered key.
    pub(super) fn free_unkeyed_page(&mut self, region_id: u64, page: u64, scope: ScopeId) {
        let doubt = self
            .journal
            .as_mut()
            .is_some_and(|j| j.in_doubt.remove(&(region_id, page)) && !j.old_leases_over(j.now_ms));
        let Some(r) = self.regions.get_mut(region_id) else {
            return;
        };
        if !doubt {
            let _ = r.pages.free(page);
            return;
        }
        if r.pages.free_later(page).is_err() {
            return;
        }
        if let Some(j) = &mut self.journal {
            j.pending.push(PendingPage {
                batch: j.batch,
                not_before_ms: 0,
                region_id,
                page,
                recovered: true,
                scope,
            });
        }
    }

    fn session_record(&self, s: &Session) -> SessionRecord {
        SessionRecord {
            id: s.id,
            owner: s.client_id.clone(),
            tenant: s.tenant.clone(),
            writes: s.access == super::tenants::Access::Write,
            engine_id: s.engine_id.clone(),
            namespace: s.namespace.clone(),
            backend: s.backend,
            scope: KeyDirectory::scope_number(s.scope),
            check: 0,
        }
        .sealed()
    }

    /// The record of key `id`, its check bound to its region's boot id.
    fn key_record(&self, id: KeyId) -> Option<KeyRecord> {
        let e = self.keys.get(id)?;
        let boot = self
            .regions
            .get(e.loc.region_id)
            .and_then(|r| r.boot_id.as_deref());
        Some(
            KeyRecord {
                id: id.get(),
                scope: KeyDirectory::scope_number(e.scope),
                name: e.name.to_string(),
                region_id: e.loc.region_id,
                offset: e.loc.offset,
                length: e.loc.length,
                prev: e.prev.map(str::to_string),
                used: e.used(),
                check: 0,
            }
            .sealed(boot),
        )
    }

    /// The whole directory as records (a store written from scratch, tests).
    /// The sealed record of scope `id` (its own check over its fields), as the
    /// journal and the image both write it.
    fn scope_record(&self, id: ScopeId) -> Option<ScopeRecord> {
        let s = self.keys.scope(id)?;
        Some(
            ScopeRecord {
                id: KeyDirectory::scope_number(id),
                namespace: s.namespace.clone(),
                layout: s.layout.clone(),
                backend: s.backend,
                check: 0,
            }
            .sealed(),
        )
    }

    pub fn image(&self) -> Image {
        let mut scopes = Vec::new();
        let mut seen = BTreeSet::new();
        for (_, e) in self.keys.iter() {
            seen.insert(e.scope);
        }
        for s in self.sessions.iter() {
            seen.insert(s.scope);
        }
        for id in seen {
            scopes.extend(self.scope_record(id));
        }
        Image {
            scopes,
            sessions: self
                .sessions
                .iter()
                .map(|s| self.session_record(s))
                .collect(),
            next_session: self.sessions.next_id(),
            regions: self.regions.iter().map(region_record).collect(),
            keys: self
                .keys
                .iter()
                .filter_map(|(id, _)| self.key_record(id))
                .collect(),
            run: 0,
            lease_timeout_ms: self.cfg.lease_timeout_ms,
        }
    }

    /// A durable core rebuilt from what a store holds. Sessions come back
    /// disconnected, their time running from `now_ms` (a worker resumes its session,
    /// or it expires and its regions go to the keeper); kept regions go back to the
    /// keeper, regions that were going back go on their way. A record that no longer
    /// fits (a key of a region not held, a page out of range) is left out and its
    /// record removed. Sessions whose tenant lost its access end as a drained close.
    ///
    /// Pages of recovered keys that are removed wait for the leases of the last run
    /// (see the [module docs](self)): until every restored session said which leases
    /// it holds or ended, at most the longer of `image.lease_timeout_ms` and this
    /// run's lease timeout from `now_ms`. Lease ids start after `image.run <<`
    /// [`LEASE_RUN_SHIFT`].
    ///
    /// Serve nothing before [`recovered_rm`](Self::recovered_rm) and
    /// [`recovered_boots`](Self::recovered_boots).
    pub fn restore(
        cfg: MetaConfig,
        tenants: Tenants,
        image: Image,
        now_ms: u64,
    ) -> Result<(MetaCore, Recovered), ConfigError> {
        let lease_ms = cfg.lease_timeout_ms.max(image.lease_timeout_ms);
        let chunk = cfg.chunk_size;
        let mut core = MetaCore::new(cfg)?.with_tenants(tenants).keep_durable();
        core.note_now(now_ms);
        let base = image.run.checked_shl(LEASE_RUN_SHIFT).unwrap_or(0);
        core.leases.start_ids_after(base);
        let mut out = Recovered::default();
        let mut sessions_left_out = false;
        for s in &image.scopes {
            if !s.verify() {
                log::warn!(
                    "recovery: the record of scope {} fails its check (changed on disk): \
                     dropped with its sessions and keys",
                    s.id
                );
                out.left_out += 1;
                out.unverified += 1;
                continue;
            }
            let scope = Scope {
                namespace: s.namespace.clone(),
                layout: s.layout.clone(),
                backend: s.backend,
            };
            if !core.keys.restore_scope(s.id, scope) {
                log::warn!("recovery: scope {} is recorded twice; left out", s.id);
            }
        }
        // Ids of every recorded session stay taken, also of one whose record is
        // dropped below (its worker may still be there), and ids of this run are
        // above every earlier run's: the counter may have been changed on disk or
        // rolled back.
        let session_base = image.run.checked_shl(SESSION_RUN_SHIFT).unwrap_or(0);
        let mut next_session = image
            .sessions
            .iter()
            .map(|s| s.id.saturating_add(1))
            .fold(image.next_session.max(session_base + 1), u64::max);
        for s in &image.sessions {
            if !s.verify() {
                log::warn!(
                    "recovery: the record of session {} fails its check (changed on disk): \
                     dropped",
                    s.id
                );
                out.left_out += 1;
                out.unverified += 1;
                sessions_left_out = true;
                continue;
            }
            let Some(scope) = core.keys.restored_scope(s.scope) else {
                log::warn!(
                    "recovery: session {} names scope {}, which is not recorded; left out",
                    s.id,
                    s.scope
                );
                out.left_out += 1;
                sessions_left_out = true;
                continue;
            };
            next_session = next_session.max(s.id.saturating_add(1));
            core.sessions.restore(
                Session {
                    id: s.id,
                    client_id: s.owner.clone(),
                    tenant: s.tenant.clone(),
                    access: s.access(),
                    engine_id: s.engine_id.clone(),
                    namespace: s.namespace.clone(),
                    backend: s.backend,
                    scope,
                    regions: BTreeSet::new(),
                    last_seen_ms: now_ms,
                    connected: false,
                    hits: 0,
                    misses: 0,
                },
                next_session,
            );
            out.sessions += 1;
        }
        core.sessions.restore_next(next_session);
        let vouched = vouched_regions(&image);
        for g in &image.regions {
            let rid = g.handle.region_id;
            if !vouched.contains(&rid) {
                out.left_out += 1;
                out.unverified += 1;
                continue;
            }
            let longest = core.cfg.region_size.max(MAX_RESTORED_REGION);
            if g.handle.length > longest
                || g.pages != g.handle.length / chunk
                || core.regions.contains(rid)
            {
                log::warn!(
                    "recovery: region {rid} is recorded with {} pages of {chunk} bytes in {} \
                     bytes (at most {longest} bytes in pages of this server's chunk size), or \
                     twice; left out (the RM takes it back)",
                    g.pages,
                    g.handle.length
                );
                out.left_out += 1;
                continue;
            }
            let holder = match g.holder {
                HolderRecord::Session(sid) => match core.sessions.get(sid) {
                    Some(_) => {
                        core.join_region(sid, rid);
                        Holder::Session(sid)
                    }
                    // Its session was not recorded: the keeper has it (below).
                    None => Holder::Keeper,
                },
                HolderRecord::Keeper => Holder::Keeper,
                HolderRecord::GivingBack => Holder::GivingBack,
            };
            core.regions.insert(Region {
                handle: g.handle.clone(),
                pool: g.pool.clone(),
                agent: g.agent.clone(),
                backend: g.backend,
                pages: PageAllocator::restore(g.pages, &g.allocated),
                holder,
                last_read_ms: now_ms,
                boot_id: g.boot_id.clone(),
                unused_since_ms: None,
            });
            out.regions += 1;
        }
        core.keys.reserve(image.keys.len());
        // Ordered for eviction once, at the end (keys come back in id order, not in
        // their use order), and each name moved in, not copied.
        core.keys.begin_restore();
        for k in image.keys {
            let boot = core.regions.get(k.region_id).map(|r| r.boot_id.as_deref());
            if boot.is_some_and(|b| !k.verify(b)) {
                log::warn!(
                    "recovery: the record of key {} fails its check (changed on disk, or its \
                     region's record did): dropped, never served",
                    k.id
                );
                core.keys.note_gone(k.id);
                out.left_out += 1;
                out.unverified += 1;
                continue;
            }
            let fits = core
                .regions
                .get(k.region_id)
                .filter(|r| r.holder != Holder::GivingBack)
                .map(|r| {
                    k.offset % chunk == 0
                        && k.offset / chunk < r.pages.pages()
                        && k.length > 0
                        && k.length <= chunk
                });
            let scope = core.keys.restored_scope(k.scope);
            let (Some(true), Some(scope)) = (fits, scope) else {
                log::warn!(
                    "recovery: key {:?} (record {}) of region {} at offset {} does not fit a \
                     recorded region and scope; left out",
                    crate::net::clip(&k.name),
                    k.id,
                    k.region_id,
                    k.offset
                );
                leave_out(&mut core, &mut out, k.id);
                continue;
            };
            if core.keys.at(k.region_id, k.offset).is_some() {
                let (offset, region, id) = (k.offset, k.region_id, k.id);
                log::warn!(
                    "recovery: two keys recorded at offset {offset} of region {region}; key \
                     record {id} left out"
                );
                leave_out(&mut core, &mut out, id);
                continue;
            }
            let loc = Location {
                region_id: k.region_id,
                offset: k.offset,
                length: k.length,
            };
            match core
                .keys
                .restore(k.id, scope, k.name, loc, k.prev.as_deref(), k.used)
            {
                Published::New(_) => {
                    if let Some(r) = core.regions.get_mut_quiet(k.region_id) {
                        r.pages.take(k.offset / chunk);
                    }
                    out.keys += 1;
                }
                Published::Exists(_) => {
                    core.keys.note_gone(k.id);
                    out.left_out += 1;
                }
            }
        }
        core.keys.finish_restore();
        // Regions of the keeper: readable while they hold keys; the rest go back.
        let ids: Vec<(u64, Holder)> = core
            .regions
            .iter()
            .map(|r| (r.handle.region_id, r.holder))
            .collect();
        for (rid, holder) in ids {
            let keys = core.keys.region_keys(rid);
            let Some(r) = core.regions.get_mut(rid) else {
                continue;
            };
            let (handle, agent) = (r.handle.clone(), r.agent.clone());
            match holder {
                Holder::Keeper if keys > 0 => {
                    let boot = r.boot_id.clone();
                    core.keeper.keep(handle, agent, boot, now_ms);
                }
                Holder::Keeper | Holder::GivingBack => {
                    r.holder = Holder::GivingBack;
                    core.keeper
                        .give_back(handle, agent, false, GiveBackReason::Recovered, now_ms);
                }
                Holder::Session(_) => r.note_use(now_ms),
            }
        }
        let mut in_doubt = BTreeSet::new();
        for r in core.regions.iter() {
            let rid = r.handle.region_id;
            let pages = r.pages.allocated_pages();
            // Each key of the region took a page of its own: as many keys as pages
            // taken, and none is without a key (no lookup per page).
            if pages.len() == core.keys.region_keys(rid) {
                continue;
            }
            for page in pages {
                if core.keys.at(rid, page * chunk).is_none() {
                    in_doubt.insert((rid, page));
                }
            }
        }
        if !in_doubt.is_empty() {
            log::info!(
                "recovery: {} page(s) are allocated without a key (reserved for their session, \
                 or their publish was lost): not handed out again until their session's worker \
                 says which pages it holds (the others are freed), frees them, or its region \
                 goes",
                in_doubt.len()
            );
        }
        if let Some(j) = &mut core.journal {
            j.in_doubt = in_doubt;
            j.unreported = core.sessions.iter().map(|s| s.id).collect();
            j.recovered = Some(OldLeases {
                last_key: core.keys.last_id(),
                until_ms: now_ms.saturating_add(lease_ms),
                silent: core.sessions.iter().map(|s| s.id).collect(),
                unknown: sessions_left_out,
                base,
            });
        }
        let tenants = core.tenants.clone();
        core.set_tenants(tenants, now_ms);
        Ok((core, out))
    }

    /// Which regions the RM holds for this server, asked after a restore: a region
    /// of the directory the RM no longer holds (same id, offset and length) loses its
    /// keys and goes (nothing is left to free); a region the RM holds that the
    /// directory does not know (an allocation answered as the server stopped) goes
    /// back, released at its agent first. Returns (regions dropped, keys dropped).
    pub fn recovered_rm(&mut self, held: &[RegionInfo], now_ms: u64) -> (usize, usize) {
        self.note_now(now_ms);
        let by_id: BTreeMap<u64, &RegionInfo> = held.iter().map(|r| (r.region_id, r)).collect();
        let gone: Vec<u64> = self
            .regions
            .iter()
            .filter(|r| {
                !by_id
                    .get(&r.handle.region_id)
                    .is_some_and(|i| i.offset == r.handle.offset && i.length == r.handle.length)
            })
            .map(|r| r.handle.region_id)
            .collect();
        let mut keys = 0;
        for rid in &gone {
            let (k, _) = self.hide_region(*rid);
            keys += k;
            if let Some(Holder::Session(sid)) = self.regions.get(*rid).map(|r| r.holder) {
                self.leave_region(sid, *rid);
            }
            self.keeper.forget(*rid);
            self.fair.region_gone(*rid, None);
            self.regions.remove(*rid);
            log::warn!(
                "recovery: region {rid} is no longer held by the RM for maru-server (reaped \
                 while it was away longer than the RM's grace period?): {k} keys dropped"
            );
        }
        for info in held {
            if self.regions.contains(info.region_id) {
                continue;
            }
            let Some(token) = info.token.clone() else {
                log::warn!(
                    "recovery: the RM holds region {} for maru-server, which its directory \
                     does not know, and names no handle for it: it stays allocated until the \
                     RM reaps it",
                    info.region_id
                );
                continue;
            };
            let handle = Handle {
                region_id: info.region_id,
                offset: info.offset,
                length: info.length,
                token,
            };
            self.give_back_orphan(handle, now_ms);
        }
        (gone.len(), keys)
    }

    /// A region the RM holds for the server that its directory does not know: back,
    /// released at the agent that would serve it first (a worker may have mapped it).
    fn give_back_orphan(&mut self, handle: Handle, now_ms: u64) {
        let rid = handle.region_id;
        log::info!("recovery: region {rid} is held at the RM but unknown here; it goes back");
        let agent = agent_for(rid, &self.cfg.agents);
        let pages = (handle.length / self.cfg.chunk_size).max(1);
        self.regions.insert(Region {
            handle: handle.clone(),
            pool: crate::wire::rm::PoolInfo {
                pool_id: 0,
                path: String::new(),
                uuid: String::new(),
                kind: String::new(),
                total: 0,
                free: 0,
                align: 0,
                draining: 0,
            },
            agent: agent.clone(),
            backend: if agent.is_some() {
                Backend::RemoteCxl
            } else {
                Backend::Cxl
            },
            pages: PageAllocator::new(pages),
            holder: Holder::GivingBack,
            last_read_ms: now_ms,
            boot_id: None,
            unused_since_ms: None,
        });
        self.keeper
            .give_back(handle, agent, false, GiveBackReason::Recovered, now_ms);
    }

    /// What each agent reported as its boot id, asked after a restore: the keys of a
    /// region whose memory node booted since they were written (another boot id, or
    /// none recorded) are dropped; a kept region goes back. An agent that did not
    /// answer decides nothing here (the keeper and the worker check it later, and a
    /// reader's lease names the recorded boot id). Returns the keys dropped.
    pub fn recovered_boots(
        &mut self,
        boots: &BTreeMap<String, Result<String, PortError>>,
        now_ms: u64,
    ) -> usize {
        self.note_now(now_ms);
        let regions: Vec<(u64, String, Option<String>, Holder)> = self
            .regions
            .iter()
            .filter(|r| self.keys.region_keys(r.handle.region_id) > 0)
            .filter_map(|r| {
                Some((
                    r.handle.region_id,
                    r.agent.clone()?,
                    r.boot_id.clone(),
                    r.holder,
                ))
            })
            .collect();
        let mut dropped = 0;
        for (rid, agent, recorded, holder) in regions {
            let now = match boots.get(&agent) {
                Some(Ok(b)) if !b.is_empty() => b,
                _ => continue,
            };
            if recorded.as_deref() == Some(now.as_str()) {
                continue;
            }
            let keys = self.keys.region_keys(rid);
            log::warn!(
                "recovery: agent {agent} reports boot id {now} for region {rid}, whose keys were \
                 written under {}: its {keys} keys are dropped",
                recorded.as_deref().unwrap_or("no recorded boot id")
            );
            dropped += keys;
            if holder == Holder::Keeper {
                let reason = GiveBackReason::Rebooted;
                self.keeper.lose(rid, reason, now_ms);
                self.apply(&[KeeperEvent::Lost {
                    region_id: rid,
                    reason,
                }]);
            } else {
                self.hide_region(rid);
                if let Some(r) = self.regions.get_mut(rid) {
                    r.boot_id = Some(now.clone());
                }
            }
        }
        dropped
    }
}

fn region_record(r: &Region) -> RegionRecord {
    RegionRecord {
        handle: r.handle.clone(),
        pool: r.pool.clone(),
        agent: r.agent.clone(),
        backend: r.backend,
        holder: match r.holder {
            Holder::Session(s) => HolderRecord::Session(s),
            Holder::Keeper => HolderRecord::Keeper,
            Holder::GivingBack => HolderRecord::GivingBack,
        },
        boot_id: r.boot_id.clone(),
        pages: r.pages.pages(),
        allocated: r.pages.allocated_pages(),
        check: 0,
    }
    .sealed()
}

/// The regions of `image` that may be served: their check holds and their range
/// of their pool overlaps no other's (two records of one range: at most one of them
/// is right, and which one cannot be told, so neither is served). Logs each one
/// dropped; returns the ids kept.
fn vouched_regions(image: &Image) -> BTreeSet<u64> {
    let mut ok: BTreeMap<u64, &RegionRecord> = BTreeMap::new();
    for g in &image.regions {
        if g.verify() {
            ok.insert(g.handle.region_id, g);
        } else {
            log::warn!(
                "recovery: the record of region {} fails its check (changed on disk): \
                 dropped with its keys, never served",
                g.handle.region_id
            );
        }
    }
    let overlapping = overlapping_regions(ok.values().copied());
    ok.into_keys()
        .filter(|r| !overlapping.contains(r))
        .collect()
}

/// What [`seal_format1`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sealed1 {
    /// Records kept and sealed.
    pub kept: u64,
    /// Records dropped: never served, their keys misses.
    pub dropped: u64,
}

/// Seals a directory of record format 1 (records without a check of their own,
/// what the release before format 2 wrote) into this format, once, at the first
/// start on it: what can be checked without a check is, and a record that fails is
/// dropped (logged; never served, its key a miss):
///
/// - a region whose range of its pool overlaps another region's (neither);
/// - a key whose region is not recorded, whose offset is not the start of one of
///   its region's pages, whose length is 0 or longer than a page, whose page is not
///   allocated in its region's record, or whose scope is not recorded; two keys
///   at one page (neither);
/// - a session whose scope is not recorded.
///
/// The records kept get their checks (a key's bound to its region's boot id, as
/// written). A bit that changed on disk before this start in a field these checks
/// do not cover cannot be told from the value written: the release that wrote the
/// directory did not record one (the restore that follows checks the rest as on
/// every start).
pub fn seal_format1(image: &mut Image) -> Sealed1 {
    let mut out = Sealed1::default();
    let mut reject = |what: String| {
        log::warn!("upgrade from record format 1: {what}: dropped, never served");
        out.dropped += 1;
    };
    let overlapping = overlapping_regions(image.regions.iter());
    image.regions.retain(|g| {
        let keep = !overlapping.contains(&g.handle.region_id);
        if !keep {
            reject(format!(
                "region {} lies over pages another region's record holds",
                g.handle.region_id
            ));
        }
        keep
    });
    let scopes: BTreeSet<u32> = image.scopes.iter().map(|s| s.id).collect();
    image.sessions.retain(|s| {
        let keep = scopes.contains(&s.scope);
        if !keep {
            reject(format!(
                "session {} names scope {}, not recorded",
                s.id, s.scope
            ));
        }
        keep
    });
    let regions: BTreeMap<u64, &RegionRecord> = image
        .regions
        .iter()
        .map(|g| (g.handle.region_id, g))
        .collect();
    let mut at_page: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    for k in &image.keys {
        *at_page.entry((k.region_id, k.offset)).or_default() += 1;
    }
    let mut kept_keys = Vec::with_capacity(image.keys.len());
    for k in std::mem::take(&mut image.keys) {
        let page = regions.get(&k.region_id).and_then(|g| {
            let size = g.handle.length.checked_div(g.pages)?;
            (size > 0
                && k.offset % size == 0
                && k.offset / size < g.pages
                && k.length > 0
                && k.length <= size
                && g.allocated.contains(&(k.offset / size)))
            .then_some(g)
        });
        let Some(g) = page else {
            reject(format!(
                "key record {} (region {}, offset {}, length {}) does not lie on an allocated \
                 page of a recorded region",
                k.id, k.region_id, k.offset, k.length
            ));
            continue;
        };
        if at_page.get(&(k.region_id, k.offset)).copied().unwrap_or(0) > 1 {
            reject(format!(
                "key record {}: another key is recorded at offset {} of region {}",
                k.id, k.offset, k.region_id
            ));
            continue;
        }
        if !scopes.contains(&k.scope) {
            reject(format!(
                "key record {} names scope {}, not recorded",
                k.id, k.scope
            ));
            continue;
        }
        let boot = g.boot_id.clone();
        kept_keys.push(k.sealed(boot.as_deref()));
    }
    image.keys = kept_keys;
    for s in &mut image.scopes {
        s.seal();
    }
    for s in &mut image.sessions {
        s.seal();
    }
    for g in &mut image.regions {
        g.seal();
    }
    out.kept =
        (image.scopes.len() + image.sessions.len() + image.regions.len() + image.keys.len()) as u64;
    out
}

/// The regions among `regions` whose range of their pool overlaps another's.
/// Logs each.
fn overlapping_regions<'a>(regions: impl Iterator<Item = &'a RegionRecord>) -> BTreeSet<u64> {
    let mut by_pool: BTreeMap<u32, Vec<(u64, u64, u64)>> = BTreeMap::new();
    for g in regions {
        let h = &g.handle;
        by_pool.entry(g.pool.pool_id).or_default().push((
            h.offset,
            h.offset.saturating_add(h.length),
            h.region_id,
        ));
    }
    let mut overlapping = BTreeSet::new();
    for ranges in by_pool.values_mut() {
        ranges.sort_unstable();
        // The furthest end so far, and whose.
        let mut reach: Option<(u64, u64)> = None;
        for &(start, end, rid) in ranges.iter() {
            if let Some((far, who)) = reach {
                if start < far {
                    overlapping.insert(rid);
                    overlapping.insert(who);
                }
            }
            if reach.is_none_or(|(far, _)| end > far) {
                reach = Some((end, rid));
            }
        }
    }
    for rid in &overlapping {
        log::warn!(
            "recovery: region {rid} is recorded over pages another region's record holds: \
             dropped with its keys, never served"
        );
    }
    overlapping
}
