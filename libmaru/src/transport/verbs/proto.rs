//! The JSON the verbs transport exchanges, and the work-request id layout.
//!
//! Three documents, all wrapped in `{"verbs": {...}}`:
//!
//! * the **target metadata** a [`VerbsTarget`](super::VerbsTarget) puts in each
//!   registration (the `transport` field of an agent's map reply):
//!   `{"verbs": {"qp_type": "rc", "device": "mlx5_0", "port": 1, "lid": 3,
//!   "gid": "fe80::1", "target": 81985529216486895}}` — `device` and `port` say which
//!   NIC port serves the region, `lid`/`gid` and the random per-process `target` id
//!   identify that agent so a worker keeps one queue pair per agent;
//! * the **worker half** of the queue-pair bring-up, sent through the
//!   [`Bringup`](crate::transport::Bringup) callback to
//!   [`Target::accept_peer`](crate::transport::Target::accept_peer):
//!   `{"verbs": {"qp_type": "rc", "worker": 42, "lid": 1, "gid": "::ffff:10.0.0.1",
//!   "qpn": 4660, "psn": 99, "mtu": 4096, "rd_atomic": 16}}`;
//! * the **target half**, the answer: the same fields without `worker`.
//!
//! `qp_type` may be absent (it means `rc`); any other value is refused: RC is the only
//! queue-pair type whose one-sided operations the NIC key-checks (UD has no one-sided
//! RDMA at all, so a UD "RDMA" would be emulated in software where a released key is
//! not checked by the NIC).
//!
//! The decoders never panic on any JSON and name the field and the expected type in
//! every error ([`TransportError::Setup`]).

use crate::transport::TransportError;
use serde_json::{json, Map, Value};
use std::net::Ipv6Addr;

/// The only queue-pair type accepted.
pub const QP_TYPE_RC: &str = "rc";

/// Bits of a work-request id that hold the operation's index in its batch.
pub const WR_INDEX_BITS: u32 = 24;
/// Bits of a work-request id that hold the batch id (its low bits).
pub const WR_BATCH_BITS: u32 = 64 - WR_INDEX_BITS;
/// The most operations one batch may hold (the index field's range).
pub const MAX_BATCH_OPS: usize = 1 << WR_INDEX_BITS;

/// Packs a batch id and an operation index into a 64-bit `wr_id`:
/// `(batch mod 2^40) << 24 | index`. `None` when `index` does not fit in 24 bits.
///
/// The batch field keeps the batch's low 40 bits: ids are only matched against the
/// operations of one queue pair that are in flight (at most its send-queue depth), so
/// two of them can only collide after 2^40 batches, while both are still in flight.
pub fn pack_wr_id(batch: u64, index: u32) -> Option<u64> {
    if u64::from(index) >= 1 << WR_INDEX_BITS {
        return None;
    }
    let batch_low = batch & ((1u64 << WR_BATCH_BITS) - 1);
    Some(batch_low << WR_INDEX_BITS | u64::from(index))
}

/// Splits a `wr_id` into (batch id low 40 bits, index).
pub fn unpack_wr_id(wr_id: u64) -> (u64, u32) {
    (
        wr_id >> WR_INDEX_BITS,
        (wr_id & ((1u64 << WR_INDEX_BITS) - 1)) as u32,
    )
}

/// What a worker learns from an agent's registration metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetMeta {
    pub device: String,
    pub port: u8,
    pub lid: Option<u16>,
    pub gid: Option<[u8; 16]>,
    /// The target process's random id (absent from metadata of other producers).
    pub target: Option<u64>,
}

