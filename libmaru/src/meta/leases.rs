//! Leases: a reader's claim on a key while it READs the key's bytes. A leased key is
//! not a victim and cannot be removed, so its page is not reused under the reader.
//!
//! Each session holds at most [`LEASE_LIMIT`] leases; an acquire that would pass the
//! limit is refused whole. A lease ends when its reader releases it, when it expires,
//! when its reader's session ends, or when its region goes back (the reader's later
//! release then reports it as ended, which is harmless).

use super::fast_hash::{FastMap, FastSet};
use super::keys::KeyId;
use crate::auth::ReadTokenKey;
use crate::wire::meta::LEASE_LIMIT;
use std::collections::BTreeSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub session: u64,
    pub key: KeyId,
    pub region_id: u64,
    pub expires_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The session would hold more than the limit.
    #[error(
        "session {session} holds {held} leases and asks for {asked} more; a session \
         holds at most {limit}: release leases after each read batch"
    )]
    Limit {
        session: u64,
        held: usize,
        asked: usize,
        limit: usize,
    },
    /// A lease id that another session holds.
    #[error("lease {lease_id} is not a lease of session {session}; nothing was released")]
    NotYours { lease_id: u64, session: u64 },
}

#[derive(Debug)]
pub struct LeaseTable {
    leases: FastMap<u64, Lease>,
    per_session: FastMap<u64, usize>,
    per_key: FastMap<KeyId, usize>,
    per_region: FastMap<u64, FastSet<u64>>,
    expiry: BTreeSet<(u64, u64)>,
    next_id: u64,
    limit: usize,
    /// The keyed HMAC of each region whose keys were leased (its read tokens), kept
    /// with the region token it is keyed with; at most [`READ_KEYS_KEPT`].
    read_keys: FastMap<u64, ReadTokenKey>,
}

/// Regions whose read-token keys are kept at most; past it the table starts again.
const READ_KEYS_KEPT: usize = 4096;

impl Default for LeaseTable {
    fn default() -> Self {
        LeaseTable::new(LEASE_LIMIT)
    }
}

