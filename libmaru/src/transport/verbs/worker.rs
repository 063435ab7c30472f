//! The worker side: one RC queue pair (and one completion queue) per agent, every
//! work request signalled, one progress thread for all of them woken by the
//! completion channel.

use super::device::{self, Device, Mr};
use super::proto::{gid_to_string, pack_wr_id, TargetHalf, TargetMeta, WorkerHalf, MAX_BATCH_OPS};
use super::status;
use crate::transport::batches::BatchTable;
use crate::transport::{
    BatchId, BatchState, Bringup, LocalBuffer, Op, OpKind, PeerId, Transport, TransportError,
};
use rdma_mummy_sys::{
    ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_post_send, ibv_req_notify_cq, ibv_send_flags,
    ibv_send_wr, ibv_sge, ibv_wc_status, ibv_wr_opcode, rdma_t, wr_t,
};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, PollCompletionQueueError,
};
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};
use sideway::ibverbs::AccessFlags;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Send-queue depth per queue pair (clamped to the device's limit).
const SQ_DEPTH: u32 = 1024;
/// The progress thread's fallback: it sweeps every completion queue this often even
/// without an event (an event fd that never fires cannot stall a batch forever).
pub(crate) const FALLBACK_POLL: Duration = Duration::from_millis(100);
/// How long a fence waits for the flushed completions of its queue pair.
pub(crate) const FENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `post` waits for send-queue room before it fails the rest of a batch.
const SQ_WAIT: Duration = Duration::from_secs(10);

/// One posted work request.
struct Posted {
    wr_id: u64,
    batch: BatchId,
    op: Op,
}

struct PeerState {
    /// Posted and not yet completed, in posting order (RC completes in that order).
    inflight: VecDeque<Posted>,
    /// Set at the first failure (error completion, failed post, fence): the queue pair
    /// is in (or on its way to) the error state and takes no more posts.
    failed: Option<String>,
    fenced: bool,
}

struct Peer {
    label: String,
    /// The `verbs` object of the metadata it was connected with (one peer per agent).
    meta: serde_json::Value,
    qp: Mutex<Option<BasicQueuePair>>,
    cq: Arc<BasicCompletionQueue>,
    state: Mutex<PeerState>,
    /// Signalled when completions free send-queue room, and at a fence.
    room: Condvar,
    sq_depth: usize,
}

struct Shared {
    batches: BatchTable,
    peers: Mutex<HashMap<PeerId, Arc<Peer>>>,
    stop: AtomicBool,
}

impl Shared {
    fn complete(&self, done: Vec<(BatchId, Option<TransportError>)>) {
        if !done.is_empty() {
            self.batches.complete_many(done);
        }
    }

    fn peer(&self, id: PeerId) -> Option<Arc<Peer>> {
        lock(&self.peers).get(&id).cloned()
    }

    fn all_peers(&self) -> Vec<Arc<Peer>> {
        lock(&self.peers).values().cloned().collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves consistent data (every update
    // is a single push/pop/insert), so a poisoned lock is used as is.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Peer {
    fn lost(&self, message: impl Into<String>) -> TransportError {
        TransportError::PeerLost {
            peer: self.label.clone(),
            message: message.into(),
        }
    }

    /// Requests an event on the completion channel for the next completion.
    fn arm(&self) {
        // SAFETY: the CQ is alive (held by `self`).
        let rc = unsafe { ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc != 0 {
            log::warn!(
                "verbs: arming the completion queue of {} failed ({}); the {} ms sweep still drains it",
                self.label,
                std::io::Error::from_raw_os_error(rc),
                FALLBACK_POLL.as_millis()
            );
        }
    }

    /// Takes every completion the CQ holds and settles its operations.
    fn drain(&self, shared: &Shared) {
        let mut done = Vec::new();
        {
            let mut st = lock(&self.state);
            loop {
                let poller = match self.cq.start_poll() {
                    Ok(p) => p,
                    Err(PollCompletionQueueError::CompletionQueueEmpty) => break,
                    Err(e) => {
                        log::error!("verbs: polling the CQ of {} failed: {e}", self.label);
                        break;
                    }
                };
                for wc in poller {
                    self.settle(&mut st, wc.wr_id(), wc.status(), wc.vendor_err(), &mut done);
                }
            }
        }
        if !done.is_empty() {
            self.room.notify_all();
            shared.complete(done);
        }
    }

    fn settle(
        &self,
        st: &mut PeerState,
        wr_id: u64,
        wc_status: u32,
        vendor_err: u32,
        done: &mut Vec<(BatchId, Option<TransportError>)>,
    ) {
        let Some(pos) = st.inflight.iter().position(|p| p.wr_id == wr_id) else {
            log::warn!(
                "verbs: completion for unknown work request {wr_id:#x} on {}",
                self.label
            );
            return;
        };
        if pos != 0 {
            log::warn!(
                "verbs: completion for work request {wr_id:#x} on {} arrived before {} earlier ones",
                self.label,
                pos
            );
        }
        let Some(p) = st.inflight.remove(pos) else {
            return;
        };
        if wc_status == ibv_wc_status::IBV_WC_SUCCESS {
            done.push((p.batch, None));
            return;
        }
        let err = status::op_error(
            wc_status,
            vendor_err,
            &p.op,
            &self.label,
            st.failed.as_deref(),
        );
        if st.failed.is_none() {
            st.failed = Some(format!(
                "{} failed: {}",
                status::describe_op(&p.op),
                status::text(wc_status)
            ));
        }
        done.push((p.batch, Some(err)));
    }
}

struct Local {
    buf: LocalBuffer,
    mr: Mr,
}

/// The verbs transport, worker side (see the [module documentation](super)).
pub struct VerbsTransport {
    dev: Device,
    instance: u64,
    channel: Arc<CompletionChannel>,
    local: OnceLock<Local>,
    shared: Arc<Shared>,
    connect_lock: Mutex<()>,
    progress: Mutex<Option<JoinHandle<()>>>,
    next_peer: AtomicU64,
    next_batch: AtomicU64,
    max_op_len: u64,
}

impl VerbsTransport {
    /// Opens `device` (`None`: the first RDMA device) at `port` (from 1) and starts the
    /// progress thread. `gid_index`: the GID to source packets from (`None`: 0 on
    /// InfiniBand, a RoCE v2 GID on Ethernet). Without a device, or without rdma-core,
    /// fails with [`TransportError::Unavailable`] naming the device looked for.
    pub fn open(
        device: Option<&str>,
        port: u8,
        gid_index: Option<u8>,
    ) -> Result<VerbsTransport, TransportError> {
        let dev = Device::open(device, port, gid_index)?;
        let channel = dev.ctx.create_comp_channel().map_err(|e| {
            TransportError::Setup(format!(
                "completion channel on {}: {e} ({})",
                dev.label(),
                std::io::Error::last_os_error()
            ))
        })?;
        channel.set_nonblocking(true).map_err(|e| {
            TransportError::Setup(format!("completion channel on {}: {e}", dev.label()))
        })?;
        let shared = Arc::new(Shared {
            batches: BatchTable::default(),
            peers: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
        });
        let (sh, ch) = (shared.clone(), channel.clone());
        let handle = std::thread::Builder::new()
            .name("verbs-progress".into())
            .spawn(move || progress_loop(sh, ch))
            .map_err(|e| TransportError::Setup(format!("starting the progress thread: {e}")))?;
        let max_op_len = match dev.max_msg {
            0 => 1 << 31,
            n => u64::from(n),
        };
        Ok(VerbsTransport {
            instance: device::random_u64(),
            dev,
            channel,
            local: OnceLock::new(),
            shared,
            connect_lock: Mutex::new(()),
            progress: Mutex::new(Some(handle)),
            next_peer: AtomicU64::new(1),
            next_batch: AtomicU64::new(1),
            max_op_len,
        })
    }

    /// The opened device's name (`mlx5_0`).
    pub fn device(&self) -> &str {
        &self.dev.name
    }

    /// The opened port.
    pub fn port(&self) -> u8 {
        self.dev.port
    }

    fn local(&self) -> Result<&Local, TransportError> {
        self.local.get().ok_or(TransportError::NoLocalBuffer)
    }

    /// Sends our half, takes the target's, and moves `qp` to RTS.
    fn bring_up(
        &self,
        tm: &TargetMeta,
        qp: &mut BasicQueuePair,
        psn: u32,
        want_rd: u8,
        bringup: &mut Bringup<'_>,
    ) -> Result<TargetHalf, TransportError> {
        let half = WorkerHalf {
            worker: self.instance,
            ep: self.dev.endpoint(qp.qp_number(), psn, want_rd),
        };
        let answer = bringup(&half.to_json())?;
        let th = TargetHalf::from_json(&answer)?;
        if th.ep.rd_atomic == 0 {
            return Err(TransportError::Setup(format!(
                "the target {}:{} serves no RDMA READ (rd_atomic 0)",
                tm.device, tm.port
            )));
        }
        // The worker's queue pair accepts no remote operation: nothing reaches into
        // the staging buffer from outside.
        self.dev.connect_rc(
            qp,
            &th.ep,
            psn,
            AccessFlags::none(),
            want_rd.min(th.ep.rd_atomic),
            0,
        )?;
        Ok(th)
    }

    fn new_peer_cq(
        &self,
        id: PeerId,
        cqe: u32,
    ) -> Result<Arc<BasicCompletionQueue>, TransportError> {
        self.dev
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe)
            .setup_comp_channel(&self.channel, 0)
            // The progress thread gets this back with each event: the peer's id.
            .setup_cq_context(id.0 as usize as *mut c_void)
            .build()
            .map_err(|e| {
                TransportError::Setup(format!(
                    "completion queue on {}: {e} ({})",
                    self.dev.label(),
                    std::io::Error::last_os_error()
                ))
            })
    }
}

fn progress_loop(shared: Arc<Shared>, channel: Arc<CompletionChannel>) {
    let fd = channel.as_raw_fd();
    // SAFETY: the channel outlives this thread (we hold an Arc).
    let ch = unsafe { channel.comp_channel().as_ptr() };
    let timeout_ms = FALLBACK_POLL.as_millis() as libc::c_int;
    while !shared.stop.load(Ordering::SeqCst) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        let mut woke: Vec<u64> = Vec::new();
        if r > 0 {
            loop {
                let mut cq: *mut ibv_cq = std::ptr::null_mut();
                let mut ctx: *mut c_void = std::ptr::null_mut();
                // SAFETY: the channel is non-blocking; out-pointers are valid.
                if unsafe { ibv_get_cq_event(ch, &mut cq, &mut ctx) } != 0 {
                    break;
                }
                // Acknowledged at once: a CQ is destroyed only when all its events are.
                // SAFETY: `cq` came from the event just read.
                unsafe { ibv_ack_cq_events(cq, 1) };
                woke.push(ctx as usize as u64);
            }
        } else if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            log::error!(
                "verbs: poll on the completion channel failed: {}",
                std::io::Error::last_os_error()
            );
            std::thread::sleep(FALLBACK_POLL);
        }
        if woke.is_empty() {
            // Timeout (or a wake-up without an event): sweep every queue pair.
            if r > 0 {
                // Readable without an event to read: do not spin on it.
                std::thread::sleep(FALLBACK_POLL);
            }
            for p in shared.all_peers() {
                p.arm();
                p.drain(&shared);
            }
        } else {
            woke.sort_unstable();
            woke.dedup();
            for id in woke {
                if let Some(p) = shared.peer(PeerId(id)) {
                    // Re-arm before draining, so a completion that lands after the
                    // drain raises a new event.
                    p.arm();
                    p.drain(&shared);
                }
            }
        }
    }
}

/// Drops a queue pair (ibv_destroy_qp), turning sideway's panic on failure into an
/// error.
pub(crate) fn destroy_qp(qp: BasicQueuePair) -> Result<(), String> {
    let qpn = qp.qp_number();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(qp)))
        .map_err(|_| format!("destroying queue pair {qpn} failed"))
}

