//! A blocking client for the daemons' control protocol: connect, handshake (version
//! and, with a key, the two-way proof), then request/reply calls with a timeout.

use super::sockopt;
use crate::auth::{fresh_nonce, ClientProof, SharedKey};
use crate::wire::handshake::{AuthResult, Hello, Proof, Welcome};
use crate::wire::{
    decode_json, encode_json, frame, Envelope, Frame, FrameDecoder, FrameKind, ReplyEnvelope,
    WireError, DEFAULT_MAX_FRAME, PROTOCOL_VERSION,
};
use serde::{de::DeserializeOwned, Serialize};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Why a call did not produce a result. `Remote` carries the daemon's own error;
/// only a `Remote` error with code `refused` is a definitive refusal.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon answered with an error.
    #[error("{0}")]
    Remote(WireError),
    /// Connecting, reading or writing failed (the outcome of an in-flight call is unknown).
    #[error("connection to {peer} failed: {err}")]
    Io {
        peer: String,
        #[source]
        err: io::Error,
    },
    /// No reply within the timeout (the outcome is unknown).
    #[error("no reply from {peer} within {} ms", after.as_millis())]
    Timeout { peer: String, after: Duration },
    /// The peer broke the protocol (bad frame, wrong reply id, bad handshake).
    #[error("protocol error with {peer}: {message}")]
    Protocol { peer: String, message: String },
    /// The key proof failed or the two sides disagree on using a key.
    #[error("authentication with {peer} failed: {message}")]
    Auth { peer: String, message: String },
}

impl ClientError {
    /// True only for a definitive refusal from the daemon.
    pub fn is_refusal(&self) -> bool {
        matches!(self, ClientError::Remote(e) if e.code == crate::wire::ErrorCode::Refused)
    }
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub service: &'static str,
    pub client_id: String,
    pub key: Option<SharedKey>,
    pub connect_timeout: Duration,
    pub call_timeout: Duration,
    pub max_frame: usize,
    /// How long a call polls its socket for the reply before it blocks (zero: block at
    /// once). A reply that comes within it saves the wake-up of a sleeping thread,
    /// which on a VM is most of a loopback round trip; an idle client never spins.
    pub reply_spin: Duration,
    /// A session secret to present in the hello (maru-server: the session this
    /// client opened earlier, resumed on a new connection).
    pub resume: Option<String>,
}

impl ClientOptions {
    pub fn new(service: &'static str, client_id: impl Into<String>) -> ClientOptions {
        ClientOptions {
            service,
            client_id: client_id.into(),
            key: None,
            connect_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(10),
            max_frame: DEFAULT_MAX_FRAME,
            reply_spin: Duration::ZERO,
            resume: None,
        }
    }
}

/// Calls of this process waiting for their reply now. A call polls only while it is
/// the only one: alone, a caller is bound by latency and polling saves it the wake-up;
/// with other calls in flight, the CPU it would burn is what they (and the daemons on
/// this host) need, so it blocks.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// One call's wait for its reply: polls until its deadline or until another call
/// starts waiting, then blocks for good.
struct Spinner {
    until: Option<Instant>,
    waiting: &'static AtomicUsize,
}

impl Spinner {
    fn start(spin: Duration) -> Spinner {
        Spinner::counted_in(&WAITING, spin)
    }

    fn counted_in(waiting: &'static AtomicUsize, spin: Duration) -> Spinner {
        let alone = waiting.fetch_add(1, Ordering::AcqRel) == 0;
        Spinner {
            until: (alone && !spin.is_zero()).then(|| Instant::now() + spin),
            waiting,
        }
    }

    fn on(&self) -> bool {
        self.until.is_some()
    }

