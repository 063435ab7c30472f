//! Deregistered ranges kept mapped with no access until their quarantine ends.
//!
//! A NIC can hand out the same remote key when the same address range is
//! registered again. If a deregistered range were unmapped at once, the next
//! mapping could land at the same addresses, its registration get the old key, and
//! a WRITE still in flight from the range's old owner would land in the new
//! region. Keeping the old range mapped (PROT_NONE) keeps its addresses taken, so no
//! registration reuses them until the quarantine ends.

use super::ports::{MappedRange, MemPort};

#[derive(Debug, Clone, Copy)]
struct Entry {
    region_id: u64,
    range: MappedRange,
    until_ms: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Quarantine {
    entries: Vec<Entry>,
}

impl Quarantine {
    /// Takes every access away from a deregistered range and keeps it mapped until
    /// `until_ms`. A failed protect_none is logged and the range is kept all the
    /// same: its addresses staying taken is what the quarantine is for.
    pub fn enter(
        &mut self,
        region_id: u64,
        range: MappedRange,
        until_ms: u64,
        mem: &mut dyn MemPort,
    ) {
        if let Err(e) = mem.protect_none(range.id) {
            log::warn!(
                "region {region_id}: cannot take access away from its deregistered range \
                 (mapping {}): {e}; it stays mapped until its quarantine ends",
                range.id
            );
        }
        self.entries.push(Entry {
            region_id,
            range,
            until_ms,
        });
    }

    /// Unmaps the ranges whose quarantine has ended by `now_ms`.
    pub fn expire(&mut self, now_ms: u64, mem: &mut dyn MemPort) {
        self.entries.retain(|e| {
            if e.until_ms > now_ms {
                return true;
            }
            log::debug!(
                "region {}: quarantine over, unmapping its range",
                e.region_id
            );
            mem.unmap(e.range.id);
            false
        });
    }

    /// When the next quarantine ends.
    pub fn next_end(&self) -> Option<u64> {
        self.entries.iter().map(|e| e.until_ms).min()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
}
