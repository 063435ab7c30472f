//! The physical limits beside which Maru is judged: memcpy over cold buffers (the
//! ceiling of the `cxl` backend, which is a copy into shared memory) and a plain TCP
//! loopback stream (the ceiling of the `soft` transport, which is a TCP software NIC);
//! and the raw `soft` transport without the worker above it.

use crate::harness::Fig;
use maru::transport::soft::{SoftTarget, SoftTransport};
use maru::transport::{no_bringup, BatchState, LocalBuffer, Op, OpKind, Target, Transport};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn touch(buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate().step_by(4096) {
        *b = i as u8;
    }
}

/// How a limit moves its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// `copy_from_slice`: a copy whose stores first read each line (read for
    /// ownership).
    Memcpy,
    /// Streaming (non-temporal) stores, no read for ownership: what the `cxl` path
    /// uses into the shared mapping and out of it for chunks of 256 KiB or more
    /// (`maru::dax::copy`). The machine's copy bandwidth.
    Stream,
    /// Reads only (a sum over the source): the machine's read bandwidth.
    Read,
}

/// memcpy of `chunk`-sized pieces with `threads` threads, each rotating over its own
/// source and destination of `mem` bytes (together far beyond the caches).
pub fn memcpy(chunk: usize, threads: usize, secs: f64, mem: usize) -> Fig {
    copy(CopyKind::Memcpy, chunk, threads, secs, mem)
}

