//! The slab behind the key directory: each name held once in a [`Slot`], indexed by
//! number, with its key's id and location, and the eviction orders of each region
//! linked through the slots ([`Order`]: a list, a tree beside it for keys ranked out
//! of turn).

use std::collections::BTreeSet;

/// A scope's number in the directory (see [`Scope`](super::Scope)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeId(pub(super) u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(pub(super) u64);

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

/// Which order of a region: all its keys, or its tails.
pub(super) const LRU: usize = 0;
/// The keys of the region that no stored key names as its previous one.
pub(super) const TAILS: usize = 1;

#[derive(Debug, Default)]
pub(super) struct RegionKeys {
    /// By (rank, key), the first to go first: [`LRU`] and [`TAILS`].
    pub(super) order: [Order; 2],
    pub(super) bytes: u64,
}

/// Keys by (rank, key), the first to go first. A key ranked after every key of
/// the list is linked at its end through its slot (8 bytes, no allocation: under
/// the recency order every publish and read is, since stamps only grow); one
/// ranked before (a key restored out of order, a tail again, the reuse rankings)
/// goes to the tree. The order is the merge of the two.
#[derive(Debug)]
pub(super) struct Order {
    pub(super) head: u32,
    pub(super) last: u32,
    pub(super) tree: BTreeSet<(u64, KeyId)>,
    pub(super) len: usize,
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
    pub(super) fn insert(&mut self, slots: &mut [Slot], w: usize, s: u32) {
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
    pub(super) fn remove(&mut self, slots: &mut [Slot], w: usize, s: u32) -> bool {
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

    pub(super) fn iter<'a>(&'a self, slots: &'a [Slot], w: usize) -> OrderIter<'a> {
        OrderIter {
            slots,
            w,
            next: self.head,
            tree: self.tree.iter().peekable(),
        }
    }
}

pub(super) struct OrderIter<'a> {
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
pub(super) const NIL: u32 = u32::MAX;

/// A name to store: borrowed (copied into its slot) or moved in (a restore).
pub(super) enum Name<'a> {
    Borrowed(&'a str),
    Owned(String),
}

impl Name<'_> {
    pub(super) fn as_str(&self) -> &str {
        match self {
            Name::Borrowed(n) => n,
            Name::Owned(n) => n,
        }
    }

    pub(super) fn boxed(self) -> Box<str> {
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
pub(super) struct Slot {
    pub(super) name: Box<str>,
    pub(super) scope: ScopeId,
    /// How many stored keys name this one as their previous one.
    pub(super) successors: u32,
    /// The slot of the name this key names as its previous one (NIL: none).
    pub(super) prev: u32,
    /// Reads since it was stored (plus those remembered from before an eviction,
    /// under the reuse rankings).
    pub(super) reads: u32,
    /// Stored as the end of its chain and neither read nor followed since.
    pub(super) fresh_end: bool,
    /// The id of the key stored under this name; 0 when none is (the name is only
    /// named as a previous one) or the slot is free.
    pub(super) id: u64,
    pub(super) loc: Location,
    /// Stamp of the last publish or read (larger is more recent).
    pub(super) used: u64,
    /// Place in the eviction order (the lowest goes first).
    pub(super) rank: u64,
    /// (previous, next) in the list of each [`Order`] of its region.
    pub(super) link: [[u32; 2]; 2],
    /// Bit `w`: linked in the list of order `w` (else in its tree, if in it).
    pub(super) listed: u8,
    /// A use-stamp row of the key may be on the store: it was restored, or a
    /// [`Record::Used`](crate::meta::records::Record::Used) of it was handed over.
    pub(super) stamped: bool,
}

impl Slot {
    pub(super) fn stored(&self) -> bool {
        self.id != 0
    }

    pub(super) fn order_key(&self) -> (u64, KeyId) {
        (self.rank, KeyId(self.id))
    }
}
