//! Who keeps a connection slot when peers crowd a port.
//!
//! A listener holds its connections in stages. A new one starts *unsettled*: in its
//! handshake (it has proved nothing yet) and, on the soft NIC, proven but not yet
//! bound to an owner. Once settled (a client of the daemon, a bound data connection)
//! it leaves this table and counts only against the total.
//!
//! Peers that proved nothing must not take the room of those that did, nor keep a
//! real client out: each unsettled stage has a cap and a deadline, and a newcomer to
//! a full stage pushes out that stage's *oldest* member instead of being turned away.
//! A flood then only closes flood connections (each of them sooner the faster it
//! comes), while a real client, whose handshake takes a round trip or two, passes
//! through. When the total is full, a new connection pushes out the oldest unsettled
//! one (the least proven stage first); only when every slot is settled is it refused.
//!
//! Sans-I/O: the caller passes the time (`now_ms`), closes the connections it is told
//! to, and calls [`Slots::expired`] at [`Slots::next_deadline`].

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// The bounds of one unsettled stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageLimits {
    /// Connections in this stage at once (at least 1 is kept).
    pub cap: usize,
    /// How long a connection may stay in this stage, from when it entered it.
    pub deadline_ms: u64,
}

/// What becomes of a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit<K> {
    /// It is in (stage 0); `push_out`: the connection to close to make room for it.
    In { push_out: Option<K> },
    /// Every slot is held by a settled connection: close the new one.
    Refused,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    stage: usize,
    /// When it entered its stage, and a tie-breaker (arrival order).
    since: (u64, u64),
}

/// The unsettled connections of one listener, by stage and age.
#[derive(Debug)]
pub struct Slots<K> {
    total: usize,
    stages: Vec<StageLimits>,
    entries: HashMap<K, Entry>,
    /// Per stage, its members oldest first.
    order: Vec<BTreeMap<(u64, u64), K>>,
    seq: u64,
}

impl<K: Copy + Eq + Hash> Slots<K> {
    /// `total`: connections at once, settled ones included (at least 1); `stages`:
    /// the unsettled stages in the order a connection goes through them.
    pub fn new(total: usize, stages: &[StageLimits]) -> Slots<K> {
        let mut stages: Vec<StageLimits> = stages
            .iter()
            .map(|s| StageLimits {
                cap: s.cap.max(1),
                deadline_ms: s.deadline_ms,
            })
            .collect();
        if stages.is_empty() {
            // Every connection has at least the stage it starts in.
            stages.push(StageLimits {
                cap: total.max(1),
                deadline_ms: u64::MAX,
            });
        }
        Slots {
            total: total.max(1),
            order: stages.iter().map(|_| BTreeMap::new()).collect(),
            stages,
            entries: HashMap::new(),
            seq: 0,
        }
    }

    /// Unsettled connections now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Connections in `stage` now.
    pub fn count(&self, stage: usize) -> usize {
        self.order.get(stage).map_or(0, BTreeMap::len)
    }

    /// The stage `key` is in (None: not in the table).
    pub fn stage_of(&self, key: K) -> Option<usize> {
        self.entries.get(&key).map(|e| e.stage)
    }

    fn oldest(&self, stage: usize) -> Option<K> {
        self.order.get(stage)?.first_key_value().map(|(_, k)| *k)
    }

    fn insert(&mut self, key: K, stage: usize, now_ms: u64) {
        self.seq += 1;
        let since = (now_ms, self.seq);
        if let Some(old) = self.entries.insert(key, Entry { stage, since }) {
            self.order[old.stage].remove(&old.since);
        }
        self.order[stage].insert(since, key);
    }

    /// A new connection `key`, while `settled` connections are held outside this
    /// table (they count against the total only).
    pub fn admit(&mut self, key: K, settled: usize, now_ms: u64) -> Admit<K> {
        let full = self.entries.len() + settled >= self.total;
        let push_out = if full {
            // Whom to push out: the oldest of the least proven stage that has one.
            let Some(k) = (0..self.stages.len()).find_map(|s| self.oldest(s)) else {
                return Admit::Refused;
            };
            Some(k)
        } else if self.count(0) >= self.stages[0].cap {
            self.oldest(0)
        } else {
            None
        };
        if let Some(k) = push_out {
            self.remove(k);
        }
        self.insert(key, 0, now_ms);
        Admit::In { push_out }
    }

    /// `key` moves on to `stage` (its deadline starts again). Returns the member of
    /// that stage pushed out to make room for it (close it), if the stage was full.
    pub fn advance(&mut self, key: K, stage: usize, now_ms: u64) -> Option<K> {
        if stage >= self.stages.len() || !self.entries.contains_key(&key) {
            return None;
        }
        let out = (self.count(stage) >= self.stages[stage].cap)
            .then(|| self.oldest(stage))
            .flatten()
            .filter(|k| *k != key);
        if let Some(k) = out {
            self.remove(k);
        }
        self.insert(key, stage, now_ms);
        out
    }

    /// `key` settled or closed: it leaves the table. Returns whether it was there.
    pub fn remove(&mut self, key: K) -> bool {
        match self.entries.remove(&key) {
            Some(e) => {
                self.order[e.stage].remove(&e.since);
                true
            }
            None => false,
        }
    }

