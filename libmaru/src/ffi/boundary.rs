//! The panic boundary every `extern "C"` body runs inside.
//!
//! A panic must never unwind into C (undefined behaviour), so each exported
//! function wraps its body in [`ffi_guard`] (for calls that return a status) or
//! [`ffi_guard_value`] (for calls that return a value). Errors are converted to a
//! status and a message exactly once, here.

use super::error::{clear_last_error, set_last_error};
use super::status::maru_status_t;
use crate::wire::WireError;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub use super::status::FfiError;

impl From<WireError> for FfiError {
    fn from(e: WireError) -> FfiError {
        (maru_status_t::from(e.code), e.to_string())
    }
}

/// Runs the body of an exported call that returns a status.
///
/// `Ok` gives `MARU_OK` and clears the thread's last error; `Err((status,
/// message))` records the message and returns the status; a panic gives
/// `MARU_ERR_PANIC` with the panic's message as the last error.
pub fn ffi_guard<F>(body: F) -> maru_status_t
where
    F: FnOnce() -> Result<(), FfiError>,
{
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            clear_last_error();
            maru_status_t::MARU_OK
        }
        Ok(Err((status, message))) => {
            // An error that claims success is a bug in the body; never let C
            // see MARU_OK together with an error message.
            let status = if status == maru_status_t::MARU_OK {
                maru_status_t::MARU_ERR_INTERNAL
            } else {
                status
            };
            set_last_error(status, message);
            status
        }
        Err(payload) => {
            set_last_error(maru_status_t::MARU_ERR_PANIC, panic_text(payload));
            maru_status_t::MARU_ERR_PANIC
        }
    }
}

/// Runs the body of an exported call that returns a value rather than a status
/// (a pointer, a count, a constant). The last error is left as it is on
/// success; a panic records `MARU_ERR_PANIC` and returns `on_panic`.
pub fn ffi_guard_value<T, F>(on_panic: T, body: F) -> T
where
    F: FnOnce() -> T,
{
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(payload) => {
            set_last_error(maru_status_t::MARU_ERR_PANIC, panic_text(payload));
            on_panic
        }
    }
}

/// The message of a panic, consuming its payload. Dropping a payload can
/// itself panic, so that happens inside its own boundary.
fn panic_text(payload: Box<dyn Any + Send>) -> String {
    let text = if let Some(s) = payload.downcast_ref::<&'static str>() {
        format!("panic inside libmaru: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panic inside libmaru: {s}")
    } else {
        "panic inside libmaru (no message)".to_owned()
    };
    let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
    text
}

/// `Err(MARU_ERR_NULL_ARGUMENT)` naming `name` when `ptr` is NULL. A `*mut T`
/// coerces to `*const T`, so this takes either.
pub fn require_non_null<T: ?Sized>(ptr: *const T, name: &str) -> Result<(), FfiError> {
    if ptr.is_null() {
        Err((
            maru_status_t::MARU_ERR_NULL_ARGUMENT,
            format!("argument `{name}` is NULL"),
        ))
    } else {
        Ok(())
    }
}

/// Returns `Err(MARU_ERR_NULL_ARGUMENT)` from the enclosing
/// `Result<_, FfiError>` closure when any of the named pointer arguments is NULL,
/// with the argument's name in the message:
///
/// ```ignore
/// ffi_guard(|| {
///     check_not_null!(handler, key);
///     ...
/// })
/// ```
#[allow(unused_macros)]
macro_rules! check_not_null {
    ($($arg:ident),+ $(,)?) => {
        $( $crate::ffi::boundary::require_non_null($arg, stringify!($arg))?; )+
    };
}
// Used by the exported handle functions; until they exist only the tests use it.
#[allow(unused_imports)]
pub(crate) use check_not_null;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::error::last_error;
    use crate::wire::ErrorCode;
    use std::ffi::c_char;
    use std::ptr;

    #[test]
    fn ok_clears_last_error() {
        set_last_error(maru_status_t::MARU_ERR_IO, "earlier failure");
        assert_eq!(ffi_guard(|| Ok(())), maru_status_t::MARU_OK);
        assert_eq!(last_error(), None);
    }

    #[test]
    fn err_sets_last_error() {
        let st = ffi_guard(|| Err((maru_status_t::MARU_ERR_CONFIG, "no pools".into())));
        assert_eq!(st, maru_status_t::MARU_ERR_CONFIG);
        assert_eq!(
            last_error(),
            Some((maru_status_t::MARU_ERR_CONFIG, "no pools".to_owned()))
        );
    }

    #[test]
    fn err_with_ok_status_becomes_internal() {
        let st = ffi_guard(|| Err((maru_status_t::MARU_OK, "confused".into())));
        assert_eq!(st, maru_status_t::MARU_ERR_INTERNAL);
    }

    #[test]
    fn panic_gives_panic_status_and_message() {
        let st = ffi_guard(|| panic!("slot table corrupted at {}", 7));
        assert_eq!(st, maru_status_t::MARU_ERR_PANIC);
        let (status, message) = last_error().expect("a last error");
        assert_eq!(status, maru_status_t::MARU_ERR_PANIC);
        assert!(
            message.contains("slot table corrupted at 7"),
            "message: {message}"
        );

        let st = ffi_guard(|| std::panic::panic_any(42u32));
        assert_eq!(st, maru_status_t::MARU_ERR_PANIC);
        assert!(last_error().unwrap().1.contains("no message"));
    }

    #[test]
    fn value_guard_returns_default_on_panic() {
        set_last_error(maru_status_t::MARU_ERR_IO, "kept");
        assert_eq!(ffi_guard_value(0u32, || 5), 5);
        assert_eq!(last_error().unwrap().1, "kept", "success leaves it alone");
        assert_eq!(ffi_guard_value(0u32, || panic!("boom")), 0);
        let (status, message) = last_error().unwrap();
        assert_eq!(status, maru_status_t::MARU_ERR_PANIC);
        assert!(message.contains("boom"));
    }

    #[test]
    fn wire_error_converts_once() {
        let st = ffi_guard(|| {
            Err(WireError::new(ErrorCode::Refused, "region 3 is draining"))?;
            Ok(())
        });
        assert_eq!(st, maru_status_t::MARU_ERR_REFUSED);
        assert!(last_error().unwrap().1.contains("region 3 is draining"));
    }

    #[test]
    fn null_check_names_the_argument() {
        fn body(handler: *const u8, key: *mut c_char) -> Result<(), FfiError> {
            check_not_null!(handler, key);
            Ok(())
        }
        let byte = 0u8;
        let mut c = 0 as c_char;
        assert_eq!(ffi_guard(|| body(&byte, &mut c)), maru_status_t::MARU_OK);
        let st = ffi_guard(|| body(&byte, ptr::null_mut()));
        assert_eq!(st, maru_status_t::MARU_ERR_NULL_ARGUMENT);
        assert_eq!(last_error().unwrap().1, "argument `key` is NULL");
        let st = ffi_guard(|| body(ptr::null(), ptr::null_mut()));
        assert_eq!(st, maru_status_t::MARU_ERR_NULL_ARGUMENT);
        assert_eq!(last_error().unwrap().1, "argument `handler` is NULL");
    }
}
