//! What runs without an RDMA device: opening errors, the bring-up JSON, the wr_id
//! layout and the completion-status mapping. The data path needs a NIC.

use super::device::{unavailable, Missing};
use super::proto::{
    pack_wr_id, unpack_wr_id, Endpoint, TargetHalf, TargetMeta, WorkerHalf, MAX_BATCH_OPS, MTUS,
    WR_BATCH_BITS, WR_INDEX_BITS,
};
use super::{status, VerbsSettings, VerbsTarget, VerbsTransport};
use crate::transport::{Op, OpKind, TransportError};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The settings of `device` (`None`: the first) at `port`, sourcing from `gid_index`.
fn at(device: Option<&str>, port: u8, gid_index: Option<u8>) -> VerbsSettings {
    VerbsSettings {
        device: device.map(str::to_string),
        port,
        gid_index,
        ..VerbsSettings::default()
    }
}

fn unavailable_text(r: Result<impl Sized, TransportError>) -> Option<String> {
    match r {
        Err(TransportError::Unavailable(m)) => Some(m),
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => None,
    }
}

#[test]
fn opening_a_missing_named_device_is_unavailable_and_names_it() {
    let name = "maru_no_such_rdma_dev7";
    let m = unavailable_text(VerbsTransport::open_with(&at(Some(name), 1, None)))
        .expect("a device with this name does not exist");
    assert!(m.contains(name), "{m}");
    assert!(m.contains("no RDMA device found"), "{m}");
    assert!(m.contains("--transport soft"), "{m}");
    let m = unavailable_text(VerbsTarget::open_with(&at(Some(name), 1, None)))
        .expect("a device with this name does not exist");
    assert!(m.contains(name), "{m}");
    // The Display form carries it too (what a daemon prints before exiting).
    let e = VerbsTransport::open_with(&at(Some(name), 1, Some(0)))
        .err()
        .unwrap();
    assert!(e.to_string().contains(name), "{e}");
}

#[test]
fn opening_mlx5_0_without_it_gives_the_documented_message() {
    match unavailable_text(VerbsTransport::open_with(&at(Some("mlx5_0"), 1, None))) {
        Some(m) => {
            assert!(
                m.starts_with("no RDMA device found (looked for mlx5_0"),
                "{m}"
            );
            assert!(
                m.contains("use --transport soft on hosts without RDMA"),
                "{m}"
            );
        }
        None => eprintln!("mlx5_0 exists on this host: the error path was not exercised"),
    }
}

#[test]
fn opening_the_first_device_without_any_is_unavailable() {
    match unavailable_text(VerbsTransport::open_with(&at(None, 1, None))) {
        Some(m) => {
            assert!(m.contains("looked for any device"), "{m}");
            assert!(m.contains("--transport soft"), "{m}");
        }
        None => eprintln!("this host has an RDMA device: the error path was not exercised"),
    }
    if let Some(m) = unavailable_text(VerbsTarget::open_with(&at(None, 1, None))) {
        assert!(m.contains("looked for any device"), "{m}");
    }
}

#[test]
fn port_zero_is_refused_before_any_device_lookup() {
    match VerbsTransport::open_with(&at(Some("mlx5_0"), 0, None)) {
        Err(TransportError::Setup(m)) => assert!(m.contains("start at 1"), "{m}"),
        other => panic!("{:?}", other.err()),
    }
}

#[test]
fn unavailable_messages_name_the_device_in_every_case() {
    let cases = [
        Missing::NoRdmaCore,
        Missing::NoDevice { detail: None },
        Missing::NoDevice {
            detail: Some("failed to get device list: Function not implemented".into()),
        },
        Missing::NotNamed {
            present: vec!["rxe0".into(), "mlx5_1".into()],
        },
    ];
    for why in &cases {
        let TransportError::Unavailable(m) = unavailable(Some("mlx5_0"), why) else {
            panic!("not Unavailable")
        };
        assert!(m.contains("(looked for mlx5_0"), "{m}");
        assert!(m.contains("--transport soft on hosts without RDMA"), "{m}");
        let TransportError::Unavailable(m) = unavailable(None, why) else {
            panic!("not Unavailable")
        };
        assert!(m.contains("looked for any device"), "{m}");
    }
    let TransportError::Unavailable(m) = unavailable(Some("mlx5_0"), &Missing::NoRdmaCore) else {
        unreachable!()
    };
    assert!(m.contains("libibverbs.so.1"), "{m}");
    let TransportError::Unavailable(m) = unavailable(
        Some("mlx5_0"),
        &Missing::NotNamed {
            present: vec!["rxe0".into()],
        },
    ) else {
        unreachable!()
    };
    assert!(m.contains("present: rxe0"), "{m}");
    let m = unavailable(
        Some("mlx5_0"),
        &Missing::NoDevice {
            detail: Some("failed to get device list: Permission denied".into()),
        },
    )
    .to_string();
    assert!(
        m.contains("(looked for mlx5_0); use --transport soft on hosts without RDMA [listing devices: failed to get device list: Permission denied]"),
        "{m}"
    );
    assert_eq!(
        unavailable(Some("mlx5_0"), &Missing::NoDevice { detail: None }).to_string(),
        "transport unavailable: no RDMA device found (looked for mlx5_0); use --transport soft on hosts without RDMA"
    );
}

