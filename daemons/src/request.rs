//! One request as every daemon serves it: the envelope decoded (a malformed one
//! answered and counted here), the result logged when it failed, counted in the
//! metrics and framed as the reply. Each service keeps only its table of handlers.

use crate::metrics::{op_of, result_of, Metrics};
use maru::wire::{self, Envelope, WireError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Instant;

/// What the reply to a request needs of it: its id, its operation (a metrics label)
/// and when it came. Kept by a service whose answer comes later.
#[derive(Debug, Clone)]
pub struct Received {
    pub id: u64,
    /// The operation, read only when metrics count it (empty otherwise).
    pub op: String,
    pub started: Instant,
}

/// Decodes request `body` from `client_id`: its header and body, or (`Err`) the reply
/// frame of a malformed request, logged and counted as `malformed`.
pub fn decode<T: DeserializeOwned>(
    body: &[u8],
    client_id: &str,
    metrics: Option<&Metrics>,
) -> Result<(Received, T), Vec<u8>> {
    decode_with(body, client_id, metrics, wire::decode_json::<Envelope<T>>)
}

/// As [`decode`], the envelope read by `read` (maru-server's one-pass decoder of its
/// hot requests: `wire::meta::decode_request`, whose requests borrow `body`).
pub fn decode_with<'b, T>(
    body: &'b [u8],
    client_id: &str,
    metrics: Option<&Metrics>,
    read: impl FnOnce(&'b [u8]) -> Result<Envelope<T>, WireError>,
) -> Result<(Received, T), Vec<u8>> {
    let started = Instant::now();
    match read(body) {
        Ok(env) => {
            let op = if metrics.is_some() {
                op_of(body)
            } else {
                String::new()
            };
            Ok((
                Received {
                    id: env.id,
                    op,
                    started,
                },
                env.body,
            ))
        }
        Err(e) => {
            log::info!(
                "bad request from {}: {}",
                maru::net::clip(client_id),
                maru::net::clip(&e.message)
            );
            if let Some(m) = metrics {
                m.request(
                    "malformed",
                    e.code.as_str(),
                    started.elapsed().as_secs_f64(),
                );
            }
            Err(wire::reply_frame::<()>(wire::request_id_of(body), Err(e)))
        }
    }
}

impl Received {
    /// The reply frame of `result`: a failure logged at `level` naming `who` asked, the
    /// request counted in `metrics`.
    pub fn reply<R: Serialize>(
        &self,
        result: Result<R, WireError>,
        who: &str,
        level: log::Level,
        metrics: Option<&Metrics>,
    ) -> Vec<u8> {
        if let Err(e) = &result {
            log::log!(
                level,
                "request {} from {}: {}",
                self.id,
                maru::net::clip(who),
                maru::net::clip(&e.to_string())
            );
        }
        if let Some(m) = metrics {
            m.request(
                &self.op,
                result_of(&result),
                self.started.elapsed().as_secs_f64(),
            );
        }
        wire::reply_frame(self.id, result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru::wire::ErrorCode;

    #[derive(Debug, serde::Deserialize)]
    #[serde(tag = "op", rename_all = "snake_case")]
    enum Req {
        Ping,
    }

    #[test]
    fn a_malformed_request_is_answered_with_its_id_and_counted() {
        let m = Metrics::new("rm", &[]);
        let frame = decode::<Req>(br#"{"id": 9, "op": "nope"}"#, "c", Some(&m)).unwrap_err();
        let reply: serde_json::Value =
            serde_json::from_slice(&frame[maru::wire::frame::HEADER_LEN..]).unwrap();
        assert_eq!(reply["id"], 9);
        assert!(m.render(0.0).contains(r#"op="malformed""#));
    }

    #[test]
    fn a_request_is_counted_under_its_op_and_result() {
        let m = Metrics::new("rm", &[]);
        let (r, Req::Ping) = decode::<Req>(br#"{"id": 3, "op": "ping"}"#, "c", Some(&m)).unwrap();
        let frame = r.reply::<()>(
            Err(WireError::new(ErrorCode::NoPool, "gone")),
            "c",
            log::Level::Debug,
            Some(&m),
        );
        let reply: serde_json::Value =
            serde_json::from_slice(&frame[maru::wire::frame::HEADER_LEN..]).unwrap();
        assert_eq!(reply["id"], 3);
        let text = m.render(0.0);
        assert!(text.contains(r#"op="ping""#), "{text}");
        assert!(text.contains(r#"result="no_pool""#), "{text}");
    }
}
