//! Requests to the pools: each goes to the pool its route key picks; a pool that
//! cannot be reached is set aside (its prefixes miss) for the background thread to
//! reconnect, and the session it lost is settled once the pool has a new one.

use super::Inner;
use crate::worker::clock::Deadline;
use crate::worker::config::BackendKind;
use crate::worker::error::{Peer, WorkerError};
use crate::worker::lifecycle::{lost_session, LostSession};
use crate::worker::pool::StoragePool;
use crate::worker::warn_limit;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Inner {
    pub(super) fn set_up(&self, i: usize, up: bool) {
        if let Ok(mut r) = self.router.lock() {
            if r.set_up(i, up) {
                if up {
                    log::info!("pool {} is available", self.urls[i]);
                } else {
                    log::warn!(
                        "pool {} is unavailable: its prefixes miss until it is back",
                        self.urls[i]
                    );
                }
            }
        }
    }

    /// Runs `f` on the request's pool; an unavailable pool is set aside for the
    /// background thread to reconnect, and the call answers `miss`.
    pub(super) fn with_pool<T>(
        &self,
        route_key: &str,
        miss: T,
        f: impl FnOnce(&Arc<StoragePool>) -> Result<T, WorkerError>,
    ) -> Result<T, WorkerError> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(WorkerError::Closed);
        }
        let i = self
            .router
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .pick(route_key);
        let pool = {
            let slot = self.pools[i].lock().map_err(|_| WorkerError::Closed)?;
            match slot.as_ref() {
                Some(p) => p.clone(),
                None => {
                    if let Some(n) = warn_limit::allow(&self.urls[i], "unavailable") {
                        log::warn!(
                            "pool {} is unavailable: the loads routed to it miss and the stores are skipped until a session opens again{}",
                            self.urls[i],
                            warn_limit::held_back(n)
                        );
                    }
                    return Ok(miss);
                }
            }
        };
        match f(&pool) {
            Err(e) => self.pool_failed(i, &pool, e, miss),
            r => r,
        }
    }

    /// As `with_pool` for a store of `n` chunks: when the pool is unavailable (set
    /// aside, or lost during the call) the chunks are skipped, counted under
    /// `pool_unavailable`, and a WARN says so (once per reason per interval).
    pub(super) fn store_on_pool(
        &self,
        route_key: &str,
        n: usize,
        f: impl FnOnce(&StoragePool) -> Result<Vec<bool>, WorkerError>,
    ) -> Result<Vec<bool>, WorkerError> {
        let mut reached = false;
        let r = self.with_pool(route_key, vec![false; n], |p| {
            let r = f(p);
            reached = r.is_ok();
            r
        });
        if r.is_ok() && !reached {
            let i = self.router.lock().map(|r| r.pick(route_key)).unwrap_or(0);
            let what = format!("pool {}", self.urls.get(i).map_or("?", |u| u.as_str()));
            let line = self.skips.lock().ok().and_then(|mut s| {
                s.note(
                    crate::worker::skips::SkipReason::PoolUnavailable,
                    n as u64,
                    crate::worker::clock::now_ms(),
                    &what,
                )
            });
            if let Some(line) = line {
                log::warn!("{line}");
            }
        }
        r
    }

    /// A request on pool `i` failed with `e`. Its session lost (see
    /// `Session::heartbeat`): the pool is set aside, the heartbeat thread
    /// opens a new session, and the request answers `miss`; the only error that sets
    /// a pool aside. maru-server out of reach: `miss` too (the session may live on;
    /// the heartbeat thread finds out). Anything else is the caller's.
    pub(super) fn pool_failed<T>(
        &self,
        i: usize,
        pool: &Arc<StoragePool>,
        e: WorkerError,
        miss: T,
    ) -> Result<T, WorkerError> {
        // A session maru-server no longer has comes back as `SessionLost` (its
        // `no_session` code): no heartbeat is needed to tell.
        match e {
            WorkerError::SessionLost { .. } => {
                log::warn!(
                    "pool {}: {e}; its prefixes miss until a new session is open",
                    self.urls[i]
                );
                self.take_down(i, pool);
                self.wake.1.notify_all();
                Ok(miss)
            }
            WorkerError::Unavailable {
                peer: Peer::Server(_),
                ..
            } => {
                if let Some(n) = warn_limit::allow(&self.urls[i], "server_unreachable") {
                    log::warn!(
                        "pool {}: {e}; its requests miss (stores skipped) while maru-server does not answer{}",
                        self.urls[i],
                        warn_limit::held_back(n)
                    );
                }
                self.wake.1.notify_all();
                Ok(miss)
            }
            e => Err(e),
        }
    }

    /// Sets pool `i` aside if it still holds `pool` (another request that failed on
    /// it may have done so already, and the background thread opened a new one).
    pub(super) fn take_down(&self, i: usize, pool: &Arc<StoragePool>) {
        let old = match self.pools[i].lock() {
            Ok(mut slot) if slot.as_ref().is_some_and(|p| Arc::ptr_eq(p, pool)) => slot.take(),
            _ => return,
        };
        self.set_aside(i, old);
        self.set_up(i, false);
    }

    /// Keeps the session a pool lost until the pool has a new one: only then is it
    /// known whether maru-server restarted (its keeper is gone with it) or the old
    /// session merely expired or was out of reach (maru-server's keeper has its regions).
    pub(super) fn set_aside(&self, i: usize, old: Option<Arc<StoragePool>>) {
        if let (Some(old), Ok(mut l)) = (old, self.lost[i].lock()) {
            // A pool set aside twice before it came back: the older one goes now.
            *l = Some(old);
        }
    }

    /// Brings pool `i` back: the session it lost when maru-server still knows it (a
    /// maru-server with a durable directory restarted, or it was out of reach for a
    /// while): its links reconnect presenting the session's secret and a heartbeat is
    /// answered, so the session goes on with its own regions and keys. Else a new
    /// session, and the lost one is settled (see `settle_set_aside`). Unavailable
    /// while maru-server cannot be reached.
    pub(super) fn reopen_pool(&self, i: usize) -> Result<Arc<StoragePool>, WorkerError> {
        let lost = self.lost[i].lock().ok().and_then(|l| l.clone());
        if let Some(old) = lost {
            match old.heartbeat(Deadline::after(self.timeout())) {
                Ok(()) => {
                    if let Ok(mut l) = self.lost[i].lock() {
                        if l.as_ref().is_some_and(|p| Arc::ptr_eq(p, &old)) {
                            *l = None;
                        }
                    }
                    log::info!(
                        "pool {}: maru-server knows session {} again: it goes on",
                        self.urls[i],
                        old.session.id
                    );
                    return Ok(old);
                }
                Err(e @ WorkerError::Unavailable { .. }) => return Err(e),
                Err(e) => log::info!(
                    "pool {}: session {} does not go on ({e}); opening a new one",
                    self.urls[i],
                    old.session.id
                ),
            }
        }
        let p = Arc::new(self.open_pool(i)?);
        self.settle_set_aside(i, &p);
        Ok(p)
    }

    /// The pool has a new session: if it comes from another run of maru-server, release
    /// the regions of the one set aside at their agents (no keeper will), else just let
    /// it go (the keeper takes its regions over when it expires).
    pub(super) fn settle_set_aside(&self, i: usize, new: &StoragePool) {
        let Some(old) = self.lost[i].lock().ok().and_then(|mut l| l.take()) else {
            return;
        };
        let (was, now) = (
            old.session.handshake.instance.clone(),
            new.session.handshake.instance.clone(),
        );
        if lost_session(&was, &now) == LostSession::ReleaseAtAgents {
            let (released, failed) = old.release_regions();
            log::warn!(
                "pool {}: maru-server restarted (instance {was} → {now}); released {released} region(s) of the lost session at their agents{}",
                self.urls[i],
                if failed > 0 {
                    format!(", {failed} could not be released (the agents' sweep deregisters them once the RM forgets them)")
                } else {
                    String::new()
                }
            );
        }
    }

    pub(super) fn load(
        &self,
        keys: &[String],
        route_key: Option<&str>,
        sink: &mut crate::worker::movers::ReadSink<'_>,
        release_after: bool,
    ) -> Result<(), WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(());
        };
        let rk = route_key.unwrap_or(first);
        if self.cfg.backend == BackendKind::Cxl {
            return self.load_in_place(keys, rk, sink, release_after);
        }
        if !release_after {
            return self.with_pool(rk, (), |p| p.load(keys, sink, None));
        }
        self.with_pool(rk, (), |p| {
            let mut held = Vec::new();
            let by = Deadline::after(self.timeout());
            let r = p.load(keys, sink, Some(&mut held));
            self.release_later(p, held, by);
            r
        })
    }

    /// `cxl` loads: leases and views under the pool's lock, the copies out of the
    /// shared mapping without it (each view keeps its mapping alive, each lease its
    /// page from reuse), the leases' release under the lock again (or after the call,
    /// `release_after`: see `releases`). So threads sharing a handler copy side by side.
    pub(super) fn load_in_place(
        &self,
        keys: &[String],
        rk: &str,
        sink: &mut crate::worker::movers::ReadSink<'_>,
        release_after: bool,
    ) -> Result<(), WorkerError> {
        // One deadline for the request's calls: the leases, and their release.
        let by = Deadline::after(self.timeout());
        let got = self.with_pool(rk, vec![None; keys.len()], |p| p.acquire_views(keys, by))?;
        let mut leases = Vec::with_capacity(got.len());
        for (i, g) in got.iter().enumerate() {
            if let Some((lease, view)) = g {
                sink(i, view.bytes());
                leases.push(lease.lease_id);
            }
        }
        if !leases.is_empty() {
            self.with_pool(rk, (), |p| {
                if release_after {
                    self.release_later(p, leases, by);
                } else {
                    p.release_leases(leases, by);
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}
