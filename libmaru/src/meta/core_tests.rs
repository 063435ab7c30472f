//! Tests of the metadata core's sessions, keys, leases and eviction: one per rule,
//! fake ports, time passed in.

use super::fakes::*;
use super::MetaConfig;
use crate::auth::read_token;
use crate::wire::meta::{
    Backend, MetaReply, MetaRequest, PageRef, PublishEntry, RegionGrant, RemoveResult, SkipCounts,
    TotalStats, CAP_CXL_STORAGE, CAP_REMOTE_CXL_STORAGE, LEASE_LIMIT, MAX_BATCH,
};
use crate::wire::{ErrorCode, WireError};

/// An OPEN_SESSION of a remote_cxl session with its first region.
fn open_remote() -> MetaRequest {
    MetaRequest::OpenSession {
        engine_id: "e".into(),
        namespace: "ns".into(),
        layout: "l".into(),
        backend: Backend::RemoteCxl,
        first_region: true,
    }
}

/// A world where a session of [`W1`] stored `k`: the world, the session, its region
/// and the totals then.
fn k_stored() -> (World, u64, RegionGrant, TotalStats) {
    let mut w = World::remote();
    let (a, g) = w.open(W1);
    w.store(W1, a, &["k"]);
    let before = totals(&w);
    (w, a, g, before)
}

/// Nothing changed since [`k_stored`]: the same totals, and `k` still there.
fn assert_untouched(w: &mut World, a: u64, before: &TotalStats) {
    assert_eq!(&totals(w), before);
    assert_eq!(w.exists(W1, a, &["k"]), vec![true]);
}

fn code<T: std::fmt::Debug>(r: Result<T, WireError>) -> ErrorCode {
    match r {
        Err(e) => e.code,
        Ok(r) => panic!("expected an error, got {r:?}"),
    }
}

fn totals(w: &World) -> TotalStats {
    w.core.total_stats()
}

#[test]
fn the_handshake_offers_remote_cxl_only_with_agents() {
    for (mut w, remote) in [(World::cxl(), false), (World::remote(), true)] {
        let Ok(MetaReply::Handshake(h)) = w.req(W1, MetaRequest::Handshake {}) else {
            panic!("handshake");
        };
        assert!(h.capabilities.contains(&CAP_CXL_STORAGE.to_string()));
        assert_eq!(
            h.capabilities.contains(&CAP_REMOTE_CXL_STORAGE.to_string()),
            remote
        );
        assert_eq!(h.agents.len(), if remote { 2 } else { 0 });
        assert_eq!((h.region_size, h.chunk_size), (REGION, PAGE));
        assert_eq!(h.rm_address, "10.0.0.1:9850");
    }
    let mut w = World::cxl();
    let r = w.req(W1, open_remote());
    assert_eq!(code(r), ErrorCode::Unsupported);
    assert!(w.calls().is_empty(), "no region was asked for");
}

#[test]
fn a_session_gets_a_region_with_its_agent_and_pages() {
    let mut w = World::remote();
    let (_, g) = w.open(W1);
    assert_eq!(g.pages, REGION / PAGE);
    assert_eq!(g.page_size, PAGE);
    let agent = g.agent.clone().unwrap();
    assert!(agent == A1 || agent == A2);
    assert_eq!(
        super::regions::agent_for(g.handle.region_id, &[A1.into(), A2.into()]),
        Some(agent)
    );
    let mut c = World::cxl();
    let (_, g) = c.open(W1);
    assert_eq!(g.agent, None);
}

#[test]
fn a_key_is_not_found_before_it_is_published() {
    let (mut w, (a, ga), (b, _)) = World::remote().with_two_sessions();
    // The worker's route key is the request's first chunk key: still not published.
    let Ok(MetaReply::Pages(p)) = w.req(
        W1,
        MetaRequest::Alloc {
            session: a,
            count: 1,
            route_key: Some("k".into()),
        },
    ) else {
        panic!("alloc");
    };
    let pages = p.pages;
    // The WRITE is in flight: the page is taken, the key is not published.
    assert_eq!(w.exists(W2, b, &["k"]), vec![false]);
    assert_eq!(w.exists(W1, a, &["k"]), vec![false]);
    assert_eq!(w.acquire(W2, b, &["k"]), vec![None]);
    let p = pages[0];
    assert_eq!(
        w.publish_at(W1, a, vec![entry("k", p.region_id, p.offset)])
            .unwrap(),
        vec![true]
    );
    assert_eq!(w.exists(W2, b, &["k"]), vec![true]);
    let lease = w
        .acquire(W2, b, &["k"])
        .remove(0)
        .expect("found after publish");
    assert_eq!(
        (lease.region_id, lease.offset, lease.length),
        (p.region_id, p.offset, 1000)
    );
    assert_eq!(
        lease.read_token,
        read_token(&ga.handle.token, p.region_id, p.offset, 1000)
    );
    assert_eq!(lease.agent, ga.agent);
    assert_eq!(
        lease.device, None,
        "remote_cxl readers go through the agent"
    );
}

