//! Transfer isolation. A transfer posts one batch per peer (agent), each with the
//! staging slots its operations use. When it ends:
//! - a peer whose batch completed (done or failed for sure) gives its slots back;
//! - a peer never posted to gives its slots back;
//! - a peer whose batch is still pending at the deadline (its outcome unknown: the NIC
//!   may still be moving bytes into those slots) keeps *only its own* slots, in the
//!   [`Isolation`] registry, until that peer is fenced; then they come back too.
//!
//! Upstream kept such slots until the process restarted; the fence (QP to error and
//! its flushed completions drained, or the soft reader stopped) is the proof that no
//! DMA touches them any more.

use super::clock::Deadline;
use super::staging::Slot;
use crate::transport::{BatchId, BatchState, Op, PeerId, Transport, TransportError};
use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

/// One peer's part of a transfer.
pub struct PeerBatch {
    pub peer: PeerId,
    pub ops: Vec<Op>,
    pub slots: Vec<Slot>,
}

/// How one peer's part ended.
#[derive(Debug)]
pub enum PeerOutcome {
    /// Every operation completed; the slots (with READ data) are the caller's again.
    Done(Vec<Slot>),
    /// Failed for sure (nothing in flight); the slots are the caller's again (their
    /// contents undefined).
    Failed(TransportError, Vec<Slot>),
    /// Outcome unknown at the deadline; the slots are kept until the peer is fenced.
    Kept(PeerId),
}

impl PeerOutcome {
    pub fn is_done(&self) -> bool {
        matches!(self, PeerOutcome::Done(_))
    }
}

/// Slots of transfers whose outcome is unknown, per peer, and what is known of each
/// peer's fence. The rule (sans-I/O: [`Isolation::record_fence`]): a peer's kept
/// slots come back, and pages its WRITEs may still reach are reused, only after a
/// fence of that peer that *succeeded*. A failed fence, or a peer the transport no
/// longer knows (`NoPeer`: another pool's fence may still be running, or it failed
/// and forgot the peer), proves nothing: the slots stay kept.
#[derive(Default)]
pub struct Isolation {
    state: Mutex<IsoState>,
}

#[derive(Default)]
struct IsoState {
    kept: Vec<(PeerId, Vec<Slot>)>,
    /// Peers whose fence succeeded: nothing of them touches memory any more.
    fenced: BTreeSet<PeerId>,
    /// Peers whose WRITEs failed with the connection (their outcome at the target is
    /// unknown) and that have not been fenced yet.
    unconfirmed: BTreeSet<PeerId>,
}

