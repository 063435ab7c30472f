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
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Why a call did not produce a result. `Remote` carries the daemon's own error;
/// only a `Remote` error with code `refused` is a definitive refusal.
#[derive(Debug)]
pub enum ClientError {
    /// The daemon answered with an error.
    Remote(WireError),
    /// Connecting, reading or writing failed (the outcome of an in-flight call is unknown).
    Io { peer: String, err: io::Error },
    /// No reply within the timeout (the outcome is unknown).
    Timeout { peer: String, after: Duration },
    /// The peer broke the protocol (bad frame, wrong reply id, bad handshake).
    Protocol { peer: String, message: String },
    /// The key proof failed or the two sides disagree on using a key.
    Auth { peer: String, message: String },
}

impl ClientError {
    /// True only for a definitive refusal from the daemon.
    pub fn is_refusal(&self) -> bool {
        matches!(self, ClientError::Remote(e) if e.code == crate::wire::ErrorCode::Refused)
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Remote(e) => write!(f, "{e}"),
            ClientError::Io { peer, err } => write!(f, "connection to {peer} failed: {err}"),
            ClientError::Timeout { peer, after } => {
                write!(f, "no reply from {peer} within {} ms", after.as_millis())
            }
            ClientError::Protocol { peer, message } => {
                write!(f, "protocol error with {peer}: {message}")
            }
            ClientError::Auth { peer, message } => {
                write!(f, "authentication with {peer} failed: {message}")
            }
        }
    }
}

impl std::error::Error for ClientError {}

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
}

impl Client {
    /// Connects to `addr` (`host:port`) and runs the handshake.
    pub fn connect(addr: &str, opts: &ClientOptions) -> Result<Client, ClientError> {
        let peer = addr.to_string();
        let io_err = |err| ClientError::Io {
            peer: peer.clone(),
            err,
        };
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(io_err)?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
        let mut stream = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, opts.connect_timeout) {
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
        };
        c.handshake(opts)?;
        Ok(c)
    }

    fn handshake(&mut self, opts: &ClientOptions) -> Result<(), ClientError> {
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
                self.send(FrameKind::Handshake, &encode_json(&Proof { proof: answer }))?;
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

    /// Whether the daemon closed this connection (or sent something no call asked
    /// for, such as the error frame of a closing daemon) while it sat idle: a call on
    /// it would fail, so a caller connects afresh first. Does not block.
    pub fn is_stale(&self) -> bool {
        if self.decoder.buffered() > 0 {
            return true;
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
        self.stream
            .write_all(&bytes)
            .map_err(|err| self.io_error(err))
    }

    fn io_error(&self, err: io::Error) -> ClientError {
        if matches!(
            err.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            ClientError::Timeout {
                peer: self.peer.clone(),
                after: self.call_timeout,
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

    /// Sends one request and waits for its reply.
    pub fn call<Req: Serialize, Rep: DeserializeOwned>(
        &mut self,
        req: &Req,
    ) -> Result<Rep, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(
            FrameKind::Request,
            &encode_json(&Envelope { id, body: req }),
        )?;
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

    /// Ends framing: the socket and any bytes already read past the handshake.
    pub fn into_parts(self) -> (TcpStream, Vec<u8>) {
        (self.stream, self.decoder.into_rest())
    }

    /// Sends raw bytes (tests use it to send garbage).
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.stream
            .write_all(bytes)
            .map_err(|err| self.io_error(err))
    }

    /// Reads the next frame whatever its kind (tests).
    pub fn recv_frame(&mut self) -> Result<Frame, ClientError> {
        self.read_frame()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::{Clock, ConnId, Server, ServerOptions, Service};

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
        let mut server = Server::bind(
            "127.0.0.1:0".parse().expect("addr"),
            ServerOptions::default(),
            Clock::new(),
        )
        .expect("bind on loopback");
        let addr = server.local_addr().expect("addr").to_string();
        // The loop runs until the test process ends.
        std::thread::spawn(move || server.run(&mut SlowEcho));
        addr
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
