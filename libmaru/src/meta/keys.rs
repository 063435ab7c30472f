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
use crate::wire::meta::Backend;
use foldhash::fast::SeedableRandomState;
use foldhash::SharedSeed;
use hashbrown::HashTable;
use std::collections::hash_map::RandomState;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::OnceLock;

/// The hasher of the directory's tables: foldhash (a multiply-fold hash, several
/// times SipHash's speed on short names; issue 46: recovery hashes every key five
/// times), seeded per process from std's `RandomState`, whose keys come from the
/// OS's random source, and per directory on top. Key names come from tenants, so
/// the seed is secret and random, never foldhash's fixed one nor its default seed
/// (address and clock bits): a tenant cannot choose names that collide without
/// learning it.
#[derive(Debug, Clone)]
struct Hasher(SeedableRandomState);

impl Default for Hasher {
    fn default() -> Hasher {
        static SHARED: OnceLock<SharedSeed> = OnceLock::new();
        let os = RandomState::new();
        let shared = SHARED.get_or_init(|| SharedSeed::from_u64(os.hash_one(0x6d61_7275u64)));
        Hasher(SeedableRandomState::with_seed(os.hash_one(1u64), shared))
    }
}

impl Hasher {
    fn hash_one<T: std::hash::Hash>(&self, v: T) -> u64 {
        self.0.hash_one(v)
    }
}

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
    pub fn get(self) -> u64 {
        self.0
    }

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

/// Which order of a region: all its keys, or its tails.
const LRU: usize = 0;
/// The keys of the region that no stored key names as its previous one.
const TAILS: usize = 1;

#[derive(Debug, Default)]
struct RegionKeys {
    /// By (rank, key), the first to go first: [`LRU`] and [`TAILS`].
    order: [Order; 2],
    bytes: u64,
}

/// Keys by (rank, key), the first to go first. A key ranked after every key of
/// the list is linked at its end through its slot (8 bytes, no allocation: under
/// the recency order every publish and read is, since stamps only grow); one
/// ranked before (a key restored out of order, a tail again, the reuse rankings)
/// goes to the tree. The order is the merge of the two.
#[derive(Debug)]
struct Order {
    head: u32,
    last: u32,
    tree: BTreeSet<(u64, KeyId)>,
    len: usize,
}

impl Default for Order {
    fn default() -> Order {
        Order {
            head: NIL,
            last: NIL,
            tree: BTreeSet::new(),
            len: 0,
        }
    }
}

impl Order {
    fn insert(&mut self, slots: &mut [Slot], w: usize, s: u32) {
        let k = slots[s as usize].order_key();
        if self.last == NIL || slots[self.last as usize].order_key() < k {
            slots[s as usize].link[w] = [self.last, NIL];
            match self.last {
                NIL => self.head = s,
                l => slots[l as usize].link[w][1] = s,
            }
            self.last = s;
            slots[s as usize].listed |= 1 << w;
        } else {
            self.tree.insert(k);
        }
        self.len += 1;
    }

    /// Takes the key out (as ranked now); false if it was not in.
    fn remove(&mut self, slots: &mut [Slot], w: usize, s: u32) -> bool {
        let e = &mut slots[s as usize];
        if e.listed & (1 << w) != 0 {
            let [p, n] = e.link[w];
            e.link[w] = [NIL, NIL];
            e.listed &= !(1 << w);
            match p {
                NIL => self.head = n,
                p => slots[p as usize].link[w][1] = n,
            }
            match n {
                NIL => self.last = p,
                n => slots[n as usize].link[w][0] = p,
            }
        } else if !self.tree.remove(&e.order_key()) {
            return false;
        }
        self.len -= 1;
        true
    }

    fn iter<'a>(&'a self, slots: &'a [Slot], w: usize) -> OrderIter<'a> {
        OrderIter {
            slots,
            w,
            next: self.head,
            tree: self.tree.iter().peekable(),
        }
    }
}

struct OrderIter<'a> {
    slots: &'a [Slot],
    w: usize,
    next: u32,
    tree: std::iter::Peekable<std::collections::btree_set::Iter<'a, (u64, KeyId)>>,
}

