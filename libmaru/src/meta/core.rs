//! The metadata server as a state machine: requests, closed connections and time go
//! in, replies come out; the RM and the agents are reached through ports lent per
//! call. No sockets, threads or clocks.
//!
//! The requests themselves are carried out in `session_ops` (sessions and regions),
//! `alloc_ops` (requests that wait for a region from the RM), `store_ops` (pages and
//! publish), `read_ops` (exists and leases), `evict_ops` (victims and remove) and
//! `stats`.

use super::config::{ConfigError, MetaConfig};
use super::errors::{check_keys, permission, refused, unsupported};
use super::keeper::{GiveBackReason, KeeperEvent, KeeperTimes, RegionKeeper};
use super::keys::{KeyDirectory, ScopeId};
use super::leases::LeaseTable;
use super::pins::PinTable;
use super::ports::{AgentPort, PortError, RmPort};
use super::regions::{Holder, RegionTable};
use super::sessions::{EndReason, SessionTable};
use super::tenants::{Access, Tenants};
use super::waits::{OpenArgs, RegionWaits, Ticket};
use crate::wire::meta::{
    Backend, CloseReply, EntryRef, HandshakeReply, HotRequest, KeysOp, MetaReply, MetaRequest,
    Request, Text, CAP_CXL_STORAGE, CAP_REMOTE_CXL_STORAGE, LEASE_LIMIT, MAX_BATCH, SERVICE,
};
use crate::wire::WireError;

/// Counters kept since the server started.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Totals {
    pub hits: u64,
    pub misses: u64,
    /// Keys removed by their owners (eviction).
    pub removed: u64,
    /// Removed keys that still had stored successors in their chain.
    pub chains_cut: u64,
}

/// Who sends a request: the owner its connection acts as (the sessions it opens
/// belong to it: a connection, or one presenting a session's secret) and the tenant
/// whose key the connection proved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller<'a> {
    pub owner: &'a str,
    pub tenant: &'a str,
}

/// The keys of an owned request, borrowed as the one-pass decoder's are.
fn keys(keys: &[String]) -> Vec<Text<'_>> {
    keys.iter().map(|k| Text::from(k.as_str())).collect()
}

/// A request about keys whose session was found ([`MetaCore::keyed`]): the session's
/// id and scope, the keys (checked), and the time it came.
pub(super) struct Keyed<'k> {
    pub(super) id: u64,
    pub(super) scope: ScopeId,
    pub(super) keys: &'k [Text<'k>],
    pub(super) now_ms: u64,
}

/// A check of the RM's list of this server's regions in flight.
#[derive(Debug)]
pub(super) struct RmCheck {
    check: u64,
    /// The regions held when it was asked, in id order.
    known: Vec<u64>,
}

/// maru-server's core. See the [module docs](super) for the rules it keeps.
pub struct MetaCore {
    pub(super) cfg: MetaConfig,
    pub(super) sessions: SessionTable,
    pub(super) regions: RegionTable,
    pub(super) keys: KeyDirectory,
    pub(super) leases: LeaseTable,
    pub(super) pins: PinTable,
    pub(super) keeper: RegionKeeper,
    pub(super) totals: Totals,
    pub(super) fair: super::fair_share::FairShare,
    pub(super) tenants: Tenants,
    /// Requests waiting for a region from the RM, and the allocation in flight.
    pub(super) waits: RegionWaits,
    /// When the next region held unused reaches the unused-region limit.
    pub(super) next_unused_ms: Option<u64>,
    /// (due, region) of each region of a session that became unused, the soonest
    /// first; entries whose region was used again since are dropped when due (so a
    /// tick visits the regions due, not every region: issue 46). Filled from every
    /// region at the first tick (regions recovered unused).
    pub(super) unused_due: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u64)>>,
    pub(super) unused_seeded: bool,
    /// Regions visited by `take_back_unused` (a measure of its work).
    pub(super) unused_visited: u64,
    /// When to ask the RM next which regions it holds for this server.
    next_rm_check_ms: u64,
    /// The check of the RM's list in flight ([`Action::CheckRm`](super::Action::CheckRm)), if any.
    rm_check: Option<RmCheck>,
    /// Checks asked so far (names each one).
    rm_checks: u64,
    /// Changes to make durable and pages waiting for it (see `durable`); None: the
    /// directory lives in memory only.
    pub(super) journal: Option<super::journal::Journal>,
}

