//! The worker side of the soft NIC: one TCP connection per agent, many operations in
//! flight, completions in order.
//!
//! `post` writes the requests (and WRITE payloads straight from the staging buffer)
//! on the caller's thread; one reader thread per peer takes completions and reads
//! READ payloads straight into the staging buffer. That reader is the only thing that
//! writes local memory, so stopping it (and joining it) is the soft transport's fence.

use super::proto::{self, Completion, Request, CPL_LEN};
use crate::auth::SharedKey;
use crate::net::{Client, ClientOptions};
use crate::transport::batches::BatchTable;
use crate::transport::{
    BatchId, BatchState, Bringup, LocalBuffer, Op, OpKind, PeerId, Transport, TransportError,
};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

struct InFlight {
    seq: u64,
    kind: OpKind,
    local_offset: u64,
    len: u64,
    batch: BatchId,
}

struct Shared {
    batches: BatchTable,
}

impl Shared {
    fn complete(&self, batch: BatchId, err: Option<TransportError>) {
        self.batches.complete(batch, err);
    }
}

struct Peer {
    addr: String,
    writer: Mutex<TcpStream>,
    inflight: Mutex<VecDeque<InFlight>>,
    reader: Mutex<Option<JoinHandle<()>>>,
    dead: AtomicBool,
    next_seq: AtomicU64,
}

/// The soft transport, worker side.
pub struct SoftTransport {
    client_id: String,
    key: Option<SharedKey>,
    connect_timeout: Duration,
    local: OnceLock<LocalBuffer>,
    peers: Mutex<HashMap<PeerId, Arc<Peer>>>,
    shared: Arc<Shared>,
    next_peer: AtomicU64,
    next_batch: AtomicU64,
    /// Fault injection (tests only, see [`SoftTransport::inject_write_delay`]): µs
    /// each WRITE waits before it goes on the wire; 0 (the default) is none.
    write_delay_us: AtomicU64,
    /// Fault injection (tests only, see [`SoftTransport::inject_payload_stall`]): µs
    /// between a WRITE's header and its payload; 0 (the default) is none.
    payload_stall_us: AtomicU64,
}

impl SoftTransport {
    /// `key`: the agent key, proved on every data connection.
    pub fn new(client_id: impl Into<String>, key: Option<SharedKey>) -> SoftTransport {
        SoftTransport {
            client_id: client_id.into(),
            key,
            connect_timeout: Duration::from_secs(5),
            local: OnceLock::new(),
            peers: Mutex::new(HashMap::new()),
            shared: Arc::new(Shared {
                batches: BatchTable::default(),
            }),
            next_peer: AtomicU64::new(1),
            next_batch: AtomicU64::new(1),
            write_delay_us: AtomicU64::new(0),
            payload_stall_us: AtomicU64::new(0),
        }
    }

    /// Fault injection for tests: every WRITE posted from now on waits `delay` on the
    /// posting thread before its request leaves, as a WRITE that sits in a NIC's send
    /// queue. `post` returns only after the delay; a test posts from another thread to
    /// let the owner give its region back while the WRITE is still on its way.
    /// `Duration::ZERO` turns it off. Never set by the library itself.
    #[doc(hidden)]
    pub fn inject_write_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.write_delay_us.store(us, Ordering::SeqCst);
    }

    /// Fault injection for tests: every WRITE posted from now on sends its request
    /// header, then waits `stall` on the posting thread before its payload, as a WRITE
    /// whose data is slow to arrive (the NIC has started it). `Duration::ZERO` turns
    /// it off. Never set by the library itself.
    #[doc(hidden)]
    pub fn inject_payload_stall(&self, stall: Duration) {
        let us = u64::try_from(stall.as_micros()).unwrap_or(u64::MAX);
        self.payload_stall_us.store(us, Ordering::SeqCst);
    }

    fn peer(&self, id: PeerId) -> Result<Arc<Peer>, TransportError> {
        let peers = self.peers.lock().map_err(|_| TransportError::NoPeer(id))?;
        match peers.get(&id) {
            Some(p) if !p.dead.load(Ordering::SeqCst) => Ok(p.clone()),
            _ => Err(TransportError::NoPeer(id)),
        }
    }

    fn local(&self) -> Result<LocalBuffer, TransportError> {
        self.local
            .get()
            .copied()
            .ok_or(TransportError::NoLocalBuffer)
    }
}

fn peer_addr(meta: &serde_json::Value) -> Result<String, TransportError> {
    meta.get("soft")
        .and_then(|s| s.get("addr"))
        .and_then(|a| a.as_str())
        .map(str::to_string)
        .ok_or_else(|| TransportError::Setup(format!("transport metadata {meta} has no soft.addr: the agent does not run the soft transport")))
}

