//! Opening an RDMA device port, memory registrations, and the RC queue-pair state
//! machine (RESET → INIT → RTR → RTS, and → ERR for a fence). Shared by the worker and
//! the target side.

use super::ops::{Access, MemoryOps, MrKeys};
use super::proto::{Endpoint, MTUS};
use super::settings::{self, event_action, EventAction, VerbsSettings};
use crate::transport::TransportError;
use rdma_mummy_sys::{
    ibv_access_flags, ibv_ack_async_event, ibv_async_event, ibv_dereg_mr, ibv_fork_init,
    ibv_get_async_event, ibv_is_fork_initialized, ibv_mr, ibv_port_state, ibv_reg_mr,
    IBV_GID_TYPE_SYSFS_ROCE_V2, IBV_LINK_LAYER_ETHERNET,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use std::collections::HashMap;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
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
    pub settings: VerbsSettings,
    pub ctx: Arc<DeviceContext>,
    pub pd: Arc<ProtectionDomain>,
    /// LID, GID and GID index: read at open, read again after a port or address event.
    addr: Mutex<PortAddress>,
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

#[derive(Debug, Clone, Copy)]
struct PortAddress {
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
}

fn setup(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("{what}: {e}"))
}

/// Turns fork protection on (`ibv_fork_init`, before any registration) and checks
/// that it is in place (see [`settings::check_fork`]).
fn fork_protection() -> Result<(), TransportError> {
    // SAFETY: plain calls; ibv_fork_init is idempotent and only affects later
    // registrations.
    let rc = unsafe { ibv_fork_init() };
    // SAFETY: as above.
    let status = unsafe { ibv_is_fork_initialized() };
    settings::check_fork(rc, status)
}

