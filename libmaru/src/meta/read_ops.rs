//! The read side: finding published keys and leasing them with read handles.

use super::core::{Keyed, MetaCore};
use super::errors::check_batch;
use super::keys::KeyId;
use crate::wire::lease_wire::Named;
use crate::wire::meta::{Backend, LeaseGrant, MetaReply};
use crate::wire::WireError;

impl MetaCore {
    /// Per key, whether a session of the same scope published it. Probes do not
    /// count as hits or reads.
    pub(super) fn exists(&mut self, req: Keyed<'_>) -> Result<MetaReply, WireError> {
        let found = req
            .keys
            .iter()
            .map(|k| self.keys.find(req.scope, k).is_some())
            .collect();
        Ok(MetaReply::Exists { found })
    }

    /// A lease per found key: its range, and where a reader reads it (`remote_cxl`:
    /// the agent and the read token of exactly that range; `cxl`: the region's device,
    /// with the region's first lease of the reply). The whole request is refused when
    /// its leases would pass the session's limit.
    pub(super) fn acquire(&mut self, req: Keyed<'_>) -> Result<MetaReply, WireError> {
        let found: Vec<Option<KeyId>> = req
            .keys
            .iter()
            .map(|k| self.keys.find(req.scope, k))
            .collect();
        let hits = found.iter().flatten().count();
        self.leases.check_room(req.id, hits)?;
        let expires_ms = req.now_ms.saturating_add(self.cfg.lease_timeout_ms);
        let mut leases = Vec::with_capacity(req.keys.len());
        // Each region's device goes with its first lease of the reply only.
        let mut named = Named::default();
        for k in found {
            let grant = k.and_then(|k| {
                let loc = self.keys.get(k)?.loc;
                let r = self.regions.get_mut_quiet(loc.region_id)?;
                r.last_read_ms = req.now_ms;
                let lease_id = self.leases.grant(req.id, k, loc.region_id, expires_ms);
                let cxl = r.backend == Backend::Cxl;
                // A read token is for the agent that maps a range for its reader
                // (`remote_cxl`), which refuses a lease without one. A cxl reader maps
                // the device itself: nothing checks a token there, and it would prove
                // nothing, so none is made.
                let read_token = if cxl {
                    String::new()
                } else {
                    self.leases
                        .read_token(loc.region_id, &r.handle.token, loc.offset, loc.length)
                };
                let device = (cxl && named.names(loc.region_id)).then(|| r.device_range());
                self.keys.touch(k);
                Some(LeaseGrant {
                    lease_id,
                    region_id: loc.region_id,
                    offset: loc.offset,
                    length: loc.length,
                    read_token,
                    agent: r.agent.clone(),
                    device,
                    expires_in_ms: self.cfg.lease_timeout_ms,
                    boot_id: r.boot_id.clone(),
                })
            });
            leases.push(grant);
        }
        let found_now = leases.iter().flatten().count() as u64;
        let missed = req.keys.len() as u64 - found_now;
        if let Some(s) = self.sessions.get_mut(req.id) {
            s.hits += found_now;
            s.misses += missed;
        }
        self.totals.hits += found_now;
        self.totals.misses += missed;
        Ok(MetaReply::Leases { leases })
    }

    pub(super) fn release_leases(
        &mut self,
        client_id: &str,
        session: u64,
        lease_ids: &[u64],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_batch("lease ids", lease_ids.len())?;
        let id = self.session(client_id, session, now_ms)?;
        let released = self.leases.release(id, lease_ids)?;
        Ok(MetaReply::LeasesReleased { released })
    }
}