fn reader_loop(
    peer: Arc<Peer>,
    mut stream: TcpStream,
    mut head: Vec<u8>,
    local: LocalBuffer,
    shared: Arc<Shared>,
) {
    let result = read_completions(&peer, &mut stream, &mut head, local, &shared);
    peer.dead.store(true, Ordering::SeqCst);
    let message = match result {
        Ok(()) => "connection closed".to_string(),
        Err(e) => e.to_string(),
    };
    log::debug!(
        "soft transport: reader for {} stopped: {message}",
        peer.addr
    );
    // Everything still in flight has an unknown outcome; fail it. The reader is
    // exiting, so no more bytes land in the staging buffer for this peer.
    let pending: Vec<InFlight> = peer
        .inflight
        .lock()
        .map(|mut q| q.drain(..).collect())
        .unwrap_or_default();
    for op in pending {
        shared.complete(
            op.batch,
            Some(TransportError::PeerLost {
                peer: peer.addr.clone(),
                message: message.clone(),
            }),
        );
    }
}

fn read_exact_with_head(
    stream: &mut TcpStream,
    head: &mut Vec<u8>,
    buf: &mut [u8],
) -> io::Result<()> {
    let n = head.len().min(buf.len());
    if n > 0 {
        buf[..n].copy_from_slice(&head[..n]);
        head.drain(..n);
    }
    crate::net::sockopt::read_exact_bulk(stream, &mut buf[n..])
}

fn read_completions(
    peer: &Peer,
    stream: &mut TcpStream,
    head: &mut Vec<u8>,
    local: LocalBuffer,
    shared: &Shared,
) -> io::Result<()> {
    let mut hdr = [0u8; CPL_LEN];
    loop {
        if let Err(e) = read_exact_with_head(stream, head, &mut hdr) {
            return if e.kind() == io::ErrorKind::UnexpectedEof {
                Ok(())
            } else {
                Err(e)
            };
        }
        let cpl = Completion::decode(&hdr);
        let op = peer
            .inflight
            .lock()
            .ok()
            .and_then(|mut q| q.pop_front())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("completion {} with nothing in flight", cpl.seq),
                )
            })?;
        if op.seq != cpl.seq {
            let msg = format!("completion {} out of order (expected {})", cpl.seq, op.seq);
            // Put it back so the exit path fails its batch too.
            if let Ok(mut q) = peer.inflight.lock() {
                q.push_front(op);
            }
            return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
        }
        let err = match cpl.status {
            proto::ST_OK => None,
            proto::ST_BAD_KEY => Some(TransportError::BadKey { rkey: 0 }),
            proto::ST_RANGE => Some(TransportError::OutOfRange {
                rkey: 0,
                addr: 0,
                len: op.len,
            }),
            proto::ST_READ_ONLY => Some(TransportError::ReadOnly { rkey: 0 }),
            s => Some(TransportError::PeerLost {
                peer: peer.addr.clone(),
                message: format!("unknown status {s}"),
            }),
        };
        if err.is_none() && op.kind == OpKind::Read {
            if cpl.len != op.len {
                let msg = format!(
                    "READ {} returned {} bytes, expected {}",
                    cpl.seq, cpl.len, op.len
                );
                if let Ok(mut q) = peer.inflight.lock() {
                    q.push_front(op);
                }
                return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
            }
            // SAFETY: the range was checked against the registered buffer at post time,
            // and the slot belongs to this operation until its batch completes.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    local.ptr.add(op.local_offset as usize),
                    op.len as usize,
                )
            };
            if let Err(e) = read_exact_with_head(stream, head, dst) {
                if let Ok(mut q) = peer.inflight.lock() {
                    q.push_front(op);
                }
                return Err(e);
            }
        }
        shared.complete(op.batch, err);
    }
}

impl Transport for SoftTransport {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn register_local(&self, buf: LocalBuffer) -> Result<(), TransportError> {
        self.local
            .set(buf)
            .map_err(|_| TransportError::Setup("a staging buffer is already registered".into()))
    }

