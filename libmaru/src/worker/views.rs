//! Views a caller holds (`cxl`): chunks in place in this host's mapping, each under a
//! lease until released (or timed out). Ids are never reused.

use super::movers::View;
use std::collections::HashMap;

/// What the caller gets for one view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewInfo {
    pub id: u64,
    pub ptr: *const u8,
    pub len: usize,
    /// The lease ends by itself this long after it was granted: the bytes may belong
    /// to another key after that, so release the view before.
    pub valid_ms: u64,
}

/// A view's lease: which route (pool) granted it, and its id there.
pub struct Held {
    pub route: String,
    pub lease_id: u64,
    /// Keeps the mapping of the view's bytes alive.
    _view: View,
}

#[derive(Default)]
pub struct ViewTable {
    next: u64,
    held: HashMap<u64, Held>,
}

impl ViewTable {
    pub fn insert(&mut self, route: &str, lease_id: u64, valid_ms: u64, view: View) -> ViewInfo {
        self.next += 1;
        let b = view.bytes();
        let info = ViewInfo {
            id: self.next,
            ptr: b.as_ptr(),
            len: b.len(),
            valid_ms,
        };
        self.held.insert(
            info.id,
            Held {
                route: route.to_string(),
                lease_id,
                _view: view,
            },
        );
        info
    }

    /// Takes the views out (unknown ids are ignored: already released).
    pub fn take(&mut self, ids: &[u64]) -> Vec<Held> {
        ids.iter().filter_map(|id| self.held.remove(id)).collect()
    }

    pub fn held(&self) -> usize {
        self.held.len()
    }

    pub fn clear(&mut self) -> Vec<Held> {
        self.held.drain().map(|(_, h)| h).collect()
    }
}
