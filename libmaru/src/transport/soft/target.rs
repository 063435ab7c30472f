//! The soft NIC's responder on the memory node: serves READ/WRITE against its
//! registration table and checks the remote key on every operation, as a NIC does.
//!
//! One thread (mio) accepts connections and runs their handshakes: a peer that has
//! not proved the key costs a small buffer, never a thread, and is closed at the
//! handshake deadline. A connection that proved the key gets a thread of its own
//! (at most [`MAX_CONNECTIONS`]), blocking I/O (it sleeps in the kernel while idle). Bytes go straight between the socket and the registered memory: a WRITE's
//! payload is read into the region, a READ's is written from it, with no staging copy.
//! Each registration has a gate: an operation holds it shared while it touches the
//! range, and deregistration takes it exclusively, so when `deregister` returns no
//! operation is touching the range and every later one fails with a bad key. A
//! connection that stalls mid-operation times out (`io_timeout`), which bounds how long
//! a deregistration can wait.

use super::proto::{self, Completion, Request, CPL_LEN, REQ_LEN};
use crate::auth::SharedKey;
use crate::net::handshake::{ServerHandshake, Step};
use crate::transport::{Registration, Target, TransportError};
use crate::wire::{self, FrameDecoder};
use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

struct Reg {
    base: u64,
    len: u64,
    writable: bool,
    /// true while registered; operations hold it shared.
    gate: RwLock<bool>,
}

struct Shared {
    regs: RwLock<HashMap<u64, Arc<Reg>>>,
    key: Option<SharedKey>,
    io_timeout: Duration,
    stop: AtomicBool,
    /// Open data connections (a handle each, to close them at shutdown), by id; a
    /// connection's thread removes its own when it ends.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    ops: AtomicU64,
    rejected: AtomicU64,
    /// Connections still in their handshake (each has a thread until it ends).
    pending: AtomicU64,
}

/// Most data connections at once (each is served by its own thread); beyond it a new
/// connection is closed at accept.
pub const MAX_CONNECTIONS: usize = 256;
/// Most connections in their handshake at once: a quarter of the connections, so peers
/// without the key cannot take the room of workers that proved it.
pub const MAX_PENDING: u64 = 64;
/// The whole handshake (hello and key proof) must finish within this.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// Largest frame before the key proof (a hello or a proof is a few hundred bytes).
pub const PRE_AUTH_MAX_FRAME: usize = 4 << 10;

/// The soft NIC responder of one agent.
pub struct SoftTarget {
    shared: Arc<Shared>,
    addr: SocketAddr,
    advertise: String,
}

/// Counters of a responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetStats {
    pub registrations: usize,
    pub ops: u64,
    /// Data connections served now (they proved the key).
    pub connections: usize,
    /// Connections in their handshake now (no thread each).
    pub pending: u64,
    /// Operations refused for a bad key, range or access.
    pub rejected: u64,
}