/// Sums the bytes as u64 words (vectorized): reads every line of `b`.
fn sum(b: &[u8]) -> u64 {
    b.chunks_exact(8)
        .map(|w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
        .fold(0u64, u64::wrapping_add)
}

/// `kind` of `chunk`-sized pieces with `threads` threads, each rotating over its own
/// source and destination of `mem` bytes (together far beyond the caches).
pub fn copy(kind: CopyKind, chunk: usize, threads: usize, secs: f64, mem: usize) -> Fig {
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            std::thread::spawn(move || {
                let mut src = vec![0u8; mem];
                let mut dst = vec![0u8; mem];
                touch(&mut src);
                touch(&mut dst);
                let pieces = mem / chunk;
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut i = 0usize;
                let mut bytes = 0u64;
                while start.elapsed().as_secs_f64() < secs {
                    let s = (i % pieces) * chunk;
                    // Destination offset by half the buffer: neither side is warm.
                    let d = ((i + pieces / 2) % pieces) * chunk;
                    let t = Instant::now();
                    match kind {
                        CopyKind::Memcpy => dst[d..d + chunk].copy_from_slice(&src[s..s + chunk]),
                        // The library's own streaming copy (into the caller's memory
                        // for chunks of 256 KiB or more; the same loop either way).
                        CopyKind::Stream => {
                            maru::dax::copy::copy_out(&mut dst[d..d + chunk], &src[s..s + chunk])
                        }
                        CopyKind::Read => {
                            std::hint::black_box(sum(&src[s..s + chunk]));
                        }
                    }
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                    std::hint::black_box(&dst);
                    bytes += chunk as u64;
                    i += 1;
                }
                (bytes, start.elapsed().as_secs_f64(), lat)
            })
        })
        .collect();
    let mut gbs = 0.0;
    let mut lat = Vec::new();
    for h in handles {
        if let Ok((b, t, l)) = h.join() {
            gbs += b as f64 / t / 1e9;
            lat.extend(l);
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    Fig {
        gbs,
        ops_per_s: 0.0,
        p50_us: crate::harness::percentile(&lat, 0.5),
        p99_us: crate::harness::percentile(&lat, 0.99),
        ops: lat.len(),
    }
}

/// One TCP stream per `streams`: a sender writes `chunk`-sized pieces from a rotating
/// buffer; the receiver reads them into a rotating buffer. GB/s summed over streams.
pub fn tcp_loopback(chunk: usize, streams: usize, secs: f64, mem: usize) -> Result<f64, String> {
    let handles: Vec<_> = (0..streams)
        .map(|_| {
            std::thread::spawn(move || -> Result<f64, String> {
                let listener =
                    TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
                let addr = listener.local_addr().map_err(|e| format!("addr: {e}"))?;
                let rx = std::thread::spawn(move || -> usize {
                    let Ok((mut s, _)) = listener.accept() else {
                        return 0;
                    };
                    let mut buf = vec![0u8; mem];
                    touch(&mut buf);
                    let mut total = 0usize;
                    let mut pos = 0usize;
                    loop {
                        let end = (pos + chunk).min(mem);
                        match s.read(&mut buf[pos..end]) {
                            Ok(0) | Err(_) => return total,
                            Ok(n) => {
                                total += n;
                                pos = if pos + n >= mem - chunk { 0 } else { pos + n };
                            }
                        }
                    }
                });
                let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
                let mut buf = vec![0u8; mem];
                touch(&mut buf);
                let start = Instant::now();
                let mut pos = 0;
                while start.elapsed().as_secs_f64() < secs {
                    s.write_all(&buf[pos..pos + chunk])
                        .map_err(|e| format!("tcp write: {e}"))?;
                    pos = if pos + 2 * chunk > mem {
                        0
                    } else {
                        pos + chunk
                    };
                }
                drop(s);
                let total = rx.join().map_err(|_| "tcp receiver panicked")?;
                Ok(total as f64 / start.elapsed().as_secs_f64() / 1e9)
            })
        })
        .collect();
    let mut sum = 0.0;
    for h in handles {
        sum += h.join().map_err(|_| "tcp stream panicked")??;
    }
    Ok(sum)
}

/// The raw soft transport: each stream has its own worker transport and staging
/// buffer and a region of `mem` bytes at a `SoftTarget`; batches of 32 operations.
pub fn soft(
    kind: OpKind,
    chunk: usize,
    streams: usize,
    secs: f64,
    mem: usize,
) -> Result<f64, String> {
    let target = std::sync::Arc::new(
        SoftTarget::start(
            "127.0.0.1:0".parse().map_err(|e| format!("addr: {e}"))?,
            "",
            None,
            Duration::from_secs(10),
        )
        .map_err(|e| format!("soft target: {e}"))?,
    );
    let handles: Vec<_> = (0..streams)
        .map(|_| {
            let target = target.clone();
            std::thread::spawn(move || -> Result<f64, String> {
                let mut region = vec![0u8; mem];
                touch(&mut region);
                // SAFETY: the region outlives its registration (deregistered below).
                let reg = unsafe { target.register(1, region.as_mut_ptr(), mem as u64, true) }
                    .map_err(|e| format!("register: {e}"))?;
                let batch = 32usize;
                let staging_len = (batch * chunk).min(mem);
                let mut staging = vec![0u8; staging_len];
                touch(&mut staging);
                let nic = SoftTransport::new("bench", None);
                nic.register_local(LocalBuffer::of(&mut staging))
                    .map_err(|e| format!("local: {e}"))?;
                let peer = nic
                    .connect(&reg.transport, &mut no_bringup)
                    .map_err(|e| format!("connect: {e}"))?;
                let per_batch = staging_len / chunk;
                let slots_in_region = mem / chunk;
                let start = Instant::now();
                let mut bytes = 0u64;
                let mut next = 0usize;
                while start.elapsed().as_secs_f64() < secs {
                    let ops: Vec<Op> = (0..per_batch)
                        .map(|i| {
                            let r = (next + i) % slots_in_region;
                            Op {
                                kind,
                                local_offset: (i * chunk) as u64,
                                remote_addr: reg.addr + (r * chunk) as u64,
                                rkey: reg.rkey,
                                len: chunk as u64,
                            }
                        })
                        .collect();
                    next = (next + per_batch) % slots_in_region;
                    let b = nic.post(peer, &ops).map_err(|e| format!("post: {e}"))?;
                    match nic.wait(b, Duration::from_secs(30)) {
                        BatchState::Done => {}
                        other => return Err(format!("batch failed: {other:?}")),
                    }
                    nic.forget(b);
                    bytes += (per_batch * chunk) as u64;
                }
                let gbs = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
                let _ = nic.fence(peer);
                let _ = target.deregister(reg.rkey);
                drop(region);
                Ok(gbs)
            })
        })
        .collect();
    let mut sum = 0.0;
    for h in handles {
        sum += h.join().map_err(|_| "soft stream panicked")??;
    }
    Ok(sum)
}
