//! The mio event loop of every daemon.
//!
//! One thread, one `Poll`: the listener, every connection, the signal pipe. The loop
//! sleeps until a socket is ready, a signal arrives or the service's next deadline
//! (no idle busy-poll). A connection first runs the handshake (version, then the key
//! proof when the daemon has a key); only then do its request frames reach the
//! service. A broken frame stream gets an `Error` frame and is closed; a malformed
//! request gets an error reply and the connection stays; other connections never
//! notice either.

use super::handshake::{ServerHandshake, Step};
use super::sockopt;
use super::{Clock, SignalPipe};
use crate::auth::SharedKey;
use crate::wire::{self, ErrorCode, FrameDecoder, FrameKind, WireError};
use mio::net::{TcpListener, TcpStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

/// Identifies one connection for the life of the server (never reused).
pub type ConnId = u64;

/// What a daemon plugs into the loop.
pub trait Service {
    /// Name clients must ask for in their hello (`maru-rm`, ...).
    fn service_name(&self) -> &'static str;

    /// Extra facts for the welcome message (an agent's boot id, ...).
    fn welcome_info(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// A connection finished its handshake as `client_id`.
    fn on_open(&mut self, _conn: ConnId, _client_id: &str, _now_ms: u64) {}

    /// One request frame body; returns the reply frame to send (encoded).
    fn on_request(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8>;

    /// A connection that had finished its handshake is gone.
    fn on_close(&mut self, _conn: ConnId, _client_id: &str, _now_ms: u64) {}

    /// Timers: called when `next_deadline` has passed (and after every batch of events).
    fn on_tick(&mut self, _now_ms: u64) {}

    /// The next time `on_tick` must run, in the clock's milliseconds.
    fn next_deadline(&self) -> Option<u64> {
        None
    }

    /// Called once when the loop stops (signal): save what must be saved.
    fn on_shutdown(&mut self, _now_ms: u64) {}
}

/// Settings of the loop.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Largest frame body accepted on a connection.
    pub max_frame: usize,
    /// Connections beyond this are closed at accept.
    pub max_connections: usize,
    /// Key every client must prove (and the server proves back). None: no proof.
    pub key: Option<SharedKey>,
    /// A connection that has not finished its handshake after this long is closed.
    pub handshake_timeout_ms: u64,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_frame: wire::DEFAULT_MAX_FRAME,
            max_connections: 1024,
            key: None,
            handshake_timeout_ms: 10_000,
        }
    }
}

enum Phase {
    Handshake(ServerHandshake),
    Ready { client_id: String },
}

struct Conn {
    id: ConnId,
    stream: TcpStream,
    peer: SocketAddr,
    decoder: FrameDecoder,
    out: Vec<u8>,
    out_pos: usize,
    phase: Phase,
    opened_ms: u64,
    /// Close once `out` is flushed (after an error frame).
    closing: bool,
    writable_registered: bool,
}

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const FIRST_CONN: usize = 2;

