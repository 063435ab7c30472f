//! The metadata benchmark: a real maru-resource-manager (fake DAX in /dev/shm) and
//! maru-server on loopback, with 1 and 8 client connections (one session each):
//! exists of 1 and 32 keys, acquire+release of 32 keys, alloc+publish of one chunk;
//! beside them, the limit of any request/reply: a plain TCP ping-pong between two
//! threads on loopback, once with blocking reads on both sides and once with the client
//! polling for the pong for up to the handler's default `reply_spin_us` before it
//! blocks, as Maru's sessions do (the server's event loop blocks between requests).
//!
//! The rows above run against a maru-server that keeps its directory in memory only
//! (`--in-memory`). Beside them, alloc+publish also runs against a second maru-server
//! on the same RM that keeps its directory durable (`--state-dir` on the scratch
//! directory's disk), in rounds interleaved with the in-memory one's so that both see
//! the same machine. Last, the recovery of a durable directory of 1 M keys: a
//! maru-server on its own RM is filled, stopped, and started again on its directory;
//! the time from its start until it serves (its ready file) is the recovery time.

use crate::harness::percentile;
use crate::procs::{
    bin_dir, server_args, stack_with, start_daemon, start_daemon_within, start_rm, Scratch,
};
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
/// The name of the ping-pong row whose pings come [`WAKE_GAP`] after the last pong
/// (the client busy meanwhile), as a batch store's publish comes after its copy:
/// what waking a server thread that slept that long costs on this machine.
pub const RTT_AFTER_GAP: &str = "tcp ping-pong, client polls, 1 ms after the last (limit)";
/// The client's busy time before each ping of the [`RTT_AFTER_GAP`] row.
const WAKE_GAP: Duration = Duration::from_millis(1);

/// The alloc+publish rows: against the in-memory maru-server, and the durable one.
pub const PUBLISH: &str = "alloc+publish x1";
pub const PUBLISH_DURABLE: &str = "alloc+publish x1, durable";
/// Interleaved rounds of each alloc+publish figure (each `secs / 2` long).
const ROUNDS: usize = 4;
/// Keys of the recovery figure, and their page size (1 KiB: 1 GiB of regions).
pub const RECOVERY_KEYS: usize = 1 << 20;
const RECOVERY_CHUNK: u64 = 1024;
const RECOVERY_REGION: u64 = 64 << 20;

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
    let ns = ("bench", "bench");
    open_session(server, key, id, ns, Duration::from_secs(10), reply_spin())
}

/// A CXL session `id` of namespace and tenant `ns` on `server`, proving the key in the
/// file `key`, that polls replies for `spin` before it sleeps.
pub(crate) fn open_session(
    server: &str,
    key: &std::path::Path,
    id: &str,
    (namespace, tenant): (&str, &str),
    timeout: Duration,
    spin: Duration,
) -> Result<Session, String> {
    let key = maru::auth::load_key_file(key).map_err(|e| e.to_string())?;
    let s = Session::open(
        server,
        id,
        Some(key),
        id,
        namespace,
        tenant,
        Backend::Cxl,
        timeout,
    )
    .map_err(|e| format!("{id}: {e}"))?;
    s.set_reply_spin(spin);
    Ok(s)
}

/// Publishes `pages[i]` as key `name(i)` of `len` bytes; one refused is an error
/// naming the first key.
pub(crate) fn publish_pages(
    s: &Session,
    pages: &[maru::wire::meta::PageGrant],
    name: impl Fn(usize) -> String,
    len: u64,
) -> Result<(), String> {
    let entries: Vec<PublishEntry> = pages
        .iter()
        .enumerate()
        .map(|(i, p)| p.entry(name(i), len))
        .collect();
    let done = s
        .publish(entries, s.call_deadline())
        .map_err(|e| e.to_string())?;
    if done.iter().any(|d| !d) {
        return Err(format!("fill: a publish at key {} was refused", name(0)));
    }
    Ok(())
}

