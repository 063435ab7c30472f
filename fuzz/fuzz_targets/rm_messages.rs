//! Resource manager messages: requests as the daemon decodes them, fed (one per
//! line) to a real `ResourceManager` core over an in-memory store, and replies as
//! clients decode them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::dax::{DeviceInfo, DeviceKind};
use maru::rm::{MemStore, ResourceManager};
use maru::wire::rm::{RmReply, RmRequest};
use maru::wire::{decode_json, Envelope, ReplyEnvelope};

const MB2: u64 = 2 << 20;

fuzz_target!(|data: &[u8]| {
    let _ = decode_json::<ReplyEnvelope<RmReply>>(data);
    let pools = vec![DeviceInfo {
        path: "/dev/dax0.0".into(),
        uuid: "00000000-0000-4000-8000-000000000001".into(),
        kind: DeviceKind::DevDax,
        device_size: MB2 * 9,
        align: MB2,
        data_offset: MB2,
    }];
    let Ok(mut rm) = ResourceManager::open(pools, Box::new(MemStore::new()), [3u8; 32], 0) else {
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
