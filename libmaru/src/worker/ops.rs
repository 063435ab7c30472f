//! Asynchronous operations: a submitted call runs on one of the handler's executor
//! threads (started on first use); the caller polls or waits on its [`OpHandle`].

use super::error::WorkerError;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The result of a finished operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpOutput {
    /// Per chunk: stored (or already present).
    Stored(Vec<bool>),
    /// Per chunk: its length where it was loaded.
    Loaded(Vec<Option<usize>>),
}

type OpResult = Result<OpOutput, WorkerError>;

#[derive(Default)]
struct OpState {
    done: Mutex<Option<OpResult>>,
    cv: Condvar,
}

/// A submitted operation.
#[derive(Clone)]
pub struct OpHandle {
    state: Arc<OpState>,
}

impl OpHandle {
    fn new() -> OpHandle {
        OpHandle {
            state: Arc::new(OpState::default()),
        }
    }

    fn finish(&self, r: OpResult) {
        if let Ok(mut d) = self.state.done.lock() {
            *d = Some(r);
        }
        self.state.cv.notify_all();
    }

    /// The result if the operation has finished.
    pub fn poll(&self) -> Option<OpResult> {
        self.state.done.lock().ok().and_then(|d| d.clone())
    }

    /// Waits up to `timeout` for the operation to finish.
    pub fn wait(&self, timeout: Duration) -> Option<OpResult> {
        let d = self.state.done.lock().ok()?;
        let (d, _) = (self.state.cv)
            .wait_timeout_while(d, timeout, |d| d.is_none())
            .ok()?;
        d.clone()
    }
}

type Job = Box<dyn FnOnce() -> OpResult + Send>;
/// The queue and the threads, once started.
type Running = (Sender<(Job, OpHandle)>, Vec<JoinHandle<()>>);

/// The next job of the executor's queue, for one of its threads; `None` once the
/// queue's sender is gone (shutdown) or another thread panicked holding it.
fn next_job(rx: &Mutex<Receiver<(Job, OpHandle)>>) -> Option<(Job, OpHandle)> {
    rx.lock().ok()?.recv().ok()
}

/// Jobs submitted and not finished yet (queued or running), and a condition that
/// says when that count reaches zero.
#[derive(Default)]
struct Pending {
    count: Mutex<usize>,
    idle: Condvar,
}

impl Pending {
    fn add(&self) {
        if let Ok(mut c) = self.count.lock() {
            *c += 1;
        }
    }

    fn done(&self) {
        if let Ok(mut c) = self.count.lock() {
            *c = c.saturating_sub(1);
            if *c == 0 {
                self.idle.notify_all();
            }
        }
    }
}

/// A fixed number of threads running submitted jobs in order of submission.
pub struct Executor {
    threads: usize,
    /// `Err(())` once shut down: no thread is started again after that.
    inner: Mutex<Result<Option<Running>, ()>>,
    pending: Arc<Pending>,
}

impl Executor {
    pub fn new(threads: usize) -> Executor {
        Executor {
            threads: threads.max(1),
            inner: Mutex::new(Ok(None)),
            pending: Arc::default(),
        }
    }

    /// Waits up to `timeout` until every job submitted so far has finished (queued
    /// ones run meanwhile); the number still queued or running then (0: all done).
    pub fn settle(&self, timeout: Duration) -> usize {
        let Ok(c) = self.pending.count.lock() else {
            return 0;
        };
        match self.pending.idle.wait_timeout_while(c, timeout, |c| *c > 0) {
            Ok((c, _)) => *c,
            Err(_) => 0,
        }
    }

