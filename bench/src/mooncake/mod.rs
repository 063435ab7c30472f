//! Part `mooncake`: Maru beside Mooncake Store, the shared KV pool a vLLM, SGLang or
//! LMCache user would pick instead, in the same run and taking turns with it.
//!
//! Mooncake comes from PyPI (`mooncake-transfer-engine-non-cuda`, a manylinux wheel for
//! CPython 3.11) into a venv of its own outside the clone (`$MARU_MOONCAKE_VENV`, by
//! default `~/.cache/maru/mooncake-venv`), made at the first run and reused. The part
//! starts `mooncake_master` with its HTTP metadata server on loopback (free ports), one
//! storage process holding a memory segment of the size of Maru's pool over the TCP
//! transport (bench/python/mooncake_row.py `serve`), and per turn N client processes
//! with no segment of their own, so that every byte crosses Mooncake's TCP transfer
//! engine, as every byte of Maru's remote_cxl crosses the soft transport. Replica
//! count 1 (the default `ReplicateConfig`).
//!
//! Each (chunk, clients) configuration takes turns: Mooncake, Maru remote_cxl/soft and
//! Maru cxl (each on a fresh stack), the order reversed every turn so that the load of
//! the machine weighs on all alike; a figure adds up its turns. Both sides: batch put
//! (32 new keys from cold registered buffers), single put, batch get into cold buffers,
//! single get, exists of a batch of 32 stored keys.
//!
//! When the venv cannot be made (PyPI unreachable, no Python 3.11, the wheel does not
//! install) or Mooncake does not start, the part says it was skipped and why, and the
//! bench goes on.

mod cluster;
mod turns;

use crate::harness::{Fig, Run};
use crate::maru_io::BATCH;
use crate::procs::Scratch;
use crate::report::{chunk_name, f0, f2, us, Table};
use cluster::{start, venv_dir, PACKAGE, VERSION};
use serde::Serialize;
use turns::{maru_turn, mooncake_turn};

const TURNS: usize = 2;
const MANY: usize = 4;
/// The systems of a row: Mooncake and the two Maru backends beside it.
pub const SYSTEMS: [&str; 3] = ["mooncake", "remote_cxl", "cxl"];

/// The five figures of one system at one chunk size and client count.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub system: &'static str,
    pub chunk: usize,
    pub clients: usize,
    pub put_batch: Fig,
    pub put_single: Fig,
    pub get_batch: Fig,
    pub get_single: Fig,
    /// Exists of 32 stored keys per operation (ops/s, latency; no bytes).
    pub exists_batch: Fig,
}

#[derive(Debug, Clone, Serialize)]
pub struct MooncakeResult {
    /// Why the part was skipped (Mooncake could not be installed or started).
    pub skipped: Option<String>,
    pub version: String,
    pub segment_bytes: u64,
    pub turns: usize,
    pub rows: Vec<Row>,
}

impl MooncakeResult {
    pub fn row(&self, system: &str, chunk: usize, clients: usize) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.system == system && r.chunk == chunk && r.clients == clients)
    }
}

