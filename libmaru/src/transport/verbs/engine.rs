//! The worker side's bookkeeping over [`QueuePairOps`]: which work requests of each
//! queue pair are in flight, what waits for send-queue room, what a completion
//! settles, and what a fence proves. No thread and no rdma-core call lives here: the
//! driver ([`VerbsTransport`](super::VerbsTransport)) calls [`Engine::service`] when
//! a completion event comes and [`Engine::sweep`] on its fallback tick; tests drive
//! the same calls over [`fake`](super::fake) queue pairs.
//!
//! Rules (each has a test in `tests_engine.rs` that fails without it):
//!
//! * **Partial posts.** When `ibv_post_send` refuses a chain at index k, the requests
//!   before k are in flight (each will complete), k and the rest are not: they fail
//!   their batch at once and the queue pair takes no more posts.
//! * **Send-queue room without blocking.** `post` never waits: what does not fit in
//!   the send queue waits in the peer's backlog and is posted as completions free
//!   room. A fence fails the backlog at once (nothing of it reached the NIC); a
//!   backlog that found no room for `sq_wait` fails and the peer with it.
//! * **Arm, then drain.** A completion event re-arms the completion queue before it
//!   polls it, so a completion landing after the poll raises a new event.
//! * **Fence outcomes.** The slots of a peer's operations are safe to reuse once every
//!   posted request has its completion (a full flush) or the queue pair is destroyed
//!   (after `ibv_destroy_qp` the NIC executes nothing of it). A fence that proves
//!   neither returns an error and keeps the peer as a *zombie*: the next fence of it
//!   (and every sweep) retries the destroy, and only a success forgets it — a reclaim
//!   never mistakes a peer whose queue pair may still DMA for one already fenced.

use super::ops::{Completion, PostRefused, QueuePairOps, WorkRequest};
use super::proto::pack_wr_id;
use super::status;
use crate::transport::batches::BatchTable;
use crate::transport::{BatchId, LocalBuffer, Op, PeerId, TransportError};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `ibv_wc_status` of a successful completion.
const WC_SUCCESS: u32 = 0;

/// Timing of the engine's bounded waits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineConfig {
    /// How long a fence waits for the flushed completions of its queue pair.
    pub fence_timeout: Duration,
    /// How long a backlog may find no send-queue room before it fails.
    pub sq_wait: Duration,
}

/// The staging buffer as posts see it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalReg {
    pub buf: LocalBuffer,
    pub lkey: u32,
    /// The largest operation the port carries.
    pub max_op_len: u64,
}

/// One posted work request.
struct Posted {
    wr_id: u64,
    batch: BatchId,
    op: Op,
}

/// One operation waiting for send-queue room.
struct Waiting {
    batch: BatchId,
    index: u32,
    op: Op,
    local_addr: u64,
}

struct PeerState {
    /// Posted and not yet completed, in posting order (RC completes in that order).
    inflight: VecDeque<Posted>,
    /// Not posted yet: waits for send-queue room.
    backlog: VecDeque<Waiting>,
    /// Since when the backlog's head has waited.
    backlog_since: Option<Instant>,
    lkey: u32,
    /// Set at the first failure (error completion, refused post, fence, async event):
    /// the queue pair is in (or on its way to) the error state and takes no posts.
    failed: Option<String>,
    fenced: bool,
}

pub(crate) struct Peer {
    pub label: String,
    /// The `verbs` object of the metadata it was connected with (the transport finds
    /// peers by it through their lane group, `lanes.rs`; the engine's tests here).
    #[cfg_attr(not(test), allow(dead_code))]
    pub meta: serde_json::Value,
    pub qp: Arc<dyn QueuePairOps>,
    state: Mutex<PeerState>,
    /// Signalled whenever completions were settled (a fence waits on it).
    settled: Condvar,
    sq_depth: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is a single push/pop/insert: a poisoned lock
    // holds consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

type Done = Vec<(BatchId, Option<TransportError>)>;

impl Peer {
    fn lost(&self, message: impl Into<String>) -> TransportError {
        TransportError::PeerLost {
            peer: self.label.clone(),
            message: message.into(),
        }
    }

