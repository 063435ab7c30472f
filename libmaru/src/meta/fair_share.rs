//! A fair share of a full pool, counted per principal (tenant) first, then per
//! session within a tenant: a storing session that cannot get a region, while the
//! keeper has nothing to give back, makes maru-server ask for one region back — of the
//! tenant furthest above its share, or, when no tenant is above its share, of the
//! session of the waiter's own tenant furthest above its share of that tenant's
//! regions. A tenant opening more sessions does not get more of the pool; the engines
//! of one tenant share its regions as engines shared the pool before tenants.
//!
//! A tenant's share is the pool's regions (every region maru-server holds) divided by
//! the storing tenants (those whose sessions hold a region, and those with a session
//! waiting for one), rounded up, at least one. A session's share is its tenant's
//! regions divided by the tenant's storing sessions, rounded up, at least one. A
//! tenant at its share does not take a new region while another tenant waits, nor a
//! session at its share while another session of its tenant waits (it evicts its own
//! keys instead), so a region given back goes to the waiter; a waiter that holds its
//! share (one that filled the pool alone and was refused more, say) waits no longer,
//! so it can be asked when the next one comes. The one picked gives its
//! region read longest ago that holds no pinned key: maru-server takes it at once when
//! that session is idle in one of its regions (see `MetaCore::ask_fair_share`), else
//! the ask rides on the session's next reply (`alloc`, `publish`, `heartbeat`) and the
//! session evicts it, releases it at its agent and returns it, as every return. One
//! request is outstanding at a time; an unanswered one is asked again of whoever is
//! then furthest above its share once `ask_timeout_ms` passed.
//!
//! The counts those rules need (regions per tenant and per session, storing sessions
//! per tenant, waiters per tenant) are kept here as regions come and go
//! ([`FairShare::region_added`], [`FairShare::region_removed`]), so that a request
//! that asks for a region, and the share every alloc's reply carries, look them up
//! instead of walking every session (issue 46). Only [`FairShare::decide`], when the
//! RM refused a region and no ask is outstanding, walks the sessions of the tenants
//! above their share.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The counts [`FairShare`] keeps (tests compare them with a scan): per storing
/// session (tenant, regions), and per tenant (regions, storing sessions).
#[cfg(test)]
pub(crate) type Counts = (
    BTreeMap<u64, (String, usize)>,
    BTreeMap<String, (usize, usize)>,
);

/// A session that holds a region or waits for one (a *storing* session).
#[derive(Debug, Clone)]
struct Member {
    tenant: String,
    regions: usize,
}

/// A tenant with a storing session.
#[derive(Debug, Clone, Default)]
struct TenantHold {
    regions: usize,
    /// Its storing sessions.
    sessions: BTreeSet<u64>,
}

/// What the fair-share rule remembers between requests.
#[derive(Debug, Default)]
pub struct FairShare {
    /// Sessions refused a region for want of room: their tenant and when they last
    /// asked.
    wanting: BTreeMap<u64, (String, u64)>,
    /// The same, by (when they last asked, session): the stale ones first.
    wanting_since: BTreeSet<(u64, u64)>,
    /// Waiting sessions per tenant.
    waiting_tenants: BTreeMap<String, usize>,
    /// The storing sessions: holding a region, or waiting for one.
    members: HashMap<u64, Member>,
    /// The tenants of the storing sessions.
    tenants: BTreeMap<String, TenantHold>,
    /// The give-back asked and not yet answered.
    asked: Option<Ask>,
    /// Regions returned because they were asked for, since the server started.
    pub returned: u64,
    /// Sessions visited by the lookups (a measure of their work, for the tests).
    visited: std::cell::Cell<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub session: u64,
    pub region_id: u64,
    pub at_ms: u64,
}

/// Of `candidates` (session, regions counted for it, its region read longest ago
/// that may be given back as (last read, region)), the one with the most regions,
/// then the region read longest ago: (session, region).
fn pick(candidates: impl Iterator<Item = (u64, usize, Option<(u64, u64)>)>) -> Option<(u64, u64)> {
    candidates
        .filter_map(|(session, n, oldest)| {
            let (last_read, rid) = oldest?;
            // Most above its share first; then the region read longest ago.
            Some((std::cmp::Reverse(n), last_read, session, rid))
        })
        .min()
        .map(|(_, _, session, rid)| (session, rid))
}

