//! `maru_op_t`: slot stores and loads that run on the handler's executor threads while
//! the caller goes on. Submit, poll or wait, read the results, free.

use super::args::{in_slice, keys_of, opt_str, out_slice};
use super::boundary::{check_not_null, ffi_guard, require_non_null, FfiError};
use super::handler::{maru_handler_t, with_handler, Call};
use super::slots::write_loaded;
use super::status::maru_status_t;
use crate::worker::{OpHandle, OpOutput, WorkerError};
use std::ffi::c_char;
use std::time::Duration;

/// An asynchronous operation from `maru_submit_store_slots` or
/// `maru_submit_load_slots`. Poll or wait on it, read its results, then free it with
/// `maru_op_free`.
///
/// Threads: `maru_op_poll`, `maru_op_wait` and `maru_op_results` may be called from
/// any thread, also concurrently with each other (several threads may wait on one
/// operation). `maru_op_free` must be the last call on it. An operation is
/// independent of its handler's memory: it may be freed after the handler.
#[allow(non_camel_case_types)]
pub struct maru_op_t {
    op: OpHandle,
    n: usize,
}

/// `maru_store_slots` without waiting: `*op` is the running operation. The arguments
/// are copied; the slots are lent to the operation until it finishes (releasing them
/// meanwhile returns `MARU_ERR_BUSY`). Read the per-chunk results with
/// `maru_op_results` (`flags[i]` = stored).
///
/// Ownership: the arrays are read during the call only; `*op` is the caller's until
/// `maru_op_free`. Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_submit_store_slots(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    ids: *const u64,
    lens: *const usize,
    n: usize,
    route_key: *const c_char,
    op: *mut *mut maru_op_t,
) -> maru_status_t {
    submit(h, keys, n, op, |call, ks| {
        let is = in_slice(ids, n, "ids")?.to_vec();
        let ls = in_slice(lens, n, "lens")?.to_vec();
        let rk = opt_str(route_key, "route_key")?.map(str::to_string);
        Ok(call.handler().submit_store_slots(ks, is, ls, rk)?)
    })
}

/// `maru_load_slots` without waiting; results with `maru_op_results` (`flags[i]` =
/// found, `lens[i]` = length).
///
/// Ownership: as `maru_submit_store_slots`. Threads: any, concurrently with other
/// calls.
#[no_mangle]
pub unsafe extern "C" fn maru_submit_load_slots(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    ids: *const u64,
    n: usize,
    route_key: *const c_char,
    op: *mut *mut maru_op_t,
) -> maru_status_t {
    submit(h, keys, n, op, |call, ks| {
        let is = in_slice(ids, n, "ids")?.to_vec();
        let rk = opt_str(route_key, "route_key")?.map(str::to_string);
        Ok(call.handler().submit_load_slots(ks, is, rk)?)
    })
}

/// Starts an operation on handler `h` over `keys[0..n]` (checked after `op`) with
/// `start`; `*op` is the operation once it started.
unsafe fn submit(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    op: *mut *mut maru_op_t,
    start: impl FnOnce(&Call, Vec<String>) -> Result<OpHandle, FfiError>,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            check_not_null!(op);
            // Owned: the operation runs on after this call returned.
            let ks = keys_of(keys, n)?.into_iter().map(str::to_string).collect();
            let handle = start(call, ks)?;
            *op = Box::into_raw(Box::new(maru_op_t { op: handle, n }));
            Ok(())
        })
    })
}

fn finished(r: Option<Result<OpOutput, WorkerError>>) -> Result<(), FfiError> {
    match r {
        None => Err((
            maru_status_t::MARU_PENDING,
            "the operation has not finished yet".into(),
        )),
        Some(Ok(_)) => Ok(()),
        Some(Err(e)) => Err(e.into()),
    }
}

/// `MARU_OK` when the operation finished successfully, `MARU_PENDING` while it runs,
/// or the operation's own error status (its message in `maru_last_error()`).
/// Threads: any (see `maru_op_t`).
#[no_mangle]
pub unsafe extern "C" fn maru_op_poll(op: *const maru_op_t) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(op);
        finished((*op).op.poll())
    })
}

/// Waits up to `timeout_ms` for the operation: the same results as `maru_op_poll`
/// (`MARU_PENDING` when the time passed first). Threads: any, also several at once
/// (see `maru_op_t`).
#[no_mangle]
pub unsafe extern "C" fn maru_op_wait(op: *const maru_op_t, timeout_ms: u32) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(op);
        finished((*op).op.wait(Duration::from_millis(timeout_ms.into())))
    })
}

/// The per-chunk results of a finished operation: `flags[i]` (stored for a store,
/// found for a load) and `lens[i]` (loaded length; may be NULL for a store) for the
/// `n` chunks it was submitted with (`n` must be that count). `MARU_PENDING` while it
/// runs; the operation's error when it failed.
///
/// Ownership: `flags` and `lens` are the caller's. Threads: any (see `maru_op_t`).
#[no_mangle]
pub unsafe extern "C" fn maru_op_results(
    op: *const maru_op_t,
    flags: *mut bool,
    lens: *mut usize,
    n: usize,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(op);
        let o = &*op;
        if n != o.n {
            return Err((
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                format!("the operation has {} chunks, not {n}", o.n),
            ));
        }
        let fs = out_slice(flags, n, "flags")?;
        match o.op.poll() {
            Some(Ok(OpOutput::Stored(ok))) => {
                fs.copy_from_slice(&ok);
                if !lens.is_null() {
                    out_slice(lens, n, "lens")?.fill(0);
                }
                Ok(())
            }
            Some(Ok(OpOutput::Loaded(got))) => {
                if n > 0 {
                    require_non_null(lens, "lens")?;
                }
                write_loaded(&got, out_slice(lens, n, "lens")?, fs);
                Ok(())
            }
            other => finished(other),
        }
    })
}

/// Frees an operation. One still running goes on to its end (its slots come back to
/// the caller then); only its results are dropped. NULL is ignored. Threads: once,
/// after every other call on `op` returned.
#[no_mangle]
pub unsafe extern "C" fn maru_op_free(op: *mut maru_op_t) {
    ffi_guard_value((), || {
        if !op.is_null() {
            drop(Box::from_raw(op));
        }
    })
}

use super::boundary::ffi_guard_value;
