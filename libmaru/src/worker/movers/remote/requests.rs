//! What a remote store or load posts, window by window (see `windows`): a
//! copying store fills store slots from the caller's chunks, a copying load hands
//! each window's slots to the caller's sink, and the slot API moves the caller's own
//! slots.

use super::post::{PendingWindow, Planned};
use super::windows::Windowed;
use super::RemoteMover;
use crate::wire::meta::{LeaseGrant, PageGrant};
use crate::worker::clock::Deadline;
use crate::worker::movers::{ReadSink, SlotOutcome, WriteItem};
use crate::worker::staging::{Slot, SlotPool};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long a store's first window waits for a store slot that other requests'
/// windows hold on the wire (see `StoreWindows::slots`).
const STORE_SLOT_WAIT: Duration = Duration::from_secs(1);

/// How long a load's first window waits for a load slot.
const LOAD_SLOT_WAIT: Duration = Duration::from_secs(1);

/// A copying store's windows: the caller's chunks are copied into store slots.
pub(super) struct StoreWindows<'a, 'd> {
    pub(super) m: &'a RemoteMover,
    pub(super) items: &'a [WriteItem<'d>],
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
    /// A request's first window waits (at most `STORE_SLOT_WAIT`) for a store slot
    /// only while other requests' store windows hold slots on the wire: theirs come
    /// back within a transfer. With none on the wire, slots are held by callers (the
    /// slot API) for as long as they like, and the store skips at once.
    fn slots(&mut self, _start: usize, want: usize, first: bool) -> Vec<Slot> {
        let got = self.m.staging.try_acquire(SlotPool::Store, want);
        if !got.is_empty() || !first || self.m.store_slots_on_wire.load(Ordering::Relaxed) == 0 {
            return got;
        }
        self.m
            .staging
            .acquire(SlotPool::Store, want, STORE_SLOT_WAIT.min(self.by.left()))
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> PendingWindow {
        let mut filled = Vec::with_capacity(slots.len());
        let mut index = Vec::with_capacity(slots.len());
        for (i, (it, mut slot)) in self.items[start..].iter().zip(slots).enumerate() {
            // A chunk larger than a slot is not stored (its slot goes back).
            if it.data.len() > slot.len() {
                continue;
            }
            slot.bytes_mut()[..it.data.len()].copy_from_slice(it.data);
            filled.push(slot);
            index.push(start + i);
        }
        let items = self.items;
        self.m
            .store_slots_on_wire
            .fetch_add(filled.len(), Ordering::Relaxed);
        let by = self.by;
        let planned =
            self.m
                .plan_writes(index, filled, &|i| (items[i].page, items[i].data.len()), by);
        self.m.launch(planned, by)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let items = self.items;
        let n = posted.items.len();
        let by = self.by;
        let r = self.m.finish_window(
            posted,
            &mut |m, which, slots| {
                m.plan_writes(which, slots, &|i| (items[i].page, items[i].data.len()), by)
            },
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
        let wait = LOAD_SLOT_WAIT.min(self.by.left());
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
    /// WRITEs: each slot's page and length.
    Write(&'a [(PageGrant, usize)]),
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

impl GivenWindows<'_> {
    /// One outcome per given slot: the items' in order, then the slots no item used.
    pub(super) fn into_outcomes(self) -> Vec<SlotOutcome> {
        let mut out = self.out;
        let used = out.len();
        out.extend(
            self.given
                .into_iter()
                .skip(used)
                .map(|slot| SlotOutcome { ok: false, slot }),
        );
        out
    }
}

/// Plans the request's `items` from or into the caller's slots.
fn plan_given(
    m: &RemoteMover,
    kind: &Given<'_>,
    items: Vec<usize>,
    slots: Vec<Slot>,
    by: Deadline,
) -> Planned {
    match kind {
        Given::Write(pages) => m.plan_writes(items, slots, &|i| pages[i], by),
        Given::Read(leases) => m.plan_reads(items, leases, slots, by),
    }
}

impl Windowed for GivenWindows<'_> {
    type Posted = PendingWindow;
    fn items(&self) -> usize {
        match self.kind {
            Given::Write(p) => p.len(),
            Given::Read(l) => l.len(),
        }
    }
    fn bytes(&self, i: usize) -> u64 {
        match self.kind {
            Given::Write(p) => p[i].1 as u64,
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
        let planned = plan_given(self.m, &self.kind, items, slots, self.by);
        self.m.launch(planned, self.by)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let (kind, by) = (&self.kind, self.by);
        self.m.finish_window(
            posted,
            &mut |m, which, slots| plan_given(m, kind, which, slots, by),
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
