//! The worker side's rules over fake queue pairs (no RDMA device needed): partial
//! posts, send-queue room, the arm/drain race, fence outcomes, async failures.

use super::engine::{Engine, EngineConfig, LocalReg};
use super::fake::{staging, FakeQp};
use crate::transport::{BatchState, Op, OpKind, PeerId, TransportError};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FENCE: Duration = Duration::from_millis(200);
const SQ_WAIT: Duration = Duration::from_secs(10);

struct Rig {
    engine: Engine,
    qp: Arc<FakeQp>,
    peer: PeerId,
    local: LocalReg,
    _buf: Vec<u8>,
}

fn rig(depth: usize) -> Rig {
    let engine = Engine::new(EngineConfig {
        fence_timeout: FENCE,
        sq_wait: SQ_WAIT,
    });
    let qp = Arc::new(FakeQp::new(77));
    let peer = PeerId(1);
    engine.add_peer(
        peer,
        "agent-a".into(),
        serde_json::json!({"device": "mlx5_0"}),
        qp.clone(),
        depth,
        0x11,
    );
    let (local, buf) = staging();
    Rig {
        engine,
        qp,
        peer,
        local,
        _buf: buf,
    }
}

fn ops(n: usize) -> Vec<Op> {
    (0..n)
        .map(|i| Op {
            kind: if i % 2 == 0 {
                OpKind::Write
            } else {
                OpKind::Read
            },
            local_offset: (i as u64) * 1024,
            remote_addr: 0x9000_0000 + (i as u64) * 1024,
            rkey: 0x42,
            len: 1024,
        })
        .collect()
}

impl Rig {
    fn post(&self, n: usize) -> crate::transport::BatchId {
        self.engine
            .post(self.peer, &ops(n), &self.local, Instant::now())
            .expect("post")
    }

    fn service(&self) {
        self.engine.service(self.peer, Instant::now());
    }
}

fn is_lost(st: &BatchState) -> bool {
    matches!(st, BatchState::Failed(TransportError::PeerLost { .. }))
}

#[test]
fn operations_complete_in_order_and_settle_their_batch() {
    let r = rig(16);
    let b = r.post(4);
    assert_eq!(r.qp.queued(), 4);
    r.qp.complete(3);
    r.service();
    assert_eq!(r.engine.batches.state(b), BatchState::Pending);
    r.qp.complete(1);
    r.service();
    assert_eq!(r.engine.batches.state(b), BatchState::Done);
    // One chain of four: the whole batch fitted in one ibv_post_send.
    assert_eq!(r.qp.state().chains, vec![4]);
}

