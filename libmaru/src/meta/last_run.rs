//! After a restart, the leases and pages of the last run: pages of recovered keys
//! wait until every session of the last run said which leases it holds (or ended,
//! or the longest lease of that run ran out), and pages found allocated without a
//! key stay their session's until its worker says which pages it holds. The rules
//! are in [`durable`](super::durable).

use super::core::MetaCore;
use crate::wire::meta::{HeldLease, PageRef};
use std::collections::BTreeSet;

/// How often a region held back for the leases of the last run is looked at again.
const HOLD_BACK_RECHECK_MS: u64 = 1_000;

impl MetaCore {
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
}
