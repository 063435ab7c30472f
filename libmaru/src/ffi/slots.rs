//! The zero-copy C API: staging slots the runtime fills or reads in place (with its
//! own GPU copy kernel), synchronous and asynchronous stores from slots and loads into
//! slots, batched exists, and the memory hook that registers the staging buffer with
//! the GPU driver.

use super::boundary::{check_not_null, ffi_guard, require_non_null, FfiError};
use super::handler::{ffi_err, handler, keys_of, maru_handler_t, opt_str};
use super::status::maru_status_t;
use crate::worker::hook::{RegisterFn, UnregisterFn};
use crate::worker::{set_memory_hook, MemoryHook, OpHandle, OpOutput, SlotPool};
use std::ffi::{c_char, c_void};
use std::time::Duration;

/// The pool a staging slot comes from: loads and stores have their own slots, sized
/// independently (`load_slots`, `store_slots` in the configuration).
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum maru_slot_pool_t {
    MARU_SLOT_LOAD = 0,
    MARU_SLOT_STORE = 1,
}

/// One staging slot held by the caller. `data` points to `capacity` bytes (one chunk)
/// inside the handler's staging buffer, valid until the slot is released or the
/// handler is closed. `id` names the slot in later calls; ids are never reused.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_slot_t {
    pub id: u64,
    pub data: *mut u8,
    pub capacity: usize,
}

/// An asynchronous operation. Poll or wait on it, read its results, then free it
/// with `maru_op_free`.
#[allow(non_camel_case_types)]
pub struct maru_op_t {
    op: OpHandle,
    n: usize,
}

fn pool_of(raw: u32) -> Result<SlotPool, FfiError> {
    match raw {
        x if x == maru_slot_pool_t::MARU_SLOT_LOAD as u32 => Ok(SlotPool::Load),
        x if x == maru_slot_pool_t::MARU_SLOT_STORE as u32 => Ok(SlotPool::Store),
        _ => Err((
            maru_status_t::MARU_ERR_INVALID_ARGUMENT,
            format!("pool {raw} is neither MARU_SLOT_LOAD (0) nor MARU_SLOT_STORE (1)"),
        )),
    }
}

/// # Safety
/// `p` points to `n` readable values (checked non-NULL by the caller).
unsafe fn slice_of<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if n == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(p, n)
    }
}

/// Takes between 1 and `n` staging slots of `pool` (a `maru_slot_pool_t` value),
/// waiting up to `timeout_ms` for at least one; `out[0..*got]` describes them. No free
/// slot within the timeout returns `MARU_ERR_NO_SPACE` (release slots, or raise
/// `load_slots`/`store_slots`). Fill a store slot or read a loaded slot in place, then
/// give it back with `maru_slots_release`.
///
/// # Safety
/// `out` points to `n` writable `maru_slot_t`; `got` is writable.
#[no_mangle]
pub unsafe extern "C" fn maru_slots_acquire(
    h: *const maru_handler_t,
    pool: u32,
    n: usize,
    timeout_ms: u32,
    out: *mut maru_slot_t,
    got: *mut usize,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, out, got);
        *got = 0;
        let pool = pool_of(pool)?;
        let slots = handler(h)
            .acquire_slots(pool, n, Duration::from_millis(timeout_ms.into()))
            .map_err(ffi_err)?;
        let dst = std::slice::from_raw_parts_mut(out, n);
        for (d, s) in dst.iter_mut().zip(&slots) {
            *d = maru_slot_t {
                id: s.id,
                data: s.ptr,
                capacity: s.capacity,
            };
        }
        *got = slots.len();
        Ok(())
    })
}

/// Gives slots back to their pools. A slot lent to an operation still running is
/// refused with `MARU_ERR_BUSY` (nothing is released then). An id libmaru already
/// took back (after a transfer whose outcome was unknown) is accepted and ignored, so
/// releasing every slot after every call is always right.
///
/// # Safety
/// `ids` points to `n` values.
#[no_mangle]
pub unsafe extern "C" fn maru_slots_release(
    h: *const maru_handler_t,
    ids: *const u64,
    n: usize,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, ids);
        handler(h).release_slots(slice_of(ids, n)).map_err(ffi_err)
    })
}

