//! The hot calls of a session as they go on the wire: requests that borrow their
//! keys ([`KeysCall`], [`EntryRef`]: the JSON of `MetaRequest`'s variants of the same
//! names, no `String` made per key) and replies decoded in one pass into a struct of
//! their kind ([`ExistsOk`], ...), not through serde's buffered tagged `MetaReply`.

use crate::wire::meta::{KeyInfo, LeaseGrant, PageGrant, PublishEntry, RemoveResult};
use crate::worker::error::WorkerError;
use serde::{Deserialize, Serialize};

/// The requests of the hot calls as the client sends them, borrowing their keys and
/// entries: the JSON of `MetaRequest`'s variants of the same names (test
/// `borrowed_requests_encode_as_the_owned_ones`), with no `String` made per key.
#[derive(Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum KeysCall<'a, K: Serialize> {
    Publish {
        session: u64,
        entries: &'a [EntryRef<'a>],
    },
    Exists {
        session: u64,
        keys: &'a [K],
    },
    Acquire {
        session: u64,
        keys: &'a [K],
    },
    Remove {
        session: u64,
        keys: &'a [K],
    },
    Pin {
        session: u64,
        keys: &'a [K],
    },
    Unpin {
        session: u64,
        keys: &'a [K],
    },
}

/// A [`PublishEntry`] that borrows its keys (the same JSON).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct EntryRef<'a> {
    pub key: &'a str,
    pub region_id: u64,
    pub offset: u64,
    pub length: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prev: Option<&'a str>,
}

impl EntryRef<'_> {
    /// `e` as a publish sends it.
    pub fn of(e: &PublishEntry) -> EntryRef<'_> {
        EntryRef {
            key: &e.key,
            region_id: e.region_id,
            offset: e.offset,
            length: e.length,
            prev: e.prev.as_deref(),
        }
    }
}

/// `MetaReply`'s `kind` tag. The hot calls decode their reply into a struct of their
/// own kind's fields and this tag (`ExistsOk`, ...), read in one pass: a
/// `MetaReply`, internally tagged, is first buffered whole by serde (every key,
/// value and string of it copied into its `Content`) and then decoded from that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum ReplyKind {
    Handshake,
    Session,
    Region,
    Pages,
    PagesFreed,
    Published,
    Exists,
    Leases,
    LeasesReleased,
    Victims,
    Removed,
    Pinned,
    Unpinned,
    Returned,
    Heartbeat,
    Closed,
    Stats,
    Usage,
}

impl ReplyKind {
    /// Ok when this is the kind `want` that `what` is answered with.
    pub(super) fn expect(self, want: ReplyKind, what: &str) -> Result<(), WorkerError> {
        if self == want {
            Ok(())
        } else {
            Err(WorkerError::Transport(format!(
                "maru-server answered {what} with a {self:?} reply"
            )))
        }
    }
}

/// A reply read for its kind only (the rest skipped unbuffered).
#[derive(Deserialize)]
pub(super) struct KindOnly {
    pub(super) kind: ReplyKind,
}

/// `MetaReply::Exists`.
#[derive(Deserialize)]
pub(super) struct ExistsOk {
    pub(super) kind: ReplyKind,
    #[serde(default)]
    pub(super) found: Vec<bool>,
}

/// `MetaReply::Leases`.
#[derive(Deserialize)]
pub(super) struct LeasesOk {
    pub(super) kind: ReplyKind,
    // Each region's device comes with its first lease only (wire::lease_wire); the
    // later ones are not given a copy of it: the cxl mover maps by the batch's.
    #[serde(default)]
    pub(super) leases: Vec<Option<LeaseGrant>>,
}

/// `MetaReply::Published`.
#[derive(Deserialize)]
pub(super) struct PublishedOk {
    pub(super) kind: ReplyKind,
    #[serde(default)]
    pub(super) is_new: Vec<bool>,
    #[serde(default)]
    pub(super) give_back: Vec<u64>,
}

/// `MetaReply::Removed`.
#[derive(Deserialize)]
pub(super) struct RemovedOk {
    pub(super) kind: ReplyKind,
    #[serde(default)]
    pub(super) results: Vec<RemoveResult>,
}

/// `MetaReply::Victims`.
#[derive(Deserialize)]
pub(super) struct VictimsOk {
    pub(super) kind: ReplyKind,
    #[serde(default)]
    pub(super) victims: Vec<KeyInfo>,
}

/// `MetaReply::Pinned` and `MetaReply::Unpinned` (one field each, per key).
#[derive(Deserialize)]
pub(super) struct PinnedOk {
    pub(super) kind: ReplyKind,
    #[serde(default, alias = "unpinned")]
    pub(super) pinned: Vec<bool>,
}

/// `MetaReply::Pages` (`PagesReply`'s fields).
#[derive(Deserialize)]
pub(super) struct PagesOk {
    pub(super) kind: ReplyKind,
    #[serde(default)]
    pub(super) pages: Vec<PageGrant>,
    #[serde(default)]
    pub(super) missing: u32,
    #[serde(default)]
    pub(super) give_back: Vec<u64>,
    #[serde(default)]
    pub(super) share_regions: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::meta::{DeviceRange, MetaReply, MetaRequest, PagesReply};
    use crate::wire::{decode_json, encode_json};

