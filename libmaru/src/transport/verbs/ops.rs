//! The narrow set of verbs calls the transport makes, as traits: one queue pair with
//! its completion queue ([`QueuePairOps`]: post a chain, poll, arm, move to ERR,
//! destroy) and memory registration ([`MemoryOps`]). The rdma-core implementation is
//! in [`sys`](super::sys); tests drive the same logic through
//! [`fake`](super::fake), so every failure path runs without an RDMA device.

use crate::transport::OpKind;

/// One work request as the transport posts it: a signalled RDMA READ or WRITE with at
/// most one scatter entry (none when `len` is 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkRequest {
    pub wr_id: u64,
    pub kind: OpKind,
    /// Local address (inside the registered staging buffer) and its key.
    pub local_addr: u64,
    pub lkey: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Completion {
    pub wr_id: u64,
    /// `ibv_wc_status` (0: success).
    pub status: u32,
    pub vendor_err: u32,
}

/// `ibv_post_send` refused the chain at `first_bad`: requests before it were posted
/// (and will each complete), it and the ones after it were not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PostRefused {
    pub first_bad: usize,
    /// The errno rdma-core returned.
    pub errno: i32,
}

/// One RC queue pair and its (own) completion queue.
pub(crate) trait QueuePairOps: Send + Sync {
    /// The local queue-pair number (for logs and async events).
    fn qpn(&self) -> u32;

    /// Posts `chain` in order as one `ibv_post_send`.
    fn post(&self, chain: &[WorkRequest]) -> Result<(), PostRefused>;

    /// Appends every completion the completion queue holds now to `out`.
    fn poll(&self, out: &mut Vec<Completion>) -> Result<(), String>;

    /// Asks for an event on the completion channel at the next completion.
    fn arm(&self) -> Result<(), String>;

    /// Moves the queue pair to ERR: the NIC stops it and flushes every posted request.
    fn to_error(&self) -> Result<(), String>;

    /// Destroys the queue pair, then its completion queue. `Ok`: the NIC will never
    /// execute anything of it again (calling it again is a no-op). `Err`: it may
    /// still exist and touch memory; the call can be retried.
    fn destroy(&self) -> Result<(), String>;
}

/// A memory registration as the transport sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MrKeys {
    pub lkey: u32,
    pub rkey: u32,
}

/// Access a registration grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// The worker's staging buffer: local writes (READ data lands there), no remote
    /// access at all.
    LocalWriteOnly,
    /// A region served for remote READ only.
    RemoteRead,
    /// A region served for remote READ and WRITE.
    RemoteReadWrite,
}

/// Memory registration with the NIC.
pub(crate) trait MemoryOps: Send + Sync {
    /// Registers `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The range must stay mapped until [`MemoryOps::deregister`] succeeded for it.
    unsafe fn register(&self, ptr: *mut u8, len: usize, access: Access) -> Result<MrKeys, String>;

    /// Deregisters the registration of `rkey`. `Ok`: the NIC refuses the key and no
    /// DMA touches the range any more. `Err`: it is still registered; retry.
    fn deregister(&self, rkey: u32) -> Result<(), String>;
}