    /// Whether this peer can take new work (connect reuses it).
    pub fn usable(&self) -> bool {
        let st = lock(&self.state);
        st.failed.is_none() && !st.fenced
    }

    /// Work requests posted and not completed.
    #[cfg(test)]
    pub fn inflight(&self) -> usize {
        lock(&self.state).inflight.len()
    }

    /// Operations waiting for room.
    #[cfg(test)]
    pub fn backlog(&self) -> usize {
        lock(&self.state).backlog.len()
    }

    fn fail_backlog(&self, st: &mut PeerState, why: &str, done: &mut Done) {
        for w in st.backlog.drain(..) {
            done.push((
                w.batch,
                Some(self.lost(format!(
                    "{} was not posted: {why}",
                    status::describe_op(&w.op)
                ))),
            ));
        }
        st.backlog_since = None;
    }

    fn mark_failed(&self, st: &mut PeerState, why: String) {
        if st.failed.is_none() {
            st.failed = Some(why);
        }
    }

    /// Posts as much of the backlog as the send queue has room for.
    fn pump(&self, st: &mut PeerState, now: Instant, done: &mut Done) {
        if let Some(why) = st.failed.clone() {
            self.fail_backlog(st, &why, done);
            return;
        }
        while !st.backlog.is_empty() {
            let room = self.sq_depth.saturating_sub(st.inflight.len());
            if room == 0 {
                break;
            }
            let n = room.min(st.backlog.len());
            let mut chain = Vec::with_capacity(n);
            for w in st.backlog.drain(..n) {
                // Fits: `post` checked the batch size against MAX_BATCH_OPS.
                let wr_id = pack_wr_id(w.batch.0, w.index).unwrap_or(0);
                chain.push(WorkRequest {
                    wr_id,
                    kind: w.op.kind,
                    local_addr: w.local_addr,
                    lkey: st.lkey,
                    len: w.op.len as u32,
                    remote_addr: w.op.remote_addr,
                    rkey: w.op.rkey as u32,
                });
                st.inflight.push_back(Posted {
                    wr_id,
                    batch: w.batch,
                    op: w.op,
                });
            }
            if let Err(PostRefused { first_bad, errno }) = self.qp.post(&chain) {
                let first_bad = first_bad.min(n);
                let why = format!(
                    "ibv_post_send refused work request {first_bad} of a chain of {n}: {}",
                    std::io::Error::from_raw_os_error(errno)
                );
                // What the NIC did not take comes off the tail and fails at once; what
                // it took stays in flight and completes (or is flushed) as usual.
                let refused = st.inflight.split_off(st.inflight.len() - (n - first_bad));
                for p in refused {
                    done.push((
                        p.batch,
                        Some(self.lost(format!(
                            "{} was not posted: {why}",
                            status::describe_op(&p.op)
                        ))),
                    ));
                }
                self.mark_failed(st, why.clone());
                self.fail_backlog(st, &why, done);
                return;
            }
        }
        st.backlog_since = if st.backlog.is_empty() {
            None
        } else {
            Some(st.backlog_since.unwrap_or(now))
        };
    }

    fn settle(&self, st: &mut PeerState, wc: Completion, done: &mut Done) {
        let Some(pos) = st.inflight.iter().position(|p| p.wr_id == wc.wr_id) else {
            log::warn!(
                "verbs: completion for unknown work request {:#x} on {}",
                wc.wr_id,
                self.label
            );
            return;
        };
        if pos != 0 {
            log::warn!(
                "verbs: completion for work request {:#x} on {} arrived before {pos} earlier ones",
                wc.wr_id,
                self.label
            );
        }
        let Some(p) = st.inflight.remove(pos) else {
            return;
        };
        if wc.status == WC_SUCCESS {
            done.push((p.batch, None));
            return;
        }
        let err = status::op_error(
            wc.status,
            wc.vendor_err,
            &p.op,
            &self.label,
            st.failed.as_deref(),
        );
        let why = format!(
            "{} failed: {}",
            status::describe_op(&p.op),
            status::text(wc.status)
        );
        self.mark_failed(st, why);
        done.push((p.batch, Some(err)));
    }

