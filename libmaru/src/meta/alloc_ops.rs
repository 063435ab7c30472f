//! Requests that need a region: `open_session` with its first region, and `expand`.
//!
//! A region comes from the RM, which may be slow or stopped, so asking for one is an
//! [action](Action) of the core and the RM's answer an event
//! ([`alloc_done`](MetaCore::alloc_done)): the request is checked at once (its session,
//! its tenant's access, share and limits) and then waits here, parked, decoded (a
//! parked request holds at most its three names, each at most `MAX_NAME_LEN` bytes,
//! never the frame it came in). One allocation is in flight at a time; its region
//! goes to the oldest waiting request that may still take it (checked again: its
//! session may have ended, its tenant may have reached its share meanwhile), and a
//! region nobody may take goes back. A request that waited `park_max_ms` is answered
//! "retry" while the allocation goes on. A request the RM refused while room is on its
//! way (the kept regions of departed engines read longest ago given back, a
//! sixteenth of them or as many as the requests waiting if more, or a fair-share
//! region taken or asked for) waits for a region to be freed, at most
//! [`ROOM_WAIT_MS`], then is answered `no_space`.
//!
//! Limits: a tenant parks at most its `max_parked` requests, all tenants together at
//! most `max_parked` of the configuration; beyond them a request is answered "retry"
//! at once.
//!
//! A tenant storing alongside others holds at most its share of the RM's pools
//! (their regions ÷ the storing tenants, rounded up) and at most its `max_regions`: a
//! tenant cannot take the pool by opening many sessions. A region its session holds
//! without a page taken or a key in it for `unused_region_ms` goes back (a session
//! that never stores gives its regions back within about one heartbeat).

use super::core::{Caller, MetaCore};
use super::errors::{internal, no_space, refused};
use super::keeper::{GiveBackReason, KeeperEvent};
use super::keys::Scope;
use super::pages::PageAllocator;
use super::ports::{PortError, RmPort};
use super::regions::{agent_for, Holder, Region};
use super::sessions::NewSession;
use super::tenants::Access;
use super::waits::{Action, OpenArgs, Parked, Ticket, Want};
use crate::wire::meta::{Backend, MetaReply, RegionGrant, SessionReply, LEASE_LIMIT};
use crate::wire::rm::AllocReply;
use crate::wire::WireError;
use std::collections::VecDeque;

/// How long a request the RM refused waits for the room on its way (kept regions
/// or a fair-share region going back) before it is answered `no_space` (its worker
/// then evicts its own keys, or skips).
pub const ROOM_WAIT_MS: u64 = 1_000;

/// A refusal of the RM gives back at least this part of the kept regions (those read
/// longest ago), or as many as the requests waiting for a region if more. Not all of
/// them: one refused region dropped the whole cache of departed engines (issue 46: at
/// 4 M keys, 5,639 kept regions and their keys for one 4 MiB region). Not one at a
/// time either: a live engine storing into a full pool would meet a refusal, and wait
/// for a free, at every region it fills; so it meets one about every sixteenth of
/// the kept cache.
pub const ROOM_SHARE: usize = 16;

impl MetaCore {
    /// The next thing the driver must do (and report back).
    pub fn next_action(&mut self) -> Option<Action> {
        self.waits.actions.pop_front()
    }

    /// Answers to requests that waited (see [`handle`](Self::handle)), by ticket.
    pub fn take_answers(&mut self) -> Vec<(Ticket, Result<MetaReply, WireError>)> {
        std::mem::take(&mut self.waits.answers)
    }

    /// Whether answers are waiting to be taken.
    pub fn has_answers(&self) -> bool {
        !self.waits.answers.is_empty()
    }

    /// Requests waiting for a region from the RM.
    pub fn waiting_for_rm(&self) -> usize {
        self.waits.len()
    }

    /// The request `ticket` no longer needs an answer (its connection closed).
    pub fn cancel(&mut self, ticket: Ticket) {
        self.waits.parked.retain(|p| p.ticket != ticket);
    }

