//! The remote mover's stores and loads, in windows of [`WINDOW_BYTES`] (at least one
//! chunk; see `docs/worker.md`, "Windows"): two in flight, the second only within the
//! data path's [`InFlightBudget`]. [`run`] is the schedule alone; what a window holds
//! is the [`Windowed`] caller's: a copying store (`StoreWindows`), a copying load
//! (`LoadWindows`), the slot API's own slots (`GivenWindows`). Each window is planned
//! (`RemoteState`'s rules: from the targets a store took with its pages, no lock; or
//! under the lock once its agents were made ready without it), posted and waited for
//! without the lock, and settled under it only when a batch did not complete; what
//! failed while a peer was dropped is posted once more.

use super::isolation::{PeerBatch, PeerOutcome};
use super::state::{PeerGroups, Planned, Settled};
use super::{InFlight, InFlightBudget, RemoteMover, RemoteState, WriteTargets, WriteTo};
use crate::transport::{BatchId, BatchState, Op, OpKind, PeerId, Transport, TransportError};
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::WorkerError;
use crate::worker::movers::{Mover, ReadSink, SlotOutcome, SlotWrite, WriteItem};
use crate::worker::op_stats::{contacted, Contact};
use crate::worker::pool::core::CoreCell;
use crate::worker::staging::{Slot, SlotPool};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A window's bytes (at least one chunk).
pub const WINDOW_BYTES: u64 = 2 << 20;
/// Windows of one request in flight at most.
const DEPTH: usize = 2;

/// A request whose items go in windows.
pub trait Windowed {
    /// A posted window, until it is finished.
    type Posted;
    /// How many items the request has.
    fn items(&self) -> usize;
    /// The bytes item `i` moves.
    fn bytes(&self, i: usize) -> u64;
    /// Slots for the `want` items from `start` (fewer cut the window; none: nothing
    /// more until a window finishes, or at all for the `first`).
    fn slots(&mut self, start: usize, want: usize, first: bool) -> Vec<Slot>;
    /// Posts the items from `start`, one for each slot, without waiting.
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> Self::Posted;
    /// Waits for a posted window: its items and, in order, their outcomes.
    fn finish(&mut self, posted: Self::Posted) -> (Vec<usize>, Vec<SlotOutcome>);
    /// A finished window, in the order posted; false: post nothing more.
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool;
}

/// Runs a request's windows; returns how many items were posted (the rest got no slot).
pub fn run<W: Windowed>(w: &mut W, budget: &InFlightBudget) -> usize {
    let n = w.items();
    let mut inflight: VecDeque<(W::Posted, InFlight<'_>)> = VecDeque::new();
    let mut next = 0;
    let mut stop = false;
    loop {
        while !stop && inflight.len() < DEPTH && next < n {
            let want = ((WINDOW_BYTES / w.bytes(next).max(1)).max(1) as usize).min(n - next);
            let first = inflight.is_empty();
            let bytes = (next..next + want).map(|i| w.bytes(i)).sum();
            let Some(share) = budget.take(bytes, first) else {
                break;
            };
            let mut slots = w.slots(next, want, first);
            if slots.is_empty() {
                stop |= first;
                break;
            }
            slots.truncate(want);
            let len = slots.len();
            inflight.push_back((w.post(next, slots), share));
            next += len;
        }
        let Some((posted, share)) = inflight.pop_front() else {
            return next;
        };
        let (items, outcomes) = w.finish(posted);
        drop(share);
        if !stop {
            stop = !w.done(&items, outcomes);
        }
    }
}

/// How long a request's first window waits for a slot (a store's only while other
/// stores' windows hold slots on the wire).
const FIRST_SLOT_WAIT: Duration = Duration::from_secs(1);

/// A retry's targets: none (its peer was dropped), so it is planned under the lock,
/// its agent made ready again first.
const NO_TARGETS: &WriteTargets = &WriteTargets::new();

/// A copying store's windows: the caller's chunks are copied into store slots.
pub(super) struct StoreWindows<'a, 'd> {
    pub(super) m: &'a RemoteMover,
    pub(super) items: &'a [WriteItem<'d>],
    /// Where the items' regions' WRITEs go, as the store took its pages.
    pub(super) to: &'a WriteTargets,
    pub(super) ok: Vec<bool>,
    /// The request's deadline.
    pub(super) by: Deadline,
}