impl Transport for VerbsTransport {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn register_local(&self, buf: LocalBuffer) -> Result<(), TransportError> {
        if self.local.get().is_some() {
            return Err(TransportError::Setup(
                "a staging buffer is already registered".into(),
            ));
        }
        // LOCAL_WRITE: RDMA READs land in it. No remote access: only this process's
        // own work requests touch the staging buffer.
        // SAFETY: the caller keeps the buffer mapped for the transport's life.
        let mr = unsafe { self.dev.register(buf.ptr, buf.len, AccessFlags::LocalWrite) }.map_err(
            |e| {
                TransportError::Setup(format!(
                    "registering the staging buffer ({} bytes at {:p}) with {}: {e}",
                    buf.len,
                    buf.ptr,
                    self.dev.label()
                ))
            },
        )?;
        self.local
            .set(Local { buf, mr })
            .map_err(|_| TransportError::Setup("a staging buffer is already registered".into()))
    }

    fn connect(
        &self,
        meta: &serde_json::Value,
        bringup: &mut Bringup<'_>,
    ) -> Result<PeerId, TransportError> {
        let tm = TargetMeta::from_json(meta)?;
        self.local()?;
        let key = meta.get("verbs").cloned().unwrap_or_default();
        let _one_at_a_time = lock(&self.connect_lock);
        for (id, p) in lock(&self.shared.peers).iter() {
            let st = lock(&p.state);
            if p.meta == key && st.failed.is_none() && !st.fenced {
                return Ok(*id);
            }
        }
        let want_rd = self.dev.max_init_rd_atom;
        if want_rd == 0 {
            return Err(TransportError::Setup(format!(
                "{} allows no RDMA READ in flight",
                self.dev.label()
            )));
        }
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        let depth = SQ_DEPTH
            .min(self.dev.max_qp_wr)
            .min(self.dev.max_cqe.saturating_sub(1))
            .max(1);
        // Every work request is signalled, so at most `depth` completions are pending.
        let cq = self.new_peer_cq(id, depth + 1)?;
        let mut qp = self.dev.create_rc_qp(&cq, depth)?;
        let psn = device::random_psn();
        let th = match self.bring_up(&tm, &mut qp, psn, want_rd, bringup) {
            Ok(th) => th,
            Err(e) => {
                if let Err(d) = destroy_qp(qp) {
                    log::error!("verbs: {d}");
                }
                return Err(e);
            }
        };
        let label = format!(
            "{}:{} at {} (QPN {}, local QPN {} on {})",
            tm.device,
            tm.port,
            gid_to_string(&th.ep.gid),
            th.ep.qpn,
            qp.qp_number(),
            self.dev.label()
        );
        let peer = Arc::new(Peer {
            label,
            meta: key,
            qp: Mutex::new(Some(qp)),
            cq,
            state: Mutex::new(PeerState {
                inflight: VecDeque::new(),
                failed: None,
                fenced: false,
            }),
            room: Condvar::new(),
            sq_depth: depth as usize,
        });
        // Armed once it can be found: the progress thread looks the peer up by the
        // CQ's context when the event comes.
        lock(&self.shared.peers).insert(id, peer.clone());
        peer.arm();
        Ok(id)
    }

