//! Handles this agent released: later maps of them are refused.
//!
//! After a release the owner gives the region back; until the RM stops accepting
//! its handle, a late map (a retry, a reader's keeper) would register the range
//! again and let the old owner's WRITEs in. Entries are whole handles compared in
//! constant time, so a release with a made-up token blocks nothing real.

use crate::auth::token_matches;
use crate::wire::rm::Handle;
use std::collections::BTreeMap;

#[derive(Debug)]
struct Entry {
    handle: Handle,
    /// Whether a mapping of it was deregistered (what a repeated release reports).
    deregistered: bool,
}

#[derive(Debug, Default)]
pub(crate) struct ReleasedHandles {
    by_region: BTreeMap<u64, Vec<Entry>>,
}

/// The same region, range and token.
pub(crate) fn same_handle(a: &Handle, b: &Handle) -> bool {
    a.region_id == b.region_id
        && a.offset == b.offset
        && a.length == b.length
        && token_matches(&a.token, &b.token)
}

impl ReleasedHandles {
    /// Records a release. Returns whether a mapping of the handle was deregistered
    /// by this release or an earlier one.
    pub fn insert(&mut self, handle: &Handle, deregistered: bool) -> bool {
        let list = self.by_region.entry(handle.region_id).or_default();
        match list.iter_mut().find(|e| same_handle(&e.handle, handle)) {
            Some(e) => {
                e.deregistered |= deregistered;
                e.deregistered
            }
            None => {
                list.push(Entry {
                    handle: handle.clone(),
                    deregistered,
                });
                deregistered
            }
        }
    }

    pub fn contains(&self, handle: &Handle) -> bool {
        self.by_region
            .get(&handle.region_id)
            .is_some_and(|l| l.iter().any(|e| same_handle(&e.handle, handle)))
    }

    /// Forgets a handle the RM refused: the RM refuses it for good (a freed region's
    /// id and token are not given out again), so its holds fail there already.
    pub fn forget(&mut self, handle: &Handle) {
        if let Some(list) = self.by_region.get_mut(&handle.region_id) {
            list.retain(|e| !same_handle(&e.handle, handle));
            if list.is_empty() {
                self.by_region.remove(&handle.region_id);
            }
        }
    }

    /// Every released handle (a copy: checking them may forget some).
    pub fn handles(&self) -> Vec<Handle> {
        self.by_region
            .values()
            .flatten()
            .map(|e| e.handle.clone())
            .collect()
    }
}