/// A cxl lease says where its region is on the device (the first lease of each
/// region in a reply: the wire's decoder gives it to the later ones), and carries
/// no read token: a cxl reader maps the device itself and nothing checks one. (A
/// `remote_cxl` lease always carries its token: `a_key_is_not_found_before_it_is_published`,
/// seen failing with tokens left out for every backend.)
#[test]
fn cxl_leases_say_where_the_region_is_on_the_device() {
    let (mut w, (a, ga), (b, _)) = World::cxl().with_two_sessions();
    w.store(W1, a, &["k", "k2"]);
    let leases = w.acquire(W2, b, &["k", "k2"]);
    let [Some(lease), Some(second)] = &leases[..] else {
        panic!("both found: {leases:?}");
    };
    let d = lease.device.clone().unwrap();
    assert_eq!(
        (d.region_offset, d.region_length, d.uuid),
        (ga.handle.offset, ga.handle.length, ga.pool.uuid)
    );
    assert_eq!(lease.agent, None);
    assert_eq!(second.region_id, lease.region_id);
    assert_eq!(second.device, None, "named once per region and reply");
    assert!(lease.read_token.is_empty() && second.read_token.is_empty());
}

#[test]
fn a_session_publishes_only_into_its_own_regions() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    let (pages, _) = w.alloc(W1, a, 2);
    let p = pages[0];
    // B names A's region (and an allocated page of it): refused, nothing published.
    let e = w
        .publish_at(
            W2,
            b,
            vec![
                entry("mine", 999, 0),
                entry("theirs", p.region_id, p.offset),
            ],
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Permission, "{e}");
    let e = w
        .publish_at(W2, b, vec![entry("theirs", p.region_id, p.offset)])
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Permission, "{e}");
    assert!(e.message.contains("own regions"), "{e}");
    assert_eq!(w.exists(W1, a, &["theirs"]), vec![false]);
    assert_eq!(w.exists(W2, b, &["theirs"]), vec![false]);
    // A's page is still A's to publish into.
    assert_eq!(
        w.publish_at(W1, a, vec![entry("k", p.region_id, p.offset)])
            .unwrap(),
        vec![true]
    );
}

#[test]
fn publish_needs_an_allocated_page_and_a_sane_length() {
    let mut w = World::remote();
    let (a, g) = w.open(W1);
    let r = g.handle.region_id;
    let (pages, _) = w.alloc(W1, a, 1);
    let p = pages[0];
    for bad in [
        entry("k", r, PAGE),         // not allocated
        entry("k", r, p.offset + 1), // not a page start
        PublishEntry {
            length: 0,
            prev: None,
            ..entry("k", r, p.offset)
        },
        PublishEntry {
            length: PAGE + 1,
            prev: None,
            ..entry("k", r, p.offset)
        },
        entry("", r, p.offset),
    ] {
        let e = w.publish_at(W1, a, vec![bad.clone()]).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{bad:?}: {e}");
    }
    // Two keys in one page: refused whole.
    let e = w
        .publish_at(
            W1,
            a,
            vec![entry("x", r, p.offset), entry("y", r, p.offset)],
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert_eq!(w.exists(W1, a, &["k", "x", "y"]), vec![false; 3]);
    w.publish_at(W1, a, vec![entry("x", r, p.offset)]).unwrap();
    let e = w
        .publish_at(W1, a, vec![entry("y", r, p.offset)])
        .unwrap_err();
    assert!(e.message.contains("holds another key"), "{e}");
    // A retried publish of the same key at the same page is a no-op.
    assert_eq!(
        w.publish_at(W1, a, vec![entry("x", r, p.offset)]).unwrap(),
        vec![false]
    );
}

#[test]
fn the_first_publish_of_a_key_wins() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    let pa = w.store(W1, a, &["k"])[0];
    let (pages, _) = w.alloc(W2, b, 1);
    let pb = pages[0];
    assert_eq!(
        w.publish_at(W2, b, vec![entry("k", pb.region_id, pb.offset)])
            .unwrap(),
        vec![false]
    );
    let lease = w.acquire(W2, b, &["k"]).remove(0).unwrap();
    assert_eq!((lease.region_id, lease.offset), (pa.region_id, pa.offset));
    // The loser's page holds nothing and goes back with free_pages.
    let r = w.req(
        W2,
        MetaRequest::FreePages {
            session: b,
            pages: vec![PageRef {
                region_id: pb.region_id,
                page: pb.page,
            }],
        },
    );
    assert_eq!(r.unwrap(), MetaReply::PagesFreed { freed: 1 });
}