impl MetaCore {
    pub fn new(config: MetaConfig) -> Result<MetaCore, ConfigError> {
        config.validate()?;
        Ok(MetaCore {
            sessions: SessionTable::new(config.max_sessions, config.session_timeout_ms),
            regions: RegionTable::new(),
            keys: KeyDirectory::ranked(config.victim_order.ranking()),
            leases: LeaseTable::new(LEASE_LIMIT),
            pins: PinTable::default(),
            tenants: Tenants::default(),
            waits: RegionWaits::default(),
            next_unused_ms: None,
            unused_due: Default::default(),
            unused_seeded: false,
            unused_visited: 0,
            keeper: RegionKeeper::new(KeeperTimes {
                silence_ms: config.keeper_silence_ms,
                check_ms: config.keeper_check_ms,
                retry_ms: config.retry_ms,
            }),
            totals: Totals::default(),
            fair: Default::default(),
            next_rm_check_ms: 0,
            rm_check: None,
            rm_checks: 0,
            journal: None,
            cfg: config,
        })
    }

    pub fn config(&self) -> &MetaConfig {
        &self.cfg
    }

    /// The core with these tenants (default: one tenant, `default`, writing every
    /// namespace).
    pub fn with_tenants(mut self, tenants: Tenants) -> MetaCore {
        self.tenants = tenants;
        self
    }

    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Puts new tenants in force (a reloaded tenants file). A session whose tenant is
    /// gone, or whose access to its namespace changed, ends as a drained close does
    /// (its regions with keys are kept and stay readable by whoever may read them);
    /// its worker opens a new session with the access it has now. Returns how many
    /// sessions ended.
    pub fn set_tenants(&mut self, tenants: Tenants, now_ms: u64) -> usize {
        let stale: Vec<(u64, String, Access)> = self
            .sessions
            .iter()
            .map(|s| {
                (
                    s.id,
                    s.tenant.clone(),
                    tenants.access(&s.tenant, &s.namespace),
                )
            })
            .filter(|(id, _, access)| self.sessions.get(*id).is_some_and(|s| s.access != *access))
            .collect();
        self.tenants = tenants;
        for (id, tenant, access) in &stale {
            log::warn!(
                "session {id} of tenant {tenant} ends: its access to its namespace is now \
                 {access:?} (tenants reloaded)"
            );
            self.end_session(*id, EndReason::Closed, true, now_ms);
        }
        self.waits.forget_tenants(&self.tenants);
        stale.len()
    }

    /// Ends every session of `tenant` (its key was removed or changed: what the old
    /// key opened ends with it, so a tenant added back under the name starts with
    /// nothing of the old one's). Returns how many ended.
    pub fn end_tenant_sessions(&mut self, tenant: &str, now_ms: u64) -> usize {
        let ids: Vec<u64> = self
            .sessions
            .iter()
            .filter(|s| s.tenant == tenant)
            .map(|s| s.id)
            .collect();
        for id in &ids {
            log::warn!(
                "session {id} of tenant {tenant} ends: the key that opened it is no longer in \
                 force (tenants reloaded)"
            );
            self.end_session(*id, EndReason::Closed, true, now_ms);
        }
        ids.len()
    }