/// How many of `keys` the server finds published.
pub(crate) fn count_found(s: &Session, keys: &[String]) -> Result<usize, String> {
    let found = s
        .exists(keys, s.call_deadline())
        .map_err(|e| e.to_string())?;
    Ok(found.iter().filter(|f| **f).count())
}

/// The recovery of a durable directory.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Recovery {
    pub keys: usize,
    /// Seconds the filling took (alloc + publish in batches of `MAX_BATCH`).
    pub fill_s: f64,
    /// Size of the directory's files on disk (MiB).
    pub dir_mib: f64,
    /// From the start of maru-server on the directory until it serves (ms).
    pub start_ms: f64,
    /// The same for a maru-server on an empty directory, for scale (ms).
    pub empty_start_ms: f64,
    /// Of a sample of the keys, how many the restarted server found.
    pub found: usize,
    pub sampled: usize,
}

/// One figure's ops: (count, seconds, latencies in µs).
type Part = (usize, f64, Vec<f64>);

fn row(op: &'static str, conns: usize, parts: Vec<Part>) -> Row {
    let total: usize = parts.iter().map(|p| p.0).sum();
    let secs: f64 = parts.iter().map(|p| p.1).sum();
    let mut lat: Vec<f64> = parts.into_iter().flat_map(|p| p.2).collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    Row {
        op,
        conns,
        ops_per_s: total as f64 / secs,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
    }
}

/// `conns` sessions doing `op` for `secs`; `tag` tells apart the session names and
/// published keys of several runs on one server.
fn measure(
    server: &str,
    key: &std::path::Path,
    op: &'static str,
    conns: usize,
    secs: f64,
    keys: &[String],
    tag: &str,
) -> Result<Part, String> {
    let sessions = (0..conns)
        .map(|c| open(server, key, &format!("bench-{op}-{conns}-{c}{tag}")))
        .collect::<Result<Vec<_>, _>>()?;
    let (part, sessions) = measure_on(sessions, op, secs, keys, tag)?;
    for s in sessions {
        let _ = s.close(s.call_deadline());
    }
    Ok(part)
}

/// `op` on each of `sessions` (one thread each) for `secs`; gives the sessions back
/// (a session keeps its regions: rounds on the same sessions take no more memory).
fn measure_on(
    sessions: Vec<Session>,
    op: &'static str,
    secs: f64,
    keys: &[String],
    tag: &str,
) -> Result<(Part, Vec<Session>), String> {
    let conns = sessions.len();
    let handles: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(c, s)| {
            let keys = keys.to_vec();
            let tag = tag.to_string();
            std::thread::spawn(move || -> Result<(usize, Vec<f64>, Session), String> {
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut n = 0usize;
                while start.elapsed().as_secs_f64() < secs {
                    let t = Instant::now();
                    match op {
                        "exists x1" => {
                            s.exists(&keys[..1], s.call_deadline())
                                .map_err(|e| e.to_string())?;
                        }
                        "exists x32" => {
                            s.exists(&keys[..32], s.call_deadline())
                                .map_err(|e| e.to_string())?;
                        }
                        "acquire+release x32" => {
                            let l = s
                                .acquire(&keys[..32], s.call_deadline())
                                .map_err(|e| e.to_string())?;
                            s.release_leases(
                                l.into_iter().flatten().map(|g| g.lease_id).collect(),
                                s.call_deadline(),
                            )
                            .map_err(|e| e.to_string())?;
                        }
                        _ => {
                            let (pages, missing) = s
                                .alloc(1, None, s.call_deadline())
                                .map_err(|e| e.to_string())?;
                            if missing > 0 {
                                s.expand(s.call_deadline()).map_err(|e| e.to_string())?;
                                continue;
                            }
                            let p = pages[0];
                            let key = format!("pub{tag}-{conns}-{c}-{n}");
                            s.publish(vec![p.entry(key, 4096)], s.call_deadline())
                                .map_err(|e| e.to_string())?;
                        }
                    }
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                    n += 1;
                }
                Ok((n, lat, s))
            })
        })
        .collect();
    let start = Instant::now();
    let mut total = 0;
    let mut lat = Vec::new();
    let mut back = Vec::with_capacity(conns);
    for h in handles {
        let (n, l, s) = h
            .join()
            .map_err(|_| "bench thread panicked".to_string())??;
        total += n;
        lat.extend(l);
        back.push(s);
    }
    let elapsed = start.elapsed().as_secs_f64().max(secs);
    Ok(((total, elapsed, lat), back))
}

