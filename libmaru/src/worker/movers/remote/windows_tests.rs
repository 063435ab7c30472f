//! Tests of `windows.rs`: the schedule of a request's windows (`run`, against a
//! script), and one window planned (`RemoteState`'s rules), posted, waited for and
//! settled, against a transport whose peers complete, fail, refuse or never answer.

use super::super::fixtures::{grant, mapped};
use super::*;
use crate::net::ClientOptions;
use crate::transport::{Bringup, LocalBuffer};
use crate::worker::movers::remote::IN_FLIGHT_BUDGET;
use crate::worker::staging::{SlotPool, StagingLayout, StagingSlots};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// A transport whose peers complete at once, fail, refuse the post, or never answer.
#[derive(Default)]
struct FaultTransport {
    silent: HashSet<u64>,
    failing: HashSet<u64>,
    lost: HashSet<u64>,
    refuse_post: HashSet<u64>,
    batches: Mutex<HashMap<BatchId, BatchState>>,
    next: AtomicU64,
}

impl Transport for FaultTransport {
    fn name(&self) -> &'static str {
        "fault"
    }
    fn register_local(&self, _b: LocalBuffer) -> Result<(), TransportError> {
        Ok(())
    }
    fn connect(
        &self,
        _m: &serde_json::Value,
        _b: &mut Bringup<'_>,
    ) -> Result<PeerId, TransportError> {
        Ok(PeerId(0))
    }
    fn post(&self, peer: PeerId, _ops: &[Op]) -> Result<BatchId, TransportError> {
        if self.refuse_post.contains(&peer.0) {
            return Err(TransportError::NoPeer(peer));
        }
        let id = BatchId(self.next.fetch_add(1, Ordering::Relaxed));
        let st = if self.silent.contains(&peer.0) {
            BatchState::Pending
        } else if self.failing.contains(&peer.0) {
            BatchState::Failed(TransportError::BadKey { rkey: 1 })
        } else if self.lost.contains(&peer.0) {
            BatchState::Failed(TransportError::PeerLost {
                peer: "p".into(),
                message: "reset".into(),
            })
        } else {
            BatchState::Done
        };
        self.batches.lock().unwrap().insert(id, st);
        Ok(id)
    }
    fn state(&self, b: BatchId) -> BatchState {
        self.batches
            .lock()
            .unwrap()
            .get(&b)
            .cloned()
            .unwrap_or(BatchState::Failed(TransportError::NoBatch(b)))
    }
    fn wait(&self, b: BatchId, _t: Duration) -> BatchState {
        self.state(b)
    }
    fn forget(&self, b: BatchId) {
        self.batches.lock().unwrap().remove(&b);
    }
    fn fence(&self, _peer: PeerId) -> Result<(), TransportError> {
        Ok(())
    }
}

fn staging(n: usize) -> StagingSlots {
    StagingSlots::new(StagingLayout {
        slot_size: 64,
        load_slots: n,
        store_slots: n,
    })
    .unwrap()
}

fn batch(st: &StagingSlots, peer: u64, n: usize, kind: OpKind) -> PeerBatch {
    let slots = st.try_acquire(SlotPool::Load, n);
    assert_eq!(slots.len(), n);
    let ops = slots
        .iter()
        .map(|s| Op {
            kind,
            local_offset: s.offset() as u64,
            remote_addr: 0,
            rkey: 1,
            len: 8,
        })
        .collect();
    PeerBatch {
        peer: PeerId(peer),
        ops,
        slots,
    }
}

fn state() -> RemoteState {
    RemoteState::new(ClientOptions::new("test", "t"))
}

/// The slots of a window's batches, back in `out` by item (see `settle`).
/// `batches` posted through `t` and finished by a deadline 1 ms away.
fn posted(t: &FaultTransport, batches: Vec<PeerBatch>) -> Vec<PeerOutcome> {
    post(t, batches, Deadline::after(Duration::from_millis(1))).finish(t)
}

