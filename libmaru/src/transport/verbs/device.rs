//! Opening an RDMA device port, memory registrations, and the RC queue-pair state
//! machine (RESET → INIT → RTR → RTS, and → ERR for a fence). Shared by the worker and
//! the target side.

use super::proto::{gid_to_string, Endpoint, MTUS};
use crate::transport::TransportError;
use rdma_mummy_sys::{
    ibv_dereg_mr, ibv_mr, ibv_port_state, ibv_reg_mr, IBV_GID_TYPE_SYSFS_ROCE_V2,
    IBV_LINK_LAYER_ETHERNET,
};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
};
use sideway::ibverbs::AccessFlags;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

/// Hop limit in the GRH (RoCE v2 may be routed).
const HOP_LIMIT: u8 = 64;
/// Local ACK timeout exponent: 4.096 µs · 2^14 ≈ 67 ms per try.
const ACK_TIMEOUT: u8 = 14;
/// Transport retries and RNR retries (7 = the maximum; RNR 7 means "forever", but
/// one-sided READ/WRITE never meet receiver-not-ready).
const RETRY_CNT: u8 = 7;
const RNR_RETRY: u8 = 7;
const MIN_RNR_TIMER: u8 = 12;
/// At most this many RDMA READs in flight per queue pair.
const MAX_RD_ATOMIC: u8 = 16;

/// Why no device could be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Missing {
    /// libibverbs.so.1 (rdma-core) could not be loaded at run time.
    NoRdmaCore,
    /// rdma-core is there, but it lists no device (or cannot list: `detail`).
    NoDevice { detail: Option<String> },
    /// Devices exist, but not the one asked for.
    NotNamed { present: Vec<String> },
}

/// The `Unavailable` error for a device that is not there. `wanted` is the device
/// name asked for (`None`: the first one).
pub(crate) fn unavailable(wanted: Option<&str>, why: &Missing) -> TransportError {
    let looked = match wanted {
        Some(name) => format!("looked for {name}"),
        None => "looked for any device".to_string(),
    };
    let hint = "use --transport soft on hosts without RDMA";
    let base = format!("no RDMA device found ({looked}); {hint}");
    TransportError::Unavailable(match why {
        Missing::NoRdmaCore => format!(
            "no RDMA device found ({looked}); rdma-core (libibverbs.so.1) could not be loaded: install rdma-core (libibverbs1), or {hint}"
        ),
        Missing::NoDevice { detail: None } => base,
        Missing::NoDevice { detail: Some(d) } => format!("{base} [listing devices: {d}]"),
        Missing::NotNamed { present } => format!(
            "no RDMA device found ({looked}; present: {}); name one of them, or {hint}",
            present.join(", ")
        ),
    })
}

/// Whether libibverbs.so.1 is loaded in this process (rdma-mummy-sys dlopens it when
/// the library is loaded; it stays absent when rdma-core is not installed).
fn rdma_core_loaded() -> bool {
    // SAFETY: RTLD_NOLOAD only looks the library up; the handle is released at once.
    unsafe {
        let h = libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        );
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}

/// An opened port of an RDMA device, with its protection domain.
pub(crate) struct Device {
    pub name: String,
    pub port: u8,
    pub ctx: Arc<DeviceContext>,
    pub pd: Arc<ProtectionDomain>,
    pub lid: u16,
    pub gid: Gid,
    pub gid_index: u8,
    /// RoCE: every packet carries a GRH.
    pub ethernet: bool,
    /// Active path MTU of the port, bytes.
    pub mtu: u32,
    /// Largest message the port carries.
    pub max_msg: u32,
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    /// Responder resources (READs served at once) and initiator depth.
    pub max_rd_atom: u8,
    pub max_init_rd_atom: u8,
}

fn setup(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("{what}: {e}"))
}