impl SoftTarget {
    /// Listens on `bind` (port 0 picks one). `advertise` is the host workers connect
    /// to (the bound IP when empty). With a key, each data connection proves it.
    pub fn start(
        bind: SocketAddr,
        advertise: &str,
        key: Option<SharedKey>,
        io_timeout: Duration,
    ) -> io::Result<SoftTarget> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let host = if advertise.is_empty() {
            addr.ip().to_string()
        } else {
            advertise.to_string()
        };
        let advertise = if host.contains(':') {
            format!("[{host}]:{}", addr.port())
        } else {
            format!("{host}:{}", addr.port())
        };
        let shared = Arc::new(Shared {
            regs: RwLock::new(HashMap::new()),
            key,
            io_timeout,
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            ops: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            pending: AtomicU64::new(0),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("soft-nic-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(SoftTarget {
            shared,
            addr,
            advertise,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The `transport` metadata workers use to connect.
    pub fn meta(&self) -> serde_json::Value {
        serde_json::json!({ "soft": { "addr": self.advertise } })
    }

    pub fn stats(&self) -> TargetStats {
        TargetStats {
            registrations: self.shared.regs.read().map(|r| r.len()).unwrap_or(0),
            ops: self.shared.ops.load(Ordering::Relaxed),
            connections: self.shared.conns.lock().map(|c| c.len()).unwrap_or(0),
            pending: self.shared.pending.load(Ordering::SeqCst),
            rejected: self.shared.rejected.load(Ordering::Relaxed),
        }
    }

    /// Stops accepting and closes every data connection.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Ok(conns) = self.shared.conns.lock() {
            for c in conns.values() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

impl Drop for SoftTarget {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn random_rkey() -> Result<u64, TransportError> {
    let b = crate::auth::random_bytes(8)
        .map_err(|e| TransportError::Setup(format!("cannot draw a key: {e}")))?;
    let mut x = [0u8; 8];
    x.copy_from_slice(&b);
    Ok(u64::from_le_bytes(x) | 1)
}

impl Target for SoftTarget {
    unsafe fn register(
        &self,
        ptr: *mut u8,
        len: u64,
        writable: bool,
    ) -> Result<Registration, TransportError> {
        let mut regs = self
            .shared
            .regs
            .write()
            .map_err(|_| TransportError::Setup("registration table poisoned".into()))?;
        let mut rkey = random_rkey()?;
        while regs.contains_key(&rkey) {
            rkey = random_rkey()?;
        }
        let base = ptr as u64;
        regs.insert(
            rkey,
            Arc::new(Reg {
                base,
                len,
                writable,
                gate: RwLock::new(true),
            }),
        );
        Ok(Registration {
            rkey,
            addr: base,
            transport: self.meta(),
        })
    }

    fn deregister(&self, rkey: u64) -> Result<(), TransportError> {
        let reg = {
            let mut regs = self
                .shared
                .regs
                .write()
                .map_err(|_| TransportError::Setup("registration table poisoned".into()))?;
            regs.remove(&rkey).ok_or(TransportError::BadKey { rkey })?
        };
        // Wait for operations in flight on this key; later ones see `false`.
        match reg.gate.write() {
            Ok(mut g) => *g = false,
            Err(p) => *p.into_inner() = false,
        }
        Ok(())
    }
}

/// A connection still in its handshake: served by the accept thread's event loop,
/// without a thread of its own.
struct Pending {
    stream: mio::net::TcpStream,
    peer: String,
    hs: ServerHandshake,
    dec: FrameDecoder,
    out: Vec<u8>,
    deadline: std::time::Instant,
    /// Close once `out` is written (after an error frame).
    closing: bool,
}

const LISTENER: mio::Token = mio::Token(usize::MAX);

/// Accepts connections and runs their handshakes on one thread (mio): a peer that has
/// not proved the key costs a small buffer, never a thread. A connection that proved
/// it is handed to a thread of its own (at most [`MAX_CONNECTIONS`] at once).
fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    if let Err(e) = run_accept_loop(listener, &shared) {
        log::error!("soft NIC: the accept loop stopped: {e}");
    }
}

fn run_accept_loop(listener: TcpListener, shared: &Arc<Shared>) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut listener = mio::net::TcpListener::from_std(listener);
    let mut poll = mio::Poll::new()?;
    poll.registry()
        .register(&mut listener, LISTENER, mio::Interest::READABLE)?;
    let mut events = mio::Events::with_capacity(128);
    let mut pending: HashMap<usize, Pending> = HashMap::new();
    let mut next = 0usize;
    let mut buf = vec![0u8; 4096];
    loop {
        let now = std::time::Instant::now();
        let timeout = pending
            .values()
            .map(|p| p.deadline.saturating_duration_since(now))
            .min();
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        for ev in events.iter() {
            if ev.token() == LISTENER {
                accept_pending(&listener, &poll, &mut pending, &mut next, shared);
                continue;
            }
            let tok = ev.token().0;
            let Some(p) = pending.get_mut(&tok) else {
                continue;
            };
            match step_pending(p, &mut buf) {
                PendingStep::Wait => {
                    let interest = if p.out.is_empty() {
                        mio::Interest::READABLE
                    } else {
                        mio::Interest::READABLE | mio::Interest::WRITABLE
                    };
                    let _ = poll
                        .registry()
                        .reregister(&mut p.stream, ev.token(), interest);
                }
                PendingStep::Close(why) => {
                    if let Some(mut p) = pending.remove(&tok) {
                        log::info!("soft NIC: connection from {} refused: {why}", p.peer);
                        let _ = poll.registry().deregister(&mut p.stream);
                    }
                }
                PendingStep::Ready(head) => {
                    if let Some(mut p) = pending.remove(&tok) {
                        let _ = poll.registry().deregister(&mut p.stream);
                        start_serving(p, head, shared);
                    }
                }
            }
        }
        let now = std::time::Instant::now();
        let late: Vec<usize> = pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(t, _)| *t)
            .collect();
        for t in late {
            if let Some(mut p) = pending.remove(&t) {
                log::info!(
                    "soft NIC: closing connection from {}: no handshake within {} ms",
                    p.peer,
                    HANDSHAKE_DEADLINE.as_millis()
                );
                let _ = poll.registry().deregister(&mut p.stream);
            }
        }
        shared.pending.store(pending.len() as u64, Ordering::SeqCst);
    }
}

fn accept_pending(
    listener: &mio::net::TcpListener,
    poll: &mio::Poll,
    pending: &mut HashMap<usize, Pending>,
    next: &mut usize,
    shared: &Shared,
) {
    loop {
        let (mut stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // EMFILE and friends: the next readiness retries.
                log::warn!("soft NIC: accept failed: {e}");
                return;
            }
        };
        let serving = shared.conns.lock().map(|c| c.len()).unwrap_or(usize::MAX);
        if serving >= MAX_CONNECTIONS || pending.len() as u64 >= MAX_PENDING {
            // Closed at once (dropped); logged at debug only, so that a flood of
            // connections does not flood the log either.
            log::debug!(
                "soft NIC: refusing connection from {peer}: {serving} served, {} in their handshake (limits)",
                pending.len()
            );
            continue;
        }
        let _ = stream.set_nodelay(true);
        let tok = *next;
        *next = (*next + 1) % LISTENER.0;
        if let Err(e) =
            poll.registry()
                .register(&mut stream, mio::Token(tok), mio::Interest::READABLE)
        {
            log::warn!("soft NIC: cannot register a connection from {peer}: {e}");
            continue;
        }
        pending.insert(
            tok,
            Pending {
                stream,
                peer: peer.to_string(),
                hs: ServerHandshake::new(
                    proto::SERVICE,
                    shared.key.clone(),
                    serde_json::Value::Null,
                ),
                dec: FrameDecoder::new(PRE_AUTH_MAX_FRAME),
                out: Vec::new(),
                deadline: std::time::Instant::now() + HANDSHAKE_DEADLINE,
                closing: false,
            },
        );
    }
}

enum PendingStep {
    /// More bytes to read or write.
    Wait,
    /// Close it (refused, failed or gone).
    Close(String),
    /// Proved: serve it, starting with these bytes read past the handshake.
    Ready(Vec<u8>),
}

/// Reads, runs the handshake, writes, as far as the socket allows now.
fn step_pending(p: &mut Pending, buf: &mut [u8]) -> PendingStep {
    if !p.closing {
        loop {
            match p.stream.read(buf) {
                Ok(0) => return PendingStep::Close("closed by the peer".into()),
                Ok(n) => p.dec.push(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return PendingStep::Close(e.to_string()),
            }
            if p.dec.buffered() > PRE_AUTH_MAX_FRAME + wire::frame::HEADER_LEN {
                break; // a whole frame's worth: decode it (or refuse it) first
            }
        }
    }
    let mut ready = None;
    while !p.closing && ready.is_none() {
        match p.dec.next_frame() {
            Ok(Some(f)) => match p.hs.on_frame(&f) {
                Step::Send(b) => p.out.extend(b),
                Step::Ready { send, .. } => {
                    p.out.extend(send);
                    ready = Some(());
                }
                Step::Fail(e) => {
                    p.out.extend(wire::error_frame(&e));
                    p.closing = true;
                }
            },
            Ok(None) => break,
            Err(e) => {
                p.out.extend(wire::error_frame(&wire::WireError::new(
                    wire::ErrorCode::Protocol,
                    e.to_string(),
                )));
                p.closing = true;
            }
        }
    }
    while !p.out.is_empty() {
        match p.stream.write(&p.out) {
            Ok(0) => return PendingStep::Close("write returned 0".into()),
            Ok(n) => {
                p.out.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return PendingStep::Close(e.to_string()),
        }
    }
    if p.closing && p.out.is_empty() {
        return PendingStep::Close("handshake failed".into());
    }
    if ready.is_some() {
        // What of the last handshake frame did not fit the socket buffer yet stays in
        // `out`: the connection's own thread writes it first (`serve`).
        let dec = std::mem::replace(&mut p.dec, FrameDecoder::new(0));
        return PendingStep::Ready(dec.into_rest());
    }
    PendingStep::Wait
}

/// Hands a connection that proved the key to a thread of its own.
fn start_serving(p: Pending, head: Vec<u8>, shared: &Arc<Shared>) {
    use std::os::fd::{FromRawFd, IntoRawFd};
    let Pending {
        stream, peer, out, ..
    } = p;
    // SAFETY: the descriptor comes from a stream we own and give up here.
    let stream = unsafe { TcpStream::from_raw_fd(stream.into_raw_fd()) };
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let kept = match stream.try_clone() {
        Ok(c) => c,
        Err(e) => return log::warn!("soft NIC: connection from {peer}: {e}"),
    };
    match shared.conns.lock() {
        Ok(mut conns) => {
            conns.insert(id, kept);
        }
        Err(_) => return,
    }
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("soft-nic-conn".into())
        .spawn(move || {
            match serve(stream, &s, &out, head) {
                Ok(()) => log::debug!("soft NIC: {peer} disconnected"),
                Err(e) => log::info!("soft NIC: connection from {peer} ended: {e}"),
            }
            // The handle kept for shutdown would hold the socket open (no FIN to
            // a refused peer, one descriptor per closed connection): close it.
            let kept = s.conns.lock().ok().and_then(|mut c| c.remove(&id));
            if let Some(c) = kept {
                let _ = c.shutdown(Shutdown::Both);
            }
        });
    if let Err(e) = spawned {
        log::warn!("soft NIC: cannot start a connection thread: {e}");
        if let Ok(mut c) = shared.conns.lock() {
            c.remove(&id);
        }
    }
}

/// A reader that first yields bytes read ahead during the handshake.
struct Prefixed<'a> {
    head: Vec<u8>,
    pos: usize,
    stream: &'a TcpStream,
}

impl Prefixed<'_> {
    /// `read_exact` of a payload: what was read ahead first, then the socket in bulk.
    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let n = buf.len().min(self.head.len() - self.pos);
        buf[..n].copy_from_slice(&self.head[self.pos..self.pos + n]);
        self.pos += n;
        crate::net::sockopt::read_exact_bulk(self.stream, &mut buf[n..])
    }
}

