//! Tests of the resource manager core: one per rule, time passed in, no sockets.

use super::*;
use crate::rm::store::tests::TempDir;
use crate::rm::{DirStore, MemStore, Step};

const MB2: u64 = 2 << 20;
const SECRET: [u8; 32] = [7u8; 32];
const C: &str = "host-a:100";

/// A devdax pool of `units` 2 MiB units after one header unit.
fn dev(i: u32, units: u64) -> DeviceInfo {
    DeviceInfo {
        path: format!("/dev/dax{i}.0"),
        uuid: format!("00000000-0000-4000-8000-00000000000{i}"),
        kind: DeviceKind::DevDax,
        device_size: MB2 * (units + 1),
        align: MB2,
        data_offset: MB2,
    }
}

fn open(store: &MemStore, pools: Vec<DeviceInfo>) -> ResourceManager {
    ResourceManager::open(pools, Box::new(store.clone()), SECRET, 0).unwrap()
}

fn setup() -> (ResourceManager, MemStore) {
    let m = MemStore::new();
    (open(&m, vec![dev(0, 8)]), m)
}

/// [`setup`] with one region of one extent allocated by `C`.
fn with_region() -> (ResourceManager, MemStore, Handle) {
    let (mut rm, m) = setup();
    let h = alloc(&mut rm, C, 1);
    (rm, m, h)
}

fn alloc_req(size: u64, request_id: u64) -> RmRequest {
    RmRequest::Alloc {
        size,
        pool: None,
        request_id,
    }
}

fn alloc(rm: &mut ResourceManager, client: &str, size: u64) -> Handle {
    match rm.handle(client, alloc_req(size, 0), 0) {
        Ok(RmReply::Alloc(a)) => a.handle,
        other => panic!("alloc: {other:?}"),
    }
}

fn free(rm: &mut ResourceManager, client: &str, h: &Handle) -> Result<RmReply, WireError> {
    rm.handle(
        client,
        RmRequest::Free {
            handle: h.clone(),
            request_id: 0,
        },
        0,
    )
}

fn hold(
    rm: &mut ResourceManager,
    h: &Handle,
    node: &str,
    epoch: u64,
) -> Result<RmReply, WireError> {
    rm.handle(
        "agent",
        RmRequest::Hold {
            handle: h.clone(),
            node: node.into(),
            epoch,
        },
        0,
    )
}

fn unhold(rm: &mut ResourceManager, id: u64, node: &str, epoch: u64) -> UnholdReply {
    match rm.handle(
        "agent",
        RmRequest::Unhold {
            region_id: id,
            node: node.into(),
            epoch,
        },
        0,
    ) {
        Ok(RmReply::Unhold(u)) => u,
        other => panic!("unhold: {other:?}"),
    }
}

fn access(rm: &mut ResourceManager, h: &Handle) -> Result<RmReply, WireError> {
    rm.handle("reader", RmRequest::GetAccess { handle: h.clone() }, 0)
}

fn regions(rm: &mut ResourceManager) -> Vec<RegionInfo> {
    match rm.handle("x", RmRequest::Regions { owner: None }, 0) {
        Ok(RmReply::Regions { regions }) => regions,
        other => panic!("regions: {other:?}"),
    }
}

fn code(r: Result<RmReply, WireError>) -> ErrorCode {
    r.expect_err("expected an error").code
}

/// Holds `h` again as node "n" (epoch 1), whose hold is already recorded and durable:
/// the retry answers as the first hold did and attempts no save.
fn retried_hold_needs_no_save(rm: &mut ResourceManager, m: &MemStore, h: &Handle) {
    let attempts = m.attempts();
    assert_eq!(
        hold(rm, h, "n", 1).unwrap(),
        RmReply::Hold(HoldReply { holds: 1 })
    );
    assert_eq!(m.attempts(), attempts, "a clean retried hold needs no save");
}

fn draining_of(r: Result<RmReply, WireError>) -> bool {
    match r {
        Ok(RmReply::Free(f)) => f.draining,
        other => panic!("free: {other:?}"),
    }
}

// ---- allocation ----

