//! Authentication: HMAC-SHA256 key proofs over per-connection nonces (both ways),
//! key files, keyrings (named keys: maru-server's tenants), read tokens.
//!
//! The proof is sans-I/O: [`ClientProof`] and [`ServerProof`] take the peer's
//! handshake messages and return what to send, so every rule (a replayed proof
//! fails, both sides prove the key, a wrong key fails) is tested without sockets.

pub mod keyfile;
pub mod keyring;
mod proof;

pub use keyfile::{
    load_key_file, load_or_create_key, server_key_from_env, KeyFileError, SharedKey,
};
pub use keyring::{Keyring, KeyringError, NoKey, DEFAULT_KEY_NAME};
pub use proof::{ClientProof, ProofError, ServerProof};

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA256 of `key` over the concatenation of `parts`, each preceded by its
/// length (u64 LE) so that no two different part lists give the same input.
pub fn hmac_parts(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // new_from_slice accepts keys of any length for HMAC.
    let mut mac = match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => unreachable_hmac(),
    };
    for p in parts {
        mac.update(&(p.len() as u64).to_le_bytes());
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

#[cold]
fn unreachable_hmac() -> ! {
    // HMAC is defined for every key length; hmac's new_from_slice never fails for it.
    panic!("HMAC-SHA256 rejected a key length, which HMAC does not do")
}

/// Compares two byte strings in time that depends only on their lengths
/// (`subtle`'s constant-time equality).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

/// Bytes of a hex string (either case), or `None` if it is not hex of even length
/// (the `hex` crate's decoding).
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    hex::decode(s).ok()
}

/// `n` random bytes from the kernel (the `getrandom` crate: getrandom(2) on Linux,
/// retried when interrupted). Fails only if the kernel refuses.
pub fn random_bytes(n: usize) -> std::io::Result<Vec<u8>> {
    let mut out = vec![0u8; n];
    getrandom::fill(&mut out).map_err(|e| match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::other(e.to_string()),
    })?;
    Ok(out)
}

/// A fresh 32-byte nonce as hex.
pub fn fresh_nonce() -> std::io::Result<String> {
    Ok(to_hex(&random_bytes(32)?))
}

/// Length of region tokens and read tokens (bytes; 128 bits).
pub const TOKEN_LEN: usize = 16;

/// The RM's auth token of a region: HMAC of the RM secret over its identity.
pub fn region_token(secret: &[u8], region_id: u64, offset: u64, length: u64, nonce: u64) -> String {
    let mac = hmac_parts(
        secret,
        &[
            b"maru-region-token",
            &region_id.to_le_bytes(),
            &offset.to_le_bytes(),
            &length.to_le_bytes(),
            &nonce.to_le_bytes(),
        ],
    );
    to_hex(&mac[..TOKEN_LEN])
}

/// A read token: HMAC of the region's RM auth token over (region id, offset, length).
/// It lets a reader map `length` bytes at `offset` of the region for reading and
/// nothing else; it cannot be turned into the region token or another range's token.
pub fn read_token(region_token: &str, region_id: u64, offset: u64, length: u64) -> String {
    let mac = hmac_parts(
        region_token.as_bytes(),
        &[
            b"maru-read-token",
            &region_id.to_le_bytes(),
            &offset.to_le_bytes(),
            &length.to_le_bytes(),
        ],
    );
    to_hex(&mac[..TOKEN_LEN])
}

/// Checks a presented token against the expected one in constant time.
pub fn token_matches(expected: &str, presented: &str) -> bool {
    ct_eq(expected.as_bytes(), presented.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_parts_are_length_framed() {
        let k = b"k";
        assert_ne!(hmac_parts(k, &[b"ab", b"c"]), hmac_parts(k, &[b"a", b"bc"]));
        assert_eq!(hmac_parts(k, &[b"ab", b"c"]), hmac_parts(k, &[b"ab", b"c"]));
    }

    #[test]
    fn hex_round_trip() {
        let b = random_bytes(33).unwrap();
        assert_eq!(from_hex(&to_hex(&b)).unwrap(), b);
        assert!(from_hex("abc").is_none());
        assert!(from_hex("zz").is_none());
        // Key files, nonces and key ids are written lower-case; either case is read.
        assert_eq!(to_hex(&[0xab, 0x01]), "ab01");
        assert_eq!(from_hex("AB01"), Some(vec![0xab, 0x01]));
    }

    #[test]
    fn random_bytes_are_fresh_and_of_the_length_asked() {
        assert!(random_bytes(0).unwrap().is_empty());
        let (a, b) = (random_bytes(32).unwrap(), random_bytes(32).unwrap());
        assert_eq!((a.len(), b.len()), (32, 32));
        assert_ne!(a, b, "two draws of 256 bits");
        assert_eq!(random_bytes(100_000).unwrap().len(), 100_000);
    }

    #[test]
    fn ct_eq_basics() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
    }

    #[test]
    fn read_tokens_bind_the_range() {
        let t = region_token(b"secret", 7, 0, 1 << 21, 99);
        let r = read_token(&t, 7, 4096, 8192);
        assert!(token_matches(&r, &read_token(&t, 7, 4096, 8192)));
        assert!(!token_matches(&r, &read_token(&t, 7, 4096, 8193)));
        assert!(!token_matches(&r, &read_token(&t, 7, 0, 8192)));
        assert!(!token_matches(&r, &read_token(&t, 8, 4096, 8192)));
        // Another region's token gives another read token for the same range.
        let t2 = region_token(b"secret", 7, 0, 1 << 21, 100);
        assert!(!token_matches(&r, &read_token(&t2, 7, 4096, 8192)));
        assert_eq!(r.len(), TOKEN_LEN * 2);
    }
}
