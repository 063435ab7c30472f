//! Writes in place on `cxl` through the C ABI (`maru_pages_take`, the caller's copy
//! into the page, `maru_pages_publish`): what `maru.compat`'s `alloc` + fill + `store`
//! does, each byte moved once, by the caller. Beside it, memcpy of the same chunks
//! over the same amount of cold memory, measured in the same run, for the ratio.
//!
//! Three figures of 32 × 2 MiB per operation: as `compat`'s `alloc` (one page taken
//! per chunk, from the pool's spare pages) + fill + `batch_store` (one publish of the
//! 32); the same with a `store` per chunk (one publish round trip each); and all
//! batched (take 32, fill 32, publish 32). Each operation then removes its keys (one
//! round trip), as a full cache that evicts reuses its pages; a warm-up cycles through
//! the region once so that first touches of fresh pages are not measured.

use crate::harness::{percentile, Fig, Rotor};
use crate::maru_io::{check, every_set, key_ptrs, CHandler};
use crate::procs::{stack, Scratch};
use crate::report::{f2, Table};
use maru::ffi::{maru_page_t, maru_pages_publish, maru_pages_take};
use serde::Serialize;
use std::ffi::CString;

const BATCH: usize = 32;
const CHUNK: usize = 2 << 20;
const REGION: usize = 256 << 20;
/// Turns of the figures and memcpy (see `run`).
const ROUNDS: usize = 4;

/// Runs `op` for `secs` on this thread: GB/s and the median operation.
fn measure(op: &mut dyn FnMut(usize) -> Result<u64, String>, secs: f64) -> Result<Fig, String> {
    let start = std::time::Instant::now();
    let mut lat = Vec::new();
    let mut bytes = 0u64;
    let mut i = 0;
    while start.elapsed().as_secs_f64() < secs || i == 0 {
        let t = std::time::Instant::now();
        bytes += op(i)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        i += 1;
    }
    let wall = start.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    Ok(Fig {
        gbs: bytes as f64 / wall / 1e9,
        ops_per_s: i as f64 / wall,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
        ops: i,
    })
}

/// Figures of equal time slices together: the mean rate, the median of the medians.
fn average(figs: &[Fig]) -> Fig {
    let n = figs.len().max(1) as f64;
    let mut p50: Vec<f64> = figs.iter().map(|f| f.p50_us).collect();
    p50.sort_by(f64::total_cmp);
    Fig {
        gbs: figs.iter().map(|f| f.gbs).sum::<f64>() / n,
        ops_per_s: figs.iter().map(|f| f.ops_per_s).sum::<f64>() / n,
        p50_us: percentile(&p50, 0.5),
        p99_us: figs.iter().map(|f| f.p99_us).fold(0.0, f64::max),
        ops: figs.iter().map(|f| f.ops).sum(),
    }
}

/// The figures of writes in place, and memcpy measured beside them.
#[derive(Debug, Clone, Serialize)]
pub struct InPlaceResult {
    /// As compat's alloc (one page each) + fill + batch_store (one publish).
    pub compat: Fig,
    /// The same with one store (publish) per chunk.
    pub per_chunk: Fig,
    /// 32 pages taken, filled and published at once.
    pub batched: Fig,
    pub memcpy: Fig,
    /// The adapters' way through Python (bench/python/adapter_row.py), or why not.
    pub adapter: Result<AdapterRow, String>,
}

/// What LMCache's or SGLang's adapter does, through `maru.MaruHandler` in Python:
/// `batched_alloc` of 32 pages, a numpy fill of each, `batch_store`, and a numpy copy of
/// the same bytes into as much cold memory measured in turns with it (its memcpy).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct AdapterRow {
    pub fill_store: PyFig,
    pub memcpy: PyFig,
    pub alloc: PyAlloc,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PyFig {
    pub gbs: f64,
    pub p50_us: f64,
    pub ops: usize,
    /// Of a load into a paged KV cache (the connector's row): the time of its
    /// `maru_load_pieces` calls alone (leases, transfers and the copies into the
    /// blocks, inside libmaru), GB/s; the rest of the load's time is Python.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_gbs: Option<f64>,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PyAlloc {
    pub p50_us: f64,
    pub p99_us: f64,
    pub ops: usize,
}