    /// Sessions open now (expired ones are gone).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Regions maru-server holds at the RM: of sessions, kept, and going back.
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Carries out one request of `caller`. Requests of a session must come from the
    /// owner that opened it. An error changes nothing, except that a refused region
    /// request may make the keeper give a kept region back.
    ///
    /// `None`: the request waits for a region from the RM (see [`Action::Alloc`](super::Action::Alloc)); its
    /// answer comes later from [`take_answers`](Self::take_answers) under `ticket`.
    pub fn handle(
        &mut self,
        caller: &Caller<'_>,
        ticket: Ticket,
        req: MetaRequest,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Option<Result<MetaReply, WireError>> {
        self.handle_request(caller, ticket, Request::Full(req), now_ms, rm)
    }

    /// [`handle`](Self::handle) of a request as maru-server decodes it: those of the
    /// data path borrow their keys from the request's bytes.
    pub fn handle_request(
        &mut self,
        caller: &Caller<'_>,
        ticket: Ticket,
        req: Request<'_>,
        now_ms: u64,
        rm: &mut dyn RmPort,
    ) -> Option<Result<MetaReply, WireError>> {
        self.note_now(now_ms);
        self.set_reply_timing(super::journal::ReplyTiming::default());
        self.expire(now_ms);
        let client_id = caller.owner;
        let req = match req {
            Request::Hot(h) => return Some(self.hot(client_id, h, now_ms)),
            Request::Full(r) => r,
        };
        let r = match req {
            MetaRequest::Handshake {} => Ok(MetaReply::Handshake(self.handshake())),
            MetaRequest::OpenSession {
                engine_id,
                namespace,
                layout,
                backend,
                first_region,
            } => {
                let open = OpenArgs {
                    engine_id,
                    namespace,
                    layout,
                    backend,
                };
                return self
                    .open_session(caller, ticket, open, first_region, now_ms, rm)
                    .transpose();
            }
            MetaRequest::Expand { session } => {
                return self.expand(caller, ticket, session, now_ms, rm).transpose()
            }
            MetaRequest::Alloc {
                session,
                count,
                route_key,
            } => self.alloc_pages(client_id, session, count, route_key.as_deref(), now_ms),
            MetaRequest::FreePages { session, pages } => {
                self.free_pages(client_id, session, &pages, now_ms)
            }
            MetaRequest::Publish { session, entries } => {
                let entries: Vec<EntryRef<'_>> = entries.iter().map(EntryRef::from).collect();
                self.publish(client_id, session, &entries, now_ms)
            }
            MetaRequest::Exists { session, keys: k } => {
                self.keys_request(client_id, KeysOp::Exists, session, &keys(&k), now_ms)
            }
            MetaRequest::Acquire { session, keys: k } => {
                self.keys_request(client_id, KeysOp::Acquire, session, &keys(&k), now_ms)
            }
            MetaRequest::ReleaseLeases { session, lease_ids } => {
                self.release_leases(client_id, session, &lease_ids, now_ms)
            }
            MetaRequest::Victims { session, max } => self.victims(client_id, session, max, now_ms),
            MetaRequest::Remove { session, keys: k } => {
                self.keys_request(client_id, KeysOp::Remove, session, &keys(&k), now_ms)
            }
            MetaRequest::Pin { session, keys: k } => {
                self.keys_request(client_id, KeysOp::Pin, session, &keys(&k), now_ms)
            }
            MetaRequest::Unpin { session, keys: k } => {
                self.keys_request(client_id, KeysOp::Unpin, session, &keys(&k), now_ms)
            }
            MetaRequest::ReturnRegion {
                session,
                region_id,
                released,
            } => self.return_region(client_id, session, region_id, released, now_ms, rm),
            MetaRequest::Heartbeat {
                session,
                boot_ids,
                regions,
                leases,
                skipped,
                held_pages,
            } => self.heartbeat(
                client_id,
                session,
                &super::session_ops::Beat {
                    boot_ids: &boot_ids,
                    regions: &regions,
                    leases: leases.as_deref(),
                    skipped,
                    held_pages: held_pages.as_deref(),
                },
                now_ms,
            ),
            MetaRequest::Close { session, drained } => {
                self.close(client_id, session, drained, now_ms)
            }
            MetaRequest::Stats { session } => self.stats(caller, session),
            MetaRequest::Usage => Ok(MetaReply::Usage(self.usage(caller))),
        };
        Some(r)
    }

    /// A request of the data path, as the one-pass decoder read it.
    fn hot(
        &mut self,
        client_id: &str,
        req: HotRequest<'_>,
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        match req {
            HotRequest::Alloc {
                session,
                count,
                route_key,
            } => self.alloc_pages(client_id, session, count, route_key.as_deref(), now_ms),
            HotRequest::FreePages { session, pages } => {
                self.free_pages(client_id, session, &pages, now_ms)
            }
            HotRequest::Publish { session, entries } => {
                self.publish(client_id, session, &entries, now_ms)
            }
            HotRequest::Keys { op, session, keys } => {
                self.keys_request(client_id, op, session, &keys, now_ms)
            }
            HotRequest::ReleaseLeases { session, lease_ids } => {
                self.release_leases(client_id, session, &lease_ids, now_ms)
            }
        }
    }

    /// `exists`, `acquire`, `remove`, `pin` or `unpin` of `keys`.
    fn keys_request(
        &mut self,
        client_id: &str,
        op: KeysOp,
        session: u64,
        keys: &[Text<'_>],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        let writes = match op {
            KeysOp::Remove => Some("remove keys"),
            KeysOp::Pin => Some("pin keys"),
            KeysOp::Exists | KeysOp::Acquire | KeysOp::Unpin => None,
        };
        let k = self.keyed(client_id, session, keys, writes, now_ms)?;
        match op {
            KeysOp::Exists => self.exists(k),
            KeysOp::Acquire => self.acquire(k),
            KeysOp::Remove => self.remove(k),
            KeysOp::Pin => self.pin(k),
            KeysOp::Unpin => self.unpin(k),
        }
    }

    /// Timers: expired leases and sessions end, the keeper checks its mappings, and
    /// regions on their way back are released at their agent and freed at the RM.
    pub fn tick(&mut self, now_ms: u64, rm: &mut dyn RmPort, agents: &mut dyn AgentPort) {
        self.note_now(now_ms);
        self.put_back_pages(now_ms);
        self.expire(now_ms);
        self.expire_waits(now_ms);
        self.take_back_unused(now_ms);
        if now_ms >= self.next_rm_check_ms && !self.regions.is_empty() {
            self.next_rm_check_ms = now_ms.saturating_add(self.cfg.rm_check_ms);
            self.ask_rm_regions();
        }
        self.hold_back_regions(now_ms);
        let events = self.keeper.run(now_ms, rm, agents);
        self.apply(&events);
    }

    /// When [`tick`](Self::tick) must run next.
    pub fn next_deadline(&self) -> Option<u64> {
        [
            self.sessions.next_expiry(),
            self.leases.next_expiry(),
            self.keeper.next_deadline(),
            self.waits.next_deadline(self.cfg.park_max_ms),
            self.next_unused_ms,
            self.next_page_deadline(),
            // Only a server that holds regions has anything the RM could reap.
            (!self.regions.is_empty()).then_some(self.next_rm_check_ms),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Gives every kept region back, as before the server stops: their keys stop
    /// being found now, and the following ticks release and free them (see
    /// [`regions_going_back`](Self::regions_going_back)). Returns how many.
    pub fn give_back_kept(&mut self, now_ms: u64) -> usize {
        let ids: Vec<u64> = self.keeper.kept_ids().collect();
        for &region_id in &ids {
            let reason = GiveBackReason::Shutdown;
            self.keeper.lose(region_id, reason, now_ms);
            self.apply(&[KeeperEvent::Lost { region_id, reason }]);
        }
        ids.len()
    }

    /// Regions on their way back that the RM has not freed yet.
    pub fn regions_going_back(&self) -> usize {
        self.keeper.giving_back_len()
    }

    /// A connection of `client_id` closed. Its sessions go on (the worker may
    /// reconnect) and expire only when their requests stop; its leases stay, since
    /// its READs may still be in flight.
    pub fn client_closed(&mut self, client_id: &str, _now_ms: u64) {
        self.sessions.client_closed(client_id);
    }

    /// Whether `client_id` has a live session (the daemon forgets the session
    /// secrets of clients that have none).
    pub fn has_session_of(&self, client_id: &str) -> bool {
        self.sessions.has_client(client_id)
    }

    fn handshake(&self) -> HandshakeReply {
        let mut capabilities = vec![CAP_CXL_STORAGE.to_string()];
        if !self.cfg.agents.is_empty() {
            capabilities.push(CAP_REMOTE_CXL_STORAGE.to_string());
        }
        HandshakeReply {
            service: SERVICE.to_string(),
            capabilities,
            rm_address: self.cfg.rm_address.clone(),
            agents: self.cfg.agents.clone(),
            region_size: self.cfg.region_size,
            chunk_size: self.cfg.chunk_size,
            max_batch: MAX_BATCH,
            lease_limit: LEASE_LIMIT,
            session_timeout_ms: self.cfg.session_timeout_ms,
            instance: self.cfg.instance.clone(),
            lease_timeout_ms: self.cfg.lease_timeout_ms,
        }
    }

    /// The live session `id` of `client_id`, marked as just seen.
    pub(super) fn session(
        &mut self,
        client_id: &str,
        id: u64,
        now_ms: u64,
    ) -> Result<u64, WireError> {
        self.sessions.lookup(client_id, id)?;
        self.touch_session(id, now_ms);
        Ok(id)
    }

    /// A request about `keys`, its session found: the keys checked first, then the
    /// session, a writing one where `writes` says what the request would change.
    pub(super) fn keyed<'k>(
        &mut self,
        client_id: &str,
        session: u64,
        keys: &'k [Text<'k>],
        writes: Option<&str>,
        now_ms: u64,
    ) -> Result<Keyed<'k>, WireError> {
        check_keys(keys)?;
        let id = match writes {
            Some(what) => self.writing_session(client_id, session, what, now_ms)?,
            None => self.session(client_id, session, now_ms)?,
        };
        let scope = self.sessions.checked(id)?.scope;
        Ok(Keyed {
            id,
            scope,
            keys,
            now_ms,
        })
    }

