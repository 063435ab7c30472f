//! DAX pools: devdax devices (`/dev/daxX.Y`) and file-backed "fake DAX" pools.
//!
//! A pool is one device of CXL memory (or a file standing in for it). Its first
//! alignment unit holds a [`DeviceHeader`] with the pool's UUID; regions are
//! carved from the rest by the resource manager and mapped with [`map_range`].
//!
//! - [`spec`]: the `--dax` / `--fake-dax` flags, parsed without touching devices.
//! - [`header`]: the 32-byte device header (sans-I/O encode/decode).
//! - [`device`]: opening a pool, creating its header, finding a device's UUID.
//! - [`map`]: shared mappings of aligned ranges, quarantine by `PROT_NONE`.
//! - [`copy`]: copies into shared memory with streaming (non-temporal) stores.

pub mod copy;
pub mod device;
mod error;
pub mod geometry;
pub mod header;
pub mod map;
pub mod spec;
#[cfg(test)]
pub(crate) mod test_support;

pub use device::{open_pool, scan_uuid};
pub use error::{DaxError, HeaderProblem};
pub use header::{DeviceHeader, HEADER_LEN, HEADER_VERSION, MAGIC};
pub use map::{map_range, Mapping};
pub use spec::{parse_dax, parse_fake_dax, parse_size, PoolSpec};

/// Alignment of fake DAX pools, and of devdax devices whose sysfs does not say:
/// 2 MiB, the huge-page size devdax uses by default.
pub const DEFAULT_ALIGN: u64 = 2 << 20;

/// Whether `n` is a multiple of `align`, a power of two. (Spelled out because
/// `u64::is_multiple_of` is newer than the workspace's minimum Rust, 1.80.)
pub(crate) fn is_aligned(n: u64, align: u64) -> bool {
    n & align.wrapping_sub(1) == 0
}

/// What kind of device backs a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    DevDax,
    File,
}

impl DeviceKind {
    /// The name used in messages and on the wire: `"devdax"` or `"file"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeviceKind::DevDax => "devdax",
            DeviceKind::File => "file",
        }
    }
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

impl DeviceInfo {
    /// Bytes available for regions: everything after the header unit.
    pub fn usable(&self) -> u64 {
        self.device_size.saturating_sub(self.data_offset)
    }
}

/// The kind of device at `path`: a character device is devdax, anything else a file.
pub fn kind_of_path(path: &str) -> DeviceKind {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_char_device() => DeviceKind::DevDax,
        _ => DeviceKind::File,
    }
}