#[test]
fn alloc_aligns_and_reports_no_space() {
    let (mut rm, _) = setup();
    let a = alloc(&mut rm, C, 1);
    assert_eq!((a.offset, a.length), (MB2, MB2));
    let b = alloc(&mut rm, C, MB2 + 1);
    assert_eq!((b.offset, b.length), (2 * MB2, 2 * MB2));
    assert_eq!(b.token.len(), 32);
    let e = rm.handle(C, alloc_req(6 * MB2, 0), 0).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSpace);
    assert!(e.message.contains(&(5 * MB2).to_string()), "{e}");
    // A region that fits still goes.
    assert_eq!(alloc(&mut rm, C, 5 * MB2).offset, 4 * MB2);
}

#[test]
fn alloc_rejects_bad_sizes_and_unknown_pools() {
    let (mut rm, _) = setup();
    assert_eq!(
        code(rm.handle(C, alloc_req(0, 0), 0)),
        ErrorCode::BadRequest
    );
    let too_big = MAX_ALLOC_SIZE + 1;
    assert_eq!(
        code(rm.handle(C, alloc_req(too_big, 0), 0)),
        ErrorCode::BadRequest
    );
    let sel = |s: &str| RmRequest::Alloc {
        size: 1,
        pool: Some(s.into()),
        request_id: 0,
    };
    assert_eq!(code(rm.handle(C, sel("nope"), 0)), ErrorCode::NoPool);
    assert_eq!(code(rm.handle(C, sel("1"), 0)), ErrorCode::NoPool);
    for s in ["0", "/dev/dax0.0", "00000000-0000-4000-8000-000000000000"] {
        assert!(
            matches!(rm.handle(C, sel(s), 0), Ok(RmReply::Alloc(_))),
            "{s}"
        );
    }
    let m = MemStore::new();
    let mut none = open(&m, vec![]);
    assert_eq!(code(none.handle(C, alloc_req(1, 0), 0)), ErrorCode::NoPool);
}

#[test]
fn alloc_tries_pools_in_order() {
    let m = MemStore::new();
    let mut rm = open(&m, vec![dev(0, 1), dev(1, 4)]);
    let big = rm.handle(C, alloc_req(2 * MB2, 0), 0).unwrap();
    let RmReply::Alloc(big) = big else { panic!() };
    assert_eq!(big.pool.pool_id, 1);
    let RmReply::Alloc(small) = rm.handle(C, alloc_req(1, 0), 0).unwrap() else {
        panic!()
    };
    assert_eq!(small.pool.pool_id, 0);
}

#[test]
fn idempotent_alloc_retry_returns_the_same_handle() {
    let (mut rm, m) = setup();
    let first = rm.handle(C, alloc_req(1, 42), 0).unwrap();
    let again = rm.handle(C, alloc_req(1, 42), 10).unwrap();
    assert_eq!(first, again);
    assert_eq!(regions(&mut rm).len(), 1);
    assert_eq!(m.saves(), 1);
    // Another client with the same request id is another request.
    rm.handle("other:1", alloc_req(1, 42), 10).unwrap();
    assert_eq!(regions(&mut rm).len(), 2);
    // The same id for another request is an error, not a replay.
    assert_eq!(
        code(rm.handle(C, alloc_req(2, 42), 10)),
        ErrorCode::BadRequest
    );
}

#[test]
fn retried_free_with_request_id_replays_after_the_region_is_gone() {
    let (mut rm, _, h) = with_region();
    let req = RmRequest::Free {
        handle: h,
        request_id: 7,
    };
    let first = rm.handle(C, req.clone(), 0).unwrap();
    assert_eq!(rm.handle(C, req, 1).unwrap(), first);
}

// ---- tokens and owners ----

#[test]
fn bad_token_is_refused_and_changes_nothing() {
    let (mut rm, m, h) = with_region();
    let before = (regions(&mut rm), m.saves(), m.attempts());
    let mut bad = h.clone();
    bad.token = "0".repeat(32);
    let mut moved = h.clone();
    moved.length *= 2;
    for b in [&bad, &moved] {
        let e = free(&mut rm, C, b).unwrap_err();
        assert_eq!(e.code, ErrorCode::Refused);
        assert!(e.message.contains("bad token for region 1"), "{e}");
        assert_eq!(code(access(&mut rm, b)), ErrorCode::Refused);
        assert_eq!(code(hold(&mut rm, b, "n", 1)), ErrorCode::Refused);
    }
    let mut unknown = h.clone();
    unknown.region_id = 99;
    assert_eq!(code(free(&mut rm, C, &unknown)), ErrorCode::Refused);
    assert_eq!(code(access(&mut rm, &unknown)), ErrorCode::Refused);
    assert_eq!(before, (regions(&mut rm), m.saves(), m.attempts()));
    assert!(matches!(access(&mut rm, &h), Ok(RmReply::Access(_))));
}

