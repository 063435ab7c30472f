//! Tests of map and map_reads: one per rule, with fake ports.

use crate::agent::fakes::{World, LEN};
use crate::auth::read_token;
use crate::wire::agent::{RangeMapped, ReadRange, MAX_READ_RANGES};
use crate::wire::rm::Handle;
use crate::wire::ErrorCode;

#[test]
fn a_map_holds_the_region_before_it_maps_or_registers_it() {
    let (w, h, m) = World::with_mapped("owner");
    let id = h.region_id;
    let hold = w.rm.calls.iter().position(|c| *c == format!("hold {id}"));
    let access = w.rm.calls.iter().position(|c| *c == format!("access {id}"));
    assert!(hold.is_some() && hold < access, "calls: {:?}", w.rm.calls);
    assert!(w.rm.held.contains(&id));
    assert!(w.nic.accepts(m.rkey));
    assert!(w.nic.live[&m.rkey].writable);
    assert_eq!((m.offset_in_region, m.length), (0, LEN));
    assert_eq!(m.transport, serde_json::json!({ "fake": m.rkey }));
}

#[test]
fn a_refused_hold_maps_nothing_and_queues_nothing() {
    let mut w = World::new();
    let mut h = w.rm.region();
    h.token = "0".repeat(32);
    let e = w.map("owner", &h, true).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused, "{e}");
    assert_eq!((w.mem.maps, w.nic.registers), (0, 0));
    assert_eq!(w.queued(), 0);
    assert_eq!(w.rm.count("access"), 0);
}

#[test]
fn an_unanswered_hold_is_no_refusal_and_queues_an_unhold() {
    let mut w = World::new();
    let h = w.rm.region();
    w.rm.lose_hold_reply = true;
    w.map_fails(
        "owner",
        &h,
        ErrorCode::Internal,
        "resource manager unreachable",
    );
    assert_eq!((w.mem.maps, w.nic.registers), (0, 0));
    // The hold went through although its reply did not: the sweep undoes it.
    w.unhold_queued(h.region_id);
    w.rm.lose_hold_reply = false;
    w.sweep_clears_every_hold();
}

#[test]
fn an_unreachable_rm_is_no_refusal() {
    let mut w = World::new();
    let h = w.rm.region();
    w.rm.down = true;
    let e = w.map("owner", &h, true).unwrap_err();
    assert_ne!(e.code, ErrorCode::Refused);
    assert!(
        e.message.contains(&format!("region {}", h.region_id)),
        "{e}"
    );
}

/// Leaves `h` unmapped with its unhold queued (the RM was away at the unmap).
fn with_a_queued_unhold(w: &mut World, h: &Handle) {
    w.map("owner", h, true).unwrap();
    w.rm.down = true;
    assert!(w.unmap("owner", h.region_id));
    w.rm.down = false;
    w.unhold_queued(h.region_id);
}

#[test]
fn a_refused_hold_keeps_the_queued_unhold() {
    let mut w = World::new();
    let h = w.rm.region();
    with_a_queued_unhold(&mut w, &h);
    // The owner freed the region meanwhile: it drains, and a late map is refused.
    w.rm.drain(h.region_id);
    let e = w.map("owner", &h, true).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert_eq!(w.queued(), 1, "the old hold still needs its unhold");
    w.sweep();
    assert!(
        w.rm.held.is_empty(),
        "the draining region can finish freeing"
    );
}

#[test]
fn a_queued_unhold_goes_once_a_new_hold_succeeds() {
    let mut w = World::new();
    let h = w.rm.region();
    with_a_queued_unhold(&mut w, &h);
    let m = w.map("owner", &h, true).unwrap();
    assert_eq!(w.queued(), 0);
    w.sweep();
    assert!(
        w.rm.held.contains(&h.region_id),
        "the old unhold must not remove the new mapping's hold"
    );
    assert!(w.nic.accepts(m.rkey));
}

