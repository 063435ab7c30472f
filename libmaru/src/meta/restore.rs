//! Rebuilding the core from what a durable store holds ([`MetaCore::restore`]), and
//! checking it against the world before anything is served
//! ([`MetaCore::recovered_rm`], [`MetaCore::recovered_boots`]). The rules are in
//! [`durable`](super::durable).

use super::config::{ConfigError, MetaConfig};
use super::core::MetaCore;
use super::durable::{LEASE_RUN_SHIFT, SESSION_RUN_SHIFT};
use super::journal::OldLeases;
use super::keeper::{GiveBackReason, KeeperEvent};
use super::keys::{Location, Published, Scope};
use super::pages::PageAllocator;
use super::ports::PortError;
use super::records::{HolderRecord, Image, RegionRecord, Sealed};
use super::regions::{agent_for, Holder, Region};
use super::seal1::overlapping_regions;
use super::sessions::Session;
use super::tenants::Tenants;
use crate::wire::meta::Backend;
use crate::wire::rm::{Handle, RegionInfo};
use std::collections::{BTreeMap, BTreeSet};

/// The longest region a restore takes from a record (longer ones, or ones whose page
/// count is not their length in chunks, are left out and go back if the RM holds
/// them): a record read back never makes the server hold pages beyond a region's.
pub const MAX_RESTORED_REGION: u64 = 64 << 30;

/// What a restore found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    pub keys: u64,
    pub regions: u64,
    pub sessions: u64,
    /// Records left out (naming what they no longer fit: a missing region or scope,
    /// a page out of range); their records go with the next batch.
    pub left_out: u64,
    /// Of those, records whose own check failed (a bit changed on disk) or whose
    /// region overlaps another's: never served.
    pub unverified: u64,
}

/// A key record recovery leaves out (never served; its id is not handed out again:
/// see [`MetaCore::restore`]).
fn leave_out(core: &mut MetaCore, out: &mut Recovered, id: u64) {
    core.keys.note_gone(id);
    out.left_out += 1;
}

