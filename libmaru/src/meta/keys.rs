//! The key directory: published key → location, scoped by namespace, KV layout and
//! backend, with a least-recently-used order per region.
//!
//! A key is in the directory only once it was published, so nothing finds a key
//! whose bytes are not complete. Keys are write-once: the first publish of a key in
//! a scope wins. Each page holds at most one key.

use crate::wire::meta::Backend;
use std::collections::{BTreeSet, HashMap};

/// Which sessions share keys: the same namespace, KV layout digest and backend.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub namespace: String,
    pub layout: String,
    pub backend: Backend,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeId(u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(u64);

impl KeyId {
    #[cfg(test)]
    pub(crate) fn test_id(n: u64) -> KeyId {
        KeyId(n)
    }
}

/// Where a key's chunk is: `length` bytes at `offset` of the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub region_id: u64,
    pub offset: u64,
    pub length: u64,
}

#[derive(Debug, Clone)]
pub struct KeyEntry {
    pub scope: ScopeId,
    pub name: String,
    pub loc: Location,
    /// Stamp of the last publish or read (larger is more recent).
    used: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    New(KeyId),
    /// The key was published before (here or elsewhere); nothing changed.
    Exists(KeyId),
}

#[derive(Debug, Default)]
struct RegionKeys {
    /// (use stamp, key), oldest first.
    lru: BTreeSet<(u64, KeyId)>,
    bytes: u64,
}

#[derive(Debug, Default)]
pub struct KeyDirectory {
    /// Scopes are interned for good: there are as many as distinct (namespace,
    /// layout, backend) triples ever opened, a few hundred bytes each.
    scopes: HashMap<Scope, ScopeId>,
    by_name: HashMap<ScopeId, HashMap<String, KeyId>>,
    entries: HashMap<KeyId, KeyEntry>,
    by_region: HashMap<u64, RegionKeys>,
    by_page: HashMap<(u64, u64), KeyId>,
    next_id: u64,
    stamp: u64,
}

impl KeyDirectory {
    pub fn new() -> KeyDirectory {
        KeyDirectory::default()
    }

    pub fn scope_id(&mut self, scope: Scope) -> ScopeId {
        let next = ScopeId(self.scopes.len() as u32);
        *self.scopes.entry(scope).or_insert(next)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn find(&self, scope: ScopeId, name: &str) -> Option<KeyId> {
        self.by_name.get(&scope)?.get(name).copied()
    }

    pub fn get(&self, id: KeyId) -> Option<&KeyEntry> {
        self.entries.get(&id)
    }

    /// The key stored in the page at `offset` of the region, if one is.
    pub fn at(&self, region_id: u64, offset: u64) -> Option<KeyId> {
        self.by_page.get(&(region_id, offset)).copied()
    }

    /// Publishes `name` at `loc` unless the scope has it already. The caller checks
    /// that the location is a page of the publisher's and holds no other key.
    pub fn publish(&mut self, scope: ScopeId, name: &str, loc: Location) -> Published {
        if let Some(id) = self.find(scope, name) {
            return Published::Exists(id);
        }
        self.next_id += 1;
        let id = KeyId(self.next_id);
        self.stamp += 1;
        let used = self.stamp;
        self.by_name
            .entry(scope)
            .or_default()
            .insert(name.to_string(), id);
        let r = self.by_region.entry(loc.region_id).or_default();
        r.lru.insert((used, id));
        r.bytes += loc.length;
        self.by_page.insert((loc.region_id, loc.offset), id);
        self.entries.insert(
            id,
            KeyEntry {
                scope,
                name: name.to_string(),
                loc,
                used,
            },
        );
        Published::New(id)
    }

    /// Marks the key as just read.
    pub fn touch(&mut self, id: KeyId) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        self.stamp += 1;
        if let Some(r) = self.by_region.get_mut(&e.loc.region_id) {
            r.lru.remove(&(e.used, id));
            r.lru.insert((self.stamp, id));
        }
        e.used = self.stamp;
    }

