//! The staging slots a caller holds through the slot API, by id (never reused). A slot
//! lent to an operation is `Busy` until it comes back; one whose transfer outcome was
//! unknown is taken back by libmaru (back in its pool after the peer's fence).

use super::error::WorkerError;
use super::staging::{Slot, SlotPool};
use std::collections::{HashMap, HashSet};

/// What the caller gets for one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInfo {
    pub id: u64,
    pub ptr: *mut u8,
    pub capacity: usize,
    pub pool: SlotPool,
}

enum Entry {
    Idle(Slot),
    Busy,
}

#[derive(Default)]
pub struct SlotTable {
    next: u64,
    held: HashMap<u64, Entry>,
    /// Ids libmaru took back after a transfer whose outcome was unknown: releasing one
    /// is accepted once (the caller cannot tell them apart by itself), then forgotten.
    taken_back: HashSet<u64>,
}

impl SlotTable {
    pub fn insert(&mut self, slot: Slot) -> SlotInfo {
        self.next += 1;
        let info = SlotInfo {
            id: self.next,
            ptr: slot.as_ptr(),
            capacity: slot.len(),
            pool: slot.pool(),
        };
        self.held.insert(info.id, Entry::Idle(slot));
        info
    }

    /// Lends the slots to an operation (all or none).
    pub fn take(&mut self, ids: &[u64]) -> Result<Vec<Option<Slot>>, WorkerError> {
        for (i, id) in ids.iter().enumerate() {
            match self.held.get(id) {
                Some(Entry::Idle(_)) => {}
                Some(Entry::Busy) => {
                    return Err(WorkerError::Busy(format!(
                        "slot {id} is in use by another operation"
                    )))
                }
                None => {
                    return Err(WorkerError::InvalidArgument(format!(
                        "slot {id} is not held by this handler (never acquired, released, or taken back after a transfer whose outcome was unknown)"
                    )))
                }
            }
            if ids[..i].contains(id) {
                return Err(WorkerError::InvalidArgument(format!(
                    "slot {id} appears twice in one call"
                )));
            }
        }
        Ok(ids
            .iter()
            .map(|id| match self.held.insert(*id, Entry::Busy) {
                Some(Entry::Idle(s)) => Some(s),
                _ => None,
            })
            .collect())
    }

    /// Takes the slots back from an operation: `None` means libmaru kept the slot.
    pub fn give_back(&mut self, ids: &[u64], slots: Vec<Option<Slot>>) {
        for (id, s) in ids.iter().zip(slots) {
            match s {
                Some(s) => {
                    self.held.insert(*id, Entry::Idle(s));
                }
                None => {
                    self.held.remove(id);
                    self.taken_back.insert(*id);
                }
            }
        }
    }

    /// Returns slots to their pools, all or none: one lent is `Busy`, an unknown id
    /// `InvalidArgument`; an id libmaru took back is accepted once.
    pub fn release(&mut self, ids: &[u64]) -> Result<(), WorkerError> {
        for (i, id) in ids.iter().enumerate() {
            match self.held.get(id) {
                Some(Entry::Busy) => {
                    return Err(WorkerError::Busy(format!(
                        "slot {id} is in use by an operation: wait for it before releasing"
                    )))
                }
                Some(Entry::Idle(_)) if !ids[..i].contains(id) => {}
                None if self.taken_back.contains(id) && !ids[..i].contains(id) => {}
                _ => {
                    return Err(WorkerError::InvalidArgument(format!(
                        "slot {id} is not held by this handler (never acquired, already released, or listed twice); nothing was released"
                    )))
                }
            }
        }
        for id in ids {
            self.held.remove(id);
            self.taken_back.remove(id);
        }
        Ok(())
    }

    pub fn contains(&self, id: u64) -> bool {
        self.held.contains_key(&id)
    }

    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Drops every slot (close).
    pub fn clear(&mut self) {
        self.held.clear();
        self.taken_back.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::staging::{StagingLayout, StagingSlots};

    #[test]
    fn lend_give_back_release_and_stale_ids() {
        let st = StagingSlots::new(StagingLayout {
            slot_size: 4096,
            load_slots: 2,
            store_slots: 1,
        })
        .unwrap();
        let mut t = SlotTable::default();
        let a = t.insert(st.try_acquire(SlotPool::Load, 1).pop().unwrap());
        let b = t.insert(st.try_acquire(SlotPool::Load, 1).pop().unwrap());
        assert_ne!(a.id, b.id);
        assert!(matches!(
            t.take(&[a.id, a.id]),
            Err(WorkerError::InvalidArgument(_))
        ));
        let lent = t.take(&[a.id, b.id]).unwrap();
        assert!(matches!(t.release(&[a.id]), Err(WorkerError::Busy(_))));
        assert!(matches!(t.take(&[b.id]), Err(WorkerError::Busy(_))));
        // b's transfer had an unknown outcome: libmaru keeps it.
        let mut lent = lent;
        let kept = lent[1].take();
        t.give_back(&[a.id, b.id], lent);
        assert_eq!(t.held(), 1);
        assert!(matches!(
            t.take(&[b.id]),
            Err(WorkerError::InvalidArgument(_))
        ));
        t.release(&[b.id]).unwrap(); // taken back: releasing it is accepted once
        assert!(
            matches!(t.release(&[b.id]), Err(WorkerError::InvalidArgument(_))),
            "a second release of a taken-back id is refused"
        );
        drop(kept);
        // A new slot never gets an old id.
        let c = t.insert(st.try_acquire(SlotPool::Load, 1).pop().unwrap());
        assert!(c.id > b.id);
        assert!(
            matches!(
                t.release(&[a.id, 999]),
                Err(WorkerError::InvalidArgument(_))
            ),
            "an unknown id is refused"
        );
        assert!(t.contains(a.id), "all or nothing: a is still held");
        t.release(&[a.id, c.id]).unwrap();
        assert!(
            matches!(t.release(&[a.id]), Err(WorkerError::InvalidArgument(_))),
            "a double release is refused"
        );
        assert_eq!(t.held(), 0);
        assert_eq!(st.free(SlotPool::Load), 2);
    }
}
