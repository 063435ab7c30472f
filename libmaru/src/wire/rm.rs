//! Messages of the resource manager protocol (service name `maru-rm`).
//!
//! Each request is a JSON object with an `op` field; see `docs/rm-protocol.md` for
//! every message, its fields and its errors.

use serde::{Deserialize, Serialize};

/// Service name announced in the handshake.
pub const SERVICE: &str = "maru-rm";

/// A capability for one region: whoever holds the whole handle (with its token) may
/// map, free and hold the region. Tokens are 128-bit, hex.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub struct Handle {
    pub region_id: u64,
    /// Offset of the region in its pool's device (bytes).
    pub offset: u64,
    /// Length of the region (bytes, a multiple of the pool's alignment).
    pub length: u64,
    /// HMAC of the RM secret over the region's identity; hex, 32 digits.
    pub token: String,
}

#[cfg(test)]
impl Handle {
    /// The region handle the messages' tests carry (4 at 2 MiB, 2 MiB long).
    pub(crate) fn example() -> Handle {
        Handle {
            region_id: 4,
            offset: 2 << 20,
            length: 2 << 20,
            token: "00112233445566778899aabbccddeeff".into(),
        }
    }
}

/// Which pool an allocation should come from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PoolInfo {
    pub pool_id: u32,
    /// Device path on the RM's host (`/dev/dax0.0` or the fake-DAX file).
    pub path: String,
    /// UUID from the device header; the same device has the same UUID on every host.
    pub uuid: String,
    /// `devdax` or `file`.
    pub kind: String,
    /// Bytes usable for regions (the device minus its reserved header unit).
    pub total: u64,
    pub free: u64,
    /// Allocation alignment (bytes).
    pub align: u64,
    /// Bytes of regions freed while still held (waiting for their last UNHOLD).
    pub draining: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum RmRequest {
    /// Allocate a region of at least `size` bytes (rounded up to the pool's alignment).
    /// `pool`: a pool id, path or UUID; absent → pools are tried in order.
    /// `request_id`: a retry with the same non-zero id gets the first reply again.
    Alloc {
        size: u64,
        #[serde(default)]
        pool: Option<String>,
        #[serde(default)]
        request_id: u64,
    },
    /// Free a region. Only its owner (the connection's client id) may free it. A held
    /// region becomes draining and its range is reused only after its last UNHOLD.
    Free {
        handle: Handle,
        #[serde(default)]
        request_id: u64,
    },
    /// Check a handle and tell where its bytes are.
    GetAccess { handle: Handle },
    /// Record that `node` (epoch `epoch`) maps the region (an agent, before it
    /// registers the range with its NIC).
    Hold {
        handle: Handle,
        node: String,
        epoch: u64,
    },
    /// Drop `node`'s hold of the region (after the agent deregistered it).
    Unhold {
        region_id: u64,
        node: String,
        epoch: u64,
    },
    /// Drop every hold of `node` from epochs before `epoch` (an agent restarted: its
    /// old registrations died with the old process).
    ResetHolds { node: String, epoch: u64 },
    /// Drop every hold of `node`, whatever its epoch (a memory node gone for good).
    /// Needs `confirm: true`.
    DropHolds { node: String, confirm: bool },
    /// Pools with their sizes.
    Pools,
    /// Regions (all, or of one owner).
    Regions {
        #[serde(default)]
        owner: Option<String>,
    },
    /// Holds (all, or of one node).
    Holds {
        #[serde(default)]
        node: Option<String>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AllocReply {
    pub handle: Handle,
    pub requested: u64,
    pub pool: PoolInfo,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FreeReply {
    /// True when the region is still held and its range waits for the last UNHOLD.
    pub draining: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AccessReply {
    pub region_id: u64,
    pub path: String,
    pub uuid: String,
    pub offset: u64,
    pub length: u64,
    pub align: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HoldReply {
    /// Holds now recorded on the region.
    pub holds: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct UnholdReply {
    /// False when that hold was not there (already dropped): not an error.
    pub removed: bool,
    /// True when this was the last hold of a draining region, which is now free.
    pub freed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResetHoldsReply {
    pub removed: usize,
    /// Draining regions whose range became free.
    pub freed: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RegionInfo {
    pub region_id: u64,
    pub owner: String,
    pub pool_id: u32,
    pub offset: u64,
    pub length: u64,
    pub requested: u64,
    /// `allocated` or `draining`.
    pub state: String,
    pub holds: Vec<HoldInfo>,
    /// The region's handle token, only in the answer to its owner asking for its own
    /// regions (a restarted maru-server gives back a region its directory lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HoldInfo {
    pub region_id: u64,
    pub node: String,
    pub epoch: u64,
}

/// The result of each request, tagged by kind so a reply decodes without knowing the
/// request it answers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RmReply {
    Alloc(AllocReply),
    Free(FreeReply),
    Access(AccessReply),
    Hold(HoldReply),
    Unhold(UnholdReply),
    ResetHolds(ResetHoldsReply),
    Pools { pools: Vec<PoolInfo> },
    Regions { regions: Vec<RegionInfo> },
    Holds { holds: Vec<HoldInfo> },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_json, Envelope};
    use proptest::prelude::*;

    #[test]
    fn request_json_shape() {
        let env: Envelope<RmRequest> =
            decode_json(br#"{"id":3,"op":"alloc","size":4096}"#).unwrap();
        assert_eq!(env.id, 3);
        assert_eq!(
            env.body,
            RmRequest::Alloc {
                size: 4096,
                pool: None,
                request_id: 0
            }
        );
        assert!(decode_json::<Envelope<RmRequest>>(br#"{"id":3,"op":"nope"}"#).is_err());
        assert!(decode_json::<Envelope<RmRequest>>(br#"{"id":3,"op":"alloc"}"#).is_err());
    }

    proptest! {
        /// The request decoder rejects or accepts arbitrary bytes without panicking.
        #[test]
        fn decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_json::<Envelope<RmRequest>>(&data);
        }

        /// Structured-but-wrong JSON (random ops and fields) is handled too.
        #[test]
        fn random_json_objects(op in "[a-z_]{0,12}", size in any::<i64>(), s in ".{0,20}") {
            let body = serde_json::json!({"id": 1, "op": op, "size": size, "handle": s,
                                          "node": size, "epoch": s});
            let _ = decode_json::<Envelope<RmRequest>>(body.to_string().as_bytes());
        }
    }
}
