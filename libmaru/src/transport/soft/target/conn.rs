//! One data connection of the soft target: its handshake (the key proved), its
//! binding to one owner, and its requests, each checked against the registration
//! table and its bytes moved straight between the socket and the registered memory
//! (a WRITE's payload read into the region, a READ's written from it). The serving
//! threads that drive it are in `serve.rs`.

use super::super::proto::{self, Completion, Request, REQ_LEN};
use super::table::*;
use crate::auth::SharedKey;
use crate::net::handshake::{ServerHandshake, Step};
use crate::wire::{self, FrameDecoder};
use std::io::{self, IoSlice, Read, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A connection still in its handshake.
struct Pending {
    hs: ServerHandshake,
    dec: FrameDecoder,
    /// Close once `out` is written (after an error frame).
    closing: bool,
    /// Why the handshake was refused (for the log).
    failure: Option<String>,
}

/// What a served connection is reading.
enum Rx {
    /// A request header; `got` bytes of it so far.
    Header { got: usize },
    /// A WRITE's payload, straight into the region.
    Payload {
        _reg: RegUse,
        addr: u64,
        left: u64,
        seq: u64,
    },
    /// The payload of a refused WRITE, thrown away.
    Discard { left: u64, seq: u64, status: u32 },
}

/// A READ's payload being sent from the region.
struct Tx {
    _reg: RegUse,
    addr: u64,
    left: u64,
}

struct Served {
    /// The owner this connection bound itself to (none: every key is refused).
    binding: Option<Binding>,
    rx: Rx,
    hdr: [u8; REQ_LEN],
    tx: Option<Tx>,
    /// Since when it is mid-operation without progress (`None`: idle).
    stalled_since: Option<Instant>,
    /// The socket's receive low-water mark now (`SO_RCVLOWAT`, see [`wake_at`]).
    lowat: usize,
    /// The highest mark the receive buffer allows.
    lowat_cap: usize,
}

/// A WRITE payload at least this long is read with a raised receive low-water mark.
const LOWAT_FROM: u64 = 128 << 10;
/// The highest mark set.
const LOWAT_MAX: usize = 256 << 10;

/// Sets the socket's receive low-water mark: while a large WRITE payload arrives, the
/// loop is woken once per `mark` bytes rather than once per segment (on a VM each
/// wake-up is an interrupt and an exit, the largest cost of a loopback stream after
/// the copies). The mark never exceeds what is still to come, nor a quarter of the
/// receive buffer, so it is always reached.
fn wake_at(stream: &mio::net::TcpStream, mark: usize) {
    use std::os::fd::AsRawFd;
    let v = i32::try_from(mark).unwrap_or(i32::MAX);
    // SAFETY: a valid socket and a pointer to one int of the size given.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        );
    }
}

/// A quarter of the socket's receive buffer (at most [`LOWAT_MAX`]).
fn lowat_cap(stream: &mio::net::TcpStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut v: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: a valid socket, an int and its length.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&mut v as *mut i32).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return 1;
    }
    (usize::try_from(v).unwrap_or(0) / 4).clamp(1, LOWAT_MAX)
}

enum State {
    Handshake(Pending),
    Served(Served),
}

pub(super) struct Conn {
    pub(super) stream: mio::net::TcpStream,
    pub(super) peer: String,
    /// Bytes read past the handshake, consumed before the socket.
    head: Vec<u8>,
    /// Bytes to send (handshake frames, completions).
    out: Vec<u8>,
    state: State,
}

impl Conn {
    /// A connection just accepted from `peer`, in its handshake (`key`: the one the
    /// peer must prove, none for a test target without one).
    pub(super) fn new(stream: mio::net::TcpStream, peer: String, key: Option<SharedKey>) -> Conn {
        Conn {
            stream,
            peer,
            head: Vec::new(),
            out: Vec::new(),
            state: State::Handshake(Pending {
                hs: ServerHandshake::new(proto::SERVICE, key, serde_json::Value::Null),
                dec: FrameDecoder::new(PRE_AUTH_MAX_FRAME),
                closing: false,
                failure: None,
            }),
        }
    }

    /// Whether it proved the key (its handshake is over).
    pub(super) fn proven(&self) -> bool {
        matches!(self.state, State::Served(_))
    }

