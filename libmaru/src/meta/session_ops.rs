//! Sessions and their regions: open, expand, heartbeat, return, close; getting a
//! region from the RM, and making room there from the keeper's regions.

use super::core::MetaCore;
use super::errors::{bad_request, check_batch, internal, no_space, permission, refused};
use super::fair_share::{Ask, Holding};
use super::keeper::{GiveBackReason, KeeperEvent};
use super::keys::Scope;
use super::pages::PageAllocator;
use super::ports::{PortError, RmPort};
use super::regions::{agent_for, Holder, Region};
use super::sessions::EndReason;
use crate::wire::meta::{
    Backend, HeartbeatReply, MetaReply, RegionGrant, ReturnReply, SessionReply, LEASE_LIMIT,
    MAX_NAME_LEN,
};
use crate::wire::{ErrorCode, WireError};
use std::collections::BTreeMap;

fn check_name(what: &str, s: &str, required: bool) -> Result<(), WireError> {
    if (required && s.is_empty()) || s.len() > MAX_NAME_LEN || s.chars().any(char::is_control) {
        let shown: String = s.chars().take(64).collect();
        return Err(bad_request(format!(
            "bad {what} {shown:?}: it must be {} to {MAX_NAME_LEN} bytes without control \
             characters",
            u8::from(required)
        )));
    }
    Ok(())
}

