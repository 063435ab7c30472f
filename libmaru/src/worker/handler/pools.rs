//! Pools that cannot be reached: a pool whose request failed on a lost session is
//! set aside (its prefixes miss) for the background thread to reopen, and the session
//! it lost is settled once the pool has a new one.

use super::Inner;
use crate::worker::clock::Deadline;
use crate::worker::error::{Peer, WorkerError};
use crate::worker::lifecycle::{lost_session, LostSession};
use crate::worker::pool::StoragePool;
use crate::worker::warn_limit;
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

    /// A request on pool `i` failed with `e`: a lost session sets the pool aside (the
    /// only error that does) and answers `miss`; maru-server out of reach answers
    /// `miss` too; anything else is the caller's.
    pub(super) fn pool_failed<T>(
        &self,
        i: usize,
        pool: &Arc<StoragePool>,
        e: WorkerError,
        miss: T,
    ) -> Result<T, WorkerError> {
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

    /// Keeps the session a pool lost until the pool has a new one (which tells whether
    /// maru-server restarted).
    pub(super) fn set_aside(&self, i: usize, old: Option<Arc<StoragePool>>) {
        if let (Some(old), Ok(mut l)) = (old, self.lost[i].lock()) {
            // A pool set aside twice before it came back: the older one goes now.
            *l = Some(old);
        }
    }

    /// Brings pool `i` back: the session it lost when maru-server still knows it (a
    /// heartbeat answered), else a new session, the lost one settled
    /// (`settle_set_aside`).
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

    /// The pool has a new session: from another run of maru-server, the regions of the
    /// one set aside are released at their agents (no keeper will); else let go.
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
}