impl Windowed for StoreWindows<'_, '_> {
    type Posted = PendingWindow;
    fn items(&self) -> usize {
        self.items.len()
    }
    fn bytes(&self, i: usize) -> u64 {
        self.items[i].data.len() as u64
    }
    fn slots(&mut self, _start: usize, want: usize, first: bool) -> Vec<Slot> {
        let got = self.m.staging.try_acquire(SlotPool::Store, want);
        if !got.is_empty() || !first || self.m.store_slots_on_wire.load(Ordering::Relaxed) == 0 {
            return got;
        }
        self.m
            .staging
            .acquire(SlotPool::Store, want, FIRST_SLOT_WAIT.min(self.by.left()))
    }
    fn post(&mut self, start: usize, mut slots: Vec<Slot>) -> PendingWindow {
        for (it, slot) in self.items[start..].iter().zip(&mut slots) {
            // A chunk larger than its slot is not copied (`plan_writes_to` gives the
            // slot back, the chunk not stored).
            if let Some(to) = slot.bytes_mut().get_mut(..it.data.len()) {
                to.copy_from_slice(it.data);
            }
        }
        let items = self.items;
        let index = (start..start + slots.len()).collect();
        self.m
            .store_slots_on_wire
            .fetch_add(slots.len(), Ordering::Relaxed);
        let (to, by) = (self.to, self.by);
        let page = |i: usize| (items[i].page, items[i].data.len());
        let planned = self.m.plan_writes(index, slots, &page, to, by);
        self.m.launch(planned, by)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let items = self.items;
        let n = posted.items.len();
        let by = self.by;
        let page = |i: usize| (items[i].page, items[i].data.len());
        let r = self.m.finish_window(
            posted,
            &mut |m, which, slots| m.plan_writes(which, slots, &page, NO_TARGETS, by),
            by,
        );
        self.m.store_slots_on_wire.fetch_sub(n, Ordering::Relaxed);
        r
    }
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool {
        for (&i, o) in items.iter().zip(outcomes) {
            self.ok[i] = o.ok;
        }
        true
    }
}

/// A copying load's windows: each window's slots go to the sink, then to a later
/// window.
pub(super) struct LoadWindows<'a, 's> {
    pub(super) m: &'a RemoteMover,
    pub(super) leases: &'a [LeaseGrant],
    pub(super) sink: &'a mut ReadSink<'s>,
    /// The request's deadline.
    pub(super) by: Deadline,
}

impl Windowed for LoadWindows<'_, '_> {
    type Posted = PendingWindow;
    fn items(&self) -> usize {
        self.leases.len()
    }
    fn bytes(&self, i: usize) -> u64 {
        self.leases[i].length
    }
    fn slots(&mut self, start: usize, want: usize, first: bool) -> Vec<Slot> {
        if !first {
            // What is free now; else the window ahead gives its slots back.
            return self.m.staging.try_acquire(SlotPool::Load, want);
        }
        let wait = FIRST_SLOT_WAIT.min(self.by.left());
        let slots = self.m.staging.acquire(SlotPool::Load, want, wait);
        if slots.is_empty() {
            log::warn!(
                "no load slot free within {} ms: {} chunk(s) not loaded",
                wait.as_millis(),
                self.leases.len() - start
            );
        }
        slots
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> PendingWindow {
        let items = (start..start + slots.len()).collect();
        let planned = self.m.plan_reads(items, self.leases, slots, self.by);
        self.m.launch(planned, self.by)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let (leases, by) = (self.leases, self.by);
        self.m.finish_window(
            posted,
            &mut |m, which, slots| m.plan_reads(which, leases, slots, by),
            by,
        )
    }
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool {
        let mut all = true;
        for (&i, o) in items.iter().zip(&outcomes) {
            match (&o.slot, o.ok) {
                (Some(s), true) => {
                    let n = self.leases[i].length as usize;
                    (self.sink)(i, &s.bytes()[..n]);
                }
                // A failed window fails the request from that window on.
                _ => all = false,
            }
        }
        all
    }
}

/// What a transfer from or into the caller's slots moves.
pub(super) enum Given<'a> {
    /// WRITEs: each slot's page and length, and where their regions' WRITEs go.
    Write(&'a [(PageGrant, usize)], &'a WriteTargets),
    /// READs: each slot's lease.
    Read(&'a [LeaseGrant]),
}

/// Windows of a transfer between the caller's slots and pages: every item is tried,
/// and each slot comes back in its outcome.
pub(super) struct GivenWindows<'a> {
    pub(super) m: &'a RemoteMover,
    pub(super) given: Vec<Option<Slot>>,
    pub(super) out: Vec<SlotOutcome>,
    pub(super) kind: Given<'a>,
    /// The request's deadline.
    pub(super) by: Deadline,
}