// --- bring-up JSON -----------------------------------------------------------------

fn ep() -> Endpoint {
    Endpoint {
        lid: 7,
        gid: "::ffff:10.0.0.2"
            .parse::<std::net::Ipv6Addr>()
            .unwrap()
            .octets(),
        qpn: 0x1234,
        psn: 0xabcdef,
        mtu: 4096,
        rd_atomic: 16,
    }
}

fn setup_msg(r: Result<impl std::fmt::Debug, TransportError>) -> String {
    match r {
        Err(TransportError::Setup(m)) => m,
        other => panic!("expected a Setup error, got {other:?}"),
    }
}

#[test]
fn halves_encode_as_documented() {
    let w = WorkerHalf {
        worker: 42,
        ep: ep(),
    };
    let j = w.to_json();
    assert_eq!(
        j,
        json!({"verbs": {"qp_type": "rc", "worker": 42, "lid": 7, "gid": "::ffff:10.0.0.2",
            "qpn": 0x1234, "psn": 0xabcdef, "mtu": 4096, "rd_atomic": 16}})
    );
    assert_eq!(WorkerHalf::from_json(&j).unwrap(), w);
    let t = TargetHalf { ep: ep() };
    assert_eq!(TargetHalf::from_json(&t.to_json()).unwrap(), t);
    // A target half carries no worker id, and a worker half needs one.
    assert!(setup_msg(WorkerHalf::from_json(&t.to_json())).contains("`worker` is missing"));
}

#[test]
fn target_meta_round_trips_and_accepts_the_minimal_form() {
    let m = TargetMeta {
        device: "mlx5_0".into(),
        port: 1,
        lid: Some(3),
        gid: Some(ep().gid),
        target: Some(u64::MAX),
    };
    assert_eq!(TargetMeta::from_json(&m.to_json()).unwrap(), m);
    let minimal =
        TargetMeta::from_json(&json!({"verbs": {"device": "mlx5_0", "port": 1}})).unwrap();
    assert_eq!(minimal.device, "mlx5_0");
    assert_eq!(minimal.port, 1);
    assert_eq!(minimal.target, None);
    // Soft metadata is not verbs metadata.
    let msg = setup_msg(TargetMeta::from_json(
        &json!({"soft": {"addr": "127.0.0.1:1"}}),
    ));
    assert!(msg.contains("no `verbs` object"), "{msg}");
    assert!(msg.contains("soft"), "{msg}");
}

#[test]
fn only_rc_is_accepted() {
    for (qp, needle) in [
        ("ud", "UD has no one-sided RDMA"),
        ("UD", "UD has no one-sided RDMA"),
        ("dc", "\"dc\" is not supported"),
        ("uc", "\"uc\" refused"),
        ("xrc", "\"xrc\" refused"),
    ] {
        let mut w = WorkerHalf {
            worker: 1,
            ep: ep(),
        }
        .to_json();
        w["verbs"]["qp_type"] = json!(qp);
        let m = setup_msg(WorkerHalf::from_json(&w));
        assert!(m.contains(needle), "{qp}: {m}");
        assert!(m.contains("only \"rc\""), "{qp}: {m}");
        let mut t = TargetHalf { ep: ep() }.to_json();
        t["verbs"]["qp_type"] = json!(qp);
        assert!(setup_msg(TargetHalf::from_json(&t)).contains(needle));
        let meta = json!({"verbs": {"device": "mlx5_0", "port": 1, "qp_type": qp}});
        assert!(setup_msg(TargetMeta::from_json(&meta)).contains(needle));
    }
    let mut w = WorkerHalf {
        worker: 1,
        ep: ep(),
    }
    .to_json();
    w["verbs"]["qp_type"] = json!(2);
    assert!(setup_msg(WorkerHalf::from_json(&w)).contains("`qp_type` must be"));
    w["verbs"]["qp_type"] = json!("RC");
    assert!(WorkerHalf::from_json(&w).is_ok());
}

