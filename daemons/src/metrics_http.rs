//! `--metrics ADDR`: the daemon's metrics over HTTP at `/metrics`, for Prometheus.
//!
//! A thread of its own runs a small mio loop over every scrape connection at once:
//! each may send at most 8 KiB of request head, and has 2 s for the whole exchange
//! (request and reply), then it is closed. At most [`MAX_SCRAPERS`] connections are
//! kept; one more pushes out the oldest ([`maru::net::Slots`]). A slow, silent or
//! hostile scraper therefore costs one slot for at most 2 s and delays no other
//! scrape: 20 slowloris connections or a flood of idle ones leave scrapes answered at
//! once. A request that is already there when its connection is accepted is answered
//! right then, so a scraper is served even while a flood pushes connections out. The
//! daemon's event loop never sees any of it; it only updates atomics.

use crate::metrics::{Metrics, CONTENT_TYPE};
use maru::net::{Admit, Slots, StageLimits};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest request head read (request line and headers).
pub const MAX_HEAD: usize = 8 << 10;
/// Time a scrape connection gets for its whole exchange: sending its request and
/// taking the reply.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Scrape connections kept at once; one more pushes out the oldest.
pub const MAX_SCRAPERS: usize = 64;

/// The address of `--metrics`: `PORT` alone means loopback (`127.0.0.1:PORT`);
/// otherwise `HOST:PORT`.
pub fn parse_metrics_addr(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    let shown: String = s.chars().take(64).collect();
    let mut addrs = s.to_socket_addrs().map_err(|e| {
        format!("--metrics {shown:?}: not PORT or HOST:PORT ({e}); for example --metrics 9851")
    })?;
    addrs
        .next()
        .ok_or_else(|| format!("--metrics {shown:?}: the host has no address"))
}

/// The reply to one request head: `GET /metrics` gets the rendered metrics, `GET /`
/// a pointer to them, anything else 404/405/400. `None`: the head is not complete.
pub fn respond(head: &[u8], render: impl FnOnce() -> String) -> Option<Vec<u8>> {
    let end = head.windows(4).position(|w| w == b"\r\n\r\n").or_else(|| {
        // Some clients end lines with \n alone.
        head.windows(2).position(|w| w == b"\n\n")
    });
    let Some(end) = end else {
        if head.len() >= MAX_HEAD {
            return Some(reply(431, "text/plain", "request head too large\n".into()));
        }
        return None;
    };
    let head = String::from_utf8_lossy(&head[..end]);
    let mut parts = head.lines().next().unwrap_or("").split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let Some((method, target)) = method
        .zip(target)
        .filter(|_| version.is_some_and(|v| v.starts_with("HTTP/1.")) && parts.next().is_none())
    else {
        return Some(reply(400, "text/plain", "bad request line\n".into()));
    };
    if method != "GET" && method != "HEAD" {
        return Some(reply(405, "text/plain", "only GET is served\n".into()));
    }
    let path = target.split('?').next().unwrap_or("");
    let mut r = match path {
        "/metrics" => reply(200, CONTENT_TYPE, render()),
        "/" => reply(
            200,
            "text/plain",
            "Maru daemon metrics: GET /metrics\n".into(),
        ),
        _ => reply(404, "text/plain", "not found: GET /metrics\n".into()),
    };
    if method == "HEAD" {
        if let Some(p) = r.windows(4).position(|w| w == b"\r\n\r\n") {
            r.truncate(p + 4);
        }
    }
    Some(r)
}

fn reply(code: u16, content_type: &str, body: String) -> Vec<u8> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Request Header Fields Too Large",
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

/// One scrape connection: its request head so far, then its reply.
struct Scrape {
    stream: TcpStream,
    head: Vec<u8>,
    /// The reply, once the request is whole; `sent` bytes of it are out.
    reply: Option<Vec<u8>>,
    sent: usize,
}

/// What to do with a scrape connection after it was served as far as it goes now.
#[derive(PartialEq)]
enum Next {
    Wait,
    Close,
}

