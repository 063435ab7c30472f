//! The slot API's bookkeeping: slots lent to an operation and taken back, also when
//! it fails or is submitted to run later.

use super::{Inner, LentJob};
use crate::worker::error::WorkerError;
use crate::worker::key::Key;
use crate::worker::ops::OpHandle;
use crate::worker::slots::SlotTable;
use crate::worker::staging::{Slot, StagingSlots};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

impl Inner {
    pub(super) fn slot_table(&self) -> Result<std::sync::MutexGuard<'_, SlotTable>, WorkerError> {
        self.slots.lock().map_err(|_| WorkerError::Closed)
    }

    pub(super) fn staging(&self) -> Result<StagingSlots, WorkerError> {
        self.data
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .as_ref()
            .map(|d| d.staging.clone())
            .ok_or_else(|| WorkerError::unavailable(
                    crate::worker::error::Peer::Host,
                    "no pool has been reached yet: the staging buffer is made from the first pool's page size",
                ))
    }

    /// Marks the caller's slots busy and hands them over (at once, also for a submitted
    /// operation, so a release racing with it is refused rather than lost).
    pub(super) fn lend(&self, ids: &[u64]) -> Result<Vec<Option<Slot>>, WorkerError> {
        self.slot_table()?.take(ids)
    }

    /// Runs `f` on lent slots and takes back whatever it hands back, also on error.
    pub(super) fn with_lent<T>(
        &self,
        ids: &[u64],
        mut lent: Vec<Option<Slot>>,
        f: impl FnOnce(&mut [Option<Slot>]) -> Result<T, WorkerError>,
    ) -> Result<T, WorkerError> {
        let r = f(&mut lent);
        match self.slot_table() {
            Ok(mut t) => t.give_back(ids, lent),
            Err(_) => drop(lent),
        }
        r
    }

    pub(super) fn store_slots<K: Key>(
        &self,
        keys: &[K],
        ids: &[u64],
        lent: Vec<Option<Slot>>,
        lens: &[usize],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        // Every check inside: lent slots must go back to the table whatever happens.
        self.with_lent(ids, lent, |slots| {
            if keys.len() != ids.len() || keys.len() != lens.len() {
                return Err(WorkerError::InvalidArgument(format!(
                    "{} keys, {} slots and {} lengths: give one slot and length per key",
                    keys.len(),
                    ids.len(),
                    lens.len()
                )));
            }
            let Some(first) = keys.first() else {
                return Ok(Vec::new());
            };
            let rk = route_key.unwrap_or(first.as_ref());
            for (i, s) in slots.iter().enumerate() {
                let cap = s.as_ref().map_or(0, |s| s.len());
                if lens[i] > cap {
                    return Err(WorkerError::InvalidArgument(format!(
                        "lens[{i}] = {} is larger than slot {} ({cap} bytes)",
                        lens[i], ids[i]
                    )));
                }
            }
            let ks: Vec<&str> = keys.iter().map(K::as_ref).collect();
            self.store_on_pool(rk, keys.len(), |p| {
                p.store_slots(&ks, slots, lens, Some(rk))
            })
        })
    }

    pub(super) fn load_slots<K: Key>(
        &self,
        keys: &[K],
        ids: &[u64],
        lent: Vec<Option<Slot>>,
        route_key: Option<&str>,
    ) -> Result<Vec<Option<usize>>, WorkerError> {
        self.with_lent(ids, lent, |slots| {
            if keys.len() != ids.len() {
                return Err(WorkerError::InvalidArgument(format!(
                    "{} keys but {} slots: give one slot per key",
                    keys.len(),
                    ids.len()
                )));
            }
            let Some(first) = keys.first() else {
                return Ok(Vec::new());
            };
            let rk = route_key.unwrap_or(first.as_ref());
            self.with_pool(rk, vec![None; keys.len()], |p| p.load_slots(keys, slots))
        })
    }

    /// Queues `job` with the slots already lent to it; if it cannot be queued, the
    /// slots go back to the caller.
    pub(super) fn submit(
        &self,
        ids: &[u64],
        lent: Vec<Option<Slot>>,
        job: LentJob,
    ) -> Result<OpHandle, WorkerError> {
        let give_back = |lent: Vec<Option<Slot>>| {
            if let Ok(mut t) = self.slot_table() {
                t.give_back(ids, lent);
            }
        };
        if self.stop.load(Ordering::SeqCst) {
            give_back(lent);
            return Err(WorkerError::Closed);
        }
        // The slots travel with the job; a job that is dropped unrun (queue closed)
        // drops them into their pool, and close clears the table anyway.
        let cell = Arc::new(Mutex::new(Some(lent)));
        let mine = cell.clone();
        let r = self.executor.submit(Box::new(move || {
            let lent = mine
                .lock()
                .ok()
                .and_then(|mut l| l.take())
                .unwrap_or_default();
            job(lent)
        }));
        if r.is_err() {
            if let Some(lent) = cell.lock().ok().and_then(|mut l| l.take()) {
                give_back(lent);
            }
        }
        r
    }
}