    /// Queues `job`; its result goes to the returned handle.
    #[allow(clippy::disallowed_methods)] // a driver: starts the executor threads
    pub fn submit(&self, job: Job) -> Result<OpHandle, WorkerError> {
        let mut guard = self.inner.lock().map_err(|_| WorkerError::Closed)?;
        let g = guard.as_mut().map_err(|_| WorkerError::Closed)?;
        if g.is_none() {
            let (tx, rx) = channel::<(Job, OpHandle)>();
            // One queue, several takers: the thread that holds the receiver waits for
            // the next job, the others for the receiver.
            let rx = Arc::new(Mutex::new(rx));
            let mut hs = Vec::with_capacity(self.threads);
            for i in 0..self.threads {
                let rx = rx.clone();
                let pending = self.pending.clone();
                let h = std::thread::Builder::new()
                    .name(format!("maru-op-{i}"))
                    .spawn(move || {
                        while let Some((job, op)) = next_job(&rx) {
                            op.finish(job());
                            pending.done();
                        }
                    })
                    .map_err(|e| {
                        WorkerError::unavailable(
                            crate::worker::error::Peer::Host,
                            format!("cannot start an executor thread: {e}"),
                        )
                    })?;
                hs.push(h);
            }
            *g = Some((tx, hs));
        }
        let op = OpHandle::new();
        let (tx, _) = g.as_ref().ok_or(WorkerError::Closed)?;
        self.pending.add();
        if tx.send((job, op.clone())).is_err() {
            self.pending.done();
            return Err(WorkerError::Closed);
        }
        Ok(op)
    }

    /// Lets queued jobs run to their end (after `close` they fail fast with `Closed`)
    /// and joins the threads. Later submits fail with `Closed`.
    pub fn shutdown(&self) {
        let taken = self
            .inner
            .lock()
            .ok()
            .and_then(|mut g| std::mem::replace(&mut *g, Err(())).ok().flatten());
        if let Some((tx, hs)) = taken {
            drop(tx);
            for h in hs {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn submit_poll_wait_and_shutdown_runs_what_was_queued() {
        let ex = Executor::new(2);
        let (gate_tx, gate_rx) = std::sync::mpsc::sync_channel::<()>(0);
        let slow = ex
            .submit(Box::new(move || {
                let _ = gate_rx.recv_timeout(Duration::from_secs(10));
                Ok(OpOutput::Stored(vec![true]))
            }))
            .unwrap();
        assert_eq!(slow.poll(), None);
        assert_eq!(slow.wait(Duration::from_millis(20)), None, "still running");
        let fast = ex.submit(Box::new(|| Err(WorkerError::Closed))).unwrap();
        assert_eq!(
            fast.wait(Duration::from_secs(10)),
            Some(Err(WorkerError::Closed))
        );
        gate_tx.send(()).unwrap();
        assert_eq!(
            slow.wait(Duration::from_secs(10)),
            Some(Ok(OpOutput::Stored(vec![true])))
        );
        let queued = ex
            .submit(Box::new(|| Ok(OpOutput::Loaded(vec![Some(3), None]))))
            .unwrap();
        assert_eq!(ex.settle(Duration::from_secs(10)), 0, "every job finished");
        ex.shutdown();
        assert_eq!(
            queued.poll(),
            Some(Ok(OpOutput::Loaded(vec![Some(3), None])))
        );
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // a test: its own thread and clock
    fn settle_waits_for_queued_and_running_jobs_and_no_longer_than_its_bound() {
        let ex = Executor::new(1);
        let (gate_tx, gate_rx) = std::sync::mpsc::sync_channel::<()>(0);
        let held = ex
            .submit(Box::new(move || {
                let _ = gate_rx.recv_timeout(Duration::from_secs(10));
                Ok(OpOutput::Stored(vec![true]))
            }))
            .unwrap();
        let queued = ex
            .submit(Box::new(|| Ok(OpOutput::Stored(vec![false]))))
            .unwrap();
        let t0 = Instant::now();
        assert_eq!(
            ex.settle(Duration::from_millis(100)),
            2,
            "both still pending"
        );
        assert!(t0.elapsed() < Duration::from_secs(5));
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            gate_tx.send(()).unwrap();
        });
        assert_eq!(ex.settle(Duration::from_secs(10)), 0);
        assert!(held.poll().is_some() && queued.poll().is_some(), "both ran");
        release.join().unwrap();
        ex.shutdown();
    }
}
