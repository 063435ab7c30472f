//! The mio event loop of every daemon.
//!
//! One thread, one `Poll`: the listener, every connection, the signal pipe. The loop
//! sleeps until a socket is ready, a signal arrives or the service's next deadline
//! (no idle busy-poll; with `poll_spin` it polls without sleeping that long after a
//! turn with events, `spin`). A connection first runs the handshake (version, then
//! the key proof when the daemon has a key); only then do its request frames reach
//! the service. A broken frame stream gets an `Error` frame and is closed; a malformed
//! request gets an error reply and the connection stays; other connections never
//! notice either.
//!
//! Before its handshake ends a connection is bounded tightly: it may hold at most one
//! pre-auth frame (4 KiB) of unread bytes, it has a deadline, and at most
//! `max_pending` such connections are kept, a newcomer pushing out the oldest
//! ([`Slots`]); so whatever peers without the key send, they hold a few MiB at most
//! and never the room of clients that proved it. What they cause is logged as one
//! summary line per interval ([`ThrottledLog`]), not one line per connection.
//!
//! After the handshake the loop is shared fairly and holds a bounded number of bytes:
//!
//! - Connections are served in rounds, not for as long as their sockets hold bytes: a
//!   readiness event only queues the connection ([`FairQueue`]); each round every
//!   tenant (the key a connection proved; every connection still in its handshake is
//!   one class more) may read and decode [`fair::DEFAULT_QUANTUM`] bytes, its
//!   connections taking turns of at most [`fair::DEFAULT_TURN`] bytes (one frame more
//!   at most: a frame is decoded whole). Between rounds the loop polls for new events
//!   without sleeping. So many connections of one tenant, each pipelining its largest
//!   requests, delay another tenant's request by about one round, not by every
//!   pipeline.
//! - A connection may hold [`SMALL_FRAME`] bytes of frames it has not sent whole yet;
//!   a larger frame is read only once its whole size is granted out of
//!   `frame_room`, of which one tenant holds at most `frame_room_per_tenant`
//!   ([`FrameRoom`]). A frame that does not fit waits unread (backpressure), so
//!   partly received frames take at most `max_connections` × `SMALL_FRAME` plus
//!   `frame_room`, however many connections send how much.
//!
//! This file holds the loop itself ([`Server`]: accepting, polling, rounds, closing).
//! Its parts: [`options`] its settings, [`counters`] what it counts, `conn` one
//! connection's state, `turn` one connection's turn of reading and serving, `spin`
//! the bounded busy poll after work.

mod conn;
pub mod counters;
pub mod options;
#[cfg(test)]
mod scan_tests;
mod spin;
#[cfg(test)]
mod spin_tests;
mod timing;
mod turn;

pub use counters::{NetCounters, ServerCounts};
pub use options::*;

use super::classes::{connection_share, over_share_victim, Class, Classes, PRE_AUTH};
use super::fair::{self, FairQueue};
use super::handshake::ServerHandshake;
use super::room::FrameRoom;
use super::service::{ConnId, Replier, Service};
use super::slots::{Admit, Slots, StageLimits};
use super::sockopt;
use super::throttled_log::{self, ThrottledLog};
use super::{Clock, SignalPipe};
use crate::auth::Keyring;
use crate::wire::{self, ErrorCode, FrameDecoder, WireError};
use conn::{flush, Conn, Phase, PreAuthEnd};
use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use spin::PollSpin;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use timing::ServedTimes;
use turn::Turn;

/// What a turn costs however little it did (its reads and bookkeeping): a round ends
/// even when turns find nothing to do.
const TURN_COST: u64 = 256;

const READ_CHUNK: usize = 64 * 1024;

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const FIRST_CONN: usize = 2;
const WAKER: Token = Token(usize::MAX);

