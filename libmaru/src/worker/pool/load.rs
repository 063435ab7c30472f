//! Loads of a pool: leases → the mover reads (or, on `cxl`, views in place) → the
//! leases are released, before the call returns or after it ([`Release`]). A read
//! that fails says why in the pool's stats. The leases are taken and released without
//! a pool lock; on `cxl` the copies run without one too (each view keeps its mapping
//! alive, each lease its page from reuse).
//!
//! Leases released after the call (`maru_load_pieces`) wait in the handler's
//! [`ReleaseQueue`], sent by its `maru-release` thread ([`ReleaseQueue::send`]). At
//! most [`super::MAX_QUEUED_RELEASES`] wait; a full queue makes the load release inline. At
//! close the queue is sent, all of it by one `timeout_ms` deadline, before the
//! sessions close.

use super::deferred::Deferred;
use super::{LeaseReader, StoragePool};
use crate::wire::meta::LeaseGrant;
use crate::worker::clock::Deadline;
use crate::worker::error::WorkerError;
use crate::worker::movers::{ReadSink, View};
use crate::worker::staging::Slot;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// How a load's leases end once its bytes are handed over.
#[derive(Clone, Copy)]
pub enum Release<'q> {
    /// Released before the call returns.
    Now,
    /// Queued for the handler's `maru-release` thread, so the call does not wait for
    /// that round trip (`maru_load_pieces`); released now when the queue is full or
    /// closing.
    After(&'q ReleaseQueue),
}

/// The leases of loads that returned, each with its pool, for the release thread.
pub type ReleaseQueue = Deferred<(Arc<StoragePool>, Vec<u64>)>;

impl ReleaseQueue {
    /// The release thread: sends each queued release with the session's own call
    /// timeout; once the queue is closed, what is left by one deadline `drain` from
    /// then. Returns when the queue is closed and empty.
    pub fn send(&self, drain: Duration) {
        let mut drain_by: Option<Deadline> = None;
        while let Some(((pool, ids), closing)) = self.next() {
            let by = match closing {
                true => *drain_by.get_or_insert_with(|| Deadline::after(drain)),
                false => pool.session.call_deadline(),
            };
            pool.release_leases(ids, by);
        }
    }
}

impl StoragePool {
    /// Loads chunks, handing each found chunk's bytes to `sink(i, bytes)` (a view valid
    /// during the call). Chunks not handed over missed or failed. The leases end as
    /// `release` says, also when a batch failed.
    pub fn load<K: Serialize>(
        self: &Arc<Self>,
        keys: &[K],
        sink: &mut ReadSink<'_>,
        release: Release<'_>,
    ) -> Result<(), WorkerError> {
        let by = self.deadline();
        let mut held = Vec::new();
        let mut r = Ok(());
        for (c, part) in keys.chunks(self.max_batch).enumerate() {
            let base = c * self.max_batch;
            r = self.load_some(part, by, &mut held, &mut |lease_ix, grants, p, by| {
                // `cxl`: from its views, no lock held while `sink` runs; `remote_cxl`:
                // window by window, by `by`.
                let (mut hits, mut bytes) = (0, 0);
                let mut each = |k: usize, b: &[u8]| {
                    hits += 1;
                    bytes += b.len() as u64;
                    sink(base + lease_ix[k], b)
                };
                p.mover.read(grants, &mut each, by);
                (hits, bytes)
            });
            if r.is_err() {
                break;
            }
        }
        self.release(held, by, release);
        r
    }

    /// Loads chunks into the caller's staging slots: `Some(len)` where chunk `i` is now
    /// in `slots[i]`. Each slot is back in `slots` afterwards, except one whose transfer
    /// outcome is unknown (`None`: kept until its peer is fenced).
    pub fn load_slots<K: Serialize>(
        &self,
        keys: &[K],
        slots: &mut [Option<Slot>],
    ) -> Result<Vec<Option<usize>>, WorkerError> {
        let by = self.deadline();
        let mut out = vec![None; keys.len()];
        let batches = keys.chunks(self.max_batch);
        let parts = slots
            .chunks_mut(self.max_batch)
            .zip(out.chunks_mut(self.max_batch));
        let mut held = Vec::new();
        let mut r = Ok(());
        for (keys, (part, got)) in batches.zip(parts) {
            r = self.load_some(keys, by, &mut held, &mut |lease_ix, grants, p, by| {
                let mut ls = Vec::with_capacity(grants.len());
                let mut gs = Vec::with_capacity(grants.len());
                let mut ix = Vec::with_capacity(grants.len());
                for (k, &i) in lease_ix.iter().enumerate() {
                    if let Some(s) = part[i].take() {
                        ls.push(s);
                        gs.push(grants[k].clone());
                        ix.push(i);
                    }
                }
                let (mut hits, mut bytes) = (0, 0);
                for ((i, g), o) in ix.into_iter().zip(&gs).zip(p.mover.read_into(&gs, ls, by)) {
                    if o.ok {
                        got[i] = Some(g.length as usize);
                        hits += 1;
                        bytes += g.length;
                    }
                    part[i] = o.slot;
                }
                (hits, bytes)
            });
            if r.is_err() {
                break;
            }
        }
        self.release_leases(held, by);
        r.map(|()| out)
    }

