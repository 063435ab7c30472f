//! The soft target's data connections, served: the shard threads' poll loop, shard
//! 0's door (accept, handshake and bind stages), and each connection's requests with
//! their bytes moved straight between the socket and the registered memory.

use super::super::proto::{self, Completion, Request, REQ_LEN};
use super::table::*;
use crate::auth::SharedKey;
use crate::net::handshake::{ServerHandshake, Step};
use crate::net::slots::{Admit, Slots, StageLimits};
use crate::net::throttled_log::{self, ThrottledLog};
use crate::wire::{self, FrameDecoder};
use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

pub(super) const LISTENER: mio::Token = mio::Token(usize::MAX);
pub(super) const WAKER: mio::Token = mio::Token(usize::MAX - 1);

/// One serving thread (its own `Poll`), seen from the others.
pub(super) struct Shard {
    pub(super) waker: mio::Waker,
    /// Proven connections handed to it by the accepting shard.
    pub(super) inbox: Mutex<Vec<Conn>>,
    /// Owners closed since it last looked: their data connections go.
    pub(super) closed_owners: Mutex<Vec<u64>>,
    /// Bound connections it serves now.
    pub(super) serving: AtomicU64,
    /// Connections in their handshake now (shard 0 only).
    pub(super) pending: AtomicU64,
    /// Proven connections not bound yet (shard 0 only).
    pub(super) unbound: AtomicU64,
}

pub(super) struct Shared {
    pub(super) regs: RwLock<HashMap<u64, Arc<Reg>>>,
    pub(super) owners: Arc<Mutex<Owners>>,
    /// Closes before binding and refused bindings, a line per interval (shard 0
    /// writes the summaries).
    pub(super) log: Mutex<ThrottledLog>,
    /// The responder's clock: milliseconds since it started.
    pub(super) started: Instant,
    pub(super) key: Option<SharedKey>,
    pub(super) io_timeout: Duration,
    pub(super) stop: AtomicBool,
    pub(super) shards: Vec<Shard>,
    pub(super) next_shard: AtomicU64,
    pub(super) ops: AtomicU64,
    pub(super) rejected: AtomicU64,
}

impl Shared {
    pub(super) fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Notes a connection closed or refused before binding (see [`ThrottledLog`]).
    pub(super) fn note(
        &self,
        level: log::Level,
        kind: &'static str,
        peer: &str,
        line: impl FnOnce() -> String,
    ) {
        let now = self.now_ms();
        throttled_log::emit(
            module_path!(),
            lock(&self.log).note(now, level, kind, peer, line),
        );
    }

    /// One count of every shard (from shard `from` on), summed.
    pub(super) fn sum(&self, from: usize, count: impl Fn(&Shard) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .skip(from)
            .map(|s| count(s).load(Ordering::SeqCst))
            .sum()
    }

    pub(super) fn unbound(&self) -> u64 {
        self.sum(0, |s| &s.unbound)
    }

    /// Bound connections served by the threads other than the door's.
    pub(super) fn serving_elsewhere(&self) -> usize {
        self.sum(1, |s| &s.serving) as usize
    }

    pub(super) fn serving(&self) -> u64 {
        self.sum(0, |s| &s.serving)
    }

    pub(super) fn pending(&self) -> u64 {
        self.sum(0, |s| &s.pending)
    }
}

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
    stream: mio::net::TcpStream,
    peer: String,
    /// Bytes read past the handshake, consumed before the socket.
    head: Vec<u8>,
    /// Bytes to send (handshake frames, completions).
    out: Vec<u8>,
    state: State,
}

/// A connection reads its next request only while less than this is unsent.
const OUT_LIMIT: usize = 64 << 10;

/// What driving a connection came to.
enum Drive {
    Open,
    Close(String),
}

/// Shard 0's door: the listener, and every connection not bound yet, by stage.
struct Door {
    listener: mio::net::TcpListener,
    slots: Slots<usize>,
}

/// The stages of [`Door::slots`].
const HANDSHAKE: usize = 0;
const UNBOUND: usize = 1;

