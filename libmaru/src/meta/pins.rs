//! Pins: a session's claim that a key stays (the upstream PIN_KV / UNPIN_KV). A
//! pinned key is neither a victim nor removable, and the region keeper does not give
//! its region back to make room at the RM. Unlike a lease a pin does not expire: it
//! ends when its session unpins it, when the session ends, or when the key's region
//! is lost (memory node rebooted, agent refused or silent, region returned), since
//! then its bytes are gone whatever anybody asked.
//!
//! Pins are counted per (session, key): two pins of one key by one session need two
//! unpins. A tenant's sessions hold at most its pin limit of (session, key) pins
//! together (each session's distinct pinned keys, summed); a pin request that would
//! pass it is refused whole. Only a session whose tenant writes the key's namespace
//! pins (see `tenants`).

use super::keys::KeyId;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the sessions of tenant {tenant} pin {held} keys and ask to pin {asked} more; a tenant pins at \
     most {limit}: unpin keys it no longer needs (or raise max_pins in the tenants file)")]
pub struct PinLimit {
    pub tenant: String,
    pub held: usize,
    pub asked: usize,
    pub limit: usize,
}

/// The members of the set at `at` in `sets` (none when it has none), copied out so that the
/// table can change while they are visited.
fn members<K: std::hash::Hash + Eq, V: Copy>(sets: &HashMap<K, HashSet<V>>, at: &K) -> Vec<V> {
    sets.get(at)
        .map(|s| s.iter().copied().collect())
        .unwrap_or_default()
}

#[derive(Debug, Default)]
pub struct PinTable {
    /// (session, key) → how many times that session pinned it.
    counts: HashMap<(u64, KeyId), u32>,
    /// key → sessions that pin it.
    per_key: HashMap<KeyId, HashSet<u64>>,
    /// session → keys it pins.
    per_session: HashMap<u64, HashSet<KeyId>>,
    /// region → pinned keys in it (for the keeper and for a lost region).
    per_region: HashMap<u64, HashSet<KeyId>>,
    region_of: HashMap<KeyId, u64>,
}

impl PinTable {
    /// Distinct pinned keys.
    pub fn keys(&self) -> usize {
        self.per_key.len()
    }

    /// Distinct keys `session` pins.
    pub fn held_by(&self, session: u64) -> usize {
        self.per_session.get(&session).map_or(0, |s| s.len())
    }

    pub fn is_pinned(&self, key: KeyId) -> bool {
        self.per_key.contains_key(&key)
    }

    pub fn region_has_pins(&self, region_id: u64) -> bool {
        self.per_region.contains_key(&region_id)
    }

    /// How many distinct keys of `keys` `session` does not pin yet (what pinning
    /// them adds to its count).
    pub fn new_for(&self, session: u64, keys: &[KeyId]) -> usize {
        let mine = self.per_session.get(&session);
        keys.iter()
            .copied()
            .filter(|k| !mine.is_some_and(|m| m.contains(k)))
            .collect::<HashSet<KeyId>>()
            .len()
    }

    /// Pins `key` (in `region_id`) once more for `session`; the caller checked the
    /// tenant's limit.
    pub fn pin(&mut self, session: u64, key: KeyId, region_id: u64) {
        *self.counts.entry((session, key)).or_default() += 1;
        self.per_key.entry(key).or_default().insert(session);
        self.per_session.entry(session).or_default().insert(key);
        self.per_region.entry(region_id).or_default().insert(key);
        self.region_of.insert(key, region_id);
    }

    /// Drops one of `session`'s pins of `key`; false when it held none.
    pub fn unpin(&mut self, session: u64, key: KeyId) -> bool {
        let Some(n) = self.counts.get_mut(&(session, key)) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            self.drop_pin(session, key);
        }
        true
    }

    /// Every pin of `session`; returns how many distinct keys it pinned.
    pub fn end_session(&mut self, session: u64) -> usize {
        let keys = members(&self.per_session, &session);
        for &k in &keys {
            self.drop_pin(session, k);
        }
        keys.len()
    }

    /// Every pin of a key that is gone (removed or its region lost).
    pub fn end_key(&mut self, key: KeyId) {
        let sessions = members(&self.per_key, &key);
        for s in sessions {
            self.drop_pin(s, key);
        }
    }

    /// Every pin of the region's keys (the region is lost); returns how many keys.
    pub fn end_region(&mut self, region_id: u64) -> usize {
        let keys = members(&self.per_region, &region_id);
        for &k in &keys {
            self.end_key(k);
        }
        keys.len()
    }

    fn drop_pin(&mut self, session: u64, key: KeyId) {
        self.counts.remove(&(session, key));
        if let Some(m) = self.per_session.get_mut(&session) {
            m.remove(&key);
            if m.is_empty() {
                self.per_session.remove(&session);
            }
        }
        let last = match self.per_key.get_mut(&key) {
            Some(s) => {
                s.remove(&session);
                s.is_empty()
            }
            None => false,
        };
        if last {
            self.per_key.remove(&key);
            if let Some(rid) = self.region_of.remove(&key) {
                if let Some(r) = self.per_region.get_mut(&rid) {
                    r.remove(&key);
                    if r.is_empty() {
                        self.per_region.remove(&rid);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> KeyId {
        KeyId::test_id(n)
    }

    /// A table where each (session, key, region) pinned once, in this order.
    fn pinned(pins: &[(u64, u64, u64)]) -> PinTable {
        let mut t = PinTable::default();
        for &(session, k, region) in pins {
            t.pin(session, key(k), region);
        }
        t
    }

    #[test]
    fn pins_count_per_session_and_end_with_the_last_unpin() {
        let mut t = pinned(&[(1, 1, 9), (1, 1, 9), (2, 1, 9)]);
        assert!(t.is_pinned(key(1)) && t.region_has_pins(9));
        assert_eq!((t.keys(), t.held_by(1), t.held_by(2)), (1, 1, 1));
        assert!(t.unpin(1, key(1)));
        assert!(t.unpin(1, key(1)));
        assert!(!t.unpin(1, key(1)), "session 1 holds no more pins of it");
        assert!(t.is_pinned(key(1)), "session 2 still pins it");
        assert!(t.unpin(2, key(1)));
        assert!(!t.is_pinned(key(1)) && !t.region_has_pins(9));
        assert_eq!(t.keys(), 0);
    }

    #[test]
    fn pins_end_with_their_session_key_or_region() {
        let mut t = pinned(&[(1, 1, 9), (1, 2, 8), (2, 2, 8), (2, 3, 8)]);
        assert_eq!(t.end_session(1), 2);
        assert!(!t.is_pinned(key(1)) && t.is_pinned(key(2)));
        assert!(!t.region_has_pins(9));
        t.end_key(key(2));
        assert!(!t.is_pinned(key(2)) && t.region_has_pins(8));
        assert_eq!(t.end_region(8), 1);
        assert_eq!((t.keys(), t.held_by(2)), (0, 0));
        assert!(!t.region_has_pins(8));
    }

    #[test]
    fn new_pins_count_distinct_keys_the_session_does_not_pin_yet() {
        let mut t = pinned(&[(1, 1, 9)]);
        // Pinning a key again, or the same new key twice, takes one place.
        assert_eq!(t.new_for(1, &[key(1), key(2), key(2)]), 1);
        t.pin(1, key(2), 9);
        assert_eq!(t.new_for(1, &[key(1), key(3)]), 1);
        assert_eq!(t.new_for(2, &[key(1), key(2)]), 2);
    }
}
