//! What the metadata core asks of the world: the resource manager (regions) and the
//! pool's agents (the region keeper's mappings and releases). The daemon implements
//! these over its RM and agent connections; tests implement them with fakes that
//! record calls and fail on demand.
//!
//! Every call is synchronous and returns its outcome; the daemon answers from what
//! its links already know where a peer is slow. Allocating a region is not a port
//! call: it is an [action](super::Action) of the core, and the RM's answer comes back
//! as an event ([`MetaCore::alloc_done`](super::MetaCore::alloc_done)), so a request
//! waiting for a region never holds the daemon. So is the regular check of which
//! regions the RM holds for the server (its list is long:
//! [`MetaCore::rm_regions`](super::MetaCore::rm_regions)). The core never blocks on
//! anything and never looks at a clock.

use crate::wire::rm::Handle;
use crate::wire::{ErrorCode, WireError};

/// How a call to the RM or an agent failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    /// The peer answered with a definitive refusal: the call did nothing and holds
    /// nothing (a bad or unknown handle; for `alloc`, no space or no pool). The only
    /// failure the core acts on as final.
    #[error("refused: {0}")]
    Refused(String),
    /// No answer: the peer could not be reached, the connection broke or timed out,
    /// or an agent's hello carried no boot id. The call may or may not have taken
    /// effect.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// The peer answered with an error that is not a refusal (storage, internal):
    /// the outcome is open, retry later.
    #[error("failed: {0}")]
    Failed(String),
}

impl PortError {
    pub fn is_refused(&self) -> bool {
        matches!(self, PortError::Refused(_))
    }

    pub fn message(&self) -> &str {
        match self {
            PortError::Refused(m) | PortError::Unreachable(m) | PortError::Failed(m) => m,
        }
    }
}

/// An answer with code `refused` is a refusal, and so are `no_space` and `no_pool`
/// (the RM allocated nothing); every other error code leaves the outcome open.
/// Connection failures are the caller's to map to [`PortError::Unreachable`].
impl From<WireError> for PortError {
    fn from(e: WireError) -> PortError {
        match e.code {
            ErrorCode::Refused | ErrorCode::NoSpace | ErrorCode::NoPool => {
                PortError::Refused(e.message)
            }
            _ => PortError::Failed(e.to_string()),
        }
    }
}

/// The sizes of the RM's pools, in bytes usable for regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSizes {
    /// The largest pool: no region larger than it can ever be allocated.
    pub largest: u64,
    /// All pools together: what the tenants storing in them share.
    pub total: u64,
}

/// The resource manager, as maru-server (the owner of every region it hands out)
/// uses it. Allocations are the core's [actions](super::Action).
pub trait RmPort {
    /// FREE a region. `Refused` when the RM does not know the handle (already freed):
    /// nothing is left to free. A held region drains at the RM until its last UNHOLD.
    fn free(&mut self, h: &Handle) -> Result<(), PortError>;
    /// Bytes usable for regions in the RM's pools.
    fn pool_sizes(&mut self) -> Result<PoolSizes, PortError>;
}

/// The pool's agents, each named `host:port` as configured.
pub trait AgentPort {
    /// Map the whole region at `agent` for the region keeper (read-only) and return
    /// the memory node's boot id. Mapping a region already mapped by the keeper is
    /// cheap and answers the same. A hello without boot id is `Unreachable`.
    fn map(&mut self, agent: &str, h: &Handle) -> Result<String, PortError>;
    /// Release the region at `agent`: deregister it whoever holds it and refuse later
    /// maps. `Ok` means no registration of the region is left at the agent's NIC;
    /// `Refused` means the agent did nothing for this handle.
    fn release(&mut self, agent: &str, h: &Handle) -> Result<(), PortError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_definitive_codes_are_refusals() {
        for code in [ErrorCode::Refused, ErrorCode::NoSpace, ErrorCode::NoPool] {
            let e: PortError = WireError::new(code, "no").into();
            assert!(e.is_refused(), "{code:?}");
            assert_eq!(e.message(), "no");
        }
        for code in [ErrorCode::Storage, ErrorCode::Internal, ErrorCode::Auth] {
            let e: PortError = WireError::new(code, "x").into();
            assert!(matches!(e, PortError::Failed(_)), "{code:?}");
        }
    }
}