impl Door {
    fn new(listener: mio::net::TcpListener) -> Door {
        Door {
            listener,
            slots: Slots::new(
                MAX_CONNECTIONS,
                &[
                    StageLimits {
                        cap: MAX_PENDING,
                        deadline_ms: HANDSHAKE_DEADLINE.as_millis() as u64,
                    },
                    StageLimits {
                        cap: MAX_UNBOUND,
                        deadline_ms: BIND_DEADLINE.as_millis() as u64,
                    },
                ],
            ),
        }
    }

    /// Accepts every connection waiting. Each takes a slot in its handshake, pushing
    /// out the oldest unbound connection when the stage or the whole port is full; a
    /// connection is refused only when every slot is bound.
    fn accept(
        &mut self,
        poll: &mio::Poll,
        conns: &mut HashMap<usize, Conn>,
        next: &mut usize,
        shared: &Shared,
    ) {
        loop {
            let (mut stream, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: the next readiness retries.
                    log::warn!("soft NIC: accept failed: {e}");
                    return;
                }
            };
            let tok = free_token(conns, next);
            let bound = conns.len() - self.slots.len() + shared.serving_elsewhere();
            match self.slots.admit(tok, bound, shared.now_ms()) {
                Admit::Refused => {
                    shared.note(
                        log::Level::Warn,
                        "refused at accept (every slot bound)",
                        &peer.to_string(),
                        || {
                            format!(
                                "refusing a data connection from {peer}: {MAX_CONNECTIONS} \
                                 bound data connections open (the limit)"
                            )
                        },
                    );
                    continue;
                }
                Admit::In { push_out } => {
                    if let Some(c) = push_out.and_then(|t| conns.remove(&t)) {
                        let proven = matches!(c.state, State::Served(_));
                        shared.note(
                            log::Level::Info,
                            "pushed out by newer connections",
                            &c.peer,
                            || {
                                format!(
                                    "closing the {} connection from {} to make room for {peer}: \
                                     it was the oldest",
                                    if proven { "unbound" } else { "unproven" },
                                    c.peer
                                )
                            },
                        );
                    }
                }
            }
            let _ = stream.set_nodelay(true);
            let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
            if let Err(e) = poll
                .registry()
                .register(&mut stream, mio::Token(tok), interest)
            {
                log::warn!("soft NIC: cannot register a connection from {peer}: {e}");
                self.slots.remove(tok);
                continue;
            }
            conns.insert(
                tok,
                Conn {
                    stream,
                    peer: peer.to_string(),
                    head: Vec::new(),
                    out: Vec::new(),
                    state: State::Handshake(Pending {
                        hs: ServerHandshake::new(
                            proto::SERVICE,
                            shared.key.clone(),
                            serde_json::Value::Null,
                        ),
                        dec: FrameDecoder::new(PRE_AUTH_MAX_FRAME),
                        closing: false,
                        failure: None,
                    }),
                },
            );
        }
    }

    /// After connection `tok` was driven: one that proved the key now must bind (its
    /// stage pushes out its oldest member when full); one that bound leaves the door
    /// for a serving thread.
    fn moved_on(
        &mut self,
        me: usize,
        tok: usize,
        poll: &mio::Poll,
        conns: &mut HashMap<usize, Conn>,
        shared: &Shared,
    ) {
        let Some(stage) = self.slots.stage_of(tok) else {
            return; // bound already, served here
        };
        let Some(State::Served(s)) = conns.get(&tok).map(|c| &c.state) else {
            return;
        };
        if s.binding.is_some() {
            self.slots.remove(tok);
            hand_over(me, tok, poll, conns, shared);
        } else if stage == HANDSHAKE {
            let out = self.slots.advance(tok, UNBOUND, shared.now_ms());
            if let Some(c) = out.and_then(|t| conns.remove(&t)) {
                shared.note(
                    log::Level::Info,
                    "pushed out unbound by newer proven connections",
                    &c.peer,
                    || {
                        format!(
                            "closing the data connection from {}: it proved the key but did \
                             not bind, and is the oldest of {MAX_UNBOUND} such",
                            c.peer
                        )
                    },
                );
            }
        }
    }

    /// Connection `tok`, gone: forgets its slot and notes why when it was not bound.
    fn closed(&mut self, tok: usize, peer: &str, why: &str, shared: &Shared) {
        let Some(stage) = self.slots.stage_of(tok) else {
            log::debug!("soft NIC: connection from {peer} closed: {why}");
            return;
        };
        self.slots.remove(tok);
        let kind = if stage == HANDSHAKE {
            "closed in their handshake"
        } else {
            "closed before binding"
        };
        shared.note(log::Level::Info, kind, peer, || {
            format!("connection from {peer} {kind}: {why}")
        });
    }

    /// Closes the connections past their stage's deadline.
    fn expire(&mut self, conns: &mut HashMap<usize, Conn>, shared: &Shared) {
        for (tok, stage) in self.slots.expired(shared.now_ms()) {
            self.slots.remove(tok);
            let Some(c) = conns.remove(&tok) else {
                continue;
            };
            let (kind, within) = if stage == HANDSHAKE {
                ("no handshake in time", HANDSHAKE_DEADLINE)
            } else {
                ("not bound in time", BIND_DEADLINE)
            };
            shared.note(log::Level::Info, kind, &c.peer, || {
                format!(
                    "closing the data connection from {}: {kind} ({} ms)",
                    c.peer,
                    within.as_millis()
                )
            });
        }
    }
}

