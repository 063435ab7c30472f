//! The worker's clock (a driver: the cores take `now_ms`).

use std::sync::OnceLock;
use std::time::Instant;

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
