//! A fair share of a full pool: a storing session that cannot get a region, while
//! the keeper has nothing to give back, makes maru-server ask the session furthest
//! above its share to give one region back.
//!
//! The share is the pool's regions (every region maru-server holds) divided by the
//! storing sessions (those holding a region, and those waiting for one), rounded up,
//! at least one. A session at its share does not take a new region while another
//! waits (it evicts its own keys instead), so a region given back goes to the waiter. The session with the most regions above its share is asked, at its
//! next heartbeat, for its region read longest ago that holds no pinned key; it
//! evicts it, releases it at its agent and returns it, as every return. One request
//! is outstanding at a time; an unanswered one is asked again of whoever is then
//! furthest above its share once `ask_timeout_ms` passed.

use std::collections::BTreeMap;

/// What the fair-share rule remembers between requests.
#[derive(Debug, Default)]
pub struct FairShare {
    /// Sessions refused a region for want of room, and when they last asked.
    wanting: BTreeMap<u64, u64>,
    /// The give-back asked and not yet answered.
    asked: Option<Ask>,
    /// Regions returned because they were asked for, since the server started.
    pub returned: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub session: u64,
    pub region_id: u64,
    pub at_ms: u64,
}

/// One session's regions, each with when it was last read and whether it may be
/// given back (it holds no pinned key).
#[derive(Debug, Clone)]
pub struct Holding {
    pub session: u64,
    pub regions: Vec<(u64, u64, bool)>,
}

impl FairShare {
    /// `session` was refused a region for want of room at `now_ms`.
    pub fn want(&mut self, session: u64, now_ms: u64) {
        self.wanting.insert(session, now_ms);
    }

    /// `session` got a region, or ended: it waits no longer, and a give-back asked
    /// of it is void when it ended.
    pub fn done_waiting(&mut self, session: u64) {
        self.wanting.remove(&session);
    }

    pub fn session_ended(&mut self, session: u64) {
        self.wanting.remove(&session);
        if self.asked.is_some_and(|a| a.session == session) || self.wanting.is_empty() {
            self.asked = None;
        }
    }