    /// The owner it bound itself to, if it did.
    pub(super) fn bound_to(&self) -> Option<u64> {
        match &self.state {
            State::Served(s) => s.binding.as_ref().map(|b| b.owner),
            State::Handshake(_) => None,
        }
    }
}

/// A connection reads its next request only while less than this is unsent.
const OUT_LIMIT: usize = 64 << 10;

/// What driving a connection came to.
pub(super) enum Drive {
    Open,
    Close(String),
}

/// When a served connection is closed unless it makes progress (handshake and bind
/// deadlines are the door's).
pub(super) fn stall_deadline(c: &Conn, io_timeout: Duration) -> Option<Instant> {
    match &c.state {
        State::Handshake(_) => None,
        State::Served(s) => s.stalled_since.map(|t| t + io_timeout),
    }
}

/// Moves the connection on as far as its socket allows now.
pub(super) fn drive(c: &mut Conn, table: &Table, scratch: &mut [u8]) -> Drive {
    if matches!(c.state, State::Handshake(_)) {
        match step_handshake(c, scratch) {
            Ok(true) => {}
            Ok(false) => return Drive::Open,
            Err(why) => return Drive::Close(why),
        }
    }
    match serve(c, table, scratch) {
        Ok(()) => Drive::Open,
        Err(e) => Drive::Close(e.to_string()),
    }
}