    fn connect(
        &self,
        meta: &serde_json::Value,
        _bringup: &mut Bringup<'_>,
    ) -> Result<PeerId, TransportError> {
        let addr = peer_addr(meta)?;
        let local = self.local()?;
        {
            let peers = self
                .peers
                .lock()
                .map_err(|_| TransportError::Setup("peer table poisoned".into()))?;
            if let Some((id, _)) = peers
                .iter()
                .find(|(_, p)| p.addr == addr && !p.dead.load(Ordering::SeqCst))
            {
                return Ok(*id);
            }
        }
        let mut opts = ClientOptions::new(proto::SERVICE, self.client_id.clone());
        opts.key = self.key.clone();
        opts.connect_timeout = self.connect_timeout;
        let client = Client::connect(&addr, &opts)
            .map_err(|e| TransportError::Setup(format!("soft NIC at {addr}: {e}")))?;
        let (stream, head) = client.into_parts();
        let setup = |e: io::Error| TransportError::Setup(format!("soft NIC at {addr}: {e}"));
        stream.set_read_timeout(None).map_err(setup)?;
        let reader_stream = stream.try_clone().map_err(setup)?;
        let peer = Arc::new(Peer {
            addr: addr.clone(),
            writer: Mutex::new(stream),
            inflight: Mutex::new(VecDeque::new()),
            reader: Mutex::new(None),
            dead: AtomicBool::new(false),
            next_seq: AtomicU64::new(1),
        });
        let (p, sh) = (peer.clone(), self.shared.clone());
        let handle = std::thread::Builder::new()
            .name("soft-transport-rx".into())
            .spawn(move || reader_loop(p, reader_stream, head, local, sh))
            .map_err(setup)?;
        if let Ok(mut r) = peer.reader.lock() {
            *r = Some(handle);
        }
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        self.peers
            .lock()
            .map_err(|_| TransportError::Setup("peer table poisoned".into()))?
            .insert(id, peer);
        Ok(id)
    }

    fn post(&self, peer_id: PeerId, ops: &[Op]) -> Result<BatchId, TransportError> {
        let local = self.local()?;
        for op in ops {
            local.check(op.local_offset, op.len)?;
            if op.len > proto::MAX_OP_LEN {
                return Err(TransportError::LocalRange {
                    offset: op.local_offset,
                    len: op.len,
                });
            }
        }
        let peer = self.peer(peer_id)?;
        let batch = BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed));
        self.shared.batches.insert(batch, ops.len());
        let mut w = peer
            .writer
            .lock()
            .map_err(|_| TransportError::NoPeer(peer_id))?;
        for (i, op) in ops.iter().enumerate() {
            let seq = peer.next_seq.fetch_add(1, Ordering::Relaxed);
            let req = Request {
                op: if op.kind == OpKind::Read {
                    proto::OP_READ
                } else {
                    proto::OP_WRITE
                },
                seq,
                addr: op.remote_addr,
                rkey: op.rkey,
                len: op.len,
            };
            let queued = peer.inflight.lock().map(|mut q| {
                q.push_back(InFlight {
                    seq,
                    kind: op.kind,
                    local_offset: op.local_offset,
                    len: op.len,
                    batch,
                });
            });
            if queued.is_err() || peer.dead.load(Ordering::SeqCst) {
                // The reader is gone (or going): fail what it will not see.
                for _ in i..ops.len() {
                    self.shared.complete(
                        batch,
                        Some(TransportError::PeerLost {
                            peer: peer.addr.clone(),
                            message: "peer failed".into(),
                        }),
                    );
                }
                return Ok(batch);
            }
            let res = if op.kind == OpKind::Write {
                let delay = self.write_delay_us.load(Ordering::Relaxed);
                if delay > 0 {
                    std::thread::sleep(Duration::from_micros(delay));
                }
                // SAFETY: checked against the registered buffer above.
                let src = unsafe {
                    std::slice::from_raw_parts(
                        local.ptr.add(op.local_offset as usize),
                        op.len as usize,
                    )
                };
                let stall = self.payload_stall_us.load(Ordering::Relaxed);
                if stall > 0 {
                    w.write_all(&req.encode()).and_then(|()| {
                        std::thread::sleep(Duration::from_micros(stall));
                        w.write_all(src)
                    })
                } else {
                    super::target::write_two(&mut *w, &req.encode(), src)
                }
            } else {
                w.write_all(&req.encode())
            };
            if let Err(e) = res {
                // The reader fails everything in flight once the socket is shut down;
                // operations not yet written are failed here.
                let _ = w.shutdown(Shutdown::Both);
                for _ in i + 1..ops.len() {
                    self.shared.complete(
                        batch,
                        Some(TransportError::PeerLost {
                            peer: peer.addr.clone(),
                            message: e.to_string(),
                        }),
                    );
                }
                return Ok(batch);
            }
        }
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
        let peer = {
            let mut peers = self
                .peers
                .lock()
                .map_err(|_| TransportError::NoPeer(peer_id))?;
            peers
                .remove(&peer_id)
                .ok_or(TransportError::NoPeer(peer_id))?
        };
        peer.dead.store(true, Ordering::SeqCst);
        if let Ok(w) = peer.writer.lock() {
            let _ = w.shutdown(Shutdown::Both);
        }
        let handle = peer.reader.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            // After the join, the reader wrote its last byte into the staging buffer.
            let _ = h.join();
        }
        Ok(())
    }
}

impl Drop for SoftTransport {
    fn drop(&mut self) {
        let ids: Vec<PeerId> = self
            .peers
            .lock()
            .map(|p| p.keys().copied().collect())
            .unwrap_or_default();
        for id in ids {
            let _ = self.fence(id);
        }
    }
}
