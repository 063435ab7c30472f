//! The allocator of the library's test binary: the system's, counting the heap
//! allocations each thread makes, so that a test can show a hot path allocates a
//! fixed number of times per call, not per chunk ([`allocations_in`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Allocations (and reallocations) of this thread so far.
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

pub(crate) struct Counting;

fn bump() {
    // A thread being torn down has no counter any more: not counted.
    let _ = COUNT.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is passed on to `System` unchanged; counting touches only a
// thread-local `Cell` (const-initialised, no destructor: it never allocates).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bump();
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump();
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

/// `f()`'s result and the heap allocations this thread made while it ran.
pub(crate) fn allocations_in<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = COUNT.with(Cell::get);
    let r = f();
    (r, COUNT.with(Cell::get) - before)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count sees allocations, and only this thread's.
    #[test]
    fn allocations_are_counted_per_thread() {
        let (v, n) = allocations_in(|| (0..3).map(|i| vec![i; 10]).collect::<Vec<_>>());
        assert_eq!((v.len(), n), (3, 4));
        let spawn = |alloc: bool| {
            allocations_in(|| {
                std::thread::scope(|s| {
                    s.spawn(move || if alloc { vec![0u8; 100].len() } else { 0 });
                })
            })
            .1
        };
        // The first spawn may set things up once (the stack size it reads); then a
        // spawn takes as many of this thread's allocations whether or not the other
        // thread allocates.
        spawn(false);
        let m = spawn(false);
        let n = spawn(true);
        assert_eq!(n, m);
    }
}
