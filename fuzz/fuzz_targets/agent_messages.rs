//! Remote CXL agent messages: requests as the agent decodes them, replies as
//! workers decode them (the boot-id check included).
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::wire::agent::{AgentReply, AgentRequest};
use maru::wire::{decode_json, request_id_of, Envelope, ReplyEnvelope};

fuzz_target!(|data: &[u8]| {
    let _ = request_id_of(data);
    if let Ok(env) = decode_json::<Envelope<AgentRequest>>(data) {
        // What decodes re-encodes and decodes to the same request.
        let again: Envelope<AgentRequest> =
            decode_json(&maru::wire::encode_json(&env)).expect("round trip");
        assert_eq!(again, env);
    }
    let _ = decode_json::<ReplyEnvelope<AgentReply>>(data);
});