/// One serving thread. Shard 0 (`listener` given) also accepts, runs handshakes and
/// bindings, and hands each bound connection to the shards in turn.
pub(super) fn run_loop(
    me: usize,
    listener: Option<TcpListener>,
    mut poll: mio::Poll,
    shared: &Arc<Shared>,
) -> io::Result<()> {
    let mut door = match listener {
        Some(l) => {
            l.set_nonblocking(true)?;
            let mut l = mio::net::TcpListener::from_std(l);
            poll.registry()
                .register(&mut l, LISTENER, mio::Interest::READABLE)?;
            Some(Door::new(l))
        }
        None => None,
    };
    let shard = &shared.shards[me];
    let mut events = mio::Events::with_capacity(256);
    let mut conns: HashMap<usize, Conn> = HashMap::new();
    let mut next = 0usize;
    let mut scratch = vec![0u8; 64 << 10];
    loop {
        let now = Instant::now();
        let now_ms = shared.now_ms();
        let door_due = door.as_ref().and_then(|d| {
            d.slots
                .next_deadline()
                .into_iter()
                .chain(lock(&shared.log).next_deadline())
                .min()
                .map(|ms| Duration::from_millis(ms.saturating_sub(now_ms)))
        });
        let timeout = conns
            .values()
            .filter_map(|c| stall_deadline(c, shared.io_timeout))
            .map(|d| d.saturating_duration_since(now))
            .chain(door_due)
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
            match ev.token() {
                LISTENER => {
                    if let Some(d) = &mut door {
                        d.accept(&poll, &mut conns, &mut next, shared);
                    }
                }
                WAKER => {
                    let closed = std::mem::take(&mut *lock(&shard.closed_owners));
                    conns.retain(|_, c| match &c.state {
                        State::Served(s) => !s
                            .binding
                            .as_ref()
                            .is_some_and(|b| closed.contains(&b.owner)),
                        State::Handshake(_) => true,
                    });
                    let handed = std::mem::take(&mut *lock(&shard.inbox));
                    for mut c in handed {
                        let tok = free_token(&conns, &mut next);
                        let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
                        if let Err(e) =
                            poll.registry()
                                .register(&mut c.stream, mio::Token(tok), interest)
                        {
                            log::warn!("soft NIC: cannot take a connection from {}: {e}", c.peer);
                            continue;
                        }
                        // Bytes may have come before it was registered here.
                        if let Drive::Open = drive(&mut c, shared, &mut scratch) {
                            conns.insert(tok, c);
                        }
                    }
                }
                tok => {
                    let Some(c) = conns.get_mut(&tok.0) else {
                        continue;
                    };
                    if let Drive::Close(why) = drive(c, shared, &mut scratch) {
                        let peer = std::mem::take(&mut c.peer);
                        conns.remove(&tok.0);
                        match &mut door {
                            Some(d) => d.closed(tok.0, &peer, &why, shared),
                            None => log::debug!("soft NIC: connection from {peer} closed: {why}"),
                        }
                        continue;
                    }
                    if let Some(d) = &mut door {
                        d.moved_on(me, tok.0, &poll, &mut conns, shared);
                    }
                }
            }
        }
        let now = Instant::now();
        let stalled: Vec<usize> = conns
            .iter()
            .filter(|(_, c)| stall_deadline(c, shared.io_timeout).is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect();
        for tok in stalled {
            if let Some(c) = conns.remove(&tok) {
                log::info!(
                    "soft NIC: closing connection from {}: stalled mid-operation",
                    c.peer
                );
                if let Some(d) = &mut door {
                    d.slots.remove(tok);
                }
            }
        }
        match &mut door {
            Some(d) => {
                d.expire(&mut conns, shared);
                throttled_log::emit(module_path!(), lock(&shared.log).due(shared.now_ms()));
                shard
                    .pending
                    .store(d.slots.count(HANDSHAKE) as u64, Ordering::SeqCst);
                shard
                    .unbound
                    .store(d.slots.count(UNBOUND) as u64, Ordering::SeqCst);
                shard
                    .serving
                    .store((conns.len() - d.slots.len()) as u64, Ordering::SeqCst);
            }
            None => shard.serving.store(conns.len() as u64, Ordering::SeqCst),
        }
    }
}