    /// As [`session`](Self::session), for a request that changes what is stored
    /// (publish, pin, remove): the session's tenant must write its namespace.
    pub(super) fn writing_session(
        &mut self,
        client_id: &str,
        id: u64,
        what: &str,
        now_ms: u64,
    ) -> Result<u64, WireError> {
        let s = self.sessions.lookup(client_id, id)?;
        if s.access != Access::Write {
            return Err(permission(format!(
                "session {id} may not {what}: its tenant {} reads namespace {:?} and does \
                 not write it (the tenants file names each namespace's writing tenant)",
                s.tenant,
                crate::net::clip(&s.namespace)
            )));
        }
        self.touch_session(id, now_ms);
        Ok(id)
    }

    fn touch_session(&mut self, id: u64, now_ms: u64) {
        self.sessions.touch(id, now_ms);
    }

    /// Ends leases and sessions whose time is up. State only: what the ports must
    /// do for an expired session's regions is left to the next tick.
    pub(super) fn expire(&mut self, now_ms: u64) {
        self.leases.expire(now_ms);
        for id in self.sessions.expired(now_ms) {
            log::info!("session {id} expired: its regions go to the region keeper");
            self.end_session(id, EndReason::Expired, true, now_ms);
        }
    }

    /// Ends a session. `drained`: its regions with keys go to the keeper and stay
    /// readable; otherwise (and for regions without keys) they go back.
    pub(super) fn end_session(
        &mut self,
        id: u64,
        reason: EndReason,
        drained: bool,
        now_ms: u64,
    ) -> CloseReply {
        let mut reply = CloseReply {
            kept: Vec::new(),
            given_back: Vec::new(),
            leases_ended: 0,
        };
        self.fair.session_ended(id);
        let Some(s) = self.sessions.end(id, reason) else {
            return reply;
        };
        reply.leases_ended = self.leases.end_session(id);
        self.pins.end_session(id);
        self.old_leases_session_ended(id, now_ms);
        self.alloc_rate_ended(id);
        for rid in s.regions {
            let Some(r) = self.regions.get_mut(rid) else {
                continue;
            };
            r.unused_since_ms = None;
            if drained && self.keys.region_keys(rid) > 0 {
                r.holder = Holder::Keeper;
                self.keeper
                    .keep(r.handle.clone(), r.agent.clone(), r.boot_id.clone(), now_ms);
                reply.kept.push(rid);
            } else {
                let why = if drained {
                    GiveBackReason::NoKeys
                } else {
                    GiveBackReason::Abandoned
                };
                r.holder = Holder::GivingBack;
                let (handle, agent) = (r.handle.clone(), r.agent.clone());
                self.hide_region(rid);
                self.keeper.give_back(handle, agent, false, why, now_ms);
                reply.given_back.push(rid);
            }
        }
        reply
    }

