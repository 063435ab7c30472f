//! The thread's last error: the text behind the status a call returned.
//!
//! Each thread has its own slot, so a C caller reads the message of its own
//! failed call without locking. A call that succeeds clears the slot (see
//! [`ffi_guard`](super::boundary::ffi_guard)). The C functions that read it are in
//! `last_error.rs`.

use super::status::maru_status_t;
use std::cell::RefCell;
use std::ffi::{CStr, CString};

/// What the last failed call on this thread recorded: its status and message.
struct Recorded {
    status: maru_status_t,
    message: CString,
}

thread_local! {
    static LAST_ERROR: RefCell<Option<Recorded>> = const { RefCell::new(None) };
}

/// Records `status` and `message` as this thread's last error, replacing any
/// earlier one. A NUL byte inside the message would cut the C string short, so
/// it is replaced by U+FFFD.
pub fn set_last_error(status: maru_status_t, message: impl Into<String>) {
    let mut text = message.into();
    if text.contains('\0') {
        text = text.replace('\0', "\u{FFFD}");
    }
    let message = CString::new(text).unwrap_or_default();
    // try_with: a call made while the thread is being torn down has nowhere to
    // leave its message, and must not panic for it.
    let _ = LAST_ERROR.try_with(|slot| {
        *slot.borrow_mut() = Some(Recorded { status, message });
    });
}

/// Clears this thread's last error.
pub fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| slot.borrow_mut().take());
}

/// This thread's last error, if there is one.
pub fn last_error() -> Option<(maru_status_t, String)> {
    LAST_ERROR
        .try_with(|slot| {
            slot.borrow()
                .as_ref()
                .map(|e| (e.status, e.message.to_string_lossy().into_owned()))
        })
        .ok()
        .flatten()
}

pub(super) fn with_last_message<T>(f: impl FnOnce(&CStr) -> T) -> T {
    let mut f = Some(f);
    let result = LAST_ERROR.try_with(|slot| {
        let slot = slot.borrow();
        let message = slot.as_ref().map_or(c"", |e| e.message.as_c_str());
        (f.take().expect("called once"))(message)
    });
    match result {
        Ok(value) => value,
        Err(_) => (f.take().expect("not called"))(c""),
    }
}