/// Runs the windows of `kind` through the caller's slots (`given`): one outcome per
/// slot, the items' in order, then the slots no item used.
fn run_given(
    m: &RemoteMover,
    given: Vec<Option<Slot>>,
    kind: Given<'_>,
    by: Deadline,
) -> Vec<SlotOutcome> {
    let out = Vec::with_capacity(given.len());
    let mut w = GivenWindows {
        m,
        given,
        out,
        kind,
        by,
    };
    run(&mut w, &m.budget);
    let used = w.out.len();
    let rest = w.given.into_iter().skip(used);
    w.out
        .extend(rest.map(|slot| SlotOutcome { ok: false, slot }));
    w.out
}

impl Given<'_> {
    /// Plans the request's `items` from or into the caller's slots.
    fn plan(&self, m: &RemoteMover, items: Vec<usize>, slots: Vec<Slot>, by: Deadline) -> Planned {
        match self {
            Given::Write(pages, to) => m.plan_writes(items, slots, &|i| pages[i], to, by),
            Given::Read(leases) => m.plan_reads(items, leases, slots, by),
        }
    }
}

impl Windowed for GivenWindows<'_> {
    type Posted = PendingWindow;
    fn items(&self) -> usize {
        match self.kind {
            Given::Write(p, _) => p.len(),
            Given::Read(l) => l.len(),
        }
    }
    fn bytes(&self, i: usize) -> u64 {
        match self.kind {
            Given::Write(p, _) => p[i].1 as u64,
            Given::Read(l) => l[i].length,
        }
    }
    fn slots(&mut self, start: usize, want: usize, _first: bool) -> Vec<Slot> {
        self.given[start..start + want]
            .iter_mut()
            .filter_map(Option::take)
            .collect()
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> PendingWindow {
        let items = (start..start + slots.len()).collect();
        let planned = self.kind.plan(self.m, items, slots, self.by);
        self.m.launch(planned, self.by)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let (kind, by) = (&self.kind, self.by);
        self.m.finish_window(
            posted,
            &mut |m, which, slots| match kind {
                Given::Write(pages, _) => Given::Write(pages, NO_TARGETS).plan(m, which, slots, by),
                Given::Read(_) => kind.plan(m, which, slots, by),
            },
            by,
        )
    }
    fn done(&mut self, items: &[usize], outcomes: Vec<SlotOutcome>) -> bool {
        debug_assert_eq!(
            items.first().copied().unwrap_or(self.out.len()),
            self.out.len()
        );
        self.out.extend(outcomes);
        true
    }
}

/// What a remote store or load does (its windows), and the rest of what a pool asks
/// of its mover (`agents`).
impl Mover for RemoteMover {
    fn core(&self) -> Option<Arc<CoreCell>> {
        Some(self.core.clone())
    }
    fn adopt(&self, grant: &RegionGrant, by: Deadline) -> Result<(), WorkerError> {
        RemoteMover::adopt(self, grant, by)
    }
    fn tick(&self, now_ms: u64, by: Deadline) -> Vec<u64> {
        RemoteMover::tick(self, now_ms, by)
    }
    fn probe_away(&self, now_ms: u64, by: Deadline) {
        RemoteMover::probe_away(self, now_ms, by)
    }
    fn check_agents(&self, now_ms: u64) {
        RemoteMover::check_agents(self, now_ms)
    }
    fn greet(&self, agents: &[String], by: Deadline) -> Result<(), WorkerError> {
        RemoteMover::greet(self, agents, by)
    }
    fn release_all(&self) -> (usize, usize) {
        RemoteMover::release_all(self)
    }