/// A token no connection of this shard uses.
fn free_token(conns: &HashMap<usize, Conn>, next: &mut usize) -> usize {
    loop {
        let t = *next;
        *next = (*next + 1) % WAKER.0;
        if !conns.contains_key(&t) {
            return t;
        }
    }
}

/// Gives a connection that just bound itself to the next shard in turn (keeps it
/// when that is this one).
fn hand_over(
    me: usize,
    tok: usize,
    poll: &mio::Poll,
    conns: &mut HashMap<usize, Conn>,
    shared: &Shared,
) {
    let n = shared.shards.len() as u64;
    let to = (shared.next_shard.fetch_add(1, Ordering::Relaxed) % n) as usize;
    if to == me {
        return;
    }
    let Some(mut c) = conns.remove(&tok) else {
        return;
    };
    let _ = poll.registry().deregister(&mut c.stream);
    let shard = &shared.shards[to];
    lock(&shard.inbox).push(c);
    shard.serving.fetch_add(1, Ordering::SeqCst);
    let _ = shard.waker.wake();
}

/// When a served connection is closed unless it makes progress (handshake and bind
/// deadlines are the door's).
fn stall_deadline(c: &Conn, io_timeout: Duration) -> Option<Instant> {
    match &c.state {
        State::Handshake(_) => None,
        State::Served(s) => s.stalled_since.map(|t| t + io_timeout),
    }
}

/// Moves the connection on as far as its socket allows now.
fn drive(c: &mut Conn, shared: &Shared, scratch: &mut [u8]) -> Drive {
    if matches!(c.state, State::Handshake(_)) {
        match step_handshake(c, scratch) {
            Ok(true) => {}
            Ok(false) => return Drive::Open,
            Err(why) => return Drive::Close(why),
        }
    }
    match serve(c, shared, scratch) {
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
fn serve(c: &mut Conn, shared: &Shared, scratch: &mut [u8]) -> io::Result<()> {
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
            moved |= receive(c, shared, scratch)?;
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
fn receive(c: &mut Conn, shared: &Shared, scratch: &mut [u8]) -> io::Result<bool> {
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
            start(c, &req, shared);
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
fn start(c: &mut Conn, req: &Request, shared: &Shared) {
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
                if lock(&shared.owners).owner_of.get(&secret) == Some(&b.owner) {
                    proto::ST_OK
                } else {
                    proto::ST_BAD_KEY
                }
            }
            None => match Binding::take(&shared.owners, secret) {
                Ok(b) => {
                    s.binding = Some(b);
                    proto::ST_OK
                }
                Err(st) => {
                    if st == proto::ST_LIMIT {
                        shared.note(
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
    shared.ops.fetch_add(1, Ordering::Relaxed);
    let reg = shared
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
            shared.rejected.fetch_add(1, Ordering::Relaxed);
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
