//! maru-server messages: requests as the server decodes them, replies as workers
//! decode them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::wire::meta::{MetaReply, MetaRequest};
use maru::wire::{decode_json, Envelope, ReplyEnvelope};

fuzz_target!(|data: &[u8]| {
    if let Ok(env) = decode_json::<Envelope<MetaRequest>>(data) {
        let again: Envelope<MetaRequest> =
            decode_json(&maru::wire::encode_json(&env)).expect("round trip");
        assert_eq!(again, env);
    }
    let _ = decode_json::<ReplyEnvelope<MetaReply>>(data);
});