#[test]
fn keys_are_shared_only_within_namespace_layout_and_backend() {
    let mut w = World::remote();
    let (a, _) = w.open_in(W1, "ns", Backend::RemoteCxl);
    let (other_ns, _) = w.open_in(W2, "other", Backend::RemoteCxl);
    let (cxl, _) = w.open_in(W2, "ns", Backend::Cxl);
    let (same, _) = w.open_in(W2, "ns", Backend::RemoteCxl);
    let Ok(MetaReply::Session(layout)) = w.req(
        W2,
        MetaRequest::OpenSession {
            engine_id: "e".into(),
            namespace: "ns".into(),
            layout: "another-model".into(),
            backend: Backend::RemoteCxl,
            first_region: true,
        },
    ) else {
        panic!("open");
    };
    w.store(W1, a, &["k"]);
    assert_eq!(w.exists(W2, same, &["k"]), vec![true]);
    for s in [other_ns, cxl, layout.session] {
        assert_eq!(w.exists(W2, s, &["k"]), vec![false]);
        assert_eq!(w.acquire(W2, s, &["k"]), vec![None]);
    }
}

#[test]
fn expand_is_refused_for_good_when_a_region_exceeds_the_largest_pool() {
    let mut w = World::remote();
    let (a, _) = w.open(W1);
    w.rm.largest = REGION - 1; // the room is there, but no pool is that large
    w.clear_log();
    let e = w.expand(W1, a).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused, "{e}");
    assert!(e.message.contains("never"), "{e}");
    assert!(
        w.calls().is_empty(),
        "the RM was not asked: {:?}",
        w.calls()
    );
    let r = w.req(W2, open_remote());
    assert_eq!(code(r), ErrorCode::Refused);
    assert_eq!(w.core.session_count(), 1, "no session was opened");
}

#[test]
fn an_rm_without_room_answers_no_space_not_a_refusal() {
    let mut w = World::with(config(&[A1]), 2 * REGION);
    let (a, _) = w.open(W1);
    w.expand(W1, a).unwrap();
    let e = w.expand(W1, a).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSpace, "{e}");
    assert!(e.message.contains("keeps no region"), "{e}");
    w.rm.down = true;
    let e = w.expand(W1, a).unwrap_err();
    assert_eq!(e.code, ErrorCode::Internal, "{e}");
    assert!(e.message.contains("10.0.0.1:9850"), "{e}");
}

#[test]
fn alloc_says_what_is_missing_and_expand_adds_a_region() {
    let mut w = World::remote();
    let (a, g) = w.open(W1);
    let (pages, missing) = w.alloc(W1, a, 6);
    assert_eq!((pages.len(), missing), (4, 2));
    assert!(pages.iter().all(|p| p.region_id == g.handle.region_id));
    assert_eq!(
        w.calls(),
        vec![Call::Alloc(REGION)],
        "alloc never asks the RM"
    );
    let g2 = w.expand(W1, a).unwrap();
    let (pages, missing) = w.alloc(W1, a, 2);
    assert_eq!(missing, 0);
    assert!(pages.iter().all(|p| p.region_id == g2.handle.region_id));
    assert_eq!(pages[1].offset, pages[1].page * PAGE);
}

#[test]
fn victims_are_unleased_keys_of_the_callers_own_regions_oldest_first() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["a0", "a1", "a2"]);
    w.store(W2, b, &["b0", "b1"]);
    // B reads a0 (now the newest of A's), and holds a lease on a1.
    let l = w.acquire(W2, b, &["a0"]).remove(0).unwrap();
    w.release_leases(W2, b, vec![l.lease_id]).unwrap();
    w.acquire(W2, b, &["a1"]);
    let Ok(MetaReply::Victims { victims }) = w.req(
        W1,
        MetaRequest::Victims {
            session: a,
            max: 10,
        },
    ) else {
        panic!("victims");
    };
    let names: Vec<&str> = victims.iter().map(|v| v.key.as_str()).collect();
    assert_eq!(
        names,
        vec!["a2", "a0"],
        "own keys only, leased a1 left out, LRU order"
    );
    let Ok(MetaReply::Victims { victims }) = w.req(W1, MetaRequest::Victims { session: a, max: 1 })
    else {
        panic!("victims");
    };
    assert_eq!(victims.len(), 1);
    assert_eq!(victims[0].key, "a2");
}

