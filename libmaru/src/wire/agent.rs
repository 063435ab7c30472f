//! Messages of the remote CXL agent protocol (service name `maru-agent`).
//!
//! A worker asks the agent of a memory node to map a region it owns (`map`, with the
//! region's handle), a reader asks it to map ranges of regions for reading
//! (`map_reads`, each range with its read token, all of them in one request), every
//! holder drops its hold with `unmap`, and the
//! owner deregisters the region with `release` before it gives the region back.
//! Each request is a JSON object with an `op` field; each reply is tagged by `kind`.

use super::rm::Handle;
use super::{ErrorCode, WireError};
use serde::{Deserialize, Serialize};

/// Service name announced in the handshake.
pub const SERVICE: &str = "maru-agent";

/// The most ranges one `map_reads` may carry. The agent refuses a longer request
/// whole (`bad_request`, nothing mapped); a worker sends its ranges at one agent in
/// requests of at most this many. It bounds the work one request asks of the agent's
/// core thread and keeps the reply well under a frame (1 MiB).
pub const MAX_READ_RANGES: usize = 256;

/// One range of a region to map for reading: `length` bytes at `offset`, with the
/// read token of exactly that range.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReadRange {
    pub region_id: u64,
    pub offset: u64,
    pub length: u64,
    pub read_token: String,
}

/// What the agent made of one range of a `map_reads`: its registration, or why it
/// has none (that range only: the others are mapped or refused on their own).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RangeMapped {
    Mapped(MapReply),
    Failed(WireError),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AgentRequest {
    /// Map and register the whole region. The agent checks the handle with the RM and
    /// holds the region there before it registers anything. `writable` asks for a
    /// registration that accepts remote WRITEs (the owner); without it the
    /// registration accepts only READs (a keeper that holds the region).
    Map {
        handle: Handle,
        #[serde(default)]
        writable: bool,
    },
    /// Register each range (of regions this agent already maps) for remote READ
    /// only; at most [`MAX_READ_RANGES`]. Answered by `MappedReads`, one result per
    /// range in the order asked.
    MapReads { ranges: Vec<ReadRange> },
    /// Drop the caller's holds of the region (its maps and read maps). The last
    /// holder's unmap deregisters the region.
    Unmap { region_id: u64 },
    /// Deregister the region whoever else holds it and refuse later maps of the
    /// handle. Needs the region's full handle (only the owner and maru-server have
    /// it). A success means no registration of the region is left at this agent's
    /// NIC: only then may the owner give the region back.
    Release { handle: Handle },
    /// The agent's identity, mappings and pending work.
    Status,
    /// Transport connection bring-up (RDMA queue pairs): the worker's half in, the
    /// agent's half out (`AgentReply::Peer`). The soft transport does not use it.
    ConnectPeer { info: serde_json::Value },
}

/// Where a mapped range is and how to reach it over the transport.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MapReply {
    pub region_id: u64,
    /// Remote address of the first byte of the registered range. For a read range the
    /// range starts at `offset_in_region`, so byte `k` of the region is at
    /// `addr + (k - offset_in_region)`.
    pub addr: u64,
    /// Remote key of the registration.
    pub rkey: u64,
    /// Bytes registered.
    pub length: u64,
    /// Where the registered range starts in the region: 0 for `map`, the read
    /// range's offset for a read range.
    pub offset_in_region: u64,
    /// Transport metadata of this registration only (never of other regions).
    pub transport: serde_json::Value,
    /// The memory node's boot id. A worker treats an agent whose boot id is missing
    /// or changed as unreachable: writes its CPU caches held died with the old boot.
    pub boot_id: String,
}