#[test]
fn only_the_owner_may_free() {
    let (mut rm, _, h) = with_region();
    let e = free(&mut rm, "intruder:1", &h).unwrap_err();
    assert_eq!(e.code, ErrorCode::Permission);
    assert!(e.message.contains(C), "{e}");
    assert_eq!(regions(&mut rm).len(), 1);
    assert!(!draining_of(free(&mut rm, C, &h)));
    assert!(regions(&mut rm).is_empty());
}

#[test]
fn get_access_says_where_the_bytes_are() {
    let (mut rm, _) = setup();
    let h = alloc(&mut rm, C, 3);
    let Ok(RmReply::Access(a)) = access(&mut rm, &h) else {
        panic!()
    };
    assert_eq!(a.path, "/dev/dax0.0");
    assert_eq!((a.offset, a.length, a.align), (h.offset, h.length, MB2));
}

// ---- holds ----

#[test]
fn freed_while_held_drains_and_its_range_waits_for_the_last_unhold() {
    let (mut rm, _) = setup();
    let h = alloc(&mut rm, C, MB2);
    hold(&mut rm, &h, "n1", 1).unwrap();
    hold(&mut rm, &h, "n2", 1).unwrap();
    assert!(draining_of(free(&mut rm, C, &h)));
    let next = alloc(&mut rm, C, MB2);
    assert_ne!(
        next.offset, h.offset,
        "a draining range was handed out again"
    );
    free(&mut rm, C, &next).unwrap();
    let Ok(RmReply::Pools { pools }) = rm.handle("x", RmRequest::Pools, 0) else {
        panic!()
    };
    assert_eq!(pools[0].draining, MB2);
    assert_eq!(pools[0].free, 7 * MB2);

    assert_eq!(
        unhold(&mut rm, h.region_id, "n1", 1),
        UnholdReply {
            removed: true,
            freed: false
        }
    );
    assert_ne!(alloc(&mut rm, C, MB2).offset, h.offset);
    assert_eq!(
        unhold(&mut rm, h.region_id, "n2", 1),
        UnholdReply {
            removed: true,
            freed: true
        }
    );
    assert!(regions(&mut rm).iter().all(|r| r.region_id != h.region_id));
    assert_eq!(alloc(&mut rm, C, MB2).offset, h.offset);
}

#[test]
fn a_draining_region_cannot_be_held_or_mapped_again() {
    let (mut rm, _, h) = with_region();
    hold(&mut rm, &h, "n1", 1).unwrap();
    free(&mut rm, C, &h).unwrap();
    let e = hold(&mut rm, &h, "n2", 1).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert!(e.message.contains("draining"), "{e}");
    assert_eq!(code(hold(&mut rm, &h, "n1", 1)), ErrorCode::Refused);
    assert_eq!(code(access(&mut rm, &h)), ErrorCode::Refused);
    // FREE again is fine (a retry) and still draining.
    assert!(draining_of(free(&mut rm, C, &h)));
}

#[test]
fn hold_is_idempotent_and_checks_the_node_name() {
    let (mut rm, m, h) = with_region();
    assert_eq!(
        hold(&mut rm, &h, "n", 1).unwrap(),
        RmReply::Hold(HoldReply { holds: 1 })
    );
    retried_hold_needs_no_save(&mut rm, &m, &h);
    assert_eq!(
        hold(&mut rm, &h, "n", 2).unwrap(),
        RmReply::Hold(HoldReply { holds: 2 })
    );
    assert_eq!(code(hold(&mut rm, &h, "", 1)), ErrorCode::Refused);
    assert_eq!(code(hold(&mut rm, &h, "a\nb", 1)), ErrorCode::Refused);
    assert_eq!(
        unhold(&mut rm, h.region_id, "n", 9),
        UnholdReply {
            removed: false,
            freed: false
        }
    );
    assert_eq!(
        unhold(&mut rm, 99, "n", 1),
        UnholdReply {
            removed: false,
            freed: false
        }
    );
}

