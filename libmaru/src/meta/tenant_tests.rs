//! Tests of tenants, per-tenant limits and requests that wait for a region: one per
//! rule, fake ports, time passed in.

use super::fakes::*;
use super::tenants::{NsPattern, TenantLimits, TenantSpec, Tenants};
use crate::wire::meta::{Backend, MetaReply, MetaRequest, RemoveResult};
use crate::wire::{ErrorCode, WireError};

const VICTIM: &str = "victim-engine:1";
const READER: &str = "victim-reader:2";
const ATTACKER: &str = "attacker:3";

/// Default limits but for the one `f` changes.
fn limits(f: impl FnOnce(&mut TenantLimits)) -> TenantLimits {
    let mut l = TenantLimits::default();
    f(&mut l);
    l
}

fn spec(name: &str, write: &[&str], read: &[&str], limits: TenantLimits) -> TenantSpec {
    TenantSpec {
        name: name.into(),
        write: Some(write.iter().map(|p| NsPattern::parse(p).unwrap()).collect()),
        read: read.iter().map(|p| NsPattern::parse(p).unwrap()).collect(),
        limits,
    }
}

/// The default tenant, `victim` writing `v-*`, `attacker` writing `a-*` and reading
/// `v-*` (the most an attacker with a key of its own could be given).
fn world(limits: TenantLimits) -> World {
    let mut cfg = config(&[]);
    cfg.max_sessions = 64;
    let mut w = World::with(cfg, 16 * REGION);
    let tenants = Tenants::new(vec![
        TenantSpec::unclaimed(Default::default()),
        spec("victim", &["v-*"], &[], limits),
        spec("attacker", &["a-*"], &["v-*"], limits),
    ])
    .unwrap();
    w.core.set_tenants(tenants, w.now);
    w.as_tenant(VICTIM, "victim");
    w.as_tenant(READER, "victim");
    w.as_tenant(ATTACKER, "attacker");
    w
}

fn open(w: &mut World, client: &str, ns: &str, first_region: bool) -> Result<MetaReply, WireError> {
    w.req(
        client,
        MetaRequest::OpenSession {
            engine_id: format!("e-{client}"),
            namespace: ns.into(),
            layout: "l".into(),
            backend: Backend::Cxl,
            first_region,
        },
    )
}

fn session(r: Result<MetaReply, WireError>) -> u64 {
    match r {
        Ok(MetaReply::Session(s)) => s.session,
        other => panic!("open_session: {other:?}"),
    }
}

#[test]
fn a_session_opens_only_where_its_tenant_writes_or_reads() {
    let mut w = world(TenantLimits::default());
    let e = open(&mut w, ATTACKER, "elsewhere", false).unwrap_err();
    assert_eq!(e.code, ErrorCode::Permission, "{e}");
    assert!(e.message.contains("tenant attacker"), "{e}");
    // Where it only reads: a session without a region, which never gets one.
    let MetaReply::Session(s) = open(&mut w, ATTACKER, "v-llama", true).unwrap() else {
        panic!("session");
    };
    assert!(s.region.is_none(), "a reading session takes no region");
    let e = w.expand(ATTACKER, s.session).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSpace, "stores skip, loads go on: {e}");
    assert_eq!(w.core.region_count(), 0);
}

#[test]
fn another_tenant_cannot_publish_pin_or_remove_in_a_victims_namespace() {
    let mut w = world(TenantLimits::default());
    // The attacker computes the victim's chunk keys (sha256 of namespace + tokens)
    // and opens where it may: reading the victim's namespace, writing its own.
    let spy = session(open(&mut w, ATTACKER, "v-llama", false));
    let own = session(open(&mut w, ATTACKER, "a-own", true));
    let (pages, _) = w.alloc(ATTACKER, own, 2);
    let forged = vec![entry("k0", pages[0].region_id, pages[0].offset)];
    let e = w.publish_at(ATTACKER, spy, forged.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::Permission, "{e}");
    // Publishing the same names in its own namespace lands in its own scope.
    assert_eq!(w.publish_at(ATTACKER, own, forged).unwrap(), [true]);
    // The victim stores its chunks: new, in its own pages.
    let victim = session(open(&mut w, VICTIM, "v-llama", true));
    let stored = w.store(VICTIM, victim, &["k0", "k1"]);
    // Another engine of the victim's tenant shares them as before, and reads the
    // victim's pages, not the attacker's.
    let reader = session(open(&mut w, READER, "v-llama", false));
    let leases = w.acquire(READER, reader, &["k0", "k1"]);
    for (l, p) in leases.iter().zip(&stored) {
        let l = l.as_ref().expect("found");
        assert_eq!((l.region_id, l.offset), (p.region_id, p.offset));
    }
    w.release_leases(
        READER,
        reader,
        leases.iter().flatten().map(|l| l.lease_id).collect(),
    )
    .unwrap();
    // The attacker can neither pin nor remove the victim's keys.
    for req in [
        MetaRequest::Pin {
            session: spy,
            keys: strings(&["k0"]),
        },
        MetaRequest::Remove {
            session: spy,
            keys: strings(&["k0"]),
        },
    ] {
        let e = w.req(ATTACKER, req).unwrap_err();
        assert_eq!(e.code, ErrorCode::Permission, "{e}");
    }
    // Reading is what it was given.
    assert_eq!(w.exists(ATTACKER, spy, &["k0", "k1"]), [true, true]);
    // The victim's own remove still works (nothing pinned it).
    let results = w.remove(VICTIM, victim, &["k1"]);
    assert_eq!(results, [RemoveResult::Removed]);
}

