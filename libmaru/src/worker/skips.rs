//! Why stores were skipped: each chunk not stored (result `false`, status OK) counted
//! under one reason, each reason at most one WARN line per [`LOG_EVERY_MS`].
//! Sans-I/O: `now_ms` comes in, the line goes out.

/// One WARN line per reason per this many ms.
pub const LOG_EVERY_MS: u64 = 10_000;

/// Why a chunk was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// No region to be had and nothing of the engine's own to evict.
    NoRegion,
    /// No staging slot was free for the copy (every store slot in flight).
    NoSlot,
    /// The pool's maru-server, or the agent of the pages, is away or unavailable.
    PoolUnavailable,
    /// The engine holds `max_bytes` of regions and nothing of them could be evicted.
    MaxBytes,
}

impl SkipReason {
    pub const ALL: [SkipReason; 4] = [
        SkipReason::NoRegion,
        SkipReason::NoSlot,
        SkipReason::PoolUnavailable,
        SkipReason::MaxBytes,
    ];

    /// The name in `stats()["total"]["skipped"]`.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NoRegion => "no_region",
            SkipReason::NoSlot => "no_slot",
            SkipReason::PoolUnavailable => "pool_unavailable",
            SkipReason::MaxBytes => "max_bytes",
        }
    }

    fn why(self) -> &'static str {
        match self {
            SkipReason::NoRegion => {
                "maru-server had no region to give (the pool is full and this engine holds \
                 its fair share, or has none yet) and nothing of its own could be evicted \
                 (leased, pinned or being written)"
            }
            SkipReason::NoSlot => "no staging slot was free (raise store_slots)",
            SkipReason::PoolUnavailable => {
                "the pool's maru-server is unavailable (reconnecting in the background), \
                 or the agent of the pages does not answer (probed every 250 ms)"
            }
            SkipReason::MaxBytes => {
                "the engine holds max_bytes of regions and nothing of them could be evicted"
            }
        }
    }
}

/// Chunks skipped, per reason, since the handler opened (the heartbeat carries a
/// pool's counts to maru-server).
pub use crate::wire::meta::SkipCounts;

impl SkipCounts {
    pub fn get(&self, r: SkipReason) -> u64 {
        match r {
            SkipReason::NoRegion => self.no_region,
            SkipReason::NoSlot => self.no_slot,
            SkipReason::PoolUnavailable => self.pool_unavailable,
            SkipReason::MaxBytes => self.max_bytes,
        }
    }

    fn slot(&mut self, r: SkipReason) -> &mut u64 {
        match r {
            SkipReason::NoRegion => &mut self.no_region,
            SkipReason::NoSlot => &mut self.no_slot,
            SkipReason::PoolUnavailable => &mut self.pool_unavailable,
            SkipReason::MaxBytes => &mut self.max_bytes,
        }
    }

    /// Adds `o`'s counts, saturating (maru-server sums counts its workers report).
    pub fn add(&mut self, o: &SkipCounts) {
        for r in SkipReason::ALL {
            let n = self.slot(r);
            *n = n.saturating_add(o.get(r));
        }
    }

    pub fn total(&self) -> u64 {
        SkipReason::ALL
            .iter()
            .fold(0u64, |t, r| t.saturating_add(self.get(*r)))
    }
}

/// The counts, and when each reason last had its line.
#[derive(Debug, Default)]
pub struct SkipLog {
    pub counts: SkipCounts,
    /// Per reason: when its last line went out, and what it skipped since.
    last: [Option<u64>; 4],
    since: [u64; 4],
}

impl SkipLog {
    /// `n` chunks skipped for `reason` at `now_ms` (`what`: which pool, say). Returns
    /// the WARN line to log, when one is due for this reason.
    pub fn note(&mut self, reason: SkipReason, n: u64, now_ms: u64, what: &str) -> Option<String> {
        if n == 0 {
            return None;
        }
        *self.counts.slot(reason) += n;
        let i = reason as usize;
        self.since[i] += n;
        let due = self.last[i].is_none_or(|t| now_ms.saturating_sub(t) >= LOG_EVERY_MS);
        if !due {
            return None;
        }
        let skipped = std::mem::take(&mut self.since[i]);
        self.last[i] = Some(now_ms);
        Some(format!(
            "{what}: {skipped} chunk(s) not stored ({}): {} (stats: skipped.{}; at most one \
             line per reason every {} s)",
            reason.as_str(),
            reason.why(),
            reason.as_str(),
            LOG_EVERY_MS / 1000
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: each reason is counted apart and logged at most once per interval, the
    /// first at once, the next naming what was skipped since. Seen failing with the
    /// interval check removed (a line at every skip).
    #[test]
    fn each_reason_is_counted_and_logged_once_per_interval() {
        let mut s = SkipLog::default();
        let first = s.note(SkipReason::NoRegion, 8, 1_000, "pool p").unwrap();
        assert!(
            first.contains("8 chunk(s)") && first.contains("no_region"),
            "{first}"
        );
        assert!(s.note(SkipReason::NoRegion, 3, 5_000, "pool p").is_none());
        assert!(
            s.note(SkipReason::NoSlot, 2, 5_000, "pool p").is_some(),
            "another reason has its own line"
        );
        assert!(s.note(SkipReason::NoRegion, 1, 10_999, "pool p").is_none());
        let next = s.note(SkipReason::NoRegion, 1, 11_000, "pool p").unwrap();
        assert!(
            next.contains("5 chunk(s)"),
            "what was skipped since: {next}"
        );
        assert_eq!(s.note(SkipReason::MaxBytes, 0, 11_000, "pool p"), None);
        assert_eq!(
            s.counts,
            SkipCounts {
                no_region: 13,
                no_slot: 2,
                pool_unavailable: 0,
                max_bytes: 0
            }
        );
        assert_eq!(s.counts.total(), 15);
    }
}