#[test]
fn a_post_refused_at_k_keeps_the_first_k_in_flight_and_fails_the_rest_at_once() {
    let r = rig(16);
    r.qp.state().refuse_at = Some(3);
    let b = r.post(6);
    let peer = r.engine.peer(r.peer).unwrap();
    // Requests 0..3 reached the NIC; 3..6 did not and are not waited for.
    assert_eq!(peer.inflight(), 3);
    assert_eq!(r.qp.queued(), 3);
    assert_eq!(r.engine.batches.state(b), BatchState::Pending);
    r.qp.complete(3);
    r.service();
    let st = r.engine.batches.state(b);
    assert!(is_lost(&st), "{st:?}");
    if let BatchState::Failed(e) = st {
        assert!(e.to_string().contains("refused work request 3"), "{e}");
    }
    // The queue pair takes no more posts until it is fenced and connected again.
    match r.engine.post(r.peer, &ops(1), &r.local, Instant::now()) {
        Err(TransportError::PeerLost { message, .. }) => {
            assert!(message.contains("fence the peer"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Nothing is left in flight: the fence is a full flush at once.
    let t = Instant::now();
    r.engine.fence(r.peer).unwrap();
    assert!(t.elapsed() < FENCE, "{:?}", t.elapsed());
}

#[test]
fn an_error_mid_chain_fails_the_batch_with_its_own_error_and_flushes_the_rest() {
    let r = rig(16);
    r.qp.state().fail_at = Some(2);
    let b = r.post(5);
    r.qp.complete(5);
    r.service();
    assert_eq!(
        r.engine.batches.state(b),
        BatchState::Failed(TransportError::BadKey { rkey: 0x42 })
    );
    assert_eq!(r.engine.peer(r.peer).unwrap().inflight(), 0);
    assert!(!r.engine.peer(r.peer).unwrap().usable());
    assert!(r
        .engine
        .find_usable(&serde_json::json!({"device": "mlx5_0"}))
        .is_none());
    r.engine.fence(r.peer).unwrap();
    assert!(r.qp.state().destroyed);
}

#[test]
fn a_batch_larger_than_the_send_queue_waits_in_the_backlog_without_blocking_post() {
    let r = rig(2);
    let t = Instant::now();
    let b = r.post(5);
    assert!(t.elapsed() < Duration::from_millis(100));
    let peer = r.engine.peer(r.peer).unwrap();
    assert_eq!((peer.inflight(), peer.backlog()), (2, 3));
    // Completions free room: the next requests are posted as the CQ is drained.
    r.qp.complete(2);
    r.service();
    assert_eq!((peer.inflight(), peer.backlog()), (2, 1));
    r.qp.complete(2);
    r.service();
    r.qp.complete(1);
    r.service();
    assert_eq!(r.engine.batches.state(b), BatchState::Done);
    assert_eq!(r.qp.state().chains, vec![2, 2, 1]);
}

#[test]
fn a_fence_fails_the_backlog_at_once() {
    let r = rig(2);
    let b = r.post(5);
    let t = Instant::now();
    r.engine.fence(r.peer).unwrap();
    // The two posted requests were flushed, the three waiting ones never reached the
    // NIC: the fence did not wait for any timeout.
    assert!(t.elapsed() < FENCE, "{:?}", t.elapsed());
    assert!(is_lost(&r.engine.batches.state(b)));
    // Nothing of the backlog was posted after the fence.
    assert_eq!(r.qp.state().posted, 2);
}

#[test]
fn a_backlog_that_finds_no_room_for_sq_wait_fails_and_the_peer_with_it() {
    let r = rig(1);
    let t0 = Instant::now();
    let b = r.engine.post(r.peer, &ops(3), &r.local, t0).expect("post");
    r.engine.sweep(t0 + SQ_WAIT / 2);
    assert_eq!(r.engine.batches.state(b), BatchState::Pending);
    r.engine.sweep(t0 + SQ_WAIT + Duration::from_millis(1));
    match r.engine.batches.state(b) {
        BatchState::Pending => panic!("the backlog waited past sq_wait"),
        BatchState::Failed(e) => assert!(e.to_string().contains("stayed full"), "{e}"),
        BatchState::Done => panic!("done?"),
    }
    assert!(!r.engine.peer(r.peer).unwrap().usable());
}

#[test]
fn a_completion_landing_right_after_the_drain_raises_an_event() {
    let r = rig(16);
    let b = r.post(2);
    r.qp.complete(1);
    r.qp.take_events();
    // The NIC completes the second request just after the poll returned.
    r.qp.state().land_after_poll = 1;
    r.service();
    // Either the batch is done, or a new event is pending for the completion: the
    // CQ was armed before it was drained.
    let events = r.qp.take_events();
    assert!(
        r.engine.batches.state(b) == BatchState::Done || events > 0,
        "a completion sits in the CQ with no event to fetch it"
    );
    r.service();
    assert_eq!(r.engine.batches.state(b), BatchState::Done);
}

#[test]
fn a_fence_after_a_full_flush_and_destroy_succeeds_and_forgets_the_peer() {
    let r = rig(16);
    let b = r.post(3);
    r.engine.fence(r.peer).unwrap();
    assert!(is_lost(&r.engine.batches.state(b)));
    assert!(r.qp.state().destroyed);
    assert_eq!(r.engine.zombies(), 0);
    assert_eq!(r.engine.fence(r.peer), Err(TransportError::NoPeer(r.peer)));
}

#[test]
fn a_flush_timeout_after_a_successful_destroy_is_a_success() {
    let r = rig(16);
    r.qp.state().withhold_flushes = true;
    let b = r.post(3);
    let t = Instant::now();
    r.engine
        .fence(r.peer)
        .expect("destroy stops the NIC: the slots are safe");
    assert!(t.elapsed() >= FENCE);
    assert!(is_lost(&r.engine.batches.state(b)));
    assert_eq!(r.engine.zombies(), 0);
}

#[test]
fn a_fence_that_proves_nothing_keeps_the_peer_as_a_zombie_until_a_destroy_succeeds() {
    let r = rig(16);
    {
        let mut s = r.qp.state();
        s.withhold_flushes = true;
        s.destroy_failures = 2;
    }
    let b = r.post(3);
    match r.engine.fence(r.peer) {
        Err(TransportError::PeerLost { message, .. }) => {
            assert!(message.contains("not flushed"), "{message}")
        }
        other => panic!("a fence without a flush or a destroy must fail: {other:?}"),
    }
    assert!(is_lost(&r.engine.batches.state(b)));
    assert_eq!(r.engine.zombies(), 1);
    // A later reclaim must not see "no peer" (which returns slots): it retries.
    assert!(matches!(
        r.engine.fence(r.peer),
        Err(TransportError::PeerLost { .. })
    ));
    // The third destroy succeeds: now, and only now, the fence succeeds.
    assert_eq!(r.engine.fence(r.peer), Ok(()));
    assert_eq!(r.qp.state().destroy_calls, 3);
    assert_eq!(r.engine.zombies(), 0);
    assert_eq!(r.engine.fence(r.peer), Err(TransportError::NoPeer(r.peer)));
}

#[test]
fn a_full_flush_with_a_failed_destroy_succeeds_and_the_sweep_retries_the_destroy() {
    let r = rig(16);
    r.qp.state().destroy_failures = 1;
    r.post(3);
    r.engine
        .fence(r.peer)
        .expect("every request flushed: no DMA left");
    assert_eq!(r.engine.zombies(), 1);
    r.engine.sweep(Instant::now());
    assert_eq!(r.engine.zombies(), 0);
    assert!(r.qp.state().destroyed);
}

#[test]
fn an_async_queue_pair_error_fails_the_peer_and_its_backlog() {
    let r = rig(1);
    let b = r.post(3);
    assert!(r.engine.fail_qpn(77, "QP fatal (async event)"));
    assert!(!r.engine.fail_qpn(78, "unknown"));
    // The one posted request is flushed by the move to ERR, the two waiting fail.
    r.service();
    assert!(is_lost(&r.engine.batches.state(b)));
    assert!(r.qp.state().error);
    assert!(matches!(
        r.engine.post(r.peer, &ops(1), &r.local, Instant::now()),
        Err(TransportError::PeerLost { .. })
    ));
    r.engine.fence(r.peer).unwrap();
}

#[test]
fn port_down_fails_every_peer() {
    let r = rig(4);
    let qp2 = Arc::new(FakeQp::new(78));
    r.engine.add_peer(
        PeerId(2),
        "agent-b".into(),
        serde_json::json!({"device": "mlx5_1"}),
        qp2.clone(),
        4,
        0x11,
    );
    r.engine.fail_all("port 1 is down");
    assert!(r.qp.state().error && qp2.state().error);
    assert!(r
        .engine
        .find_usable(&serde_json::json!({"device": "mlx5_1"}))
        .is_none());
    assert!(!r.engine.close());
}

#[test]
fn posts_are_checked_before_anything_is_posted() {
    let r = rig(4);
    let mut bad = ops(2);
    bad[1].local_offset = 1 << 20;
    assert!(matches!(
        r.engine.post(r.peer, &bad, &r.local, Instant::now()),
        Err(TransportError::LocalRange { .. })
    ));
    let mut bad = ops(2);
    bad[0].rkey = 1 << 33;
    assert!(matches!(
        r.engine.post(r.peer, &bad, &r.local, Instant::now()),
        Err(TransportError::BadKey { .. })
    ));
    assert_eq!(r.qp.state().posted, 0);
    assert_eq!(
        r.engine.post(PeerId(9), &ops(1), &r.local, Instant::now()),
        Err(TransportError::NoPeer(PeerId(9)))
    );
}