/// Reads, runs the handshake, writes. `Ok(true)`: proved, now served.
///
/// It never reads more than the frame under way may still need
/// ([`FrameDecoder::room`]): a peer that has proved nothing holds at most one
/// pre-auth frame here.
fn step_handshake(c: &mut Conn, buf: &mut [u8]) -> Result<bool, String> {
    let State::Handshake(p) = &mut c.state else {
        return Ok(true);
    };
    let mut ready = false;
    let mut drained = false;
    while !p.closing && !ready && !drained {
        let room = p.dec.room().min(buf.len());
        if room > 0 {
            match c.stream.read(&mut buf[..room]) {
                Ok(0) => return Err("closed by the peer".into()),
                Ok(n) => p.dec.push(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => drained = true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        let mut progress = false;
        while !p.closing && !ready {
            match p.dec.next_frame() {
                Ok(Some(f)) => {
                    progress = true;
                    match p.hs.on_frame(&f) {
                        Step::Send(b) => c.out.extend(b),
                        Step::Ready { send, .. } => {
                            c.out.extend(send);
                            ready = true;
                        }
                        Step::Fail(e) => {
                            c.out.extend(wire::error_frame(&e));
                            p.failure = Some(e.message);
                            p.closing = true;
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    c.out.extend(wire::error_frame(&wire::WireError::new(
                        wire::ErrorCode::Protocol,
                        e.to_string(),
                    )));
                    p.failure = Some(e.to_string());
                    p.closing = true;
                }
            }
        }
        if room == 0 && !progress {
            break; // cannot happen (a full decoder holds a frame); never spin
        }
    }
    flush_out(&mut c.stream, &mut c.out).map_err(|e| e.to_string())?;
    if p.closing {
        return if c.out.is_empty() {
            Err(format!(
                "handshake refused: {}",
                p.failure.as_deref().unwrap_or("protocol error")
            ))
        } else {
            Ok(false)
        };
    }
    if ready {
        let dec = std::mem::replace(&mut p.dec, FrameDecoder::new(0));
        c.head = dec.into_rest();
        let cap = lowat_cap(&c.stream);
        c.state = State::Served(Served {
            binding: None,
            rx: Rx::Header { got: 0 },
            hdr: [0; REQ_LEN],
            tx: None,
            stalled_since: None,
            lowat: 1,
            lowat_cap: cap,
        });
        return Ok(true);
    }
    Ok(false)
}

/// Writes what `out` holds as far as the socket takes it.
fn flush_out(stream: &mut mio::net::TcpStream, out: &mut Vec<u8>) -> io::Result<bool> {
    let mut moved = false;
    while !out.is_empty() {
        match stream.write(out) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                out.drain(..n);
                moved = true;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(moved)
}

/// Reads into `dst`: bytes read ahead first, then the socket. `Ok(None)`: would block.
fn read_some(c: &mut Conn, dst: &mut [u8]) -> io::Result<Option<usize>> {
    if !c.head.is_empty() {
        let n = dst.len().min(c.head.len());
        dst[..n].copy_from_slice(&c.head[..n]);
        c.head.drain(..n);
        return Ok(Some(n));
    }
    loop {
        match c.stream.read(dst) {
            Ok(0) if !dst.is_empty() => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed by the peer",
                ))
            }
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Sends unsent completions and the READ payload under way. Returns whether bytes
/// moved.
fn send(c: &mut Conn) -> io::Result<bool> {
    let State::Served(s) = &mut c.state else {
        return Ok(false);
    };
    let mut moved = false;
    loop {
        let payload: &[u8] = match &s.tx {
            // SAFETY: the range lies inside a live registration (checked when the READ
            // was accepted), whose memory stays mapped while its use is held.
            Some(t) => unsafe { std::slice::from_raw_parts(t.addr as *const u8, t.left as usize) },
            None => &[],
        };
        if c.out.is_empty() && payload.is_empty() {
            s.tx = None;
            return Ok(moved);
        }
        let r = if c.out.is_empty() {
            c.stream.write(payload)
        } else {
            c.stream
                .write_vectored(&[IoSlice::new(&c.out), IoSlice::new(payload)])
        };
        match r {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                moved = true;
                let from_out = n.min(c.out.len());
                c.out.drain(..from_out);
                if let Some(t) = &mut s.tx {
                    t.addr += (n - from_out) as u64;
                    t.left -= (n - from_out) as u64;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(moved),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Serves requests until the socket blocks (or the peer does not read its replies).
fn serve(c: &mut Conn, table: &Table, scratch: &mut [u8]) -> io::Result<()> {
    loop {
        let mut moved = send(c)?;
        let State::Served(s) = &c.state else {
            return Ok(());
        };
        let may_read = match s.rx {
            Rx::Header { .. } => s.tx.is_none() && c.out.len() < OUT_LIMIT,
            _ => true,
        };
        if may_read {
            moved |= receive(c, table, scratch)?;
        }
        let State::Served(s) = &mut c.state else {
            return Ok(());
        };
        let busy = !matches!(s.rx, Rx::Header { got: 0 }) || s.tx.is_some() || !c.out.is_empty();
        if moved || !busy {
            s.stalled_since = busy.then(Instant::now);
        } else if s.stalled_since.is_none() {
            s.stalled_since = Some(Instant::now());
        }
        if !moved {
            return Ok(());
        }
    }
}

/// Reads what the socket holds now, one step. Returns whether bytes moved.
fn receive(c: &mut Conn, table: &Table, scratch: &mut [u8]) -> io::Result<bool> {
    let State::Served(s) = &mut c.state else {
        return Ok(false);
    };
    match &mut s.rx {
        Rx::Header { got } => {
            let at = *got;
            let mut hdr = s.hdr;
            let Some(n) = read_some(c, &mut hdr[at..])? else {
                return Ok(false);
            };
            let State::Served(s) = &mut c.state else {
                return Ok(false);
            };
            s.hdr = hdr;
            if at + n < REQ_LEN {
                s.rx = Rx::Header { got: at + n };
                return Ok(true);
            }
            let req = Request::decode(&s.hdr)
                .map_err(|m| io::Error::new(io::ErrorKind::InvalidData, m))?;
            start(c, &req, table);
            Ok(true)
        }
        Rx::Payload { addr, left, .. } => {
            let (a, l) = (*addr, *left);
            let mark = if l >= LOWAT_FROM {
                (l as usize).min(s.lowat_cap)
            } else {
                1
            };
            if mark != s.lowat {
                wake_at(&c.stream, mark);
                s.lowat = mark;
            }
            let want = l.min(1 << 30) as usize;
            // SAFETY: the range lies inside a live registration (checked when the
            // WRITE was accepted), whose memory stays mapped while its use is held.
            let dst = unsafe { std::slice::from_raw_parts_mut(a as *mut u8, want) };
            let Some(n) = read_some(c, dst)? else {
                return Ok(false);
            };
            let State::Served(s) = &mut c.state else {
                return Ok(false);
            };
            if let Rx::Payload {
                addr, left, seq, ..
            } = &mut s.rx
            {
                *addr += n as u64;
                *left -= n as u64;
                if *left == 0 {
                    let seq = *seq;
                    // The use ends with the payload, before the completion is sent.
                    s.rx = Rx::Header { got: 0 };
                    if s.lowat != 1 {
                        wake_at(&c.stream, 1);
                        s.lowat = 1;
                    }
                    complete(&mut c.out, seq, proto::ST_OK, 0);
                }
            }
            Ok(true)
        }
        Rx::Discard { left, .. } => {
            let want = (*left).min(scratch.len() as u64) as usize;
            let Some(n) = read_some(c, &mut scratch[..want])? else {
                return Ok(false);
            };
            let State::Served(s) = &mut c.state else {
                return Ok(false);
            };
            if let Rx::Discard { left, seq, status } = &mut s.rx {
                *left -= n as u64;
                if *left == 0 {
                    let (seq, status) = (*seq, *status);
                    s.rx = Rx::Header { got: 0 };
                    complete(&mut c.out, seq, status, 0);
                }
            }
            Ok(true)
        }
    }
}

fn complete(out: &mut Vec<u8>, seq: u64, status: u32, len: u64) {
    out.extend_from_slice(&Completion { seq, status, len }.encode());
}

/// Starts a request whose header was read: checks its key against the connection's
/// owner, its range and access, then reads or sends its payload.
fn start(c: &mut Conn, req: &Request, table: &Table) {
    let State::Served(s) = &mut c.state else {
        return;
    };
    s.rx = Rx::Header { got: 0 };
    if req.op == proto::OP_BIND {
        let secret = (u128::from(req.addr) << 64) | u128::from(req.rkey);
        let status = match &s.binding {
            // Bound already: a connection serves one owner for good. Its own owner's
            // secret again changes nothing; any other is refused.
            Some(b) => {
                if lock(&table.owners).owner_of.get(&secret) == Some(&b.owner) {
                    proto::ST_OK
                } else {
                    proto::ST_BAD_KEY
                }
            }
            None => match Binding::take(&table.owners, secret) {
                Ok(b) => {
                    s.binding = Some(b);
                    proto::ST_OK
                }
                Err(st) => {
                    if st == proto::ST_LIMIT {
                        table.note(
                            log::Level::Warn,
                            "bindings refused (owner at its cap)",
                            &c.peer,
                            || {
                                format!(
                                    "refusing to bind the data connection from {}: its owner \
                                     has {MAX_PER_OWNER} data connections already",
                                    c.peer
                                )
                            },
                        );
                    }
                    st
                }
            },
        };
        return complete(&mut c.out, req.seq, status, 0);
    }
    table.ops.fetch_add(1, Ordering::Relaxed);
    let reg = table
        .regs
        .read()
        .ok()
        .and_then(|r| r.get(&req.rkey).cloned())
        // A key of another owner is no key on this connection (as a key of another
        // protection domain is none on a queue pair).
        .filter(|r| s.binding.as_ref().is_some_and(|b| b.owner == r.owner))
        .and_then(RegUse::take);
    let status = match &reg {
        Some(r) => proto::op_status(r.0.base, r.0.len, r.0.writable, req),
        None => proto::ST_BAD_KEY,
    };
    match reg {
        Some(r) if status == proto::ST_OK => {
            if req.op == proto::OP_WRITE {
                if req.len == 0 {
                    complete(&mut c.out, req.seq, proto::ST_OK, 0);
                } else {
                    s.rx = Rx::Payload {
                        _reg: r,
                        addr: req.addr,
                        left: req.len,
                        seq: req.seq,
                    };
                }
            } else {
                complete(&mut c.out, req.seq, proto::ST_OK, req.len);
                s.tx = Some(Tx {
                    _reg: r,
                    addr: req.addr,
                    left: req.len,
                });
            }
        }
        _ => {
            table.rejected.fetch_add(1, Ordering::Relaxed);
            if req.op == proto::OP_WRITE && req.len > 0 {
                // Consume and discard the payload: nothing is written.
                s.rx = Rx::Discard {
                    left: req.len,
                    seq: req.seq,
                    status,
                };
            } else {
                complete(&mut c.out, req.seq, status, 0);
            }
        }
    }
}
