//! The worker data path, top-down: `handler` ([`Handler`], the calls an engine
//! makes) → [`pool`] (one maru-server's [`pool::StoragePool`]: its core, the drivers
//! of stores and loads, its [`session`]) → [`movers`] (`remote` or `cxl`) → the
//! transport. Beside them: `lifecycle` (held by the pool core for `remote_cxl`),
//! `staging`, `slots`, `views`, `router`, `ops`, `op_stats`, `hook`, `prefault`,
//! `skips`, `condition`, `key`; `clock` is the one place that reads the time. See
//! `docs/worker.md`.

pub mod agents;
pub mod clock;
pub(crate) mod condition;
pub mod config;
pub(crate) mod error;
pub(crate) mod handler;
pub(crate) mod hook;
pub(crate) mod key;
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
pub use handler::{Handler, InPlaceInfo, Loaded, RegionInfo};
pub use hook::{set_memory_hook, MemoryHook};
pub use key::Key;
pub use op_stats::core_locks;
pub use ops::{OpHandle, OpOutput};
pub use pool::MAX_QUEUED_RELEASES;
pub use router::{parse_server_urls, PoolRouter};
pub use slots::SlotInfo;
pub use staging::{Slot, SlotPool, StagingLayout, StagingSlots};
pub use views::ViewInfo;
