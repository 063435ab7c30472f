//! The memory-node side: memory registrations with remote access, and one responder
//! RC queue pair per worker.

use super::device::{self, Device, Mr};
use super::proto::{TargetHalf, TargetMeta, WorkerHalf};
use super::worker::destroy_qp;
use crate::transport::{Registration, Target, TransportError};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};
use sideway::ibverbs::AccessFlags;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

/// At most this many responder queue pairs; past it the oldest is destroyed (a worker
/// that still used it sees its operations fail and connects again).
pub const MAX_TARGET_QPS: usize = 1024;

struct TargetQp {
    qp: BasicQueuePair,
    _cq: Arc<BasicCompletionQueue>,
}

#[derive(Default)]
struct Qps {
    by_worker: HashMap<u64, TargetQp>,
    /// Worker ids, oldest first.
    order: VecDeque<u64>,
}

/// The verbs transport, memory-node side (see the [module documentation](super)).
pub struct VerbsTarget {
    dev: Device,
    instance: u64,
    mrs: Mutex<HashMap<u32, Mr>>,
    qps: Mutex<Qps>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl VerbsTarget {
    /// Opens `device` (`None`: the first RDMA device) at `port`; see
    /// [`VerbsTransport::open`](super::VerbsTransport::open).
    pub fn open(
        device: Option<&str>,
        port: u8,
        gid_index: Option<u8>,
    ) -> Result<VerbsTarget, TransportError> {
        Ok(VerbsTarget {
            dev: Device::open(device, port, gid_index)?,
            instance: device::random_u64(),
            mrs: Mutex::new(HashMap::new()),
            qps: Mutex::new(Qps::default()),
        })
    }

    /// The opened device's name.
    pub fn device(&self) -> &str {
        &self.dev.name
    }

    /// The metadata a worker needs to reach this target (in every registration).
    pub fn meta(&self) -> serde_json::Value {
        TargetMeta {
            device: self.dev.name.clone(),
            port: self.dev.port,
            lid: Some(self.dev.lid),
            gid: Some(self.dev.gid.raw),
            target: Some(self.instance),
        }
        .to_json()
    }

    /// Registrations alive.
    pub fn registrations(&self) -> usize {
        lock(&self.mrs).len()
    }

    /// Responder queue pairs alive.
    pub fn queue_pairs(&self) -> usize {
        lock(&self.qps).by_worker.len()
    }

    fn retire(&self, old: TargetQp, why: &str) {
        let qpn = old.qp.qp_number();
        if let Err(e) = destroy_qp(old.qp) {
            log::error!("verbs target: {e}");
        } else {
            log::debug!("verbs target: queue pair {qpn} destroyed ({why})");
        }
    }
}

impl Target for VerbsTarget {
    unsafe fn register(
        &self,
        ptr: *mut u8,
        len: u64,
        writable: bool,
    ) -> Result<Registration, TransportError> {
        let access = if writable {
            AccessFlags::RemoteRead | AccessFlags::RemoteWrite | AccessFlags::LocalWrite
        } else {
            AccessFlags::RemoteRead
        };
        let len_usize = usize::try_from(len)
            .map_err(|_| TransportError::Setup(format!("{len} bytes do not fit this host")))?;
        // SAFETY: the caller keeps the range mapped until deregister returns.
        let mr = unsafe { self.dev.register(ptr, len_usize, access) }.map_err(|e| {
            TransportError::Setup(format!(
                "registering {len} bytes at {ptr:p} with {}: {e}",
                self.dev.label()
            ))
        })?;
        let rkey = mr.rkey();
        match lock(&self.mrs).entry(rkey) {
            Entry::Vacant(v) => {
                v.insert(mr);
            }
            Entry::Occupied(_) => {
                // Two live registrations with one key: the NIC would never do that;
                // keep the old one, give the new one back.
                drop(mr);
                return Err(TransportError::Setup(format!(
                    "{} returned key {rkey:#x}, which is still registered",
                    self.dev.label()
                )));
            }
        }
        Ok(Registration {
            rkey: u64::from(rkey),
            addr: ptr as u64,
            transport: self.meta(),
        })
    }

    fn deregister(&self, rkey: u64) -> Result<(), TransportError> {
        let key = u32::try_from(rkey).map_err(|_| TransportError::BadKey { rkey })?;
        let mut mrs = lock(&self.mrs);
        let mr = mrs.remove(&key).ok_or(TransportError::BadKey { rkey })?;
        // ibv_dereg_mr returns once the NIC dropped the key: any later operation with
        // it gets a remote access error, and none is still touching the range.
        match mr.deregister() {
            Ok(()) => Ok(()),
            Err((mr, e)) => {
                mrs.insert(key, mr);
                Err(TransportError::Setup(format!(
                    "deregistering key {rkey:#x} on {}: {e}; it is still registered, retry",
                    self.dev.label()
                )))
            }
        }
    }

    fn accept_peer(&self, worker: &serde_json::Value) -> Result<serde_json::Value, TransportError> {
        let wh = WorkerHalf::from_json(worker)?;
        let resp = self.dev.max_rd_atom;
        if resp == 0 {
            return Err(TransportError::Setup(format!(
                "{} serves no RDMA READ (max_qp_rd_atom 0)",
                self.dev.label()
            )));
        }
        // A responder's send queue carries only READ responses and ACKs, generated by
        // the NIC; it posts nothing itself, and no completion is ever polled.
        let cq = self
            .dev
            .ctx
            .create_cq_builder()
            .setup_cqe(1)
            .build()
            .map_err(|e| {
                TransportError::Setup(format!(
                    "completion queue on {}: {e} ({})",
                    self.dev.label(),
                    std::io::Error::last_os_error()
                ))
            })?;
        let mut qp = self.dev.create_rc_qp(&cq, 1)?;
        let psn = device::random_psn();
        // What the queue pair lets in; each registration's own access flags decide
        // per region (read-only regions refuse WRITE at the NIC).
        let access = AccessFlags::RemoteRead | AccessFlags::RemoteWrite;
        if let Err(e) = self.dev.connect_rc(&mut qp, &wh.ep, psn, access, 0, resp) {
            let _ = destroy_qp(qp);
            return Err(e);
        }
        let ours = TargetHalf {
            ep: self.dev.endpoint(qp.qp_number(), psn, resp),
        };
        let mut qps = lock(&self.qps);
        if let Some(old) = qps.by_worker.remove(&wh.worker) {
            qps.order.retain(|w| *w != wh.worker);
            self.retire(old, "the worker connected again");
        }
        while qps.by_worker.len() >= MAX_TARGET_QPS {
            let Some(oldest) = qps.order.pop_front() else {
                break;
            };
            if let Some(old) = qps.by_worker.remove(&oldest) {
                self.retire(old, "too many queue pairs");
            }
        }
        qps.by_worker.insert(wh.worker, TargetQp { qp, _cq: cq });
        qps.order.push_back(wh.worker);
        Ok(ours.to_json())
    }
}

impl Drop for VerbsTarget {
    fn drop(&mut self) {
        // Queue pairs first, then the registrations (their Drop deregisters).
        let qps = std::mem::take(&mut *lock(&self.qps));
        for (_, q) in qps.by_worker {
            self.retire(q, "target closed");
        }
    }
}