    /// Forgets waiters that stopped asking `wait_ms` ago; with nobody waiting, a
    /// give-back asked is no longer needed.
    pub fn forget_stale(&mut self, now_ms: u64, wait_ms: u64) {
        self.wanting
            .retain(|_, since| now_ms.saturating_sub(*since) < wait_ms);
        if self.wanting.is_empty() {
            self.asked = None;
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

    /// The region this session is asked to give back, if any.
    pub fn asked_of(&self, session: u64) -> Option<u64> {
        self.asked
            .filter(|a| a.session == session)
            .map(|a| a.region_id)
    }

    pub fn waiting(&self) -> usize {
        self.wanting.len()
    }

    /// Whether `session`, holding `held` regions, must let waiting sessions go first:
    /// another session waits for a region and this one holds its share already. A
    /// region given back for a waiter is then not taken again by whoever asks first
    /// (the session that gave it back, typically), which would only move keys around.
    pub fn must_yield(
        &self,
        session: u64,
        held: usize,
        holdings: &[Holding],
        pool_regions: usize,
    ) -> bool {
        if !self.wanting.keys().any(|&s| s != session) {
            return false;
        }
        held >= self.share(holdings, pool_regions)
    }

    /// Pool regions ÷ storing sessions (those holding a region, and those waiting),
    /// rounded up, at least one. Rounded up, so that with regions that do not divide
    /// evenly a session one region above another is not asked: giving it back would
    /// only make the other one the larger, and the two would hand regions (and their
    /// keys) back and forth.
    pub fn share(&self, holdings: &[Holding], pool_regions: usize) -> usize {
        let storing = holdings
            .iter()
            .filter(|h| !h.regions.is_empty() && !self.wanting.contains_key(&h.session))
            .count()
            + self.wanting.len();
        pool_regions.div_ceil(storing.max(1)).max(1)
    }

    /// Decides whether to ask a session for a region: forgets waiters that stopped
    /// asking `wait_ms` ago, keeps an outstanding ask younger than `ask_timeout_ms`,
    /// else picks the session furthest above its share. `pool_regions` counts every
    /// region maru-server holds.
    pub fn decide(
        &mut self,
        holdings: &[Holding],
        pool_regions: usize,
        now_ms: u64,
        wait_ms: u64,
        ask_timeout_ms: u64,
    ) -> Option<Ask> {
        self.forget_stale(now_ms, wait_ms);
        if let Some(a) = self.asked {
            if now_ms.saturating_sub(a.at_ms) < ask_timeout_ms {
                return None;
            }
            self.asked = None;
        }
        if self.wanting.is_empty() {
            return None;
        }
        let share = self.share(holdings, pool_regions);
        let ask = holdings
            .iter()
            .filter(|h| !self.wanting.contains_key(&h.session) && h.regions.len() > share)
            .filter_map(|h| {
                let (last_read, rid, _) = h
                    .regions
                    .iter()
                    .filter(|(_, _, may)| *may)
                    .map(|&(rid, read, may)| (read, rid, may))
                    .min()?;
                // Most above its share first; then the region read longest ago.
                Some((
                    std::cmp::Reverse(h.regions.len()),
                    last_read,
                    h.session,
                    rid,
                ))
            })
            .min()
            .map(|(_, _, session, region_id)| Ask {
                session,
                region_id,
                at_ms: now_ms,
            });
        self.asked = ask;
        ask
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(session: u64, regions: &[(u64, u64)]) -> Holding {
        Holding {
            session,
            regions: regions.iter().map(|&(r, t)| (r, t, true)).collect(),
        }
    }

    #[test]
    fn the_session_furthest_above_its_share_gives_its_least_read_region() {
        let mut f = FairShare::default();
        f.want(3, 100);
        // 6 regions, 3 storing sessions: a share of 2. Session 1 holds 4.
        let h = [
            holding(1, &[(10, 50), (11, 20), (12, 90), (13, 70)]),
            holding(2, &[(20, 5), (21, 6)]),
            holding(3, &[]),
        ];
        let ask = f.decide(&h, 6, 100, 10_000, 5_000).unwrap();
        assert_eq!((ask.session, ask.region_id), (1, 11));
        assert_eq!(f.asked_of(1), Some(11));
        assert_eq!(f.asked_of(2), None, "session 2 is within its share");
        // One outstanding ask at a time.
        assert_eq!(f.decide(&h, 6, 200, 10_000, 5_000), None);
        f.region_gone(11, Some(1));
        assert_eq!((f.asked_of(1), f.returned), (None, 1));
    }

    #[test]
    fn nobody_is_asked_when_every_session_is_within_its_share() {
        let mut f = FairShare::default();
        f.want(5, 0);
        // 4 regions, 5 storing sessions: the floor of one region each.
        let h: Vec<Holding> = (1..=4).map(|s| holding(s, &[(s * 10, 0)])).collect();
        assert_eq!(f.decide(&h, 4, 0, 10_000, 5_000), None);
        // Nobody waits: nobody is asked, whatever the imbalance.
        let mut g = FairShare::default();
        let h = [holding(1, &[(1, 0), (2, 0), (3, 0)]), holding(2, &[(4, 0)])];
        assert_eq!(g.decide(&h, 4, 0, 10_000, 5_000), None);
    }

    #[test]
    fn regions_with_pinned_keys_are_never_asked_for() {
        let mut f = FairShare::default();
        f.want(2, 0);
        let h = [
            Holding {
                session: 1,
                regions: vec![(10, 0, false), (11, 5, true), (12, 1, false)],
            },
            holding(2, &[]),
        ];
        let ask = f.decide(&h, 3, 0, 10_000, 5_000).unwrap();
        assert_eq!(ask.region_id, 11, "10 and 12 hold pinned keys");
        let mut g = FairShare::default();
        g.want(2, 0);
        let pinned = [
            Holding {
                session: 1,
                regions: vec![(10, 0, false), (11, 0, false)],
            },
            holding(2, &[]),
        ];
        assert_eq!(g.decide(&pinned, 2, 0, 10_000, 5_000), None);
    }

    #[test]
    fn an_unanswered_ask_is_made_again_and_stale_waiters_are_forgotten() {
        let mut f = FairShare::default();
        f.want(3, 0);
        let h = [
            holding(1, &[(10, 0), (11, 1), (12, 2)]),
            holding(2, &[(20, 0), (21, 0), (22, 0)]),
            holding(3, &[]),
        ];
        let first = f.decide(&h, 6, 0, 10_000, 5_000).unwrap();
        assert_eq!(first.session, 1, "a tie goes to the lower session id");
        assert!(f.decide(&h, 6, 4_999, 10_000, 5_000).is_none());
        let again = f.decide(&h, 6, 5_000, 10_000, 5_000).unwrap();
        assert_eq!(again.at_ms, 5_000);
        // The waiter stopped asking: nobody waits, nothing is asked any more.
        f.forget_stale(10_000, 10_000);
        assert_eq!((f.waiting(), f.asked_of(1)), (0, None));
        assert!(f.decide(&h, 6, 10_000, 10_000, 5_000).is_none());
        f.region_gone(again.region_id, None);
        assert_eq!(f.returned, 0, "not returned by the session asked");
    }

    #[test]
    fn regions_that_do_not_divide_evenly_are_not_handed_back_and_forth() {
        let mut f = FairShare::default();
        f.want(2, 0);
        // 3 regions, 2 storing sessions: a share of 2 (rounded up).
        let h = [holding(1, &[(10, 0), (11, 0)]), holding(2, &[(20, 0)])];
        assert_eq!(f.decide(&h, 3, 0, 10_000, 5_000), None);
    }

    #[test]
    fn a_session_at_its_share_yields_to_a_waiter() {
        let mut f = FairShare::default();
        let h = [holding(1, &[(10, 0), (11, 0)]), holding(2, &[(20, 0)])];
        assert!(!f.must_yield(1, 2, &h, 4), "nobody waits");
        f.want(2, 0);
        // 4 regions, 2 storing sessions: a share of 2, which session 1 holds.
        assert!(f.must_yield(1, 2, &h, 4));
        assert!(!f.must_yield(1, 1, &h, 4), "below its share it may grow");
        assert!(
            !f.must_yield(2, 1, &h, 4),
            "the waiter itself never yields to itself"
        );
    }

    #[test]
    fn a_waiting_session_is_not_asked_to_give_to_itself() {
        let mut f = FairShare::default();
        f.want(1, 0);
        let h = [
            holding(1, &[(10, 0), (11, 0), (12, 0)]),
            holding(2, &[(20, 0)]),
        ];
        assert_eq!(f.decide(&h, 4, 0, 10_000, 5_000), None);
        f.session_ended(1);
        assert_eq!(f.waiting(), 0);
    }
}