#[test]
fn a_failure_after_the_hold_undoes_it() {
    let mut w = World::new();
    let h = w.rm.region();
    w.nic.fail_register = true;
    w.map_fails("owner", &h, ErrorCode::Internal, "register");
    assert!(w.mem.ranges.is_empty(), "the range is unmapped again");
    assert!(w.rm.held.is_empty(), "the hold is dropped");
    assert_eq!(w.queued(), 0);
    w.nic.fail_register = false;

    w.mem.fail_map = true;
    assert!(w.map("owner", &h, true).is_err());
    assert!(w.rm.held.is_empty());
    w.mem.fail_map = false;

    // An unhold the RM does not take stays queued for the sweep.
    w.nic.fail_register = true;
    w.rm.fail_unhold = true;
    assert!(w.map("owner", &h, true).is_err());
    assert_eq!(w.queued(), 1);
    w.rm.fail_unhold = false;
    w.sweep_clears_every_hold();
}

#[test]
fn a_region_mapped_once_is_shared_by_its_holders_each_with_its_own_key() {
    let (mut w, h, a) = World::with_mapped("owner");
    let b = w.map("owner2", &h, true).unwrap();
    assert_eq!(a.addr, b.addr);
    assert_ne!(
        a.rkey, b.rkey,
        "a key belongs to the connection it was issued to"
    );
    assert!(w.nic.accepts_from("owner", a.rkey) && !w.nic.accepts_from("owner2", a.rkey));
    assert!(w.nic.accepts_from("owner2", b.rkey) && !w.nic.accepts_from("owner", b.rkey));
    assert_eq!((w.mem.maps, w.nic.registers), (1, 2));
    // Mapping again on the same connection gives the same key.
    let again = w.map("owner", &h, true).unwrap();
    assert_eq!(again.rkey, a.rkey);
    assert_eq!(w.nic.registers, 2);
    // A holder that does not write gets its own key, which cannot write.
    let k = w.map("keeper", &h, false).unwrap();
    assert_ne!(k.rkey, a.rkey);
    assert!(!w.nic.live[&k.rkey].writable);
    assert_eq!(w.mem.maps, 1);
}

#[test]
fn a_released_handle_is_not_mapped_again() {
    let (mut w, h, _) = World::with_mapped("owner");
    w.release("owner", &h).unwrap();
    let holds = w.rm.count("hold");
    // The RM still accepts the handle (the owner has not given it back yet).
    w.map_fails("late", &h, ErrorCode::Refused, "released");
    assert_eq!(w.rm.count("hold"), holds, "no hold of a released handle");
    assert_eq!(w.nic.live.len(), 0);
}

#[test]
fn a_map_with_another_handle_of_a_mapped_region_is_refused() {
    let (mut w, h, _) = World::with_mapped("owner");
    let holds = w.rm.count("hold");
    let forged = Handle {
        token: "f".repeat(32),
        ..h.clone()
    };
    let e = w.map("other", &forged, true).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert_eq!(w.rm.count("hold"), holds);
    assert_eq!(w.nic.registers, 1);
}

#[test]
fn a_read_handle_maps_only_a_region_mapped_here() {
    let mut w = World::new();
    let h = w.rm.region();
    let e = w.map_read("reader", &h, 4096, 8192).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert!(e.message.contains("not mapped at this agent"), "{e}");
    assert_eq!((w.mem.maps, w.nic.registers), (0, 0));
    assert_eq!(w.rm.count("hold"), 0, "a reader never holds a region");

    let owner = w.map("owner", &h, true).unwrap();
    let r = w.map_read("reader", &h, 4096, 8192).unwrap();
    assert_eq!((r.offset_in_region, r.length), (4096, 8192));
    assert_eq!(r.addr, owner.addr + 4096);
    let reg = w.nic.live[&r.rkey].clone();
    assert!(!reg.writable, "a reader's key cannot write");
    assert_eq!((reg.ptr, reg.len), (owner.addr + 4096, 8192));
}