impl FairShare {
    /// Sessions visited so far by the lookups.
    pub fn visited(&self) -> u64 {
        self.visited.get()
    }

    fn visit(&self, n: usize) {
        self.visited.set(self.visited.get() + n as u64);
    }

    /// `session` of `tenant` got a region.
    pub fn region_added(&mut self, session: u64, tenant: &str) {
        let m = self.members.entry(session).or_insert_with(|| Member {
            tenant: tenant.to_string(),
            regions: 0,
        });
        m.regions += 1;
        match self.tenants.get_mut(&m.tenant) {
            Some(t) => {
                t.regions += 1;
                t.sessions.insert(session);
            }
            None => {
                self.tenants.insert(
                    m.tenant.clone(),
                    TenantHold {
                        regions: 1,
                        sessions: BTreeSet::from([session]),
                    },
                );
            }
        }
    }

    /// `session` no longer holds one of its regions.
    pub fn region_removed(&mut self, session: u64) {
        let Some(m) = self.members.get_mut(&session) else {
            return;
        };
        if m.regions == 0 {
            return;
        }
        m.regions -= 1;
        let left = m.regions;
        if let Some(t) = self.tenants.get_mut(&m.tenant) {
            t.regions -= 1;
        }
        if left == 0 && !self.wanting.contains_key(&session) {
            self.leave(session);
        }
    }

    /// `session` stores no longer (no region, not waiting, or ended).
    fn leave(&mut self, session: u64) {
        let Some(m) = self.members.remove(&session) else {
            return;
        };
        if let Some(t) = self.tenants.get_mut(&m.tenant) {
            t.regions -= m.regions;
            t.sessions.remove(&session);
            if t.sessions.is_empty() {
                self.tenants.remove(&m.tenant);
            }
        }
    }

    /// `session` waits no longer; it stays a storing session while it holds a region.
    fn stop_waiting(&mut self, session: u64) {
        let Some((tenant, since)) = self.wanting.remove(&session) else {
            return;
        };
        self.wanting_since.remove(&(since, session));
        if let Some(n) = self.waiting_tenants.get_mut(&tenant) {
            *n -= 1;
            if *n == 0 {
                self.waiting_tenants.remove(&tenant);
            }
        }
        if self.members.get(&session).is_some_and(|m| m.regions == 0) {
            self.leave(session);
        }
    }

    /// `session` of `tenant` was refused a region for want of room at `now_ms`.
    pub fn want(&mut self, session: u64, tenant: &str, now_ms: u64) {
        match self.wanting.get_mut(&session) {
            Some((_, since)) => {
                self.wanting_since.remove(&(*since, session));
                *since = now_ms;
            }
            None => {
                self.wanting.insert(session, (tenant.to_string(), now_ms));
                *self.waiting_tenants.entry(tenant.to_string()).or_default() += 1;
            }
        }
        self.wanting_since.insert((now_ms, session));
        if let std::collections::hash_map::Entry::Vacant(e) = self.members.entry(session) {
            e.insert(Member {
                tenant: tenant.to_string(),
                regions: 0,
            });
            self.tenants
                .entry(tenant.to_string())
                .or_default()
                .sessions
                .insert(session);
        }
    }

    /// `session` got a region, or ended: it waits no longer, and a give-back asked
    /// of it is void when it ended.
    pub fn done_waiting(&mut self, session: u64) {
        self.stop_waiting(session);
    }

    pub fn session_ended(&mut self, session: u64) {
        self.stop_waiting(session);
        self.leave(session);
        if self.asked.is_some_and(|a| a.session == session) || self.wanting.is_empty() {
            self.asked = None;
        }
    }

    /// Forgets waiters that stopped asking `wait_ms` ago; with nobody waiting, a
    /// give-back asked is no longer needed. Visits the waiters it forgets and one more.
    pub fn forget_stale(&mut self, now_ms: u64, wait_ms: u64) {
        let stale: Vec<u64> = self
            .wanting_since
            .iter()
            .take_while(|(since, _)| now_ms.saturating_sub(*since) >= wait_ms)
            .map(|&(_, s)| s)
            .collect();
        self.visit(stale.len() + 1);
        for s in stale {
            self.stop_waiting(s);
        }
        if self.wanting.is_empty() {
            self.asked = None;
        }
    }

