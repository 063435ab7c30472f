//! maru-bench: Maru beside what users would pick instead and beside the physical
//! limits, in one run on loopback. It starts what it needs (resource manager on a fake
//! DAX file on a 2 MiB-page tmpfs it mounts for itself, or in /dev/shm; remote CXL
//! agent, maru-server, redis-server) and measures:
//!
//! - Maru `cxl` and `remote_cxl` over `soft`, store and load through the C ABI, batches
//!   of 32 and single chunks, 256 KiB and 2 MiB, 1 and 4 clients (engines), and one
//!   handler shared by 2 threads;
//! - Redis SET/GET, pipelined 32 and single, the same payloads and clients;
//! - Mooncake Store over TCP (part `mooncake`, bench/src/mooncake.rs), taking turns with
//!   Maru on the same chunks and clients;
//! - memcpy (1 and 2 threads) and a TCP loopback stream over cold buffers, and the raw
//!   soft transport;
//! - metadata operations against maru-server; idle CPU of every daemon and of an idle
//!   open handler.
//!
//! It prints one set of tables with the ratios and the targets, and writes
//! latest.{json,md,txt,png} into the output directory.

mod chart;
mod connector;
mod harness;
mod hitrate;
mod idle;
mod in_place;
mod limits;
mod machine;
mod maru_io;
mod meta;
mod mooncake;
mod pairs;
mod procs;
mod python_row;
mod redis;
mod report;
mod results;
mod scale;
mod scale_agent;
mod scale_report;
mod scale_split;
mod tables;

use clap::Parser;
use machine::{loadavg, machine};
use maru::transport::OpKind;
use maru_io::{Config, Sizes, BATCH, MIB};
use report::chunk_name;
use results::{MemcpyRow, Results, SoftRow, TcpRow, CHUNKS, MANY};
use std::path::PathBuf;
use tables::{chart_panels, tables, targets};

#[derive(Parser, Debug)]
#[command(
    name = "maru-bench",
    about = "Maru vs Redis, Mooncake Store, memcpy and TCP loopback; metadata ops; idle CPU (one run, loopback)"
)]
struct Args {
    /// Seconds per figure.
    #[arg(long)]
    seconds: Option<f64>,
    /// A short run (about a quarter of the time, smaller buffers): a smoke test.
    #[arg(long)]
    quick: bool,
    /// Seconds of the idle CPU measurement (each of two).
    #[arg(long)]
    idle_seconds: Option<f64>,
    /// Size of the fake-DAX pool (GiB); bounds the bytes each store figure writes,
    /// except "store into a full cache", which first fills it and then evicts.
    #[arg(long)]
    pool_gib: Option<u64>,
    /// Page size of the fake-DAX pool: 2M (a huge-page tmpfs the benchmark mounts for
    /// itself, as a devdax device maps with 2 MiB pages; needs root, falls back to 4K)
    /// or 4K (/dev/shm). With 2M, the cxl figures of 2 MiB chunks (1 client) are also
    /// measured on a 4 KiB-page pool in /dev/shm.
    #[arg(long, default_value = "2M", value_parser = ["2M", "4K"])]
    pool_pages: String,
    /// Memory the clients of one figure rotate over (MiB), far beyond the caches.
    #[arg(long)]
    rotate_mib: Option<usize>,
    /// Directory for latest.json, latest.md, latest.txt and latest.png.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Maru backends to measure (default both): cxl, remote_cxl.
    #[arg(long, value_delimiter = ',')]
    backends: Vec<String>,
    /// Parts to run, comma-separated: limits, soft, maru, threads (one handler used by
    /// 2 and 4 threads against as many handlers, interleaved on one stack), in_place,
    /// connector (the vLLM connector's worker, Python), redis, meta, idle, hitrate (a chat
    /// trace replayed through maru-server's eviction beside LRU and Belady), mooncake
    /// (Mooncake Store over TCP from a venv it makes, beside Maru in turns; default all);
    /// scale (maru-server with up to 4,000 simulated engines and 16 M keys, about 10
    /// minutes; only when named, alone: scale.{json,md,png}).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Chunk sizes to measure, comma-separated: 256K, 2M (default both).
    #[arg(long, value_delimiter = ',', value_parser = ["256K", "2M"])]
    chunks: Vec<String>,
    /// Client counts of the Maru, threads and Redis figures, comma-separated: 1, 2 and
    /// 4 (engines with a handler each, and one handler shared by as many threads);
    /// default all.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(usize))]
    clients: Vec<usize>,
    /// The maru part's stores and loads move 64 bytes per chunk into and out of pages
    /// of the chunk size: every call does all its work but the copy, and the table
    /// "Time outside the copy" gives its time per call and per chunk. These rows are
    /// apart from the others (no target reads them); the cxl rows on a pool of 4 KiB
    /// pages are not run.
    #[arg(long)]
    null_copy: bool,
    /// Keys of the scale part's largest step (default 4 M, 1 M with --quick; 16777216
    /// for 16 M, longer than 15 minutes on a loaded 2-core machine).
    #[arg(long)]
    scale_keys: Option<u64>,
    /// A trace in Mooncake's JSON-lines format for part hitrate, beside its own
    /// synthesized one (repeatable): FAST25-release/traces/conversation_trace.jsonl of
    /// github.com/kvcache-ai/Mooncake (docs/benchmarks.md). Without it, that row is
    /// skipped.
    #[arg(long)]
    trace: Vec<PathBuf>,
}