    /// The connections past their stage's deadline at `now_ms`, with their stage
    /// (they stay in the table until removed).
    pub fn expired(&self, now_ms: u64) -> Vec<(K, usize)> {
        let mut out = Vec::new();
        for (stage, order) in self.order.iter().enumerate() {
            let limit = self.stages[stage].deadline_ms;
            for ((since, _), k) in order {
                if since.saturating_add(limit) > now_ms {
                    break;
                }
                out.push((*k, stage));
            }
        }
        out
    }

    /// When the next connection passes its deadline.
    pub fn next_deadline(&self) -> Option<u64> {
        self.order
            .iter()
            .zip(&self.stages)
            .filter_map(|(o, s)| {
                o.first_key_value()
                    .map(|((since, _), _)| since.saturating_add(s.deadline_ms))
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const HS: usize = 0;
    const UNBOUND: usize = 1;

    fn two_stage(total: usize, cap: usize) -> Slots<u32> {
        Slots::new(
            total,
            &[
                StageLimits {
                    cap,
                    deadline_ms: 5_000,
                },
                StageLimits {
                    cap,
                    deadline_ms: 3_000,
                },
            ],
        )
    }

    #[test]
    fn a_newcomer_to_a_full_stage_pushes_out_its_oldest_member_not_itself() {
        let mut s = two_stage(100, 3);
        for k in 0..3 {
            assert_eq!(s.admit(k, 0, u64::from(k)), Admit::In { push_out: None });
        }
        assert_eq!(s.admit(3, 0, 10), Admit::In { push_out: Some(0) });
        assert_eq!(s.admit(4, 0, 10), Admit::In { push_out: Some(1) });
        assert_eq!(s.count(HS), 3);
        assert_eq!(s.stage_of(0), None);
        // The unbound stage has its own cap: a fourth proven connection pushes out the
        // oldest proven one, never the one moving in.
        for k in [2, 3, 4] {
            assert_eq!(s.advance(k, UNBOUND, 20 + u64::from(k)), None);
        }
        s.admit(5, 0, 30);
        assert_eq!(s.advance(5, UNBOUND, 31), Some(2));
        assert_eq!(s.count(UNBOUND), 3);
        assert_eq!(s.count(HS), 0);
    }

    #[test]
    fn a_full_port_pushes_out_the_least_proven_oldest_and_refuses_only_when_all_settled() {
        let mut s = two_stage(4, 4);
        s.admit(1, 0, 0);
        s.advance(1, UNBOUND, 1);
        s.admit(2, 0, 2);
        // 2 unsettled + 2 settled: full. The handshake (2) goes before the older but
        // proven connection (1).
        assert_eq!(s.admit(3, 2, 5), Admit::In { push_out: Some(2) });
        s.advance(3, UNBOUND, 6);
        assert_eq!(s.admit(4, 2, 7), Admit::In { push_out: Some(1) });
        s.remove(3);
        s.remove(4);
        assert_eq!(s.admit(9, 4, 8), Admit::Refused);
        assert!(s.is_empty());
    }

    #[test]
    fn deadlines_are_per_stage_and_restart_when_a_connection_moves_on() {
        let mut s = two_stage(100, 10);
        s.admit(1, 0, 1_000);
        s.admit(2, 0, 2_000);
        assert_eq!(s.next_deadline(), Some(6_000));
        assert!(s.expired(5_999).is_empty());
        assert_eq!(s.expired(6_000), vec![(1, HS)]);
        s.advance(1, UNBOUND, 5_500);
        assert_eq!(s.next_deadline(), Some(7_000));
        assert_eq!(s.expired(8_500), vec![(2, HS), (1, UNBOUND)]);
        s.remove(1);
        s.remove(2);
        assert_eq!(s.next_deadline(), None);
    }

    proptest! {
        /// Whatever peers do, no stage ever holds more than its cap, the table and the
        /// settled connections never exceed the total, and a new connection is refused
        /// only when every slot is settled.
        #[test]
        fn caps_hold_under_any_sequence(ops in proptest::collection::vec((0u8..4, 0u32..40), 1..400)) {
            let total = 12;
            let mut s = two_stage(total, 4);
            let mut settled: Vec<u32> = Vec::new();
            let mut now = 0u64;
            for (op, k) in ops {
                now += 7;
                match op {
                    0 if s.stage_of(k).is_none() && !settled.contains(&k) => {
                        match s.admit(k, settled.len(), now) {
                            Admit::In { .. } => prop_assert_eq!(s.stage_of(k), Some(HS)),
                            Admit::Refused => prop_assert!(settled.len() >= total),
                        }
                    }
                    1 => { s.advance(k, UNBOUND, now); }
                    2 if s.remove(k) => settled.push(k),
                    3 => { settled.retain(|x| *x != k); s.remove(k); }
                    _ => {}
                }
                prop_assert!(s.count(HS) <= 4 && s.count(UNBOUND) <= 4);
                prop_assert!(s.len() + settled.len() <= total);
                prop_assert_eq!(s.len(), s.count(HS) + s.count(UNBOUND));
            }
        }
    }
}
