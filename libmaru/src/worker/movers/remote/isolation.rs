//! Transfer isolation, as records in the pool core (the fences are the driver's,
//! `RemoteMover::fence_round`). A peer whose batch is still pending at the deadline
//! keeps only its own slots here; they come back, and pages its WRITEs may reach are
//! reused, only after a fence of that peer that *succeeded* (a failed fence, or
//! `NoPeer`, proves nothing). Every other peer's slots come back at once.

use crate::transport::{Op, PeerId, TransportError};
use crate::worker::staging::Slot;
use std::collections::BTreeSet;

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
    /// Failed for sure (nothing in flight); the slots are the caller's again.
    Failed(TransportError, Vec<Slot>),
    /// Outcome unknown at the deadline: kept ([`Isolation::keep`]) until a fence.
    Kept(PeerId, Vec<Slot>),
}

/// Slots of transfers whose outcome is unknown, per peer, and what is known of each
/// peer's fence.
#[derive(Default)]
pub struct Isolation {
    kept: Vec<(PeerId, Vec<Slot>)>,
    /// Peers whose fence succeeded: nothing of them touches memory any more.
    fenced: BTreeSet<PeerId>,
    /// Peers whose WRITEs failed with the connection, not fenced yet.
    unconfirmed: BTreeSet<PeerId>,
}

impl Isolation {
    /// Keeps a peer's slots until it is fenced.
    pub fn keep(&mut self, peer: PeerId, slots: Vec<Slot>) {
        log::warn!(
            "transfer to peer {} did not finish in time: keeping its {} slots until the peer is fenced",
            peer.0,
            slots.len()
        );
        self.kept.push((peer, slots));
    }

    /// Whether `peer` keeps slots no fence freed yet (its agent counts as away).
    pub fn holds(&self, peer: PeerId) -> bool {
        !self.fenced.contains(&peer) && self.kept.iter().any(|(p, _)| *p == peer)
    }

    /// Slots kept now.
    #[cfg(test)]
    pub fn kept_slots(&self) -> usize {
        self.kept.iter().map(|(_, s)| s.len()).sum()
    }

    /// WRITEs to `peer` failed with its connection: the target may still apply what it
    /// read, so pages they aimed at stay out of use until the peer is fenced.
    pub fn unknown_writes(&mut self, peer: PeerId) {
        if !self.fenced.contains(&peer) {
            self.unconfirmed.insert(peer);
        }
    }

    /// True while a transfer of unknown outcome could still land somewhere: a peer
    /// keeps slots, or its failed WRITEs were not fenced yet.
    pub fn may_still_write(&self) -> bool {
        !self.kept.is_empty() || !self.unconfirmed.is_empty()
    }

    /// The peers to fence: with kept slots or unconfirmed WRITEs, not fenced yet.
    pub fn to_fence(&self) -> Vec<PeerId> {
        let mut p: Vec<PeerId> = self.kept.iter().map(|(p, _)| *p).collect();
        p.extend(self.unconfirmed.iter().copied());
        p.sort();
        p.dedup();
        p.retain(|p| !self.fenced.contains(p));
        p
    }

    /// Records the outcome of a fence of `peer` (a fence made for another reason
    /// too: a peer dropped after a failed batch); true when it proves the peer quiet
    /// (only a success does, or one that succeeded before).
    pub fn record_fence(&mut self, peer: PeerId, outcome: &Result<(), TransportError>) -> bool {
        match outcome {
            Ok(()) => {
                self.fenced.insert(peer);
                self.unconfirmed.remove(&peer);
                true
            }
            Err(_) => self.fenced.contains(&peer),
        }
    }

    /// After a round of fences (each recorded): the slots of every peer proven quiet,
    /// to drop once the core's lock is let go (they go back to their pool then,
    /// exactly once). Fences nothing refers to any more are forgotten (peer ids are
    /// never reused), except those of `fenced_now`.
    pub fn release(&mut self, fenced_now: &[PeerId]) -> Vec<Slot> {
        let (back, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.kept)
            .into_iter()
            .partition(|(p, _)| self.fenced.contains(p));
        self.kept = keep;
        let still: BTreeSet<PeerId> = self.kept.iter().map(|(p, _)| *p).collect();
        self.fenced
            .retain(|p| still.contains(p) || fenced_now.contains(p));
        back.into_iter().flat_map(|(_, s)| s).collect()
    }