/// Stores `lens[i]` bytes of slot `ids[i]` under `keys[i]` for `n` chunks of one
/// request (`route_key`: NULL for the first key). On `remote_cxl` the WRITE goes from
/// the slot itself: no copy. `stored[i]` (the array may be NULL) is true when the chunk
/// is stored or was already present. The slots stay the caller's (release them).
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `ids`, `lens` (and `stored`) `n` values.
#[no_mangle]
pub unsafe extern "C" fn maru_store_slots(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    ids: *const u64,
    lens: *const usize,
    n: usize,
    route_key: *const c_char,
    stored: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, keys, ids, lens);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let ok = handler(h)
            .store_slots(&ks, slice_of(ids, n), slice_of(lens, n), rk)
            .map_err(ffi_err)?;
        if !stored.is_null() {
            std::slice::from_raw_parts_mut(stored, n).copy_from_slice(&ok);
        }
        Ok(())
    })
}

/// Loads chunk `keys[i]` into slot `ids[i]` for `n` chunks of one request. `found[i]`
/// says whether it was loaded and `lens[i]` its length (0 otherwise). A slot whose
/// transfer outcome was unknown is taken back by libmaru (its `found[i]` is false).
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `ids`, `lens`, `found` `n` values each.
#[no_mangle]
pub unsafe extern "C" fn maru_load_slots(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    ids: *const u64,
    n: usize,
    route_key: *const c_char,
    lens: *mut usize,
    found: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, keys, ids, lens, found);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let got = handler(h)
            .load_slots(&ks, slice_of(ids, n), rk)
            .map_err(ffi_err)?;
        write_loaded(&got, lens, found, n);
        Ok(())
    })
}

/// # Safety
/// `lens` and `found` point to `n` writable values.
unsafe fn write_loaded(got: &[Option<usize>], lens: *mut usize, found: *mut bool, n: usize) {
    let (ls, fs) = (
        std::slice::from_raw_parts_mut(lens, n),
        std::slice::from_raw_parts_mut(found, n),
    );
    for (i, g) in got.iter().enumerate().take(n) {
        (fs[i], ls[i]) = match g {
            Some(len) => (true, *len),
            None => (false, 0),
        };
    }
}

/// `maru_store_slots` without waiting: `*op` is the running operation. The arguments
/// are copied; the slots are lent to the operation until it finishes (releasing them
/// meanwhile returns `MARU_ERR_BUSY`). Read the per-chunk results with
/// `maru_op_results` (`flags[i]` = stored).
///
/// # Safety
/// As `maru_store_slots`; `op` is writable.
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
    ffi_guard(|| {
        check_not_null!(h, keys, ids, lens, op);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?.map(str::to_string);
        let handle = handler(h)
            .submit_store_slots(
                ks,
                slice_of(ids, n).to_vec(),
                slice_of(lens, n).to_vec(),
                rk,
            )
            .map_err(ffi_err)?;
        *op = Box::into_raw(Box::new(maru_op_t { op: handle, n }));
        Ok(())
    })
}

/// `maru_load_slots` without waiting; results with `maru_op_results` (`flags[i]` =
/// found, `lens[i]` = length).
///
/// # Safety
/// As `maru_load_slots`; `op` is writable.
#[no_mangle]
pub unsafe extern "C" fn maru_submit_load_slots(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    ids: *const u64,
    n: usize,
    route_key: *const c_char,
    op: *mut *mut maru_op_t,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, keys, ids, op);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?.map(str::to_string);
        let handle = handler(h)
            .submit_load_slots(ks, slice_of(ids, n).to_vec(), rk)
            .map_err(ffi_err)?;
        *op = Box::into_raw(Box::new(maru_op_t { op: handle, n }));
        Ok(())
    })
}

fn finished(r: Option<Result<OpOutput, crate::worker::WorkerError>>) -> Result<(), FfiError> {
    match r {
        None => Err((
            maru_status_t::MARU_PENDING,
            "the operation has not finished yet".into(),
        )),
        Some(Ok(_)) => Ok(()),
        Some(Err(e)) => Err(ffi_err(e)),
    }
}

/// `MARU_OK` when the operation finished successfully, `MARU_PENDING` while it runs,
/// or the operation's own error status (its message in `maru_last_error()`).
///
/// # Safety
/// `op` is an operation from a `maru_submit_*` call, not yet freed.
#[no_mangle]
pub unsafe extern "C" fn maru_op_poll(op: *const maru_op_t) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(op);
        finished((*op).op.poll())
    })
}

