//! The handler C API: open a handler from JSON, store/load/exists by key (single and
//! batched, with a route key), stats as JSON, close.

use super::boundary::{check_not_null, ffi_guard, FfiError};
use super::status::maru_status_t;
use crate::worker::{Handler, Loaded, WorkerError};
use std::ffi::{c_char, CStr};

/// An open handler. Create with `maru_handler_open`, free with `maru_handler_close`.
/// Thread-safe: calls from several threads may run at once.
#[allow(non_camel_case_types)]
pub struct maru_handler_t {
    pub(super) inner: Handler,
}

fn status_of(e: &WorkerError) -> maru_status_t {
    match e {
        WorkerError::Config(_) => maru_status_t::MARU_ERR_CONFIG,
        WorkerError::InvalidArgument(_) => maru_status_t::MARU_ERR_INVALID_ARGUMENT,
        WorkerError::Unavailable(_) => maru_status_t::MARU_ERR_UNAVAILABLE,
        WorkerError::Refused(_) => maru_status_t::MARU_ERR_REFUSED,
        WorkerError::NoSpace(_) => maru_status_t::MARU_ERR_NO_SPACE,
        WorkerError::Timeout(_) => maru_status_t::MARU_ERR_TIMEOUT,
        WorkerError::Transport(_) => maru_status_t::MARU_ERR_IO,
        WorkerError::Busy(_) => maru_status_t::MARU_ERR_BUSY,
        WorkerError::Closed => maru_status_t::MARU_ERR_CLOSED,
    }
}

pub(super) fn ffi_err(e: WorkerError) -> FfiError {
    (status_of(&e), e.to_string())
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub(super) unsafe fn opt_str<'a>(
    p: *const c_char,
    name: &str,
) -> Result<Option<&'a str>, FfiError> {
    if p.is_null() {
        return Ok(None);
    }
    CStr::from_ptr(p).to_str().map(Some).map_err(|_| {
        (
            maru_status_t::MARU_ERR_INVALID_ARGUMENT,
            format!("argument `{name}` is not UTF-8"),
        )
    })
}

/// # Safety
/// `p` is a NUL-terminated string (checked non-NULL by the caller).
pub(super) unsafe fn req_str<'a>(p: *const c_char, name: &str) -> Result<&'a str, FfiError> {
    opt_str(p, name)?.ok_or((
        maru_status_t::MARU_ERR_NULL_ARGUMENT,
        format!("argument `{name}` is NULL"),
    ))
}

/// # Safety
/// `h` is a live handler from `maru_handler_open`.
pub(super) unsafe fn handler<'a>(h: *const maru_handler_t) -> &'a Handler {
    &(*h).inner
}

/// Opens a handler from a JSON configuration (see docs/configuration.md): backend
/// (`remote_cxl` or `cxl`), `server_url`, `engine_id`, namespace, layout, agent key
/// file, transport, staging slot counts, timeout. On success `*out` is the handler.
/// A configuration error returns `MARU_ERR_CONFIG` at once (do not retry);
/// `MARU_ERR_UNAVAILABLE` means no pool answered.
///
/// # Safety
/// `config_json` is a NUL-terminated string; `out` points to writable storage.
#[no_mangle]
pub unsafe extern "C" fn maru_handler_open(
    config_json: *const c_char,
    out: *mut *mut maru_handler_t,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(config_json, out);
        let cfg = req_str(config_json, "config_json")?;
        let h = Handler::open(cfg).map_err(ffi_err)?;
        *out = Box::into_raw(Box::new(maru_handler_t { inner: h }));
        Ok(())
    })
}

/// Closes the handler's sessions and frees it. NULL is ignored. The pointer must not
/// be used afterwards.
///
/// # Safety
/// `h` is NULL or a handler from `maru_handler_open` not yet closed.
#[no_mangle]
pub unsafe extern "C" fn maru_handler_close(h: *mut maru_handler_t) -> maru_status_t {
    ffi_guard(|| {
        if h.is_null() {
            return Ok(());
        }
        let b = Box::from_raw(h);
        b.inner.close().map_err(ffi_err)
    })
}

/// Stores `len` bytes under `key`. `route_key` (may be NULL: the key itself) picks the
/// pool: pass the request's first chunk key for every chunk of a request. `*stored`
/// (may be NULL) is false when the chunk was skipped (no free staging slot, pool
/// unavailable), true when it is stored or was already present.
///
/// # Safety
/// `key`/`route_key` are NUL-terminated strings; `data` points to `len` bytes.
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
        check_not_null!(h, key, data);
        let k = req_str(key, "key")?;
        let rk = opt_str(route_key, "route_key")?;
        let d = std::slice::from_raw_parts(data, len);
        let ok = handler(h).store(k, d, rk).map_err(ffi_err)?;
        if !stored.is_null() {
            *stored = ok;
        }
        Ok(())
    })
}

