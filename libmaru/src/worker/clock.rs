//! The worker's clock (a driver: the cores take `now_ms`).

use std::sync::OnceLock;
use std::time::Instant;

/// Milliseconds on a monotonic clock since the first call in this process.
#[allow(clippy::disallowed_methods)] // the one place the worker reads the clock
pub(crate) fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}
