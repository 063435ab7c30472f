//! Ranks of stored keys in the eviction order (the lowest goes first), kept by the
//! key directory in each region's ordered sets.
//!
//! Under recency (`--victim-order prefix` and `lru`) a key's rank is its use stamp:
//! least recently used first. Under reuse (`--victim-order reuse`, the default) two
//! rules of a prefix cache's traffic are added, and `reuse-ends` adds a third; each
//! measured on Mooncake's conversation trace (docs/benchmarks.md):
//!
//! - **a read is worth half a cache of recency**: a key read `n` times since it was
//!   stored ranks as if used `n × (stored keys / 2)` stamps later. A block read once
//!   is read again more often than a block never read (on that trace 42 % against
//!   24 %), so recency alone keeps too many blocks a prompt brought in once.
//! - **reads outlive an eviction** (a ghost list): the read count of a removed key
//!   is remembered, up to as many names as there are stored keys, and a key stored
//!   again starts from it plus one (it was asked for again).
//! - **the end of a prompt goes first** (`reuse-ends` only): a key stored as the
//!   last of its chain
//!   (no stored key names it as its previous one) and never read since ranks below
//!   every other key until a read or a successor's publish. The last chunk of a
//!   prompt is mostly a partial one; the next turn of the conversation extends it,
//!   so its key is not asked for again (0.8 % of them on that trace). A connector
//!   that stores whole chunks only (Maru's vLLM connector) stores no partial chunk,
//!   and there the end of a prompt is the chunk the next turn reads first: the rule
//!   costs hits, so it is not the default.

use super::fast_hash::{FastMap, Hasher};
use std::collections::VecDeque;
use std::hash::BuildHasher;

/// Ranks of keys not at the end of a fresh prompt start here, so that every fresh
/// end (ranked by its stamp alone) goes before them; stamps stay far below it.
pub const FRESH_END_SPAN: u64 = 1 << 48;

/// A ghost list never holds more names than this, whatever the directory's size.
pub const GHOST_MAX: usize = 1 << 20;

/// How the directory ranks keys for eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ranking {
    /// By last use.
    #[default]
    Recency,
    /// By last use and reads (remembered past eviction).
    Reuse,
    /// As `Reuse`, and fresh prompt ends first.
    ReuseEnds,
}

impl Ranking {
    /// The rank of a key last used at `used`, read `reads` times, at the end of a
    /// fresh prompt or not, in a directory of `stored` keys.
    pub fn rank(self, used: u64, reads: u32, fresh_end: bool, stored: usize) -> u64 {
        match self {
            Ranking::Recency => used,
            Ranking::ReuseEnds if fresh_end => used,
            Ranking::Reuse | Ranking::ReuseEnds => {
                let credit = (stored as u64 / 2).saturating_mul(u64::from(reads));
                FRESH_END_SPAN.saturating_add(used).saturating_add(credit)
            }
        }
    }
}

/// Read counts of removed keys, oldest removal forgotten first. Names are scoped by
/// the key directory's scope number (`KeyDirectory::scope_number`) and kept as a
/// 64-bit hash of (scope, name) under a secret seed, not copied: a removal and a
/// publish hash the name once and allocate nothing. Two names of one hash (with a
/// million names remembered, about one chance in 10^7 that any two share one) would
/// share a read count: an eviction rank, never what a key holds or who reads it.
#[derive(Debug, Default)]
pub struct Ghosts {
    hasher: Hasher,
    /// Hash of (scope, name) → (reads, sequence number of its removal).
    reads: FastMap<u64, (u32, u64)>,
    /// Removals in order, (sequence number, hash); an entry whose sequence number no
    /// longer matches the map was recalled or removed again since.
    order: VecDeque<(u64, u64)>,
    seq: u64,
}

impl Ghosts {
    fn hash(&self, scope: u32, name: &str) -> u64 {
        self.hasher.hash_one((scope, name))
    }

    /// Remembers that a key read `reads` times was removed; keeps at most `bound`
    /// names (at least one, at most [`GHOST_MAX`]).
    pub fn forget(&mut self, scope: u32, name: &str, reads: u32, bound: usize) {
        self.seq += 1;
        let h = self.hash(scope, name);
        self.reads.insert(h, (reads, self.seq));
        self.order.push_back((self.seq, h));
        let bound = bound.clamp(1, GHOST_MAX);
        while self.reads.len() > bound || self.order.len() > 2 * bound {
            let Some((seq, h)) = self.order.pop_front() else {
                break;
            };
            if self.reads.get(&h).is_some_and(|&(_, s)| s == seq) {
                self.reads.remove(&h);
            }
        }
    }

    /// The reads of a removed key stored again, if it is still remembered (and
    /// forgets it).
    pub fn recall(&mut self, scope: u32, name: &str) -> Option<u32> {
        if self.reads.is_empty() {
            // Nothing evicted yet (a recovery, a fill): no name to hash.
            return None;
        }
        let h = self.hash(scope, name);
        self.reads.remove(&h).map(|(reads, _)| reads)
    }

    /// Names remembered now.
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.reads.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recency_ranks_by_use_and_reuse_adds_half_the_cache_per_read() {
        assert_eq!(Ranking::Recency.rank(7, 3, true, 100), 7);
        let r = |used, reads, end| Ranking::ReuseEnds.rank(used, reads, end, 100);
        assert_eq!(r(7, 0, false), FRESH_END_SPAN + 7);
        assert_eq!(r(7, 2, false), FRESH_END_SPAN + 7 + 2 * 50);
        // A key read once outranks one used up to half a cache later, not more.
        assert!(r(10, 1, false) > r(59, 0, false));
        assert!(r(10, 1, false) < r(61, 0, false));
        // A fresh end goes before any other key, however old; without ends, it is
        // ranked as any other key.
        assert!(r(1_000_000, 0, true) < r(1, 0, false));
        assert_eq!(Ranking::Reuse.rank(7, 2, true, 100), r(7, 2, false));
    }

    #[test]
    fn ghosts_recall_once_and_forget_the_oldest_past_their_bound() {
        let s = 0;
        let mut g = Ghosts::default();
        g.forget(s, "a", 2, 2);
        g.forget(s, "b", 0, 2);
        assert_eq!(g.recall(s, "a"), Some(2));
        assert_eq!(g.recall(s, "a"), None, "recalled once");
        g.forget(s, "c", 1, 2);
        g.forget(s, "d", 5, 2);
        assert_eq!(g.remembered(), 2);
        assert_eq!(g.recall(s, "b"), None, "the oldest went");
        assert_eq!((g.recall(s, "c"), g.recall(s, "d")), (Some(1), Some(5)));
        // Removed again: the later removal counts, and the earlier entry in the order
        // does not forget it.
        g.forget(s, "e", 1, 2);
        g.forget(s, "e", 3, 2);
        g.forget(s, "f", 0, 2);
        assert_eq!(g.recall(s, "e"), Some(3));
        for i in 0..100 {
            g.forget(s, &format!("x{i}"), 0, 3);
        }
        assert!(g.remembered() <= 3 && g.order.len() <= 6, "bounded");
        // A name is remembered in its own scope only.
        g.forget(1, "y", 4, 3);
        assert_eq!(g.recall(2, "y"), None);
        assert_eq!(g.recall(1, "y"), Some(4));
    }
}