/// Runs the part: Mooncake set up (or skipped), then each configuration in turns.
pub fn run(
    s: &Scratch,
    chunks: &[usize],
    clients: &[usize],
    secs: f64,
    rotate: usize,
    say: &dyn Fn(&str),
) -> MooncakeResult {
    let segment = s.pool_size;
    let mut res = MooncakeResult {
        skipped: None,
        version: VERSION.into(),
        segment_bytes: segment,
        turns: TURNS,
        rows: Vec::new(),
    };
    let logs = s.path("mooncake");
    if let Err(e) = std::fs::create_dir_all(&logs) {
        res.skipped = Some(format!("{}: {e}", logs.display()));
        return res;
    }
    say(&format!(
        "mooncake: venv {} ({PACKAGE}=={VERSION}), master and a {} GiB segment on loopback",
        venv_dir().display(),
        segment >> 30
    ));
    let cluster = match start(segment, &logs) {
        Ok(c) => c,
        Err(e) => {
            let why = format!("Mooncake Store not measured: {e}");
            eprintln!("maru-bench: part mooncake skipped: {why}");
            res.skipped = Some(why);
            return res;
        }
    };
    for &chunk in chunks {
        for &n in clients {
            let rot = (rotate / n).max(chunk * BATCH * 2);
            let mut acc: Vec<[Run; 5]> = (0..SYSTEMS.len()).map(|_| Default::default()).collect();
            let mut failed = None;
            'turns: for t in 0..TURNS {
                let mut order: Vec<usize> = (0..SYSTEMS.len()).collect();
                if t % 2 == 1 {
                    order.reverse();
                }
                for i in order {
                    let sys = SYSTEMS[i];
                    say(&format!(
                        "mooncake part: {sys} {} x {n} client(s), turn {} of {TURNS}",
                        chunk_name(chunk),
                        t + 1
                    ));
                    let turn = if sys == "mooncake" {
                        let tag = format!("mc{t}-{chunk}-{n}");
                        mooncake_turn(&cluster, chunk, n, secs, rot, segment, &tag)
                    } else {
                        maru_turn(s, sys, chunk, n, secs, rot)
                    };
                    match turn {
                        Ok(runs) => {
                            for (a, r) in acc[i].iter_mut().zip(runs) {
                                a.add(r);
                            }
                        }
                        Err(e) => {
                            failed = Some(format!("{sys}: {e}"));
                            break 'turns;
                        }
                    }
                }
            }
            if let Some(e) = failed {
                eprintln!(
                    "maru-bench: part mooncake, {} x {n}: {e}",
                    chunk_name(chunk)
                );
                res.skipped.get_or_insert(e);
                continue;
            }
            for (i, runs) in acc.into_iter().enumerate() {
                let [a, b, c, d, e] = runs;
                res.rows.push(Row {
                    system: SYSTEMS[i],
                    chunk,
                    clients: n,
                    put_batch: a.fig(),
                    put_single: b.fig(),
                    get_batch: c.fig(),
                    get_single: d.fig(),
                    exists_batch: e.fig(),
                });
            }
        }
    }
    drop(cluster);
    res
}

fn system_name(sys: &str) -> &'static str {
    match sys {
        "mooncake" => "mooncake store (tcp)",
        "remote_cxl" => "maru remote_cxl/soft",
        _ => "maru cxl",
    }
}