    /// Takes every completion the completion queue holds and settles it.
    fn drain(&self, st: &mut PeerState, done: &mut Done) {
        let mut wcs = Vec::new();
        if let Err(e) = self.qp.poll(&mut wcs) {
            log::error!(
                "verbs: polling the completion queue of {} failed: {e}",
                self.label
            );
        }
        let before = done.len();
        for wc in wcs {
            self.settle(st, wc, done);
        }
        if done.len() > before {
            self.settled.notify_all();
        }
    }
}

/// The worker side's queue pairs and batches (see the module documentation).
pub(crate) struct Engine {
    pub batches: BatchTable,
    peers: Mutex<HashMap<PeerId, Arc<Peer>>>,
    /// Fenced peers whose queue pair could not be proven stopped (or not destroyed).
    zombies: Mutex<HashMap<PeerId, Arc<Peer>>>,
    next_batch: AtomicU64,
    cfg: EngineConfig,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Engine {
        Engine {
            batches: BatchTable::default(),
            peers: Mutex::new(HashMap::new()),
            zombies: Mutex::new(HashMap::new()),
            next_batch: AtomicU64::new(1),
            cfg,
        }
    }

    fn complete(&self, done: Done) {
        if !done.is_empty() {
            self.batches.complete_many(done);
        }
    }

    /// Adds a connected queue pair of `sq_depth` send-queue entries and arms it.
    pub fn add_peer(
        &self,
        id: PeerId,
        label: String,
        meta: serde_json::Value,
        qp: Arc<dyn QueuePairOps>,
        sq_depth: usize,
        lkey: u32,
    ) -> Arc<Peer> {
        let peer = Arc::new(Peer {
            label,
            meta,
            qp,
            state: Mutex::new(PeerState {
                inflight: VecDeque::new(),
                backlog: VecDeque::new(),
                backlog_since: None,
                lkey,
                failed: None,
                fenced: false,
            }),
            settled: Condvar::new(),
            sq_depth: sq_depth.max(1),
        });
        // Armed once it can be found: the progress thread looks the peer up by the
        // completion queue's context when the event comes.
        lock(&self.peers).insert(id, peer.clone());
        if let Err(e) = peer.qp.arm() {
            log::warn!("verbs: arming the completion queue of {}: {e}", peer.label);
        }
        peer
    }

    /// A live peer connected with this metadata and still usable.
    #[cfg(test)]
    pub fn find_usable(&self, meta: &serde_json::Value) -> Option<PeerId> {
        lock(&self.peers)
            .iter()
            .find(|(_, p)| p.meta == *meta && p.usable())
            .map(|(id, _)| *id)
    }

    /// Whether `id` is a live peer or a zombie (not yet proved quiet).
    pub fn knows(&self, id: PeerId) -> bool {
        lock(&self.peers).contains_key(&id) || lock(&self.zombies).contains_key(&id)
    }

    pub fn peer(&self, id: PeerId) -> Option<Arc<Peer>> {
        lock(&self.peers).get(&id).cloned()
    }

    pub fn peer_ids(&self) -> Vec<PeerId> {
        lock(&self.peers).keys().copied().collect()
    }

    /// Peers kept after a fence that proved nothing.
    pub fn zombies(&self) -> usize {
        lock(&self.zombies).len()
    }