impl Device {
    /// Opens `device` (or the first device) at `port`. `gid_index`: the GID to use;
    /// `None` picks one (index 0 on InfiniBand, a RoCE v2 GID on Ethernet).
    pub fn open(
        device: Option<&str>,
        port: u8,
        gid_index: Option<u8>,
    ) -> Result<Device, TransportError> {
        if port == 0 {
            return Err(TransportError::Setup(
                "RDMA port numbers start at 1 (port 0 given)".into(),
            ));
        }
        let list = match DeviceList::new() {
            Ok(l) => l,
            Err(e) => {
                let os = match &e.0 {
                    GetDeviceListErrorKind::Ibverbs(io) => io.raw_os_error(),
                    _ => None,
                };
                let why = if !rdma_core_loaded() {
                    Missing::NoRdmaCore
                } else if os == Some(libc::ENOSYS) {
                    // The kernel has no RDMA support (no /sys/class/infiniband_verbs):
                    // no device, plainly.
                    Missing::NoDevice { detail: None }
                } else {
                    Missing::NoDevice {
                        detail: Some(match os {
                            Some(n) => format!("{e}: {}", io::Error::from_raw_os_error(n)),
                            None => e.to_string(),
                        }),
                    }
                };
                return Err(unavailable(device, &why));
            }
        };
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        let found = match device {
            Some(want) => list.iter().find(|d| d.name() == want),
            None => list.iter().next(),
        };
        let Some(dev) = found else {
            let why = if names.is_empty() {
                if rdma_core_loaded() {
                    Missing::NoDevice { detail: None }
                } else {
                    Missing::NoRdmaCore
                }
            } else {
                Missing::NotNamed { present: names }
            };
            return Err(unavailable(device, &why));
        };
        let name = dev.name();
        let ctx = dev.open().map_err(|e| {
            TransportError::Unavailable(format!(
                "cannot open RDMA device {name}: {e} ({})",
                io::Error::last_os_error()
            ))
        })?;
        let attr = ctx
            .query_device()
            .map_err(|e| setup(&format!("querying {name}"), e))?;
        let phys = attr.attr.orig_attr.phys_port_cnt;
        if port > phys {
            return Err(TransportError::Unavailable(format!(
                "RDMA device {name} has {phys} port(s); port {port} does not exist"
            )));
        }
        let pattr = ctx
            .query_port(port)
            .map_err(|e| setup(&format!("querying port {port} of {name}"), e))?;
        let p = &pattr.attr;
        if p.state != ibv_port_state::IBV_PORT_ACTIVE {
            return Err(TransportError::Unavailable(format!(
                "port {port} of RDMA device {name} is not active (state {}); check the link",
                p.state
            )));
        }
        let mtu = mtu_bytes(p.active_mtu).ok_or_else(|| {
            setup(
                &format!("port {port} of {name}"),
                format!("unknown active MTU code {}", p.active_mtu),
            )
        })?;
        let ethernet = p.link_layer == IBV_LINK_LAYER_ETHERNET;
        let gid_tbl_len = p.gid_tbl_len.max(0) as u32;
        let gid_index = match gid_index {
            Some(i) => i,
            None if ethernet => pick_roce_gid(&ctx, port, gid_tbl_len).ok_or_else(|| {
                TransportError::Unavailable(format!(
                    "port {port} of RDMA device {name} has no usable GID (is an IP address configured on its netdev?)"
                ))
            })?,
            None => 0,
        };
        let gid = ctx
            .query_gid(port, u32::from(gid_index))
            .map_err(|e| setup(&format!("GID {gid_index} of {name} port {port}"), e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| setup(&format!("protection domain on {name}"), e))?;
        let o = &attr.attr.orig_attr;
        let clamp_u8 = |x: i32| x.clamp(0, i32::from(MAX_RD_ATOMIC)) as u8;
        Ok(Device {
            port,
            ctx,
            pd,
            lid: p.lid,
            gid,
            gid_index,
            ethernet,
            mtu,
            max_msg: p.max_msg_sz,
            max_qp_wr: o.max_qp_wr.max(1) as u32,
            max_cqe: o.max_cqe.max(1) as u32,
            max_rd_atom: clamp_u8(o.max_qp_rd_atom),
            max_init_rd_atom: clamp_u8(o.max_qp_init_rd_atom),
            name,
        })
    }

    /// Human-readable `device:port`.
    pub fn label(&self) -> String {
        format!("{}:{}", self.name, self.port)
    }

    /// This side's endpoint for a queue pair.
    pub fn endpoint(&self, qpn: u32, psn: u32, rd_atomic: u8) -> Endpoint {
        Endpoint {
            lid: self.lid,
            gid: self.gid.raw,
            qpn,
            psn,
            mtu: self.mtu,
            rd_atomic,
        }
    }

    /// Registers `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The range must stay mapped until the returned registration is dropped.
    pub unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Mr, io::Error> {
        // SAFETY: the PD is alive (held by `self` and by the Mr); the caller keeps the
        // range mapped.
        let mr = unsafe { ibv_reg_mr(self.pd.pd().as_ptr(), ptr.cast(), len, access.into()) };
        match NonNull::new(mr) {
            Some(mr) => Ok(Mr {
                mr,
                _pd: self.pd.clone(),
            }),
            None => Err(io::Error::last_os_error()),
        }
    }

    /// Creates an RC queue pair on `cq` (send and receive).
    pub fn create_rc_qp(
        &self,
        cq: &Arc<BasicCompletionQueue>,
        max_send_wr: u32,
    ) -> Result<BasicQueuePair, TransportError> {
        self.pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .setup_max_send_wr(max_send_wr)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0)
            .build()
            .map_err(|e| {
                setup(
                    &format!("creating an RC queue pair on {}", self.label()),
                    format!("{e} ({})", io::Error::last_os_error()),
                )
            })
    }