    /// One empty poll.
    fn tick(&mut self) {
        match self.until {
            Some(until) if Instant::now() >= until || self.waiting.load(Ordering::Acquire) > 1 => {
                self.until = None
            }
            _ => std::hint::spin_loop(),
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection to a daemon.
pub struct Client {
    stream: TcpStream,
    peer: String,
    decoder: FrameDecoder,
    next_id: u64,
    welcome: Welcome,
    call_timeout: Duration,
    reply_spin: Duration,
    /// Read buffer, allocated once (not zeroed on the stack for every reply).
    rbuf: Box<[u8]>,
    /// A request's frame, encoded in place and kept for the next one: a call
    /// allocates nothing to send once the buffer has grown to its requests' size.
    wbuf: Vec<u8>,
    /// When the exchange in progress (a handshake, a call) must be over, and how long
    /// it was given (for the error): every read and write waits at most until then,
    /// so a peer that sends a byte now and then holds a call no longer than its limit.
    until: Instant,
    limit: Duration,
    /// The socket's read and write timeouts as set now (set again only when the time
    /// left moves away from them: a reply read at once costs no system call).
    read_timeout: Duration,
    write_timeout: Duration,
}

/// How recently a connection's last exchange must have begun for [`Client::is_stale`]
/// to take it as open without a system call. Well below any daemon's idle timeout
/// (whole seconds), so a connection this fresh was not closed for idleness; a daemon
/// that closed it otherwise (it stopped, or revoked the key) is not serving again
/// within 2 ms, so a call on it fails as one on a new connection would. Calls in a row
/// (a store's, a load's, a run of single stores) ask nothing.
const FRESH: Duration = Duration::from_millis(2);

/// How far the time left of an exchange may move from a socket's timeout before the
/// timeout is set again (a call's wait may end up to this much early, never late).
const TIMEOUT_SLACK: Duration = Duration::from_millis(20);

impl Client {
    /// Connects to `addr` (`host:port`) and runs the handshake (the connect within
    /// `opts.connect_timeout`, each step of the handshake within `opts.call_timeout`).
    pub fn connect(addr: &str, opts: &ClientOptions) -> Result<Client, ClientError> {
        Client::open(addr, opts, None)
    }

    /// As [`Client::connect`], the connect and the whole handshake within `limit`
    /// (and the connect within `opts.connect_timeout`): a peer that accepts the
    /// connection and never answers (a stopped process, a half-open path) costs at
    /// most `limit`.
    pub fn connect_within(
        addr: &str,
        opts: &ClientOptions,
        limit: Duration,
    ) -> Result<Client, ClientError> {
        Client::open(addr, opts, Some(limit))
    }

    fn open(
        addr: &str,
        opts: &ClientOptions,
        limit: Option<Duration>,
    ) -> Result<Client, ClientError> {
        let peer = addr.to_string();
        let start = Instant::now();
        let until = limit.map(|l| start + l);
        let io_err = |err| ClientError::Io {
            peer: peer.clone(),
            err,
        };
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(io_err)?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
        let mut stream = None;
        for a in addrs {
            let wait = match until {
                Some(u) => u.saturating_duration_since(Instant::now()),
                None => opts.connect_timeout,
            }
            .min(opts.connect_timeout);
            if wait.is_zero() {
                return Err(ClientError::Timeout {
                    peer,
                    after: limit.unwrap_or(opts.connect_timeout),
                });
            }
            match TcpStream::connect_timeout(&a, wait) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or_else(|| io_err(last))?;
        let _ = stream.set_nodelay(true);
        sockopt::keepalive(&stream);
        stream
            .set_read_timeout(Some(opts.call_timeout))
            .map_err(io_err)?;
        stream
            .set_write_timeout(Some(opts.call_timeout))
            .map_err(io_err)?;
        let mut c = Client {
            stream,
            peer: peer.clone(),
            decoder: FrameDecoder::new(opts.max_frame),
            next_id: 1,
            welcome: Welcome {
                service: String::new(),
                version: 0,
                nonce: String::new(),
                auth_required: false,
                proof: None,
                info: serde_json::Value::Null,
            },
            call_timeout: opts.call_timeout,
            reply_spin: opts.reply_spin,
            rbuf: vec![0u8; 64 * 1024].into_boxed_slice(),
            wbuf: Vec::new(),
            until: Instant::now() + opts.call_timeout,
            limit: opts.call_timeout,
            read_timeout: opts.call_timeout,
            write_timeout: opts.call_timeout,
        };
        c.handshake(opts, until.map(|u| (u, limit.unwrap_or_default())))?;
        Ok(c)
    }

    /// Starts an exchange that must be over within `limit`.
    fn begin(&mut self, limit: Duration) {
        self.until = Instant::now() + limit;
        self.limit = limit;
    }

    /// The time left of the exchange, with the socket's timeout of that direction
    /// brought to it (`reads`: the read timeout, else the write timeout); a timeout
    /// error once none is left.
    fn bound(&mut self, reads: bool) -> Result<(), ClientError> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ClientError::Timeout {
                peer: self.peer.clone(),
                after: self.limit,
            });
        }
        let set = if reads {
            &mut self.read_timeout
        } else {
            &mut self.write_timeout
        };
        if left + TIMEOUT_SLACK < *set || left > *set + TIMEOUT_SLACK {
            let r = if reads {
                self.stream.set_read_timeout(Some(left))
            } else {
                self.stream.set_write_timeout(Some(left))
            };
            r.map_err(|err| ClientError::Io {
                peer: self.peer.clone(),
                err,
            })?;
            *set = left;
        }
        Ok(())
    }

    /// The hello, the welcome and (with a key) the two proofs; each read and write
    /// within `opts.call_timeout`, and all of it by `until` when given (with the limit
    /// it came from, for the error).
    fn handshake(
        &mut self,
        opts: &ClientOptions,
        until: Option<(Instant, Duration)>,
    ) -> Result<(), ClientError> {
        let step = |c: &mut Client| match until {
            Some((u, l)) => {
                c.until = u;
                c.limit = l;
            }
            None => c.begin(opts.call_timeout),
        };
        step(self);
        let nonce = fresh_nonce().map_err(|err| ClientError::Io {
            peer: self.peer.clone(),
            err,
        })?;
        let hello = Hello {
            service: opts.service.to_string(),
            version: PROTOCOL_VERSION,
            client_id: opts.client_id.clone(),
            nonce: nonce.clone(),
            resume: opts.resume.clone(),
            key_id: opts.key.as_ref().map(SharedKey::id),
        };
        self.send(FrameKind::Handshake, &encode_json(&hello))?;
        step(self);
        let welcome: Welcome = self.read_handshake("welcome")?;
        let peer = self.peer.clone();
        let auth = |message: String| ClientError::Auth {
            peer: peer.clone(),
            message,
        };
        match (&opts.key, welcome.auth_required) {
            (None, false) => {}
            (None, true) => {
                return Err(auth(format!(
                    "{} requires a key proof and no key file was given",
                    opts.service
                )))
            }
            (Some(_), false) => {
                // We hold a key: a server that does not prove it could be anyone.
                return Err(auth(format!(
                    "{} did not prove the key; refusing to talk to an unauthenticated peer",
                    opts.service
                )));
            }
            (Some(key), true) => {
                let cp = ClientProof::new(&nonce).map_err(|e| auth(e.to_string()))?;
                let sp = welcome.proof.clone().unwrap_or_default();
                let answer = cp
                    .answer(key, &welcome.nonce, &sp)
                    .map_err(|e| auth(e.to_string()))?;
                step(self);
                self.send(FrameKind::Handshake, &encode_json(&Proof { proof: answer }))?;
                step(self);
                let r: AuthResult = self.read_handshake("auth result")?;
                if !r.ok {
                    return Err(auth("the server rejected our proof".into()));
                }
            }
        }
        self.welcome = welcome;
        Ok(())
    }

    /// What the daemon said in its welcome (version, info such as a boot id).
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Whether the daemon closed this connection (or sent something no call asked for,
    /// such as the error frame of a closing daemon) while it sat idle: a call on it
    /// would fail, so a caller connects afresh first. Does not block. A connection whose
    /// last exchange began less than [`FRESH`] ago is taken as open without asking the
    /// kernel (a `MSG_PEEK`, a system call before every request otherwise).
    pub fn is_stale(&self) -> bool {
        if self.decoder.buffered() > 0 {
            return true;
        }
        let began = self.until.checked_sub(self.limit);
        if began.is_some_and(|b| b.elapsed() < FRESH) {
            return false;
        }
        let mut b = [0u8; 1];
        // SAFETY: b is a live buffer of 1 byte; the descriptor is open (owned by self).
        let n = unsafe {
            libc::recv(
                std::os::fd::AsRawFd::as_raw_fd(&self.stream),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_DONTWAIT | libc::MSG_PEEK,
            )
        };
        if n >= 0 {
            return true; // end of stream (0) or bytes nobody asked for
        }
        let e = io::Error::last_os_error();
        !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        )
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Changes how long calls poll for their reply before they block.
    pub fn set_reply_spin(&mut self, spin: Duration) {
        self.reply_spin = spin;
    }

    fn read_handshake<T: DeserializeOwned>(&mut self, what: &str) -> Result<T, ClientError> {
        let f = self.read_frame()?;
        match f.kind {
            FrameKind::Handshake => decode_json(&f.body).map_err(|e| ClientError::Protocol {
                peer: self.peer.clone(),
                message: format!("bad {what}: {}", e.message),
            }),
            FrameKind::Error => Err(self.remote_error(&f)),
            k => Err(ClientError::Protocol {
                peer: self.peer.clone(),
                message: format!("expected {what}, got a {k:?} frame"),
            }),
        }
    }

    fn remote_error(&self, f: &Frame) -> ClientError {
        match decode_json::<WireError>(&f.body) {
            Ok(e) if e.code == crate::wire::ErrorCode::Auth => ClientError::Auth {
                peer: self.peer.clone(),
                message: e.message,
            },
            Ok(e) => ClientError::Remote(e),
            Err(e) => ClientError::Protocol {
                peer: self.peer.clone(),
                message: format!("unreadable error frame: {}", e.message),
            },
        }
    }

    fn send(&mut self, kind: FrameKind, body: &[u8]) -> Result<(), ClientError> {
        let bytes = frame::encode(kind, body);
        self.write_until(&bytes)
    }

    /// Writes all of `bytes` by the end of the exchange in progress (a peer that
    /// stopped reading fills the socket's buffer, and each write then waits).
    fn write_until(&mut self, mut bytes: &[u8]) -> Result<(), ClientError> {
        while !bytes.is_empty() {
            self.bound(false)?;
            match self.stream.write(bytes) {
                Ok(0) => {
                    return Err(self.io_error(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the connection took no more bytes",
                    )))
                }
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(e)),
            }
        }
        Ok(())
    }