impl Iterator for OrderIter<'_> {
    type Item = (u64, KeyId);

    fn next(&mut self) -> Option<(u64, KeyId)> {
        let listed = (self.next != NIL).then(|| self.slots[self.next as usize].order_key());
        match (listed, self.tree.peek()) {
            (Some(l), Some(&&t)) if t < l => self.tree.next().copied(),
            (Some(l), _) => {
                self.next = self.slots[self.next as usize].link[self.w][1];
                Some(l)
            }
            (None, _) => self.tree.next().copied(),
        }
    }
}

/// No slot.
const NIL: u32 = u32::MAX;

/// A name to store: borrowed (copied into its slot) or moved in (a restore).
enum Name<'a> {
    Borrowed(&'a str),
    Owned(String),
}

impl Name<'_> {
    fn as_str(&self) -> &str {
        match self {
            Name::Borrowed(n) => n,
            Name::Owned(n) => n,
        }
    }

    fn boxed(self) -> Box<str> {
        match self {
            Name::Borrowed(n) => n.into(),
            Name::Owned(n) => n.into_boxed_str(),
        }
    }
}

/// One name of a scope: a stored key, a name that stored keys name as their
/// previous one (their successors), or both. Each name is held once, here; the
/// tables of [`KeyDirectory`] index slots by number (issue 46: a name stored three
/// times and a map entry per index cost 560-630 bytes per key).
#[derive(Debug)]
struct Slot {
    name: Box<str>,
    scope: ScopeId,
    /// How many stored keys name this one as their previous one.
    successors: u32,
    /// The slot of the name this key names as its previous one (NIL: none).
    prev: u32,
    /// Reads since it was stored (plus those remembered from before an eviction,
    /// under the reuse rankings).
    reads: u32,
    /// Stored as the end of its chain and neither read nor followed since.
    fresh_end: bool,
    /// The id of the key stored under this name; 0 when none is (the name is only
    /// named as a previous one) or the slot is free.
    id: u64,
    loc: Location,
    /// Stamp of the last publish or read (larger is more recent).
    used: u64,
    /// Place in the eviction order (the lowest goes first).
    rank: u64,
    /// (previous, next) in the list of each [`Order`] of its region.
    link: [[u32; 2]; 2],
    /// Bit `w`: linked in the list of order `w` (else in its tree, if in it).
    listed: u8,
}

impl Slot {
    fn stored(&self) -> bool {
        self.id != 0
    }

