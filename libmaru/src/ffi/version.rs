//! Which library is loaded: the ABI version and the release.

use std::ffi::{c_char, CStr};

/// The version of the C ABI described by this header. It changes only when an
/// existing function, type or value changes incompatibly; additions keep it.
/// Compare it with `maru_abi_version()` after loading the library.
pub const MARU_ABI_VERSION: u32 = 1;

const VERSION_STRING: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(s) => s,
        Err(_) => panic!("the crate version contains a NUL byte"),
    };

/// The ABI version of the loaded library. A caller that was compiled against
/// this header should refuse to use a library whose value differs from
/// `MARU_ABI_VERSION`. Never fails; does not change the last error. Threads: any.
#[no_mangle]
pub extern "C" fn maru_abi_version() -> u32 {
    MARU_ABI_VERSION
}

/// The version of libmaru, such as "0.1.0", as a static NUL-terminated string
/// that is never freed. Never NULL; does not change the last error. Threads: any.
#[no_mangle]
pub extern "C" fn maru_version_string() -> *const c_char {
    VERSION_STRING.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abi_version_matches_constant() {
        assert_eq!(maru_abi_version(), MARU_ABI_VERSION);
    }

    #[test]
    fn version_string_is_crate_version() {
        // SAFETY: a static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(maru_version_string()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