impl TargetMeta {
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("qp_type".into(), json!(QP_TYPE_RC));
        m.insert("device".into(), json!(self.device));
        m.insert("port".into(), json!(self.port));
        if let Some(lid) = self.lid {
            m.insert("lid".into(), json!(lid));
        }
        if let Some(gid) = self.gid {
            m.insert("gid".into(), json!(gid_to_string(&gid)));
        }
        if let Some(t) = self.target {
            m.insert("target".into(), json!(t));
        }
        json!({ "verbs": Value::Object(m) })
    }

    pub fn from_json(v: &Value) -> Result<TargetMeta, TransportError> {
        const W: &str = "transport metadata";
        let m = verbs_object(v, W)?;
        check_qp_type(m, W)?;
        let device = match m.get("device") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(other) => return Err(wrong(W, "device", "a non-empty string", other)),
            None => return Err(missing(W, "device")),
        };
        let port = req_uint(m, W, "port", 1, 255)? as u8;
        let lid = opt_uint(m, W, "lid", 0, 0xffff)?.map(|x| x as u16);
        let gid = match m.get("gid") {
            None => None,
            Some(g) => Some(parse_gid(g, W)?),
        };
        let target = opt_uint(m, W, "target", 0, u64::MAX)?;
        Ok(TargetMeta {
            device,
            port,
            lid,
            gid,
            target,
        })
    }
}

/// One side's queue-pair address and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Port LID (0 on RoCE, where the GID routes).
    pub lid: u16,
    /// Port GID (all zero when the port has none, e.g. IB without GRH).
    pub gid: [u8; 16],
    /// Queue-pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number of this side's send queue (24 bits).
    pub psn: u32,
    /// Active path MTU of this side's port, in bytes (256, 512, 1024, 2048 or 4096).
    pub mtu: u32,
    /// RDMA READs in flight: the initiator depth on a worker, the responder resources
    /// on a target.
    pub rd_atomic: u8,
}

/// The worker's half of the bring-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerHalf {
    /// Random id of the worker's transport: a target keeps one queue pair per worker
    /// and replaces it when the same worker connects again (after a fence).
    pub worker: u64,
    pub ep: Endpoint,
}

/// The target's half of the bring-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetHalf {
    pub ep: Endpoint,
}

impl WorkerHalf {
    pub fn to_json(&self) -> Value {
        let mut m = endpoint_fields(&self.ep);
        m.insert("worker".into(), json!(self.worker));
        json!({ "verbs": Value::Object(m) })
    }

    pub fn from_json(v: &Value) -> Result<WorkerHalf, TransportError> {
        const W: &str = "worker half of the queue-pair bring-up";
        let m = verbs_object(v, W)?;
        check_qp_type(m, W)?;
        let worker = req_uint(m, W, "worker", 0, u64::MAX)?;
        let ep = endpoint_from(m, W)?;
        Ok(WorkerHalf { worker, ep })
    }
}

impl TargetHalf {
    pub fn to_json(&self) -> Value {
        json!({ "verbs": Value::Object(endpoint_fields(&self.ep)) })
    }

    pub fn from_json(v: &Value) -> Result<TargetHalf, TransportError> {
        const W: &str = "target half of the queue-pair bring-up";
        let m = verbs_object(v, W)?;
        check_qp_type(m, W)?;
        let ep = endpoint_from(m, W)?;
        Ok(TargetHalf { ep })
    }
}

/// The five path MTUs, in bytes.
pub const MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

pub fn gid_to_string(gid: &[u8; 16]) -> String {
    Ipv6Addr::from(*gid).to_string()
}

fn endpoint_fields(ep: &Endpoint) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("qp_type".into(), json!(QP_TYPE_RC));
    m.insert("lid".into(), json!(ep.lid));
    m.insert("gid".into(), json!(gid_to_string(&ep.gid)));
    m.insert("qpn".into(), json!(ep.qpn));
    m.insert("psn".into(), json!(ep.psn));
    m.insert("mtu".into(), json!(ep.mtu));
    m.insert("rd_atomic".into(), json!(ep.rd_atomic));
    m
}

