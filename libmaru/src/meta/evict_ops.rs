//! Eviction: victims and remove act only on keys of the caller's own regions, and
//! never on a leased key.

use super::core::MetaCore;
use super::errors::{check_batch, check_keys};
use crate::wire::meta::{KeyInfo, MetaReply, RemoveResult};
use crate::wire::WireError;

impl MetaCore {
    /// Up to `max` unleased keys of the session's regions, least recently used first.
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
        // The `max` oldest unleased keys of each region, then the oldest of those.
        let mut candidates: Vec<_> = s
            .regions
            .iter()
            .flat_map(|&rid| {
                self.keys
                    .lru(rid)
                    .filter(|(_, k)| !self.leases.is_leased(*k))
                    .take(max)
            })
            .collect();
        candidates.sort_unstable();
        candidates.truncate(max);
        let victims = candidates
            .into_iter()
            .filter_map(|(_, k)| {
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
            self.keys.remove(k);
            if let Some(r) = self.regions.get_mut(loc.region_id) {
                // A published key's page is allocated (publish checks it).
                let _ = r.pages.free(loc.offset / page_size);
            }
            results.push(RemoveResult::Removed);
        }
        Ok(MetaReply::Removed { results })
    }
}
