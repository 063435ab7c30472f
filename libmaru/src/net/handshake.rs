//! The server side of the handshake as a sans-I/O state machine, shared by the mio
//! loop and the blocking responders (soft transport): feed it frames, send what it
//! returns.

use super::text::clip;
use crate::auth::{fresh_nonce, Keyring, ServerProof, SharedKey};
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
        /// The key the hello named (its name in the keyring, and the key).
        key_name: String,
        key: SharedKey,
    },
    Done,
}

/// What to do after a frame.
#[derive(Debug)]
pub enum Step {
    /// Send these bytes and wait for the next frame.
    Send(Vec<u8>),
    /// Send these bytes; the client `client_id` is authenticated. `resume`: the
    /// session secret its hello carried, for the service to check. `key_name`: the
    /// keyring's name of the key the client proved (None when the server has no key),
    /// `key_id` that key's [id](crate::auth::SharedKey::id) (whether it is still in
    /// force is asked by name and id).
    Ready {
        send: Vec<u8>,
        client_id: String,
        resume: Option<String>,
        key_name: Option<String>,
        key_id: Option<String>,
    },
    /// Send this error frame and close.
    Fail(WireError),
}

pub struct ServerHandshake {
    service: &'static str,
    keys: Option<Keyring>,
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
    /// A handshake proving `key` (none: no proof either way).
    pub fn new(
        service: &'static str,
        key: Option<SharedKey>,
        info: serde_json::Value,
    ) -> ServerHandshake {
        ServerHandshake::with_keys(service, key.map(Keyring::single), info)
    }