fn set_nonblocking(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl on an fd we were handed; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Device {
    /// Opens the device and port of `settings`. Refuses iWARP and other non-InfiniBand
    /// transports, inactive ports, and a process without fork protection.
    pub fn open(settings: &VerbsSettings) -> Result<Device, TransportError> {
        settings.check()?;
        let device = settings.device.as_deref();
        let port = settings.port;
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
        settings::check_transport(&name, dev.transport_type() as i32)?;
        fork_protection()?;
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
        let addr = port_address(&ctx, &name, port, settings.gid_index, ethernet)?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| setup(&format!("protection domain on {name}"), e))?;
        let o = &attr.attr.orig_attr;
        let clamp_u8 = |x: i32| x.clamp(0, i32::from(MAX_RD_ATOMIC)) as u8;
        Ok(Device {
            port,
            settings: settings.clone(),
            ctx,
            pd,
            addr: Mutex::new(addr),
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

    /// LID, GID and GID index in use.
    pub fn lid_gid(&self) -> (u16, [u8; 16]) {
        let a = *lock(&self.addr);
        (a.lid, a.gid)
    }

    /// The GID (raw) and its index.
    pub fn address(&self) -> ([u8; 16], u8) {
        let a = *lock(&self.addr);
        (a.gid, a.gid_index)
    }

    /// Reads LID and GID again (after a port, LID or GID change event). Queue pairs
    /// brought up later use the new address; existing ones are failed by the event.
    pub fn refresh_address(&self) -> Result<(), TransportError> {
        let a = port_address(
            &self.ctx,
            &self.name,
            self.port,
            self.settings.gid_index,
            self.ethernet,
        )?;
        let mut cur = lock(&self.addr);
        if cur.lid != a.lid || cur.gid != a.gid {
            log::info!(
                "verbs: {} address changed: LID {} → {}, GID {} → {} (index {})",
                self.label(),
                cur.lid,
                a.lid,
                super::proto::gid_to_string(&cur.gid),
                super::proto::gid_to_string(&a.gid),
                a.gid_index
            );
        }
        *cur = a;
        Ok(())
    }

    /// The device's async-event fd, switched to non-blocking.
    pub fn async_fd(&self) -> Result<i32, TransportError> {
        // SAFETY: the context is alive (held by `self`).
        let fd = unsafe { (*self.ctx.context().as_ptr()).async_fd };
        set_nonblocking(fd)
            .map_err(|e| setup(&format!("async event fd of {}", self.label()), e))?;
        Ok(fd)
    }

    /// Reads every pending async event (the fd must be non-blocking), hands each to
    /// `on_event` as (action, `ibv_event_type`, QPN or 0) and acknowledges it. Returns
    /// how many were read.
    pub fn read_async_events(&self, mut on_event: impl FnMut(EventAction, u32, u32)) -> usize {
        // SAFETY: the context is alive (held by `self`).
        let ctx = unsafe { self.ctx.context().as_ptr() };
        let mut n = 0;
        loop {
            // SAFETY: ibv_async_event is plain data.
            let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: valid context and out-pointer; the fd is non-blocking.
            if unsafe { ibv_get_async_event(ctx, &mut ev) } != 0 {
                return n;
            }
            n += 1;
            let kind = ev.event_type as u32;
            let action = event_action(kind);
            let qpn = if action == EventAction::FailQp {
                // SAFETY: a QP event carries its QP, valid until acknowledged.
                let qp = unsafe { ev.element.qp };
                // SAFETY: as above.
                if qp.is_null() {
                    0
                } else {
                    unsafe { (*qp).qp_num }
                }
            } else {
                0
            };
            on_event(action, kind, qpn);
            // SAFETY: read above, acknowledged once.
            unsafe { ibv_ack_async_event(&mut ev) };
        }
    }

    /// This side's endpoint for a queue pair.
    pub fn endpoint(&self, qpn: u32, psn: u32, rd_atomic: u8) -> Endpoint {
        let (lid, gid) = self.lid_gid();
        Endpoint {
            lid,
            gid,
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
        access: Access,
    ) -> Result<Mr, io::Error> {
        // SAFETY: passed on.
        unsafe { register_in(&self.pd, ptr, len, access) }
    }

    /// A new protection domain on this device.
    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>, String> {
        self.ctx
            .alloc_pd()
            .map_err(|e| format!("protection domain on {}: {e}", self.label()))
    }
}

/// Registers `len` bytes at `ptr` in protection domain `pd`.
///
/// # Safety
/// The range must stay mapped until the returned registration is dropped.
unsafe fn register_in(
    pd: &Arc<ProtectionDomain>,
    ptr: *mut u8,
    len: usize,
    access: Access,
) -> Result<Mr, io::Error> {
    use ibv_access_flags as f;
    let bits = match access {
        Access::LocalWriteOnly => f::IBV_ACCESS_LOCAL_WRITE.0,
        Access::RemoteRead => f::IBV_ACCESS_REMOTE_READ.0,
        Access::RemoteReadWrite => {
            f::IBV_ACCESS_REMOTE_READ.0 | f::IBV_ACCESS_REMOTE_WRITE.0 | f::IBV_ACCESS_LOCAL_WRITE.0
        }
    };
    // SAFETY: the PD is alive (held by the caller and then by the Mr); the caller
    // keeps the range mapped.
    let mr = unsafe { ibv_reg_mr(pd.pd().as_ptr(), ptr.cast(), len, bits as i32) };
    match NonNull::new(mr) {
        Some(mr) => Ok(Mr {
            mr,
            _pd: pd.clone(),
        }),
        None => Err(io::Error::last_os_error()),
    }
}

/// The port's LID and the GID to use.
fn port_address(
    ctx: &DeviceContext,
    name: &str,
    port: u8,
    gid_index: Option<u8>,
    ethernet: bool,
) -> Result<PortAddress, TransportError> {
    let pattr = ctx
        .query_port(port)
        .map_err(|e| setup(&format!("querying port {port} of {name}"), e))?;
    let p = &pattr.attr;
    let gid_tbl_len = p.gid_tbl_len.max(0) as u32;
    let gid_index = match gid_index {
        Some(i) => i,
        None if ethernet => pick_roce_gid(ctx, port, gid_tbl_len).ok_or_else(|| {
            TransportError::Unavailable(format!(
                "port {port} of RDMA device {name} has no usable GID (is an IP address configured on its netdev?)"
            ))
        })?,
        None => 0,
    };
    let gid = ctx
        .query_gid(port, u32::from(gid_index))
        .map_err(|e| setup(&format!("GID {gid_index} of {name} port {port}"), e))?;
    Ok(PortAddress {
        lid: p.lid,
        gid: gid.raw,
        gid_index,
    })
}

/// The registrations of one protection domain, by remote key (the regions an agent
/// registered for one connection; that connection's responder queue pairs are made
/// in the same domain, so the NIC accepts these keys from them only).
pub(crate) struct MrTable {
    dev: Arc<Device>,
    pd: Arc<ProtectionDomain>,
    mrs: Mutex<HashMap<u32, Mr>>,
}

impl MrTable {
    /// A new, empty protection domain on `dev`.
    pub fn new(dev: Arc<Device>) -> Result<MrTable, String> {
        let pd = dev.alloc_pd()?;
        Ok(MrTable {
            dev,
            pd,
            mrs: Mutex::new(HashMap::new()),
        })
    }

    /// The protection domain (queue pairs of its owner are created in it).
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

impl MemoryOps for MrTable {
    unsafe fn register(&self, ptr: *mut u8, len: usize, access: Access) -> Result<MrKeys, String> {
        // SAFETY: the caller keeps the range mapped until deregister succeeded.
        let mr = unsafe { register_in(&self.pd, ptr, len, access) }.map_err(|e| {
            format!(
                "registering {len} bytes at {ptr:p} with {}: {e}",
                self.dev.label()
            )
        })?;
        let keys = MrKeys {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        let mut mrs = lock(&self.mrs);
        if mrs.contains_key(&keys.rkey) {
            // Two live registrations with one key: the NIC would never do that; keep
            // the old one, give the new one back.
            drop(mr);
            return Err(format!(
                "{} returned key {:#x}, which is still registered",
                self.dev.label(),
                keys.rkey
            ));
        }
        mrs.insert(keys.rkey, mr);
        Ok(keys)
    }

    fn deregister(&self, rkey: u32) -> Result<(), String> {
        let mut mrs = lock(&self.mrs);
        let mr = mrs
            .remove(&rkey)
            .ok_or_else(|| format!("key {rkey:#x} is not registered"))?;
        // ibv_dereg_mr returns once the NIC dropped the key: any later operation with
        // it gets a remote access error, and none is still touching the range.
        match mr.deregister() {
            Ok(()) => Ok(()),
            Err((mr, e)) => {
                mrs.insert(rkey, mr);
                Err(format!(
                    "deregistering key {rkey:#x} on {}: {e}; it is still registered, retry",
                    self.dev.label()
                ))
            }
        }
    }
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
