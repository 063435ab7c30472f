//! Handshake messages. Every connection starts with them, before any request:
//!
//! 1. client → [`Hello`]: protocol name and version, client id, a fresh nonce, and
//!    (with a key) the key's id;
//! 2. server → [`Welcome`]: version, server's fresh nonce, whether a key is
//!    required, and (with a key) the server's proof over both nonces;
//! 3. client → [`Proof`] (only with a key): the client's proof over both nonces;
//! 4. server → [`AuthResult`].
//!
//! A peer that speaks another version gets an `Error` frame with code `version`,
//! then the connection is closed. The key proof itself is in [`crate::auth`].

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    /// Which service the client wants to talk to (`maru-rm`, `maru-agent`, `maru-server`).
    pub service: String,
    pub version: u32,
    /// Who the client is (`host:pid` or a name the operator gave). Owners of regions
    /// are identified by it; it is pinned on the connection.
    pub client_id: String,
    /// 32 random bytes, hex; fresh for every connection.
    pub nonce: String,
    /// A session secret a service handed this client earlier (maru-server's
    /// `open_session`): a reconnecting client proves with it that the session is its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<String>,
    /// The [id](crate::auth::SharedKey::id) of the key the client is about to prove
    /// (absent without a key). A server holding several keys proves this one back and
    /// checks the client's proof with it; naming a key proves nothing by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Welcome {
    pub service: String,
    pub version: u32,
    pub nonce: String,
    /// True when the server requires the client to prove the key.
    pub auth_required: bool,
    /// With a key: the server's proof (hex HMAC) over both nonces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<String>,
    /// Extra facts the service announces (for example an agent's boot id).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub info: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Proof {
    pub proof: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuthResult {
    pub ok: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::decode_json;
    use proptest::prelude::*;

    #[test]
    fn welcome_without_optional_fields() {
        let w: Welcome =
            decode_json(br#"{"service":"maru-rm","version":1,"nonce":"ab","auth_required":false}"#)
                .unwrap();
        assert!(w.proof.is_none());
        assert!(w.info.is_null());
    }

    proptest! {
        /// Every handshake decoder takes arbitrary bytes without panicking.
        #[test]
        fn handshake_decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_json::<Hello>(&data);
            let _ = decode_json::<Welcome>(&data);
            let _ = decode_json::<Proof>(&data);
            let _ = decode_json::<AuthResult>(&data);
        }

        #[test]
        fn hello_with_odd_fields(service in ".{0,16}", version in any::<i64>(), id in ".{0,300}") {
            let body = serde_json::json!({"service": service, "version": version,
                                          "client_id": id, "nonce": 5});
            let _ = decode_json::<Hello>(body.to_string().as_bytes());
        }
    }
}
