//! The worker side of the soft NIC: per agent, one TCP connection per lane (the
//! `lanes` setting, as verbs has queue pairs: `rdma_qps_per_agent`), many operations in
//! flight on each, completions in order per lane.
//!
//! `post` writes the requests (and WRITE payloads straight from the staging buffer)
//! on the caller's thread, a batch whole on the lane with the fewest operations in
//! flight, so that threads posting at once write on different connections and the
//! target serves them on different threads. One reader thread per lane takes
//! completions and reads READ payloads straight into the staging buffer. The readers
//! are the only things that write local memory, so stopping them (and joining them) is
//! the local half of the soft transport's fence; a fence fences every lane.
//!
//! The remote half: a target applies a WRITE whose frame is already in its socket
//! buffer even after the worker stopped listening. So the fence shuts only the write
//! side, and waits (at most [`FENCE_WAIT`]) for the target's end of the connection:
//! the target closes it only after it read every frame up to the worker's shutdown
//! and applied each. Until then the fence fails, the peer stays (dead for new posts)
//! and the next fence waits again; a fence of a peer already fenced succeeds at
//! once, so two pools sharing a peer both learn that it is quiet.

use super::lane::{read_exact_with_head, reader_loop, InFlight, Lane, Shared};
use super::proto::{self, Completion, Request, CPL_LEN};
use crate::auth::SharedKey;
use crate::net::{Client, ClientOptions};
use crate::transport::batches::BatchTable;
use crate::transport::{
    BatchId, BatchState, Bringup, LocalBuffer, Op, OpKind, PeerId, Staging, Transport,
    TransportError,
};
use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a fence waits for the target to confirm it applies nothing more.
pub const FENCE_WAIT: Duration = Duration::from_secs(1);
/// How long `post` may take to write a batch (`post_within` takes its own limit).
const POST_WAIT: Duration = Duration::from_secs(10);
/// How long `connect` gives a peer's handshakes and bindings beyond the TCP connect
/// (`connect_within` takes its own limit).
const CONNECT_HANDSHAKE: Duration = Duration::from_secs(10);
/// Fenced peer ids remembered (a fence of one of them succeeds again at once).
const FENCED_MEMORY: usize = 4096;

/// A peer: its lanes, each a data connection of its own.
struct Lanes {
    addr: String,
    bind: u128,
    lanes: Vec<Arc<Lane>>,
    /// Held for the whole fence: a second fence of the peer waits for the first.
    fence: Mutex<bool>,
}

impl Lanes {
    /// True while every lane can take operations.
    fn alive(&self) -> bool {
        self.lanes.iter().all(|l| !l.dead.load(Ordering::SeqCst))
    }
}

/// The soft transport, worker side.
pub struct SoftTransport {
    client_id: String,
    key: Option<SharedKey>,
    connect_timeout: Duration,
    local: Staging<LocalBuffer>,
    peers: Mutex<HashMap<PeerId, Arc<Lanes>>>,
    /// Data connections per peer (at least 1).
    lanes: usize,
    /// Peers whose fence succeeded, oldest first.
    fenced: Mutex<VecDeque<PeerId>>,
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
            local: Staging::default(),
            peers: Mutex::new(HashMap::new()),
            lanes: 1,
            fenced: Mutex::new(VecDeque::new()),
            shared: Arc::new(Shared {
                batches: BatchTable::default(),
            }),
            next_peer: AtomicU64::new(1),
            next_batch: AtomicU64::new(1),
            write_delay_us: AtomicU64::new(0),
            payload_stall_us: AtomicU64::new(0),
        }
    }

    /// Opens `n` data connections (lanes) per peer, 1 to 8 (see the module
    /// documentation); 1 by default.
    pub fn with_lanes(mut self, n: u8) -> SoftTransport {
        self.lanes = usize::from(n.clamp(1, 8));
        self
    }

    /// Fault injection for tests: every WRITE posted from now on waits `delay` on the
    /// posting thread before its request leaves, as a WRITE that sits in a NIC's send
    /// queue. `post` returns only after the delay; a test posts from another thread to
    /// let the owner give its region back while the WRITE is still on its way.
    /// `Duration::ZERO` turns it off. Never set by the library itself.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn inject_write_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.write_delay_us.store(us, Ordering::SeqCst);
    }

    /// Fault injection for tests: every WRITE posted from now on sends its request
    /// header, then waits `stall` on the posting thread before its payload, as a WRITE
    /// whose data is slow to arrive (the NIC has started it). `Duration::ZERO` turns
    /// it off. Never set by the library itself.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn inject_payload_stall(&self, stall: Duration) {
        let us = u64::try_from(stall.as_micros()).unwrap_or(u64::MAX);
        self.payload_stall_us.store(us, Ordering::SeqCst);
    }

    /// The lane of peer `id` a batch goes on: the live one with the fewest operations
    /// in flight.
    fn peer(&self, id: PeerId) -> Result<Arc<Lane>, TransportError> {
        let peers = self.peers.lock().map_err(|_| TransportError::NoPeer(id))?;
        peers
            .get(&id)
            .and_then(|p| {
                p.lanes
                    .iter()
                    .filter(|l| !l.dead.load(Ordering::SeqCst))
                    .min_by_key(|l| l.inflight.lock().map_or(usize::MAX, |q| q.len()))
            })
            .cloned()
            .ok_or(TransportError::NoPeer(id))
    }

    fn local(&self) -> Result<LocalBuffer, TransportError> {
        self.local.get().copied()
    }
}

