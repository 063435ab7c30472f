//! Views (backend `cxl`): chunks read in place from this host's mapping of the CXL
//! memory, with no copy. Acquire, read, release.

use super::args::{in_slice, opt_str, out_slice};
use super::boundary::ffi_guard;
use super::calls::keyed;
use super::handler::{maru_handler_t, with_handler_releasing};
use super::status::maru_status_t;
use crate::worker::WorkerError;
use std::ffi::c_char;

/// A chunk read in place from this host's mapping of the CXL memory (backend `cxl`).
/// `data` points to `len` bytes, read-only, valid until `maru_views_release` (or
/// `maru_handler_free`) and at most `valid_ms` milliseconds from the acquire: the view holds a
/// lease that keeps the chunk's page from being reused, and the lease ends by itself
/// then. maru-server starts the lease's clock while the call is on its way, so count
/// `valid_ms` from just before calling `maru_views_acquire`, not from its return.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_view_t {
    pub id: u64,
    pub data: *const u8,
    pub len: usize,
    pub valid_ms: u64,
}

const NO_VIEW: maru_view_t = maru_view_t {
    id: 0,
    data: std::ptr::null(),
    len: 0,
    valid_ms: 0,
};

/// Views of `n` chunks of one request in place, with no copy (backend `cxl` only;
/// `remote_cxl` returns `MARU_ERR_INVALID_ARGUMENT`: load into slots instead).
/// `found[i]` says whether `views[i]` holds chunk `keys[i]`; release every found view
/// with `maru_views_release` as soon as its bytes are used (e.g. copied to the GPU).
/// `route_key`: as for `maru_load_batch` (NULL: the first key).
///
/// Ownership: `views` and `found` are the caller's; the bytes a view points to belong
/// to the handler. Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_views_acquire(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    views: *mut maru_view_t,
    found: *mut bool,
) -> maru_status_t {
    keyed(h, keys, n, |call, ks| {
        let vs = out_slice(views, n, "views")?;
        let fs = out_slice(found, n, "found")?;
        let rk = opt_str(route_key, "route_key")?;
        let got = call.handler().acquire_views(&ks, rk)?;
        let ids: Vec<u64> = got.iter().flatten().map(|v| v.id).collect();
        if call.shutting_down() {
            // The mapping goes with the sessions: never hand a view of it out now.
            let _ = call.handler().release_views(&ids);
            return Err(WorkerError::Closed.into());
        }
        // Every entry is written: one the handler did not answer is a miss.
        let mut got = got.into_iter();
        for (v, f) in vs.iter_mut().zip(fs.iter_mut()) {
            (*v, *f) = match got.next().flatten() {
                Some(g) => (
                    maru_view_t {
                        id: g.id,
                        data: g.ptr,
                        len: g.len,
                        valid_ms: g.valid_ms,
                    },
                    true,
                ),
                None => (NO_VIEW, false),
            };
        }
        Ok(())
    })
}

/// Ends views: their leases go back and their `data` must not be read any more. Ids
/// already released, and 0 (the id of a view not found), are ignored: a view's lease
/// may also have ended by itself. Also after `maru_handler_shutdown` (until
/// `maru_handler_free`): the release succeeds as before.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_views_release(
    h: *const maru_handler_t,
    ids: *const u64,
    n: usize,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler_releasing(h, |call| {
            call.handler().release_views(in_slice(ids, n, "ids")?)?;
            Ok(())
        })
    })
}
