//! The handshake: its JSON messages, and the server's state machine fed arbitrary
//! frames (with and without a key). A client that never proves the key is never
//! reported ready by a server that requires it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::auth::SharedKey;
use maru::net::handshake::{ServerHandshake, Step};
use maru::wire::handshake::{AuthResult, Hello, Proof, Welcome};
use maru::wire::{decode_json, FrameDecoder, DEFAULT_MAX_FRAME};

fuzz_target!(|data: &[u8]| {
    let _ = decode_json::<Hello>(data);
    let _ = decode_json::<Welcome>(data);
    let _ = decode_json::<Proof>(data);
    let _ = decode_json::<AuthResult>(data);

    let Some((&ctl, rest)) = data.split_first() else {
        return;
    };
    let key = (ctl & 1 == 1).then(|| SharedKey::from_bytes(vec![7u8; 32]).expect("key"));
    let keyed = key.is_some();
    let mut hs = ServerHandshake::new("maru-agent", key, serde_json::Value::Null);
    let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
    dec.push(rest);
    while let Ok(Some(f)) = dec.next_frame() {
        match hs.on_frame(&f) {
            Step::Send(_) => {}
            Step::Ready { .. } => {
                // With a key, readiness needs an HMAC over our fresh nonce, which
                // random input cannot produce.
                assert!(!keyed, "a keyed handshake completed without the key");
                break;
            }
            Step::Fail(_) => break,
        }
    }
});