impl Read for Prefixed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos < self.head.len() {
            let n = buf.len().min(self.head.len() - self.pos);
            buf[..n].copy_from_slice(&self.head[self.pos..self.pos + n]);
            self.pos += n;
            return Ok(n);
        }
        (&*self.stream).read(buf)
    }
}

/// Serves the operations of a connection that proved the key. `unsent`: the end of
/// the handshake not written yet; `head`: bytes read past the handshake.
fn serve(stream: TcpStream, shared: &Shared, unsent: &[u8], head: Vec<u8>) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(shared.io_timeout))?;
    stream.set_write_timeout(Some(shared.io_timeout))?;
    (&stream).write_all(unsent)?;
    // Idle between operations is fine: wait without a timeout for the next header.
    let mut rd = Prefixed {
        head,
        pos: 0,
        stream: &stream,
    };
    let mut hdr = [0u8; REQ_LEN];
    loop {
        stream.set_read_timeout(None)?;
        if let Err(e) = rd.read_exact(&mut hdr[..1]) {
            return if e.kind() == io::ErrorKind::UnexpectedEof {
                Ok(())
            } else {
                Err(e)
            };
        }
        stream.set_read_timeout(Some(shared.io_timeout))?;
        rd.read_exact(&mut hdr[1..])?;
        let req =
            Request::decode(&hdr).map_err(|m| io::Error::new(io::ErrorKind::InvalidData, m))?;
        shared.ops.fetch_add(1, Ordering::Relaxed);
        serve_op(&req, &mut rd, &stream, shared)?;
    }
}

