//! Checking a key file before a handler proves it, so that a runtime can stop at start
//! naming its own setting (a connector's option, a command-line flag) when the file is
//! missing, unreadable, open to others or not a key. The same loader as the handler's.

use super::args::req_str;
use super::boundary::{ffi_guard, FfiError};
use super::status::maru_status_t;
use std::ffi::c_char;
use std::path::Path;

fn check(path: &str) -> Result<(), FfiError> {
    crate::auth::load_key_file(Path::new(path))
        .map(|_| ())
        .map_err(|e| (maru_status_t::MARU_ERR_CONFIG, e.to_string()))
}

/// Checks that the file at `path` (a NUL-terminated path) holds a key a handler can
/// prove (the agents' key of `agent_key_file`, maru-server's key): readable, with no
/// access for group or others (mode 0600),
/// and a key of at least 16 bytes in hex. `MARU_OK`, or `MARU_ERR_CONFIG` with the
/// reason in `maru_last_error()` (it names the file and what to do). Whether a daemon
/// holds the same key is not checked here: `maru_handler_open` proves it
/// (`MARU_ERR_AUTH` when it does not match).
///
/// Ownership: `path` is read during the call only. Threads: any.
#[no_mangle]
pub unsafe extern "C" fn maru_key_file_check(path: *const c_char) -> maru_status_t {
    ffi_guard(|| check(req_str(path, "path")?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::keyfile::write_new_key_file;
    use crate::auth::SharedKey;
    use std::ffi::CString;
    use std::os::unix::fs::PermissionsExt;

    fn status_of(path: &Path) -> (maru_status_t, String) {
        let c = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated string that outlives the call.
        let s = unsafe { maru_key_file_check(c.as_ptr()) };
        (s, crate::ffi::last_error().map(|e| e.1).unwrap_or_default())
    }

    #[test]
    fn a_good_key_passes_and_every_bad_file_is_a_config_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("maru-key-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.key");
        write_new_key_file(&good, &SharedKey::generate().unwrap()).unwrap();
        assert_eq!(status_of(&good).0, maru_status_t::MARU_OK);

        let missing = dir.join("missing.key");
        let open = dir.join("open.key");
        std::fs::copy(&good, &open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        let junk = dir.join("junk.key");
        std::fs::write(&junk, "not a key\n").unwrap();
        std::fs::set_permissions(&junk, std::fs::Permissions::from_mode(0o600)).unwrap();
        for bad in [&missing, &open, &junk] {
            let (s, msg) = status_of(bad);
            assert_eq!(s, maru_status_t::MARU_ERR_CONFIG, "{bad:?}: {msg}");
            assert!(msg.contains(bad.to_str().unwrap()), "{msg}");
        }
        // SAFETY: NULL is the case under test.
        assert_eq!(
            unsafe { maru_key_file_check(std::ptr::null()) },
            maru_status_t::MARU_ERR_NULL_ARGUMENT
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