#[test]
fn the_first_publish_wins_among_the_sessions_of_one_tenant() {
    let mut w = world(TenantLimits::default());
    let a = session(open(&mut w, VICTIM, "v-llama", true));
    let b = session(open(&mut w, READER, "v-llama", true));
    w.store(VICTIM, a, &["k"]);
    let (pages, _) = w.alloc(READER, b, 1);
    let is_new = w
        .publish_at(
            READER,
            b,
            vec![entry("k", pages[0].region_id, pages[0].offset)],
        )
        .unwrap();
    assert_eq!(
        is_new,
        [false],
        "the second engine's publish changes nothing"
    );
}

#[test]
fn sessions_count_per_tenant_opens_waiting_for_a_region_included() {
    let mut w = world(limits(|l| l.max_sessions = 2));
    session(open(&mut w, VICTIM, "v-1", false));
    // An open waiting for its region counts.
    let waiting = w
        .send(
            VICTIM,
            MetaRequest::OpenSession {
                engine_id: "e".into(),
                namespace: "v-2".into(),
                layout: "l".into(),
                backend: Backend::Cxl,
                first_region: true,
            },
        )
        .expect_err("waits for the RM");
    let e = open(&mut w, READER, "v-3", false).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert!(e.message.contains("tenant victim has 2 sessions"), "{e}");
    // Other tenants are not limited by it.
    session(open(&mut w, ATTACKER, "a-1", false));
    w.run_actions();
    assert!(matches!(
        w.answers.remove(&waiting),
        Some(Ok(MetaReply::Session(_)))
    ));
}

#[test]
fn pins_count_per_tenant_across_its_sessions() {
    let mut w = world(limits(|l| l.max_pins = 3));
    let a = session(open(&mut w, VICTIM, "v-1", true));
    w.store(VICTIM, a, &["k0", "k1", "k2", "k3"]);
    let b = session(open(&mut w, READER, "v-1", false));
    let pin = |w: &mut World, c: &str, s: u64, k: &[&str]| w.try_pin(c, s, k, true);
    assert!(pin(&mut w, VICTIM, a, &["k0", "k1"]).is_ok());
    let e = pin(&mut w, READER, b, &["k2", "k3"]).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert!(e.message.contains("tenant victim pin 2 keys"), "{e}");
    assert!(pin(&mut w, READER, b, &["k2"]).is_ok(), "the third fits");
}

/// A pool of 16 regions (`World::cxl`): the victim stores first, then the attacker's
/// 14 sessions ask for a region each.
#[test]
fn a_tenant_gets_no_more_than_its_share_however_many_sessions_it_opens() {
    let mut w = world(TenantLimits::default());
    let v = session(open(&mut w, VICTIM, "v-1", true));
    w.store(VICTIM, v, &["k"]);
    let mut got = 0;
    let mut refused = Vec::new();
    for _ in 0..14 {
        match open(&mut w, ATTACKER, "a-1", true) {
            Ok(MetaReply::Session(s)) if s.region.is_some() => got += 1,
            Err(e) => refused.push(e),
            other => panic!("{other:?}"),
        }
    }
    // Two storing tenants: a share of 8 regions each.
    assert_eq!(got, 8, "{refused:?}");
    assert!(refused
        .iter()
        .all(|e| e.code == ErrorCode::NoSpace && e.message.contains("its share")));
    // The victim grows to its own share while the attacker holds its.
    let mut grown = 0;
    while w.expand(VICTIM, v).is_ok() {
        grown += 1;
    }
    assert_eq!(grown, 7, "the victim holds 8 regions, its share");
}

#[test]
fn max_regions_caps_a_tenant_even_alone() {
    let mut w = world(limits(|l| l.max_regions = 2));
    let v = session(open(&mut w, VICTIM, "v-1", true));
    w.expand(VICTIM, v).unwrap();
    let e = w.expand(VICTIM, v).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSpace);
    assert!(e.message.contains("max_regions"), "{e}");
}