impl Isolation {
    pub fn new() -> Isolation {
        Isolation::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, IsoState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Slots kept now.
    pub fn kept_slots(&self) -> usize {
        self.lock().kept.iter().map(|(_, s)| s.len()).sum()
    }

    /// Peers that have kept slots.
    pub fn peers(&self) -> Vec<PeerId> {
        let mut p: Vec<PeerId> = self.lock().kept.iter().map(|(p, _)| *p).collect();
        p.sort();
        p.dedup();
        p
    }

    fn keep(&self, peer: PeerId, slots: Vec<Slot>) {
        self.lock().kept.push((peer, slots));
    }

    /// WRITEs to `peer` failed with its connection: the target may still apply what it
    /// read, so pages they aimed at stay out of use until the peer is fenced.
    pub fn unknown_writes(&self, peer: PeerId) {
        let mut st = self.lock();
        if !st.fenced.contains(&peer) {
            st.unconfirmed.insert(peer);
        }
    }

    /// True while a transfer of unknown outcome could still land somewhere: a peer
    /// keeps slots, or its failed WRITEs were not fenced yet.
    pub fn may_still_write(&self) -> bool {
        let st = self.lock();
        !st.kept.is_empty() || !st.unconfirmed.is_empty()
    }

    /// Records the outcome of a fence of `peer`; true when it proves the peer quiet
    /// (only a success does).
    pub fn record_fence(&self, peer: PeerId, outcome: &Result<(), TransportError>) -> bool {
        let mut st = self.lock();
        match outcome {
            Ok(()) => {
                st.fenced.insert(peer);
                st.unconfirmed.remove(&peer);
                true
            }
            Err(_) => st.fenced.contains(&peer),
        }
    }

    /// Fences `peer` at the transport (waiting for its proof until `by`) and records
    /// the outcome.
    pub fn fence(&self, t: &dyn Transport, peer: PeerId, by: Deadline) -> bool {
        let r = t.fence_within(peer, by.left());
        if let Err(e) = &r {
            log::warn!("fence of peer {} failed: {e}", peer.0);
        }
        self.record_fence(peer, &r)
    }

    /// Gives up the slots whose peer could not be fenced without returning them to
    /// their pool (a DMA may still touch them): for a mover that goes away. Returns how
    /// many were left out of use.
    pub fn abandon(&self) -> usize {
        let kept = std::mem::take(&mut self.lock().kept);
        let mut n = 0;
        for (_, slots) in kept {
            n += slots.len();
            for s in slots {
                std::mem::forget(s);
            }
        }
        n
    }

    /// Fences every peer with kept slots (or unconfirmed WRITEs) not fenced yet (the
    /// fences wait for their proof until `by`), and gives back the slots of every peer
    /// whose fence succeeded. Returns the peers fenced: they must be connected again
    /// before use. A peer whose fence fails keeps its slots (and is tried again next
    /// time).
    pub fn reclaim(&self, t: &dyn Transport, by: Deadline) -> Vec<PeerId> {
        let todo: Vec<PeerId> = {
            let st = self.lock();
            let mut p: Vec<PeerId> = st.kept.iter().map(|(p, _)| *p).collect();
            p.extend(st.unconfirmed.iter().copied());
            p.sort();
            p.dedup();
            p.retain(|p| !st.fenced.contains(p));
            p
        };
        let mut fenced = Vec::new();
        for peer in todo {
            if self.fence(t, peer, by) {
                fenced.push(peer);
            }
        }
        let back: Vec<(PeerId, Vec<Slot>)> = {
            let mut st = self.lock();
            let fenced_now = st.fenced.clone();
            let (back, keep) = std::mem::take(&mut st.kept)
                .into_iter()
                .partition(|(p, _)| fenced_now.contains(p));
            st.kept = keep;
            // Peer ids are never reused: forget fences nothing refers to any more.
            let still: BTreeSet<PeerId> = st.kept.iter().map(|(p, _)| *p).collect();
            st.fenced
                .retain(|p| still.contains(p) || fenced.contains(p));
            back
        };
        drop(back); // the slots go back to their pool here, exactly once
        fenced
    }
}

/// Posts every peer's batch and waits for all of them until `timeout`.
pub fn execute(
    t: &dyn Transport,
    batches: Vec<PeerBatch>,
    timeout: Duration,
    iso: &Isolation,
) -> Vec<PeerOutcome> {
    post(t, batches, Deadline::after(timeout)).finish(t, iso)
}

/// A transfer whose batches are on their way: [`Posted::finish`] waits for them and
/// hands the slots back as [`execute`] does, so that a caller can post the next
/// transfer before it waits for this one.
#[must_use = "a posted transfer owns its slots until it is finished"]
pub struct Posted {
    parts: Vec<PostedPart>,
    deadline: Deadline,
}

/// One peer's batch as posted, or why it could not be, with its slots.
type PostedPart = Result<(PeerBatch, BatchId), (TransportError, Vec<Slot>)>;

/// Posts every peer's batch; each must complete by `deadline`.
pub fn post(t: &dyn Transport, batches: Vec<PeerBatch>, deadline: Deadline) -> Posted {
    let parts = batches
        .into_iter()
        .map(|b| match t.post_within(b.peer, &b.ops, deadline.left()) {
            Ok(id) => Ok((b, id)),
            // Nothing was sent for this peer: its slots come back with the outcome.
            Err(e) => Err((e, b.slots)),
        })
        .collect();
    Posted { parts, deadline }
}

impl Posted {
    /// Waits for every peer's batch until the deadline set when it was posted; a peer
    /// still pending then keeps its slots in `iso` until it is fenced.
    pub fn finish(mut self, t: &dyn Transport, iso: &Isolation) -> Vec<PeerOutcome> {
        let deadline = self.deadline;
        std::mem::take(&mut self.parts)
            .into_iter()
            .map(|p| match p {
                Err((e, slots)) => PeerOutcome::Failed(e, slots),
                Ok((b, id)) => {
                    match t.wait(id, deadline.left()) {
                        BatchState::Done => {
                            t.forget(id);
                            PeerOutcome::Done(b.slots)
                        }
                        BatchState::Failed(e) => {
                            t.forget(id);
                            PeerOutcome::Failed(e, b.slots)
                        }
                        BatchState::Pending => {
                            log::warn!(
                                "transfer to peer {} did not finish in time: keeping its {} slots until the peer is fenced",
                                b.peer.0,
                                b.slots.len()
                            );
                            iso.keep(b.peer, b.slots);
                            PeerOutcome::Kept(b.peer)
                        }
                    }
                }
            })
            .collect()
    }
}

impl Drop for Posted {
    /// Only a transfer dropped without [`Posted::finish`] (a bug, or a panic unwinding)
    /// has parts left: their NIC may still move bytes into the slots, and nothing here
    /// can fence it, so the slots never go back to their pool.
    fn drop(&mut self) {
        let mut lost = 0;
        for p in std::mem::take(&mut self.parts) {
            let slots = match p {
                Ok((b, _)) => b.slots,
                Err((_, s)) => s,
            };
            lost += slots.len();
            for s in slots {
                std::mem::forget(s);
            }
        }
        if lost > 0 {
            log::error!(
                "a transfer was dropped unfinished: {lost} staging slot(s) stay out of use"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Bringup, LocalBuffer, OpKind};
    use crate::worker::staging::{SlotPool, StagingLayout, StagingSlots};
    use std::collections::{HashMap, HashSet};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A deadline for fences of the fake transport (which answer at once).
    fn soon() -> Deadline {
        Deadline::after(Duration::from_secs(1))
    }

    /// A transport whose peers either complete at once, fail, or never answer until fenced.
    #[derive(Default)]
    struct FaultTransport {
        silent: HashSet<u64>,
        failing: HashSet<u64>,
        refuse_post: HashSet<u64>,
        batches: Mutex<HashMap<BatchId, (PeerId, BatchState)>>,
        fenced: Mutex<Vec<PeerId>>,
        /// What `fence` answers (None: success).
        fence_err: Mutex<Option<TransportError>>,
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
            } else {
                BatchState::Done
            };
            self.batches.lock().unwrap().insert(id, (peer, st));
            Ok(id)
        }
        fn state(&self, b: BatchId) -> BatchState {
            self.batches
                .lock()
                .unwrap()
                .get(&b)
                .map(|x| x.1.clone())
                .unwrap_or(BatchState::Failed(TransportError::NoBatch(b)))
        }
        fn wait(&self, b: BatchId, _t: Duration) -> BatchState {
            self.state(b)
        }
        fn forget(&self, b: BatchId) {
            self.batches.lock().unwrap().remove(&b);
        }
        fn fence(&self, peer: PeerId) -> Result<(), TransportError> {
            self.fenced.lock().unwrap().push(peer);
            match self.fence_err.lock().unwrap().clone() {
                Some(e) => Err(e),
                None => Ok(()),
            }
        }
    }

