//! What the agent core asks of the world: the resource manager, the node's memory
//! and its NIC. The daemon implements these over a RM connection, DAX mappings and a
//! transport; tests implement them with fakes that record calls and fail on demand.
//!
//! Every call is synchronous and returns its outcome. The core never blocks on
//! anything else and never looks at a clock: time comes in as milliseconds.

use crate::wire::rm::{AccessReply, Handle};
use crate::wire::{ErrorCode, WireError};

/// How a call to the resource manager failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RmCallError {
    /// The RM answered with a refusal: the call did nothing and nothing is held
    /// because of it. The only failure the agent may act on as definitive.
    #[error("refused: {0}")]
    Refused(String),
    /// Anything else: no answer, a lost connection, a storage error. The call may or
    /// may not have taken effect at the RM.
    #[error("failed: {0}")]
    Failed(String),
}

impl RmCallError {
    pub fn is_refused(&self) -> bool {
        matches!(self, RmCallError::Refused(_))
    }

    pub fn message(&self) -> &str {
        match self {
            RmCallError::Refused(m) | RmCallError::Failed(m) => m,
        }
    }
}

/// Only an answer with code `refused` is a refusal; every other error code leaves
/// the outcome open.
impl From<WireError> for RmCallError {
    fn from(e: WireError) -> RmCallError {
        if e.code == ErrorCode::Refused {
            RmCallError::Refused(e.message)
        } else {
            RmCallError::Failed(e.to_string())
        }
    }
}

/// The resource manager, as this agent (`node`, `epoch`) uses it.
pub trait RmPort {
    /// HOLD: check the handle and record that `node` maps the region.
    fn hold(&mut self, h: &Handle, node: &str, epoch: u64) -> Result<(), RmCallError>;
    /// UNHOLD: drop `node`'s hold of the region (after its deregistration).
    fn unhold(&mut self, region_id: u64, node: &str, epoch: u64) -> Result<(), RmCallError>;
    /// GET_ACCESS: check the handle and tell where the region's bytes are.
    fn get_access(&mut self, h: &Handle) -> Result<AccessReply, RmCallError>;
    /// RESET_HOLDS: drop `node`'s holds of epochs before `epoch`.
    fn reset_holds(&mut self, node: &str, epoch: u64) -> Result<(), RmCallError>;
}

/// A mapped range of the node's memory. The daemon keeps the mapping itself (a
/// `dax::Mapping`) keyed by `id`; the core only passes the id back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappedRange {
    pub id: u64,
    /// Address of the first byte in the agent's address space.
    pub ptr: u64,
    pub len: u64,
}

/// The node's memory: map a region's range from its device, take all access away
/// from it, unmap it.
pub trait MemPort {
    /// Maps the range `access` describes (shared, writable).
    fn map(&mut self, access: &AccessReply) -> Result<MappedRange, String>;
    /// Keeps the range mapped but with no access (PROT_NONE), so its addresses stay
    /// taken and the NIC cannot register the same range again.
    fn protect_none(&mut self, id: u64) -> Result<(), String>;
    /// Unmaps the range; its addresses may be reused afterwards.
    fn unmap(&mut self, id: u64);
}

/// A registration of memory with the NIC: the transport's own.
pub use crate::transport::Registration;

/// The node's NIC.
pub trait NicPort {
    /// Registers `len` bytes at `ptr` for remote READ, and remote WRITE when
    /// `writable`, for `holder` only: the key works on the data path of the agent
    /// connection `holder` stands for (its protection domain, its soft NIC binding)
    /// and on no other, so a worker that learns another worker's key cannot use it.
    fn register(
        &mut self,
        holder: &str,
        ptr: u64,
        len: u64,
        writable: bool,
    ) -> Result<Registration, String>;
    /// Deregisters a key. Returns once no operation is in flight on it: after `Ok`
    /// the NIC fails every operation that presents the key.
    fn deregister(&mut self, rkey: u64) -> Result<(), String>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_refused_code_is_a_refusal() {
        let r: RmCallError = WireError::new(ErrorCode::Refused, "bad token").into();
        assert_eq!(r, RmCallError::Refused("bad token".into()));
        for code in [ErrorCode::Storage, ErrorCode::Internal, ErrorCode::NoPool] {
            let e: RmCallError = WireError::new(code, "x").into();
            assert!(!e.is_refused(), "{code:?} must not count as a refusal");
        }
    }
}