    pub fn remove(&mut self, id: KeyId) -> Option<KeyEntry> {
        let e = self.entries.remove(&id)?;
        if let Some(names) = self.by_name.get_mut(&e.scope) {
            names.remove(&e.name);
            if names.is_empty() {
                self.by_name.remove(&e.scope);
            }
        }
        if let Some(r) = self.by_region.get_mut(&e.loc.region_id) {
            r.lru.remove(&(e.used, id));
            r.bytes -= e.loc.length;
            if r.lru.is_empty() {
                self.by_region.remove(&e.loc.region_id);
            }
        }
        self.by_page.remove(&(e.loc.region_id, e.loc.offset));
        Some(e)
    }

    /// Removes every key of the region at once; returns the removed entries.
    pub fn drop_region(&mut self, region_id: u64) -> Vec<KeyEntry> {
        let ids: Vec<KeyId> = match self.by_region.get(&region_id) {
            Some(r) => r.lru.iter().map(|(_, id)| *id).collect(),
            None => return Vec::new(),
        };
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    pub fn region_keys(&self, region_id: u64) -> usize {
        self.by_region.get(&region_id).map_or(0, |r| r.lru.len())
    }

    pub fn region_bytes(&self, region_id: u64) -> u64 {
        self.by_region.get(&region_id).map_or(0, |r| r.bytes)
    }

    /// The region's keys with their use stamps, least recently used first.
    pub fn lru(&self, region_id: u64) -> impl Iterator<Item = (u64, KeyId)> + '_ {
        self.by_region
            .get(&region_id)
            .into_iter()
            .flat_map(|r| r.lru.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(ns: &str, layout: &str) -> Scope {
        Scope {
            namespace: ns.into(),
            layout: layout.into(),
            backend: Backend::RemoteCxl,
        }
    }

    fn loc(region_id: u64, offset: u64) -> Location {
        Location {
            region_id,
            offset,
            length: 10,
        }
    }

    #[test]
    fn keys_are_scoped_by_namespace_layout_and_backend() {
        let mut d = KeyDirectory::new();
        let a = d.scope_id(scope("ns", "l1"));
        let b = d.scope_id(scope("ns", "l2"));
        let c = d.scope_id(scope("other", "l1"));
        let cxl = d.scope_id(Scope {
            backend: Backend::Cxl,
            ..scope("ns", "l1")
        });
        assert_eq!(d.scope_id(scope("ns", "l1")), a, "interned");
        assert!(matches!(d.publish(a, "k", loc(1, 0)), Published::New(_)));
        assert!(d.find(a, "k").is_some());
        for s in [b, c, cxl] {
            assert!(d.find(s, "k").is_none());
        }
    }

    #[test]
    fn the_first_publish_wins() {
        let mut d = KeyDirectory::new();
        let s = d.scope_id(scope("ns", "l"));
        let Published::New(id) = d.publish(s, "k", loc(1, 0)) else {
            panic!("first publish is new");
        };
        assert_eq!(d.publish(s, "k", loc(2, 0)), Published::Exists(id));
        assert_eq!(d.get(id).unwrap().loc, loc(1, 0));
        assert_eq!(d.at(2, 0), None, "the loser's page holds nothing");
    }

    #[test]
    fn lru_order_follows_reads_and_regions_drop_at_once() {
        let mut d = KeyDirectory::new();
        let s = d.scope_id(scope("ns", "l"));
        let ids: Vec<KeyId> = (0..3)
            .map(|i| match d.publish(s, &format!("k{i}"), loc(1, i * 10)) {
                Published::New(id) => id,
                other => panic!("{other:?}"),
            })
            .collect();
        d.touch(ids[0]);
        let order: Vec<KeyId> = d.lru(1).map(|(_, id)| id).collect();
        assert_eq!(order, vec![ids[1], ids[2], ids[0]]);
        assert_eq!((d.region_keys(1), d.region_bytes(1)), (3, 30));
        d.publish(s, "other", loc(2, 0));
        assert_eq!(d.drop_region(1).len(), 3);
        assert!(d.find(s, "k0").is_none());
        assert_eq!(d.at(1, 0), None);
        assert_eq!((d.region_keys(1), d.region_bytes(1), d.len()), (0, 0, 1));
        assert!(d.remove(ids[0]).is_none(), "already gone");
    }
}