/// Loads `key` into `buf` (capacity `cap`); `*out_len` is its length. A miss returns
/// `MARU_ERR_NOT_FOUND`; a buffer too small returns `MARU_ERR_BUFFER_TOO_SMALL` with
/// the needed length in `*out_len`.
///
/// # Safety
/// `key`/`route_key` are NUL-terminated strings; `buf` points to `cap` writable bytes.
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
        check_not_null!(h, key, buf, out_len);
        let k = req_str(key, "key")?;
        let rk = opt_str(route_key, "route_key")?;
        let mut bufs = [buffer_of(buf, cap)];
        let got = handler(h)
            .load_into(&[k.to_string()], &mut bufs, rk)
            .map_err(ffi_err)?;
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
}

/// The caller's buffer as a slice (empty for NULL).
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes not aliased during the call.
unsafe fn buffer_of<'a>(buf: *mut u8, cap: usize) -> &'a mut [u8] {
    if buf.is_null() || cap == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(buf, cap)
    }
}

/// Sets `*found` to whether `key` is stored (published) in its pool.
///
/// # Safety
/// `key`/`route_key` are NUL-terminated strings; `found` is writable.
#[no_mangle]
pub unsafe extern "C" fn maru_exists(
    h: *const maru_handler_t,
    key: *const c_char,
    route_key: *const c_char,
    found: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, key, found);
        let k = req_str(key, "key")?.to_string();
        let rk = opt_str(route_key, "route_key")?;
        *found = handler(h)
            .exists_batch(&[k], rk)
            .map_err(ffi_err)?
            .first()
            .copied()
            .unwrap_or(false);
        Ok(())
    })
}

/// # Safety
/// `keys` points to `n` NUL-terminated strings.
pub(super) unsafe fn keys_of(
    keys: *const *const c_char,
    n: usize,
) -> Result<Vec<String>, FfiError> {
    let ks = std::slice::from_raw_parts(keys, n);
    ks.iter()
        .enumerate()
        .map(|(i, &k)| req_str(k, &format!("keys[{i}]")).map(str::to_string))
        .collect()
}

/// Stores `n` chunks of one request (keys[i], datas[i], lens[i]); `stored[i]` (the
/// array may be NULL) as for `maru_store`.
///
/// # Safety
/// Each array has `n` valid entries.
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
    ffi_guard(|| {
        check_not_null!(h, keys, datas, lens);
        let ks = keys_of(keys, n)?;
        let ds = std::slice::from_raw_parts(datas, n);
        let ls = std::slice::from_raw_parts(lens, n);
        let mut items = Vec::with_capacity(n);
        for i in 0..n {
            super::boundary::require_non_null(ds[i], &format!("datas[{i}]"))?;
            items.push((ks[i].as_str(), std::slice::from_raw_parts(ds[i], ls[i])));
        }
        let rk = opt_str(route_key, "route_key")?;
        let ok = handler(h).store_batch(&items, rk).map_err(ffi_err)?;
        if !stored.is_null() {
            std::slice::from_raw_parts_mut(stored, n).copy_from_slice(&ok);
        }
        Ok(())
    })
}

/// Loads `n` chunks of one request into `bufs[i]` (capacity `caps[i]`); `lens[i]` is
/// each length (0 on a miss) and `found[i]` whether it was loaded. A chunk larger than
/// its buffer fails the call with `MARU_ERR_BUFFER_TOO_SMALL` (its `lens[i]` says the
/// size).
///
/// # Safety
/// Each array has `n` valid entries; `bufs[i]` points to `caps[i]` writable bytes.
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
    ffi_guard(|| {
        check_not_null!(h, keys, bufs, caps, lens, found);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let (bs, cs) = (
            std::slice::from_raw_parts(bufs, n),
            std::slice::from_raw_parts(caps, n),
        );
        let mut dst: Vec<&mut [u8]> = (0..n).map(|i| buffer_of(bs[i], cs[i])).collect();
        let got = handler(h).load_into(&ks, &mut dst, rk).map_err(ffi_err)?;
        let (ls, fs) = (
            std::slice::from_raw_parts_mut(lens, n),
            std::slice::from_raw_parts_mut(found, n),
        );
        let mut too_small = None;
        for (i, g) in got.into_iter().enumerate() {
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

/// Writes the handler's statistics as JSON (NUL-terminated) into `buf` of `cap` bytes;
/// `*out_len` is the JSON's length without the NUL. Too small a buffer returns
/// `MARU_ERR_BUFFER_TOO_SMALL` (call again with `*out_len + 1` bytes).
///
/// # Safety
/// `buf` points to `cap` writable bytes (may be NULL when `cap` is 0).
#[no_mangle]
pub unsafe extern "C" fn maru_stats_json(
    h: *const maru_handler_t,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, out_len);
        let s = handler(h).stats().to_string();
        *out_len = s.len();
        if buf.is_null() || cap < s.len() + 1 {
            return Err((
                maru_status_t::MARU_ERR_BUFFER_TOO_SMALL,
                format!("stats need {} bytes", s.len() + 1),
            ));
        }
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
        Ok(())
    })
}

/// Sets `*out` to the pools' chunk (page) size: the largest chunk `maru_store` takes.
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn maru_chunk_size(h: *const maru_handler_t, out: *mut u64) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, out);
        *out = handler(h).chunk_size().ok_or((
            maru_status_t::MARU_ERR_UNAVAILABLE,
            "no pool is available".to_string(),
        ))?;
        Ok(())
    })
}
