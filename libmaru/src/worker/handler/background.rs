//! The handler's background threads: `heartbeats` (each session well within its
//! timeout; pools that went away reopened about once a second) and `ticks` (each
//! pool's probes about once a second, away agents every 250 ms). Two, so that a
//! probe slow to answer never delays a heartbeat; neither holds a lock across I/O.

use super::Inner;
use crate::worker::clock::Deadline;
use crate::worker::error::WorkerError;
use crate::worker::pool::StoragePool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Inner {
    /// Waits `d` or until the handler closes; false once it is closing.
    fn pause(&self, d: Duration) -> bool {
        if let Ok(g) = self.wake.0.lock() {
            // `stop` is set under this lock, so a close between the caller's check and
            // here is seen before waiting.
            if self.stop.load(Ordering::SeqCst) {
                return false;
            }
            let _ = self.wake.1.wait_timeout(g, d);
        }
        !self.stop.load(Ordering::SeqCst)
    }

    /// Pool `i` if it is up (its slot's lock only to take a reference).
    fn pool_up(&self, i: usize) -> Option<Arc<StoragePool>> {
        self.pools[i].lock().ok().and_then(|g| g.clone())
    }

    /// A heartbeat or tick of pool `i` failed with `e`: a lost session sets it aside;
    /// anything else is tried again at the next beat.
    fn failed(&self, i: usize, p: &Arc<StoragePool>, what: &str, e: WorkerError) {
        log::warn!("pool {}: {what} failed: {e}", self.urls[i]);
        if matches!(e, WorkerError::SessionLost { .. }) {
            self.take_down(i, p);
        }
    }

    pub(super) fn heartbeats(self: &Arc<Self>) {
        // Heartbeat well within the shortest session timeout of the pools.
        let timeout_ms = (0..self.pools.len())
            .filter_map(|i| self.pool_up(i).map(|p| p.session.session_timeout_ms))
            .min()
            .unwrap_or(30_000);
        let beat = Duration::from_millis((timeout_ms / 3).clamp(200, 10_000));
        let step = Duration::from_secs(1).min(beat);
        let mut since_beat = Duration::ZERO;
        while self.pause(step) {
            since_beat += step;
            let due = since_beat >= beat;
            for i in 0..self.pools.len() {
                match self.pool_up(i) {
                    None => match self.reopen_pool(i) {
                        Ok(p) => {
                            if let Ok(mut g) = self.pools[i].lock() {
                                *g = Some(p);
                            }
                            self.set_up(i, true);
                        }
                        Err(e) => log::debug!("pool {} still unavailable: {e}", self.urls[i]),
                    },
                    Some(p) if due => {
                        if let Err(e) = p.heartbeat(Deadline::after(self.timeout())) {
                            self.failed(i, &p, "heartbeat", e);
                        }
                    }
                    Some(_) => {}
                }
            }
            if due {
                since_beat = Duration::ZERO;
            }
        }
    }

    /// Each pool's tick about once a second; in between, every
    /// `AWAY_PROBE_EVERY_MS`, the probes of what is away.
    pub(super) fn ticks(self: &Arc<Self>) {
        use crate::worker::clock::now_ms;
        use crate::worker::lifecycle::{AWAY_PROBE_EVERY_MS, PROBE_EVERY_MS};
        let mut last_tick = now_ms();
        while self.pause(Duration::from_millis(AWAY_PROBE_EVERY_MS)) {
            let full = now_ms().saturating_sub(last_tick) >= PROBE_EVERY_MS;
            if full {
                last_tick = now_ms();
            }
            for i in 0..self.pools.len() {
                let Some(p) = self.pool_up(i) else { continue };
                // Between ticks, the away probes: their fences and maru-server's ping
                // wait 1 s at most, the probe of an away agent the request timeout (so
                // that it is already waiting when the agent answers again); a tick waits
                // the timeout.
                if !full {
                    p.probe_away(now_ms(), Deadline::after(Duration::from_secs(1)));
                } else if let Err(e) = p.tick(now_ms(), Deadline::after(self.timeout())) {
                    self.failed(i, &p, "tick", e);
                }
            }
        }
    }
}
