//! The report of a `maru-bench` run: its tables, its targets (met or not) and its
//! chart's panels, all read from [`Results`].

use crate::harness::Fig;
use crate::maru_io::{self, BATCH, MIB};
use crate::report::{chunk_name, f0, f2, us, Table};
use crate::results::*;
use crate::{chart, connector, meta, mooncake, pairs, redis};

/// A row of the store/load table: system, op, chunk and clients, then the batch and
/// the single figure (GB/s, p50, p99; "-" where there is none).
fn fig_row(
    system: &str,
    op: &str,
    chunk: usize,
    clients: String,
    batch: Option<&Fig>,
    single: Option<&Fig>,
) -> Vec<String> {
    let mut row = vec![system.into(), op.into(), chunk_name(chunk), clients];
    for f in [batch, single] {
        row.extend(match f {
            Some(f) => [f2(f.gbs), us(f.p50_us), us(f.p99_us)],
            None => ["-".into(), "-".into(), "-".into()],
        });
    }
    row
}

pub(crate) fn tables(r: &Results) -> Vec<Table> {
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
                        t.row(fig_row(
                            name,
                            op,
                            chunk,
                            clients.to_string(),
                            Some(b),
                            Some(s),
                        ));
                    }
                }
            }
            if let (true, "cxl", Some(m)) = (chunk == 2 * MIB, backend, &r.cxl_small_pages) {
                for (op, b, s) in [
                    ("store", &m.store_batch, &m.store_single),
                    ("load", &m.load_batch, &m.load_single),
                ] {
                    let system = "maru cxl, 4 KiB pool pages";
                    t.row(fig_row(system, op, chunk, "1".into(), Some(b), Some(s)));
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
                    t.row(fig_row(name, op, chunk, clients.to_string(), Some(f), None));
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
                    t.row(fig_row(
                        "redis",
                        op,
                        chunk,
                        clients.to_string(),
                        Some(b),
                        Some(s),
                    ));
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
                    let threads = format!("{threads} thr");
                    t.row(fig_row(name, op, chunk, threads, None, Some(&x.fig)));
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
    if let Some(t) = outside_copy(r) {
        out.push(t);
    }
    let mut t = Table::new(
        "Targets (issues 8, 23, 35 and 47)",
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

/// The time of a call outside its copy (issue 47): for the copying rows, the mean
/// time of a call less what its bytes take at the limit's rate (the streaming copy
/// for cxl, shared by the clients of a figure; the TCP stream for remote_cxl), per
/// chunk; for the null-copy rows (`--null-copy`, 64 bytes per chunk), the mean time
/// of a call per chunk.
fn outside_copy(r: &Results) -> Option<Table> {
    if r.maru.is_empty() && r.maru_null.is_empty() {
        return None;
    }
    let mut t = Table::new(
        "Time outside the copy: mean µs per call, and per chunk (copying rows: the call less its bytes at the limit's rate; null-copy rows: 64 bytes per chunk into pages of the chunk size)",
        &[
            "backend",
            "chunk",
            "handlers x threads",
            "copy",
            "op",
            "call µs",
            "copy µs",
            "outside per chunk µs",
        ],
    );
    for (null, rows) in [(false, &r.maru), (true, &r.maru_null)] {
        for m in rows.iter() {
            let c = m.config;
            let n = c.clients();
            // Bytes per second one client's copy gets at the limit.
            let limit = if c.backend == "cxl" {
                r.stream_of(c.chunk, n.min(2)).map(|g| g * 1e9 / n as f64)
            } else {
                r.tcp_of(c.chunk).map(|g| g * 1e9 / n as f64)
            };
            for (op, fig, chunks) in [
                ("store batch", &m.store_batch, BATCH),
                ("load batch", &m.load_batch, BATCH),
                ("store single", &m.store_single, 1),
                ("load single", &m.load_single, 1),
            ] {
                if fig.ops_per_s <= 0.0 {
                    continue;
                }
                let call_us = n as f64 / fig.ops_per_s * 1e6;
                let copy_us = if null {
                    Some(0.0)
                } else {
                    limit.map(|l| (chunks * c.chunk) as f64 / l * 1e6)
                };
                t.row(vec![
                    c.backend.into(),
                    chunk_name(c.chunk),
                    format!("{} x {}", c.handlers, c.threads),
                    if null { "null (64 B)" } else { "copying" }.into(),
                    op.into(),
                    f0(call_us),
                    copy_us.map(f0).unwrap_or_else(|| "-".into()),
                    copy_us
                        .map(|cu| f2((call_us - cu) / chunks as f64))
                        .unwrap_or_else(|| "-".into()),
                ]);
            }
        }
    }
    Some(t)
}

/// The targets' rows as they are checked.
struct Targets(Vec<TargetRow>);

impl Targets {
    /// `target` measured as `x` (None: not measured), shown with `fmt`, met when `ok`.
    fn push(
        &mut self,
        target: &str,
        x: Option<f64>,
        fmt: &dyn Fn(f64) -> String,
        ok: &dyn Fn(f64) -> bool,
    ) {
        self.0.push(TargetRow {
            target: target.into(),
            measured: x.map(fmt).unwrap_or_else(|| "-".into()),
            met: x.map(ok),
        });
    }

    /// A ratio target: `x` times, met at `least` or more.
    fn at_least(&mut self, target: &str, x: Option<f64>, least: f64) {
        self.push(target, x, &|f| format!("{f:.2} x"), &|f| f >= least);
    }
}

/// GB/s of a batch load (`load`) or a batch store of `m`.
fn batch_gbs(m: &maru_io::Result_, load: bool) -> f64 {
    if load {
        m.load_batch.gbs
    } else {
        m.store_batch.gbs
    }
}

pub(crate) fn targets(r: &Results) -> Vec<TargetRow> {
    let mut t = Targets(Vec::new());
    let two = 2 * MIB;
    // The cxl targets compare with the streaming copy, the copy cxl makes (memcpy
    // stays a reference row of the tables).
    let sc = r.stream_of(two, 1);
    if let Some(m) = &r.cxl_small_pages {
        t.at_least(
            "for reference, not a device's page size: cxl batch store 32 x 2 MiB on a pool of 4 KiB tmpfs pages >= 0.9 x streaming copy",
            ratio(Some(m.store_batch.gbs), sc),
            0.9,
        );
    }
    t.at_least(
        "cxl batch store 32 x 2 MiB into reused pages (a full cache) >= 0.9 x streaming copy",
        ratio(r.maru_of("cxl", two, 1, 1).map(|m| m.store_reused.gbs), sc),
        0.9,
    );
    for (backend, clients) in [
        ("cxl", 1),
        ("cxl", MANY),
        ("remote_cxl", 1),
        ("remote_cxl", MANY),
    ] {
        for c in [two, 256 * 1024] {
            let m = r.maru_of(backend, c, clients, 1);
            t.at_least(
                &format!(
                    "{backend} store into a full cache, {} x {clients} clients >= 0.8 x into reused pages (median of turns)",
                    chunk_name(c)
                ),
                m.map(maru_io::Result_::full_vs_reused_median),
                0.8,
            );
        }
    }
    // Issue 35: the adapters' way through Python (numpy fill), and one alloc.
    let adapter = r.in_place.as_ref().and_then(|i| i.adapter.as_ref().ok());
    t.at_least(
        "cxl batched_alloc + numpy fill + batch_store 32 x 2 MiB (Python, maru.MaruHandler) >= 0.9 x its numpy copy",
        adapter.map(|a| a.ratio()),
        0.9,
    );
    t.push(
        "one maru.MaruHandler.alloc (cxl) <= 10 us p50",
        adapter.map(|a| a.alloc.p50_us),
        &|f| format!("{f:.1} us"),
        &|f| f <= 10.0,
    );
    // Issue 38: the vLLM connector's loads into a paged KV cache, beside the raw batch
    // load of the same run, chunk size and backend.
    for c in &r.connector {
        t.at_least(
            &format!(
                "vLLM connector load into a paged KV cache, {} 32 x 2 MiB (Python) >= 0.5 x {} batch load 2 MiB",
                c.backend, c.backend
            ),
            ratio(
                c.row.as_ref().ok().map(|row| row.load.gbs),
                r.batch_load(c.backend, connector::CHUNK),
            ),
            0.5,
        );
    }
    // Issue 47: cxl against the streaming copy (the copy it makes; memcpy reads each
    // line it writes first, so it is slower and no ceiling), for 1 client and for 2
    // clients (2 handlers of one thread, 1 handler of two) against 2 threads' limit.
    for c in [256 * 1024, two] {
        for (handlers, threads) in [(1, 1), (2, 1), (1, 2)] {
            let lim = r.stream_of(c, handlers * threads);
            for load in [false, true] {
                t.at_least(
                    &format!(
                        "cxl batch {} 32 x {}, {handlers} handler(s) x {threads} thread(s) >= 0.9 x streaming copy ({} thread(s))",
                        if load { "load" } else { "store" },
                        chunk_name(c),
                        handlers * threads
                    ),
                    ratio(
                        r.maru_of("cxl", c, handlers, threads)
                            .map(|m| batch_gbs(m, load)),
                        lim,
                    ),
                    0.9,
                );
            }
        }
    }
    t.at_least(
        "cxl single 256 KiB store >= 0.6 x streaming copy (1 thread)",
        ratio(
            r.maru_of("cxl", 256 * 1024, 1, 1)
                .map(|m| m.store_single.gbs),
            r.stream_of(256 * 1024, 1),
        ),
        0.6,
    );
    // One handler used by N threads against N handlers of one thread (issue 23): the
    // median of the pairs of interleaved passes on one stack.
    for backend in ["cxl", "remote_cxl"] {
        for c in [256 * 1024, two] {
            for n in [2, MANY] {
                for (op, load) in [("store", false), ("load", true)] {
                    t.at_least(
                        &format!(
                            "{backend} {} {op}: 1 handler x {n} threads >= 0.9 x {n} handlers x 1 thread (interleaved passes)",
                            chunk_name(c),
                        ),
                        r.pair_of(backend, c, n)
                            .map(|p| if load { &p.load } else { &p.store }.median()),
                        0.9,
                    );
                }
            }
        }
    }
    t.at_least(
        "remote_cxl/soft batch store 256 KiB >= 1.0 x tcp loopback",
        ratio(
            r.maru_of("remote_cxl", 256 * 1024, 1, 1)
                .map(|m| m.store_batch.gbs),
            r.tcp_of(256 * 1024),
        ),
        1.0,
    );
    t.at_least(
        "remote_cxl/soft load 2 MiB >= 0.8 x tcp loopback",
        ratio(
            r.maru_of("remote_cxl", two, 1, 1).map(|m| m.load_batch.gbs),
            r.tcp_of(two),
        ),
        0.8,
    );
    t.at_least(
        "remote_cxl/soft load 2 MiB, 4 clients >= 1.25 x Redis GET (its best)",
        ratio(
            r.maru_of("remote_cxl", two, MANY, 1)
                .map(|m| m.load_batch.gbs),
            r.redis_of(two, MANY)
                .map(|x| x.get_batch.gbs.max(x.get_single.gbs)),
        ),
        1.25,
    );
    t.at_least(
        "remote_cxl/soft load into staging slots 2 MiB, 4 clients >= 1.25 x Redis GET (its best)",
        ratio(
            r.maru_of("remote_cxl", two, MANY, 1)
                .and_then(|m| m.load_slots.as_ref())
                .map(|f| f.gbs),
            r.redis_of(two, MANY)
                .map(|x| x.get_batch.gbs.max(x.get_single.gbs)),
        ),
        1.25,
    );
    let e = r.meta_of("exists x32", 1);
    t.push(
        "exists x32 p50 <= 50 us",
        e.map(|m| m.p50_us),
        &|f| format!("{f:.1} us"),
        &|f| f <= 50.0,
    );
    t.push(
        "exists x32 p99 <= 200 us",
        e.map(|m| m.p99_us),
        &|f| format!("{f:.1} us"),
        &|f| f <= 200.0,
    );
    for op in ["exists x1", meta::PUBLISH] {
        t.push(
            &format!("{op}, 8 conns >= 30000 ops/s"),
            r.meta_of(op, 8).map(|m| m.ops_per_s),
            &|f| format!("{f:.0} ops/s"),
            &|f| f >= 30000.0,
        );
    }
    for conns in [1, 8] {
        t.at_least(
            &format!("alloc+publish durable >= 0.8 x in-memory ({conns} conns, interleaved)"),
            ratio(
                r.meta_of(meta::PUBLISH_DURABLE, conns).map(|m| m.ops_per_s),
                r.meta_of(meta::PUBLISH, conns).map(|m| m.ops_per_s),
            ),
            0.8,
        );
    }
    if let Some(rec) = &r.meta_recovery {
        t.push(
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
        t.at_least(&name, got, least);
    }
    for i in &r.idle {
        t.push(
            &format!("idle CPU of {} < 1% of a core", i.what),
            Some(i.pct_of_core),
            &|f| format!("{f:.2} %"),
            &|f| f < 1.0,
        );
    }
    t.0
}

pub(crate) fn chart_panels(r: &Results) -> Vec<chart::Panel> {
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
                        let pick = |m: &maru_io::Result_| batch_gbs(m, load);
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