#[test]
fn reset_holds_drops_only_older_epochs() {
    let (mut rm, _, h) = with_region();
    hold(&mut rm, &h, "n", 1).unwrap();
    hold(&mut rm, &h, "n", 2).unwrap();
    hold(&mut rm, &h, "m", 1).unwrap();
    free(&mut rm, C, &h).unwrap();
    let reset = |rm: &mut ResourceManager, node: &str, epoch| match rm
        .handle(
            "agent",
            RmRequest::ResetHolds {
                node: node.into(),
                epoch,
            },
            0,
        )
        .unwrap()
    {
        RmReply::ResetHolds(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        reset(&mut rm, "n", 2),
        ResetHoldsReply {
            removed: 1,
            freed: 0
        }
    );
    assert_eq!(
        reset(&mut rm, "n", 2),
        ResetHoldsReply {
            removed: 0,
            freed: 0
        }
    );
    assert_eq!(
        reset(&mut rm, "n", 3),
        ResetHoldsReply {
            removed: 1,
            freed: 0
        }
    );
    assert_eq!(regions(&mut rm)[0].holds.len(), 1);
    assert_eq!(
        reset(&mut rm, "m", 2),
        ResetHoldsReply {
            removed: 1,
            freed: 1
        }
    );
    assert!(regions(&mut rm).is_empty());
    assert_eq!(
        code(rm.handle(
            "agent",
            RmRequest::ResetHolds {
                node: String::new(),
                epoch: 1
            },
            0
        )),
        ErrorCode::Refused
    );
}

#[test]
fn drop_holds_needs_confirm() {
    let (mut rm, m, h) = with_region();
    hold(&mut rm, &h, "gone", 1).unwrap();
    hold(&mut rm, &h, "gone", 5).unwrap();
    free(&mut rm, C, &h).unwrap();
    let saves = m.saves();
    let drop = |confirm| RmRequest::DropHolds {
        node: "gone".into(),
        confirm,
    };
    let e = rm.handle("ctl", drop(false), 0).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("confirm"), "{e}");
    assert_eq!(m.saves(), saves);
    assert_eq!(regions(&mut rm).len(), 1);
    assert_eq!(
        rm.handle("ctl", drop(true), 0).unwrap(),
        RmReply::ResetHolds(ResetHoldsReply {
            removed: 2,
            freed: 1
        })
    );
    assert!(regions(&mut rm).is_empty());
    let Ok(RmReply::Holds { holds }) = rm.handle("x", RmRequest::Holds { node: None }, 0) else {
        panic!()
    };
    assert!(holds.is_empty());
}

// ---- durability ----

#[test]
fn every_change_is_saved_before_its_reply() {
    let (mut rm, m, h) = with_region();
    assert_eq!(m.saved().unwrap().regions.len(), 1);
    hold(&mut rm, &h, "n", 1).unwrap();
    assert_eq!(m.saved().unwrap().holds.len(), 1);
    free(&mut rm, C, &h).unwrap();
    assert!(m.saved().unwrap().regions[0].draining);
    unhold(&mut rm, h.region_id, "n", 1);
    let s = m.saved().unwrap();
    assert!(s.regions.is_empty() && s.holds.is_empty());
    assert_eq!(s.next_region_id, 2);
}

#[test]
fn a_failed_save_answers_storage_and_keeps_the_change() {
    let (mut rm, m, h) = with_region();
    m.fail_next(Step::Write);
    let e = hold(&mut rm, &h, "n", 1).unwrap_err();
    assert_eq!(
        e.code,
        ErrorCode::Storage,
        "only a refusal may say Refused: {e}"
    );
    assert!(rm.is_dirty());
    // The hold is real: freeing the region leaves it draining.
    assert_eq!(regions(&mut rm)[0].holds.len(), 1);
    assert!(draining_of(free(&mut rm, C, &h)));
    assert!(!rm.is_dirty());
    assert_eq!(m.saved().unwrap().holds.len(), 1);

    // An alloc whose save fails keeps its region too.
    m.fail_next(Step::Fsync);
    assert_eq!(code(rm.handle(C, alloc_req(1, 0), 0)), ErrorCode::Storage);
    assert_eq!(regions(&mut rm).len(), 2);
}

