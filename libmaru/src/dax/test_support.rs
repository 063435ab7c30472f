//! Unique scratch files for the tests of this module, removed on drop.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A path no other test (or test process) uses; the file is removed on drop.
pub struct ScratchPath(pub PathBuf);

impl ScratchPath {
    /// Under `/dev/shm` (tmpfs, as fake pools are in use) where it exists.
    pub fn new(tag: &str) -> ScratchPath {
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        ScratchPath(dir.join(format!("maru-dax-test-{tag}-{}-{n}", std::process::id())))
    }

    pub fn as_str(&self) -> &str {
        self.0.to_str().expect("scratch paths are UTF-8")
    }
}

impl Drop for ScratchPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