    /// Forgets waiters that hold their share already: their tenant holds its share of
    /// the pool and the session its share of the tenant's regions. An engine alone on
    /// a pool it filled is refused a region and noted as waiting; counted as waiting
    /// it would never be asked to give back (a waiting tenant is never asked) until it
    /// stopped asking for `wait_ms`, and a newcomer got nothing meanwhile (seen: 3 s,
    /// the session timeout, after which the newcomer had stopped storing).
    fn forget_satisfied(&mut self, pool_regions: usize) {
        if self.wanting.is_empty() {
            return;
        }
        let share = self.share(pool_regions);
        self.visit(self.wanting.len());
        let satisfied: Vec<u64> = self
            .wanting
            .iter()
            .filter(|(s, (t, _))| {
                self.tenant_regions(t) >= share
                    && self.session_regions(**s) >= self.session_share(t)
            })
            .map(|(s, _)| *s)
            .collect();
        for s in satisfied {
            self.stop_waiting(s);
        }
    }

    /// The region went back to the RM (returned, or lost otherwise).
    pub fn region_gone(&mut self, region_id: u64, returned_by: Option<u64>) {
        if let Some(a) = self.asked {
            if a.region_id == region_id {
                if returned_by == Some(a.session) {
                    self.returned += 1;
                }
                self.asked = None;
            }
        }
    }

    /// The give-back asked and not answered yet.
    pub fn asked(&self) -> Option<Ask> {
        self.asked
    }

    /// maru-server took a region of `session` for the waiters itself (nobody was
    /// writing or reading it): an ask of `session` is answered.
    pub fn taken(&mut self, session: u64) {
        if self.asked.is_some_and(|a| a.session == session) {
            self.asked = None;
            self.returned += 1;
        }
    }

    /// The region this session is asked to give back, if any.
    pub fn asked_of(&self, session: u64) -> Option<u64> {
        self.asked
            .filter(|a| a.session == session)
            .map(|a| a.region_id)
    }

    /// Whether `session` waits for a region.
    pub fn is_waiting(&self, session: u64) -> bool {
        self.wanting.contains_key(&session)
    }

    /// Sessions waiting for a region.
    pub fn waiting(&self) -> usize {
        self.wanting.len()
    }

    /// Regions `tenant`'s sessions hold.
    pub fn tenant_regions(&self, tenant: &str) -> usize {
        self.visit(1);
        self.tenants.get(tenant).map_or(0, |t| t.regions)
    }

    /// Regions `session` holds.
    pub fn session_regions(&self, session: u64) -> usize {
        self.visit(1);
        self.members.get(&session).map_or(0, |m| m.regions)
    }

    /// Whether `session` stores: holds a region or waits for one.
    pub fn is_storing(&self, session: u64) -> bool {
        self.members.contains_key(&session)
    }

    /// Storing sessions of `tenant`.
    pub fn storing_sessions(&self, tenant: &str) -> usize {
        self.visit(1);
        self.tenants.get(tenant).map_or(0, |t| t.sessions.len())
    }

    /// Whether `session` of `tenant`, asking for a region, must let waiting sessions
    /// go first: a session of another tenant waits and `tenant` holds its share
    /// already, or another session of `tenant` waits and `session` holds its share of
    /// the tenant's regions. A region given back for a waiter is then not taken again
    /// by whoever asks first (the one that gave it back, typically), which would only
    /// move keys around.
    pub fn must_yield(&self, session: u64, tenant: &str, pool_regions: usize) -> bool {
        let of_tenant = self.waiting_tenants.get(tenant).copied().unwrap_or(0);
        let other_tenant_waits = self.waiting_tenants.len() > usize::from(of_tenant > 0);
        if other_tenant_waits && self.tenant_regions(tenant) >= self.share(pool_regions) {
            return true;
        }
        let own_tenant_waits = of_tenant > usize::from(self.is_waiting(session));
        own_tenant_waits && self.session_regions(session) >= self.session_share(tenant)
    }