impl Scrape {
    /// Reads what came, answers a whole request, writes what the socket takes.
    fn progress(&mut self, render: &dyn Fn() -> String) -> Next {
        let mut buf = [0u8; 2048];
        while self.reply.is_none() {
            if let Some(r) = respond(&self.head, render) {
                self.reply = Some(r);
                break;
            }
            let room = (MAX_HEAD - self.head.len().min(MAX_HEAD)).min(buf.len());
            // `respond` answered 431 once the head reached MAX_HEAD: room is not 0.
            match self.stream.read(&mut buf[..room]) {
                Ok(0) => return Next::Close,
                Ok(n) => self.head.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Wait,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Next::Close,
            }
        }
        let Some(reply) = &self.reply else {
            return Next::Wait;
        };
        while self.sent < reply.len() {
            match self.stream.write(&reply[self.sent..]) {
                Ok(0) => return Next::Close,
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Wait,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Next::Close,
            }
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        Next::Close
    }
}

const LISTENER: Token = Token(usize::MAX);

/// The scrape loop: runs until the process ends (or its poll fails).
fn run(mut listener: TcpListener, render: &dyn Fn() -> String) -> io::Result<()> {
    let mut poll = Poll::new()?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let started = Instant::now();
    let now_ms = || started.elapsed().as_millis() as u64;
    let mut slots: Slots<usize> = Slots::new(
        MAX_SCRAPERS,
        &[StageLimits {
            cap: MAX_SCRAPERS,
            deadline_ms: IO_TIMEOUT.as_millis() as u64,
        }],
    );
    let mut conns: HashMap<usize, Scrape> = HashMap::new();
    let mut next_token = 0usize;
    let mut events = Events::with_capacity(256);
    loop {
        let timeout = slots
            .next_deadline()
            .map(|d| Duration::from_millis(d.saturating_sub(now_ms())));
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        for ev in events.iter() {
            if ev.token() != LISTENER {
                let t = ev.token().0;
                if let Some(c) = conns.get_mut(&t) {
                    if c.progress(render) == Next::Close {
                        conns.remove(&t);
                        slots.remove(t);
                    }
                }
                continue;
            }
            loop {
                let (mut stream, _) = match listener.accept() {
                    Ok(x) => x,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // EMFILE and friends: the next readiness retries.
                        log::warn!("metrics: accept failed: {e}");
                        break;
                    }
                };
                let t = next_token;
                next_token = (next_token + 1) % LISTENER.0;
                if let Err(e) = poll.registry().register(
                    &mut stream,
                    Token(t),
                    Interest::READABLE | Interest::WRITABLE,
                ) {
                    log::warn!("metrics: cannot register a scrape connection: {e}");
                    continue;
                }
                if let Admit::In {
                    push_out: Some(old),
                } = slots.admit(t, 0, now_ms())
                {
                    conns.remove(&old);
                }
                let mut c = Scrape {
                    stream,
                    head: Vec::new(),
                    reply: None,
                    sent: 0,
                };
                // The request usually came with the connection: answer it now, before
                // later connections of a flood can push this one out.
                if c.progress(render) == Next::Close {
                    slots.remove(t);
                } else {
                    conns.insert(t, c);
                }
            }
        }
        for (t, _) in slots.expired(now_ms()) {
            slots.remove(t);
            conns.remove(&t);
        }
    }
}

/// Binds `addr` and serves the metrics from a thread of their own. The bind error,
/// if any, comes back at once (so a daemon refuses to start on a taken port).
pub fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    started: Instant,
) -> std::io::Result<SocketAddr> {
    serve_render(addr, move || {
        metrics.render(started.elapsed().as_secs_f64())
    })
}

