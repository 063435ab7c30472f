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
//! opened or closed are answered once their batch is durable, except a removal of
//! keys published since the last batch was taken: publish and removal go in one
//! batch, so no crash can keep the publish and lose the removal.
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
//!
//! This file holds the journal side: batches of changes, pages handed out again once
//! durable, the records. The restore is in [`restore`](super::restore), the last
//! run's leases and pages in doubt in [`last_run`](super::last_run), the upgrade from
//! record format 1 in [`seal1`](super::seal1).

use super::core::MetaCore;
use super::journal::{Journal, PendingPage, ReplyTiming};
use super::keys::{KeyDirectory, KeyId, ScopeId};
use super::records::{
    Changes, HolderRecord, Image, KeyRecord, Record, RegionRecord, ScopeRecord, Sealed,
    SessionRecord,
};
use super::regions::{Holder, Region};
use super::sessions::Session;
use std::collections::BTreeSet;

/// Lease ids of run `r` of a server on its state directory are above `r <<
/// LEASE_RUN_SHIFT` (2^40 leases per run before they reach the next run's).
pub const LEASE_RUN_SHIFT: u32 = 40;

/// Session ids of run `r` of a server on its state directory are above `r <<
/// SESSION_RUN_SHIFT`: an id handed out in one run is never handed out in a later
/// one, whatever the counter read back says (changed on disk, or rolled back with
/// the commits the store's repair after a crash could not keep).
pub const SESSION_RUN_SHIFT: u32 = 32;

/// Pages reserved for a session at a time, ahead of its allocs (at most an eighth
/// of a region): an alloc is answered from pages whose reservation is durable, with
/// no commit of its own. A crash keeps the pages of the reserve out of use until their
/// session's worker says which pages it holds, frees them, or ends (a restart cannot
/// tell which of them were handed out).
pub const RESERVE_BLOCK: u64 = 1024;

/// Most blocks reserved for one session at a time, however fast it allocates (what
/// a crash leaves in doubt until its worker says which pages it holds).
pub const RESERVE_MAX_BLOCKS: u64 = 4;

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
    /// Key records come sealed (each key's check binds its region's boot id); the
    /// store seals the others as it takes the batch ([`Changes::seal`]), off the
    /// event loop: a region's record carries its list of allocated pages.
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
        for (id, stamped) in kj.gone {
            records.push(match stamped {
                true => Record::KeyGone(id.get()),
                false => Record::KeyGoneUnread(id.get()),
            });
        }
        for id in &kj.put {
            if let Some(r) = self.key_record(*id) {
                records.push(Record::Key(r));
            }
        }
        for id in kj.used.difference(&kj.put) {
            if let Some(used) = self.keys.stamp_to_record(*id) {
                records.push(Record::Used { id: id.get(), used });
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

    /// The record of session `s`, its check not set yet (see [`Record::seal`]).
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

    /// The record of scope `id`, its check not set yet (see [`Record::seal`]).
    fn scope_record(&self, id: ScopeId) -> Option<ScopeRecord> {
        let s = self.keys.scope(id)?;
        Some(ScopeRecord {
            id: KeyDirectory::scope_number(id),
            namespace: s.namespace.clone(),
            layout: s.layout.clone(),
            backend: s.backend,
            check: 0,
        })
    }

    /// The whole directory as sealed records (a store written from scratch, tests).
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
            scopes.extend(self.scope_record(id).map(Sealed::sealed));
        }
        Image {
            scopes,
            sessions: self
                .sessions
                .iter()
                .map(|s| self.session_record(s).sealed())
                .collect(),
            next_session: self.sessions.next_id(),
            regions: self
                .regions
                .iter()
                .map(|r| region_record(r).sealed())
                .collect(),
            keys: self
                .keys
                .iter()
                .filter_map(|(id, _)| self.key_record(id))
                .collect(),
            run: 0,
            lease_timeout_ms: self.cfg.lease_timeout_ms,
            key_ids_end: 0,
        }
    }
}

/// The record of region `r`, its check not set yet (see [`Record::seal`]).
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
}