    /// The RM answered the allocation `alloc` (see [`Action::Alloc`]).
    pub fn alloc_done(
        &mut self,
        alloc: u64,
        result: Result<AllocReply, PortError>,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) {
        self.note_now(now_ms);
        self.expire(now_ms);
        if self.waits.in_flight != Some(alloc) {
            log::warn!("an answer to allocation {alloc}, which is not in flight");
            if let Ok(a) = result {
                self.give_back_unclaimed(a, now_ms, rm);
            }
            return;
        }
        self.waits.in_flight = None;
        match result {
            Ok(a) => self.hand_out(a, now_ms, rm),
            Err(PortError::Refused(m)) => {
                if let Some(p) = self.waits.parked.pop_front() {
                    let freed = self.waits.freed;
                    let (e, coming) = self.rm_full(&p, &m, now_ms, rm);
                    let young = now_ms.saturating_sub(p.since_ms) < self.cfg.park_max_ms;
                    if coming && young {
                        // It waits for the room on its way: answered when a region
                        // is freed, or `no_space` after `ROOM_WAIT_MS`.
                        log::debug!("a region request waits for room: {}", e.message);
                        let mut p = p;
                        let by = p
                            .room
                            .as_ref()
                            .map_or(now_ms.saturating_add(ROOM_WAIT_MS), |r| r.0);
                        p.room = Some((by, e));
                        self.waits.parked.push_front(p);
                        self.waits.room_coming = self.waits.freed == freed;
                    } else {
                        self.waits.answers.push((p.ticket, Err(e)));
                    }
                }
            }
            Err(e) => {
                // The RM cannot be reached (or failed): the same for every waiter.
                let msg = format!(
                    "could not get a region of {} bytes from the RM at {} ({e}): retry",
                    self.cfg.region_size, self.cfg.rm_address
                );
                for p in std::mem::take(&mut self.waits.parked) {
                    self.waits
                        .answers
                        .push((p.ticket, Err(internal(msg.clone()))));
                }
            }
        }
        self.start_alloc();
    }

