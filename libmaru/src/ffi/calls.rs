//! The shapes the calls on a handler share, written once: a call on the keys of one
//! request (`maru_store_batch`, `maru_load_slots`, `maru_views_acquire`, ...), and a
//! call that stores them and says per key whether it did (`maru_store_batch`,
//! `maru_store_slots`, `maru_pages_publish`), a call that fills a caller's array and
//! says how many entries there are (`maru_slots_acquire`, `maru_pages_take`,
//! `maru_regions_list`), and the memory those hand out.

use super::args::{copy_to_opt_out, keys_of, opt_str, out_slice};
use super::boundary::{check_not_null, ffi_guard, FfiError};
use super::handler::{maru_handler_t, with_handler, Call};
use super::status::maru_status_t;
use crate::worker::WorkerError;
use std::ffi::c_char;

/// Runs `body` on handler `h` with the `n` keys at `keys` (checked first, in order:
/// see [`keys_of`]).
pub(crate) unsafe fn keyed(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    body: impl FnOnce(&Call, Vec<&str>) -> Result<(), FfiError>,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            let ks = keys_of(keys, n)?;
            body(call, ks)
        })
    })
}

/// A call that answers each of the `n` keys at `keys`: runs `answer` on handler `h`
/// with the keys and the route key, and writes its answer for `keys[i]`, through
/// `into`, to `out[i]` (checked in order: the keys, `out`, named `out_name` in errors,
/// then `route_key`).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn answer_each_key<T, R, E>(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    out: *mut T,
    out_name: &str,
    answer: impl FnOnce(&Call, &[&str], Option<&str>) -> Result<Vec<R>, E>,
    into: impl Fn(R) -> T,
) -> maru_status_t
where
    FfiError: From<E>,
{
    keyed(h, keys, n, |call, ks| {
        let o = out_slice(out, n, out_name)?;
        let rk = opt_str(route_key, "route_key")?;
        let got = answer(call, &ks, rk)?;
        for (o, r) in o.iter_mut().zip(got) {
            *o = into(r);
        }
        Ok(())
    })
}

/// A call that stores the `n` keys at `keys` with `store` on handler `h` and copies its
/// outcome for `keys[i]` to `out[i]` (`out` may be NULL: not wanted).
pub(crate) unsafe fn store_each(
    h: *const maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    out: *mut bool,
    store: impl FnOnce(&Call, &[&str]) -> Result<Vec<bool>, FfiError>,
) -> maru_status_t {
    keyed(h, keys, n, |call, ks| {
        let stored = store(call, &ks)?;
        copy_to_opt_out(out, n, &stored);
        Ok(())
    })
}

/// The end of a call that takes memory for the caller (`maru_slots_acquire`,
/// `maru_pages_take`): writes each of `taken` to `dst` through `to_c` and returns how
/// many there are. Unless the handler is being shut down (`shutting_down`, asked once
/// the memory is taken): the memory goes with the sessions then, so none is handed
/// out; `give_back` returns it and the call fails with `MARU_ERR_CLOSED`.
pub(crate) fn hand_out<S, T>(
    shutting_down: bool,
    dst: &mut [T],
    taken: Vec<S>,
    to_c: impl Fn(&S) -> T,
    give_back: impl FnOnce(&[S]),
) -> Result<usize, FfiError> {
    if shutting_down {
        give_back(&taken);
        return Err(WorkerError::Closed.into());
    }
    for (d, s) in dst.iter_mut().zip(&taken) {
        *d = to_c(s);
    }
    Ok(taken.len())
}

/// Runs `fill` on handler `h` with `out[0..cap]` (`out` may be NULL when `cap` is 0);
/// `*count` is what it returns once it succeeded, and 0 after any error (checked
/// first: `count` must not be NULL).
pub(crate) unsafe fn fill_out<T>(
    h: *const maru_handler_t,
    out: *mut T,
    cap: usize,
    count: *mut usize,
    fill: impl FnOnce(&Call, &mut [T]) -> Result<usize, FfiError>,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(count);
        *count = 0;
        with_handler(h, |call| {
            let dst = out_slice(out, cap, "out")?;
            *count = fill(call, dst)?;
            Ok(())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_taken_while_shutting_down_is_given_back_not_handed_out() {
        let mut dst = [0u64; 3];
        let mut back = Vec::new();
        let e = hand_out(
            true,
            &mut dst,
            vec![5, 6],
            |x| *x,
            |t| back.extend_from_slice(t),
        );
        assert_eq!(e.unwrap_err().0, maru_status_t::MARU_ERR_CLOSED);
        assert_eq!((dst, back), ([0; 3], vec![5, 6]));
        let mut back = Vec::new();
        let got = hand_out(
            false,
            &mut dst,
            vec![5, 6],
            |x| x * 10,
            |t| back.extend_from_slice(t),
        );
        assert_eq!((got.unwrap(), dst), (2, [50, 60, 0]));
        assert!(back.is_empty());
    }

    #[test]
    fn a_failed_fill_leaves_the_count_at_0_and_a_null_count_is_refused() {
        let mut out = [0u64; 2];
        let mut count = 7usize;
        // SAFETY: a NULL handler is refused before `out` is touched.
        let st = unsafe {
            fill_out(std::ptr::null(), out.as_mut_ptr(), 2, &mut count, |_, _| {
                Ok(2)
            })
        };
        assert_ne!(st, maru_status_t::MARU_OK);
        assert_eq!(count, 0, "an error leaves *count at 0");
        // SAFETY: as above; the NULL count is checked first.
        let st = unsafe {
            fill_out(
                std::ptr::null(),
                out.as_mut_ptr(),
                2,
                std::ptr::null_mut(),
                |_, _| Ok(2),
            )
        };
        assert_eq!(st, maru_status_t::MARU_ERR_NULL_ARGUMENT);
    }
}