    /// Posts a batch: checks every operation, then posts what the send queue has room
    /// for; the rest waits in the backlog. Never blocks.
    pub fn post(
        &self,
        peer_id: PeerId,
        ops: &[Op],
        local: &LocalReg,
        now: Instant,
    ) -> Result<BatchId, TransportError> {
        if ops.len() >= super::proto::MAX_BATCH_OPS {
            return Err(TransportError::Setup(format!(
                "a batch holds at most {} operations ({} given)",
                super::proto::MAX_BATCH_OPS - 1,
                ops.len()
            )));
        }
        for op in ops {
            local.buf.check(op.local_offset, op.len)?;
            if op.len > local.max_op_len || op.len > u64::from(u32::MAX) {
                return Err(TransportError::LocalRange {
                    offset: op.local_offset,
                    len: op.len,
                });
            }
            if op.rkey > u64::from(u32::MAX) {
                return Err(TransportError::BadKey { rkey: op.rkey });
            }
        }
        let peer = self.peer(peer_id).ok_or(TransportError::NoPeer(peer_id))?;
        let mut done = Vec::new();
        let batch = {
            let mut st = lock(&peer.state);
            if st.fenced {
                return Err(TransportError::NoPeer(peer_id));
            }
            if let Some(why) = &st.failed {
                return Err(peer.lost(format!("{why}; fence the peer and connect again")));
            }
            let batch = BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed));
            self.batches.insert(batch, ops.len());
            let base = local.buf.ptr as u64;
            for (i, op) in ops.iter().enumerate() {
                st.backlog.push_back(Waiting {
                    batch,
                    index: i as u32,
                    op: *op,
                    local_addr: base + op.local_offset,
                });
            }
            peer.pump(&mut st, now, &mut done);
            batch
        };
        self.complete(done);
        Ok(batch)
    }

    /// A completion event for `peer`: re-arm its completion queue, then drain it, then
    /// post what now fits.
    pub fn service(&self, peer_id: PeerId, now: Instant) {
        if let Some(peer) = self.peer(peer_id) {
            self.service_peer(&peer, now);
        }
    }

    fn service_peer(&self, peer: &Peer, now: Instant) {
        // Arm before draining: a completion that lands after the poll then raises a
        // new event instead of waiting for the fallback sweep.
        if let Err(e) = peer.qp.arm() {
            log::warn!(
                "verbs: arming the completion queue of {}: {e}; the fallback sweep still drains it",
                peer.label
            );
        }
        let mut done = Vec::new();
        {
            let mut st = lock(&peer.state);
            peer.drain(&mut st, &mut done);
            peer.pump(&mut st, now, &mut done);
        }
        self.complete(done);
    }

    /// The fallback tick: services every peer, fails backlogs that found no room for
    /// `sq_wait`, and retries the destroy of zombies.
    pub fn sweep(&self, now: Instant) {
        let peers: Vec<Arc<Peer>> = lock(&self.peers).values().cloned().collect();
        for peer in peers {
            let expired = {
                let st = lock(&peer.state);
                st.backlog_since
                    .is_some_and(|since| now.saturating_duration_since(since) >= self.cfg.sq_wait)
            };
            if expired {
                // The NIC has not freed one entry for `sq_wait`: the peer is stuck.
                // ERR flushes what it holds, so its batches fail now, not at their
                // callers' timeouts.
                self.fail_peer(
                    &peer,
                    &format!(
                        "the send queue stayed full for {} ms",
                        self.cfg.sq_wait.as_millis()
                    ),
                );
            }
            self.service_peer(&peer, now);
        }
        self.retry_zombies();
    }

    /// Retries the destroy of every zombie; forgets those destroyed.
    pub fn retry_zombies(&self) {
        let zs: Vec<(PeerId, Arc<Peer>)> = lock(&self.zombies)
            .iter()
            .map(|(id, p)| (*id, p.clone()))
            .collect();
        for (id, p) in zs {
            match p.qp.destroy() {
                Ok(()) => {
                    log::info!("verbs: queue pair of {} destroyed on a retry", p.label);
                    lock(&self.zombies).remove(&id);
                }
                Err(e) => log::debug!("verbs: {} still not destroyed: {e}", p.label),
            }
        }
    }

    /// A queue pair failed outside any completion (an async event): the peer takes no
    /// more posts, its queue pair goes to ERR so its requests are flushed, and its
    /// backlog fails.
    pub fn fail_qpn(&self, qpn: u32, why: &str) -> bool {
        let peer = lock(&self.peers)
            .values()
            .find(|p| p.qp.qpn() == qpn)
            .cloned();
        match peer {
            Some(p) => {
                self.fail_peer(&p, why);
                true
            }
            None => false,
        }
    }

    /// Every peer failed (port down, device fatal).
    pub fn fail_all(&self, why: &str) {
        let peers: Vec<Arc<Peer>> = lock(&self.peers).values().cloned().collect();
        for p in peers {
            self.fail_peer(&p, why);
        }
    }

    fn fail_peer(&self, p: &Peer, why: &str) {
        let mut done = Vec::new();
        {
            let mut st = lock(&p.state);
            p.mark_failed(&mut st, why.to_string());
            p.fail_backlog(&mut st, why, &mut done);
        }
        if let Err(e) = p.qp.to_error() {
            log::warn!("verbs: moving the queue pair of {} to ERR: {e}", p.label);
        }
        self.complete(done);
    }

    /// Stops every operation of `peer_id` (see the module documentation for what an
    /// `Ok` proves). A zombie's fence retries its destroy.
    pub fn fence(&self, peer_id: PeerId) -> Result<(), TransportError> {
        let zombie = lock(&self.zombies).get(&peer_id).cloned();
        if let Some(z) = zombie {
            return match z.qp.destroy() {
                Ok(()) => {
                    lock(&self.zombies).remove(&peer_id);
                    Ok(())
                }
                Err(e) => Err(z.lost(format!(
                    "fence: the queue pair is still not destroyed ({e}); its slots stay out of use"
                ))),
            };
        }
        let peer = lock(&self.peers)
            .remove(&peer_id)
            .ok_or(TransportError::NoPeer(peer_id))?;
        let mut done = Vec::new();
        {
            let mut st = lock(&peer.state);
            st.fenced = true;
            peer.mark_failed(&mut st, "the peer was fenced".into());
            peer.fail_backlog(&mut st, "the peer was fenced", &mut done);
        }
        self.complete(std::mem::take(&mut done));
        let mut problems: Vec<String> = Vec::new();
        // ERR: the NIC stops the queue pair and flushes every posted request.
        if let Err(e) = peer.qp.to_error() {
            problems.push(format!("moving it to ERR: {e}"));
        }
        let deadline = Instant::now() + self.cfg.fence_timeout;
        let flushed = {
            let mut st = lock(&peer.state);
            loop {
                peer.drain(&mut st, &mut done);
                if st.inflight.is_empty() {
                    break true;
                }
                let now = Instant::now();
                if now >= deadline {
                    break false;
                }
                let wait = (deadline - now).min(Duration::from_millis(10));
                st = peer
                    .settled
                    .wait_timeout(st, wait)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        };
        self.complete(std::mem::take(&mut done));
        let destroyed = peer.qp.destroy();
        // Either proof frees the slots: every request accounted for, or the queue pair
        // gone. What was never flushed fails its batch either way.
        let leftover: Vec<Posted> = lock(&peer.state).inflight.drain(..).collect();
        let n_left = leftover.len();
        for p in leftover {
            done.push((p.batch, Some(peer.lost("fenced before it completed"))));
        }
        self.complete(done);
        match (flushed, destroyed) {
            (_, Ok(())) => {
                if !flushed {
                    log::warn!(
                        "verbs: {n_left} work request(s) of {} were not flushed within {} ms; the queue pair is destroyed, so none of them runs any more",
                        peer.label,
                        self.cfg.fence_timeout.as_millis()
                    );
                }
                if !problems.is_empty() {
                    log::warn!("verbs: fence of {}: {}", peer.label, problems.join("; "));
                }
                Ok(())
            }
            (true, Err(e)) => {
                // Every request has its completion: nothing of it touches the buffer
                // any more. The queue pair itself is kept to destroy later.
                log::warn!(
                    "verbs: destroying the queue pair of {} failed ({e}); every request was flushed, the destroy is retried",
                    peer.label
                );
                lock(&self.zombies).insert(peer_id, peer);
                Ok(())
            }
            (false, Err(e)) => {
                problems.insert(
                    0,
                    format!(
                        "{n_left} work request(s) were not flushed within {} ms and the queue pair could not be destroyed ({e}); its slots stay out of use until a later fence destroys it",
                        self.cfg.fence_timeout.as_millis()
                    ),
                );
                let err = peer.lost(format!("fence: {}", problems.join("; ")));
                lock(&self.zombies).insert(peer_id, peer);
                Err(err)
            }
        }
    }

    /// Fences every peer and retries every zombie once (at close). Returns whether
    /// some queue pair is still not destroyed.
    pub fn close(&self) -> bool {
        for id in self.peer_ids() {
            if let Err(e) = self.fence(id) {
                log::warn!("verbs: closing peer {}: {e}", id.0);
            }
        }
        self.retry_zombies();
        self.zombies() > 0
    }
}
