//! The memory-node side: memory registrations with remote access, and responder RC
//! queue pairs owned by the agent connection that brought them up
//! (`QpTable`, `qp_table.rs`). Each connection has its own protection domain
//! (`Domains`, `domains.rs`) holding its registrations and its queue pairs, so the
//! NIC refuses a key presented by another connection's queue pair.

use super::device::{self, Device, MrTable};
use super::domains::Domains;
use super::ops::{Access, QueuePairOps};
use super::proto::{TargetHalf, TargetMeta, WorkerHalf};
use super::qp_table::{QpOwner, QpTable};
use super::settings::EventAction;
use super::settings::VerbsSettings;
use super::sys::RawQp;
use crate::transport::{Registration, Target, TransportError};
use rdma_mummy_sys::ibv_access_flags;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// At most this many responder queue pairs; past it a new one is refused (only
/// queue pairs brought up without a connection are evicted to make room).
pub const MAX_TARGET_QPS: usize = 1024;
/// At most this many per agent connection; a connection's newest replaces its oldest.
pub const MAX_QPS_PER_CONNECTION: usize = 16;

/// The verbs transport, memory-node side (see the [module documentation](super)).
pub struct VerbsTarget {
    dev: Arc<Device>,
    instance: u64,
    domains: Mutex<Domains<MrTable>>,
    qps: Arc<Mutex<QpTable>>,
    stop: Arc<AtomicBool>,
    events: Option<JoinHandle<()>>,
}

/// How often the target's event thread wakes without an event (it then retries the
/// destroy of queue pairs whose destroy failed).
const EVENT_TICK: Duration = Duration::from_millis(500);

/// Off the agent's event loop: reads the device's async events (a port, LID or GID
/// change re-reads the address put in every registration's metadata; errors are
/// logged — the worker side sees its own operations fail and connects again) and
/// retries failed queue-pair destroys.
fn event_loop(dev: Arc<Device>, qps: Arc<Mutex<QpTable>>, stop: Arc<AtomicBool>, fd: i32) {
    let label = dev.label();
    while !stop.load(Ordering::SeqCst) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, EVENT_TICK.as_millis() as libc::c_int) };
        if r > 0 {
            let n = dev.read_async_events(|action, kind, qpn| match action {
                EventAction::RefreshAddress => {
                    log::info!("verbs target: async event {kind} on {label}: reading LID and GID again");
                    if let Err(e) = dev.refresh_address() {
                        log::warn!("verbs target: {e}");
                    }
                }
                EventAction::FailQp => log::warn!(
                    "verbs target: async event {kind} on responder queue pair {qpn} of {label}; its worker sees its operations fail and connects again"
                ),
                EventAction::FailAll => {
                    log::error!("verbs target: async event {kind} on {label} (port or device error)")
                }
                EventAction::Ignore => log::debug!("verbs target: async event {kind} on {label}"),
            });
            if n == 0 {
                // Readable without an event: do not spin.
                std::thread::sleep(EVENT_TICK);
            }
        } else if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            log::error!(
                "verbs target: poll on the async event fd failed: {}",
                std::io::Error::last_os_error()
            );
            std::thread::sleep(EVENT_TICK);
        }
        let mut t = lock(&qps);
        if t.zombies() > 0 {
            t.retry();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl VerbsTarget {
    /// Opens the device and port of `settings`; see
    /// [`VerbsTransport::open_with`](super::VerbsTransport::open_with).
    pub fn open_with(settings: &VerbsSettings) -> Result<VerbsTarget, TransportError> {
        let dev = Arc::new(Device::open(settings)?);
        let fd = dev.async_fd()?;
        let qps = Arc::new(Mutex::new(QpTable::new(
            MAX_TARGET_QPS,
            MAX_QPS_PER_CONNECTION,
        )));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, q, st) = (dev.clone(), qps.clone(), stop.clone());
        let events = std::thread::Builder::new()
            .name("verbs-target-events".into())
            .spawn(move || event_loop(d, q, st, fd))
            .map_err(|e| TransportError::Setup(format!("starting the event thread: {e}")))?;
        Ok(VerbsTarget {
            domains: Mutex::new(Domains::new({
                let dev = dev.clone();
                Box::new(move || MrTable::new(dev.clone()))
            })),
            dev,
            instance: device::random_u64(),
            qps,
            stop,
            events: Some(events),
        })
    }

    /// The opened device's name.
    pub fn device(&self) -> &str {
        &self.dev.name
    }

    /// The metadata a worker needs to reach this target (in every registration).
    pub fn meta(&self) -> serde_json::Value {
        let (lid, gid) = self.dev.lid_gid();
        TargetMeta {
            device: self.dev.name.clone(),
            port: self.dev.port,
            lid: Some(lid),
            gid: Some(gid),
            target: Some(self.instance),
        }
        .to_json()
    }

    /// Registrations alive.
    pub fn registrations(&self) -> usize {
        lock(&self.domains).registrations()
    }

    /// Protection domains kept (one per connection with registrations or open).
    pub fn protection_domains(&self) -> usize {
        lock(&self.domains).len()
    }

    /// Responder queue pairs alive.
    pub fn queue_pairs(&self) -> usize {
        lock(&self.qps).len()
    }

    /// Responder queue pairs whose destroy failed (retried by [`VerbsTarget::sweep`]).
    pub fn undestroyed_queue_pairs(&self) -> usize {
        lock(&self.qps).zombies()
    }

    /// Brings up a responder queue pair owned by agent connection `conn` (answers the
    /// worker's half with ours).
    pub fn accept_peer_on(
        &self,
        conn: u64,
        worker: &serde_json::Value,
    ) -> Result<serde_json::Value, TransportError> {
        self.accept(QpOwner::Connection(conn), worker)
    }

    /// Agent connection `conn` closed: its responder queue pairs are destroyed (a
    /// failed destroy is retried by [`VerbsTarget::sweep`]).
    pub fn connection_closed(&self, conn: u64) -> usize {
        let n = lock(&self.qps).close(QpOwner::Connection(conn));
        lock(&self.domains).close(QpOwner::Connection(conn));
        n
    }

    /// Retries the destroy of queue pairs whose destroy failed.
    pub fn sweep(&self) {
        lock(&self.qps).retry();
    }

    fn accept(
        &self,
        owner: QpOwner,
        worker: &serde_json::Value,
    ) -> Result<serde_json::Value, TransportError> {
        let wh = WorkerHalf::from_json(worker)?;
        let resp = self.dev.max_rd_atom;
        if resp == 0 {
            return Err(TransportError::Setup(format!(
                "{} serves no RDMA READ (max_qp_rd_atom 0)",
                self.dev.label()
            )));
        }
        let owner = match owner {
            QpOwner::Unbound(_) => QpOwner::Unbound(wh.worker),
            o => o,
        };
        lock(&self.qps).admit(owner)?;
        // In the owner's protection domain: it reaches the owner's registrations only.
        let domain = lock(&self.domains).domain(owner)?;
        // A responder's send queue carries only READ responses and ACKs, generated by
        // the NIC; it posts nothing itself, and no completion is ever polled.
        let qp = RawQp::create(&self.dev, domain.pd(), None, 0, 1)?;
        let psn = device::random_psn();
        // What the queue pair lets in; each registration's own access flags decide
        // per region (read-only regions refuse WRITE at the NIC).
        let access = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        qp.connect(&self.dev, &wh.ep, psn, access, 0, resp)?;
        let ours = TargetHalf {
            ep: self.dev.endpoint(qp.qpn(), psn, resp),
        };
        if let Err(e) = lock(&self.qps).insert(owner, Arc::new(qp)) {
            // Its connection closed during the bring-up: the domain made for it goes.
            lock(&self.domains).close(owner);
            return Err(e);
        }
        Ok(ours.to_json())
    }
}