impl MetaCore {
    /// A durable core rebuilt from what a store holds. Sessions come back
    /// disconnected, their time running from `now_ms` (a worker resumes its session,
    /// or it expires and its regions go to the keeper); kept regions go back to the
    /// keeper, regions that were going back go on their way. A record that no longer
    /// fits (a key of a region not held, a page out of range) is left out and its
    /// record removed. Sessions whose tenant lost its access end as a drained close.
    ///
    /// Pages of recovered keys that are removed wait for the leases of the last run
    /// (see [`durable`](super::durable)): until every restored session said which leases
    /// it holds or ended, at most the longer of `image.lease_timeout_ms` and this
    /// run's lease timeout from `now_ms`. Lease ids start after `image.run <<`
    /// [`LEASE_RUN_SHIFT`].
    ///
    /// Serve nothing before [`recovered_rm`](Self::recovered_rm) and
    /// [`recovered_boots`](Self::recovered_boots).
    pub fn restore(
        cfg: MetaConfig,
        tenants: Tenants,
        image: Image,
        now_ms: u64,
    ) -> Result<(MetaCore, Recovered), ConfigError> {
        let lease_ms = cfg.lease_timeout_ms.max(image.lease_timeout_ms);
        let chunk = cfg.chunk_size;
        let mut core = MetaCore::new(cfg)?.with_tenants(tenants).keep_durable();
        core.note_now(now_ms);
        let base = image.run.checked_shl(LEASE_RUN_SHIFT).unwrap_or(0);
        core.leases.start_ids_after(base);
        let mut out = Recovered::default();
        let mut sessions_left_out = false;
        for s in &image.scopes {
            if !s.verify() {
                log::warn!(
                    "recovery: the record of scope {} fails its check (changed on disk): \
                     dropped with its sessions and keys",
                    s.id
                );
                out.left_out += 1;
                out.unverified += 1;
                continue;
            }
            let scope = Scope {
                namespace: s.namespace.clone(),
                layout: s.layout.clone(),
                backend: s.backend,
            };
            if !core.keys.restore_scope(s.id, scope) {
                log::warn!("recovery: scope {} is recorded twice; left out", s.id);
            }
        }
        // Ids of every recorded session stay taken, also of one whose record is
        // dropped below (its worker may still be there), and ids of this run are
        // above every earlier run's: the counter may have been changed on disk or
        // rolled back.
        let session_base = image.run.checked_shl(SESSION_RUN_SHIFT).unwrap_or(0);
        let mut next_session = image
            .sessions
            .iter()
            .map(|s| s.id.saturating_add(1))
            .fold(image.next_session.max(session_base + 1), u64::max);
        for s in &image.sessions {
            if !s.verify() {
                log::warn!(
                    "recovery: the record of session {} fails its check (changed on disk): \
                     dropped",
                    s.id
                );
                out.left_out += 1;
                out.unverified += 1;
                sessions_left_out = true;
                continue;
            }
            let Some(scope) = core.keys.restored_scope(s.scope) else {
                log::warn!(
                    "recovery: session {} names scope {}, which is not recorded; left out",
                    s.id,
                    s.scope
                );
                out.left_out += 1;
                sessions_left_out = true;
                continue;
            };
            next_session = next_session.max(s.id.saturating_add(1));
            core.sessions.restore(
                Session {
                    id: s.id,
                    client_id: s.owner.clone(),
                    tenant: s.tenant.clone(),
                    access: s.access(),
                    engine_id: s.engine_id.clone(),
                    namespace: s.namespace.clone(),
                    backend: s.backend,
                    scope,
                    regions: BTreeSet::new(),
                    last_seen_ms: now_ms,
                    connected: false,
                    hits: 0,
                    misses: 0,
                },
                next_session,
            );
            out.sessions += 1;
        }
        core.sessions.restore_next(next_session);
        let vouched = vouched_regions(&image);
        for g in &image.regions {
            let rid = g.handle.region_id;
            if !vouched.contains(&rid) {
                out.left_out += 1;
                out.unverified += 1;
                continue;
            }
            let longest = core.cfg.region_size.max(MAX_RESTORED_REGION);
            if g.handle.length > longest
                || g.pages != g.handle.length / chunk
                || core.regions.contains(rid)
            {
                log::warn!(
                    "recovery: region {rid} is recorded with {} pages of {chunk} bytes in {} \
                     bytes (at most {longest} bytes in pages of this server's chunk size), or \
                     twice; left out (the RM takes it back)",
                    g.pages,
                    g.handle.length
                );
                out.left_out += 1;
                continue;
            }
            let holder = match g.holder {
                HolderRecord::Session(sid) => match core.sessions.get(sid) {
                    Some(_) => {
                        core.join_region(sid, rid);
                        Holder::Session(sid)
                    }
                    // Its session was not recorded: the keeper has it (below).
                    None => Holder::Keeper,
                },
                HolderRecord::Keeper => Holder::Keeper,
                HolderRecord::GivingBack => Holder::GivingBack,
            };
            core.regions.insert(Region {
                handle: g.handle.clone(),
                pool: g.pool.clone(),
                agent: g.agent.clone(),
                backend: g.backend,
                pages: PageAllocator::restore(g.pages, &g.allocated),
                holder,
                last_read_ms: now_ms,
                boot_id: g.boot_id.clone(),
                unused_since_ms: None,
            });
            out.regions += 1;
        }
        core.keys.reserve(image.keys.len());
        // No recorded id is handed out again, not even one left out below or that
        // the store could not decode: maru-server's store writes a new key's record
        // without deleting a use-stamp row of its id.
        let ids_end = image.keys.iter().map(|k| k.id.saturating_add(1)).max();
        core.keys.ids_after(
            ids_end
                .unwrap_or(0)
                .max(image.key_ids_end)
                .saturating_sub(1),
        );
        // Ordered for eviction once, at the end (keys come back in id order, not in
        // their use order), and each name moved in, not copied.
        core.keys.begin_restore();
        for k in image.keys {
            let boot = core.regions.get(k.region_id).map(|r| r.boot_id.as_deref());
            if boot.is_some_and(|b| !k.verify(b)) {
                log::warn!(
                    "recovery: the record of key {} fails its check (changed on disk, or its \
                     region's record did): dropped, never served",
                    k.id
                );
                core.keys.note_gone(k.id);
                out.left_out += 1;
                out.unverified += 1;
                continue;
            }
            let fits = core
                .regions
                .get(k.region_id)
                .filter(|r| r.holder != Holder::GivingBack)
                .map(|r| {
                    k.offset % chunk == 0
                        && k.offset / chunk < r.pages.pages()
                        && k.length > 0
                        && k.length <= chunk
                });
            let scope = core.keys.restored_scope(k.scope);
            let (Some(true), Some(scope)) = (fits, scope) else {
                log::warn!(
                    "recovery: key {:?} (record {}) of region {} at offset {} does not fit a \
                     recorded region and scope; left out",
                    crate::net::clip(&k.name),
                    k.id,
                    k.region_id,
                    k.offset
                );
                leave_out(&mut core, &mut out, k.id);
                continue;
            };
            if core.keys.at(k.region_id, k.offset).is_some() {
                let (offset, region, id) = (k.offset, k.region_id, k.id);
                log::warn!(
                    "recovery: two keys recorded at offset {offset} of region {region}; key \
                     record {id} left out"
                );
                leave_out(&mut core, &mut out, id);
                continue;
            }
            let loc = Location {
                region_id: k.region_id,
                offset: k.offset,
                length: k.length,
            };
            match core
                .keys
                .restore(k.id, scope, k.name, loc, k.prev.as_deref(), k.used)
            {
                Published::New(_) => {
                    if let Some(r) = core.regions.get_mut_quiet(k.region_id) {
                        r.pages.take(k.offset / chunk);
                    }
                    out.keys += 1;
                }
                Published::Exists(_) => {
                    core.keys.note_gone(k.id);
                    out.left_out += 1;
                }
            }
        }
        core.keys.finish_restore();
        // Regions of the keeper: readable while they hold keys; the rest go back.
        let ids: Vec<(u64, Holder)> = core
            .regions
            .iter()
            .map(|r| (r.handle.region_id, r.holder))
            .collect();
        for (rid, holder) in ids {
            let keys = core.keys.region_keys(rid);
            let Some(r) = core.regions.get_mut(rid) else {
                continue;
            };
            let (handle, agent) = (r.handle.clone(), r.agent.clone());
            match holder {
                Holder::Keeper if keys > 0 => {
                    let boot = r.boot_id.clone();
                    core.keeper.keep(handle, agent, boot, now_ms);
                }
                Holder::Keeper | Holder::GivingBack => {
                    r.holder = Holder::GivingBack;
                    core.keeper
                        .give_back(handle, agent, false, GiveBackReason::Recovered, now_ms);
                }
                Holder::Session(_) => r.note_use(now_ms),
            }
        }
        let mut in_doubt = BTreeSet::new();
        for r in core.regions.iter() {
            let rid = r.handle.region_id;
            let pages = r.pages.allocated_pages();
            // Each key of the region took a page of its own: as many keys as pages
            // taken, and none is without a key (no lookup per page).
            if pages.len() == core.keys.region_keys(rid) {
                continue;
            }
            for page in pages {
                if core.keys.at(rid, page * chunk).is_none() {
                    in_doubt.insert((rid, page));
                }
            }
        }
        if !in_doubt.is_empty() {
            log::info!(
                "recovery: {} page(s) are allocated without a key (reserved for their session, \
                 or their publish was lost): not handed out again until their session's worker \
                 says which pages it holds (the others are freed), frees them, or its region \
                 goes",
                in_doubt.len()
            );
        }
        if let Some(j) = &mut core.journal {
            j.in_doubt = in_doubt;
            j.unreported = core.sessions.iter().map(|s| s.id).collect();
            j.recovered = Some(OldLeases {
                last_key: core.keys.last_id(),
                until_ms: now_ms.saturating_add(lease_ms),
                silent: core.sessions.iter().map(|s| s.id).collect(),
                unknown: sessions_left_out,
                base,
            });
        }
        let tenants = core.tenants.clone();
        core.set_tenants(tenants, now_ms);
        Ok((core, out))
    }