/// The parts `--only` picks, in the order a run measures them: a new part is
/// registered here, given a field in [`Results`] and its rows in `tables.rs`.
const PARTS: &[&str] = &[
    "limits",
    "soft",
    "maru",
    "threads",
    "in_place",
    "connector",
    "redis",
    "meta",
    "idle",
    "hitrate",
    "mooncake",
    "scale",
];

/// A chunk size as `--chunks` spells it.
fn chunk_flag(c: usize) -> String {
    if c >= MIB {
        format!("{}M", c / MIB)
    } else {
        format!("{}K", c / 1024)
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("maru-bench: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let quick = args.quick;
    let secs = args.seconds.unwrap_or(if quick { 0.5 } else { 2.0 });
    let idle_secs = args.idle_seconds.unwrap_or(if quick { 3.0 } else { 10.0 });
    let pool_gib = args.pool_gib.unwrap_or(if quick { 2 } else { 4 });
    let rotate = args.rotate_mib.unwrap_or(if quick { 256 } else { 1024 }) * MIB;
    let want = |p: &str| args.only.is_empty() || args.only.iter().any(|o| o == p);
    let chunks: Vec<usize> = CHUNKS
        .iter()
        .copied()
        .filter(|&c| args.chunks.is_empty() || args.chunks.iter().any(|n| *n == chunk_flag(c)))
        .collect();
    for n in &args.clients {
        if ![1, 2, MANY].contains(n) {
            return Err(format!("--clients {n}: use 1, 2 or {MANY}"));
        }
    }
    let want_clients = |n: usize| args.clients.is_empty() || args.clients.contains(&n);
    // The backends asked for (both by default).
    let backends: Vec<&'static str> = ["cxl", "remote_cxl"]
        .into_iter()
        .filter(|b| args.backends.is_empty() || args.backends.iter().any(|x| x == b))
        .collect();
    // Each chunk size with each client count of `counts` asked for.
    let chunk_clients = |counts: &[usize]| -> Vec<(usize, usize)> {
        chunks
            .iter()
            .flat_map(|&c| {
                counts
                    .iter()
                    .copied()
                    .filter(|&n| want_clients(n))
                    .map(move |n| (c, n))
            })
            .collect()
    };
    for o in &args.only {
        if !PARTS.contains(&o.as_str()) {
            return Err(format!("unknown part {o}: use {}", PARTS.join(", ")));
        }
    }
    if args.only.iter().any(|o| o == "scale") {
        std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
        if let Some(j) = std::env::var_os("MARU_SCALE_REPLOT") {
            return scale_report::replot(std::path::Path::new(&j), &args.out);
        }
        let r = scale::run(quick, args.scale_keys)?;
        let m = machine();
        let desc = format!(
            "{}, {} cores, {:.0} GiB, kernel {}; load {} before, {} after",
            m.cpu,
            m.cores,
            m.memory_gib,
            m.kernel,
            m.load_before,
            loadavg()
        );
        for t in scale::tables(&r) {
            println!("{}", t.text());
        }
        return scale_report::write(&args.out, &r, &desc);
    }
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let needs_stack = want("maru")
        || want("threads")
        || want("in_place")
        || want("connector")
        || want("meta")
        || want("idle")
        || want("mooncake");
    // First, before any thread starts (the namespace is entered by this thread only).
    let huge = match (needs_stack, args.pool_pages.as_str()) {
        (true, "2M") => match procs::HugeTmpfs::mount((pool_gib << 30) + 256 * MIB as u64) {
            Ok(h) => Ok(h),
            Err(e) => {
                eprintln!("maru-bench: no pool with 2 MiB pages ({e}); the pool lies in /dev/shm with 4 KiB pages");
                Err(e)
            }
        },
        _ => Err("--pool-pages 4K".to_string()),
    };
    let mut mach = machine();
    mach.pool_pages = match &huge {
        Ok(_) => "2 MiB pages (tmpfs huge=always, mounted for the run; a devdax device maps with 2 MiB pages)".into(),
        Err(why) => format!("4 KiB pages (/dev/shm tmpfs; {why})"),
    };
    let started = std::time::Instant::now();
    let mut r = Results::default();
    let say = |s: &str| eprintln!("[{:>5.0} s] {s}", started.elapsed().as_secs_f64());

    if want("limits") {
        for &c in &chunks {
            for threads in [1, 2] {
                say(&format!("memcpy {} x {threads} thread(s)", chunk_name(c)));
                // Each thread rotates over its own source and destination.
                let fig = limits::memcpy(c, threads, secs, rotate / 2);
                r.memcpy.push(MemcpyRow {
                    chunk: c,
                    threads,
                    fig,
                });
                for (what, kind, rows) in [
                    ("streaming copy", limits::CopyKind::Stream, &mut r.stream),
                    ("read", limits::CopyKind::Read, &mut r.read),
                ] {
                    say(&format!("{what} {} x {threads} thread(s)", chunk_name(c)));
                    let fig = limits::copy(kind, c, threads, secs, rotate / 2);
                    rows.push(MemcpyRow {
                        chunk: c,
                        threads,
                        fig,
                    });
                }
            }
            say(&format!("tcp loopback {}", chunk_name(c)));
            let gbs = limits::tcp_loopback(c, 1, secs, rotate / 2)?;
            r.tcp.push(TcpRow { chunk: c, gbs });
        }
    }
    if want("soft") {
        for &c in &chunks {
            say(&format!("raw soft transport {}", chunk_name(c)));
            let tcp = match r.tcp_of(c) {
                Some(t) => t,
                None => limits::tcp_loopback(c, 1, secs, rotate / 2)?,
            };
            let read_gbs = limits::soft(OpKind::Read, c, 1, secs, rotate / 2)?;
            let write_gbs = limits::soft(OpKind::Write, c, 1, secs, rotate / 2)?;
            r.soft.push(SoftRow {
                chunk: c,
                tcp_gbs: tcp,
                read_gbs,
                write_gbs,
            });
        }
    }
    let scratch = if needs_stack {
        let dir = huge.as_ref().ok().map(|h| h.dir.as_path());
        let s = procs::Scratch::with_pool("pool", pool_gib << 30, dir)?;
        if let (Ok(_), Some(h)) = (&huge, s.huge_bytes) {
            let share = h as f64 / s.pool_size.max(1) as f64;
            mach.pool_pages = format!(
                "{} ({:.1} % of it on 2 MiB pages)",
                mach.pool_pages,
                share * 100.0
            );
            if h < s.pool_size {
                eprintln!(
                    "maru-bench: only {:.1} % of the pool got 2 MiB pages (memory too fragmented); the rest has 4 KiB pages and stores into it are slower",
                    share * 100.0
                );
            }
        }
        Some(s)
    } else {
        None
    };
    if let (true, Some(s)) = (want("maru"), &scratch) {
        for &backend in &backends {
            for &chunk in &chunks {
                // One handler used by N threads beside N handlers of one thread each.
                for (handlers, threads) in [(1, 1), (2, 1), (1, 2), (MANY, 1), (1, MANY)] {
                    if !want_clients(handlers * threads) {
                        continue;
                    }
                    let cfg = Config {
                        backend,
                        chunk,
                        handlers,
                        threads,
                    };
                    say(&format!(
                        "maru {backend} {} x {handlers} handler(s) x {threads} thread(s)",
                        chunk_name(chunk)
                    ));
                    let sz = Sizes {
                        secs,
                        rotate: (rotate / cfg.clients()).max(chunk * BATCH * 2),
                        region: 256 * MIB,
                        payload: if args.null_copy {
                            maru_io::NULL_COPY_BYTES
                        } else {
                            chunk
                        },
                    };
                    let m = maru_io::run(s, cfg, &sz)?;
                    if args.null_copy {
                        r.maru_null.push(m);
                    } else {
                        r.maru.push(m);
                    }
                }
            }
        }
        let cxl = args.backends.is_empty() || args.backends.iter().any(|b| b == "cxl");
        if huge.is_ok() && cxl && !args.null_copy && chunks.contains(&(2 * MIB)) && want_clients(1)
        {
            say("maru cxl 2 MiB x 1 handler, pool of 4 KiB pages in /dev/shm");
            let small = procs::Scratch::with_pool("small-pages", 2 << 30, None)?;
            let cfg = Config {
                backend: "cxl",
                chunk: 2 * MIB,
                handlers: 1,
                threads: 1,
            };
            let sz = Sizes {
                secs,
                rotate,
                region: 256 * MIB,
                payload: 2 * MIB,
            };
            r.cxl_small_pages = Some(maru_io::run(&small, cfg, &sz)?);
        }
    }
    if let (true, Some(s)) = (want("threads"), &scratch) {
        for &backend in &backends {
            for (chunk, n) in chunk_clients(&[2, MANY]) {
                say(&format!(
                    "maru {backend} {}: 1 handler x {n} threads against {n} handlers, interleaved passes",
                    chunk_name(chunk)
                ));
                // Each side's store passes take about twice a figure's seconds
                // (the median of the pairs' ratios needs a good many).
                let min_passes = if quick { 4 } else { 10 };
                r.pairs.push(pairs::run(
                    s,
                    backend,
                    chunk,
                    n,
                    2.0 * secs,
                    min_passes,
                    rotate,
                )?);
            }
        }
    }
    if let (true, Some(s)) = (want("in_place"), &scratch) {
        say("maru cxl writes in place 2 MiB x 1 handler");
        r.in_place = Some(in_place::run(s, secs, rotate)?);
    }
    if let (true, Some(s)) = (want("connector"), &scratch) {
        say("vLLM connector's worker (Python) 2 MiB, cxl and remote_cxl");
        r.connector = connector::run(s, secs);
    }
    if want("redis") {
        let (redis_proc, addr) = procs::start_redis()?;
        for (chunk, clients) in chunk_clients(&[1, MANY]) {
            say(&format!(
                "redis {} x {clients} client(s)",
                chunk_name(chunk)
            ));
            r.redis
                .push(redis::bench(&addr, chunk, clients, secs, rotate)?);
        }
        drop(redis_proc);
    }
    if let (true, Some(s)) = (want("mooncake"), &scratch) {
        let cl: Vec<usize> = [1, MANY].into_iter().filter(|&n| want_clients(n)).collect();
        r.mooncake = Some(mooncake::run(s, &chunks, &cl, secs, rotate, &say));
    }
    if want("hitrate") {
        say("hit rate of a multi-turn chat trace through maru-server's eviction");
        if args.trace.is_empty() {
            say(hitrate::SKIPPED);
        }
        r.hitrate = Some(hitrate::run(quick, &args.trace)?);
    }
    if let (true, Some(s)) = (want("meta"), &scratch) {
        say("metadata ops");
        r.meta = meta::run(s, secs)?;
        say(&format!(
            "recovery of a durable directory of {} keys",
            meta::RECOVERY_KEYS
        ));
        r.meta_recovery = Some(meta::recovery(s, meta::RECOVERY_KEYS)?);
    }
    if let (true, Some(s)) = (want("idle"), &scratch) {
        for backend in ["remote_cxl", "cxl"] {
            say(&format!("idle CPU, {backend} handler open, {idle_secs} s"));
            let st = procs::stack(s, backend == "remote_cxl", "256M", "256K")?;
            let h = maru_io::CHandler::open(&maru_io::handler_config(
                &st.server,
                backend,
                "bench-idle",
                s,
            ))?;
            // Use the data path once, so that its connections and threads exist.
            let src = harness::Rotor::new(256 * 1024, 256 * 1024, 1);
            let key = std::ffi::CString::new("idle-key").map_err(|e| e.to_string())?;
            h.store_one(&key, src.base(), 256 * 1024)?;
            let mut dst = harness::Rotor::new(256 * 1024, 256 * 1024, 1);
            h.load_one(&key, dst.next_ptr(), 256 * 1024)?;
            // The first region's pages are faulted in in the background (cxl): once.
            h.settle_prefault()?;
            let mut procs_ = vec![
                ("maru-resource-manager".to_string(), st.rm.pid()),
                ("maru-server".to_string(), st.srv.pid()),
            ];
            if let Some(a) = &st.agent {
                procs_.push(("maru-remote-cxl-agent".to_string(), a.pid()));
            }
            let rows = idle::measure(
                &procs_,
                &format!("open {backend} handler (its threads)"),
                idle_secs,
            )?;
            for row in rows {
                // The daemons once per run: from the remote_cxl stack, which has all three.
                if backend == "remote_cxl" || row.what.starts_with("open") {
                    r.idle.push(row);
                }
            }
            drop(h);
            drop(st);
        }
    }
    drop(scratch);
    drop(huge);
    mach.load_after = loadavg();
    let elapsed = started.elapsed().as_secs_f64();

    let mut ts = tables(&r);
    ts.extend(r.in_place.as_ref().map(in_place::table));
    if !r.connector.is_empty() {
        ts.push(connector::table(&r.connector, &|b| {
            r.batch_load(b, connector::CHUNK)
        }));
    }
    ts.extend(r.hitrate.iter().flat_map(hitrate::tables));
    ts.extend(r.mooncake.as_ref().map(mooncake::table));
    let header = format!(
        "maru-bench{}: {} s per figure, {} MiB rotated per figure, pool {} GiB of {}; {} ({} cores, {:.1} GiB), kernel {}; load average {} before, {} after; {:.0} s in all\n",
        if quick { " --quick" } else { "" },
        secs,
        rotate / MIB,
        pool_gib,
        mach.pool_pages,
        mach.cpu,
        mach.cores,
        mach.memory_gib,
        mach.kernel,
        mach.load_before,
        mach.load_after,
        elapsed
    );
    let mut text = header.clone();
    let mut md = format!("{header}\n");
    for t in &ts {
        text.push('\n');
        text.push_str(&t.text());
        md.push('\n');
        md.push_str(&t.markdown());
    }
    print!("{text}");
    let write = |name: &str, body: &[u8]| -> Result<(), String> {
        let p = args.out.join(name);
        std::fs::write(&p, body).map_err(|e| format!("cannot write {}: {e}", p.display()))
    };
    write("latest.txt", text.as_bytes())?;
    write("latest.md", md.as_bytes())?;
    let doc = serde_json::json!({
        "benchmark": "maru-bench",
        "quick": quick,
        "seconds_per_figure": secs,
        "rotate_mib": rotate / MIB,
        "pool_gib": pool_gib,
        "elapsed_s": elapsed,
        "machine": mach,
        "results": r,
        "targets": targets(&r),
    });
    write(
        "latest.json",
        serde_json::to_string_pretty(&doc)
            .map_err(|e| e.to_string())?
            .as_bytes(),
    )?;
    if !r.maru.is_empty() || !r.redis.is_empty() || !r.memcpy.is_empty() || r.mooncake.is_some() {
        let png = args.out.join("latest.png");
        chart::draw(
            &png,
            "GB/s by system and chunk size (maru-bench, one run on loopback)",
            &chart_panels(&r),
        )?;
    }
    Ok(())
}
