//! The sweep: the agent's periodic housekeeping.
//!
//! Local work comes first and needs no RM: ending quarantines and retrying failed
//! deregistrations of every mapping, so keys die while the RM is away. Then the RM
//! work, which stops at the first call the RM does not answer (it is away; the next
//! sweep tries again): the pending RESET_HOLDS, the queued unholds, a check of each
//! live mapping's handle, and of each released handle.

use super::core::{AgentCore, Ports};
use super::ports::{MemPort, NicPort, RmCallError, RmPort};

impl AgentCore {
    /// Runs the sweep at `now_ms`. The daemon calls it every few seconds and at
    /// [`next_deadline`](Self::next_deadline).
    pub fn sweep(
        &mut self,
        now_ms: u64,
        rm: &mut dyn RmPort,
        mem: &mut dyn MemPort,
        nic: &mut dyn NicPort,
    ) {
        let mut p = Ports { rm, mem, nic };
        self.sweep_local(now_ms, &mut p);
        // Each step returns false when the RM did not answer.
        let _ = self.sweep_reset(&mut p)
            && self.sweep_unholds(&mut p)
            && self.sweep_live(now_ms, &mut p)
            && self.sweep_released(&mut p);
    }

    /// Quarantines, then failed deregistrations of every mapping, whether it is out
    /// of use (released, refused, holderless) or still serves other holders.
    fn sweep_local(&mut self, now_ms: u64, p: &mut Ports<'_>) {
        self.quarantine.expire(now_ms, p.mem);
        let ids: Vec<u64> = self.mappings.keys().copied().collect();
        for id in ids {
            if let Some(m) = self.mappings.get_mut(&id) {
                m.retry_stuck(p.nic);
            }
            // Done keys queue the region's unhold; it is sent with the others.
            self.finish_retirement(id, now_ms, p.mem);
        }
    }

    fn sweep_reset(&mut self, p: &mut Ports<'_>) -> bool {
        !self.reset_pending || self.reset_holds(p.rm)
    }

    fn sweep_unholds(&mut self, p: &mut Ports<'_>) -> bool {
        self.unholds
            .pending()
            .into_iter()
            .all(|id| self.send_unhold(id, p.rm))
    }

    /// Asks the RM about every live mapping. A refusal means the region is no
    /// longer valid there (freed, draining, unknown): its keys go, its range to
    /// quarantine, its hold back.
    fn sweep_live(&mut self, now_ms: u64, p: &mut Ports<'_>) -> bool {
        let live: Vec<_> = self
            .mappings
            .values()
            .filter(|m| !m.retiring)
            .map(|m| m.handle.clone())
            .collect();
        for handle in live {
            let id = handle.region_id;
            match p.rm.get_access(&handle) {
                Ok(_) => {}
                Err(RmCallError::Refused(msg)) => {
                    log::warn!(
                        "region {id}: the resource manager no longer accepts its handle \
                         ({msg}); deregistering it"
                    );
                    if let Some(m) = self.mappings.get_mut(&id) {
                        m.retiring = true;
                        m.deregister_all(p.nic);
                    }
                    if self.finish_retirement(id, now_ms, p.mem) && !self.send_unhold(id, p.rm) {
                        return false;
                    }
                }
                Err(RmCallError::Failed(msg)) => {
                    log::warn!(
                        "sweep: the resource manager is unreachable ({msg}); retrying later"
                    );
                    return false;
                }
            }
        }
        true
    }

    /// Forgets released handles the RM refuses for good: their maps fail at the
    /// hold already, and the list would otherwise grow for as long as the agent runs.
    fn sweep_released(&mut self, p: &mut Ports<'_>) -> bool {
        for handle in self.released.handles() {
            if self.mappings.contains_key(&handle.region_id) {
                continue; // still retiring here
            }
            match p.rm.get_access(&handle) {
                Ok(_) => {}
                Err(RmCallError::Refused(_)) => self.released.forget(&handle),
                Err(RmCallError::Failed(_)) => return false,
            }
        }
        true
    }
}

#[cfg(test)]
#[path = "sweep_tests.rs"]
mod tests;