    fn batch(st: &StagingSlots, peer: u64, n: usize) -> PeerBatch {
        let slots = st.try_acquire(SlotPool::Load, n);
        assert_eq!(slots.len(), n);
        let ops = slots
            .iter()
            .map(|s| Op {
                kind: OpKind::Read,
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

    #[test]
    fn only_the_silent_peers_slots_are_kept_and_they_return_after_the_fence() {
        let st = StagingSlots::new(StagingLayout {
            slot_size: 64,
            load_slots: 12,
            store_slots: 0,
        })
        .unwrap();
        for silent_peer in 0..3u64 {
            let t = FaultTransport {
                silent: [silent_peer].into(),
                ..Default::default()
            };
            let iso = Isolation::new();
            let out = execute(
                &t,
                vec![batch(&st, 0, 2), batch(&st, 1, 3), batch(&st, 2, 4)],
                Duration::from_millis(1),
                &iso,
            );
            let kept_n = [2, 3, 4][silent_peer as usize];
            for (i, o) in out.iter().enumerate() {
                if i as u64 == silent_peer {
                    assert!(matches!(o, PeerOutcome::Kept(p) if p.0 == silent_peer));
                } else {
                    assert!(o.is_done());
                }
            }
            drop(out); // the done peers' slots go back with their outcomes
            assert_eq!(iso.kept_slots(), kept_n);
            assert_eq!(
                st.free(SlotPool::Load),
                12 - kept_n,
                "only the silent peer's slots are kept"
            );
            assert_eq!(iso.reclaim(&t, soon()), vec![PeerId(silent_peer)]);
            assert_eq!(*t.fenced.lock().unwrap(), vec![PeerId(silent_peer)]);
            assert_eq!(iso.kept_slots(), 0);
            assert_eq!(
                st.free(SlotPool::Load),
                12,
                "every slot is back, exactly once"
            );
        }
    }

    #[test]
    fn failed_and_unposted_peers_hand_their_slots_back_with_the_outcome() {
        let st = StagingSlots::new(StagingLayout {
            slot_size: 64,
            load_slots: 6,
            store_slots: 0,
        })
        .unwrap();
        let t = FaultTransport {
            failing: [0].into(),
            refuse_post: [1].into(),
            ..Default::default()
        };
        let iso = Isolation::new();
        let out = execute(
            &t,
            vec![batch(&st, 0, 2), batch(&st, 1, 2), batch(&st, 2, 2)],
            Duration::from_millis(1),
            &iso,
        );
        assert!(matches!(
            &out[0],
            PeerOutcome::Failed(TransportError::BadKey { .. }, s) if s.len() == 2
        ));
        assert!(matches!(
            &out[1],
            PeerOutcome::Failed(TransportError::NoPeer(_), s) if s.len() == 2
        ));
        assert!(out[2].is_done());
        assert_eq!(
            iso.kept_slots(),
            0,
            "nothing kept for failed or unposted peers"
        );
        drop(out);
        assert_eq!(st.free(SlotPool::Load), 6);
        assert_eq!(iso.kept_slots(), 0);
        assert!(iso.reclaim(&t, soon()).is_empty());
    }

    fn one_kept(st: &StagingSlots, t: &FaultTransport, iso: &Isolation, peer: u64) {
        let out = execute(t, vec![batch(st, peer, 2)], Duration::from_millis(1), iso);
        assert!(matches!(out[0], PeerOutcome::Kept(_)));
    }

    #[test]
    fn slots_come_back_only_after_a_fence_that_succeeded() {
        let st = StagingSlots::new(StagingLayout {
            slot_size: 64,
            load_slots: 4,
            store_slots: 0,
        })
        .unwrap();
        let t = FaultTransport {
            silent: [0].into(),
            ..Default::default()
        };
        let iso = Isolation::new();
        one_kept(&st, &t, &iso, 0);
        // The fence fails (flushed completions did not drain): the slots stay kept.
        *t.fence_err.lock().unwrap() = Some(TransportError::Setup("flush did not drain".into()));
        assert!(iso.reclaim(&t, soon()).is_empty());
        assert_eq!(iso.kept_slots(), 2);
        assert!(iso.may_still_write());
        // The transport forgot the failed peer: "no such peer" is no proof of quiet.
        *t.fence_err.lock().unwrap() = Some(TransportError::NoPeer(PeerId(0)));
        assert!(iso.reclaim(&t, soon()).is_empty(), "NoPeer is not a fence");
        assert_eq!(iso.kept_slots(), 2);
        assert_eq!(st.free(SlotPool::Load), 2);
        // A fence that succeeds gives them back, exactly once.
        *t.fence_err.lock().unwrap() = None;
        assert_eq!(iso.reclaim(&t, soon()), vec![PeerId(0)]);
        assert_eq!(iso.kept_slots(), 0);
        assert_eq!(st.free(SlotPool::Load), 4);
        assert!(!iso.may_still_write());
    }

    #[test]
    fn a_fence_that_succeeded_elsewhere_counts_and_is_not_needed_again() {
        let st = StagingSlots::new(StagingLayout {
            slot_size: 64,
            load_slots: 4,
            store_slots: 0,
        })
        .unwrap();
        let t = FaultTransport {
            silent: [3].into(),
            ..Default::default()
        };
        let iso = Isolation::new();
        one_kept(&st, &t, &iso, 3);
        // The peer was fenced when its batch failed (recorded), then forgotten.
        assert!(iso.record_fence(PeerId(3), &Ok(())));
        *t.fence_err.lock().unwrap() = Some(TransportError::NoPeer(PeerId(3)));
        iso.reclaim(&t, soon());
        assert_eq!(st.free(SlotPool::Load), 4, "the recorded fence proves it");
        assert!(t.fenced.lock().unwrap().is_empty(), "no second fence");
    }

    #[test]
    fn pages_of_writes_lost_with_their_connection_wait_for_a_fence_that_succeeded() {
        let t = FaultTransport::default();
        let iso = Isolation::new();
        iso.unknown_writes(PeerId(5));
        assert!(
            iso.may_still_write(),
            "the target may still apply what it read"
        );
        *t.fence_err.lock().unwrap() = Some(TransportError::NoPeer(PeerId(5)));
        iso.reclaim(&t, soon());
        assert!(iso.may_still_write());
        *t.fence_err.lock().unwrap() = None;
        iso.reclaim(&t, soon());
        assert!(!iso.may_still_write());
    }
}
