//! Whose bytes the event loop reads and decodes next.
//!
//! One thread serves every connection, so the time it spends on one is time every
//! other waits. Connections with work (bytes in the socket, whole frames buffered)
//! wait here, grouped in *classes*: a daemon's tenants (the key a connection proved),
//! and the connections still in their handshake as one class of their own. The loop
//! serves them in rounds, deficit round robin over the classes: each round a class
//! may use [`FairQueue::new`]'s `quantum` bytes, taken by its connections in turn, each
//! turn at most `turn` bytes. A turn may overrun its budget by one frame (a frame is
//! decoded whole); the overrun is owed, and the class waits out the rounds that pay
//! it back. So however many connections a tenant opens and however much they pipeline,
//! another tenant's request waits for at most about one quantum and one frame of
//! that tenant's work per round, and one connection never holds the loop for longer
//! than a turn.
//!
//! Sans-I/O: the loop says which connections have work ([`FairQueue::ready`]), asks
//! whose turn it is ([`FairQueue::next_turn`]), does the work and reports what it cost
//! ([`FairQueue::end_turn`]). `None` from `next_turn` ends a round: the loop polls for
//! new events (without sleeping while work is left) before the next one.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Bytes one class may read and decode per round, by default.
pub const DEFAULT_QUANTUM: u64 = 256 << 10;
/// Bytes one connection may read and decode per turn, by default.
pub const DEFAULT_TURN: u64 = 64 << 10;

#[derive(Debug)]
struct Class<K> {
    /// Its members with work, next turn first.
    ready: VecDeque<K>,
    /// Bytes it may still use; negative: what it overran and owes.
    deficit: i64,
}

/// Connections `K` with work, in classes `C`, served in rounds (see the module doc).
#[derive(Debug)]
pub struct FairQueue<C, K> {
    quantum: i64,
    turn: u64,
    classes: HashMap<C, Class<K>>,
    /// The class of each connection with work.
    member_of: HashMap<K, C>,
    /// Classes with work not being served now, in the order of their next visit.
    order: VecDeque<C>,
    /// The class being visited, and the member whose turn it is (if a turn is on).
    current: Option<(C, Option<K>)>,
    /// A round is under way, with this many classes still to visit.
    round: Option<usize>,
}

impl<C: Copy + Eq + Hash, K: Copy + Eq + Hash> FairQueue<C, K> {
    /// `quantum`: bytes per class and round; `turn`: bytes per connection and turn
    /// (both at least 1).
    pub fn new(quantum: u64, turn: u64) -> FairQueue<C, K> {
        FairQueue {
            quantum: quantum.clamp(1, i64::MAX as u64) as i64,
            turn: turn.max(1),
            classes: HashMap::new(),
            member_of: HashMap::new(),
            order: VecDeque::new(),
            current: None,
            round: None,
        }
    }

    /// No connection has work.
    pub fn is_empty(&self) -> bool {
        self.member_of.is_empty()
    }

    /// Connections with work.
    pub fn len(&self) -> usize {
        self.member_of.len()
    }

    /// Whether `key` waits for a turn (or has one now).
    pub fn contains(&self, key: K) -> bool {
        self.member_of.contains_key(&key)
    }

    /// `key`, of `class`, has work: it gets a turn after the members of its class
    /// already waiting. Nothing changes when it waits already (in whatever class).
    pub fn ready(&mut self, class: C, key: K) {
        if self.member_of.contains_key(&key) {
            return;
        }
        self.member_of.insert(key, class);
        let is_current = self.current.is_some_and(|(c, _)| c == class);
        let c = self.classes.entry(class).or_insert_with(|| Class {
            ready: VecDeque::new(),
            deficit: 0,
        });
        c.ready.push_back(key);
        if c.ready.len() == 1 && !is_current {
            self.order.push_back(class);
        }
    }

    /// `key` has no work any more, or is gone. A turn it has now still ends with
    /// [`end_turn`](Self::end_turn), which charges its class.
    pub fn remove(&mut self, key: K) {
        let Some(class) = self.member_of.remove(&key) else {
            return;
        };
        if let Some(c) = self.classes.get_mut(&class) {
            c.ready.retain(|k| *k != key);
        }
        if self.current.is_none_or(|(c, _)| c != class) {
            self.forget_if_idle(class);
        }
    }

