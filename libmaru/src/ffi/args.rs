//! Reading C arguments: strings, (pointer, count) arrays, caller buffers.
//!
//! One rule for every array argument: with `n == 0` the pointer is never read and may
//! be NULL (an empty `std::vector`'s `data()` may be); with `n > 0` a NULL pointer is
//! `MARU_ERR_NULL_ARGUMENT` naming the argument. Rust's slice constructors require a
//! non-NULL pointer even for length 0, so every array goes through these helpers.

use super::boundary::{require_non_null, FfiError};
use super::status::maru_status_t;
use std::ffi::{c_char, CStr};

/// An optional NUL-terminated UTF-8 string (`None` for NULL).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn opt_str<'a>(
    p: *const c_char,
    name: &str,
) -> Result<Option<&'a str>, FfiError> {
    if p.is_null() {
        return Ok(None);
    }
    CStr::from_ptr(p).to_str().map(Some).map_err(|_| {
        (
            maru_status_t::MARU_ERR_INVALID_ARGUMENT,
            format!("argument `{name}` is not UTF-8"),
        )
    })
}

/// A required NUL-terminated UTF-8 string.
///
/// # Safety
/// As [`opt_str`].
pub(crate) unsafe fn req_str<'a>(p: *const c_char, name: &str) -> Result<&'a str, FfiError> {
    opt_str(p, name)?.ok_or_else(|| {
        (
            maru_status_t::MARU_ERR_NULL_ARGUMENT,
            format!("argument `{name}` is NULL"),
        )
    })
}

/// `n` values the caller passes in; NULL is fine when `n == 0`.
///
/// # Safety
/// When `n > 0`, `p` is NULL or points to `n` readable values that outlive `'a`.
pub(crate) unsafe fn in_slice<'a, T>(
    p: *const T,
    n: usize,
    name: &str,
) -> Result<&'a [T], FfiError> {
    if n == 0 {
        return Ok(&[]);
    }
    require_non_null(p, name)?;
    Ok(std::slice::from_raw_parts(p, n))
}

/// `n` values the call writes; NULL is fine when `n == 0`.
///
/// # Safety
/// When `n > 0`, `p` is NULL or points to `n` writable values not aliased during `'a`.
pub(crate) unsafe fn out_slice<'a, T>(
    p: *mut T,
    n: usize,
    name: &str,
) -> Result<&'a mut [T], FfiError> {
    if n == 0 {
        return Ok(&mut []);
    }
    require_non_null(p, name)?;
    Ok(std::slice::from_raw_parts_mut(p, n))
}

/// The outputs of a load of `n` chunks, `lens` and `found`, written first as all misses
/// (length 0, not found): whatever the call returns then, every entry is written.
///
/// # Safety
/// As [`out_slice`], for each of the two arrays.
pub(crate) unsafe fn load_outputs<'a>(
    lens: *mut usize,
    found: *mut bool,
    n: usize,
) -> Result<(&'a mut [usize], &'a mut [bool]), FfiError> {
    let ls = out_slice(lens, n, "lens")?;
    let fs = out_slice(found, n, "found")?;
    ls.fill(0);
    fs.fill(false);
    Ok((ls, fs))
}

/// Copies `src` into an optional output array of `n` values (NULL: the caller does
/// not want it; nothing is written). `src` holds the `n` values.
///
/// # Safety
/// `p` is NULL or points to `n` writable values not aliased during the call.
pub(crate) unsafe fn copy_to_opt_out<T: Copy>(p: *mut T, n: usize, src: &[T]) {
    if !p.is_null() && n > 0 {
        std::slice::from_raw_parts_mut(p, n).copy_from_slice(src);
    }
}

/// The caller's buffer of `cap` bytes (empty for NULL or 0).
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes not aliased during `'a`.
pub(crate) unsafe fn buffer_of<'a>(buf: *mut u8, cap: usize) -> &'a mut [u8] {
    if buf.is_null() || cap == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(buf, cap)
    }
}

/// `n` keys (NUL-terminated UTF-8 strings), borrowed.
///
/// # Safety
/// As [`in_slice`], and each entry is NULL or a NUL-terminated string that outlives
/// `'a`.
pub(crate) unsafe fn keys_of<'a>(
    keys: *const *const c_char,
    n: usize,
) -> Result<Vec<&'a str>, FfiError> {
    in_slice(keys, n, "keys")?
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            // The key's argument name is formatted only for an error message, not for
            // every key of every batch call.
            req_str(k, "keys").or_else(|_| req_str(k, &format!("keys[{i}]")))
        })
        .collect()
}

