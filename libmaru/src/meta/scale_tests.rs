//! The work of one operation does not grow with the number of sessions: the session
//! table counts the sessions its lookups visit (`SessionTable::visited`), and each
//! request (an alloc and an expand among them, which look up the fair share), the
//! event loop's question of when to tick next, and a closed connection visit as many
//! with 4,000 sessions open as with 100 (issue 46: a scan of every session on each
//! request was invisible at 8 engines and a core's worth of work at thousands).

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
        // Sessions visited by the session table and by the fair share's lookups.
        let visited = |w: &World| w.core.sessions.visited() + w.core.fair.visited();
        let before = visited(w);
        f(w);
        out.push((what, visited(w) - before));
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
    count(&mut w, "alloc", &mut |w| {
        w.alloc(&c, id, 4);
    });
    count(&mut w, "expand", &mut |w| {
        w.expand(&c, id).unwrap();
    });
    count(&mut w, "alloc in a region", &mut |w| {
        w.alloc(&c, id, 4);
    });
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

/// Regions visited by the ticks that look for regions held unused, with `n`
/// sessions each holding a region with a key in it (none unused).
fn unused_visits(n: usize) -> u64 {
    let cfg = MetaConfig {
        max_sessions: n + 8,
        ..config(&[])
    };
    let mut w = World::with(cfg, (n as u64 + 8) * REGION);
    for i in 0..n {
        let c = format!("worker-{i}:1");
        let (id, _) = w.open(&c);
        w.store(&c, id, &[&format!("k{i}")]);
    }
    // The first tick looks at every region once (regions recovered unused).
    w.now += 1;
    w.tick();
    let before = w.core.unused_visited;
    for _ in 0..10 {
        w.now += 1;
        w.tick();
    }
    w.core.unused_visited - before
}

#[test]
fn ticks_visit_only_the_regions_due_to_go_back_unused() {
    let (small, large) = (unused_visits(100), unused_visits(4000));
    assert!(
        large as f64 <= 1.5 * small as f64 + 4.0,
        "unused regions: {small} regions visited by 10 ticks with 100 sessions, {large} with \
         4,000"
    );
}

/// Regions the keeper visits to say when it is next due and to run a tick at
/// which nothing is due, with `n` regions kept (mapped at their agents, checked a
/// while ago) and `n / 10` on their way back (their agent unreachable, retrying).
fn keeper_visits(n: u64) -> u64 {
    use super::keeper::{KeeperTimes, RegionKeeper};
    use crate::wire::rm::Handle;
    let times = KeeperTimes {
        silence_ms: 30_000,
        check_ms: 5_000,
        retry_ms: 1_000,
    };
    let mut k = RegionKeeper::new(times);
    let mut rm = FakeRm::new(Log::default(), u64::MAX);
    let mut agents = FakeAgents::default();
    let handle = |id: u64| Handle {
        region_id: id,
        offset: id * REGION,
        length: REGION,
        token: String::new(),
    };
    for id in 1..=n {
        k.keep(handle(id), Some("agent-a".into()), None, 0);
    }
    agents.down.insert("agent-b".into());
    for id in n + 1..=n + n / 10 {
        k.give_back(
            handle(id),
            Some("agent-b".into()),
            false,
            super::keeper::GiveBackReason::Unused,
            0,
        );
    }
    k.run(0, &mut rm, &mut agents);
    assert_eq!(k.kept_len() as u64, n, "all mapped");
    let before = k.visited();
    let next = k.next_deadline();
    assert!(next.is_some_and(|t| t > 10), "nothing due before the retry");
    k.run(10, &mut rm, &mut agents);
    k.visited() - before
}

#[test]
fn the_keeper_visits_only_the_regions_due() {
    let (small, large) = (keeper_visits(100), keeper_visits(4000));
    assert!(
        large as f64 <= 1.5 * small as f64 + 4.0,
        "keeper: {small} regions visited with 100 regions kept, {large} with 4,000"
    );
}

/// Resident bytes of this process (Linux; 0 elsewhere).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Resident bytes per key of a key directory of `n` keys named as the scale bench
/// names them (32 hex digits), each chained to the one before it or not.
fn directory_bytes_per_key(n: u64, chained: bool) -> f64 {
    use super::keys::{KeyDirectory, Location, Scope};
    let before = rss_bytes();
    let mut d = KeyDirectory::new();
    let s = d.scope_id(Scope {
        namespace: "ns".into(),
        layout: "l".into(),
        backend: crate::wire::meta::Backend::RemoteCxl,
    });
    let name = |i: u64| format!("{:016x}{:016x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15), i);
    for i in 0..n {
        let loc = Location {
            region_id: i / 4096,
            offset: (i % 4096) << 18,
            length: 1 << 18,
        };
        let prev = (chained && i % 16 != 0).then(|| name(i - 1));
        d.publish(s, &name(i), loc, prev.as_deref());
    }
    let per_key = rss_bytes().saturating_sub(before) as f64 / n as f64;
    assert_eq!(d.len() as u64, n);
    per_key
}

/// The key directory's resident bytes per key at 1 M keys named as the bench
/// names them, none chained (issue 46: at most 200 per key in all of maru-server).
/// A measurement, run alone so that no other test's memory counts: `cargo test -p
/// maru --lib meta::scale_tests::bytes_per_key_1m -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement: run alone"]
fn bytes_per_key_1m() {
    let b = directory_bytes_per_key(1 << 20, false);
    println!("bytes per key: {b:.0} at 1 M keys, not chained");
}

/// As [`bytes_per_key_1m`], at 4 M keys chained in prompts of 16.
#[test]
#[ignore = "a measurement: run alone"]
fn bytes_per_key_4m() {
    let b = directory_bytes_per_key(4 << 20, true);
    println!("bytes per key: {b:.0} at 4 M keys, chained in prompts of 16");
}
