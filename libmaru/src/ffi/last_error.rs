//! The C functions that read the thread's last error (`maru_last_error`,
//! `maru_last_error_copy`) and describe a status (`maru_status_str`).

use super::boundary::ffi_guard_value;
use super::error::with_last_message;
use super::status::{maru_status_t, StatusArg};
use std::ffi::c_char;

/// The message of the last call on this thread that failed, as a NUL-terminated
/// UTF-8 string; the empty string when the last call succeeded or none failed.
///
/// Never NULL. The string belongs to libmaru and stays valid until the next
/// libmaru call on this thread other than `maru_last_error`,
/// `maru_last_error_copy` and `maru_status_str`; copy it to keep it.
/// Threads: any thread; each thread has its own last error.
#[no_mangle]
pub extern "C" fn maru_last_error() -> *const c_char {
    ffi_guard_value(c"".as_ptr(), || with_last_message(|m| m.as_ptr()))
}

/// Copies the message of this thread's last error into `buf`, NUL-terminated.
///
/// `*out_len` receives the length of the whole message in bytes, not counting
/// the terminating NUL, so a buffer needs `*out_len + 1` bytes. When `len` is
/// smaller than that, as much of the message as fits (cut at a UTF-8 character
/// boundary) is written, still NUL-terminated when `len > 0`, and the call
/// returns `MARU_ERR_BUFFER_TOO_SMALL`. `buf` may be NULL when `len` is 0, to
/// ask for the length. This call never changes the last error itself.
///
/// Returns `MARU_OK`, `MARU_ERR_BUFFER_TOO_SMALL`, or `MARU_ERR_NULL_ARGUMENT`
/// when `out_len` is NULL, or `buf` is NULL with `len > 0`.
///
/// Ownership: `buf` (`len` writable bytes) and `out_len` are the caller's.
/// Threads: any thread; it reads that thread's own message.
#[no_mangle]
pub unsafe extern "C" fn maru_last_error_copy(
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> maru_status_t {
    ffi_guard_value(maru_status_t::MARU_ERR_PANIC, || {
        if out_len.is_null() || (buf.is_null() && len > 0) {
            return maru_status_t::MARU_ERR_NULL_ARGUMENT;
        }
        with_last_message(|message| {
            let bytes = message.to_bytes();
            // SAFETY: out_len is non-null and, by the contract, writable.
            unsafe { out_len.write(bytes.len()) };
            if len == 0 {
                // Not even the NUL fits.
                return maru_status_t::MARU_ERR_BUFFER_TOO_SMALL;
            }
            let fits = bytes.len() < len;
            let n = if fits {
                bytes.len()
            } else {
                utf8_prefix_len(bytes, len - 1)
            };
            // SAFETY: buf is non-null and points to len >= n + 1 writable bytes;
            // it cannot overlap the message, which libmaru owns.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                buf.add(n).write(0);
            }
            if fits {
                maru_status_t::MARU_OK
            } else {
                maru_status_t::MARU_ERR_BUFFER_TOO_SMALL
            }
        })
    })
}

/// The longest prefix of `bytes`, at most `max` long, that ends on a UTF-8
/// character boundary.
fn utf8_prefix_len(bytes: &[u8], max: usize) -> usize {
    let mut n = max.min(bytes.len());
    // A continuation byte (0b10xx_xxxx) at n means n is inside a character.
    while n > 0 && n < bytes.len() && (bytes[n] & 0xC0) == 0x80 {
        n -= 1;
    }
    n
}

