//! The remote CXL agent: the process on a memory node that maps regions from the
//! node's DAX device and registers them with its NIC, so that workers without CXL
//! reach them with one-sided READ and WRITE.
//!
//! [`AgentCore`] is the sans-I/O core. The daemon feeds it requests, closed
//! connections and the time, and lends it [ports](ports) to the RM, the memory and
//! the NIC. Rules it keeps:
//!
//! - hold at the RM before registering, unhold only after deregistering;
//! - only a refusal from the RM means nothing is held: any other failure keeps the
//!   unhold queued, and a queued unhold goes only after a new hold succeeds;
//! - a release deregisters whoever else holds the region and refuses later maps of
//!   its handle; a failed deregistration keeps the region held until a retry works;
//! - a deregistered range stays mapped without access for the quarantine (600 s), so
//!   the NIC cannot hand its key out again for a new region;
//! - a read handle maps only a region already mapped here, for READ only;
//! - the sweep retries deregistrations before it asks the RM anything;
//! - no boot id, no agent: every map reply carries it.

mod core;
mod error;
mod map;
mod mapping;
pub mod ports;
mod quarantine;
mod released;
mod sweep;
mod teardown;
mod unholds;

#[cfg(test)]
mod fakes;

pub use self::core::{AgentCore, DEFAULT_QUARANTINE_MS};
pub use error::AgentError;
pub use ports::{MappedRange, MemPort, NicPort, Registration, RmCallError, RmPort};