    /// Which regions the RM holds for this server, asked after a restore: a region
    /// of the directory the RM no longer holds (same id, offset and length) loses its
    /// keys and goes (nothing is left to free); a region the RM holds that the
    /// directory does not know (an allocation answered as the server stopped) goes
    /// back, released at its agent first. Returns (regions dropped, keys dropped).
    pub fn recovered_rm(&mut self, held: &[RegionInfo], now_ms: u64) -> (usize, usize) {
        self.note_now(now_ms);
        let by_id: BTreeMap<u64, &RegionInfo> = held.iter().map(|r| (r.region_id, r)).collect();
        let gone: Vec<u64> = self
            .regions
            .iter()
            .filter(|r| {
                !by_id
                    .get(&r.handle.region_id)
                    .is_some_and(|i| i.offset == r.handle.offset && i.length == r.handle.length)
            })
            .map(|r| r.handle.region_id)
            .collect();
        let mut keys = 0;
        for rid in &gone {
            let (k, _) = self.hide_region(*rid);
            keys += k;
            if let Some(Holder::Session(sid)) = self.regions.get(*rid).map(|r| r.holder) {
                self.leave_region(sid, *rid);
            }
            self.keeper.forget(*rid);
            self.fair.region_gone(*rid, None);
            self.regions.remove(*rid);
            log::warn!(
                "recovery: region {rid} is no longer held by the RM for maru-server (reaped \
                 while it was away longer than the RM's grace period?): {k} keys dropped"
            );
        }
        for info in held {
            if self.regions.contains(info.region_id) {
                continue;
            }
            let Some(token) = info.token.clone() else {
                log::warn!(
                    "recovery: the RM holds region {} for maru-server, which its directory \
                     does not know, and names no handle for it: it stays allocated until the \
                     RM reaps it",
                    info.region_id
                );
                continue;
            };
            let handle = Handle {
                region_id: info.region_id,
                offset: info.offset,
                length: info.length,
                token,
            };
            self.give_back_orphan(handle, now_ms);
        }
        (gone.len(), keys)
    }

