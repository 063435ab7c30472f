//! Unmap and release: taking keys away, in the order that keeps a late WRITE out
//! of a region's next owner.
//!
//! Deregister first; only once the NIC confirmed it does the range go to quarantine
//! (mapped, no access) and the hold to the RM. A release deregisters whoever else
//! holds the region, because the owner is about to give it back.

use super::core::{internal, refused, rm_error, AgentCore, Ports};
use super::ports::RmCallError;
use super::released::same_handle;
use crate::wire::agent::AgentReply;
use crate::wire::rm::Handle;
use crate::wire::WireError;

impl AgentCore {
    /// Drops `client`'s holds of the region (only its read handles when
    /// `reads_only`); the last holder's unmap retires it.
    pub(super) fn unmap(
        &mut self,
        client: &str,
        region_id: u64,
        reads_only: bool,
        now_ms: u64,
        p: &mut Ports<'_>,
    ) -> AgentReply {
        let Some(m) = self.mappings.get_mut(&region_id) else {
            return AgentReply::Unmapped { removed: false };
        };
        let removed = m.drop_holder(client, reads_only, p.nic);
        if m.unused() && !m.retiring {
            log::info!("region {region_id}: its last holder {client} left; retiring it");
            m.retiring = true;
        }
        if self.finish_retirement(region_id, now_ms, p.mem) {
            self.send_unhold(region_id, p.rm);
        }
        AgentReply::Unmapped { removed }
    }

    /// Deregisters the region whoever holds it and refuses later maps of `handle`.
    /// Succeeds only when no key of the region is left at the NIC: the owner gives
    /// the region back only after that.
    pub(super) fn release(
        &mut self,
        handle: &Handle,
        now_ms: u64,
        p: &mut Ports<'_>,
    ) -> Result<AgentReply, WireError> {
        let id = handle.region_id;
        let Some(m) = self.mappings.get_mut(&id) else {
            // Nothing registered here. A handle the RM accepts is refused from now on,
            // so a late map cannot register the range after the owner gave it back.
            // One the RM refuses (a forgery, a freed region) is not recorded: its maps
            // fail at the hold already, and recording it would let anyone with the
            // agent key grow the list (and the sweep's work) without bound.
            if self.released.contains(handle) {
                return Ok(AgentReply::Released {
                    deregistered: self.released.insert(handle, false),
                });
            }
            return match p.rm.get_access(handle) {
                Ok(_) => Ok(AgentReply::Released {
                    deregistered: self.released.insert(handle, false),
                }),
                Err(RmCallError::Refused(m)) => Err(refused(format!(
                    "region {id} is not mapped here and the resource manager does not accept \
                     its handle ({}): nothing to release",
                    crate::net::clip(&m)
                ))),
                Err(e) => Err(rm_error(id, "release check", e)),
            };
        };
        if !same_handle(&m.handle, handle) {
            return Err(refused(format!(
                "the handle does not match region {id} as this agent maps it; a release \
                 needs the region's own handle"
            )));
        }
        if !m.released {
            log::info!("region {id} released: deregistering it whoever holds it");
        }
        m.released = true;
        m.retiring = true;
        m.deregister_all(p.nic);
        // A repeated release is a natural time to retry a failed deregistration.
        m.retry_stuck(p.nic);
        self.released.insert(handle, true);
        if let Some(e) = m.stuck_error() {
            return Err(internal(format!(
                "deregistration of region {id} failed: {e}; the agent retries it in its sweep \
                 and keeps the region held: do not give the region back until a release \
                 succeeds"
            )));
        }
        if self.finish_retirement(id, now_ms, p.mem) {
            // A failed unhold stays queued; the release is done all the same, since
            // the RM keeps the range until the unhold arrives.
            self.send_unhold(id, p.rm);
        }
        Ok(AgentReply::Released { deregistered: true })
    }
}

#[cfg(test)]
#[path = "teardown_tests.rs"]
mod tests;