    /// RESET → INIT → RTR → RTS, towards `remote`. `psn`: this side's first send PSN;
    /// `access`: the remote operations this queue pair accepts; `max_rd_atomic`: READs
    /// this side issues at once; `max_dest_rd_atomic`: READs it serves at once.
    pub fn connect_rc(
        &self,
        qp: &mut BasicQueuePair,
        remote: &Endpoint,
        psn: u32,
        access: AccessFlags,
        max_rd_atomic: u8,
        max_dest_rd_atomic: u8,
    ) -> Result<(), TransportError> {
        let label = self.label();
        let local_qpn = qp_num(qp);
        let step = |s: &str, e: &dyn std::fmt::Display| {
            TransportError::Setup(format!(
                "queue pair {} on {label} towards QPN {} at {}: {s}: {e}",
                local_qpn,
                remote.qpn,
                gid_to_string(&remote.gid)
            ))
        };
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.port)
            .setup_access_flags(access);
        qp.modify(&init).map_err(|e| step("RESET→INIT", &e))?;

        let path_mtu = mtu_code(self.mtu.min(remote.mtu));
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(self.port)
            .setup_service_level(0);
        if self.ethernet || remote.lid == 0 {
            ah.setup_grh_dest_gid(&Gid { raw: remote.gid })
                .setup_grh_src_gid_index(self.gid_index)
                .setup_grh_hop_limit(HOP_LIMIT);
        }
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(path_mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(max_dest_rd_atomic)
            .setup_min_rnr_timer(MIN_RNR_TIMER)
            .setup_address_vector(&ah);
        qp.modify(&rtr).map_err(|e| step("INIT→RTR", &e))?;

        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(psn)
            .setup_timeout(ACK_TIMEOUT)
            .setup_retry_cnt(RETRY_CNT)
            .setup_rnr_retry(RNR_RETRY)
            .setup_max_read_atomic(max_rd_atomic);
        qp.modify(&rts).map_err(|e| step("RTR→RTS", &e))?;
        Ok(())
    }
}

