//! Writes in place (backend `cxl`): take pages of the engine's own regions, write each
//! chunk straight into the mapping (a GPU copies into it), publish or give the pages
//! back. And views of whole regions this host maps.

use super::args::{in_slice, opt_str};
use super::boundary::{check_not_null, ffi_guard};
use super::calls::{fill_out, hand_out, store_each};
use super::handler::{maru_handler_t, with_handler, with_handler_releasing};
use super::status::maru_status_t;
use crate::worker::{InPlaceInfo, RegionInfo};
use std::ffi::c_char;

/// A page of one of the engine's own regions, taken for writing a chunk in place
/// (backend `cxl`). `data` points to `capacity` bytes (one chunk) in this host's
/// writable mapping of the region, valid until the page is published or given back
/// (or the handler freed). `(region_id, page)` names the page in later calls;
/// `offset` is its byte offset in the region.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_page_t {
    pub region_id: u64,
    pub page: u64,
    pub offset: u64,
    pub data: *mut u8,
    pub capacity: usize,
}

/// A region this host maps (backend `cxl`): `len` bytes at `data`, `page_count`
/// pages of `page_size` bytes. `writable`: one of the engine's own regions (mapped
/// writable); otherwise another engine's, read-only. The memory stays mapped until the
/// handler is freed (`maru_handler_free` or `maru_handler_close`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_region_t {
    pub region_id: u64,
    pub data: *mut u8,
    pub len: usize,
    pub page_size: u64,
    pub page_count: u64,
    pub writable: bool,
}

fn region_of(r: &RegionInfo) -> maru_region_t {
    maru_region_t {
        region_id: r.region_id,
        data: r.ptr,
        len: r.len,
        page_size: r.page_size,
        page_count: (r.len as u64).checked_div(r.page_size).unwrap_or(0),
        writable: r.writable,
    }
}

fn locs(pages: &[maru_page_t]) -> Vec<(u64, u64)> {
    pages.iter().map(|p| (p.region_id, p.page)).collect()
}

/// Takes up to `n` pages of the engine's own regions for writing chunks in place
/// (backend `cxl`; `remote_cxl` returns `MARU_ERR_INVALID_ARGUMENT`: fill store
/// staging slots instead). `out[0..*got]` describes them (`out` must have room for
/// `n`). `*got` is at most `n` and at most 4096 (maru-server's batch limit, the
/// most pages one request takes): ask again for more. It is fewer than `n` when the
/// pool has no room (every page leased, pinned or taken, and no region to be had);
/// a larger `n` is never an error.
///
/// Limit: the caller holds at most half of its fair share of the pool taken at once
/// (maru-server's regions ÷ the storing tenants, ÷ its tenant's storing engines,
/// within `max_bytes`; one region before maru-server has told the share), counting
/// pages taken earlier and not yet published or given back; a take beyond it gets
/// fewer pages (0 once the limit is reached), so the engine's own stores keep room.
/// `route_key` picks the pool, as the request's first chunk key does for
/// `maru_store_batch` (NULL: the first pool's pick for "").
///
/// Write each chunk at `data`, then publish it with `maru_pages_publish` (only then
/// can it be found) or give the page back with `maru_pages_give_back`. A page taken is
/// the caller's: no store reuses it, no eviction takes it, its region is not given
/// back meanwhile. Each page is published only by its taker, and only while its
/// region is still the engine's.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_pages_take(
    h: *const maru_handler_t,
    n: usize,
    route_key: *const c_char,
    out: *mut maru_page_t,
    got: *mut usize,
) -> maru_status_t {
    fill_out(h, out, n, got, |call, dst| {
        let rk = opt_str(route_key, "route_key")?.unwrap_or("");
        if n == 0 {
            return Ok(0);
        }
        let pages = call.handler().take_in_place(n, rk)?;
        let to_c = |p: &InPlaceInfo| maru_page_t {
            region_id: p.region_id,
            page: p.page,
            offset: p.offset,
            data: p.ptr,
            capacity: p.capacity,
        };
        hand_out(call.shutting_down(), dst, pages, to_c, |pages| {
            let locs: Vec<(u64, u64)> = pages.iter().map(|p| (p.region_id, p.page)).collect();
            let _ = call.handler().give_back_in_place(&locs);
        })
    })
}