    /// Drops every key of the region and ends its leases, at once. Returns (keys,
    /// leases). The pages of the dropped keys are free again.
    pub(super) fn hide_region(&mut self, region_id: u64) -> (usize, usize) {
        let dropped = self.keys.drop_region(region_id);
        let ended = self.leases.end_region(region_id);
        self.pins.end_region(region_id);
        // Keys are write-once, so a page that held one is written no more.
        for (k, e) in &dropped {
            self.free_key_page(region_id, e.loc.offset / self.cfg.chunk_size, *k, e.scope);
        }
        (dropped.len(), ended)
    }

    /// Asks the RM which regions it holds for this server, as an
    /// [action](super::Action::CheckRm) whose answer comes back as an event
    /// ([`rm_regions`](Self::rm_regions)): the RM's list (over a megabyte at a few
    /// thousand regions) is asked for, sent and decoded while the loop serves, never
    /// on it (issue 46: waiting for it once a second made the slowest requests' tail).
    /// One check at a time; the regions held now are noted, since only they can be
    /// judged by the answer (a region granted after the RM made its list is not in it).
    fn ask_rm_regions(&mut self) {
        if self.rm_check.is_some() {
            return;
        }
        self.rm_checks += 1;
        let check = self.rm_checks;
        self.rm_check = Some(RmCheck {
            check,
            known: self.regions.iter().map(|r| r.handle.region_id).collect(),
        });
        self.waits
            .actions
            .push_back(super::Action::CheckRm { check });
    }

