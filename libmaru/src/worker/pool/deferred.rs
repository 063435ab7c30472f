//! [`Deferred`]: work a call leaves for one of the handler's threads to do after it
//! returned (the lease releases of `maru_load_pieces`, `ReleaseQueue`; the next region
//! of a pool taken ahead of need, `AheadQueue`).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

/// Items queued at most; one more is done inline by the call that has it.
pub const MAX_QUEUED_RELEASES: usize = 64;

/// A bounded queue of items for one consumer thread, which drains it once closed.
pub struct Deferred<T> {
    state: Mutex<Queue<T>>,
    ready: Condvar,
}

struct Queue<T> {
    items: VecDeque<T>,
    /// Set by `close`: the consumer takes what is left, then ends.
    closing: bool,
}

impl<T> Default for Deferred<T> {
    fn default() -> Deferred<T> {
        Deferred {
            state: Mutex::new(Queue {
                items: VecDeque::new(),
                closing: false,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> Deferred<T> {
    /// Queues `item` for the consumer; gives it back (`Err`) when
    /// `MAX_QUEUED_RELEASES` wait already or the queue is closing: the caller then
    /// does the work itself.
    pub(super) fn push(&self, item: T) -> Result<(), T> {
        let Ok(mut q) = self.state.lock() else {
            return Err(item);
        };
        if q.closing || q.items.len() >= MAX_QUEUED_RELEASES {
            return Err(item);
        }
        q.items.push_back(item);
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    /// The next item, waiting for one (no lock held by the caller meanwhile); with
    /// whether the queue is closing. None once it is closed and empty.
    pub(super) fn next(&self) -> Option<(T, bool)> {
        let mut q = self.state.lock().ok()?;
        loop {
            if let Some(item) = q.items.pop_front() {
                return Some((item, q.closing));
            }
            if q.closing {
                return None;
            }
            q = self.ready.wait(q).ok()?;
        }
    }

    /// No more items are taken; the consumer drains what is queued and ends.
    pub fn close(&self) {
        if let Ok(mut q) = self.state.lock() {
            q.closing = true;
        }
        self.ready.notify_all();
    }

    /// Items waiting now.
    pub fn len(&self) -> usize {
        self.state.lock().map_or(0, |q| q.items.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_gives_the_item_back_and_a_closed_one_is_drained_then_ends() {
        let q = Deferred::default();
        for i in 0..MAX_QUEUED_RELEASES {
            assert!(q.push(i).is_ok());
        }
        assert_eq!(
            q.push(MAX_QUEUED_RELEASES),
            Err(MAX_QUEUED_RELEASES),
            "full: the caller does it"
        );
        assert_eq!(q.next(), Some((0, false)));
        assert!(q.push(MAX_QUEUED_RELEASES).is_ok(), "room again");
        q.close();
        assert_eq!(q.push(99), Err(99), "closing: the caller does it");
        // Everything queued before the close still comes out, in order, then None.
        let rest: Vec<usize> = std::iter::from_fn(|| q.next())
            .map(|(i, closing)| {
                assert!(closing);
                i
            })
            .collect();
        assert_eq!(rest, (1..=MAX_QUEUED_RELEASES).collect::<Vec<_>>());
        assert_eq!(q.next(), None);
        assert_eq!(q.len(), 0);
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // a test: the consumer runs on a thread
    fn the_consumer_waits_for_items_and_ends_at_close() {
        let q = std::sync::Arc::new(Deferred::default());
        let c = q.clone();
        let consumer = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some((i, _)) = c.next() {
                got.push(i);
            }
            got
        });
        for i in 0..10 {
            q.push(i).unwrap();
        }
        q.close();
        assert_eq!(consumer.join().unwrap(), (0..10).collect::<Vec<_>>());
    }
}
