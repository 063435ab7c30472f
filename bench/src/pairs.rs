//! One handler used by N threads against N handlers of one thread each, measured on
//! one stack in interleaved passes (issue 23's targets).
//!
//! The main table's figures of the two sides come from separate stacks, a minute or
//! more apart; on a small shared machine a figure moves by 10-30% between such runs,
//! more than the difference the target looks for. Here both sides are open on one
//! stack at once and take turns: a pass of one side (each of its N clients stores, or
//! loads, the same number of batches), then a pass of the other, the order swapped
//! every pair. A slow spell of the machine so hits both sides of a pair alike; the
//! ratio of each pair is taken, and the target reads their median.
//!
//! Store passes write new keys into pages used before: each pass's keys are removed
//! after it (not timed), and an untimed first pass of each side takes the regions and
//! touches the pages, so no pass pays for a region's first use. After the store
//! passes each client stores one more pass's keys and keeps them: the load passes
//! read them back, each client its own.

use crate::harness::{alternate, run_clients, Bound, Fig, Rotor};
use crate::maru_io::{handler_config, CHandler, BATCH, MIB};
use crate::procs::{stack, Scratch};
use serde::Serialize;
use std::ffi::CString;
use std::sync::{Arc, Mutex};

/// Bytes one side moves in one pass at most (all its clients together).
const PASS_BYTES: usize = 1 << 30;
/// A pass that takes longer than this is an error (a stuck store or load).
const PASS_SECS: f64 = 120.0;
/// Pairs of passes at most (short passes: fast cxl stores).
const MAX_PASSES: usize = 40;

/// The figures of one side over all its passes, and the ratios pass by pass.
#[derive(Debug, Clone, Serialize)]
pub struct Compared {
    /// GB/s over all passes: one handler used by N threads.
    pub shared_gbs: f64,
    /// GB/s over all passes: N handlers of one thread.
    pub apart_gbs: f64,
    /// shared / apart of each pair of passes, sorted.
    pub pass_ratios: Vec<f64>,
}

impl Compared {
    pub fn median(&self) -> f64 {
        crate::harness::percentile(&self.pass_ratios, 0.5)
    }

    fn from_passes(shared: &[Fig], apart: &[Fig], bytes_per_op: usize) -> Compared {
        let total = |figs: &[Fig]| {
            let bytes: f64 = figs.iter().map(|f| (f.ops * bytes_per_op) as f64).sum();
            let secs: f64 = figs
                .iter()
                .map(|f| f.ops as f64 / f.ops_per_s.max(1e-12))
                .sum();
            bytes / secs.max(1e-9) / 1e9
        };
        let mut pass_ratios: Vec<f64> = shared
            .iter()
            .zip(apart)
            .map(|(a, b)| a.gbs / b.gbs.max(1e-12))
            .collect();
        pass_ratios.sort_by(|a, b| a.total_cmp(b));
        Compared {
            shared_gbs: total(shared),
            apart_gbs: total(apart),
            pass_ratios,
        }
    }
}

/// One comparison: `n` threads on one handler against `n` handlers.
#[derive(Debug, Clone, Serialize)]
pub struct PairResult {
    pub backend: &'static str,
    pub chunk: usize,
    pub n: usize,
    pub passes: usize,
    /// Bytes one side moves in one pass.
    pub pass_bytes: usize,
    pub store: Compared,
    pub load: Compared,
}

/// Which way a pass moves chunks: stores of new keys, or loads of stored ones.
#[derive(Clone, Copy)]
enum Way {
    Store,
    Load,
}

/// One side: its clients' handlers (one shared, or one each) and source/destination
/// buffers.
struct Side {
    name: &'static str,
    handlers: Vec<Arc<CHandler>>,
    srcs: Vec<Arc<Mutex<Rotor>>>,
    dsts: Vec<Arc<Mutex<Rotor>>>,
}

impl Side {
    fn clients(&self) -> usize {
        self.srcs.len()
    }

    fn handler(&self, c: usize) -> Arc<CHandler> {
        self.handlers[c % self.handlers.len()].clone()
    }