    /// Gives up the slots whose peer could not be fenced without returning them to
    /// their pool (a DMA may still touch them): for a mover that goes away. Returns
    /// how many were left out of use.
    pub fn abandon(&mut self) -> usize {
        let kept = std::mem::take(&mut self.kept);
        let mut n = 0;
        for (_, slots) in kept {
            n += slots.len();
            for s in slots {
                std::mem::forget(s);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::staging::{SlotPool, StagingLayout, StagingSlots};

    fn staging(n: usize) -> StagingSlots {
        StagingSlots::new(StagingLayout {
            slot_size: 64,
            load_slots: n,
            store_slots: 0,
        })
        .unwrap()
    }

    fn kept(st: &StagingSlots, iso: &mut Isolation, peer: u64, n: usize) {
        let slots = st.try_acquire(SlotPool::Load, n);
        assert_eq!(slots.len(), n);
        iso.keep(PeerId(peer), slots);
    }

    /// One round of fences with these outcomes: the peers proven quiet and the slots
    /// that came back.
    fn round(iso: &mut Isolation, outcomes: &[(u64, Result<(), TransportError>)]) -> Vec<PeerId> {
        let mut proven = Vec::new();
        for (p, r) in outcomes {
            if iso.record_fence(PeerId(*p), r) {
                proven.push(PeerId(*p));
            }
        }
        drop(iso.release(&proven));
        proven
    }

    #[test]
    fn slots_come_back_only_after_a_fence_that_succeeded() {
        let st = staging(4);
        let mut iso = Isolation::default();
        kept(&st, &mut iso, 0, 2);
        assert_eq!(iso.to_fence(), vec![PeerId(0)]);
        // The fence fails (flushed completions did not drain): the slots stay kept.
        let failed = Err(TransportError::Setup("flush did not drain".into()));
        assert!(round(&mut iso, &[(0, failed)]).is_empty());
        assert_eq!(iso.kept_slots(), 2);
        assert!(iso.may_still_write());
        // The transport forgot the failed peer: "no such peer" is no proof of quiet.
        assert!(
            round(&mut iso, &[(0, Err(TransportError::NoPeer(PeerId(0))))]).is_empty(),
            "NoPeer is not a fence"
        );
        assert_eq!(iso.kept_slots(), 2);
        assert_eq!(st.free(SlotPool::Load), 2);
        // A fence that succeeds gives them back, exactly once.
        assert_eq!(round(&mut iso, &[(0, Ok(()))]), vec![PeerId(0)]);
        assert_eq!(iso.kept_slots(), 0);
        assert_eq!(st.free(SlotPool::Load), 4);
        assert!(!iso.may_still_write());
        assert!(iso.to_fence().is_empty());
    }

    #[test]
    fn only_the_kept_peers_slots_stay_out_and_each_peers_come_back_with_its_fence() {
        let st = staging(9);
        let mut iso = Isolation::default();
        kept(&st, &mut iso, 1, 3);
        kept(&st, &mut iso, 2, 4);
        assert_eq!(st.free(SlotPool::Load), 2);
        round(
            &mut iso,
            &[(1, Ok(())), (2, Err(TransportError::Setup("no".into())))],
        );
        assert_eq!(
            st.free(SlotPool::Load),
            5,
            "peer 1's slots back, peer 2's kept"
        );
        assert_eq!(iso.to_fence(), vec![PeerId(2)]);
    }

    #[test]
    fn a_fence_that_succeeded_elsewhere_counts_and_is_not_needed_again() {
        let st = staging(4);
        let mut iso = Isolation::default();
        kept(&st, &mut iso, 3, 2);
        // The peer was fenced when its batch failed (recorded), then forgotten.
        assert!(iso.record_fence(PeerId(3), &Ok(())));
        assert!(iso.to_fence().is_empty(), "no second fence");
        assert!(
            iso.record_fence(PeerId(3), &Err(TransportError::NoPeer(PeerId(3)))),
            "the recorded fence proves it"
        );
        drop(iso.release(&[]));
        assert_eq!(st.free(SlotPool::Load), 4);
    }

    #[test]
    fn pages_of_writes_lost_with_their_connection_wait_for_a_fence_that_succeeded() {
        let mut iso = Isolation::default();
        iso.unknown_writes(PeerId(5));
        assert!(
            iso.may_still_write(),
            "the target may still apply what it read"
        );
        assert_eq!(iso.to_fence(), vec![PeerId(5)]);
        round(&mut iso, &[(5, Err(TransportError::NoPeer(PeerId(5))))]);
        assert!(iso.may_still_write());
        round(&mut iso, &[(5, Ok(()))]);
        assert!(!iso.may_still_write());
        iso.unknown_writes(PeerId(5));
        assert!(
            !iso.may_still_write(),
            "a peer fenced once applies nothing more"
        );
    }

    #[test]
    fn slots_of_a_peer_that_cannot_be_fenced_never_go_back_to_their_pool() {
        let st = staging(3);
        let mut iso = Isolation::default();
        kept(&st, &mut iso, 7, 2);
        assert_eq!(iso.abandon(), 2);
        assert_eq!(
            st.free(SlotPool::Load),
            1,
            "a late DMA could still land in them"
        );
    }
}
