//! Tests of the durable directory: one per rule, with the fake RM and agents. A
//! "restart" rebuilds the core from the batches made durable before it (an
//! [`Image`]), as maru-server does from its store.

use super::fakes::*;
use super::records::Image;
use super::{MetaCore, PortError, Tenants};
use crate::wire::meta::MetaRequest;
use crate::wire::rm::RegionInfo;
use std::collections::BTreeMap;

/// A world whose core keeps its directory durable.
fn durable(agents: &[&str]) -> World {
    let mut w = World::with(config(agents), 16 * REGION);
    w.core = MetaCore::new(config(agents)).unwrap().keep_durable();
    w
}

/// Takes the batches the core made, makes them durable in `img` and tells the core.
fn persist(w: &mut World, img: &mut Image) {
    while let Some(c) = w.core.take_changes() {
        img.apply(&c);
        w.core.durable(c.batch, w.now);
    }
}

/// The regions the fake RM holds, as its `regions` answer to their owner.
fn held(w: &World) -> Vec<RegionInfo> {
    w.rm.allocated
        .values()
        .map(|h| RegionInfo {
            region_id: h.region_id,
            owner: "maru-server".into(),
            pool_id: 0,
            offset: h.offset,
            length: h.length,
            requested: h.length,
            state: "allocated".into(),
            holds: vec![],
            token: Some(h.token.clone()),
        })
        .collect()
}

/// maru-server restarts from `img` (what was durable), at the time `w.now`.
fn restart(w: &mut World, img: &Image) -> super::Recovered {
    let agents = w.core.config().agents.clone();
    let agents: Vec<&str> = agents.iter().map(String::as_str).collect();
    let cfg = config(&agents);
    let (core, rec) = MetaCore::restore(cfg, Tenants::default(), img.clone(), w.now).unwrap();
    w.core = core;
    rec
}

#[test]
fn a_restart_brings_back_keys_sessions_regions_and_their_places() {
    let mut w = durable(&[A1]);
    let mut img = Image::default();
    let (s, g) = w.open(W1);
    let rid = g.handle.region_id;
    w.heartbeat(W1, s, &[(rid, BOOT)]);
    w.store_chain(W1, s, None, &["k1", "k2", "k3"]);
    persist(&mut w, &mut img);
    let before = w.acquire(W1, s, &["k1", "k2", "k3"]);
    w.now += 100;
    let rec = restart(&mut w, &img);
    assert_eq!((rec.keys, rec.regions, rec.sessions), (3, 1, 1));
    w.core.recovered_rm(&held(&w), w.now);
    // Chains came back: the tail goes first.
    assert_eq!(w.victims(W1, s, 1), ["k3"]);
    // The worker's session goes on: same owner, same id, same regions.
    let after = w.acquire(W1, s, &["k1", "k2", "k3"]);
    for (b, a) in before.iter().zip(&after) {
        let (b, a) = (b.as_ref().unwrap(), a.as_ref().unwrap());
        assert_eq!(
            (a.region_id, a.offset, a.length, &a.boot_id),
            (b.region_id, b.offset, b.length, &b.boot_id)
        );
    }
    // Pages with keys stay taken; the next store gets another page.
    let (pages, _) = w.alloc(W1, s, 1);
    assert!(before
        .iter()
        .all(|l| l.as_ref().unwrap().offset != pages[0].offset));
}