#[test]
fn a_retried_alloc_after_a_failed_save_saves_again_and_returns_the_region() {
    let (mut rm, m) = setup();
    m.fail_always(Some(Step::DirSync));
    assert_eq!(code(rm.handle(C, alloc_req(1, 5), 0)), ErrorCode::Storage);
    assert_eq!(code(rm.handle(C, alloc_req(1, 5), 1)), ErrorCode::Storage);
    m.fail_always(None);
    let RmReply::Alloc(a) = rm.handle(C, alloc_req(1, 5), 2).unwrap() else {
        panic!()
    };
    assert_eq!(regions(&mut rm).len(), 1);
    assert_eq!(m.saved().unwrap().regions[0].region_id, a.handle.region_id);
}

#[test]
fn a_retried_hold_after_a_failed_directory_sync_syncs_again() {
    let (mut rm, m, h) = with_region();
    m.fail_next(Step::DirSync);
    assert_eq!(code(hold(&mut rm, &h, "n", 1)), ErrorCode::Storage);
    // The retry finds the hold recorded, but it is not durable yet: with the store
    // still failing, the retry fails too.
    m.fail_always(Some(Step::DirSync));
    let e = hold(&mut rm, &h, "n", 1).unwrap_err();
    assert_eq!(e.code, ErrorCode::Storage, "{e}");
    m.fail_always(None);
    let saves = m.saves();
    assert_eq!(
        hold(&mut rm, &h, "n", 1).unwrap(),
        RmReply::Hold(HoldReply { holds: 1 })
    );
    assert_eq!(m.saves(), saves + 1, "the successful retry saved the state");
    assert_eq!(m.saved().unwrap().holds.len(), 1);
    // Synced now: a further retry needs no save.
    retried_hold_needs_no_save(&mut rm, &m, &h);
}

#[test]
fn a_retried_free_of_a_draining_region_syncs_again() {
    let (mut rm, m, h) = with_region();
    hold(&mut rm, &h, "n", 1).unwrap();
    m.fail_always(Some(Step::Rename));
    assert_eq!(code(free(&mut rm, C, &h)), ErrorCode::Storage);
    assert_eq!(code(free(&mut rm, C, &h)), ErrorCode::Storage);
    assert!(!m.saved().unwrap().regions[0].draining);
    m.fail_always(None);
    assert!(draining_of(free(&mut rm, C, &h)));
    assert!(m.saved().unwrap().regions[0].draining);
}

#[test]
fn a_retried_unhold_after_a_failed_save_syncs_again() {
    let (mut rm, m, h) = with_region();
    hold(&mut rm, &h, "n", 1).unwrap();
    free(&mut rm, C, &h).unwrap();
    m.fail_next(Step::Write);
    let req = RmRequest::Unhold {
        region_id: h.region_id,
        node: "n".into(),
        epoch: 1,
    };
    assert_eq!(code(rm.handle("agent", req.clone(), 0)), ErrorCode::Storage);
    m.fail_next(Step::Write);
    assert_eq!(code(rm.handle("agent", req.clone(), 0)), ErrorCode::Storage);
    assert_eq!(m.saved().unwrap().holds.len(), 1);
    let r = rm.handle("agent", req, 0).unwrap();
    assert_eq!(
        r,
        RmReply::Unhold(UnholdReply {
            removed: false,
            freed: false
        })
    );
    assert!(m.saved().unwrap().regions.is_empty());
}

#[test]
fn any_successful_save_clears_dirty() {
    let (mut rm, m, h) = with_region();
    m.fail_next(Step::DirSync);
    assert_eq!(code(hold(&mut rm, &h, "n", 1)), ErrorCode::Storage);
    // An unrelated change saves the whole state, the hold with it.
    alloc(&mut rm, C, 1);
    assert!(!rm.is_dirty());
    assert_eq!(m.saved().unwrap().holds.len(), 1);
    retried_hold_needs_no_save(&mut rm, &m, &h);
}

// ---- owners and reaping ----

#[test]
fn an_owner_that_does_not_reconnect_is_reaped_after_grace() {
    let (mut rm, m) = setup();
    rm.set_grace_ms(500);
    rm.client_connected(C);
    let h = alloc(&mut rm, C, 1);
    rm.client_connected("other:1");
    alloc(&mut rm, "other:1", 1);
    assert_eq!(rm.next_deadline(), None);
    rm.client_disconnected(C, 1000);
    assert_eq!(rm.next_deadline(), Some(1500));
    assert!(rm.tick(1499).is_empty());
    assert_eq!(rm.tick(1500), vec![h.region_id]);
    assert_eq!(rm.next_deadline(), None);
    assert_eq!(regions(&mut rm).len(), 1);
    assert_eq!(m.saved().unwrap().regions.len(), 1);
    assert_eq!(code(access(&mut rm, &h)), ErrorCode::Refused);
}