/// Whether a mapping is in use or on its way out.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MappingState {
    /// Registered and held; takes new holders.
    Live,
    /// Released, refused by the RM or out of holders, with a deregistration that
    /// failed and is retried by the sweep. Takes no new holder.
    Retiring,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MappingInfo {
    pub region_id: u64,
    /// Offset of the region in its pool's device (bytes).
    pub offset: u64,
    pub length: u64,
    pub state: MappingState,
    /// Whether the owner released it (later maps of its handle are refused).
    pub released: bool,
    /// Client ids holding it (owners, keepers and readers), sorted.
    pub holders: Vec<String>,
    /// Live registrations of the region or of ranges of it.
    pub registrations: usize,
    /// Registrations whose deregistration failed, retried by the sweep.
    pub failed_deregistrations: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StatusReply {
    pub node: String,
    pub epoch: u64,
    pub boot_id: String,
    pub mappings: Vec<MappingInfo>,
    /// Unholds the RM has not confirmed yet (retried by the sweep).
    pub queued_unholds: usize,
    /// Deregistered ranges kept mapped without access until their quarantine ends.
    pub quarantined: usize,
    /// True while the RESET_HOLDS sent at start has not reached the RM.
    pub holds_reset_pending: bool,
}

/// The result of each request, tagged by kind so a reply decodes without knowing the
/// request it answers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AgentReply {
    Mapped(MapReply),
    /// The answer to `map_reads`: per range asked, in its order, its result.
    MappedReads {
        ranges: Vec<RangeMapped>,
    },
    /// `removed`: false when the caller held nothing of that region (not an error).
    Unmapped {
        removed: bool,
    },
    /// `deregistered`: true when a mapping of the region was deregistered (by this
    /// release or an earlier one), false when this agent had none.
    Released {
        deregistered: bool,
    },
    Status(StatusReply),
    /// The agent's half of a transport bring-up.
    Peer {
        info: serde_json::Value,
    },
}

