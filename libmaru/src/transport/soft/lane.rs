//! One lane of the soft NIC, worker side: its data connection, the operations in
//! flight on it, and the reader thread that takes their completions in order (and
//! READ payloads straight into the staging buffer). Stopping and joining the readers
//! is the local half of the soft transport's fence ([`super::worker`]).

use super::proto::{self, Completion, CPL_LEN};
use crate::transport::batches::BatchTable;
use crate::transport::{BatchId, LocalBuffer, OpKind, TransportError};
use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An operation sent on a lane whose completion has not come back yet.
pub(super) struct InFlight {
    pub(super) seq: u64,
    pub(super) kind: OpKind,
    pub(super) local_offset: u64,
    pub(super) len: u64,
    pub(super) batch: BatchId,
}

/// What the transport and its lanes' readers share: the table of batches they complete.
pub(super) struct Shared {
    pub(super) batches: BatchTable,
}

impl Shared {
    pub(super) fn complete(&self, batch: BatchId, err: Option<TransportError>) {
        self.batches.complete(batch, err);
    }
}

/// One lane of a peer: a data connection and its reader.
pub(super) struct Lane {
    pub(super) addr: String,
    /// Held by one poster while it writes a batch (bounded: see `post_within`).
    pub(super) writer: Mutex<TcpStream>,
    /// The writer's write timeout as set now, in µs.
    pub(super) write_timeout_us: AtomicU64,
    /// The same socket, to shut it down without the writer's lock (a poster may sit
    /// in a write to a peer that stopped reading: the shutdown ends that write).
    pub(super) ctl: TcpStream,
    pub(super) inflight: Mutex<VecDeque<InFlight>>,
    pub(super) reader: Mutex<Option<JoinHandle<()>>>,
    pub(super) dead: AtomicBool,
    pub(super) next_seq: AtomicU64,
}

impl Lane {
    /// Stops the lane for good: no more sends, the reader joined.
    pub(super) fn close(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.ctl.shutdown(Shutdown::Both);
        if let Some(h) = self.reader.lock().ok().and_then(|mut h| h.take()) {
            let _ = h.join();
        }
    }

    /// The first half of a lane's fence: no new operation goes out; what was sent is
    /// the target's to finish.
    pub(super) fn stop_sending(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.ctl.shutdown(Shutdown::Write);
    }

    /// The second half (see the module documentation): false when the target did not
    /// close its end by `until` (the reader is kept, to wait again next time).
    pub(super) fn wait_quiet(&self, until: Instant) -> bool {
        let handle = self.reader.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            if !wait_finished(&h, until) {
                if let Ok(mut r) = self.reader.lock() {
                    *r = Some(h);
                }
                return false;
            }
            // After the join, the reader wrote its last byte into the staging buffer.
            let _ = h.join();
        }
        let _ = self.ctl.shutdown(Shutdown::Both);
        true
    }
}

/// Whether the thread finished by `until` (polled: `JoinHandle` has no timed join).
#[allow(clippy::disallowed_methods)] // a driver: waits until a deadline
fn wait_finished(h: &JoinHandle<()>, until: Instant) -> bool {
    let step = Duration::from_millis(2);
    while !h.is_finished() {
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(step);
    }
    true
}

pub(super) fn reader_loop(
    peer: Arc<Lane>,
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

pub(super) fn read_exact_with_head(
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
    peer: &Lane,
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
