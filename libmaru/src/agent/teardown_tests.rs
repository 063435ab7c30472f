//! Tests of unmap, closed clients and release: one per rule, with fake ports.

use crate::agent::fakes::{World, Q_MS};
use crate::wire::rm::Handle;
use crate::wire::ErrorCode;

#[test]
fn the_last_holder_unmapping_deregisters_then_unholds() {
    let mut w = World::new();
    let h = w.rm.region();
    let id = h.region_id;
    let a = w.map("a", &h, true).unwrap();
    let b = w.map("b", &h, true).unwrap();
    assert!(w.unmap("a", id));
    assert!(!w.nic.accepts(a.rkey), "a's own key goes with its unmap");
    assert!(w.nic.accepts(b.rkey), "b still holds the region");
    assert_eq!(w.rm.count("unhold"), 0);
    assert!(w.mem.unmaps.is_empty() && w.mem.range_at(a.addr).is_some_and(|r| !r.protected));
    assert!(!w.unmap("a", id), "a holds nothing any more");
    assert!(w.unmap("b", id));
    assert!(!w.nic.accepts(b.rkey));
    assert!(w.rm.held.is_empty());
    // The range stays mapped without access for the quarantine.
    let r = w.mem.range_at(a.addr).unwrap();
    assert!(r.protected);
    assert!(w.mem.unmaps.is_empty());
}

#[test]
fn an_unmap_of_a_region_not_mapped_removes_nothing() {
    let mut w = World::new();
    assert!(!w.unmap("a", 99));
    assert_eq!(w.rm.calls, vec!["reset".to_string()]);
}

#[test]
fn a_closed_client_drops_its_read_handles_but_keeps_its_regions_readable() {
    let mut w = World::new();
    let h = w.rm.region();
    let h2 = w.rm.region();
    let m = w.map("a", &h, true).unwrap();
    let other = w.map("b", &h2, true).unwrap();
    let r = w.map_read("a", &h2, 0, 4096).unwrap();
    w.close("a");
    assert!(
        !w.nic.accepts(r.rkey),
        "a closed client's read handle goes at once"
    );
    // A writer that crashed left keys in its region: it stays mapped and held, so
    // readers keep reading until maru-server's keeper takes it over.
    assert!(w.nic.accepts(m.rkey));
    assert!(w.rm.held.contains(&h.region_id));
    w.map_read("reader", &h, 0, 4096)
        .expect("the region of a closed writer is still readable");
    assert!(w.nic.accepts(other.rkey), "b's region is untouched");
    assert!(w.rm.held.contains(&h2.region_id));
    // The keeper's release later deregisters it whoever holds it.
    assert!(w.release("server", &h).unwrap());
    assert!(!w.nic.accepts(m.rkey));
}

#[test]
fn a_release_deregisters_whoever_else_holds_the_region() {
    let (mut w, h, owner) = World::with_mapped("owner");
    let keeper = w.map("keeper", &h, false).unwrap();
    let reader = w.map_read("reader", &h, 0, 4096).unwrap();
    // maru-server releases with the handle too: the releasing client holds nothing.
    assert!(w.release("server", &h).unwrap());
    for k in [owner.rkey, keeper.rkey, reader.rkey] {
        assert!(!w.nic.accepts(k), "key {k} survived the release");
    }
    assert!(w.rm.held.is_empty());
    assert!(w.core.released.contains(&h));
}

#[test]
fn a_release_needs_the_regions_own_handle() {
    let (mut w, h, owner) = World::with_mapped("owner");
    let forged = Handle {
        token: "1".repeat(32),
        ..h.clone()
    };
    let e = w.release("reader", &forged).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert!(w.nic.accepts(owner.rkey));
    assert!(w.rm.held.contains(&h.region_id));
    assert!(
        w.map("owner", &h, true).is_ok(),
        "the real handle still maps"
    );
}