/// A TCP ping-pong on loopback: one thread writes `PING` bytes and waits for `PONG`
/// bytes, which another thread writes back once it has read the ping. One op = one
/// round trip. The floor under any metadata request (one request, one reply). With
/// `spin`, the client polls for the pong that long before it blocks; with `gap`, it
/// spins that long before each ping (not timed), so the echo thread sleeps as long.
pub fn tcp_rtt(secs: f64, spin: Duration, gap: Duration) -> Result<Row, String> {
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
        let idle = Instant::now();
        while idle.elapsed() < gap {
            std::hint::spin_loop();
        }
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
        op: match (gap.is_zero(), spin.is_zero()) {
            (false, _) => RTT_AFTER_GAP,
            (true, true) => RTT,
            (true, false) => RTT_SPIN,
        },
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

/// Runs the metadata benchmark on a fresh RM + in-memory maru-server (64 MiB regions, 4 KiB
/// pages) over the scratch pool.
pub fn run(scratch: &Scratch, secs: f64) -> Result<Vec<Row>, String> {
    let st = stack_with(scratch, false, "64M", "4K", false)?;
    let server = st.server.clone();
    // 32 published keys for the lookups.
    let s = open(&server, &scratch.server_key, "bench-writer")?;
    let (pages, _) = s
        .alloc(32, None, s.call_deadline())
        .map_err(|e| e.to_string())?;
    let keys: Vec<String> = (0..32).map(|i| format!("bench-key-{i}")).collect();
    let entries = keys
        .iter()
        .zip(&pages)
        .map(|(k, p)| p.entry(k.clone(), 4096))
        .collect();
    s.publish(entries, s.call_deadline())
        .map_err(|e| e.to_string())?;
    // The round-trip floor first, then again after the ops: the box may change
    // between them (the better of the two is the floor).
    let first = tcp_rtt(secs / 2.0, Duration::ZERO, Duration::ZERO)?;
    let first_spin = tcp_rtt(secs / 2.0, reply_spin(), Duration::ZERO)?;
    let mut rows = Vec::new();
    for op in ["exists x1", "exists x32", "acquire+release x32"] {
        for conns in [1usize, 8] {
            let part = measure(&server, &scratch.server_key, op, conns, secs, &keys, "")?;
            rows.push(row(op, conns, vec![part]));
        }
    }
    // alloc+publish against both servers, in interleaved rounds.
    let state = scratch.path("server-state");
    let (durable_proc, durable) = start_daemon(
        &bin_dir().join("maru-server"),
        &server_args(
            scratch,
            &st.rm_addr,
            &st.rm_key,
            None,
            "64M",
            "4K",
            Some(&state),
        ),
        &scratch.path("server.ready"),
    )?;
    for conns in [1usize, 8] {
        // The same sessions in every round: each keeps its region.
        let mut on = [&server, &durable].map(|srv| {
            (0..conns)
                .map(|c| {
                    open(
                        srv,
                        &scratch.server_key,
                        &format!("bench-{PUBLISH}-{conns}-{c}"),
                    )
                })
                .collect::<Result<Vec<_>, _>>()
        });
        let mut parts: [Vec<Part>; 2] = [Vec::new(), Vec::new()];
        for round in 0..ROUNDS {
            let tag = format!("-r{round}");
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let sessions = std::mem::replace(&mut on[i], Ok(Vec::new()))?;
                let (part, back) = measure_on(sessions, PUBLISH, secs / 2.0, &keys, &tag)?;
                parts[i].push(part);
                on[i] = Ok(back);
            }
        }
        for s in on.into_iter().flatten().flatten() {
            let _ = s.close(s.call_deadline());
        }
        let [mem, dur] = parts;
        rows.push(row(PUBLISH, conns, mem));
        rows.push(row(PUBLISH_DURABLE, conns, dur));
    }
    drop(durable_proc);
    rows.push(better(
        first,
        tcp_rtt(secs / 2.0, Duration::ZERO, Duration::ZERO)?,
    ));
    rows.push(better(
        first_spin,
        tcp_rtt(secs / 2.0, reply_spin(), Duration::ZERO)?,
    ));
    // The client polls for as long as the gap: the pong's wait is the echo thread's
    // wake-up, not the client's own.
    rows.push(tcp_rtt(secs / 2.0, WAKE_GAP, WAKE_GAP)?);
    let _ = s.close(s.call_deadline());
    Ok(rows)
}