/// CPU seconds the calling thread has run (0 when the clock cannot be read).
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a live timespec the call writes.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0.0;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// The event loop over one listener.
pub struct Server {
    poll: Poll,
    listener: TcpListener,
    conns: HashMap<Token, Conn>,
    /// Each connection's token by its id (a deferred reply names the id).
    tokens: HashMap<ConnId, Token>,
    /// When the loop next checks every connection for its idle timeout.
    idle_check_ms: u64,
    next_token: usize,
    next_conn_id: ConnId,
    opts: ServerOptions,
    clock: Clock,
    signals: Option<SignalPipe>,
    /// One read buffer for every connection (the loop is single-threaded), allocated
    /// once rather than zeroed on the stack for every readable event.
    rbuf: Box<[u8]>,
    /// Connections still in their handshake, by age (caps, deadlines, push-outs).
    slots: Slots<Token>,
    /// What peers that did not finish the handshake caused: a line per interval.
    prelog: ThrottledLog,
    /// Connections with work, served in rounds by tenant.
    queue: FairQueue<Class, Token>,
    /// Room for frames larger than [`SMALL_FRAME`] while they arrive.
    room: FrameRoom<Class, Token>,
    classes: Classes,
    /// The keyring generation whose keys in force the open connections were checked
    /// against.
    keys_checked: u64,
    counters: Arc<NetCounters>,
    replies: std::sync::mpsc::Receiver<(ConnId, Vec<u8>)>,
    replier: Replier,
    /// Polls without sleeping for a while after a turn with events.
    spin: PollSpin,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port; see [`Server::local_addr`]).
    pub fn bind(addr: SocketAddr, opts: ServerOptions, clock: Clock) -> io::Result<Server> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::bind(addr)?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = std::sync::Arc::new(mio::Waker::new(poll.registry(), WAKER)?);
        let (tx, replies) = std::sync::mpsc::channel();
        let keys_checked = opts.keys.as_ref().map_or(0, Keyring::generation);
        let slots = Slots::new(
            opts.max_connections,
            &[StageLimits {
                cap: opts.pending_cap(),
                deadline_ms: opts.handshake_timeout_ms,
            }],
        );
        let room = FrameRoom::new(
            opts.frame_room,
            opts.frame_room_per_tenant,
            opts.max_frame.max(opts.pre_auth_max_frame) + wire::frame::HEADER_LEN,
        );
        let spin = PollSpin::new(opts.poll_spin);
        Ok(Server {
            poll,
            listener,
            conns: HashMap::new(),
            tokens: HashMap::new(),
            idle_check_ms: 0,
            next_token: FIRST_CONN,
            next_conn_id: 1,
            opts,
            clock,
            signals: None,
            rbuf: vec![0u8; READ_CHUNK].into_boxed_slice(),
            slots,
            prelog: ThrottledLog::new(
                "connections that did not finish the handshake",
                throttled_log::DEFAULT_INTERVAL_MS,
            ),
            queue: FairQueue::new(fair::DEFAULT_QUANTUM, fair::DEFAULT_TURN),
            room,
            classes: Classes::default(),
            keys_checked,
            counters: Arc::default(),
            replies,
            replier: Replier { tx, waker },
            spin,
        })
    }

    /// Where a service hands its deferred replies (see [`Service::on_request`]).
    pub fn replier(&self) -> Replier {
        self.replier.clone()
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// A server on a free loopback port with a clock of its own, and its address
    /// (tests).
    #[cfg(test)]
    pub(crate) fn loopback(opts: ServerOptions) -> (Server, String) {
        let server = Server::bind("127.0.0.1:0".parse().expect("addr"), opts, Clock::new())
            .expect("bind on loopback");
        let addr = server.local_addr().expect("addr").to_string();
        (server, addr)
    }

    /// The loop's counters (shared: read them from any thread).
    pub fn counters(&self) -> Arc<NetCounters> {
        self.counters.clone()
    }

    pub fn counts(&self) -> ServerCounts {
        ServerCounts {
            connections: self.conns.len(),
            pending: self.slots.len(),
        }
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
            // Connections with work left, or a spin after work: look for new events
            // without sleeping.
            let spinning = self.spin.on() && self.spin.spinning(Instant::now());
            let timeout = if self.queue.is_empty() && !spinning {
                self.timeout(service, now)
            } else {
                Some(Duration::ZERO)
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let had_events = !events.is_empty();
            if spinning && !had_events && self.queue.is_empty() {
                // Spinning with nothing to do: let a thread that waits for this core
                // (the client the loop waits for, on a busy machine) run first.
                std::thread::yield_now();
            }
            // An empty poll of the spin is not the loop's work.
            let busy = (service.loop_timed() && (had_events || !spinning))
                .then(|| (Instant::now(), thread_cpu_seconds()));
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(service),
                    WAKER => self.deliver(service),
                    SIGNALS => {
                        if self.signals.as_ref().is_some_and(|s| s.drain()) {
                            log::info!("signal received; shutting down");
                            let now = self.clock.now_ms();
                            self.close_all(service, now);
                            service.on_shutdown(now);
                            return Ok(());
                        }
                    }
                    tok => self.on_event(
                        service,
                        tok,
                        ev.is_readable() || ev.is_read_closed(),
                        ev.is_read_closed(),
                        ev.is_writable(),
                    ),
                }
            }
            self.serve_round(service);
            let now = self.clock.now_ms();
            if service.next_deadline().is_some_and(|d| d <= now) {
                service.on_tick(now);
            }
            self.deliver(service);
            self.expire(service, now);
            self.close_revoked(service, now);
            throttled_log::emit(module_path!(), self.prelog.due(now));
            if let Some((wall, cpu)) = busy {
                let cpu = (thread_cpu_seconds() - cpu).max(0.0);
                service.on_loop_busy(wall.elapsed().as_secs_f64(), cpu);
            }
            if self.spin.on() {
                self.spin.turned(had_events, Instant::now());
            }
        }
    }

    /// When connection `c`, past its handshake, is due to be closed for silence, if
    /// ever (handshake deadlines are the slots').
    fn idle_deadline(&self, c: &Conn) -> Option<u64> {
        (!c.pending() && self.opts.idle_timeout_ms > 0)
            .then(|| c.last_frame_ms.saturating_add(self.opts.idle_timeout_ms))
    }

    /// How often the loop checks every connection for its idle timeout: an eighth of
    /// it, at most a second (a connection closes at most that late). Checking them
    /// at every turn of the loop cost each request a walk over every connection.
    fn idle_check_every(&self) -> u64 {
        (self.opts.idle_timeout_ms / 8).clamp(1, 1000)
    }

    fn timeout<S: Service>(&self, service: &S, now: u64) -> Option<Duration> {
        let idle_check = (self.opts.idle_timeout_ms > 0 && self.conns.len() > self.slots.len())
            .then_some(self.idle_check_ms);
        let deadline = idle_check
            .into_iter()
            .chain(service.next_deadline())
            .chain(self.slots.next_deadline())
            .chain(self.prelog.next_deadline())
            .chain(self.room.next_stall(self.opts.frame_stall_ms))
            .min();
        deadline.map(|d| Duration::from_millis(d.saturating_sub(now)))
    }

    fn accept<S: Service>(&mut self, service: &mut S) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, peer)) => {
                    let now = self.clock.now_ms();
                    let token = Token(self.next_token);
                    self.next_token += 1;
                    self.make_room_over_share(service, peer, now);
                    let settled = self.conns.len() - self.slots.len();
                    match self.slots.admit(token, settled, now) {
                        Admit::Refused => {
                            NetCounters::add(&self.counters.refused_cap, 1);
                            let open = self.conns.len();
                            throttled_log::emit(
                                module_path!(),
                                self.prelog.note(
                                    now,
                                    log::Level::Warn,
                                    "refused at accept (every connection slot is a client's)",
                                    &peer.to_string(),
                                    || {
                                        format!(
                                            "refusing a connection from {peer}: {open} clients \
                                         connected, the limit (--max-clients)"
                                        )
                                    },
                                ),
                            );
                            continue;
                        }
                        Admit::In { push_out: Some(t) } => {
                            // The oldest unfinished handshake makes room: a flood of
                            // peers without the key cannot keep a real client out.
                            NetCounters::add(&self.counters.pushed_out, 1);
                            if let Some(c) = self.conns.get_mut(&t) {
                                let cap = self.opts.pending_cap();
                                c.pre_auth_end = Some(PreAuthEnd {
                                    level: log::Level::Info,
                                    kind: "pushed out by newer connections",
                                    line: format!(
                                        "closing the handshake of {} to make room for {peer}: \
                                         it was the oldest of {cap} unfinished ones, or every \
                                         other slot is a client's",
                                        c.peer
                                    ),
                                });
                            }
                            self.drop_conn(service, t, now);
                        }
                        Admit::In { push_out: None } => {}
                    }
                    let _ = stream.set_nodelay(true);
                    sockopt::keepalive(&stream);
                    if let Err(e) =
                        self.poll
                            .registry()
                            .register(&mut stream, token, Interest::READABLE)
                    {
                        log::warn!("cannot register connection from {peer}: {e}");
                        self.slots.remove(token);
                        continue;
                    }
                    let id = self.next_conn_id;
                    self.next_conn_id += 1;
                    self.tokens.insert(id, token);
                    log::debug!("connection {id} from {peer}");
                    NetCounters::add(&self.counters.accepted, 1);
                    NetCounters::add(&self.counters.open, 1);
                    self.conns.insert(
                        token,
                        Conn {
                            id,
                            stream,
                            peer,
                            decoder: FrameDecoder::new(self.opts.pre_auth_max_frame),
                            out: Vec::new(),
                            out_pos: 0,
                            phase: Phase::Handshake(ServerHandshake::with_keys(
                                service.service_name(),
                                self.opts.keys.clone(),
                                service.welcome_info(),
                            )),
                            pre_auth_end: None,
                            last_frame_ms: now,
                            closing: false,
                            unread: false,
                            peer_closed: false,
                            waiting_room: false,
                            class: PRE_AUTH,
                            interest: (true, false),
                            deferred: 0,
                            times: ServedTimes::new(std::time::Instant::now()),
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: log and let the next readiness retry.
                    log::warn!("accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// A readiness event: replies go out at once; reading waits for the connection's
    /// turn ([`serve_round`](Self::serve_round)).
    fn on_event<S: Service>(
        &mut self,
        service: &mut S,
        tok: Token,
        readable: bool,
        read_closed: bool,
        writable: bool,
    ) {
        let Some(conn) = self.conns.get_mut(&tok) else {
            return;
        };
        conn.unread |= readable;
        conn.peer_closed |= read_closed;
        let was_pending = conn.pending();
        let alive = !(writable || conn.unsent() > 0) || flush(conn, &self.counters);
        self.settle(service, tok, alive, was_pending);
    }

    /// One round: each class of connections with work gets its share of the loop
    /// ([`FairQueue`]), each connection at most a turn's budget at a time.
    fn serve_round<S: Service>(&mut self, service: &mut S) {
        while let Some((tok, budget)) = self.queue.next_turn() {
            let now = self.clock.now_ms();
            let Some(conn) = self.conns.get_mut(&tok) else {
                self.queue.end_turn(0, false);
                continue;
            };
            let was_pending = conn.pending();
            let class = conn.class;
            let mut granted = Vec::new();
            let mut ctx = Turn {
                tok,
                opts: &self.opts,
                counters: &self.counters,
                room: &mut self.room,
                classes: &mut self.classes,
                granted: &mut granted,
                now,
            };
            let (spent, alive) = ctx.run(conn, service, &mut self.rbuf, budget);
            let spent = spent + TURN_COST;
            // A connection that finished its handshake takes its next turn with its
            // tenant.
            let more = alive && conn.class == class && conn.has_work(&self.opts);
            self.queue.end_turn(spent, more);
            self.settle(service, tok, alive, was_pending);
            self.wake_granted(granted);
        }
    }

    /// Connections whose frames were granted room: they are read again.
    fn wake_granted(&mut self, granted: Vec<Token>) {
        for t in granted {
            if let Some(c) = self.conns.get_mut(&t) {
                c.waiting_room = false;
                if c.has_work(&self.opts) {
                    self.queue.ready(c.class, t);
                }
            }
        }
    }

    /// After an event or a turn: closes the connection when it is gone or done,
    /// registers the interest it has now and queues it when it has work.
    fn settle<S: Service>(&mut self, service: &mut S, tok: Token, alive: bool, was_pending: bool) {
        let now = self.clock.now_ms();
        let opts = &self.opts;
        let Some(conn) = self.conns.get_mut(&tok) else {
            return;
        };
        for (label, seconds) in conn.times.take_served() {
            service.on_served(label, seconds);
        }
        let alive = alive && !(conn.closing && conn.unsent() == 0);
        if was_pending && !conn.pending() {
            self.slots.remove(tok);
        }
        if !alive && !conn.closing {
            if let Phase::Handshake(hs) = &conn.phase {
                if hs.awaits_proof() {
                    // The client checks the daemon's proof first and hangs up when it
                    // fails: from here, a key mismatch (or a probe without the key).
                    NetCounters::add(&self.counters.auth_failures, 1);
                    conn.pre_auth_end = Some(PreAuthEnd {
                        level: log::Level::Warn,
                        kind: "closed before their key proof",
                        line: format!(
                            "connection from {} closed before its key proof: its key is not \
                             this daemon's?",
                            conn.peer
                        ),
                    });
                }
            }
        }
        if !alive {
            self.drop_conn(service, tok, now);
            return;
        }
        // Read only while the unsent replies are under the bound; a peer that does
        // not read its replies stops being read.
        let want = (conn.may_read(opts), conn.unsent() > 0);
        if want != conn.interest {
            let interest = match want {
                (true, true) => Interest::READABLE | Interest::WRITABLE,
                (true, false) => Interest::READABLE,
                _ => Interest::WRITABLE,
            };
            // Re-arming reports readiness again, so bytes left unread come back as
            // an event once reading resumes.
            if self
                .poll
                .registry()
                .reregister(&mut conn.stream, tok, interest)
                .is_ok()
            {
                conn.interest = want;
            }
        }
        if conn.has_work(opts) {
            self.queue.ready(conn.class, tok);
        }
    }

    /// Sends the deferred replies that are ready: those handed over through the
    /// [`Replier`] (work done off the loop) and those the service answered later on
    /// the loop ([`Service::take_replies`]). A reply for a connection that closed
    /// meanwhile is dropped.
    fn deliver<S: Service>(&mut self, service: &mut S) {
        let mut ready: Vec<(ConnId, Vec<u8>)> = self.replies.try_iter().collect();
        ready.extend(service.take_replies());
        for (id, reply) in ready {
            NetCounters::add(&self.counters.conns_visited, 1);
            let Some(tok) = self
                .tokens
                .get(&id)
                .copied()
                .filter(|t| self.conns.get(t).is_some_and(|c| !c.pending()))
            else {
                continue; // closed meanwhile
            };
            if let Some(c) = self.conns.get_mut(&tok) {
                c.deferred = c.deferred.saturating_sub(1);
                if c.times.awaits_deferred() {
                    let body = reply.get(wire::frame::HEADER_LEN..).unwrap_or_default();
                    c.times.delivered(wire::request_id_of(body));
                }
                c.out.extend(reply);
            }
            // Flush, and queue what waited for room.
            self.on_event(service, tok, false, false, true);
        }
    }

    fn drop_conn<S: Service>(&mut self, service: &mut S, tok: Token, now: u64) {
        if let Some(mut c) = self.conns.remove(&tok) {
            self.tokens.remove(&c.id);
            self.counters.open.fetch_sub(1, Ordering::Relaxed);
            NetCounters::sub(&self.counters.buffered, c.decoder.buffered() as u64);
            self.queue.remove(tok);
            let granted = self.room.give_back(tok, now);
            self.wake_granted(granted);
            let _ = self.poll.registry().deregister(&mut c.stream);
            log::debug!("connection {} from {} closed", c.id, c.peer);
            self.slots.remove(tok);
            if let Phase::Ready { client_id, .. } = &c.phase {
                service.on_close(c.id, client_id, now);
            }
            if let Some(end) = c.pre_auth_end.take() {
                let peer = c.peer.to_string();
                throttled_log::emit(
                    module_path!(),
                    self.prelog
                        .note(now, end.level, end.kind, &peer, || end.line),
                );
            }
        }
    }

    /// The daemon is full and the handshakes are under their share: a new connection
    /// pushes out an idle connection of the tenant furthest over its share of the
    /// connections (see [`over_share_victim`]), if there is one. A tenant within its
    /// share never loses a connection to another's.
    fn make_room_over_share<S: Service>(&mut self, service: &mut S, peer: SocketAddr, now: u64) {
        let Some(keys) = &self.opts.keys else {
            return;
        };
        if self.conns.len() < self.opts.max_connections
            || self.slots.len() >= self.opts.pending_cap()
        {
            return;
        }
        let total = self.opts.max_connections;
        let settled = self.conns.iter().filter_map(|(t, c)| match &c.phase {
            Phase::Ready {
                key: Some((name, _)),
                ..
            } => Some((*t, c.class, name.as_str(), c.idle(), c.last_frame_ms)),
            _ => None,
        });
        let Some(victim) = over_share_victim(keys, total, settled) else {
            return;
        };
        NetCounters::add(&self.counters.pushed_out_over_share, 1);
        if let Some(c) = self.conns.get(&victim) {
            if let Phase::Ready {
                key: Some((name, _)),
                ..
            } = &c.phase
            {
                let share = connection_share(keys, name, total);
                log::info!(
                    "closing idle connection {} from {} of tenant {name} (over its share of                      {share} connections) to make room for {peer}: all {total} connections                      (--max-clients) are open",
                    c.id,
                    c.peer
                );
            }
        }
        self.drop_conn(service, victim, now);
    }

    /// After the keyring changed (a tenants file reloaded): closes every connection
    /// whose key is no longer in force, removed or changed, telling its peer why.
    fn close_revoked<S: Service>(&mut self, service: &mut S, now: u64) {
        let Some(keys) = &self.opts.keys else {
            return;
        };
        let generation = keys.generation();
        if generation == self.keys_checked {
            return;
        }
        self.keys_checked = generation;
        let revoked: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| match &c.phase {
                Phase::Ready {
                    key: Some((name, id)),
                    ..
                } => !keys.in_force(name, id),
                _ => false,
            })
            .map(|(t, _)| *t)
            .collect();
        for t in revoked {
            if let Some(c) = self.conns.get_mut(&t) {
                NetCounters::add(&self.counters.key_revoked, 1);
                log::warn!(
                    "closing connection {} from {}: the key it proved is no longer in force \
                     (removed or changed in the tenants file)",
                    c.id,
                    c.peer
                );
                c.out.extend(wire::error_frame(&WireError::new(
                    ErrorCode::Auth,
                    "the key this connection proved is no longer in force (removed or \
                     changed): reconnect with the key the server holds now",
                )));
                let _ = flush(c, &self.counters);
            }
            self.drop_conn(service, t, now);
        }
    }

    fn close_all<S: Service>(&mut self, service: &mut S, now: u64) {
        let toks: Vec<Token> = self.conns.keys().copied().collect();
        for t in toks {
            self.drop_conn(service, t, now);
        }
    }

    /// Closes connections past their handshake deadline or idle timeout.
    fn expire<S: Service>(&mut self, service: &mut S, now: u64) {
        self.close_stalled(service, now);
        let mut late: Vec<Token> = self
            .slots
            .expired(now)
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        if now >= self.idle_check_ms {
            self.idle_check_ms = now.saturating_add(self.idle_check_every());
            NetCounters::add(&self.counters.conns_visited, self.conns.len() as u64);
            late.extend(
                self.conns
                    .iter()
                    .filter(|(_, c)| self.idle_deadline(c).is_some_and(|d| now >= d))
                    .map(|(t, _)| *t),
            );
        }
        for t in late {
            if let Some(c) = self.conns.get_mut(&t) {
                if c.pending() {
                    NetCounters::add(&self.counters.handshake_timeouts, 1);
                    c.pre_auth_end = Some(PreAuthEnd {
                        level: log::Level::Info,
                        kind: "no handshake in time",
                        line: format!(
                            "closing connection from {}: no handshake within {} ms",
                            c.peer, self.opts.handshake_timeout_ms
                        ),
                    });
                } else {
                    NetCounters::add(&self.counters.idle_closed, 1);
                    log::info!(
                        "closing connection {} from {}: nothing received for {} ms",
                        c.id,
                        c.peer,
                        self.opts.idle_timeout_ms
                    );
                }
            }
            self.drop_conn(service, t, now);
        }
    }

    /// While frames wait for room, closes the connections granted room whose peers
    /// sent nothing of their frames for `frame_stall_ms`: room others need goes back.
    /// One the loop itself does not read (replies it owes are not back yet) is not the
    /// peer's doing: its clock starts again.
    fn close_stalled<S: Service>(&mut self, service: &mut S, now: u64) {
        for t in self.room.stalled(now, self.opts.frame_stall_ms) {
            let Some(c) = self.conns.get(&t) else {
                self.room.give_back(t, now);
                continue;
            };
            if c.deferred > 0 {
                self.room.moved(t, now);
                continue;
            }
            NetCounters::add(&self.counters.protocol_errors, 1);
            log::warn!(
                "closing connection {} from {}: granted room for a {} byte request, it \
                 sent none of it for {} ms while others waited for room \
                 (--frame-room-mib)",
                c.id,
                c.peer,
                self.room.granted(t),
                self.opts.frame_stall_ms
            );
            self.drop_conn(service, t, now);
        }
    }
}
