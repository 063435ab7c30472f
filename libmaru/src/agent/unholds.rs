//! Unholds the resource manager has not confirmed.
//!
//! A region's unhold goes to the RM only after every registration of the region is
//! deregistered. When the RM does not answer, or answers with anything but a
//! refusal, the hold may still be recorded there, so the unhold stays queued and the
//! sweep sends it again; forgetting it would keep the region's range from ever
//! being reused. A refusal means nothing is held, so it ends the entry as an
//! acknowledgement does.

use std::collections::BTreeSet;

/// Region ids whose unhold is still owed to the RM.
#[derive(Debug, Default)]
pub(crate) struct UnholdQueue {
    regions: BTreeSet<u64>,
}

impl UnholdQueue {
    /// Owes the RM the unhold of `region_id`.
    pub fn queue(&mut self, region_id: u64) {
        self.regions.insert(region_id);
    }

    /// A new hold of the region succeeded: the queued unhold would now remove the
    /// hold the new mapping relies on, so it goes. Called only after the RM
    /// confirmed the hold; a refused or failed hold leaves the unhold queued (a
    /// draining region refuses holds, and its old hold still needs the unhold).
    ///
    /// The RM records one hold per (region, node, epoch), whatever handle took it,
    /// so the entry goes whichever handle queued it.
    pub fn hold_confirmed(&mut self, region_id: u64) {
        self.regions.remove(&region_id);
    }

    /// The RM acknowledged or refused the unhold.
    pub fn done(&mut self, region_id: u64) {
        self.regions.remove(&region_id);
    }

    pub fn contains(&self, region_id: u64) -> bool {
        self.regions.contains(&region_id)
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// The queued region ids, in order (a copy: sending changes the queue).
    pub fn pending(&self) -> Vec<u64> {
        self.regions.iter().copied().collect()
    }
}
