//! maru-server messages: requests as the server decodes them, replies as workers
//! decode them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::wire::meta::{one_pass, MetaReply, MetaRequest};
use maru::wire::{decode_json, Envelope, ReplyEnvelope};

fuzz_target!(|data: &[u8]| {
    let buffered = decode_json::<Envelope<MetaRequest>>(data);
    // maru-server's one-pass decoder of the data path's requests accepts only what
    // the buffered one accepts, as the same request.
    if let Some(env) = one_pass(data) {
        let env = Envelope {
            id: env.id,
            body: env.body.into_owned(),
        };
        assert_eq!(buffered.as_ref().ok(), Some(&env));
    }
    if let Ok(env) = buffered {
        let again: Envelope<MetaRequest> =
            decode_json(&maru::wire::encode_json(&env)).expect("round trip");
        assert_eq!(again, env);
    }
    let _ = decode_json::<ReplyEnvelope<MetaReply>>(data);
});