    /// Copies each window into store slots while the one ahead is on the wire; what
    /// got no slot is skipped (counted under `no_slot`).
    fn write(&self, items: &[WriteItem<'_>], to: &WriteTargets, by: Deadline) -> Vec<bool> {
        let mut w = StoreWindows {
            m: self,
            items,
            to,
            ok: vec![false; items.len()],
            by,
        };
        let posted = run(&mut w, &self.budget);
        let ok = w.ok;
        if posted < items.len() {
            let line = self.core.lock().skipped(
                crate::worker::skips::SkipReason::NoSlot,
                (items.len() - posted) as u64,
                now_ms(),
                "remote_cxl store staging",
            );
            if let Some(line) = line {
                log::warn!("{line}");
            }
        }
        ok
    }

    /// From the caller's slots, window by window (see `windows`).
    fn write_slots(
        &self,
        items: Vec<SlotWrite>,
        to: &WriteTargets,
        by: Deadline,
    ) -> Vec<SlotOutcome> {
        let pages: Vec<(PageGrant, usize)> = items.iter().map(|it| (it.page, it.len)).collect();
        let given: Vec<Option<Slot>> = items.into_iter().map(|it| Some(it.slot)).collect();
        run_given(self, given, Given::Write(&pages, to), by)
    }

    /// Each window's slots go to `sink`, then to a later window; nothing more after a
    /// window that failed.
    fn read(&self, leases: &[LeaseGrant], sink: &mut ReadSink<'_>, by: Deadline) {
        run(
            &mut LoadWindows {
                m: self,
                leases,
                sink,
                by,
            },
            &self.budget,
        );
    }

    /// Into the caller's slots, window by window; every lease is tried.
    fn read_into(&self, leases: &[LeaseGrant], slots: Vec<Slot>, by: Deadline) -> Vec<SlotOutcome> {
        let n = leases.len().min(slots.len());
        let given: Vec<Option<Slot>> = slots.into_iter().map(Some).collect();
        run_given(self, given, Given::Read(&leases[..n]), by)
    }
}

/// Plans a WRITE of each of `items` from the slot of the same index into its page
/// (`page(item)`: page and length), where `to` says its region's WRITEs go; one with
/// no target, or longer than its slot, gets its slot back.
pub(super) fn plan_writes_to(
    items: Vec<usize>,
    slots: Vec<Slot>,
    page: &dyn Fn(usize) -> (PageGrant, usize),
    to: &dyn Fn(u64) -> Option<WriteTo>,
) -> Planned {
    let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
    let mut group = PeerGroups::default();
    for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
        out.push(SlotOutcome {
            ok: false,
            slot: None,
        });
        let (page, len) = page(item);
        match to(page.region_id) {
            Some(t) if len <= slot.len() => {
                let op = Op {
                    kind: OpKind::Write,
                    local_offset: slot.offset() as u64,
                    remote_addr: t.addr + page.offset,
                    rkey: t.rkey,
                    len: len as u64,
                };
                group.add(t.peer, op, slot, i);
            }
            _ => out[i].slot = Some(slot),
        }
    }
    Planned {
        items,
        out,
        group,
        reads: false,
    }
}

/// A transfer whose batches are on their way ([`Posted::finish`] waits for them).
#[must_use = "a posted transfer owns its slots until it is finished"]
pub(super) struct Posted {
    parts: Vec<PostedPart>,
    deadline: Deadline,
}

/// One peer's batch as posted, or why it could not be, with its slots.
type PostedPart = Result<(PeerBatch, BatchId), (TransportError, Vec<Slot>)>;

