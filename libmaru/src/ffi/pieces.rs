//! Chunks by key copied in pieces into the caller's memory, in one call: for a runtime
//! whose KV cache is paged (each chunk lands in several places, one per layer, say),
//! so that a load takes the leases, copies the pieces while they are held and gives
//! the leases back without returning to the caller in between.

use super::args::{in_slice, load_outputs, opt_str};
use super::boundary::FfiError;
use super::calls::keyed;
use super::status::maru_status_t;
use std::ffi::c_char;

/// One piece of a chunk that `maru_load_pieces` copies: the `len` bytes at `offset` of
/// chunk `keys[chunk]`, written to `dst`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct maru_piece_t {
    pub chunk: usize,
    pub offset: usize,
    pub dst: *mut u8,
    pub len: usize,
}

/// One piece as the copy takes it: `(offset in the chunk, dst, len)`.
type Piece = (usize, *mut u8, usize);

/// The pieces of each of `n` chunks, in the caller's order, after checking every piece
/// (nothing is loaded when one is wrong): its chunk index below `n`, a destination for
/// its bytes, an end that does not overflow.
fn by_chunk(pieces: &[maru_piece_t], n: usize) -> Result<Vec<Vec<Piece>>, FfiError> {
    let mut out: Vec<Vec<Piece>> = vec![Vec::new(); n];
    for (j, p) in pieces.iter().enumerate() {
        if p.chunk >= n {
            return Err((
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                format!("pieces[{j}] names chunk {} of {n} keys", p.chunk),
            ));
        }
        if p.len > 0 && p.dst.is_null() {
            return Err((
                maru_status_t::MARU_ERR_NULL_ARGUMENT,
                format!("pieces[{j}] has a NULL dst for {} bytes", p.len),
            ));
        }
        if p.offset.checked_add(p.len).is_none() {
            return Err((
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                format!("pieces[{j}]: offset {} + len {} overflows", p.offset, p.len),
            ));
        }
        out[p.chunk].push((p.offset, p.dst, p.len));
    }
    Ok(out)
}

/// Copies `pieces` out of one chunk's bytes, with one fence; false (nothing copied)
/// when a piece ends past the chunk.
///
/// # Safety
/// Each piece's `dst` is writable for its `len` bytes and overlaps neither `chunk` nor
/// another piece's destination.
unsafe fn copy_chunk(chunk: &[u8], pieces: &[Piece]) -> bool {
    if pieces.iter().any(|&(off, _, len)| off + len > chunk.len()) {
        return false;
    }
    let moves: Vec<(*mut u8, *const u8, usize)> = pieces
        .iter()
        .map(|&(off, dst, len)| (dst, chunk[off..].as_ptr(), len))
        .collect();
    // SAFETY: every source lies inside `chunk` (checked above); the destinations are
    // the caller's contract.
    unsafe { crate::dax::copy::copy_pieces(&moves, false) };
    true
}

