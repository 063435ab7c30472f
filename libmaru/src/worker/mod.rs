//! The worker data path. A store reads top-down:
//!
//! - `handler`: [`Handler`], the calls an engine makes; which pool a request goes
//!   to, the staging buffer and transport (`data_path`), the background thread;
//! - [`pool`]: one maru-server's [`pool::StoragePool`]: pages, publish after WRITE,
//!   leases (`store`, `load`), its storage [`session`], heartbeats and ticks;
//! - [`movers`]: what moves the bytes: `remote` (agents, posting windows, transfer
//!   isolation) or `cxl` (copies through this host's mapping);
//! - the transport (`crate::transport`).
//!
//! Beside them: `lifecycle`, the sans-I/O core of the own regions' lifecycle (boot
//! ids, restarts, silent agents), which the pool core (`pool::core`) holds for
//! `remote_cxl`; `staging`, `slots`, `views`, `router`, `ops`, `op_stats` (per-call
//! figures), `hook`, `prefault`, `skips` (why stores were skipped). `clock` is the one place that reads the time.

pub mod agents;
pub mod clock;
pub mod config;
pub(crate) mod error;
pub(crate) mod handler;
pub(crate) mod hook;
pub(crate) mod lifecycle;
pub mod movers;
pub(crate) mod op_stats;
pub(crate) mod ops;
pub mod pool;
pub(crate) mod prefault;
pub(crate) mod router;
pub mod skips;
pub(crate) mod slots;
pub(crate) mod staging;
pub(crate) mod views;
pub(crate) mod warn_limit;

pub use pool::session;

pub use config::{BackendKind, HandlerConfig, TransportKind};
pub use error::{Peer, WorkerError};
pub use handler::{Handler, InPlaceInfo, Loaded, RegionInfo, MAX_QUEUED_RELEASES};
pub use hook::{set_memory_hook, MemoryHook};
pub use ops::{OpHandle, OpOutput};
pub use router::{parse_server_urls, PoolRouter};
pub use slots::SlotInfo;
pub use staging::{Slot, SlotPool, StagingLayout, StagingSlots};
pub use views::ViewInfo;