#[test]
fn victims_span_the_callers_regions_in_lru_order() {
    let mut w = World::remote();
    let (a, _) = w.open(W1);
    w.expand(W1, a).unwrap();
    let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let pages = w.store(W1, a, &refs);
    assert_ne!(pages[0].region_id, pages[5].region_id);
    let Ok(MetaReply::Victims { victims }) = w.req(W1, MetaRequest::Victims { session: a, max: 6 })
    else {
        panic!("victims");
    };
    let names: Vec<String> = victims.into_iter().map(|v| v.key).collect();
    assert_eq!(names, keys);
}

#[test]
fn remove_refuses_keys_of_other_sessions_and_leased_keys() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    let pa = w.store(W1, a, &["a0", "a1"]);
    w.store(W2, b, &["b0"]);
    w.acquire(W2, b, &["a1"]);
    let results = w.remove(W1, a, &["b0", "a1", "a0", "nope"]);
    assert_eq!(
        results,
        vec![
            RemoveResult::NotOwner,
            RemoveResult::Leased,
            RemoveResult::Removed,
            RemoveResult::NotFound
        ]
    );
    assert_eq!(
        w.exists(W1, a, &["b0", "a1", "a0"]),
        vec![true, true, false]
    );
    // The removed key's page comes back (after the pages never used).
    let (pages, _) = w.alloc(W1, a, 3);
    assert_eq!(pages[2], pa[0]);
}

#[test]
fn a_return_hides_keys_ends_leases_and_frees_at_the_rm() {
    let (mut w, (a, g), (b, _)) = World::remote().with_two_sessions();
    let r = g.handle.region_id;
    w.store(W1, a, &["k0", "k1"]);
    let lease = w.acquire(W2, b, &["k0"]).remove(0).unwrap();
    let ret = w.return_region(W1, a, r, true).unwrap();
    assert!(ret.freed);
    assert_eq!((ret.keys_dropped, ret.leases_ended), (2, 1));
    assert_eq!(w.exists(W2, b, &["k0", "k1"]), vec![false, false]);
    assert_eq!(w.acquire(W2, b, &["k0"]), vec![None]);
    // The reader's late release is told the lease ended: harmless.
    assert_eq!(
        w.release_leases(W2, b, vec![lease.lease_id]).unwrap(),
        vec![false]
    );
    assert!(!w.at_rm(r));
    assert_eq!(w.core.region_count(), 1);
    assert_eq!(totals(&w).leases, 0);
    // The session keeps going without regions until it expands.
    let (pages, missing) = w.alloc(W1, a, 1);
    assert_eq!((pages.len(), missing), (0, 1));
}

#[test]
fn a_remote_return_without_a_confirmed_release_is_released_before_the_free() {
    let (mut w, a, r, agent) = World::remote_session();
    w.agents.down.insert(agent.clone());
    let ret = w.return_region(W1, a, r, false).unwrap();
    assert!(!ret.freed);
    w.run_for(10_000, 1_000);
    assert!(w.at_rm(r), "not freed while its agent cannot release it");
    w.agents.down.clear();
    w.advance(1_000);
    assert!(!w.at_rm(r));
    assert_eq!(w.core.region_count(), 0);
    w.assert_released_before_freed();
}

#[test]
fn a_failed_free_at_the_rm_is_retried() {
    let mut w = World::cxl();
    let (a, g) = w.open(W1);
    let r = g.handle.region_id;
    w.rm.fail_free = true;
    let ret = w.return_region(W1, a, r, false).unwrap();
    assert!(!ret.freed);
    assert_eq!(totals(&w).giving_back, 1);
    w.advance(1_000);
    assert!(w.at_rm(r));
    w.rm.fail_free = false;
    w.advance(1_000);
    assert!(!w.at_rm(r));
    assert_eq!(totals(&w).giving_back, 0);
}

#[test]
fn a_region_of_another_session_is_not_returned() {
    let (mut w, (a, g), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["k"]);
    let r = w.return_region(W2, b, g.handle.region_id, true);
    assert_eq!(code(r), ErrorCode::Permission);
    let r = w.return_region(W2, b, 999, true);
    assert_eq!(code(r), ErrorCode::Refused);
    assert_eq!(w.exists(W2, b, &["k"]), vec![true]);
    assert!(w.at_rm(g.handle.region_id));
}

