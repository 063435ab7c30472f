//! Leases given back after the call that read under them returned
//! (`maru_load_pieces`): queued here, sent by the handler's `maru-release` thread. At
//! most [`MAX_QUEUED`] wait; a full queue makes the call release inline. At close the
//! queue is sent, all of it by one `timeout_ms` deadline, before the sessions close.

use super::Inner;
use crate::worker::clock::Deadline;
use crate::worker::pool::StoragePool;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

/// Releases queued at most; one more is sent inline by the load that has it.
pub const MAX_QUEUED: usize = 64;

/// A bounded queue of items for one consumer thread, which drains it once closed.
pub(super) struct Deferred<T> {
    state: Mutex<Queue<T>>,
    ready: Condvar,
}

struct Queue<T> {
    items: VecDeque<T>,
    /// Set by `close`: the consumer takes what is left, then ends.
    closing: bool,
}

impl<T> Deferred<T> {
    pub(super) fn new() -> Deferred<T> {
        Deferred {
            state: Mutex::new(Queue {
                items: VecDeque::new(),
                closing: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Queues `item` for the consumer; gives it back (`Err`) when `MAX_QUEUED` wait
    /// already or the queue is closing: the caller then does the work itself.
    pub(super) fn push(&self, item: T) -> Result<(), T> {
        let Ok(mut q) = self.state.lock() else {
            return Err(item);
        };
        if q.closing || q.items.len() >= MAX_QUEUED {
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
    pub(super) fn close(&self) {
        if let Ok(mut q) = self.state.lock() {
            q.closing = true;
        }
        self.ready.notify_all();
    }

    /// Items waiting now.
    pub(super) fn len(&self) -> usize {
        self.state.lock().map_or(0, |q| q.items.len())
    }
}

/// Leases of one pool to give back.
pub(super) type Release = (Arc<StoragePool>, Vec<u64>);

impl Inner {
    /// Gives `ids` of `pool` back after the caller returns (queued to the release
    /// thread), or now, by `by`, when the queue is full or the handler is closing.
    pub(super) fn release_later(&self, pool: &Arc<StoragePool>, ids: Vec<u64>, by: Deadline) {
        if ids.is_empty() {
            return;
        }
        if let Err((p, ids)) = self.releases.push((pool.clone(), ids)) {
            log::debug!(
                "pool {}: {} lease(s) released inline (release queue full or closing)",
                p.session.url,
                ids.len()
            );
            p.release_leases(ids, by);
        }
    }

    /// The release thread: sends each queued release with the session's own call
    /// timeout; once the handler closes, what is left by one deadline from then.
    pub(super) fn releases(&self) {
        let mut drain_by: Option<Deadline> = None;
        while let Some(((pool, ids), closing)) = self.releases.next() {
            if closing {
                let by = *drain_by.get_or_insert_with(|| Deadline::after(self.timeout()));
                pool.release_leases(ids, by);
            } else {
                pool.release_leases(ids, pool.session.call_deadline());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_gives_the_item_back_and_a_closed_one_is_drained_then_ends() {
        let q = Deferred::new();
        for i in 0..MAX_QUEUED {
            assert!(q.push(i).is_ok());
        }
        assert_eq!(
            q.push(MAX_QUEUED),
            Err(MAX_QUEUED),
            "full: the caller does it"
        );
        assert_eq!(q.next(), Some((0, false)));
        assert!(q.push(MAX_QUEUED).is_ok(), "room again");
        q.close();
        assert_eq!(q.push(99), Err(99), "closing: the caller does it");
        // Everything queued before the close still comes out, in order, then None.
        let rest: Vec<usize> = std::iter::from_fn(|| q.next())
            .map(|(i, closing)| {
                assert!(closing);
                i
            })
            .collect();
        assert_eq!(rest, (1..=MAX_QUEUED).collect::<Vec<_>>());
        assert_eq!(q.next(), None);
        assert_eq!(q.len(), 0);
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // a test: the consumer runs on a thread
    fn the_consumer_waits_for_items_and_ends_at_close() {
        let q = Arc::new(Deferred::new());
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
