//! One window of transfers: the agents it needs made ready (connected, regions
//! mapped again, peers connected: without the state's lock, by the request's
//! deadline), operations grouped into a batch per peer and planned under the state's
//! lock, posted and waited for without it, and settled under it again. A peer whose
//! batch failed is dropped (and fenced, without the lock: pages its WRITEs may still
//! reach wait for a fence that succeeded); a peer whose batch did not finish keeps
//! its slots in transfer isolation. What failed while a peer was dropped is posted
//! once more.

use super::{RemoteState, Shared};
use crate::transport::{Op, OpKind, PeerId, TransportError};
use crate::wire::meta::{LeaseGrant, PageGrant};
use crate::worker::clock::Deadline;
use crate::worker::movers::SlotOutcome;
use crate::worker::staging::Slot;
use crate::worker::transfer::{post, PeerBatch, PeerOutcome, Posted};

/// Plans once more the items (with their slots) of a window that failed while a peer
/// was dropped (`Shared::plan_writes` or `plan_reads`).
pub(super) type PostAgain<'a> = dyn FnMut(&Shared, Vec<usize>, Vec<Slot>) -> Planned + 'a;

/// One window of a transfer, planned under the state's lock (targets and peers looked
/// up) and not yet posted: `Shared::launch` posts it without the lock (on the soft
/// transport a post writes the WRITE payloads on the socket).
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

/// What settling a window found.
struct Settled {
    /// A batch did not complete.
    failed: bool,
    /// A batch failed with a known outcome (its peer is dropped: a try on a fresh
    /// connection may succeed).
    dropped: bool,
    /// A batch's outcome is unknown (its slots are kept until its peer is fenced).
    kept: bool,
    /// Peers whose WRITEs failed with their connection: the target may still apply
    /// what it read (see `Isolation::unknown_writes`).
    unknown: Vec<PeerId>,
}

impl Planned {
    /// A window that posts nothing: every slot comes back, no item done.
    fn nothing(items: Vec<usize>, slots: Vec<Slot>, reads: bool) -> Planned {
        Planned {
            items,
            out: slots
                .into_iter()
                .map(|s| SlotOutcome {
                    ok: false,
                    slot: Some(s),
                })
                .collect(),
            group: PeerGroups::default(),
            reads,
        }
    }
}