#[test]
fn a_region_held_without_storing_goes_back_after_the_unused_limit() {
    let mut w = World::tuned(|c| c.unused_region_ms = 3_000);
    let (idle, g) = w.open(W1);
    let (busy, _) = w.open(W2);
    let (taken, _) = w.alloc(W2, busy, 1);
    w.run_for(2_900, 100);
    assert_eq!(w.core.region_count(), 2, "not yet");
    w.run_for(100, 100);
    assert!(!w.at_rm(g.handle.region_id), "released, then freed");
    w.assert_released_before_freed();
    assert_eq!(
        w.core.region_count(),
        1,
        "the storing session keeps its region"
    );
    // The idle worker hears of it at its next heartbeat.
    let beat = Beat {
        boot_ids: [(g.handle.region_id, BOOT.to_string())].into(),
        ..Beat::default()
    };
    let h = w.beat(W1, idle, beat).expect("heartbeat");
    assert_eq!(h.unknown_regions, [g.handle.region_id]);
    // A region emptied again (its pages freed) counts from then on.
    w.req(
        W2,
        MetaRequest::FreePages {
            session: busy,
            pages: vec![crate::wire::meta::PageRef {
                region_id: taken[0].region_id,
                page: taken[0].page,
            }],
        },
    )
    .unwrap();
    w.run_for(2_900, 100);
    assert_eq!(w.core.region_count(), 1);
    w.run_for(3_000, 100);
    assert_eq!(w.core.region_count(), 0);
}

#[test]
fn requests_needing_a_region_wait_for_the_rm_while_others_are_served() {
    let mut w = World::cxl();
    let (s, _) = w.open(W1);
    w.store(W1, s, &["k"]);
    let t = w.send(W1, MetaRequest::Expand { session: s }).unwrap_err();
    assert_eq!(w.core.waiting_for_rm(), 1);
    assert_eq!(w.core.total_stats().waiting_for_rm, 1);
    // The RM has not answered: the session is served meanwhile.
    assert_eq!(w.exists(W1, s, &["k"]), [true]);
    assert!(w.answers.is_empty());
    w.run_actions();
    assert!(matches!(
        w.answers.remove(&t),
        Some(Ok(MetaReply::Region(_)))
    ));
    assert_eq!(w.core.waiting_for_rm(), 0);
}

#[test]
fn one_allocation_is_in_flight_and_a_late_region_goes_to_the_next_waiter() {
    let mut w = World::cxl();
    let (a, _) = w.open(W1);
    let first = w.send(W1, MetaRequest::Expand { session: a }).unwrap_err();
    let alloc = match w.core.next_action() {
        Some(super::Action::Alloc { alloc, size }) => {
            assert_eq!(size, REGION);
            alloc
        }
        other => panic!("an allocation, not {other:?}"),
    };
    let second = w.send(W1, MetaRequest::Expand { session: a }).unwrap_err();
    assert_eq!(w.core.next_action(), None, "one in flight at a time");
    // The RM is slow: the first waited too long.
    w.run_for(8_000, 1_000);
    let e = w.answers.remove(&first).expect("answered").unwrap_err();
    assert_eq!(e.code, ErrorCode::Internal);
    assert!(e.message.contains("did not answer"), "{e}");
    assert!(w.answers.remove(&second).is_some(), "both waited 8 s");
    // The next one waits for the same allocation, whose region comes late.
    let third = w.send(W1, MetaRequest::Expand { session: a }).unwrap_err();
    let r = w.rm.alloc(REGION);
    w.core.alloc_done(alloc, r, w.now, &mut w.rm);
    w.answers.extend(w.core.take_answers());
    assert!(matches!(
        w.answers.remove(&third),
        Some(Ok(MetaReply::Region(_)))
    ));
}

#[test]
fn a_region_nobody_waits_for_any_more_goes_back() {
    let mut w = World::cxl();
    let (a, _) = w.open(W1);
    let t = w.send(W1, MetaRequest::Expand { session: a }).unwrap_err();
    w.close(W1, a, false);
    w.tick();
    assert!(w.rm.allocated.is_empty());
    w.run_actions();
    let e = w.answers.remove(&t).unwrap().unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSession, "its session is closed: {e}");
    assert!(w.rm.allocated.is_empty(), "allocated, then freed");
    assert_eq!(w.core.region_count(), 0);
    // A cancelled request (its connection closed) takes no region either.
    let (b, _) = w.open(W2);
    let t = w.send(W2, MetaRequest::Expand { session: b }).unwrap_err();
    w.core.cancel(t);
    w.run_actions();
    assert!(!w.answers.contains_key(&t));
    assert_eq!(w.core.region_count(), 1, "only b's first region");
}

