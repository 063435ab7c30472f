//! Regions maru-server got from the RM: their handles, pages, agent and who holds
//! them now (a session, the region keeper, or nobody while they go back).

use super::pages::PageAllocator;
use crate::wire::meta::{Backend, DeviceRange, RegionGrant};
use crate::wire::rm::{Handle, PoolInfo};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Owned by a live session: it allocates, publishes and evicts in it.
    Session(u64),
    /// Its owner left; the region keeper keeps it readable.
    Keeper,
    /// On its way back (release at the agent, then free at the RM): no key of it is
    /// found, no lease on it is left, no page of it is handed out.
    GivingBack,
}

#[derive(Debug, Clone)]
pub struct Region {
    pub handle: Handle,
    pub pool: PoolInfo,
    /// The agent serving the region (`remote_cxl`).
    pub agent: Option<String>,
    pub backend: Backend,
    pub pages: PageAllocator,
    pub holder: Holder,
    /// When a key of it was last acquired (or when it was allocated).
    pub last_read_ms: u64,
    /// The memory node's boot id its owner last reported.
    pub boot_id: Option<String>,
    /// Since when its session has held it without a page taken or a key in it (None
    /// while it holds one, or when no session holds it): a region held unused for
    /// the unused-region limit goes back.
    pub unused_since_ms: Option<u64>,
}

impl Region {
    /// Notes at `now_ms` whether the region is in use (a page taken or a key in it,
    /// or a freed page not handed out again yet: a reader of the last run may still
    /// read it, so the region does not go back either).
    pub fn note_use(&mut self, now_ms: u64) {
        self.unused_since_ms = if self.pages.in_use() > 0 {
            None
        } else {
            self.unused_since_ms.or(Some(now_ms))
        };
    }

    pub fn grant(&self, page_size: u64) -> RegionGrant {
        RegionGrant {
            handle: self.handle.clone(),
            pool: self.pool.clone(),
            agent: self.agent.clone(),
            page_size,
            pages: self.pages.pages(),
        }
    }

    pub fn device_range(&self) -> DeviceRange {
        DeviceRange {
            uuid: self.pool.uuid.clone(),
            path: self.pool.path.clone(),
            region_offset: self.handle.offset,
            region_length: self.handle.length,
        }
    }
}

/// The agent that serves a region: the region id hashed over the agent list, so
/// regions spread over a shared pool's memory nodes. None without agents.
pub fn agent_for(region_id: u64, agents: &[String]) -> Option<String> {
    if agents.is_empty() {
        return None;
    }
    let i = (splitmix64(region_id) % agents.len() as u64) as usize;
    agents.get(i).cloned()
}

/// A fixed 64-bit mix (splitmix64's finaliser): stable across builds and runs.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Debug, Default)]
pub struct RegionTable {
    regions: BTreeMap<u64, Region>,
    /// Regions changed since the last [`take_dirty`](Self::take_dirty), when the
    /// table is kept durable: every insert, remove and `get_mut` counts.
    dirty: Option<BTreeSet<u64>>,
    changes: u64,
}

impl RegionTable {
    pub fn new() -> RegionTable {
        RegionTable::default()
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.regions.contains_key(&id)
    }

    pub fn insert(&mut self, region: Region) {
        self.mark(region.handle.region_id);
        self.regions.insert(region.handle.region_id, region);
    }

    /// Records which regions change from now on.
    pub fn keep_journal(&mut self) {
        self.dirty.get_or_insert_with(BTreeSet::new);
    }

    fn mark(&mut self, id: u64) {
        if let Some(d) = &mut self.dirty {
            d.insert(id);
            self.changes += 1;
        }
    }

    /// Records `id` as changed (its next record carries its pages).
    pub fn mark_dirty(&mut self, id: u64) {
        if self.regions.contains_key(&id) {
            self.mark(id);
        }
    }

    /// Changes so far.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Regions changed since the last call.
    pub fn take_dirty(&mut self) -> BTreeSet<u64> {
        self.dirty.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The region, for a change of what is not kept durable (when it was last read,
    /// whether it is in use; pages put back).
    pub fn get_mut_quiet(&mut self, id: u64) -> Option<&mut Region> {
        self.regions.get_mut(&id)
    }

    pub fn get(&self, id: u64) -> Option<&Region> {
        self.regions.get(&id)
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut Region> {
        if self.regions.contains_key(&id) {
            self.mark(id);
        }
        self.regions.get_mut(&id)
    }

    pub fn remove(&mut self, id: u64) -> Option<Region> {
        let r = self.regions.remove(&id);
        if r.is_some() {
            self.mark(id);
        }
        r
    }

    pub fn iter(&self) -> impl Iterator<Item = &Region> {
        self.regions.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_spread_over_agents_and_stay_put() {
        let agents: Vec<String> = (0..3).map(|i| format!("10.0.0.{i}:9860")).collect();
        assert_eq!(agent_for(5, &[]), None);
        let mut seen = std::collections::BTreeSet::new();
        for id in 1..64 {
            let a = agent_for(id, &agents).unwrap();
            assert_eq!(agent_for(id, &agents).as_ref(), Some(&a), "stable");
            seen.insert(a);
        }
        assert_eq!(seen.len(), 3, "every agent serves some regions");
        // Fixed values: the choice must not change between builds.
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
    }
}