    fn post(&self, peer_id: PeerId, ops: &[Op]) -> Result<BatchId, TransportError> {
        let local = self.local()?;
        if ops.len() >= MAX_BATCH_OPS {
            return Err(TransportError::Setup(format!(
                "a batch holds at most {} operations ({} given)",
                MAX_BATCH_OPS - 1,
                ops.len()
            )));
        }
        for op in ops {
            local.buf.check(op.local_offset, op.len)?;
            if op.len > self.max_op_len {
                return Err(TransportError::LocalRange {
                    offset: op.local_offset,
                    len: op.len,
                });
            }
            if op.rkey > u64::from(u32::MAX) {
                return Err(TransportError::BadKey { rkey: op.rkey });
            }
        }
        let peer = self
            .shared
            .peer(peer_id)
            .ok_or(TransportError::NoPeer(peer_id))?;
        {
            let st = lock(&peer.state);
            if st.fenced {
                return Err(TransportError::NoPeer(peer_id));
            }
            if let Some(why) = &st.failed {
                return Err(peer.lost(format!("{why}; fence the peer and connect again")));
            }
        }
        let batch = BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed));
        self.shared.batches.insert(batch, ops.len());
        let mut failures: Vec<(BatchId, Option<TransportError>)> = Vec::new();
        {
            let qp_slot = lock(&peer.qp);
            let qp_ptr = match qp_slot.as_ref() {
                // SAFETY: the QP lives while `qp_slot` is held (fence takes it under
                // this lock).
                Some(qp) => unsafe { qp.qp().as_ptr() },
                None => std::ptr::null_mut(),
            };
            let deadline = Instant::now() + SQ_WAIT;
            let mut next = 0usize;
            while next < ops.len() {
                let mut st = lock(&peer.state);
                let mut stop: Option<String> = None;
                let room = loop {
                    if qp_ptr.is_null() || st.fenced {
                        stop = Some("the peer was fenced".into());
                        break 0;
                    }
                    if let Some(why) = &st.failed {
                        stop = Some(why.clone());
                        break 0;
                    }
                    let room = peer.sq_depth.saturating_sub(st.inflight.len());
                    if room > 0 {
                        break room;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        stop = Some(format!(
                            "the send queue stayed full for {} s",
                            SQ_WAIT.as_secs()
                        ));
                        break 0;
                    }
                    st = peer
                        .room
                        .wait_timeout(st, deadline - now)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                };
                if let Some(why) = stop {
                    for _ in next..ops.len() {
                        failures.push((batch, Some(peer.lost(why.clone()))));
                    }
                    break;
                }
                let n = room.min(ops.len() - next);
                let chunk = &ops[next..next + n];
                let mut sges: Vec<ibv_sge> = chunk
                    .iter()
                    .map(|op| ibv_sge {
                        addr: local.buf.ptr as u64 + op.local_offset,
                        length: op.len as u32,
                        lkey: local.mr.lkey(),
                    })
                    .collect();
                let mut wrs: Vec<ibv_send_wr> = Vec::with_capacity(n);
                for (i, op) in chunk.iter().enumerate() {
                    let index = (next + i) as u32;
                    // Fits: the batch size was checked against MAX_BATCH_OPS.
                    let wr_id = pack_wr_id(batch.0, index).unwrap_or(0);
                    // SAFETY: an all-zero ibv_send_wr is valid (null pointers, zero
                    // numbers, plain-data unions).
                    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
                    wr.wr_id = wr_id;
                    wr.opcode = match op.kind {
                        OpKind::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
                        OpKind::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                    };
                    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                    wr.wr = wr_t {
                        rdma: rdma_t {
                            remote_addr: op.remote_addr,
                            rkey: op.rkey as u32,
                        },
                    };
                    // A zero-length operation carries no scatter entry (some NICs
                    // read a zero SGE length as 2 GiB).
                    if op.len > 0 {
                        wr.sg_list = &mut sges[i];
                        wr.num_sge = 1;
                    }
                    wrs.push(wr);
                    st.inflight.push_back(Posted {
                        wr_id,
                        batch,
                        op: *op,
                    });
                }
                let base = wrs.as_mut_ptr();
                for i in 0..n.saturating_sub(1) {
                    // SAFETY: i + 1 < n = wrs.len(); the Vec is not resized any more.
                    unsafe { (*base.add(i)).next = base.add(i + 1) };
                }
                let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
                // SAFETY: the QP is alive (qp_slot held); the chain and its SGEs live
                // until the call returns (the NIC copies them into the send queue);
                // the SGEs point into the registered staging buffer (checked above).
                let rc = unsafe { ibv_post_send(qp_ptr, base, &mut bad) };
                if rc != 0 {
                    let posted = if bad.is_null() {
                        0
                    } else {
                        // SAFETY: `bad` points into `wrs`.
                        (unsafe { bad.offset_from(base) }).clamp(0, n as isize) as usize
                    };
                    let why = format!(
                        "ibv_post_send failed: {}",
                        std::io::Error::from_raw_os_error(rc)
                    );
                    // What the NIC did not take: its records come off the tail.
                    for _ in posted..n {
                        st.inflight.pop_back();
                    }
                    for _ in next + posted..ops.len() {
                        failures.push((batch, Some(peer.lost(why.clone()))));
                    }
                    if st.failed.is_none() {
                        st.failed = Some(why);
                    }
                    break;
                }
                next += n;
            }
        }
        self.shared.complete(failures);
        Ok(batch)
    }

    fn state(&self, batch: BatchId) -> BatchState {
        self.shared.batches.state(batch)
    }

    fn wait(&self, batch: BatchId, timeout: Duration) -> BatchState {
        self.shared.batches.wait(batch, timeout)
    }

    fn forget(&self, batch: BatchId) {
        self.shared.batches.forget(batch);
    }

    fn fence(&self, peer_id: PeerId) -> Result<(), TransportError> {
        let peer = lock(&self.shared.peers)
            .remove(&peer_id)
            .ok_or(TransportError::NoPeer(peer_id))?;
        {
            let mut st = lock(&peer.state);
            st.fenced = true;
            if st.failed.is_none() {
                st.failed = Some("the peer was fenced".into());
            }
        }
        // Wakes a post waiting for room; it gives up and lets go of the QP.
        peer.room.notify_all();
        let mut qp_slot = lock(&peer.qp);
        let mut problems: Vec<String> = Vec::new();
        if let Some(qp) = qp_slot.as_mut() {
            // ERR: the NIC stops the queue pair and flushes every posted request.
            if let Err(e) = device::to_error(qp) {
                problems.push(e.to_string());
            }
        }
        let deadline = Instant::now() + FENCE_TIMEOUT;
        let leftover: Vec<Posted> = loop {
            peer.drain(&self.shared);
            let mut st = lock(&peer.state);
            if st.inflight.is_empty() {
                break Vec::new();
            }
            let now = Instant::now();
            if now >= deadline {
                break st.inflight.drain(..).collect();
            }
            let wait = (deadline - now).min(Duration::from_millis(10));
            drop(peer.room.wait_timeout(st, wait));
        };
        if let Some(qp) = qp_slot.take() {
            if let Err(e) = destroy_qp(qp) {
                problems.push(e);
            }
        }
        drop(qp_slot);
        if !leftover.is_empty() {
            problems.insert(
                0,
                format!(
                    "{} work request(s) were not flushed within {} s (the queue pair was destroyed anyway; keep their slots out of use)",
                    leftover.len(),
                    FENCE_TIMEOUT.as_secs()
                ),
            );
        }
        let done = leftover
            .into_iter()
            .map(|p| (p.batch, Some(peer.lost("fenced before it completed"))))
            .collect();
        self.shared.complete(done);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(peer.lost(format!("fence: {}", problems.join("; "))))
        }
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        let ids: Vec<PeerId> = lock(&self.shared.peers).keys().copied().collect();
        for id in ids {
            if let Err(e) = self.fence(id) {
                log::warn!("verbs: closing peer {}: {e}", id.0);
            }
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = lock(&self.progress).take() {
            let _ = h.join();
        }
        // Then the fields: the staging registration, the channel (no CQ is left on
        // it), the protection domain and the device.
    }
}