#[test]
fn a_removed_keys_page_is_handed_out_again_only_once_the_removal_is_durable() {
    let mut w = durable(&[]);
    let mut img = Image::default();
    let (s, _) = w.open(W1);
    let pages_per_region = REGION / PAGE;
    let all: Vec<String> = (0..pages_per_region).map(|i| format!("k{i}")).collect();
    let names: Vec<&str> = all.iter().map(String::as_str).collect();
    let stored = w.store(W1, s, &names);
    persist(&mut w, &mut img);
    let r = w.req(
        W1,
        MetaRequest::Remove {
            session: s,
            keys: strings(&["k0"]),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    // The removal is not durable: a crash now brings k0 back, so its page is not
    // handed out.
    let (pages, missing) = w.alloc(W1, s, 1);
    assert_eq!(
        (pages.len(), missing),
        (0, 1),
        "the page waits for the removal"
    );
    // A restart from what is durable has k0, in its old page.
    let mut crashed = durable(&[]);
    crashed.now = w.now;
    restart(&mut crashed, &img);
    crashed.rm = FakeRm::new(crashed.log.clone(), 16 * REGION);
    let found = crashed.exists(W1, s, &["k0"]);
    assert_eq!(
        found,
        [true],
        "k0 comes back after a crash before its removal is durable"
    );
    // Once durable, the page is free again.
    persist(&mut w, &mut img);
    let (pages, missing) = w.alloc(W1, s, 1);
    assert_eq!((pages.len(), missing), (1, 0));
    assert_eq!(pages[0].offset, stored[0].offset);
}

#[test]
fn pages_of_recovered_keys_wait_for_the_leases_of_the_last_run() {
    let mut w = durable(&[]);
    let mut img = Image::default();
    let (s, _) = w.open(W1);
    let names: Vec<String> = (0..REGION / PAGE).map(|i| format!("k{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    w.store(W1, s, &names);
    // A reader of the last run leases k0 and is still reading when the server dies.
    w.acquire(W1, s, &["k0"]);
    persist(&mut w, &mut img);
    w.now += 50;
    restart(&mut w, &img);
    w.core.recovered_rm(&held(&w), w.now);
    let r = w.req(
        W1,
        MetaRequest::Remove {
            session: s,
            keys: strings(&["k0"]),
        },
    );
    assert!(r.is_ok(), "{r:?}");
    persist(&mut w, &mut img);
    assert_eq!(w.alloc(W1, s, 1).1, 1, "not while the old lease may run");
    // The lease timeout (5 s in the fake config) after the restart, it is free.
    w.advance(5_000);
    persist(&mut w, &mut img);
    assert_eq!(w.alloc(W1, s, 1).1, 0);
}

#[test]
fn a_region_the_rm_no_longer_holds_loses_its_recovered_keys() {
    let mut w = durable(&[]);
    let mut img = Image::default();
    let (s, g) = w.open(W1);
    w.store(W1, s, &["a", "b"]);
    persist(&mut w, &mut img);
    // While maru-server is away longer than the RM's grace period, the RM reaps.
    let rid = g.handle.region_id;
    let h = w.rm.allocated.remove(&rid).unwrap();
    w.rm.room += h.length;
    restart(&mut w, &img);
    let (regions, keys) = w.core.recovered_rm(&held(&w), w.now);
    assert_eq!((regions, keys), (1, 2));
    assert_eq!(w.exists(W1, s, &["a", "b"]), [false, false]);
    assert_eq!(w.core.region_count(), 0);
    // The worker hears of it as an unknown region.
    let hb = w.req(
        W1,
        MetaRequest::Heartbeat {
            session: s,
            boot_ids: Default::default(),
            regions: vec![rid],
        },
    );
    match hb {
        Ok(crate::wire::meta::MetaReply::Heartbeat(h)) => assert_eq!(h.unknown_regions, [rid]),
        other => panic!("{other:?}"),
    }
    // And the record goes with the next batch.
    persist(&mut w, &mut img);
    assert!(img.regions.is_empty() && img.keys.is_empty());
}

#[test]
fn a_region_of_a_rebooted_memory_node_loses_its_recovered_keys() {
    let mut w = durable(&[A1]);
    let mut img = Image::default();
    let (s, g) = w.open(W1);
    let rid = g.handle.region_id;
    w.heartbeat(W1, s, &[(rid, BOOT)]);
    w.store(W1, s, &["a", "b"]);
    // A second engine's region on the same agent, whose keys the keeper holds.
    let (s2, g2) = w.open(W2);
    w.heartbeat(W2, s2, &[(g2.handle.region_id, BOOT)]);
    w.store(W2, s2, &["c"]);
    w.close(W2, s2, true);
    persist(&mut w, &mut img);
    restart(&mut w, &img);
    w.core.recovered_rm(&held(&w), w.now);
    let mut boots = BTreeMap::new();
    boots.insert(agent_of(&w, rid), Ok("boot-2".to_string()));
    let other = agent_of(&w, g2.handle.region_id);
    boots.insert(other, Ok("boot-2".to_string()));
    let dropped = w.core.recovered_boots(&boots, w.now);
    assert_eq!(dropped, 3);
    assert_eq!(w.exists(W1, s, &["a", "b", "c"]), [false, false, false]);
}

#[test]
fn an_agent_on_the_same_boot_or_silent_keeps_the_recovered_keys() {
    let mut w = durable(&[A1]);
    let mut img = Image::default();
    let (s, g) = w.open(W1);
    let rid = g.handle.region_id;
    w.heartbeat(W1, s, &[(rid, BOOT)]);
    w.store(W1, s, &["a"]);
    persist(&mut w, &mut img);
    for answer in [
        Ok(BOOT.to_string()),
        Err(PortError::Unreachable("down".into())),
    ] {
        restart(&mut w, &img);
        w.core.recovered_rm(&held(&w), w.now);
        let mut boots = BTreeMap::new();
        boots.insert(agent_of(&w, rid), answer);
        assert_eq!(w.core.recovered_boots(&boots, w.now), 0);
        assert_eq!(w.exists(W1, s, &["a"]), [true]);
    }
}

fn agent_of(w: &World, rid: u64) -> String {
    super::regions::agent_for(rid, &w.core.config().agents).unwrap()
}

#[test]
fn a_region_the_rm_holds_but_the_directory_lost_goes_back() {
    let mut w = durable(&[A1]);
    let mut img = Image::default();
    let (s, _) = w.open(W1);
    persist(&mut w, &mut img);
    // An expand the RM answered as maru-server died: its record never became durable.
    let g2 = w.expand(W1, s).unwrap();
    let lost = g2.handle.region_id;
    restart(&mut w, &img);
    w.core.recovered_rm(&held(&w), w.now);
    w.clear_log();
    w.tick();
    assert!(!w.at_rm(lost), "given back");
    assert!(w.calls().contains(&Call::Release(agent_of(&w, lost), lost)));
    w.assert_released_before_freed();
}

#[test]
fn replies_that_change_the_directory_move_the_change_mark_and_reads_do_not() {
    let mut w = durable(&[]);
    let (s, _) = w.open(W1);
    w.store(W1, s, &["a"]);
    w.core.take_changes();
    let mark = w.core.change_mark();
    w.acquire(W1, s, &["a"]);
    w.exists(W1, s, &["a"]);
    w.heartbeat(W1, s, &[]);
    assert_eq!(
        w.core.change_mark(),
        mark,
        "reads and heartbeats change nothing durable"
    );
    w.alloc(W1, s, 1);
    assert!(
        w.core.change_mark() > mark,
        "pages handed out are durable first"
    );
    // A read is recorded (the eviction order) without holding anything.
    let c = w.core.take_changes().unwrap();
    assert!(c
        .records
        .iter()
        .any(|r| matches!(r, super::records::Record::Used { .. })));
}

#[test]
fn the_in_memory_core_hands_a_removed_keys_page_out_at_once_and_records_nothing() {
    let mut w = World::cxl();
    let (s, _) = w.open(W1);
    let names: Vec<String> = (0..REGION / PAGE).map(|i| format!("k{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    w.store(W1, s, &names);
    w.req(
        W1,
        MetaRequest::Remove {
            session: s,
            keys: strings(&["k0"]),
        },
    )
    .unwrap();
    assert_eq!(w.alloc(W1, s, 1).1, 0);
    assert!(w.core.take_changes().is_none());
}
