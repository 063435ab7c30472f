//! The hasher of maru-server's tables ([`Hasher`]): foldhash, secretly seeded, in
//! place of std's SipHash, and the maps and sets built on it ([`FastMap`],
//! [`FastSet`]).

use foldhash::fast::{FoldHasher, SeedableRandomState};
use foldhash::SharedSeed;
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::OnceLock;

/// foldhash (a multiply-fold hash, several times SipHash's speed on short names and
/// on integers; issue 46: recovery hashes every key five times; issue 47: a batch's
/// leases, keys and journal entries are hashed several times each), seeded per
/// process from std's `RandomState`, whose keys come from the OS's random source,
/// and per table on top. Key names come from tenants, so the seed is secret and
/// random, never foldhash's fixed one nor its default seed (address and clock
/// bits): a tenant cannot choose names that collide without learning it.
#[derive(Debug, Clone)]
pub struct Hasher(SeedableRandomState);

impl Default for Hasher {
    fn default() -> Hasher {
        static SHARED: OnceLock<SharedSeed> = OnceLock::new();
        let os = RandomState::new();
        let shared = SHARED.get_or_init(|| SharedSeed::from_u64(os.hash_one(0x6d61_7275u64)));
        Hasher(SeedableRandomState::with_seed(os.hash_one(1u64), shared))
    }
}

impl BuildHasher for Hasher {
    type Hasher = FoldHasher;

    fn build_hasher(&self) -> FoldHasher {
        self.0.build_hasher()
    }
}

/// A map hashed with [`Hasher`].
pub type FastMap<K, V> = HashMap<K, V, Hasher>;

/// A set hashed with [`Hasher`].
pub type FastSet<K> = HashSet<K, Hasher>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Two tables hash the same value differently (each has its own seed on top of
    /// the process's), and one table always the same way.
    #[test]
    fn each_table_has_its_own_seed() {
        let (a, b) = (Hasher::default(), Hasher::default());
        assert_eq!(a.hash_one("k"), a.hash_one("k"));
        assert_ne!(a.hash_one("k"), b.hash_one("k"));
    }
}
