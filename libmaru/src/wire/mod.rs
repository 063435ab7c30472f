//! The wire format shared by every Maru connection.
//!
//! A connection carries [frames](frame): `u32` length, `u8` kind, body. Control
//! messages are JSON bodies ([`Envelope`] for requests, [`ReplyEnvelope`] for
//! replies); the soft transport's data-plane operations use binary bodies. Every
//! connection starts with the [handshake](handshake) (version, identity, key proof).

pub mod agent;
pub mod frame;
pub mod handshake;
pub(crate) mod lease_wire;
pub mod meta;
mod meta_decode;
#[cfg(test)]
mod meta_tests;
pub mod rm;

pub use frame::{Frame, FrameDecoder, FrameError, FrameKind, DEFAULT_MAX_FRAME, HEADER_LEN};

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// Protocol version spoken by this build. A peer with another version is refused
/// in the handshake with an error naming both versions. 2: the agent maps a load's
/// ranges with one `map_reads` (`map_read` is gone), and an acquire reply names a
/// region's device with its first lease only; a worker, an agent or a maru-server of
/// version 1 cannot read these, so it is refused at connect rather than on each load.
pub const PROTOCOL_VERSION: u32 = 2;

/// A request: an id the reply echoes, and the operation with its fields flattened
/// (`{"id": 7, "op": "alloc", "size": 2097152}`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Envelope<T> {
    pub id: u64,
    #[serde(flatten)]
    pub body: T,
}

/// A reply: the request's id and either `ok` (the result) or `err`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReplyEnvelope<T> {
    pub id: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ok: Option<T>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub err: Option<WireError>,
}

/// The error every daemon sends back: a stable machine code and a message for
/// people (what failed, on which region/key/peer, what to do).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, thiserror::Error)]
#[error("{message} ({})", code.as_str())]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError {
            code,
            message: message.into(),
        }
    }
}

/// Stable error codes. `Refused` is the only code that means "definitively not
/// done, nothing is held": callers may act on it (drop a queued unhold, give a
/// region back). Every other code leaves the outcome to be retried or checked.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Definitive refusal: bad token, unknown region, draining region, bad name.
    Refused,
    /// The request could not be parsed or has invalid fields.
    BadRequest,
    /// The frame stream is broken (oversized, unknown kind, bad JSON in a handshake).
    Protocol,
    /// The peer speaks another protocol version.
    Version,
    /// Key proof missing or wrong.
    Auth,
    /// The caller is not allowed to do this (not the owner, wrong client id).
    Permission,
    /// No pool can satisfy the allocation.
    NoSpace,
    /// No such pool.
    NoPool,
    /// The change is in memory but could not be made durable; retry it.
    Storage,
    /// The operation is not known to this daemon.
    Unsupported,
    /// A bug or an unexpected condition inside the daemon.
    Internal,
    /// The session the request names is not open here (unknown, expired, closed, or
    /// another client's): nothing was done; the client opens a new session.
    NoSession,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Refused => "refused",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Protocol => "protocol",
            ErrorCode::Version => "version",
            ErrorCode::Auth => "auth",
            ErrorCode::Permission => "permission",
            ErrorCode::NoSpace => "no_space",
            ErrorCode::NoPool => "no_pool",
            ErrorCode::Storage => "storage",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Internal => "internal",
            ErrorCode::NoSession => "no_session",
        }
    }
}

/// Decodes a JSON body into `T`, with an error that says what was wrong.
pub fn decode_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    serde_json::from_slice(body)
        .map_err(|e| WireError::new(ErrorCode::BadRequest, format!("malformed message: {e}")))
}

/// Encodes a value as a JSON body. Serialising our own types cannot fail for the
/// types used here (no maps with non-string keys), but the error is kept typed.
pub fn encode_json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_else(|e| {
        // Only reachable with a type that serde_json cannot represent: a bug.
        format!("{{\"id\":0,\"err\":{{\"code\":\"internal\",\"message\":\"encode: {e}\"}}}}")
            .into_bytes()
    })
}

/// The id of a request whose body failed to decode, if it has one, so the error
/// reply can still be matched by the client.
pub fn request_id_of(body: &[u8]) -> u64 {
    #[derive(Deserialize)]
    struct IdOnly {
        id: u64,
    }
    serde_json::from_slice::<IdOnly>(body)
        .map(|x| x.id)
        .unwrap_or(0)
}

/// Encodes a reply frame for request `id`.
pub fn reply_frame<T: Serialize>(id: u64, result: Result<T, WireError>) -> Vec<u8> {
    let env = match result {
        Ok(v) => ReplyEnvelope {
            id,
            ok: Some(v),
            err: None,
        },
        Err(e) => ReplyEnvelope {
            id,
            ok: None,
            err: Some(e),
        },
    };
    // As serde_json::to_vec starts, with the header's room: one buffer, no copy.
    let mut out = Vec::with_capacity(128 + HEADER_LEN);
    if frame::encode_json_frame(FrameKind::Reply, &env, &mut out).is_err() {
        // Only reachable with a type that serde_json cannot represent (a bug): the
        // error encode_json stands in for it.
        return frame::encode(FrameKind::Reply, &encode_json(&env));
    }
    out
}

/// Encodes a protocol error frame (sent before closing a broken connection).
pub fn error_frame(err: &WireError) -> Vec<u8> {
    frame::encode(FrameKind::Error, &encode_json(err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reply_envelope_round_trip() {
        let f = reply_frame::<u32>(9, Err(WireError::new(ErrorCode::Refused, "no")));
        let mut d = FrameDecoder::new(1024);
        d.push(&f);
        let fr = d.next_frame().unwrap().unwrap();
        let env: ReplyEnvelope<u32> = decode_json(&fr.body).unwrap();
        assert_eq!(env.id, 9);
        assert_eq!(env.err.unwrap().code, ErrorCode::Refused);
    }

    proptest! {
        #[test]
        fn request_id_of_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = request_id_of(&data);
        }
    }
}