/// Waits up to `timeout_ms` for the operation: the same results as `maru_op_poll`
/// (`MARU_PENDING` when the time passed first).
///
/// # Safety
/// As `maru_op_poll`.
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
/// # Safety
/// `flags` (and `lens` when not NULL) point to `n` writable values.
#[no_mangle]
pub unsafe extern "C" fn maru_op_results(
    op: *const maru_op_t,
    flags: *mut bool,
    lens: *mut usize,
    n: usize,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(op, flags);
        let o = &*op;
        if n != o.n {
            return Err((
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                format!("the operation has {} chunks, not {n}", o.n),
            ));
        }
        let r = o.op.poll();
        match r {
            Some(Ok(OpOutput::Stored(ok))) => {
                std::slice::from_raw_parts_mut(flags, n).copy_from_slice(&ok);
                if !lens.is_null() {
                    std::slice::from_raw_parts_mut(lens, n).fill(0);
                }
                Ok(())
            }
            Some(Ok(OpOutput::Loaded(got))) => {
                require_non_null(lens, "lens")?;
                write_loaded(&got, lens, flags, n);
                Ok(())
            }
            other => finished(other),
        }
    })
}

/// Frees an operation. One still running goes on to its end (its slots come back to
/// the caller then); only its results are dropped. NULL is ignored.
///
/// # Safety
/// `op` is NULL or an operation not yet freed.
#[no_mangle]
pub unsafe extern "C" fn maru_op_free(op: *mut maru_op_t) {
    if !op.is_null() {
        drop(Box::from_raw(op));
    }
}

/// Sets `*found_out` (`n` values) to whether each of `keys` is stored, in one round
/// trip for a request's keys (`route_key`: NULL for the first key).
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `found_out` `n` writable values.
#[no_mangle]
pub unsafe extern "C" fn maru_exists_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    found_out: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, keys, found_out);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let got = handler(h).exists_batch(&ks, rk).map_err(ffi_err)?;
        std::slice::from_raw_parts_mut(found_out, n).copy_from_slice(&got);
        Ok(())
    })
}

/// `register(ctx, ptr, len)`: pin/register host memory with the GPU driver; 0 on success.
#[allow(non_camel_case_types)]
pub type maru_mem_register_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, len: usize) -> i32>;
/// `unregister(ctx, ptr, len)`: undo `register`.
#[allow(non_camel_case_types)]
pub type maru_mem_unregister_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, len: usize)>;

/// Sets the process-wide memory hook for handlers opened from now on: each handler
/// calls `register(ctx, ptr, len)` with its staging buffer before first use (a nonzero
/// return fails `maru_handler_open` with `MARU_ERR_CONFIG`), and `unregister(ctx, ptr,
/// len)` (may be NULL) when it is closed. A NULL `register` removes the hook.
///
/// # Safety
/// The callbacks stay callable, and `ctx` valid for them, while any handler opened
/// with them is open.
#[no_mangle]
pub unsafe extern "C" fn maru_set_memory_hook(
    register: maru_mem_register_fn,
    unregister: maru_mem_unregister_fn,
    ctx: *mut c_void,
) -> maru_status_t {
    ffi_guard(|| {
        let hook = match register {
            None => MemoryHook::None,
            Some(r) => MemoryHook::Callbacks {
                register: r as RegisterFn,
                unregister: unregister.map(|u| u as UnregisterFn),
                ctx: ctx as usize,
            },
        };
        set_memory_hook(hook);
        Ok(())
    })
}

/// Sets the memory hook to `auto` for handlers opened from now on: libmaru dlopens
/// libcudart (the library named by the environment variable `MARU_CUDART`, else
/// libcudart.so, .so.12, .so.11.0) and pins each staging buffer with
/// `cudaHostRegister(ptr, len, cudaHostRegisterPortable)`, unpinning it on close.
/// Without CUDA the log says so and handlers work with pageable memory.
#[no_mangle]
pub extern "C" fn maru_set_memory_hook_auto() -> maru_status_t {
    ffi_guard(|| {
        set_memory_hook(MemoryHook::Auto);
        Ok(())
    })
}

/// A chunk read in place from this host's mapping of the CXL memory (backend `cxl`).
/// `data` points to `len` bytes, read-only, valid until `maru_views_release` (or
/// close) and at most `valid_ms` milliseconds from the acquire: the view holds a lease
/// that keeps the chunk's page from being reused, and the lease ends by itself then.
/// maru-server starts the lease's clock while the call is on its way, so count
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