impl RemoteState {
    /// Records each item's outcome of a group that was waited for in `out` (the slot
    /// back unless its peer's outcome is unknown).
    fn settle(
        &mut self,
        order: &[Vec<usize>],
        peers: Vec<PeerId>,
        writes: bool,
        outcomes: Vec<PeerOutcome>,
        out: &mut [SlotOutcome],
    ) -> Settled {
        let mut any_failed = false;
        let mut dropped = false;
        let mut any_kept = false;
        let mut unknown = Vec::new();
        for ((items, o), peer) in order.iter().zip(outcomes).zip(peers) {
            let (ok, slots) = match o {
                PeerOutcome::Done(s) => (true, s),
                PeerOutcome::Failed(e, s) => {
                    log::debug!("transfer batch failed: {e}");
                    if writes && matches!(e, TransportError::PeerLost { .. }) {
                        // Locally it is over, but the target may still apply WRITEs
                        // it read: their pages wait for a fence that succeeds.
                        unknown.push(peer);
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
        Settled {
            failed: any_failed,
            dropped,
            kept: any_kept,
            unknown,
        }
    }

    /// The agents of the own regions of `items`' pages (`page(item)`).
    fn agents_of_pages(
        &self,
        items: &[usize],
        page: &dyn Fn(usize) -> (PageGrant, usize),
    ) -> Vec<String> {
        items
            .iter()
            .filter_map(|&i| self.own.get(&page(i).0.region_id))
            .map(|r| r.agent.clone())
            .collect()
    }

    /// The agents `leases` are read from (own regions, or mapped for reading).
    fn agents_of_leases(&self, items: &[usize], leases: &[LeaseGrant]) -> Vec<String> {
        items
            .iter()
            .filter_map(|&i| {
                let l = &leases[i];
                match self.own.get(&l.region_id) {
                    Some(r) => Some(r.agent.clone()),
                    None => self
                        .reads
                        .get(&(l.region_id, l.offset, l.length))
                        .map(|t| t.0.clone()),
                }
            })
            .collect()
    }

    /// The peer of `agent`, if it is connected.
    fn peer_of(&self, agent: &str) -> Option<PeerId> {
        self.agents.get(agent).and_then(|c| c.peer)
    }

    /// Plans a WRITE of each of the request's `items` from the slot of the same index
    /// into its page; `page(item)` is the page and the bytes to write. An item whose
    /// region is not usable, or whose agent has no peer, gets its slot back.
    fn post_writes(
        &mut self,
        items: Vec<usize>,
        slots: Vec<Slot>,
        page: &dyn Fn(usize) -> (PageGrant, usize),
    ) -> Planned {
        let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
        let mut group = PeerGroups::default();
        for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
            out.push(SlotOutcome {
                ok: false,
                slot: None,
            });
            let (page, len) = page(item);
            let usable = self.life.usable(page.region_id);
            let target = self
                .own
                .get(&page.region_id)
                .filter(|_| usable)
                .map(|r| (r.agent.clone(), r.map.addr, r.map.rkey));
            let Some((agent, addr, rkey)) = target else {
                out[i].slot = Some(slot);
                continue;
            };
            let peer = match self.peer_of(&agent) {
                Some(p) if len <= slot.len() => p,
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

    /// Plans a READ of each of the request's `items` (its lease in `leases`, the
    /// request's) into the slot of the same index.
    fn post_reads(
        &mut self,
        items: Vec<usize>,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
    ) -> Planned {
        let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
        let mut group = PeerGroups::default();
        for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
            let l = &leases[item];
            out.push(SlotOutcome {
                ok: false,
                slot: None,
            });
            let peer = match self.read_target(l) {
                Ok((agent, addr, rkey, _)) if l.length as usize <= slot.len() => {
                    match self.peer_of(&agent) {
                        Some(p) => Some((p, addr, rkey)),
                        None => {
                            self.read_error = Some(format!(
                                "agent {agent}: no data connection (it did not answer in time)"
                            ));
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
    /// Makes the agents of `agents` that a window cannot use yet ready (without the
    /// state's lock, by `by`); one that is not stays unready and the window's items
    /// there fail.
    fn prepare(&self, agents: Vec<String>, by: Deadline) {
        let unready = self.lock().unready(agents);
        for agent in unready {
            if let Err(e) = self.ready(&agent, by) {
                log::debug!("agent {agent} not ready for a transfer: {e}");
            }
        }
    }

    /// Plans WRITEs of `items` from `slots` (see `RemoteState::post_writes`), their
    /// agents made ready first; nothing once `by` passed (a batch posted then would
    /// keep its slots until a fence).
    pub(super) fn plan_writes(
        &self,
        items: Vec<usize>,
        slots: Vec<Slot>,
        page: &dyn Fn(usize) -> (PageGrant, usize),
        by: Deadline,
    ) -> Planned {
        if by.passed() {
            return Planned::nothing(items, slots, false);
        }
        let agents = self.lock().agents_of_pages(&items, page);
        self.prepare(agents, by);
        self.lock().post_writes(items, slots, page)
    }

    /// Plans READs of `items` into `slots` (see `RemoteState::post_reads`): the ranges
    /// not mapped for reading are mapped and the agents made ready first.
    pub(super) fn plan_reads(
        &self,
        items: Vec<usize>,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
        by: Deadline,
    ) -> Planned {
        if by.passed() {
            return Planned::nothing(items, slots, true);
        }
        let window: Vec<LeaseGrant> = items.iter().map(|&i| leases[i].clone()).collect();
        self.map_reads(&window, by);
        let agents = self.lock().agents_of_leases(&items, leases);
        self.prepare(agents, by);
        self.lock().post_reads(items, leases, slots)
    }

    /// Posts a planned window (without the state's lock); it must complete by `by`.
    pub(super) fn launch(&self, p: Planned, by: Deadline) -> PendingWindow {
        let peers = p.group.batches.iter().map(|b| b.peer).collect();
        PendingWindow {
            items: p.items,
            out: p.out,
            group: PostedGroup {
                posted: post(self.nic.as_ref(), p.group.batches, by),
                order: p.group.order,
                peers,
                writes: !p.reads,
            },
            reads: p.reads,
        }
    }

    /// Waits for a posted group without the state's lock, settles it under the lock
    /// (see `RemoteState::settle`), then fences what that queued and, when a batch
    /// kept its slots, the peers that keep slots (without the lock, until `by`).
    fn wait(&self, group: PostedGroup, out: &mut [SlotOutcome], by: Deadline) -> Settled {
        let PostedGroup {
            posted,
            order,
            peers,
            writes,
        } = group;
        let outcomes = posted.finish(self.nic.as_ref(), &self.iso);
        let settled = self.lock().settle(&order, peers, writes, outcomes, out);
        for &p in &settled.unknown {
            self.iso.unknown_writes(p);
        }
        self.fence_queued(by);
        if settled.kept {
            self.reclaim(by);
        }
        settled
    }

    /// Waits for a posted window: its items and their outcomes. Transfers that failed
    /// while a peer was dropped (an agent restarted, say: their outcome is known,
    /// nothing of them is in flight) are posted once more through `again(items, slots)`
    /// and waited for; the next try connects again and maps the regions again.
    pub(super) fn finish_window(
        &self,
        pending: PendingWindow,
        again: &mut PostAgain<'_>,
        by: Deadline,
    ) -> (Vec<usize>, Vec<SlotOutcome>) {
        let PendingWindow {
            items,
            mut out,
            group,
            reads,
        } = pending;
        let settled = self.wait(group, &mut out, by);
        let mut failed = settled.failed;
        if settled.dropped && out.iter().any(|o| !o.ok) {
            let (idx, slots) = take_failed(&mut out);
            let which = idx.iter().map(|&k| items[k]).collect();
            let planned = again(self, which, slots);
            let retry = self.launch(planned, by);
            let mut retried = retry.out;
            failed = self.wait(retry.group, &mut retried, by).failed;
            put_back(&mut out, &idx, retried);
        }
        if failed && reads {
            // Read registrations may have gone with their region: map again next time.
            self.lock().forget_reads(None);
        }
        (items, out)
    }
}