fn settle_all(
    st: &mut RemoteState,
    outcomes: Vec<PeerOutcome>,
    sizes: &[usize],
    writes: bool,
) -> (Settled, Vec<SlotOutcome>) {
    let mut order = Vec::new();
    let mut next = 0;
    for &n in sizes {
        order.push((next..next + n).collect::<Vec<_>>());
        next += n;
    }
    let peers = (0..sizes.len() as u64).map(PeerId).collect();
    let mut out: Vec<SlotOutcome> = (0..next)
        .map(|_| SlotOutcome {
            ok: false,
            slot: None,
        })
        .collect();
    let s = st.settle(&order, peers, writes, outcomes, &mut out);
    (s, out)
}

/// A transfer to four peers: one answers, one never does, one fails, one refuses
/// the post. Only the silent peer's slots stay out (kept until it is fenced); the
/// others come back with their outcomes, exactly once.
#[test]
fn only_the_silent_peers_slots_are_kept_and_the_others_come_back_with_their_outcome() {
    let sl = staging(12);
    let t = FaultTransport {
        silent: [1].into(),
        failing: [2].into(),
        refuse_post: [3].into(),
        ..Default::default()
    };
    let batches = (0..4).map(|p| batch(&sl, p, 3, OpKind::Read)).collect();
    let outcomes = posted(&t, batches);
    assert!(matches!(outcomes[0], PeerOutcome::Done(ref s) if s.len() == 3));
    assert!(matches!(outcomes[1], PeerOutcome::Kept(PeerId(1), ref s) if s.len() == 3));
    assert!(matches!(
        outcomes[2],
        PeerOutcome::Failed(TransportError::BadKey { .. }, ref s) if s.len() == 3
    ));
    assert!(matches!(
        outcomes[3],
        PeerOutcome::Failed(TransportError::NoPeer(_), ref s) if s.len() == 3
    ));
    let mut st = state();
    let (s, out) = settle_all(&mut st, outcomes, &[3, 3, 3, 3], false);
    assert!(s.kept && s.failed && s.dropped);
    assert_eq!(out.iter().filter(|o| o.ok).count(), 3);
    assert_eq!(out.iter().filter(|o| o.slot.is_none()).count(), 3);
    drop(out);
    assert_eq!(
        sl.free(SlotPool::Load),
        9,
        "only the silent peer's slots are out"
    );
    assert_eq!(st.iso.kept_slots(), 3);
    assert!(st.iso.may_still_write());
}

/// A batch of WRITEs that failed with its connection: its peer is dropped (queued
/// for a fence), the read registrations go, and its pages' outcome stays unknown
/// until a fence succeeds (`may_still_write`).
#[test]
fn a_write_batch_lost_with_its_connection_drops_its_peer_and_stays_unconfirmed() {
    let sl = staging(4);
    let t = FaultTransport {
        lost: [0].into(),
        ..Default::default()
    };
    let mut st = state();
    st.agent("a:1").peer = Some(PeerId(0));
    st.reads
        .insert((9, 0, 8), ("a:1".into(), 0, 1, serde_json::Value::Null));
    let outcomes = posted(&t, vec![batch(&sl, 0, 2, OpKind::Write)]);
    let (s, out) = settle_all(&mut st, outcomes, &[2], true);
    assert!(s.failed && s.dropped && !s.kept);
    assert!(out.iter().all(|o| !o.ok && o.slot.is_some()), "slots back");
    assert_eq!(
        st.agent("a:1").peer,
        None,
        "dropped: the next transfer connects again"
    );
    assert_eq!(st.to_fence, vec![PeerId(0)]);
    assert!(st.reads.is_empty());
    assert!(st.life.needs_remap("a:1"));
    assert!(
        st.iso.may_still_write(),
        "the target may still apply what it read"
    );
}