    /// A class without work leaves the order; what it owes stays owed.
    fn forget_if_idle(&mut self, class: C) {
        if let Some(c) = self.classes.get(&class) {
            if c.ready.is_empty() {
                if c.deficit >= 0 {
                    self.classes.remove(&class);
                }
                self.order.retain(|x| *x != class);
            }
        }
    }

    /// The connection whose turn it is, with the bytes it may use; `None`: this round
    /// is over (poll for events, then ask again for the next round).
    pub fn next_turn(&mut self) -> Option<(K, u64)> {
        loop {
            if let Some((class, _)) = self.current {
                if let Some(c) = self.classes.get(&class) {
                    if let (Some(&key), true) = (c.ready.front(), c.deficit > 0) {
                        self.current = Some((class, Some(key)));
                        return Some((key, self.turn.min(c.deficit as u64)));
                    }
                }
                self.leave_current();
                continue;
            }
            // A round visits the classes that had work when it began, once each.
            let left = *self.round.get_or_insert(self.order.len());
            if left == 0 {
                self.round = None;
                return None;
            }
            self.round = Some(left - 1);
            let Some(class) = self.order.pop_front() else {
                continue;
            };
            let Some(c) = self.classes.get_mut(&class) else {
                continue;
            };
            // A class paying back an overrun gets its quantum all the same.
            c.deficit = c.deficit.saturating_add(self.quantum);
            self.current = Some((class, None));
        }
    }

    /// The class visited now is done for this round: back in the order when it has
    /// work left, its unused credit dropped (a class cannot save up for a burst).
    fn leave_current(&mut self) {
        let Some((class, _)) = self.current.take() else {
            return;
        };
        let Some(c) = self.classes.get_mut(&class) else {
            return;
        };
        if c.ready.is_empty() {
            c.deficit = c.deficit.min(0);
            if c.deficit == 0 {
                self.classes.remove(&class);
            }
        } else {
            c.deficit = c.deficit.min(0);
            self.order.push_back(class);
        }
    }

