//! Staging slots for zero-copy transfers: acquire, fill or read in place (with the
//! runtime's own GPU copy), store from or load into them, release.

use super::args::{in_slice, load_outputs, opt_str, out_slice};
use super::boundary::{ffi_guard, FfiError};
use super::calls::{fill_out, hand_out, keyed, store_each};
use super::handler::{maru_handler_t, with_handler, with_handler_releasing};
use super::status::maru_status_t;
use crate::worker::{SlotInfo, SlotPool, WorkerError};
use std::ffi::c_char;
use std::time::{Duration, Instant};

/// The pool a staging slot comes from: loads and stores have their own slots, sized
/// independently (`load_slots`, `store_slots` in the configuration).
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum maru_slot_pool_t {
    /// Slots that loads land in (`maru_load_slots`).
    MARU_SLOT_LOAD = 0,
    /// Slots that stores go from (`maru_store_slots`).
    MARU_SLOT_STORE = 1,
}

/// A `maru_slot_pool_t` as C passes it: any 32-bit value, checked before use (never
/// transmuted). The header spells it `maru_slot_pool_t`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotPoolArg(pub u32);

impl From<maru_slot_pool_t> for SlotPoolArg {
    fn from(p: maru_slot_pool_t) -> SlotPoolArg {
        SlotPoolArg(p as u32)
    }
}

/// One staging slot held by the caller. `data` points to `capacity` bytes (one chunk)
/// inside the handler's staging buffer, valid until the slot is released or the
/// handler freed (`maru_handler_free` or `maru_handler_close`; it stays valid after
/// `maru_handler_shutdown`). `id` names the slot in later calls; ids are never reused.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_slot_t {
    pub id: u64,
    pub data: *mut u8,
    pub capacity: usize,
}

fn pool_of(raw: SlotPoolArg) -> Result<SlotPool, FfiError> {
    match raw.0 {
        x if x == maru_slot_pool_t::MARU_SLOT_LOAD as u32 => Ok(SlotPool::Load),
        x if x == maru_slot_pool_t::MARU_SLOT_STORE as u32 => Ok(SlotPool::Store),
        x => Err((
            maru_status_t::MARU_ERR_INVALID_ARGUMENT,
            format!("pool {x} is neither MARU_SLOT_LOAD (0) nor MARU_SLOT_STORE (1)"),
        )),
    }
}

/// How long one wait for a free slot lasts before the call looks whether the handler
/// is being shut down: the longest a shutdown waits for a blocked acquire to notice.
const ACQUIRE_SLICE: Duration = Duration::from_millis(20);

/// Takes between 1 and `n` staging slots of `pool`, waiting up to `timeout_ms` for at
/// least one; `out[0..*got]` describes them. No free slot within the timeout returns
/// `MARU_ERR_NO_SPACE` (release slots, or raise `load_slots`/`store_slots`). Fill a
/// store slot or read a loaded slot in place, then give it back with
/// `maru_slots_release`. `n` = 0 returns at once with `*got` = 0; any error leaves
/// `*got` = 0.
///
/// Ownership: the slots are the caller's until released; their memory belongs to
/// the handler and is valid until the slot is released or the handler freed.
/// Threads: any, concurrently with other calls; a shutdown wakes a waiting call,
/// which returns `MARU_ERR_CLOSED` with no slot.
#[no_mangle]
pub unsafe extern "C" fn maru_slots_acquire(
    h: *const maru_handler_t,
    pool: SlotPoolArg,
    n: usize,
    timeout_ms: u32,
    out: *mut maru_slot_t,
    got: *mut usize,
) -> maru_status_t {
    fill_out(h, out, n, got, |call, dst| {
        let pool = pool_of(pool)?;
        if n == 0 {
            return Ok(0);
        }
        let timeout = Duration::from_millis(timeout_ms.into());
        let deadline = Instant::now() + timeout;
        // Waits in slices so a shutdown wakes this call (within ACQUIRE_SLICE).
        let slots = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match call.handler().acquire_slots(pool, n, left.min(ACQUIRE_SLICE)) {
                Ok(s) => break s,
                Err(WorkerError::NoSpace(_))
                    if left > ACQUIRE_SLICE && call.handler().slots_configured(pool) > 0 =>
                {
                    if call.shutting_down() {
                        return Err(WorkerError::Closed.into());
                    }
                }
                Err(WorkerError::NoSpace(_)) => {
                    return Err((
                        maru_status_t::MARU_ERR_NO_SPACE,
                        format!(
                            "no free {pool} staging slot within {timeout_ms} ms: release slots or raise {pool}_slots"
                        ),
                    ))
                }
                Err(e) => return Err(e.into()),
            }
        };
        let to_c = |s: &SlotInfo| maru_slot_t {
            id: s.id,
            data: s.ptr,
            capacity: s.capacity,
        };
        hand_out(call.shutting_down(), dst, slots, to_c, |slots| {
            let ids: Vec<u64> = slots.iter().map(|s| s.id).collect();
            let _ = call.handler().release_slots(&ids);
        })
    })
}

