//! Sessions and their regions: open, expand (both wait for the RM in `alloc_ops`),
//! heartbeat, return, close.

use super::core::{Caller, MetaCore};
use super::errors::{bad_request, check_batch, internal, no_space, permission};
use super::fair_share::Ask;
use super::keeper::GiveBackReason;
use super::ports::RmPort;
use super::regions::{Holder, Region};
use super::sessions::EndReason;
use super::tenants::Access;
use super::waits::Ticket;
use super::waits::{OpenArgs, Want};
use crate::wire::meta::{
    Backend, HeartbeatReply, HeldLease, MetaReply, PageRef, RegionGrant, ReturnReply, SkipCounts,
    MAX_HELD_PAGES, MAX_NAME_LEN,
};
use crate::wire::WireError;
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

/// What a heartbeat says (see `MetaRequest::Heartbeat`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Beat<'a> {
    pub boot_ids: &'a BTreeMap<u64, String>,
    pub regions: &'a [u64],
    pub leases: Option<&'a [HeldLease]>,
    pub skipped: Option<SkipCounts>,
    pub held_pages: Option<&'a [PageRef]>,
}

impl MetaCore {
    /// Opens a session in a namespace its tenant writes or reads. A writing session
    /// asked for its first region waits for it (`Ok(None)`); a reading one gets none.
    pub(super) fn open_session(
        &mut self,
        caller: &Caller<'_>,
        ticket: Ticket,
        args: OpenArgs,
        first_region: bool,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Result<Option<MetaReply>, WireError> {
        check_name("engine id", &args.engine_id, true)?;
        check_name("namespace", &args.namespace, false)?;
        check_name("layout digest", &args.layout, false)?;
        self.check_backend_configured(args.backend)?;
        let access = self.tenants.access(caller.tenant, &args.namespace);
        if access == Access::None {
            return Err(permission(format!(
                "tenant {} may neither write nor read namespace {:?}: the tenants file names \
                 the namespaces of each tenant",
                caller.tenant,
                crate::net::clip(&args.namespace)
            )));
        }
        self.check_session_room(caller.tenant)?;
        if first_region && access == Access::Write {
            self.park(caller, ticket, Want::Open { args, access }, now_ms, rm)?;
            return Ok(None);
        }
        Ok(Some(self.new_session(caller, &args, access, None, now_ms)))
    }

    /// One more region for a writing session: waits for the RM (`Ok(None)`) once the
    /// tenant's share and limits allow it.
    pub(super) fn expand(
        &mut self,
        caller: &Caller<'_>,
        ticket: Ticket,
        session: u64,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Result<Option<MetaReply>, WireError> {
        let id = self.session(caller.owner, session, now_ms)?;
        let s = self.sessions.checked(id)?;
        if s.access != Access::Write {
            // Not a refusal: a worker that stores into a namespace it only reads skips
            // its stores, and goes on loading.
            return Err(no_space(format!(
                "session {id} reads namespace {:?} and its tenant {} does not write it: it \
                 gets no region, its stores are skipped",
                crate::net::clip(&s.namespace),
                s.tenant
            )));
        }
        self.park(caller, ticket, Want::Expand { session: id }, now_ms, rm)?;
        Ok(None)
    }

    /// Hands a new region to the session.
    pub(super) fn give_region(
        &mut self,
        session: u64,
        mut region: Region,
        now_ms: u64,
    ) -> RegionGrant {
        let rid = region.handle.region_id;
        region.holder = Holder::Session(session);
        let grant = region.grant(self.cfg.chunk_size);
        self.regions.insert(region);
        self.join_region(session, rid);
        self.note_region_use(rid, now_ms);
        grant
    }

    /// Region `rid` is session `sid`'s from now on (counted for the fair share: its
    /// only way into a session's regions).
    pub(super) fn join_region(&mut self, sid: u64, rid: u64) {
        if let Some(s) = self.sessions.get_mut(sid) {
            if s.regions.insert(rid) {
                self.fair.region_added(sid, &s.tenant);
            }
        }
    }

    /// Session `sid` no longer holds region `rid` (counted for the fair share: its
    /// only way out of a session's regions, but for the session's end). Whether it
    /// held it.
    pub(super) fn leave_region(&mut self, sid: u64, rid: u64) -> bool {
        let left = self
            .sessions
            .get_mut(sid)
            .is_some_and(|s| s.regions.remove(&rid));
        if left {
            self.fair.region_removed(sid);
        }
        left
    }

    /// Asks the session holding the region read longest ago of the tenant furthest
    /// above its fair share for that region, if a storing session waits and none was
    /// asked lately (see `fair_share`). A region of that session that nobody can be
    /// writing or reading now (every page taken holds a published key, no lease, no
    /// pin: its worker is idle there) is taken back at once, read longest ago first,
    /// so the waiter does not wait for that session's next call; otherwise the
    /// session is asked at its next call (any reply to it carries the ask).
    pub(super) fn ask_fair_share(&mut self, now_ms: u64, rm: &mut dyn RmPort) -> Option<Ask> {
        let timeout = self.cfg.session_timeout_ms;
        let (sessions, regions, pins) = (&self.sessions, &self.regions, &self.pins);
        // The region of a session read longest ago that holds no pinned key.
        let oldest = |sid: u64| {
            sessions
                .get(sid)?
                .regions
                .iter()
                .filter(|&&rid| !pins.region_has_pins(rid))
                .filter_map(|&rid| Some((regions.get(rid)?.last_read_ms, rid)))
                .min()
        };
        let ask = self
            .fair
            .decide(regions.len(), now_ms, timeout, timeout, oldest)?;
        if let Some(rid) = self.quiet_region_of(ask.session) {
            self.take_for_fair_share(ask.session, rid, now_ms, rm);
            return Some(Ask {
                region_id: rid,
                ..ask
            });
        }
        log::info!(
            "the pool is full and {} storing sessions wait for a region: session {} (of the \
             tenant most regions above its fair share) is asked to give back region {} at its \
             next call",
            self.fair.waiting(),
            ask.session,
            ask.region_id
        );
        Some(ask)
    }

    /// The region `session` is asked to give back (still its own), for any reply to
    /// it: a storing session hears it at its next call, an idle one at its next
    /// heartbeat.
    pub(super) fn asked_back(&self, session: u64) -> Vec<u64> {
        self.fair
            .asked_of(session)
            .filter(|&rid| {
                self.sessions
                    .get(session)
                    .is_some_and(|s| s.regions.contains(&rid))
            })
            .into_iter()
            .collect()
    }

    /// Of `session`'s regions, the one read longest ago that nobody can be writing or
    /// reading now: every page handed out holds a published key (no store of its
    /// worker has pages there), and no key of it is leased or pinned.
    fn quiet_region_of(&self, session: u64) -> Option<u64> {
        let s = self.sessions.get(session)?;
        s.regions
            .iter()
            .filter_map(|&rid| {
                let r = self.regions.get(rid)?;
                let quiet = r.pages.used() == self.keys.region_keys(rid) as u64
                    && !self.leases.region_has_leases(rid)
                    && !self.pins.region_has_pins(rid);
                quiet.then_some((r.last_read_ms, rid))
            })
            .min()
            .map(|(_, rid)| rid)
    }

    /// Takes `region_id` from `session` for a waiting session's fair share: its keys
    /// go now, it is released at its agent (its worker may have it mapped) and freed
    /// at the RM. The worker hears of it as a region no longer its own at its next
    /// heartbeat; it had no page there to write into.
    fn take_for_fair_share(
        &mut self,
        session: u64,
        region_id: u64,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) {
        self.leave_region(session, region_id);
        self.fair.taken(session);
        let (keys, _) = self.hide_region(region_id);
        if !self.send_back(region_id, GiveBackReason::FairShare, now_ms) {
            return;
        }
        log::info!(
            "the pool is full and {} storing sessions wait for a region: region {region_id} \
             ({keys} keys, none being written, leased or pinned) is taken back from session \
             {session}, the one furthest above its fair share",
            self.fair.waiting()
        );
        if let Some(e) = self.keeper.free_now(region_id, now_ms, rm) {
            self.apply(&[e]);
        }
    }

    /// Hands a region that left its session to the keeper, to be released and freed
    /// at the RM (`reason` for its counts); false when there is no such region.
    pub(super) fn send_back(
        &mut self,
        region_id: u64,
        reason: GiveBackReason,
        now_ms: u64,
    ) -> bool {
        let Some(r) = self.regions.get_mut(region_id) else {
            return false;
        };
        r.holder = Holder::GivingBack;
        r.unused_since_ms = None;
        let (handle, agent) = (r.handle.clone(), r.agent.clone());
        self.keeper.give_back(handle, agent, false, reason, now_ms);
        true
    }

    pub(super) fn heartbeat(
        &mut self,
        client_id: &str,
        session: u64,
        beat: &Beat<'_>,
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        let Beat {
            boot_ids,
            regions,
            leases,
            skipped,
            held_pages,
        } = *beat;
        check_batch("boot ids", boot_ids.len())?;
        check_batch("regions", regions.len())?;
        check_batch("leases", leases.map_or(0, <[HeldLease]>::len))?;
        let held_count = held_pages.map_or(0, <[PageRef]>::len);
        if held_count > MAX_HELD_PAGES {
            return Err(bad_request(format!(
                "held_pages names {held_count} pages, more than {MAX_HELD_PAGES}: a worker \
                 holding more does not report (its pages found allocated without a key stay \
                 its session's until their region goes); nothing was done"
            )));
        }
        for (rid, boot) in boot_ids {
            if boot.is_empty() || boot.len() > MAX_NAME_LEN {
                return Err(bad_request(format!(
                    "region {rid}: a boot id must be 1 to {MAX_NAME_LEN} bytes; a worker whose \
                     agent reports none treats the agent as unreachable"
                )));
            }
        }
        let id = self.session(client_id, session, now_ms)?;
        if let Some(held) = leases {
            self.leases_held(id, held, now_ms);
        }
        if let Some(held) = held_pages {
            self.pages_held(id, held, now_ms);
        }
        if let Some(counts) = skipped {
            self.sessions.note_skipped(id, counts);
        }
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
            let Some(r) = self.regions.get(rid).filter(|_| owned) else {
                unknown_regions.push(rid);
                continue;
            };
            if r.boot_id.as_deref() == Some(boot.as_str()) {
                continue; // nothing new (and nothing to record)
            }
            // Keys published before maru-server had any boot id for their region
            // cannot be vouched for (a reboot may have come first): they go too.
            let changed = match &r.boot_id {
                Some(b) => b != boot,
                None => self.keys.region_keys(rid) > 0,
            };
            if let Some(r) = self.regions.get_mut(rid) {
                r.boot_id = Some(boot.clone());
            }
            if changed {
                let (keys, leases) = self.hide_region(rid);
                self.note_region_use(rid, now_ms);
                log::warn!(
                    "session {id}: the memory node of region {rid} rebooted (boot id now \
                     {boot}): {keys} keys dropped, {leases} leases ended"
                );
                rebooted_regions.push(rid);
            }
        }
        let expires_in_ms = self.cfg.session_timeout_ms;
        self.fair.forget_stale(now_ms, self.cfg.session_timeout_ms);
        let give_back = self.asked_back(id);
        Ok(MetaReply::Heartbeat(HeartbeatReply {
            unknown_regions,
            rebooted_regions,
            expires_in_ms,
            give_back,
            held_pages_wanted: self.wants_held_pages(id),
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
        if !self.leave_region(id, region_id) {
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
        self.hold_back_regions(now_ms);
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
