//! Tests of the durable directory: one per rule, with the fake RM and agents. A
//! "restart" rebuilds the core from the batches made durable before it (an
//! [`Image`]), as maru-server does from its store.

use super::fakes::*;
use super::records::{Image, Sealed};
use super::{MetaConfig, MetaCore, PortError, Tenants, LEASE_RUN_SHIFT, SESSION_RUN_SHIFT};
use crate::wire::meta::{HeldLease, MetaReply, MetaRequest, RegionGrant, RemoveResult};
use crate::wire::rm::RegionInfo;
use std::collections::BTreeMap;

/// A world whose core keeps its directory durable.
fn durable(agents: &[&str]) -> World {
    durable_with(config(agents))
}

/// A world of 16 regions whose core keeps a durable log, under `cfg`.
fn durable_with(cfg: MetaConfig) -> World {
    let mut w = World::with(cfg.clone(), 16 * cfg.region_size);
    w.core = MetaCore::new(cfg).unwrap().keep_durable();
    w
}

/// A durable world on agent A1 with nothing persisted yet, and W1's session in a
/// region whose boot id it reported: (world, image, session, region).
fn booted() -> (World, Image, u64, u64) {
    let mut w = durable(&[A1]);
    let (s, g) = w.open(W1);
    let rid = g.handle.region_id;
    w.heartbeat(W1, s, &[(rid, BOOT)]);
    (w, Image::default(), s, rid)
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

/// maru-server restarts from `img` (what was durable), at the time `w.now`, as the
/// next run on its store.
fn restart(w: &mut World, img: &Image) -> super::Recovered {
    let cfg = w.core.config().clone();
    let mut img = img.clone();
    img.run = (w.core.leases.last_id() >> LEASE_RUN_SHIFT) + 1;
    img.lease_timeout_ms = img.lease_timeout_ms.max(cfg.lease_timeout_ms);
    let (core, rec) = MetaCore::restore(cfg, Tenants::default(), img, w.now).unwrap();
    w.core = core;
    rec
}

/// [`restart`], then the RM's list of what it holds, as maru-server reads it first.
fn restart_with_rm(w: &mut World, img: &Image) {
    restart(w, img);
    let rm = held(w);
    w.core.recovered_rm(&rm, w.now);
}

/// maru-server dies with every batch it made durable in `img`, and `after_ms` later
/// restarts from it and reads the RM's list ([`restart_with_rm`]).
fn crash_and_restart(w: &mut World, img: &mut Image, after_ms: u64) {
    persist(w, img);
    w.now += after_ms;
    restart_with_rm(w, img);
}

/// A heartbeat of `client`'s session that says which leases it holds.
fn say_leases(w: &mut World, client: &str, session: u64, leases: Vec<HeldLease>) {
    let beat = Beat {
        leases: Some(leases),
        ..Beat::default()
    };
    w.beat(client, session, beat).expect("heartbeat");
}

/// What a worker says of a lease it holds, `left_ms` before it runs out.
fn held_lease(l: &crate::wire::meta::LeaseGrant, left_ms: u64) -> HeldLease {
    HeldLease {
        lease_id: l.lease_id,
        region_id: l.region_id,
        offset: l.offset,
        expires_in_ms: left_ms,
    }
}

/// W1's session `s` stores k0, k1, ... into every page of its region.
fn fill_region(w: &mut World, s: u64) -> Vec<crate::wire::meta::PageGrant> {
    let names: Vec<String> = (0..REGION / PAGE).map(|i| format!("k{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    w.store(W1, s, &names)
}

/// `w` with nothing durable yet and a session of W1 open with its first region: the
/// world, the (empty) image, the session and its region.
fn opened(mut w: World) -> (World, Image, (u64, RegionGrant)) {
    let first = w.open(W1);
    (w, Image::default(), first)
}

/// `w` with a writer W1 whose one region is full of keys `k0..k3`, and a reader W2 of
/// the same namespace; both sessions durable in the image returned. The world, the
/// image, the writer's and the reader's session, the writer's pages.
fn full_region(w: World) -> (World, Image, u64, u64, Vec<crate::wire::meta::PageGrant>) {
    let (mut w, mut img, (s, _)) = opened(w);
    let pages = fill_region(&mut w, s);
    let r = w.open_without_region(W2);
    persist(&mut w, &mut img);
    (w, img, s, r, pages)
}

/// The next page W1's session `s` is given is `page` again.
fn assert_page_back(w: &mut World, s: u64, page: &crate::wire::meta::PageGrant) {
    let (pages, missing) = w.alloc(W1, s, 1);
    assert_eq!((pages.len(), missing), (1, 0));
    assert_eq!(pages[0].offset, page.offset);
}

/// [`full_region`] with the reader holding a lease on k0 (a view, say) when
/// maru-server dies, restarted `after_ms` later: the world, the image, the writer's and
/// the reader's session, the writer's pages and the reader's lease of the last run.
fn leased_at_crash(
    after_ms: u64,
) -> (
    World,
    Image,
    u64,
    u64,
    Vec<crate::wire::meta::PageGrant>,
    crate::wire::meta::LeaseGrant,
) {
    let (mut w, mut img, s, r, pages) = full_region(durable(&[]));
    let lease = w.acquire(W2, r, &["k0"])[0].clone().unwrap();
    crash_and_restart(&mut w, &mut img, after_ms);
    (w, img, s, r, pages, lease)
}

/// The reader W2's session `r` releases `lease`: whether that ended a lease.
fn reader_releases(w: &mut World, r: u64, lease: &crate::wire::meta::LeaseGrant) -> bool {
    w.release_leases(W2, r, vec![lease.lease_id]).unwrap() == [true]
}

fn remove(w: &mut World, client: &str, session: u64, key: &str) -> RemoveResult {
    w.remove(client, session, &[key])[0]
}

#[test]
fn a_restart_brings_back_keys_sessions_regions_and_their_places() {
    let (mut w, mut img, s, _) = booted();
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
    // Pages with keys stay taken (and the page reserved before the crash: nobody
    // gets it again); the next store gets another page, or none.
    let (pages, _) = w.alloc(W1, s, 1);
    assert!(pages.iter().all(|p| before
        .iter()
        .all(|l| l.as_ref().unwrap().offset != p.offset)));
}

#[test]
fn a_restart_journals_none_of_the_keys_it_restores() {
    // A recovered key is on disk already: restoring it is no change to record (5 M
    // keys each put in the journal and taken out again cost the recovery ~2 s).
    let (mut w, mut img, s, _) = booted();
    w.store_chain(W1, s, None, &["k1", "k2", "k3", "k4"]);
    persist(&mut w, &mut img);
    let rec = restart(&mut w, &img);
    assert_eq!(rec.keys, 4);
    assert_eq!(w.core.keys.changes(), 0, "restored keys counted as changes");
    assert!(w
        .core
        .keys
        .take_journal()
        .is_some_and(|j| j.put.is_empty() && j.gone.is_empty()));
    assert!(w.acquire(W1, s, &["k1", "k4"]).iter().all(Option::is_some));
}

#[test]
fn a_restart_hands_out_no_key_id_recorded_before() {
    // A new key's record is written without looking for a use-stamp row of its id
    // (maru-server's store): ids of records left out at recovery, whose check fails
    // (k2 here), or that the store could not decode (`key_ids_end`: id 9, with a use
    // stamp of its own on disk), are not handed out again.
    let (mut w, mut img, s, _) = booted();
    w.store_chain(W1, s, None, &["k1", "k2"]);
    persist(&mut w, &mut img);
    let last = img.keys.iter().map(|k| k.id).max().unwrap();
    img.keys.iter_mut().find(|k| k.id == last).unwrap().check ^= 1;
    img.key_ids_end = 10;
    let rec = restart(&mut w, &img);
    assert_eq!((rec.keys, rec.left_out), (1, 1));
    w.core.recovered_rm(&held(&w), w.now);
    w.store_chain(W1, s, None, &["k3"]);
    let ids: Vec<u64> = std::iter::from_fn(|| w.core.take_changes())
        .flat_map(|c| c.records)
        .filter_map(|r| match r {
            super::records::Record::Key(k) => Some(k.id),
            _ => None,
        })
        .collect();
    assert_eq!(ids.len(), 1, "one key published: {ids:?}");
    assert!(ids[0] >= 10, "a recorded id handed out again: {ids:?}");
}

#[test]
fn a_removal_takes_the_use_stamp_row_of_every_key_that_may_have_one() {
    // The store deletes a removed key's use-stamp row only for `KeyGone`: a key whose
    // read's stamp was handed over (k1), or that was restored (k4), may have one; a
    // key never read (k3), or read but removed before its stamp went (k2), has none.
    use super::records::Record;
    let (mut w, mut img, s, _) = booted();
    w.store_chain(W1, s, None, &["k1", "k2", "k3", "k4"]);
    persist(&mut w, &mut img);
    let id = |img: &Image, name: &str| img.keys.iter().find(|k| k.name == name).unwrap().id;
    let (k1, k2, k3, k4) = (
        id(&img, "k1"),
        id(&img, "k2"),
        id(&img, "k3"),
        id(&img, "k4"),
    );
    for k in ["k1", "k2"] {
        let lease = w.acquire(W1, s, &[k])[0].clone().unwrap();
        let ended = w.release_leases(W1, s, vec![lease.lease_id]).unwrap();
        assert_eq!(ended, [true]);
        if k == "k1" {
            persist(&mut w, &mut img);
        }
    }
    let gone = |w: &mut World| -> BTreeMap<u64, bool> {
        std::iter::from_fn(|| w.core.take_changes())
            .flat_map(|c| c.records)
            .filter_map(|r| match r {
                Record::KeyGone(id) => Some((id, true)),
                Record::KeyGoneUnread(id) => Some((id, false)),
                _ => None,
            })
            .collect()
    };
    for k in ["k1", "k2", "k3"] {
        assert_eq!(remove(&mut w, W1, s, k), RemoveResult::Removed);
    }
    let want = BTreeMap::from([(k1, true), (k2, false), (k3, false)]);
    assert_eq!(gone(&mut w), want);
    restart_with_rm(&mut w, &img);
    assert_eq!(remove(&mut w, W1, s, "k4"), RemoveResult::Removed);
    assert_eq!(gone(&mut w), BTreeMap::from([(k4, true)]));
}

#[test]
fn a_restore_orders_each_region_once_and_puts_no_key_in_an_order_tree() {
    // Keys come back in id order, and a key read since it was stored ranks after
    // those stored later. Put in the region's orders one by one, every key after
    // the first read one went to an order's B-tree (issue 46: a tree insert per
    // key, and the tree kept after the recovery).
    let (mut w, mut img, s, rid) = booted();
    w.store_chain(W1, s, None, &["k0", "k1"]);
    w.store_chain(W1, s, None, &["k2", "k3"]);
    assert!(w.acquire(W1, s, &["k0", "k2"]).iter().all(Option::is_some));
    persist(&mut w, &mut img);
    let ids = |w: &World, tails: bool| -> Vec<u64> {
        let k = &w.core.keys;
        let order: Vec<_> = if tails {
            k.tails(rid).collect()
        } else {
            k.ranked_keys(rid).collect()
        };
        order.into_iter().map(|(_, id)| id.get()).collect()
    };
    let (order, tails) = (ids(&w, false), ids(&w, true));
    assert_eq!(tails.len(), 2, "one tail per chain");
    let rec = restart(&mut w, &img);
    assert_eq!(rec.keys, 4);
    assert_eq!(w.core.keys.order_tree_len(), 0, "keys put in a tree");
    assert_eq!(ids(&w, false), order, "the eviction order came back");
    assert_eq!(ids(&w, true), tails, "the tails came back");
    assert_eq!(w.core.keys.region_keys(rid), 4);
}

#[test]
fn a_removed_keys_page_is_handed_out_again_only_once_the_removal_is_durable() {
    let (mut w, mut img, (s, _)) = opened(durable(&[]));
    let stored = fill_region(&mut w, s);
    persist(&mut w, &mut img);
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
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
    assert_page_back(&mut w, s, &stored[0]);
}

/// The same rule when timers run between the removal and its commit: a tick (any
/// deadline of the core) puts back only pages whose removal is durable, so the page
/// of k0 is not handed out while a crash would still bring k0 back onto it.
#[test]
fn a_tick_between_a_removal_and_its_commit_does_not_hand_out_the_page() {
    let (mut w, mut img, (s, _)) = opened(durable(&[]));
    w.alive.push((W1.to_string(), s));
    let stored = fill_region(&mut w, s);
    persist(&mut w, &mut img);
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
    // Timers run (the removal's batch is taken but not yet durable: the commit is
    // under way), well past every deadline of the core.
    let pending = w.core.take_changes().expect("the removal's batch");
    for _ in 0..3 {
        w.advance(1_000);
    }
    let (pages, missing) = w.alloc(W1, s, 1);
    assert_eq!(
        (pages.len(), missing),
        (0, 1),
        "a tick before the commit must not hand out the page of k0"
    );
    // Once the commit is durable, the page comes back, with the next tick at the latest.
    img.apply(&pending);
    w.core.durable(pending.batch, w.now);
    w.advance(1);
    assert_page_back(&mut w, s, &stored[0]);
}

/// A removal's reply waits for its commit (a key said removed stays removed after a
/// crash), unless every key it removed was published since the last batch went to
/// the store: publish and removal then go in one batch, which a crash keeps or loses
/// whole. Its pages wait for that batch either way. Seen failing with every removal
/// answered early (the removal of k0, whose publish the store had: the crash below
/// shows k0 back), with the publish looked up after the key went (every removal
/// waited), and with a removal of a key the store never had recorded anyway.
#[test]
fn a_removal_goes_before_its_commit_only_when_its_keys_publish_is_in_the_same_batch() {
    use super::records::Record;
    use super::ReplyTiming;
    let (mut w, mut img, (s, _)) = opened(durable(&[]));
    w.store(W1, s, &["k0"]);
    // k0's publish goes to the store (its commit under way); k1 and k2 come after.
    let k0_batch = w.core.take_changes().expect("k0's publish");
    let k0 = k0_batch
        .records
        .iter()
        .find_map(|r| match r {
            Record::Key(k) if k.name == "k0" => Some(k.id),
            _ => None,
        })
        .expect("k0's record");
    w.store(W1, s, &["k1", "k2"]);
    assert_eq!(
        w.remove(W1, s, &["k0", "k1"]),
        [RemoveResult::Removed, RemoveResult::Removed]
    );
    assert_eq!(
        w.core.reply_timing(),
        ReplyTiming::AfterItsChanges,
        "the store has k0's publish: its removal must be durable before the reply"
    );
    assert_eq!(remove(&mut w, W1, s, "k2"), RemoveResult::Removed);
    assert_eq!(
        w.core.reply_timing(),
        ReplyTiming::Early,
        "k2's publish and removal share the open batch"
    );
    assert_eq!(w.core.pages_waiting(), 3, "every page waits for the batch");
    // A crash with k0's publish durable and nothing after: k0 is back, as a reply
    // sent before its removal's commit would have denied; k1 and k2 are not.
    let mut crashed_img = img.clone();
    crashed_img.apply(&k0_batch);
    let mut crashed = durable(&[]);
    crashed.now = w.now;
    restart(&mut crashed, &crashed_img);
    assert_eq!(
        crashed.exists(W1, s, &["k0", "k1", "k2"]),
        [true, false, false]
    );
    // The open batch takes k0 out of the store and has no record of k1 or k2.
    let next = w.core.take_changes().expect("the removals' batch");
    let of_keys: Vec<&Record> = next
        .records
        .iter()
        .filter(|r| {
            matches!(
                r,
                Record::Key(_) | Record::KeyGone(_) | Record::KeyGoneUnread(_)
            )
        })
        .collect();
    assert_eq!(of_keys, [&Record::KeyGoneUnread(k0)]);
    img.apply(&k0_batch);
    img.apply(&next);
    w.core.durable(next.batch, w.now);
    assert_eq!(w.core.pages_waiting(), 0);
    let mut restarted = durable(&[]);
    restarted.now = w.now;
    restart(&mut restarted, &img);
    assert_eq!(restarted.exists(W1, s, &["k0", "k1", "k2"]), [false; 3]);
}

#[test]
fn pages_of_recovered_keys_wait_for_the_leases_of_the_last_run() {
    let (mut w, mut img, (s, _)) = opened(durable(&[]));
    fill_region(&mut w, s);
    // A reader of the last run leases k0 and is still reading when the server dies.
    w.acquire(W1, s, &["k0"]);
    crash_and_restart(&mut w, &mut img, 50);
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
    persist(&mut w, &mut img);
    assert_eq!(w.alloc(W1, s, 1).1, 1, "not while the old lease may run");
    // The lease timeout (5 s in the fake config) after the restart, it is free.
    w.advance(5_000);
    persist(&mut w, &mut img);
    assert_eq!(w.alloc(W1, s, 1).1, 0);
}

#[test]
fn a_region_the_rm_no_longer_holds_loses_its_recovered_keys() {
    let (mut w, mut img, (s, g)) = opened(durable(&[]));
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
    let beat = Beat {
        regions: vec![rid],
        ..Beat::default()
    };
    let h = w.beat(W1, s, beat).expect("heartbeat");
    assert_eq!(h.unknown_regions, [rid]);
    // And the record goes with the next batch.
    persist(&mut w, &mut img);
    assert!(img.regions.is_empty() && img.keys.is_empty());
}

#[test]
fn a_region_of_a_rebooted_memory_node_loses_its_recovered_keys() {
    let (mut w, mut img, s, rid) = booted();
    w.store(W1, s, &["a", "b"]);
    // A second engine's region on the same agent, whose keys the keeper holds.
    let (s2, g2) = w.open(W2);
    w.heartbeat(W2, s2, &[(g2.handle.region_id, BOOT)]);
    w.store(W2, s2, &["c"]);
    w.close(W2, s2, true);
    crash_and_restart(&mut w, &mut img, 0);
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
    let (mut w, mut img, s, rid) = booted();
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
    restart_with_rm(&mut w, &img);
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
    fill_region(&mut w, s);
    assert_eq!(w.remove(W1, s, &["k0"]), [RemoveResult::Removed]);
    assert_eq!(w.alloc(W1, s, 1).1, 0);
    assert!(w.core.take_changes().is_none());
}

#[test]
fn pages_of_recovered_keys_are_handed_out_once_every_session_of_the_last_run_said_its_leases() {
    let (mut w, mut img, s, r, _) = full_region(durable(&[]));
    w.now += 50;
    restart_with_rm(&mut w, &img);
    assert_eq!(w.core.last_run_sessions_silent(), Some(2));
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
    persist(&mut w, &mut img);
    // The writer says it holds nothing; the reader has not said yet: it may still
    // be reading k0 under a lease of the last run.
    say_leases(&mut w, W1, s, vec![]);
    assert_eq!(
        w.alloc(W1, s, 1).1,
        1,
        "not while a session of the last run is silent"
    );
    // A heartbeat that says nothing of leases (an older worker) does not count.
    w.heartbeat(W2, r, &[]);
    assert_eq!(w.alloc(W1, s, 1).1, 1);
    say_leases(&mut w, W2, r, vec![]);
    assert_eq!(w.core.last_run_sessions_silent(), None);
    // Long before the lease timeout (5 s in the fake config).
    assert_eq!(
        w.alloc(W1, s, 1).1,
        0,
        "every session said: the page is free"
    );
}

#[test]
fn a_lease_held_across_a_restart_keeps_its_key_and_its_page() {
    let (mut w, mut img, s, r, pages, lease) = leased_at_crash(50);
    say_leases(&mut w, W1, s, vec![]);
    say_leases(&mut w, W2, r, vec![held_lease(&lease, 4_000)]);
    // k0 is leased again: neither a victim nor removable; the others are.
    assert!(!w.victims(W1, s, 8).contains(&"k0".to_string()));
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Leased);
    assert_eq!(remove(&mut w, W1, s, "k1"), RemoveResult::Removed);
    persist(&mut w, &mut img);
    let (got, _) = w.alloc(W1, s, 2);
    assert_eq!(got.len(), 1, "k1's page only");
    assert_eq!(got[0].offset, pages[1].offset);
    // The reader's release of its lease (id of the last run) ends it.
    assert!(reader_releases(&mut w, r, &lease));
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
}

#[test]
fn a_lease_on_a_key_removed_before_its_reader_said_keeps_the_page_until_it_ends() {
    let (mut w, mut img, s, r, pages, lease) = leased_at_crash(50);
    // The writer evicts k0 before the reader's first heartbeat (nothing leases it
    // in this run yet), then says it holds nothing.
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
    persist(&mut w, &mut img);
    say_leases(&mut w, W1, s, vec![]);
    say_leases(&mut w, W2, r, vec![held_lease(&lease, 2_000)]);
    assert_eq!(
        w.alloc(W1, s, 1).1,
        1,
        "k0's page waits while the lease runs"
    );
    w.advance(1_000);
    assert_eq!(w.alloc(W1, s, 1).1, 1);
    w.advance(1_000);
    let (got, missing) = w.alloc(W1, s, 1);
    assert_eq!((got[0].offset, missing), (pages[0].offset, 0));
}

#[test]
fn a_lease_id_of_the_last_run_never_ends_a_lease_of_this_one() {
    let (mut w, _, s, r, _, old) = leased_at_crash(0);
    say_leases(&mut w, W1, s, vec![]);
    say_leases(&mut w, W2, r, vec![]);
    // A new lease on k1, then the worker's late release of its lease of the last
    // run: it ends nothing of this run.
    let new = w.acquire(W2, r, &["k1"])[0].clone().unwrap();
    assert_ne!(new.lease_id, old.lease_id);
    assert!(!reader_releases(&mut w, r, &old));
    assert_eq!(remove(&mut w, W1, s, "k1"), RemoveResult::Leased);
}

#[test]
fn what_a_session_says_of_leases_it_could_not_hold_is_ignored() {
    let (mut w, mut img, s, r, pages) = full_region(durable(&[]));
    // A session of another namespace (another scope), of the last run.
    let (o, _) = w.open_in(W2, "other-ns", w.backend());
    crash_and_restart(&mut w, &mut img, 0);
    let claim = |lease_id: u64, page: usize| HeldLease {
        lease_id,
        region_id: pages[page].region_id,
        offset: pages[page].offset,
        expires_in_ms: 4_000,
    };
    say_leases(&mut w, W1, s, vec![]);
    // The other namespace's session names k0, a key it cannot read; the reader of
    // the namespace names k1 under an id of this run (none of the last run's).
    say_leases(&mut w, W2, o, vec![claim(1, 0)]);
    let this_run = w.core.leases.last_id() + 1;
    say_leases(&mut w, W2, r, vec![claim(this_run, 1)]);
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
    assert_eq!(remove(&mut w, W1, s, "k1"), RemoveResult::Removed);
    persist(&mut w, &mut img);
    assert_eq!(w.core.last_run_sessions_silent(), None);
    let (got, _) = w.alloc(W1, s, 2);
    assert_eq!(got.len(), 2, "both pages, at once");
}

#[test]
fn a_silent_session_of_the_last_run_holds_pages_up_only_until_it_expires() {
    let mut cfg = config(&[]);
    cfg.session_timeout_ms = 2_000;
    let (mut w, mut img, s, _, _) = full_region(durable_with(cfg));
    restart_with_rm(&mut w, &img);
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
    persist(&mut w, &mut img);
    say_leases(&mut w, W1, s, vec![]);
    w.alive = vec![(W1.into(), s)];
    // The reader's worker is gone: its session expires after 2 s (its leases with
    // it), long before the last run's leases (5 s) could run out.
    w.advance(1_000);
    assert_eq!(w.alloc(W1, s, 1).1, 1);
    w.advance(1_100);
    persist(&mut w, &mut img);
    assert_eq!(w.core.last_run_sessions_silent(), None);
    assert_eq!(w.alloc(W1, s, 1).1, 0);
}

#[test]
fn the_wait_for_old_leases_is_the_longest_lease_timeout_of_the_last_run() {
    let (mut w, mut img, s, _, _) = full_region(durable(&[]));
    // The last run granted leases of 8 s; this one grants 5 s.
    img.lease_timeout_ms = 8_000;
    restart_with_rm(&mut w, &img);
    assert_eq!(remove(&mut w, W1, s, "k0"), RemoveResult::Removed);
    persist(&mut w, &mut img);
    // Nobody says anything (old workers); the sessions are kept alive.
    w.alive = vec![(W1.into(), s)];
    w.advance(5_000);
    persist(&mut w, &mut img);
    assert_eq!(
        w.alloc(W1, s, 1).1,
        1,
        "an 8 s lease of the last run may still run"
    );
    w.advance(3_000);
    persist(&mut w, &mut img);
    assert_eq!(w.alloc(W1, s, 1).1, 0);
}

/// Seen failing with `PageAllocator::in_use` counting allocated pages only (the region
/// went back as unused while a page of it waited for the last run's leases).
#[test]
fn a_region_whose_pages_wait_for_old_leases_is_not_given_back_as_unused() {
    let mut cfg = config(&[]);
    cfg.unused_region_ms = 1_000;
    let (mut w, mut img, s, _, pages) = full_region(durable_with(cfg));
    let rid = pages[0].region_id;
    restart_with_rm(&mut w, &img);
    // The writer evicts every key of its region; the reader has not said yet.
    for i in 0..REGION / PAGE {
        let k = format!("k{i}");
        assert_eq!(remove(&mut w, W1, s, &k), RemoveResult::Removed);
    }
    persist(&mut w, &mut img);
    w.alive = vec![(W1.into(), s)];
    w.advance(2_000);
    persist(&mut w, &mut img);
    assert!(
        w.at_rm(rid)
            && w.core
                .regions
                .get(rid)
                .is_some_and(|r| r.holder == super::regions::Holder::Session(s)),
        "the region stays the writer's while a reader of the last run may read it"
    );
    assert_eq!(w.alloc(W1, s, 1).1, 1);
}

/// Seen failing with `hold_back_regions` doing nothing (the returned region was freed
/// at the RM before the reader of the last run said which leases it holds).
#[test]
fn a_region_going_back_is_freed_only_once_no_lease_of_the_last_run_can_cover_it() {
    let (mut w, mut img, s, r, pages) = full_region(durable(&[]));
    let rid = pages[0].region_id;
    restart_with_rm(&mut w, &img);
    say_leases(&mut w, W1, s, vec![]);
    // The writer returns its region (asked for its fair share, say) before the reader
    // said which leases it holds: its keys go, but its memory is not handed out.
    let ret = w.return_region(W1, s, rid, true);
    assert!(matches!(ret, Ok(ref x) if !x.freed), "{ret:?}");
    persist(&mut w, &mut img);
    w.advance(1_000);
    assert!(
        w.at_rm(rid),
        "held back while a reader of the last run may read it"
    );
    say_leases(&mut w, W2, r, vec![]);
    w.advance(1_000);
    assert!(
        !w.at_rm(rid),
        "freed once every session of the last run said"
    );
}

#[test]
fn a_region_record_longer_than_a_region_or_with_another_page_count_is_left_out() {
    let (mut w, mut img, _, _, pages) = full_region(durable(&[]));
    let rid = pages[0].region_id;
    let good = img
        .regions
        .iter()
        .find(|r| r.handle.region_id == rid)
        .cloned();
    let good = good.expect("the region is recorded");
    // Page counts no region has: a restore never builds an allocator that large.
    let mut huge = good.clone();
    huge.handle.region_id = rid + 1000;
    huge.handle.length = u64::MAX / 2;
    huge.handle.offset = u64::MAX / 2;
    huge.pages = huge.handle.length / PAGE;
    let mut miscounted = good.clone();
    miscounted.handle.region_id = rid + 1001;
    miscounted.pages = u64::MAX;
    miscounted.handle.offset += 1 << 40;
    // Sealed: their checks hold, the rule here is what refuses them.
    huge.seal();
    miscounted.seal();
    img.regions.push(huge);
    img.regions.push(miscounted);
    let keys = img.keys.len() as u64;
    let rec = restart(&mut w, &img);
    assert_eq!(
        (rec.regions, rec.keys, rec.left_out),
        (1, keys, 2),
        "{rec:?}"
    );
}

/// A region record whose check fails (a bit changed on disk) is dropped with its
/// keys, and so are two region records over the same pages of a pool, checks holding
/// (which one is right cannot be told): none of their keys is served. Seen failing
/// with the overlap check taken out (both regions restored, the keys served).
#[test]
fn region_records_that_fail_their_check_or_overlap_are_dropped_with_their_keys() {
    let (mut w, img, _, _, pages) = full_region(durable(&[]));
    let rid = pages[0].region_id;
    let keys = img.keys.len() as u64;
    assert!(keys > 0);
    let good = img
        .regions
        .iter()
        .find(|r| r.handle.region_id == rid)
        .cloned()
        .expect("the region is recorded");
    let mut twin = good.clone();
    twin.handle.region_id = rid + 1000;
    twin.handle.offset += PAGE;
    twin.seal();
    let mut both = img.clone();
    both.regions.push(twin);
    let rec = restart(&mut w, &both);
    assert_eq!(
        (rec.regions, rec.keys, rec.unverified),
        (0, 0, 2),
        "{rec:?}"
    );
    let mut flipped = img.clone();
    for r in flipped
        .regions
        .iter_mut()
        .filter(|r| r.handle.region_id == rid)
    {
        r.handle.offset ^= 1 << 30;
    }
    let rec = restart(&mut w, &flipped);
    assert_eq!(
        (rec.regions, rec.keys, rec.unverified),
        (0, 0, 1),
        "{rec:?}"
    );
    let rec = restart(&mut w, &img);
    assert_eq!(
        (rec.regions, rec.keys, rec.unverified),
        (1, keys, 0),
        "{rec:?}"
    );
}

/// A durable world whose regions hold 64 pages (a reserve block of 8).
fn durable_big() -> World {
    let mut cfg = config(&[]);
    cfg.region_size = 64 * PAGE;
    durable_with(cfg)
}

/// `(region_id, page)` pairs as the wire names pages.
fn page_refs(pages: &[(u64, u64)]) -> Vec<crate::wire::meta::PageRef> {
    let page_ref = |&(region_id, page): &(u64, u64)| crate::wire::meta::PageRef { region_id, page };
    pages.iter().map(page_ref).collect()
}

fn free_pages(w: &mut World, client: &str, session: u64, pages: &[(u64, u64)]) {
    let pages = page_refs(pages);
    match w.req(client, MetaRequest::FreePages { session, pages }) {
        Ok(MetaReply::PagesFreed { .. }) => {}
        other => panic!("free_pages: {other:?}"),
    }
}

fn entry(key: &str, p: &crate::wire::meta::PageGrant) -> crate::wire::meta::PublishEntry {
    crate::wire::meta::PublishEntry {
        key: key.into(),
        region_id: p.region_id,
        offset: p.offset,
        length: 1000,
        prev: None,
    }
}

/// Allocs one page at a time until none is left; the (region, page) pairs.
fn alloc_all(w: &mut World, client: &str, session: u64) -> Vec<(u64, u64)> {
    let mut got = Vec::new();
    for _ in 0..1_000 {
        let (pages, _) = w.alloc(client, session, 1);
        let Some(p) = pages.first() else {
            return got;
        };
        got.push((p.region_id, p.page));
    }
    panic!("alloc never ran out");
}

/// Seen failing with `take_reserved` ignoring its tag (a page whose reservation was
/// not durable answered early) and with `allocated_pages` leaving reserved pages out
/// of the record (a restart handed the pages of the reserve out again).
#[test]
fn an_alloc_is_answered_early_only_from_pages_whose_reservation_is_durable() {
    use super::ReplyTiming;
    let (mut w, mut img, (s, g)) = opened(durable_big());
    let rid = g.handle.region_id;
    persist(&mut w, &mut img);
    // Nothing reserved yet: the page is taken from the free ones, and its reply
    // waits for its record; a block is reserved with it.
    let (first, _) = w.alloc(W1, s, 1);
    assert_eq!(w.core.reply_timing(), ReplyTiming::AfterAll);
    let c = w
        .core
        .take_changes()
        .expect("the page and the reserve are recorded");
    // The reservation is not durable yet: a page of it waits for it.
    let (second, _) = w.alloc(W1, s, 1);
    assert_eq!(w.core.reply_timing(), ReplyTiming::AfterAll);
    img.apply(&c);
    w.core.durable(c.batch, w.now);
    persist(&mut w, &mut img);
    // Durable now: pages of the reserve are answered without a commit of their own.
    let mut handed = vec![first[0].page, second[0].page];
    let mark = w.core.change_mark();
    // (a block of 8: one handed with the first page, one waited for; 4 left after
    // these 3, which is half a block)
    for _ in 0..3 {
        let (p, _) = w.alloc(W1, s, 1);
        assert_eq!(
            w.core.reply_timing(),
            ReplyTiming::Early,
            "a page of a durable reservation needs no commit"
        );
        handed.push(p[0].page);
    }
    assert_eq!(w.core.change_mark(), mark, "no record changed");
    // Below half a block: the next alloc reserves the next block, and still goes
    // early (what it changed is only the reserve).
    let (p, _) = w.alloc(W1, s, 1);
    handed.push(p[0].page);
    assert_eq!(w.core.reply_timing(), ReplyTiming::Early);
    assert!(w.core.change_mark() > mark, "the next block is recorded");
    let reserved_before_crash: Vec<u64> = img
        .regions
        .iter()
        .find(|r| r.handle.region_id == rid)
        .unwrap()
        .allocated
        .clone();
    assert!(handed.iter().all(|p| reserved_before_crash.contains(p)));
    // A crash now (the new block's record is lost). Whatever the worker was handed,
    // from the reserve or not, no page of it is handed out again, to it or another.
    w.now += 100;
    restart_with_rm(&mut w, &img);
    let again = alloc_all(&mut w, W1, s);
    assert!(!again.is_empty());
    for (r, p) in &again {
        assert!(
            *r != rid || !reserved_before_crash.contains(p),
            "page {p} of region {r} was recorded as the session's before the crash and is \
             handed out again"
        );
    }
    // The session frees what it was handed and did not use: those pages come back
    // (once no lease of the last run may cover them).
    free_pages(&mut w, W1, s, &[(rid, handed[0])]);
    say_leases(&mut w, W1, s, vec![]);
    persist(&mut w, &mut img);
    let (p, _) = w.alloc(W1, s, 1);
    assert_eq!(
        p.iter().map(|p| (p.region_id, p.page)).collect::<Vec<_>>(),
        [(rid, handed[0])],
        "a page the session freed after the restart is handed out again"
    );
}

/// A publish goes before its commit: a crash in the window loses the key, and the
/// rest stays right. Seen failing with `restore` putting pages allocated without a
/// key back on the free list (the lost key's page, whose bytes a reader of the
/// last run may still read, went to another writer).
#[test]
fn a_publish_answered_before_its_commit_is_at_worst_lost_in_a_crash() {
    use super::ReplyTiming;
    use RemoveResult;
    let (mut w, mut img, (s, g)) = opened(durable_big());
    let rid = g.handle.region_id;
    let reader = w.open_without_region(W2);
    w.store(W1, s, &["kept"]);
    persist(&mut w, &mut img);
    // "lost" and "gone" are answered before their commit.
    let (pages, _) = w.alloc(W1, s, 3);
    persist(&mut w, &mut img);
    let mark = w.core.change_mark();
    let is_new = w
        .publish_at(
            W1,
            s,
            vec![entry("lost", &pages[0]), entry("gone", &pages[1])],
        )
        .unwrap();
    assert_eq!(is_new, [true, true]);
    assert_eq!(w.core.reply_timing(), ReplyTiming::Early);
    assert!(w.core.change_mark() > mark, "the keys are recorded");
    // First publish wins against a key not durable yet.
    assert_eq!(
        w.publish_at(W1, s, vec![entry("lost", &pages[2])]).unwrap(),
        [false]
    );
    // A reader takes a lease on it; its owner removes "gone", whose publish is in
    // the same batch: that reply goes at once too (a crash loses both).
    let lease = w.acquire(W2, reader, &["lost"])[0].clone().unwrap();
    let mark = w.core.change_mark();
    assert_eq!(remove(&mut w, W1, s, "gone"), RemoveResult::Removed);
    assert_eq!(w.core.reply_timing(), ReplyTiming::Early);
    assert!(w.core.change_mark() > mark, "a removal is recorded");
    // The removed key's page is not handed out before its removal is durable.
    let got = alloc_all(&mut w, W1, s);
    assert!(!got.contains(&(rid, pages[1].page)));
    // The crash: nothing since the last persist is durable.
    w.now += 100;
    restart_with_rm(&mut w, &img);
    assert_eq!(
        w.exists(W1, s, &["kept", "lost", "gone"]),
        [true, false, false],
        "keys durable before the crash load; keys of the window are lost"
    );
    // The lost keys' pages stay the session's: none is handed out again while a
    // reader of the last run may read them.
    let again = alloc_all(&mut w, W1, s);
    for p in &pages {
        assert!(
            !again.contains(&(rid, p.page)),
            "page {} handed out",
            p.page
        );
    }
    // The worker frees the page of the key it published twice (and learns its
    // publish was lost); while the reader of the last run has not said which
    // leases it holds, the page waits.
    free_pages(&mut w, W1, s, &[(rid, pages[0].page)]);
    say_leases(&mut w, W1, s, vec![]);
    persist(&mut w, &mut img);
    assert_eq!(
        w.alloc(W1, s, 1).0.len(),
        0,
        "a reader of the last run may read it"
    );
    // The reader says it holds its lease for 2 s more: the page waits as long.
    say_leases(&mut w, W2, reader, vec![held_lease(&lease, 2_000)]);
    persist(&mut w, &mut img);
    assert_eq!(w.alloc(W1, s, 1).0.len(), 0, "the lease still covers it");
    w.now += 2_001;
    w.tick();
    persist(&mut w, &mut img);
    let (p, _) = w.alloc(W1, s, 1);
    assert_eq!(
        p.iter().map(|p| (p.region_id, p.page)).collect::<Vec<_>>(),
        [(rid, pages[0].page)],
        "back once the lease of the last run is over"
    );
}

/// A heartbeat of `client`'s session that says which pages it holds without a key;
/// whether the reply asked for it.
fn say_held(w: &mut World, client: &str, session: u64, pages: &[(u64, u64)]) -> bool {
    let beat = Beat {
        held_pages: Some(page_refs(pages)),
        ..Beat::default()
    };
    w.beat(client, session, beat)
        .expect("heartbeat")
        .held_pages_wanted
}

/// After a crash, a session of the last run says which pages it holds without a
/// key; the others it was found holding so (the rest of its reserve block, a page
/// whose publish was lost) are freed, and wait for the leases of the last run like
/// any page freed in doubt. Pages it names stay its own; another session's pages in
/// doubt are untouched by its report, however dishonest. Seen failing with
/// `pages_held` not called (the reserve and the lost publish's page never came
/// back), with it freeing the named pages too (a page the worker still writes was
/// handed out again), and with its check of the session's own regions left out
/// (W2's page in doubt, named by W1, was freed).
#[test]
fn a_report_of_the_pages_held_frees_the_other_pages_in_doubt() {
    use std::collections::BTreeSet;
    let (mut w, mut img, (s, g)) = opened(durable_big());
    let rid = g.handle.region_id;
    let (s2, g2) = w.open(W2);
    let rid2 = g2.handle.region_id;
    let reader = w.open_without_region(W2);
    w.store(W1, s, &["kept"]);
    // W1's worker holds 3 pages (a spare one, two of a store in progress) and
    // publishes a key whose record the crash loses; a reader leases it meanwhile.
    let (pages, _) = w.alloc(W1, s, 4);
    let (other, _) = w.alloc(W2, s2, 2);
    persist(&mut w, &mut img);
    assert_eq!(
        w.publish_at(W1, s, vec![entry("lost", &pages[0])]).unwrap(),
        [true]
    );
    let lease = w.acquire(W2, reader, &["lost"])[0].clone().unwrap();
    // The crash.
    w.now += 100;
    restart_with_rm(&mut w, &img);
    let recorded = |w: &World, rid: u64| -> BTreeSet<u64> {
        let r = w.core.regions.get(rid).unwrap();
        (0..r.pages.pages())
            .filter(|&p| r.pages.is_allocated(p))
            .collect()
    };
    let doubt_s: BTreeSet<u64> = recorded(&w, rid)
        .into_iter()
        .filter(|&p| w.core.keys.at(rid, p * PAGE).is_none())
        .collect();
    assert!(
        doubt_s.len() > pages.len(),
        "the rest of the reserve block is in doubt too: {doubt_s:?}"
    );
    let doubt_s2 = recorded(&w, rid2);
    let (in_doubt, _) = w.core.pages_in_doubt();
    assert_eq!(in_doubt, doubt_s.len() + doubt_s2.len());
    // Every session of the last run is asked; the report is taken once.
    assert!(w.heartbeat_reply(W1, s).held_pages_wanted);
    assert!(w.heartbeat_reply(W2, s2).held_pages_wanted);
    let mine = [
        (rid, pages[1].page),
        (rid, pages[2].page),
        (rid, pages[3].page),
    ];
    // W1 names its own pages, a page of W2's region and one it does not hold.
    let mut said = mine.to_vec();
    said.push((rid2, other[0].page));
    said.push((rid, 63));
    assert!(!say_held(&mut w, W1, s, &said), "asked no more once said");
    assert!(!w.heartbeat_reply(W1, s).held_pages_wanted);
    // A second report changes nothing (the first one counts).
    say_held(&mut w, W1, s, &[]);
    persist(&mut w, &mut img);
    let freed = doubt_s.len() - mine.len();
    // (pages named stay in doubt: freed later, they wait for old leases too)
    assert_eq!(
        w.core.pages_in_doubt(),
        (doubt_s2.len() + mine.len(), freed as u64)
    );
    // Freed, but not handed out while a reader of the last run may read the lost
    // key's page (the reader's session has not said which leases it holds).
    // (the region's free pages are all taken here, so what comes back later is
    // what the report freed)
    let first = alloc_all(&mut w, W1, s);
    assert!(
        first.iter().all(|(r, p)| *r != rid || !doubt_s.contains(p)),
        "pages freed in doubt wait for the leases of the last run: {first:?}"
    );
    say_leases(&mut w, W2, reader, vec![held_lease(&lease, 2_000)]);
    say_leases(&mut w, W1, s, vec![]);
    say_leases(&mut w, W2, s2, vec![]);
    persist(&mut w, &mut img);
    let back: BTreeSet<(u64, u64)> = alloc_all(&mut w, W1, s).into_iter().collect();
    let want: BTreeSet<(u64, u64)> = doubt_s
        .iter()
        .map(|&p| (rid, p))
        .filter(|p| !mine.contains(p) && p.1 != pages[0].page)
        .collect();
    assert_eq!(
        back, want,
        "every page in doubt not named comes back, but the leased one"
    );
    w.now += 2_001;
    w.tick();
    persist(&mut w, &mut img);
    assert_eq!(
        alloc_all(&mut w, W1, s),
        [(rid, pages[0].page)],
        "the lost publish's page once the reader's lease of the last run ran out"
    );
    // W1's named pages are still its own: it frees them (or publishes into them).
    free_pages(&mut w, W1, s, &mine[..1]);
    assert!(
        w.publish_at(W1, s, vec![entry("later", &pages[2])])
            .unwrap()[0]
    );
    // W2's pages are untouched by W1's report: still allocated to W2, in doubt.
    assert_eq!(recorded(&w, rid2), doubt_s2);
    assert!(doubt_s2.contains(&other[0].page));
    // W2 never reports: they stay its own until it frees them.
    free_pages(&mut w, W2, s2, &[(rid2, other[0].page)]);
}

/// A report naming more pages than a report may is refused whole and changes
/// nothing: the session is still asked, and still served.
#[test]
fn an_oversized_report_of_pages_held_is_refused_and_changes_nothing() {
    use crate::wire::meta::{PageRef, MAX_HELD_PAGES};
    use crate::wire::ErrorCode;
    let mut w = durable_big();
    let mut img = Image::default();
    let (s, _) = w.open(W1);
    w.alloc(W1, s, 2);
    crash_and_restart(&mut w, &mut img, 100);
    let before = w.core.pages_in_doubt();
    let beat = Beat {
        held_pages: Some(vec![
            PageRef {
                region_id: 1,
                page: 0
            };
            MAX_HELD_PAGES + 1
        ]),
        ..Beat::default()
    };
    match w.beat(W1, s, beat) {
        Err(e) => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(e.message.contains("held_pages"), "{}", e.message);
        }
        other => panic!("an oversized report must be refused: {other:?}"),
    }
    assert_eq!(w.core.pages_in_doubt(), before);
    assert!(w.heartbeat_reply(W1, s).held_pages_wanted);
}

/// A session allocating fast has its reserve topped up by its rate: with each
/// block's commit landing only after the session's next alloc, a session taking 5
/// pages every 2 ms (more than half a block of 8 per window) waits for a commit at
/// most in its first window; at rest, the reserve is half a block to a block as
/// before. Seen failing with the low mark kept at half a block (the rate ignored):
/// 36 of the 36 allocs after the first window waited for a commit.
#[test]
fn a_session_allocating_fast_gets_its_reserve_topped_up_by_its_rate() {
    use super::{ReplyTiming, RATE_WINDOW_MS, RESERVE_MAX_BLOCKS};
    let mut w = durable_big();
    let mut img = Image::default();
    let (s, g) = w.open(W1);
    let mut regions = vec![g.handle.region_id];
    for _ in 0..8 {
        regions.push(w.expand(W1, s).unwrap().handle.region_id);
    }
    persist(&mut w, &mut img);
    let reserved = |w: &World| -> u64 {
        regions
            .iter()
            .filter_map(|r| w.core.regions.get(*r))
            .map(|r| r.pages.reserved())
            .sum()
    };
    let block = 8; // an eighth of a region of 64 pages
    let mut waited_late = 0;
    let mut lagging = None;
    let start = w.now;
    for i in 0..100 {
        w.now += 2;
        let (p, _) = w.alloc(W1, s, 5);
        assert_eq!(p.len(), 5);
        // (its first full window ends 100 ms in; its rate counts from then)
        let late = w.now >= start + RATE_WINDOW_MS + 10;
        if late && i < 90 && w.core.reply_timing() == ReplyTiming::AfterAll {
            waited_late += 1;
        }
        // The commit of what this alloc reserved lands only after the next alloc.
        if let Some(c) = lagging.take() {
            let c: super::records::Changes = c;
            img.apply(&c);
            w.core.durable(c.batch, w.now);
        }
        lagging = w.core.take_changes();
        assert!(
            reserved(&w) <= RESERVE_MAX_BLOCKS * block,
            "at most {RESERVE_MAX_BLOCKS} blocks reserved: {}",
            reserved(&w)
        );
        if i == 90 {
            break;
        }
    }
    assert_eq!(
        waited_late, 0,
        "allocs of a fast session after its first window wait for no commit"
    );
    assert!(
        reserved(&w) > block,
        "a fast session keeps more than a block"
    );
    // At rest again (a window with nothing taken, then one slow alloc): half a block
    // to a block, as before.
    if let Some(c) = lagging.take() {
        img.apply(&c);
        w.core.durable(c.batch, w.now);
    }
    w.now += 3 * RATE_WINDOW_MS;
    w.alloc(W1, s, 1);
    w.now += RATE_WINDOW_MS;
    let have = reserved(&w);
    let (p, _) = w.alloc(W1, s, (have - block / 2 + 1) as u32);
    assert!(!p.is_empty());
    assert!(
        reserved(&w) <= block,
        "a slow session is topped up to a block: {}",
        reserved(&w)
    );
}

/// What a directory of record format 1 reads back as: the same records without a
/// check of their own (the store's reader of format 1 leaves `check` at 0).
fn as_format1(img: &Image) -> Image {
    let mut old = img.clone();
    old.scopes.iter_mut().for_each(|s| s.check = 0);
    old.sessions.iter_mut().for_each(|s| s.check = 0);
    old.regions.iter_mut().for_each(|g| g.check = 0);
    old.keys.iter_mut().for_each(|k| k.check = 0);
    old
}

/// Issue 49: an upgrade keeps the cache. A directory of record format 1 is refused
/// record by record by the checks of format 2 (every key a miss); sealed once by
/// [`seal_format1`](super::seal_format1) its keys come back, except those it
/// cannot vouch for: two keys recorded at one page (neither is served: at most one
/// is right), a key of a region not recorded. Seen failing with the one-page rule
/// removed from `seal_format1`: k2 was served from k3's page.
#[test]
fn a_format1_directory_is_sealed_keeping_every_key_it_can_vouch_for() {
    let (mut w, mut img, s, rid) = booted();
    w.store_chain(W1, s, None, &["k1", "k2", "k3", "k4"]);
    persist(&mut w, &mut img);
    let mut old = as_format1(&img);
    let rec = restart(&mut w, &old);
    assert_eq!((rec.keys, rec.left_out), (0, 4 + 1 + 1 + 1), "{rec:?}");
    let at = |old: &Image, name: &str| old.keys.iter().position(|k| k.name == name).unwrap();
    let k3_offset = old.keys[at(&old, "k3")].offset;
    let k2 = at(&old, "k2");
    old.keys[k2].offset = k3_offset;
    let k4 = at(&old, "k4");
    old.keys[k4].region_id = rid + 1000;
    let mut sealed = old.clone();
    let done = super::seal_format1(&mut sealed);
    assert_eq!(done.dropped, 3, "{done:?}");
    assert_eq!(done.kept, 1 + 1 + 1 + 1, "{done:?}");
    let rec = restart(&mut w, &sealed);
    assert_eq!(
        (rec.keys, rec.sessions, rec.regions, rec.unverified),
        (1, 1, 1, 0),
        "{rec:?}"
    );
    w.core.recovered_rm(&held(&w), w.now);
    assert_eq!(
        w.exists(W1, s, &["k1", "k2", "k3", "k4"]),
        [true, false, false, false]
    );
    // Sealed records are format 2's: a bit changed since is caught as on any start.
    let mut flipped = sealed.clone();
    flipped.keys[0].offset ^= PAGE;
    let rec = restart(&mut w, &flipped);
    assert_eq!((rec.keys, rec.unverified), (0, 1), "{rec:?}");
}

/// Issue 49: regions of a format-1 directory recorded over one range of their pool
/// are both dropped with their keys when it is sealed (which is right cannot be
/// told). Seen failing with the overlap rule removed from `seal_format1`.
#[test]
fn overlapping_regions_of_a_format1_directory_are_dropped_when_it_is_sealed() {
    let (mut w, img, _, _, pages) = full_region(durable(&[]));
    let rid = pages[0].region_id;
    let mut old = as_format1(&img);
    let mut twin = old
        .regions
        .iter()
        .find(|r| r.handle.region_id == rid)
        .cloned()
        .unwrap();
    twin.handle.region_id = rid + 1000;
    twin.handle.offset += PAGE;
    old.regions.push(twin);
    let done = super::seal_format1(&mut old);
    assert!(
        done.dropped >= 3,
        "two regions and a key at least: {done:?}"
    );
    assert!(old.regions.iter().all(|r| r.handle.region_id != rid));
    assert!(old.keys.iter().all(|k| k.region_id != rid));
    let rec = restart(&mut w, &old);
    assert_eq!((rec.keys, rec.unverified), (0, 0), "{rec:?}");
}

/// Issue 49: the next session id is never one of a recorded session, whatever the
/// counter read back says (a changed or rolled-back counter), also of a session
/// whose record fails its check and is dropped (its worker may still be there).
/// Also when the sessions' records and the counter were rolled back together:
/// ids of a run are above every earlier run's ([`SESSION_RUN_SHIFT`]). Seen
/// failing with the ids of dropped records left out of the floor (the new session
/// got id 2, the id of the dropped one), and with the run floor removed (id 1).
#[test]
fn a_rolled_back_counter_never_hands_out_the_id_of_a_recorded_session() {
    let (mut w, mut img, (s1, _)) = opened(durable(&[]));
    let (s2, _) = w.open(W2);
    persist(&mut w, &mut img);
    assert!(s2 > s1);
    let mut bad = img.clone();
    bad.next_session = 1;
    for s in bad.sessions.iter_mut().filter(|s| s.id == s2) {
        s.engine_id.push('x');
    }
    let rec = restart(&mut w, &bad);
    assert_eq!((rec.sessions, rec.unverified), (1, 1), "{rec:?}");
    let (s3, _) = w.open("worker-3:300");
    assert!(s3 > s2, "new session {s3}: ids {s1} and {s2} are recorded");
    // The store's repair after a crash rolled back the commits of the last run's
    // sessions (none recorded, the counter at 0): this run's ids are above every
    // id of the runs before it.
    let mut lost = Image::default();
    persist(&mut w, &mut lost);
    lost.sessions.clear();
    lost.next_session = 0;
    lost.run = 3;
    let cfg = w.core.config().clone();
    w.core = MetaCore::restore(cfg, Tenants::default(), lost, w.now)
        .unwrap()
        .0;
    let (s4, _) = w.open("worker-4:400");
    assert!(
        s4 > s3,
        "new session {s4}: {s3} was handed out in an earlier run"
    );
    assert!(s4 > 3 << SESSION_RUN_SHIFT);
}