/// A window writes only into own regions that are usable, through agents with a
/// data connection: an item of a region unknown, of an agent not connected yet,
/// or of a region whose node rebooted gets its slot back and is not posted.
#[test]
fn a_window_plans_writes_only_into_usable_regions_whose_agent_has_a_peer() {
    let sl = staging(4);
    let mut st = state();
    st.adopted(&grant(1, "a:1"), "a:1", mapped(1, "boot-1"), 0)
        .unwrap();
    let page = |region: u64| PageGrant {
        region_id: region,
        page: 1,
        offset: 4096,
        length: 4096,
    };
    let plan = |st: &mut RemoteState, region: u64| {
        let slots = sl.try_acquire(SlotPool::Store, 1);
        plan_writes_to(vec![0], slots, &|_| (page(region), 32), &|r| st.write_to(r))
    };
    let p = plan(&mut st, 1);
    assert!(
        p.group.batches.is_empty(),
        "no peer yet: `ready` connects first"
    );
    assert!(p.out[0].slot.is_some());
    assert_eq!(st.unready(["a:1".to_string()]), vec!["a:1".to_string()]);
    st.agent("a:1").peer = Some(PeerId(5));
    assert!(st.unready(["a:1".to_string()]).is_empty());
    let p = plan(&mut st, 1);
    assert_eq!(p.group.batches.len(), 1);
    assert_eq!(p.group.batches[0].ops[0].remote_addr, 0x10000 + 4096);
    drop(p);
    assert!(
        plan(&mut st, 2).group.batches.is_empty(),
        "not an own region"
    );
    st.seen("a:1", Some("boot-2"), None, 5).unwrap();
    assert!(
        plan(&mut st, 1).group.batches.is_empty(),
        "its node rebooted: neither read nor written until maru-server knows"
    );
}

/// A stalled peer costs one timeout: a batch still pending at the request's
/// deadline (kept until its peer is fenced) makes its agent away, and the next
/// window plans no WRITE to it (the slot comes back at once) and does not try to
/// make it ready, until a fence of that peer succeeds; the agent's control
/// connection answering (a welcome, a probe) is not enough (a half-open data
/// port). Seen failing with `holds` answering false (the next window posted to the
/// silent peer again).
#[test]
fn a_batch_pending_at_its_deadline_makes_its_agent_away_until_its_fence() {
    let sl = staging(4);
    let t = FaultTransport {
        silent: [5].into(),
        ..Default::default()
    };
    let mut st = state();
    st.adopted(&grant(1, "a:1"), "a:1", mapped(1, "boot-1"), 0)
        .unwrap();
    st.agent("a:1").peer = Some(PeerId(5));
    let outcomes = posted(&t, vec![batch(&sl, 5, 1, OpKind::Write)]);
    let mut out = vec![SlotOutcome {
        ok: false,
        slot: None,
    }];
    let s = st.settle(&[vec![0]], vec![PeerId(5)], true, outcomes, &mut out);
    assert!(s.kept);
    assert!(st.agent_away("a:1") && st.region_away(1));
    let page = PageGrant {
        region_id: 1,
        page: 1,
        offset: 4096,
        length: 4096,
    };
    let plan = |st: &mut RemoteState| {
        plan_writes_to(
            vec![0],
            sl.try_acquire(SlotPool::Store, 1),
            &|_| (page, 32),
            &|r| st.write_to(r),
        )
    };
    let p = plan(&mut st);
    assert!(
        p.group.batches.is_empty(),
        "nothing posted to the away agent"
    );
    assert!(p.out[0].slot.is_some(), "its slot back at once");
    drop(p);
    assert!(st.unready(["a:1".to_string()]).is_empty(), "not made ready");
    st.seen("a:1", Some("boot-1"), None, 7_250).unwrap();
    assert!(
        st.agent_away("a:1"),
        "the control connection answering is not enough"
    );
    // A fence that failed proves nothing; one that succeeded ends it.
    assert!(!st
        .iso
        .record_fence(PeerId(5), &Err(TransportError::NoPeer(PeerId(5)))));
    assert!(st.agent_away("a:1"));
    assert!(st.iso.record_fence(PeerId(5), &Ok(())));
    drop(st.iso.release(&[PeerId(5)]));
    assert!(!st.agent_away("a:1"));
    assert_eq!(
        plan(&mut st).group.batches.len(),
        1,
        "answering again: written"
    );
}

/// Posts nothing anywhere: records what the schedule does. Items fail where
/// `fail` says; `slots` hands out at most `free` slots of a small pool.
struct Script {
    sizes: Vec<u64>,
    staging: StagingSlots,
    fail: Vec<usize>,
    stop_on_failure: bool,
    open: Vec<usize>,
    most_open_bytes: u64,
    posted: Vec<(usize, usize)>,
    done: Vec<usize>,
    outstanding_at_done: Vec<usize>,
}

