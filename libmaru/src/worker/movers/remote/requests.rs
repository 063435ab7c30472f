//! What a remote store or load posts, window by window (see `worker::windows`): a
//! copying store fills store slots from the caller's chunks, a copying load hands
//! each window's slots to the caller's sink, and the slot API moves the caller's own
//! slots.

use super::post::{PendingWindow, Planned};
use super::{RemoteState, Shared};
use crate::wire::meta::{LeaseGrant, PageGrant};
use crate::worker::movers::{ReadSink, SlotOutcome, WriteItem};
use crate::worker::staging::{Slot, SlotPool};
use crate::worker::windows::Windowed;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long a store's first window waits for a store slot that other requests'
/// windows hold on the wire (see `StoreWindows::slots`).
const STORE_SLOT_WAIT: Duration = Duration::from_secs(1);

/// A copying store's windows: the caller's chunks are copied into store slots.
pub(super) struct StoreWindows<'a, 'd> {
    pub(super) m: &'a Shared,
    pub(super) items: &'a [WriteItem<'d>],
    pub(super) ok: Vec<bool>,
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
            .acquire(SlotPool::Store, want, STORE_SLOT_WAIT)
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
        let planned = self
            .m
            .lock()
            .post_writes(index, filled, &|i| (items[i].page, items[i].data.len()));
        self.m.launch(planned)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let items = self.items;
        let n = posted.items.len();
        let r = self.m.finish_window(posted, &mut |st, which, slots| {
            st.post_writes(which, slots, &|i| (items[i].page, items[i].data.len()))
        });
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
    pub(super) m: &'a Shared,
    pub(super) leases: &'a [LeaseGrant],
    pub(super) sink: &'a mut ReadSink<'s>,
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
        let slots = self
            .m
            .staging
            .acquire(SlotPool::Load, want, Duration::from_secs(1));
        if slots.is_empty() {
            log::warn!(
                "no load slot free within 1 s: {} chunk(s) not loaded",
                self.leases.len() - start
            );
        }
        slots
    }
    fn post(&mut self, start: usize, slots: Vec<Slot>) -> PendingWindow {
        let items = (start..start + slots.len()).collect();
        let planned = self.m.lock().post_reads(items, self.leases, slots);
        self.m.launch(planned)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let leases = self.leases;
        self.m.finish_window(posted, &mut |st, which, slots| {
            st.post_reads(which, leases, slots)
        })
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
    pub(super) m: &'a Shared,
    pub(super) given: Vec<Option<Slot>>,
    pub(super) out: Vec<SlotOutcome>,
    pub(super) kind: Given<'a>,
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

/// Posts the request's `items` from or into the caller's slots.
pub(super) fn post_given(
    m: &mut RemoteState,
    kind: &Given<'_>,
    items: Vec<usize>,
    slots: Vec<Slot>,
) -> Planned {
    match kind {
        Given::Write(pages) => m.post_writes(items, slots, &|i| pages[i]),
        Given::Read(leases) => m.post_reads(items, leases, slots),
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
        let planned = post_given(&mut self.m.lock(), &self.kind, items, slots);
        self.m.launch(planned)
    }
    fn finish(&mut self, posted: PendingWindow) -> (Vec<usize>, Vec<SlotOutcome>) {
        let kind = &self.kind;
        self.m.finish_window(posted, &mut |st, which, slots| {
            post_given(st, kind, which, slots)
        })
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
