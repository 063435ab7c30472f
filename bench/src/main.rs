//! maru-bench: measures in one run, on loopback, the soft transport's READ and WRITE
//! throughput beside a plain TCP loopback stream (the physical limit of the path it
//! emulates), and prints the ratios. Buffers rotate over more memory than the caches
//! hold, so the figures are for cold memory.

mod meta;

use clap::Parser;
use maru::transport::soft::{SoftTarget, SoftTransport};
use maru::transport::{no_bringup, BatchState, LocalBuffer, Op, OpKind, Target, Transport};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "maru-bench",
    about = "Soft transport vs TCP loopback throughput (GB/s), in one run"
)]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Region memory per stream (MiB); larger than the caches.
    #[arg(long, default_value_t = 256)]
    region_mib: usize,
    /// Write the tables as JSON to this file too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Run only one part: `soft` or `meta`.
    #[arg(long)]
    only: Option<String>,
}

const MIB: usize = 1 << 20;

fn touch(buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate().step_by(4096) {
        *b = i as u8;
    }
}

/// One TCP stream: a sender writes `chunk`-sized pieces from a rotating buffer; the
/// receiver reads them into a rotating buffer. Returns GB/s summed over `streams`.
fn tcp_loopback(chunk: usize, streams: usize, secs: f64, mem: usize) -> f64 {
    let handles: Vec<_> = (0..streams)
        .map(|_| {
            std::thread::spawn(move || {
                let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
                let addr = listener.local_addr().expect("addr");
                let rx = std::thread::spawn(move || {
                    let (mut s, _) = listener.accept().expect("accept");
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
                let mut s = TcpStream::connect(addr).expect("connect");
                let mut buf = vec![0u8; mem];
                touch(&mut buf);
                let start = Instant::now();
                let mut pos = 0;
                while start.elapsed().as_secs_f64() < secs {
                    s.write_all(&buf[pos..pos + chunk]).expect("write");
                    pos = if pos + 2 * chunk > mem {
                        0
                    } else {
                        pos + chunk
                    };
                }
                drop(s);
                let total = rx.join().expect("rx");
                total as f64 / start.elapsed().as_secs_f64() / 1e9
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("stream")).sum()
}

/// Soft transport: each stream has its own worker transport and staging buffer and a
/// region of `mem` bytes at the target; batches of 32 operations of `chunk` bytes.
fn soft(kind: OpKind, chunk: usize, streams: usize, secs: f64, mem: usize) -> f64 {
    let target = std::sync::Arc::new(
        SoftTarget::start(
            "127.0.0.1:0".parse().expect("addr"),
            "",
            None,
            Duration::from_secs(10),
        )
        .expect("target"),
    );
    let handles: Vec<_> = (0..streams)
        .map(|_| {
            let target = target.clone();
            std::thread::spawn(move || {
                let mut region = vec![0u8; mem];
                touch(&mut region);
                let reg = unsafe { target.register(region.as_mut_ptr(), mem as u64, true) }
                    .expect("register");
                let batch = 32usize;
                let staging_len = (batch * chunk).min(mem);
                let mut staging = vec![0u8; staging_len];
                touch(&mut staging);
                let nic = SoftTransport::new("bench", None);
                nic.register_local(LocalBuffer {
                    ptr: staging.as_mut_ptr(),
                    len: staging_len,
                })
                .expect("local");
                let peer = nic
                    .connect(&reg.transport, &mut no_bringup)
                    .expect("connect");
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
                    let b = nic.post(peer, &ops).expect("post");
                    match nic.wait(b, Duration::from_secs(30)) {
                        BatchState::Done => {}
                        other => panic!("batch failed: {other:?}"),
                    }
                    nic.forget(b);
                    bytes += (per_batch * chunk) as u64;
                }
                let gbs = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
                let _ = nic.fence(peer);
                let _ = target.deregister(reg.rkey);
                drop(region);
                gbs
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("stream")).sum()
}

fn main() {
    let args = Args::parse();
    let mem = args.region_mib * MIB;
    let mut rows = Vec::new();
    let want = |part: &str| args.only.as_deref().is_none_or(|o| o == part);
    if want("soft") {
        println!("soft transport vs TCP loopback, {} s per figure, {} MiB per stream (GB/s, summed over streams)", args.seconds, args.region_mib);
        println!(
            "{:>8} {:>7} {:>10} {:>10} {:>10} {:>11} {:>11}",
            "chunk", "streams", "tcp", "soft_read", "soft_write", "read/tcp", "write/tcp"
        );
        for &chunk in &[256 * 1024, 2 * MIB] {
            for &streams in &[1usize, 4] {
                let tcp = tcp_loopback(chunk, streams, args.seconds, mem);
                let rd = soft(OpKind::Read, chunk, streams, args.seconds, mem);
                let wr = soft(OpKind::Write, chunk, streams, args.seconds, mem);
                println!(
                    "{:>7}K {:>7} {:>10.2} {:>10.2} {:>10.2} {:>11.2} {:>11.2}",
                    chunk / 1024,
                    streams,
                    tcp,
                    rd,
                    wr,
                    rd / tcp,
                    wr / tcp
                );
                rows.push(serde_json::json!({"part": "soft", "chunk": chunk, "streams": streams, "tcp_gbs": tcp,
                    "soft_read_gbs": rd, "soft_write_gbs": wr, "read_over_tcp": rd / tcp, "write_over_tcp": wr / tcp}));
            }
        }
    }
    if want("meta") {
        let bin_dir = std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.to_path_buf()))
            .unwrap_or_default();
        println!();
        println!(
            "metadata (maru-server on loopback), {} s per figure",
            args.seconds
        );
        println!(
            "{:<22} {:>5} {:>12} {:>10} {:>10}",
            "op", "conns", "ops/s", "p50 us", "p99 us"
        );
        match meta::run(&bin_dir, args.seconds) {
            Ok(r) => {
                for x in r {
                    println!(
                        "{:<22} {:>5} {:>12.0} {:>10.1} {:>10.1}",
                        x.op, x.conns, x.ops_per_s, x.p50_us, x.p99_us
                    );
                    rows.push(serde_json::json!({"part": "meta", "op": x.op, "conns": x.conns, "ops_per_s": x.ops_per_s, "p50_us": x.p50_us, "p99_us": x.p99_us}));
                }
            }
            Err(e) => {
                eprintln!("metadata benchmark failed: {e}");
                std::process::exit(1);
            }
        }
    }
    if let Some(p) = args.json {
        let doc = serde_json::json!({"benchmark": "maru-bench", "rows": rows});
        if let Err(e) = std::fs::write(&p, serde_json::to_string_pretty(&doc).unwrap_or_default()) {
            eprintln!("cannot write {}: {e}", p.display());
            std::process::exit(1);
        }
    }
}
