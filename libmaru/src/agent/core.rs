//! The agent as a state machine: requests, closed connections and time go in,
//! replies come out, and the world is reached only through the [ports](super::ports).
//!
//! The order of every step follows one rule: the RM may hand a range out again only
//! after no NIC accepts a key for it. So a region is held at the RM before it is
//! registered, unheld only after every key of it is deregistered, and a range whose
//! deregistration failed stays mapped and held until a retry succeeds.

use super::error::AgentError;
use super::mapping::RegionMapping;
use super::ports::{MemPort, NicPort, RmCallError, RmPort};
use super::quarantine::Quarantine;
use super::released::ReleasedHandles;
use super::unholds::UnholdQueue;
use crate::wire::agent::{AgentReply, AgentRequest, StatusReply};
use crate::wire::{ErrorCode, WireError};
use std::collections::BTreeMap;

/// How long a deregistered range stays mapped without access (600 s).
pub const DEFAULT_QUARANTINE_MS: u64 = 600_000;

/// The ports one call works with.
pub(super) struct Ports<'a> {
    pub rm: &'a mut dyn RmPort,
    pub mem: &'a mut dyn MemPort,
    pub nic: &'a mut dyn NicPort,
}

/// The remote CXL agent of one memory node (`node`, in process epoch `epoch`).
pub struct AgentCore {
    pub(super) node: String,
    pub(super) epoch: u64,
    pub(super) boot_id: String,
    pub(super) quarantine_ms: u64,
    /// Regions mapped here, live or retiring, by region id.
    pub(super) mappings: BTreeMap<u64, RegionMapping>,
    pub(super) unholds: UnholdQueue,
    pub(super) quarantine: Quarantine,
    pub(super) released: ReleasedHandles,
    /// The RESET_HOLDS of start has not reached the RM yet.
    pub(super) reset_pending: bool,
}

pub(super) fn refused(msg: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::Refused, msg)
}

/// A failure that is not a refusal: the caller may retry.
pub(super) fn internal(msg: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::Internal, msg)
}

/// The reply for an RM call that failed, from the request's point of view.
pub(super) fn rm_error(region_id: u64, what: &str, e: RmCallError) -> WireError {
    match e {
        RmCallError::Refused(m) => refused(format!(
            "the resource manager refused the {what} of region {region_id}: {m}"
        )),
        RmCallError::Failed(m) => internal(format!(
            "resource manager unreachable: {m} (during the {what} of region {region_id}); \
             retry later"
        )),
    }
}

impl AgentCore {
    /// An agent for `node` in epoch `epoch` (a new epoch every start, so RESET_HOLDS
    /// clears the holds of earlier processes). Without a boot id the agent refuses to
    /// start: workers rely on it to notice a reboot of this node.
    pub fn new(
        node: String,
        epoch: u64,
        boot_id: String,
        quarantine_ms: u64,
    ) -> Result<AgentCore, AgentError> {
        if boot_id.trim().is_empty() {
            return Err(AgentError::NoBootId);
        }
        if node.trim().is_empty() {
            return Err(AgentError::NoNodeName);
        }
        Ok(AgentCore {
            node,
            epoch,
            boot_id,
            quarantine_ms,
            mappings: BTreeMap::new(),
            unholds: UnholdQueue::default(),
            quarantine: Quarantine::default(),
            released: ReleasedHandles::default(),
            reset_pending: false,
        })
    }

    /// Tells the RM that this node's older epochs hold nothing any more: their
    /// registrations died with their process. If the RM cannot be reached the sweep
    /// tries again; maps go on meanwhile (holds of this epoch are unaffected).
    pub fn start(&mut self, rm: &mut dyn RmPort) {
        self.reset_pending = true;
        self.reset_holds(rm);
    }

    /// Sends the pending RESET_HOLDS. Returns false when the RM did not answer.
    pub(super) fn reset_holds(&mut self, rm: &mut dyn RmPort) -> bool {
        match rm.reset_holds(&self.node, self.epoch) {
            Ok(()) => {
                self.reset_pending = false;
                true
            }
            Err(RmCallError::Refused(m)) => {
                // Retrying cannot change a refusal (a bad node name): say so once.
                log::error!(
                    "the resource manager refused RESET_HOLDS of node {} epoch {}: {m}; holds \
                     of this node's earlier runs stay until `maru-rm-ctl drop-holds`",
                    self.node,
                    self.epoch
                );
                self.reset_pending = false;
                true
            }
            Err(RmCallError::Failed(m)) => {
                log::warn!(
                    "RESET_HOLDS of node {} epoch {} did not reach the resource manager: {m}; \
                     the sweep retries it",
                    self.node,
                    self.epoch
                );
                false
            }
        }
    }

