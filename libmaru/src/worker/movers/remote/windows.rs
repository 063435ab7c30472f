//! The remote mover's stores and loads, in windows of [`WINDOW_BYTES`] (at least one
//! chunk; see `docs/worker.md`, "Windows"): two in flight, the second only within the
//! data path's [`InFlightBudget`]. [`run`] is the schedule alone; what posting and
//! waiting mean is the [`Windowed`] caller's: a copying store (`StoreWindows`), a
//! copying load (`LoadWindows`), the slot API's own slots (`GivenWindows`).

use super::post::{PendingWindow, Planned};
use super::{InFlight, InFlightBudget, RemoteMover, WriteTargets};
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::WorkerError;
use crate::worker::movers::{Mover, ReadSink, SlotOutcome, SlotWrite, WriteItem};
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

/// How long a store's first window waits for a store slot (`StoreWindows::slots`).
const STORE_SLOT_WAIT: Duration = Duration::from_secs(1);

/// How long a load's first window waits for a load slot.
const LOAD_SLOT_WAIT: Duration = Duration::from_secs(1);

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
    /// A first window waits (at most `STORE_SLOT_WAIT`) only while other requests'
    /// store windows hold slots on the wire; else the store skips at once.
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
        let (to, by) = (self.to, self.by);
        let page = |i: usize| (items[i].page, items[i].data.len());
        let planned = self.m.plan_writes(index, filled, &page, to, by);
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
    fn tick(&self, now_ms: u64) -> Vec<u64> {
        RemoteMover::tick(self, now_ms)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::movers::remote::IN_FLIGHT_BUDGET;
    use crate::worker::staging::{SlotPool, StagingLayout, StagingSlots};

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

    #[test]
    fn windows_of_the_window_size_two_in_flight_handed_over_in_order() {
        let budget = InFlightBudget::default();
        // 24 chunks of 256 KiB: windows of 8, two in flight, three in all.
        let mut s = Script::new(vec![256 << 10; 24], 64);
        assert_eq!(run(&mut s, &budget), 24);
        assert_eq!(s.posted, vec![(0, 8), (8, 8), (16, 8)]);
        assert_eq!(s.done, (0..24).collect::<Vec<_>>());
        assert_eq!(s.most_open_bytes, 4 << 20, "two windows of 2 MiB at most");
        // When the first window is handed over, the second is still in flight.
        assert_eq!(s.outstanding_at_done[0], 1);
        assert_eq!(s.staging.free(SlotPool::Load), 64, "every slot is back");
        // Chunks larger than a window go one a window.
        let mut s = Script::new(vec![3 << 20; 3], 64);
        assert_eq!(run(&mut s, &budget), 3);
        assert_eq!(s.posted, vec![(0, 1), (1, 1), (2, 1)]);
    }

    #[test]
    fn a_second_window_waits_while_the_data_path_is_over_its_budget() {
        let budget = InFlightBudget::default();
        // Another request holds the whole budget: this one keeps one window in flight.
        let other = budget.take(IN_FLIGHT_BUDGET, true).expect("a first window");
        let mut s = Script::new(vec![256 << 10; 24], 64);
        assert_eq!(run(&mut s, &budget), 24);
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
        let mut s = Script::new(vec![256 << 10; 24], 64);
        assert_eq!(run(&mut s, &budget), 24);
        assert_eq!(s.most_open_bytes, 2 * WINDOW_BYTES, "two windows in flight");
        drop(other);
        assert_eq!(budget.in_flight(), 0);
    }

    #[test]
    fn few_slots_cut_windows_and_none_for_the_first_stops_the_request() {
        let budget = InFlightBudget::default();
        // 3 slots: a window of 3, then nothing free for a second until it is back.
        let mut s = Script::new(vec![256 << 10; 8], 3);
        assert_eq!(run(&mut s, &budget), 8);
        assert_eq!(s.posted, vec![(0, 3), (3, 3), (6, 2)]);
        assert_eq!(s.done, (0..8).collect::<Vec<_>>());
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
}