    /// Storing tenants: those holding a region, those waiting, and `also` (a tenant
    /// asking for its first region).
    pub fn storing_tenants(&self, also: Option<&str>) -> usize {
        self.visit(1);
        self.tenants.len() + usize::from(also.is_some_and(|t| !self.tenants.contains_key(t)))
    }

    /// Pool regions ÷ storing tenants, rounded up, at least one. Rounded up, so that
    /// with regions that do not divide evenly a tenant one region above another is
    /// not asked: giving it back would only make the other one the larger, and the
    /// two would hand regions (and their keys) back and forth.
    pub fn share(&self, pool_regions: usize) -> usize {
        let storing = self.storing_tenants(None);
        pool_regions.div_ceil(storing.max(1)).max(1)
    }

    /// A session's share of its tenant's regions: they ÷ the tenant's storing
    /// sessions (holding a region, or waiting), rounded up, at least one.
    pub fn session_share(&self, tenant: &str) -> usize {
        let storing = self.storing_sessions(tenant);
        self.tenant_regions(tenant).div_ceil(storing.max(1)).max(1)
    }

    /// Decides whether to ask a session for a region: forgets waiters that stopped
    /// asking `wait_ms` ago, keeps an outstanding ask younger than `ask_timeout_ms`,
    /// else picks the tenant furthest above its share and, of its regions that may go,
    /// the one read longest ago; with no tenant above its share, the session furthest
    /// above its share of a waiting tenant's regions. `pool_regions` counts every
    /// region maru-server holds; `oldest(session)` is the region of the session read
    /// longest ago that may be given back (no pinned key), as (last read, region).
    /// Walks the sessions of the tenants above their share (and, failing those, of
    /// the waiting tenants), when an ask is due.
    pub fn decide(
        &mut self,
        pool_regions: usize,
        now_ms: u64,
        wait_ms: u64,
        ask_timeout_ms: u64,
        oldest: impl Fn(u64) -> Option<(u64, u64)>,
    ) -> Option<Ask> {
        self.forget_stale(now_ms, wait_ms);
        self.forget_satisfied(pool_regions);
        if let Some(a) = self.asked {
            if now_ms.saturating_sub(a.at_ms) < ask_timeout_ms {
                return None;
            }
            self.asked = None;
        }
        if self.wanting.is_empty() {
            return None;
        }
        let share = self.share(pool_regions);
        // First the tenants above their share (never a waiting one).
        let across = pick(
            self.tenants
                .iter()
                .filter(|(t, h)| !self.waiting_tenants.contains_key(*t) && h.regions > share)
                .flat_map(|(_, h)| h.sessions.iter().map(move |&s| (s, h.regions)))
                .inspect(|_| self.visit(1))
                .map(|(s, n)| (s, n, oldest(s))),
        );
        // Then, within a waiting tenant, its sessions above their share (never a
        // waiting session).
        let within = || {
            pick(
                self.waiting_tenants
                    .keys()
                    .filter_map(|t| Some((self.tenants.get(t)?, self.session_share(t))))
                    .flat_map(|(h, share)| h.sessions.iter().map(move |&s| (s, share)))
                    .inspect(|_| self.visit(1))
                    .filter(|&(s, share)| !self.is_waiting(s) && self.session_regions(s) > share)
                    .map(|(s, _)| (s, self.session_regions(s), oldest(s))),
            )
        };
        let ask = across.or_else(within).map(|(session, region_id)| Ask {
            session,
            region_id,
            at_ms: now_ms,
        });
        self.asked = ask;
        ask
    }

    /// Forgets every region counted (the waiters stay storing), for tests that set
    /// the counts from a list of holdings.
    #[cfg(test)]
    pub(crate) fn reset_regions(&mut self) {
        self.members.clear();
        self.tenants.clear();
        for (s, (t, _)) in &self.wanting {
            self.members.insert(
                *s,
                Member {
                    tenant: t.clone(),
                    regions: 0,
                },
            );
            self.tenants
                .entry(t.clone())
                .or_default()
                .sessions
                .insert(*s);
        }
    }

