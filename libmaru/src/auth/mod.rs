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
    mac_parts(keyed(key), parts)
}

/// HMAC-SHA256 keyed with `key` (the key's two blocks hashed), ready for a message.
fn keyed(key: &[u8]) -> HmacSha256 {
    // new_from_slice accepts keys of any length for HMAC.
    match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => unreachable_hmac(),
    }
}

/// `mac` finished over the length-framed `parts` (see [`hmac_parts`]).
fn mac_parts(mut mac: HmacSha256, parts: &[&[u8]]) -> [u8; 32] {
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

/// Lower-case hex of `bytes` (written two digits a byte into one buffer, not a
/// `char` at a time).
pub fn to_hex(bytes: &[u8]) -> String {
    let mut out = vec![0u8; bytes.len() * 2];
    if hex::encode_to_slice(bytes, &mut out).is_err() {
        unreachable_hex();
    }
    match String::from_utf8(out) {
        Ok(s) => s,
        Err(_) => unreachable_hex(),
    }
}

#[cold]
fn unreachable_hex() -> ! {
    // The buffer is exactly twice the input, and hex digits are ASCII.
    panic!("hex of n bytes did not fit 2n ASCII bytes")
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
    ReadTokenKey::new(region_token).token(region_id, offset, length)
}

/// The HMAC of one region's read tokens, keyed once with the region's RM token:
/// each [`token`](Self::token) clones it and hashes only its message, where
/// [`read_token`] hashes the key's two blocks again (maru-server grants a token per
/// lease, a few regions' worth per batch). The same tokens as [`read_token`].
#[derive(Clone)]
pub struct ReadTokenKey {
    region_token: String,
    mac: HmacSha256,
}

impl ReadTokenKey {
    pub fn new(region_token: &str) -> ReadTokenKey {
        ReadTokenKey {
            region_token: region_token.to_owned(),
            mac: keyed(region_token.as_bytes()),
        }
    }

    /// Whether this is keyed with `region_token` (a region given out again gets a
    /// new one).
    pub fn is_for(&self, region_token: &str) -> bool {
        self.region_token == region_token
    }

    /// The read token of (region id, offset, length), as [`read_token`].
    pub fn token(&self, region_id: u64, offset: u64, length: u64) -> String {
        let mac = mac_parts(
            self.mac.clone(),
            &[
                b"maru-read-token",
                &region_id.to_le_bytes(),
                &offset.to_le_bytes(),
                &length.to_le_bytes(),
            ],
        );
        to_hex(&mac[..TOKEN_LEN])
    }
}

impl std::fmt::Debug for ReadTokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is the region's token: never printed.
        f.write_str("ReadTokenKey(..)")
    }
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

    /// A key kept for a region gives the tokens keyed afresh gives (itself cloned per
    /// token, so one token does not change the next), and is for its own token only.
    #[test]
    fn a_kept_read_token_key_gives_the_same_tokens() {
        let t = region_token(b"secret", 7, 0, 1 << 21, 99);
        let k = ReadTokenKey::new(&t);
        for (off, len) in [(0, 4096), (4096, 8192), (0, 4096), (1 << 20, 1 << 20)] {
            assert_eq!(k.token(7, off, len), read_token(&t, 7, off, len));
        }
        assert!(k.is_for(&t));
        assert!(!k.is_for(&region_token(b"secret", 7, 0, 1 << 21, 100)));
        assert_eq!(format!("{k:?}"), "ReadTokenKey(..)");
    }

    /// `to_hex` writes what the `hex` crate's one-`char`-at-a-time encoder writes.
    #[test]
    fn to_hex_is_hex_encode() {
        let b = random_bytes(300).unwrap();
        for n in [0, 1, 16, 32, 300] {
            assert_eq!(to_hex(&b[..n]), hex::encode(&b[..n]));
        }
    }
}