fn peer_addr(meta: &serde_json::Value) -> Result<String, TransportError> {
    meta.get("soft")
        .and_then(|s| s.get("addr"))
        .and_then(|a| a.as_str())
        .map(str::to_string)
        .ok_or_else(|| TransportError::Setup(format!("transport metadata {meta} has no soft.addr: the agent does not run the soft transport")))
}

/// The owner's binding secret in the metadata (32 hex digits).
fn peer_bind(meta: &serde_json::Value) -> Result<u128, TransportError> {
    meta.get("soft")
        .and_then(|s| s.get("bind"))
        .and_then(|b| b.as_str())
        .and_then(|b| u128::from_str_radix(b, 16).ok())
        .ok_or_else(|| {
            TransportError::Setup(format!(
                "transport metadata {meta} has no soft.bind: the agent's soft NIC is too old"
            ))
        })
}

/// Binds a fresh data connection to the owner of `bind` (its first request).
fn send_bind(stream: &mut TcpStream, head: &mut Vec<u8>, bind: u128) -> io::Result<()> {
    let req = Request {
        op: proto::OP_BIND,
        seq: 0,
        addr: (bind >> 64) as u64,
        rkey: bind as u64,
        len: 0,
    };
    stream.write_all(&req.encode())?;
    let mut hdr = [0u8; CPL_LEN];
    read_exact_with_head(stream, head, &mut hdr)?;
    match Completion::decode(&hdr) {
        c if c.seq == 0 && c.status == proto::ST_OK => Ok(()),
        c => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the soft NIC refused the binding (status {}): the agent connection that \
                 mapped these regions is gone",
                c.status
            ),
        )),
    }
}

