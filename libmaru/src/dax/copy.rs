//! Copies with streaming (non-temporal) stores, for bytes the copying thread does not
//! read again.
//!
//! - Into shared CXL memory ([`copy_to_shared`]): a stored chunk is read by other
//!   engines, not by the writer. An ordinary store first reads each line it writes
//!   (read for ownership; over the CXL link for real CXL memory) and the line is
//!   evicted again later; streaming stores write whole lines without reading them and
//!   leave the cache alone.
//! - Out of a region or a staging slot into the caller's buffer ([`copy_out`]), for
//!   chunks of 256 KiB or more: such a chunk goes on to the GPU by DMA, which reads
//!   memory, and a batch of them is larger than the caches anyway.
//!
//! On this project's 2-core EPYC bench VM streaming copies of 2 MiB chunks into cold
//! memory run at about 1.3 times `memcpy` (see `docs/benchmarks.md`). Both end with a
//! store fence, so the bytes are globally visible before any later store or call of
//! this thread (the publish that names them, the reply that hands them over). Small
//! copies, and targets other than x86_64, use an ordinary copy.

/// Stores into shared memory of at least this many bytes stream; below it an ordinary
/// copy is as fast and the fence not worth it.
pub const SHARED_STREAM_MIN: usize = 16 << 10;

/// Copies out to caller memory of at least this many bytes stream; smaller chunks are
/// likely read by the CPU next, from the cache an ordinary copy leaves them in.
pub const OUT_STREAM_MIN: usize = 256 << 10;

/// Copies `src` into shared memory at `dst`; the bytes are visible to other CPUs when
/// it returns.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`.
pub unsafe fn copy_to_shared(dst: *mut u8, src: &[u8]) {
    // SAFETY: the caller's contract.
    unsafe { copy_streaming(dst, src, SHARED_STREAM_MIN) }
}

/// Copies a loaded chunk into the caller's buffer (`dst.len() >= src.len()`; the
/// bytes after `src.len()` are left as they are).
pub fn copy_out(dst: &mut [u8], src: &[u8]) {
    assert!(dst.len() >= src.len(), "copy_out: destination too small");
    // SAFETY: `dst` is a distinct, writable slice of at least `src.len()` bytes (a
    // `&mut` cannot alias the shared `src`).
    unsafe { copy_streaming(dst.as_mut_ptr(), src, OUT_STREAM_MIN) }
}

/// Pieces of a batch copied out to caller memory ([`copy_pieces`]) stream from this
/// size when the whole batch is at least [`OUT_STREAM_MIN`]: the batch as a whole is
/// what leaves the caches (a chunk scattered over a paged KV cache, e.g. 128 KiB per
/// layer, is as cold as one 2 MiB piece), and below a page the fixed cost of the
/// unaligned head and tail outweighs what streaming saves.
pub const PIECE_STREAM_MIN: usize = 4 << 10;

/// Copies `src` to `dst`, streaming when `src.len() >= min`.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`.
unsafe fn copy_streaming(dst: *mut u8, src: &[u8], min: usize) {
    // SAFETY: the caller's contract.
    if unsafe { copy_unfenced(dst, src, min) } {
        fence();
    }
}

/// Copies `src` to `dst`, streaming (without the closing fence) when
/// `src.len() >= min`; returns whether it streamed.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`.
unsafe fn copy_unfenced(dst: *mut u8, src: &[u8], min: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= min {
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: AVX is present (checked above); the caller's contract covers
            // the ranges.
            unsafe { x86::stream_avx(dst, src) };
        } else {
            // SAFETY: SSE2 is part of x86_64; the caller's contract covers the ranges.
            unsafe { x86::stream_sse2(dst, src) };
        }
        return true;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = min;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    false
}

/// The store fence that makes streaming stores globally visible (nothing elsewhere).
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// The piece size from which [`copy_pieces`] streams the pieces of this batch.
fn stream_from(pieces: &[(*mut u8, *const u8, usize)], into_shared: bool) -> usize {
    if into_shared {
        SHARED_STREAM_MIN
    } else if pieces.iter().map(|p| p.2).sum::<usize>() >= OUT_STREAM_MIN {
        PIECE_STREAM_MIN
    } else {
        usize::MAX
    }
}

