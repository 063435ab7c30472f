//! The key directory: published key → location, scoped by namespace, KV layout and
//! backend, with an eviction order per region (least recently used first, or the
//! ranks of [`evict_rank`](super::evict_rank)).
//!
//! A key is in the directory only once it was published, so nothing finds a key
//! whose bytes are not complete. Keys are write-once: the first publish of a key in
//! a scope wins. Each page holds at most one key.
//!
//! Keys are prefix-chained: a publish may name the key before it in its chain. The
//! directory counts, for every name, the stored keys that name it as their previous
//! one (its successors), and keeps per region the keys with no stored successor (the
//! tails) in the same order. A load stops at the first miss, so evicting
//! a chunk that still has successors leaves them unreachable: victims are taken from
//! the tails first (see `evict_ops`).

use super::evict_rank::{Ghosts, Ranking};
use super::fast_hash::{FastMap, FastSet, Hasher};
use crate::wire::meta::Backend;
use hashbrown::HashTable;
use std::collections::HashMap;
use std::hash::BuildHasher;

/// Which sessions share keys: the same namespace, KV layout digest and backend.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub namespace: String,
    pub layout: String,
    pub backend: Backend,
}

/// A stored key, as [`KeyDirectory::get`] shows it.
#[derive(Debug, Clone, Copy)]
pub struct KeyEntry<'a> {
    pub scope: ScopeId,
    pub name: &'a str,
    pub loc: Location,
    /// The key before this one in its prefix chain, as the publisher named it.
    pub prev: Option<&'a str>,
    used: u64,
    rank: u64,
}

impl KeyEntry<'_> {
    /// Stamp of the last publish or read (larger is more recent).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Place in the eviction order (the lowest goes first).
    pub fn rank(&self) -> u64 {
        self.rank
    }
}

/// A key [`KeyDirectory::remove`] took out.
#[derive(Debug, Clone)]
pub struct RemovedKey {
    pub scope: ScopeId,
    pub name: Box<str>,
    pub loc: Location,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    New(KeyId),
    /// The key was published before (here or elsewhere); nothing changed.
    Exists(KeyId),
}

mod slots;

pub use slots::{KeyId, Location, ScopeId};
use slots::{Name, RegionKeys, Slot, LRU, NIL, TAILS};

#[derive(Debug, Default)]
pub struct KeyDirectory {
    /// Scopes are interned for good: there are as many as distinct (namespace,
    /// layout, backend) triples ever opened, a few hundred bytes each.
    scopes: HashMap<Scope, ScopeId>,
    slots: Vec<Slot>,
    /// Slots free for reuse.
    free: Vec<u32>,
    /// Slots by (scope, name): every slot in use.
    names: HashTable<u32>,
    /// Slots of stored keys by id.
    ids: HashTable<u32>,
    /// Slots of stored keys by (region, offset).
    pages: HashTable<u32>,
    hasher: Hasher,
    by_region: FastMap<u64, RegionKeys>,
    next_id: u64,
    stamp: u64,
    ranking: Ranking,
    /// Reads of removed keys, under the reuse rankings.
    ghosts: Ghosts,
    /// What changed since the last [`take_journal`](Self::take_journal), when the
    /// directory is kept durable.
    journal: Option<KeyJournal>,
    /// Keys are being restored ([`begin_restore`](Self::begin_restore)): the
    /// regions' orders are built once, sorted, at the end.
    restoring: bool,
}

/// Keys and scopes changed since the last batch of records.
#[derive(Debug, Default)]
pub struct KeyJournal {
    pub scopes: Vec<ScopeId>,
    pub put: FastSet<KeyId>,
    /// Removed keys, each with whether a use-stamp row of it may be on the store.
    pub gone: FastMap<KeyId, bool>,
    pub used: FastSet<KeyId>,
    /// Changes other than reads.
    pub changes: u64,
}

fn name_hash(h: &Hasher, scope: ScopeId, name: &str) -> u64 {
    h.hash_one((scope.0, name))
}

fn id_hash(h: &Hasher, id: u64) -> u64 {
    h.hash_one(id)
}

fn page_hash(h: &Hasher, region_id: u64, offset: u64) -> u64 {
    h.hash_one((region_id, offset))
}