#[test]
fn requests_waiting_for_a_region_are_bounded_per_tenant() {
    let mut w = world(limits(|l| l.max_parked = 2));
    let v = session(open(&mut w, VICTIM, "v-1", false));
    for _ in 0..2 {
        w.send(VICTIM, MetaRequest::Expand { session: v })
            .unwrap_err();
    }
    let e = w
        .send(VICTIM, MetaRequest::Expand { session: v })
        .expect("answered at once")
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Internal, "retry: {e}");
    assert!(e.message.contains("tenant victim"), "{e}");
    // Another tenant still waits its turn.
    let a = session(open(&mut w, ATTACKER, "a-1", false));
    assert!(w
        .send(ATTACKER, MetaRequest::Expand { session: a })
        .is_err());
    assert_eq!(w.core.waiting_for_rm(), 3);
}

#[test]
fn the_rms_answer_decides_every_waiter_it_concerns() {
    let mut w = World::with(config(&[]), REGION);
    let (a, _) = w.open(W1);
    let b = w.open_without_region(W2);
    // The RM is full: the oldest waiter hears no_space, the next asks again.
    let ta = w.send(W1, MetaRequest::Expand { session: a }).unwrap_err();
    let tb = w.send(W2, MetaRequest::Expand { session: b }).unwrap_err();
    w.run_actions();
    for t in [ta, tb] {
        let e = w.answers.remove(&t).unwrap().unwrap_err();
        assert_eq!(e.code, ErrorCode::NoSpace, "{e}");
    }
    // The RM is unreachable: every waiter hears "retry" from the one failure.
    let mut w = World::with(config(&[]), REGION);
    let a = w.open_without_region(W1);
    let b = w.open_without_region(W2);
    let ta = w.send(W1, MetaRequest::Expand { session: a }).unwrap_err();
    let tb = w.send(W2, MetaRequest::Expand { session: b }).unwrap_err();
    let Some(super::Action::Alloc { alloc, .. }) = w.core.next_action() else {
        panic!("an allocation");
    };
    w.core.alloc_done(
        alloc,
        Err(super::PortError::Unreachable("timed out".into())),
        w.now,
        &mut w.rm,
    );
    w.answers.extend(w.core.take_answers());
    for t in [ta, tb] {
        let e = w.answers.remove(&t).unwrap().unwrap_err();
        assert_eq!(e.code, ErrorCode::Internal, "{e}");
    }
    assert_eq!(w.core.next_action(), None);
}

#[test]
fn reloaded_tenants_end_sessions_whose_access_changed() {
    let mut w = world(TenantLimits::default());
    let v = session(open(&mut w, VICTIM, "v-1", true));
    w.store(VICTIM, v, &["k"]);
    let a = session(open(&mut w, ATTACKER, "a-1", false));
    // The operator takes the victim tenant out of the tenants file.
    let tenants = Tenants::new(vec![
        TenantSpec::unclaimed(Default::default()),
        spec("attacker", &["a-*"], &[], TenantLimits::default()),
    ])
    .unwrap();
    assert_eq!(w.core.set_tenants(tenants, w.now), 1);
    let e = w
        .req(
            VICTIM,
            MetaRequest::Exists {
                session: v,
                keys: strings(&["k"]),
            },
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSession, "{e}");
    assert_eq!(w.exists(ATTACKER, a, &["k"]), [false]);
    // Its region with keys is kept, as at a drained close.
    assert_eq!(w.core.total_stats().kept_regions, 1);
    // A key of the removed tenant opens nothing.
    assert_eq!(
        open(&mut w, VICTIM, "v-1", false).unwrap_err().code,
        ErrorCode::Permission
    );
}

#[test]
fn stats_and_usage_show_a_tenant_its_own_sessions_and_the_operator_all() {
    let mut w = world(TenantLimits::default());
    let v = session(open(&mut w, VICTIM, "v-1", false));
    session(open(&mut w, ATTACKER, "a-1", false));
    let Ok(MetaReply::Usage(u)) = w.req(ATTACKER, MetaRequest::Usage) else {
        panic!("usage");
    };
    assert_eq!(u.sessions.len(), 1);
    assert_eq!(u.sessions[0].tenant, "attacker");
    let e = w
        .req(ATTACKER, MetaRequest::Stats { session: Some(v) })
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    let Ok(MetaReply::Stats(st)) = w.req("operator", MetaRequest::Stats { session: None }) else {
        panic!("stats");
    };
    assert_eq!(
        st.sessions.len(),
        2,
        "the default tenant sees every session"
    );
}
