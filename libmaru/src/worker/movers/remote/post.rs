//! One window of transfers: operations grouped into a batch per peer, posted, and
//! settled. A peer whose batch failed is dropped (and fenced: pages its WRITEs may
//! still reach wait for a fence that succeeded); a peer whose batch did not finish
//! keeps its slots in transfer isolation. What failed while a peer was dropped is
//! posted once more.

use super::RemoteMover;
use crate::transport::{Op, OpKind, PeerId, TransportError};
use crate::wire::meta::{LeaseGrant, PageGrant};
use crate::worker::movers::Mover;
use crate::worker::movers::SlotOutcome;
use crate::worker::staging::Slot;
use crate::worker::transfer::{post, PeerBatch, PeerOutcome, Posted};

/// Posts once more the items (with their slots) of a window that failed while a peer
/// was dropped.
pub(super) type PostAgain<'a> =
    dyn FnMut(&mut RemoteMover, Vec<usize>, Vec<Slot>) -> PendingWindow + 'a;

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

impl RemoteMover {
    pub(super) fn post_group(&self, group: PeerGroups, writes: bool) -> PostedGroup {
        let peers = group.batches.iter().map(|b| b.peer).collect();
        PostedGroup {
            posted: post(self.nic.as_ref(), group.batches, self.timeout),
            order: group.order,
            peers,
            writes,
        }
    }

    /// Waits for a posted group and records each item's outcome in `out` (the slot
    /// back unless its peer's outcome is unknown). True when any batch did not complete.
    pub(super) fn settle_posted(&mut self, pending: PostedGroup, out: &mut [SlotOutcome]) -> bool {
        let outcomes = pending.posted.finish(self.nic.as_ref(), &self.iso);
        let writes = pending.writes;
        let mut any_failed = false;
        let mut any_kept = false;
        for ((items, o), peer) in pending.order.iter().zip(outcomes).zip(pending.peers) {
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
                    // again before their next use.
                    self.drop_failed_peer(peer);
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
        any_failed
    }

    /// Posts a WRITE of each of the request's `items` from the slot of the same index
    /// into its page; `page(item)` is the page and the bytes to write.
    pub(super) fn post_writes(
        &mut self,
        items: Vec<usize>,
        slots: Vec<Slot>,
        page: &dyn Fn(usize) -> (PageGrant, usize),
    ) -> PendingWindow {
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
        PendingWindow {
            items,
            out,
            group: self.post_group(group, true),
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
    ) -> PendingWindow {
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
        PendingWindow {
            items,
            out,
            group: self.post_group(group, false),
            reads: true,
        }
    }

    /// Waits for a posted window: its items and their outcomes. Transfers that failed
    /// while a peer was dropped (an agent restarted, say: their outcome is known,
    /// nothing of them is in flight) are posted once more through `again(items, slots)`
    /// and waited for; the next try connects again and maps the regions again.
    pub(super) fn finish_window(
        &mut self,
        pending: PendingWindow,
        again: &mut PostAgain<'_>,
    ) -> (Vec<usize>, Vec<SlotOutcome>) {
        let PendingWindow {
            items,
            mut out,
            group,
            reads,
        } = pending;
        let mut failed = self.settle_posted(group, &mut out);
        if self.peer_dropped && out.iter().any(|o| !o.ok) {
            let (idx, slots) = take_failed(&mut out);
            let which = idx.iter().map(|&k| items[k]).collect();
            let retry = again(self, which, slots);
            let mut retried = retry.out;
            failed = self.settle_posted(retry.group, &mut retried);
            put_back(&mut out, &idx, retried);
        }
        if failed && reads {
            // Read registrations may have gone with their region: map again next time.
            self.reads.clear();
        }
        (items, out)
    }
}