#[test]
fn a_read_map_needs_the_read_token_of_that_range() {
    let (mut w, h, _) = World::with_mapped("owner");
    let id = h.region_id;
    let forged = "0".repeat(32);
    let e = w.map_read_with("r", id, 0, 4096, forged).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    // A token of another range does not open this one.
    let other = read_token(&h.token, id, 0, 8192);
    assert!(w.map_read_with("r", id, 0, 4096, other).is_err());
    // Nor does no token (a cxl lease carries none): seen failing with an empty token
    // let through.
    let e = w
        .map_read_with("r", id, 0, 4096, String::new())
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused, "{e}");
    assert_eq!(w.nic.registers, 1);
}

#[test]
fn a_read_range_lies_inside_its_region() {
    let (mut w, h, _) = World::with_mapped("owner");
    for (offset, length) in [(LEN - 4096, 8192), (u64::MAX, 2), (0, 0), (LEN, 1)] {
        let e = w.map_read("r", &h, offset, length).unwrap_err();
        assert_eq!(e.code, ErrorCode::Refused, "{offset} {length}: {e}");
    }
    assert!(w.map_read("r", &h, 0, LEN).is_ok());
}

#[test]
fn readers_of_a_range_get_read_registrations_of_their_own() {
    let (mut w, h, owner) = World::with_mapped("owner");
    let a = w.map_read("ra", &h, 0, 4096).unwrap();
    let b = w.map_read("rb", &h, 0, 4096).unwrap();
    assert_ne!(a.rkey, b.rkey);
    assert!(w.nic.accepts_from("ra", a.rkey) && !w.nic.accepts_from("rb", a.rkey));
    assert_eq!(w.nic.registers, 3);
    assert!(w.unmap("ra", h.region_id));
    assert!(!w.nic.accepts(a.rkey));
    assert!(w.nic.accepts(b.rkey), "rb still reads it");
    assert!(w.unmap("rb", h.region_id));
    assert!(!w.nic.accepts(b.rkey));
    assert!(w.nic.accepts(owner.rkey), "the owner's key is untouched");
    assert!(w.rm.held.contains(&h.region_id));
}

#[test]
fn a_region_being_torn_down_is_not_mapped_meanwhile() {
    let (mut w, h, _) = World::with_mapped("owner");
    w.nic.fail_deregister = true;
    w.unmap("owner", h.region_id);
    let e = w.map("owner", &h, true).unwrap_err();
    assert_eq!(
        e.code,
        ErrorCode::Internal,
        "a retry later works: no refusal"
    );
    assert!(e.message.contains("torn down"), "{e}");
    w.nic.fail_deregister = false;
    w.sweep();
    assert!(w.map("owner", &h, true).is_ok());
}

#[test]
fn a_read_handle_does_not_map_a_region_being_torn_down() {
    let (mut w, h, _) = World::with_mapped("owner");
    w.nic.fail_deregister = true;
    assert!(w.release("owner", &h).is_err());
    w.nic.fail_deregister = false;
    let e = w.map_read("reader", &h, 0, 4096).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert_eq!(w.nic.registers, 1);
}

#[test]
fn a_region_freed_at_the_rm_takes_no_new_holder() {
    let (mut w, h, _) = World::with_mapped("owner");
    w.rm.drain(h.region_id);
    let e = w.map("keeper", &h, false).unwrap_err();
    assert_eq!(e.code, ErrorCode::Refused);
    assert_eq!(w.nic.registers, 1);
}

#[test]
fn an_unanswered_hold_of_a_mapped_region_queues_no_unhold() {
    let (mut w, h, m) = World::with_mapped("owner");
    w.rm.down = true;
    assert_eq!(
        w.map("keeper", &h, false).unwrap_err().code,
        ErrorCode::Internal
    );
    w.rm.down = false;
    assert_eq!(w.queued(), 0, "the hold belongs to the live mapping");
    w.sweep();
    assert!(w.rm.held.contains(&h.region_id));
    assert!(w.nic.accepts(m.rkey));
}