    #[test]
    fn borrowed_requests_encode_as_the_owned_ones() {
        let keys = ["a", "b\"c", "ü"];
        let owned: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let same = |borrowed: &KeysCall<'_, &str>, owned: MetaRequest| {
            let b = encode_json(borrowed);
            assert_eq!(b, encode_json(&owned));
            // And maru-server reads it as the owned request.
            assert_eq!(decode_json::<MetaRequest>(&b).unwrap(), owned);
        };
        same(
            &KeysCall::Exists {
                session: 3,
                keys: &keys,
            },
            MetaRequest::Exists {
                session: 3,
                keys: owned.clone(),
            },
        );
        same(
            &KeysCall::Acquire {
                session: 3,
                keys: &keys,
            },
            MetaRequest::Acquire {
                session: 3,
                keys: owned.clone(),
            },
        );
        for (call, owned) in [
            (
                KeysCall::Remove {
                    session: 3,
                    keys: &keys,
                },
                MetaRequest::Remove {
                    session: 3,
                    keys: owned.clone(),
                },
            ),
            (
                KeysCall::Pin {
                    session: 3,
                    keys: &keys,
                },
                MetaRequest::Pin {
                    session: 3,
                    keys: owned.clone(),
                },
            ),
            (
                KeysCall::Unpin {
                    session: 3,
                    keys: &keys,
                },
                MetaRequest::Unpin {
                    session: 3,
                    keys: owned.clone(),
                },
            ),
        ] {
            same(&call, owned);
        }
        let entries = vec![
            PublishEntry {
                key: "a".into(),
                region_id: 1,
                offset: 1 << 21,
                length: 9,
                prev: None,
            },
            PublishEntry {
                key: "b".into(),
                region_id: u64::MAX,
                offset: 0,
                length: 1,
                prev: Some("a".into()),
            },
        ];
        let refs: Vec<EntryRef<'_>> = entries.iter().map(EntryRef::of).collect();
        same(
            &KeysCall::Publish {
                session: 4,
                entries: &refs,
            },
            MetaRequest::Publish {
                session: 4,
                entries: entries.clone(),
            },
        );
    }

    #[test]
    fn concrete_replies_read_what_maru_server_sends() {
        let lease = LeaseGrant {
            lease_id: 7,
            region_id: 2,
            offset: 1 << 18,
            length: 100,
            read_token: "t".into(),
            agent: None,
            device: Some(DeviceRange {
                uuid: "u".into(),
                path: "/dev/dax0.0".into(),
                region_offset: 0,
                region_length: 1 << 30,
            }),
            expires_in_ms: 5,
            boot_id: None,
        };
        let second = LeaseGrant {
            lease_id: 8,
            offset: 2 << 18,
            ..lease.clone()
        };
        let leases = vec![Some(lease), None, Some(second)];
        let r: LeasesOk = decode_json(&encode_json(&MetaReply::Leases {
            leases: leases.clone(),
        }))
        .unwrap();
        assert_eq!((r.kind, r.leases), (ReplyKind::Leases, leases));
        let r: ExistsOk = decode_json(&encode_json(&MetaReply::Exists {
            found: vec![true, false],
        }))
        .unwrap();
        assert_eq!((r.kind, r.found), (ReplyKind::Exists, vec![true, false]));
        let r: PublishedOk = decode_json(&encode_json(&MetaReply::Published {
            is_new: vec![false, true],
            give_back: vec![9],
        }))
        .unwrap();
        assert_eq!(
            (r.kind, r.is_new, r.give_back),
            (ReplyKind::Published, vec![false, true], vec![9])
        );
        let pages = PagesReply {
            pages: vec![PageGrant {
                region_id: 1,
                page: 2,
                offset: 2 << 18,
                length: 1 << 18,
            }],
            missing: 3,
            give_back: vec![4],
            share_regions: Some(5),
        };
        let r: PagesOk = decode_json(&encode_json(&MetaReply::Pages(pages.clone()))).unwrap();
        assert_eq!(r.kind, ReplyKind::Pages);
        assert_eq!(
            PagesReply {
                pages: r.pages,
                missing: r.missing,
                give_back: r.give_back,
                share_regions: r.share_regions
            },
            pages
        );
        let results = vec![RemoveResult::Removed, RemoveResult::Leased];
        let r: RemovedOk = decode_json(&encode_json(&MetaReply::Removed {
            results: results.clone(),
        }))
        .unwrap();
        assert_eq!((r.kind, r.results), (ReplyKind::Removed, results));
        let r: PinnedOk =
            decode_json(&encode_json(&MetaReply::Pinned { pinned: vec![true] })).unwrap();
        assert_eq!((r.kind, r.pinned), (ReplyKind::Pinned, vec![true]));
        let r: PinnedOk = decode_json(&encode_json(&MetaReply::Unpinned {
            unpinned: vec![false, true],
        }))
        .unwrap();
        assert_eq!((r.kind, r.pinned), (ReplyKind::Unpinned, vec![false, true]));
        let victims = vec![KeyInfo {
            key: "k\"1".into(),
            region_id: 2,
            offset: 1 << 21,
            length: 3,
        }];
        let r: VictimsOk = decode_json(&encode_json(&MetaReply::Victims {
            victims: victims.clone(),
        }))
        .unwrap();
        assert_eq!((r.kind, r.victims), (ReplyKind::Victims, victims));
        let r: KindOnly = decode_json(&encode_json(&MetaReply::LeasesReleased {
            released: vec![true],
        }))
        .unwrap();
        assert_eq!(r.kind, ReplyKind::LeasesReleased);
        // A reply of another kind is an error, not an empty answer.
        let r: ExistsOk =
            decode_json(&encode_json(&MetaReply::Pinned { pinned: vec![true] })).unwrap();
        assert!(r.kind.expect(ReplyKind::Exists, "exists").is_err());
        assert!(decode_json::<ExistsOk>(br#"{"found":[true]}"#).is_err());
        assert!(decode_json::<ExistsOk>(br#"{"kind":"nonsense","found":[true]}"#).is_err());
    }
}