/// Stores `lens[i]` bytes of slot `ids[i]` under `keys[i]` for `n` chunks of one
/// request. On `remote_cxl` the WRITE goes from the slot itself: no copy. `stored[i]`
/// (the array may be NULL) is true when the chunk is stored now or was already
/// stored (by any engine), false when it was skipped (its reason counted in
/// `maru_stats_json`'s `total.skipped`, see `maru_store`). The slots stay the caller's
/// (release them), except one whose transfer outcome was unknown: libmaru takes it
/// back (`maru_slots_held` says false for it).
///
/// Threads: any, concurrently with other calls; a slot is used by one call at a time
/// (a second call on it returns `MARU_ERR_BUSY`).
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
    store_each(h, keys, n, stored, |call, ks| {
        let is = in_slice(ids, n, "ids")?;
        let ls = in_slice(lens, n, "lens")?;
        let rk = opt_str(route_key, "route_key")?;
        Ok(call.handler().store_slots(ks, is, ls, rk)?)
    })
}

/// Loads chunk `keys[i]` into slot `ids[i]` for `n` chunks of one request. `found[i]`
/// says whether it was loaded and `lens[i]` its length (0 otherwise). A slot whose
/// transfer outcome was unknown is taken back by libmaru (its `found[i]` is false and
/// `maru_slots_held` says false for it).
///
/// Threads: as `maru_store_slots`.
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
    keyed(h, keys, n, |call, ks| {
        let is = in_slice(ids, n, "ids")?;
        let (ls, fs) = load_outputs(lens, found, n)?;
        let rk = opt_str(route_key, "route_key")?;
        let got = call.handler().load_slots(&ks, is, rk)?;
        write_loaded(&got, ls, fs);
        Ok(())
    })
}

/// `found[i]`/`lens[i]` from per-chunk results (a missing entry is a miss).
pub(crate) fn write_loaded(got: &[Option<usize>], lens: &mut [usize], found: &mut [bool]) {
    for (i, (l, f)) in lens.iter_mut().zip(found.iter_mut()).enumerate() {
        (*f, *l) = match got.get(i).copied().flatten() {
            Some(len) => (true, len),
            None => (false, 0),
        };
    }
}

/// Whether each of `ids` is still a slot the caller holds (`held[i]`): false once it
/// was released, or taken back by libmaru after a transfer whose outcome was unknown.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_slots_held(
    h: *const maru_handler_t,
    ids: *const u64,
    n: usize,
    held: *mut bool,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            let is = in_slice(ids, n, "ids")?;
            let out = out_slice(held, n, "held")?;
            out.copy_from_slice(&call.handler().slots_held(is)?);
            Ok(())
        })
    })
}

/// Gives `n` slots back to their pools; their memory must not be used afterwards.
/// All or nothing: a slot lent to an operation still running returns `MARU_ERR_BUSY`,
/// an id that was never acquired or was already released returns
/// `MARU_ERR_INVALID_ARGUMENT`, and nothing is released then. An id libmaru took back
/// (after a transfer whose outcome was unknown) is accepted once, so releasing every
/// slot a call used is always right.
///
/// Also after `maru_handler_shutdown` (until `maru_handler_free`): the release
/// succeeds as before, so a runtime's "release after every call" needs no special
/// case at shutdown. After `maru_handler_free` the slots are gone with the handler.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_slots_release(
    h: *const maru_handler_t,
    ids: *const u64,
    n: usize,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler_releasing(h, |call| {
            let is = in_slice(ids, n, "ids")?;
            call.handler().release_slots(is)?;
            Ok(())
        })
    })
}