/// Fills a durable directory with `keys` keys (1 KiB pages) through a maru-server on
/// an RM of its own (a sparse fake-DAX file in the scratch directory: nothing touches
/// its bytes), stops it (SIGTERM), and times its start on that directory until it
/// serves; then checks a sample of the keys.
pub fn recovery(scratch: &Scratch, keys: usize) -> Result<Recovery, String> {
    let bins = bin_dir();
    let regions = (keys as u64 * RECOVERY_CHUNK).div_ceil(RECOVERY_REGION) + 4;
    let rm_state = scratch.path("recovery-rm-state");
    let pool = scratch.path("recovery-pool");
    let (_rm, rm_addr, rm_key) = start_rm(
        &rm_state,
        &pool,
        regions * RECOVERY_REGION,
        &scratch.path("rm.ready"),
    )?;
    let state = scratch.path("recovery-state");
    let args = server_args(
        scratch,
        &rm_addr,
        &rm_key,
        None,
        &RECOVERY_REGION.to_string(),
        &RECOVERY_CHUNK.to_string(),
        Some(&state),
    );
    let server = bins.join("maru-server");
    let started = Instant::now();
    let (srv, addr) = start_daemon(&server, &args, &scratch.path("server.ready"))?;
    let empty_start_ms = started.elapsed().as_secs_f64() * 1e3;
    let s = open(&addr, &scratch.server_key, "bench-recovery-fill")?;
    let name = |i: usize| format!("recovered-{i}");
    let started = Instant::now();
    let mut n = 0;
    while n < keys {
        let want = (keys - n).min(maru::wire::meta::MAX_BATCH) as u32;
        let (pages, missing) = s
            .alloc(want, None, s.call_deadline())
            .map_err(|e| e.to_string())?;
        if pages.is_empty() && missing > 0 {
            s.expand(s.call_deadline())
                .map_err(|e| format!("expand at key {n}: {e}"))?;
            continue;
        }
        if pages.is_empty() {
            return Err(format!("recovery fill: no page at key {n}"));
        }
        let key = |i: usize| name(n + i);
        publish_pages(&s, &pages, key, RECOVERY_CHUNK).map_err(|e| format!("recovery {e}"))?;
        n += pages.len();
    }
    let fill_s = started.elapsed().as_secs_f64();
    let _ = s.close(s.call_deadline());
    // SIGTERM: the writer makes what is left durable before it exits.
    drop(srv);
    let dir_mib = dir_bytes(&state) as f64 / (1 << 20) as f64;
    let started = Instant::now();
    let (_srv, addr) = start_daemon_within(
        &server,
        &args,
        &scratch.path("server.ready"),
        Duration::from_secs(300),
    )?;
    let start_ms = started.elapsed().as_secs_f64() * 1e3;
    let s = open(&addr, &scratch.server_key, "bench-recovery-check")?;
    let sample: Vec<String> = (0..keys).step_by((keys / 1000).max(1)).map(name).collect();
    let found = count_found(&s, &sample)?;
    let _ = s.close(s.call_deadline());
    Ok(Recovery {
        keys,
        fill_s,
        dir_mib,
        start_ms,
        empty_start_ms,
        found,
        sampled: sample.len(),
    })
}

/// Bytes of the files under `dir`.
pub(crate) fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