#[test]
fn a_session_that_stops_sending_expires_and_holds_nothing() {
    let mut w = World::tuned(|c| {
        c.max_sessions = 2;
        c.lease_timeout_ms = 60_000; // outlives the session
    });
    let (a, _) = w.open(W1);
    let (b, _) = w.open(W2);
    w.store(W1, a, &["k"]);
    w.acquire(W1, a, &["k"]);
    assert_eq!(totals(&w).leases, 1);
    // B keeps sending heartbeats; A sends nothing.
    for _ in 0..9 {
        w.advance(1_000);
        w.heartbeat(W2, b, &[]);
    }
    assert_eq!(w.core.session_count(), 2, "not expired before its timeout");
    w.advance(1_000);
    w.heartbeat(W2, b, &[]);
    assert_eq!(w.core.session_count(), 1);
    let e = w.req(W1, MetaRequest::Expand { session: a }).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSession);
    assert!(e.message.contains("expired"), "{e}");
    let t = totals(&w);
    assert_eq!((t.sessions, t.leases), (1, 0), "its leases ended");
    // Its slot is free again.
    w.open(W1);
}

#[test]
fn expiry_is_seen_by_requests_before_any_tick() {
    let mut w = World::tuned(|c| c.max_sessions = 1);
    w.open(W1);
    w.now += 10_000; // no tick ran
    w.open(W2);
}

#[test]
fn any_request_of_a_session_keeps_it_alive() {
    let cfg = MetaConfig {
        rm_check_ms: 60_000, // out of the way of the session's timer
        ..config(&[A1, A2])
    };
    let mut w = World::with(cfg, 16 * REGION);
    let (a, _) = w.open(W1);
    for _ in 0..5 {
        w.advance(9_000);
        w.exists(W1, a, &["k"]);
    }
    assert_eq!(w.core.session_count(), 1);
    assert_eq!(w.core.next_deadline(), Some(w.now + 10_000));
}

#[test]
fn a_changed_boot_id_in_a_heartbeat_drops_the_regions_keys() {
    let (mut w, (a, g), (b, _)) = World::remote().with_two_sessions();
    let r = g.handle.region_id;
    // The worker reports a region's boot id before it publishes keys in it.
    w.heartbeat(W1, a, &[(r, BOOT)]);
    w.store(W1, a, &["k"]);
    w.acquire(W2, b, &["k"]);
    w.heartbeat(W1, a, &[(r, BOOT)]);
    assert_eq!(w.exists(W2, b, &["k"]), vec![true]);
    let beat = Beat {
        boot_ids: [(r, "boot-2".to_string()), (999, "x".to_string())].into(),
        ..Beat::default()
    };
    let h = w.beat(W1, a, beat).expect("heartbeat");
    assert_eq!(h.rebooted_regions, vec![r]);
    assert_eq!(h.unknown_regions, vec![999]);
    // Regions named without boot ids (cxl): only those not the session's come back.
    let beat = Beat {
        regions: vec![998, r],
        ..Beat::default()
    };
    let h = w.beat(W1, a, beat).expect("heartbeat");
    assert_eq!(h.unknown_regions, vec![998]);
    assert!(h.rebooted_regions.is_empty());
    assert_eq!(w.exists(W2, b, &["k"]), vec![false]);
    assert_eq!(totals(&w).leases, 0);
    let beat = Beat {
        boot_ids: [(r, String::new())].into(),
        ..Beat::default()
    };
    let e = w.beat(W1, a, beat).map(MetaReply::Heartbeat);
    assert_eq!(code(e), ErrorCode::BadRequest);
}

#[test]
fn the_session_limit_refuses_clearly() {
    let mut w = World::tuned(|c| c.max_sessions = 1);
    let (a, _) = w.open(W1);
    w.clear_log();
    let e = w.req(W2, open_remote()).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert!(e.message.contains("at most 1"), "{e}");
    assert!(w.calls().is_empty(), "no region was asked for");
    w.close(W1, a, false);
    w.open(W2);
}

#[test]
fn the_lease_limit_refuses_an_acquire_whole() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["k", "j"]);
    let many: Vec<&str> = vec!["k"; LEASE_LIMIT - 1];
    let leases = w.acquire(W2, b, &many);
    assert!(leases.iter().all(Option::is_some));
    let e = w.try_acquire(W2, b, &["k", "j"]).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert!(e.message.contains("at most 4096"), "{e}");
    assert_eq!(totals(&w).leases, LEASE_LIMIT as u64 - 1, "nothing granted");
    // Misses take no lease, so a request of misses passes.
    assert_eq!(w.acquire(W2, b, &["nope", "k"]).len(), 2);
    w.release_leases(W2, b, vec![leases[0].as_ref().unwrap().lease_id])
        .unwrap();
    w.acquire(W2, b, &["j"]);
    // Other sessions have their own limit.
    w.acquire(W1, a, &["k"]);
}