#[test]
fn a_map_that_does_not_ask_to_write_gets_a_key_that_cannot() {
    let mut w = World::new();
    let h = w.rm.region();
    let k = w.map("keeper", &h, false).unwrap();
    assert!(!w.nic.live[&k.rkey].writable);
    let o = w.map("owner", &h, true).unwrap();
    assert!(w.nic.live[&o.rkey].writable);
}

/// A range of `h` with its right read token (`good`) or a forged one.
fn range(h: &Handle, offset: u64, length: u64, good: bool) -> ReadRange {
    let read_token = if good {
        read_token(&h.token, h.region_id, offset, length)
    } else {
        "0".repeat(32)
    };
    ReadRange {
        region_id: h.region_id,
        offset,
        length,
        read_token,
    }
}

/// One map_reads maps every range it may, each refused range says why on its own
/// (a forged token, a range outside the region, a region not mapped here), and the
/// results come in the order asked. Seen failing with the batch stopped at its first
/// refusal (the later good ranges were not mapped).
#[test]
fn map_reads_maps_the_good_ranges_and_refuses_each_bad_one_on_its_own() {
    let (mut w, h, owner) = World::with_mapped("owner");
    let (g, _) = w.mapped("owner");
    let unmapped = w.rm.region();
    let asked = vec![
        range(&h, 0, 4096, true),
        range(&h, 4096, 4096, false),
        range(&g, 8192, 4096, true),
        range(&h, LEN - 4096, 8192, true),
        range(&unmapped, 0, 4096, true),
        range(&h, 8192, 4096, true),
    ];
    let got = w.map_reads("reader", asked).unwrap();
    let mapped: Vec<(u64, u64)> = got
        .iter()
        .filter_map(|r| match r {
            RangeMapped::Mapped(m) => Some((m.region_id, m.offset_in_region)),
            RangeMapped::Failed(_) => None,
        })
        .collect();
    assert_eq!(
        mapped,
        vec![(h.region_id, 0), (g.region_id, 8192), (h.region_id, 8192)]
    );
    for (i, why) in [(1, "read token"), (3, "not a range"), (4, "not mapped")] {
        match &got[i] {
            RangeMapped::Failed(e) => {
                assert_eq!(e.code, ErrorCode::Refused, "{e}");
                assert!(e.message.contains(why), "range {i}: {e}");
            }
            RangeMapped::Mapped(m) => panic!("range {i} was mapped: {m:?}"),
        }
    }
    if let RangeMapped::Mapped(m) = &got[5] {
        assert_eq!(m.addr, owner.addr + 8192);
        assert!(!w.nic.live[&m.rkey].writable, "a reader's key cannot write");
    }
    // Two owner maps and three read ranges: nothing registered for a refused one.
    assert_eq!(w.nic.registers, 5);
}

/// More than MAX_READ_RANGES in one request is refused whole, saying so, and maps
/// nothing; exactly MAX_READ_RANGES is served. Seen failing with the cap check taken
/// out (the 257 ranges were mapped).
#[test]
fn map_reads_of_more_ranges_than_the_cap_is_refused_whole() {
    let (mut w, h, _) = World::with_mapped("owner");
    let ranges = |n: u64| (0..n).map(|i| range(&h, i * 16, 16, true)).collect();
    let e = w
        .map_reads("reader", ranges(MAX_READ_RANGES as u64 + 1))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
    assert!(
        e.message.contains(&format!("at most {MAX_READ_RANGES}")),
        "{e}"
    );
    assert_eq!(w.nic.registers, 1, "nothing of it was registered");
    let got = w
        .map_reads("reader", ranges(MAX_READ_RANGES as u64))
        .unwrap();
    assert!(got.iter().all(|r| matches!(r, RangeMapped::Mapped(_))));
    assert_eq!(w.nic.registers, 1 + MAX_READ_RANGES);
}
