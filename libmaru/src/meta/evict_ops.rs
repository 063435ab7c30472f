//! Eviction: victims and remove act only on keys of the caller's own regions, and
//! never on a leased or pinned key. Victims come tail of a prefix chain first. Pins:
//! any session of the key's scope whose tenant writes its namespace may pin it (the
//! pins of a tenant's sessions count toward its limit); remove and pin need that too.

use super::core::{Keyed, MetaCore};
use super::errors::{check_batch, refused};
use super::journal::ReplyTiming;
use super::keys::KeyId;
use super::pins::PinLimit;
use crate::wire::meta::{KeyInfo, MetaReply, RemoveResult};
use crate::wire::WireError;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

impl MetaCore {
    /// Up to `max` keys of the session's regions that no lease or pin holds, in the
    /// order they should go: with `--victim-order reuse` and `prefix`, tails of prefix chains first (lowest rank
    /// first: see [`evict_rank`](super::evict_rank)), a chunk offered only once every
    /// stored chunk after it is offered before it; then, if that is not `max`, the
    /// rest lowest rank first. With `lru`, least recently used first
    /// ([`VictimOrder`](super::config::VictimOrder)).
    pub(super) fn victims(
        &mut self,
        client_id: &str,
        session: u64,
        max: u32,
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_batch("victims", max as usize)?;
        let id = self.session(client_id, session, now_ms)?;
        let s = self.sessions.checked(id)?;
        let max = max as usize;
        let free = |k: KeyId| !self.leases.is_leased(k) && !self.pins.is_pinned(k);
        let mut chosen: Vec<KeyId> = Vec::with_capacity(max);
        let mut taken: HashSet<KeyId> = HashSet::new();
        if self.cfg.victim_order.tails_first() {
            // Lowest-ranked tail first (the regions' tails merged, each region's already in
            // order); a chosen tail's predecessor joins once every stored successor
            // of it is chosen.
            let mut tails = Merge::new(
                s.regions
                    .iter()
                    .map(|&rid| self.keys.tails(rid).filter(move |(_, k)| free(*k)))
                    .collect(),
            );
            let mut joined: BinaryHeap<Reverse<(u64, KeyId)>> = BinaryHeap::new();
            let mut chosen_successors: HashMap<&str, u32> = HashMap::new();
            while chosen.len() < max {
                let from_tails = match (tails.peek(), joined.peek()) {
                    (Some(t), Some(Reverse(j))) => t < j,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                let next = if from_tails {
                    tails.next()
                } else {
                    joined.pop().map(|Reverse(x)| x)
                };
                let Some((_, k)) = next else {
                    break;
                };
                if !taken.insert(k) {
                    continue;
                }
                chosen.push(k);
                let Some(e) = self.keys.get(k) else { continue };
                let Some(prev) = e.prev else {
                    continue;
                };
                let n = chosen_successors.entry(prev).or_insert(0);
                *n += 1;
                let Some(pk) = self.keys.find(e.scope, prev) else {
                    continue;
                };
                let Some(pe) = self.keys.get(pk) else {
                    continue;
                };
                if *n == self.keys.successors_of(e.scope, prev)
                    && s.regions.contains(&pe.loc.region_id)
                    && free(pk)
                    && !taken.contains(&pk)
                {
                    joined.push(Reverse((pe.rank(), pk)));
                }
            }
        }
        if chosen.len() < max {
            // The rest, lowest rank first across the regions (merged).
            let want = max - chosen.len();
            let rest: Vec<KeyId> = Merge::new(
                s.regions
                    .iter()
                    .map(|&rid| {
                        self.keys
                            .ranked_keys(rid)
                            .filter(|(_, k)| free(*k) && !taken.contains(k))
                    })
                    .collect(),
            )
            .take(want)
            .map(|(_, k)| k)
            .collect();
            chosen.extend(rest);
        }
        let victims = chosen
            .into_iter()
            .filter_map(|k| {
                let e = self.keys.get(k)?;
                Some(KeyInfo {
                    key: e.name.to_string(),
                    region_id: e.loc.region_id,
                    offset: e.loc.offset,
                    length: e.loc.length,
                })
            })
            .collect();
        Ok(MetaReply::Victims { victims })
    }

    /// Unpublishes keys of the session's regions and frees their pages. A key of
    /// another region, or a leased one, is refused and stays as it is.
    ///
    /// With a durable directory the reply waits for the removal's commit (a key said
    /// removed stays removed after a crash), unless every key removed was published
    /// since the last batch went to the store: its publish and its removal then go in
    /// the same batch, one commit, and a crash loses both, so the reply goes at once
    /// ([`ReplyTiming::Early`]). The pages wait for that commit either way.
    pub(super) fn remove(&mut self, req: Keyed<'_>) -> Result<MetaReply, WireError> {
        let own = self.sessions.checked(req.id)?.regions.clone();
        let page_size = self.cfg.chunk_size;
        let mut results = Vec::with_capacity(req.keys.len());
        let mut freed_in = Vec::new();
        let mut recorded = false;
        for name in req.keys {
            let Some(k) = self.keys.find(req.scope, name) else {
                results.push(RemoveResult::NotFound);
                continue;
            };
            let Some(loc) = self.keys.get(k).map(|e| e.loc) else {
                results.push(RemoveResult::NotFound);
                continue;
            };
            if !own.contains(&loc.region_id) {
                results.push(RemoveResult::NotOwner);
                continue;
            }
            if self.leases.is_leased(k) {
                results.push(RemoveResult::Leased);
                continue;
            }
            if self.pins.is_pinned(k) {
                results.push(RemoveResult::Pinned);
                continue;
            }
            recorded |= !self.keys.unrecorded(k);
            if let Some(e) = self.keys.remove(k) {
                if self.keys.successors_of(e.scope, &e.name) > 0 {
                    // Stored chunks after it can no longer be reached by a load.
                    self.totals.chains_cut += 1;
                }
                self.totals.removed += 1;
            }
            // A published key's page is allocated (publish checks it); it is handed
            // out again once the removal is durable.
            self.free_key_page(loc.region_id, loc.offset / page_size, k, req.scope);
            results.push(RemoveResult::Removed);
            freed_in.push(loc.region_id);
        }
        freed_in.dedup();
        for rid in freed_in {
            self.note_region_use(rid, req.now_ms);
        }
        if !recorded && self.reply_timing() == ReplyTiming::AfterItsChanges {
            self.set_reply_timing(ReplyTiming::Early);
        }
        Ok(MetaReply::Removed { results })
    }
}

impl MetaCore {
    /// Pins each found key once more for the session; a miss is not pinned. Refused
    /// whole when the pins of the tenant's sessions would pass its limit.
    pub(super) fn pin(&mut self, req: Keyed<'_>) -> Result<MetaReply, WireError> {
        let s = self.sessions.checked(req.id)?;
        let found: Vec<Option<(KeyId, u64)>> = req
            .keys
            .iter()
            .map(|k| {
                let kid = self.keys.find(req.scope, k)?;
                Some((kid, self.keys.get(kid)?.loc.region_id))
            })
            .collect();
        let hits: Vec<KeyId> = found.iter().flatten().map(|(k, _)| *k).collect();
        let tenant = &s.tenant;
        let held: usize = self
            .sessions
            .iter()
            .filter(|o| o.tenant == *tenant)
            .map(|o| self.pins.held_by(o.id))
            .sum();
        let asked = self.pins.new_for(req.id, &hits);
        let limit = self.tenants.limits(tenant).max_pins;
        if held + asked > limit {
            let e = PinLimit {
                tenant: tenant.clone(),
                held,
                asked,
                limit,
            };
            return Err(refused(e.to_string()));
        }
        let pinned = found
            .into_iter()
            .map(|f| match f {
                Some((k, rid)) => {
                    self.pins.pin(req.id, k, rid);
                    true
                }
                None => false,
            })
            .collect();
        Ok(MetaReply::Pinned { pinned })
    }

