//! The resource manager: pools of DAX memory, regions with tokens, GET_ACCESS,
//! holds of agents that registered a region with their NIC, and the durable state.
//!
//! [`ResourceManager`] is the sans-I/O core: the daemon feeds it requests,
//! connection events and the time, and gives it a [`StateStore`] ([`DirStore`] in
//! production). Rules it keeps:
//!
//! - a region freed while held is *draining*: its range is reused only after the last
//!   UNHOLD, and it cannot be held again;
//! - only a `Refused` error means nothing was done or held;
//! - every change is saved before its reply; a failed save keeps the change and
//!   answers `Storage`, and a retry saves again before it succeeds.

mod core;
mod error;
pub mod extents;
pub mod holds;
pub mod owners;
mod pool_file;
pub mod replies;
mod secret;
pub mod state;
mod store;

pub use self::core::{
    ResourceManager, ABSENT_POOL, DEFAULT_GRACE_MS, MAX_ALLOC_SIZE, MAX_NODE_NAME,
};
pub use error::RmError;
pub use extents::{ExtentAllocator, ExtentError};
pub use holds::HoldLedger;
pub use pool_file::check_pool_file;
pub use secret::{load_or_create_secret, SecretError, RM_KEY_FILE, SECRET_FILE, SECRET_LEN};
pub use state::{HoldRecord, RegionRecord, RmState, STATE_VERSION};
#[doc(hidden)]
pub use store::parse_state;
pub use store::{
    private_dir, DirStore, MemStore, PersistError, StateStore, Step, STATE_FILE, STATE_TMP_FILE,
};

/// A handle as an RM gives one, for the fake RMs of tests: region `id` of `length`
/// bytes at `id * length`, with a token of its own.
#[cfg(test)]
pub(crate) fn fake_handle(id: u64, length: u64) -> crate::wire::rm::Handle {
    crate::wire::rm::Handle {
        region_id: id,
        offset: id * length,
        length,
        token: format!("{:032x}", id * 7919),
    }
}