impl Target for VerbsTarget {
    unsafe fn register(
        &self,
        owner: u64,
        ptr: *mut u8,
        len: u64,
        writable: bool,
    ) -> Result<Registration, TransportError> {
        let access = if writable {
            Access::RemoteReadWrite
        } else {
            Access::RemoteRead
        };
        let len_usize = usize::try_from(len)
            .map_err(|_| TransportError::Setup(format!("{len} bytes do not fit this host")))?;
        // SAFETY: the caller keeps the range mapped until deregister returns.
        let keys = unsafe {
            lock(&self.domains).register(QpOwner::Connection(owner), ptr, len_usize, access)
        }?;
        Ok(Registration {
            rkey: u64::from(keys.rkey),
            addr: ptr as u64,
            transport: self.meta(),
        })
    }

    fn deregister(&self, rkey: u64) -> Result<(), TransportError> {
        let key = u32::try_from(rkey).map_err(|_| TransportError::BadKey { rkey })?;
        lock(&self.domains).deregister(key)
    }

    fn owner_closed(&self, owner: u64) {
        self.connection_closed(owner);
    }

    /// Without a connection to own it: keyed by the worker's declared id (see
    /// [`QpOwner::Unbound`]). The agent uses [`VerbsTarget::accept_peer_on`].
    fn accept_peer(&self, worker: &serde_json::Value) -> Result<serde_json::Value, TransportError> {
        self.accept(QpOwner::Unbound(0), worker)
    }
}

impl Drop for VerbsTarget {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.events.take() {
            let _ = h.join();
        }
        // Queue pairs first, then the registrations (their Drop deregisters).
        let left = lock(&self.qps).close_all();
        if left > 0 {
            log::error!("verbs target: {left} queue pair(s) could not be destroyed at close");
        }
    }
}