#[test]
fn reconnecting_cancels_the_grace_timer() {
    let (mut rm, _) = setup();
    rm.client_connected(C);
    rm.client_connected(C);
    alloc(&mut rm, C, 1);
    rm.client_disconnected(C, 0);
    assert_eq!(rm.next_deadline(), None, "one connection is still open");
    rm.client_disconnected(C, 0);
    assert_eq!(rm.next_deadline(), Some(DEFAULT_GRACE_MS));
    rm.client_connected(C);
    assert_eq!(rm.next_deadline(), None);
    assert!(rm.tick(10 * DEFAULT_GRACE_MS).is_empty());
    assert_eq!(regions(&mut rm).len(), 1);
}

#[test]
fn no_timer_for_a_client_without_regions() {
    let (mut rm, _) = setup();
    rm.client_connected("agent");
    rm.client_disconnected("agent", 0);
    assert_eq!(rm.next_deadline(), None);
}

#[test]
fn reaping_a_held_region_leaves_it_draining() {
    let (mut rm, _) = setup();
    rm.client_connected(C);
    let h = alloc(&mut rm, C, MB2);
    hold(&mut rm, &h, "n", 1).unwrap();
    rm.client_disconnected(C, 0);
    assert_eq!(rm.tick(DEFAULT_GRACE_MS), vec![h.region_id]);
    assert_eq!(regions(&mut rm)[0].state, "draining");
    assert_ne!(alloc(&mut rm, "b:1", MB2).offset, h.offset);
    assert!(unhold(&mut rm, h.region_id, "n", 1).freed);
}

#[test]
fn owner_gone_reaps_at_once() {
    let (mut rm, m, h) = with_region();
    assert_eq!(rm.owner_gone(C), vec![h.region_id]);
    assert!(regions(&mut rm).is_empty());
    assert!(m.saved().unwrap().regions.is_empty());
    assert!(rm.owner_gone(C).is_empty());
}

#[test]
fn a_failed_save_after_reaping_stays_dirty() {
    let (mut rm, m, h) = with_region();
    hold(&mut rm, &h, "n", 1).unwrap();
    m.fail_next(Step::DirSync);
    assert_eq!(rm.owner_gone(C), vec![h.region_id]);
    assert!(rm.is_dirty());
    // The agent's retried hold must not succeed while the draining state is unsaved;
    // it is refused (draining) — nothing new is held.
    assert_eq!(code(hold(&mut rm, &h, "n", 2)), ErrorCode::Refused);
    let saves = m.saves();
    unhold(&mut rm, h.region_id, "n", 1);
    assert_eq!(m.saves(), saves + 1);
    assert!(!rm.is_dirty());
}

// ---- restart ----

/// Regions, tokens, holds and draining all come back from the saved state.
fn check_restart(make: &mut dyn FnMut() -> Box<dyn StateStore>) {
    let pools = vec![dev(0, 8)];
    let mut rm = ResourceManager::open(pools.clone(), make(), SECRET, 0).unwrap();
    let kept = alloc(&mut rm, C, 1);
    let drained = alloc(&mut rm, C, MB2);
    hold(&mut rm, &kept, "n", 1).unwrap();
    hold(&mut rm, &drained, "n", 1).unwrap();
    free(&mut rm, C, &drained).unwrap();
    let before = regions(&mut rm);
    drop(rm);

    let mut rm = ResourceManager::open(pools, make(), SECRET, 5000).unwrap();
    assert_eq!(regions(&mut rm), before);
    assert!(matches!(access(&mut rm, &kept), Ok(RmReply::Access(_))));
    assert_eq!(code(hold(&mut rm, &drained, "m", 1)), ErrorCode::Refused);
    assert_ne!(alloc(&mut rm, "b:1", MB2).offset, drained.offset);
    // The owner has a fresh grace period from the restart.
    assert_eq!(rm.next_deadline(), Some(5000 + DEFAULT_GRACE_MS));
    rm.client_connected(C);
    assert_eq!(rm.next_deadline(), None);
    // Old handles still free, ids are not reused.
    assert!(draining_of(free(&mut rm, C, &kept)));
    assert!(unhold(&mut rm, drained.region_id, "n", 1).freed);
    assert!(alloc(&mut rm, C, 1).region_id > drained.region_id + 1);
}

