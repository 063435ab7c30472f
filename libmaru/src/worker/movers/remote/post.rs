//! One window of transfers: operations grouped into a batch per peer, posted (under
//! the mover's state lock), waited for (without it), and settled (under it again). A peer whose batch failed is dropped (and fenced: pages its WRITEs may
//! still reach wait for a fence that succeeded); a peer whose batch did not finish
//! keeps its slots in transfer isolation. What failed while a peer was dropped is
//! posted once more.

use super::{RemoteState, Shared};
use crate::transport::{Op, OpKind, PeerId, TransportError};
use crate::wire::meta::{LeaseGrant, PageGrant};
use crate::worker::movers::SlotOutcome;
use crate::worker::staging::Slot;
use crate::worker::transfer::{post, PeerBatch, PeerOutcome, Posted};

/// Posts once more the items (with their slots) of a window that failed while a peer
/// was dropped.
pub(super) type PostAgain<'a> = dyn FnMut(&mut RemoteState, Vec<usize>, Vec<Slot>) -> Planned + 'a;

/// One window of a transfer, planned under the state's lock (targets looked up, peers
/// connected) and not yet posted: `Shared::launch` posts it without the lock (on the
/// soft transport a post writes the WRITE payloads on the socket).
pub(super) struct Planned {
    items: Vec<usize>,
    out: Vec<SlotOutcome>,
    group: PeerGroups,
    reads: bool,
}

/// One window of a transfer, posted and not yet waited for.
pub(super) struct PendingWindow {
    /// The request's items it holds, in the order of `out`.
    pub(super) items: Vec<usize>,
    pub(super) out: Vec<SlotOutcome>,
    pub(super) group: PostedGroup,
    pub(super) reads: bool,
}

/// A posted transfer with, per peer, the items its operations came from.
pub(super) struct PostedGroup {
    pub(super) posted: Posted,
    pub(super) order: Vec<Vec<usize>>,
    pub(super) peers: Vec<PeerId>,
    /// WRITEs (their pages matter when the connection is lost), or READs.
    pub(super) writes: bool,
}

/// Operations grouped into one batch per peer, remembering which item each came from.
#[derive(Default)]
pub(super) struct PeerGroups {
    pub(super) batches: Vec<PeerBatch>,
    pub(super) order: Vec<Vec<usize>>,
}

impl PeerGroups {
    fn add(&mut self, peer: PeerId, op: Op, slot: Slot, item: usize) {
        let bi = match self.batches.iter().position(|b| b.peer == peer) {
            Some(bi) => bi,
            None => {
                self.batches.push(PeerBatch {
                    peer,
                    ops: Vec::new(),
                    slots: Vec::new(),
                });
                self.order.push(Vec::new());
                self.batches.len() - 1
            }
        };
        self.batches[bi].ops.push(op);
        self.batches[bi].slots.push(slot);
        self.order[bi].push(item);
    }
}

/// Takes the slots of the transfers that failed with a known outcome (their slot came
/// back), with their places in `out`, to try them again.
pub(super) fn take_failed(out: &mut [SlotOutcome]) -> (Vec<usize>, Vec<Slot>) {
    out.iter_mut()
        .enumerate()
        .filter(|(_, o)| !o.ok)
        .filter_map(|(i, o)| o.slot.take().map(|s| (i, s)))
        .unzip()
}

/// Puts the outcomes of a second try back in the places they were taken from.
pub(super) fn put_back(out: &mut [SlotOutcome], idx: &[usize], again: Vec<SlotOutcome>) {
    for (&i, o) in idx.iter().zip(again) {
        out[i] = o;
    }
}

impl RemoteState {
    /// Records each item's outcome of a group that was waited for in `out` (the slot
    /// back unless its peer's outcome is unknown). Returns whether any batch did not
    /// complete, and whether any failed with a known outcome (its peer is dropped: a
    /// try on a fresh connection may succeed).
    fn settle(
        &mut self,
        order: &[Vec<usize>],
        peers: Vec<PeerId>,
        writes: bool,
        outcomes: Vec<PeerOutcome>,
        out: &mut [SlotOutcome],
    ) -> (bool, bool) {
        let mut any_failed = false;
        let mut dropped = false;
        let mut any_kept = false;
        for ((items, o), peer) in order.iter().zip(outcomes).zip(peers) {
            let (ok, slots) = match o {
                PeerOutcome::Done(s) => (true, s),
                PeerOutcome::Failed(e, s) => {
                    log::debug!("transfer batch failed: {e}");
                    if writes && matches!(e, TransportError::PeerLost { .. }) {
                        // Locally it is over, but the target may still apply WRITEs
                        // it read: their pages wait for a fence that succeeds.
                        self.iso.unknown_writes(peer);
                    }
                    // Nothing of it is in flight here: drop the peer (fenced), so the
                    // next transfer connects again, and map our regions at its agent
                    // again before their next use. Another request may have dropped it
                    // already: this one still tries its failed items again.
                    self.drop_failed_peer(peer);
                    dropped = true;
                    (false, s)
                }
                PeerOutcome::Kept(_) => {
                    any_kept = true;
                    (false, Vec::new())
                }
            };
            any_failed |= !ok;
            for (&i, slot) in items.iter().zip(slots) {
                out[i] = SlotOutcome {
                    ok,
                    slot: Some(slot),
                };
            }
        }
        if any_kept {
            self.reclaim();
        }
        (any_failed, dropped)
    }