impl KeyDirectory {
    pub fn new() -> KeyDirectory {
        KeyDirectory::default()
    }

    /// A directory whose eviction order ranks keys so.
    pub fn ranked(ranking: Ranking) -> KeyDirectory {
        KeyDirectory {
            ranking,
            ..KeyDirectory::default()
        }
    }

    pub fn scope_id(&mut self, scope: Scope) -> ScopeId {
        if let Some(&id) = self.scopes.get(&scope) {
            return id;
        }
        // After the largest id: restored scopes keep theirs.
        let next = ScopeId(self.scopes.values().map(|v| v.0 + 1).max().unwrap_or(0));
        let id = *self.scopes.entry(scope).or_insert(next);
        if id == next {
            if let Some(j) = &mut self.journal {
                j.scopes.push(id);
                j.changes += 1;
            }
        }
        id
    }

    /// Records what changes from now on (see [`take_journal`](Self::take_journal)).
    pub fn keep_journal(&mut self) {
        self.journal.get_or_insert_with(KeyJournal::default);
    }

    /// Changes other than reads so far.
    pub fn changes(&self) -> u64 {
        self.journal.as_ref().map_or(0, |j| j.changes)
    }

    /// What changed since the last call (None when no journal is kept).
    pub fn take_journal(&mut self) -> Option<KeyJournal> {
        let j = self.journal.as_mut()?;
        let changes = j.changes;
        let taken = std::mem::take(j);
        j.changes = changes;
        Some(taken)
    }

    /// The scope named `id`.
    pub fn scope(&self, id: ScopeId) -> Option<&Scope> {
        self.scopes.iter().find(|(_, v)| **v == id).map(|(k, _)| k)
    }

    pub fn scope_number(id: ScopeId) -> u32 {
        id.0
    }

    /// Puts a scope back under its recorded id (recovery). False when the id or the
    /// scope is taken by another.
    pub fn restore_scope(&mut self, id: u32, scope: Scope) -> bool {
        if self.scopes.values().any(|v| v.0 == id) || self.scopes.contains_key(&scope) {
            return false;
        }
        self.scopes.insert(scope, ScopeId(id));
        true
    }

    /// The scope recorded as `id`, if restored.
    pub fn restored_scope(&self, id: u32) -> Option<ScopeId> {
        self.scopes.values().copied().find(|v| v.0 == id)
    }

    /// Puts a recorded key back with its id and use stamp (recovery); later ids and
    /// stamps come after every restored one.
    /// The name is moved into the directory, not copied.
    pub fn restore(
        &mut self,
        id: u64,
        scope: ScopeId,
        name: String,
        loc: Location,
        prev: Option<&str>,
        used: u64,
    ) -> Published {
        let (next, stamp) = (self.next_id, self.stamp);
        self.next_id = id.saturating_sub(1);
        self.stamp = used.saturating_sub(1);
        // A restored key is on disk already: not a change to journal.
        let journal = self.journal.take();
        let r = self.publish_named(scope, Name::Owned(name), loc, prev);
        self.journal = journal;
        self.next_id = next.max(id);
        self.stamp = stamp.max(used);
        r
    }

    /// Room for `additional` more keys without growing the tables one doubling at a
    /// time (recovery knows how many keys it restores).
    pub fn reserve(&mut self, additional: usize) {
        self.slots.reserve(additional);
        let (slots, h) = (&self.slots, &self.hasher);
        self.names.reserve(additional, |&x| {
            let e = &slots[x as usize];
            name_hash(h, e.scope, &e.name)
        });
        self.ids
            .reserve(additional, |&x| id_hash(h, slots[x as usize].id));
        self.pages.reserve(additional, |&x| {
            let l = &slots[x as usize].loc;
            page_hash(h, l.region_id, l.offset)
        });
    }

    /// Restores many keys at once (recovery): from now until
    /// [`finish_restore`](Self::finish_restore), published and restored keys are
    /// counted in their regions but not put in the regions' eviction orders; those
    /// are built once at the end, each sorted in one go. Restored out of rank order
    /// (keys come back in id order, read keys ranked later), each key would otherwise
    /// go to an order's tree (issue 46: a B-tree insert per key).
    /// [`ranked_keys`](Self::ranked_keys) and [`tails`](Self::tails) are empty until
    /// then; a removal finishes the restore first.
    pub fn begin_restore(&mut self) {
        self.restoring = true;
    }

