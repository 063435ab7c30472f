//! Hit rate of a full cache: traces replayed as a prefix cache (a hit is a chunk of
//! the leading run found; the chunks after the first miss are stored) through
//! maru-server's eviction, beside orders from the caching literature and Belady's
//! offline optimum, at 5 %, 12.5 % and 25 % of each trace's distinct chunks.
//!
//! - **maru-server** (`hitrate_core.rs`): its core with each `--victim-order`
//!   (`reuse`, the default; `reuse-ends`; `prefix`; `lru`), 1 and 4 engines each with its session,
//!   the 4 sharing the pool by fair share, requests routed as a prefix-aware balancer
//!   routes them (`hitrate_trace.rs`);
//! - **one global cache** of the same number of chunks (`hitrate_policies.rs`): LRU,
//!   ARC, 2Q, S3-FIFO, the `reuse` rules one by one, Belady.
//!
//! Traces: the bench's own synthesized chat trace, always; files in Mooncake's
//! JSON-lines format given with `--trace` (docs/benchmarks.md says where to get them).

#[path = "hitrate_core.rs"]
mod core;
#[path = "hitrate_policies.rs"]
mod policies;
#[path = "hitrate_trace.rs"]
mod trace;

use maru::meta::VictimOrder;
use serde::Serialize;
use std::path::PathBuf;

use crate::report::Table;
use policies::{replay, Arc, Lru, Reuse, S3Fifo, TwoQ};

/// Capacities, as fractions of a trace's distinct chunks.
pub const CAPACITIES: [f64; 3] = [0.05, 0.125, 0.25];
const ENGINES: [usize; 2] = [1, 4];
const ORDERS: [(&str, VictimOrder); 4] = [
    ("reuse", VictimOrder::Reuse),
    ("reuse-ends", VictimOrder::ReuseEnds),
    ("prefix", VictimOrder::PrefixAware),
    ("lru", VictimOrder::Lru),
];

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub capacity: f64,
    pub capacity_chunks: u64,
    /// Engines of maru-server's replay; 0: one global cache.
    pub engines: usize,
    pub order: String,
    /// Hits over chunk accesses.
    pub hits: f64,
    pub of_belady: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TraceResult {
    pub trace: String,
    pub requests: usize,
    pub accesses: usize,
    pub distinct_chunks: usize,
    /// Accesses to a chunk seen before, over all: what no cache can pass.
    pub reuse_bound: f64,
    pub rows: Vec<Row>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HitRateResult {
    pub traces: Vec<TraceResult>,
    /// Why no file trace was replayed, if none was given.
    pub skipped: Option<String>,
}

/// The message of a run without `--trace`.
pub const SKIPPED: &str = "no --trace given: the Mooncake conversation trace's row was skipped \
     (get FAST25-release/traces/conversation_trace.jsonl of github.com/kvcache-ai/Mooncake and \
     pass --trace PATH; docs/benchmarks.md)";

fn measure(t: &trace::Trace, capacities: &[f64]) -> Result<TraceResult, String> {
    let mut rows = Vec::new();
    let routes: Vec<(usize, Vec<usize>)> =
        ENGINES.iter().map(|&n| (n, trace::route(t, n))).collect();
    for &frac in capacities {
        let regions = ((t.distinct as f64 * frac) as u64 / core::REGION_PAGES).max(4);
        let cap = regions * core::REGION_PAGES;
        let c = cap as usize;
        let belady = policies::belady(t, c);
        let mut row = |engines: usize, order: &str, hits: f64| {
            rows.push(Row {
                capacity: frac,
                capacity_chunks: cap,
                engines,
                order: order.to_string(),
                hits,
                of_belady: hits / belady.max(1e-12),
            })
        };
        for (engines, route) in &routes {
            for (name, order) in ORDERS {
                row(*engines, name, core::replay(t, route, order, regions)?);
            }
        }
        row(0, "LRU", replay(t, &mut Lru::new(c)));
        row(0, "ARC", replay(t, &mut Arc::new(c)));
        row(0, "2Q", replay(t, &mut TwoQ::new(c)));
        row(0, "S3-FIFO", replay(t, &mut S3Fifo::new(c)));
        // The reuse policy's parts, one by one: (credit per read, ghosts, fresh ends
        // first).
        for (name, (credit, ghosts, fresh)) in [
            ("reuse: credit per read", (true, false, false)),
            ("reuse: + ghosts", (true, true, false)),
            ("reuse: + fresh ends first", (true, true, true)),
            ("fresh ends first alone", (false, false, true)),
        ] {
            row(
                0,
                name,
                replay(t, &mut Reuse::new(c, credit, ghosts, fresh)),
            );
        }
        row(0, "Belady", belady);
    }
    Ok(TraceResult {
        trace: t.name.clone(),
        requests: t.requests.len(),
        accesses: t.accesses(),
        distinct_chunks: t.distinct,
        reuse_bound: policies::reuse_bound(t),
        rows,
    })
}

/// The synthesized trace and every file of `files`, each also with its partial last
/// blocks not stored (as Maru's vLLM connector stores them) when it has any; `quick`:
/// a smaller synthesized trace, the first 3,000 requests of each file, 5 % only.
/// Each trace and capacity is replayed on a thread of its own.
pub fn run(quick: bool, files: &[PathBuf]) -> Result<HitRateResult, String> {
    let caps: &[f64] = if quick { &CAPACITIES[..1] } else { &CAPACITIES };
    let (conversations, requests) = if quick { (400, 6_000) } else { (1_000, 30_000) };
    let mut all = vec![trace::synthesize(conversations, requests)];
    for f in files {
        let t = trace::load_jsonl(f, quick.then_some(3_000))?;
        let whole = t
            .partial_last
            .iter()
            .any(|p| *p)
            .then(|| t.whole_chunks_only());
        all.push(t);
        all.extend(whole);
    }
    let measured: Vec<Result<TraceResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = all
            .iter()
            .flat_map(|t| caps.iter().map(move |&c| s.spawn(move || measure(t, &[c]))))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a hit-rate replay panicked".into()))
            })
            .collect()
    });
    let mut traces: Vec<TraceResult> = Vec::new();
    for m in measured {
        let m = m?;
        match traces.last_mut() {
            Some(last) if last.trace == m.trace => last.rows.extend(m.rows),
            _ => traces.push(m),
        }
    }
    Ok(HitRateResult {
        traces,
        skipped: files.is_empty().then(|| SKIPPED.to_string()),
    })
}