/// Copies each `(dst, src, len)` piece, with one store fence at the end (not one per
/// piece): a batch of pieces, as `maru_copy` gets them. `into_shared` (Maru's memory
/// that other processes read): pieces of [`SHARED_STREAM_MIN`] or more stream, as with
/// [`copy_to_shared`]. Otherwise (the caller's memory): when the batch totals
/// [`OUT_STREAM_MIN`] or more, its pieces of [`PIECE_STREAM_MIN`] or more stream, as a
/// single piece of that size would with [`copy_out`]; a smaller batch is copied
/// ordinarily. The bytes are visible to other CPUs when it returns.
///
/// # Safety
/// Each `dst` must be valid for writes of `len` bytes and each `src` for reads of
/// `len` bytes, and no piece's destination may overlap its own source or another
/// piece's destination. Pieces of 0 bytes are skipped (their addresses unused).
pub unsafe fn copy_pieces(pieces: &[(*mut u8, *const u8, usize)], into_shared: bool) {
    let min = stream_from(pieces, into_shared);
    let mut streamed = false;
    for &(dst, src, len) in pieces.iter().filter(|p| p.2 > 0) {
        // SAFETY: the caller's contract.
        streamed |= unsafe { copy_unfenced(dst, std::slice::from_raw_parts(src, len), min) };
    }
    if streamed {
        fence();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_loadu_si128,
        _mm_stream_si128,
    };

    /// The bytes before `dst` reaches `align`, and the whole blocks of `block` bytes
    /// after that: `(head, body)`; the rest is the tail.
    fn split(dst: *mut u8, len: usize, align: usize, block: usize) -> (usize, usize) {
        let head = dst.align_offset(align).min(len);
        let body = (len - head) / block * block;
        (head, body)
    }

    /// 32-byte streaming stores, 128 bytes per step, without the closing store fence
    /// (the caller's).
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
        }
    }

    /// 16-byte streaming stores, 64 bytes per step (every x86_64 has SSE2), without
    /// the closing store fence (the caller's).
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

    unsafe fn out(d: *mut u8, s: &[u8]) {
        // SAFETY: `check` hands a buffer with room for `s.len()` bytes at `d`.
        copy_out(unsafe { std::slice::from_raw_parts_mut(d, s.len()) }, s)
    }

    #[test]
    fn large_and_small_copies_at_every_alignment_keep_every_byte() {
        for len in [
            0,
            1,
            100,
            SHARED_STREAM_MIN - 1,
            SHARED_STREAM_MIN,
            SHARED_STREAM_MIN + 77,
            OUT_STREAM_MIN - 1,
            OUT_STREAM_MIN + 5,
            1 << 20,
        ] {
            for off in [0, 1, 15, 16, 31, 33, 64] {
                check(copy_to_shared, off % 5, off, len);
                check(out, off % 3, off, len);
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

    /// Copies pieces of `lens` (each at an odd offset in both buffers, with gaps
    /// between them) in one [`copy_pieces`] call, in reverse order, with an empty piece
    /// of NULL addresses among them; checks every piece and that no byte between or
    /// around them changed.
    fn check_pieces(lens: &[usize], into_shared: bool) {
        let gap = 37;
        let total: usize = lens.iter().map(|n| n + gap).sum::<usize>() + gap;
        let src = pattern(total, 11);
        let mut dst = vec![0xEEu8; total];
        let mut pieces = vec![(std::ptr::null_mut(), std::ptr::null(), 0)];
        let mut at = gap;
        for &n in lens {
            // SAFETY: `at + n <= total` in both buffers.
            pieces.push(unsafe { (dst.as_mut_ptr().add(at), src.as_ptr().add(at), n) });
            at += n + gap;
        }
        pieces.reverse();
        // SAFETY: the pieces lie inside `src` and `dst` (separate), none overlapping.
        unsafe { copy_pieces(&pieces, into_shared) };
        let mut at = gap;
        for (i, &n) in lens.iter().enumerate() {
            assert!(dst[at..at + n] == src[at..at + n], "piece {i} of {n} bytes");
            assert!(
                dst[at - gap..at].iter().all(|&b| b == 0xEE),
                "bytes before piece {i}"
            );
            at += n + gap;
        }
        assert!(
            dst[at - gap..].iter().all(|&b| b == 0xEE),
            "bytes after the last piece"
        );
    }

    #[test]
    fn a_batch_of_pieces_keeps_every_byte_and_touches_nothing_else() {
        // A paged KV cache's chunk (16 layers of 2 blocks): 32 pieces of 64 KiB + 3, a
        // batch far above OUT_STREAM_MIN; then pieces around PIECE_STREAM_MIN; then a
        // batch below OUT_STREAM_MIN (copied ordinarily).
        let kv: Vec<usize> = (0..32).map(|i| (64 << 10) + 3 + i).collect();
        let around = [
            PIECE_STREAM_MIN - 1,
            PIECE_STREAM_MIN,
            PIECE_STREAM_MIN + 1,
            1,
            127,
            OUT_STREAM_MIN + 5,
        ];
        for into_shared in [false, true] {
            check_pieces(&kv, into_shared);
            check_pieces(&around, into_shared);
            check_pieces(&[100, 5000, 70_001], into_shared);
            check_pieces(&[], into_shared);
        }
    }

    #[test]
    fn a_batch_streams_by_its_total_size_not_only_its_pieces() {
        let piece = |len| (std::ptr::null_mut(), std::ptr::null(), len);
        // One chunk of a paged KV cache: 16 layers of 128 KiB, each below OUT_STREAM_MIN.
        let chunk: Vec<_> = (0..16).map(|_| piece(128 << 10)).collect();
        assert_eq!(stream_from(&chunk, false), PIECE_STREAM_MIN);
        assert_eq!(stream_from(&chunk, true), SHARED_STREAM_MIN);
        // A small batch stays in the caches for the caller to read next.
        let small = [piece(64 << 10), piece(64 << 10)];
        assert_eq!(stream_from(&small, false), usize::MAX);
        assert_eq!(
            stream_from(&[piece(OUT_STREAM_MIN)], false),
            PIECE_STREAM_MIN
        );
    }

    proptest! {
        #[test]
        fn any_pieces_copy_exactly(lens in proptest::collection::vec(0usize..40_000, 0..24), into_shared: bool) {
            check_pieces(&lens, into_shared);
        }

        #[test]
        fn any_length_and_offset_copies_exactly(len in 0usize..200_000, off in 0usize..64, so in 0usize..64) {
            check(copy_to_shared, so, off, len);
            check(out, so, off, len);
        }
    }
}