impl AdapterRow {
    /// alloc + numpy fill + store over the numpy copy of the same bytes.
    pub fn ratio(&self) -> f64 {
        if self.memcpy.gbs > 0.0 {
            self.fill_store.gbs / self.memcpy.gbs
        } else {
            0.0
        }
    }
}

/// Runs bench/python/adapter_row.py against `server`, proving `server_key` (see
/// `python_row::run`).
fn adapter_row(
    server: &str,
    server_key: &std::path::Path,
    secs: f64,
) -> Result<AdapterRow, String> {
    let args = [
        "--server".to_string(),
        server.to_string(),
        "--server-key-file".into(),
        server_key.display().to_string(),
        "--chunk".into(),
        CHUNK.to_string(),
        "--batch".into(),
        BATCH.to_string(),
        "--secs".into(),
        format!("{secs:.1}"),
    ];
    crate::python_row::run("adapter_row.py", &args, secs)
}

const NO_PAGE: maru_page_t = maru_page_t {
    region_id: 0,
    page: 0,
    offset: 0,
    data: std::ptr::null_mut(),
    capacity: 0,
};

/// `n` pages of the handler's own regions, taken to write in place (`maru_pages_take`).
fn take(h: &CHandler, n: usize, route: &CString) -> Result<Vec<maru_page_t>, String> {
    let mut pages = vec![NO_PAGE; n];
    let mut got = 0usize;
    // SAFETY: `pages` has n entries; `got` is writable.
    check(
        unsafe { maru_pages_take(h.as_ptr(), n, route.as_ptr(), pages.as_mut_ptr(), &mut got) },
        "maru_pages_take",
    )?;
    if got != n {
        return Err(format!("maru_pages_take gave {got} of {n} pages"));
    }
    Ok(pages)
}

/// Publishes `keys[i]` in `pages[i]`, CHUNK bytes each (`maru_pages_publish`); all must be published.
fn publish(h: &CHandler, keys: &[CString], pages: &[maru_page_t]) -> Result<(), String> {
    let kp = key_ptrs(keys);
    let lens = vec![CHUNK; keys.len()];
    let mut ok = vec![false; keys.len()];
    // SAFETY: arrays of keys.len() entries.
    check(
        unsafe {
            maru_pages_publish(
                h.as_ptr(),
                kp.as_ptr(),
                pages.as_ptr(),
                lens.as_ptr(),
                keys.len(),
                ok.as_mut_ptr(),
            )
        },
        "maru_pages_publish",
    )?;
    every_set(&ok, |n, of| {
        format!("maru_pages_publish published {} of {of}", of - n)
    })
}

/// Fills a page with the caller's copy (what the GPU's copy is in a runtime): streaming
/// stores, as libmaru's own stores copy into shared memory (`maru::dax::copy`), so the
/// figure compares with `maru_store_batch`'s.
fn fill(page: &maru_page_t, src: *const u8) {
    // SAFETY: a source piece of CHUNK bytes inside the rotor; the destination is a
    // taken page of `capacity` >= CHUNK bytes in the writable mapping.
    unsafe {
        let from = std::slice::from_raw_parts(src, CHUNK);
        maru::dax::copy::copy_to_shared(page.data, from);
    }
}