    /// The RM answered check `check` (see [`Action::CheckRm`](super::Action::CheckRm))
    /// with the ids of the regions it holds for this server. A region the server held
    /// when it asked that the RM no longer lists was freed or reaped behind the
    /// server's back (the RM reaps an owner that stayed away longer than its grace
    /// period): its keys stop being found now, it leaves its session (whose worker is
    /// told at its next heartbeat: an unknown region) or the keeper, and it goes the way
    /// of every give-back (release at its agent, then a free the RM answers as already
    /// done). An error changes nothing; the next check tries again.
    pub fn rm_regions(&mut self, check: u64, held: Result<Vec<u64>, PortError>, now_ms: u64) {
        self.note_now(now_ms);
        let Some(asked) = self.rm_check.take_if(|c| c.check == check) else {
            log::warn!("an answer to RM check {check}, which is not in flight");
            return;
        };
        let mut held = match held {
            Ok(ids) => ids,
            Err(e) => {
                log::debug!("could not ask the RM for this server's regions: {e}");
                return;
            }
        };
        held.sort_unstable();
        let gone: Vec<(u64, Holder)> = asked
            .known
            .iter()
            .filter(|rid| held.binary_search(rid).is_err())
            .filter_map(|&rid| self.regions.get(rid).map(|r| (rid, r.holder)))
            .collect();
        for (rid, holder) in gone {
            let reason = GiveBackReason::RmDropped;
            match holder {
                Holder::GivingBack => continue, // already on its way out
                Holder::Keeper => {
                    self.keeper.lose(rid, reason, now_ms);
                    self.apply(&[KeeperEvent::Lost {
                        region_id: rid,
                        reason,
                    }]);
                }
                Holder::Session(sid) => {
                    self.leave_region(sid, rid);
                    self.hide_region(rid);
                    let Some(r) = self.regions.get_mut(rid) else {
                        continue;
                    };
                    r.holder = Holder::GivingBack;
                    let (handle, agent) = (r.handle.clone(), r.agent.clone());
                    self.keeper.give_back(handle, agent, false, reason, now_ms);
                }
            }
            log::warn!(
                "region {rid}: the RM no longer holds it for maru-server (reaped after the \
                 server was away longer than the RM's grace period?): its keys are dropped"
            );
        }
    }

    /// Applies what the keeper did: lost regions' keys go now, freed regions go.
    pub(super) fn apply(&mut self, events: &[KeeperEvent]) {
        for e in events {
            match *e {
                KeeperEvent::Lost { region_id, .. } => {
                    if let Some(r) = self.regions.get_mut(region_id) {
                        r.holder = Holder::GivingBack;
                    }
                    self.hide_region(region_id);
                }
                KeeperEvent::Freed { region_id } => {
                    self.regions.remove(region_id);
                    self.region_freed();
                }
            }
        }
    }

    pub(super) fn check_backend_configured(&self, backend: Backend) -> Result<(), WireError> {
        if backend == Backend::RemoteCxl && self.cfg.agents.is_empty() {
            return Err(unsupported(
                "this maru-server has no remote CXL agents, so it serves no remote_cxl \
                 sessions: start it with --remote-cxl-agent host:port",
            ));
        }
        Ok(())
    }

    pub(super) fn unknown_region(region_id: u64) -> WireError {
        refused(format!(
            "unknown region {region_id} (already returned or never handed out)"
        ))
    }
}