/// Posts every peer's batch; each must complete by `deadline`.
pub(super) fn post(t: &dyn Transport, batches: Vec<PeerBatch>, deadline: Deadline) -> Posted {
    let parts = batches
        .into_iter()
        .map(|b| {
            contacted(Contact::Agent);
            match t.post_within(b.peer, &b.ops, deadline.left()) {
                Ok(id) => Ok((b, id)),
                // Nothing was sent for this peer: its slots come back with the outcome.
                Err(e) => Err((e, b.slots)),
            }
        })
        .collect();
    Posted { parts, deadline }
}

impl Posted {
    /// Waits for every peer's batch until the deadline; one still pending then is `Kept`.
    pub(super) fn finish(mut self, t: &dyn Transport) -> Vec<PeerOutcome> {
        let deadline = self.deadline;
        std::mem::take(&mut self.parts)
            .into_iter()
            .map(|p| match p {
                Err((e, slots)) => PeerOutcome::Failed(e, slots),
                Ok((b, id)) => match t.wait(id, deadline.left()) {
                    BatchState::Done => {
                        t.forget(id);
                        PeerOutcome::Done(b.slots)
                    }
                    BatchState::Failed(e) => {
                        t.forget(id);
                        PeerOutcome::Failed(e, b.slots)
                    }
                    BatchState::Pending => PeerOutcome::Kept(b.peer, b.slots),
                },
            })
            .collect()
    }
}

impl Drop for Posted {
    /// A transfer dropped unfinished (a bug, a panic): its slots never go back.
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

/// Plans once more the items (with their slots) of a window that failed while a peer
/// was dropped (`RemoteMover::plan_writes` or `plan_reads`).
pub(super) type PostAgain<'a> = dyn FnMut(&RemoteMover, Vec<usize>, Vec<Slot>) -> Planned + 'a;

/// One window of a transfer, posted and not yet waited for.
pub(super) struct PendingWindow {
    /// The request's items it holds, in the order of `out`.
    pub(super) items: Vec<usize>,
    out: Vec<SlotOutcome>,
    posted: Posted,
    /// Per peer of `posted`: the peer, and the places in `out` its operations came from.
    peers: Vec<PeerId>,
    order: Vec<Vec<usize>>,
    reads: bool,
}

impl RemoteMover {
    /// The state, locked, once the ranges of `reads` in other engines' regions are
    /// mapped for reading and the agents `agents` names are ready (what is not is
    /// done without the lock, by `by`: what fails stays undone and the window's items
    /// there fail); `None` once `by` passed (a batch posted then would keep its slots
    /// until a fence). All mapped and ready (the usual case): one lock.
    fn ready_for(
        &self,
        by: Deadline,
        reads: &[LeaseGrant],
        agents: impl FnOnce(&RemoteState) -> Vec<String>,
    ) -> Option<super::StateGuard<'_>> {
        if by.passed() {
            return None;
        }
        let mut st = self.lock();
        let to_map = st.reads_to_map(reads);
        let agents = agents(&st);
        let unready = st.unready(agents);
        if to_map.is_empty() && unready.is_empty() {
            return Some(st);
        }
        drop(st);
        self.map_reads(to_map, by);
        for agent in unready {
            if let Err(e) = self.ready(&agent, by) {
                log::debug!("agent {agent} not ready for a transfer: {e}");
            }
        }
        Some(self.lock())
    }

    /// Plans WRITEs of `items` from `slots` (see `plan_writes_to`), their
    /// agents made ready first (`ready_for`).
    /// Without the lock when the store took every item's region's target with its
    /// pages (`to`, `PoolCore::store_begin`: the usual case).
    pub(super) fn plan_writes(
        &self,
        items: Vec<usize>,
        slots: Vec<Slot>,
        page: &dyn Fn(usize) -> (PageGrant, usize),
        to: &WriteTargets,
        by: Deadline,
    ) -> Planned {
        if !by.passed() && items.iter().all(|&i| to.contains_key(&page(i).0.region_id)) {
            return plan_writes_to(items, slots, page, &|r| to.get(&r).copied());
        }
        match self.ready_for(by, &[], |st| st.agents_of_pages(&items, page)) {
            Some(st) => plan_writes_to(items, slots, page, &|r| st.write_to(r)),
            None => Planned::nothing(items, slots, false),
        }
    }