    /// Drops one of the session's pins of each key; false where it held none.
    pub(super) fn unpin(&mut self, req: Keyed<'_>) -> Result<MetaReply, WireError> {
        let unpinned = req
            .keys
            .iter()
            .map(|k| {
                self.keys
                    .find(req.scope, k)
                    .is_some_and(|kid| self.pins.unpin(req.id, kid))
            })
            .collect();
        Ok(MetaReply::Unpinned { unpinned })
    }
}

/// Iterators each in ascending order, merged into one in ascending order: a k-way
/// merge, so taking `n` items of `k` regions costs O((k + n) log k), not the
/// O(k × n) of taking `n` from each and sorting (a pool of many regions evicts often).
struct Merge<I: Iterator>
where
    I::Item: Ord,
{
    heads: BinaryHeap<Reverse<(I::Item, usize)>>,
    iters: Vec<I>,
}

impl<I: Iterator> Merge<I>
where
    I::Item: Ord,
{
    fn new(mut iters: Vec<I>) -> Merge<I> {
        let heads = iters
            .iter_mut()
            .enumerate()
            .filter_map(|(i, it)| it.next().map(|x| Reverse((x, i))))
            .collect();
        Merge { heads, iters }
    }

    fn peek(&self) -> Option<&I::Item> {
        self.heads.peek().map(|Reverse((x, _))| x)
    }
}

impl<I: Iterator> Iterator for Merge<I>
where
    I::Item: Ord,
{
    type Item = I::Item;

    fn next(&mut self) -> Option<I::Item> {
        let Reverse((x, i)) = self.heads.pop()?;
        if let Some(y) = self.iters.get_mut(i).and_then(Iterator::next) {
            self.heads.push(Reverse((y, i)));
        }
        Some(x)
    }
}

#[cfg(test)]
mod tests {
    use super::Merge;
    use proptest::prelude::*;

    proptest! {
        /// The merge of sorted lists is their sorted concatenation, and taking `n`
        /// of it gives the `n` smallest.
        #[test]
        fn a_merge_of_sorted_lists_is_their_sorted_union(
            mut lists in proptest::collection::vec(proptest::collection::vec(0u64..1000, 0..20), 0..12),
            n in 0usize..100,
        ) {
            for l in &mut lists {
                l.sort_unstable();
            }
            let mut all: Vec<u64> = lists.iter().flatten().copied().collect();
            all.sort_unstable();
            let merged: Vec<u64> = Merge::new(lists.iter().map(|l| l.iter().copied()).collect()).collect();
            prop_assert_eq!(&merged, &all);
            let first: Vec<u64> = Merge::new(lists.iter().map(|l| l.iter().copied()).collect()).take(n).collect();
            prop_assert_eq!(&first[..], &all[..n.min(all.len())]);
        }
    }
}