/// Each field with a value of the wrong type or out of range: refused, and the error
/// names the field and what it must be.
#[test]
fn wrong_types_are_refused_with_the_field_named() {
    let good = WorkerHalf {
        worker: 9,
        ep: ep(),
    }
    .to_json();
    let bad: &[(&str, Value, &str)] = &[
        ("worker", json!("9"), "`worker` must be an integer"),
        ("worker", json!(-1), "`worker` must be an integer"),
        ("worker", json!(1.5), "`worker` must be an integer"),
        (
            "lid",
            json!(65536),
            "`lid` must be an integer from 0 to 65535",
        ),
        ("lid", json!(null), "`lid` must be"),
        ("gid", json!(12), "`gid` must be a GID in IPv6 notation"),
        (
            "gid",
            json!("not a gid"),
            "`gid` must be a GID in IPv6 notation",
        ),
        ("gid", json!(["fe80::1"]), "`gid` must be"),
        (
            "qpn",
            json!(1 << 24),
            "`qpn` must be an integer from 0 to 16777215",
        ),
        ("qpn", json!({"n": 1}), "got an object"),
        ("psn", json!(true), "`psn` must be"),
        ("psn", json!(u64::MAX), "`psn` must be"),
        (
            "mtu",
            json!(1500),
            "`mtu` must be one of 256, 512, 1024, 2048, 4096",
        ),
        ("mtu", json!("4096"), "`mtu` must be an integer"),
        (
            "rd_atomic",
            json!(256),
            "`rd_atomic` must be an integer from 0 to 255",
        ),
    ];
    for (field, value, needle) in bad {
        let mut v = good.clone();
        v["verbs"][*field] = value.clone();
        let m = setup_msg(WorkerHalf::from_json(&v));
        assert!(m.contains(needle), "{field}={value}: {m}");
        assert!(m.contains("worker half"), "{m}");
        if *field != "worker" {
            let mut t = TargetHalf { ep: ep() }.to_json();
            t["verbs"][*field] = value.clone();
            let m = setup_msg(TargetHalf::from_json(&t));
            assert!(m.contains(needle), "{field}={value}: {m}");
            assert!(m.contains("target half"), "{m}");
        }
    }
    for field in ["lid", "gid", "qpn", "psn", "mtu", "rd_atomic"] {
        let mut v = good.clone();
        v["verbs"].as_object_mut().unwrap().remove(field);
        let m = setup_msg(WorkerHalf::from_json(&v));
        assert!(m.contains(&format!("`{field}` is missing")), "{m}");
    }
    for top in [json!(null), json!("verbs"), json!([1]), json!({"verbs": 3})] {
        let m = setup_msg(WorkerHalf::from_json(&top));
        assert!(m.contains("verbs"), "{m}");
    }
    let meta_bad: &[(&str, Value, &str)] = &[
        ("device", json!(""), "`device` must be a non-empty string"),
        ("device", json!(5), "`device` must be a non-empty string"),
        ("port", json!(0), "`port` must be an integer from 1 to 255"),
        ("port", json!("1"), "`port` must be"),
        ("target", json!("x"), "`target` must be"),
    ];
    for (field, value, needle) in meta_bad {
        let mut v = json!({"verbs": {"device": "mlx5_0", "port": 1}});
        v["verbs"][*field] = value.clone();
        let m = setup_msg(TargetMeta::from_json(&v));
        assert!(m.contains(needle), "{field}={value}: {m}");
    }
}

const FIELDS: &[&str] = &[
    "verbs",
    "qp_type",
    "worker",
    "lid",
    "gid",
    "qpn",
    "psn",
    "mtu",
    "rd_atomic",
    "device",
    "port",
    "target",
];

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (0u64..70_000).prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,24}".prop_map(Value::String),
        prop_oneof![
            Just("rc"),
            Just("ud"),
            Just("fe80::1"),
            Just("::"),
            Just("mlx5_0")
        ]
        .prop_map(|s| json!(s)),
    ]
}