    /// Plans READs of `items` into `slots` (see `RemoteState::post_reads`), their
    /// ranges mapped for reading and their agents made ready first (`ready_for`).
    pub(super) fn plan_reads(
        &self,
        items: Vec<usize>,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
        by: Deadline,
    ) -> Planned {
        // The first window maps every range of the request not mapped yet, so no
        // `map_reads` goes while its READs are out; a later one checks its own.
        let window: Vec<LeaseGrant> = match items.first() {
            Some(0) => leases.to_vec(),
            _ => items.iter().map(|&i| leases[i].clone()).collect(),
        };
        match self.ready_for(by, &window, |st| st.agents_of_leases(&items, leases)) {
            Some(mut st) => st.post_reads(items, leases, slots),
            None => Planned::nothing(items, slots, true),
        }
    }

    /// Posts a planned window (without the state's lock); it must complete by `by`.
    pub(super) fn launch(&self, p: Planned, by: Deadline) -> PendingWindow {
        PendingWindow {
            items: p.items,
            out: p.out,
            peers: p.group.batches.iter().map(|b| b.peer).collect(),
            posted: post(self.nic.as_ref(), p.group.batches, by),
            order: p.group.order,
            reads: p.reads,
        }
    }

    /// Waits for a posted window without the state's lock, settles it under one lock,
    /// then fences (without it, by `by`) what that queued and the peers keeping slots.
    fn wait(&self, w: PendingWindow, by: Deadline) -> (Vec<usize>, Vec<SlotOutcome>, Settled) {
        let PendingWindow {
            items,
            mut out,
            posted,
            peers,
            order,
            reads,
        } = w;
        let outcomes = posted.finish(self.nic.as_ref());
        if outcomes.iter().all(|o| matches!(o, PeerOutcome::Done(_))) {
            // Every batch done (the usual case): nothing for the state to record, no
            // lock; what others queued for a fence the tick fences.
            for (places, o) in order.iter().zip(outcomes) {
                if let PeerOutcome::Done(slots) = o {
                    for (&i, slot) in places.iter().zip(slots) {
                        out[i] = SlotOutcome {
                            ok: true,
                            slot: Some(slot),
                        };
                    }
                }
            }
            return (items, out, Settled::default());
        }
        let (settled, queued) = {
            let mut st = self.lock();
            let settled = st.settle(&order, peers, !reads, outcomes, &mut out);
            (settled, std::mem::take(&mut st.to_fence))
        };
        self.fence_round(queued, by);
        if settled.kept {
            self.reclaim(by);
        }
        (items, out, settled)
    }

    /// Waits for a posted window: its items and their outcomes. Transfers that failed
    /// while a peer was dropped (outcome known) are posted once more through `again`.
    pub(super) fn finish_window(
        &self,
        pending: PendingWindow,
        again: &mut PostAgain<'_>,
        by: Deadline,
    ) -> (Vec<usize>, Vec<SlotOutcome>) {
        let reads = pending.reads;
        let (items, mut out, settled) = self.wait(pending, by);
        let mut failed = settled.failed;
        if settled.dropped && out.iter().any(|o| !o.ok) {
            // The slots of what failed with a known outcome, with their places in `out`.
            let (places, slots): (Vec<usize>, Vec<Slot>) = out
                .iter_mut()
                .enumerate()
                .filter(|(_, o)| !o.ok)
                .filter_map(|(i, o)| o.slot.take().map(|s| (i, s)))
                .unzip();
            let which = places.iter().map(|&k| items[k]).collect();
            let (_, retried, s) = self.wait(self.launch(again(self, which, slots), by), by);
            failed = s.failed;
            for (&i, o) in places.iter().zip(retried) {
                out[i] = o;
            }
        }
        if failed && reads {
            // Read registrations may have gone with their region: map again next time.
            self.lock().forget_reads(None);
        }
        (items, out)
    }
}

#[cfg(test)]
#[path = "windows_tests.rs"]
mod tests;
