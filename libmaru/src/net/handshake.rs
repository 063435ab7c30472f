//! The server side of the handshake as a sans-I/O state machine, shared by the mio
//! loop and the blocking responders (soft transport): feed it frames, send what it
//! returns.

use super::text::clip;
use crate::auth::{fresh_nonce, ServerProof, SharedKey};
use crate::wire::handshake::{AuthResult, Hello, Proof, Welcome};
use crate::wire::{
    decode_json, encode_json, frame, ErrorCode, Frame, FrameKind, WireError, PROTOCOL_VERSION,
};

enum State {
    Hello,
    Proof {
        proof: ServerProof,
        client_id: String,
        resume: Option<String>,
    },
    Done,
}

/// What to do after a frame.
#[derive(Debug)]
pub enum Step {
    /// Send these bytes and wait for the next frame.
    Send(Vec<u8>),
    /// Send these bytes; the client `client_id` is authenticated. `resume`: the
    /// session secret its hello carried, for the service to check.
    Ready {
        send: Vec<u8>,
        client_id: String,
        resume: Option<String>,
    },
    /// Send this error frame and close.
    Fail(WireError),
}

pub struct ServerHandshake {
    service: &'static str,
    key: Option<SharedKey>,
    info: serde_json::Value,
    state: State,
}

fn handshake_frame<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    frame::encode(FrameKind::Handshake, &encode_json(msg))
}

fn fail(code: ErrorCode, message: String) -> Step {
    Step::Fail(WireError::new(code, message))
}

impl ServerHandshake {
    pub fn new(
        service: &'static str,
        key: Option<SharedKey>,
        info: serde_json::Value,
    ) -> ServerHandshake {
        ServerHandshake {
            service,
            key,
            info,
            state: State::Hello,
        }
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// The server sent its challenge and proof and waits for the client's proof. A
    /// client that closes now has seen the server's proof fail: its key differs.
    pub fn awaits_proof(&self) -> bool {
        matches!(self.state, State::Proof { .. })
    }

    pub fn on_frame(&mut self, f: &Frame) -> Step {
        if f.kind != FrameKind::Handshake {
            return fail(
                ErrorCode::Protocol,
                format!(
                    "expected a handshake frame, got {:?}: send hello first",
                    f.kind
                ),
            );
        }
        match std::mem::replace(&mut self.state, State::Done) {
            State::Hello => self.on_hello(&f.body),
            State::Proof {
                proof,
                client_id,
                resume,
            } => {
                let Some(key) = &self.key else {
                    return fail(ErrorCode::Internal, "proof state without a key".into());
                };
                let p: Proof = match decode_json(&f.body) {
                    Ok(p) => p,
                    Err(e) => {
                        return fail(
                            ErrorCode::Protocol,
                            format!("expected a proof: {}", clip(&e.message)),
                        )
                    }
                };
                if let Err(e) = proof.check_client(key, &p.proof) {
                    return fail(ErrorCode::Auth, format!("client {}: {e}", clip(&client_id)));
                }
                Step::Ready {
                    send: handshake_frame(&AuthResult { ok: true }),
                    client_id,
                    resume,
                }
            }
            State::Done => fail(ErrorCode::Protocol, "handshake already finished".into()),
        }
    }

    fn on_hello(&mut self, body: &[u8]) -> Step {
        let hello: Hello = match decode_json(body) {
            Ok(h) => h,
            Err(e) => {
                return fail(
                    ErrorCode::Protocol,
                    format!("malformed hello: {}", clip(&e.message)),
                )
            }
        };
        if hello.version != PROTOCOL_VERSION {
            return fail(
                ErrorCode::Version,
                format!(
                    "protocol version {} is not supported: this {} speaks version {PROTOCOL_VERSION}; upgrade the older side",
                    hello.version, self.service
                ),
            );
        }
        if hello.service != self.service {
            return fail(
                ErrorCode::Protocol,
                format!(
                    "this port serves {}, not {}: check the address",
                    self.service,
                    clip(&hello.service)
                ),
            );
        }
        if hello.client_id.is_empty() || hello.client_id.len() > 255 {
            return fail(
                ErrorCode::Protocol,
                "client id must be 1 to 255 bytes".into(),
            );
        }
        // Client ids reach log lines and owner records: no control characters, so no
        // peer can forge a line or hide text in them.
        if hello.client_id.chars().any(char::is_control) {
            return fail(
                ErrorCode::Protocol,
                "client id must not contain control characters".into(),
            );
        }
        let nonce = match fresh_nonce() {
            Ok(n) => n,
            Err(e) => return fail(ErrorCode::Internal, format!("cannot draw a nonce: {e}")),
        };
        let mut welcome = Welcome {
            service: self.service.to_string(),
            version: PROTOCOL_VERSION,
            nonce: nonce.clone(),
            auth_required: self.key.is_some(),
            proof: None,
            info: self.info.clone(),
        };
        match &self.key {
            None => Step::Ready {
                send: handshake_frame(&welcome),
                client_id: hello.client_id,
                resume: hello.resume,
            },
            Some(key) => {
                let proof = match ServerProof::new(&hello.nonce, &nonce) {
                    Ok(p) => p,
                    Err(e) => return fail(ErrorCode::Auth, e.to_string()),
                };
                welcome.proof = Some(proof.server_proof(key));
                self.state = State::Proof {
                    proof,
                    client_id: hello.client_id,
                    resume: hello.resume,
                };
                Step::Send(handshake_frame(&welcome))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::handshake::Hello;

    fn hello(client_id: &str) -> Frame {
        Frame::new(
            FrameKind::Handshake,
            encode_json(&Hello {
                service: "maru-rm".into(),
                version: PROTOCOL_VERSION,
                client_id: client_id.into(),
                nonce: "00".repeat(32),
                resume: None,
            }),
        )
    }

    #[test]
    fn client_ids_with_control_characters_are_refused() {
        let mut hs = ServerHandshake::new("maru-rm", None, serde_json::Value::Null);
        assert!(matches!(
            hs.on_frame(&hello("a\nERROR forged")),
            Step::Fail(_)
        ));
        let mut hs = ServerHandshake::new("maru-rm", None, serde_json::Value::Null);
        assert!(matches!(hs.on_frame(&hello("host:42")), Step::Ready { .. }));
    }

    #[test]
    fn a_wrong_service_name_is_echoed_cut() {
        let mut hs = ServerHandshake::new("maru-rm", None, serde_json::Value::Null);
        let f = Frame::new(
            FrameKind::Handshake,
            encode_json(&Hello {
                service: "x".repeat(10_000),
                version: PROTOCOL_VERSION,
                client_id: "c".into(),
                nonce: "00".repeat(32),
                resume: None,
            }),
        );
        match hs.on_frame(&f) {
            Step::Fail(e) => assert!(e.message.len() < 400, "{}", e.message.len()),
            s => panic!("{s:?}"),
        }
    }
}