impl Script {
    fn new(sizes: Vec<u64>, slots: usize) -> Script {
        Script {
            sizes,
            staging: StagingSlots::new(StagingLayout {
                slot_size: 64,
                load_slots: slots,
                store_slots: 0,
            })
            .unwrap(),
            fail: Vec::new(),
            stop_on_failure: false,
            open: Vec::new(),
            most_open_bytes: 0,
            posted: Vec::new(),
            done: Vec::new(),
            outstanding_at_done: Vec::new(),
        }
    }
}

impl Windowed for Script {
    type Posted = (usize, Vec<Slot>);
    fn items(&self) -> usize {
        self.sizes.len()
    }
    fn bytes(&self, i: usize) -> u64 {
        self.sizes[i]
    }
    fn slots(&mut self, _start: usize, want: usize, _first: bool) -> Vec<Slot> {
        self.staging.try_acquire(SlotPool::Load, want)
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> Self::Posted {
        self.posted.push((start, slots.len()));
        self.open.push(start);
        let open_bytes: u64 = self
            .open
            .iter()
            .map(|&s| {
                let len = self.posted.iter().find(|p| p.0 == s).map_or(0, |p| p.1);
                self.sizes[s..s + len].iter().sum::<u64>()
            })
            .sum();
        self.most_open_bytes = self.most_open_bytes.max(open_bytes);
        (start, slots)
    }
    fn finish(&mut self, (start, slots): Self::Posted) -> (Vec<usize>, Vec<SlotOutcome>) {
        self.open.retain(|&s| s != start);
        let items: Vec<usize> = (start..start + slots.len()).collect();
        let outs = items
            .iter()
            .zip(slots)
            .map(|(i, slot)| SlotOutcome {
                ok: !self.fail.contains(i),
                slot: Some(slot),
            })
            .collect();
        (items, outs)
    }
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool {
        self.outstanding_at_done.push(self.open.len());
        let mut ok = true;
        for (&i, o) in items.iter().zip(outcomes) {
            self.done.push(i);
            ok &= o.ok;
        }
        ok || !self.stop_on_failure
    }
}

/// A script of chunks of `sizes` run through `slots` staging slots: every chunk handed
/// over, in order.
fn handed_over(sizes: Vec<u64>, slots: usize, budget: &InFlightBudget) -> Script {
    let mut s = Script::new(sizes, slots);
    let n = s.sizes.len();
    assert_eq!(run(&mut s, budget), n, "every chunk handed over");
    assert_eq!(s.done, (0..n).collect::<Vec<_>>(), "in order");
    s
}

#[test]
fn windows_of_the_window_size_two_in_flight_handed_over_in_order() {
    let budget = InFlightBudget::default();
    // 24 chunks of 256 KiB: windows of 8, two in flight, three in all.
    let s = handed_over(vec![256 << 10; 24], 64, &budget);
    assert_eq!(s.posted, vec![(0, 8), (8, 8), (16, 8)]);
    assert_eq!(s.most_open_bytes, 4 << 20, "two windows of 2 MiB at most");
    // When the first window is handed over, the second is still in flight.
    assert_eq!(s.outstanding_at_done[0], 1);
    assert_eq!(s.staging.free(SlotPool::Load), 64, "every slot is back");
    // Chunks larger than a window go one a window.
    let s = handed_over(vec![3 << 20; 3], 64, &budget);
    assert_eq!(s.posted, vec![(0, 1), (1, 1), (2, 1)]);
}

#[test]
fn a_second_window_waits_while_the_data_path_is_over_its_budget() {
    let budget = InFlightBudget::default();
    // Another request holds the whole budget: this one keeps one window in flight.
    let other = budget.take(IN_FLIGHT_BUDGET, true).expect("a first window");
    let s = handed_over(vec![256 << 10; 24], 64, &budget);
    assert_eq!(s.posted.len(), 3);
    assert!(
        s.outstanding_at_done.iter().all(|&n| n == 0),
        "one window at a time: {:?}",
        s.outstanding_at_done
    );
    assert_eq!(s.most_open_bytes, 2 << 20);
    drop(other);
    assert_eq!(budget.in_flight(), 0, "every share given back");
    assert!(budget.take(1, false).is_some(), "within the budget again");
    // Another data path has its own budget: it never waits for this one's.
    let mine = budget.take(IN_FLIGHT_BUDGET, true);
    let other_path = InFlightBudget::default();
    assert!(other_path.take(1, false).is_some());
    drop(mine);
}

#[test]
fn two_requests_of_one_data_path_each_get_two_windows() {
    let budget = InFlightBudget::default();
    // Another request of the handler has its two windows in flight: this one still
    // gets two, as a request of a second handler would.
    let other = budget.take(DEPTH as u64 * WINDOW_BYTES, true);
    let s = handed_over(vec![256 << 10; 24], 64, &budget);
    assert_eq!(s.most_open_bytes, 2 * WINDOW_BYTES, "two windows in flight");
    drop(other);
    assert_eq!(budget.in_flight(), 0);
}

#[test]
fn few_slots_cut_windows_and_none_for_the_first_stops_the_request() {
    let budget = InFlightBudget::default();
    // 3 slots: a window of 3, then nothing free for a second until it is back.
    let s = handed_over(vec![256 << 10; 8], 3, &budget);
    assert_eq!(s.posted, vec![(0, 3), (3, 3), (6, 2)]);
    // No slot at all: nothing is posted.
    let mut s = Script::new(vec![256 << 10; 8], 3);
    let held = s.staging.try_acquire(SlotPool::Load, 3);
    assert_eq!(run(&mut s, &budget), 0);
    assert!(s.posted.is_empty() && s.done.is_empty());
    drop(held);
}

#[test]
fn after_a_failed_window_nothing_more_is_posted_or_handed_over() {
    let budget = InFlightBudget::default();
    let mut s = Script::new(vec![256 << 10; 40], 64);
    s.fail = vec![3];
    s.stop_on_failure = true;
    assert_eq!(
        run(&mut s, &budget),
        16,
        "the window behind the failed one was in flight"
    );
    assert_eq!(s.posted, vec![(0, 8), (8, 8)]);
    assert_eq!(
        s.done,
        (0..8).collect::<Vec<_>>(),
        "the window in flight was finished, not handed over"
    );
    assert_eq!(s.staging.free(SlotPool::Load), 64, "its slots are back too");
    // A caller that goes on after failures gets every window.
    let mut s = Script::new(vec![256 << 10; 40], 64);
    s.fail = vec![3, 20];
    assert_eq!(run(&mut s, &budget), 40);
    assert_eq!(s.done, (0..40).collect::<Vec<_>>());
}

/// The mover's tick ends by the deadline the pool's tick gives it: a map again due at
/// an agent that takes connections and never answers (a stopped node) waits until that
/// deadline, not the mover's own timeout, so what the pool's tick sends after it (the
/// give-back of silent regions, a reboot's report) is not left with a deadline already
/// spent. Seen failing with the maps again made by a deadline of their own (the
/// mover's 5 s timeout: the tick took 10 s).
#[test]
#[allow(clippy::disallowed_methods)] // a test: a real socket and the wall clock
fn the_tick_ends_by_its_deadline_at_an_agent_that_never_answers() {
    use crate::worker::clock::{now_ms, Deadline};
    // Its backlog takes the connection; nothing ever answers the handshake.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = silent.local_addr().unwrap().to_string();
    let mut opts = ClientOptions::new(crate::wire::agent::SERVICE, "t");
    opts.connect_timeout = Duration::from_secs(5);
    opts.call_timeout = Duration::from_secs(5);
    let m = RemoteMover::new(
        Arc::new(FaultTransport::default()),
        staging(2),
        opts,
        Duration::from_secs(5),
        Arc::new(InFlightBudget::default()),
    );
    let now = now_ms();
    {
        let mut st = m.lock();
        st.adopted(&grant(1, &a), &a, mapped(1, "boot-1"), now)
            .unwrap();
        st.seen(&a, Some("boot-1"), Some(1), now).unwrap();
        // A restart on the same boot: the region is to be mapped again.
        st.seen(&a, Some("boot-1"), Some(2), now).unwrap();
        assert!(st.remap_due(&a));
    }
    let t = std::time::Instant::now();
    m.tick(now, Deadline::after(Duration::from_millis(300)));
    let took = t.elapsed();
    assert!(took < Duration::from_secs(2), "the tick took {took:?}");
    drop(silent);
}