impl AgentReply {
    /// The reply to a `map_reads` of one range, as that range's result: its mapping,
    /// or why it has none (any other reply is an `internal` error).
    pub fn single_read(self) -> Result<MapReply, WireError> {
        let n = match self {
            AgentReply::MappedReads { mut ranges } => match (ranges.pop(), ranges.is_empty()) {
                (Some(RangeMapped::Mapped(m)), true) => return Ok(m),
                (Some(RangeMapped::Failed(e)), true) => return Err(e),
                _ => ranges.len() + 1,
            },
            other => {
                return Err(WireError::new(
                    ErrorCode::Internal,
                    format!("a map_reads of one range was answered with {other:?}"),
                ))
            }
        };
        Err(WireError::new(
            ErrorCode::Internal,
            format!("a map_reads of one range was answered with {n} results"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_json, encode_json, Envelope};
    use proptest::prelude::*;

    #[test]
    fn request_json_shape() {
        let env: Envelope<AgentRequest> = decode_json(
            br#"{"id":5,"op":"map","handle":{"region_id":4,"offset":2097152,
                 "length":2097152,"token":"00112233445566778899aabbccddeeff"}}"#,
        )
        .unwrap();
        assert_eq!(env.id, 5);
        // `writable` defaults to false: a map that does not ask cannot write.
        assert_eq!(
            env.body,
            AgentRequest::Map {
                handle: Handle::example(),
                writable: false
            }
        );
        let s: Envelope<AgentRequest> = decode_json(br#"{"id":1,"op":"status"}"#).unwrap();
        assert_eq!(s.body, AgentRequest::Status);
        let r: Envelope<AgentRequest> = decode_json(
            br#"{"id":2,"op":"map_reads","ranges":[{"region_id":4,"offset":0,
                 "length":4096,"read_token":"ab"},{"region_id":5,"offset":8192,
                 "length":4096,"read_token":"cd"}]}"#,
        )
        .unwrap();
        match r.body {
            AgentRequest::MapReads { ranges } => {
                assert_eq!(ranges.len(), 2);
                assert_eq!((ranges[1].region_id, ranges[1].offset), (5, 8192));
            }
            other => panic!("{other:?}"),
        }
        // The single-range op of earlier versions is gone, as is a range without
        // its token.
        assert!(decode_json::<Envelope<AgentRequest>>(
            br#"{"id":2,"op":"map_read","region_id":4,"offset":0,"length":4096,"read_token":"ab"}"#
        )
        .is_err());
        assert!(decode_json::<Envelope<AgentRequest>>(
            br#"{"id":2,"op":"map_reads","ranges":[{"region_id":4,"offset":0,"length":1}]}"#
        )
        .is_err());
        assert!(decode_json::<Envelope<AgentRequest>>(br#"{"id":3,"op":"nope"}"#).is_err());
        assert!(decode_json::<Envelope<AgentRequest>>(br#"{"id":3,"op":"unmap"}"#).is_err());
        assert!(decode_json::<Envelope<AgentRequest>>(br#"{"id":3,"op":"release"}"#).is_err());
    }

    #[test]
    fn replies_round_trip_by_kind() {
        let replies = [
            AgentReply::Mapped(MapReply {
                region_id: 4,
                addr: 0x7000_0000,
                rkey: 17,
                length: 4096,
                offset_in_region: 8192,
                transport: serde_json::json!({"soft": "10.0.0.2:9861"}),
                boot_id: "b0".into(),
            }),
            AgentReply::MappedReads {
                ranges: vec![
                    RangeMapped::Failed(WireError::new(ErrorCode::Refused, "wrong token")),
                    RangeMapped::Mapped(MapReply {
                        region_id: 5,
                        addr: 1,
                        rkey: 2,
                        length: 3,
                        offset_in_region: 4,
                        transport: serde_json::Value::Null,
                        boot_id: "b1".into(),
                    }),
                ],
            },
            AgentReply::MappedReads { ranges: vec![] },
            AgentReply::Unmapped { removed: true },
            AgentReply::Released {
                deregistered: false,
            },
            AgentReply::Status(StatusReply {
                node: "mem1".into(),
                epoch: 3,
                boot_id: "b0".into(),
                mappings: vec![MappingInfo {
                    region_id: 4,
                    offset: 0,
                    length: 4096,
                    state: MappingState::Retiring,
                    released: true,
                    holders: vec![],
                    registrations: 0,
                    failed_deregistrations: 1,
                }],
                queued_unholds: 1,
                quarantined: 2,
                holds_reset_pending: false,
            }),
        ];
        for r in replies {
            let body = encode_json(&r);
            assert_eq!(decode_json::<AgentReply>(&body).unwrap(), r);
        }
        let body = encode_json(&AgentReply::Unmapped { removed: false });
        assert_eq!(body, br#"{"kind":"unmapped","removed":false}"#);
        let refused = AgentReply::MappedReads {
            ranges: vec![RangeMapped::Failed(WireError::new(
                ErrorCode::Refused,
                "no",
            ))],
        };
        assert_eq!(
            encode_json(&refused),
            br#"{"kind":"mapped_reads","ranges":[{"failed":{"code":"refused","message":"no"}}]}"#
        );
    }

    /// A map_reads of MAX_READ_RANGES ranges and its reply, every number at its widest,
    /// fit a frame four times over: the cap keeps them off the frame limit.
    #[test]
    fn a_full_map_reads_and_its_reply_fit_well_within_a_frame() {
        let ranges = (0..MAX_READ_RANGES)
            .map(|_| ReadRange {
                region_id: u64::MAX,
                offset: u64::MAX,
                length: u64::MAX,
                read_token: "f".repeat(64),
            })
            .collect();
        let req = Envelope {
            id: u64::MAX,
            body: AgentRequest::MapReads { ranges },
        };
        let mapped = RangeMapped::Mapped(MapReply {
            region_id: u64::MAX,
            addr: u64::MAX,
            rkey: u64::MAX,
            length: u64::MAX,
            offset_in_region: u64::MAX,
            transport: serde_json::json!({"soft": {
                "addr": "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535",
                "bind": "f".repeat(32)}}),
            boot_id: "f".repeat(36),
        });
        let reply = AgentReply::MappedReads {
            ranges: vec![mapped; MAX_READ_RANGES],
        };
        let limit = crate::wire::DEFAULT_MAX_FRAME / 4;
        for (what, n) in [
            ("request", encode_json(&req).len()),
            ("reply", encode_json(&reply).len()),
        ] {
            assert!(n < limit, "a full map_reads {what}: {n} bytes");
        }
    }

    fn read_range() -> impl Strategy<Value = ReadRange> {
        (any::<u64>(), any::<u64>(), any::<u64>(), ".{0,40}").prop_map(
            |(region_id, offset, length, read_token)| ReadRange {
                region_id,
                offset,
                length,
                read_token,
            },
        )
    }

    fn range_mapped() -> impl Strategy<Value = RangeMapped> {
        prop_oneof![
            (any::<u64>(), any::<u64>(), ".{0,20}").prop_map(|(n, m, s)| {
                RangeMapped::Mapped(MapReply {
                    region_id: n,
                    addr: m,
                    rkey: n ^ m,
                    length: m,
                    offset_in_region: n,
                    transport: serde_json::json!({ "soft": s.clone() }),
                    boot_id: s,
                })
            }),
            ".{0,40}".prop_map(|m| RangeMapped::Failed(WireError::new(ErrorCode::Refused, m))),
        ]
    }

    proptest! {
        /// The request decoder rejects or accepts arbitrary bytes without panicking.
        #[test]
        fn decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_json::<Envelope<AgentRequest>>(&data);
        }

        /// Structured-but-wrong JSON (random ops and mistyped fields) is handled too.
        #[test]
        fn random_json_objects(op in "[a-z_]{0,12}", n in any::<i64>(), s in ".{0,20}",
                               w in any::<bool>()) {
            let body = serde_json::json!({"id": 1, "op": op, "region_id": n, "offset": s,
                                          "length": n, "read_token": n, "writable": w,
                                          "handle": {"region_id": s, "token": n}});
            let _ = decode_json::<Envelope<AgentRequest>>(body.to_string().as_bytes());
            let batch = serde_json::json!({"id": 1, "op": "map_reads",
                                           "ranges": [{"region_id": n, "offset": s,
                                                       "length": w, "read_token": n}]});
            let _ = decode_json::<Envelope<AgentRequest>>(batch.to_string().as_bytes());
        }

        /// Any list of ranges round-trips through the request decoder, and any list
        /// of per-range results through the reply decoder, in order.
        #[test]
        fn map_reads_round_trip(ranges in proptest::collection::vec(read_range(), 0..40),
                                results in proptest::collection::vec(range_mapped(), 0..40)) {
            let req = Envelope { id: 9, body: AgentRequest::MapReads { ranges } };
            let back: Envelope<AgentRequest> = decode_json(&encode_json(&req)).unwrap();
            prop_assert_eq!(back, req);
            let reply = AgentReply::MappedReads { ranges: results };
            prop_assert_eq!(decode_json::<AgentReply>(&encode_json(&reply)).unwrap(), reply);
        }

        /// A map_reads request cut short or with a byte changed decodes or fails, never
        /// panics.
        #[test]
        fn map_reads_mangled(ranges in proptest::collection::vec(read_range(), 1..8),
                             cut in any::<prop::sample::Index>(), at in any::<prop::sample::Index>(),
                             byte in any::<u8>()) {
            let req = Envelope { id: 9, body: AgentRequest::MapReads { ranges } };
            let body = encode_json(&req);
            let _ = decode_json::<Envelope<AgentRequest>>(&body[..cut.index(body.len())]);
            let mut changed = body.clone();
            let i = at.index(changed.len());
            changed[i] = byte;
            let _ = decode_json::<Envelope<AgentRequest>>(&changed);
        }
    }
}