/// Moves a queue pair to ERR: the NIC stops processing it and flushes every posted
/// work request with an error completion.
pub(crate) fn to_error(qp: &mut BasicQueuePair) -> Result<(), TransportError> {
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::Error);
    qp.modify(&attr)
        .map_err(|e| TransportError::Setup(format!("queue pair {} → ERR: {e}", qp_num(qp))))
}

pub(crate) fn qp_num(qp: &BasicQueuePair) -> u32 {
    qp.qp_number()
}

/// A random 24-bit packet sequence number.
pub(crate) fn random_psn() -> u32 {
    (random_u64() & 0x00ff_ffff) as u32
}

/// A random 64-bit id (getrandom; the clock as a fallback).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: writes at most 8 bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 8 {
        u64::from_ne_bytes(b)
    } else {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ (u64::from(std::process::id()) << 32)
    }
}

fn mtu_bytes(code: u32) -> Option<u32> {
    // ibv_mtu: 1 = 256 … 5 = 4096.
    (1..=5).contains(&code).then(|| MTUS[(code - 1) as usize])
}

fn mtu_code(bytes: u32) -> Mtu {
    match bytes {
        0..=256 => Mtu::Mtu256,
        257..=512 => Mtu::Mtu512,
        513..=1024 => Mtu::Mtu1024,
        1025..=2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// On RoCE: a RoCE v2 GID holding an IPv4-mapped address, else any RoCE v2 GID, else
/// the first non-zero GID of the port.
fn pick_roce_gid(ctx: &DeviceContext, port: u8, len: u32) -> Option<u8> {
    let mut v2_any = None;
    let mut first = None;
    for idx in 0..len.min(256) {
        let Ok(gid) = ctx.query_gid(port, idx) else {
            continue;
        };
        if gid.is_zero() {
            continue;
        }
        let idx8 = idx as u8;
        first.get_or_insert(idx8);
        let v2 = ctx
            .query_gid_type(port, idx)
            .map(|t| t == IBV_GID_TYPE_SYSFS_ROCE_V2)
            .unwrap_or(false);
        if v2 {
            let r = gid.raw;
            let v4_mapped = r[..10].iter().all(|&b| b == 0) && r[10] == 0xff && r[11] == 0xff;
            if v4_mapped {
                return Some(idx8);
            }
            v2_any.get_or_insert(idx8);
        }
    }
    v2_any.or(first)
}

/// A memory registration. Dropping it deregisters (errors are logged);
/// [`Mr::deregister`] reports them.
pub(crate) struct Mr {
    mr: NonNull<ibv_mr>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: an ibv_mr is an immutable description once registered; rdma-core's
// deregistration is thread-safe.
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl Mr {
    pub fn lkey(&self) -> u32 {
        // SAFETY: `mr` is valid until deregistered, which consumes `self`.
        unsafe { self.mr.as_ref().lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { self.mr.as_ref().rkey }
    }

    /// Deregisters. On success the NIC refuses the key from then on, and no DMA is
    /// still touching the range; on failure the registration is handed back.
    pub fn deregister(self) -> Result<(), (Mr, io::Error)> {
        // SAFETY: `mr` is a live registration owned by `self`.
        let rc = unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
        if rc == 0 {
            // Gone at the NIC: skip Drop's deregistration but release the PD.
            let this = std::mem::ManuallyDrop::new(self);
            // SAFETY: `this` is never used or dropped again; the Arc is moved out once.
            drop(unsafe { std::ptr::read(&this._pd) });
            Ok(())
        } else {
            Err((self, io::Error::from_raw_os_error(rc)))
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: `mr` is a live registration owned by `self`.
        let rc = unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            log::error!(
                "verbs: deregistering memory region (rkey {:#x}) failed: {}",
                self.rkey(),
                io::Error::from_raw_os_error(rc)
            );
        }
    }
}