/// The event loop over one listener.
pub struct Server {
    poll: Poll,
    listener: TcpListener,
    conns: HashMap<Token, Conn>,
    next_token: usize,
    next_conn_id: ConnId,
    opts: ServerOptions,
    clock: Clock,
    signals: Option<SignalPipe>,
    /// One read buffer for every connection (the loop is single-threaded), allocated
    /// once rather than zeroed on the stack for every readable event.
    rbuf: Box<[u8]>,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port; see [`Server::local_addr`]).
    pub fn bind(addr: SocketAddr, opts: ServerOptions, clock: Clock) -> io::Result<Server> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::bind(addr)?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        Ok(Server {
            poll,
            listener,
            conns: HashMap::new(),
            next_token: FIRST_CONN,
            next_conn_id: 1,
            opts,
            clock,
            signals: None,
            rbuf: vec![0u8; READ_CHUNK].into_boxed_slice(),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Stops the loop on SIGINT/SIGTERM (after `on_shutdown`).
    pub fn with_signals(mut self, pipe: SignalPipe) -> io::Result<Server> {
        let fd = pipe.fd();
        self.poll
            .registry()
            .register(&mut SourceFd(&fd), SIGNALS, Interest::READABLE)?;
        self.signals = Some(pipe);
        Ok(self)
    }

    /// Runs until a signal arrives (or forever without a signal pipe).
    pub fn run<S: Service>(&mut self, service: &mut S) -> io::Result<()> {
        let mut events = Events::with_capacity(256);
        loop {
            let now = self.clock.now_ms();
            let timeout = self.timeout(service, now);
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(service),
                    SIGNALS => {
                        if self.signals.as_ref().is_some_and(|s| s.drain()) {
                            log::info!("signal received; shutting down");
                            let now = self.clock.now_ms();
                            self.close_all(service, now);
                            service.on_shutdown(now);
                            return Ok(());
                        }
                    }
                    tok => self.on_conn_event(
                        service,
                        tok,
                        ev.is_readable() || ev.is_read_closed(),
                        ev.is_read_closed(),
                        ev.is_writable(),
                    ),
                }
            }
            let now = self.clock.now_ms();
            if service.next_deadline().is_some_and(|d| d <= now) {
                service.on_tick(now);
            }
            self.expire_handshakes(service, now);
        }
    }

    fn timeout<S: Service>(&self, service: &S, now: u64) -> Option<Duration> {
        let mut deadline = service.next_deadline();
        for c in self.conns.values() {
            if !matches!(c.phase, Phase::Ready { .. }) {
                let d = c.opened_ms + self.opts.handshake_timeout_ms;
                deadline = Some(deadline.map_or(d, |x| x.min(d)));
            }
        }
        deadline.map(|d| Duration::from_millis(d.saturating_sub(now)))
    }

    fn accept<S: Service>(&mut self, service: &S) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, peer)) => {
                    if self.conns.len() >= self.opts.max_connections {
                        log::warn!(
                            "refusing connection from {peer}: {} connections already open (limit)",
                            self.conns.len()
                        );
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    sockopt::keepalive(&stream);
                    let token = Token(self.next_token);
                    self.next_token += 1;
                    if let Err(e) =
                        self.poll
                            .registry()
                            .register(&mut stream, token, Interest::READABLE)
                    {
                        log::warn!("cannot register connection from {peer}: {e}");
                        continue;
                    }
                    let id = self.next_conn_id;
                    self.next_conn_id += 1;
                    log::debug!("connection {id} from {peer}");
                    self.conns.insert(
                        token,
                        Conn {
                            id,
                            stream,
                            peer,
                            decoder: FrameDecoder::new(self.opts.max_frame),
                            out: Vec::new(),
                            out_pos: 0,
                            phase: Phase::Handshake(ServerHandshake::new(
                                service.service_name(),
                                self.opts.key.clone(),
                                service.welcome_info(),
                            )),
                            opened_ms: self.clock.now_ms(),
                            closing: false,
                            writable_registered: false,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    // EMFILE and friends: log and let the next readiness retry.
                    log::warn!("accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn on_conn_event<S: Service>(
        &mut self,
        service: &mut S,
        tok: Token,
        readable: bool,
        read_closed: bool,
        writable: bool,
    ) {
        let now = self.clock.now_ms();
        let Some(conn) = self.conns.get_mut(&tok) else {
            return;
        };
        let mut alive = true;
        if readable && !conn.closing {
            alive = read_all(conn, &mut self.rbuf, read_closed);
            process_frames(conn, service, now);
        }
        if alive && (writable || !conn.out.is_empty()) {
            alive = flush(conn);
        }
        if alive && conn.closing && conn.out_pos >= conn.out.len() {
            alive = false;
        }
        if !alive {
            self.drop_conn(service, tok, now);
            return;
        }
        let want_write = conn.out_pos < conn.out.len();
        if want_write != conn.writable_registered {
            let interest = if want_write {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            if self
                .poll
                .registry()
                .reregister(&mut conn.stream, tok, interest)
                .is_ok()
            {
                conn.writable_registered = want_write;
            }
        }
    }

    fn drop_conn<S: Service>(&mut self, service: &mut S, tok: Token, now: u64) {
        if let Some(mut c) = self.conns.remove(&tok) {
            let _ = self.poll.registry().deregister(&mut c.stream);
            log::debug!("connection {} from {} closed", c.id, c.peer);
            if let Phase::Ready { client_id } = &c.phase {
                service.on_close(c.id, client_id, now);
            }
        }
    }

    fn close_all<S: Service>(&mut self, service: &mut S, now: u64) {
        let toks: Vec<Token> = self.conns.keys().copied().collect();
        for t in toks {
            self.drop_conn(service, t, now);
        }
    }

    fn expire_handshakes<S: Service>(&mut self, service: &mut S, now: u64) {
        let limit = self.opts.handshake_timeout_ms;
        let late: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| !matches!(c.phase, Phase::Ready { .. }) && now >= c.opened_ms + limit)
            .map(|(t, _)| *t)
            .collect();
        for t in late {
            if let Some(c) = self.conns.get(&t) {
                log::info!(
                    "closing connection from {}: no handshake within {limit} ms",
                    c.peer
                );
            }
            self.drop_conn(service, t, now);
        }
    }
}

const READ_CHUNK: usize = 64 * 1024;

/// Reads everything available; false when the peer closed or the socket failed.
///
/// A read that did not fill the buffer drained the socket at that instant, so the loop
/// stops there instead of paying one more `read` for `WouldBlock` (mio's readiness is
/// edge-triggered: bytes or a FIN that arrive later raise a new event). When the event
/// already said the peer closed, it reads on until end of stream.
fn read_all(conn: &mut Conn, buf: &mut [u8], read_closed: bool) -> bool {
    loop {
        match conn.stream.read(buf) {
            Ok(0) => return false,
            Ok(n) => {
                conn.decoder.push(&buf[..n]);
                if n < buf.len() && !read_closed {
                    return true;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::debug!("read from {} failed: {e}", conn.peer);
                return false;
            }
        }
    }
}

/// Writes what is queued; false when the socket failed.
fn flush(conn: &mut Conn) -> bool {
    while conn.out_pos < conn.out.len() {
        match conn.stream.write(&conn.out[conn.out_pos..]) {
            Ok(0) => return false,
            Ok(n) => conn.out_pos += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::debug!("write to {} failed: {e}", conn.peer);
                return false;
            }
        }
    }
    conn.out.clear();
    conn.out_pos = 0;
    true
}

fn fail(conn: &mut Conn, code: ErrorCode, message: String) {
    log::info!("connection from {}: {message}; closing", conn.peer);
    conn.out
        .extend(wire::error_frame(&WireError::new(code, message)));
    conn.closing = true;
}

fn process_frames<S: Service>(conn: &mut Conn, service: &mut S, now: u64) {
    while !conn.closing {
        let f = match conn.decoder.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => return fail(conn, ErrorCode::Protocol, e.to_string()),
        };
        match &mut conn.phase {
            Phase::Handshake(hs) => match hs.on_frame(&f) {
                Step::Send(bytes) => conn.out.extend(bytes),
                Step::Ready { send, client_id } => {
                    conn.out.extend(send);
                    service.on_open(conn.id, &client_id, now);
                    conn.phase = Phase::Ready { client_id };
                }
                Step::Fail(e) => return fail(conn, e.code, e.message),
            },
            Phase::Ready { client_id } if f.kind == FrameKind::Request => {
                let reply = service.on_request(conn.id, client_id, &f.body, now);
                conn.out.extend(reply);
            }
            Phase::Ready { .. } => {
                // The frame was intact, so the stream is still in sync: reply and go on.
                let id = wire::request_id_of(&f.body);
                conn.out.extend(wire::reply_frame::<()>(
                    id,
                    Err(WireError::new(
                        ErrorCode::Protocol,
                        format!(
                            "unexpected {:?} frame after the handshake; send Request frames",
                            f.kind
                        ),
                    )),
                ));
            }
        }
    }
}