#[test]
fn a_released_range_stays_mapped_without_access_for_the_quarantine() {
    let (mut w, h, m) = World::with_mapped("owner");
    w.release("owner", &h).unwrap();
    let released_at = w.now;
    assert!(w.mem.range_at(m.addr).unwrap().protected);
    assert_eq!(w.core.next_deadline(), Some(released_at + Q_MS));
    w.advance(Q_MS - 1);
    w.sweep();
    assert!(
        w.mem.range_at(m.addr).is_some(),
        "unmapped before its quarantine ended"
    );
    w.advance(1);
    w.sweep();
    assert!(w.mem.range_at(m.addr).is_none());
    assert_eq!(w.core.next_deadline(), None);
    assert_eq!(w.core.status().quarantined, 0);
}

#[test]
fn a_new_region_never_gets_a_key_of_a_released_one_within_the_quarantine() {
    let mut w = World::new();
    let h1 = w.rm.region();
    let old = w.map("owner", &h1, true).unwrap();
    w.release("owner", &h1).unwrap();
    // The next region is mapped at once; the old range still takes its addresses.
    let h2 = w.rm.region();
    let new = w.map("owner2", &h2, true).unwrap();
    assert_ne!(new.addr, old.addr);
    assert_ne!(
        new.rkey, old.rkey,
        "a late WRITE with the old key would land"
    );
}

#[test]
fn a_release_while_the_rm_is_away_succeeds_and_queues_the_unhold() {
    let (mut w, h, m) = World::with_mapped("owner");
    w.rm.down = true;
    assert!(w.release("owner", &h).unwrap());
    assert!(!w.nic.accepts(m.rkey));
    w.unhold_queued(h.region_id);
    w.rm.down = false;
    w.sweep_clears_every_hold();
}

#[test]
fn a_failed_deregistration_keeps_the_region_held_until_a_retry_works() {
    let (mut w, h, m) = World::with_mapped("owner");
    w.nic.fail_deregister = true;
    let e = w.release("owner", &h).unwrap_err();
    assert_eq!(
        e.code,
        ErrorCode::Internal,
        "not a refusal: retry the release"
    );
    assert!(e.message.contains("do not give the region back"), "{e}");
    assert_eq!(
        w.rm.count("unhold"),
        0,
        "no unhold before the deregistration"
    );
    assert!(w.rm.held.contains(&h.region_id));
    assert!(!w.mem.range_at(m.addr).unwrap().protected);
    assert_eq!(w.core.status().mappings[0].failed_deregistrations, 1);
    // Later maps are refused already.
    assert_eq!(w.map("x", &h, true).unwrap_err().code, ErrorCode::Refused);
    // A repeated release retries the deregistration.
    w.nic.fail_deregister = false;
    assert!(w.release("owner", &h).unwrap());
    assert!(!w.nic.accepts(m.rkey));
    assert!(w.rm.held.is_empty());
    assert!(w.mem.range_at(m.addr).unwrap().protected);
}

#[test]
fn a_release_of_a_region_not_mapped_here_refuses_its_later_maps() {
    let mut w = World::new();
    let h = w.rm.region();
    assert!(!w.release("owner", &h).unwrap());
    assert_eq!(
        w.map("late", &h, true).unwrap_err().code,
        ErrorCode::Refused
    );
    assert_eq!(w.nic.registers, 0);
}

#[test]
fn a_repeated_release_reports_the_earlier_deregistration() {
    let (mut w, h, _) = World::with_mapped("owner");
    assert!(w.release("owner", &h).unwrap());
    assert!(
        w.release("owner", &h).unwrap(),
        "the reply of a retry is the same"
    );
    assert_eq!(w.rm.count("unhold"), 1);
}

#[test]
fn a_forged_release_of_a_region_never_mapped_is_refused_and_not_recorded() {
    let mut w = World::new();
    let h = w.rm.region();
    let mut forged = h.clone();
    forged.token = "00".repeat(16);
    for i in 0..10_000u64 {
        let mut f = forged.clone();
        f.region_id = h.region_id + i;
        let e = w.release("attacker", &f).unwrap_err();
        assert_eq!(e.code, ErrorCode::Refused, "{e}");
    }
    assert!(
        w.core.released.handles().is_empty(),
        "forged handles must not be recorded (the sweep would check each of them)"
    );
    // The real handle can still be mapped: the forgery blocked nothing.
    w.map("owner", &h, true).unwrap();
}
