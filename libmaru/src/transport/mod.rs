//! One-sided READ/WRITE between a worker's registered staging buffer and regions that
//! an agent registered on a memory node.
//!
//! The worker side is a [`Transport`]: register the local buffer, connect to a peer
//! from the metadata an agent returned, post batches of operations, ask for their
//! state, and [`fence`](Transport::fence) a peer — the proof that no more DMA touches
//! the local buffer for that peer's operations, after which their slots can be
//! reused. The memory-node side is a [`Target`]: register a range (address + remote
//! key), deregister it (after which every operation with that key fails and none is
//! still touching the range).
//!
//! Implementations: [`soft`] (a software NIC over TCP, key-checked like a NIC) and
//! `verbs` (RC queue pairs; cargo feature `verbs`).

pub(crate) mod batches;
#[allow(clippy::disallowed_methods)] // a driver: sockets, reader threads
pub mod soft;
#[cfg(feature = "verbs")]
#[allow(clippy::disallowed_methods)] // a driver: completion threads, deadlines
pub mod verbs;

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// Remote → local.
    Read,
    /// Local → remote.
    Write,
}

/// One one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub kind: OpKind,
    /// Offset in the registered local buffer.
    pub local_offset: u64,
    /// Remote virtual address (registration address + offset).
    pub remote_addr: u64,
    pub rkey: u64,
    pub len: u64,
}

/// A connected peer (one per agent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// A posted batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchState {
    /// Some operations have not completed.
    Pending,
    /// Every operation completed successfully.
    Done,
    /// At least one operation failed (the others may or may not have run).
    Failed(TransportError),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The remote key is unknown or was deregistered: nothing was read or written.
    #[error("remote key {rkey:#x} is not registered (deregistered or never issued)")]
    BadKey { rkey: u64 },
    /// The range is outside the registration.
    #[error("range {addr:#x}+{len} is outside the registration of key {rkey:#x}")]
    OutOfRange { rkey: u64, addr: u64, len: u64 },
    /// A WRITE to a read-only registration.
    #[error("registration {rkey:#x} is read-only; WRITE refused")]
    ReadOnly { rkey: u64 },
    /// The local range is outside the registered buffer.
    #[error("local range {offset}+{len} is outside the registered staging buffer")]
    LocalRange { offset: u64, len: u64 },
    /// The peer connection failed; operations in flight have an unknown outcome until
    /// the peer is fenced.
    #[error("connection to {peer} lost: {message}")]
    PeerLost { peer: String, message: String },
    /// The peer is unknown or was fenced.
    #[error("peer {} is not connected", .0.0)]
    NoPeer(PeerId),
    /// The batch id is unknown (never posted, or already forgotten).
    #[error("batch {} is unknown", .0.0)]
    NoBatch(BatchId),
    /// No local buffer registered yet.
    #[error("no staging buffer registered")]
    NoLocalBuffer,
    /// Setting up (connecting, proving the key, bringing up a queue pair) failed.
    #[error("transport setup failed: {0}")]
    Setup(String),
    /// This transport is not available on this host (no RDMA device, ...).
    #[error("transport unavailable: {0}")]
    Unavailable(String),
}

/// The worker's registered local memory (the staging buffer). The caller keeps the
/// memory alive and in place for as long as the transport exists.
#[derive(Debug, Clone, Copy)]
pub struct LocalBuffer {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a LocalBuffer is an address range; synchronisation of its bytes is the
// transport's job (slots are owned by one operation at a time).
unsafe impl Send for LocalBuffer {}
unsafe impl Sync for LocalBuffer {}

impl LocalBuffer {
    /// The whole of `bytes` (keep them alive and in place while the transport may
    /// use them).
    pub fn of(bytes: &mut [u8]) -> LocalBuffer {
        LocalBuffer {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
        }
    }

    pub(crate) fn check(&self, offset: u64, len: u64) -> Result<(), TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(TransportError::LocalRange { offset, len }),
        }
    }
}

/// What a transport keeps of its staging buffer's registration: set once (a second
/// [`Transport::register_local`] is refused), and asked for by every operation (none
/// yet: [`TransportError::NoLocalBuffer`]).
#[derive(Debug)]
pub(crate) struct Staging<T>(std::sync::OnceLock<T>);

impl<T> Default for Staging<T> {
    fn default() -> Self {
        Staging(std::sync::OnceLock::new())
    }
}

impl<T> Staging<T> {
    /// Refuses a second registration before `make` (the registration itself) runs.
    pub(crate) fn register(
        &self,
        make: impl FnOnce() -> Result<T, TransportError>,
    ) -> Result<(), TransportError> {
        let taken = || TransportError::Setup("a staging buffer is already registered".into());
        if self.0.get().is_some() {
            return Err(taken());
        }
        self.0.set(make()?).map_err(|_| taken())
    }

    pub(crate) fn get(&self) -> Result<&T, TransportError> {
        self.0.get().ok_or(TransportError::NoLocalBuffer)
    }

    /// The registration, taken out (the transport's drop).
    #[cfg(any(test, feature = "verbs"))]
    pub(crate) fn take(&mut self) -> Option<T> {
        self.0.take()
    }
}

/// The worker side of a one-sided transport.
pub trait Transport: Send + Sync {
    fn name(&self) -> &'static str;

    /// Registers the staging buffer (once).
    fn register_local(&self, buf: LocalBuffer) -> Result<(), TransportError>;

    /// Connects to the peer described by `meta` (the `transport` field of an agent's
    /// map reply). A transport that must exchange connection data with the target
    /// (RDMA queue-pair bring-up) sends its half through `bringup`, which carries it
    /// over the agent's control connection to [`Target::accept_peer`] and returns the
    /// target's half. The soft transport does not call it.
    fn connect(
        &self,
        meta: &serde_json::Value,
        bringup: &mut Bringup<'_>,
    ) -> Result<PeerId, TransportError>;

