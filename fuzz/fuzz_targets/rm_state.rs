//! The resource manager's state file: any bytes decode or give a parse error, and a
//! decoded state (overlapping, out-of-pool, duplicate regions, stray holds) opens a
//! resource manager or is refused, never a panic; the opened core then serves.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::dax::{DeviceInfo, DeviceKind};
use maru::rm::{parse_state, MemStore, ResourceManager};
use maru::wire::rm::RmRequest;
use std::path::Path;

const MB2: u64 = 2 << 20;

fuzz_target!(|data: &[u8]| {
    let Ok(state) = parse_state(Path::new("state.json"), data) else {
        return;
    };
    let pools = vec![DeviceInfo {
        path: "/dev/dax0.0".into(),
        uuid: "00000000-0000-4000-8000-000000000001".into(),
        kind: DeviceKind::DevDax,
        device_size: MB2 * 9,
        align: MB2,
        data_offset: MB2,
    }];
    let store = MemStore::with_state(state);
    let Ok(mut rm) = ResourceManager::open(pools, Box::new(store), [5u8; 32], 0) else {
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