/// Loads `n` chunks of one request and copies pieces of them straight into the
/// caller's memory: each `pieces[j]` is `len` bytes at `offset` of chunk
/// `keys[pieces[j].chunk]`, written to `dst` (a chunk may have any number of pieces,
/// in any order, none too). The leases of the chunks are taken and the pieces copied
/// while they are held (on `cxl` from this host's mapping, on `remote_cxl` from the
/// handler's staging buffer after the transfer), inside this call, each wait bounded
/// by the handler's `timeout_ms`: one call where `maru_views_acquire`, `maru_copy` and
/// `maru_views_release` take three. The call returns once the bytes are copied: the
/// leases are given back after it by the handler's `maru-release` thread (sent inline
/// when 64 releases wait already), at the latest by `maru_handler_close`; one whose
/// release fails expires at maru-server. Until then a key loaded stays leased (it
/// cannot be removed or evicted meanwhile). Both backends. `route_key`: as for
/// `maru_load_batch` (NULL: the first key).
///
/// Every piece is checked before anything is loaded: a chunk index not below `n` or
/// an `offset + len` that overflows is `MARU_ERR_INVALID_ARGUMENT`, a NULL `dst` with
/// `len` > 0 `MARU_ERR_NULL_ARGUMENT`, each naming the piece. Then, whatever the
/// status, every `found[i]` and `lens[i]` is written: `found[i]` true where chunk `i`
/// was found and all its pieces copied; `lens[i]` the chunk's length wherever it was
/// found (also for a chunk shorter than one of its pieces needs: none of its pieces
/// is copied and `found[i]` is false), 0 for a miss or a failed read. A chunk missing
/// does not stop the others (`found` may have holes, as with `maru_load_batch`).
///
/// Ownership: `keys`, `pieces`, `lens` and `found` are the caller's; every `dst` must
/// be writable for its `len` bytes during the call, and no two pieces' destinations
/// may overlap (libmaru cannot check this, as with `memcpy`). Large calls stream
/// their copies (as `maru_copy` into the runtime's memory): the bytes are visible to
/// other threads when the call returns. Threads: any, concurrently with other calls on
/// the handler.
#[no_mangle]
pub unsafe extern "C" fn maru_load_pieces(
    h: *const super::handler::maru_handler_t,
    keys: *const *const c_char,
    n: usize,
    route_key: *const c_char,
    pieces: *const maru_piece_t,
    n_pieces: usize,
    lens: *mut usize,
    found: *mut bool,
) -> maru_status_t {
    keyed(h, keys, n, |call, ks| {
        let rk = opt_str(route_key, "route_key")?;
        let ps = in_slice(pieces, n_pieces, "pieces")?;
        let (ls, fs) = load_outputs(lens, found, n)?;
        let groups = by_chunk(ps, n)?;
        call.handler().load_each(&ks, rk, true, &mut |i, bytes| {
            let (Some(l), Some(f), Some(g)) = (ls.get_mut(i), fs.get_mut(i), groups.get(i)) else {
                return;
            };
            *l = bytes.len();
            // SAFETY: the caller's contract on every `dst`; the sources are checked
            // against the chunk.
            *f = unsafe { copy_chunk(bytes, g) };
        })?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(chunk: usize, offset: usize, dst: *mut u8, len: usize) -> maru_piece_t {
        maru_piece_t {
            chunk,
            offset,
            dst,
            len,
        }
    }

    #[test]
    fn pieces_are_grouped_by_chunk_and_a_wrong_one_is_named() {
        let mut a = [0u8; 4];
        let p = a.as_mut_ptr();
        let ok = [piece(1, 0, p, 2), piece(0, 2, p, 2), piece(1, 2, p, 0)];
        let g = by_chunk(&ok, 3).unwrap();
        assert_eq!(g.iter().map(Vec::len).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(g[1][0].0, 0, "the caller's order kept");
        // An empty piece may have a NULL destination.
        assert!(by_chunk(&[piece(0, 0, std::ptr::null_mut(), 0)], 1).is_ok());
        for (bad, status, names) in [
            (
                piece(3, 0, p, 1),
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                "chunk 3 of 3",
            ),
            (
                piece(0, 0, std::ptr::null_mut(), 1),
                maru_status_t::MARU_ERR_NULL_ARGUMENT,
                "NULL dst",
            ),
            (
                piece(0, usize::MAX, p, 1),
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                "overflows",
            ),
        ] {
            let e = by_chunk(&[ok[0], bad], 3).unwrap_err();
            assert_eq!(e.0, status);
            assert!(e.1.contains("pieces[1]") && e.1.contains(names), "{}", e.1);
        }
    }

    #[test]
    fn a_chunk_is_copied_in_pieces_or_not_at_all() {
        // Large enough that the copy streams, with odd offsets and lengths.
        let chunk: Vec<u8> = (0..(300usize << 10) + 7).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; chunk.len()];
        let cut = (100 << 10) + 3;
        let d = dst.as_mut_ptr();
        // SAFETY: both pieces lie inside `dst`, apart, and `chunk` is another vector.
        let ok = unsafe {
            copy_chunk(
                &chunk,
                &[(cut, d.wrapping_add(cut), chunk.len() - cut), (0, d, cut)],
            )
        };
        assert!(ok && dst == chunk);
        // One piece past the end: nothing is copied, also not the pieces that fit.
        let mut dst = vec![0u8; 16];
        let d = dst.as_mut_ptr();
        // SAFETY: as above; the second piece is refused before any copy.
        let ok = unsafe { copy_chunk(&chunk[..8], &[(0, d, 8), (4, d.wrapping_add(8), 8)]) };
        assert!(!ok);
        assert_eq!(dst, [0u8; 16]);
    }
}
