//! The worker data path: staging slots, the pool router, transfer isolation (and, as
//! the worker issue lands, the storage clients and the handler behind the C ABI).

pub mod router;
pub mod staging;
pub mod transfer;

pub use router::{parse_server_urls, PoolRouter};
pub use staging::{Slot, SlotPool, StagingLayout, StagingSlots};
pub use transfer::{execute, Isolation, PeerBatch, PeerOutcome};
