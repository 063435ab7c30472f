//! `--metrics ADDR`: the daemon's metrics over HTTP at `/metrics`, for Prometheus.
//!
//! One thread serves one connection at a time: each gets 2 s to send its request
//! (at most 8 KiB of head) and to read the reply, then it is closed. A slow or
//! hostile scraper therefore delays others by at most a few seconds and holds one
//! socket; it never reaches the daemon's event loop, which only updates atomics.

use crate::metrics::{Metrics, CONTENT_TYPE};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest request head read (request line and headers).
pub const MAX_HEAD: usize = 8 << 10;
/// Time a scraper gets to send its request, and to take the reply.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

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

fn serve_one(mut conn: TcpStream, metrics: &Metrics, started: Instant) {
    let _ = conn.set_read_timeout(Some(IO_TIMEOUT));
    let _ = conn.set_write_timeout(Some(IO_TIMEOUT));
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let out = loop {
        if let Some(r) = respond(&head, || metrics.render(started.elapsed().as_secs_f64())) {
            break r;
        }
        if Instant::now() >= deadline {
            return;
        }
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n.min(MAX_HEAD - head.len().min(MAX_HEAD))]),
        }
    };
    let _ = conn.write_all(&out);
}

/// Binds `addr` and serves the metrics from a thread of their own. The bind error,
/// if any, comes back at once (so a daemon refuses to start on a taken port).
pub fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    started: Instant,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    std::thread::Builder::new()
        .name("maru-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(c) => serve_one(c, &metrics, started),
                    Err(e) => {
                        log::warn!("metrics: accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
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

    #[test]
    fn a_scrape_over_tcp_gets_the_counters_and_a_silent_client_does_not_block_it_for_long() {
        let m = Arc::new(Metrics::new("server", &[("sessions", "Open sessions")]));
        m.set("sessions", 3);
        let addr = serve("127.0.0.1:0".parse().unwrap(), m.clone(), Instant::now()).unwrap();
        // A client that connects and says nothing holds the server at most IO_TIMEOUT.
        let _silent = TcpStream::connect(addr).unwrap();
        let t = Instant::now();
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        assert!(t.elapsed() < IO_TIMEOUT + Duration::from_secs(3));
        assert!(got.contains("\nmaru_server_sessions 3\n"), "{got}");
        assert!(got.contains("maru_server_uptime_seconds "), "{got}");
    }
}