fn endpoint_from(m: &Map<String, Value>, what: &str) -> Result<Endpoint, TransportError> {
    let lid = req_uint(m, what, "lid", 0, 0xffff)? as u16;
    let gid = match m.get("gid") {
        Some(g) => parse_gid(g, what)?,
        None => return Err(missing(what, "gid")),
    };
    let qpn = req_uint(m, what, "qpn", 0, (1 << 24) - 1)? as u32;
    let psn = req_uint(m, what, "psn", 0, (1 << 24) - 1)? as u32;
    let mtu = req_uint(m, what, "mtu", 0, u64::MAX)?;
    if !MTUS.iter().any(|&x| u64::from(x) == mtu) {
        return Err(TransportError::Setup(format!(
            "verbs {what}: field `mtu` must be one of 256, 512, 1024, 2048, 4096 (bytes), got {mtu}"
        )));
    }
    let rd_atomic = req_uint(m, what, "rd_atomic", 0, 255)? as u8;
    Ok(Endpoint {
        lid,
        gid,
        qpn,
        psn,
        mtu: mtu as u32,
        rd_atomic,
    })
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => {
            let mut short: String = s.chars().take(40).collect();
            if short.len() < s.len() {
                short.push('…');
            }
            format!("the string {short:?}")
        }
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

fn wrong(what: &str, field: &str, expected: &str, got: &Value) -> TransportError {
    TransportError::Setup(format!(
        "verbs {what}: field `{field}` must be {expected}, got {}",
        type_name(got)
    ))
}

fn missing(what: &str, field: &str) -> TransportError {
    TransportError::Setup(format!("verbs {what}: field `{field}` is missing"))
}

fn verbs_object<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>, TransportError> {
    match v {
        Value::Object(top) => match top.get("verbs") {
            Some(Value::Object(m)) => Ok(m),
            Some(other) => Err(wrong(what, "verbs", "an object", other)),
            None => Err(TransportError::Setup(format!(
                "verbs {what}: no `verbs` object (keys: {}); the other side does not run the verbs transport",
                top.keys().take(8).cloned().collect::<Vec<_>>().join(", ")
            ))),
        },
        other => Err(TransportError::Setup(format!(
            "verbs {what}: must be a JSON object {{\"verbs\": {{...}}}}, got {}",
            type_name(other)
        ))),
    }
}

fn check_qp_type(m: &Map<String, Value>, what: &str) -> Result<(), TransportError> {
    match m.get("qp_type") {
        None => Ok(()),
        Some(Value::String(s)) if s.eq_ignore_ascii_case(QP_TYPE_RC) => Ok(()),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("ud") => Err(TransportError::Setup(format!(
            "verbs {what}: queue-pair type \"ud\" refused: UD has no one-sided RDMA, so a released remote key would not be checked by the NIC; only \"rc\" is accepted"
        ))),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("dc") => Err(TransportError::Setup(format!(
            "verbs {what}: queue-pair type \"dc\" is not supported by this build; only \"rc\" is accepted"
        ))),
        Some(Value::String(s)) => Err(TransportError::Setup(format!(
            "verbs {what}: queue-pair type {s:?} refused; only \"rc\" is accepted"
        ))),
        Some(other) => Err(wrong(what, "qp_type", "the string \"rc\"", other)),
    }
}

fn uint_of(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

fn req_uint(
    m: &Map<String, Value>,
    what: &str,
    field: &str,
    min: u64,
    max: u64,
) -> Result<u64, TransportError> {
    match opt_uint(m, what, field, min, max)? {
        Some(x) => Ok(x),
        None => Err(missing(what, field)),
    }
}

fn opt_uint(
    m: &Map<String, Value>,
    what: &str,
    field: &str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, TransportError> {
    let Some(v) = m.get(field) else {
        return Ok(None);
    };
    let expected = if max == u64::MAX {
        format!("an integer of at least {min}")
    } else {
        format!("an integer from {min} to {max}")
    };
    match uint_of(v) {
        Some(x) if x >= min && x <= max => Ok(Some(x)),
        _ => Err(wrong(what, field, &expected, v)),
    }
}

fn parse_gid(v: &Value, what: &str) -> Result<[u8; 16], TransportError> {
    match v {
        Value::String(s) => s
            .parse::<Ipv6Addr>()
            .map(|a| a.octets())
            .map_err(|_| wrong(what, "gid", "a GID in IPv6 notation", v)),
        other => wrong_gid(what, other),
    }
}

fn wrong_gid(what: &str, got: &Value) -> Result<[u8; 16], TransportError> {
    Err(wrong(what, "gid", "a GID in IPv6 notation (a string)", got))
}
