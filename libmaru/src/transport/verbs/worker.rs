//! The worker side's driver: opens the device, brings queue pairs up, and runs one
//! progress thread that waits (poll(2), no spinning) on the completion channel and
//! the device's async-event fd, handing what it reads to the [`Engine`].

use super::device::{self, Device, Mr};
use super::engine::{Engine, EngineConfig, LocalReg};
use super::lanes::Lanes;
use super::ops::{Access, QueuePairOps};
use super::proto::{gid_to_string, TargetHalf, TargetMeta, WorkerHalf};
use super::settings::{EventAction, VerbsSettings};
use super::sys::RawQp;
use crate::transport::{
    BatchId, BatchState, Bringup, LocalBuffer, Op, PeerId, Staging, Transport, TransportError,
};
use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_event_type, ibv_get_cq_event};
use sideway::ibverbs::completion::CompletionChannel;
use std::ffi::c_void;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Send-queue depth per queue pair (clamped to the device's limit).
const SQ_DEPTH: u32 = 1024;
/// The progress thread's fallback: it sweeps every completion queue this often even
/// without an event (an event fd that never fires cannot stall a batch forever).
pub(crate) const FALLBACK_POLL: Duration = Duration::from_millis(100);
/// How long a fence waits for the flushed completions of its queue pair.
pub(crate) const FENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a backlog may find no send-queue room before its operations fail.
const SQ_WAIT: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Local {
    reg: LocalReg,
    _mr: Mr,
}

struct Shared {
    engine: Engine,
    /// The peers the worker holds: groups of queue pairs (lanes) to one agent.
    lanes: Lanes,
    /// Queue pairs per agent.
    qps_per_agent: u8,
    dev: Arc<Device>,
    stop: AtomicBool,
}

/// The verbs transport, worker side (see the [module documentation](super)).
pub struct VerbsTransport {
    shared: Arc<Shared>,
    instance: u64,
    channel: Arc<CompletionChannel>,
    local: Staging<Local>,
    connect_lock: Mutex<()>,
    progress: Mutex<Option<JoinHandle<()>>>,
    next_peer: AtomicU64,
    max_op_len: u64,
}

impl VerbsTransport {
    /// Opens the device and port of `settings` and starts the progress thread (traffic
    /// class and service level apply to every queue pair it brings up). Without a
    /// device, or without rdma-core, fails with [`TransportError::Unavailable`] naming
    /// the device looked for.
    pub fn open_with(settings: &VerbsSettings) -> Result<VerbsTransport, TransportError> {
        let dev = Arc::new(Device::open(settings)?);
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
        let async_fd = dev.async_fd()?;
        let max_op_len = match dev.max_msg {
            0 => 1 << 31,
            n => u64::from(n),
        };
        let shared = Arc::new(Shared {
            engine: Engine::new(EngineConfig {
                fence_timeout: FENCE_TIMEOUT,
                sq_wait: SQ_WAIT,
            }),
            lanes: Lanes::default(),
            qps_per_agent: settings.qps_per_agent.max(1),
            dev,
            stop: AtomicBool::new(false),
        });
        let (sh, ch) = (shared.clone(), channel.clone());
        let handle = std::thread::Builder::new()
            .name("verbs-progress".into())
            .spawn(move || progress_loop(sh, ch, async_fd))
            .map_err(|e| TransportError::Setup(format!("starting the progress thread: {e}")))?;
        Ok(VerbsTransport {
            instance: device::random_u64(),
            shared,
            channel,
            local: Staging::default(),
            connect_lock: Mutex::new(()),
            progress: Mutex::new(Some(handle)),
            next_peer: AtomicU64::new(1),
            max_op_len,
        })
    }

    /// The opened device's name (`mlx5_0`).
    pub fn device(&self) -> &str {
        &self.shared.dev.name
    }

    /// The opened port.
    pub fn port(&self) -> u8 {
        self.shared.dev.port
    }

    fn local(&self) -> Result<&Local, TransportError> {
        self.local.get()
    }

    /// Sends our half, takes the target's, and moves `qp` to RTS.
    fn bring_up(
        &self,
        tm: &TargetMeta,
        qp: &RawQp,
        psn: u32,
        want_rd: u8,
        bringup: &mut Bringup<'_>,
    ) -> Result<TargetHalf, TransportError> {
        let dev = &self.shared.dev;
        let half = WorkerHalf {
            worker: self.instance,
            ep: dev.endpoint(qp.qpn(), psn, want_rd),
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
        qp.connect(dev, &th.ep, psn, 0, want_rd.min(th.ep.rd_atomic), 0)?;
        Ok(th)
    }
}

/// Reads every pending async event and acts on it; returns how many it read.
fn read_async_events(shared: &Shared) -> usize {
    let label = shared.dev.label();
    shared
        .dev
        .read_async_events(|action, kind, qpn| match action {
            EventAction::FailQp => {
                log::error!(
                    "verbs: async event {kind} on queue pair {qpn} of {label}: the peer fails"
                );
                shared
                    .engine
                    .fail_qpn(qpn, &format!("async event {kind} (queue pair error)"));
            }
            EventAction::FailAll => {
                log::error!(
                    "verbs: async event {kind} on {label} (port or device error): every peer fails"
                );
                shared.engine.fail_all(&format!(
                    "async event {kind} on {label} (port or device error)"
                ));
            }
            EventAction::RefreshAddress => {
                log::info!("verbs: async event {kind} on {label}: reading LID and GID again");
                if let Err(e) = shared.dev.refresh_address() {
                    log::warn!("verbs: {e}");
                }
                if kind == ibv_event_type::IBV_EVENT_GID_CHANGE as u32 {
                    // Queue pairs were brought up with the old GID: the peers must be
                    // connected again.
                    shared.engine.fail_all("the port's GID changed");
                }
            }
            EventAction::Ignore => log::debug!("verbs: async event {kind} on {label}"),
        })
}

fn progress_loop(shared: Arc<Shared>, channel: Arc<CompletionChannel>, async_fd: i32) {
    let fd = channel.as_raw_fd();
    // SAFETY: the channel outlives this thread (we hold an Arc).
    let ch = unsafe { channel.comp_channel().as_ptr() };
    let timeout_ms = FALLBACK_POLL.as_millis() as libc::c_int;
    let mut last_sweep = Instant::now();
    while !shared.stop.load(Ordering::SeqCst) {
        let mut pfd = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: async_fd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let r = unsafe { libc::poll(pfd.as_mut_ptr(), 2, timeout_ms) };
        if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            log::error!(
                "verbs: poll on the completion channel failed: {}",
                std::io::Error::last_os_error()
            );
            std::thread::sleep(FALLBACK_POLL);
        }
        let mut idle_wakeup = false;
        if r > 0 && pfd[1].revents != 0 && read_async_events(&shared) == 0 {
            idle_wakeup = true;
        }
        let mut woke: Vec<u64> = Vec::new();
        if r > 0 && pfd[0].revents != 0 {
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
            idle_wakeup |= woke.is_empty();
        }
        if idle_wakeup {
            // Readable without an event to read (an fd in an error state): do not
            // spin on it.
            std::thread::sleep(FALLBACK_POLL);
        }
        let now = Instant::now();
        woke.sort_unstable();
        woke.dedup();
        for id in woke {
            shared.engine.service(PeerId(id), now);
        }
        if now.duration_since(last_sweep) >= FALLBACK_POLL || r == 0 {
            // A lost or never-armed event delays a batch by at most FALLBACK_POLL.
            shared.engine.sweep(now);
            last_sweep = now;
        }
    }
}

impl Transport for VerbsTransport {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn register_local(&self, buf: LocalBuffer) -> Result<(), TransportError> {
        self.local.register(|| {
            let dev = &self.shared.dev;
            // LOCAL_WRITE: RDMA READs land in it. No remote access: only this process's
            // own work requests touch the staging buffer.
            // SAFETY: the caller keeps the buffer mapped for the transport's life.
            let mr =
                unsafe { dev.register(buf.ptr, buf.len, Access::LocalWriteOnly) }.map_err(|e| {
                    TransportError::Setup(format!(
                        "registering the staging buffer ({} bytes at {:p}) with {}: {e}",
                        buf.len,
                        buf.ptr,
                        dev.label()
                    ))
                })?;
            let reg = LocalReg {
                buf,
                lkey: mr.lkey(),
                max_op_len: self.max_op_len,
            };
            Ok(Local { reg, _mr: mr })
        })
    }

    fn connect(
        &self,
        meta: &serde_json::Value,
        bringup: &mut Bringup<'_>,
    ) -> Result<PeerId, TransportError> {
        let tm = TargetMeta::from_json(meta)?;
        let lkey = self.local()?.reg.lkey;
        let key = meta.get("verbs").cloned().unwrap_or_default();
        let _one_at_a_time = lock(&self.connect_lock);
        let sh = &self.shared;
        if let Some(id) = sh.lanes.find_usable(&sh.engine, &key) {
            return Ok(id);
        }
        let dev = &sh.dev;
        let want_rd = dev.max_init_rd_atom;
        if want_rd == 0 {
            return Err(TransportError::Setup(format!(
                "{} allows no RDMA READ in flight",
                dev.label()
            )));
        }
        let depth = SQ_DEPTH
            .min(dev.max_qp_wr)
            .min(dev.max_cqe.saturating_sub(1))
            .max(1);
        // Every lane is brought up before any is used: a failure drops (destroys) the
        // ones made so far.
        let mut made = Vec::new();
        for _ in 0..sh.qps_per_agent {
            let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
            // Every work request is signalled, so at most `depth` completions are
            // pending; the progress thread gets the lane's id back with each event.
            let qp = RawQp::create(dev, &dev.pd, Some(&self.channel), id.0, depth)?;
            let psn = device::random_psn();
            // On failure `qp` is dropped: destroyed, a failure logged (never a panic).
            let th = self.bring_up(&tm, &qp, psn, want_rd, bringup)?;
            let label = format!(
                "{}:{} at {} (QPN {}, local QPN {} on {})",
                tm.device,
                tm.port,
                gid_to_string(&th.ep.gid),
                th.ep.qpn,
                qp.qpn(),
                dev.label()
            );
            made.push((id, label, qp));
        }
        let mut lanes = Vec::with_capacity(made.len());
        for (id, label, qp) in made {
            sh.engine
                .add_peer(id, label, key.clone(), Arc::new(qp), depth as usize, lkey);
            lanes.push(id);
        }
        let group = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        sh.lanes.add(&sh.engine, group, key, lanes);
        Ok(group)
    }

    fn post(&self, peer_id: PeerId, ops: &[Op]) -> Result<BatchId, TransportError> {
        let local = self.local()?;
        let sh = &self.shared;
        sh.lanes
            .post(&sh.engine, peer_id, ops, &local.reg, Instant::now())
    }

    fn state(&self, batch: BatchId) -> BatchState {
        self.shared.engine.batches.state(batch)
    }

    fn wait(&self, batch: BatchId, timeout: Duration) -> BatchState {
        self.shared.engine.batches.wait(batch, timeout)
    }

    fn forget(&self, batch: BatchId) {
        self.shared.engine.batches.forget(batch);
    }

    fn fence(&self, peer_id: PeerId) -> Result<(), TransportError> {
        self.shared.lanes.fence(&self.shared.engine, peer_id)
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        let undestroyed = self.shared.engine.close();
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = lock(&self.progress).take() {
            let _ = h.join();
        }
        if undestroyed {
            log::error!(
                "verbs: some queue pairs of {} could not be destroyed; they and the staging registration are leaked",
                self.shared.dev.label()
            );
            // The staging buffer stays registered: a queue pair that may still DMA
            // into it must find it registered, and the caller must not reuse it.
            if let Some(l) = self.local.take() {
                std::mem::forget(l);
            }
        }
        // Then the fields: the staging registration, the channel (the RawQps that
        // could not be destroyed hold a reference that is never released), the
        // protection domain and the device.
    }
}