impl SoftTransport {
    /// A data connection to `addr`, bound to `bind`, with its reader; the connect, the
    /// handshake and the binding by `until`.
    fn open_lane(
        &self,
        addr: &str,
        bind: u128,
        local: &LocalBuffer,
        until: Instant,
    ) -> Result<Arc<Lane>, TransportError> {
        let mut opts = ClientOptions::new(proto::SERVICE, self.client_id.clone());
        opts.key = self.key.clone();
        opts.connect_timeout = self.connect_timeout;
        let left = || until.saturating_duration_since(Instant::now());
        let client = Client::connect_within(addr, &opts, left())
            .map_err(|e| TransportError::Setup(format!("soft NIC at {addr}: {e}")))?;
        let (mut stream, mut head) = client.into_parts();
        let setup = |e: io::Error| TransportError::Setup(format!("soft NIC at {addr}: {e}"));
        let bind_wait = left();
        if bind_wait.is_zero() {
            return Err(TransportError::Setup(format!(
                "soft NIC at {addr}: no time left to bind the connection"
            )));
        }
        stream.set_read_timeout(Some(bind_wait)).map_err(setup)?;
        stream.set_write_timeout(Some(bind_wait)).map_err(setup)?;
        send_bind(&mut stream, &mut head, bind).map_err(setup)?;
        // WRITE payloads go out on the posting thread: a peer that stops reading
        // fails them after the usual call timeout, as before.
        stream
            .set_write_timeout(Some(opts.call_timeout))
            .map_err(setup)?;
        stream.set_read_timeout(None).map_err(setup)?;
        let reader_stream = stream.try_clone().map_err(setup)?;
        let ctl = stream.try_clone().map_err(setup)?;
        let peer = Arc::new(Lane {
            addr: addr.to_string(),
            writer: Mutex::new(stream),
            write_timeout_us: AtomicU64::new(micros(opts.call_timeout)),
            ctl,
            inflight: Mutex::new(VecDeque::new()),
            reader: Mutex::new(None),
            dead: AtomicBool::new(false),
            next_seq: AtomicU64::new(1),
        });
        let (p, sh, local) = (peer.clone(), self.shared.clone(), *local);
        let handle = std::thread::Builder::new()
            .name("soft-transport-rx".into())
            .spawn(move || reader_loop(p, reader_stream, head, local, sh))
            .map_err(setup)?;
        if let Ok(mut r) = peer.reader.lock() {
            *r = Some(handle);
        }
        Ok(peer)
    }
}

impl Transport for SoftTransport {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn register_local(&self, buf: LocalBuffer) -> Result<(), TransportError> {
        self.local.register(|| Ok(buf))
    }

    fn connect(
        &self,
        meta: &serde_json::Value,
        bringup: &mut Bringup<'_>,
    ) -> Result<PeerId, TransportError> {
        self.connect_within(meta, bringup, self.connect_timeout + CONNECT_HANDSHAKE)
    }

    /// Opens the lanes one after the other, all of them by `limit` from now.
    #[allow(clippy::disallowed_methods)] // a driver: the limit starts now
    fn connect_within(
        &self,
        meta: &serde_json::Value,
        _bringup: &mut Bringup<'_>,
        limit: Duration,
    ) -> Result<PeerId, TransportError> {
        let until = Instant::now() + limit;
        let addr = peer_addr(meta)?;
        let bind = peer_bind(meta)?;
        let local = self.local()?;
        {
            let peers = self
                .peers
                .lock()
                .map_err(|_| TransportError::Setup("peer table poisoned".into()))?;
            if let Some((id, _)) = peers
                .iter()
                .find(|(_, p)| p.addr == addr && p.bind == bind && p.alive())
            {
                return Ok(*id);
            }
        }
        let mut lanes = Vec::with_capacity(self.lanes);
        for _ in 0..self.lanes {
            match self.open_lane(&addr, bind, &local, until) {
                Ok(l) => lanes.push(l),
                Err(e) => {
                    // Lanes opened already are closed: nothing was posted on them.
                    for l in lanes {
                        l.close();
                    }
                    return Err(e);
                }
            }
        }
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        self.peers
            .lock()
            .map_err(|_| TransportError::Setup("peer table poisoned".into()))?
            .insert(
                id,
                Arc::new(Lanes {
                    addr,
                    bind,
                    lanes,
                    fence: Mutex::new(false),
                }),
            );
        Ok(id)
    }

    fn post(&self, peer_id: PeerId, ops: &[Op]) -> Result<BatchId, TransportError> {
        self.post_within(peer_id, ops, POST_WAIT)
    }

