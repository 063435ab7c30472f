//! [`QueuePairOps`] over rdma-core: an RC queue pair and its own completion queue.
//!
//! Both are created and destroyed with direct calls (`ibv_create_qp`/`ibv_destroy_qp`,
//! `ibv_create_cq`/`ibv_destroy_cq`), not with sideway's owning types: sideway's drops
//! `assert!` that the destroy succeeded, and a failed destroy (a queue pair the NIC
//! still holds) must be an error that is retried, never a panic on the progress
//! thread. The device, protection domain and completion channel stay sideway's.
//! A queue pair whose destroy never succeeded keeps its completion channel alive for
//! the rest of the process (the channel's own drop would assert on its busy CQ).

use super::device::Device;
use super::ops::{Completion, PostRefused, QueuePairOps, WorkRequest};
use super::proto::{gid_to_string, Endpoint};
use crate::transport::{OpKind, TransportError};
use rdma_mummy_sys::{
    ibv_cq, ibv_create_cq, ibv_create_qp, ibv_destroy_cq, ibv_destroy_qp, ibv_modify_qp, ibv_mtu,
    ibv_poll_cq, ibv_post_send, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_cap,
    ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_req_notify_cq, ibv_send_flags, ibv_send_wr,
    ibv_sge, ibv_wc, ibv_wr_opcode, rdma_t, wr_t,
};
use sideway::ibverbs::completion::CompletionChannel;
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use std::ffi::c_void;
use std::io;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard};

/// Hop limit in the GRH (RoCE v2 may be routed).
const HOP_LIMIT: u8 = 64;
/// Local ACK timeout exponent: 4.096 µs · 2^14 ≈ 67 ms per try.
const ACK_TIMEOUT: u8 = 14;
/// Transport retries and RNR retries (7 = the maximum; RNR 7 means "forever", but
/// one-sided READ/WRITE never meet receiver-not-ready).
const RETRY_CNT: u8 = 7;
const RNR_RETRY: u8 = 7;
const MIN_RNR_TIMER: u8 = 12;

fn os(rc: i32) -> io::Error {
    if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        io::Error::last_os_error()
    }
}

#[derive(Default)]
struct Alive {
    qp: bool,
    cq: bool,
}

/// An RC queue pair with its own completion queue.
pub(crate) struct RawQp {
    qp: *mut ibv_qp,
    cq: *mut ibv_cq,
    qpn: u32,
    alive: Mutex<Alive>,
    /// Kept alive while the queue pair may exist; leaked with it (see the module doc).
    channel: ManuallyDrop<Option<Arc<CompletionChannel>>>,
    _pd: Arc<ProtectionDomain>,
    _ctx: Arc<DeviceContext>,
}

// SAFETY: rdma-core's queue-pair and completion-queue calls are thread-safe; the
// destroy state is behind a mutex, and every other call happens only while `alive`
// says the object exists (destroy is serialized with them by the engine's locks).
unsafe impl Send for RawQp {}
unsafe impl Sync for RawQp {}

impl RawQp {
    /// Creates a completion queue of `depth + 1` entries (on `channel`, reporting
    /// `cq_context` with each event) and an RC queue pair of `depth` send entries on
    /// it, in protection domain `pd` (it reaches only that domain's registrations).
    pub fn create(
        dev: &Device,
        pd: &Arc<ProtectionDomain>,
        channel: Option<&Arc<CompletionChannel>>,
        cq_context: u64,
        depth: u32,
    ) -> Result<RawQp, TransportError> {
        // SAFETY: the context and the channel are alive (held by `dev`/`channel`).
        let ctx = unsafe { dev.ctx.context().as_ptr() };
        let ch = match channel {
            // SAFETY: as above.
            Some(c) => unsafe { c.comp_channel().as_ptr() },
            None => std::ptr::null_mut(),
        };
        let cqe = i32::try_from(depth.saturating_add(1)).unwrap_or(i32::MAX);
        // SAFETY: valid context; a null channel means "no events".
        let cq = unsafe { ibv_create_cq(ctx, cqe, cq_context as usize as *mut c_void, ch, 0) };
        if cq.is_null() {
            return Err(TransportError::Setup(format!(
                "completion queue of {cqe} entries on {}: {}",
                dev.label(),
                io::Error::last_os_error()
            )));
        }
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: depth.max(1),
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid PD and init attributes.
        let qp = unsafe { ibv_create_qp(pd.pd().as_ptr(), &mut init) };
        if qp.is_null() {
            let e = io::Error::last_os_error();
            // SAFETY: the CQ was just created and nothing else uses it.
            let rc = unsafe { ibv_destroy_cq(cq) };
            let mut channel = channel.cloned();
            if rc != 0 {
                log::error!(
                    "verbs: destroying an unused completion queue failed: {}",
                    os(rc)
                );
                // The channel must outlive the CQ: leak one reference.
                std::mem::forget(channel.take());
            }
            return Err(TransportError::Setup(format!(
                "creating an RC queue pair on {}: {e}",
                dev.label()
            )));
        }
        // SAFETY: `qp` is valid.
        let qpn = unsafe { (*qp).qp_num };
        Ok(RawQp {
            qp,
            cq,
            qpn,
            alive: Mutex::new(Alive { qp: true, cq: true }),
            channel: ManuallyDrop::new(channel.cloned()),
            _pd: pd.clone(),
            _ctx: dev.ctx.clone(),
        })
    }