/// A short, static description of a status code, such as "not found".
///
/// An unknown value gives "unknown status". Never NULL; the string is static
/// and never freed. This call does not change the last error. Threads: any.
#[no_mangle]
pub extern "C" fn maru_status_str(status: StatusArg) -> *const c_char {
    ffi_guard_value(c"unknown status".as_ptr(), || {
        maru_status_t::from_raw(status.0)
            .map_or(c"unknown status", maru_status_t::description)
            .as_ptr()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::error::{clear_last_error, last_error, set_last_error};
    use std::ffi::CStr;
    use std::ptr;

    fn last_error_text() -> String {
        // SAFETY: maru_last_error never returns NULL and the text is NUL-terminated.
        unsafe { CStr::from_ptr(maru_last_error()) }
            .to_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn last_error_set_and_cleared() {
        clear_last_error();
        assert!(!maru_last_error().is_null());
        assert_eq!(last_error_text(), "");
        assert_eq!(last_error(), None);

        set_last_error(maru_status_t::MARU_ERR_CONFIG, "bad pool name");
        assert_eq!(last_error_text(), "bad pool name");
        assert_eq!(
            last_error(),
            Some((maru_status_t::MARU_ERR_CONFIG, "bad pool name".to_owned()))
        );

        clear_last_error();
        assert_eq!(last_error_text(), "");
        assert_eq!(last_error(), None);
    }

    #[test]
    fn last_error_is_per_thread() {
        set_last_error(maru_status_t::MARU_ERR_IO, "here");
        let other = std::thread::spawn(last_error_text).join().unwrap();
        assert_eq!(other, "");
        assert_eq!(last_error_text(), "here");
    }

    #[test]
    fn nul_inside_message_is_replaced() {
        set_last_error(maru_status_t::MARU_ERR_IO, "a\0b");
        assert_eq!(last_error_text(), "a\u{FFFD}b");
    }

    /// Copies the last error into `cap` bytes filled with 0x55 first: the status, the
    /// length written to `*out_len` (which starts at `usize::MAX`), and the text up to
    /// the NUL the copy wrote.
    fn copy_last(cap: usize) -> (maru_status_t, usize, String) {
        let mut buf = vec![0x55 as c_char; cap];
        let mut out = usize::MAX;
        let st = unsafe { maru_last_error_copy(buf.as_mut_ptr(), buf.len(), &mut out) };
        let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
        let text = CStr::from_bytes_until_nul(&bytes)
            .unwrap_or_else(|_| panic!("no NUL written: {bytes:?}"))
            .to_str()
            .unwrap()
            .to_string();
        (st, out, text)
    }

    #[test]
    fn copy_into_large_buffer() {
        set_last_error(maru_status_t::MARU_ERR_TIMEOUT, "timed out");
        let ok = (maru_status_t::MARU_OK, 9, "timed out".to_string());
        assert_eq!(copy_last(32), ok);
        // Exactly message + NUL also fits.
        assert_eq!(copy_last(10), ok);
        // The copy left the last error in place.
        assert_eq!(last_error_text(), "timed out");
    }

    #[test]
    fn copy_into_small_buffer() {
        set_last_error(maru_status_t::MARU_ERR_TIMEOUT, "timed out");
        // One byte short of message + NUL: the length the caller needs (plus NUL).
        assert_eq!(
            copy_last(9),
            (
                maru_status_t::MARU_ERR_BUFFER_TOO_SMALL,
                9,
                "timed ou".to_string()
            )
        );

        // Asking for the length only.
        let mut out = 0usize;
        let st = unsafe { maru_last_error_copy(ptr::null_mut(), 0, &mut out) };
        assert_eq!(st, maru_status_t::MARU_ERR_BUFFER_TOO_SMALL);
        assert_eq!(out, 9);
        assert_eq!(last_error_text(), "timed out");
    }

    #[test]
    fn copy_cuts_at_character_boundary() {
        set_last_error(maru_status_t::MARU_ERR_IO, "aé"); // 'é' is two bytes
        assert_eq!(
            copy_last(3),
            (maru_status_t::MARU_ERR_BUFFER_TOO_SMALL, 3, "a".to_string())
        );
    }

    #[test]
    fn copy_with_empty_message() {
        clear_last_error();
        assert_eq!(copy_last(1), (maru_status_t::MARU_OK, 0, String::new()));
    }

    #[test]
    fn copy_rejects_null_arguments() {
        let mut buf = [0 as c_char; 4];
        let st = unsafe { maru_last_error_copy(buf.as_mut_ptr(), buf.len(), ptr::null_mut()) };
        assert_eq!(st, maru_status_t::MARU_ERR_NULL_ARGUMENT);
        let mut out = 0usize;
        let st = unsafe { maru_last_error_copy(ptr::null_mut(), 4, &mut out) };
        assert_eq!(st, maru_status_t::MARU_ERR_NULL_ARGUMENT);
    }

    #[test]
    fn status_str_is_static_and_distinct() {
        let ok = unsafe { CStr::from_ptr(maru_status_str(StatusArg(0))) };
        assert_eq!(ok.to_str().unwrap(), "ok");
        let panic = unsafe { CStr::from_ptr(maru_status_str(StatusArg(99))) };
        assert_eq!(panic.to_str().unwrap(), "panic inside libmaru");
        let unknown = unsafe { CStr::from_ptr(maru_status_str(StatusArg(12345))) };
        assert_eq!(unknown.to_str().unwrap(), "unknown status");
        assert_ne!(maru_status_str(StatusArg(1)), maru_status_str(StatusArg(2)));
    }
}