    /// The batch written by `limit` from now: the lane's writer taken (another poster
    /// may have it) and every request and WRITE payload written (a peer that stopped
    /// reading fills the socket) within it. A writer not free in time posts nothing
    /// (the lane is stuck: `PeerLost`); a write that runs out of time shuts the lane
    /// down, as any failed write does.
    #[allow(clippy::disallowed_methods)] // a driver: the limit starts now
    fn post_within(
        &self,
        peer_id: PeerId,
        ops: &[Op],
        limit: Duration,
    ) -> Result<BatchId, TransportError> {
        let until = Instant::now() + limit;
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
        let Some(w) = lock_until(&peer.writer, until) else {
            return Err(TransportError::PeerLost {
                peer: peer.addr.clone(),
                message: format!(
                    "its lane was still taken by another batch after {} ms (the peer does not read)",
                    limit.as_millis()
                ),
            });
        };
        let batch = BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed));
        self.shared.batches.insert(batch, ops.len());
        let mut w = Until {
            s: &w,
            until,
            timeout_us: &peer.write_timeout_us,
        };
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
                    write_two(&mut w, &req.encode(), src)
                }
            } else {
                w.write_all(&req.encode())
            };
            if let Err(e) = res {
                // The reader fails everything in flight once the socket is shut down;
                // operations not yet written are failed here.
                let _ = peer.ctl.shutdown(Shutdown::Both);
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
        self.fence_within(peer_id, FENCE_WAIT)
    }

    /// Every lane stops sending at once and their targets drain side by side: the
    /// fence waits `wait` in all, not per lane.
    #[allow(clippy::disallowed_methods)] // a driver: the wait starts now
    fn fence_within(&self, peer_id: PeerId, wait: Duration) -> Result<(), TransportError> {
        let until = Instant::now() + wait;
        let peer = {
            let peers = self
                .peers
                .lock()
                .map_err(|_| TransportError::NoPeer(peer_id))?;
            peers.get(&peer_id).cloned()
        };
        let Some(peer) = peer else {
            let known = self
                .fenced
                .lock()
                .map(|f| f.contains(&peer_id))
                .unwrap_or(false);
            return if known {
                Ok(())
            } else {
                Err(TransportError::NoPeer(peer_id))
            };
        };
        // A second fence of the peer while one runs proves nothing now: it fails at
        // once, and is made again later (when the first may have succeeded).
        let mut done = match peer.fence.try_lock() {
            Ok(d) => d,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err(TransportError::PeerLost {
                    peer: peer.addr.clone(),
                    message: "fence: another fence of this peer is under way".into(),
                })
            }
        };
        if *done {
            return Ok(());
        }
        // Every lane stops first, so that their targets drain side by side; then
        // each is waited for, even after one failed.
        for l in &peer.lanes {
            l.stop_sending();
        }
        let quiet = peer
            .lanes
            .iter()
            .map(|l| l.wait_quiet(until))
            .fold(true, |a, b| a & b);
        if !quiet {
            return Err(TransportError::PeerLost {
                peer: peer.addr.clone(),
                message: format!(
                    "fence: the target did not close a connection within {} ms, so it may still apply WRITEs it read; fenced again later",
                    wait.as_millis()
                ),
            });
        }
        *done = true;
        if let Ok(mut peers) = self.peers.lock() {
            peers.remove(&peer_id);
        }
        if let Ok(mut f) = self.fenced.lock() {
            f.push_back(peer_id);
            while f.len() > FENCED_MEMORY {
                f.pop_front();
            }
        }
        Ok(())
    }
}

/// The lock of `m` once it is free, or None if it still is not at `until` (polled:
/// a lane's writer is held only while a batch is written, so it is short unless the
/// peer stopped reading).
#[allow(clippy::disallowed_methods)] // a driver: waits until a deadline
fn lock_until<T>(m: &Mutex<T>, until: Instant) -> Option<std::sync::MutexGuard<'_, T>> {
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                if Instant::now() >= until {
                    return None;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Writes on a lane's socket that end by `until`: before each write the socket's
/// write timeout is brought to the time left (set again only when it moved, so a
/// batch written at once costs no system call), and none is made once it passed.
struct Until<'a> {
    s: &'a TcpStream,
    until: Instant,
    timeout_us: &'a AtomicU64,
}

impl Until<'_> {
    #[allow(clippy::disallowed_methods)] // a driver: waits until a deadline
    fn bound(&self) -> io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the batch was not written in time",
            ));
        }
        let cur = Duration::from_micros(self.timeout_us.load(Ordering::Relaxed));
        let slack = Duration::from_millis(20);
        if left + slack < cur || left > cur + slack {
            self.s.set_write_timeout(Some(left))?;
            self.timeout_us.store(micros(left), Ordering::Relaxed);
        }
        Ok(())
    }
}

