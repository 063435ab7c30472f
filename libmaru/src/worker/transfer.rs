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

use super::staging::Slot;
use crate::transport::{BatchId, BatchState, Op, PeerId, Transport, TransportError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

/// Slots of transfers whose outcome is unknown, per peer.
#[derive(Default)]
pub struct Isolation {
    kept: Mutex<Vec<(PeerId, Vec<Slot>)>>,
}

impl Isolation {
    pub fn new() -> Isolation {
        Isolation::default()
    }

    /// Slots kept now.
    pub fn kept_slots(&self) -> usize {
        self.kept
            .lock()
            .map(|k| k.iter().map(|(_, s)| s.len()).sum())
            .unwrap_or(0)
    }

    /// Peers that have kept slots.
    pub fn peers(&self) -> Vec<PeerId> {
        let mut p: Vec<PeerId> = self
            .kept
            .lock()
            .map(|k| k.iter().map(|(p, _)| *p).collect())
            .unwrap_or_default();
        p.sort();
        p.dedup();
        p
    }

    fn keep(&self, peer: PeerId, slots: Vec<Slot>) {
        if let Ok(mut k) = self.kept.lock() {
            k.push((peer, slots));
        }
    }

    /// Gives up the slots whose peer could not be fenced without returning them to
    /// their pool (a DMA may still touch them): for a mover that goes away. Returns how
    /// many were left out of use.
    pub fn abandon(&self) -> usize {
        let kept = self
            .kept
            .lock()
            .map(|mut k| std::mem::take(&mut *k))
            .unwrap_or_default();
        let mut n = 0;
        for (_, slots) in kept {
            n += slots.len();
            for s in slots {
                std::mem::forget(s);
            }
        }
        n
    }

    /// Fences every peer with kept slots and gives their slots back. Returns the
    /// fenced peers: they must be connected again before use. A peer whose fence
    /// fails keeps its slots (and is retried next time).
    pub fn reclaim(&self, t: &dyn Transport) -> Vec<PeerId> {
        let mut fenced = Vec::new();
        for peer in self.peers() {
            match t.fence(peer) {
                Ok(()) | Err(TransportError::NoPeer(_)) => {
                    // NoPeer: already fenced (e.g. by another reclaim): no DMA is left.
                    if let Ok(mut k) = self.kept.lock() {
                        k.retain(|(p, _)| *p != peer);
                    }
                    fenced.push(peer);
                }
                Err(e) => log::warn!("fence of peer {} failed, its slots stay kept: {e}", peer.0),
            }
        }
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
    post(t, batches, timeout).finish(t, iso)
}

/// A transfer whose batches are on their way: [`Posted::finish`] waits for them and
/// hands the slots back as [`execute`] does, so that a caller can post the next
/// transfer before it waits for this one.
#[must_use = "a posted transfer owns its slots until it is finished"]
pub struct Posted {
    parts: Vec<PostedPart>,
    deadline: Instant,
}

/// One peer's batch as posted, or why it could not be, with its slots.
type PostedPart = Result<(PeerBatch, BatchId), (TransportError, Vec<Slot>)>;

/// Posts every peer's batch; each must complete within `timeout` of now.
pub fn post(t: &dyn Transport, batches: Vec<PeerBatch>, timeout: Duration) -> Posted {
    let deadline = Instant::now() + timeout;
    let parts = batches
        .into_iter()
        .map(|b| match t.post(b.peer, &b.ops) {
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
                    let left = deadline.saturating_duration_since(Instant::now());
                    match t.wait(id, left) {
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

    /// A transport whose peers either complete at once, fail, or never answer until fenced.
    #[derive(Default)]
    struct FaultTransport {
        silent: HashSet<u64>,
        failing: HashSet<u64>,
        refuse_post: HashSet<u64>,
        batches: Mutex<HashMap<BatchId, (PeerId, BatchState)>>,
        fenced: Mutex<Vec<PeerId>>,
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
            Ok(())
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
            assert_eq!(iso.reclaim(&t), vec![PeerId(silent_peer)]);
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
        assert!(iso.reclaim(&t).is_empty());
    }
}
