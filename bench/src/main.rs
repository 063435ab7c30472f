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
mod maru_io;
mod meta;
mod mooncake;
mod pairs;
mod procs;
mod python_row;
mod redis;
mod report;
mod scale;
mod scale_agent;
mod scale_report;

use clap::Parser;
use harness::Fig;
use maru::transport::OpKind;
use maru_io::{Config, Sizes, BATCH, MIB};
use report::{chunk_name, f0, f2, us, Table};
use serde::Serialize;
use std::path::PathBuf;

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

#[derive(Debug, Clone, Serialize)]
struct Machine {
    cpu: String,
    cores: usize,
    memory_gib: f64,
    kernel: String,
    /// Page size and place of the fake-DAX pool.
    pool_pages: String,
    load_before: String,
    load_after: String,
}

fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mem_kib: f64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|x| x.parse().ok()))
        .unwrap_or(0.0);
    Machine {
        cpu,
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        memory_gib: mem_kib / 1024.0 / 1024.0,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        pool_pages: String::new(),
        load_before: loadavg(),
        load_after: String::new(),
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[derive(Debug, Clone, Serialize)]
struct MemcpyRow {
    chunk: usize,
    threads: usize,
    fig: Fig,
}

#[derive(Debug, Clone, Serialize)]
struct TcpRow {
    chunk: usize,
    gbs: f64,
}

#[derive(Debug, Clone, Serialize)]
struct SoftRow {
    chunk: usize,
    tcp_gbs: f64,
    read_gbs: f64,
    write_gbs: f64,
}

#[derive(Debug, Clone, Serialize)]
struct TargetRow {
    target: String,
    measured: String,
    met: Option<bool>,
}

#[derive(Debug, Default, Serialize)]
struct Results {
    memcpy: Vec<MemcpyRow>,
    /// Streaming-store copies (no read for ownership): the machine's copy bandwidth.
    stream: Vec<MemcpyRow>,
    /// Reads only: the machine's read bandwidth.
    read: Vec<MemcpyRow>,
    tcp: Vec<TcpRow>,
    soft: Vec<SoftRow>,
    maru: Vec<maru_io::Result_>,
    /// One handler used by N threads against N handlers, interleaved on one stack.
    pairs: Vec<pairs::PairResult>,
    /// cxl, 2 MiB chunks, 1 client, on a pool of 4 KiB pages (when the main pool has
    /// 2 MiB pages).
    cxl_small_pages: Option<maru_io::Result_>,
    redis: Vec<redis::RedisResult>,
    meta: Vec<meta::Row>,
    /// A durable directory of `meta::RECOVERY_KEYS` keys, stopped and started again.
    meta_recovery: Option<meta::Recovery>,
    idle: Vec<idle::IdleCpu>,
    /// cxl writes in place (part `in_place`).
    in_place: Option<in_place::InPlaceResult>,
    /// The vLLM connector's worker, both backends (part `connector`).
    connector: Vec<connector::ConnectorResult>,
    /// Hit rate of a multi-turn chat trace replayed through maru-server's eviction
    /// (part `hitrate`).
    hitrate: Option<hitrate::HitRateResult>,
    /// Maru beside Mooncake Store, taking turns (part `mooncake`).
    mooncake: Option<mooncake::MooncakeResult>,
}

const CHUNKS: [usize; 2] = [256 * 1024, 2 * MIB];
const MANY: usize = 4;

impl Results {
    fn memcpy_of(&self, chunk: usize, threads: usize) -> Option<&Fig> {
        self.memcpy
            .iter()
            .find(|r| r.chunk == chunk && r.threads == threads)
            .map(|r| &r.fig)
    }
    fn stream_of(&self, chunk: usize, threads: usize) -> Option<f64> {
        self.stream
            .iter()
            .find(|r| r.chunk == chunk && r.threads == threads)
            .map(|r| r.fig.gbs)
    }
    fn read_of(&self, chunk: usize, threads: usize) -> Option<f64> {
        self.read
            .iter()
            .find(|r| r.chunk == chunk && r.threads == threads)
            .map(|r| r.fig.gbs)
    }
    fn tcp_of(&self, chunk: usize) -> Option<f64> {
        self.tcp.iter().find(|r| r.chunk == chunk).map(|r| r.gbs)
    }
    /// The batch load of one client of `backend` at `chunk` (GB/s), for the rows judged
    /// by it.
    fn batch_load(&self, backend: &str, chunk: usize) -> Option<f64> {
        self.maru_of(backend, chunk, 1, 1).map(|m| m.load_batch.gbs)
    }

    fn maru_of(
        &self,
        backend: &str,
        chunk: usize,
        handlers: usize,
        threads: usize,
    ) -> Option<&maru_io::Result_> {
        self.maru.iter().find(|r| {
            r.config.backend == backend
                && r.config.chunk == chunk
                && r.config.handlers == handlers
                && r.config.threads == threads
        })
    }
    fn redis_of(&self, chunk: usize, clients: usize) -> Option<&redis::RedisResult> {
        self.redis
            .iter()
            .find(|r| r.chunk == chunk && r.clients == clients)
    }
    fn pair_of(&self, backend: &str, chunk: usize, n: usize) -> Option<&pairs::PairResult> {
        self.pairs
            .iter()
            .find(|p| p.backend == backend && p.chunk == chunk && p.n == n)
    }
    fn meta_of(&self, op: &str, conns: usize) -> Option<&meta::Row> {
        self.meta.iter().find(|r| r.op == op && r.conns == conns)
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn opt(x: Option<f64>) -> String {
    x.map(f2).unwrap_or_else(|| "-".into())
}

fn tables(r: &Results) -> Vec<Table> {
    let mut out = Vec::new();
    // 1. Store/load by system.
    let mut t = Table::new(
        "Store and load, GB/s and latency per operation (batch = 32 chunks; µs)",
        &[
            "system",
            "op",
            "chunk",
            "clients",
            "batch GB/s",
            "p50",
            "p99",
            "single GB/s",
            "p50",
            "p99",
        ],
    );
    let fig_cells = |f: &Fig| vec![f2(f.gbs), us(f.p50_us), us(f.p99_us)];
    for &chunk in &CHUNKS {
        for backend in ["cxl", "remote_cxl"] {
            let name = if backend == "cxl" {
                "maru cxl"
            } else {
                "maru remote_cxl/soft"
            };
            for (op, pick) in [("store", 0), ("load", 1)] {
                for clients in [1, MANY] {
                    if let Some(m) = r.maru_of(backend, chunk, clients, 1) {
                        let (b, s) = if pick == 0 {
                            (&m.store_batch, &m.store_single)
                        } else {
                            (&m.load_batch, &m.load_single)
                        };
                        let mut row = vec![
                            name.into(),
                            op.into(),
                            chunk_name(chunk),
                            clients.to_string(),
                        ];
                        row.extend(fig_cells(b));
                        row.extend(fig_cells(s));
                        t.row(row);
                    }
                }
            }
            if let (true, "cxl", Some(m)) = (chunk == 2 * MIB, backend, &r.cxl_small_pages) {
                for (op, b, s) in [
                    ("store", &m.store_batch, &m.store_single),
                    ("load", &m.load_batch, &m.load_single),
                ] {
                    let mut row = vec![
                        "maru cxl, 4 KiB pool pages".into(),
                        op.into(),
                        chunk_name(chunk),
                        "1".into(),
                    ];
                    row.extend(fig_cells(b));
                    row.extend(fig_cells(s));
                    t.row(row);
                }
            }
            // Batch-only figures: stores into reused pages, loads into staging slots.
            for clients in [1, MANY] {
                let Some(m) = r.maru_of(backend, chunk, clients, 1) else {
                    continue;
                };
                let extra = [
                    ("store, reused pages", Some(&m.store_reused)),
                    ("store into a full cache", Some(&m.store_full)),
                    ("load into slots", m.load_slots.as_ref()),
                ];
                for (op, fig) in extra {
                    let Some(f) = fig else { continue };
                    let mut row = vec![
                        name.into(),
                        op.into(),
                        chunk_name(chunk),
                        clients.to_string(),
                    ];
                    row.extend(fig_cells(f));
                    row.extend(["-".into(), "-".into(), "-".into()]);
                    t.row(row);
                }
            }
        }
        for (op, set) in [("SET", true), ("GET", false)] {
            for clients in [1, MANY] {
                if let Some(x) = r.redis_of(chunk, clients) {
                    let (b, s) = if set {
                        (&x.set_batch, &x.set_single)
                    } else {
                        (&x.get_batch, &x.get_single)
                    };
                    let mut row = vec![
                        "redis".into(),
                        op.into(),
                        chunk_name(chunk),
                        clients.to_string(),
                    ];
                    row.extend(fig_cells(b));
                    row.extend(fig_cells(s));
                    t.row(row);
                }
            }
        }
        for threads in [1, 2] {
            for (name, op, rows) in [
                ("memcpy (limit)", "copy", &r.memcpy),
                ("streaming copy (limit)", "copy, nt stores", &r.stream),
                ("read (limit)", "read", &r.read),
            ] {
                if let Some(x) = rows
                    .iter()
                    .find(|x| x.chunk == chunk && x.threads == threads)
                {
                    let mut row = vec![
                        name.into(),
                        op.into(),
                        chunk_name(chunk),
                        format!("{threads} thr"),
                    ];
                    row.extend(["-".into(), "-".into(), "-".into()]);
                    row.extend(fig_cells(&x.fig));
                    t.row(row);
                }
            }
        }
        if let Some(g) = r.tcp_of(chunk) {
            let mut row = vec![
                "tcp loopback (limit)".into(),
                "stream".into(),
                chunk_name(chunk),
                "1".into(),
            ];
            row.extend([
                "-".into(),
                "-".into(),
                "-".into(),
                f2(g),
                "-".into(),
                "-".into(),
            ]);
            t.row(row);
        }
    }
    out.push(t);

    // 2. Ratios.
    let mut t = Table::new(
        "Ratios (same run; Maru batch figures; Redis: the faster of pipelined and single)",
        &["ratio", "256 KiB", "2 MiB"],
    );
    let per_chunk =
        |f: &dyn Fn(usize) -> Option<f64>| CHUNKS.iter().map(|&c| opt(f(c))).collect::<Vec<_>>();
    let mut add = |name: &str, f: &dyn Fn(usize) -> Option<f64>| {
        let mut row = vec![name.to_string()];
        row.extend(per_chunk(f));
        t.row(row);
    };
    let mb = |b: &str, c: usize, n: usize, load: bool| {
        r.maru_of(b, c, n, 1).map(|m| {
            if load {
                m.load_batch.gbs
            } else {
                m.store_batch.gbs
            }
        })
    };
    // Redis at its best for the payload: pipelined or single, whichever was faster
    // (large pipelined GETs queue whole replies in Redis and are often slower).
    let rg = |c: usize, n: usize, get: bool| {
        r.redis_of(c, n).map(|x| {
            if get {
                x.get_batch.gbs.max(x.get_single.gbs)
            } else {
                x.set_batch.gbs.max(x.set_single.gbs)
            }
        })
    };
    add("cxl store / memcpy (1 client, 1 thread)", &|c| {
        ratio(mb("cxl", c, 1, false), r.memcpy_of(c, 1).map(|f| f.gbs))
    });
    if r.cxl_small_pages.is_some() {
        add(
            "cxl store / memcpy, pool of 4 KiB pages (1 client, 1 thread)",
            &|c| {
                let m = r.cxl_small_pages.as_ref().filter(|m| m.config.chunk == c);
                ratio(
                    m.map(|m| m.store_batch.gbs),
                    r.memcpy_of(c, 1).map(|f| f.gbs),
                )
            },
        );
    }
    add(
        "cxl store into reused pages / memcpy (1 client, 1 thread)",
        &|c| {
            ratio(
                r.maru_of("cxl", c, 1, 1).map(|m| m.store_reused.gbs),
                r.memcpy_of(c, 1).map(|f| f.gbs),
            )
        },
    );
    for (backend, clients) in [
        ("cxl", 1),
        ("cxl", MANY),
        ("remote_cxl", 1),
        ("remote_cxl", MANY),
    ] {
        add(
            &format!("{backend} store into a full cache / into reused pages ({clients} clients; median of 8 turns)"),
            &move |c| {
                r.maru_of(backend, c, clients, 1)
                    .map(maru_io::Result_::full_vs_reused_median)
            },
        );
    }
    add("cxl load / memcpy (1 client, 1 thread)", &|c| {
        ratio(mb("cxl", c, 1, true), r.memcpy_of(c, 1).map(|f| f.gbs))
    });
    add("cxl store / streaming copy (1 client, 1 thread)", &|c| {
        ratio(mb("cxl", c, 1, false), r.stream_of(c, 1))
    });
    add("cxl load / streaming copy (1 client, 1 thread)", &|c| {
        ratio(mb("cxl", c, 1, true), r.stream_of(c, 1))
    });
    add("cxl load / read bandwidth (1 client, 1 thread)", &|c| {
        ratio(mb("cxl", c, 1, true), r.read_of(c, 1))
    });
    add(
        "cxl store / streaming copy (4 clients; 2 threads' limit, 2 cores)",
        &|c| ratio(mb("cxl", c, MANY, false), r.stream_of(c, 2)),
    );
    add(
        "cxl load / streaming copy (4 clients; 2 threads' limit, 2 cores)",
        &|c| ratio(mb("cxl", c, MANY, true), r.stream_of(c, 2)),
    );
    add("soft load / tcp (remote_cxl, 1 client)", &|c| {
        ratio(mb("remote_cxl", c, 1, true), r.tcp_of(c))
    });
    add("soft store / tcp (remote_cxl, 1 client)", &|c| {
        ratio(mb("remote_cxl", c, 1, false), r.tcp_of(c))
    });
    add("remote_cxl load / Redis GET (4 clients)", &|c| {
        ratio(mb("remote_cxl", c, MANY, true), rg(c, MANY, true))
    });
    let slot_load = |b: &str, c: usize, n: usize| {
        r.maru_of(b, c, n, 1)
            .and_then(|m| m.load_slots.as_ref())
            .map(|f| f.gbs)
    };
    add("remote_cxl load into slots / Redis GET (4 clients)", &|c| {
        ratio(slot_load("remote_cxl", c, MANY), rg(c, MANY, true))
    });
    add("remote_cxl load into slots / Redis GET (1 client)", &|c| {
        ratio(slot_load("remote_cxl", c, 1), rg(c, 1, true))
    });
    add("remote_cxl store / Redis SET (4 clients)", &|c| {
        ratio(mb("remote_cxl", c, MANY, false), rg(c, MANY, false))
    });
    add("remote_cxl load / Redis GET (1 client)", &|c| {
        ratio(mb("remote_cxl", c, 1, true), rg(c, 1, true))
    });
    add("cxl load / Redis GET (4 clients)", &|c| {
        ratio(mb("cxl", c, MANY, true), rg(c, MANY, true))
    });
    add("cxl store / Redis SET (4 clients)", &|c| {
        ratio(mb("cxl", c, MANY, false), rg(c, MANY, false))
    });
    for (name, f) in mooncake::ratio_rows(r.mooncake.as_ref()) {
        add(&name, &*f);
    }
    add("raw soft READ / tcp (transport only)", &|c| {
        r.soft
            .iter()
            .find(|s| s.chunk == c)
            .and_then(|s| ratio(Some(s.read_gbs), Some(s.tcp_gbs)))
    });
    out.push(t);

    // 3. The C ABI table: one handler used by N threads beside N handlers of one
    // thread each (issue 23), against the limits of the backend.
    let mut t = Table::new(
        "C ABI (maru_store_batch / maru_load_batch, batches of 32): one handler used by N threads beside N handlers of one thread",
        &["backend", "chunk", "handlers x threads", "store GB/s", "load GB/s", "limit", "limit GB/s", "store/limit", "load/limit"],
    );
    for backend in ["remote_cxl", "cxl"] {
        for &chunk in &CHUNKS {
            for (handlers, threads) in [(1, 1), (2, 1), (1, 2), (MANY, 1), (1, MANY)] {
                let Some(m) = r.maru_of(backend, chunk, handlers, threads) else {
                    continue;
                };
                let n = handlers * threads;
                let (lname, lim) = if backend == "cxl" {
                    // The machine has 2 cores: more threads do not raise the limit.
                    let lt = n.min(2);
                    (format!("streaming copy {lt} thr"), r.stream_of(chunk, lt))
                } else {
                    ("tcp 1 stream".to_string(), r.tcp_of(chunk))
                };
                t.row(vec![
                    backend.into(),
                    chunk_name(chunk),
                    format!("{handlers} x {threads}"),
                    f2(m.store_batch.gbs),
                    f2(m.load_batch.gbs),
                    lname,
                    opt(lim),
                    opt(ratio(Some(m.store_batch.gbs), lim)),
                    opt(ratio(Some(m.load_batch.gbs), lim)),
                ]);
            }
        }
    }
    out.push(t);

    // 4. The same comparison on one stack, the two sides taking turns (issue 23's
    // targets read these).
    if !r.pairs.is_empty() {
        let mut t = Table::new(
            "One handler used by N threads against N handlers of one thread, on one stack in interleaved passes (batches of 32; ratio: median of the pairs of passes)",
            &["backend", "chunk", "N", "passes x MiB per side", "store 1 x N GB/s", "store N x 1 GB/s", "store ratio", "store ratios min-max", "load 1 x N GB/s", "load N x 1 GB/s", "load ratio", "load ratios min-max"],
        );
        let range = |c: &pairs::Compared| match (c.pass_ratios.first(), c.pass_ratios.last()) {
            (Some(lo), Some(hi)) => format!("{lo:.2}-{hi:.2}"),
            _ => "-".into(),
        };
        for p in &r.pairs {
            t.row(vec![
                p.backend.into(),
                chunk_name(p.chunk),
                p.n.to_string(),
                format!("{} x {}", p.passes, p.pass_bytes / MIB),
                f2(p.store.shared_gbs),
                f2(p.store.apart_gbs),
                f2(p.store.median()),
                range(&p.store),
                f2(p.load.shared_gbs),
                f2(p.load.apart_gbs),
                f2(p.load.median()),
                range(&p.load),
            ]);
        }
        out.push(t);
    }

    if !r.soft.is_empty() {
        let mut t = Table::new(
            "Raw soft transport (no worker), 1 stream, batches of 32, GB/s",
            &[
                "chunk",
                "tcp",
                "soft READ",
                "soft WRITE",
                "read/tcp",
                "write/tcp",
            ],
        );
        for s in &r.soft {
            t.row(vec![
                chunk_name(s.chunk),
                f2(s.tcp_gbs),
                f2(s.read_gbs),
                f2(s.write_gbs),
                f2(s.read_gbs / s.tcp_gbs),
                f2(s.write_gbs / s.tcp_gbs),
            ]);
        }
        out.push(t);
    }
    if !r.meta.is_empty() {
        let mut t = Table::new(
            "Metadata (maru-server on loopback; one request = one op; µs)",
            &["op", "conns", "ops/s", "p50", "p99"],
        );
        for m in &r.meta {
            t.row(vec![
                m.op.into(),
                m.conns.to_string(),
                f0(m.ops_per_s),
                us(m.p50_us),
                us(m.p99_us),
            ]);
        }
        out.push(t);
        if let Some(rec) = &r.meta_recovery {
            let mut t = Table::new(
                "Recovery of a durable directory (maru-server stopped, started again on it)",
                &[
                    "keys",
                    "fill s",
                    "directory MiB",
                    "start on it, ms",
                    "start on empty, ms",
                    "sampled keys found",
                ],
            );
            t.row(vec![
                rec.keys.to_string(),
                f2(rec.fill_s),
                f0(rec.dir_mib),
                f0(rec.start_ms),
                f0(rec.empty_start_ms),
                format!("{} of {}", rec.found, rec.sampled),
            ]);
            out.push(t);
        }
        if let Some(rtt) = r.meta_of(meta::RTT_SPIN, 1).or(r.meta_of(meta::RTT, 1)) {
            let mut t = Table::new(
                &format!(
                    "Metadata beside the TCP ping-pong ({}; 1 connection, p50, µs)",
                    rtt.op
                ),
                &[
                    "op",
                    "p50",
                    "tcp ping-pong p50",
                    "op / ping-pong",
                    "op - ping-pong",
                ],
            );
            // One request, one reply each (the other ops are two requests).
            for op in ["exists x1", "exists x32"] {
                if let Some(m) = r.meta_of(op, 1) {
                    t.row(vec![
                        op.into(),
                        us(m.p50_us),
                        us(rtt.p50_us),
                        f2(m.p50_us / rtt.p50_us),
                        us(m.p50_us - rtt.p50_us),
                    ]);
                }
            }
            out.push(t);
        }
    }
    if !r.idle.is_empty() {
        let mut t = Table::new(
            "Idle CPU (percent of one core)",
            &["process", "threads", "idle CPU %"],
        );
        for i in &r.idle {
            t.row(vec![
                i.what.clone(),
                i.threads.to_string(),
                format!("{:.2}", i.pct_of_core),
            ]);
        }
        out.push(t);
    }
    let mut t = Table::new(
        "Targets (issues 8, 23 and 35)",
        &["target", "measured", "met"],
    );
    for x in targets(r) {
        t.row(vec![
            x.target,
            x.measured,
            match x.met {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => "not measured".into(),
            },
        ]);
    }
    out.push(t);
    out
}

fn targets(r: &Results) -> Vec<TargetRow> {
    let mut v = Vec::new();
    let mut push =
        |target: &str, x: Option<f64>, fmt: &dyn Fn(f64) -> String, ok: &dyn Fn(f64) -> bool| {
            v.push(TargetRow {
                target: target.into(),
                measured: x.map(fmt).unwrap_or_else(|| "-".into()),
                met: x.map(ok),
            });
        };
    let two = 2 * MIB;
    let mc = r.memcpy_of(two, 1).map(|f| f.gbs);
    let x = |f: f64| format!("{f:.2} x");
    push(
        "cxl batch store 32 x 2 MiB >= 0.9 x memcpy (1 thread)",
        ratio(r.maru_of("cxl", two, 1, 1).map(|m| m.store_batch.gbs), mc),
        &x,
        &|f| f >= 0.9,
    );
    if let Some(m) = &r.cxl_small_pages {
        push(
            "for reference, not a device's page size: the same on a pool of 4 KiB tmpfs pages",
            ratio(Some(m.store_batch.gbs), mc),
            &x,
            &|f| f >= 0.9,
        );
    }
    push(
        "cxl batch store 32 x 2 MiB into reused pages (a full cache) >= 0.9 x memcpy",
        ratio(r.maru_of("cxl", two, 1, 1).map(|m| m.store_reused.gbs), mc),
        &x,
        &|f| f >= 0.9,
    );
    for (backend, clients) in [
        ("cxl", 1),
        ("cxl", MANY),
        ("remote_cxl", 1),
        ("remote_cxl", MANY),
    ] {
        for c in [two, 256 * 1024] {
            let m = r.maru_of(backend, c, clients, 1);
            push(
                &format!(
                    "{backend} store into a full cache, {} x {clients} clients >= 0.8 x into reused pages (median of turns)",
                    chunk_name(c)
                ),
                m.map(maru_io::Result_::full_vs_reused_median),
                &x,
                &|f| f >= 0.8,
            );
        }
    }
    // Issue 35: the adapters' way through Python (numpy fill), and one alloc.
    let adapter = r.in_place.as_ref().and_then(|i| i.adapter.as_ref().ok());
    push(
        "cxl batched_alloc + numpy fill + batch_store 32 x 2 MiB (Python, maru.MaruHandler) >= 0.9 x its numpy copy",
        adapter.map(|a| a.ratio()),
        &x,
        &|f| f >= 0.9,
    );
    push(
        "one maru.MaruHandler.alloc (cxl) <= 10 us p50",
        adapter.map(|a| a.alloc.p50_us),
        &|f| format!("{f:.1} us"),
        &|f| f <= 10.0,
    );
    // Issue 38: the vLLM connector's loads into a paged KV cache, beside the raw batch
    // load of the same run, chunk size and backend.
    for c in &r.connector {
        push(
            &format!(
                "vLLM connector load into a paged KV cache, {} 32 x 2 MiB (Python) >= 0.5 x {} batch load 2 MiB",
                c.backend, c.backend
            ),
            ratio(
                c.row.as_ref().ok().map(|row| row.load.gbs),
                r.batch_load(c.backend, connector::CHUNK),
            ),
            &x,
            &|f| f >= 0.5,
        );
    }
    push(
        "cxl batch load 32 x 2 MiB >= 0.9 x memcpy (1 thread)",
        ratio(r.maru_of("cxl", two, 1, 1).map(|m| m.load_batch.gbs), mc),
        &x,
        &|f| f >= 0.9,
    );
    // One handler used by N threads against N handlers of one thread (issue 23): the
    // median of the pairs of interleaved passes on one stack.
    for backend in ["cxl", "remote_cxl"] {
        for c in [256 * 1024, two] {
            for n in [2, MANY] {
                for load in [false, true] {
                    push(
                        &format!(
                            "{backend} {} {}: 1 handler x {n} threads >= 0.9 x {n} handlers x 1 thread (interleaved passes)",
                            chunk_name(c),
                            if load { "load" } else { "store" },
                        ),
                        r.pair_of(backend, c, n).map(|p| {
                            if load {
                                p.load.median()
                            } else {
                                p.store.median()
                            }
                        }),
                        &x,
                        &|f| f >= 0.9,
                    );
                }
            }
        }
    }
    push(
        "cxl single 256 KiB store >= 2 GB/s",
        r.maru_of("cxl", 256 * 1024, 1, 1)
            .map(|m| m.store_single.gbs),
        &|f| format!("{f:.2} GB/s"),
        &|f| f >= 2.0,
    );
    push(
        "remote_cxl/soft load 2 MiB >= 0.8 x tcp loopback",
        ratio(
            r.maru_of("remote_cxl", two, 1, 1).map(|m| m.load_batch.gbs),
            r.tcp_of(two),
        ),
        &x,
        &|f| f >= 0.8,
    );
    push(
        "remote_cxl/soft load 2 MiB, 4 clients >= 1.25 x Redis GET (its best)",
        ratio(
            r.maru_of("remote_cxl", two, MANY, 1)
                .map(|m| m.load_batch.gbs),
            r.redis_of(two, MANY)
                .map(|x| x.get_batch.gbs.max(x.get_single.gbs)),
        ),
        &x,
        &|f| f >= 1.25,
    );
    push(
        "remote_cxl/soft load into staging slots 2 MiB, 4 clients >= 1.25 x Redis GET (its best)",
        ratio(
            r.maru_of("remote_cxl", two, MANY, 1)
                .and_then(|m| m.load_slots.as_ref())
                .map(|f| f.gbs),
            r.redis_of(two, MANY)
                .map(|x| x.get_batch.gbs.max(x.get_single.gbs)),
        ),
        &x,
        &|f| f >= 1.25,
    );
    let e = r.meta_of("exists x32", 1);
    push(
        "exists x32 p50 <= 50 us",
        e.map(|m| m.p50_us),
        &|f| format!("{f:.1} us"),
        &|f| f <= 50.0,
    );
    push(
        "exists x32 p99 <= 200 us",
        e.map(|m| m.p99_us),
        &|f| format!("{f:.1} us"),
        &|f| f <= 200.0,
    );
    for op in ["exists x1", meta::PUBLISH] {
        push(
            &format!("{op}, 8 conns >= 30000 ops/s"),
            r.meta_of(op, 8).map(|m| m.ops_per_s),
            &|f| format!("{f:.0} ops/s"),
            &|f| f >= 30000.0,
        );
    }
    for conns in [1, 8] {
        push(
            &format!("alloc+publish durable >= 0.8 x in-memory ({conns} conns, interleaved)"),
            ratio(
                r.meta_of(meta::PUBLISH_DURABLE, conns).map(|m| m.ops_per_s),
                r.meta_of(meta::PUBLISH, conns).map(|m| m.ops_per_s),
            ),
            &x,
            &|f| f >= 0.8,
        );
    }
    if let Some(rec) = &r.meta_recovery {
        push(
            &format!(
                "a durable directory of {} keys recovers whole (start until serving reported)",
                rec.keys
            ),
            Some(rec.start_ms),
            &|f| {
                format!(
                    "{f:.0} ms; {} of {} sampled keys found",
                    rec.found, rec.sampled
                )
            },
            &|_| rec.found == rec.sampled,
        );
    }
    for (name, got, least) in mooncake::targets(r.mooncake.as_ref()) {
        push(&name, got, &x, &|f| f >= least);
    }
    for i in &r.idle {
        push(
            &format!("idle CPU of {} < 1% of a core", i.what),
            Some(i.pct_of_core),
            &|f| format!("{f:.2} %"),
            &|f| f < 1.0,
        );
    }
    v
}

fn chart_panels(r: &Results) -> Vec<chart::Panel> {
    CHUNKS
        .iter()
        .map(|&c| {
            let mut bars = Vec::new();
            if let Some(a) = r.memcpy_of(c, 1) {
                bars.push(chart::Bars {
                    system: "memcpy (limit)".into(),
                    one: a.gbs,
                    many: r.memcpy_of(c, 2).map(|f| f.gbs),
                });
            }
            if let Some(g) = r.tcp_of(c) {
                bars.push(chart::Bars {
                    system: "tcp loopback (limit)".into(),
                    one: g,
                    many: None,
                });
            }
            for (b, name) in [("cxl", "cxl"), ("remote_cxl", "remote_cxl/soft")] {
                for load in [false, true] {
                    if let Some(m) = r.maru_of(b, c, 1, 1) {
                        let pick = |m: &maru_io::Result_| {
                            if load {
                                m.load_batch.gbs
                            } else {
                                m.store_batch.gbs
                            }
                        };
                        bars.push(chart::Bars {
                            system: format!("maru {name} {}", if load { "load" } else { "store" }),
                            one: pick(m),
                            many: r.maru_of(b, c, MANY, 1).map(pick),
                        });
                    }
                }
            }
            for (get, single) in [(false, false), (false, true), (true, false), (true, true)] {
                if let Some(x) = r.redis_of(c, 1) {
                    let pick = |x: &redis::RedisResult| match (get, single) {
                        (false, false) => x.set_batch.gbs,
                        (false, true) => x.set_single.gbs,
                        (true, false) => x.get_batch.gbs,
                        (true, true) => x.get_single.gbs,
                    };
                    bars.push(chart::Bars {
                        system: format!(
                            "redis {} ({})",
                            if get { "GET" } else { "SET" },
                            if single { "single" } else { "pipelined 32" }
                        ),
                        one: pick(x),
                        many: r.redis_of(c, MANY).map(pick),
                    });
                }
            }
            bars.extend(mooncake::bars(r.mooncake.as_ref(), c, r.maru.is_empty()));
            // Top to bottom in the order above.
            bars.reverse();
            chart::Panel {
                title: format!("{} chunks (Maru: batches of 32)", chunk_name(c)),
                bars,
            }
        })
        .collect()
}

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
    for o in &args.only {
        if ![
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
        ]
        .contains(&o.as_str())
        {
            return Err(format!(
                "unknown part {o}: use limits, soft, maru, threads, in_place, connector, redis, meta, idle, hitrate, mooncake, scale"
            ));
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
                say(&format!(
                    "streaming copy {} x {threads} thread(s)",
                    chunk_name(c)
                ));
                let fig = limits::copy(limits::CopyKind::Stream, c, threads, secs, rotate / 2);
                r.stream.push(MemcpyRow {
                    chunk: c,
                    threads,
                    fig,
                });
                say(&format!("read {} x {threads} thread(s)", chunk_name(c)));
                let fig = limits::copy(limits::CopyKind::Read, c, threads, secs, rotate / 2);
                r.read.push(MemcpyRow {
                    chunk: c,
                    threads,
                    fig,
                });
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
        for backend in ["cxl", "remote_cxl"] {
            if !args.backends.is_empty() && !args.backends.iter().any(|b| b == backend) {
                continue;
            }
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
                    };
                    r.maru.push(maru_io::run(s, cfg, &sz)?);
                }
            }
        }
        let cxl = args.backends.is_empty() || args.backends.iter().any(|b| b == "cxl");
        if huge.is_ok() && cxl && chunks.contains(&(2 * MIB)) && want_clients(1) {
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
            };
            r.cxl_small_pages = Some(maru_io::run(&small, cfg, &sz)?);
        }
    }
    if let (true, Some(s)) = (want("threads"), &scratch) {
        for backend in ["cxl", "remote_cxl"] {
            if !args.backends.is_empty() && !args.backends.iter().any(|b| b == backend) {
                continue;
            }
            for &chunk in &chunks {
                for n in [2, MANY] {
                    if !want_clients(n) {
                        continue;
                    }
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
        for &chunk in &chunks {
            for clients in [1, MANY] {
                if !want_clients(clients) {
                    continue;
                }
                say(&format!(
                    "redis {} x {clients} client(s)",
                    chunk_name(chunk)
                ));
                r.redis
                    .push(redis::bench(&addr, chunk, clients, secs, rotate)?);
            }
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
