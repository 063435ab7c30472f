//! Asynchronous operations: a submitted call runs on one of the handler's executor
//! threads (started on first use); the caller polls or waits on its [`OpHandle`].

use super::error::WorkerError;
use crossbeam::channel::{unbounded, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
    #[allow(clippy::disallowed_methods)] // a driver: waits on a deadline
    pub fn wait(&self, timeout: Duration) -> Option<OpResult> {
        let deadline = Instant::now() + timeout;
        let mut d = self.state.done.lock().ok()?;
        loop {
            if let Some(r) = d.as_ref() {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            d = self.state.cv.wait_timeout(d, deadline - now).ok()?.0;
        }
    }
}

type Job = Box<dyn FnOnce() -> OpResult + Send>;
/// The queue and the threads, once started.
type Running = (Sender<(Job, OpHandle)>, Vec<JoinHandle<()>>);

/// A fixed number of threads running submitted jobs in order of submission.
pub struct Executor {
    threads: usize,
    /// `Err(())` once shut down: no thread is started again after that.
    inner: Mutex<Result<Option<Running>, ()>>,
}

impl Executor {
    pub fn new(threads: usize) -> Executor {
        Executor {
            threads: threads.max(1),
            inner: Mutex::new(Ok(None)),
        }
    }

    /// Queues `job`; its result goes to the returned handle.
    #[allow(clippy::disallowed_methods)] // a driver: starts the executor threads
    pub fn submit(&self, job: Job) -> Result<OpHandle, WorkerError> {
        let mut guard = self.inner.lock().map_err(|_| WorkerError::Closed)?;
        let g = guard.as_mut().map_err(|_| WorkerError::Closed)?;
        if g.is_none() {
            let (tx, rx) = unbounded::<(Job, OpHandle)>();
            let mut hs = Vec::with_capacity(self.threads);
            for i in 0..self.threads {
                let rx = rx.clone();
                let h = std::thread::Builder::new()
                    .name(format!("maru-op-{i}"))
                    .spawn(move || {
                        while let Ok((job, op)) = rx.recv() {
                            op.finish(job());
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
        tx.send((job, op.clone()))
            .map_err(|_| WorkerError::Closed)?;
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

    #[test]
    fn submit_poll_wait_and_shutdown_runs_what_was_queued() {
        let ex = Executor::new(2);
        let (gate_tx, gate_rx) = crossbeam::channel::bounded::<()>(0);
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
        ex.shutdown();
        assert_eq!(
            queued.poll(),
            Some(Ok(OpOutput::Loaded(vec![Some(3), None])))
        );
    }
}
