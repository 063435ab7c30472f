//! The work of one operation does not grow with the number of sessions: the session
//! table counts the sessions its lookups visit (`SessionTable::visited`), and each
//! request, the event loop's question of when to tick next, and a closed connection
//! visit as many with 4,000 sessions open as with 100 (issue 46: a scan of every
//! session on each request was invisible at 8 engines and a core's worth of work at
//! thousands).

use super::fakes::*;
use super::MetaConfig;
use crate::wire::meta::MetaRequest;

/// A world of `n` open sessions (no region each: readers that heartbeat) of one
/// client each; the clock then moves by less than the session timeout.
fn world_of(n: usize) -> (World, Vec<(String, u64)>) {
    let cfg = MetaConfig {
        max_sessions: n + 8,
        ..config(&[])
    };
    let mut w = World::with(cfg, 16 * REGION);
    let sessions: Vec<(String, u64)> = (0..n)
        .map(|i| {
            let c = format!("worker-{i}:1");
            let id = w.open_without_region(&c);
            w.now += 1;
            (c, id)
        })
        .collect();
    (w, sessions)
}

/// Sessions visited by one of each per-request path, on a world of `n` sessions.
fn visits_per_op(n: usize) -> Vec<(&'static str, u64)> {
    let (mut w, sessions) = world_of(n);
    let (c, id) = sessions[n / 2].clone();
    let mut out = Vec::new();
    let mut count = |w: &mut World, what: &'static str, f: &mut dyn FnMut(&mut World)| {
        let before = w.core.sessions.visited();
        f(w);
        out.push((what, w.core.sessions.visited() - before));
    };
    count(&mut w, "heartbeat", &mut |w| {
        w.heartbeat_reply(&c, id);
    });
    count(&mut w, "exists", &mut |w| {
        w.exists(&c, id, &["a", "b", "c"]);
    });
    count(&mut w, "next deadline", &mut |w| {
        w.core.next_deadline();
    });
    count(&mut w, "tick", &mut |w| w.tick());
    count(&mut w, "connection closed", &mut |w| {
        w.core.client_closed(&c, w.now);
        assert!(w.core.has_session_of(&c));
    });
    count(&mut w, "open", &mut |w| {
        w.open_without_region("newcomer:1");
    });
    count(&mut w, "close", &mut |w| {
        w.req(
            &c,
            MetaRequest::Close {
                session: id,
                drained: true,
            },
        )
        .unwrap();
    });
    out
}

#[test]
fn the_work_of_an_operation_does_not_grow_with_the_sessions() {
    let small = visits_per_op(100);
    let large = visits_per_op(4000);
    for ((what, a), (_, b)) in small.iter().zip(&large) {
        // Flat: within 1.5 x (and a few sessions) from 100 to 4,000 sessions.
        assert!(
            (*b as f64) <= 1.5 * (*a as f64) + 4.0,
            "{what}: {a} sessions visited with 100 sessions open, {b} with 4,000"
        );
    }
}

#[test]
fn expired_sessions_are_found_in_order_of_silence() {
    let (mut w, sessions) = world_of(50);
    // All but the last 10 opened go silent; those 10 heartbeat.
    let timeout = w.core.config().session_timeout_ms;
    w.now += timeout - 100;
    for (c, id) in &sessions[40..] {
        w.heartbeat_reply(c, *id);
    }
    w.now += 200;
    let before = w.core.sessions.visited();
    w.tick();
    assert_eq!(w.core.session_count(), 10, "the 40 silent sessions expired");
    // The 40 expired, and the first live one that ends the walk.
    assert!(w.core.sessions.visited() - before <= 2 * 41);
    for (c, id) in &sessions[40..] {
        w.heartbeat_reply(c, *id);
    }
}
