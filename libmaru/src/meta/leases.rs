//! Leases: a reader's claim on a key while it READs the key's bytes. A leased key is
//! not a victim and cannot be removed, so its page is not reused under the reader.
//!
//! Each session holds at most [`LEASE_LIMIT`] leases; an acquire that would pass the
//! limit is refused whole. A lease ends when its reader releases it, when it expires,
//! when its reader's session ends, or when its region goes back (the reader's later
//! release then reports it as ended, which is harmless).

use super::keys::KeyId;
use crate::wire::meta::LEASE_LIMIT;
use std::collections::{BTreeSet, HashMap, HashSet};

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
    leases: HashMap<u64, Lease>,
    per_session: HashMap<u64, usize>,
    per_key: HashMap<KeyId, usize>,
    per_region: HashMap<u64, HashSet<u64>>,
    expiry: BTreeSet<(u64, u64)>,
    next_id: u64,
    limit: usize,
}

impl Default for LeaseTable {
    fn default() -> Self {
        LeaseTable::new(LEASE_LIMIT)
    }
}

impl LeaseTable {
    pub fn new(limit: usize) -> LeaseTable {
        LeaseTable {
            leases: HashMap::new(),
            per_session: HashMap::new(),
            per_key: HashMap::new(),
            per_region: HashMap::new(),
            expiry: BTreeSet::new(),
            next_id: 0,
            limit,
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

fn dec<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: K) {
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
