//! The soft NIC's responder on the memory node: serves READ/WRITE against its
//! registration table and checks the remote key on every operation, as a NIC does.
//!
//! One thread per worker connection, blocking I/O (it sleeps in the kernel while
//! idle). Bytes go straight between the socket and the registered memory: a WRITE's
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
    /// Data connections open now.
    pub connections: usize,
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

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                log::warn!("soft NIC: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let open = shared.conns.lock().map(|c| c.len()).unwrap_or(usize::MAX);
        if open >= MAX_CONNECTIONS || shared.pending.load(Ordering::SeqCst) >= MAX_PENDING {
            // Closed at once (dropped): no thread, no buffer. Logged at debug only, so
            // a flood of connections does not flood the log either.
            log::debug!("soft NIC: refusing connection from {peer}: {open} open (limit)");
            continue;
        }
        shared.pending.fetch_add(1, Ordering::SeqCst);
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        if let Ok(c) = stream.try_clone() {
            if let Ok(mut conns) = shared.conns.lock() {
                conns.insert(id, c);
            }
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("soft-nic-conn".into())
            .spawn(move || {
                match serve(stream, &s) {
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
            shared.pending.fetch_sub(1, Ordering::SeqCst);
            if let Ok(mut c) = shared.conns.lock() {
                c.remove(&id);
            }
        }
    }
}

/// Runs the handshake; returns the bytes already read past it. The whole handshake
/// has [`HANDSHAKE_DEADLINE`], and frames before the proof are small.
fn handshake(stream: &mut TcpStream, shared: &Shared) -> io::Result<Vec<u8>> {
    let mut hs = ServerHandshake::new(proto::SERVICE, shared.key.clone(), serde_json::Value::Null);
    let mut dec = FrameDecoder::new(PRE_AUTH_MAX_FRAME);
    let mut buf = [0u8; 4096];
    let deadline = std::time::Instant::now() + HANDSHAKE_DEADLINE;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no handshake within the deadline",
            ));
        }
        stream.set_read_timeout(Some(left))?;
        match dec.next_frame() {
            Ok(Some(f)) => match hs.on_frame(&f) {
                Step::Send(b) => stream.write_all(&b)?,
                Step::Ready { send, .. } => {
                    stream.write_all(&send)?;
                    return Ok(dec.into_rest());
                }
                Step::Fail(e) => {
                    let _ = stream.write_all(&wire::error_frame(&e));
                    return Err(io::Error::new(io::ErrorKind::PermissionDenied, e.message));
                }
            },
            Ok(None) => {
                let n = stream.read(&mut buf)?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                dec.push(&buf[..n]);
            }
            Err(e) => {
                let _ = stream.write_all(&wire::error_frame(&wire::WireError::new(
                    wire::ErrorCode::Protocol,
                    e.to_string(),
                )));
                return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()));
            }
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

/// Counts a connection as pending until dropped (its handshake ended, either way).
struct PendingGuard<'a>(&'a AtomicU64);

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve(mut stream: TcpStream, shared: &Shared) -> io::Result<()> {
    let pending = PendingGuard(&shared.pending);
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(shared.io_timeout))?;
    stream.set_write_timeout(Some(shared.io_timeout))?;
    let head = handshake(&mut stream, shared)?;
    drop(pending);
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