    /// The turn [`next_turn`](Self::next_turn) gave ended having used `spent` bytes;
    /// `more`: the connection still has work (it goes behind its class's other
    /// members). A connection removed during its turn stays out.
    pub fn end_turn(&mut self, spent: u64, more: bool) {
        let Some((class, Some(key))) = self.current else {
            return;
        };
        self.current = Some((class, None));
        let Some(c) = self.classes.get_mut(&class) else {
            return;
        };
        c.deficit = c.deficit.saturating_sub(spent.min(i64::MAX as u64) as i64);
        if c.ready.front() == Some(&key) {
            c.ready.pop_front();
            if more {
                c.ready.push_back(key);
            } else {
                self.member_of.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs `rounds` rounds where every connection of `conns` (class, key) always has
    /// work and each turn costs `cost(key, budget)`; returns bytes served per class.
    fn run(
        q: &mut FairQueue<u8, u32>,
        rounds: usize,
        cost: impl Fn(u32, u64) -> u64,
    ) -> HashMap<u8, u64> {
        let mut served: HashMap<u8, u64> = HashMap::new();
        for _ in 0..rounds {
            while let Some((key, budget)) = q.next_turn() {
                let class = q.member_of[&key];
                let spent = cost(key, budget);
                *served.entry(class).or_default() += spent;
                q.end_turn(spent, true);
            }
        }
        served
    }

    #[test]
    fn a_class_of_many_connections_gets_no_more_than_a_class_of_one() {
        let mut q = FairQueue::new(1000, 100);
        for k in 0..50 {
            q.ready(0, k);
        }
        q.ready(1, 1000);
        let served = run(&mut q, 100, |_, budget| budget);
        assert_eq!(served[&0], served[&1], "{served:?}");
        assert_eq!(served[&1], 100 * 1000);
    }

    #[test]
    fn connections_of_a_class_take_turns_each_within_the_turn_budget() {
        let mut q = FairQueue::new(300, 100);
        for k in 0..3u32 {
            q.ready(7, k);
        }
        let mut order = Vec::new();
        for _ in 0..2 {
            while let Some((key, budget)) = q.next_turn() {
                assert!(budget <= 100);
                order.push(key);
                q.end_turn(budget, true);
            }
        }
        assert_eq!(order, vec![0, 1, 2, 0, 1, 2], "one turn each per round");
    }

    #[test]
    fn an_overrun_is_paid_back_in_the_next_rounds() {
        let mut q = FairQueue::new(100, 100);
        q.ready(0u8, 1u32);
        q.ready(1, 2);
        // Connection 1 decodes a frame of 450 bytes in its first turn: its class
        // owes 350 and sits out the next rounds while class 1 is served.
        let mut served: Vec<Vec<u32>> = Vec::new();
        let mut first = true;
        for _ in 0..6 {
            let mut this = Vec::new();
            while let Some((key, budget)) = q.next_turn() {
                let spent = if key == 1 && first {
                    first = false;
                    450
                } else {
                    budget
                };
                this.push(key);
                q.end_turn(spent, true);
            }
            served.push(this);
        }
        // It owes 350 after its first round: three rounds of 100 pay 300, the fourth
        // leaves it 50 to use.
        let rounds_of_1: Vec<usize> = (0..6).filter(|r| served[*r].contains(&1)).collect();
        assert_eq!(rounds_of_1, vec![0, 4, 5], "{served:?}");
        assert!(served.iter().all(|r| r.contains(&2)), "{served:?}");
    }

    #[test]
    fn a_class_with_nothing_to_do_leaves_and_saves_no_credit() {
        let mut q = FairQueue::new(1000, 1000);
        q.ready(0u8, 1u32);
        let (k, b) = q.next_turn().unwrap();
        assert_eq!((k, b), (1, 1000));
        q.end_turn(10, false);
        assert_eq!(q.next_turn(), None);
        assert!(q.is_empty());
        assert!(q.classes.is_empty(), "no credit kept: {:?}", q.classes);
        // Back with work: one quantum, not the 990 it did not use on top.
        q.ready(0, 1);
        assert_eq!(q.next_turn(), Some((1, 1000)));
    }

    #[test]
    fn a_connection_removed_during_its_turn_is_charged_and_stays_out() {
        let mut q = FairQueue::new(100, 100);
        q.ready(0u8, 1u32);
        q.ready(0, 2);
        let (k, _) = q.next_turn().unwrap();
        assert_eq!(k, 1);
        q.remove(1);
        q.end_turn(100, true);
        assert!(!q.contains(1));
        // The class used its quantum: connection 2 waits for the next round.
        assert_eq!(q.next_turn(), None);
        assert_eq!(q.next_turn(), Some((2, 100)));
    }

    proptest! {
        /// Whatever the classes, members and costs, no turn is offered more than the
        /// turn budget, every connection with work gets a turn within a bounded number
        /// of rounds, and two classes that always have work are served within one
        /// quantum and one largest overrun of each other.
        #[test]
        fn classes_share_rounds_whatever_the_costs(
            members in proptest::collection::vec(1usize..20, 2..5),
            overruns in proptest::collection::vec(0u64..2_000, 1..64),
        ) {
            let (quantum, turn) = (1_000u64, 300u64);
            let mut q: FairQueue<u8, u32> = FairQueue::new(quantum, turn);
            let mut key = 0u32;
            for (class, n) in members.iter().enumerate() {
                for _ in 0..*n {
                    q.ready(class as u8, key);
                    key += 1;
                }
            }
            let mut served: HashMap<u8, u64> = HashMap::new();
            let mut last_turn: HashMap<u32, usize> = HashMap::new();
            let mut i = 0usize;
            let max_overrun = *overruns.iter().max().unwrap();
            for round in 0..200usize {
                while let Some((k, budget)) = q.next_turn() {
                    prop_assert!(budget > 0 && budget <= turn);
                    let class = q.member_of[&k];
                    let spent = budget + overruns[i % overruns.len()];
                    i += 1;
                    *served.entry(class).or_default() += spent;
                    last_turn.insert(k, round);
                    q.end_turn(spent, true);
                }
            }
            let most = *served.values().max().unwrap();
            let least = *served.values().min().unwrap();
            prop_assert!(most - least <= 2 * (quantum + turn + max_overrun),
                "served {:?}", served);
            for k in 0..key {
                prop_assert!(last_turn.get(&k).is_some_and(|r| *r >= 150),
                    "connection {} last served in round {:?}", k, last_turn.get(&k));
            }
        }
    }
}