/// [`serve`] with any renderer of the text format (`maru-usage --metrics`).
pub fn serve_render(
    addr: SocketAddr,
    render: impl Fn() -> String + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    std::thread::Builder::new()
        .name("maru-metrics".into())
        .spawn(move || {
            if let Err(e) = run(listener, &render) {
                log::error!("metrics: the scrape loop stopped: {e}; /metrics is no longer served");
            }
        })?;
    log::info!("metrics at http://{local}/metrics");
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_is_loopback_and_bad_addresses_are_refused() {
        assert_eq!(
            parse_metrics_addr("9851").unwrap(),
            "127.0.0.1:9851".parse().unwrap()
        );
        assert_eq!(
            parse_metrics_addr("0.0.0.0:9851").unwrap(),
            "0.0.0.0:9851".parse().unwrap()
        );
        for bad in ["", "notanaddr", "1.2.3.4", "host:99999", "70000"] {
            let e = parse_metrics_addr(bad).unwrap_err();
            assert!(e.contains("--metrics"), "{bad}: {e}");
        }
    }

    #[test]
    fn requests_get_the_metrics_or_a_clear_status() {
        let body = || "maru_x 1\n".to_string();
        let ok = respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", body).unwrap();
        let ok = String::from_utf8(ok).unwrap();
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains(CONTENT_TYPE) && ok.ends_with("\r\n\r\nmaru_x 1\n"),
            "{ok}"
        );
        assert!(ok.contains("Content-Length: 9\r\n"), "{ok}");
        let head =
            String::from_utf8(respond(b"HEAD /metrics HTTP/1.0\n\n", body).unwrap()).unwrap();
        assert!(
            head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        for (req, code) in [
            (&b"GET /nope HTTP/1.1\r\n\r\n"[..], "404"),
            (b"POST /metrics HTTP/1.1\r\n\r\n", "405"),
            (b"GET /metrics\r\n\r\n", "400"),
            (b"GET /metrics SPDY/3 extra\r\n\r\n", "400"),
            (b"\x00\xff garbage\r\n\r\n", "400"),
        ] {
            let r = String::from_utf8(respond(req, body).unwrap()).unwrap();
            assert!(r.starts_with(&format!("HTTP/1.1 {code}")), "{req:?}: {r}");
        }
        assert!(
            respond(b"GET /metrics HTTP/1.1\r\n", body).is_none(),
            "incomplete"
        );
        let huge = vec![b'a'; MAX_HEAD];
        let r = String::from_utf8(respond(&huge, body).unwrap()).unwrap();
        assert!(r.starts_with("HTTP/1.1 431"), "{r}");
    }

    fn scrape(addr: SocketAddr) -> String {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        got
    }

    #[test]
    fn a_scrape_over_tcp_gets_the_counters_while_silent_clients_wait_beside_it() {
        let m = Arc::new(Metrics::new("server", &[("sessions", "Open sessions")]));
        m.set("sessions", 3);
        let addr = serve("127.0.0.1:0".parse().unwrap(), m.clone(), Instant::now()).unwrap();
        // Clients that connect and say nothing cost a slot each, no time.
        let silent: Vec<_> = (0..8)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let t = Instant::now();
        let got = scrape(addr);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(got.contains("\nmaru_server_sessions 3\n"), "{got}");
        assert!(got.contains("maru_server_uptime_seconds "), "{got}");
        drop(silent);
    }

    #[test]
    fn past_the_cap_the_oldest_scrape_connection_is_pushed_out_and_the_rest_time_out() {
        let m = Arc::new(Metrics::new("server", &[]));
        let addr = serve("127.0.0.1:0".parse().unwrap(), m, Instant::now()).unwrap();
        let start = Instant::now();
        let mut idle: Vec<_> = (0..MAX_SCRAPERS + 4)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let closed = |s: &mut std::net::TcpStream, within: Duration| {
            s.set_read_timeout(Some(within)).unwrap();
            match s.read(&mut [0u8; 16]) {
                Ok(n) => n == 0,
                Err(e) => !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ),
            }
        };
        for s in idle.iter_mut().take(4) {
            assert!(
                closed(s, Duration::from_secs(1)),
                "the oldest was not pushed out"
            );
        }
        assert!(start.elapsed() < IO_TIMEOUT, "pushed out, not timed out");
        for s in idle.iter_mut().skip(4) {
            assert!(closed(s, IO_TIMEOUT + Duration::from_secs(2)));
        }
        assert!(start.elapsed() >= IO_TIMEOUT - Duration::from_millis(200));
        assert!(scrape(addr).starts_with("HTTP/1.1 200 OK"));
    }
}