/// Runs the figures on a fresh cxl stack over the scratch pool.
pub fn run(s: &Scratch, secs: f64, rotate: usize) -> Result<InPlaceResult, String> {
    let rotate = rotate.max(CHUNK * BATCH * 2);
    let st = stack(s, false, &REGION.to_string(), &CHUNK.to_string())?;
    let cfg = crate::maru_io::handler_config(&st.server, "cxl", "bench-in-place", s);
    let h = std::sync::Arc::new(CHandler::open(&cfg)?);
    let route = CString::new("in-place").map_err(|e| e.to_string())?;
    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Compat,
        PerChunk,
        Batched,
    }
    type Op = Box<dyn FnMut(usize) -> Result<u64, String>>;
    let make = |mode: Mode, tag: &'static str| -> Result<Op, String> {
        let h = h.clone();
        let route = route.clone();
        let mut src = Rotor::new(rotate, CHUNK, 11);
        let mut op = move |i: usize| -> Result<u64, String> {
            let keys: Vec<CString> = (0..BATCH)
                .map(|j| CString::new(format!("{tag}-{i}-{j}")).unwrap_or_default())
                .collect();
            match mode {
                Mode::Batched => {
                    let pages = take(&h, BATCH, &route)?;
                    for p in &pages {
                        fill(p, src.next_ptr());
                    }
                    publish(&h, &keys, &pages)?;
                }
                Mode::Compat => {
                    let mut pages = Vec::with_capacity(BATCH);
                    for _ in 0..BATCH {
                        let page = take(&h, 1, &route)?;
                        fill(&page[0], src.next_ptr());
                        pages.push(page[0]);
                    }
                    publish(&h, &keys, &pages)?;
                }
                Mode::PerChunk => {
                    for k in &keys {
                        let page = take(&h, 1, &route)?;
                        fill(&page[0], src.next_ptr());
                        publish(&h, std::slice::from_ref(k), &page)?;
                    }
                }
            }
            h.remove_batch(&keys)?;
            Ok((BATCH * CHUNK) as u64)
        };
        // Once through the region (and one more), unmeasured: every page touched.
        for i in 0..REGION / (CHUNK * BATCH) + 2 {
            op((1 << 32) + i)?;
        }
        Ok(Box::new(op))
    };
    let mut ops = [
        make(Mode::Compat, "a")?,
        make(Mode::PerChunk, "c")?,
        make(Mode::Batched, "b")?,
    ];
    // The machine's load changes from second to second: the figures and memcpy are
    // measured in turns, a slice of the time each, ROUNDS times, and averaged.
    let slice = secs / ROUNDS as f64;
    let mut rounds: [Vec<Fig>; 4] = Default::default();
    for _ in 0..ROUNDS {
        rounds[3].push(crate::limits::memcpy(CHUNK, 1, slice, rotate / 2));
        for (k, op) in ops.iter_mut().enumerate() {
            let fig = measure(&mut **op, slice)?;
            rounds[k].push(fig);
        }
    }
    let [compat, per_chunk, batched, memcpy] = rounds.map(|r| average(&r));
    drop(h);
    // The Python adapters' way, on the same stack once the figures above are done.
    let adapter = adapter_row(&st.server, &s.server_key, secs);
    drop(st);
    Ok(InPlaceResult {
        compat,
        per_chunk,
        batched,
        memcpy,
        adapter,
    })
}

/// The table of the figures, each with its ratio to memcpy.
pub fn table(r: &InPlaceResult) -> Table {
    let mut t = Table::new(
        "cxl writes in place (maru_pages_take, the caller's copy, maru_pages_publish)",
        &["figure", "GB/s", "p50 us", "x memcpy"],
    );
    let ratio = |f: &Fig| {
        if r.memcpy.gbs > 0.0 {
            format!("{:.2} x", f.gbs / r.memcpy.gbs)
        } else {
            "-".into()
        }
    };
    for (name, f) in [
        ("compat alloc + fill + store, cxl, 32 x 2 MiB", &r.compat),
        ("the same, a store (publish) per chunk", &r.per_chunk),
        ("the same, 32 pages taken and published at once", &r.batched),
        ("memcpy 2 MiB, 1 thread (same run)", &r.memcpy),
    ] {
        t.row(vec![name.into(), f2(f.gbs), f2(f.p50_us), ratio(f)]);
    }
    match &r.adapter {
        Ok(a) => {
            t.row(vec![
                "adapters' way in Python: batched_alloc + numpy fill + batch_store, cxl, 32 x 2 MiB (x its numpy copy)".into(),
                f2(a.fill_store.gbs),
                f2(a.fill_store.p50_us),
                format!("{:.2} x", a.ratio()),
            ]);
            t.row(vec![
                "numpy copy of the same 2 MiB chunks (same script, in turns)".into(),
                f2(a.memcpy.gbs),
                f2(a.memcpy.p50_us),
                "-".into(),
            ]);
            t.row(vec![
                format!(
                    "one alloc (maru.MaruHandler.alloc), p99 {:.1} us",
                    a.alloc.p99_us
                ),
                "-".into(),
                f2(a.alloc.p50_us),
                "-".into(),
            ]);
        }
        Err(e) => t.row(vec![
            format!("adapters' way in Python: not measured: {e}"),
            "-".into(),
            "-".into(),
            "-".into(),
        ]),
    }
    t
}