pub fn tables(r: &HitRateResult) -> Vec<Table> {
    r.traces
        .iter()
        .map(|t| {
            let mut tab = Table::new(
                &format!(
                    "Hit rate, {}: {} chunk accesses, {} distinct chunks; a chunk seen before is {:.3} of accesses",
                    t.trace, t.accesses, t.distinct_chunks, t.reuse_bound
                ),
                &["capacity", "engines", "order", "hits", "of Belady"],
            );
            for row in &t.rows {
                tab.row(vec![
                    format!(
                        "{:.1} % ({} chunks)",
                        row.capacity * 100.0,
                        row.capacity_chunks
                    ),
                    match row.engines {
                        0 => "one global cache".into(),
                        n => format!("maru-server, {n}"),
                    },
                    row.order.clone(),
                    format!("{:.3}", row.hits),
                    format!("{:.3}", row.of_belady),
                ]);
            }
            tab
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_optimum_bounds_every_order_and_the_replays_hit() {
        let t = trace::synthesize(60, 600);
        let r = measure(&t, &[0.125]).unwrap();
        let belady = r.rows.iter().find(|x| x.order == "Belady").unwrap().hits;
        assert!(belady <= r.reuse_bound + 1e-12);
        assert_eq!(r.rows.len(), 2 * ORDERS.len() + 9);
        for x in &r.rows {
            assert!(x.hits > 0.0, "{x:?}");
            assert!(x.hits <= belady + 1e-12, "Belady {belady} below {x:?}");
        }
        // With neither credit, ghosts nor ends, the reuse ranks are plain LRU.
        let c = r.rows[0].capacity_chunks as usize;
        assert_eq!(
            replay(&t, &mut Reuse::new(c, false, false, false)),
            replay(&t, &mut Lru::new(c))
        );
    }
}