fn arb_key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(FIELDS).prop_map(str::to_string),
        1 => ".{0,8}",
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    arb_leaf().prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((arb_key(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// `{"verbs": {field: anything, ...}}`: gets past the outer checks into every field.
fn arb_verbs_doc() -> impl Strategy<Value = Value> {
    prop::collection::vec(
        (
            prop::sample::select(FIELDS).prop_map(str::to_string),
            prop_oneof![3 => arb_leaf(), 1 => arb_json()],
        ),
        0..12,
    )
    .prop_map(|kv| json!({ "verbs": Value::Object(kv.into_iter().collect()) }))
}

fn arb_endpoint() -> impl Strategy<Value = Endpoint> {
    (
        any::<u16>(),
        any::<[u8; 16]>(),
        0u32..1 << 24,
        0u32..1 << 24,
        prop::sample::select(&MTUS[..]),
        any::<u8>(),
    )
        .prop_map(|(lid, gid, qpn, psn, mtu, rd_atomic)| Endpoint {
            lid,
            gid,
            qpn,
            psn,
            mtu,
            rd_atomic,
        })
}

fn decode_all(v: &Value) {
    let _ = WorkerHalf::from_json(v);
    let _ = TargetHalf::from_json(v);
    let _ = TargetMeta::from_json(v);
}

proptest! {
    #[test]
    fn decoders_never_panic_on_arbitrary_json(v in arb_json()) {
        decode_all(&v);
        decode_all(&json!({ "verbs": v }));
    }

    #[test]
    fn decoders_never_panic_on_verbs_shaped_json(v in arb_verbs_doc()) {
        decode_all(&v);
        // Whatever they refuse, they say why with a Setup error.
        for r in [
            WorkerHalf::from_json(&v).err(),
            TargetHalf::from_json(&v).err(),
            TargetMeta::from_json(&v).err(),
        ]
        .into_iter()
        .flatten()
        {
            match r {
                TransportError::Setup(m) => prop_assert!(m.starts_with("verbs "), "{}", m),
                other => prop_assert!(false, "not a Setup error: {:?}", other),
            }
        }
    }

    #[test]
    fn a_field_replaced_by_a_string_or_object_is_refused_naming_it(
        e in arb_endpoint(),
        field in prop::sample::select(&["worker", "lid", "gid", "qpn", "psn", "mtu", "rd_atomic"][..]),
        junk in prop_oneof![
            ".{0,12}".prop_filter("not a GID", |s| s.parse::<std::net::Ipv6Addr>().is_err()).prop_map(Value::String),
            Just(json!({})),
            Just(json!([])),
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
        ],
    ) {
        let mut v = WorkerHalf { worker: 5, ep: e }.to_json();
        v["verbs"][field] = junk.clone();
        match WorkerHalf::from_json(&v) {
            Err(TransportError::Setup(m)) => {
                let needle = format!("`{field}` must be");
                prop_assert!(m.contains(&needle), "{} = {}: {}", field, junk, m);
            }
            other => prop_assert!(false, "{} = {} accepted: {:?}", field, junk, other),
        }
    }

    #[test]
    fn halves_round_trip(worker in any::<u64>(), e in arb_endpoint()) {
        let w = WorkerHalf { worker, ep: e };
        prop_assert_eq!(WorkerHalf::from_json(&w.to_json()).unwrap(), w);
        // Through text too (what crosses the agent's control connection).
        let text = serde_json::to_string(&w.to_json()).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(WorkerHalf::from_json(&back).unwrap(), w);
        let t = TargetHalf { ep: e };
        prop_assert_eq!(TargetHalf::from_json(&t.to_json()).unwrap(), t);
    }

    #[test]
    fn target_meta_round_trips(
        device in "[a-z][a-z0-9_]{0,15}",
        port in 1u8..,
        lid in proptest::option::of(any::<u16>()),
        gid in proptest::option::of(any::<[u8; 16]>()),
        target in proptest::option::of(any::<u64>()),
    ) {
        let m = TargetMeta { device, port, lid, gid, target };
        prop_assert_eq!(TargetMeta::from_json(&m.to_json()).unwrap(), m);
    }

    #[test]
    fn wr_id_round_trips(batch in 0u64..1 << WR_BATCH_BITS, index in 0u32..1 << WR_INDEX_BITS) {
        let id = pack_wr_id(batch, index).unwrap();
        prop_assert_eq!(unpack_wr_id(id), (batch, index));
    }

    #[test]
    fn wr_id_keeps_the_low_batch_bits(batch in any::<u64>(), index in 0u32..1 << WR_INDEX_BITS) {
        let id = pack_wr_id(batch, index).unwrap();
        prop_assert_eq!(unpack_wr_id(id), (batch & ((1 << WR_BATCH_BITS) - 1), index));
    }

    #[test]
    fn wr_ids_of_distinct_ops_differ(
        a in (0u64..1 << WR_BATCH_BITS, 0u32..1 << WR_INDEX_BITS),
        b in (0u64..1 << WR_BATCH_BITS, 0u32..1 << WR_INDEX_BITS),
    ) {
        prop_assume!(a != b);
        prop_assert_ne!(pack_wr_id(a.0, a.1), pack_wr_id(b.0, b.1));
    }
}

#[test]
fn wr_id_edges() {
    assert_eq!(pack_wr_id(0, 0), Some(0));
    assert_eq!(pack_wr_id(1, 0), Some(1 << 24));
    assert_eq!(pack_wr_id((1 << 40) - 1, (1 << 24) - 1), Some(u64::MAX));
    assert_eq!(pack_wr_id(3, 1 << 24), None);
    assert_eq!(pack_wr_id(3, u32::MAX), None);
    assert_eq!(unpack_wr_id(u64::MAX), ((1 << 40) - 1, (1 << 24) - 1));
    assert_eq!(MAX_BATCH_OPS, 1 << 24);
}

// --- completion statuses -------------------------------------------------------------

#[test]
fn completion_statuses_map_to_transport_errors() {
    use rdma_mummy_sys::ibv_wc_status as s;
    let op = Op {
        kind: OpKind::Write,
        local_offset: 4096,
        remote_addr: 0x7000_0000,
        rkey: 0x1234,
        len: 512,
    };
    assert_eq!(
        status::op_error(s::IBV_WC_REM_ACCESS_ERR, 0, &op, "p", None),
        TransportError::BadKey { rkey: 0x1234 }
    );
    assert_eq!(
        status::op_error(s::IBV_WC_LOC_PROT_ERR, 0, &op, "p", None),
        TransportError::LocalRange {
            offset: 4096,
            len: 512
        }
    );
    match status::op_error(
        s::IBV_WC_WR_FLUSH_ERR,
        0,
        &op,
        "peer-x",
        Some("RDMA READ failed"),
    ) {
        TransportError::PeerLost { peer, message } => {
            assert_eq!(peer, "peer-x");
            assert!(
                message.contains("flushed after an earlier failure: RDMA READ failed"),
                "{message}"
            );
            assert!(message.contains("RDMA WRITE of 512 bytes"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    match status::op_error(s::IBV_WC_RETRY_EXC_ERR, 0x81, &op, "peer-x", None) {
        TransportError::PeerLost { message, .. } => {
            assert!(message.contains("retry counter exceeded"), "{message}");
            assert!(message.contains("vendor error 0x81"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Unknown statuses never panic.
    assert_eq!(status::text(9999), "unknown completion status");
    assert!(matches!(
        status::op_error(9999, 0, &op, "p", None),
        TransportError::PeerLost { .. }
    ));
}

// --- on a host with an RDMA device ----------------------------------------------------

/// The end-to-end check over a real device (or rdma_rxe: `rdma link add rxe0 type rxe
/// netdev lo`). Skipped, with one line, where no device exists.
#[test]
fn a_loopback_bring_up_passes_every_check_on_an_rdma_device() {
    let settings = VerbsSettings {
        device: std::env::var("MARU_RDMA_DEVICE").ok(),
        ..VerbsSettings::default()
    };
    match super::check::run(&settings) {
        Err(TransportError::Unavailable(m)) => {
            eprintln!("skipped: no usable RDMA device ({m})");
        }
        Err(e) => panic!("bring-up check failed: {e}"),
        Ok(lines) => {
            for l in &lines {
                eprintln!(
                    "{} {}: {}",
                    if l.ok { "ok" } else { "FAIL" },
                    l.what,
                    l.detail
                );
            }
            // The memlock line is advice (CI containers often cap it); the rest must pass.
            assert!(
                lines
                    .iter()
                    .filter(|l| l.what != "memlock limit")
                    .all(|l| l.ok),
                "{lines:#?}"
            );
        }
    }
}