/// The part's table: every figure of every system, in the order they are compared.
pub fn table(m: &MooncakeResult) -> Table {
    let mut t = Table::new(
        &format!(
            "Maru beside Mooncake Store {VERSION} (TCP transport, segment {} GiB, 1 replica; {} interleaved turns; batch = 32 chunks; µs)",
            m.segment_bytes >> 30,
            m.turns
        ),
        &["system", "op", "chunk", "clients", "GB/s", "ops/s", "p50", "p99"],
    );
    if let Some(why) = &m.skipped {
        t.row(vec![
            format!("skipped: {why}"),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
    }
    let mut chunks: Vec<usize> = m.rows.iter().map(|r| r.chunk).collect();
    chunks.dedup();
    for chunk in chunks {
        for (op, pick) in [
            ("batch put", 0),
            ("single put", 1),
            ("batch get", 2),
            ("single get", 3),
            ("exists x32", 4),
        ] {
            for n in [1, MANY] {
                for sys in SYSTEMS {
                    let Some(r) = m.row(sys, chunk, n) else {
                        continue;
                    };
                    let f = match pick {
                        0 => &r.put_batch,
                        1 => &r.put_single,
                        2 => &r.get_batch,
                        3 => &r.get_single,
                        _ => &r.exists_batch,
                    };
                    t.row(vec![
                        system_name(sys).into(),
                        op.into(),
                        chunk_name(chunk),
                        n.to_string(),
                        if pick == 4 { "-".into() } else { f2(f.gbs) },
                        f0(f.ops_per_s),
                        us(f.p50_us),
                        us(f.p99_us),
                    ]);
                }
            }
        }
    }
    t
}

fn clients_name(n: usize) -> String {
    if n == 1 {
        "1 client".into()
    } else {
        format!("{n} clients")
    }
}

type Pick = fn(&Row) -> f64;
/// A ratio table cell by chunk size.
pub type PerChunk<'a> = Box<dyn Fn(usize) -> Option<f64> + 'a>;

fn ratio_of(
    m: Option<&MooncakeResult>,
    sys: &str,
    chunk: usize,
    n: usize,
    pick: Pick,
) -> Option<f64> {
    let m = m?;
    let a = m.row(sys, chunk, n).map(pick)?;
    let b = m.row("mooncake", chunk, n).map(pick)?;
    (b > 0.0).then(|| a / b)
}

/// Rows of the ratio table (one cell per chunk size).
pub fn ratio_rows(m: Option<&MooncakeResult>) -> Vec<(String, PerChunk<'_>)> {
    let mut v: Vec<(String, PerChunk<'_>)> = Vec::new();
    if m.is_none() {
        return v;
    }
    let ops: [(&str, &str, Pick); 5] = [
        ("load", "get", |r: &Row| r.get_batch.gbs),
        ("store", "put", |r: &Row| r.put_batch.gbs),
        ("single load", "single get", |r: &Row| r.get_single.gbs),
        ("single store", "single put", |r: &Row| r.put_single.gbs),
        ("exists x32 ops/s", "exists x32 ops/s", |r: &Row| {
            r.exists_batch.ops_per_s
        }),
    ];
    for (sys, name) in [("remote_cxl", "remote_cxl/soft"), ("cxl", "cxl")] {
        for (ours, theirs, pick) in ops {
            for n in [1, MANY] {
                v.push((
                    format!(
                        "{name} {ours} / Mooncake Store {theirs} over TCP ({})",
                        clients_name(n)
                    ),
                    Box::new(move |c| ratio_of(m, sys, c, n, pick)),
                ));
            }
        }
    }
    v
}

/// The targets: (what, measured ratio, least ratio that meets it).
pub fn targets(m: Option<&MooncakeResult>) -> Vec<(String, Option<f64>, f64)> {
    let mut v = Vec::new();
    let Some(m) = m else { return v };
    for chunk in [256 << 10, 2 << 20] {
        for n in [1, MANY] {
            for (op, theirs, pick) in [
                (
                    "batch load",
                    "batch_get_into",
                    (|r: &Row| r.get_batch.gbs) as Pick,
                ),
                ("batch store", "batch_put_from", |r: &Row| r.put_batch.gbs),
            ] {
                v.push((
                    format!(
                        "remote_cxl/soft {op} {}, {} >= 1.0 x Mooncake Store {theirs} over TCP",
                        chunk_name(chunk),
                        clients_name(n)
                    ),
                    ratio_of(Some(m), "remote_cxl", chunk, n, pick),
                    1.0,
                ));
            }
        }
    }
    for chunk in [256 << 10, 2 << 20] {
        for n in [1, MANY] {
            v.push((
                format!(
                    "cxl batch load {}, {} >= 3 x Mooncake Store batch_get_into",
                    chunk_name(chunk),
                    clients_name(n)
                ),
                ratio_of(Some(m), "cxl", chunk, n, |r: &Row| r.get_batch.gbs),
                3.0,
            ));
        }
    }
    for sys in ["remote_cxl", "cxl"] {
        for n in [1, MANY] {
            v.push((
                format!(
                    "{sys} exists x32 ops/s, {} >= 2 x Mooncake Store batch_is_exist (256 KiB keys)",
                    clients_name(n)
                ),
                ratio_of(Some(m), sys, 256 << 10, n, |r: &Row| r.exists_batch.ops_per_s),
                2.0,
            ));
        }
    }
    v
}

/// Chart bars (GB/s, 1 and 4 clients) of Mooncake, and of the Maru figures taken
/// beside it when `with_maru` (the part `maru` did not run).
pub fn bars(m: Option<&MooncakeResult>, chunk: usize, with_maru: bool) -> Vec<crate::chart::Bars> {
    let mut v = Vec::new();
    let Some(m) = m else { return v };
    for sys in SYSTEMS {
        if sys != "mooncake" && !with_maru {
            continue;
        }
        for (op, pick) in [
            ("put", (|r: &Row| r.put_batch.gbs) as Pick),
            ("get", |r: &Row| r.get_batch.gbs),
        ] {
            if let Some(r) = m.row(sys, chunk, 1) {
                let label = if sys == "mooncake" {
                    format!("mooncake {op} (tcp, batch 32)")
                } else {
                    format!("{sys} {op} (mooncake part)")
                };
                v.push(crate::chart::Bars {
                    system: label,
                    one: pick(r),
                    many: m.row(sys, chunk, MANY).map(pick),
                });
            }
        }
    }
    v
}