    /// Checks that `caller` may take a region now, then parks the request until the
    /// RM answers (for an expand, its session was checked to be the caller's).
    pub(super) fn park(
        &mut self,
        caller: &Caller<'_>,
        ticket: Ticket,
        want: Want,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Result<(), WireError> {
        let session = match &want {
            Want::Expand { session } => Some(*session),
            Want::Open { .. } => None,
        };
        self.check_pool(rm)?;
        self.check_share(caller.tenant, session)?;
        let limit = self.tenants.limits(caller.tenant).max_parked;
        let mine = self.waits.parked_of(caller.tenant);
        if mine >= limit || self.waits.len() >= self.cfg.max_parked {
            return Err(internal(format!(
                "{} requests of tenant {} and {} in all wait for a region from the RM at {} \
                 (at most {limit} of one tenant, {} in all): retry",
                mine,
                caller.tenant,
                self.waits.len(),
                self.cfg.rm_address,
                self.cfg.max_parked
            )));
        }
        self.waits.parked.push_back(Parked {
            ticket,
            owner: caller.owner.to_string(),
            tenant: caller.tenant.to_string(),
            since_ms: now_ms,
            want,
            room: None,
        });
        self.start_alloc();
        Ok(())
    }

    pub(super) fn start_alloc(&mut self) {
        if self.waits.in_flight.is_some() || self.waits.parked.is_empty() {
            return;
        }
        if self.waits.room_coming {
            return;
        }
        self.waits.next_alloc += 1;
        let alloc = self.waits.next_alloc;
        self.waits.in_flight = Some(alloc);
        self.waits.actions.push_back(Action::Alloc {
            alloc,
            size: self.cfg.region_size,
        });
    }

    /// Requests that waited `park_max_ms` are answered "retry".
    pub(super) fn expire_waits(&mut self, now_ms: u64) {
        let max = self.cfg.park_max_ms;
        while let Some(p) = self.waits.parked.front() {
            if now_ms.saturating_sub(p.since_ms) < max {
                break;
            }
            let Some(p) = self.waits.parked.pop_front() else {
                break;
            };
            self.waits.answers.push((
                p.ticket,
                Err(internal(format!(
                    "the RM at {} did not answer an allocation within {} ms: retry",
                    self.cfg.rm_address, max
                ))),
            ));
        }
        // Requests the RM refused that waited for room long enough: `no_space`.
        let mut keep = VecDeque::new();
        while let Some(p) = self.waits.parked.pop_front() {
            match p.room {
                Some((by, ref e)) if now_ms >= by => {
                    let e = e.clone();
                    self.waits.answers.push((p.ticket, Err(e)));
                }
                _ => keep.push_back(p),
            }
        }
        self.waits.parked = keep;
        if self.waits.room_coming && self.waits.parked.iter().all(|p| p.room.is_none()) {
            self.waits.room_coming = false;
            self.start_alloc();
        }
    }

    /// The RM freed a region: a request waiting for room asks for it now.
    pub(super) fn region_freed(&mut self) {
        self.waits.freed += 1;
        self.waits.room_coming = false;
        self.start_alloc();
    }

    /// A region larger than the RM's largest pool is refused for good.
    fn check_pool(&mut self, rm: &mut dyn RmPort) -> Result<(), WireError> {
        match rm.pool_sizes() {
            Ok(s) => self.waits.sizes = Some(s),
            // The allocation itself will tell.
            Err(e) => log::debug!("could not ask the RM for its pools: {e}"),
        }
        let size = self.cfg.region_size;
        match self.waits.sizes {
            Some(s) if size > s.largest => Err(refused(format!(
                "a region of {size} bytes is larger than the RM's largest pool ({} bytes), so \
                 it can never be allocated: lower the region size (maru_pool_size) or give \
                 the RM a larger pool; do not retry",
                s.largest
            ))),
            _ => Ok(()),
        }
    }

    /// Most regions `tenant` may hold now: its share of the RM's pools among the
    /// storing tenants (itself counted), and its `max_regions`. None: no bound.
    pub(super) fn region_cap(&self, tenant: &str) -> Option<usize> {
        let storing = self.fair.storing_tenants(Some(tenant));
        let share = self.waits.sizes.filter(|_| storing > 1).map(|s| {
            let pool = (s.total / self.cfg.region_size.max(1)) as usize;
            pool.div_ceil(storing).max(1)
        });
        let max = self.tenants.limits(tenant).max_regions;
        match (share, max) {
            (s, 0) => s,
            (Some(s), m) => Some(s.min(m)),
            (None, m) => Some(m),
        }
    }

    /// Session `id`'s fair share of the pool now, in regions: the RM's pools (or,
    /// before they are known, the regions maru-server holds) ÷ the storing tenants
    /// (its own counted), within its tenant's `max_regions`, ÷ the tenant's storing
    /// sessions (itself counted); rounded up, at least one. Looked up in the counts
    /// of [`fair_share`](super::fair_share): every alloc's reply carries it.
    pub(super) fn share_regions(&self, id: u64) -> u64 {
        let Some(me) = self.sessions.get(id) else {
            return 1;
        };
        let tenant = me.tenant.as_str();
        let pool = self.waits.sizes.map_or(self.regions.len() as u64, |s| {
            s.total / self.cfg.region_size.max(1)
        });
        let tenants = self.fair.storing_tenants(Some(tenant)) as u64;
        // The tenant's other storing sessions.
        let mine =
            (self.fair.storing_sessions(tenant) - usize::from(self.fair.is_storing(id))) as u64;
        let mut share = pool.div_ceil(tenants).max(1);
        let max = self.tenants.limits(tenant).max_regions as u64;
        if max > 0 {
            share = share.min(max);
        }
        share.div_ceil(mine + 1).max(1)
    }

    /// Whether `tenant` may take one more region now: it does not hold its share of a
    /// full pool while another tenant waits (see `fair_share`), nor its cap.
    fn check_share(&mut self, tenant: &str, session: Option<u64>) -> Result<(), WireError> {
        let pool_regions = self.regions.len();
        let held = self.fair.tenant_regions(tenant);
        let id = session.unwrap_or(0);
        if self.fair.must_yield(id, tenant, pool_regions) {
            // It holds its share: it does not wait for more, it evicts.
            if let Some(id) = session {
                self.fair.done_waiting(id);
            }
            return Err(no_space(format!(
                "session {id} of tenant {tenant} holds its fair share of the full pool \
                 (tenant: {held} of {pool_regions} regions) while other sessions wait for \
                 one: evict keys of its own regions"
            )));
        }
        if let Some(cap) = self.region_cap(tenant).filter(|&cap| held >= cap) {
            return Err(no_space(format!(
                "tenant {tenant} holds {held} regions, its share of the pool among the tenants \
                 storing in it (or its max_regions): {cap}; evict keys of its own regions"
            )));
        }
        Ok(())
    }

    /// The RM's region `a` goes to the oldest waiting request that may take it.
    fn hand_out(&mut self, a: AllocReply, now_ms: u64, rm: &mut dyn RmPort) {
        let rid = a.handle.region_id;
        if self.regions.contains(rid) {
            // Freeing it would free the region we already have under that id.
            let e = internal(format!(
                "the RM handed out region {rid}, which maru-server holds already"
            ));
            log::error!("{e}");
            if let Some(p) = self.waits.parked.pop_front() {
                self.waits.answers.push((p.ticket, Err(e)));
            }
            return;
        }
        if a.handle.length / self.cfg.chunk_size == 0 {
            let _ = rm.free(&a.handle);
            if let Some(p) = self.waits.parked.pop_front() {
                let e = internal(format!(
                    "the RM gave region {rid} of {} bytes for {} asked, less than one page",
                    a.handle.length, self.cfg.region_size
                ));
                self.waits.answers.push((p.ticket, Err(e)));
            }
            return;
        }
        while let Some(p) = self.waits.parked.pop_front() {
            let r = self.complete(&p, &a, now_ms);
            let taken = r.is_ok();
            self.waits.answers.push((p.ticket, r));
            if taken {
                return;
            }
        }
        self.give_back_unclaimed(a, now_ms, rm);
    }

    /// Gives the region to the waiting request `p`, checked again.
    fn complete(
        &mut self,
        p: &Parked,
        a: &AllocReply,
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        match &p.want {
            Want::Expand { session } => {
                let id = self.session(&p.owner, *session, now_ms)?;
                self.check_share(&p.tenant, Some(id))?;
                let backend = self.sessions.checked(id)?.backend;
                let region = self.region_from(a, backend, now_ms);
                self.fair.done_waiting(id);
                Ok(MetaReply::Region(self.give_region(id, region, now_ms)))
            }
            Want::Open { args, access } => {
                self.check_session_room(&p.tenant)?;
                self.check_share(&p.tenant, None)?;
                let region = self.region_from(a, args.backend, now_ms);
                let caller = Caller {
                    owner: &p.owner,
                    tenant: &p.tenant,
                };
                Ok(self.new_session(&caller, args, *access, Some(region), now_ms))
            }
        }
    }

    /// Whether `tenant` may open one more session (the server's and its own limit).
    pub(super) fn check_session_room(&self, tenant: &str) -> Result<(), WireError> {
        self.sessions.check_room()?;
        let max = self.tenants.limits(tenant).max_sessions;
        let open = self.sessions.count_of(tenant) + self.waits.opens_of(tenant);
        if open >= max {
            return Err(refused(format!(
                "tenant {tenant} has {open} sessions open (or opening) and may have at most \
                 {max}: close sessions, or raise max_sessions in the tenants file"
            )));
        }
        Ok(())
    }

    /// A new session, with its first region if it came with one.
    pub(super) fn new_session(
        &mut self,
        caller: &Caller<'_>,
        args: &OpenArgs,
        access: Access,
        region: Option<Region>,
        now_ms: u64,
    ) -> MetaReply {
        let scope = self.keys.scope_id(Scope {
            namespace: args.namespace.clone(),
            layout: args.layout.clone(),
            backend: args.backend,
        });
        let new = NewSession {
            client_id: caller.owner,
            tenant: caller.tenant,
            access,
            engine_id: &args.engine_id,
            namespace: &args.namespace,
            backend: args.backend,
        };
        let id = self.sessions.insert(new, scope, now_ms);
        let grant: Option<RegionGrant> = region.map(|r| self.give_region(id, r, now_ms));
        log::info!(
            "session {id} opened by {} of tenant {} (engine {}, namespace {}, {}{}) with {}",
            crate::net::clip(caller.owner),
            caller.tenant,
            crate::net::clip(&args.engine_id),
            crate::net::clip(&args.namespace),
            args.backend.as_str(),
            if access == Access::Write {
                ""
            } else {
                ", reads only"
            },
            grant
                .as_ref()
                .map_or("no region yet".to_string(), |g| format!(
                    "region {}",
                    g.handle.region_id
                ))
        );
        MetaReply::Session(SessionReply {
            session: id,
            page_size: self.cfg.chunk_size,
            region: grant,
            session_timeout_ms: self.cfg.session_timeout_ms,
            lease_timeout_ms: self.cfg.lease_timeout_ms,
            lease_limit: LEASE_LIMIT,
            session_secret: None,
        })
    }

    /// The RM's region as a region of `backend`, not yet in the table.
    fn region_from(&self, a: &AllocReply, backend: Backend, now_ms: u64) -> Region {
        let rid = a.handle.region_id;
        let agent = match backend {
            Backend::RemoteCxl => agent_for(rid, &self.cfg.agents),
            Backend::Cxl => None,
        };
        Region {
            handle: a.handle.clone(),
            pool: a.pool.clone(),
            agent,
            backend,
            pages: PageAllocator::new(a.handle.length / self.cfg.chunk_size),
            holder: Holder::GivingBack,
            last_read_ms: now_ms,
            boot_id: None,
            unused_since_ms: None,
        }
    }

    /// A region the RM handed out that no request takes: straight back (nobody
    /// mapped it, so no agent holds it).
    fn give_back_unclaimed(&mut self, a: AllocReply, now_ms: u64, rm: &mut dyn RmPort) {
        let rid = a.handle.region_id;
        if self.regions.contains(rid) {
            log::error!("the RM handed out region {rid}, which maru-server holds already");
            return;
        }
        let region = self.region_from(&a, Backend::Cxl, now_ms);
        self.regions.insert(region);
        self.keeper
            .give_back(a.handle, None, true, GiveBackReason::Unclaimed, now_ms);
        if let Some(e) = self.keeper.free_now(rid, now_ms, rm) {
            self.apply(&[e]);
        }
    }

    /// The RM refused the region `p` waited for: make room (kept regions of departed
    /// engines first, see `make_room_at_rm`; else, for a storing session, a region of the session
    /// furthest above its fair share), and say so. True when room is on its way, so
    /// that `p` may wait for it rather than be refused.
    fn rm_full(
        &mut self,
        p: &Parked,
        why: &str,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> (WireError, bool) {
        let (room, mut coming) = self.make_room_at_rm(now_ms, rm);
        let mut e = no_space(format!(
            "the RM refused a region of {} bytes ({why}); {room}",
            self.cfg.region_size
        ));
        if let Want::Expand { session } = p.want {
            if self.sessions.get(session).is_some() {
                self.fair.want(session, &p.tenant, now_ms);
                if !coming {
                    let ask = self.ask_fair_share(now_ms, rm);
                    if let Some(ask) = ask {
                        e.message.push_str(&format!(
                            "; session {} of the tenant furthest above its fair share gives \
                             back region {}: retry shortly",
                            ask.session, ask.region_id
                        ));
                    }
                    // Taken now, or asked before and not answered yet.
                    coming = ask.is_some() || self.fair.asked().is_some();
                }
            }
        }
        (e, coming)
    }

    /// Gives back the kept regions that hold no pinned key read longest ago (departed
    /// engines' keys go before any live engine evicts its own): as many as the
    /// requests waiting for a region, the refused one counted, or the
    /// [`ROOM_SHARE`]th part of those kept if more. Says what it did, and whether room
    /// is on its way (given back now, or earlier and not freed yet).
    fn make_room_at_rm(&mut self, now_ms: u64, rm: &mut dyn RmPort) -> (String, bool) {
        let mut victims: Vec<(u64, u64)> = self
            .keeper
            .kept_ids()
            .filter(|id| !self.pins.region_has_pins(*id))
            .filter_map(|id| self.regions.get(id).map(|r| (r.last_read_ms, id)))
            .collect();
        victims.sort_unstable();
        let kept = victims.len();
        victims.truncate((self.waits.parked.len() + 1).max(kept.div_ceil(ROOM_SHARE)));
        if victims.is_empty() {
            if self.keeper.pressure_pending() {
                return (
                    "regions are being given back to make room: retry shortly".into(),
                    true,
                );
            }
            return (
                "maru-server keeps no region of a departed engine it could give back (none, \
                 or each holds pinned keys)"
                    .into(),
                false,
            );
        }
        let mut freed = 0;
        for &(_, id) in &victims {
            self.keeper.lose(id, GiveBackReason::RmPressure, now_ms);
            self.apply(&[KeeperEvent::Lost {
                region_id: id,
                reason: GiveBackReason::RmPressure,
            }]);
            // Without an agent to ask first, the RM can free it right away.
            if let Some(e) = self.keeper.free_now(id, now_ms, rm) {
                self.apply(&[e]);
                freed += 1;
            }
        }
        let ids: Vec<u64> = victims.iter().map(|&(_, id)| id).collect();
        (
            format!(
                "{} of {kept} kept region(s) of departed engines, read longest ago \
                 ({ids:?}), given back, {freed} freed already: retry shortly",
                ids.len()
            ),
            true,
        )
    }

    /// Notes whether a region of a session is in use now (see `Region::note_use`).
    pub(super) fn note_region_use(&mut self, region_id: u64, now_ms: u64) {
        let limit = self.cfg.unused_region_ms;
        let Some(r) = self.regions.get_mut_quiet(region_id) else {
            return;
        };
        if !matches!(r.holder, Holder::Session(_)) {
            return;
        }
        let was = r.unused_since_ms;
        r.note_use(now_ms);
        if let Some(t) = r.unused_since_ms {
            let due = t.saturating_add(limit);
            self.next_unused_ms = Some(self.next_unused_ms.map_or(due, |d| d.min(due)));
            if was != Some(t) {
                self.unused_due.push(std::cmp::Reverse((due, region_id)));
            }
        }
    }

    /// Regions sessions held unused for the unused-region limit go back: released at
    /// their agent (the worker may have mapped it), then freed. The worker hears of it
    /// as an unknown region at its next heartbeat. Also finds when the next one is due
    /// (at every tick: regions that left their sessions are forgotten so).
    pub(super) fn take_back_unused(&mut self, now_ms: u64) {
        let limit = self.cfg.unused_region_ms;
        if !self.unused_seeded {
            self.unused_seeded = true;
            for r in self.regions.iter() {
                self.unused_visited += 1;
                if let (Holder::Session(_), Some(t)) = (r.holder, r.unused_since_ms) {
                    let d = t.saturating_add(limit);
                    self.unused_due
                        .push(std::cmp::Reverse((d, r.handle.region_id)));
                }
            }
        }
        let mut due = Vec::new();
        while let Some(&std::cmp::Reverse((d, rid))) = self.unused_due.peek() {
            // An entry stands while its region is unused since the time it was made
            // for; a region used again since (or gone from its session) has a later
            // entry, if any. So the first entry left is the next one due.
            let sid = self.regions.get(rid).and_then(|r| match r.holder {
                Holder::Session(sid)
                    if r.unused_since_ms.map(|t| t.saturating_add(limit)) == Some(d) =>
                {
                    Some(sid)
                }
                _ => None,
            });
            if sid.is_some() && d > now_ms {
                break;
            }
            self.unused_due.pop();
            self.unused_visited += 1;
            if let Some(sid) = sid {
                due.push((rid, sid));
            }
        }
        due.sort_unstable();
        due.dedup();
        self.next_unused_ms = self.unused_due.peek().map(|&std::cmp::Reverse((d, _))| d);
        for (rid, sid) in due {
            self.leave_region(sid, rid);
            self.fair.region_gone(rid, None);
            if self.send_back(rid, GiveBackReason::Unused, now_ms) {
                log::info!(
                    "region {rid}: session {sid} held it for {limit} ms without storing in it; \
                     it goes back"
                );
            }
        }
    }
}