    fn io_error(&self, err: io::Error) -> ClientError {
        if matches!(
            err.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            ClientError::Timeout {
                peer: self.peer.clone(),
                after: self.limit,
            }
        } else {
            ClientError::Io {
                peer: self.peer.clone(),
                err,
            }
        }
    }

    fn read_frame(&mut self) -> Result<Frame, ClientError> {
        let mut spin = Spinner::start(self.reply_spin);
        loop {
            match self.decoder.next_frame() {
                Ok(Some(f)) => return Ok(f),
                Ok(None) => {}
                Err(e) => {
                    return Err(ClientError::Protocol {
                        peer: self.peer.clone(),
                        message: e.to_string(),
                    })
                }
            }
            let got = if spin.on() {
                match super::sockopt::recv_now(&self.stream, &mut self.rbuf) {
                    Ok(Some(n)) => Ok(n),
                    Ok(None) => {
                        spin.tick();
                        continue;
                    }
                    Err(e) => Err(e),
                }
            } else {
                self.bound(true)?;
                self.stream.read(&mut self.rbuf)
            };
            match got {
                Ok(0) => {
                    return Err(ClientError::Io {
                        peer: self.peer.clone(),
                        err: io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "connection closed by the peer",
                        ),
                    })
                }
                Ok(n) => self.decoder.push(&self.rbuf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(e)),
            }
        }
    }

    /// Sends one request and waits for its reply, all of it within the call timeout.
    pub fn call<Req: Serialize, Rep: DeserializeOwned>(
        &mut self,
        req: &Req,
    ) -> Result<Rep, ClientError> {
        self.call_within(req, self.call_timeout)
    }

    /// As [`Client::call`], the request sent and its reply read within `limit`.
    pub fn call_within<Req: Serialize, Rep: DeserializeOwned>(
        &mut self,
        req: &Req,
        limit: Duration,
    ) -> Result<Rep, ClientError> {
        self.begin(limit);
        let id = self.next_id;
        self.next_id += 1;
        let mut wbuf = std::mem::take(&mut self.wbuf);
        let sent = match frame::encode_json_frame(
            FrameKind::Request,
            &Envelope { id, body: req },
            &mut wbuf,
        ) {
            Ok(()) => self.write_until(&wbuf),
            Err(e) => Err(ClientError::Protocol {
                peer: self.peer.clone(),
                message: format!("request not encodable: {e}"),
            }),
        };
        self.wbuf = wbuf;
        sent?;
        let f = self.read_frame()?;
        match f.kind {
            FrameKind::Reply => {}
            FrameKind::Error => return Err(self.remote_error(&f)),
            k => {
                return Err(ClientError::Protocol {
                    peer: self.peer.clone(),
                    message: format!("expected a reply, got a {k:?} frame"),
                })
            }
        }
        let env: ReplyEnvelope<Rep> = decode_json(&f.body).map_err(|e| ClientError::Protocol {
            peer: self.peer.clone(),
            message: format!("bad reply: {}", e.message),
        })?;
        if env.id != id {
            return Err(ClientError::Protocol {
                peer: self.peer.clone(),
                message: format!("reply for request {} while waiting for {id}", env.id),
            });
        }
        match (env.ok, env.err) {
            (_, Some(e)) => Err(ClientError::Remote(e)),
            (Some(v), None) => Ok(v),
            (None, None) => Err(ClientError::Protocol {
                peer: self.peer.clone(),
                message: "reply with neither ok nor err".into(),
            }),
        }
    }

    /// Ends framing: the socket (its read and write timeouts the call timeout again)
    /// and any bytes already read past the handshake.
    pub fn into_parts(self) -> (TcpStream, Vec<u8>) {
        let _ = self.stream.set_read_timeout(Some(self.call_timeout));
        let _ = self.stream.set_write_timeout(Some(self.call_timeout));
        (self.stream, self.decoder.into_rest())
    }

    /// Sends raw bytes (tests use it to send garbage).
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.begin(self.call_timeout);
        self.write_until(bytes)
    }

    /// Reads the next frame whatever its kind (tests).
    pub fn recv_frame(&mut self) -> Result<Frame, ClientError> {
        self.begin(self.call_timeout);
        self.read_frame()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::{ConnId, Server, ServerOptions, Service};

    /// Replies with the request's body after sleeping the number of ms it names.
    struct SlowEcho;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Delay {
        ms: u64,
    }

    impl Service for SlowEcho {
        fn service_name(&self) -> &'static str {
            "slow-echo"
        }
        fn on_request(&mut self, _: ConnId, _: &str, body: &[u8], _: u64) -> Vec<u8> {
            let env: Envelope<Delay> = decode_json(body).expect("test request");
            std::thread::sleep(Duration::from_millis(env.body.ms));
            let reply = crate::wire::ReplyEnvelope {
                id: env.id,
                ok: Some(env.body),
                err: None,
            };
            frame::encode(FrameKind::Reply, &encode_json(&reply))
        }
    }

    fn slow_echo() -> String {
        let (mut server, addr) = Server::loopback(ServerOptions::default());
        // The loop runs until the test process ends.
        std::thread::spawn(move || server.run(&mut SlowEcho));
        addr
    }

    /// How long a connect to `addr` within `limit` took to give up (call timeout 10 s);
    /// it must end in a timeout.
    fn connect_times_out(addr: &str, limit: Duration) -> Duration {
        let mut opts = ClientOptions::new("slow-echo", "t");
        opts.call_timeout = Duration::from_secs(10);
        let t = Instant::now();
        let r = Client::connect_within(addr, &opts, limit);
        let took = t.elapsed();
        assert!(
            matches!(r, Err(ClientError::Timeout { .. })),
            "{:?}",
            r.err()
        );
        took
    }

    /// A peer that accepts connections and does what `serve` does with each.
    fn raw_peer(serve: fn(std::net::TcpStream)) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind on loopback");
        let addr = l.local_addr().expect("addr").to_string();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || serve(s));
            }
        });
        addr
    }

    /// A stopped process, or a half-open path: the connection is accepted (by the
    /// kernel) and nothing ever answers. `connect_within` gives up at its limit, not
    /// after the call timeout of each handshake step.
    #[test]
    fn a_peer_that_accepts_and_never_answers_costs_a_connect_its_limit() {
        let addr = raw_peer(|s| {
            std::thread::sleep(Duration::from_secs(30));
            drop(s);
        });
        let took = connect_times_out(&addr, Duration::from_millis(300));
        assert!(
            took >= Duration::from_millis(290) && took < Duration::from_millis(1500),
            "{took:?}"
        );
    }

    /// A peer that sends its welcome one byte every 50 ms: each read gets a byte well
    /// within any socket timeout, and the exchange still ends at its limit.
    #[test]
    fn a_trickling_peer_holds_an_exchange_no_longer_than_its_limit() {
        let addr = raw_peer(|mut s| {
            let mut hdr = frame::encode(FrameKind::Handshake, &[b' '; 4096]);
            hdr.truncate(64);
            for b in hdr {
                if s.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let took = connect_times_out(&addr, Duration::from_millis(400));
        assert!(took < Duration::from_millis(1500), "{took:?}");
    }

    /// A daemon that stalls (here: its reply 1.5 s late) costs a call the limit its
    /// caller gave, not the call timeout, whether the call polls for its reply first
    /// or blocks at once.
    #[test]
    fn a_stalled_peer_costs_a_call_its_limit() {
        for spin in [Duration::ZERO, Duration::from_micros(500)] {
            let addr = slow_echo();
            let mut opts = ClientOptions::new("slow-echo", "t");
            opts.call_timeout = Duration::from_secs(10);
            opts.reply_spin = spin;
            let mut c = Client::connect(&addr, &opts).expect("connect");
            let t = Instant::now();
            let r: Result<Delay, _> =
                c.call_within(&Delay { ms: 1500 }, Duration::from_millis(200));
            let took = t.elapsed();
            assert!(
                matches!(r, Err(ClientError::Timeout { .. })),
                "spin {spin:?}: {r:?}"
            );
            assert!(
                took >= Duration::from_millis(180) && took < Duration::from_millis(1000),
                "spin {spin:?}: {took:?}"
            );
        }
    }

    #[test]
    fn a_polling_call_gets_replies_that_come_within_and_after_its_poll() {
        let addr = slow_echo();
        let mut opts = ClientOptions::new("slow-echo", "t");
        opts.reply_spin = Duration::from_micros(500);
        let mut c = Client::connect(&addr, &opts).expect("connect");
        for delay_ms in [0u64, 5, 0, 20, 1, 0] {
            let got: Delay = c.call(&Delay { ms: delay_ms }).expect("reply");
            assert_eq!(got, Delay { ms: delay_ms });
        }
        c.set_reply_spin(Duration::ZERO);
        let got: Delay = c.call(&Delay { ms: 3 }).expect("reply");
        assert_eq!(got, Delay { ms: 3 });
    }

    /// The stale-connection rule: a connection the daemon closed while it sat idle (its
    /// idle timeout, here 100 ms) is seen as stale before the next call is lost on it,
    /// also when it had been used just before. Seen failing with `is_stale` answering
    /// from the freshness of the last exchange alone (no `MSG_PEEK`).
    #[test]
    fn a_connection_its_daemon_closed_while_idle_is_stale() {
        let (mut server, addr) = Server::loopback(ServerOptions {
            idle_timeout_ms: 100,
            ..ServerOptions::default()
        });
        std::thread::spawn(move || server.run(&mut SlowEcho));
        let mut c = Client::connect(&addr, &ClientOptions::new("slow-echo", "t")).expect("connect");
        let got: Delay = c.call(&Delay { ms: 0 }).expect("reply");
        assert_eq!(got, Delay { ms: 0 });
        assert!(!c.is_stale(), "open and just used");
        let t = Instant::now();
        while !c.is_stale() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the daemon closed it after 100 ms idle; still not seen stale"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            t.elapsed() >= Duration::from_millis(50),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_call_polls_only_while_no_other_call_waits() {
        static W: AtomicUsize = AtomicUsize::new(0);
        let spin = Duration::from_secs(60);
        let mut first = Spinner::counted_in(&W, spin);
        assert!(first.on(), "a lone call polls");
        first.tick();
        assert!(first.on(), "its deadline is far off");
        let second = Spinner::counted_in(&W, spin);
        assert!(!second.on(), "a second waiting call blocks at once");
        first.tick();
        assert!(
            !first.on(),
            "the first stops polling once another call waits"
        );
        drop(second);
        drop(first);
        assert_eq!(
            W.load(Ordering::Acquire),
            0,
            "every wait is uncounted at its end"
        );
        let mut alone = Spinner::counted_in(&W, Duration::from_micros(1));
        std::thread::sleep(Duration::from_millis(1));
        alone.tick();
        assert!(!alone.on(), "polling ends at its deadline");
        assert!(
            !Spinner::counted_in(&W, Duration::ZERO).on(),
            "zero turns polling off"
        );
    }
}