    fn alive(&self) -> MutexGuard<'_, Alive> {
        self.alive.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the queue pair to `state` with the attributes `set` writes (into an
    /// otherwise all-zero `ibv_qp_attr`) and `mask` names (the state aside).
    fn move_to(
        &self,
        state: ibv_qp_state::Type,
        mask: ibv_qp_attr_mask,
        set: impl FnOnce(&mut ibv_qp_attr),
    ) -> Result<(), io::Error> {
        // SAFETY: an all-zero ibv_qp_attr is valid plain data.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        set(&mut attr);
        let mask = mask | ibv_qp_attr_mask::IBV_QP_STATE;
        let alive = self.alive();
        if !alive.qp {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: the QP is alive (checked under the lock that destroy takes).
        let rc = unsafe { ibv_modify_qp(self.qp, &mut attr, mask.0 as i32) };
        if rc == 0 {
            Ok(())
        } else {
            Err(os(rc))
        }
    }

    /// RESET → INIT → RTR → RTS towards `remote`. `access`: the remote operations
    /// this queue pair accepts (`IBV_ACCESS_*` bits); `max_rd_atomic`: READs this side
    /// issues at once; `max_dest_rd_atomic`: READs it serves at once.
    pub fn connect(
        &self,
        dev: &Device,
        remote: &Endpoint,
        psn: u32,
        access: u32,
        max_rd_atomic: u8,
        max_dest_rd_atomic: u8,
    ) -> Result<(), TransportError> {
        let step = |s: &str, e: io::Error| {
            TransportError::Setup(format!(
                "queue pair {} on {} towards QPN {} at {}: {s}: {e}",
                self.qpn,
                dev.label(),
                remote.qpn,
                gid_to_string(&remote.gid)
            ))
        };
        use ibv_qp_attr_mask as m;
        let init = m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS;
        self.move_to(ibv_qp_state::IBV_QPS_INIT, init, |a| {
            a.pkey_index = 0;
            a.port_num = dev.port;
            a.qp_access_flags = access;
        })
        .map_err(|e| step("RESET→INIT", e))?;

        let (_, gid_index) = dev.address();
        let rtr = m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        self.move_to(ibv_qp_state::IBV_QPS_RTR, rtr, |a| {
            a.path_mtu = mtu_code(dev.mtu.min(remote.mtu));
            a.dest_qp_num = remote.qpn;
            a.rq_psn = remote.psn;
            a.max_dest_rd_atomic = max_dest_rd_atomic;
            a.min_rnr_timer = MIN_RNR_TIMER;
            a.ah_attr.dlid = remote.lid;
            a.ah_attr.sl = dev.settings.service_level;
            a.ah_attr.port_num = dev.port;
            if dev.ethernet || remote.lid == 0 {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = remote.gid;
                a.ah_attr.grh.sgid_index = gid_index;
                a.ah_attr.grh.hop_limit = HOP_LIMIT;
                a.ah_attr.grh.traffic_class = dev.settings.traffic_class;
            }
        })
        .map_err(|e| step("INIT→RTR", e))?;

        let rts = m::IBV_QP_SQ_PSN
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        self.move_to(ibv_qp_state::IBV_QPS_RTS, rts, |a| {
            a.sq_psn = psn;
            a.timeout = ACK_TIMEOUT;
            a.retry_cnt = RETRY_CNT;
            a.rnr_retry = RNR_RETRY;
            a.max_rd_atomic = max_rd_atomic;
        })
        .map_err(|e| step("RTR→RTS", e))
    }
}

fn mtu_code(bytes: u32) -> ibv_mtu::Type {
    match bytes {
        0..=256 => ibv_mtu::IBV_MTU_256,
        257..=512 => ibv_mtu::IBV_MTU_512,
        513..=1024 => ibv_mtu::IBV_MTU_1024,
        1025..=2048 => ibv_mtu::IBV_MTU_2048,
        _ => ibv_mtu::IBV_MTU_4096,
    }
}

impl QueuePairOps for RawQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn post(&self, chain: &[WorkRequest]) -> Result<(), PostRefused> {
        if chain.is_empty() {
            return Ok(());
        }
        let alive = self.alive();
        if !alive.qp {
            return Err(PostRefused {
                first_bad: 0,
                errno: libc::EINVAL,
            });
        }
        let mut sges: Vec<ibv_sge> = chain
            .iter()
            .map(|w| ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        let mut wrs: Vec<ibv_send_wr> = Vec::with_capacity(chain.len());
        for (i, w) in chain.iter().enumerate() {
            // SAFETY: an all-zero ibv_send_wr is valid (null pointers, zero numbers,
            // plain-data unions).
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = w.wr_id;
            wr.opcode = match w.kind {
                OpKind::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
                OpKind::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            };
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.wr = wr_t {
                rdma: rdma_t {
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                },
            };
            // A zero-length operation carries no scatter entry (some NICs read a zero
            // SGE length as 2 GiB).
            if w.len > 0 {
                wr.sg_list = &mut sges[i];
                wr.num_sge = 1;
            }
            wrs.push(wr);
        }
        let base = wrs.as_mut_ptr();
        for i in 0..chain.len() - 1 {
            // SAFETY: i + 1 < wrs.len(); the Vec is not resized any more.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (lock held); the chain and its SGEs live until the
        // call returns (the NIC copies them into the send queue); the SGEs point into
        // the registered staging buffer (checked by the engine).
        let rc = unsafe { ibv_post_send(self.qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let first_bad = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into `wrs`.
            (unsafe { bad.offset_from(base) }).clamp(0, chain.len() as isize) as usize
        };
        Err(PostRefused {
            first_bad,
            errno: rc,
        })
    }

    fn poll(&self, out: &mut Vec<Completion>) -> Result<(), String> {
        let alive = self.alive();
        if !alive.cq {
            return Ok(());
        }
        const N: usize = 32;
        // SAFETY: ibv_wc is plain data.
        let mut wcs: [ibv_wc; N] = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: the CQ is alive; `wcs` holds N entries.
            let n = unsafe { ibv_poll_cq(self.cq, N as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(format!("ibv_poll_cq returned {n}"));
            }
            for wc in &wcs[..n as usize] {
                out.push(Completion {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    vendor_err: wc.vendor_err,
                });
            }
            if (n as usize) < N {
                return Ok(());
            }
        }
    }

    fn arm(&self) -> Result<(), String> {
        let alive = self.alive();
        if !alive.cq {
            return Ok(());
        }
        // SAFETY: the CQ is alive.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("ibv_req_notify_cq: {}", os(rc)))
        }
    }

    fn to_error(&self) -> Result<(), String> {
        self.move_to(ibv_qp_state::IBV_QPS_ERR, ibv_qp_attr_mask(0), |_| {})
            .map_err(|e| format!("queue pair {} → ERR: {e}", self.qpn))
    }

    fn destroy(&self) -> Result<(), String> {
        let mut alive = self.alive();
        if alive.qp {
            // SAFETY: the QP is alive; no other call runs on it (lock held).
            let rc = unsafe { ibv_destroy_qp(self.qp) };
            if rc != 0 {
                return Err(format!("ibv_destroy_qp({}): {}", self.qpn, os(rc)));
            }
            alive.qp = false;
        }
        if alive.cq {
            // SAFETY: the CQ is alive and its QP is gone.
            let rc = unsafe { ibv_destroy_cq(self.cq) };
            if rc != 0 {
                // The queue pair is gone (the NIC executes nothing of it any more);
                // only its completion queue lingers, retried at the next destroy.
                log::warn!(
                    "verbs: destroying the completion queue of queue pair {}: {}",
                    self.qpn,
                    os(rc)
                );
                return Ok(());
            }
            alive.cq = false;
        }
        Ok(())
    }
}

impl Drop for RawQp {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            log::error!("verbs: {e}; the queue pair is leaked");
        }
        let alive = self.alive();
        let leaked = alive.qp || alive.cq;
        drop(alive);
        // SAFETY: `channel` is taken once, here.
        let channel = unsafe { ManuallyDrop::take(&mut self.channel) };
        if leaked {
            // A CQ still on the channel: dropping the channel would assert.
            std::mem::forget(channel);
        }
    }
}
