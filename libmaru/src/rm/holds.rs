//! Which agents still have a region registered with their NIC.
//!
//! An agent records a hold before it registers a region and drops it only after the
//! NIC deregistered it. The resource manager hands a range out again only when no
//! hold is left on it: otherwise an RDMA WRITE still in flight through an old
//! registration could land in the range's next owner. A hold is (node, epoch): an
//! agent restarted with a new epoch clears the holds of its old epochs, whose
//! registrations died with the old process.

use crate::wire::rm::HoldInfo;
use std::collections::{BTreeMap, BTreeSet};

/// region id → the (node, epoch) pairs holding it.
#[derive(Debug, Clone, Default)]
pub struct HoldLedger {
    by_region: BTreeMap<u64, BTreeSet<(String, u64)>>,
}

impl HoldLedger {
    pub fn new() -> HoldLedger {
        HoldLedger::default()
    }

    /// Records a hold. Returns false when it was already there.
    pub fn hold(&mut self, region_id: u64, node: &str, epoch: u64) -> bool {
        self.by_region
            .entry(region_id)
            .or_default()
            .insert((node.to_string(), epoch))
    }

    /// Drops one hold. Returns false when it was not there.
    pub fn unhold(&mut self, region_id: u64, node: &str, epoch: u64) -> bool {
        let Some(set) = self.by_region.get_mut(&region_id) else {
            return false;
        };
        let removed = set.remove(&(node.to_string(), epoch));
        if set.is_empty() {
            self.by_region.remove(&region_id);
        }
        removed
    }

    /// Drops `node`'s holds from epochs before `epoch`; returns what it dropped.
    pub fn reset(&mut self, node: &str, epoch: u64) -> Vec<HoldInfo> {
        self.remove_where(|n, e| n == node && e < epoch)
    }

    /// Drops every hold of `node`, whatever its epoch; returns what it dropped.
    pub fn drop_node(&mut self, node: &str) -> Vec<HoldInfo> {
        self.remove_where(|n, _| n == node)
    }

    /// How many holds the region has.
    pub fn count(&self, region_id: u64) -> usize {
        self.by_region.get(&region_id).map_or(0, BTreeSet::len)
    }

    pub fn is_held(&self, region_id: u64) -> bool {
        self.count(region_id) > 0
    }

    pub fn contains(&self, region_id: u64, node: &str, epoch: u64) -> bool {
        self.by_region
            .get(&region_id)
            .is_some_and(|s| s.contains(&(node.to_string(), epoch)))
    }

    /// The holds of one region, (node, epoch) order.
    pub fn holders(&self, region_id: u64) -> Vec<HoldInfo> {
        self.by_region
            .get(&region_id)
            .into_iter()
            .flatten()
            .map(|(node, epoch)| HoldInfo {
                region_id,
                node: node.clone(),
                epoch: *epoch,
            })
            .collect()
    }

    /// Every hold (or those of `node`), region order.
    pub fn list(&self, node: Option<&str>) -> Vec<HoldInfo> {
        self.by_region
            .iter()
            .flat_map(|(&region_id, set)| {
                set.iter().map(move |(n, e)| HoldInfo {
                    region_id,
                    node: n.clone(),
                    epoch: *e,
                })
            })
            .filter(|h| match node {
                Some(n) => h.node == n,
                None => true,
            })
            .collect()
    }

    fn remove_where(&mut self, pred: impl Fn(&str, u64) -> bool) -> Vec<HoldInfo> {
        let mut removed = Vec::new();
        self.by_region.retain(|&region_id, set| {
            set.retain(|(n, e)| {
                let drop = pred(n, *e);
                if drop {
                    removed.push(HoldInfo {
                        region_id,
                        node: n.clone(),
                        epoch: *e,
                    });
                }
                !drop
            });
            !set.is_empty()
        });
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ledger with each `(region, node, epoch)` of `holds` held.
    fn holding(holds: &[(u64, &str, u64)]) -> HoldLedger {
        let mut l = HoldLedger::new();
        for &(region, node, epoch) in holds {
            assert!(l.hold(region, node, epoch));
        }
        l
    }

    #[test]
    fn hold_is_idempotent_per_node_and_epoch() {
        let mut l = HoldLedger::new();
        assert!(l.hold(1, "a", 1));
        assert!(!l.hold(1, "a", 1));
        assert!(l.hold(1, "a", 2));
        assert!(l.hold(1, "b", 1));
        assert_eq!(l.count(1), 3);
        assert!(l.unhold(1, "a", 1));
        assert!(!l.unhold(1, "a", 1));
        assert!(!l.unhold(9, "a", 1));
        assert_eq!(l.count(1), 2);
        assert!(l.contains(1, "b", 1));
        assert!(!l.contains(1, "a", 1));
    }

    #[test]
    fn reset_drops_only_older_epochs_of_that_node() {
        let mut l = holding(&[(1, "a", 1), (2, "a", 2), (3, "a", 3), (1, "b", 1)]);
        let removed = l.reset("a", 3);
        assert_eq!(removed.len(), 2);
        assert!(removed.iter().all(|h| h.node == "a" && h.epoch < 3));
        assert!(!l.is_held(2));
        assert!(l.is_held(3));
        assert_eq!(l.holders(1).len(), 1);
        assert_eq!(l.list(Some("a")).len(), 1);
        assert_eq!(l.list(None).len(), 2);
    }

    #[test]
    fn drop_node_drops_every_epoch() {
        let mut l = holding(&[(1, "a", 1), (1, "a", 7), (2, "b", 1)]);
        assert_eq!(l.drop_node("a").len(), 2);
        assert!(!l.is_held(1));
        assert!(l.is_held(2));
        assert!(l.drop_node("a").is_empty());
    }
}
