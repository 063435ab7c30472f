//! Tests of the agent's start, boot id and status.

use super::*;
use crate::agent::fakes::{FakeRm, World, BOOT, EPOCH, LEN, NODE, Q_MS};
use crate::wire::agent::MappingState;

#[test]
fn an_agent_without_a_boot_id_refuses_to_start() {
    let e = AgentCore::new(NODE.into(), EPOCH, String::new(), Q_MS).err();
    assert_eq!(e, Some(AgentError::NoBootId));
    let e = AgentCore::new(NODE.into(), EPOCH, " \n".into(), Q_MS).err();
    assert_eq!(e, Some(AgentError::NoBootId));
    assert!(AgentError::NoBootId
        .to_string()
        .contains("refuses to start"));
    let e = AgentCore::new(String::new(), EPOCH, BOOT.into(), Q_MS).err();
    assert_eq!(e, Some(AgentError::NoNodeName));
}

#[test]
fn start_resets_the_holds_of_earlier_epochs() {
    let w = World::new();
    assert_eq!(w.rm.resets, 1);
    assert!(!w.core.status().holds_reset_pending);
}

#[test]
fn a_reset_the_rm_did_not_get_is_retried_by_the_sweep() {
    let mut rm = FakeRm::default();
    rm.down = true;
    let mut w = World::new();
    w.core = AgentCore::new(NODE.into(), EPOCH, BOOT.into(), Q_MS).unwrap();
    w.core.start(&mut rm);
    assert!(w.core.status().holds_reset_pending);
    w.rm = rm;
    w.sweep();
    assert!(w.core.status().holds_reset_pending, "the RM is still away");
    w.rm.down = false;
    w.sweep();
    assert!(!w.core.status().holds_reset_pending);
    assert_eq!(w.rm.resets, 1);
    w.sweep();
    assert_eq!(w.rm.resets, 1, "a reset that arrived is not sent again");
}

#[test]
fn every_map_reply_carries_the_boot_id() {
    let mut w = World::new();
    let h = w.rm.region();
    assert_eq!(w.map("owner", &h, true).unwrap().boot_id, BOOT);
    assert_eq!(w.map("keeper", &h, false).unwrap().boot_id, BOOT);
    assert_eq!(w.map_read("reader", &h, 0, 4096).unwrap().boot_id, BOOT);
    assert_eq!(w.core.status().boot_id, BOOT);
}

#[test]
fn status_lists_mappings_and_pending_work() {
    let (mut w, h, _) = World::with_mapped("owner");
    w.map_read("reader", &h, 0, 4096).unwrap();
    let s = w.core.status();
    assert_eq!((s.node.as_str(), s.epoch), (NODE, EPOCH));
    assert_eq!(s.mappings.len(), 1);
    let m = &s.mappings[0];
    assert_eq!((m.region_id, m.length), (h.region_id, LEN));
    assert_eq!(m.state, MappingState::Live);
    assert_eq!(m.holders, vec!["owner".to_string(), "reader".to_string()]);
    assert_eq!(m.registrations, 2);
    assert_eq!((s.queued_unholds, s.quarantined), (0, 0));
    w.release("owner", &h).unwrap();
    let s = w.core.status();
    assert!(s.mappings.is_empty());
    assert_eq!(s.quarantined, 1);
}

#[test]
fn the_status_request_answers_the_status() {
    let mut w = World::new();
    match w.req("c", AgentRequest::Status) {
        Ok(AgentReply::Status(s)) => assert_eq!(s.boot_id, BOOT),
        other => panic!("status: {other:?}"),
    }
}