#[test]
fn leases_expire_and_then_stop_protecting_their_key() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["k"]);
    let l = w.acquire(W2, b, &["k"]).remove(0).unwrap();
    assert_eq!(l.expires_in_ms, 5_000);
    w.advance(4_999);
    assert_eq!(totals(&w).leases, 1);
    w.advance(1);
    assert_eq!(totals(&w).leases, 0);
    assert_eq!(
        w.release_leases(W2, b, vec![l.lease_id]).unwrap(),
        vec![false]
    );
    let results = w.remove(W1, a, &["k"]);
    assert_eq!(results, vec![RemoveResult::Removed]);
}

#[test]
fn a_lease_of_another_session_is_refused_and_nothing_is_released() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["k"]);
    let mine = w.acquire(W1, a, &["k"]).remove(0).unwrap().lease_id;
    let theirs = w.acquire(W2, b, &["k"]).remove(0).unwrap().lease_id;
    let e = w.release_leases(W1, a, vec![mine, theirs]).unwrap_err();
    assert_eq!(e.code, ErrorCode::Permission);
    assert!(e.message.contains(&format!("lease {theirs}")), "{e}");
    assert_eq!(totals(&w).leases, 2);
    assert_eq!(w.release_leases(W1, a, vec![mine]).unwrap(), vec![true]);
}

#[test]
fn unknown_sessions_and_sessions_of_other_clients_answer_no_session() {
    let (mut w, a, _, before) = k_stored();
    for (client, session) in [(W1, 99), (W2, a)] {
        for req in [
            MetaRequest::Expand { session },
            MetaRequest::Exists {
                session,
                keys: strings(&["k"]),
            },
            MetaRequest::Remove {
                session,
                keys: strings(&["k"]),
            },
            MetaRequest::Close {
                session,
                drained: false,
            },
            MetaRequest::Victims { session, max: 5 },
        ] {
            let e = w.req(client, req).unwrap_err();
            assert_eq!(e.code, ErrorCode::NoSession, "{e}");
            assert!(e.message.contains("open a new session"), "{e}");
        }
    }
    assert_untouched(&mut w, a, &before);
}

#[test]
fn batches_over_the_cap_are_refused_whole() {
    let (mut w, a, g, before) = k_stored();
    let r = g.handle.region_id;
    let big_keys = vec!["k".to_string(); MAX_BATCH + 1];
    for req in [
        MetaRequest::Exists {
            session: a,
            keys: big_keys.clone(),
        },
        MetaRequest::Acquire {
            session: a,
            keys: big_keys.clone(),
        },
        MetaRequest::Remove {
            session: a,
            keys: big_keys,
        },
        MetaRequest::Publish {
            session: a,
            entries: vec![entry("x", r, 0); MAX_BATCH + 1],
        },
        MetaRequest::Alloc {
            session: a,
            count: MAX_BATCH as u32 + 1,
            route_key: None,
        },
        MetaRequest::FreePages {
            session: a,
            pages: vec![
                PageRef {
                    region_id: r,
                    page: 0
                };
                MAX_BATCH + 1
            ],
        },
        MetaRequest::ReleaseLeases {
            session: a,
            lease_ids: vec![1; MAX_BATCH + 1],
        },
        MetaRequest::Victims {
            session: a,
            max: u32::MAX,
        },
        MetaRequest::Heartbeat {
            session: a,
            boot_ids: (0..=MAX_BATCH as u64)
                .map(|i| (i, "b".to_string()))
                .collect(),
            regions: vec![],
            leases: None,
            skipped: None,
            held_pages: None,
        },
    ] {
        let e = w.req(W1, req).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
        assert!(e.message.contains("at most 4096"), "{e}");
    }
    let long_key = "x".repeat(2000);
    let r2 = w.req(
        W1,
        MetaRequest::Exists {
            session: a,
            keys: vec![long_key],
        },
    );
    assert_eq!(code(r2), ErrorCode::BadRequest);
    assert_untouched(&mut w, a, &before);
}

#[test]
fn free_pages_refuses_double_frees_foreign_pages_and_pages_with_keys() {
    let (mut w, (a, g), (b, _)) = World::remote().with_two_sessions();
    let r = g.handle.region_id;
    let keyed = w.store(W1, a, &["k"])[0];
    let (pages, _) = w.alloc(W1, a, 1);
    let free = PageRef {
        region_id: r,
        page: pages[0].page,
    };
    let keyed = PageRef {
        region_id: r,
        page: keyed.page,
    };
    let unused = PageRef {
        region_id: r,
        page: 3,
    };
    let cases = [
        (W1, a, vec![free, free], ErrorCode::BadRequest),
        (W1, a, vec![free, unused], ErrorCode::BadRequest),
        (W1, a, vec![free, keyed], ErrorCode::BadRequest),
        (
            W1,
            a,
            vec![PageRef {
                region_id: r,
                page: 99,
            }],
            ErrorCode::BadRequest,
        ),
        (W2, b, vec![free], ErrorCode::Permission),
    ];
    for (client, session, pages, want) in cases {
        let got = w.req(client, MetaRequest::FreePages { session, pages });
        assert_eq!(code(got), want);
    }
    let ok = w.req(
        W1,
        MetaRequest::FreePages {
            session: a,
            pages: vec![free],
        },
    );
    assert_eq!(ok.unwrap(), MetaReply::PagesFreed { freed: 1 });
    let again = w.req(
        W1,
        MetaRequest::FreePages {
            session: a,
            pages: vec![free],
        },
    );
    assert_eq!(
        code(again),
        ErrorCode::BadRequest,
        "a double free is refused"
    );
    assert_eq!(w.exists(W1, a, &["k"]), vec![true]);
}

