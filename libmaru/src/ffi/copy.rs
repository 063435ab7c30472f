//! Copies between a runtime's memory and Maru's (a chunk read in place, a staging slot,
//! a page taken for writing in place), with libmaru's own copy: streaming stores for
//! large pieces, a store fence at the end. For a runtime whose KV cache is in host
//! memory (an engine on CPU): its blocks are scattered, so one chunk is several pieces,
//! and one call copies all the pieces of a batch of chunks.

use super::args::in_slice;
use super::boundary::{ffi_guard, FfiError};
use super::status::maru_status_t;

/// One piece to copy: `len` bytes from `src` to `dst`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_copy_t {
    pub dst: *mut u8,
    pub src: *const u8,
    pub len: usize,
}

fn check(copies: &[maru_copy_t]) -> Result<(), FfiError> {
    for (i, c) in copies.iter().enumerate() {
        if c.len > 0 && (c.dst.is_null() || c.src.is_null()) {
            return Err((
                maru_status_t::MARU_ERR_NULL_ARGUMENT,
                format!("copies[{i}] has a NULL address for {} bytes", c.len),
            ));
        }
    }
    Ok(())
}

/// Copies each of the `n` pieces of `copies` (`len` bytes from `src` to `dst`; a piece
/// of 0 bytes is skipped). `into_shared`: the destinations are Maru's memory that other
/// processes read (a page taken with `maru_pages_take`, a store slot): pieces of 16 KiB
/// or more are written with streaming stores, which do not read the lines they write.
/// Otherwise (the runtime's own memory, from a view or a load slot) the pieces of 4 KiB
/// or more stream when all the pieces together are 256 KiB or more (a chunk scattered
/// over a paged KV cache leaves the caches as a whole, however small its pieces); a
/// smaller call copies ordinarily. One store fence ends the call (not one per piece);
/// the bytes are visible to other threads when the call returns. A
/// piece with a NULL address (and `len` > 0) fails the call before anything is copied
/// (`MARU_ERR_NULL_ARGUMENT`, naming it).
///
/// Ownership: every `src` must be readable and every `dst` writable for `len` bytes
/// during the call, and no piece may overlap another piece's destination or its own
/// source; libmaru cannot check this (as with `memcpy`). Threads: any.
#[no_mangle]
pub unsafe extern "C" fn maru_copy(
    copies: *const maru_copy_t,
    n: usize,
    into_shared: bool,
) -> maru_status_t {
    ffi_guard(|| {
        let copies = in_slice(copies, n, "copies")?;
        check(copies)?;
        let pieces: Vec<(*mut u8, *const u8, usize)> = copies
            .iter()
            .map(|c| (c.dst, c.src.cast(), c.len))
            .collect();
        // SAFETY: the caller's contract: every `src` readable and every `dst` writable
        // for `len` bytes, not overlapping.
        unsafe { crate::dax::copy::copy_pieces(&pieces, into_shared) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_piece_is_copied_and_a_null_one_copies_nothing() {
        for into_shared in [false, true] {
            let src: Vec<u8> = (0..(600usize << 10)).map(|i| (i % 251) as u8).collect();
            let mut dst = vec![0u8; src.len()];
            // Three pieces in another order, one of them large enough to stream, and an
            // empty one.
            let (a, b) = (100usize, 300usize << 10);
            let copies = [
                maru_copy_t {
                    dst: dst[b..].as_mut_ptr(),
                    src: src[b..].as_ptr(),
                    len: src.len() - b,
                },
                maru_copy_t {
                    dst: dst.as_mut_ptr(),
                    src: src.as_ptr(),
                    len: a,
                },
                maru_copy_t {
                    dst: std::ptr::null_mut(),
                    src: std::ptr::null(),
                    len: 0,
                },
                maru_copy_t {
                    dst: dst[a..].as_mut_ptr(),
                    src: src[a..].as_ptr(),
                    len: b - a,
                },
            ];
            // SAFETY: every piece lies inside `src` and `dst`, which do not overlap.
            let st = unsafe { maru_copy(copies.as_ptr(), copies.len(), into_shared) };
            assert_eq!(st, maru_status_t::MARU_OK);
            assert!(dst == src, "into_shared {into_shared}");
        }
        let src = [1u8; 8];
        let mut dst = [0u8; 8];
        let copies = [
            maru_copy_t {
                dst: dst.as_mut_ptr(),
                src: src.as_ptr(),
                len: 8,
            },
            maru_copy_t {
                dst: std::ptr::null_mut(),
                src: src.as_ptr(),
                len: 8,
            },
        ];
        // SAFETY: the first piece is valid; the second is the NULL case under test.
        let st = unsafe { maru_copy(copies.as_ptr(), 2, false) };
        assert_eq!(st, maru_status_t::MARU_ERR_NULL_ARGUMENT);
        assert_eq!(dst, [0u8; 8], "nothing copied");
        assert!(crate::ffi::last_error()
            .map(|e| e.1)
            .unwrap_or_default()
            .contains("copies[1]"));
    }
}
