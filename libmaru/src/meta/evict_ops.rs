//! Eviction: victims and remove act only on keys of the caller's own regions, and
//! never on a leased or pinned key. Victims come tail of a prefix chain first. Pins: any session of the key's scope may pin it.

use super::config::VictimOrder;
use super::core::MetaCore;
use super::errors::{check_batch, check_keys, refused};
use super::keys::KeyId;
use crate::wire::meta::{KeyInfo, MetaReply, RemoveResult};
use crate::wire::WireError;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

impl MetaCore {
    /// Up to `max` keys of the session's regions that no lease or pin holds, in the
    /// order they should go: with [`VictimOrder::PrefixAware`], tails of prefix
    /// chains first (least recently used first), a chunk offered only once every
    /// stored chunk after it is offered before it; then, if that is not `max`, the
    /// rest least recently used first. With [`VictimOrder::Lru`], least recently
    /// used first.
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
        if self.cfg.victim_order == VictimOrder::PrefixAware {
            // Oldest tail first; a chosen tail's predecessor joins once every stored
            // successor of it is chosen.
            let mut heap: BinaryHeap<Reverse<(u64, KeyId)>> = s
                .regions
                .iter()
                .flat_map(|&rid| self.keys.tails(rid).filter(|(_, k)| free(*k)).take(max))
                .map(Reverse)
                .collect();
            let mut chosen_successors: HashMap<&str, u32> = HashMap::new();
            while chosen.len() < max {
                let Some(Reverse((_, k))) = heap.pop() else {
                    break;
                };
                if !taken.insert(k) {
                    continue;
                }
                chosen.push(k);
                let Some(e) = self.keys.get(k) else { continue };
                let Some(prev) = e.prev.as_deref() else {
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
                    heap.push(Reverse((pe.used(), pk)));
                }
            }
        }
        if chosen.len() < max {
            // The `max` oldest of each region, then the oldest of those.
            let mut rest: Vec<(u64, KeyId)> = s
                .regions
                .iter()
                .flat_map(|&rid| {
                    self.keys
                        .lru(rid)
                        .filter(|(_, k)| free(*k) && !taken.contains(k))
                        .take(max)
                })
                .collect();
            rest.sort_unstable();
            chosen.extend(rest.into_iter().map(|(_, k)| k).take(max - chosen.len()));
        }
        let victims = chosen
            .into_iter()
            .filter_map(|k| {
                let e = self.keys.get(k)?;
                Some(KeyInfo {
                    key: e.name.clone(),
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
    pub(super) fn remove(
        &mut self,
        client_id: &str,
        session: u64,
        keys: &[String],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_keys(keys)?;
        let id = self.session(client_id, session, now_ms)?;
        let s = self.sessions.checked(id)?;
        let page_size = self.cfg.chunk_size;
        let mut results = Vec::with_capacity(keys.len());
        for name in keys {
            let Some(k) = self.keys.find(s.scope, name) else {
                results.push(RemoveResult::NotFound);
                continue;
            };
            let Some(loc) = self.keys.get(k).map(|e| e.loc) else {
                results.push(RemoveResult::NotFound);
                continue;
            };
            if !s.regions.contains(&loc.region_id) {
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
            if let Some(e) = self.keys.remove(k) {
                if self.keys.successors_of(e.scope, &e.name) > 0 {
                    // Stored chunks after it can no longer be reached by a load.
                    self.totals.chains_cut += 1;
                }
                self.totals.removed += 1;
            }
            if let Some(r) = self.regions.get_mut(loc.region_id) {
                // A published key's page is allocated (publish checks it).
                let _ = r.pages.free(loc.offset / page_size);
            }
            results.push(RemoveResult::Removed);
        }
        Ok(MetaReply::Removed { results })
    }
}

impl MetaCore {
    /// Pins each found key once more for the session; a miss is not pinned. Refused
    /// whole when the session would pin more than its limit of distinct keys.
    pub(super) fn pin(
        &mut self,
        client_id: &str,
        session: u64,
        keys: &[String],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_keys(keys)?;
        let id = self.session(client_id, session, now_ms)?;
        let s = self.sessions.checked(id)?;
        let found: Vec<Option<(KeyId, u64)>> = keys
            .iter()
            .map(|k| {
                let kid = self.keys.find(s.scope, k)?;
                Some((kid, self.keys.get(kid)?.loc.region_id))
            })
            .collect();
        let hits: Vec<KeyId> = found.iter().flatten().map(|(k, _)| *k).collect();
        self.pins
            .check_room(id, &hits)
            .map_err(|e| refused(e.to_string()))?;
        let pinned = found
            .into_iter()
            .map(|f| match f {
                Some((k, rid)) => {
                    self.pins.pin(id, k, rid);
                    true
                }
                None => false,
            })
            .collect();
        Ok(MetaReply::Pinned { pinned })
    }

    /// Drops one of the session's pins of each key; false where it held none.
    pub(super) fn unpin(
        &mut self,
        client_id: &str,
        session: u64,
        keys: &[String],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_keys(keys)?;
        let id = self.session(client_id, session, now_ms)?;
        let scope = self.sessions.checked(id)?.scope;
        let unpinned = keys
            .iter()
            .map(|k| {
                self.keys
                    .find(scope, k)
                    .is_some_and(|kid| self.pins.unpin(id, kid))
            })
            .collect();
        Ok(MetaReply::Unpinned { unpinned })
    }
}
