//! Chunks by key, copied through the caller's buffers: store, load, exists (single and
//! batched), remove, pin and unpin.
//!
//! Every function here takes the `route_key` of the request: the pool is chosen by
//! it, so pass the request's first chunk key for every chunk of a request. NULL means
//! the first key of this call (for the single-key calls, the key itself).

use super::args::{buffer_of, chunks_of, in_slice, load_outputs, opt_str, req_str};
use super::boundary::{check_not_null, ffi_guard, require_non_null};
use super::calls::{answer_each_key, keyed, store_each};
use super::handler::{maru_handler_t, with_handler};
use super::status::maru_status_t;
use crate::wire::meta::RemoveResult;
use crate::worker::Loaded;
use std::ffi::c_char;

/// Stores `len` bytes of `data` under `key`. `*stored` (may be NULL) is true when the
/// chunk is stored now or was already stored (by this or another engine: its bytes
/// are there either way), false when it was skipped. A skip is not an error (the call
/// returns `MARU_OK`); the engine recomputes that chunk later if it needs it. A chunk
/// is skipped when:
/// - no store staging slot frees up in time (`remote_cxl`);
/// - its pool is unavailable (maru-server out of reach, or the session lost until a
///   new one opens);
/// - the pool has no page for it: it is full, every page of this engine's regions is
///   leased, pinned or being written, and no region is to be had;
/// - it waits for a region: the pool is full and the region it gets (one another
///   engine gives back for its fair share) has not come within the call;
/// - its bytes could not be written by `timeout_ms` (an agent that does not answer,
///   a transfer that failed, a region taken whose agent did not map it);
/// - its region was lost, or its memory node rebooted, before it was published.
///
/// Each skip's reason is counted in `maru_stats_json`'s `total.skipped`: `no_region`
/// (no region to be had, or none came within the call, and nothing of the engine's
/// own to evict), `no_slot` (no free staging slot), `pool_unavailable` (maru-server
/// away, or the session lost), `max_bytes` (the engine's `max_bytes` reached and
/// nothing to evict); each reason logs one WARN line per 10 s. An agent that does
/// not answer, or a region that could not be made usable, is named in a warning of
/// the log, at most one line per cause and agent every 10 s.
///
/// Ownership: `key`, `data`, `route_key` are read during the call only.
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_store(
    h: *const maru_handler_t,
    key: *const c_char,
    data: *const u8,
    len: usize,
    route_key: *const c_char,
    stored: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            check_not_null!(key);
            let k = req_str(key, "key")?;
            let rk = opt_str(route_key, "route_key")?;
            let d = in_slice(data, len, "data")?;
            let ok = call.handler().store(k, d, rk)?;
            if !stored.is_null() {
                *stored = ok;
            }
            Ok(())
        })
    })
}

/// Stores `n` chunks of one request: `keys[i]` gets `lens[i]` bytes of `datas[i]`.
/// `stored[i]` (the array may be NULL) as for `maru_store`. `n` may be 0 (the
/// arrays may then be NULL).
///
/// Ownership: as `maru_store`. Threads: any, concurrently with other calls on the
/// handler.
#[no_mangle]
pub unsafe extern "C" fn maru_store_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    datas: *const *const u8,
    lens: *const usize,
    n: usize,
    route_key: *const c_char,
    stored: *mut bool,
) -> maru_status_t {
    store_each(h, keys, n, stored, |call, ks| {
        let items: Vec<(&str, &[u8])> =
            ks.iter().copied().zip(chunks_of(datas, lens, n)?).collect();
        let rk = opt_str(route_key, "route_key")?;
        Ok(call.handler().store_batch(&items, rk)?)
    })
}

/// Loads `key` into `buf` (capacity `cap`); `*out_len` is its length. A miss returns
/// `MARU_ERR_NOT_FOUND`; too small a buffer returns `MARU_ERR_BUFFER_TOO_SMALL` with
/// the length needed in `*out_len` (nothing is written to `buf` then).
///
/// Ownership: `buf` (`cap` writable bytes) and `out_len` are the caller's.
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_load(
    h: *const maru_handler_t,
    key: *const c_char,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
    route_key: *const c_char,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            check_not_null!(key, out_len);
            if cap > 0 {
                require_non_null(buf, "buf")?;
            }
            let k = req_str(key, "key")?;
            let rk = opt_str(route_key, "route_key")?;
            let mut bufs = [buffer_of(buf, cap)];
            let got = call.handler().load_into(&[k], &mut bufs, rk)?;
            match got.first().copied().unwrap_or(Loaded::Miss) {
                Loaded::Miss => Err((
                    maru_status_t::MARU_ERR_NOT_FOUND,
                    format!("key {k} not found"),
                )),
                Loaded::Bytes(n) => {
                    *out_len = n;
                    Ok(())
                }
                Loaded::TooSmall(n) => {
                    *out_len = n;
                    Err((
                        maru_status_t::MARU_ERR_BUFFER_TOO_SMALL,
                        format!("key {k} has {n} bytes; the buffer holds {cap}"),
                    ))
                }
            }
        })
    })
}

