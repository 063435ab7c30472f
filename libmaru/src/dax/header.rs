//! The device header: 32 bytes at offset 0 of every pool.
//!
//! The header gives a device an identity that survives renaming: the same CXL
//! device may be `/dev/dax0.0` on one host and `/dev/dax1.0` on another, and a
//! file-backed pool may be opened under another path. Hosts find their local path
//! of a pool by its UUID. The whole first alignment unit is kept for the header
//! so that region offsets stay aligned; data starts at `align`.
//!
//! Layout (little endian):
//!
//! | bytes  | field                      |
//! |--------|----------------------------|
//! | 0..8   | magic `MARUDEV\0`          |
//! | 8..12  | version, u32, `1`          |
//! | 12..28 | UUID v4                    |
//! | 28..32 | reserved, written as zero  |

use super::error::{DaxError, HeaderProblem};

/// Bytes of the header.
pub const HEADER_LEN: usize = 32;
/// First bytes of a Maru device.
pub const MAGIC: [u8; 8] = *b"MARUDEV\0";
/// Header version this build writes and reads.
pub const HEADER_VERSION: u32 = 1;

/// The identity of a pool device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceHeader {
    pub uuid: [u8; 16],
}

impl DeviceHeader {
    /// A header with a fresh random (version 4) UUID.
    pub fn generate() -> Result<DeviceHeader, DaxError> {
        let bytes = crate::auth::random_bytes(16).map_err(|err| DaxError::Random { err })?;
        let mut uuid = [0u8; 16];
        // random_bytes returns exactly the length asked for.
        uuid.copy_from_slice(&bytes[..16]);
        Ok(DeviceHeader::from_random(uuid))
    }

    /// A header whose UUID is `random` with the RFC 4122 version (4) and variant
    /// bits set, so that tools that print UUIDs recognise it.
    pub fn from_random(mut random: [u8; 16]) -> DeviceHeader {
        random[6] = (random[6] & 0x0f) | 0x40;
        random[8] = (random[8] & 0x3f) | 0x80;
        DeviceHeader { uuid: random }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..8].copy_from_slice(&MAGIC);
        out[8..12].copy_from_slice(&HEADER_VERSION.to_le_bytes());
        out[12..28].copy_from_slice(&self.uuid);
        out
    }

    /// Reads a header from the first bytes of a device.
    ///
    /// `Ok(None)` means no header is there (a new device: zeros, or bytes without
    /// the magic). Bytes with the magic that cannot be read are an error rather than
    /// absent, so that a damaged or newer header is never silently overwritten.
    pub fn decode(buf: &[u8]) -> Result<Option<DeviceHeader>, DaxError> {
        let bad = |problem| DaxError::BadHeader {
            path: None,
            problem,
        };
        if buf.len() < MAGIC.len() || buf[..MAGIC.len()] != MAGIC {
            return Ok(None);
        }
        if buf.len() < HEADER_LEN {
            return Err(bad(HeaderProblem::Truncated {
                len: buf.len(),
                need: HEADER_LEN,
            }));
        }
        let mut version = [0u8; 4];
        version.copy_from_slice(&buf[8..12]);
        let version = u32::from_le_bytes(version);
        if version != HEADER_VERSION {
            return Err(bad(HeaderProblem::Version {
                found: version,
                reads: HEADER_VERSION,
            }));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&buf[12..28]);
        Ok(Some(DeviceHeader { uuid }))
    }

    /// The UUID as `8-4-4-4-12` lower-case hex.
    pub fn uuid_string(&self) -> String {
        let hex = crate::auth::to_hex(&self.uuid);
        format!(
            "{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let h = DeviceHeader::generate().expect("random bytes");
        let bytes = h.encode();
        assert_eq!(&bytes[0..8], b"MARUDEV\0");
        assert_eq!(&bytes[8..12], &[1, 0, 0, 0]);
        assert_eq!(&bytes[28..32], &[0, 0, 0, 0]);
        assert_eq!(DeviceHeader::decode(&bytes).expect("decodes"), Some(h));
    }

    #[test]
    fn generated_uuids_are_v4_and_differ() {
        let a = DeviceHeader::generate().expect("random bytes");
        let b = DeviceHeader::generate().expect("random bytes");
        assert_ne!(a, b);
        let s = a.uuid_string();
        assert_eq!(s.len(), 36);
        assert_eq!(s.as_bytes()[14], b'4');
        assert!(matches!(s.as_bytes()[19], b'8' | b'9' | b'a' | b'b'), "{s}");
    }

    #[test]
    fn uuid_string_format() {
        let h = DeviceHeader {
            uuid: [
                0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0x4d, 0xef, 0x80, 0x01, 0x02, 0x03, 0x04, 0x05,
                0x06, 0x07,
            ],
        };
        assert_eq!(h.uuid_string(), "12345678-9abc-4def-8001-020304050607");
    }

    #[test]
    fn zeros_and_garbage_are_absent() {
        assert_eq!(DeviceHeader::decode(&[0u8; 32]).expect("ok"), None);
        assert_eq!(DeviceHeader::decode(&[0xffu8; 64]).expect("ok"), None);
        assert_eq!(DeviceHeader::decode(b"MARU").expect("ok"), None);
        assert_eq!(DeviceHeader::decode(&[]).expect("ok"), None);
    }

    #[test]
    fn wrong_version_is_an_error() {
        let mut bytes = DeviceHeader::from_random([7; 16]).encode();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        let e = DeviceHeader::decode(&bytes).expect_err("version 2");
        assert!(
            matches!(
                e,
                DaxError::BadHeader {
                    problem: HeaderProblem::Version {
                        found: 2,
                        reads: HEADER_VERSION,
                    },
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn truncated_header_is_an_error() {
        let bytes = DeviceHeader::from_random([7; 16]).encode();
        let e = DeviceHeader::decode(&bytes[..20]).expect_err("truncated");
        assert!(
            matches!(
                e,
                DaxError::BadHeader {
                    problem: HeaderProblem::Truncated {
                        len: 20,
                        need: HEADER_LEN,
                    },
                    ..
                }
            ),
            "{e}"
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = DeviceHeader::decode(&buf);
        }

        #[test]
        fn encode_decode(uuid in any::<[u8; 16]>()) {
            let h = DeviceHeader { uuid };
            prop_assert_eq!(DeviceHeader::decode(&h.encode()).ok().flatten(), Some(h));
        }
    }
}