/// Rule: a heartbeat's skip counts are kept per session (the last report wins), shown
/// in `stats` per session and summed in the total without overflow (the counts are
/// the worker's word), and go with the session. Seen failing with the
/// `note_skipped` call taken out of `heartbeat` (stats showed 0).
#[test]
fn skip_counts_of_heartbeats_show_in_stats_per_session_and_in_total() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    let beat = |w: &mut World, client: &str, session: u64, skipped: Option<SkipCounts>| {
        let beat = Beat {
            skipped,
            ..Beat::default()
        };
        w.beat(client, session, beat).expect("heartbeat");
    };
    let stats = |w: &mut World| match w.req(W1, MetaRequest::Stats { session: None }) {
        Ok(MetaReply::Stats(s)) => s,
        other => panic!("stats: {other:?}"),
    };
    let some = SkipCounts {
        no_region: 3,
        max_bytes: 8,
        ..Default::default()
    };
    beat(&mut w, W1, a, Some(SkipCounts { no_slot: 1, ..some }));
    beat(&mut w, W1, a, Some(some));
    // An older worker says nothing: its session shows none.
    beat(&mut w, W2, b, None);
    let s = stats(&mut w);
    assert_eq!(
        (s.sessions[0].skipped, s.sessions[1].skipped),
        (some, SkipCounts::default())
    );
    assert_eq!(s.total.skipped, some);
    let huge = SkipCounts {
        no_region: u64::MAX,
        no_slot: u64::MAX,
        pool_unavailable: u64::MAX,
        max_bytes: u64::MAX,
    };
    beat(&mut w, W2, b, Some(huge));
    assert_eq!(stats(&mut w).total.skipped, huge, "summed, saturating");
    w.close(W2, b, false);
    let s = stats(&mut w);
    assert_eq!((s.sessions.len(), s.total.skipped), (1, some));
}

#[test]
fn stats_count_per_session_and_in_total() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["k0", "k1"]);
    w.acquire(W2, b, &["k0", "nope", "k1"]);
    let Ok(MetaReply::Stats(s)) = w.req(W2, MetaRequest::Stats { session: None }) else {
        panic!("stats");
    };
    assert_eq!(s.sessions.len(), 2);
    let sa = &s.sessions[0];
    assert_eq!(
        (
            sa.session,
            sa.keys,
            sa.regions,
            sa.region_bytes,
            sa.key_bytes
        ),
        (a, 2, 1, REGION, 2000)
    );
    let sb = &s.sessions[1];
    assert_eq!((sb.hits, sb.misses, sb.leases, sb.keys), (2, 1, 2, 0));
    let t = s.total;
    assert_eq!(
        (t.sessions, t.keys, t.regions, t.region_bytes, t.key_bytes),
        (2, 2, 2, 2 * REGION, 2000)
    );
    assert_eq!((t.hits, t.misses, t.leases), (2, 1, 2));
    let Ok(MetaReply::Stats(one)) = w.req(W1, MetaRequest::Stats { session: Some(b) }) else {
        panic!("stats");
    };
    assert_eq!(one.sessions.len(), 1);
    assert_eq!(one.sessions[0].session, b);
    assert_eq!(
        code(w.req(W1, MetaRequest::Stats { session: Some(99) })),
        ErrorCode::Refused
    );
    let Ok(MetaReply::Usage(u)) = w.req(W1, MetaRequest::Usage) else {
        panic!("usage");
    };
    assert_eq!(u.sessions[0].used, 2 * PAGE);
    assert_eq!(u.sessions[0].allocated, REGION);
    // Hits and misses are kept in the total after their session ends.
    w.close(W2, b, true);
    let t = totals(&w);
    assert_eq!((t.sessions, t.hits, t.misses, t.leases), (1, 2, 1, 0));
}

