//! The resource manager's persisted state: everything a restart needs to keep
//! handing out the same answers (regions, their tokens' nonces, holds, draining).
//!
//! Connections, grace timers and the reply cache are not persisted: after a restart
//! every owner gets a fresh grace period to reconnect, and a retried request whose
//! reply was lost is answered from the state (a retried FREE finds the region
//! draining or gone).
//!
//! Pools are matched by UUID, not by path or index: a device may get another
//! `/dev/dax` name after a reboot, while its header keeps its UUID.

use serde::{Deserialize, Serialize};

/// Version of the state file format written by this build.
pub const STATE_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RmState {
    pub version: u32,
    /// The id the next region gets; ids are never reused.
    pub next_region_id: u64,
    pub regions: Vec<RegionRecord>,
    pub holds: Vec<HoldRecord>,
}

impl RmState {
    /// The state of a resource manager that never allocated anything.
    pub fn empty() -> RmState {
        RmState {
            version: STATE_VERSION,
            next_region_id: 1,
            regions: Vec::new(),
            holds: Vec::new(),
        }
    }
}

/// One allocated (or draining) region.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RegionRecord {
    pub region_id: u64,
    /// Client id of the owner, the only one who may free it.
    pub owner: String,
    /// UUID of the pool's device header.
    pub pool_uuid: String,
    /// Device offset.
    pub offset: u64,
    /// Aligned length.
    pub length: u64,
    /// Bytes the owner asked for.
    pub requested: u64,
    /// Random input of the region's token, so a token cannot be guessed from the
    /// region's id and range, and a reused range gets a new token.
    pub nonce: u64,
    /// Freed by its owner while held: its range waits for the last UNHOLD.
    pub draining: bool,
}

/// One hold: `node` (epoch `epoch`) has the region registered with its NIC.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct HoldRecord {
    pub region_id: u64,
    pub node: String,
    pub epoch: u64,
}