    /// Builds every region's orders from its keys (see
    /// [`begin_restore`](Self::begin_restore)).
    pub fn finish_restore(&mut self) {
        if !std::mem::take(&mut self.restoring) {
            return;
        }
        let mut of_region: HashMap<u64, Vec<u32>> = HashMap::new();
        for (s, e) in self.slots.iter_mut().enumerate() {
            e.link = [[NIL; 2]; 2];
            e.listed = 0;
            if e.stored() {
                of_region.entry(e.loc.region_id).or_default().push(s as u32);
            }
        }
        for (rid, mut list) in of_region {
            let slots = &mut self.slots;
            list.sort_unstable_by_key(|&s| slots[s as usize].order_key());
            let r = self.by_region.entry(rid).or_default();
            r.order = Default::default();
            for s in list {
                // In rank order: each one is linked at its list's end.
                r.order[LRU].insert(slots, LRU, s);
                if slots[s as usize].successors == 0 {
                    r.order[TAILS].insert(slots, TAILS, s);
                }
            }
        }
    }

    /// The next key gets an id above `id` (recovery: ids recorded before).
    pub fn ids_after(&mut self, id: u64) {
        self.next_id = self.next_id.max(id);
    }

    /// Ids at most this were recorded before this run, restored or not (0: none):
    /// the next key's id is above it.
    pub fn last_id(&self) -> u64 {
        self.next_id
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The slot of (scope, name), stored or only named as a previous key.
    fn slot_of(&self, scope: ScopeId, name: &str) -> Option<u32> {
        self.slot_of_hashed(name_hash(&self.hasher, scope, name), scope, name)
    }

    /// [`slot_of`](Self::slot_of) with the name's hash already made (a publish
    /// hashes its name once).
    fn slot_of_hashed(&self, hash: u64, scope: ScopeId, name: &str) -> Option<u32> {
        let slots = &self.slots;
        self.names
            .find(hash, |&s| {
                let e = &slots[s as usize];
                e.scope == scope && *e.name == *name
            })
            .copied()
    }

    fn slot_of_id(&self, id: KeyId) -> Option<u32> {
        let slots = &self.slots;
        self.ids
            .find(id_hash(&self.hasher, id.0), |&s| {
                slots[s as usize].id == id.0
            })
            .copied()
    }

    /// The slot of (scope, name), made (not stored, no successor) if it has none.
    fn slot_or_new(&mut self, scope: ScopeId, name: &str) -> u32 {
        let hash = name_hash(&self.hasher, scope, name);
        self.slot_or_new_hashed(hash, scope, Name::Borrowed(name))
    }

    /// [`slot_or_new`](Self::slot_or_new) with the name's hash already made.
    fn slot_or_new_hashed(&mut self, hash: u64, scope: ScopeId, name: Name<'_>) -> u32 {
        if let Some(s) = self.slot_of_hashed(hash, scope, name.as_str()) {
            return s;
        }
        let slot = Slot {
            name: name.boxed(),
            scope,
            successors: 0,
            prev: NIL,
            reads: 0,
            fresh_end: false,
            id: 0,
            loc: Location {
                region_id: 0,
                offset: 0,
                length: 0,
            },
            used: 0,
            rank: 0,
            link: [[NIL; 2]; 2],
            listed: 0,
            stamped: false,
        };
        let s = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = slot;
                s
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        let (slots, h) = (&self.slots, &self.hasher);
        self.names.insert_unique(hash, s, |&x| {
            let e = &slots[x as usize];
            name_hash(h, e.scope, &e.name)
        });
        s
    }

    /// Frees slot `s` if it holds no key and no stored key names it.
    fn release(&mut self, s: u32) {
        let e = &self.slots[s as usize];
        if e.stored() || e.successors > 0 {
            return;
        }
        let hash = name_hash(&self.hasher, e.scope, &e.name);
        if let Ok(o) = self.names.find_entry(hash, |&x| x == s) {
            o.remove();
        }
        self.slots[s as usize].name = Box::default();
        self.free.push(s);
    }

    fn entry(&self, s: u32) -> KeyEntry<'_> {
        let e = &self.slots[s as usize];
        KeyEntry {
            scope: e.scope,
            name: &e.name,
            loc: e.loc,
            prev: (e.prev != NIL).then(|| &*self.slots[e.prev as usize].name),
            used: e.used,
            rank: e.rank,
        }
    }