    /// Posts a WRITE of each of the request's `items` from the slot of the same index
    /// into its page; `page(item)` is the page and the bytes to write.
    pub(super) fn post_writes(
        &mut self,
        items: Vec<usize>,
        slots: Vec<Slot>,
        page: &dyn Fn(usize) -> (PageGrant, usize),
    ) -> Planned {
        self.remap_failed_agents();
        let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
        let mut group = PeerGroups::default();
        for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
            out.push(SlotOutcome {
                ok: false,
                slot: None,
            });
            let (page, len) = page(item);
            let usable = self.life.usable(page.region_id);
            let target = self.own.get(&page.region_id).filter(|_| usable).map(|r| {
                (
                    r.agent.clone(),
                    r.map.addr,
                    r.map.rkey,
                    r.map.transport.clone(),
                )
            });
            let Some((agent, addr, rkey, meta)) = target else {
                out[i].slot = Some(slot);
                continue;
            };
            let peer = match self.peer(&agent, &meta) {
                Ok(p) if len <= slot.len() => p,
                _ => {
                    out[i].slot = Some(slot);
                    continue;
                }
            };
            let op = Op {
                kind: OpKind::Write,
                local_offset: slot.offset() as u64,
                remote_addr: addr + page.offset,
                rkey,
                len: len as u64,
            };
            group.add(peer, op, slot, i);
        }
        Planned {
            items,
            out,
            group,
            reads: false,
        }
    }

    /// Posts a READ of each of the request's `items` (its lease in `leases`, the
    /// request's) into the slot of the same index.
    pub(super) fn post_reads(
        &mut self,
        items: Vec<usize>,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
    ) -> Planned {
        self.remap_failed_agents();
        let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
        let mut group = PeerGroups::default();
        for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
            let l = &leases[item];
            out.push(SlotOutcome {
                ok: false,
                slot: None,
            });
            let peer = match self.read_target(l) {
                Ok((agent, addr, rkey, meta)) if l.length as usize <= slot.len() => {
                    match self.peer(&agent, &meta) {
                        Ok(p) => Some((p, addr, rkey)),
                        Err(e) => {
                            self.read_error = Some(e.to_string());
                            None
                        }
                    }
                }
                Ok(_) => None,
                Err(e) => {
                    // Said once per request, not per chunk.
                    if self.read_error.is_none() {
                        log::warn!("load of {} bytes of region {}: {e}", l.length, l.region_id);
                    }
                    self.read_error = Some(e.to_string());
                    None
                }
            };
            let Some((peer, addr, rkey)) = peer else {
                out[i].slot = Some(slot);
                continue;
            };
            let op = Op {
                kind: OpKind::Read,
                local_offset: slot.offset() as u64,
                remote_addr: addr,
                rkey,
                len: l.length,
            };
            group.add(peer, op, slot, i);
        }
        Planned {
            items,
            out,
            group,
            reads: true,
        }
    }
}

impl Shared {
    /// Posts a planned window (without the state's lock).
    pub(super) fn launch(&self, p: Planned) -> PendingWindow {
        let peers = p.group.batches.iter().map(|b| b.peer).collect();
        PendingWindow {
            items: p.items,
            out: p.out,
            group: PostedGroup {
                posted: post(self.nic.as_ref(), p.group.batches, self.timeout),
                order: p.group.order,
                peers,
                writes: !p.reads,
            },
            reads: p.reads,
        }
    }

    /// Waits for a posted group without the state's lock, then settles it under the
    /// lock (see `RemoteState::settle`).
    fn wait(&self, group: PostedGroup, out: &mut [SlotOutcome]) -> (bool, bool) {
        let PostedGroup {
            posted,
            order,
            peers,
            writes,
        } = group;
        let outcomes = posted.finish(self.nic.as_ref(), &self.iso);
        self.lock().settle(&order, peers, writes, outcomes, out)
    }

    /// Waits for a posted window: its items and their outcomes. Transfers that failed
    /// while a peer was dropped (an agent restarted, say: their outcome is known,
    /// nothing of them is in flight) are posted once more through `again(items, slots)`
    /// and waited for; the next try connects again and maps the regions again.
    pub(super) fn finish_window(
        &self,
        pending: PendingWindow,
        again: &mut PostAgain<'_>,
    ) -> (Vec<usize>, Vec<SlotOutcome>) {
        let PendingWindow {
            items,
            mut out,
            group,
            reads,
        } = pending;
        let (mut failed, dropped) = self.wait(group, &mut out);
        if dropped && out.iter().any(|o| !o.ok) {
            let (idx, slots) = take_failed(&mut out);
            let which = idx.iter().map(|&k| items[k]).collect();
            let planned = again(&mut self.lock(), which, slots);
            let retry = self.launch(planned);
            let mut retried = retry.out;
            failed = self.wait(retry.group, &mut retried).0;
            put_back(&mut out, &idx, retried);
        }
        if failed && reads {
            // Read registrations may have gone with their region: map again next time.
            self.lock().forget_reads(None);
        }
        (items, out)
    }
}
