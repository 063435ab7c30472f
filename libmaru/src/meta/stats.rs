//! Counters and usage, per session and in total. The default tenant (maru-server's
//! own key: the operator's tools) sees every session; another tenant sees only its
//! own sessions, and the totals.

use super::core::{Caller, MetaCore};
use super::errors::refused;
use super::sessions::Session;
use super::tenants::DEFAULT_TENANT;
use crate::wire::meta::{
    MetaReply, SessionStats, SessionUsage, StatsReply, TotalStats, UsageReply,
};
use crate::wire::WireError;

impl MetaCore {
    fn session_stats(&self, s: &Session) -> SessionStats {
        let mut st = SessionStats {
            session: s.id,
            engine_id: s.engine_id.clone(),
            tenant: s.tenant.clone(),
            backend: Some(s.backend),
            hits: s.hits,
            misses: s.misses,
            leases: self.leases.held_by(s.id) as u64,
            pins: self.pins.held_by(s.id) as u64,
            skipped: self.sessions.skipped(s.id),
            ..Default::default()
        };
        for &rid in &s.regions {
            st.regions += 1;
            st.region_bytes += self.regions.get(rid).map_or(0, |r| r.handle.length);
            st.keys += self.keys.region_keys(rid) as u64;
            st.key_bytes += self.keys.region_bytes(rid);
        }
        st
    }

    /// Whether `caller` sees session `s` in stats and usage.
    fn shows(caller: &Caller<'_>, s: &Session) -> bool {
        caller.tenant == DEFAULT_TENANT || s.tenant == caller.tenant
    }

    /// Stats of one session or of all the caller sees, with the totals.
    pub(super) fn stats(
        &self,
        caller: &Caller<'_>,
        session: Option<u64>,
    ) -> Result<MetaReply, WireError> {
        let sessions = match session {
            Some(id) => match self.sessions.get(id).filter(|s| Self::shows(caller, s)) {
                Some(s) => vec![self.session_stats(s)],
                None => return Err(refused(format!("unknown session {id}"))),
            },
            None => self
                .sessions
                .iter()
                .filter(|s| Self::shows(caller, s))
                .map(|s| self.session_stats(s))
                .collect(),
        };
        Ok(MetaReply::Stats(StatsReply {
            total: self.total_stats(),
            sessions,
        }))
    }

    pub fn total_stats(&self) -> TotalStats {
        let mut t = TotalStats {
            sessions: self.sessions.len() as u64,
            keys: self.keys.len() as u64,
            regions: self.regions.len() as u64,
            hits: self.totals.hits,
            misses: self.totals.misses,
            removed: self.totals.removed,
            chains_cut: self.totals.chains_cut,
            fair_share_returns: self.fair.returned,
            waiting_for_region: self.fair.waiting() as u64,
            waiting_for_rm: self.waits.len() as u64,
            leases: self.leases.len() as u64,
            pinned_keys: self.pins.keys() as u64,
            kept_regions: self.keeper.kept_len() as u64,
            giving_back: self.keeper.giving_back_len() as u64,
            ..Default::default()
        };
        for r in self.regions.iter() {
            t.region_bytes += r.handle.length;
            t.key_bytes += self.keys.region_bytes(r.handle.region_id);
        }
        for s in self.sessions.iter() {
            t.skipped.add(&self.sessions.skipped(s.id));
        }
        let (doubt, freed) = self.pages_in_doubt();
        t.pages_in_doubt = doubt as u64;
        t.pages_in_doubt_freed = freed;
        t.kept_keys = self
            .keeper
            .kept_ids()
            .map(|id| self.keys.region_keys(id) as u64)
            .sum();
        t
    }

    pub(super) fn usage(&self, caller: &Caller<'_>) -> UsageReply {
        let page_size = self.cfg.chunk_size;
        let sessions = self
            .sessions
            .iter()
            .filter(|s| Self::shows(caller, s))
            .map(|s| {
                let regions = s.regions.iter().filter_map(|&rid| self.regions.get(rid));
                let (mut allocated, mut used) = (0, 0);
                for r in regions {
                    allocated += r.handle.length;
                    used += r.pages.used() * page_size;
                }
                SessionUsage {
                    session: s.id,
                    engine_id: s.engine_id.clone(),
                    client_id: s.client_id.clone(),
                    tenant: s.tenant.clone(),
                    backend: s.backend,
                    namespace: s.namespace.clone(),
                    regions: s.regions.len() as u64,
                    allocated,
                    used,
                    connected: s.connected,
                }
            })
            .collect();
        let bytes = |ids: &mut dyn Iterator<Item = u64>| -> u64 {
            ids.filter_map(|id| self.regions.get(id))
                .map(|r| r.handle.length)
                .sum()
        };
        UsageReply {
            sessions,
            kept_regions: self.keeper.kept_len() as u64,
            kept_bytes: bytes(&mut self.keeper.kept_ids()),
            giving_back: self.keeper.giving_back_len() as u64,
            giving_back_bytes: bytes(&mut self.keeper.giving_back_ids()),
        }
    }
}
