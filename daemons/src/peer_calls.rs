//! Calls to one peer made from a thread of their own, so that a peer that stops
//! answering never stalls the event loop that asks (maru-server's links to the RM
//! and to each agent).

use maru::meta::PortError;
use maru::net::LinkError;
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Duration;

/// Calls to one peer, made from a thread of their own, so that a peer that stopped
/// answering (SIGSTOP, a dead host) never stalls maru-server's event loop: at most one
/// call is in flight per peer, and while it is, further calls to that peer fail at
/// once (unreachable) instead of queueing behind it. A call waits on the loop only up
/// to its `wait`; an answer that comes later is kept for the next same call.
pub struct PeerCalls<K, Q, A> {
    jobs: mpsc::Sender<(K, Q)>,
    done: mpsc::Receiver<(K, A)>,
    in_flight: Option<K>,
    ready: HashMap<K, (std::time::Instant, A)>,
}

/// An answer older than this is not handed to a later call (the call is made again).
const READY_FOR: Duration = Duration::from_secs(10);

/// Answers kept for later calls at most (a keeper retries what it needs).
const READY_MAX: usize = 4096;

impl<K, Q, A> PeerCalls<K, Q, A>
where
    K: Copy + Eq + std::hash::Hash + std::fmt::Debug + Send + 'static,
    Q: Send + 'static,
    A: Send + 'static,
{
    /// Starts the thread `name`, which answers each job with `call`.
    pub fn start(
        name: String,
        mut call: impl FnMut(Q) -> A + Send + 'static,
    ) -> PeerCalls<K, Q, A> {
        let (jobs, rx) = mpsc::channel::<(K, Q)>();
        let (tx, done) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                while let Ok((key, q)) = rx.recv() {
                    if tx.send((key, call(q))).is_err() {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            log::error!("cannot start thread {name}: {e}");
        }
        PeerCalls {
            jobs,
            done,
            in_flight: None,
            ready: HashMap::new(),
        }
    }

    fn take_done(&mut self) {
        while let Ok((k, a)) = self.done.try_recv() {
            if self.in_flight == Some(k) {
                self.in_flight = None;
            }
            if self.ready.len() >= READY_MAX {
                self.ready.clear();
            }
            self.ready.insert(k, (std::time::Instant::now(), a));
        }
    }

    /// The answer to `q`, or why there is none now (to be treated as unreachable).
    pub fn call(&mut self, peer: &str, key: K, q: Q, wait: Duration) -> Result<A, String> {
        self.take_done();
        if let Some((at, a)) = self.ready.remove(&key) {
            if at.elapsed() < READY_FOR {
                return Ok(a);
            }
        }
        if let Some(busy) = self.in_flight {
            return Err(format!(
                "{peer} has not answered an earlier call ({busy:?}) yet"
            ));
        }
        if self.jobs.send((key, q)).is_err() {
            return Err(format!("the link thread of {peer} is gone"));
        }
        self.in_flight = Some(key);
        if let Ok((k, a)) = self.done.recv_timeout(wait) {
            self.in_flight = None;
            if k == key {
                return Ok(a);
            }
            self.ready.insert(k, (std::time::Instant::now(), a));
        }
        Err(format!(
            "{peer} did not answer within {} ms; the call goes on in the background",
            wait.as_millis()
        ))
    }
}

/// A failed call as the metadata core's ports see it.
pub(crate) fn port_error(e: LinkError) -> PortError {
    match e {
        LinkError::Remote(w) => PortError::from(w),
        LinkError::Unreachable(m) | LinkError::Auth(m) | LinkError::Rejected(m) => {
            PortError::Unreachable(m)
        }
    }
}

pub(crate) fn unexpected<T: std::fmt::Debug>(r: T) -> PortError {
    PortError::Failed(format!("unexpected reply {r:?}"))
}