/// `n` chunks: `lens[i]` bytes at `datas[i]`, borrowed.
///
/// # Safety
/// As [`in_slice`] for `datas` and `lens`, and each `datas[i]` is NULL or points to
/// `lens[i]` readable bytes that outlive `'a`.
pub(crate) unsafe fn chunks_of<'a>(
    datas: *const *const u8,
    lens: *const usize,
    n: usize,
) -> Result<Vec<&'a [u8]>, FfiError> {
    let ds = in_slice(datas, n, "datas")?;
    let ls = in_slice(lens, n, "lens")?;
    ds.iter()
        .zip(ls)
        .enumerate()
        .map(|(i, (&d, &len))| {
            // The chunk's argument name is formatted only for an error message, not for
            // every chunk of every batch call.
            in_slice(d, len, "datas").or_else(|_| in_slice(d, len, &format!("datas[{i}]")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr;

    #[test]
    fn an_optional_output_is_written_only_when_given() {
        let mut out = [false; 3];
        // SAFETY: `out` holds 3 writable values; NULL asks for nothing.
        unsafe {
            copy_to_opt_out(ptr::null_mut(), 3, &[true, false, true]);
            copy_to_opt_out(out.as_mut_ptr(), 3, &[true, false, true]);
        }
        assert_eq!(out, [true, false, true]);
    }

    #[test]
    fn a_load_writes_every_output_as_a_miss_before_it_loads() {
        let (mut lens, mut found) = ([7usize; 3], [true; 3]);
        // SAFETY: both arrays hold 3 writable values.
        let (ls, fs) = unsafe { load_outputs(lens.as_mut_ptr(), found.as_mut_ptr(), 3) }.unwrap();
        assert_eq!((&*ls, &*fs), (&[0usize; 3][..], &[false; 3][..]));
        let e = unsafe { load_outputs(lens.as_mut_ptr(), ptr::null_mut(), 3) }.unwrap_err();
        assert!(e.1.contains("`found`"), "{}", e.1);
    }

    #[test]
    fn empty_arrays_may_be_null() {
        unsafe {
            assert!(in_slice::<u64>(ptr::null(), 0, "ids").unwrap().is_empty());
            assert!(out_slice::<bool>(ptr::null_mut(), 0, "found")
                .unwrap()
                .is_empty());
            assert!(keys_of(ptr::null(), 0).unwrap().is_empty());
        }
    }

    #[test]
    fn a_null_array_with_entries_names_the_argument() {
        let e = unsafe { in_slice::<u64>(ptr::null(), 2, "ids") }.unwrap_err();
        assert_eq!(e.0, maru_status_t::MARU_ERR_NULL_ARGUMENT);
        assert!(e.1.contains("`ids`"), "{}", e.1);
        let k = [c"a".as_ptr(), ptr::null()];
        let e = unsafe { keys_of(k.as_ptr(), 2) }.unwrap_err();
        assert!(e.1.contains("keys[1]"), "{}", e.1);
    }

    #[test]
    fn a_null_chunk_is_named_with_its_index_and_an_empty_one_may_be_null() {
        let a = [1u8, 2, 3];
        let d = [a.as_ptr(), ptr::null(), ptr::null()];
        let got = unsafe { chunks_of(d.as_ptr(), [3, 0, 0].as_ptr(), 3) }.unwrap();
        assert_eq!(got, [&a[..], &[], &[]]);
        let e = unsafe { chunks_of(d.as_ptr(), [3, 0, 4].as_ptr(), 3) }.unwrap_err();
        assert_eq!(e.0, maru_status_t::MARU_ERR_NULL_ARGUMENT);
        assert!(e.1.contains("`datas[2]`"), "{}", e.1);
    }

    #[test]
    fn a_key_that_is_not_utf8_is_named_with_its_index() {
        let bad = [0xffu8, 0];
        let k = [c"a".as_ptr(), c"b".as_ptr(), bad.as_ptr().cast::<c_char>()];
        let e = unsafe { keys_of(k.as_ptr(), 3) }.unwrap_err();
        assert_eq!(e.0, maru_status_t::MARU_ERR_INVALID_ARGUMENT);
        assert!(e.1.contains("`keys[2]` is not UTF-8"), "{}", e.1);
    }
}
