//! The worker's clock (a driver: the cores take `now_ms`), and the deadlines of
//! requests read from it.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

static START: OnceLock<Instant> = OnceLock::new();

/// Milliseconds on a monotonic clock since the first call in this process.
pub(crate) fn now_ms() -> u64 {
    now_us() / 1000
}

/// Microseconds on the same clock (durations of calls, see `op_stats`).
#[allow(clippy::disallowed_methods)] // the one place the worker reads the clock
pub(crate) fn now_us() -> u64 {
    let start = *START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// When every wait made for one request must be over: its start plus `timeout_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline {
    at_us: u64,
}

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        let us = u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX);
        Deadline {
            at_us: now_us().saturating_add(us),
        }
    }

    /// The time left (zero once it passed).
    pub fn left(&self) -> Duration {
        Duration::from_micros(self.at_us.saturating_sub(now_us()))
    }

    /// True once no time is left.
    pub fn passed(&self) -> bool {
        self.left().is_zero()
    }

    /// The sooner of this deadline and `d` from now (a wait with a bound of its own).
    pub fn within(self, d: Duration) -> Deadline {
        self.min(Deadline::after(d))
    }
}
