//! The handler's background thread: about once a second it reconnects pools that went
//! away and lets each pool's mover probe its agents (the region lifecycle); it
//! heartbeats each session well within its timeout.

use super::Inner;
use crate::worker::error::WorkerError;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Inner {
    pub(super) fn background(self: &Arc<Self>) {
        // Heartbeat well within the shortest session timeout of the pools.
        let timeout_ms = self
            .pools
            .iter()
            .filter_map(|p| {
                p.lock()
                    .ok()
                    .and_then(|g| g.as_ref().map(|p| p.session.session_timeout_ms))
            })
            .min()
            .unwrap_or(30_000);
        let beat = Duration::from_millis((timeout_ms / 3).clamp(200, 10_000));
        let mut since_beat = Duration::ZERO;
        let tick = Duration::from_secs(1).min(beat);
        while !self.stop.load(Ordering::SeqCst) {
            // Every tick: reconnect pools that are down, and let each pool's mover
            // probe its agents (a restart or a reboot is seen within about a second).
            let wait = tick;
            if let Ok(g) = self.wake.0.lock() {
                // `stop` is set under this lock, so a close between the loop check and
                // here is seen before waiting.
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                let _ = self.wake.1.wait_timeout(g, wait);
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            since_beat += wait;
            for i in 0..self.pools.len() {
                let down = self.pools[i].lock().map(|g| g.is_none()).unwrap_or(false);
                if down {
                    match self.reopen_pool(i) {
                        Ok(p) => {
                            if let Ok(mut g) = self.pools[i].lock() {
                                *g = Some(p);
                            }
                            self.set_up(i, true);
                        }
                        Err(e) => log::debug!("pool {} still unavailable: {e}", self.urls[i]),
                    }
                } else {
                    // The slot's lock only to take a reference: requests go on while
                    // the pool ticks (its gate orders the tick against publishes).
                    let pool = match self.pools[i].lock() {
                        Ok(g) => g.clone(),
                        Err(_) => continue,
                    };
                    if let Some(p) = pool {
                        let r = match p.tick(crate::worker::clock::now_ms()) {
                            Ok(()) if since_beat >= beat => p.heartbeat(),
                            r => r,
                        };
                        if let Err(e) = r {
                            log::warn!("pool {}: heartbeat failed: {e}", self.urls[i]);
                            if matches!(e, WorkerError::Unavailable(_) | WorkerError::Refused(_)) {
                                self.take_down(i, &p);
                            }
                        }
                    }
                }
            }
            if since_beat >= beat {
                since_beat = Duration::ZERO;
            }
        }
    }
}
