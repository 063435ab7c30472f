//! Chunk keys: the one keying scheme every engine of a pool shares (the Python
//! binding's `maru.chunk_keys` computes the same keys), so a C++ runtime and a
//! Python engine that see the same prompt prefix find each other's chunks.

use super::args::{in_slice, req_str};
use super::boundary::{check_not_null, ffi_guard};
use super::status::maru_status_t;
use sha2::{Digest, Sha256};
use std::ffi::c_char;

/// Bytes one key takes in the output of `maru_chunk_keys`: 64 lowercase hex
/// characters and the terminating NUL.
pub const MARU_CHUNK_KEY_SIZE: usize = 65;

const DOMAIN: &[u8] = b"maru-chunk-v1\0";

/// The keys of the full chunks of `tokens` (see `maru_chunk_keys`).
pub fn chunk_keys(tokens: &[i32], chunk_tokens: usize, namespace: &str) -> Vec<String> {
    if chunk_tokens == 0 {
        return Vec::new();
    }
    let mut prev: Option<[u8; 32]> = None;
    tokens
        .chunks_exact(chunk_tokens)
        .map(|chunk| {
            let mut h = Sha256::new();
            match &prev {
                None => {
                    h.update(DOMAIN);
                    h.update(namespace.as_bytes());
                    h.update([0u8]);
                }
                Some(p) => h.update(p),
            }
            for t in chunk {
                h.update(t.to_le_bytes());
            }
            let d: [u8; 32] = h.finalize().into();
            prev = Some(d);
            d.iter().map(|b| format!("{b:02x}")).collect()
        })
        .collect()
}

/// Derives the keys of the full chunks of `n_tokens` token ids, `chunk_tokens` ids
/// per chunk, in namespace `ns`: the same keys as the Python `maru.chunk_keys`.
///
/// With the chunks `c_0, c_1, ...` (a partial last chunk has no key) and `le32(c)`
/// each id of `c` as a little-endian 32-bit integer:
/// `d_0 = sha256("maru-chunk-v1" NUL namespace NUL le32(c_0))`,
/// `d_i = sha256(d_{i-1} le32(c_i))`, and key `i` is `d_i` in 64 lowercase hex digits.
/// A key depends on every token up to the end of its chunk and on the namespace: put
/// everything that makes KV bytes incompatible (model, dtype, chunk size, rank) in
/// the namespace.
///
/// `keys_out` holds `cap` keys of `MARU_CHUNK_KEY_SIZE` bytes each; key `i` is written
/// NUL-terminated at `keys_out + i * MARU_CHUNK_KEY_SIZE`. `*n_keys` is the number of
/// keys (`n_tokens / chunk_tokens`); when that exceeds `cap` nothing is written and
/// the call returns `MARU_ERR_BUFFER_TOO_SMALL`. `chunk_tokens` = 0 is
/// `MARU_ERR_INVALID_ARGUMENT`; `tokens` and `keys_out` may be NULL when their count
/// is 0. Needs no handler. Threads: any.
#[no_mangle]
pub unsafe extern "C" fn maru_chunk_keys(
    tokens: *const i32,
    n_tokens: usize,
    chunk_tokens: usize,
    ns: *const c_char,
    keys_out: *mut c_char,
    cap: usize,
    n_keys: *mut usize,
) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(ns, n_keys);
        if chunk_tokens == 0 {
            return Err((
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                "chunk_tokens must be positive".into(),
            ));
        }
        let ns = req_str(ns, "ns")?;
        let ts = in_slice(tokens, n_tokens, "tokens")?;
        let need = n_tokens / chunk_tokens;
        *n_keys = need;
        if need > cap {
            return Err((
                maru_status_t::MARU_ERR_BUFFER_TOO_SMALL,
                format!("{need} keys; keys_out holds {cap}"),
            ));
        }
        let out = super::args::out_slice(
            keys_out.cast::<u8>(),
            need * MARU_CHUNK_KEY_SIZE,
            "keys_out",
        )?;
        for (k, dst) in chunk_keys(ts, chunk_tokens, ns)
            .iter()
            .zip(out.chunks_exact_mut(MARU_CHUNK_KEY_SIZE))
        {
            dst[..64].copy_from_slice(k.as_bytes());
            dst[64] = 0;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn the_first_key_follows_the_documented_formula() {
        // sha256("maru-chunk-v1\0" "ns\0" le32(1) le32(2)), computed independently.
        let mut h = Sha256::new();
        h.update(b"maru-chunk-v1\0ns\0\x01\x00\x00\x00\x02\x00\x00\x00");
        let want: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let keys = chunk_keys(&[1, 2, 3], 2, "ns");
        assert_eq!(keys, vec![want], "a partial chunk has no key");
    }

    #[test]
    fn keys_chain_and_depend_on_the_namespace() {
        let a = chunk_keys(&[1, 2, 3, 4], 2, "ns");
        let b = chunk_keys(&[1, 2, 3, 5], 2, "ns");
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_ne!(chunk_keys(&[1, 2], 2, "other")[0], a[0]);
        let c = chunk_keys(&[9, 2, 3, 4], 2, "ns");
        assert_ne!(c[1], a[1], "a later key depends on every earlier token");
    }

    #[test]
    fn the_c_call_writes_nul_terminated_keys() {
        let toks = [5i32, -1, 7, 8, 9];
        let mut out = vec![0x55 as c_char; 2 * MARU_CHUNK_KEY_SIZE];
        let mut n = 0usize;
        // The five tokens in chunks of 2 under "m/l", into `cap` keys of `out`.
        let call = |out: &mut [c_char], cap: usize, n: &mut usize| unsafe {
            maru_chunk_keys(
                toks.as_ptr(),
                5,
                2,
                c"m/l".as_ptr(),
                out.as_mut_ptr(),
                cap,
                n,
            )
        };
        let st = call(&mut out, 2, &mut n);
        assert_eq!(st, maru_status_t::MARU_OK);
        assert_eq!(n, 2);
        let want = chunk_keys(&toks, 2, "m/l");
        for (i, w) in want.iter().enumerate() {
            let k = unsafe { CStr::from_ptr(out.as_ptr().add(i * MARU_CHUNK_KEY_SIZE)) };
            assert_eq!(k.to_str().unwrap(), w);
        }
        let st = call(&mut out, 1, &mut n);
        assert_eq!(st, maru_status_t::MARU_ERR_BUFFER_TOO_SMALL);
        assert_eq!(n, 2);
        let st = unsafe {
            maru_chunk_keys(
                std::ptr::null(),
                0,
                4,
                c"m".as_ptr(),
                std::ptr::null_mut(),
                0,
                &mut n,
            )
        };
        assert_eq!(st, maru_status_t::MARU_OK);
        assert_eq!(n, 0);
        let st = unsafe {
            maru_chunk_keys(
                toks.as_ptr(),
                5,
                0,
                c"m".as_ptr(),
                out.as_mut_ptr(),
                2,
                &mut n,
            )
        };
        assert_eq!(st, maru_status_t::MARU_ERR_INVALID_ARGUMENT);
    }
}