    /// As [`Transport::connect`], waiting at most `limit` for the peer (its data
    /// connections and their handshakes). `bringup` bounds its own round trips (the
    /// caller's control connection). By default `connect`, for transports whose
    /// connect waits on nothing but `bringup`.
    fn connect_within(
        &self,
        meta: &serde_json::Value,
        bringup: &mut Bringup<'_>,
        limit: Duration,
    ) -> Result<PeerId, TransportError> {
        let _ = limit;
        self.connect(meta, bringup)
    }

    /// Posts a batch to one peer. Operations complete in order.
    fn post(&self, peer: PeerId, ops: &[Op]) -> Result<BatchId, TransportError>;

    /// As [`Transport::post`], waiting at most `limit` to hand the batch over (a
    /// soft NIC writes the requests and WRITE payloads on the caller's thread, and a
    /// peer that stopped reading fills the socket). By default `post`, for transports
    /// whose post does not wait on the peer.
    fn post_within(
        &self,
        peer: PeerId,
        ops: &[Op],
        limit: Duration,
    ) -> Result<BatchId, TransportError> {
        let _ = limit;
        self.post(peer, ops)
    }

    /// The batch's state now (no waiting).
    fn state(&self, batch: BatchId) -> BatchState;

    /// Waits until the batch is no longer pending or `timeout` passed (then Pending).
    fn wait(&self, batch: BatchId, timeout: Duration) -> BatchState;

    /// Drops the record of a finished batch.
    fn forget(&self, batch: BatchId);

    /// Stops every operation of `peer`: once this returns `Ok`, no DMA of that peer's
    /// operations touches the local buffer, the target applies none of its WRITEs any
    /// more, and its pending batches are failed. The peer must be connected again
    /// before further use.
    ///
    /// The worker reuses slots and pages only on `Ok` (`worker::movers::remote::isolation`),
    /// so: a fence that cannot prove quiet returns an error and may be called again
    /// for the same peer later (keep the peer until then); a fence of a peer already
    /// fenced returns `Ok` again (two pools may share a peer); `NoPeer` is for ids
    /// this transport never issued, and proves nothing.
    fn fence(&self, peer: PeerId) -> Result<(), TransportError>;

    /// As [`Transport::fence`], waiting at most `wait` for the proof (a fence that
    /// runs out of it fails, proves nothing, and may be made again later). By default
    /// `fence`, for transports whose fence waits on nothing the peer does (verbs: the
    /// local NIC flushes the queue pair).
    fn fence_within(&self, peer: PeerId, wait: Duration) -> Result<(), TransportError> {
        let _ = wait;
        self.fence(peer)
    }
}

/// Carries a transport's connection data to the target and returns the answer.
pub type Bringup<'a> =
    dyn FnMut(&serde_json::Value) -> Result<serde_json::Value, TransportError> + 'a;

/// A `Bringup` for transports that need none (it refuses to be called).
pub fn no_bringup(_: &serde_json::Value) -> Result<serde_json::Value, TransportError> {
    Err(TransportError::Setup(
        "this transport needs no connection exchange".into(),
    ))
}

/// A registration at the memory node.
#[derive(Debug, Clone, PartialEq)]
pub struct Registration {
    /// The remote key a peer presents with every one-sided operation.
    pub rkey: u64,
    /// The remote address of the registered range's first byte.
    pub addr: u64,
    /// What a worker needs to reach this registration, and nothing else (sent in the
    /// map reply).
    pub transport: serde_json::Value,
}

/// The memory-node side: registers ranges the agent mapped.
pub trait Target: Send + Sync {
    /// Registers `len` bytes at `ptr` for remote READ (and WRITE when `writable`),
    /// for `owner` (the agent connection it is made for): the key works only on data
    /// paths of that owner (its protection domain's queue pairs, the soft NIC
    /// connections bound to it), so a worker that learns another's key cannot use it.
    ///
    /// # Safety
    /// The range must stay mapped until [`Target::deregister`] returned for its key.
    unsafe fn register(
        &self,
        owner: u64,
        ptr: *mut u8,
        len: u64,
        writable: bool,
    ) -> Result<Registration, TransportError>;

    /// Deregisters: when this returns, every later operation with `rkey` fails with
    /// `BadKey` and none is still touching the range.
    fn deregister(&self, rkey: u64) -> Result<(), TransportError>;

    /// The owner (agent connection) closed: its data paths are closed. Its
    /// registrations stay until deregistered.
    fn owner_closed(&self, owner: u64) {
        let _ = owner;
    }

    /// Answers a worker's connection data (RDMA queue-pair bring-up) with ours.
    /// Transports without such an exchange refuse.
    fn accept_peer(&self, worker: &serde_json::Value) -> Result<serde_json::Value, TransportError> {
        let _ = worker;
        Err(TransportError::Setup(
            "this transport has no connection exchange".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staging_buffer_is_registered_once_and_asked_for_before_use() {
        let mut s = Staging::default();
        assert_eq!(s.get(), Err(TransportError::NoLocalBuffer));
        s.register(|| Ok(1)).unwrap();
        let mut made = false;
        let again = s.register(|| {
            made = true;
            Ok(2)
        });
        assert!(matches!(again, Err(TransportError::Setup(m)) if m.contains("already")));
        assert!(
            !made,
            "the second registration is refused before it is made"
        );
        assert_eq!(s.get(), Ok(&1));
        assert_eq!(s.take(), Some(1));
    }
}