    fn keys(&self, c: usize, kind: &str, batch: usize) -> Vec<CString> {
        (0..BATCH)
            .map(|j| {
                CString::new(format!("pair-{}-{c}-{kind}-{batch}-{j}", self.name))
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Runs `op(side, client, i)` for i in 0..batches on each client at once: one
    /// pass, timed; all its batches must be done.
    fn pass<F>(self: &Arc<Self>, what: &str, batches: usize, op: F) -> Result<Fig, String>
    where
        F: Fn(&Side, usize, usize) -> Result<u64, String> + Clone + Send + 'static,
    {
        let ops: Vec<_> = (0..self.clients())
            .map(|c| {
                let side = self.clone();
                let op = op.clone();
                move |i: usize| op(&side, c, i)
            })
            .collect();
        let fig = run_clients(ops, bound(batches))?;
        if fig.ops != batches * self.clients() {
            return Err(format!(
                "{} side: a {what} pass did {} of {} batches in {PASS_SECS} s",
                self.name,
                fig.ops,
                batches * self.clients()
            ));
        }
        Ok(fig)
    }

    /// Each client stores `batches` batches of new keys (`kind`), or loads the
    /// `batches` batches it stored under `kind`: one pass, timed.
    fn batch_pass(
        self: &Arc<Self>,
        way: Way,
        kind: &str,
        batches: usize,
        chunk: usize,
    ) -> Result<Fig, String> {
        let kind = kind.to_string();
        let what = match way {
            Way::Store => "store",
            Way::Load => "load",
        };
        self.pass(what, batches, move |side, c, i| {
            let keys = side.keys(c, &kind, i);
            let rotor = match way {
                Way::Store => &side.srcs[c],
                Way::Load => &side.dsts[c],
            };
            let ptrs: Vec<*mut u8> = {
                let mut r = rotor.lock().map_err(|_| "poisoned")?;
                (0..BATCH).map(|_| r.next_ptr()).collect()
            };
            match way {
                Way::Store => {
                    let srcs: Vec<*const u8> =
                        ptrs.into_iter().map(<*mut u8>::cast_const).collect();
                    side.handler(c).store_batch(&keys, &srcs, chunk)?;
                    Ok((BATCH * chunk) as u64)
                }
                Way::Load => side.handler(c).load_batch(&keys, &ptrs, chunk),
            }
        })
    }

    /// Removes what a store pass of `kind` stored (not timed).
    fn remove_pass(&self, kind: &str, batches: usize) -> Result<(), String> {
        for c in 0..self.clients() {
            for b in 0..batches {
                self.handler(c).remove_batch(&self.keys(c, kind, b))?;
            }
        }
        Ok(())
    }
}

fn bound(max_ops: usize) -> Bound {
    Bound {
        secs: PASS_SECS,
        max_ops,
    }
}

/// Measures `n` threads on one handler against `n` handlers of one thread on a fresh
/// stack of `backend`: pairs of store passes, and as many of load passes, enough for
/// each side's store passes to take about `secs` (at least `min_passes`).
pub fn run(
    s: &Scratch,
    backend: &'static str,
    chunk: usize,
    n: usize,
    secs: f64,
    min_passes: usize,
    rotate: usize,
) -> Result<PairResult, String> {
    let region = 256 * MIB;
    let st = stack(
        s,
        backend == "remote_cxl",
        &format!("{region}"),
        &format!("{chunk}"),
    )?;
    let open = |name: String| -> Result<Arc<CHandler>, String> {
        CHandler::open(&handler_config(&st.server, backend, &name, s)).map(Arc::new)
    };
    let rotors = |seed: u64| -> Vec<Arc<Mutex<Rotor>>> {
        (0..n)
            .map(|c| {
                let per = (rotate / n).max(chunk * BATCH * 2);
                Arc::new(Mutex::new(Rotor::new(per, chunk, seed + c as u64)))
            })
            .collect()
    };
    let shared = Arc::new(Side {
        name: "shared",
        handlers: vec![open(format!("pair-{backend}-shared"))?],
        srcs: rotors(11),
        dsts: rotors(3),
    });
    let apart = Arc::new(Side {
        name: "apart",
        handlers: (0..n)
            .map(|i| open(format!("pair-{backend}-apart-{i}")))
            .collect::<Result<_, _>>()?,
        srcs: rotors(11),
        dsts: rotors(3),
    });
    // Space: each side's pass within half of the pool, less two regions per handler
    // (one partly filled, one taken ahead of need) and two to spare.
    let handlers = n + 1;
    let usable = (s.pool_size as usize).saturating_sub(region * (2 * handlers + 2));
    let batch_bytes = BATCH * chunk;
    let per_client = (usable / 2).min(PASS_BYTES) / n;
    let batches = (per_client / batch_bytes).max(1);
    // Untimed: each side's regions taken and pages touched, connections made. The
    // second round's time sets how many pairs of passes fill `secs` per side.
    let mut pass_secs = 0.0f64;
    for round in 0..2 {
        for side in [&shared, &apart] {
            let fig = side.batch_pass(Way::Store, "warm", batches, chunk)?;
            side.remove_pass("warm", batches)?;
            if round == 1 {
                pass_secs = pass_secs.max(fig.ops as f64 / fig.ops_per_s.max(1e-12));
            }
        }
    }
    let passes = ((secs / pass_secs.max(1e-6)).ceil() as usize).clamp(min_passes, MAX_PASSES);
    let side = |is_apart: bool| if is_apart { &apart } else { &shared };
    let store = alternate(passes, |is_apart, p| {
        let side = side(is_apart);
        let kind = format!("s{p}");
        let fig = side.batch_pass(Way::Store, &kind, batches, chunk)?;
        side.remove_pass(&kind, batches)?;
        Ok(fig)
    })?;
    // The keys the load passes read, kept.
    for side in [&shared, &apart] {
        side.batch_pass(Way::Store, "load", batches, chunk)?;
    }
    let load = alternate(passes, |is_apart, _| {
        side(is_apart).batch_pass(Way::Load, "load", batches, chunk)
    })?;
    drop(shared);
    drop(apart);
    drop(st);
    Ok(PairResult {
        backend,
        chunk,
        n,
        passes,
        pass_bytes: batches * batch_bytes * n,
        store: Compared::from_passes(&store.0, &store.1, batch_bytes),
        load: Compared::from_passes(&load.0, &load.1, batch_bytes),
    })
}
