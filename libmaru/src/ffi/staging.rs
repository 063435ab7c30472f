//! Where the staging buffer lies and how it is cut into slots, for a runtime that
//! hands its slots out as pages of its own (the upstream-compatible Python layer shows
//! them to LMCache's and SGLang's adapters as regions on `remote_cxl`). Slots are still
//! taken and given back only through `maru_slots_acquire` / `maru_slots_release`.

use super::boundary::{check_not_null, ffi_guard};
use super::handler::{maru_handler_t, with_handler};
use super::status::maru_status_t;

/// The handler's staging buffer: `len` bytes at `data`, cut into slots of
/// `slot_size` bytes: `load_slots` load slots first (slot `i` at `data + i *
/// slot_size`), then `store_slots` store slots. A slot acquired from a pool lies at one
/// of its pool's places; the buffer stays mapped (and registered with the memory hook)
/// until the handler is freed (`maru_handler_free` or `maru_handler_close`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_staging_t {
    pub data: *mut u8,
    pub len: usize,
    pub slot_size: usize,
    pub load_slots: usize,
    pub store_slots: usize,
}

/// Describes the handler's staging buffer in `*out`. `MARU_ERR_UNAVAILABLE` while no
/// pool has been reached yet (the buffer is made with the first pool's session).
///
/// Ownership: the memory is the handler's; a caller reads or writes only the slots it
/// holds. Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_staging_buffer(
    h: *const maru_handler_t,
    out: *mut maru_staging_t,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(out);
        with_handler(h, |call| {
            let (data, l) = call.handler().staging_buffer()?;
            *out = maru_staging_t {
                data,
                len: l.total_bytes(),
                slot_size: l.slot_size,
                load_slots: l.load_slots,
                store_slots: l.store_slots,
            };
            Ok(())
        })
    })
}