fn lookup(shared: &Shared, rkey: u64) -> Option<Arc<Reg>> {
    shared.regs.read().ok()?.get(&rkey).cloned()
}

fn check(reg: &Reg, req: &Request) -> u32 {
    proto::op_status(reg.base, reg.len, reg.writable, req)
}

fn serve_op(
    req: &Request,
    rd: &mut Prefixed<'_>,
    mut out: &TcpStream,
    shared: &Shared,
) -> io::Result<()> {
    let reg = lookup(shared, req.rkey);
    // Holding the gate shared for the whole copy keeps deregistration waiting.
    let gate = reg.as_ref().map(|r| r.gate.read());
    let status = match (&reg, &gate) {
        (Some(r), Some(Ok(alive))) if **alive => check(r, req),
        _ => proto::ST_BAD_KEY,
    };
    if status != proto::ST_OK {
        shared.rejected.fetch_add(1, Ordering::Relaxed);
        drop(gate);
        if req.op == proto::OP_WRITE {
            // Consume and discard the payload: nothing is written.
            io::copy(&mut rd.take(req.len), &mut io::sink())?;
        }
        let cpl = Completion {
            seq: req.seq,
            status,
            len: 0,
        };
        return out.write_all(&cpl.encode());
    }
    let ptr = req.addr as *mut u8;
    if req.op == proto::OP_WRITE {
        // SAFETY: the range lies inside a live registration (checked above), whose
        // memory stays mapped while the gate is held shared.
        let dst = unsafe { std::slice::from_raw_parts_mut(ptr, req.len as usize) };
        rd.read_payload(dst)?;
        drop(gate);
        out.write_all(
            &Completion {
                seq: req.seq,
                status,
                len: 0,
            }
            .encode(),
        )
    } else {
        // SAFETY: as above, for reading.
        let src = unsafe { std::slice::from_raw_parts(ptr as *const u8, req.len as usize) };
        let cpl = Completion {
            seq: req.seq,
            status,
            len: req.len,
        }
        .encode();
        write_two(&mut out, &cpl, src)?;
        drop(gate);
        Ok(())
    }
}

/// Writes `a` then `b` with vectored writes (one syscall for header + payload).
pub(crate) fn write_two(out: &mut impl Write, a: &[u8], b: &[u8]) -> io::Result<()> {
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

#[allow(dead_code)]
const _: () = assert!(CPL_LEN == 24 && REQ_LEN == 40);
