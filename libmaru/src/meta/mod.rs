//! The metadata server (maru-server): storage sessions, their regions and pages,
//! the key directory, leases, eviction and the region keeper. It never touches KV
//! bytes.
//!
//! [`MetaCore`] is the sans-I/O core. The daemon feeds it requests
//! ([`MetaRequest`](crate::wire::meta::MetaRequest)), closed connections and the
//! time, and lends it [ports](ports) to the RM and the agents. Rules it keeps:
//!
//! - a key is found only after it was published, and a session publishes only into
//!   allocated pages of its own regions; the first publish of a key wins;
//! - keys are shared only within one namespace, KV layout and backend;
//! - a key proves a [tenant](tenants); a session opens only in a namespace its tenant
//!   writes or reads, and publishes, pins and removes only where it writes; each
//!   namespace has one writing tenant;
//! - limits count per tenant: sessions, regions (the fair share of a pool counts
//!   tenants), pins, requests waiting for a region; a region held without storing
//!   goes back;
//! - a region comes from the RM as an [action](Action) and its answer as an event:
//!   requests that need one wait, decoded and bounded, while others are served;
//! - a region larger than the RM's largest pool is refused for good;
//! - victims and remove act only on keys of the caller's own regions; leased and
//!   pinned keys are neither victims nor removed, and a region with pinned keys is
//!   not given back to make room at the RM;
//! - a returned region's keys stop being found at once and its leases end; the RM
//!   frees a `remote_cxl` region only after its agent released it;
//! - a session that stops sending requests expires; an ended session holds nothing
//!   and does not count toward the session limit;
//! - the regions of a worker that left go to the [region keeper](keeper): those with
//!   keys stay readable until their memory node reboots, their agent refuses them or
//!   stays silent for 30 s, or the RM needs room; the others go back;
//! - bad input (unknown session, another session's lease, batches over
//!   [`MAX_BATCH`](crate::wire::meta::MAX_BATCH)) gets a clear error and changes
//!   nothing.

mod alloc_ops;
mod config;
mod core;
mod durable;
mod errors;
mod evict_ops;
pub mod evict_rank;
pub mod fair_share;
mod fast_hash;
mod journal;
pub mod keeper;
pub mod keys;
mod last_run;
pub mod leases;
pub mod pages;
pub mod pins;
pub mod ports;
mod read_ops;
pub mod records;
pub mod regions;
mod restore;
mod seal1;
mod session_ops;
pub mod sessions;
mod stats;
mod store_ops;
pub mod tenants;
mod waits;

#[cfg(test)]
mod core_tests;
#[cfg(test)]
mod durable_tests;
#[cfg(test)]
mod evict_tests;
#[cfg(test)]
mod fakes;
#[cfg(test)]
mod keeper_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod scale_tests;
#[cfg(test)]
mod tenant_tests;

pub use self::config::{
    heartbeat_ms, new_instance, ConfigError, MetaConfig, VictimOrder, DEFAULT_KEEPER_SILENCE_MS,
};
pub use self::core::{Caller, MetaCore};
pub use self::durable::{LEASE_RUN_SHIFT, RESERVE_BLOCK, RESERVE_MAX_BLOCKS, SESSION_RUN_SHIFT};
pub use self::journal::{ReplyTiming, RATE_WINDOW_MS};
pub use self::restore::Recovered;
pub use self::seal1::{seal_format1, Sealed1};
pub use self::waits::{Action, Ticket};
pub use keeper::{GiveBackReason, KeeperEvent, RegionKeeper};
pub use pages::{PageAllocator, PageError};
pub use ports::{AgentPort, PoolSizes, PortError, RmPort};
pub use tenants::{Access, NsPattern, TenantLimits, TenantSpec, Tenants, DEFAULT_TENANT};
