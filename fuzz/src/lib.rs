//! What more than one fuzz target sets up the same way.

use maru::dax::{DeviceInfo, DeviceKind};

/// 2 MiB, the pools' alignment and region size.
pub const MB2: u64 = 2 << 20;

/// The one devdax pool the resource manager targets open: 9 × 2 MiB, data from 2 MiB.
pub fn one_pool() -> Vec<DeviceInfo> {
    vec![DeviceInfo {
        path: "/dev/dax0.0".into(),
        uuid: "00000000-0000-4000-8000-000000000001".into(),
        kind: DeviceKind::DevDax,
        device_size: MB2 * 9,
        align: MB2,
        data_offset: MB2,
    }]
}