    /// A region the RM holds for the server that its directory does not know: back,
    /// released at the agent that would serve it first (a worker may have mapped it).
    fn give_back_orphan(&mut self, handle: Handle, now_ms: u64) {
        let rid = handle.region_id;
        log::info!("recovery: region {rid} is held at the RM but unknown here; it goes back");
        let agent = agent_for(rid, &self.cfg.agents);
        let pages = (handle.length / self.cfg.chunk_size).max(1);
        self.regions.insert(Region {
            handle: handle.clone(),
            pool: crate::wire::rm::PoolInfo {
                pool_id: 0,
                path: String::new(),
                uuid: String::new(),
                kind: String::new(),
                total: 0,
                free: 0,
                align: 0,
                draining: 0,
            },
            agent: agent.clone(),
            backend: if agent.is_some() {
                Backend::RemoteCxl
            } else {
                Backend::Cxl
            },
            pages: PageAllocator::new(pages),
            holder: Holder::GivingBack,
            last_read_ms: now_ms,
            boot_id: None,
            unused_since_ms: None,
        });
        self.keeper
            .give_back(handle, agent, false, GiveBackReason::Recovered, now_ms);
    }

    /// What each agent reported as its boot id, asked after a restore: the keys of a
    /// region whose memory node booted since they were written (another boot id, or
    /// none recorded) are dropped; a kept region goes back. An agent that did not
    /// answer decides nothing here (the keeper and the worker check it later, and a
    /// reader's lease names the recorded boot id). Returns the keys dropped.
    pub fn recovered_boots(
        &mut self,
        boots: &BTreeMap<String, Result<String, PortError>>,
        now_ms: u64,
    ) -> usize {
        self.note_now(now_ms);
        let regions: Vec<(u64, String, Option<String>, Holder)> = self
            .regions
            .iter()
            .filter(|r| self.keys.region_keys(r.handle.region_id) > 0)
            .filter_map(|r| {
                Some((
                    r.handle.region_id,
                    r.agent.clone()?,
                    r.boot_id.clone(),
                    r.holder,
                ))
            })
            .collect();
        let mut dropped = 0;
        for (rid, agent, recorded, holder) in regions {
            let now = match boots.get(&agent) {
                Some(Ok(b)) if !b.is_empty() => b,
                _ => continue,
            };
            if recorded.as_deref() == Some(now.as_str()) {
                continue;
            }
            let keys = self.keys.region_keys(rid);
            log::warn!(
                "recovery: agent {agent} reports boot id {now} for region {rid}, whose keys were \
                 written under {}: its {keys} keys are dropped",
                recorded.as_deref().unwrap_or("no recorded boot id")
            );
            dropped += keys;
            if holder == Holder::Keeper {
                let reason = GiveBackReason::Rebooted;
                self.keeper.lose(rid, reason, now_ms);
                self.apply(&[KeeperEvent::Lost {
                    region_id: rid,
                    reason,
                }]);
            } else {
                self.hide_region(rid);
                if let Some(r) = self.regions.get_mut(rid) {
                    r.boot_id = Some(now.clone());
                }
            }
        }
        dropped
    }
}

/// The regions of `image` that may be served: their check holds and their range
/// of their pool overlaps no other's (two records of one range: at most one of them
/// is right, and which one cannot be told, so neither is served). Logs each one
/// dropped; returns the ids kept.
fn vouched_regions(image: &Image) -> BTreeSet<u64> {
    let mut ok: BTreeMap<u64, &RegionRecord> = BTreeMap::new();
    for g in &image.regions {
        if g.verify() {
            ok.insert(g.handle.region_id, g);
        } else {
            log::warn!(
                "recovery: the record of region {} fails its check (changed on disk): \
                 dropped with its keys, never served",
                g.handle.region_id
            );
        }
    }
    let overlapping = overlapping_regions(ok.values().copied());
    ok.into_keys()
        .filter(|r| !overlapping.contains(r))
        .collect()
}
