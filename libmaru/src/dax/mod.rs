//! DAX pools: devdax devices (`/dev/daxX.Y`) and file-backed "fake DAX" pools.
//! (Being written; the `DeviceInfo` contract below is fixed.)

/// What kind of device backs a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    DevDax,
    File,
}

/// A pool's device as the RM sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub path: String,
    pub uuid: String,
    pub kind: DeviceKind,
    pub device_size: u64,
    pub align: u64,
    pub data_offset: u64,
}