    /// A handshake proving the key of `keys` that the client's hello names (see
    /// [`Keyring`]); `Step::Ready` tells which.
    pub fn with_keys(
        service: &'static str,
        keys: Option<Keyring>,
        info: serde_json::Value,
    ) -> ServerHandshake {
        ServerHandshake {
            service,
            keys,
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
                key_name,
                key,
            } => {
                let p: Proof = match decode_json(&f.body) {
                    Ok(p) => p,
                    Err(e) => {
                        return fail(
                            ErrorCode::Protocol,
                            format!("expected a proof: {}", clip(&e.message)),
                        )
                    }
                };
                if let Err(e) = proof.check_client(&key, &p.proof) {
                    return fail(ErrorCode::Auth, format!("client {}: {e}", clip(&client_id)));
                }
                Step::Ready {
                    send: handshake_frame(&AuthResult { ok: true }),
                    client_id,
                    resume,
                    key_name: Some(key_name),
                    key_id: Some(key.id()),
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
            auth_required: self.keys.is_some(),
            proof: None,
            info: self.info.clone(),
        };
        match &self.keys {
            None => Step::Ready {
                send: handshake_frame(&welcome),
                client_id: hello.client_id,
                resume: hello.resume,
                key_name: None,
                key_id: None,
            },
            Some(keys) => {
                let (key_name, key) = match keys.find(hello.key_id.as_deref()) {
                    Ok(k) => k,
                    Err(e) => {
                        return fail(
                            ErrorCode::Auth,
                            format!("client {}: {e}", clip(&hello.client_id)),
                        )
                    }
                };
                let proof = match ServerProof::new(&hello.nonce, &nonce) {
                    Ok(p) => p,
                    Err(e) => return fail(ErrorCode::Auth, e.to_string()),
                };
                welcome.proof = Some(proof.server_proof(&key));
                self.state = State::Proof {
                    proof,
                    client_id: hello.client_id,
                    resume: hello.resume,
                    key_name,
                    key,
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
    use serde_json::Value;

    fn hello(client_id: &str) -> Frame {
        Frame::new(
            FrameKind::Handshake,
            encode_json(&Hello {
                service: "maru-rm".into(),
                version: PROTOCOL_VERSION,
                client_id: client_id.into(),
                nonce: "00".repeat(32),
                resume: None,
                key_id: None,
            }),
        )
    }

    /// Runs a whole handshake against `hs` as a client holding `key` and naming the
    /// key `named` in its hello. The client answers with a proof made with its own key
    /// whatever the server proved (as an attacker would). Returns the key name the
    /// server settled on (or its error), and whether the server's proof checked out
    /// with the client's key.
    fn prove(
        hs: &mut ServerHandshake,
        key: &SharedKey,
        named: Option<String>,
    ) -> (Result<Option<String>, WireError>, bool) {
        use crate::auth::ClientProof;
        use crate::wire::handshake::{Proof, Welcome};
        let nonce = fresh_nonce().unwrap();
        let hello = Frame::new(
            FrameKind::Handshake,
            encode_json(&Hello {
                service: "maru-server".into(),
                version: PROTOCOL_VERSION,
                client_id: "w".into(),
                nonce: nonce.clone(),
                resume: None,
                key_id: named,
            }),
        );
        let welcome = match hs.on_frame(&hello) {
            Step::Send(b) => b,
            Step::Fail(e) => return (Err(e), false),
            s => panic!("{s:?}"),
        };
        let mut dec = crate::wire::FrameDecoder::new(1 << 16);
        dec.push(&welcome);
        let w: Welcome = decode_json(&dec.next_frame().unwrap().unwrap().body).unwrap();
        let client = ClientProof::new(&nonce).unwrap();
        let server_proved = client
            .answer(key, &w.nonce, w.proof.as_deref().unwrap_or(""))
            .is_ok();
        let own = ServerProof::new(&nonce, &w.nonce)
            .unwrap()
            .server_proof(key);
        let answer = client.answer(key, &w.nonce, &own).unwrap();
        let proof = Frame::new(FrameKind::Handshake, encode_json(&Proof { proof: answer }));
        let r = match hs.on_frame(&proof) {
            Step::Ready { key_name, .. } => Ok(key_name),
            Step::Fail(e) => Err(e),
            s => panic!("{s:?}"),
        };
        (r, server_proved)
    }

    fn tenants() -> (Keyring, SharedKey, SharedKey) {
        let (a, b) = (
            SharedKey::generate().unwrap(),
            SharedKey::generate().unwrap(),
        );
        let ring = Keyring::new(vec![
            ("alpha".into(), a.clone()),
            ("beta".into(), b.clone()),
        ])
        .unwrap();
        (ring, a, b)
    }

    #[test]
    fn a_keyring_names_the_key_the_client_proved() {
        let (ring, a, b) = tenants();
        for (key, name) in [(&b, "beta"), (&a, "alpha")] {
            let mut hs = ServerHandshake::with_keys("maru-server", Some(ring.clone()), Value::Null);
            let (r, server_proved) = prove(&mut hs, key, Some(key.id()));
            assert_eq!(r.unwrap().as_deref(), Some(name));
            assert!(server_proved, "the server proves the key the client named");
        }
    }

    #[test]
    fn naming_another_tenants_key_without_holding_it_fails_the_proof() {
        let (ring, a, b) = tenants();
        // Holds beta's key and names alpha's: the server proves alpha's key (which the
        // client cannot check) and refuses the client's proof made with beta's key.
        let mut hs = ServerHandshake::with_keys("maru-server", Some(ring.clone()), Value::Null);
        let (r, server_proved) = prove(&mut hs, &b, Some(a.id()));
        assert_eq!(r.unwrap_err().code, ErrorCode::Auth);
        assert!(!server_proved);
        // A key the server does not hold, or none named with several keys: refused
        // before any proof.
        let stranger = SharedKey::generate().unwrap();
        let mut hs = ServerHandshake::with_keys("maru-server", Some(ring.clone()), Value::Null);
        let e = prove(&mut hs, &stranger, Some(stranger.id()))
            .0
            .unwrap_err();
        assert!(e.message.contains("not one this server accepts"), "{e}");
        let mut hs = ServerHandshake::with_keys("maru-server", Some(ring), Value::Null);
        assert_eq!(
            prove(&mut hs, &a, None).0.unwrap_err().code,
            ErrorCode::Auth
        );
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
                key_id: None,
            }),
        );
        match hs.on_frame(&f) {
            Step::Fail(e) => assert!(e.message.len() < 400, "{}", e.message.len()),
            s => panic!("{s:?}"),
        }
    }
}
