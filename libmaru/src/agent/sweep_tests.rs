//! Tests of the sweep: one per rule, with fake ports.

use crate::agent::fakes::{World, Q_MS};

#[test]
fn the_sweep_deregisters_failed_mappings_while_the_rm_is_away() {
    let mut w = World::new();
    // A live mapping is checked with the RM; it must not stop the local retries.
    let live = w.rm.region();
    let l = w.map("a", &live, true).unwrap();
    let released = w.rm.region();
    let r = w.map("b", &released, true).unwrap();
    let holderless = w.rm.region();
    let u = w.map("c", &holderless, true).unwrap();
    w.nic.fail_deregister = true;
    assert!(w.release("b", &released).is_err());
    w.unmap("c", holderless.region_id);
    assert!(w.nic.accepts(r.rkey) && w.nic.accepts(u.rkey));

    w.nic.fail_deregister = false;
    w.rm.down = true;
    w.sweep();
    assert!(!w.nic.accepts(r.rkey), "failed mapping not retried");
    assert!(!w.nic.accepts(u.rkey), "holderless mapping not retried");
    assert!(w.nic.accepts(l.rkey));
    assert!(w.mem.range_at(r.addr).unwrap().protected);
    assert_eq!(w.queued(), 2, "their unholds wait for the RM");

    w.rm.down = false;
    w.sweep();
    assert_eq!(w.queued(), 0);
    assert_eq!(
        w.rm.held.iter().copied().collect::<Vec<_>>(),
        vec![live.region_id]
    );
}

#[test]
fn only_a_refusal_ends_a_queued_unhold() {
    let (mut w, h, _) = World::with_mapped("a");
    w.rm.fail_unhold = true;
    w.unmap("a", h.region_id);
    assert_eq!(w.queued(), 1);
    w.sweep();
    w.sweep();
    assert_eq!(w.queued(), 1, "a failed unhold stays queued");
    w.rm.fail_unhold = false;
    w.rm.refuse_unhold = true;
    w.sweep();
    assert_eq!(w.queued(), 0, "a refusal means nothing is held");
}

#[test]
fn the_sweep_retires_a_mapping_the_rm_no_longer_accepts() {
    let (mut w, h, m) = World::with_mapped("a");
    w.sweep();
    assert!(w.nic.accepts(m.rkey), "an accepted handle stays mapped");
    w.rm.drain(h.region_id);
    w.sweep();
    assert!(!w.nic.accepts(m.rkey));
    assert!(w.mem.range_at(m.addr).unwrap().protected);
    assert!(w.rm.held.is_empty());
    assert!(w.core.status().mappings.is_empty());
}

#[test]
fn an_unanswered_access_check_keeps_the_mapping() {
    let (mut w, h, m) = World::with_mapped("a");
    w.rm.down = true;
    w.sweep();
    assert!(w.nic.accepts(m.rkey));
    assert!(w.rm.held.contains(&h.region_id));
}

#[test]
fn quarantines_end_while_the_rm_is_away() {
    let (mut w, h, m) = World::with_mapped("a");
    w.release("a", &h).unwrap();
    w.rm.down = true;
    w.advance(Q_MS);
    w.sweep();
    assert!(w.mem.range_at(m.addr).is_none());
}

#[test]
fn released_handles_are_forgotten_once_the_rm_refuses_them() {
    let (mut w, h, _) = World::with_mapped("a");
    w.release("a", &h).unwrap();
    w.sweep();
    assert!(w.core.released.contains(&h), "the RM still accepts it");
    // The owner gave the region back and the RM freed it.
    w.rm.regions.remove(&h.region_id);
    w.sweep();
    assert!(!w.core.released.contains(&h));
    assert_eq!(
        w.map("late", &h, true).unwrap_err().code,
        crate::wire::ErrorCode::Refused
    );
}
