//! Copies into shared CXL memory with non-temporal stores.
//!
//! A chunk stored into a region is read by other engines, not by the writer, so
//! bringing its lines into the writer's cache only costs: an ordinary store first
//! reads each line it writes (read for ownership, over the CXL link for real CXL
//! memory), then the line is evicted again later. Streaming stores write whole lines
//! without reading them and leave the cache alone. On this project's 2-core EPYC
//! bench VM they copy 2 MiB chunks into cold memory about 1.3 times as fast as
//! `memcpy` (see `docs/benchmarks.md`).
//!
//! [`copy_to_shared`] ends with a store fence, so the bytes are globally visible
//! before any later store or call of this thread (the publish that names them).
//! Small copies, and targets other than x86_64, use an ordinary copy.

/// Below this many bytes an ordinary copy is as fast and the fence not worth it.
pub const STREAM_MIN: usize = 16 << 10;

/// Copies `src` to `dst` (`src.len()` bytes), streaming the bulk of it past the caches
/// when the copy is large; the bytes are visible to other CPUs when it returns.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`.
pub unsafe fn copy_to_shared(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_MIN {
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: AVX is present (checked above); the caller's contract covers
            // the ranges.
            unsafe { x86::stream_avx(dst, src) };
        } else {
            // SAFETY: SSE2 is part of x86_64; the caller's contract covers the ranges.
            unsafe { x86::stream_sse2(dst, src) };
        }
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_loadu_si128, _mm_sfence,
        _mm_stream_si128,
    };

    /// The bytes before `dst` reaches `align`, and the whole blocks of `block` bytes
    /// after that: `(head, body)`; the rest is the tail.
    fn split(dst: *mut u8, len: usize, align: usize, block: usize) -> (usize, usize) {
        let head = dst.align_offset(align).min(len);
        let body = (len - head) / block * block;
        (head, body)
    }

    /// 32-byte streaming stores, 128 bytes per step.
    ///
    /// # Safety
    /// AVX must be present; `dst` valid for `src.len()` bytes, not overlapping `src`.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn stream_avx(dst: *mut u8, src: &[u8]) {
        let n = src.len();
        let s = src.as_ptr();
        let (head, body) = split(dst, n, 32, 128);
        // SAFETY: every offset below stays inside `0..n` of both ranges, and the
        // streaming stores are 32-byte aligned (`head` brings `dst` to 32).
        unsafe {
            std::ptr::copy_nonoverlapping(s, dst, head);
            let mut i = head;
            while i < head + body {
                let a = _mm256_loadu_si256(s.add(i).cast::<__m256i>());
                let b = _mm256_loadu_si256(s.add(i + 32).cast::<__m256i>());
                let c = _mm256_loadu_si256(s.add(i + 64).cast::<__m256i>());
                let d = _mm256_loadu_si256(s.add(i + 96).cast::<__m256i>());
                _mm256_stream_si256(dst.add(i).cast::<__m256i>(), a);
                _mm256_stream_si256(dst.add(i + 32).cast::<__m256i>(), b);
                _mm256_stream_si256(dst.add(i + 64).cast::<__m256i>(), c);
                _mm256_stream_si256(dst.add(i + 96).cast::<__m256i>(), d);
                i += 128;
            }
            std::ptr::copy_nonoverlapping(s.add(i), dst.add(i), n - i);
            _mm_sfence();
        }
    }

    /// 16-byte streaming stores, 64 bytes per step (every x86_64 has SSE2).
    ///
    /// # Safety
    /// `dst` valid for `src.len()` bytes, not overlapping `src`.
    pub(super) unsafe fn stream_sse2(dst: *mut u8, src: &[u8]) {
        let n = src.len();
        let s = src.as_ptr();
        let (head, body) = split(dst, n, 16, 64);
        // SAFETY: as in `stream_avx`, with 16-byte alignment.
        unsafe {
            std::ptr::copy_nonoverlapping(s, dst, head);
            let mut i = head;
            while i < head + body {
                for k in (0..64).step_by(16) {
                    let v = _mm_loadu_si128(s.add(i + k).cast::<__m128i>());
                    _mm_stream_si128(dst.add(i + k).cast::<__m128i>(), v);
                }
                i += 64;
            }
            std::ptr::copy_nonoverlapping(s.add(i), dst.add(i), n - i);
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Copies with `f` into `dst[off..off + len]` of a buffer filled with 0xEE and
    /// checks the copy and that no byte around it changed.
    fn check(f: unsafe fn(*mut u8, &[u8]), src_off: usize, off: usize, len: usize) {
        let src = pattern(src_off + len, 7);
        let mut dst = vec![0xEEu8; off + len + 64];
        // SAFETY: `dst` has room for `off + len`; separate allocations.
        unsafe { f(dst.as_mut_ptr().add(off), &src[src_off..]) };
        assert_eq!(&dst[off..off + len], &src[src_off..], "off {off} len {len}");
        assert!(dst[..off].iter().all(|&b| b == 0xEE), "bytes before");
        assert!(dst[off + len..].iter().all(|&b| b == 0xEE), "bytes after");
    }

    #[test]
    fn large_and_small_copies_at_every_alignment_keep_every_byte() {
        for len in [
            0,
            1,
            100,
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN + 77,
            1 << 20,
        ] {
            for off in [0, 1, 15, 16, 31, 33, 64] {
                check(copy_to_shared, off % 5, off, len);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_streaming_paths_copy_exactly() {
        unsafe fn sse2(d: *mut u8, s: &[u8]) {
            // SAFETY: forwarded contract.
            unsafe { x86::stream_sse2(d, s) }
        }
        unsafe fn avx(d: *mut u8, s: &[u8]) {
            // SAFETY: only called where AVX is present; forwarded contract.
            unsafe { x86::stream_avx(d, s) }
        }
        for len in [0, 1, 63, 64, 65, 127, 128, 129, 4096 + 3, 300_001] {
            for off in [0, 1, 7, 16, 17, 32, 45] {
                check(sse2, 3, off, len);
                if std::arch::is_x86_feature_detected!("avx") {
                    check(avx, 3, off, len);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn any_length_and_offset_copies_exactly(len in 0usize..200_000, off in 0usize..64, so in 0usize..64) {
            check(copy_to_shared, so, off, len);
        }
    }
}