    /// One batch: acquire leases → `read(found indices, their leases, pool)`, which
    /// answers (hits, bytes) → what the read left, under one lock; the leases' ids go
    /// to `held`, for the caller to release.
    fn load_some<K: Serialize>(
        &self,
        keys: &[K],
        by: Deadline,
        held: &mut Vec<u64>,
        read: &mut LeaseReader<'_>,
    ) -> Result<(), WorkerError> {
        // Only `remote_cxl` has agents that may be away.
        let remote = !self.mover.writes_in_place();
        // maru-server did not answer a call by its deadline, or every agent did not
        // (every byte of the pool is there): a miss at once, nobody asked.
        if self.session.away() || (remote && self.core.every_agent_away()) {
            self.core.lock().stats.misses += keys.len() as u64;
            return Ok(());
        }
        let leases = self.session.acquire(keys, by)?;
        let (found, grants): (Vec<usize>, Vec<LeaseGrant>) = leases
            .into_iter()
            .enumerate()
            .filter_map(|(i, l)| l.map(|g| (i, g)))
            .unzip();
        // Bytes at an agent that is away miss at once (their leases are released as
        // the others are): a stalled agent costs the call that found it one timeout.
        let away = match remote {
            true => self.core.lock().leases_away(&grants),
            false => vec![false; grants.len()],
        };
        let away_n = away.iter().filter(|&&a| a).count();
        let (hits, bytes) = if away_n == 0 {
            read(&found, &grants, self, by)
        } else {
            let (ix, readable): (Vec<usize>, Vec<LeaseGrant>) = found
                .iter()
                .zip(&grants)
                .zip(&away)
                .filter(|(_, &a)| !a)
                .map(|((&i, g), _)| (i, g.clone()))
                .unzip();
            let url = &self.session.url;
            log::debug!("pool {url}: {away_n} chunk(s) missed: their agent is away");
            read(&ix, &readable, self, by)
        };
        // What the read left, under one lock: hits, failures and why, misses, and
        // whether it found a reboot to report.
        let must_report = {
            let mut c = self.core.lock();
            if let Some(e) = c.remote.as_mut().and_then(|r| r.read_error.take()) {
                c.stats.last_load_error = Some(e);
            }
            c.stats.hits += hits;
            c.stats.bytes_loaded += bytes;
            c.stats.load_failed += ((found.len() - away_n) as u64).saturating_sub(hits);
            c.stats.misses += (keys.len() - found.len() + away_n) as u64;
            c.must_report()
        };
        held.extend(grants.iter().map(|g| g.lease_id));
        // A reboot found by this read: every reader misses those keys from now on.
        if must_report {
            self.heartbeat(by)?;
        }
        Ok(())
    }

    /// Views of the chunks in place (`cxl`): per key, its lease and view, the lease held
    /// until the caller releases it with `release_leases`. Keys that missed or whose
    /// view failed are `None` (their leases are released at once).
    pub fn acquire_views<K: Serialize>(
        &self,
        keys: &[K],
        by: Deadline,
    ) -> Result<Vec<Option<(LeaseGrant, View)>>, WorkerError> {
        if self.session.away() {
            // maru-server did not answer a call by its deadline: a miss at once.
            self.core.lock().stats.misses += keys.len() as u64;
            return Ok(vec![None; keys.len()]);
        }
        let mut out: Vec<Option<(LeaseGrant, View)>> = Vec::with_capacity(keys.len());
        for part in keys.chunks(self.max_batch) {
            let leases = self.session.acquire(part, by)?;
            // The found leases moved out of the reply (not cloned: a lease owns three
            // strings), with the index of each in `part`.
            let mut at = Vec::with_capacity(leases.len());
            let mut found = Vec::with_capacity(leases.len());
            for (i, l) in leases.into_iter().enumerate() {
                if let Some(g) = l {
                    at.push(i);
                    found.push(g);
                }
            }
            let views = self.mover.views(&found);
            let base = out.len();
            out.extend((0..part.len()).map(|_| None));
            let misses = (part.len() - found.len()) as u64;
            let mut unused = Vec::new();
            let (mut hits, mut bytes, mut failed) = (0, 0, 0);
            for ((i, l), v) in at.into_iter().zip(found).zip(views) {
                match v {
                    Some(v) => {
                        hits += 1;
                        bytes += l.length;
                        out[base + i] = Some((l, v));
                    }
                    None => {
                        failed += 1;
                        unused.push(l.lease_id);
                    }
                }
            }
            {
                let mut c = self.core.lock();
                c.stats.misses += misses;
                c.stats.hits += hits;
                c.stats.bytes_loaded += bytes;
                c.stats.load_failed += failed;
            }
            self.release_leases(unused, by);
        }
        Ok(out)
    }

    /// Ends leases of a request as `how` says: now, by its deadline `by`, or queued
    /// for the release thread (now all the same when the queue is full or closing).
    pub fn release(self: &Arc<Self>, ids: Vec<u64>, by: Deadline, how: Release<'_>) {
        let ids = match how {
            Release::After(q) if !ids.is_empty() => match q.push((self.clone(), ids)) {
                Ok(()) => return,
                Err((_, ids)) => {
                    log::debug!(
                        "pool {}: {} lease(s) released inline (release queue full or closing)",
                        self.session.url,
                        ids.len()
                    );
                    ids
                }
            },
            _ => ids,
        };
        self.release_leases(ids, by);
    }

    /// Ends leases of a request, by its deadline `by`: one not released in time ends
    /// by itself when its lease times out.
    pub fn release_leases(&self, ids: Vec<u64>, by: Deadline) {
        if ids.is_empty() {
            return;
        }
        if let Err(e) = self.session.release_leases(ids, by) {
            if let Some(n) = crate::worker::warn_limit::allow(&self.session.url, "lease_release") {
                log::warn!(
                    "pool {}: releasing leases failed (they expire on their own): {e}{}",
                    self.session.url,
                    crate::worker::warn_limit::held_back(n)
                );
            }
        }
    }
}