    /// Carries out one request of client `client_id` (a connection that proved the
    /// agent key).
    pub fn handle(
        &mut self,
        client_id: &str,
        req: AgentRequest,
        now_ms: u64,
        rm: &mut dyn RmPort,
        mem: &mut dyn MemPort,
        nic: &mut dyn NicPort,
    ) -> Result<AgentReply, WireError> {
        let mut p = Ports { rm, mem, nic };
        match req {
            AgentRequest::Map { handle, writable } => self.map(client_id, handle, writable, &mut p),
            AgentRequest::MapReads { ranges } => self.map_reads(client_id, &ranges, p.nic),
            AgentRequest::Unmap { region_id } => {
                Ok(self.unmap(client_id, region_id, false, now_ms, &mut p))
            }
            AgentRequest::Release { handle } => self.release(&handle, now_ms, &mut p),
            AgentRequest::Status => Ok(AgentReply::Status(self.status())),
            // Transport bring-up touches no mapping; the daemon answers it from its NIC.
            AgentRequest::ConnectPeer { .. } => Err(WireError::new(
                ErrorCode::Unsupported,
                "connect_peer is answered by the agent's transport, not its core",
            )),
        }
    }

    /// A client's connection closed: its read handles go as its unmaps would. Its
    /// whole-region holds stay: a writer that crashed leaves keys in its regions, which
    /// must stay readable until maru-server's keeper takes the regions over (at the
    /// session's expiry) and later releases them. They also go when the region is
    /// released, when the RM no longer knows the handle (sweep), or by an unmap.
    pub fn client_closed(
        &mut self,
        client_id: &str,
        now_ms: u64,
        rm: &mut dyn RmPort,
        mem: &mut dyn MemPort,
        nic: &mut dyn NicPort,
    ) {
        let mut p = Ports { rm, mem, nic };
        let held: Vec<u64> = self
            .mappings
            .iter()
            .filter(|(_, m)| m.holds(client_id))
            .map(|(&id, _)| id)
            .collect();
        for id in held {
            self.unmap(client_id, id, true, now_ms, &mut p);
        }
    }

    /// When the next quarantine ends. The daemon also sweeps on its periodic timer,
    /// which retries failed deregistrations and queued unholds.
    pub fn next_deadline(&self) -> Option<u64> {
        self.quarantine.next_end()
    }

    pub fn status(&self) -> StatusReply {
        StatusReply {
            node: self.node.clone(),
            epoch: self.epoch,
            boot_id: self.boot_id.clone(),
            mappings: self.mappings.values().map(RegionMapping::info).collect(),
            queued_unholds: self.unholds.len(),
            quarantined: self.quarantine.len(),
            holds_reset_pending: self.reset_pending,
        }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    /// Ends a retiring region whose keys are all deregistered: its range goes to
    /// quarantine and its unhold is queued (the caller sends it). Returns whether the
    /// region left the table.
    pub(super) fn finish_retirement(
        &mut self,
        region_id: u64,
        now_ms: u64,
        mem: &mut dyn MemPort,
    ) -> bool {
        if !self
            .mappings
            .get(&region_id)
            .is_some_and(|m| m.retiring && m.clean())
        {
            return false;
        }
        let Some(m) = self.mappings.remove(&region_id) else {
            return false;
        };
        let until = now_ms.saturating_add(self.quarantine_ms);
        self.quarantine.enter(region_id, m.range, until, mem);
        self.unholds.queue(region_id);
        true
    }

    /// Sends the queued unhold of a region, if one is queued. Returns false when the
    /// RM gave no definitive answer (the unhold stays queued).
    pub(super) fn send_unhold(&mut self, region_id: u64, rm: &mut dyn RmPort) -> bool {
        if !self.unholds.contains(region_id) {
            return true;
        }
        match rm.unhold(region_id, &self.node, self.epoch) {
            Ok(()) => {
                self.unholds.done(region_id);
                true
            }
            Err(RmCallError::Refused(m)) => {
                // A refusal means nothing is held: nothing left to undo.
                log::info!("region {region_id}: the resource manager refused its unhold ({m})");
                self.unholds.done(region_id);
                true
            }
            Err(RmCallError::Failed(m)) => {
                log::warn!(
                    "region {region_id}: unhold did not reach the resource manager: {m}; the \
                     sweep sends it again"
                );
                false
            }
        }
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