/// Publishes `n` pages written in place: `keys[i]` with the first `lens[i]` bytes of
/// `pages[i]` (only its `region_id` and `page` are read), the chunks of one request
/// in chain order, all taken with one route key. `published[i]` (the array may be
/// NULL) is true when the chunk is stored now or was already stored (by any engine;
/// its page then serves later stores), false when its region was lost while it was
/// written (nothing is published from a region no longer the engine's) or the pool is
/// unavailable. Afterwards the pages are no longer the caller's, whatever the outcome.
/// A page not taken by this handler (or already published or given back, or named
/// twice), an empty key or a length over the page's capacity returns
/// `MARU_ERR_INVALID_ARGUMENT`: nothing is published and the pages stay the caller's.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_pages_publish(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    pages: *const maru_page_t,
    lens: *const usize,
    n: usize,
    published: *mut bool,
) -> maru_status_t {
    store_each(h, keys, n, published, |call, ks| {
        let ps = in_slice(pages, n, "pages")?;
        let ls = in_slice(lens, n, "lens")?;
        Ok(call.handler().publish_in_place(ks, &locs(ps), ls)?)
    })
}

/// Gives back `n` pages taken with `maru_pages_take` and not published (only their
/// `region_id` and `page` are read): they serve later stores. Their `data` must not be
/// written any more. A page not held returns `MARU_ERR_INVALID_ARGUMENT` and none is
/// given back. Also after `maru_handler_shutdown` (until `maru_handler_free`): the
/// give-back succeeds as before.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_pages_give_back(
    h: *const maru_handler_t,
    pages: *const maru_page_t,
    n: usize,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler_releasing(h, |call| {
            let ps = in_slice(pages, n, "pages")?;
            call.handler().give_back_in_place(&locs(ps))?;
            Ok(())
        })
    })
}

/// The mappings of regions this host holds now (backend `cxl`; none on `remote_cxl`):
/// the engine's own regions (writable) and other engines' it has read from
/// (read-only), by region id. An own region that was also read in place (views) has a
/// second, read-only mapping, listed after its writable one: the `data` of a view lies
/// in it. `out[0..min(cap, *count)]` describes them; `*count` is how many there are (call
/// again with a larger `out` if it exceeds `cap`). `out` may be NULL when `cap` is 0.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_regions_list(
    h: *const maru_handler_t,
    out: *mut maru_region_t,
    cap: usize,
    count: *mut usize,
) -> maru_status_t {
    fill_out(h, out, cap, count, |call, dst| {
        let regions = call.handler().regions()?;
        for (d, r) in dst.iter_mut().zip(&regions) {
            *d = region_of(r);
        }
        Ok(regions.len())
    })
}

/// The region `region_id` as this host maps it: `*found` is false (and `*out`
/// untouched) when it maps no such region. An own region that was also read in place
/// has two mappings (see `maru_regions_list`): this returns its writable one
/// (`writable` true), never the read-only mapping the views of it point into. Its
/// memory stays mapped until the handler is freed, even if the region stops being the
/// engine's: write into an own region only into pages taken with `maru_pages_take`
/// and not yet published.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_region_view(
    h: *const maru_handler_t,
    region_id: u64,
    out: *mut maru_region_t,
    found: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(found);
        *found = false;
        check_not_null!(out);
        with_handler(h, |call| {
            if let Some(r) = call.handler().region_view(region_id)? {
                *out = region_of(&r);
                *found = true;
            }
            Ok(())
        })
    })
}
