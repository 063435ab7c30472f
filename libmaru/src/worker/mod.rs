//! The worker data path: the handler an engine opens ([`Handler`]), its pools (a
//! storage session and a mover each), staging slots with separate load and store
//! pools, the pool router, and transfer isolation.

pub mod agents;
pub(crate) mod clock;
pub mod config;
pub mod error;
pub mod handler;
pub mod hook;
pub(crate) mod lifecycle;
pub mod movers;
pub mod ops;
pub mod pool;
pub mod prefault;
pub mod router;
pub mod session;
pub mod slots;
pub mod staging;
pub mod transfer;
pub mod views;
pub mod windows;

pub use config::{BackendKind, HandlerConfig, TransportKind};
pub use error::WorkerError;
pub use handler::{Handler, Loaded};
pub use hook::{set_memory_hook, MemoryHook};
pub use ops::{OpHandle, OpOutput};
pub use router::{parse_server_urls, PoolRouter};
pub use slots::SlotInfo;
pub use staging::{Slot, SlotPool, StagingLayout, StagingSlots};
pub use transfer::{execute, Isolation, PeerBatch, PeerOutcome};
pub use views::ViewInfo;