    /// The counts kept, as a scan would find them: per storing session (tenant,
    /// regions), and per tenant (regions, storing sessions).
    #[cfg(test)]
    pub(crate) fn counts(&self) -> Counts {
        (
            self.members
                .iter()
                .map(|(s, m)| (*s, (m.tenant.clone(), m.regions)))
                .collect(),
            self.tenants
                .iter()
                .map(|(t, h)| (t.clone(), (h.regions, h.sessions.len())))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One session's regions, each (region, last read, may be given back).
    #[derive(Debug, Clone)]
    struct Holding {
        session: u64,
        tenant: String,
        regions: Vec<(u64, u64, bool)>,
    }

    /// `f` counting the regions of `h` (and no other).
    fn load(f: &mut FairShare, h: &[Holding]) {
        f.reset_regions();
        for x in h {
            for _ in &x.regions {
                f.region_added(x.session, &x.tenant);
            }
        }
    }

    /// The region of `session` in `h` read longest ago that may go.
    fn oldest(h: &[Holding], session: u64) -> Option<(u64, u64)> {
        h.iter()
            .filter(|x| x.session == session)
            .flat_map(|x| x.regions.iter())
            .filter(|r| r.2)
            .map(|&(rid, read, _)| (read, rid))
            .min()
    }

    fn decide(
        f: &mut FairShare,
        h: &[Holding],
        pool: usize,
        now: u64,
        wait: u64,
        ask: u64,
    ) -> Option<Ask> {
        load(f, h);
        f.decide(pool, now, wait, ask, |s| oldest(h, s))
    }

    fn must_yield(f: &mut FairShare, s: u64, t: &str, h: &[Holding], pool: usize) -> bool {
        load(f, h);
        f.must_yield(s, t, pool)
    }

    fn storing_tenants(f: &mut FairShare, h: &[Holding], also: Option<&str>) -> usize {
        load(f, h);
        f.storing_tenants(also)
    }

    fn share(f: &mut FairShare, h: &[Holding], pool: usize) -> usize {
        load(f, h);
        f.share(pool)
    }

    fn session_share(f: &mut FairShare, t: &str, h: &[Holding]) -> usize {
        load(f, h);
        f.session_share(t)
    }

    /// Session `session` of its own tenant (`t<session>`).
    fn holding(session: u64, regions: &[(u64, u64)]) -> Holding {
        of("", session, regions)
    }

    /// Session `session` of tenant `tenant` (`t<session>` when empty).
    fn of(tenant: &str, session: u64, regions: &[(u64, u64)]) -> Holding {
        Holding {
            session,
            tenant: if tenant.is_empty() {
                format!("t{session}")
            } else {
                tenant.into()
            },
            regions: regions.iter().map(|&(r, t)| (r, t, true)).collect(),
        }
    }

    /// A fair share where `session` (of tenant `t<session>`) waits since 0.
    fn waiting(session: u64) -> FairShare {
        let mut f = FairShare::default();
        want(&mut f, session, 0);
        f
    }

    /// Session `session` of tenant `t<session>` holding `regions`, each (region, last
    /// read, may be given back): false where it holds pinned keys.
    fn with_pins(session: u64, regions: &[(u64, u64, bool)]) -> Holding {
        Holding {
            session,
            tenant: format!("t{session}"),
            regions: regions.to_vec(),
        }
    }

    fn want(f: &mut FairShare, session: u64, now: u64) {
        f.want(session, &format!("t{session}"), now);
    }

    #[test]
    fn the_session_furthest_above_its_share_gives_its_least_read_region() {
        let mut f = FairShare::default();
        want(&mut f, 3, 100);
        // 6 regions, 3 storing sessions: a share of 2. Session 1 holds 4.
        let h = [
            holding(1, &[(10, 50), (11, 20), (12, 90), (13, 70)]),
            holding(2, &[(20, 5), (21, 6)]),
            holding(3, &[]),
        ];
        let ask = decide(&mut f, &h, 6, 100, 10_000, 5_000).unwrap();
        assert_eq!((ask.session, ask.region_id), (1, 11));
        assert_eq!(f.asked_of(1), Some(11));
        assert_eq!(f.asked_of(2), None, "session 2 is within its share");
        // One outstanding ask at a time.
        assert_eq!(decide(&mut f, &h, 6, 200, 10_000, 5_000), None);
        f.region_gone(11, Some(1));
        assert_eq!((f.asked_of(1), f.returned), (None, 1));
    }

    #[test]
    fn nobody_is_asked_when_every_session_is_within_its_share() {
        let mut f = waiting(5);
        // 4 regions, 5 storing sessions: the floor of one region each.
        let h: Vec<Holding> = (1..=4).map(|s| holding(s, &[(s * 10, 0)])).collect();
        assert_eq!(decide(&mut f, &h, 4, 0, 10_000, 5_000), None);
        // Nobody waits: nobody is asked, whatever the imbalance.
        let mut g = FairShare::default();
        let h = [holding(1, &[(1, 0), (2, 0), (3, 0)]), holding(2, &[(4, 0)])];
        assert_eq!(decide(&mut g, &h, 4, 0, 10_000, 5_000), None);
    }

    #[test]
    fn regions_with_pinned_keys_are_never_asked_for() {
        let mut f = waiting(2);
        let h = [
            with_pins(1, &[(10, 0, false), (11, 5, true), (12, 1, false)]),
            holding(2, &[]),
        ];
        let ask = decide(&mut f, &h, 3, 0, 10_000, 5_000).unwrap();
        assert_eq!(ask.region_id, 11, "10 and 12 hold pinned keys");
        let mut g = waiting(2);
        let pinned = [
            with_pins(1, &[(10, 0, false), (11, 0, false)]),
            holding(2, &[]),
        ];
        assert_eq!(decide(&mut g, &pinned, 2, 0, 10_000, 5_000), None);
    }

    #[test]
    fn an_unanswered_ask_is_made_again_and_stale_waiters_are_forgotten() {
        let mut f = waiting(3);
        let h = [
            holding(1, &[(10, 0), (11, 1), (12, 2)]),
            holding(2, &[(20, 0), (21, 0), (22, 0)]),
            holding(3, &[]),
        ];
        let first = decide(&mut f, &h, 6, 0, 10_000, 5_000).unwrap();
        assert_eq!(first.session, 1, "a tie goes to the lower session id");
        assert!(decide(&mut f, &h, 6, 4_999, 10_000, 5_000).is_none());
        let again = decide(&mut f, &h, 6, 5_000, 10_000, 5_000).unwrap();
        assert_eq!(again.at_ms, 5_000);
        // The waiter stopped asking: nobody waits, nothing is asked any more.
        f.forget_stale(10_000, 10_000);
        assert_eq!((f.waiting(), f.asked_of(1)), (0, None));
        assert!(decide(&mut f, &h, 6, 10_000, 10_000, 5_000).is_none());
        f.region_gone(again.region_id, None);
        assert_eq!(f.returned, 0, "not returned by the session asked");
    }

    #[test]
    fn regions_that_do_not_divide_evenly_are_not_handed_back_and_forth() {
        let mut f = waiting(2);
        // 3 regions, 2 storing sessions: a share of 2 (rounded up).
        let h = [holding(1, &[(10, 0), (11, 0)]), holding(2, &[(20, 0)])];
        assert_eq!(decide(&mut f, &h, 3, 0, 10_000, 5_000), None);
    }

    #[test]
    fn a_session_at_its_share_yields_to_a_waiter() {
        let mut f = FairShare::default();
        let h = [holding(1, &[(10, 0), (11, 0)]), holding(2, &[(20, 0)])];
        assert!(!must_yield(&mut f, 1, "t1", &h, 4), "nobody waits");
        want(&mut f, 2, 0);
        // 4 regions, 2 storing tenants: a share of 2, which tenant t1 holds.
        assert!(must_yield(&mut f, 1, "t1", &h, 4));
        let below = [holding(1, &[(10, 0)]), holding(2, &[(20, 0)])];
        assert!(
            !must_yield(&mut f, 1, "t1", &below, 4),
            "below its share it may grow"
        );
        assert!(
            !must_yield(&mut f, 2, "t2", &h, 4),
            "the waiter itself never yields to itself"
        );
    }

    #[test]
    fn shares_count_tenants_not_sessions() {
        let mut f = FairShare::default();
        // 14 sessions of one tenant, a region each; the victim's one session holds 2
        // and waits for more. 16 regions, 2 storing tenants: a share of 8 each.
        let mut h: Vec<Holding> = (1..=14).map(|s| of("sybil", s, &[(100 + s, s)])).collect();
        h.push(of("victim", 20, &[(1, 0), (2, 0)]));
        assert_eq!(storing_tenants(&mut f, &h, None), 2);
        f.want(20, "victim", 0);
        assert_eq!(share(&mut f, &h, 16), 8);
        let ask = decide(&mut f, &h, 16, 0, 10_000, 5_000).expect("the sybil tenant is asked");
        assert_eq!(
            (ask.session, ask.region_id),
            (1, 101),
            "its region read longest ago"
        );
        assert!(
            must_yield(&mut f, 1, "sybil", &h, 16),
            "it holds more than its share"
        );
        assert!(!must_yield(&mut f, 20, "victim", &h, 16));
        // Counted per session (the old rule) each sybil session held one region, under
        // a share of ceil(16/15) = 2, and nobody was asked.
        assert_eq!(storing_tenants(&mut f, &h, Some("newcomer")), 3);
    }

    #[test]
    fn sessions_of_one_tenant_share_its_regions_when_no_tenant_is_above_its_share() {
        let mut f = FairShare::default();
        // One tenant, three engines: A holds 3 regions, B 1, C none and waits.
        let h = [
            of("t", 1, &[(10, 5), (11, 1), (12, 9)]),
            of("t", 2, &[(20, 0)]),
            of("t", 3, &[]),
        ];
        f.want(3, "t", 0);
        // 4 regions, 3 storing sessions of t: a session share of 2; A is above it.
        assert_eq!(session_share(&mut f, "t", &h), 2);
        let ask = decide(&mut f, &h, 4, 0, 10_000, 5_000).expect("A is asked");
        assert_eq!((ask.session, ask.region_id), (1, 11));
        assert!(
            must_yield(&mut f, 1, "t", &h, 4),
            "A holds more than its share"
        );
        assert!(!must_yield(&mut f, 2, "t", &h, 4), "B is below it");
        // Another tenant above its share goes first.
        let mut g = FairShare::default();
        let h2 = [
            of("t", 1, &[(10, 5), (11, 1), (12, 9)]),
            of("t", 3, &[]),
            of("u", 4, &[(40, 7), (41, 8), (42, 3), (43, 2), (44, 6)]),
        ];
        g.want(3, "t", 0);
        let ask = decide(&mut g, &h2, 8, 0, 10_000, 5_000).unwrap();
        assert_eq!(
            ask.session, 4,
            "tenant u holds 5 of 8 regions, its share is 4"
        );
    }

    /// Rule: a waiter holding its share waits no longer. Seen failing without
    /// `forget_satisfied` (nobody asked: A, alone on the pool it filled and refused a
    /// region then, counted as a waiting tenant until it stopped asking).
    #[test]
    fn an_engine_refused_on_the_pool_it_filled_alone_is_asked_when_a_newcomer_waits() {
        let mut f = FairShare::default();
        let alone = [holding(1, &[(10, 5), (11, 1), (12, 9), (13, 7)])];
        want(&mut f, 1, 0);
        assert_eq!(decide(&mut f, &alone, 4, 0, 10_000, 5_000), None);
        assert_eq!(
            f.waiting(),
            0,
            "A holds all of its share: it waits no longer"
        );
        want(&mut f, 1, 100);
        want(&mut f, 2, 200);
        let h = [alone[0].clone(), holding(2, &[])];
        let ask = decide(&mut f, &h, 4, 200, 10_000, 5_000).expect("A is above its share of 2");
        assert_eq!((ask.session, ask.region_id), (1, 11));
        assert!(!f.is_waiting(1) && f.is_waiting(2));
        // A waiter below its share keeps waiting.
        let mut g = waiting(2);
        let h = [
            holding(1, &[(10, 0), (11, 0), (12, 0)]),
            holding(2, &[(20, 0)]),
        ];
        assert!(decide(&mut g, &h, 4, 0, 10_000, 5_000).is_some());
        assert!(g.is_waiting(2));
    }

    #[test]
    fn a_waiting_session_is_not_asked_to_give_to_itself() {
        let mut f = waiting(1);
        let h = [
            holding(1, &[(10, 0), (11, 0), (12, 0)]),
            holding(2, &[(20, 0)]),
        ];
        assert_eq!(decide(&mut f, &h, 4, 0, 10_000, 5_000), None);
        f.session_ended(1);
        assert_eq!(f.waiting(), 0);
    }
}
