//! Writes in place on `cxl` through the C ABI (`maru_pages_take`, the caller's copy
//! into the page, `maru_pages_publish`): what `maru.compat`'s `alloc` + fill + `store`
//! does, each byte moved once, by the caller. Beside it, memcpy of the same chunks
//! over the same amount of cold memory, measured in the same run, for the ratio.
//!
//! Two figures of 32 × 2 MiB per operation: chunk by chunk as `compat` does (take one
//! page, fill it, publish it: one publish round trip per chunk) and batched (take 32,
//! fill 32, publish 32). Each operation then removes its keys (one round trip), as a
//! full cache that evicts reuses its pages; a warm-up cycles through the region once
//! so that first touches of fresh pages are not measured.

use crate::harness::{run_clients, Bound, Fig, Rotor};
use crate::procs::{stack, Scratch};
use crate::report::{f2, Table};
use maru::ffi::{
    maru_handler_close, maru_handler_open, maru_handler_t, maru_page_t, maru_pages_publish,
    maru_pages_take, maru_remove_batch, maru_remove_result_t, maru_status_t,
};
use serde::Serialize;
use std::ffi::{c_char, CString};

const BATCH: usize = 32;
const CHUNK: usize = 2 << 20;
const REGION: usize = 256 << 20;

/// The figures of writes in place, and memcpy measured beside them.
#[derive(Debug, Clone, Serialize)]
pub struct InPlaceResult {
    /// Chunk by chunk, as compat's alloc + fill + store.
    pub per_chunk: Fig,
    /// 32 pages taken, filled and published at once.
    pub batched: Fig,
    pub memcpy: Fig,
}

struct Handler(*mut maru_handler_t);

impl Drop for Handler {
    fn drop(&mut self) {
        // SAFETY: a handler from maru_handler_open, closed once.
        let _ = unsafe { maru_handler_close(self.0) };
    }
}

// SAFETY: the C ABI documents the handler as thread-safe; it is freed only in Drop.
unsafe impl Send for Handler {}
// SAFETY: as above: the C ABI allows calls from several threads at once.
unsafe impl Sync for Handler {}

fn check(st: maru_status_t, what: &str) -> Result<(), String> {
    if st == maru_status_t::MARU_OK {
        return Ok(());
    }
    let msg = maru::ffi::last_error().map(|(_, m)| m).unwrap_or_default();
    Err(format!("{what}: {st:?}: {msg}"))
}

const NO_PAGE: maru_page_t = maru_page_t {
    region_id: 0,
    page: 0,
    offset: 0,
    data: std::ptr::null_mut(),
    capacity: 0,
};

impl Handler {
    fn take(&self, n: usize, route: &CString) -> Result<Vec<maru_page_t>, String> {
        let mut pages = vec![NO_PAGE; n];
        let mut got = 0usize;
        // SAFETY: `pages` has n entries; `got` is writable.
        check(
            unsafe { maru_pages_take(self.0, n, route.as_ptr(), pages.as_mut_ptr(), &mut got) },
            "maru_pages_take",
        )?;
        if got != n {
            return Err(format!("maru_pages_take gave {got} of {n} pages"));
        }
        Ok(pages)
    }

    fn publish(&self, keys: &[CString], pages: &[maru_page_t]) -> Result<(), String> {
        let kp: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
        let lens = vec![CHUNK; keys.len()];
        let mut ok = vec![false; keys.len()];
        // SAFETY: arrays of keys.len() entries.
        check(
            unsafe {
                maru_pages_publish(
                    self.0,
                    kp.as_ptr(),
                    pages.as_ptr(),
                    lens.as_ptr(),
                    keys.len(),
                    ok.as_mut_ptr(),
                )
            },
            "maru_pages_publish",
        )?;
        match ok.iter().filter(|o| !**o).count() {
            0 => Ok(()),
            n => Err(format!(
                "maru_pages_publish published {} of {}",
                keys.len() - n,
                keys.len()
            )),
        }
    }

    fn remove(&self, keys: &[CString]) -> Result<(), String> {
        let kp: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
        let mut res = vec![maru_remove_result_t::MARU_REMOVE_NOT_FOUND; keys.len()];
        // SAFETY: arrays of keys.len() entries; the route key is the first key.
        check(
            unsafe { maru_remove_batch(self.0, kp.as_ptr(), kp.len(), kp[0], res.as_mut_ptr()) },
            "maru_remove_batch",
        )
    }
}

/// Fills a page with the caller's copy (what the GPU's copy is in a runtime).
fn fill(page: &maru_page_t, src: *const u8) {
    // SAFETY: a taken page of `capacity` >= CHUNK bytes in the writable mapping, and a
    // source piece of CHUNK bytes inside the rotor.
    unsafe { std::ptr::copy_nonoverlapping(src, page.data, CHUNK) };
}

/// Runs the figures on a fresh cxl stack over the scratch pool.
pub fn run(s: &Scratch, secs: f64, rotate: usize) -> Result<InPlaceResult, String> {
    let rotate = rotate.max(CHUNK * BATCH * 2);
    let memcpy = crate::limits::memcpy(CHUNK, 1, secs, rotate / 2);
    let st = stack(s, false, &REGION.to_string(), &CHUNK.to_string())?;
    let cfg = crate::maru_io::handler_config(
        &st.server,
        "cxl",
        "bench-in-place",
        &s.key_file.display().to_string(),
    );
    let c = CString::new(cfg).map_err(|e| e.to_string())?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: a NUL-terminated config and a writable out pointer.
    check(
        unsafe { maru_handler_open(c.as_ptr(), &mut raw) },
        "maru_handler_open",
    )?;
    let h = std::sync::Arc::new(Handler(raw));
    let route = CString::new("in-place").map_err(|e| e.to_string())?;
    let figure = |batched: bool, tag: &'static str| -> Result<Fig, String> {
        let h = h.clone();
        let route = route.clone();
        let mut src = Rotor::new(rotate, CHUNK, 11);
        let mut op = move |i: usize| -> Result<u64, String> {
            let keys: Vec<CString> = (0..BATCH)
                .map(|j| CString::new(format!("{tag}-{i}-{j}")).unwrap_or_default())
                .collect();
            if batched {
                let pages = h.take(BATCH, &route)?;
                for p in &pages {
                    fill(p, src.next_ptr());
                }
                h.publish(&keys, &pages)?;
            } else {
                for k in &keys {
                    let page = h.take(1, &route)?;
                    fill(&page[0], src.next_ptr());
                    h.publish(std::slice::from_ref(k), &page)?;
                }
            }
            h.remove(&keys)?;
            Ok((BATCH * CHUNK) as u64)
        };
        // Once through the region (and one more), unmeasured: every page touched.
        for i in 0..REGION / (CHUNK * BATCH) + 2 {
            op((1 << 32) + i)?;
        }
        run_clients(
            vec![op],
            Bound {
                secs,
                max_ops: usize::MAX,
            },
        )
    };
    let per_chunk = figure(false, "c")?;
    let batched = figure(true, "b")?;
    drop(h);
    drop(st);
    Ok(InPlaceResult {
        per_chunk,
        batched,
        memcpy,
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
        ("compat alloc + fill + store, cxl, 32 x 2 MiB", &r.per_chunk),
        ("the same, 32 pages taken and published at once", &r.batched),
        ("memcpy 2 MiB, 1 thread (same run)", &r.memcpy),
    ] {
        t.row(vec![name.into(), f2(f.gbs), f2(f.p50_us), ratio(f)]);
    }
    t
}