impl LeaseTable {
    pub fn new(limit: usize) -> LeaseTable {
        LeaseTable {
            leases: FastMap::default(),
            per_session: FastMap::default(),
            per_key: FastMap::default(),
            per_region: FastMap::default(),
            expiry: BTreeSet::new(),
            next_id: 0,
            limit,
            read_keys: FastMap::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    pub fn held_by(&self, session: u64) -> usize {
        self.per_session.get(&session).copied().unwrap_or(0)
    }

    pub fn is_leased(&self, key: KeyId) -> bool {
        self.per_key.contains_key(&key)
    }

    pub fn region_has_leases(&self, region_id: u64) -> bool {
        self.per_region.contains_key(&region_id)
    }

    /// Whether `session` may take `n` more leases.
    pub fn check_room(&self, session: u64, n: usize) -> Result<(), LeaseError> {
        let held = self.held_by(session);
        if held + n > self.limit {
            return Err(LeaseError::Limit {
                session,
                held,
                asked: n,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// Lease ids from now on come after `base` (a restarted server's: see
    /// [`MetaCore::restore`](super::MetaCore::restore)), so that an id a worker holds
    /// from an earlier run never names a lease of this one.
    pub fn start_ids_after(&mut self, base: u64) {
        self.next_id = self.next_id.max(base);
    }

    /// The last id handed out (or the base ids start after).
    pub fn last_id(&self) -> u64 {
        self.next_id
    }

    /// The read token of (region, offset, length) for a lease, keyed with the
    /// region's token `region_token` (see [`ReadTokenKey`]): the region's key is kept,
    /// and keyed again when the region's token is another now.
    pub fn read_token(
        &mut self,
        region_id: u64,
        region_token: &str,
        offset: u64,
        length: u64,
    ) -> String {
        if let Some(k) = self.read_keys.get(&region_id) {
            if k.is_for(region_token) {
                return k.token(region_id, offset, length);
            }
        }
        if self.read_keys.len() >= READ_KEYS_KEPT {
            self.read_keys.clear();
        }
        let k = ReadTokenKey::new(region_token);
        let token = k.token(region_id, offset, length);
        self.read_keys.insert(region_id, k);
        token
    }

    /// Grants a lease; the caller checked the room first.
    pub fn grant(&mut self, session: u64, key: KeyId, region_id: u64, expires_ms: u64) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.insert(id, session, key, region_id, expires_ms);
        id
    }

    /// Grants a lease under an id an earlier run of the server handed out (a worker
    /// said it still holds it), so that the worker's release of that id ends it. False
    /// when the id is in use here.
    pub fn grant_as(
        &mut self,
        id: u64,
        session: u64,
        key: KeyId,
        region_id: u64,
        expires_ms: u64,
    ) -> bool {
        if self.leases.contains_key(&id) {
            return false;
        }
        self.insert(id, session, key, region_id, expires_ms);
        true
    }

    fn insert(&mut self, id: u64, session: u64, key: KeyId, region_id: u64, expires_ms: u64) {
        self.leases.insert(
            id,
            Lease {
                session,
                key,
                region_id,
                expires_ms,
            },
        );
        *self.per_session.entry(session).or_default() += 1;
        *self.per_key.entry(key).or_default() += 1;
        self.per_region.entry(region_id).or_default().insert(id);
        self.expiry.insert((expires_ms, id));
    }

    fn end(&mut self, id: u64) -> Option<Lease> {
        let l = self.leases.remove(&id)?;
        dec(&mut self.per_session, l.session);
        dec(&mut self.per_key, l.key);
        if let Some(s) = self.per_region.get_mut(&l.region_id) {
            s.remove(&id);
            if s.is_empty() {
                self.per_region.remove(&l.region_id);
            }
        }
        self.expiry.remove(&(l.expires_ms, id));
        Some(l)
    }

    /// Releases leases of `session`: per id, whether it was still there. An id held
    /// by another session refuses the whole request and nothing is released.
    pub fn release(&mut self, session: u64, ids: &[u64]) -> Result<Vec<bool>, LeaseError> {
        if let Some(&lease_id) = ids
            .iter()
            .find(|id| self.leases.get(id).is_some_and(|l| l.session != session))
        {
            return Err(LeaseError::NotYours { lease_id, session });
        }
        Ok(ids.iter().map(|id| self.end(*id).is_some()).collect())
    }

    /// Ends every lease on the region (it goes back); returns how many.
    pub fn end_region(&mut self, region_id: u64) -> usize {
        self.read_keys.remove(&region_id);
        let ids: Vec<u64> = self
            .per_region
            .get(&region_id)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        ids.iter().filter(|id| self.end(**id).is_some()).count()
    }

    /// Ends every lease the session holds as a reader; returns how many.
    pub fn end_session(&mut self, session: u64) -> usize {
        if self.held_by(session) == 0 {
            return 0;
        }
        let ids: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.session == session)
            .map(|(id, _)| *id)
            .collect();
        ids.iter().filter(|id| self.end(**id).is_some()).count()
    }

    /// Ends leases whose time is up; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let due: Vec<u64> = self
            .expiry
            .iter()
            .take_while(|(t, _)| *t <= now_ms)
            .map(|(_, id)| *id)
            .collect();
        due.iter().filter(|id| self.end(**id).is_some()).count()
    }

    pub fn next_expiry(&self) -> Option<u64> {
        self.expiry.iter().next().map(|(t, _)| *t)
    }
}

fn dec<K: std::hash::Hash + Eq>(m: &mut FastMap<K, usize>, k: K) {
    if let Some(n) = m.get_mut(&k) {
        *n -= 1;
        if *n == 0 {
            m.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> KeyId {
        KeyId::test_id(n)
    }

    #[test]
    fn the_limit_refuses_clearly_and_room_comes_back() {
        let mut t = LeaseTable::new(2);
        t.check_room(1, 2).unwrap();
        let a = t.grant(1, key(1), 9, 100);
        t.grant(1, key(1), 9, 100);
        let e = t.check_room(1, 1).unwrap_err();
        assert!(e.to_string().contains("at most 2"), "{e}");
        t.check_room(2, 2).unwrap();
        assert_eq!(t.release(1, &[a]).unwrap(), vec![true]);
        t.check_room(1, 1).unwrap();
    }

    /// A lease's read token is the one its region's token gives, also when the
    /// region id is given out again with another token (the kept key is not reused),
    /// and after the region went back; so a token keyed with an old region's token is
    /// refused by the agent of the new one.
    #[test]
    fn read_tokens_follow_the_regions_token() {
        use crate::auth::{read_token, region_token};
        let mut t = LeaseTable::new(10);
        let (a, b) = (
            region_token(b"s", 9, 0, 1 << 21, 1),
            region_token(b"s", 9, 0, 1 << 21, 2),
        );
        for (tok, off) in [(&a, 0), (&a, 4096), (&b, 0), (&b, 8192), (&a, 0)] {
            assert_eq!(
                t.read_token(9, tok, off, 4096),
                read_token(tok, 9, off, 4096)
            );
        }
        assert_ne!(t.read_token(9, &b, 0, 4096), read_token(&a, 9, 0, 4096));
        t.end_region(9);
        assert!(t.read_keys.is_empty());
        assert_eq!(t.read_token(9, &b, 0, 4096), read_token(&b, 9, 0, 4096));
        // Past the bound the kept keys start again.
        for r in 0..READ_KEYS_KEPT as u64 + 1 {
            t.read_token(r, &a, 0, 4096);
        }
        assert!(t.read_keys.len() <= READ_KEYS_KEPT);
    }

    #[test]
    fn another_sessions_lease_refuses_the_release_whole() {
        let mut t = LeaseTable::new(10);
        let mine = t.grant(1, key(1), 9, 100);
        let theirs = t.grant(2, key(1), 9, 100);
        let e = t.release(1, &[mine, theirs]).unwrap_err();
        assert_eq!(
            e,
            LeaseError::NotYours {
                lease_id: theirs,
                session: 1
            }
        );
        assert_eq!((t.len(), t.held_by(1)), (2, 1), "nothing was released");
        assert_eq!(t.release(1, &[mine, 999]).unwrap(), vec![true, false]);
    }

    #[test]
    fn leases_expire_and_end_with_their_region_or_session() {
        let mut t = LeaseTable::new(10);
        let k = key(2);
        t.grant(1, k, 9, 100);
        t.grant(1, k, 8, 200);
        t.grant(2, k, 8, 300);
        assert!(t.is_leased(k));
        assert_eq!(t.next_expiry(), Some(100));
        assert_eq!(t.expire(99), 0);
        assert_eq!(t.expire(100), 1);
        assert_eq!(t.end_region(8), 2);
        assert!(!t.is_leased(k));
        assert!(!t.region_has_leases(8));
        t.grant(3, k, 7, 500);
        assert_eq!(t.end_session(3), 1);
        assert!(t.is_empty());
        assert_eq!(t.next_expiry(), None);
    }
}