impl MetaCore {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open_session(
        &mut self,
        client_id: &str,
        engine_id: &str,
        namespace: &str,
        layout: &str,
        backend: Backend,
        first_region: bool,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Result<MetaReply, WireError> {
        check_name("engine id", engine_id, true)?;
        check_name("namespace", namespace, false)?;
        check_name("layout digest", layout, false)?;
        self.check_backend_configured(backend)?;
        self.sessions.check_room()?;
        let region = if first_region {
            Some(self.alloc_region(backend, now_ms, rm)?)
        } else {
            None
        };
        let scope = self.keys.scope_id(Scope {
            namespace: namespace.to_string(),
            layout: layout.to_string(),
            backend,
        });
        let id = self
            .sessions
            .insert(client_id, engine_id, namespace, backend, scope, now_ms);
        let grant = region.map(|region| self.give_region(id, region));
        log::info!(
            "session {id} opened by {} (engine {}, namespace {}, {}) with {}",
            crate::net::clip(client_id),
            crate::net::clip(engine_id),
            crate::net::clip(namespace),
            backend.as_str(),
            grant
                .as_ref()
                .map_or("no region yet".to_string(), |g| format!(
                    "region {}",
                    g.handle.region_id
                ))
        );
        Ok(MetaReply::Session(SessionReply {
            session: id,
            page_size: self.cfg.chunk_size,
            region: grant,
            session_timeout_ms: self.cfg.session_timeout_ms,
            lease_timeout_ms: self.cfg.lease_timeout_ms,
            lease_limit: LEASE_LIMIT,
            session_secret: None,
        }))
    }

    pub(super) fn expand(
        &mut self,
        client_id: &str,
        session: u64,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Result<MetaReply, WireError> {
        let id = self.session(client_id, session, now_ms)?;
        let backend = match self.sessions.get(id) {
            Some(s) => s.backend,
            None => return Err(internal(format!("session {id} vanished"))),
        };
        let holdings = self.holdings();
        let held = self.sessions.get(id).map_or(0, |s| s.regions.len());
        let pool_regions = self.regions.len();
        if self.fair.must_yield(id, held, &holdings, pool_regions) {
            // It holds its share: it does not wait for more, it evicts.
            self.fair.done_waiting(id);
            return Err(no_space(format!(
                "session {id} holds its fair share of the full pool ({held} of {pool_regions} \
                 regions) while other engines wait for one: evict keys of its own regions"
            )));
        }
        let region = match self.alloc_region(backend, now_ms, rm) {
            Ok(r) => r,
            Err(mut e) if e.code == ErrorCode::NoSpace => {
                self.fair.want(id, now_ms);
                if !self.keeper.pressure_pending() {
                    if let Some(ask) = self.ask_fair_share(now_ms) {
                        e.message.push_str(&format!(
                            "; session {} holds the most regions above its fair share and is \
                             asked to give back region {}: retry shortly",
                            ask.session, ask.region_id
                        ));
                    }
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        self.fair.done_waiting(id);
        Ok(MetaReply::Region(self.give_region(id, region)))
    }

    /// Hands a new region to the session.
    fn give_region(&mut self, session: u64, mut region: Region) -> RegionGrant {
        let rid = region.handle.region_id;
        region.holder = Holder::Session(session);
        let grant = region.grant(self.cfg.chunk_size);
        self.regions.insert(region);
        if let Some(s) = self.sessions.get_mut(session) {
            s.regions.insert(rid);
        }
        grant
    }

    /// Asks the session furthest above its fair share of the pool for a region, if
    /// a storing session waits and none was asked lately (see `fair_share`).
    fn ask_fair_share(&mut self, now_ms: u64) -> Option<Ask> {
        let holdings = self.holdings();
        let timeout = self.cfg.session_timeout_ms;
        let ask = self
            .fair
            .decide(&holdings, self.regions.len(), now_ms, timeout, timeout)?;
        log::info!(
            "the pool is full and {} storing sessions wait for a region: session {} (most \
             regions above its fair share) is asked to give back region {}",
            self.fair.waiting(),
            ask.session,
            ask.region_id
        );
        Some(ask)
    }

    /// Every session's regions, when each was last read, and whether it may be given
    /// back (no pinned key).
    fn holdings(&self) -> Vec<Holding> {
        self.sessions
            .iter()
            .map(|s| Holding {
                session: s.id,
                regions: s
                    .regions
                    .iter()
                    .filter_map(|&rid| {
                        let r = self.regions.get(rid)?;
                        Some((rid, r.last_read_ms, !self.pins.region_has_pins(rid)))
                    })
                    .collect(),
            })
            .collect()
    }

    /// A new region from the RM, not yet in the table. A region larger than the
    /// RM's largest pool is refused for good; a refusal of the RM makes the keeper
    /// give back the kept region read longest ago (one at a time), and the caller
    /// may retry.
    fn alloc_region(
        &mut self,
        backend: Backend,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Result<Region, WireError> {
        let size = self.cfg.region_size;
        match rm.largest_pool() {
            Ok(largest) if size > largest => {
                return Err(refused(format!(
                    "a region of {size} bytes is larger than the RM's largest pool ({largest} \
                     bytes), so it can never be allocated: lower the region size \
                     (maru_pool_size) or give the RM a larger pool; do not retry"
                )));
            }
            Ok(_) => {}
            // The allocation itself will tell.
            Err(e) => log::debug!("could not ask the RM for its largest pool: {e}"),
        }
        let a = match rm.alloc(size) {
            Ok(a) => a,
            Err(PortError::Refused(m)) => {
                let room = self.make_room_at_rm(now_ms, rm);
                return Err(no_space(format!(
                    "the RM refused a region of {size} bytes ({m}); {room}"
                )));
            }
            Err(e) => {
                return Err(internal(format!(
                    "could not get a region of {size} bytes from the RM at {} ({e}): retry",
                    self.cfg.rm_address
                )))
            }
        };
        let rid = a.handle.region_id;
        if self.regions.contains(rid) {
            // Freeing it would free the region we already have under that id.
            return Err(internal(format!(
                "the RM handed out region {rid}, which maru-server holds already"
            )));
        }
        let pages = a.handle.length / self.cfg.chunk_size;
        if pages == 0 {
            let _ = rm.free(&a.handle);
            return Err(internal(format!(
                "the RM gave region {rid} of {} bytes for {size} asked, less than one page",
                a.handle.length
            )));
        }
        let agent = match backend {
            Backend::RemoteCxl => agent_for(rid, &self.cfg.agents),
            Backend::Cxl => None,
        };
        Ok(Region {
            handle: a.handle,
            pool: a.pool,
            agent,
            backend,
            pages: PageAllocator::new(pages),
            holder: Holder::GivingBack,
            last_read_ms: now_ms,
            boot_id: None,
        })
    }

    /// Gives back one kept region, the one read longest ago, unless one given back
    /// for this reason has not reached the RM yet. Says what it did.
    fn make_room_at_rm(&mut self, now_ms: u64, rm: &mut dyn RmPort) -> String {
        if self.keeper.pressure_pending() {
            return "a kept region is being given back to make room: retry shortly".into();
        }
        let victim = self
            .keeper
            .kept_ids()
            .filter(|id| !self.pins.region_has_pins(*id))
            .filter_map(|id| self.regions.get(id).map(|r| (r.last_read_ms, id)))
            .min()
            .map(|(_, id)| id);
        let Some(id) = victim else {
            return "maru-server keeps no region it could give back (none, or each holds \
                    pinned keys): retry later, unpin keys or give the RM more memory"
                .into();
        };
        self.keeper.lose(id, GiveBackReason::RmPressure, now_ms);
        self.apply(&[KeeperEvent::Lost {
            region_id: id,
            reason: GiveBackReason::RmPressure,
        }]);
        // Without an agent to ask first, the RM can free it right away.
        if let Some(e) = self.keeper.free_now(id, now_ms, rm) {
            self.apply(&[e]);
            return format!("kept region {id}, read longest ago, was given back: retry");
        }
        format!("kept region {id}, read longest ago, is being given back: retry shortly")
    }

    pub(super) fn heartbeat(
        &mut self,
        client_id: &str,
        session: u64,
        boot_ids: &BTreeMap<u64, String>,
        regions: &[u64],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_batch("boot ids", boot_ids.len())?;
        check_batch("regions", regions.len())?;
        for (rid, boot) in boot_ids {
            if boot.is_empty() || boot.len() > MAX_NAME_LEN {
                return Err(bad_request(format!(
                    "region {rid}: a boot id must be 1 to {MAX_NAME_LEN} bytes; a worker whose \
                     agent reports none treats the agent as unreachable"
                )));
            }
        }
        let id = self.session(client_id, session, now_ms)?;
        let owned = |me: &Self, rid: u64| {
            me.sessions
                .get(id)
                .is_some_and(|s| s.regions.contains(&rid))
        };
        let mut unknown_regions: Vec<u64> = regions
            .iter()
            .copied()
            .filter(|&rid| !boot_ids.contains_key(&rid) && !owned(self, rid))
            .collect();
        unknown_regions.sort_unstable();
        unknown_regions.dedup();
        let mut rebooted_regions = Vec::new();
        for (&rid, boot) in boot_ids {
            let owned = owned(self, rid);
            let Some(r) = self.regions.get_mut(rid).filter(|_| owned) else {
                unknown_regions.push(rid);
                continue;
            };
            // Keys published before maru-server had any boot id for their region
            // cannot be vouched for (a reboot may have come first): they go too.
            let changed = match &r.boot_id {
                Some(b) => b != boot,
                None => self.keys.region_keys(rid) > 0,
            };
            r.boot_id = Some(boot.clone());
            if changed {
                let (keys, leases) = self.hide_region(rid);
                log::warn!(
                    "session {id}: the memory node of region {rid} rebooted (boot id now \
                     {boot}): {keys} keys dropped, {leases} leases ended"
                );
                rebooted_regions.push(rid);
            }
        }
        let expires_in_ms = self.cfg.session_timeout_ms;
        self.fair.forget_stale(now_ms, self.cfg.session_timeout_ms);
        let give_back = self
            .fair
            .asked_of(id)
            .filter(|&rid| owned(self, rid))
            .into_iter()
            .collect();
        Ok(MetaReply::Heartbeat(HeartbeatReply {
            unknown_regions,
            rebooted_regions,
            expires_in_ms,
            give_back,
        }))
    }

    pub(super) fn return_region(
        &mut self,
        client_id: &str,
        session: u64,
        region_id: u64,
        released: bool,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Result<MetaReply, WireError> {
        let id = self.session(client_id, session, now_ms)?;
        let owned = self
            .sessions
            .get_mut(id)
            .is_some_and(|s| s.regions.remove(&region_id));
        if !owned {
            if self.regions.contains(region_id) {
                return Err(permission(format!(
                    "region {region_id} is not a region of session {id}: only its owner \
                     returns it"
                )));
            }
            return Err(Self::unknown_region(region_id));
        }
        self.fair.region_gone(region_id, Some(id));
        let (keys_dropped, leases_ended) = self.hide_region(region_id);
        let Some(r) = self.regions.get_mut(region_id) else {
            return Err(internal(format!("region {region_id} vanished")));
        };
        r.holder = Holder::GivingBack;
        // The RM frees a remote_cxl region only after its agent released it: by the
        // worker (`released`), or else by the keeper before the free.
        let needs_release = r.backend == Backend::RemoteCxl && !released;
        let (handle, agent) = (r.handle.clone(), r.agent.clone());
        self.keeper.give_back(
            handle,
            agent,
            !needs_release,
            GiveBackReason::Returned,
            now_ms,
        );
        let freed = match self.keeper.free_now(region_id, now_ms, rm) {
            Some(e) => {
                self.apply(&[e]);
                true
            }
            None => false,
        };
        Ok(MetaReply::Returned(ReturnReply {
            region_id,
            freed,
            keys_dropped,
            leases_ended,
        }))
    }

    pub(super) fn close(
        &mut self,
        client_id: &str,
        session: u64,
        drained: bool,
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        let id = self.session(client_id, session, now_ms)?;
        let reply = self.end_session(id, EndReason::Closed, drained, now_ms);
        log::info!(
            "session {id} closed ({}): {} regions kept, {} going back",
            if drained { "drained" } else { "not drained" },
            reply.kept.len(),
            reply.given_back.len()
        );
        Ok(MetaReply::Closed(reply))
    }
}