    fn order_key(&self) -> (u64, KeyId) {
        (self.rank, KeyId(self.id))
    }
}

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
    by_region: HashMap<u64, RegionKeys>,
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
    pub put: HashSet<KeyId>,
    pub gone: HashSet<KeyId>,
    pub used: HashSet<KeyId>,
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

    /// Ids at most this were restored (0: none).
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
        let (loc, reads, scope) = {
            let e = &self.slots[s as usize];
            (e.loc, e.reads, e.scope)
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
            j.put.remove(&id);
            j.used.remove(&id);
            j.gone.insert(id);
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
            j.gone.insert(KeyId(id));
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
        assert!(matches!(
            d.publish(a, "k", loc(1, 0), None),
            Published::New(_)
        ));
        assert!(d.find(a, "k").is_some());
        for s in [b, c, cxl] {
            assert!(d.find(s, "k").is_none());
        }
    }

    #[test]
    fn the_first_publish_wins() {
        let mut d = KeyDirectory::new();
        let s = d.scope_id(scope("ns", "l"));
        let Published::New(id) = d.publish(s, "k", loc(1, 0), None) else {
            panic!("first publish is new");
        };
        assert_eq!(d.publish(s, "k", loc(2, 0), None), Published::Exists(id));
        assert_eq!(d.get(id).unwrap().loc, loc(1, 0));
        assert_eq!(d.at(2, 0), None, "the loser's page holds nothing");
    }

    #[test]
    fn lru_order_follows_reads_and_regions_drop_at_once() {
        let mut d = KeyDirectory::new();
        let s = d.scope_id(scope("ns", "l"));
        let ids: Vec<KeyId> = (0..3)
            .map(
                |i| match d.publish(s, &format!("k{i}"), loc(1, i * 10), None) {
                    Published::New(id) => id,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        d.touch(ids[0]);
        let order: Vec<KeyId> = d.ranked_keys(1).map(|(_, id)| id).collect();
        assert_eq!(order, vec![ids[1], ids[2], ids[0]]);
        assert_eq!((d.region_keys(1), d.region_bytes(1)), (3, 30));
        d.publish(s, "other", loc(2, 0), None);
        assert_eq!(d.drop_region(1).len(), 3);
        assert!(d.find(s, "k0").is_none());
        assert_eq!(d.at(1, 0), None);
        assert_eq!((d.region_keys(1), d.region_bytes(1), d.len()), (0, 0, 1));
        assert!(d.remove(ids[0]).is_none(), "already gone");
    }

    fn tails_of(d: &KeyDirectory, region_id: u64) -> Vec<String> {
        d.tails(region_id)
            .map(|(_, id)| d.get(id).unwrap().name.to_string())
            .collect()
    }

    #[test]
    fn a_key_is_a_tail_until_a_stored_key_names_it_as_its_previous_one() {
        let mut d = KeyDirectory::new();
        let s = d.scope_id(scope("ns", "l"));
        d.publish(s, "a", loc(1, 0), None);
        assert_eq!(tails_of(&d, 1), ["a"]);
        d.publish(s, "b", loc(1, 10), Some("a"));
        d.publish(s, "c", loc(1, 20), Some("b"));
        assert_eq!(tails_of(&d, 1), ["c"], "a and b have successors");
        assert_eq!(d.successors_of(s, "a"), 1);
        // A second continuation of the same prefix.
        d.publish(s, "b2", loc(1, 30), Some("a"));
        assert_eq!(d.successors_of(s, "a"), 2);
        let c = d.find(s, "c").unwrap();
        d.remove(c);
        assert_eq!(tails_of(&d, 1), ["b", "b2"], "b is a tail again");
        let b2 = d.find(s, "b2").unwrap();
        d.remove(b2);
        assert_eq!(d.successors_of(s, "a"), 1, "b still follows a");
        let b = d.find(s, "b").unwrap();
        d.remove(b);
        assert_eq!(tails_of(&d, 1), ["a"]);
        assert_eq!(d.names_held(), d.len(), "no count outlives its keys");
    }

    #[test]
    fn a_successor_published_first_still_counts_and_reads_keep_tail_order() {
        let mut d = KeyDirectory::new();
        let s = d.scope_id(scope("ns", "l"));
        // Chunks of one chain may be published out of order, across regions.
        d.publish(s, "b", loc(2, 0), Some("a"));
        d.publish(s, "a", loc(1, 0), None);
        assert_eq!(tails_of(&d, 1), Vec::<String>::new(), "b follows a");
        assert_eq!(tails_of(&d, 2), ["b"]);
        d.publish(s, "x", loc(2, 10), None);
        let b = d.find(s, "b").unwrap();
        d.touch(b);
        assert_eq!(
            tails_of(&d, 2),
            ["x", "b"],
            "a read moves a tail to the back"
        );
        // Chains are per scope: a key of another scope naming `x` is no successor.
        let other = d.scope_id(scope("other", "l"));
        d.publish(other, "y", loc(3, 0), Some("x"));
        assert_eq!(tails_of(&d, 2), ["x", "b"]);
        // A key naming itself is a chain's head, not its own successor.
        d.publish(s, "self", loc(1, 10), Some("self"));
        assert!(tails_of(&d, 1).contains(&"self".to_string()));
    }

    #[test]
    fn under_the_recency_order_chained_publishes_and_reads_cost_no_tree_node() {
        let mut d = KeyDirectory::new();
        let s = d.scope_id(scope("ns", "l"));
        for i in 0..64u64 {
            let prev = (i % 16 != 0).then(|| format!("k{}", i - 1));
            d.publish(s, &format!("k{i}"), loc(1, i * 10), prev.as_deref());
        }
        for i in (0..64).step_by(3) {
            let id = d.find(s, &format!("k{i}")).unwrap();
            d.touch(id);
        }
        let r = &d.by_region[&1];
        assert_eq!(r.order[LRU].len, 64);
        assert_eq!(
            (r.order[LRU].tree.len(), r.order[TAILS].tree.len()),
            (0, 0),
            "every key linked through its slot (8 bytes, no allocation)"
        );
        assert_eq!(d.tails(1).count(), 4, "one tail per prompt of 16");
    }

    /// The order of every region as the directory gives it: (rank, key) of its
    /// keys, sorted, and its tails among them.
    fn check_orders(d: &KeyDirectory) -> Result<(), proptest::test_runner::TestCaseError> {
        use proptest::prelude::*;
        for rid in 0..3u64 {
            let mut want: Vec<(u64, KeyId)> = d
                .iter()
                .filter(|(_, e)| e.loc.region_id == rid)
                .map(|(id, e)| (e.rank(), id))
                .collect();
            want.sort_unstable();
            let got: Vec<(u64, KeyId)> = d.ranked_keys(rid).collect();
            prop_assert_eq!(&got, &want, "order of region {}", rid);
            prop_assert_eq!(d.region_keys(rid), want.len());
            let tails: Vec<(u64, KeyId)> = want
                .iter()
                .copied()
                .filter(|&(_, id)| {
                    let e = d.get(id).unwrap();
                    d.successors_of(e.scope, e.name) == 0
                })
                .collect();
            let got: Vec<(u64, KeyId)> = d.tails(rid).collect();
            prop_assert_eq!(&got, &tails, "tails of region {}", rid);
        }
        Ok(())
    }

    proptest::proptest! {
        /// Under every ranking, whatever the publishes (chained or not), reads,
        /// removals, restores out of order and dropped regions, each region's order
        /// is its keys sorted by (rank, key) and its tails those no stored key
        /// follows: the lists linked through the slots and the trees beside them
        /// merge into the order a sorted set gave.
        #[test]
        fn each_region_order_is_its_keys_sorted_by_rank(
            ranking in 0u8..3,
            ops in proptest::collection::vec((0u8..6, 0u8..32, 0u8..32, 0u16..2000), 0..120),
        ) {
            let ranking = [Ranking::Recency, Ranking::Reuse, Ranking::ReuseEnds][ranking as usize];
            let mut d = KeyDirectory::ranked(ranking);
            let s = d.scope_id(scope("ns", "l"));
            let mut page = 0u64;
            let mut next_restored = 100_000u64;
            for (op, a, b, used) in ops {
                let name = format!("k{}", a % 24);
                let prev = (b % 3 != 0).then(|| format!("k{}", b % 24));
                page += 1;
                let at = loc(u64::from(a % 3), page * 10);
                match op {
                    0 => {
                        d.publish(s, &name, at, prev.as_deref());
                    }
                    1 => {
                        if let Some(id) = d.find(s, &name) {
                            d.touch(id);
                        }
                    }
                    2 => {
                        if let Some(id) = d.find(s, &name) {
                            proptest::prop_assert!(d.remove(id).is_some());
                            proptest::prop_assert!(d.find(s, &name).is_none());
                        }
                    }
                    3 => {
                        // Recorded ids are unique: after every id given.
                        next_restored = next_restored.max(d.last_id()) + 1;
                        d.restore(next_restored, s, name.clone(), at, prev.as_deref(), u64::from(used));
                    }
                    4 => {
                        d.drop_region(u64::from(a % 3));
                    }
                    // Restores (and publishes, reads) between these are ordered
                    // at once, at the end.
                    _ if d.restoring => d.finish_restore(),
                    _ => d.begin_restore(),
                }
                if !d.restoring {
                    check_orders(&d)?;
                }
            }
            d.finish_restore();
            check_orders(&d)?;
            let ids: Vec<KeyId> = d.iter().map(|(id, _)| id).collect();
            for id in ids {
                d.remove(id);
            }
            proptest::prop_assert_eq!(d.names_held(), 0, "no name outlives its keys");
        }
    }
}
