//! The metadata benchmark: a real maru-resource-manager (fake DAX in /dev/shm) and
//! maru-server on loopback, with 1 and 8 client connections (one session each):
//! exists of 1 and 32 keys, acquire+release of 32 keys, alloc+publish of one chunk;
//! beside them, the limit of any request/reply: a plain TCP ping-pong between two
//! threads on loopback, once with blocking reads on both sides and once with the client
//! polling for the pong for up to the handler's default `reply_spin_us` before it
//! blocks, as Maru's sessions do (the server's event loop blocks between requests).

use crate::harness::percentile;
use crate::procs::{stack, Scratch};
use maru::wire::meta::{Backend, PublishEntry};
use maru::worker::session::Session;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Bytes of the ping (about an `exists` request of 32 keys) and of the pong.
const PING: usize = 600;
const PONG: usize = 64;
/// The name of the ping-pong row (both sides block).
pub const RTT: &str = "tcp ping-pong (limit)";
/// The name of the ping-pong row where the client polls first, as sessions do.
pub const RTT_SPIN: &str = "tcp ping-pong, client polls (limit)";

fn reply_spin() -> Duration {
    Duration::from_micros(maru::worker::config::DEFAULT_REPLY_SPIN_US)
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub op: &'static str,
    pub conns: usize,
    pub ops_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// A session as a handler opens it (with the default reply polling), proving the
/// server's key.
fn open(server: &str, key: &std::path::Path, id: &str) -> Result<Session, String> {
    let key = maru::auth::load_key_file(key).map_err(|e| e.to_string())?;
    let s = Session::open(
        server,
        id,
        Some(key),
        id,
        "bench",
        "bench",
        Backend::Cxl,
        Duration::from_secs(10),
    )
    .map_err(|e| e.to_string())?;
    s.set_reply_spin(reply_spin());
    Ok(s)
}

fn run_op(
    server: &str,
    key: &std::path::Path,
    op: &'static str,
    conns: usize,
    secs: f64,
    keys: &[String],
) -> Result<Row, String> {
    let handles: Vec<_> = (0..conns)
        .map(|c| {
            let server = server.to_string();
            let key = key.to_path_buf();
            let keys = keys.to_vec();
            std::thread::spawn(move || -> Result<(usize, Vec<f64>), String> {
                let s = open(&server, &key, &format!("bench-{op}-{conns}-{c}"))?;
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut n = 0usize;
                while start.elapsed().as_secs_f64() < secs {
                    let t = Instant::now();
                    match op {
                        "exists x1" => {
                            s.exists(&keys[..1]).map_err(|e| e.to_string())?;
                        }
                        "exists x32" => {
                            s.exists(&keys[..32]).map_err(|e| e.to_string())?;
                        }
                        "acquire+release x32" => {
                            let l = s.acquire(&keys[..32]).map_err(|e| e.to_string())?;
                            s.release_leases(l.into_iter().flatten().map(|g| g.lease_id).collect())
                                .map_err(|e| e.to_string())?;
                        }
                        _ => {
                            let (pages, missing) = s.alloc(1, None).map_err(|e| e.to_string())?;
                            if missing > 0 {
                                s.expand().map_err(|e| e.to_string())?;
                                continue;
                            }
                            let p = pages[0];
                            let key = format!("pub-{conns}-{c}-{n}");
                            s.publish(vec![PublishEntry {
                                key,
                                region_id: p.region_id,
                                offset: p.offset,
                                length: 4096,
                                prev: None,
                            }])
                            .map_err(|e| e.to_string())?;
                        }
                    }
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                    n += 1;
                }
                let _ = s.close();
                Ok((n, lat))
            })
        })
        .collect();
    let start = Instant::now();
    let mut total = 0;
    let mut lat = Vec::new();
    for h in handles {
        let (n, l) = h
            .join()
            .map_err(|_| "bench thread panicked".to_string())??;
        total += n;
        lat.extend(l);
    }
    let elapsed = start.elapsed().as_secs_f64().max(secs);
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok(Row {
        op,
        conns,
        ops_per_s: total as f64 / elapsed,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
    })
}

/// A TCP ping-pong on loopback: one thread writes `PING` bytes and waits for `PONG`
/// bytes, which another thread writes back once it has read the ping. One op = one
/// round trip. The floor under any metadata request (one request, one reply). With
/// `spin`, the client polls for the pong that long before it blocks.
pub fn tcp_rtt(secs: f64, spin: Duration) -> Result<Row, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| format!("addr: {e}"))?;
    let echo = std::thread::spawn(move || -> Result<(), String> {
        let (mut s, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
        let _ = s.set_nodelay(true);
        let mut ping = [0u8; PING];
        let pong = [7u8; PONG];
        loop {
            match s.read_exact(&mut ping) {
                Ok(()) => {}
                // The client is done.
                Err(_) => return Ok(()),
            }
            s.write_all(&pong).map_err(|e| format!("pong: {e}"))?;
        }
    });
    let mut c = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    let _ = c.set_nodelay(true);
    let ping = [1u8; PING];
    let mut pong = [0u8; PONG];
    let mut lat = Vec::new();
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        c.write_all(&ping).map_err(|e| format!("ping: {e}"))?;
        let mut got = 0;
        let until = t + spin;
        while got < PONG && Instant::now() < until {
            match maru::net::recv_now(&c, &mut pong[got..]) {
                Ok(Some(0)) => return Err("pong: the echo thread closed".into()),
                Ok(n) => got += n.unwrap_or(0),
                Err(e) => return Err(format!("pong: {e}")),
            }
            std::hint::spin_loop();
        }
        c.read_exact(&mut pong[got..])
            .map_err(|e| format!("pong: {e}"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let elapsed = start.elapsed().as_secs_f64();
    drop(c);
    echo.join().map_err(|_| "ping-pong thread panicked")??;
    let n = lat.len();
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok(Row {
        op: if spin.is_zero() { RTT } else { RTT_SPIN },
        conns: 1,
        ops_per_s: n as f64 / elapsed,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
    })
}

/// The better (lower p50) of two runs of the same ping-pong.
fn better(a: Row, b: Row) -> Row {
    if b.p50_us < a.p50_us {
        b
    } else {
        a
    }
}

/// Runs the metadata benchmark on a fresh RM + maru-server (64 MiB regions, 4 KiB
/// pages) over the scratch pool.
pub fn run(scratch: &Scratch, secs: f64) -> Result<Vec<Row>, String> {
    let st = stack(scratch, false, "64M", "4K")?;
    let server = st.server.clone();
    // 32 published keys for the lookups.
    let s = open(&server, &scratch.server_key, "bench-writer")?;
    let (pages, _) = s.alloc(32, None).map_err(|e| e.to_string())?;
    let keys: Vec<String> = (0..32).map(|i| format!("bench-key-{i}")).collect();
    let entries = keys
        .iter()
        .zip(&pages)
        .map(|(k, p)| PublishEntry {
            key: k.clone(),
            region_id: p.region_id,
            offset: p.offset,
            length: 4096,
            prev: None,
        })
        .collect();
    s.publish(entries).map_err(|e| e.to_string())?;
    // The round-trip floor first, then again after the ops: the box may change
    // between them (the better of the two is the floor).
    let first = tcp_rtt(secs / 2.0, Duration::ZERO)?;
    let first_spin = tcp_rtt(secs / 2.0, reply_spin())?;
    let mut rows = Vec::new();
    for op in [
        "exists x1",
        "exists x32",
        "acquire+release x32",
        "alloc+publish x1",
    ] {
        for conns in [1usize, 8] {
            rows.push(run_op(
                &server,
                &scratch.server_key,
                op,
                conns,
                secs,
                &keys,
            )?);
        }
    }
    rows.push(better(first, tcp_rtt(secs / 2.0, Duration::ZERO)?));
    rows.push(better(first_spin, tcp_rtt(secs / 2.0, reply_spin())?));
    let _ = s.close();
    Ok(rows)
}
