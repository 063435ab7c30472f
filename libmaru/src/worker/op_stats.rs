//! Per-operation figures of a handler (`stats()["ops"]`): calls of each kind that
//! succeeded or failed, their chunks, a latency histogram (cumulative, as
//! Prometheus'), the elapsed time passed in; and the peers each call contacted on its
//! own thread (`contacted`), so a call that asked nobody shows as one.

use serde::Serialize;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// A peer a call contacts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Contact {
    /// A round trip to maru-server.
    Server,
    /// A control call or connect at an agent, a batch of transfers posted to it, a
    /// fence of its data connection.
    Agent,
}

thread_local! {
    /// (maru-server, agent) contacts this thread made so far.
    static CONTACTS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    /// Times this thread took a pool core's lock (`CoreCell::lock`).
    static CORE_LOCKS: Cell<u64> = const { Cell::new(0) };
}

/// Counts one acquisition of a pool core's lock by this thread.
pub(crate) fn core_locked() {
    CORE_LOCKS.with(|n| n.set(n.get() + 1));
}

/// How many times this thread took a pool core's lock so far: the figure the walks
/// of `docs/worker.md` give per call (a test reads it around one call).
pub fn core_locks() -> u64 {
    CORE_LOCKS.with(Cell::get)
}

/// Counts one contact of this thread with `c` (for the call it runs).
pub(crate) fn contacted(c: Contact) {
    CONTACTS.with(|n| {
        let (s, a) = n.get();
        n.set(match c {
            Contact::Server => (s + 1, a),
            Contact::Agent => (s, a + 1),
        });
    });
}

/// (maru-server, agent) contacts this thread made so far.
pub(crate) fn contacts() -> (u64, u64) {
    CONTACTS.with(Cell::get)
}

/// Upper bounds of the latency buckets, in microseconds (the last bucket, `+Inf`, is
/// the count).
pub const LATENCY_BOUNDS_US: [u64; 14] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
    5_000_000,
];

/// The figures of one kind of call.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct OpFigures {
    /// Calls that returned without an error.
    pub ok: u64,
    /// Calls that returned an error.
    pub failed: u64,
    /// Chunks (keys, slots, pages) the calls named.
    pub items: u64,
    /// Sum of the calls' durations, microseconds.
    pub latency_us_sum: u64,
    /// Round trips to maru-server the calls made (see [`Contact`]).
    pub server_round_trips: u64,
    /// Contacts with agents the calls made (see [`Contact`]).
    pub agent_contacts: u64,
    /// Per bound of [`LATENCY_BOUNDS_US`]: calls that took at most that long
    /// (cumulative, so the last entry is at most `ok + failed`).
    pub latency_us_le: Vec<(u64, u64)>,
}

/// The figures of every kind of call of one handler.
#[derive(Debug, Default)]
pub struct OpStats {
    ops: Mutex<BTreeMap<&'static str, OpFigures>>,
}

impl OpStats {
    /// Counts one call of kind `op` that named `items` chunks, succeeded or not, took
    /// `elapsed_us` and made `(server, agent)` contacts.
    pub fn record(
        &self,
        op: &'static str,
        ok: bool,
        items: usize,
        elapsed_us: u64,
        (server, agent): (u64, u64),
    ) {
        let mut ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let f = ops.entry(op).or_insert_with(|| OpFigures {
            latency_us_le: LATENCY_BOUNDS_US.iter().map(|&b| (b, 0)).collect(),
            ..OpFigures::default()
        });
        if ok {
            f.ok += 1;
        } else {
            f.failed += 1;
        }
        f.items += items as u64;
        f.latency_us_sum = f.latency_us_sum.saturating_add(elapsed_us);
        f.server_round_trips += server;
        f.agent_contacts += agent;
        for (bound, n) in &mut f.latency_us_le {
            if elapsed_us <= *bound {
                *n += 1;
            }
        }
    }

    /// The figures so far, by kind of call.
    pub fn snapshot(&self) -> BTreeMap<&'static str, OpFigures> {
        self.ops.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_kind_and_result_with_cumulative_latency_buckets() {
        let s = OpStats::default();
        s.record("store", true, 32, 40, (2, 3));
        s.record("store", true, 32, 700, (0, 0));
        s.record("store", false, 1, 2_000_000, (1, 0));
        s.record("load", true, 4, 10_000_000, (2, 0));
        let snap = s.snapshot();
        let st = &snap["store"];
        assert_eq!((st.ok, st.failed, st.items), (2, 1, 65));
        assert_eq!(st.latency_us_sum, 2_000_740);
        assert_eq!((st.server_round_trips, st.agent_contacts), (3, 3));
        let le = |f: &OpFigures, b: u64| f.latency_us_le.iter().find(|(x, _)| *x == b).unwrap().1;
        assert_eq!(le(st, 50), 1);
        assert_eq!(le(st, 500), 1);
        assert_eq!(le(st, 1_000), 2);
        assert_eq!(le(st, 1_000_000), 2);
        assert_eq!(le(st, 5_000_000), 3);
        // Longer than the last bound: counted only in the sum and the count.
        let ld = &snap["load"];
        assert_eq!((ld.ok, le(ld, 5_000_000)), (1, 0));
        // Cumulative: never decreasing along the bounds.
        for f in snap.values() {
            assert!(f.latency_us_le.windows(2).all(|w| w[0].1 <= w[1].1));
        }
    }

    #[test]
    fn contacts_are_counted_per_thread() {
        let before = contacts();
        contacted(Contact::Server);
        contacted(Contact::Agent);
        contacted(Contact::Agent);
        std::thread::scope(|s| {
            s.spawn(|| contacted(Contact::Server));
        });
        let after = contacts();
        assert_eq!((after.0 - before.0, after.1 - before.1), (1, 2));
    }
}
