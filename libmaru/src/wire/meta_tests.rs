//! Tests of the metadata server protocol's messages (`wire/meta.rs`): their JSON
//! shape, and decoding untrusted bytes (property-tested).

use super::meta::*;
use super::rm::{Handle, PoolInfo};
use crate::wire::{decode_json, encode_json, Envelope, ReplyEnvelope};
use proptest::prelude::*;
use std::borrow::Cow;
use std::collections::BTreeMap;

#[test]
fn request_json_shape() {
    let env: Envelope<MetaRequest> = decode_json(br#"{"id":1,"op":"handshake"}"#).unwrap();
    assert_eq!(env.body, MetaRequest::Handshake {});
    let env: Envelope<MetaRequest> = decode_json(
        br#"{"id":2,"op":"open_session","engine_id":"e","namespace":"n",
             "layout":"l","backend":"remote_cxl"}"#,
    )
    .unwrap();
    assert!(matches!(
        env.body,
        MetaRequest::OpenSession {
            backend: Backend::RemoteCxl,
            first_region: true,
            ..
        }
    ));
    let env: Envelope<MetaRequest> =
        decode_json(br#"{"id":3,"op":"alloc","session":1,"count":2}"#).unwrap();
    assert_eq!(
        env.body,
        MetaRequest::Alloc {
            session: 1,
            count: 2,
            route_key: None
        }
    );
    let env: Envelope<MetaRequest> =
        decode_json(br#"{"id":4,"op":"heartbeat","session":1,"boot_ids":{"7":"b0","9":"b1"}}"#)
            .unwrap();
    match env.body {
        MetaRequest::Heartbeat { boot_ids, .. } => {
            assert_eq!(boot_ids.get(&7).map(String::as_str), Some("b0"));
            assert_eq!(boot_ids.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    let env: Envelope<MetaRequest> = decode_json(br#"{"id":5,"op":"stats"}"#).unwrap();
    assert_eq!(env.body, MetaRequest::Stats { session: None });
    let env: Envelope<MetaRequest> = decode_json(br#"{"id":6,"op":"usage"}"#).unwrap();
    assert_eq!(env.body, MetaRequest::Usage);
}

#[test]
fn requests_round_trip() {
    let reqs = [
        MetaRequest::Heartbeat {
            session: 2,
            boot_ids: [(7, "b0".to_string()), (u64::MAX, "b1".to_string())].into(),
            regions: vec![],
            leases: None,
            skipped: None,
            held_pages: None,
        },
        MetaRequest::Heartbeat {
            session: 2,
            boot_ids: BTreeMap::new(),
            regions: vec![3, u64::MAX],
            leases: Some(vec![HeldLease {
                lease_id: u64::MAX,
                region_id: 3,
                offset: 1 << 20,
                expires_in_ms: 59_000,
            }]),
            skipped: Some(SkipCounts {
                no_region: 1,
                max_bytes: u64::MAX,
                ..Default::default()
            }),
            held_pages: Some(vec![PageRef {
                region_id: u64::MAX,
                page: 0,
            }]),
        },
        MetaRequest::Publish {
            session: 2,
            entries: vec![PublishEntry {
                key: "k".into(),
                region_id: 1,
                offset: 0,
                length: 9,
                prev: Some("j".into()),
            }],
        },
        MetaRequest::FreePages {
            session: 2,
            pages: vec![PageRef {
                region_id: 1,
                page: 3,
            }],
        },
        MetaRequest::Stats { session: Some(4) },
        MetaRequest::Handshake {},
        MetaRequest::Usage,
    ];
    for body in reqs {
        let env = Envelope { id: 8, body };
        let back: Envelope<MetaRequest> = decode_json(&encode_json(&env)).unwrap();
        assert_eq!(back, env);
    }
}

#[test]
fn malformed_requests_are_errors() {
    for body in [
        &br#"{"id":1,"op":"nope"}"#[..],
        br#"{"id":1,"op":"alloc","session":1}"#,
        br#"{"id":1,"op":"alloc","session":1,"count":-1}"#,
        br#"{"id":1,"op":"open_session","engine_id":"e","namespace":"n","layout":"l",
             "backend":"cpu"}"#,
        br#"{"id":1,"op":"heartbeat","session":1,"boot_ids":{"x":"b"}}"#,
        br#"{"id":1,"op":"heartbeat","session":1,"skipped":{"no_region":-1}}"#,
        br#"{"id":1,"op":"heartbeat","session":1,"held_pages":[{"region_id":-1,"page":0}]}"#,
        br#"{"id":1,"op":"heartbeat","session":1,"held_pages":[{"region_id":1}]}"#,
        br#"{"id":1,"op":"heartbeat","session":1,"held_pages":7}"#,
        br#"{"id":1,"op":"heartbeat","session":1,"skipped":{"max_bytes":1e30}}"#,
        br#"{"id":1,"op":"exists","session":1,"keys":"k"}"#,
        br#"[1,2]"#,
    ] {
        assert!(
            decode_json::<Envelope<MetaRequest>>(body).is_err(),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

#[test]
fn replies_round_trip_by_kind() {
    let grant = RegionGrant {
        handle: Handle::example(),
        pool: PoolInfo {
            pool_id: 0,
            path: "/dev/dax0.0".into(),
            uuid: "u".into(),
            kind: "devdax".into(),
            total: 1 << 30,
            free: 1 << 29,
            align: 2 << 20,
            draining: 0,
        },
        agent: Some("10.0.0.2:9860".into()),
        page_size: 1 << 20,
        pages: 2,
    };
    let replies = [
        MetaReply::Region(grant.clone()),
        MetaReply::Session(SessionReply {
            session: 3,
            page_size: 1 << 20,
            region: Some(grant),
            session_timeout_ms: 30_000,
            lease_timeout_ms: 60_000,
            lease_limit: LEASE_LIMIT,
            session_secret: Some("ab".into()),
        }),
        MetaReply::Leases {
            leases: vec![
                None,
                Some(LeaseGrant {
                    lease_id: 1,
                    region_id: 4,
                    offset: 0,
                    length: 10,
                    read_token: "ab".into(),
                    agent: None,
                    device: None,
                    expires_in_ms: 5,
                    boot_id: Some("boot-1".into()),
                }),
            ],
        },
        MetaReply::Removed {
            results: vec![RemoveResult::NotOwner, RemoveResult::Removed],
        },
        MetaReply::PagesFreed { freed: 2 },
        MetaReply::Pinned {
            pinned: vec![true, false],
        },
        MetaReply::Unpinned {
            unpinned: vec![false],
        },
        MetaReply::Usage(UsageReply {
            sessions: vec![],
            kept_regions: 1,
            kept_bytes: 2,
            giving_back: 0,
            giving_back_bytes: 0,
        }),
    ];
    for r in replies {
        let env = ReplyEnvelope {
            id: 1,
            ok: Some(r.clone()),
            err: None,
        };
        let back: ReplyEnvelope<MetaReply> = decode_json(&encode_json(&env)).unwrap();
        assert_eq!(back.ok, Some(r));
    }
}

fn op_names() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("handshake".to_string()),
        Just("open_session".to_string()),
        Just("expand".to_string()),
        Just("alloc".to_string()),
        Just("free_pages".to_string()),
        Just("publish".to_string()),
        Just("exists".to_string()),
        Just("acquire".to_string()),
        Just("release_leases".to_string()),
        Just("victims".to_string()),
        Just("remove".to_string()),
        Just("pin".to_string()),
        Just("unpin".to_string()),
        Just("return_region".to_string()),
        Just("heartbeat".to_string()),
        Just("close".to_string()),
        Just("stats".to_string()),
        Just("usage".to_string()),
        "[a-z_]{0,14}",
    ]
}

/// Odd JSON values for any field: numbers of every sign and size, strings,
/// nested arrays and objects.
fn odd_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z0-9_]{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    /// The request decoder rejects or accepts arbitrary bytes without panicking.
    #[test]
    fn decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_json::<Envelope<MetaRequest>>(&data);
    }

    /// Known and unknown ops with odd values in every field a request may carry.
    #[test]
    fn odd_json_never_panics(
        op in op_names(),
        fields in proptest::collection::btree_map(
            field_name(&[
                "session", "count", "keys", "entries", "pages", "lease_ids", "boot_ids",
                "backend", "engine_id", "namespace", "layout", "region_id", "released",
                "drained", "max", "route_key", "leases", "regions", "skipped", "id",
            ]),
            odd_value(),
            0..8,
        ),
    ) {
        let mut obj = serde_json::Map::new();
        obj.insert("id".into(), serde_json::json!(1));
        for (k, v) in fields {
            obj.insert(k, v);
        }
        obj.insert("op".into(), serde_json::Value::String(op));
        let body = serde_json::Value::Object(obj).to_string();
        let _ = decode_json::<Envelope<MetaRequest>>(body.as_bytes());
    }
}

/// A field name of a request body: one of `known`, or (as likely as any one of them)
/// a made-up one.
fn field_name(known: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        known.len() as u32 => proptest::sample::select(known).prop_map(String::from),
        1 => "[a-z_]{1,8}",
    ]
}

/// The requests of the data path, with any values their fields may hold.
fn hot_request() -> impl Strategy<Value = MetaRequest> {
    let key = || "[a-z0-9/\"\\\\é\\x00-\\x1f]{0,12}";
    let keys = move || proptest::collection::vec(key(), 0..6);
    let entry = (
        key(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        proptest::option::of(key()),
    )
        .prop_map(|(key, region_id, offset, length, prev)| PublishEntry {
            key,
            region_id,
            offset,
            length,
            prev,
        });
    let page =
        (any::<u64>(), any::<u64>()).prop_map(|(region_id, page)| PageRef { region_id, page });
    prop_oneof![
        (any::<u64>(), keys()).prop_map(|(session, keys)| MetaRequest::Exists { session, keys }),
        (any::<u64>(), keys()).prop_map(|(session, keys)| MetaRequest::Acquire { session, keys }),
        (any::<u64>(), keys()).prop_map(|(session, keys)| MetaRequest::Remove { session, keys }),
        (any::<u64>(), keys()).prop_map(|(session, keys)| MetaRequest::Pin { session, keys }),
        (any::<u64>(), keys()).prop_map(|(session, keys)| MetaRequest::Unpin { session, keys }),
        (any::<u64>(), proptest::collection::vec(entry, 0..5))
            .prop_map(|(session, entries)| MetaRequest::Publish { session, entries }),
        (any::<u64>(), any::<u32>(), proptest::option::of(key())).prop_map(
            |(session, count, route_key)| MetaRequest::Alloc {
                session,
                count,
                route_key
            }
        ),
        (any::<u64>(), proptest::collection::vec(page, 0..5))
            .prop_map(|(session, pages)| MetaRequest::FreePages { session, pages }),
        (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..5))
            .prop_map(|(session, lease_ids)| MetaRequest::ReleaseLeases { session, lease_ids }),
    ]
}

/// `{"id": <id>, "op": <op>, <fields>}` in that order, as text (serde_json's `Map`
/// would sort the keys).
fn ordered_body(
    id: &serde_json::Value,
    op: &serde_json::Value,
    fields: &[(String, serde_json::Value)],
) -> String {
    let mut s = format!("{{\"id\":{id},\"op\":{op}");
    for (k, v) in fields {
        s.push_str(&format!(",{}:{v}", serde_json::Value::String(k.clone())));
    }
    s.push('}');
    s
}

/// The one-pass decoder's request, as the buffered decoder's type reads it.
fn one_pass(body: &[u8]) -> Option<Envelope<MetaRequest>> {
    super::meta::one_pass(body).map(owned)
}

/// maru-server's decoding of a request, as the buffered decoder's type reads it.
fn decode_request(body: &[u8]) -> Result<Envelope<MetaRequest>, crate::wire::WireError> {
    super::meta::decode_request(body).map(owned)
}

fn owned(e: Envelope<Request<'_>>) -> Envelope<MetaRequest> {
    Envelope {
        id: e.id,
        body: e.body.into_owned(),
    }
}

#[test]
fn the_one_pass_decoder_reads_the_usual_order_and_leaves_the_rest() {
    let usual = br#"{"id":7,"op":"exists","session":3,"keys":["a","b\"c"]}"#;
    let want = Envelope {
        id: 7,
        body: MetaRequest::Exists {
            session: 3,
            keys: vec!["a".into(), "b\"c".into()],
        },
    };
    assert_eq!(one_pass(usual), Some(want.clone()));
    // Another order, or an op it does not read: the buffered decoder's, alike.
    let reordered = br#"{"op":"exists","session":3,"keys":["a","b\"c"],"id":7}"#;
    assert_eq!(one_pass(reordered), None);
    assert_eq!(decode_request(reordered), Ok(want));
    assert_eq!(one_pass(br#"{"id":1,"op":"stats"}"#), None);
    assert_eq!(
        decode_request(br#"{"id":1,"op":"stats"}"#).map(|e| e.body),
        Ok(MetaRequest::Stats { session: None })
    );
    // A second id or op (even null) is the buffered decoder's to refuse.
    for dup in [
        &br#"{"id":1,"op":"exists","session":3,"keys":[],"id":2}"#[..],
        br#"{"id":1,"op":"exists","session":3,"keys":[],"op":null}"#,
        br#"{"id":1,"op":"exists","session":3,"keys":[],"\u0069d":2}"#,
    ] {
        assert_eq!(one_pass(dup), None, "{}", String::from_utf8_lossy(dup));
        assert!(
            decode_request(dup).is_err(),
            "{}",
            String::from_utf8_lossy(dup)
        );
    }
    // An op named by anything but a string, trailing bytes: not read here.
    assert_eq!(one_pass(br#"{"id":1,"op":7,"session":3,"keys":[]}"#), None);
    assert_eq!(
        one_pass(br#"{"id":1,"op":"exists","session":3,"keys":[]} x"#),
        None
    );
}

/// The one-pass decoder allocates only the request's vectors: its keys borrow the
/// body (no string copied), and no buffered copy of the body's every value is made.
/// Seen failing (64 allocations: a `String` per key and per `prev`) with `Text`'s
/// `#[serde(borrow)]` taken out.
#[test]
fn the_one_pass_decoder_allocates_no_key() {
    let keys: Vec<String> = (0..32).map(|i| format!("engine/layer/{i:08}")).collect();
    let entries: Vec<PublishEntry> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| PublishEntry {
            key: k.clone(),
            region_id: 1,
            offset: i as u64 * 262_144,
            length: 262_144,
            prev: i.checked_sub(1).map(|j| keys[j].clone()),
        })
        .collect();
    let body = encode_json(&Envelope {
        id: 9,
        body: MetaRequest::Publish {
            session: 2,
            entries,
        },
    });
    let (fast, n_fast) = crate::test_alloc::allocations_in(|| super::meta::one_pass(&body));
    let (slow, n_slow) =
        crate::test_alloc::allocations_in(|| decode_json::<Envelope<MetaRequest>>(&body));
    let Some(Envelope {
        body: Request::Hot(HotRequest::Publish { entries, .. }),
        ..
    }) = &fast
    else {
        panic!("not read in one pass: {fast:?}");
    };
    assert!(entries.iter().all(|e| matches!(e.key.0, Cow::Borrowed(_))
        && e.prev
            .as_ref()
            .is_none_or(|p| matches!(p.0, Cow::Borrowed(_)))));
    assert_eq!(fast.map(owned), slow.ok());
    // The entries' vector as it grows; no string.
    assert!(n_fast <= 8, "{n_fast} allocations");
    assert!(n_fast * 8 < n_slow, "{n_fast} against {n_slow} buffered");
    // A key with an escape is copied (and still read in one pass).
    let escaped = br#"{"id":1,"op":"exists","session":3,"keys":["a\"b","c"]}"#;
    let Some(Envelope {
        body: Request::Hot(HotRequest::Keys { keys, .. }),
        ..
    }) = super::meta::one_pass(escaped)
    else {
        panic!("an escaped key is read in one pass");
    };
    assert!(matches!(&keys[0].0, Cow::Owned(k) if k == "a\"b"));
    assert!(matches!(keys[1].0, Cow::Borrowed("c")));
}

proptest! {
    /// Every request of the data path, as a worker encodes it, is read in one pass,
    /// as the buffered decoder reads it.
    #[test]
    fn hot_requests_read_in_one_pass_as_buffered(id in any::<u64>(), req in hot_request()) {
        let env = Envelope { id, body: req };
        let body = encode_json(&env);
        prop_assert_eq!(one_pass(&body), Some(env.clone()));
        prop_assert_eq!(decode_json::<Envelope<MetaRequest>>(&body), Ok(env));
    }

    /// Whatever the one-pass decoder accepts, the buffered decoder accepts as the same
    /// request: ids, ops and fields of odd values and kinds, duplicates included.
    #[test]
    fn one_pass_accepts_only_what_the_buffered_decoder_accepts_alike(
        id in prop_oneof![any::<u64>().prop_map(|n| serde_json::json!(n)), odd_value()],
        op in prop_oneof![op_names().prop_map(serde_json::Value::String), odd_value()],
        fields in proptest::collection::vec(
            (
                field_name(&[
                    "session", "count", "keys", "entries", "pages", "lease_ids", "route_key",
                    "id", "op",
                ]),
                prop_oneof![
                    odd_value(),
                    Just(serde_json::json!(1)),
                    Just(serde_json::json!(["a", "b"])),
                    Just(serde_json::json!([{"region_id": 1, "offset": 0, "length": 1, "key": "k"}])),
                    Just(serde_json::json!([{"region_id": 1, "page": 0}])),
                    Just(serde_json::json!([1, 2])),
                ],
            ),
            0..6,
        ),
    ) {
        let body = ordered_body(&id, &op, &fields);
        if let Some(env) = one_pass(body.as_bytes()) {
            prop_assert_eq!(decode_json::<Envelope<MetaRequest>>(body.as_bytes()), Ok(env), "{}", body);
        }
    }

    /// Arbitrary bytes: no panic, and nothing accepted that the buffered decoder refuses.
    #[test]
    fn one_pass_never_panics_on_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Some(env) = one_pass(&data) {
            prop_assert_eq!(decode_json::<Envelope<MetaRequest>>(&data), Ok(env));
        }
    }
}

/// A field the one-pass decoder does not know sends the body to the buffered decoder,
/// at the top and inside an entry or a page: a value the one pass would skip is not
/// checked as the buffered decoder checks it (fuzz-smoke's meta_messages input in
/// fuzz/regressions/meta_messages/: invalid UTF-8 in an unknown field).
#[test]
fn an_unknown_field_anywhere_goes_to_the_buffered_decoder() {
    let crash: &[u8] =
        b"{\"id\": 3, \"op\": \"alloc\", \"session\": 1, \"count\": 4, \"rprev_ke!y\": \"\xb4\"}";
    assert!(one_pass(crash).is_none());
    assert!(decode_request(crash).is_err());
    let known = br#"{"id":1,"op":"publish","session":2,"entries":[{"key":"k","region_id":1,"offset":0,"length":8}]}"#;
    assert!(one_pass(known).is_some());
    for body in [
        &br#"{"id":1,"op":"publish","session":2,"entries":[{"key":"k","region_id":1,"offset":0,"length":8,"x":1e400}]}"#[..],
        br#"{"id":1,"op":"free_pages","session":2,"pages":[{"region_id":1,"page":0,"x":"\ud800"}]}"#,
        br#"{"id":1,"op":"exists","session":2,"keys":["a"],"x":0}"#,
    ] {
        assert!(one_pass(body).is_none(), "{}", String::from_utf8_lossy(body));
        assert_eq!(
            decode_request(body).is_ok(),
            decode_json::<Envelope<MetaRequest>>(body).is_ok(),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}