#[test]
fn a_closed_connection_ends_nothing() {
    let mut w = World::remote();
    let (a, _) = w.open(W1);
    w.store(W1, a, &["k"]);
    w.core.client_closed(W1, w.now);
    let Ok(MetaReply::Usage(u)) = w.req(W2, MetaRequest::Usage) else {
        panic!("usage");
    };
    assert!(!u.sessions[0].connected);
    assert_eq!(w.exists(W1, a, &["k"]), vec![true]);
    let Ok(MetaReply::Usage(u)) = w.req(W2, MetaRequest::Usage) else {
        panic!("usage");
    };
    assert!(
        u.sessions[0].connected,
        "its next request marks it connected"
    );
}

#[test]
fn pinned_keys_are_neither_victims_nor_removed_until_unpinned() {
    let (mut w, (a, _), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["a0", "a1"]);
    // Any session of the scope pins; a miss is not pinned.
    assert_eq!(w.pin(W2, b, &["a0", "nope"], true), vec![true, false]);
    assert_eq!(w.pin(W2, b, &["a0"], true), vec![true], "pins count");
    let victims = |w: &mut World| w.victims(W1, a, 9);
    assert_eq!(victims(&mut w), vec!["a1".to_string()]);
    let remove = |w: &mut World| w.remove(W1, a, &["a0"]);
    assert_eq!(remove(&mut w), vec![RemoveResult::Pinned]);
    assert_eq!(totals(&w).pinned_keys, 1);
    // Unpin: only the pinning session's own pins, one per call.
    assert_eq!(w.pin(W1, a, &["a0"], false), vec![false]);
    assert_eq!(w.pin(W2, b, &["a0", "nope"], false), vec![true, false]);
    assert_eq!(remove(&mut w), vec![RemoveResult::Pinned], "one pin left");
    assert_eq!(w.pin(W2, b, &["a0"], false), vec![true]);
    assert_eq!(w.pin(W2, b, &["a0"], false), vec![false]);
    assert_eq!(victims(&mut w).len(), 2);
    assert_eq!(remove(&mut w), vec![RemoveResult::Removed]);
    assert_eq!(totals(&w).pinned_keys, 0);
}

#[test]
fn pins_end_with_their_session_and_with_their_region() {
    let (mut w, (a, g), (b, _)) = World::remote().with_two_sessions();
    w.store(W1, a, &["k0", "k1"]);
    w.pin(W2, b, &["k0"], true);
    let st = |w: &mut World, s: u64| match w.req(W1, MetaRequest::Stats { session: Some(s) }) {
        Ok(MetaReply::Stats(st)) => st.sessions[0].pins,
        r => panic!("stats: {r:?}"),
    };
    assert_eq!(st(&mut w, b), 1);
    w.close(W2, b, true);
    assert_eq!(totals(&w).pinned_keys, 0, "the reader's pins ended with it");
    let (c, _) = w.open(W2);
    w.pin(W2, c, &["k0", "k1"], true);
    assert_eq!(totals(&w).pinned_keys, 2);
    // A returned region drops its keys, so their pins end too.
    w.return_region(W1, a, g.handle.region_id, true).unwrap();
    assert_eq!(totals(&w).pinned_keys, 0);
    assert_eq!(st(&mut w, c), 0);
    assert_eq!(w.pin(W2, c, &["k0"], false), vec![false]);
}

#[test]
fn pin_requests_check_the_session_and_the_batch() {
    let mut w = World::remote();
    let (a, _) = w.open(W1);
    w.store(W1, a, &["k"]);
    let e = w.try_pin(W2, a, &["k"], true).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSession, "{e}");
    let e = w
        .req(
            W1,
            MetaRequest::Unpin {
                session: a,
                keys: vec!["k".to_string(); MAX_BATCH + 1],
            },
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
    assert_eq!(totals(&w).pinned_keys, 0);
}

#[test]
fn keys_published_before_any_boot_id_was_reported_go_at_the_first_report() {
    let mut w = World::remote();
    let (a, g) = w.open(W1);
    let r = g.handle.region_id;
    // Published before maru-server heard a boot id for the region: a reboot may have
    // come in between, and nothing here could tell.
    w.store(W1, a, &["k"]);
    assert_eq!(w.exists(W1, a, &["k"]), vec![true]);
    let beat = Beat {
        boot_ids: [(r, BOOT.to_string())].into(),
        ..Beat::default()
    };
    let h = w.beat(W1, a, beat).expect("heartbeat");
    assert_eq!(h.rebooted_regions, vec![r]);
    assert_eq!(w.exists(W1, a, &["k"]), vec![false]);
    // From now on the boot id is known: the same one keeps new keys.
    w.store(W1, a, &["k2"]);
    w.heartbeat(W1, a, &[(r, BOOT)]);
    assert_eq!(w.exists(W1, a, &["k2"]), vec![true]);
}