impl Write for Until<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.bound()?;
        (&*self.s).write(b)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.bound()?;
        (&*self.s).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
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
            if self.fence(id).is_ok() {
                continue;
            }
            // The staging buffer may go after this: stop the reader for good (a
            // target that never closed may still apply WRITEs; nothing can wait for
            // it here).
            let peer = self.peers.lock().ok().and_then(|mut p| p.remove(&id));
            if let Some(peer) = peer {
                for l in &peer.lanes {
                    l.close();
                }
            }
        }
    }
}

/// Writes `a` then `b` with vectored writes (one syscall for header + payload).
fn write_two(out: &mut impl Write, a: &[u8], b: &[u8]) -> io::Result<()> {
    let (mut a, mut b) = (a, b);
    while !a.is_empty() || !b.is_empty() {
        let n = if a.is_empty() {
            out.write(b)?
        } else {
            out.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

#[cfg(test)]
mod fence_tests {
    use super::*;
    use crate::net::handshake::ServerHandshake;
    use crate::testing::serve_handshake;
    use crate::transport::no_bringup;
    use std::io::Read;
    use std::net::TcpListener;
    use std::sync::mpsc;
    use std::time::Instant;

    /// A target that proves nothing but completes the handshake, then holds the
    /// connection as a stopped agent would, until told to go on: then it reads every
    /// byte up to the worker's shutdown (counting them, as if applying the WRITEs)
    /// and only then closes.
    fn slow_target() -> (String, mpsc::Sender<()>, mpsc::Receiver<usize>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<usize>();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let hs = ServerHandshake::new(proto::SERVICE, None, serde_json::Value::Null);
            let mut rest = serve_handshake(&mut s, hs)
                .expect("the worker's handshake")
                .into_rest();
            let mut buf = [0u8; 4096];
            // The worker binds the connection first: accept it.
            while rest.len() < proto::REQ_LEN {
                let n = s.read(&mut buf).unwrap();
                rest.extend_from_slice(&buf[..n]);
            }
            assert_eq!(rest[0], proto::OP_BIND);
            let ok = Completion {
                seq: 0,
                status: proto::ST_OK,
                len: 0,
            };
            s.write_all(&ok.encode()).unwrap();
            let mut applied = rest.len() - proto::REQ_LEN;
            let _ = go_rx.recv();
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => applied += n,
                }
            }
            done_tx.send(applied).unwrap();
            // Closing only now: everything read was applied.
        });
        (addr, go_tx, done_rx)
    }

    #[test]
    fn a_fence_succeeds_only_after_the_target_applied_every_write_it_read() {
        let (addr, go, done) = slow_target();
        let mut staging = vec![7u8; 1 << 16];
        let nic = SoftTransport::new("fence-test", None);
        nic.register_local(LocalBuffer::of(&mut staging)).unwrap();
        let meta = serde_json::json!({"soft": {"addr": addr, "bind": "1"}});
        let peer = nic.connect(&meta, &mut no_bringup).unwrap();
        let write = Op {
            kind: OpKind::Write,
            local_offset: 0,
            remote_addr: 0x1000,
            rkey: 1,
            len: 4096,
        };
        nic.post(peer, &[write]).unwrap();
        // The WRITE sits in the target's socket buffer: no fence may succeed yet.
        let t0 = Instant::now();
        let r = nic.fence(peer);
        assert!(
            matches!(r, Err(TransportError::PeerLost { .. })),
            "a fence while the target may still apply a WRITE: {r:?}"
        );
        assert!(t0.elapsed() >= FENCE_WAIT, "it waited for the target");
        assert!(
            matches!(nic.post(peer, &[write]), Err(TransportError::NoPeer(_))),
            "nothing new goes to a peer being fenced"
        );
        // The target goes on, applies what it read, closes: the next fence succeeds.
        go.send(()).unwrap();
        let applied = done.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(applied >= 4096, "the WRITE was applied before the close");
        nic.fence(peer).expect("the target confirmed");
        // Again (another pool sharing the peer): already fenced, so it succeeds.
        nic.fence(peer).expect("a fenced peer stays fenced");
        assert!(matches!(
            nic.fence(PeerId(999)),
            Err(TransportError::NoPeer(_))
        ));
        drop(nic);
        drop(staging);
    }
}
