//! The record of posted batches a worker-side transport keeps: how many operations of
//! each are still outstanding and the first error. Completion paths (a reader thread,
//! a completion-queue poller) count operations down; callers ask for the state or
//! wait for it to leave `Pending`.

use super::{BatchId, BatchState, TransportError};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

struct BatchRec {
    remaining: usize,
    failed: Option<TransportError>,
}

#[derive(Default)]
pub struct BatchTable {
    map: Mutex<HashMap<BatchId, BatchRec>>,
    cv: Condvar,
}

impl BatchTable {
    fn lock(&self) -> MutexGuard<'_, HashMap<BatchId, BatchRec>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a batch of `ops` operations (before any of them can complete).
    pub fn insert(&self, batch: BatchId, ops: usize) {
        self.lock().insert(
            batch,
            BatchRec {
                remaining: ops,
                failed: None,
            },
        );
    }

    /// One operation of each listed batch finished (`Some` error: it failed).
    pub fn complete_many(&self, done: impl IntoIterator<Item = (BatchId, Option<TransportError>)>) {
        {
            let mut m = self.lock();
            for (batch, err) in done {
                if let Some(rec) = m.get_mut(&batch) {
                    rec.remaining = rec.remaining.saturating_sub(1);
                    if rec.failed.is_none() {
                        rec.failed = err;
                    }
                }
            }
        }
        self.cv.notify_all();
    }

    pub fn complete(&self, batch: BatchId, err: Option<TransportError>) {
        self.complete_many([(batch, err)]);
    }

    pub fn state(&self, batch: BatchId) -> BatchState {
        state_of(&self.lock(), batch)
    }

    /// Waits until the batch is no longer pending, at most `timeout`.
    #[allow(clippy::disallowed_methods)] // a driver: waits on a deadline
    pub fn wait(&self, batch: BatchId, timeout: Duration) -> BatchState {
        let deadline = Instant::now() + timeout;
        let mut m = self.lock();
        loop {
            let st = state_of(&m, batch);
            let now = Instant::now();
            if st != BatchState::Pending || now >= deadline {
                return st;
            }
            m = self
                .cv
                .wait_timeout(m, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    pub fn forget(&self, batch: BatchId) {
        self.lock().remove(&batch);
    }
}

fn state_of(m: &HashMap<BatchId, BatchRec>, batch: BatchId) -> BatchState {
    match m.get(&batch) {
        None => BatchState::Failed(TransportError::NoBatch(batch)),
        Some(r) if r.remaining > 0 => BatchState::Pending,
        Some(BatchRec {
            failed: Some(e), ..
        }) => BatchState::Failed(e.clone()),
        Some(_) => BatchState::Done,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests drive threads and clocks
mod tests {
    use super::*;

    #[test]
    fn counts_down_keeps_the_first_error_and_wakes_waiters() {
        let t = std::sync::Arc::new(BatchTable::default());
        let b = BatchId(1);
        t.insert(b, 2);
        assert_eq!(t.state(b), BatchState::Pending);
        t.complete(b, Some(TransportError::BadKey { rkey: 7 }));
        t.complete(b, Some(TransportError::NoLocalBuffer));
        assert_eq!(
            t.state(b),
            BatchState::Failed(TransportError::BadKey { rkey: 7 })
        );
        let c = BatchId(2);
        t.insert(c, 1);
        let t2 = t.clone();
        let h = std::thread::spawn(move || t2.wait(c, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        t.complete(c, None);
        assert_eq!(h.join().unwrap(), BatchState::Done);
        assert_eq!(
            t.wait(BatchId(3), Duration::ZERO),
            BatchState::Failed(TransportError::NoBatch(BatchId(3)))
        );
        t.forget(c);
        assert!(matches!(
            t.state(c),
            BatchState::Failed(TransportError::NoBatch(_))
        ));
    }
}