    pub fn find(&self, scope: ScopeId, name: &str) -> Option<KeyId> {
        let s = self.slot_of(scope, name)?;
        let e = &self.slots[s as usize];
        e.stored().then_some(KeyId(e.id))
    }

    pub fn get(&self, id: KeyId) -> Option<KeyEntry<'_>> {
        Some(self.entry(self.slot_of_id(id)?))
    }

    /// The key stored in the page at `offset` of the region, if one is.
    pub fn at(&self, region_id: u64, offset: u64) -> Option<KeyId> {
        let slots = &self.slots;
        self.pages
            .find(page_hash(&self.hasher, region_id, offset), |&s| {
                let l = &slots[s as usize].loc;
                l.region_id == region_id && l.offset == offset
            })
            .map(|&s| KeyId(slots[s as usize].id))
    }

    /// Publishes `name` at `loc` unless the scope has it already. `prev` is the key
    /// before it in its chain, if the publisher knows it (it need not be stored).
    /// The caller checks that the location is a page of the publisher's and holds
    /// no other key.
    pub fn publish(
        &mut self,
        scope: ScopeId,
        name: &str,
        loc: Location,
        prev: Option<&str>,
    ) -> Published {
        self.publish_named(scope, Name::Borrowed(name), loc, prev)
    }

    /// [`publish`](Self::publish) of a name given or moved in.
    fn publish_named(
        &mut self,
        scope: ScopeId,
        name: Name<'_>,
        loc: Location,
        prev: Option<&str>,
    ) -> Published {
        let hash = name_hash(&self.hasher, scope, name.as_str());
        let known = self.slot_of_hashed(hash, scope, name.as_str());
        if let Some(e) = known
            .map(|s| &self.slots[s as usize])
            .filter(|e| e.stored())
        {
            return Published::Exists(KeyId(e.id));
        }
        // Stored again after an eviction: asked for once more than it was read.
        let reads = match self.ranking {
            Ranking::Recency => 0,
            _ => self
                .ghosts
                .recall(scope.0, name.as_str())
                .map_or(0, |n| n + 1),
        };
        // A key is not its own predecessor: that would keep it from ever being a tail.
        let prev = prev.filter(|p| *p != name.as_str());
        self.next_id += 1;
        let id = KeyId(self.next_id);
        self.stamp += 1;
        let used = self.stamp;
        let s = match known {
            Some(s) => s,
            None => self.slot_or_new_hashed(hash, scope, name),
        };
        let is_tail = self.slots[s as usize].successors == 0;
        let fresh_end = is_tail && reads == 0;
        let rank = self.ranking.rank(used, reads, fresh_end, self.len());
        {
            let e = &mut self.slots[s as usize];
            e.id = id.0;
            e.loc = loc;
            e.used = used;
            e.reads = reads;
            e.fresh_end = fresh_end;
            e.rank = rank;
            // Restored (its journal set aside: `restore`): its row may be there.
            e.stamped = self.journal.is_none();
        }
        let r = self.by_region.entry(loc.region_id).or_default();
        if self.restoring {
            // Ordered at the end of the restore.
            r.order[LRU].len += 1;
        } else {
            r.order[LRU].insert(&mut self.slots, LRU, s);
            if is_tail {
                r.order[TAILS].insert(&mut self.slots, TAILS, s);
            }
        }
        r.bytes += loc.length;
        let (slots, h) = (&self.slots, &self.hasher);
        self.ids
            .insert_unique(id_hash(h, id.0), s, |&x| id_hash(h, slots[x as usize].id));
        self.pages
            .insert_unique(page_hash(h, loc.region_id, loc.offset), s, |&x| {
                let l = &slots[x as usize].loc;
                page_hash(h, l.region_id, l.offset)
            });
        if let Some(p) = prev {
            let ps = self.add_successor(scope, p);
            self.slots[s as usize].prev = ps;
        }
        if let Some(j) = &mut self.journal {
            j.put.insert(id);
            j.changes += 1;
        }
        Published::New(id)
    }

    /// How many stored keys name `name` as the key before them.
    pub fn successors_of(&self, scope: ScopeId, name: &str) -> u32 {
        self.slot_of(scope, name)
            .map_or(0, |s| self.slots[s as usize].successors)
    }

    /// Counts a successor of (scope, prev); returns the slot of `prev`.
    fn add_successor(&mut self, scope: ScopeId, prev: &str) -> u32 {
        let ps = self.slot_or_new(scope, prev);
        let pe = &mut self.slots[ps as usize];
        pe.successors += 1;
        if pe.successors == 1 && pe.stored() {
            // `prev` was a tail and is one no longer, nor the end of a fresh prompt.
            let (pid, rid) = (KeyId(pe.id), pe.loc.region_id);
            if let Some(r) = self.by_region.get_mut(&rid).filter(|_| !self.restoring) {
                r.order[TAILS].remove(&mut self.slots, TAILS, ps);
            }
            self.rerank(pid, false);
        }
        ps
    }

    fn drop_successor(&mut self, ps: u32) {
        let pe = &mut self.slots[ps as usize];
        pe.successors -= 1;
        if pe.successors > 0 {
            return;
        }
        if pe.stored() {
            // `prev` has no successor left: it is a tail now.
            let rid = pe.loc.region_id;
            if let Some(r) = self.by_region.get_mut(&rid).filter(|_| !self.restoring) {
                r.order[TAILS].insert(&mut self.slots, TAILS, ps);
            }
        } else {
            self.release(ps);
        }
    }

    /// Ranks the key again: as read just now (`read`), or as it is with its
    /// fresh-end mark dropped.
    fn rerank(&mut self, id: KeyId, read: bool) {
        let stored = self.len();
        let Some(s) = self.slot_of_id(id) else {
            return;
        };
        let e = &mut self.slots[s as usize];
        if !read && !e.fresh_end {
            return;
        }
        if read {
            self.stamp += 1;
            e.used = self.stamp;
            e.reads = e.reads.saturating_add(1);
        }
        e.fresh_end = false;
        let rank = self.ranking.rank(e.used, e.reads, false, stored);
        if rank == e.rank {
            // In place already (under the recency order, a key that gets a
            // successor): taken out and put back, it would leave its list.
            return;
        }
        let rid = e.loc.region_id;
        let Some(r) = self.by_region.get_mut(&rid).filter(|_| !self.restoring) else {
            // Not in an order (yet): ranked where the restore's end puts it.
            self.slots[s as usize].rank = rank;
            return;
        };
        r.order[LRU].remove(&mut self.slots, LRU, s);
        let tail = r.order[TAILS].remove(&mut self.slots, TAILS, s);
        self.slots[s as usize].rank = rank;
        r.order[LRU].insert(&mut self.slots, LRU, s);
        if tail {
            r.order[TAILS].insert(&mut self.slots, TAILS, s);
        }
    }

    /// Whether key `id` was published since the last
    /// [`take_journal`](Self::take_journal): no batch handed to the store carries
    /// its record yet.
    pub fn unrecorded(&self, id: KeyId) -> bool {
        self.journal.as_ref().is_some_and(|j| j.put.contains(&id))
    }

    /// The use stamp of key `id`, for its [`Record::Used`](super::records::Record::Used),
    /// the key noted as having a use-stamp row from now on (None: not stored).
    pub fn stamp_to_record(&mut self, id: KeyId) -> Option<u64> {
        let s = self.slot_of_id(id)?;
        let e = &mut self.slots[s as usize];
        e.stamped = true;
        Some(e.used)
    }

    /// Marks the key as just read.
    pub fn touch(&mut self, id: KeyId) {
        if self.slot_of_id(id).is_none() {
            return;
        }
        self.rerank(id, true);
        if let Some(j) = &mut self.journal {
            j.used.insert(id);
        }
    }

    pub fn remove(&mut self, id: KeyId) -> Option<RemovedKey> {
        self.finish_restore();
        let s = self.slot_of_id(id)?;
        let h = &self.hasher;
        if let Ok(o) = self.ids.find_entry(id_hash(h, id.0), |&x| x == s) {
            o.remove();
        }
        let (loc, reads, scope, stamped) = {
            let e = &self.slots[s as usize];
            (e.loc, e.reads, e.scope, e.stamped)
        };
        if let Some(r) = self.by_region.get_mut(&loc.region_id) {
            r.order[LRU].remove(&mut self.slots, LRU, s);
            r.order[TAILS].remove(&mut self.slots, TAILS, s);
            r.bytes -= loc.length;
            if r.order[LRU].len == 0 {
                self.by_region.remove(&loc.region_id);
            }
        }
        let e = &mut self.slots[s as usize];
        if let Ok(o) = self
            .pages
            .find_entry(page_hash(h, loc.region_id, loc.offset), |&x| x == s)
        {
            o.remove();
        }
        e.id = 0;
        let prev = std::mem::replace(&mut e.prev, NIL);
        let out = RemovedKey {
            scope,
            name: e.name.clone(),
            loc,
        };
        if prev != NIL {
            self.drop_successor(prev);
        }
        self.release(s);
        if self.ranking != Ranking::Recency {
            let bound = self.len().max(1);
            self.ghosts.forget(scope.0, &out.name, reads, bound);
        }
        if let Some(j) = &mut self.journal {
            // A key the store never got needs no record of its removal either.
            if !j.put.remove(&id) {
                j.gone.insert(id, stamped);
            }
            j.used.remove(&id);
            j.changes += 1;
        }
        Some(out)
    }

    /// Removes every key of the region at once; returns the removed entries.
    pub fn drop_region(&mut self, region_id: u64) -> Vec<(KeyId, RemovedKey)> {
        self.finish_restore();
        let ids: Vec<KeyId> = match self.by_region.get(&region_id) {
            Some(r) => r.order[LRU]
                .iter(&self.slots, LRU)
                .map(|(_, id)| id)
                .collect(),
            None => return Vec::new(),
        };
        ids.into_iter()
            .filter_map(|id| Some((id, self.remove(id)?)))
            .collect()
    }

    /// Every key with its id (records of a whole directory).
    pub fn iter(&self) -> impl Iterator<Item = (KeyId, KeyEntry<'_>)> {
        (0..self.slots.len() as u32)
            .filter(|&s| self.slots[s as usize].stored())
            .map(|s| (KeyId(self.slots[s as usize].id), self.entry(s)))
    }

    /// Keys in the trees of the regions' orders (not linked through their slots).
    #[cfg(test)]
    pub(crate) fn order_tree_len(&self) -> usize {
        self.by_region
            .values()
            .map(|r| r.order[LRU].tree.len() + r.order[TAILS].tree.len())
            .sum()
    }

    /// Names held (stored keys and names only named as a previous key).
    #[cfg(test)]
    pub(crate) fn names_held(&self) -> usize {
        self.names.len()
    }

    /// Notes that a recorded key was left out at recovery (its record goes).
    pub fn note_gone(&mut self, id: u64) {
        if let Some(j) = &mut self.journal {
            j.gone.insert(KeyId(id), true);
            j.changes += 1;
        }
    }

    pub fn region_keys(&self, region_id: u64) -> usize {
        self.by_region
            .get(&region_id)
            .map_or(0, |r| r.order[LRU].len)
    }

    pub fn region_bytes(&self, region_id: u64) -> u64 {
        self.by_region.get(&region_id).map_or(0, |r| r.bytes)
    }

    /// The region's keys with their ranks, the first to go first (least recently
    /// used first under [`Ranking::Recency`]).
    pub fn ranked_keys(&self, region_id: u64) -> impl Iterator<Item = (u64, KeyId)> + '_ {
        self.by_region
            .get(&region_id)
            .into_iter()
            .flat_map(move |r| r.order[LRU].iter(&self.slots, LRU))
    }

    /// The region's keys that no stored key follows in a chain, with their ranks,
    /// the first to go first.
    pub fn tails(&self, region_id: u64) -> impl Iterator<Item = (u64, KeyId)> + '_ {
        self.by_region
            .get(&region_id)
            .into_iter()
            .flat_map(move |r| r.order[TAILS].iter(&self.slots, TAILS))
    }
}

#[cfg(test)]
mod tests;