#[test]
fn restart_from_a_mem_store_keeps_everything() {
    let m = MemStore::new();
    check_restart(&mut || Box::new(m.clone()));
}

#[test]
fn restart_from_a_state_directory_keeps_everything() {
    let d = TempDir::new("core-restart");
    let dir = d.0.clone();
    check_restart(&mut || Box::new(DirStore::open(&dir).unwrap()));
    assert!(dir.join(crate::rm::STATE_FILE).exists());
}

#[test]
fn a_region_whose_pool_is_absent_is_kept_but_not_mapped() {
    let m = MemStore::new();
    let mut rm = open(&m, vec![dev(0, 4), dev(1, 4)]);
    let sel = |p: &str| RmRequest::Alloc {
        size: 1,
        pool: Some(p.into()),
        request_id: 0,
    };
    let RmReply::Alloc(a) = rm.handle(C, sel("1"), 0).unwrap() else {
        panic!()
    };
    drop(rm);
    let mut rm = open(&m, vec![dev(0, 4)]);
    let listed = regions(&mut rm);
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].pool_id, ABSENT_POOL);
    let e = access(&mut rm, &a.handle).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoPool, "absent is not a refusal: {e}");
    assert_eq!(code(hold(&mut rm, &a.handle, "n", 1)), ErrorCode::NoPool);
    // Back with its pool, it works again.
    drop(rm);
    let mut rm = open(&m, vec![dev(1, 4), dev(0, 4)]);
    let Ok(RmReply::Access(acc)) = access(&mut rm, &a.handle) else {
        panic!()
    };
    assert_eq!(acc.path, "/dev/dax1.0");
    assert_eq!(
        alloc(&mut rm, C, 1).offset,
        MB2 * 2,
        "its range stays taken"
    );
}

#[test]
fn open_refuses_inconsistent_state_and_duplicate_pools() {
    let overlapping = |offset| RegionRecord {
        region_id: 1,
        owner: C.into(),
        pool_uuid: dev(0, 4).uuid,
        offset,
        length: 2 * MB2,
        requested: 1,
        nonce: 1,
        draining: false,
    };
    let mut st = RmState::empty();
    st.next_region_id = 3;
    st.regions.push(overlapping(MB2));
    let mut second = overlapping(2 * MB2);
    second.region_id = 2;
    st.regions.push(second);
    let m = MemStore::with_state(st.clone());
    let e = ResourceManager::open(vec![dev(0, 4)], Box::new(m), SECRET, 0)
        .err()
        .unwrap();
    assert!(matches!(e, RmError::Inconsistent(_)), "{e}");
    assert!(e.to_string().contains("region 2"), "{e}");

    st.regions.truncate(1);
    st.holds.push(HoldRecord {
        region_id: 9,
        node: "n".into(),
        epoch: 1,
    });
    let m = MemStore::with_state(st);
    let e = ResourceManager::open(vec![dev(0, 4)], Box::new(m), SECRET, 0)
        .err()
        .unwrap();
    assert!(e.to_string().contains("region 9"), "{e}");

    let e = ResourceManager::open(
        vec![dev(0, 4), dev(0, 4)],
        Box::new(MemStore::new()),
        SECRET,
        0,
    )
    .err()
    .unwrap();
    assert!(matches!(e, RmError::DuplicatePool { .. }), "{e}");

    let m = MemStore::new();
    m.fail_next(Step::Read);
    let e = ResourceManager::open(vec![dev(0, 4)], Box::new(m), SECRET, 0)
        .err()
        .unwrap();
    assert!(matches!(e, RmError::Persist(_)), "{e}");
}

#[test]
fn another_secret_makes_old_tokens_fail() {
    let m = MemStore::new();
    let mut rm = open(&m, vec![dev(0, 4)]);
    let h = alloc(&mut rm, C, 1);
    drop(rm);
    let mut rm = ResourceManager::open(vec![dev(0, 4)], Box::new(m), [8u8; 32], 0).unwrap();
    assert_eq!(code(access(&mut rm, &h)), ErrorCode::Refused);
}
