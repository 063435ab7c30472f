//! The resource manager's state file: any bytes decode or give a parse error, and a
//! decoded state (overlapping, out-of-pool, duplicate regions, stray holds) opens a
//! resource manager or is refused, never a panic; the opened core then serves.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::rm::{parse_state, MemStore, ResourceManager};
use maru::wire::rm::RmRequest;
use maru_fuzz::{one_pool, MB2};
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(state) = parse_state(Path::new("state.json"), data) else {
        return;
    };
    let store = MemStore::with_state(state);
    let Ok(mut rm) = ResourceManager::open(one_pool(), Box::new(store), [5u8; 32], 0) else {
        return;
    };
    for req in [
        RmRequest::Pools,
        RmRequest::Regions { owner: None },
        RmRequest::Holds { node: None },
        RmRequest::Alloc {
            size: MB2,
            pool: None,
            request_id: 0,
        },
        RmRequest::ResetHolds {
            node: "mem0".into(),
            epoch: u64::MAX,
        },
    ] {
        let _ = rm.handle("maru-server", req, 1);
    }
    let _ = rm.tick(1 << 40);
});
