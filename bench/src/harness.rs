//! Running N clients at once and turning their operations into a figure: GB/s over
//! the wall time of the whole group, p50/p99 of one operation, and how many ran.
//! Buffers that rotate over more memory than the caches hold keep the data cold.

use serde::Serialize;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Chunks per batch in the batched store and load rows (Maru, Redis pipelines).
pub const BATCH: usize = 32;

/// One measured figure.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Fig {
    pub gbs: f64,
    pub ops_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Operations measured (the p99 of few operations is close to their maximum).
    pub ops: usize,
}

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// What bounds one client's run: wall time and, where the operations consume space
/// (stores into a pool without eviction), a number of operations.
#[derive(Clone, Copy)]
pub struct Bound {
    pub secs: f64,
    pub max_ops: usize,
}

/// What one run of clients measured, before it is made a figure: runs of the same
/// figure add up (`add`).
#[derive(Debug, Default)]
pub struct Run {
    pub bytes: u64,
    /// Wall time of the group, seconds.
    pub wall: f64,
    /// Each operation's time, µs.
    pub lat: Vec<f64>,
}

impl Run {
    pub fn add(&mut self, other: Run) {
        self.bytes += other.bytes;
        self.wall += other.wall;
        self.lat.extend(other.lat);
    }

    /// Bytes per second over the wall time.
    pub fn rate(&self) -> f64 {
        self.bytes as f64 / self.wall.max(1e-9)
    }

    pub fn fig(mut self) -> Fig {
        let wall = self.wall.max(1e-9);
        self.lat.sort_by(|a, b| a.total_cmp(b));
        Fig {
            gbs: self.rate() / 1e9,
            ops_per_s: self.lat.len() as f64 / wall,
            p50_us: percentile(&self.lat, 0.5),
            p99_us: percentile(&self.lat, 0.99),
            ops: self.lat.len(),
        }
    }
}

/// Runs `op(i)` (returns the bytes it moved) repeatedly on each client of `clients`
/// (each its own thread), all released at once, each until its bound.
pub fn run_clients<F>(clients: Vec<F>, bound: Bound) -> Result<Fig, String>
where
    F: FnMut(usize) -> Result<u64, String> + Send + 'static,
{
    run_clients_raw(clients, bound).map(Run::fig)
}

/// As [`run_clients`], what was measured before it is a figure.
pub fn run_clients_raw<F>(clients: Vec<F>, bound: Bound) -> Result<Run, String>
where
    F: FnMut(usize) -> Result<u64, String> + Send + 'static,
{
    let n = clients.len();
    let gate = Arc::new(Barrier::new(n + 1));
    let handles: Vec<_> = clients
        .into_iter()
        .map(|mut op| {
            let gate = gate.clone();
            std::thread::spawn(move || -> Result<(u64, Vec<f64>), String> {
                gate.wait();
                let start = Instant::now();
                let mut lat = Vec::new();
                let mut bytes = 0u64;
                let mut i = 0;
                while i < bound.max_ops && start.elapsed().as_secs_f64() < bound.secs {
                    let t = Instant::now();
                    bytes += op(i)?;
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                    i += 1;
                }
                Ok((bytes, lat))
            })
        })
        .collect();
    gate.wait();
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut lat = Vec::new();
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok((b, l))) => {
                bytes += b;
                lat.extend(l);
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert("a benchmark client panicked".to_string());
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(Run {
        bytes,
        wall: start.elapsed().as_secs_f64(),
        lat,
    })
}

/// Two measurements taking `turns` turns, the first (`run(false, t)`) ahead in even
/// turns and the second (`run(true, t)`) ahead in odd ones, so that the machine's
/// drift weighs on both alike: each one's results, turn by turn.
pub fn alternate<T>(
    turns: usize,
    mut run: impl FnMut(bool, usize) -> Result<T, String>,
) -> Result<(Vec<T>, Vec<T>), String> {
    let (mut a, mut b) = (Vec::with_capacity(turns), Vec::with_capacity(turns));
    for t in 0..turns {
        if t % 2 == 0 {
            a.push(run(false, t)?);
            b.push(run(true, t)?);
        } else {
            b.push(run(true, t)?);
            a.push(run(false, t)?);
        }
    }
    Ok((a, b))
}

/// A buffer of `len` bytes (pages touched, contents varied) cut into `chunk`-sized
/// pieces handed out in rotation, so that consecutive operations use cold memory.
pub struct Rotor {
    buf: Vec<u8>,
    chunk: usize,
    next: usize,
}

impl Rotor {
    pub fn new(len: usize, chunk: usize, seed: u64) -> Rotor {
        let n = (len / chunk).max(1);
        let mut buf = vec![0u8; n * chunk];
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for w in buf.chunks_mut(64) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w[0] = x as u8;
        }
        Rotor {
            buf,
            chunk,
            next: 0,
        }
    }

    pub fn pieces(&self) -> usize {
        self.buf.len() / self.chunk
    }

    /// The next piece's pointer (read or written by the caller).
    pub fn next_ptr(&mut self) -> *mut u8 {
        let i = self.next;
        self.next = (self.next + 1) % self.pieces();
        // SAFETY: i < pieces, so the piece lies inside buf.
        unsafe { self.buf.as_mut_ptr().add(i * self.chunk) }
    }

    /// The start of the buffer (its first piece).
    pub fn base(&self) -> *const u8 {
        self.buf.as_ptr()
    }
}

/// Sleeps while the daemons and the handler are idle; bounded by the caller's seconds.
pub fn idle_for(secs: f64) {
    std::thread::sleep(Duration::from_secs_f64(secs));
}