/// Loads `n` chunks of one request into `bufs[i]` (capacity `caps[i]`). Every chunk
/// found is loaded, also one after a miss: `found` may have holes (a chunk evicted
/// since the lookup, say). A runtime that caches prefixes uses the leading run of
/// `found` (the chunks after a miss are of no use to it without the missing one; to
/// move none of them, load only the leading run of `maru_exists_batch`). On return,
/// whatever the status, every `found[i]` and `lens[i]` is written: `found[i]` true
/// and `lens[i]` its length where the chunk is in `bufs[i]`; otherwise `found[i]`
/// false and `lens[i]` 0, except for a chunk larger than its buffer, whose `lens[i]`
/// is the length it needs. Such a chunk makes the call return
/// `MARU_ERR_BUFFER_TOO_SMALL`, the other chunks being loaded as usual.
///
/// Ownership: `bufs[i]` (`caps[i]` writable bytes), `lens`, `found` are the caller's.
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_load_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    bufs: *const *mut u8,
    caps: *const usize,
    lens: *mut usize,
    found: *mut bool,
    n: usize,
    route_key: *const c_char,
) -> maru_status_t {
    keyed(h, keys, n, |call, ks| {
        let rk = opt_str(route_key, "route_key")?;
        let bs = in_slice(bufs, n, "bufs")?;
        let cs = in_slice(caps, n, "caps")?;
        let (ls, fs) = load_outputs(lens, found, n)?;
        let mut dst: Vec<&mut [u8]> = (0..n).map(|i| buffer_of(bs[i], cs[i])).collect();
        let got = call.handler().load_into(&ks, &mut dst, rk)?;
        let mut too_small = None;
        for (i, g) in got.into_iter().enumerate().take(n) {
            (fs[i], ls[i]) = match g {
                Loaded::Miss => (false, 0),
                Loaded::Bytes(len) => (true, len),
                Loaded::TooSmall(len) => {
                    too_small.get_or_insert(i);
                    (false, len)
                }
            };
        }
        match too_small {
            Some(i) => Err((
                maru_status_t::MARU_ERR_BUFFER_TOO_SMALL,
                format!(
                    "chunk {} has {} bytes; bufs[{i}] holds {}",
                    ks[i], ls[i], cs[i]
                ),
            )),
            None => Ok(()),
        }
    })
}

/// Sets `*found` to whether `key` is stored (published, complete) in its pool.
///
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_exists(
    h: *const maru_handler_t,
    key: *const c_char,
    route_key: *const c_char,
    found: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            check_not_null!(key, found);
            let k = req_str(key, "key")?;
            let rk = opt_str(route_key, "route_key")?;
            *found = call
                .handler()
                .exists_batch(&[k], rk)?
                .first()
                .copied()
                .unwrap_or(false);
            Ok(())
        })
    })
}

/// Sets `found_out[i]` to whether `keys[i]` is stored, for `n` keys of one request
/// in one round trip.
///
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_exists_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    found_out: *mut bool,
) -> maru_status_t {
    answer_each_key(
        h,
        keys,
        n,
        route_key,
        found_out,
        "found_out",
        |call, ks, rk| call.handler().exists_batch(ks, rk),
        |found| found,
    )
}

/// What `maru_remove_batch` did with one key.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum maru_remove_result_t {
    /// Unpublished; its page is free for this engine's next stores.
    MARU_REMOVED = 0,
    /// Not stored (or its pool is unavailable now).
    MARU_REMOVE_NOT_FOUND = 1,
    /// Refused: another engine stored it (or maru-server's keeper holds it).
    MARU_REMOVE_NOT_OWNER = 2,
    /// Refused: a reader holds a lease on it now; try again later.
    MARU_REMOVE_LEASED = 3,
    /// Refused: an engine pins it (`maru_pin_batch`) until it unpins it.
    MARU_REMOVE_PINNED = 4,
}

/// Unpublishes `n` keys of one request that this engine stored; `results[i]` says
/// what happened to `keys[i]`.
///
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_remove_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    results: *mut maru_remove_result_t,
) -> maru_status_t {
    answer_each_key(
        h,
        keys,
        n,
        route_key,
        results,
        "results",
        |call, ks, rk| call.handler().remove_batch(ks, rk),
        |r| match r {
            RemoveResult::Removed => maru_remove_result_t::MARU_REMOVED,
            RemoveResult::NotFound => maru_remove_result_t::MARU_REMOVE_NOT_FOUND,
            RemoveResult::NotOwner => maru_remove_result_t::MARU_REMOVE_NOT_OWNER,
            RemoveResult::Leased => maru_remove_result_t::MARU_REMOVE_LEASED,
            RemoveResult::Pinned => maru_remove_result_t::MARU_REMOVE_PINNED,
        },
    )
}

/// Pins `n` keys of one request: `pinned[i]` says whether `keys[i]` was found and is
/// pinned now. A pinned key is neither evicted nor removed (by any engine) until this
/// handler unpins it (`maru_unpin_batch`) or closes, or its memory is lost (the memory
/// node rebooted, its region went back). Pins count: two pins need two unpins.
///
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_pin_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    pinned: *mut bool,
) -> maru_status_t {
    pin_ffi(h, keys, n, route_key, pinned, true)
}

/// Drops one of this handler's pins of each of `n` keys: `unpinned[i]` says whether it
/// held one of `keys[i]`.
///
/// Threads: any, concurrently with other calls on the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_unpin_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    unpinned: *mut bool,
) -> maru_status_t {
    pin_ffi(h, keys, n, route_key, unpinned, false)
}

unsafe fn pin_ffi(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    out: *mut bool,
    pin: bool,
) -> maru_status_t {
    answer_each_key(
        h,
        keys,
        n,
        route_key,
        out,
        if pin { "pinned" } else { "unpinned" },
        |call, ks, rk| call.handler().pin_batch(ks, rk, pin),
        |held| held,
    )
}
