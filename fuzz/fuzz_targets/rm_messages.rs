//! Resource manager messages: requests as the daemon decodes them, fed (one per
//! line) to a real `ResourceManager` core over an in-memory store, and replies as
//! clients decode them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::rm::{MemStore, ResourceManager};
use maru::wire::rm::{RmReply, RmRequest};
use maru::wire::{decode_json, Envelope, ReplyEnvelope};
use maru_fuzz::one_pool;

fuzz_target!(|data: &[u8]| {
    let _ = decode_json::<ReplyEnvelope<RmReply>>(data);
    let Ok(mut rm) = ResourceManager::open(one_pool(), Box::new(MemStore::new()), [3u8; 32], 0)
    else {
        return;
    };
    for (now, line) in data.split(|&b| b == b'\n').take(32).enumerate() {
        if let Ok(env) = decode_json::<Envelope<RmRequest>>(line) {
            let client = if now % 3 == 0 {
                "agent-mem0"
            } else {
                "maru-server"
            };
            let _ = rm.handle(client, env.body, now as u64 * 1000);
        }
    }
    let _ = rm.tick(1 << 40);
});
