//! The memory hook: how the runtime registers (pins) the staging buffer and, on `cxl`,
//! every mapping of CXL memory with its GPU driver, so GPU copies to and from staging
//! slots and straight to and from CXL are DMA, not bounce copies.

use super::boundary::ffi_guard;
use super::status::maru_status_t;
use crate::worker::hook::{check_cudart_env, hook_counters, memory_hook, RegisterFn, UnregisterFn};
use crate::worker::{set_memory_hook, MemoryHook};
use std::ffi::c_void;

/// `register(ctx, ptr, len)`: pin/register `len` bytes at `ptr` with the GPU driver
/// (e.g. `cudaHostRegister`); return 0 on success.
#[allow(non_camel_case_types)]
pub type maru_mem_register_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, len: usize) -> i32>;
/// `unregister(ctx, ptr, len)`: undo `register` for the same `ptr` and `len`.
#[allow(non_camel_case_types)]
pub type maru_mem_unregister_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, len: usize)>;

/// Sets the process-wide memory hook for handlers opened from now on: each handler
/// calls `register(ctx, ptr, len)` with its staging buffer during `maru_handler_open`
/// (a nonzero return fails the open with `MARU_ERR_CONFIG`), and `unregister(ctx,
/// ptr, len)` (may be NULL) once when it is shut down. On `cxl` it also calls
/// `register` once for each mapping of CXL memory it makes (its own regions, and other
/// engines' it reads in place; a nonzero return is logged and the mapping used
/// unregistered) and `unregister` once for it before it is unmapped. A NULL `register`
/// removes the hook. Handlers already open keep the hook they were opened with.
///
/// Threads: `register` runs on the thread calling `maru_handler_open` (for a CXL
/// mapping: the thread whose call maps it, or the handler's background thread);
/// `unregister` on the thread calling `maru_handler_shutdown`, `maru_handler_free` or
/// `maru_handler_close` (for a CXL mapping also the background thread, when its region
/// is lost or given back). The callbacks must not call libmaru. This call may run concurrently with opens: an open uses
/// either the old hook or the new one, never a mix.
///
/// Ownership: the callbacks, and `ctx` for them, must stay valid while any handler
/// opened with them is open.
#[no_mangle]
pub unsafe extern "C" fn maru_set_memory_hook(
    register: maru_mem_register_fn,
    unregister: maru_mem_unregister_fn,
    ctx: *mut c_void,
) -> maru_status_t {
    crate::logging::install();
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
/// libcudart (the absolute path in the environment variable `MARU_CUDART`, else
/// libcudart.so, .so.12, .so.11.0 from the library search path) and pins each staging
/// buffer and each CXL mapping (`cxl`) with `cudaHostRegister(ptr, len,
/// cudaHostRegisterPortable)`, unpinning it at shutdown (a mapping: before it is
/// unmapped). Without CUDA, or when the pin fails, handlers work with pageable memory
/// and a warning is logged; `maru_stats_json` tells whether memory was pinned
/// (`memory_hook.pinned_bytes`, `memory_hook.register_failures`).
///
/// Returns `MARU_ERR_CONFIG` when `MARU_CUDART` is set to a relative path (nothing
/// is changed then). Threads: as `maru_set_memory_hook`; the CUDA calls run on the
/// threads that open and shut down handlers.
#[no_mangle]
pub extern "C" fn maru_set_memory_hook_auto() -> maru_status_t {
    crate::logging::install();
    ffi_guard(|| {
        check_cudart_env().map_err(|e| (maru_status_t::MARU_ERR_CONFIG, e))?;
        set_memory_hook(MemoryHook::Auto);
        Ok(())
    })
}

/// The `memory_hook` object of the stats.
pub(crate) fn hook_stats_json() -> serde_json::Value {
    let mode = match memory_hook() {
        MemoryHook::None => "none",
        MemoryHook::Auto => "auto",
        MemoryHook::Callbacks { .. } => "callbacks",
    };
    let (pinned, failures) = hook_counters();
    serde_json::json!({
        "mode": mode,
        "pinned_bytes": pinned,
        "register_failures": failures,
    })
}
