//! What the event loop counts for a daemon's metrics ([`NetCounters`]) and what its
//! listener reports ([`ServerCounts`]).

use std::sync::atomic::{AtomicU64, Ordering};

/// What the loop counts for a daemon's metrics: refusals and failed key proofs happen
/// inside the loop, before any request reaches the service. Atomics, so another thread
/// (a `/metrics` scrape) reads them while the loop runs; totals only ever grow, except
/// `open`, the connections open now.
#[derive(Debug, Default)]
pub struct NetCounters {
    /// Connections accepted (and kept) since start.
    pub accepted: AtomicU64,
    /// Connections open now (in their handshake or past it).
    pub open: AtomicU64,
    /// Closed at accept: the connection cap was reached.
    pub refused_cap: AtomicU64,
    /// Closed to make room: the oldest unfinished handshake when too many were pending.
    pub pushed_out: AtomicU64,
    /// Closed to make room: an idle connection of a tenant over its share of the
    /// connections, for a newcomer while the daemon was full.
    pub pushed_out_over_share: AtomicU64,
    /// Closed because the key they proved is no longer in force (removed or changed).
    pub key_revoked: AtomicU64,
    /// Closed for not finishing the handshake in time.
    pub handshake_timeouts: AtomicU64,
    /// Closed after the idle timeout.
    pub idle_closed: AtomicU64,
    /// Key proofs that failed (wrong key, forged proof).
    pub auth_failures: AtomicU64,
    /// Connections closed for a broken frame stream or handshake (other than the key).
    pub protocol_errors: AtomicU64,
    /// Bytes read from and written to connections.
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Bytes of request frames read and not yet served, partly received ones
    /// included, every connection together (a gauge).
    pub buffered: AtomicU64,
    /// Times a frame larger than [`SMALL_FRAME`] waited for room to be read.
    pub frame_room_waits: AtomicU64,
    /// Connections the loop looked at besides serving them: to find the one a
    /// deferred reply is for, and in its checks of every connection for the idle
    /// timeout (a count of work: it must not grow with connections × requests).
    pub conns_visited: AtomicU64,
}

impl NetCounters {
    pub(super) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn sub(c: &AtomicU64, n: u64) {
        c.fetch_sub(n, Ordering::Relaxed);
    }

    /// The value of one counter.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// What a daemon's listener reports (for tests and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerCounts {
    pub connections: usize,
    pub pending: usize,
}