/// Views of `n` chunks of one request in place, with no copy (backend `cxl` only;
/// `remote_cxl` returns `MARU_ERR_INVALID_ARGUMENT`: load into slots instead).
/// `found[i]` says whether `views[i]` holds chunk `keys[i]`; release every found view
/// with `maru_views_release` as soon as its bytes are used (e.g. copied to the GPU).
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `views` and `found` `n` writable values.
#[no_mangle]
pub unsafe extern "C" fn maru_views_acquire(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    views: *mut maru_view_t,
    found: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, keys, views, found);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let got = handler(h).acquire_views(&ks, rk).map_err(ffi_err)?;
        let (vs, fs) = (
            std::slice::from_raw_parts_mut(views, n),
            std::slice::from_raw_parts_mut(found, n),
        );
        // Every entry is written: one the handler did not answer is a miss.
        let mut got = got.into_iter();
        for i in 0..n {
            (vs[i], fs[i]) = match got.next().flatten() {
                Some(v) => (
                    maru_view_t {
                        id: v.id,
                        data: v.ptr,
                        len: v.len,
                        valid_ms: v.valid_ms,
                    },
                    true,
                ),
                None => (
                    maru_view_t {
                        id: 0,
                        data: std::ptr::null(),
                        len: 0,
                        valid_ms: 0,
                    },
                    false,
                ),
            };
        }
        Ok(())
    })
}

/// Ends views: their leases go back and their `data` must not be read any more. Ids
/// already released (or 0, from a view not found) are ignored.
///
/// # Safety
/// `ids` points to `n` values.
#[no_mangle]
pub unsafe extern "C" fn maru_views_release(
    h: *const maru_handler_t,
    ids: *const u64,
    n: usize,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, ids);
        handler(h).release_views(slice_of(ids, n)).map_err(ffi_err)
    })
}

/// Whether each of `ids` is still a slot the caller holds (`held[i]`): false once it
/// was released, or taken back by libmaru after a transfer whose outcome was unknown.
/// Lets a caller keep its slots after a plain miss instead of guessing.
///
/// # Safety
/// `ids` and `held` point to `n` values.
#[no_mangle]
pub unsafe extern "C" fn maru_slots_held(
    h: *const maru_handler_t,
    ids: *const u64,
    n: usize,
    held: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h, ids, held);
        let got = handler(h).slots_held(slice_of(ids, n)).map_err(ffi_err)?;
        std::slice::from_raw_parts_mut(held, n).copy_from_slice(&got);
        Ok(())
    })
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

/// Unpublishes `n` keys of one request that this engine stored; `results[i]` (a
/// `maru_remove_result_t` value) says what happened to `keys[i]`.
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `results` `n` writable values.
#[no_mangle]
pub unsafe extern "C" fn maru_remove_batch(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    results: *mut u32,
) -> maru_status_t {
    use crate::wire::meta::RemoveResult;
    ffi_guard(|| {
        check_not_null!(h, keys, results);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let got = handler(h).remove_batch(&ks, rk).map_err(ffi_err)?;
        let out = std::slice::from_raw_parts_mut(results, n);
        for (o, r) in out.iter_mut().zip(got) {
            *o = match r {
                RemoveResult::Removed => maru_remove_result_t::MARU_REMOVED,
                RemoveResult::NotFound => maru_remove_result_t::MARU_REMOVE_NOT_FOUND,
                RemoveResult::NotOwner => maru_remove_result_t::MARU_REMOVE_NOT_OWNER,
                RemoveResult::Leased => maru_remove_result_t::MARU_REMOVE_LEASED,
                RemoveResult::Pinned => maru_remove_result_t::MARU_REMOVE_PINNED,
            } as u32;
        }
        Ok(())
    })
}

/// Pins `n` keys of one request: `pinned[i]` says whether `keys[i]` was found and is
/// pinned now. A pinned key is neither evicted nor removed (by any engine) until this
/// handler unpins it (`maru_unpin_batch`) or closes, or its memory is lost (the memory
/// node rebooted, its region went back). Pins count: two pins need two unpins.
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `pinned` `n` writable values.
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
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `unpinned` `n` writable values.
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
    ffi_guard(|| {
        check_not_null!(h, keys, out);
        let ks = keys_of(keys, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let got = handler(h).pin_batch(&ks, rk, pin).map_err(ffi_err)?;
        std::slice::from_raw_parts_mut(out, n).copy_from_slice(&got);
        Ok(())
    })
}
